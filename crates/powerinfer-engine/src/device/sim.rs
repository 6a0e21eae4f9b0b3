//! A simulated GPU: the device every machine has, so that the hybrid engine's schedule runs
//! end to end without a GPU (in CI too).
//!
//! It behaves as a discrete GPU does, on the CPU:
//!
//! - **its own memory**: every matrix, hot slice and work buffer is a separate allocation
//!   held against a [`MemoryBudget`] (the VRAM budget), which refuses before anything is
//!   allocated;
//! - **explicit transfers**: weights are copied in at upload, a job's inputs are copied into
//!   the device's work buffers and its output is copied back; the CPU never reads device
//!   memory, the device never reads host memory;
//! - **its own threads**: one worker thread executes commands in order (a stream) with its
//!   own kernel thread pool, beside the CPU side's pool;
//! - **an optional speed model** ([`SimSpeed`]): each command takes at least
//!   `launches · launch + bytes read / bandwidth + bytes copied / link bandwidth`, so that a
//!   slower or faster device can be played.
//!
//! The arithmetic is that of the CPU kernels (`powerinfer-kernels-cpu`) on the device's copies.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use half::f16;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ops::attention::{attention_part, AttentionParams, AttentionPart};
use powerinfer_kernels_cpu::{MatMul, ThreadPool, Weights};
use powerinfer_kernels_cuda::{MemoryBudget, Reservation};
use powerinfer_predictor::predictor::Predictor;

use super::{
    AttentionDevice, AttentionJob, Device, HotDone, HotId, HotJob, HotSpec, HotSwap, MatId, Queue,
    SimOptions, SimSpeed, Ticket, WorkShape,
};
use crate::error::{EngineError, Result};
use crate::model::FfnAct;
use powerinfer_kernels_cpu::ffn::{token_ffn, NeuronRows, TokenBufs};

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
    up_bias: Option<Vec<f32>>,
    act: FfnAct,
    _held: Reservation,
}

/// The mirror of one sequence's first KV rows, per layer (the attention split's share).
struct DevKv {
    positions: usize,
    kv_row: usize,
    /// Per layer, `positions · kv_row` keys, then values.
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
    _held: Reservation,
}

/// The device's memory: what was uploaded.
#[derive(Default)]
struct Memory {
    mats: Vec<DevMat>,
    /// `None`: freed.
    hots: Vec<Option<DevHot>>,
    kv: Option<DevKv>,
}

/// Work buffers in device memory (inputs copied in, outputs before they are copied out).
struct Work {
    /// Tokens per chunk.
    t_max: usize,
    x: Vec<f32>,
    out: Vec<f32>,
    scores: Vec<f32>,
    g: Vec<f32>,
    u: Vec<f32>,
    y: Vec<f32>,
    hidden: Vec<f32>,
    list: Vec<u32>,
    fired: Vec<u32>,
    _held: Option<Reservation>,
}

impl Work {
    fn empty() -> Work {
        Work {
            t_max: 0,
            x: Vec::new(),
            out: Vec::new(),
            scores: Vec::new(),
            g: Vec::new(),
            u: Vec::new(),
            y: Vec::new(),
            hidden: Vec::new(),
            list: Vec::new(),
            fired: Vec::new(),
            _held: None,
        }
    }
}

/// A command of the device's stream. Inputs are the host's copies in flight.
enum Cmd {
    Work {
        shape: WorkShape,
        reply: Sender<Result<()>>,
    },
    Product {
        m: MatId,
        x: Vec<f32>,
        t: usize,
        reply: Sender<Result<Vec<f32>>>,
    },
    Scores {
        fc1: MatId,
        fc2: MatId,
        h: Vec<f32>,
        t: usize,
        reply: Sender<Result<Vec<f32>>>,
    },
    Replace {
        hot: HotId,
        slots: Vec<u32>,
        rows: NewRows,
        reply: Sender<Result<Duration>>,
    },
    Hot {
        hot: HotId,
        x: Vec<f32>,
        scores: Vec<f32>,
        t: usize,
        threshold: f32,
        reply: Sender<Result<(Vec<f32>, HotDone)>>,
    },
    KvWrite {
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

/// Where an attention part and the device's time arrive.
type AttentionReply = Receiver<Result<(AttentionPart, Duration)>>;

/// Neurons' rows staged in host memory for a copy into a hot slice.
struct NewRows {
    neurons: Vec<u32>,
    gate: Option<Vec<u8>>,
    up: Vec<u8>,
    down: Vec<u8>,
    up_bias: Option<Vec<f32>>,
}

/// Where a hot job's output and report arrive.
type HotReply = Receiver<Result<(Vec<f32>, HotDone)>>;

/// The simulated GPU (see the [module docs](self)).
pub(crate) struct SimDevice {
    budget: MemoryBudget,
    memory: Arc<RwLock<Memory>>,
    stream: Mutex<Sender<Cmd>>,
    worker: Option<JoinHandle<()>>,
    pending: Queue<HotReply>,
    pending_attention: Queue<AttentionReply>,
    next: AtomicU64,
    overruns: Arc<AtomicU64>,
    threads: usize,
    speed: Option<SimSpeed>,
}

/// Bytes a buffer of `n` values of `T` holds.
fn bytes_of<T>(n: usize) -> u64 {
    (n * std::mem::size_of::<T>()) as u64
}

/// Values of the products' output buffer: `t_max` tokens of a layer's widest product, and at
/// least one token of the largest matrix (the output head; its products run in chunks).
fn out_len(s: &WorkShape) -> usize {
    (s.t_max.max(1) * s.n_ff.max(s.n_embd)).max(s.max_rows)
}

/// Bytes of the work buffers for `s`: inputs (`x`), outputs of products (`out`), FFN outputs
/// (`y`), scores, a token's gate/up values, the predictor's hidden layer, row lists.
fn work_bytes(s: &WorkShape) -> u64 {
    let t = s.t_max.max(1);
    bytes_of::<f32>(
        t * s.max_cols.max(s.n_embd)
            + out_len(s)
            + t * s.n_embd
            + t * s.n_ff
            + 2 * s.n_ff
            + t * s.rank,
    ) + bytes_of::<u32>(2 * s.n_ff)
}

impl SimDevice {
    /// A device with `budget` bytes of memory.
    pub(crate) fn new(budget: u64, opts: &SimOptions) -> Result<SimDevice> {
        let budget = MemoryBudget::new(budget);
        let memory = Arc::new(RwLock::new(Memory::default()));
        let overruns = Arc::new(AtomicU64::new(0));
        let (tx, rx) = channel::<Cmd>();
        let stream = Stream {
            memory: memory.clone(),
            budget: budget.clone(),
            speed: opts.speed,
            overruns: overruns.clone(),
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
            pending: Queue::new(),
            pending_attention: Queue::new(),
            next: AtomicU64::new(0),
            overruns,
            threads: opts.threads.max(1),
            speed: opts.speed,
        })
    }

    fn send(&self, cmd: Cmd) -> Result<()> {
        self.stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(cmd)
            .map_err(|_| EngineError::Device("the simulated GPU's worker has stopped".into()))
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
            Some(rows) => {
                let mut out = Vec::with_capacity(n * rb);
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
                out
            }
        };
        Ok(DevMat {
            ty: w.ty(),
            rows: n,
            cols: w.cols(),
            bytes,
            _held: held,
        })
    }
}

fn budget_error(e: powerinfer_kernels_cuda::BudgetError) -> EngineError {
    EngineError::DeviceMemory {
        requested: e.requested,
        used: e.used,
        limit: e.limit,
    }
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
            "sim ({} thread{})",
            self.threads,
            if self.threads == 1 { "" } else { "s" }
        )
    }

    fn identity(&self) -> String {
        match self.speed {
            Some(s) => format!(
                "{} at {} B/s, launch {:?}, link {} B/s",
                self.name(),
                s.bandwidth,
                s.launch,
                s.link_bandwidth
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

    fn work_bytes(&self, shape: &WorkShape) -> u64 {
        work_bytes(shape)
    }

    fn reserve_work(&self, shape: &WorkShape) -> Result<()> {
        let (reply, answer) = channel();
        self.send(Cmd::Work {
            shape: *shape,
            reply,
        })?;
        answer.recv().map_err(stopped)?
    }

    fn upload(&self, w: &Weights<'_>) -> Result<MatId> {
        let m = self.copy_in(w, None)?;
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        mem.mats.push(m);
        Ok(MatId(mem.mats.len() - 1))
    }

    fn upload_hot(&self, spec: &HotSpec<'_>) -> Result<HotId> {
        let held = self
            .budget
            .try_reserve(bytes_of::<u32>(spec.bucket.len()))
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
        let gather = |w: &Weights<'_>| -> Result<Vec<u8>> {
            let rb = w.row_bytes();
            let mut out = Vec::with_capacity(neurons.len() * rb);
            for &n in neurons {
                let n = n as usize;
                if n >= w.rows() {
                    return Err(EngineError::Device(format!(
                        "neuron {n} outside the matrix's {} rows",
                        w.rows()
                    )));
                }
                out.extend_from_slice(&w.data()[n * rb..][..rb]);
            }
            Ok(out)
        };
        let rows = NewRows {
            neurons: neurons.to_vec(),
            gate: spec.gate.as_ref().map(gather).transpose()?,
            up: gather(&spec.up)?,
            down: gather(&spec.down_t)?,
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
        wait(&answer, REPLY_SPIN).map_err(stopped)?
    }

    fn drop_hot(&self, hot: HotId) -> Result<()> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        match mem.hots.get_mut(hot.0) {
            Some(h @ Some(_)) => {
                *h = None;
                Ok(())
            }
            _ => Err(EngineError::Device(format!("unknown hot slice {}", hot.0))),
        }
    }

    fn product(&self, m: MatId, x: &[f32], t: usize, y: &mut [f32]) -> Result<()> {
        let (reply, answer) = channel();
        self.send(Cmd::Product {
            m,
            x: x.to_vec(),
            t,
            reply,
        })?;
        let out = wait(&answer, REPLY_SPIN).map_err(stopped)??;
        copy_out(&out, y)
    }

    fn scores(&self, fc1: MatId, fc2: MatId, h: &[f32], t: usize, out: &mut [f32]) -> Result<()> {
        let (reply, answer) = channel();
        self.send(Cmd::Scores {
            fc1,
            fc2,
            h: h.to_vec(),
            t,
            reply,
        })?;
        let scores = wait(&answer, REPLY_SPIN).map_err(stopped)??;
        copy_out(&scores, out)
    }

    fn submit(&self, job: &HotJob<'_>) -> Result<Ticket> {
        let (reply, answer) = channel();
        self.send(Cmd::Hot {
            hot: job.hot,
            x: job.x.to_vec(),
            scores: job.scores.to_vec(),
            t: job.t,
            threshold: job.threshold,
            reply,
        })?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(self.pending.push(id, answer))
    }

    fn finish(&self, ticket: Ticket, out: &mut [f32]) -> Result<HotDone> {
        let answer = self.pending.take(ticket, "device job")?;
        let (y, done) = wait(&answer, REPLY_SPIN).map_err(stopped)??;
        if y.len() != out.len() {
            return Err(EngineError::Device(format!(
                "device output of {} values for {}",
                y.len(),
                out.len()
            )));
        }
        out.iter_mut().zip(&y).for_each(|(o, d)| *o += d);
        Ok(done)
    }

    fn attention(&self) -> Option<&dyn AttentionDevice> {
        Some(self)
    }

    fn overruns(&self) -> u64 {
        self.overruns.load(Ordering::Relaxed)
    }
}

impl AttentionDevice for SimDevice {
    fn reserve_kv(&self, n_layer: usize, positions: usize, kv_row: usize) -> Result<()> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        mem.kv = None;
        let values = n_layer
            .checked_mul(positions)
            .and_then(|v| v.checked_mul(kv_row))
            .ok_or_else(|| EngineError::Device("KV mirror size overflows".into()))?;
        let held = self
            .budget
            .try_reserve(2 * bytes_of::<f16>(values))
            .map_err(budget_error)?;
        mem.kv = Some(DevKv {
            positions,
            kv_row,
            k: vec![vec![f16::ZERO; positions * kv_row]; n_layer],
            v: vec![vec![f16::ZERO; positions * kv_row]; n_layer],
            _held: held,
        });
        Ok(())
    }

    fn write_kv(&self, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<Duration> {
        let (reply, answer) = channel();
        self.send(Cmd::KvWrite {
            layer,
            start,
            k: k.to_vec(),
            v: v.to_vec(),
            reply,
        })?;
        wait(&answer, REPLY_SPIN).map_err(stopped)?
    }

    fn submit_attention(&self, job: &AttentionJob<'_>) -> Result<Ticket> {
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
        wait(&answer, REPLY_SPIN).map_err(stopped)?
    }
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

fn stopped<E>(_: E) -> EngineError {
    EngineError::Device("the simulated GPU's worker has stopped".into())
}

fn copy_out(src: &[f32], dst: &mut [f32]) -> Result<()> {
    if src.len() != dst.len() {
        return Err(EngineError::Device(format!(
            "device output of {} values for {}",
            src.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// The worker: executes commands in order on the device's memory with its own threads.
struct Stream {
    memory: Arc<RwLock<Memory>>,
    budget: MemoryBudget,
    speed: Option<SimSpeed>,
    overruns: Arc<AtomicU64>,
    threads: usize,
}

/// What a command cost in the speed model's terms.
#[derive(Default)]
struct Cost {
    launches: u32,
    read: u64,
    copied: u64,
}

impl Stream {
    fn run(self, rx: Receiver<Cmd>) {
        let pool = ThreadPool::new(self.threads);
        let mm = MatMul::new(&pool);
        let mut work = Work::empty();
        while let Ok(cmd) = wait(&rx, COMMAND_SPIN) {
            let start = Instant::now();
            match cmd {
                Cmd::Work { shape, reply } => {
                    let r = self.alloc_work(&mut work, &shape);
                    let _ = reply.send(r);
                }
                Cmd::Product { m, x, t, reply } => {
                    let r = self.product(&mm, &mut work, m, &x, t);
                    let r = r.map(|(y, cost)| {
                        self.pace(start, &cost);
                        y
                    });
                    let _ = reply.send(r);
                }
                Cmd::Scores {
                    fc1,
                    fc2,
                    h,
                    t,
                    reply,
                } => {
                    let r = self.scores(&mm, &mut work, fc1, fc2, &h, t);
                    let r = r.map(|(s, cost)| {
                        self.pace(start, &cost);
                        s
                    });
                    let _ = reply.send(r);
                }
                Cmd::Replace {
                    hot,
                    slots,
                    rows,
                    reply,
                } => {
                    let r = self.replace(hot, &slots, rows).map(|cost| {
                        self.pace(start, &cost);
                        start.elapsed()
                    });
                    let _ = reply.send(r);
                }
                Cmd::Hot {
                    hot,
                    x,
                    scores,
                    t,
                    threshold,
                    reply,
                } => {
                    let r = self.hot(&mm, &mut work, hot, &x, &scores, t, threshold);
                    let r = r.map(|(y, active, cost)| {
                        let transfer = self.pace(start, &cost);
                        let done = HotDone {
                            active,
                            busy: start.elapsed(),
                            transfer,
                        };
                        (y, done)
                    });
                    let _ = reply.send(r);
                }
                Cmd::KvWrite {
                    layer,
                    start: from,
                    k,
                    v,
                    reply,
                } => {
                    let r = self.write_kv(layer, from, &k, &v).map(|cost| {
                        self.pace(start, &cost);
                        start.elapsed()
                    });
                    let _ = reply.send(r);
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
                }
            }
        }
    }

    /// Copies whole K and V rows into the mirror of `layer` from position `from`.
    fn write_kv(&self, layer: usize, from: usize, k: &[f16], v: &[f16]) -> Result<Cost> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let kv = mem
            .kv
            .as_mut()
            .ok_or_else(|| EngineError::Device("no KV mirror reserved".into()))?;
        let row = kv.kv_row;
        if k.len() != v.len() || k.len() % row != 0 {
            return Err(EngineError::Device(format!(
                "KV rows of {} and {} values for rows of {row}",
                k.len(),
                v.len()
            )));
        }
        let rows = k.len() / row;
        if layer >= kv.k.len() || from + rows > kv.positions {
            return Err(EngineError::Device(format!(
                "KV rows {from}..{} of layer {layer} outside the mirror ({} layers, {} positions)",
                from + rows,
                kv.k.len(),
                kv.positions
            )));
        }
        kv.k[layer][from * row..][..k.len()].copy_from_slice(k);
        kv.v[layer][from * row..][..v.len()].copy_from_slice(v);
        Ok(Cost {
            launches: 0,
            read: 0,
            copied: 2 * bytes_of::<f16>(k.len()),
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
        let kv = mem
            .kv
            .as_ref()
            .ok_or_else(|| EngineError::Device("no KV mirror reserved".into()))?;
        let row = kv.kv_row;
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
            },
        ))
    }

    /// Waits until the speed model's time for `cost` has passed since `start` (counting an
    /// overrun when the work itself took longer); returns the copies' share of the time.
    fn pace(&self, start: Instant, cost: &Cost) -> Duration {
        let Some(s) = self.speed else {
            return Duration::ZERO;
        };
        let secs = |bytes: u64, bps: f64| {
            if bps > 0.0 {
                Duration::from_secs_f64(bytes as f64 / bps)
            } else {
                Duration::ZERO
            }
        };
        let transfer = secs(cost.copied, s.link_bandwidth);
        let modeled = s.launch * cost.launches + secs(cost.read, s.bandwidth) + transfer;
        let deadline = start + modeled;
        let now = Instant::now();
        if now > deadline {
            self.overruns.fetch_add(1, Ordering::Relaxed);
            return transfer;
        }
        // Sleep most of the wait, then yield to the deadline (sleep alone overshoots).
        let left = deadline - now;
        if left > Duration::from_micros(300) {
            std::thread::sleep(left - Duration::from_micros(150));
        }
        while Instant::now() < deadline {
            std::thread::yield_now();
        }
        transfer
    }

    fn alloc_work(&self, work: &mut Work, s: &WorkShape) -> Result<()> {
        work._held = None;
        let held = self
            .budget
            .try_reserve(work_bytes(s))
            .map_err(budget_error)?;
        let t = s.t_max.max(1);
        *work = Work {
            t_max: t,
            x: vec![0.0; t * s.max_cols.max(s.n_embd)],
            out: vec![0.0; out_len(s)],
            y: vec![0.0; t * s.n_embd],
            scores: vec![0.0; t * s.n_ff],
            g: vec![0.0; s.n_ff],
            u: vec![0.0; s.n_ff],
            hidden: vec![0.0; t * s.rank],
            list: Vec::with_capacity(s.n_ff),
            fired: Vec::with_capacity(s.n_ff),
            _held: Some(held),
        };
        Ok(())
    }

    /// Copies `src` into the work buffer `dst` (inputs beyond the reserved work size are
    /// refused, as a real device's buffers would be).
    fn copy_to<'w>(dst: &'w mut [f32], src: &[f32], what: &str) -> Result<&'w mut [f32]> {
        if src.len() > dst.len() {
            return Err(EngineError::Device(format!(
                "{what}: {} values do not fit the device's work buffer of {}",
                src.len(),
                dst.len()
            )));
        }
        let d = &mut dst[..src.len()];
        d.copy_from_slice(src);
        Ok(d)
    }

    /// The token ranges of `t` tokens in chunks of at most `per` tokens (what the work
    /// buffers hold).
    fn chunks(per: usize, t: usize) -> Result<Vec<std::ops::Range<usize>>> {
        if per == 0 {
            return Err(EngineError::Device(
                "the device's work buffers cannot hold one token".into(),
            ));
        }
        Ok((0..t).step_by(per).map(|a| a..(a + per).min(t)).collect())
    }

    fn mat(mem: &Memory, id: MatId) -> Result<&DevMat> {
        mem.mats
            .get(id.0)
            .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", id.0)))
    }

    fn product(
        &self,
        mm: &MatMul<'_>,
        work: &mut Work,
        m: MatId,
        x: &[f32],
        t: usize,
    ) -> Result<(Vec<f32>, Cost)> {
        let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
        let dm = Stream::mat(&mem, m)?;
        let w = dm.view()?;
        let (rows, cols) = (w.rows(), w.cols());
        if x.len() != t * cols {
            return Err(EngineError::Device(format!(
                "product input of {} values for {t} tokens of {cols}",
                x.len()
            )));
        }
        let mut y = vec![0f32; t * rows];
        let mut cost = Cost::default();
        let per = work.t_max.min(work.out.len() / rows.max(1));
        for c in Stream::chunks(per, t)? {
            let n = c.len();
            let xs = Stream::copy_to(&mut work.x, &x[c.start * cols..c.end * cols], "input")?;
            let out = &mut work.out[..n * rows];
            mm.gemm(&w, xs, n, out)?;
            y[c.start * rows..c.end * rows].copy_from_slice(out);
            cost.launches += 1;
            cost.read += dm.bytes.len() as u64;
            cost.copied += bytes_of::<f32>(n * (cols + rows));
        }
        Ok((y, cost))
    }

    fn scores(
        &self,
        mm: &MatMul<'_>,
        work: &mut Work,
        fc1: MatId,
        fc2: MatId,
        h: &[f32],
        t: usize,
    ) -> Result<(Vec<f32>, Cost)> {
        let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
        let (a, b) = (Stream::mat(&mem, fc1)?, Stream::mat(&mem, fc2)?);
        let p = Predictor::new(a.view()?, b.view()?)?;
        let (ne, nff) = (p.n_embd(), p.n_ff());
        if h.len() != t * ne {
            return Err(EngineError::Device(format!(
                "predictor input of {} values for {t} tokens of {ne}",
                h.len()
            )));
        }
        let mut scores = vec![0f32; t * nff];
        let mut cost = Cost::default();
        let per = work.t_max.min(work.scores.len() / nff.max(1));
        for c in Stream::chunks(per, t)? {
            let n = c.len();
            let hs = Stream::copy_to(&mut work.x, &h[c.start * ne..c.end * ne], "input")?;
            let out = &mut work.scores[..n * nff];
            p.scores_with(mm, hs, n, &mut work.hidden, out)?;
            scores[c.start * nff..c.end * nff].copy_from_slice(out);
            cost.launches += 3;
            cost.read += (a.bytes.len() + b.bytes.len()) as u64;
            cost.copied += bytes_of::<f32>(n * (ne + nff));
        }
        Ok((scores, cost))
    }

    /// Copies staged rows into slots of a hot slice (the bucket stays unique: a neuron the
    /// slice holds in another slot is refused).
    fn replace(&self, hot: HotId, slots: &[u32], rows: NewRows) -> Result<Cost> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let h = mem
            .hots
            .get_mut(hot.0)
            .and_then(Option::as_mut)
            .ok_or_else(|| EngineError::Device(format!("unknown hot slice {}", hot.0)))?;
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
        h.bucket = bucket;
        Ok(Cost {
            launches: 1,
            read: 0,
            copied: copied + bytes_of::<u32>(slots.len()),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn hot(
        &self,
        mm: &MatMul<'_>,
        work: &mut Work,
        hot: HotId,
        x: &[f32],
        scores: &[f32],
        t: usize,
        threshold: f32,
    ) -> Result<(Vec<f32>, u64, Cost)> {
        let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
        let h = mem
            .hots
            .get(hot.0)
            .and_then(Option::as_ref)
            .ok_or_else(|| EngineError::Device(format!("unknown hot slice {}", hot.0)))?;
        let (up, down) = (h.up.view()?, h.down.view()?);
        let gate = h.gate.as_ref().map(DevMat::view).transpose()?;
        let ne = down.cols();
        let k = h.bucket.len();
        let nff = scores.len().checked_div(t).unwrap_or(0);
        if x.len() != t * ne || scores.len() != t * nff {
            return Err(EngineError::Device(format!(
                "hot job: {} inputs and {} scores for {t} tokens of width {ne}",
                x.len(),
                scores.len()
            )));
        }
        if work.g.len() < k || h.bucket.iter().any(|&j| j as usize >= nff) {
            return Err(EngineError::Device(
                "the hot slice does not fit the device's work buffers or the scores".into(),
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
        let mut y_all = vec![0f32; t * ne];
        let mut active = 0u64;
        let mut cost = Cost::default();
        let per = work.t_max.min(work.scores.len() / nff.max(1));
        for c in Stream::chunks(per, t)? {
            let n = c.len();
            Stream::copy_to(&mut work.x, &x[c.start * ne..c.end * ne], "FFN input")?;
            Stream::copy_to(
                &mut work.scores,
                &scores[c.start * nff..c.end * nff],
                "scores",
            )?;
            for i in 0..n {
                let sc = &work.scores[i * nff..][..nff];
                work.list.clear();
                work.list.extend(
                    (0..k as u32).filter(|&j| sc[h.bucket[j as usize] as usize] >= threshold),
                );
                let y = &mut work.y[i * ne..][..ne];
                y.fill(0.0);
                let mut bufs = TokenBufs {
                    g: &mut work.g[..k],
                    u: &mut work.u[..k],
                    fired: &mut work.fired,
                };
                let xi = &work.x[i * ne..][..ne];
                let n_up = token_ffn(mm, &rows, xi, &work.list, &mut bufs, y)?;
                let a = work.list.len() as u64;
                active += a;
                cost.read += a * (gate_row + down_row) + n_up as u64 * up_row;
            }
            y_all[c.start * ne..c.end * ne].copy_from_slice(&work.y[..n * ne]);
            cost.launches += 4;
            cost.copied += bytes_of::<f32>(n * (2 * ne + nff));
        }
        Ok((y_all, active, cost))
    }
}
