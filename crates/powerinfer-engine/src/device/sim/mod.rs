//! A simulated GPU: the device every machine has, so that the hybrid engine's schedule runs
//! end to end without a GPU (in CI too).
//!
//! It behaves as a discrete GPU does, on the CPU:
//!
//! - **its own memory**: every matrix, hot slice, buffer and KV store is a separate allocation
//!   held against a [`MemoryBudget`] (the VRAM budget), which refuses before anything is
//!   allocated;
//! - **explicit transfers**: weights are copied in at upload; a program's inputs come in by
//!   `write`, its outputs go out by `read` and `wait`; the CPU never reads device memory, the
//!   device never reads host memory;
//! - **its own threads**: one worker thread executes commands in order (a stream) with its
//!   own kernel thread pool, beside the CPU side's pool;
//! - **what a GPU charges**: every device counts kernel launches ([`launches_of`](crate::device::cuda::launches::launches_of)),
//!   host waits and link bytes; with a speed model ([`SimSpeed`]) each command also takes at
//!   least `launches · launch + bytes read / bandwidth`, each copy over the link
//!   `latency + bytes / link bandwidth`, and each host wait costs the host `host_wait`, so that
//!   a schedule that waits on the device per operation is slow here as it is on a real card.
//!
//! The arithmetic is that of the CPU kernels (`powerinfer-kernels-cpu`) on the device's copies,
//! so a layer computed here gives the CPU's bits.

mod clock;
mod kernels;
mod memory;
mod stream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::f16;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ops::attention::AttentionPart;
use powerinfer_kernels_cpu::ops::kv::KvType;
use powerinfer_kernels_cpu::Weights;
use powerinfer_kernels_cuda::MemoryBudget;

use clock::{Gate, HostClock};
use memory::{budget_error, bytes_of, new_kv, DevBuf, DevHot, DevMat, Memory, Mirror, NewRows};
use stream::{spin_until, wait, Answer, Cmd, Job, Stream, REPLY_SPIN};

use super::cuda::launches::{converts_activation, program_launches, Conversion, HotKind};
use super::program::{graph_segments, masked_flags, GraphCache, Sighting};
use super::report::TrafficCounters;
use super::{
    free_entry, hot_slice_overhead, AttentionDevice, AttentionJob, BufId, Device, HotId, HotSpec,
    HotSwap, KvId, KvRows, KvShape, MatId, Op, ReadId, SimOptions, SimSpeed, Span, Ticket, Traffic,
};
use crate::error::{EngineError, Result};

/// Where an attention part and the device's time arrive.
type AttentionReply = Receiver<Answer<(AttentionPart, Duration)>>;

/// Where a read's values arrive.
type ReadReply = Receiver<Answer<Vec<f32>>>;

/// The simulated GPU (see the [module docs](self)).
pub(crate) struct SimDevice {
    budget: MemoryBudget,
    memory: Arc<RwLock<Memory>>,
    stream: Mutex<Sender<Job>>,
    /// The host's side of the timeline.
    clock: Mutex<HostClock>,
    /// On a card's clock (not paced), the worker runs only while the host waits.
    gate: Option<Arc<Gate>>,
    worker: Option<JoinHandle<()>>,
    reads: Mutex<HashMap<u64, ReadReply>>,
    pending_attention: Queue<AttentionReply>,
    next: AtomicU64,
    overruns: Arc<AtomicU64>,
    traffic: Arc<TrafficCounters>,
    marks: Arc<Mutex<Vec<Option<Duration>>>>,
    /// What the device holds, as the launch rules need it: the front counts a program's
    /// launches from this, never from the worker's memory (which would wait for the worker).
    known: Mutex<Known>,
    /// With graphs, the programs a GPU would have captured (to count its launches).
    graph_cache: Mutex<GraphCache<()>>,
    /// Error of a command the worker could not run, reported at the next wait.
    failed: Arc<Mutex<Option<EngineError>>>,
    threads: usize,
    speed: Option<SimSpeed>,
    paced: bool,
    /// Programs replay as one launch each (CUDA graphs).
    graphs: bool,
}

/// What the device holds, as the launch rules ([`program_launches`]) need it.
#[derive(Default)]
struct Known {
    /// Per matrix, how its products convert their activation.
    mats: Vec<Conversion>,
    /// Per hot slice, what its FFN's launches depend on (its mask as the host last set it:
    /// what a GPU's programs queued from now on launch for), and its layer's neurons.
    hots: Vec<(HotKind, usize)>,
}

fn stopped<E>(_: E) -> EngineError {
    EngineError::Device("the simulated GPU's worker has stopped".into())
}

impl SimDevice {
    /// A device with `budget` bytes of memory.
    /// A simulated device of `budget` bytes; `graphs`: it replays each program as one launch,
    /// as a GPU with CUDA graphs does ([`DeviceOptions::graphs`](crate::schedule::DeviceOptions::graphs)).
    pub(crate) fn new(budget: u64, opts: &SimOptions, graphs: bool) -> Result<SimDevice> {
        let budget = MemoryBudget::new(budget);
        let memory = Arc::new(RwLock::new(Memory::default()));
        let overruns = Arc::new(AtomicU64::new(0));
        let traffic = Arc::new(TrafficCounters::default());
        let marks = Arc::new(Mutex::new(Vec::new()));
        let failed = Arc::new(Mutex::new(None));
        let (tx, rx) = channel::<Job>();
        let origin = Instant::now();
        let gate = (opts.speed.is_some() && !opts.paced).then(|| Arc::new(Gate::default()));
        let stream = Stream {
            gate: gate.clone(),
            memory: memory.clone(),
            speed: opts.speed,
            paced: opts.paced,
            origin,
            overruns: overruns.clone(),
            traffic: traffic.clone(),
            marks: marks.clone(),
            failed: failed.clone(),
            threads: opts.threads.max(1),
        };
        let worker = std::thread::Builder::new()
            .name("powerinfer-sim-gpu".into())
            .spawn(move || stream.run(rx))
            .map_err(|e| EngineError::Device(format!("starting the simulated GPU: {e}")))?;
        Ok(SimDevice {
            budget,
            memory,
            stream: Mutex::new(tx),
            clock: Mutex::new(HostClock::new(origin, opts.speed)),
            gate,
            worker: Some(worker),
            reads: Mutex::new(HashMap::new()),
            pending_attention: Queue::new(),
            next: AtomicU64::new(0),
            overruns,
            traffic,
            marks,
            known: Mutex::new(Known::default()),
            graph_cache: Mutex::new(GraphCache::default()),
            failed,
            threads: opts.threads.max(1),
            speed: opts.speed,
            paced: opts.paced,
            graphs,
        })
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn host_clock(&self) -> std::sync::MutexGuard<'_, HostClock> {
        self.clock.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Issues `cmd` to the stream at the host's time.
    fn send(&self, cmd: Cmd) -> Result<()> {
        let mut clock = self.host_clock();
        let at = clock.enter();
        let sent = (self.stream.lock().unwrap_or_else(|e| e.into_inner()))
            .send(Job { at, cmd })
            .map_err(stopped);
        clock.leave();
        sent
    }

    /// Waits for a command's answer: the host's time moves to its end (and the wake-up), the
    /// wait is counted, and the first error of the stream (if any) reported.
    fn answer<T>(&self, rx: &Receiver<Answer<T>>) -> Result<T> {
        self.host_clock().enter();
        if let Some(g) = &self.gate {
            g.open();
        }
        let answered = wait(rx, REPLY_SPIN).map_err(stopped);
        if let Some(g) = &self.gate {
            g.close();
        }
        let (got, end) = answered?;
        self.host_clock().waited(end);
        self.traffic.waited();
        if let (true, Some(s)) = (self.paced, self.speed) {
            spin_until(Instant::now() + s.host_wait);
            self.host_clock().leave();
        }
        if let Some(e) = self.failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
            return Err(e);
        }
        got
    }

    /// A copy of `w`'s rows `rows` (all when `None`) in device memory.
    fn copy_in(&self, w: &Weights<'_>, rows: Option<&[u32]>) -> Result<DevMat> {
        let rb = w.row_bytes();
        let n = rows.map_or(w.rows(), <[u32]>::len);
        let held = self
            .budget
            .try_reserve((n * rb) as u64)
            .map_err(budget_error)?;
        let bytes = match rows {
            None => w.data().to_vec(),
            Some(rows) => gather(w, rows)?,
        };
        Ok(DevMat {
            ty: w.ty(),
            rows: n,
            cols: w.cols(),
            bytes,
            _held: held,
        })
    }

    fn new_buffer(&self, data: Vec<f32>) -> Result<BufId> {
        let held = self
            .budget
            .try_reserve(bytes_of::<f32>(data.len()))
            .map_err(budget_error)?;
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        mem.bufs.push(DevBuf { data, _held: held });
        Ok(BufId(mem.bufs.len() - 1))
    }
}

/// The rows `rows` of `w`, concatenated.
fn gather(w: &Weights<'_>, rows: &[u32]) -> Result<Vec<u8>> {
    let rb = w.row_bytes();
    let mut out = Vec::with_capacity(rows.len() * rb);
    for &r in rows {
        let r = r as usize;
        if r >= w.rows() {
            return Err(EngineError::Device(format!(
                "neuron {r} outside the matrix's {} rows",
                w.rows()
            )));
        }
        out.extend_from_slice(&w.data()[r * rb..][..rb]);
    }
    Ok(out)
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        // Closing the channel ends the worker's loop (once it has run out its queue).
        let (dead, _) = channel();
        *self.stream.lock().unwrap_or_else(|e| e.into_inner()) = dead;
        if let Some(g) = &self.gate {
            g.stop();
        }
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Device for SimDevice {
    fn name(&self) -> String {
        let card = match self.speed {
            Some(s) => format!("{} model, ", s.name),
            None => String::new(),
        };
        format!(
            "sim ({card}{} thread{}{})",
            self.threads,
            if self.threads == 1 { "" } else { "s" },
            if self.graphs { ", graphs" } else { "" }
        )
    }

    fn identity(&self) -> String {
        match self.speed {
            Some(s) => format!(
                "{} at {} B/s, launch {:?}, link {} B/s + {:?}, wait {:?}",
                self.name(),
                s.bandwidth,
                s.launch,
                s.link_bandwidth,
                s.link_latency,
                s.host_wait
            ),
            None => self.name(),
        }
    }

    fn memory(&self) -> (u64, u64, u64) {
        (self.budget.limit(), self.budget.used(), self.budget.peak())
    }

    fn supports(&self, ty: GgmlType) -> bool {
        powerinfer_kernels_cpu::matmul::is_supported(ty)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.get()
    }

    fn overruns(&self) -> u64 {
        self.overruns.load(Ordering::Relaxed)
    }

    fn upload(&self, w: &Weights<'_>) -> Result<MatId> {
        let m = self.copy_in(w, None)?;
        let mut known = self.known();
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        known
            .mats
            .push(converts_activation(m.ty).then_some((m.ty, m.cols)));
        mem.mats.push(m);
        Ok(MatId(mem.mats.len() - 1))
    }

    fn upload_vec(&self, v: &[f32]) -> Result<BufId> {
        self.new_buffer(v.to_vec())
    }

    fn alloc(&self, len: usize) -> Result<BufId> {
        self.new_buffer(vec![0.0; len])
    }

    fn upload_hot(&self, spec: &HotSpec<'_>) -> Result<HotId> {
        let held = self
            .budget
            .try_reserve(hot_slice_overhead(
                spec.up.rows(),
                spec.bucket.len(),
                spec.gate.is_some(),
                spec.up_bias.is_some(),
            ))
            .map_err(budget_error)?;
        let gate = spec
            .gate
            .as_ref()
            .map(|g| self.copy_in(g, Some(spec.bucket)))
            .transpose()?;
        let up = self.copy_in(&spec.up, Some(spec.bucket))?;
        let down = self.copy_in(&spec.down_t, Some(spec.bucket))?;
        let up_bias = spec
            .up_bias
            .map(|b| spec.bucket.iter().map(|&j| b[j as usize]).collect());
        let kind = HotKind {
            masked: false,
            gated: gate.is_some(),
            converts: converts_activation(up.ty),
            up_bias: up_bias.is_some(),
            f16_down: down.ty == GgmlType::F16,
        };
        let hot = DevHot {
            gate,
            up,
            down,
            bucket: spec.bucket.to_vec(),
            enabled: None,
            up_bias,
            act: spec.act,
            _held: held,
        };
        let mut known = self.known();
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        known.hots.push((kind, spec.up.rows()));
        mem.hots.push(Some(hot));
        Ok(HotId(mem.hots.len() - 1))
    }

    fn replace_hot(&self, hot: HotId, swap: &HotSwap<'_>) -> Result<Duration> {
        let (slots, neurons, spec) = (swap.slots(), swap.neurons(), swap.spec);
        let rows = NewRows {
            neurons: neurons.to_vec(),
            gate: spec.gate.as_ref().map(|g| gather(g, neurons)).transpose()?,
            up: gather(&spec.up, neurons)?,
            down: gather(&spec.down_t, neurons)?,
            up_bias: spec
                .up_bias
                .map(|b| neurons.iter().map(|&j| b[j as usize]).collect()),
        };
        let (reply, answer) = channel();
        self.send(Cmd::Replace {
            hot,
            slots: slots.to_vec(),
            rows,
            reply,
        })?;
        self.answer(&answer)
    }

    fn set_enabled(&self, hot: HotId, enabled: Option<&[bool]>) -> Result<()> {
        let n_ff = match self.known().hots.get_mut(hot.0) {
            Some((kind, n_ff)) => {
                kind.masked = enabled.is_some();
                *n_ff
            }
            None => return Err(EngineError::Device(format!("unknown hot slice {}", hot.0))),
        };
        // A GPU copies its mask over every neuron of the layer (an f32 each).
        if enabled.is_some() {
            self.traffic.moved(bytes_of::<f32>(n_ff));
        }
        self.send(Cmd::Enabled {
            hot,
            enabled: enabled.map(<[bool]>::to_vec),
        })
    }

    fn drop_hot(&self, hot: HotId) -> Result<()> {
        // A GPU forgets its captured programs (they may point at the slice).
        (self.graph_cache.lock().unwrap_or_else(|e| e.into_inner())).clear();
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        free_entry(&mut mem.hots, hot.0, "hot slice")
    }

    fn alloc_kv(&self, s: KvShape) -> Result<KvId> {
        let kv = new_kv(&self.budget, s)?;
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        mem.kvs.push(kv);
        Ok(KvId(mem.kvs.len() - 1))
    }

    fn write_kv(&self, kv: KvId, layer: usize, start: usize, k: &[u8], v: &[u8]) -> Result<()> {
        self.traffic.moved((k.len() + v.len()) as u64);
        self.send(Cmd::KvWrite {
            kv,
            layer,
            start,
            k: k.to_vec(),
            v: v.to_vec(),
        })
    }

    fn read_kv(&self, kv: KvId, layer: usize, start: usize, n: usize) -> Result<KvRows> {
        let (reply, answer) = channel();
        self.send(Cmd::KvRead {
            kv,
            layer,
            start,
            n,
            reply,
        })?;
        let (k, v) = self.answer(&answer)?;
        self.traffic.moved((k.len() + v.len()) as u64);
        Ok((k, v))
    }

    fn copy_kv(&self, from: KvId, to: KvId, n: usize) -> Result<()> {
        self.traffic.launched(1);
        self.send(Cmd::KvCopy { from, to, n })
    }

    fn set_step(&self, ids: &[u32], positions: &[u32]) -> Result<()> {
        self.traffic
            .moved(bytes_of::<u32>(ids.len() + positions.len()));
        self.send(Cmd::Step {
            ids: ids.to_vec(),
            positions: positions.iter().map(|&p| p as usize).collect(),
        })
    }

    fn enqueue(&self, ops: &[Op]) -> Result<()> {
        let known = self.known();
        let hot_kind = |h: HotId| known.hots.get(h.0).map_or(HotKind::default(), |k| k.0);
        let is_masked = |h: HotId| hot_kind(h).masked;
        let plain = |run: &[Op]| {
            program_launches(run, |m| known.mats.get(m.0).copied().flatten(), hot_kind)
        };
        // With graphs, what a GPU does with each run: run it the first time it sees it,
        // capture it the second, replay it after (one launch each time but the first).
        let (mut launches, mut graphed) = (0, Vec::new());
        if self.graphs {
            let mut cache = self.graph_cache.lock().unwrap_or_else(|e| e.into_inner());
            for run in graph_segments(ops) {
                let flags = masked_flags(run, is_masked);
                let sighting = cache.sight(run, &flags);
                if sighting == Sighting::Capture {
                    cache.keep(run, &flags, ());
                    self.traffic.captured();
                }
                let replayed = sighting != Sighting::First;
                launches += if replayed { 1 } else { plain(run) };
                graphed.push(replayed);
            }
        } else {
            launches = plain(ops);
        }
        drop(known);
        self.traffic.launched(launches);
        self.send(Cmd::Ops {
            ops: ops.to_vec(),
            graphed,
        })
    }

    fn write(&self, dst: Span, src: &[f32]) -> Result<()> {
        dst.check_write(src.len())?;
        self.traffic.moved(bytes_of::<f32>(src.len()));
        self.send(Cmd::Write {
            dst,
            data: src.to_vec(),
        })
    }

    fn read(&self, src: Span) -> Result<ReadId> {
        self.traffic.moved(bytes_of::<f32>(src.len));
        let (reply, answer) = channel();
        self.send(Cmd::Read { src, reply })?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, answer);
        Ok(ReadId(id))
    }

    fn wait(&self, read: ReadId, dst: &mut [f32]) -> Result<()> {
        let answer = self
            .reads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&read.0)
            .ok_or_else(|| EngineError::Device(format!("unknown read {}", read.0)))?;
        let got = self.answer(&answer)?;
        if got.len() != dst.len() {
            return Err(EngineError::Device(format!(
                "a read of {} values into {}",
                got.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(&got);
        Ok(())
    }

    fn elapsed(&self, from: usize, to: usize) -> Result<Duration> {
        let marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
        match (
            marks.get(from).copied().flatten(),
            marks.get(to).copied().flatten(),
        ) {
            (Some(a), Some(b)) => Ok(b.saturating_sub(a)),
            _ => Err(EngineError::Device(format!(
                "marks {from} and {to} were not both reached"
            ))),
        }
    }

    fn now(&self) -> Duration {
        let mut clock = self.host_clock();
        let t = clock.enter();
        clock.leave();
        t
    }

    fn attention(&self) -> Option<&dyn AttentionDevice> {
        Some(self)
    }
}

impl AttentionDevice for SimDevice {
    fn reserve_kv(&self, n_layer: usize, positions: usize, kv_row: usize) -> Result<()> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        mem.mirror = None;
        let shape = KvShape {
            layers: n_layer,
            positions,
            n_kv_head: 1,
            head_dim: kv_row,
            types: (KvType::F16, KvType::F16),
        };
        let kv = new_kv(&self.budget, shape)?;
        mem.mirror = Some(Mirror { kv });
        Ok(())
    }

    fn write_mirror(&self, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<Duration> {
        self.traffic.moved(2 * bytes_of::<f16>(k.len()));
        let (reply, answer) = channel();
        let bytes = |x: &[f16]| x.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<u8>>();
        self.send(Cmd::MirrorWrite {
            layer,
            start,
            k: bytes(k),
            v: bytes(v),
            reply,
        })?;
        self.answer(&answer)
    }

    fn submit_attention(&self, job: &AttentionJob<'_>) -> Result<Ticket> {
        self.traffic.launched(1);
        self.traffic.moved(bytes_of::<f32>(job.q.len()));
        let (reply, answer) = channel();
        self.send(Cmd::Attend {
            layer: job.layer,
            q: job.q.to_vec(),
            n: job.n,
            params: *job.params,
            reply,
        })?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(self.pending_attention.push(id, answer))
    }

    fn finish_attention(&self, ticket: Ticket) -> Result<(AttentionPart, Duration)> {
        let answer = self.pending_attention.take(ticket, "attention job")?;
        let (part, took) = self.answer(&answer)?;
        self.traffic.moved(bytes_of::<f32>(
            part.max.len() + part.sum.len() + part.acc.len(),
        ));
        Ok((part, took))
    }
}

/// A device's submitted jobs by ticket number, until they are finished.
pub(crate) struct Queue<T>(Mutex<HashMap<u64, T>>);

impl<T> Queue<T> {
    /// No jobs.
    pub(crate) fn new() -> Queue<T> {
        Queue(Mutex::new(HashMap::new()))
    }

    /// Files `job` under ticket number `id`.
    pub(crate) fn push(&self, id: u64, job: T) -> Ticket {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, job);
        Ticket(id)
    }

    /// Takes out the job of `ticket`; an unknown ticket is an error naming the `kind` of job.
    pub(crate) fn take(&self, ticket: Ticket, kind: &str) -> Result<T> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ticket.0)
            .ok_or_else(|| EngineError::Device(format!("unknown {kind} {}", ticket.0)))
    }
}
