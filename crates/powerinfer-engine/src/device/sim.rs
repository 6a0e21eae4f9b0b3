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
//! - **what a GPU charges**: every device counts kernel launches ([`super::launches_of`]),
//!   host waits and link bytes; with a speed model ([`SimSpeed`]) each command also takes at
//!   least `launches · launch + bytes read / bandwidth`, each copy over the link
//!   `latency + bytes / link bandwidth`, and each host wait costs the host `host_wait`, so that
//!   a schedule that waits on the device per operation is slow here as it is on a real card.
//!
//! The arithmetic is that of the CPU kernels (`powerinfer-kernels-cpu`) on the device's copies,
//! so a layer computed here gives the CPU's bits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::f16;
use half::slice::HalfFloatSliceExt;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ffn::{activate, token_ffn, FfnAct, NeuronRows, TokenBufs};
use powerinfer_kernels_cpu::ops::activation::{add, relu};
use powerinfer_kernels_cpu::ops::attention::{
    attention_block, attention_part, AttentionParams, AttentionPart,
};
use powerinfer_kernels_cpu::ops::norm::{layer_norm, rms_norm};
use powerinfer_kernels_cpu::ops::rope::rope_block;
use powerinfer_kernels_cpu::{MatMul, ThreadPool, Weights};
use powerinfer_kernels_cuda::{MemoryBudget, Reservation};
use powerinfer_predictor::predictor::Predictor;

use super::{
    converts_activation, entry, entry_mut, free_entry, graph_segments, hot_slice_overhead,
    masked_flags, program_launches, unknown_kv, AttentionDevice, AttentionJob, BufId, Device,
    GraphCache, HotId, HotKind, HotSpec, HotSwap, KvId, KvRows, KvShape, MatId, Op, PredictorOp,
    Queue, ReadId, RowsOf, Sighting, SimOptions, SimSpeed, Span, Ticket, Traffic, TrafficCounters,
};
use crate::error::{EngineError, Result};

/// A matrix in device memory.
struct DevMat {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
    _held: Reservation,
}

impl DevMat {
    fn view(&self) -> Result<Weights<'_>> {
        Ok(Weights::new(self.ty, self.rows, self.cols, &self.bytes)?)
    }
}

/// A layer's hot neuron rows in device memory, in bucket order.
struct DevHot {
    gate: Option<DevMat>,
    up: DevMat,
    down: DevMat,
    bucket: Vec<u32>,
    /// Neurons of the layer (the enabled mask a GPU keeps covers every one).
    n_ff: usize,
    /// Per slot, whether the device computes it (`None`: every slot).
    enabled: Option<Vec<bool>>,
    up_bias: Option<Vec<f32>>,
    act: FfnAct,
    _held: Reservation,
}

/// One sequence's K and V rows, per layer.
struct DevKv {
    positions: usize,
    row: usize,
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    _held: Reservation,
}

/// The mirror of one sequence's first KV rows, per layer (the attention split's share).
struct Mirror {
    kv: DevKv,
}

/// A buffer in device memory.
struct DevBuf {
    data: Vec<f32>,
    _held: Reservation,
}

/// The device's memory: what was uploaded and allocated.
#[derive(Default)]
struct Memory {
    mats: Vec<DevMat>,
    /// `None`: freed.
    hots: Vec<Option<DevHot>>,
    bufs: Vec<DevBuf>,
    kvs: Vec<DevKv>,
    mirror: Option<Mirror>,
}

/// A command of the device's stream. Inputs are the host's copies in flight.
enum Cmd {
    /// A program; per run between its marks, whether it replays as a graph (one launch).
    Ops {
        ops: Vec<Op>,
        graphed: Vec<bool>,
    },
    Step {
        ids: Vec<u32>,
        positions: Vec<usize>,
    },
    Write {
        dst: Span,
        data: Vec<f32>,
    },
    Read {
        src: Span,
        reply: Sender<Result<Vec<f32>>>,
    },
    KvWrite {
        kv: KvId,
        layer: usize,
        start: usize,
        k: Vec<f16>,
        v: Vec<f16>,
    },
    KvRead {
        kv: KvId,
        layer: usize,
        start: usize,
        n: usize,
        reply: Sender<Result<(Vec<f16>, Vec<f16>)>>,
    },
    KvCopy {
        from: KvId,
        to: KvId,
        n: usize,
    },
    Replace {
        hot: HotId,
        slots: Vec<u32>,
        rows: NewRows,
        reply: Sender<Result<Duration>>,
    },
    Enabled {
        hot: HotId,
        enabled: Option<Vec<bool>>,
    },
    MirrorWrite {
        layer: usize,
        start: usize,
        k: Vec<f16>,
        v: Vec<f16>,
        reply: Sender<Result<Duration>>,
    },
    Attend {
        layer: usize,
        q: Vec<f32>,
        n: usize,
        params: AttentionParams,
        reply: Sender<Result<(AttentionPart, Duration)>>,
    },
}

/// Neurons' rows staged in host memory for a copy into a hot slice.
struct NewRows {
    neurons: Vec<u32>,
    gate: Option<Vec<u8>>,
    up: Vec<u8>,
    down: Vec<u8>,
    up_bias: Option<Vec<f32>>,
}

/// Where an attention part and the device's time arrive.
type AttentionReply = Receiver<Result<(AttentionPart, Duration)>>;

/// Where a read's values arrive.
type ReadReply = Receiver<Result<Vec<f32>>>;

/// The simulated GPU (see the [module docs](self)).
pub(crate) struct SimDevice {
    budget: MemoryBudget,
    memory: Arc<RwLock<Memory>>,
    stream: Mutex<Sender<Cmd>>,
    worker: Option<JoinHandle<()>>,
    reads: Mutex<HashMap<u64, ReadReply>>,
    pending_attention: Queue<AttentionReply>,
    next: AtomicU64,
    overruns: Arc<AtomicU64>,
    traffic: Arc<TrafficCounters>,
    marks: Arc<Mutex<Vec<Option<Instant>>>>,
    /// Per hot slice, whether its enabled mask applies (as the host last set it: what a GPU's
    /// programs queued from now on launch for).
    masked: Mutex<Vec<bool>>,
    /// With graphs, the programs a GPU would have captured (to count its launches).
    graph_cache: Mutex<GraphCache<()>>,
    /// Error of a command the worker could not run, reported at the next wait.
    failed: Arc<Mutex<Option<EngineError>>>,
    threads: usize,
    speed: Option<SimSpeed>,
    /// Programs replay as one launch each (CUDA graphs).
    graphs: bool,
}

/// Bytes a buffer of `n` values of `T` holds.
fn bytes_of<T>(n: usize) -> u64 {
    (n * std::mem::size_of::<T>()) as u64
}

fn budget_error(e: powerinfer_kernels_cuda::BudgetError) -> EngineError {
    EngineError::DeviceMemory {
        requested: e.requested,
        used: e.used,
        limit: e.limit,
    }
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
        let (tx, rx) = channel::<Cmd>();
        let stream = Stream {
            memory: memory.clone(),
            speed: opts.speed,
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
            worker: Some(worker),
            reads: Mutex::new(HashMap::new()),
            pending_attention: Queue::new(),
            next: AtomicU64::new(0),
            overruns,
            traffic,
            marks,
            masked: Mutex::new(Vec::new()),
            graph_cache: Mutex::new(GraphCache::default()),
            failed,
            threads: opts.threads.max(1),
            speed: opts.speed,
            graphs,
        })
    }

    fn send(&self, cmd: Cmd) -> Result<()> {
        self.stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(cmd)
            .map_err(stopped)
    }

    /// The host's side of a wait: counted, charged by the speed model, and the first error
    /// of the stream (if any) reported.
    fn host_waited(&self) -> Result<()> {
        self.traffic.waited();
        if let Some(s) = self.speed {
            spin_until(Instant::now() + s.host_wait);
        }
        match self.failed.lock().unwrap_or_else(|e| e.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
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
        // Closing the channel ends the worker's loop.
        let (dead, _) = channel();
        *self.stream.lock().unwrap_or_else(|e| e.into_inner()) = dead;
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Device for SimDevice {
    fn name(&self) -> String {
        format!(
            "sim ({} thread{}{})",
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
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
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
        let hot = DevHot {
            gate,
            up,
            down,
            bucket: spec.bucket.to_vec(),
            n_ff: spec.up.rows(),
            enabled: None,
            up_bias,
            act: spec.act,
            _held: held,
        };
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
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
        let took = wait(&answer, REPLY_SPIN).map_err(stopped)??;
        self.host_waited()?;
        Ok(took)
    }

    fn set_enabled(&self, hot: HotId, enabled: Option<&[bool]>) -> Result<()> {
        {
            let mut masked = self.masked.lock().unwrap_or_else(|e| e.into_inner());
            if masked.len() <= hot.0 {
                masked.resize(hot.0 + 1, false);
            }
            masked[hot.0] = enabled.is_some();
        }
        // A GPU copies its mask over every neuron of the layer (an f32 each).
        if enabled.is_some() {
            let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
            let n_ff = mem
                .hots
                .get(hot.0)
                .and_then(Option::as_ref)
                .map_or(0, |h| h.n_ff);
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
        let kv = new_kv(
            &self.budget,
            s.layers,
            s.positions,
            s.n_kv_head * s.head_dim,
        )?;
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        mem.kvs.push(kv);
        Ok(KvId(mem.kvs.len() - 1))
    }

    fn write_kv(&self, kv: KvId, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<()> {
        self.traffic.moved(2 * bytes_of::<f16>(k.len()));
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
        let (k, v) = wait(&answer, REPLY_SPIN).map_err(stopped)??;
        self.traffic.moved(2 * bytes_of::<f16>(k.len()));
        self.host_waited()?;
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
        let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
        let masked = self.masked.lock().unwrap_or_else(|e| e.into_inner());
        let is_masked = |h: HotId| masked.get(h.0).copied().unwrap_or(false);
        let plain = |run: &[Op]| {
            program_launches(
                run,
                |m| {
                    let d = mem.mats.get(m.0)?;
                    converts_activation(d.ty).then_some((d.ty, d.cols))
                },
                |h| {
                    let kind = (mem.hots.get(h.0).and_then(Option::as_ref)).map(|d| HotKind {
                        masked: false,
                        gated: d.gate.is_some(),
                        converts: converts_activation(d.up.ty),
                        up_bias: d.up_bias.is_some(),
                        f16_down: d.down.ty == GgmlType::F16,
                    });
                    HotKind {
                        masked: is_masked(h),
                        ..kind.unwrap_or_default()
                    }
                },
            )
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
                }
                let replayed = sighting != Sighting::First;
                launches += if replayed { 1 } else { plain(run) };
                graphed.push(replayed);
            }
        } else {
            launches = plain(ops);
        }
        drop((mem, masked));
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
        let got = wait(&answer, REPLY_SPIN).map_err(stopped)?;
        self.host_waited()?;
        let got = got?;
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
            (Some(a), Some(b)) => Ok(b.saturating_duration_since(a)),
            _ => Err(EngineError::Device(format!(
                "marks {from} and {to} were not both reached"
            ))),
        }
    }

    fn attention(&self) -> Option<&dyn AttentionDevice> {
        Some(self)
    }
}

impl AttentionDevice for SimDevice {
    fn reserve_kv(&self, n_layer: usize, positions: usize, kv_row: usize) -> Result<()> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        mem.mirror = None;
        let kv = new_kv(&self.budget, n_layer, positions, kv_row)?;
        mem.mirror = Some(Mirror { kv });
        Ok(())
    }

    fn write_mirror(&self, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<Duration> {
        self.traffic.moved(2 * bytes_of::<f16>(k.len()));
        let (reply, answer) = channel();
        self.send(Cmd::MirrorWrite {
            layer,
            start,
            k: k.to_vec(),
            v: v.to_vec(),
            reply,
        })?;
        let took = wait(&answer, REPLY_SPIN).map_err(stopped)??;
        self.host_waited()?;
        Ok(took)
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
        let (part, took) = wait(&answer, REPLY_SPIN).map_err(stopped)??;
        self.traffic.moved(bytes_of::<f32>(
            part.max.len() + part.sum.len() + part.acc.len(),
        ));
        self.host_waited()?;
        Ok((part, took))
    }
}

/// A zeroed KV store held against `budget`.
fn new_kv(budget: &MemoryBudget, layers: usize, positions: usize, row: usize) -> Result<DevKv> {
    let values = layers
        .checked_mul(positions)
        .and_then(|v| v.checked_mul(row))
        .ok_or_else(|| EngineError::Device("KV store size overflows".into()))?;
    let held = budget
        .try_reserve(2 * bytes_of::<f16>(values))
        .map_err(budget_error)?;
    Ok(DevKv {
        positions,
        row,
        k: vec![vec![f16::ZERO; positions * row]; layers],
        v: vec![vec![f16::ZERO; positions * row]; layers],
        _held: held,
    })
}

/// How long the worker polls for the next command before it sleeps: a layer's commands come
/// in bursts, and waking a sleeping thread costs tens of microseconds on a busy machine.
const COMMAND_SPIN: Duration = Duration::from_micros(300);

/// How long a caller polls for its answer before it sleeps (its core has nothing else to do).
const REPLY_SPIN: Duration = Duration::from_millis(2);

/// The next message of `rx`: polled for `spin`, then waited for.
fn wait<T>(rx: &Receiver<T>, spin: Duration) -> std::result::Result<T, RecvError> {
    let until = Instant::now() + spin;
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(TryRecvError::Disconnected) => return Err(RecvError),
            Err(TryRecvError::Empty) if Instant::now() < until => std::hint::spin_loop(),
            Err(TryRecvError::Empty) => return rx.recv(),
        }
    }
}

/// Returns at `deadline`: sleeps most of the wait, then yields (sleep alone overshoots).
fn spin_until(deadline: Instant) {
    let now = Instant::now();
    if deadline <= now {
        return;
    }
    let left = deadline - now;
    if left > Duration::from_micros(300) {
        std::thread::sleep(left - Duration::from_micros(150));
    }
    while Instant::now() < deadline {
        std::thread::yield_now();
    }
}

/// The worker: executes commands in order on the device's memory with its own threads.
struct Stream {
    memory: Arc<RwLock<Memory>>,
    speed: Option<SimSpeed>,
    overruns: Arc<AtomicU64>,
    traffic: Arc<TrafficCounters>,
    marks: Arc<Mutex<Vec<Option<Instant>>>>,
    failed: Arc<Mutex<Option<EngineError>>>,
    threads: usize,
}

/// What a command cost in the speed model's terms.
#[derive(Default)]
struct Cost {
    launches: u64,
    read: u64,
    /// Bytes over the link, and copies (each paying the link's latency).
    copied: u64,
    copies: u32,
}

/// The worker's state between commands: the step's parameters and scratch.
struct StepState {
    ids: Vec<u32>,
    positions: Vec<usize>,
    list: Vec<u32>,
    fired: Vec<u32>,
    u: Vec<f32>,
}

impl Stream {
    fn run(self, rx: Receiver<Cmd>) {
        let pool = ThreadPool::new(self.threads);
        let mm = MatMul::new(&pool);
        let mut st = StepState {
            ids: Vec::new(),
            positions: Vec::new(),
            list: Vec::new(),
            fired: Vec::new(),
            u: Vec::new(),
        };
        while let Ok(cmd) = wait(&rx, COMMAND_SPIN) {
            let start = Instant::now();
            let cost = self.execute(&mm, &mut st, cmd, start);
            match cost {
                Ok(c) => {
                    self.pace(start, &c);
                }
                Err(e) => {
                    let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
                    f.get_or_insert(e);
                }
            }
        }
    }

    /// Runs one command; replies go out here (after pacing for the commands that answer).
    fn execute(
        &self,
        mm: &MatMul<'_>,
        st: &mut StepState,
        cmd: Cmd,
        start: Instant,
    ) -> Result<Cost> {
        match cmd {
            Cmd::Ops { ops, graphed } => {
                let mut cost = Cost::default();
                // A run replayed as a graph is one launch.
                let (mut run, mut in_run) = (0, false);
                for op in &ops {
                    if let Op::Mark { slot } = op {
                        // The marks of the speed model's time, not the host's.
                        self.pace(start, &cost);
                        let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
                        if marks.len() <= *slot {
                            marks.resize(slot + 1, None);
                        }
                        marks[*slot] = Some(Instant::now());
                        if in_run {
                            run += 1;
                            in_run = false;
                        }
                        continue;
                    }
                    let first = !in_run;
                    in_run = true;
                    let c = self.op(mm, st, op)?;
                    if !graphed.get(run).copied().unwrap_or(false) {
                        cost.launches += c.launches;
                    } else if first {
                        cost.launches += 1;
                    }
                    cost.read += c.read;
                }
                Ok(cost)
            }
            Cmd::Step { ids, positions } => {
                let n = (ids.len() + positions.len()) as u64;
                st.ids = ids;
                st.positions = positions;
                Ok(Cost {
                    copied: 4 * n,
                    copies: 1,
                    ..Cost::default()
                })
            }
            Cmd::Write { dst, data } => {
                let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
                span_mut(&mut mem.bufs, dst)?.copy_from_slice(&data);
                Ok(Cost {
                    copied: bytes_of::<f32>(data.len()),
                    copies: 1,
                    ..Cost::default()
                })
            }
            Cmd::Read { src, reply } => {
                let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
                let got = span(&mem.bufs, src).map(<[f32]>::to_vec);
                drop(mem);
                let cost = Cost {
                    copied: bytes_of::<f32>(src.len),
                    copies: 1,
                    ..Cost::default()
                };
                self.pace(start, &cost);
                let _ = reply.send(got);
                Ok(Cost::default())
            }
            Cmd::KvWrite {
                kv,
                layer,
                start: from,
                k,
                v,
            } => {
                let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
                let store = mem.kvs.get_mut(kv.0).ok_or_else(|| unknown_kv(kv))?;
                put_rows(store, layer, from, &k, &v)?;
                Ok(Cost {
                    copied: 2 * bytes_of::<f16>(k.len()),
                    copies: 1,
                    ..Cost::default()
                })
            }
            Cmd::KvRead {
                kv,
                layer,
                start: from,
                n,
                reply,
            } => {
                let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
                let got = mem
                    .kvs
                    .get(kv.0)
                    .ok_or_else(|| unknown_kv(kv))
                    .and_then(|s| take_rows(s, layer, from, n));
                drop(mem);
                let bytes = got
                    .as_ref()
                    .map_or(0, |(k, _)| 2 * bytes_of::<f16>(k.len()));
                let cost = Cost {
                    copied: bytes,
                    copies: 1,
                    ..Cost::default()
                };
                self.pace(start, &cost);
                let _ = reply.send(got);
                Ok(Cost::default())
            }
            Cmd::KvCopy { from, to, n } => {
                let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
                if from.0 >= mem.kvs.len() || to.0 >= mem.kvs.len() {
                    return Err(EngineError::Device("unknown KV store".into()));
                }
                let layers = mem.kvs[from.0].k.len();
                let mut read = 0;
                for l in 0..layers {
                    let (k, v) = take_rows(&mem.kvs[from.0], l, 0, n)?;
                    read += 2 * bytes_of::<f16>(k.len());
                    put_rows(&mut mem.kvs[to.0], l, 0, &k, &v)?;
                }
                Ok(Cost {
                    launches: 1,
                    read,
                    ..Cost::default()
                })
            }
            Cmd::Replace {
                hot,
                slots,
                rows,
                reply,
            } => {
                let r = self.replace(hot, &slots, rows);
                let took = r.map(|cost| {
                    self.pace(start, &cost);
                    start.elapsed()
                });
                let _ = reply.send(took);
                Ok(Cost::default())
            }
            Cmd::Enabled { hot, enabled } => {
                let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
                let h = hot_mut(&mut mem, hot)?;
                if let Some(e) = &enabled {
                    if e.len() != h.bucket.len() {
                        return Err(EngineError::Device(format!(
                            "{} enabled flags for {} slots",
                            e.len(),
                            h.bucket.len()
                        )));
                    }
                }
                let bytes = enabled.as_ref().map_or(0, |e| e.len().div_ceil(8) as u64);
                h.enabled = enabled;
                Ok(Cost {
                    copied: bytes,
                    copies: 1,
                    ..Cost::default()
                })
            }
            Cmd::MirrorWrite {
                layer,
                start: from,
                k,
                v,
                reply,
            } => {
                let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
                let r = match mem.mirror.as_mut() {
                    Some(m) => put_rows(&mut m.kv, layer, from, &k, &v),
                    None => Err(EngineError::Device("no KV mirror reserved".into())),
                };
                drop(mem);
                let r = r.map(|()| {
                    self.pace(
                        start,
                        &Cost {
                            copied: 2 * bytes_of::<f16>(k.len()),
                            copies: 1,
                            ..Cost::default()
                        },
                    );
                    start.elapsed()
                });
                let _ = reply.send(r);
                Ok(Cost::default())
            }
            Cmd::Attend {
                layer,
                q,
                n,
                params,
                reply,
            } => {
                let r = self.attend(layer, &q, n, &params).map(|(part, cost)| {
                    self.pace(start, &cost);
                    (part, start.elapsed())
                });
                let _ = reply.send(r);
                Ok(Cost::default())
            }
        }
    }

    /// One operation of a program.
    fn op(&self, mm: &MatMul<'_>, st: &mut StepState, op: &Op) -> Result<Cost> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let mem = &mut *mem;
        let one = |read: u64| Cost {
            launches: 1,
            read,
            ..Cost::default()
        };
        match op {
            Op::MatMul { m, x, y, t } => {
                let dm = mat(&mem.mats, *m)?;
                let w = dm.view()?;
                let (ins, out) = io(&mut mem.bufs, &[*x], *y)?;
                mm.gemm(&w, ins[0], *t, out)?;
                Ok(one(dm.bytes.len() as u64))
            }
            Op::GetRows {
                m,
                rows,
                from,
                n,
                y,
            } => {
                let dm = mat(&mem.mats, *m)?;
                let out = span_mut(&mut mem.bufs, *y)?;
                let rb = dm.bytes.len() / dm.rows.max(1);
                if out.len() != n * dm.cols || from + n > st.ids.len() {
                    return Err(EngineError::Device(format!(
                        "rows of {n} tokens from {from} into {} values",
                        out.len()
                    )));
                }
                for (i, o) in out.chunks_exact_mut(dm.cols).enumerate() {
                    let r = match rows {
                        RowsOf::Ids => st.ids[from + i] as usize,
                        RowsOf::Positions(off) => st.positions[from + i] + off,
                    };
                    if r >= dm.rows {
                        return Err(EngineError::Device(format!(
                            "row {r} of a table of {}",
                            dm.rows
                        )));
                    }
                    powerinfer_gguf::quants::dequantize(dm.ty, &dm.bytes[r * rb..][..rb], o)?;
                }
                Ok(one((n * rb) as u64))
            }
            Op::Norm {
                x,
                add: residual,
                w,
                b,
                eps,
                y,
            } => {
                if let Some(a) = residual {
                    let (ins, out) = io(&mut mem.bufs, &[*a], *x)?;
                    add(out, ins[0])?;
                }
                let wv = buf(&mem.bufs, *w)?.to_vec();
                let bv = b
                    .map(|b| buf(&mem.bufs, b).map(<[f32]>::to_vec))
                    .transpose()?;
                let (ins, out) = io(&mut mem.bufs, &[*x], *y)?;
                match &bv {
                    None => rms_norm(ins[0], &wv, *eps, out)?,
                    Some(bv) => layer_norm(ins[0], &wv, bv, *eps, out)?,
                }
                let added = if residual.is_some() { 12 } else { 8 };
                Ok(one(added * x.len as u64))
            }
            Op::AddRows { y, b } => {
                let bv = buf(&mem.bufs, *b)?.to_vec();
                let out = span_mut(&mut mem.bufs, *y)?;
                if bv.is_empty() || out.len() % bv.len() != 0 {
                    return Err(EngineError::Device(format!(
                        "a bias of {} values over {}",
                        bv.len(),
                        out.len()
                    )));
                }
                for r in out.chunks_exact_mut(bv.len()) {
                    add(r, &bv)?;
                }
                Ok(one(8 * y.len as u64))
            }
            Op::Add { y, x } => {
                let (ins, out) = io(&mut mem.bufs, &[*x], *y)?;
                add(out, ins[0])?;
                Ok(one(8 * y.len as u64))
            }
            Op::Zero { y } => {
                span_mut(&mut mem.bufs, *y)?.fill(0.0);
                Ok(one(4 * y.len as u64))
            }
            Op::Copy { x, y } => {
                let (ins, out) = io(&mut mem.bufs, &[*x], *y)?;
                if ins[0].len() != out.len() {
                    return Err(EngineError::Device(format!(
                        "a copy of {} values into {}",
                        ins[0].len(),
                        out.len()
                    )));
                }
                out.copy_from_slice(ins[0]);
                Ok(one(8 * y.len as u64))
            }
            Op::Rope(r) => {
                let n = r.q.len / (r.n_head * r.head_dim).max(1);
                let pos = (st.positions.get(..n))
                    .ok_or_else(|| EngineError::Device("RoPE of tokens outside the step".into()))?;
                if r.k.len != n * r.n_head_kv * r.head_dim {
                    return Err(EngineError::Device(format!(
                        "RoPE of {n} tokens' Q with {} values of K",
                        r.k.len
                    )));
                }
                for (x, heads) in [(r.q, r.n_head), (r.k, r.n_head_kv)] {
                    let out = span_mut(&mut mem.bufs, x)?;
                    rope_block(out, heads, r.head_dim, pos, &r.params)?;
                }
                Ok(one(8 * (r.q.len + r.k.len) as u64))
            }
            Op::Attention(a) => {
                // The step's positions of the tokens: consecutive for one sequence's part.
                let pos = match st.positions.get(a.at..a.at + a.n) {
                    Some(p) if p.iter().enumerate().all(|(i, &q)| q == p[0] + i) => p[0],
                    Some([]) => 0,
                    _ => {
                        return Err(EngineError::Device(format!(
                            "attention of tokens {}..{} of the step: not consecutive positions \
                             of the step",
                            a.at,
                            a.at + a.n
                        )))
                    }
                };
                let (n, kf) = (a.n, span(&mem.bufs, a.k)?);
                let vf = span(&mem.bufs, a.v)?;
                let store = mem.kvs.get_mut(a.kv.0).ok_or_else(|| unknown_kv(a.kv))?;
                let row = store.row;
                if kf.len() != n * row || vf.len() != n * row {
                    return Err(EngineError::Device(format!(
                        "KV rows of {} values for {n} rows of {row}",
                        kf.len()
                    )));
                }
                let mut kh = vec![f16::ZERO; kf.len()];
                let mut vh = vec![f16::ZERO; vf.len()];
                kh.convert_from_f32_slice(kf);
                vh.convert_from_f32_slice(vf);
                put_rows(store, a.layer, pos, &kh, &vh)?;
                let written = 4 * (n * row) as u64;
                let (layer, len) = (a.layer, pos + a.n);
                let qv = span(&mem.bufs, a.q)?.to_vec();
                let store = mem.kvs.get(a.kv.0).ok_or_else(|| unknown_kv(a.kv))?;
                let row = store.row;
                if layer >= store.k.len() || len > store.positions || a.n > len {
                    return Err(EngineError::Device(format!(
                        "attention over {len} positions of layer {layer} of a store of {} \
                         layers and {} positions",
                        store.k.len(),
                        store.positions
                    )));
                }
                let (kc, vc) = (&store.k[layer][..len * row], &store.v[layer][..len * row]);
                let read = 4 * (len * row) as u64;
                let out = span_mut(&mut mem.bufs, a.out)?;
                attention_block(mm.pool(), &qv, kc, vc, a.n, &a.params, out)?;
                Ok(Cost {
                    launches: 2,
                    ..one(written + read)
                })
            }
            Op::Predictor(pr) => {
                let PredictorOp {
                    x, hidden, scores, ..
                } = *pr;
                let t = pr.t;
                let (a, b) = (mat(&mem.mats, pr.fc1)?, mat(&mem.mats, pr.fc2)?);
                let p = Predictor::new(a.view()?, b.view()?)?;
                if hidden.len != t * p.rank() {
                    return Err(EngineError::Device(format!(
                        "a predictor's hidden span of {} values for {t} tokens of rank {}",
                        hidden.len,
                        p.rank()
                    )));
                }
                let xv = span(&mem.bufs, x)?.to_vec();
                // The span checked, the product uses the buffer as its scratch; its length is
                // given back as it was.
                let mut h = std::mem::take(span_vec(&mut mem.bufs, hidden)?);
                let len = h.len();
                let out = span_mut(&mut mem.bufs, scores)?;
                let r = p.scores_with(mm, &xv, t, &mut h, out);
                h.resize(len, 0.0);
                *span_vec(&mut mem.bufs, hidden)? = h;
                r?;
                Ok(Cost {
                    launches: 3,
                    read: (a.bytes.len() + b.bytes.len()) as u64,
                    ..Cost::default()
                })
            }
            Op::HotFfn(f) => {
                let h = entry(&mem.hots, f.hot.0, "hot slice")?;
                let xv = span(&mem.bufs, f.x)?.to_vec();
                let sv = span(&mem.bufs, f.scores)?.to_vec();
                let (ys, read, counts) = hot_ffn(mm, st, h, &xv, &sv, f.threshold, f.t)?;
                let out = span_mut(&mut mem.bufs, f.y)?;
                if out.len() != ys.len() {
                    return Err(EngineError::Device(format!(
                        "a hot FFN of {} values into {}",
                        ys.len(),
                        out.len()
                    )));
                }
                if f.accumulate {
                    add(out, &ys)?;
                } else {
                    out.copy_from_slice(&ys);
                }
                if let Some(c) = f.count {
                    let out = span_mut(&mut mem.bufs, c)?;
                    if out.len() != counts.len() {
                        return Err(EngineError::Device("a count span of the wrong size".into()));
                    }
                    // Added for one token of a gated FFN (as a GPU's fused products count).
                    let adds = h.gate.is_some() && f.t == 1;
                    for (o, &n) in out.iter_mut().zip(&counts) {
                        *o = if adds { *o + n as f32 } else { n as f32 };
                    }
                }
                Ok(Cost {
                    launches: 5,
                    read,
                    ..Cost::default()
                })
            }
            Op::Activate { act, gate, up } => {
                if *act == FfnAct::Relu {
                    relu(span_mut(&mut mem.bufs, *gate)?);
                } else {
                    let (ins, out) = io(&mut mem.bufs, &[*up], *gate)?;
                    activate(*act, out, ins[0])?;
                }
                Ok(one(12 * gate.len as u64))
            }
            Op::Mark { .. } => Ok(Cost::default()),
        }
    }

    /// Copies staged rows into slots of a hot slice (the bucket stays unique: a neuron the
    /// slice holds in another slot is refused); the new slots are enabled.
    fn replace(&self, hot: HotId, slots: &[u32], rows: NewRows) -> Result<Cost> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let h = hot_mut(&mut mem, hot)?;
        let k = h.bucket.len();
        let mut bucket = h.bucket.clone();
        for (&s, &n) in slots.iter().zip(&rows.neurons) {
            let s = s as usize;
            if s >= k {
                return Err(EngineError::Device(format!(
                    "slot {s} outside the hot slice's {k}"
                )));
            }
            bucket[s] = n;
        }
        let mut seen = std::collections::HashSet::with_capacity(k);
        if !bucket.iter().all(|n| seen.insert(*n)) {
            return Err(EngineError::Device(
                "the replaced rows would hold a neuron twice".into(),
            ));
        }
        if h.gate.is_some() != rows.gate.is_some() || h.up_bias.is_some() != rows.up_bias.is_some()
        {
            return Err(EngineError::Device(
                "replacement rows do not match the hot slice's matrices".into(),
            ));
        }
        let mut copied = 0u64;
        let mut put = |m: &mut DevMat, src: &[u8]| -> Result<()> {
            let rb = m.bytes.len() / k.max(1);
            if src.len() != slots.len() * rb {
                return Err(EngineError::Device(
                    "replacement rows of the wrong size".into(),
                ));
            }
            for (i, &s) in slots.iter().enumerate() {
                m.bytes[s as usize * rb..][..rb].copy_from_slice(&src[i * rb..][..rb]);
            }
            copied += src.len() as u64;
            Ok(())
        };
        if let (Some(g), Some(src)) = (h.gate.as_mut(), rows.gate.as_deref()) {
            put(g, src)?;
        }
        put(&mut h.up, &rows.up)?;
        put(&mut h.down, &rows.down)?;
        if let (Some(b), Some(src)) = (h.up_bias.as_mut(), rows.up_bias.as_deref()) {
            for (&s, &v) in slots.iter().zip(src) {
                b[s as usize] = v;
            }
        }
        if let Some(e) = h.enabled.as_mut() {
            for &s in slots {
                e[s as usize] = true;
            }
        }
        h.bucket = bucket;
        let copied = copied + bytes_of::<u32>(slots.len());
        self.traffic.moved(copied);
        Ok(Cost {
            launches: 1,
            copied,
            copies: 1,
            ..Cost::default()
        })
    }

    /// One token's attention part over the first `n` mirrored positions of `layer`.
    fn attend(
        &self,
        layer: usize,
        q: &[f32],
        n: usize,
        params: &AttentionParams,
    ) -> Result<(AttentionPart, Cost)> {
        let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
        let kv = &mem
            .mirror
            .as_ref()
            .ok_or_else(|| EngineError::Device("no KV mirror reserved".into()))?
            .kv;
        let row = kv.row;
        if layer >= kv.k.len() || n > kv.positions || row != params.kv_row_len() {
            return Err(EngineError::Device(format!(
                "attention over {n} positions of layer {layer}: the mirror has {} layers of {} \
                 positions of {row} values",
                kv.k.len(),
                kv.positions
            )));
        }
        let mut part = AttentionPart::default();
        attention_part(
            q,
            &kv.k[layer][..n * row],
            &kv.v[layer][..n * row],
            params,
            &mut part,
        )?;
        let out = part.max.len() + part.sum.len() + part.acc.len();
        Ok((
            part,
            Cost {
                launches: 1,
                read: 2 * bytes_of::<f16>(n * row),
                copied: bytes_of::<f32>(q.len() + out),
                copies: 2,
            },
        ))
    }

    /// Waits until the speed model's time for `cost` has passed since `start` (counting an
    /// overrun when the work itself took longer).
    fn pace(&self, start: Instant, cost: &Cost) {
        let Some(s) = self.speed else {
            return;
        };
        let secs = |bytes: u64, bps: f64| {
            if bps > 0.0 {
                Duration::from_secs_f64(bytes as f64 / bps)
            } else {
                Duration::ZERO
            }
        };
        let launches = u32::try_from(cost.launches).unwrap_or(u32::MAX);
        let modeled = s.launch * launches
            + secs(cost.read, s.bandwidth)
            + s.link_latency * cost.copies
            + secs(cost.copied, s.link_bandwidth);
        let deadline = start + modeled;
        if Instant::now() > deadline && cost.read > 0 {
            self.overruns.fetch_add(1, Ordering::Relaxed);
            return;
        }
        spin_until(deadline);
    }
}

/// The hot part of a sparse FFN over `t` tokens: per token the enabled slots whose neuron's
/// score is at least `threshold`, through [`token_ffn`]. Returns the outputs (`t × n_embd`),
/// the bytes read and each token's count of computed neurons.
#[allow(clippy::too_many_arguments)]
fn hot_ffn(
    mm: &MatMul<'_>,
    st: &mut StepState,
    h: &DevHot,
    x: &[f32],
    scores: &[f32],
    threshold: f32,
    t: usize,
) -> Result<(Vec<f32>, u64, Vec<u32>)> {
    let (up, down) = (h.up.view()?, h.down.view()?);
    let gate = h.gate.as_ref().map(DevMat::view).transpose()?;
    let ne = down.cols();
    let k = h.bucket.len();
    let nff = scores.len().checked_div(t).unwrap_or(0);
    if x.len() != t * ne || scores.len() != t * nff {
        return Err(EngineError::Device(format!(
            "hot FFN: {} inputs and {} scores for {t} tokens of width {ne}",
            x.len(),
            scores.len()
        )));
    }
    if h.bucket.iter().any(|&j| j as usize >= nff) {
        return Err(EngineError::Device(
            "the hot slice holds neurons outside the scores".into(),
        ));
    }
    let rows = NeuronRows {
        gate: gate.as_ref(),
        up: &up,
        down: &down,
        up_bias: h.up_bias.as_deref(),
        act: h.act,
    };
    let per_row = |m: &DevMat| (m.bytes.len() / k.max(1)) as u64;
    let gate_row = h.gate.as_ref().map_or(0, per_row);
    let (up_row, down_row) = (per_row(&h.up), per_row(&h.down));
    st.u.resize(k, 0.0);
    let mut g = vec![0f32; k];
    let mut y = vec![0f32; t * ne];
    let mut read = 0u64;
    let mut counts = Vec::with_capacity(t);
    for i in 0..t {
        let sc = &scores[i * nff..][..nff];
        st.list.clear();
        st.list.extend((0..k as u32).filter(|&j| {
            h.enabled.as_ref().is_none_or(|e| e[j as usize])
                && sc[h.bucket[j as usize] as usize] >= threshold
        }));
        let mut bufs = TokenBufs {
            g: &mut g,
            u: &mut st.u[..k],
            fired: &mut st.fired,
        };
        let yi = &mut y[i * ne..][..ne];
        let n_up = token_ffn(mm, &rows, &x[i * ne..][..ne], &st.list, &mut bufs, yi)?;
        let a = st.list.len() as u64;
        counts.push(a as u32);
        read += a * (gate_row + down_row) + n_up as u64 * up_row;
    }
    Ok((y, read, counts))
}

fn mat(mats: &[DevMat], id: MatId) -> Result<&DevMat> {
    mats.get(id.0)
        .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", id.0)))
}

fn hot_mut(mem: &mut Memory, hot: HotId) -> Result<&mut DevHot> {
    entry_mut(&mut mem.hots, hot.0, "hot slice")
}

fn buf(bufs: &[DevBuf], id: BufId) -> Result<&[f32]> {
    bufs.get(id.0)
        .map(|b| b.data.as_slice())
        .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", id.0)))
}

fn bad_span(s: Span, len: usize) -> EngineError {
    EngineError::Device(format!(
        "values {}..{} of buffer {} of {len}",
        s.off,
        s.off + s.len,
        s.buf.0
    ))
}

fn span(bufs: &[DevBuf], s: Span) -> Result<&[f32]> {
    let b = buf(bufs, s.buf)?;
    b.get(s.off..s.off + s.len)
        .ok_or_else(|| bad_span(s, b.len()))
}

fn span_vec(bufs: &mut [DevBuf], s: Span) -> Result<&mut Vec<f32>> {
    bufs.get_mut(s.buf.0)
        .map(|b| &mut b.data)
        .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", s.buf.0)))
}

fn span_mut(bufs: &mut [DevBuf], s: Span) -> Result<&mut [f32]> {
    let b = span_vec(bufs, s)?;
    let len = b.len();
    b.get_mut(s.off..s.off + s.len)
        .ok_or_else(|| bad_span(s, len))
}

/// The inputs `ins` and the output `out` of an operation, borrowed together: inputs in other
/// buffers than the output are borrowed, those in the output's buffer must not overlap it.
fn io<'b>(
    bufs: &'b mut [DevBuf],
    ins: &[Span],
    out: Span,
) -> Result<(Vec<&'b [f32]>, &'b mut [f32])> {
    if out.buf.0 >= bufs.len() {
        return Err(EngineError::Device(format!(
            "unknown device buffer {}",
            out.buf.0
        )));
    }
    for s in ins {
        if s.buf == out.buf && s.off < out.off + out.len && out.off < s.off + s.len {
            return Err(EngineError::Device(
                "an operation reads the values it writes".into(),
            ));
        }
    }
    // Split the table around the output's buffer.
    let (before, rest) = bufs.split_at_mut(out.buf.0);
    let (target, after) = rest.split_first_mut().expect("index checked above");
    let tlen = target.data.len();
    if out.off + out.len > tlen {
        return Err(bad_span(out, tlen));
    }
    // Inputs in the output's buffer lie outside the output span.
    let (lo, hi_all) = target.data.split_at_mut(out.off);
    let (o, hi) = hi_all.split_at_mut(out.len);
    let mut got = Vec::with_capacity(ins.len());
    for s in ins {
        let slice: &[f32] = if s.buf == out.buf {
            if s.off + s.len <= out.off {
                &lo[s.off..s.off + s.len]
            } else {
                let start = s.off - (out.off + out.len);
                hi.get(start..start + s.len)
                    .ok_or_else(|| bad_span(*s, tlen))?
            }
        } else if s.buf.0 < out.buf.0 {
            let b = &before[s.buf.0].data;
            b.get(s.off..s.off + s.len)
                .ok_or_else(|| bad_span(*s, b.len()))?
        } else {
            let i = s.buf.0 - out.buf.0 - 1;
            let b = &after
                .get(i)
                .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", s.buf.0)))?
                .data;
            b.get(s.off..s.off + s.len)
                .ok_or_else(|| bad_span(*s, b.len()))?
        };
        got.push(slice);
    }
    Ok((got, o))
}

/// Writes K and V rows (whole rows) into layer `layer` of `kv` from position `from`.
fn put_rows(kv: &mut DevKv, layer: usize, from: usize, k: &[f16], v: &[f16]) -> Result<()> {
    let row = kv.row;
    if k.len() != v.len() || row == 0 || k.len() % row != 0 {
        return Err(EngineError::Device(format!(
            "KV rows of {} and {} values for rows of {row}",
            k.len(),
            v.len()
        )));
    }
    let rows = k.len() / row;
    if layer >= kv.k.len() || from + rows > kv.positions {
        return Err(EngineError::Device(format!(
            "KV rows {from}..{} of layer {layer} outside the store ({} layers, {} positions)",
            from + rows,
            kv.k.len(),
            kv.positions
        )));
    }
    kv.k[layer][from * row..][..k.len()].copy_from_slice(k);
    kv.v[layer][from * row..][..v.len()].copy_from_slice(v);
    Ok(())
}

/// Rows `from .. from + n` of layer `layer` of `kv`.
fn take_rows(kv: &DevKv, layer: usize, from: usize, n: usize) -> Result<(Vec<f16>, Vec<f16>)> {
    let row = kv.row;
    if layer >= kv.k.len() || from + n > kv.positions {
        return Err(EngineError::Device(format!(
            "KV rows {from}..{} of layer {layer} outside the store ({} layers, {} positions)",
            from + n,
            kv.k.len(),
            kv.positions
        )));
    }
    Ok((
        kv.k[layer][from * row..(from + n) * row].to_vec(),
        kv.v[layer][from * row..(from + n) * row].to_vec(),
    ))
}
