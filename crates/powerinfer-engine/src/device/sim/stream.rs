//! The simulated device's stream: one worker thread that executes commands in order and
//! paces them by the speed model.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use half::f16;
use powerinfer_kernels_cpu::ops::attention::{AttentionParams, AttentionPart};
use powerinfer_kernels_cpu::{MatMul, ThreadPool};

use super::memory::{bytes_of, hot_mut, put_rows, span, span_mut, take_rows, Memory, NewRows};
use crate::device::report::TrafficCounters;
use crate::device::{unknown_kv, HotId, KvId, Op, SimSpeed, Span};
use crate::error::{EngineError, Result};

/// A command of the device's stream. Inputs are the host's copies in flight.
pub(super) enum Cmd {
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

/// How long the worker polls for the next command before it sleeps: a layer's commands come
/// in bursts, and waking a sleeping thread costs tens of microseconds on a busy machine.
pub(super) const COMMAND_SPIN: Duration = Duration::from_micros(300);

/// How long a caller polls for its answer before it sleeps (its core has nothing else to do).
pub(super) const REPLY_SPIN: Duration = Duration::from_millis(2);

/// The next message of `rx`: polled for `spin`, then waited for.
pub(super) fn wait<T>(rx: &Receiver<T>, spin: Duration) -> std::result::Result<T, RecvError> {
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
pub(super) fn spin_until(deadline: Instant) {
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
pub(super) struct Stream {
    pub(super) memory: Arc<RwLock<Memory>>,
    pub(super) speed: Option<SimSpeed>,
    pub(super) overruns: Arc<AtomicU64>,
    pub(super) traffic: Arc<TrafficCounters>,
    pub(super) marks: Arc<Mutex<Vec<Option<Instant>>>>,
    pub(super) failed: Arc<Mutex<Option<EngineError>>>,
    pub(super) threads: usize,
}

/// What a command cost in the speed model's terms.
#[derive(Default)]
pub(super) struct Cost {
    pub(super) launches: u64,
    pub(super) read: u64,
    /// Bytes over the link, and copies (each paying the link's latency).
    pub(super) copied: u64,
    pub(super) copies: u32,
}

impl Cost {
    /// One copy of `bytes` over the host link.
    pub(super) fn copy(bytes: u64) -> Cost {
        Cost {
            copied: bytes,
            copies: 1,
            ..Cost::default()
        }
    }
}

/// The worker's state between commands: the step's parameters and scratch.
pub(super) struct StepState {
    pub(super) ids: Vec<u32>,
    pub(super) positions: Vec<usize>,
    pub(super) list: Vec<u32>,
    pub(super) fired: Vec<u32>,
    pub(super) u: Vec<f32>,
}

impl Stream {
    pub(super) fn run(self, rx: Receiver<Cmd>) {
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
            Cmd::Ops { ops, graphed } => self.program(mm, st, &ops, &graphed, start),
            Cmd::Step { ids, positions } => {
                let n = (ids.len() + positions.len()) as u64;
                st.ids = ids;
                st.positions = positions;
                Ok(Cost::copy(4 * n))
            }
            Cmd::Write { dst, data } => {
                let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
                span_mut(&mut mem.bufs, dst)?.copy_from_slice(&data);
                Ok(Cost::copy(bytes_of::<f32>(data.len())))
            }
            Cmd::Read { src, reply } => {
                let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
                let got = span(&mem.bufs, src).map(<[f32]>::to_vec);
                drop(mem);
                self.pace(start, &Cost::copy(bytes_of::<f32>(src.len)));
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
                Ok(Cost::copy(2 * bytes_of::<f16>(k.len())))
            }
            Cmd::KvRead {
                kv,
                layer,
                start: from,
                n,
                reply,
            } => {
                let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
                let got = (mem.kvs.get(kv.0))
                    .ok_or_else(|| unknown_kv(kv))
                    .and_then(|s| take_rows(s, layer, from, n));
                drop(mem);
                let bytes = (got.as_ref()).map_or(0, |(k, _)| 2 * bytes_of::<f16>(k.len()));
                self.pace(start, &Cost::copy(bytes));
                let _ = reply.send(got);
                Ok(Cost::default())
            }
            Cmd::KvCopy { from, to, n } => self.kv_copy(from, to, n),
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
            Cmd::Enabled { hot, enabled } => self.set_enabled(hot, enabled),
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
                    self.pace(start, &Cost::copy(2 * bytes_of::<f16>(k.len())));
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

    /// A program's ops in order; a run between marks that replays as a graph is one launch.
    fn program(
        &self,
        mm: &MatMul<'_>,
        st: &mut StepState,
        ops: &[Op],
        graphed: &[bool],
        start: Instant,
    ) -> Result<Cost> {
        let mut cost = Cost::default();
        let (mut run, mut in_run) = (0, false);
        for op in ops {
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

    /// Copies the first `n` positions of every layer of store `from` into store `to`.
    fn kv_copy(&self, from: KvId, to: KvId, n: usize) -> Result<Cost> {
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

    /// Which slots of a hot slice the device computes from the next program on.
    fn set_enabled(&self, hot: HotId, enabled: Option<Vec<bool>>) -> Result<Cost> {
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
        Ok(Cost::copy(bytes))
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
