//! The simulated device's stream: one worker thread that executes commands in order and
//! paces them by the speed model.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvError, Sender, TryRecvError};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use powerinfer_kernels_cpu::ops::attention::{AttentionParams, AttentionPart};
use powerinfer_kernels_cpu::{MatMul, ThreadPool};

use super::clock::{Cost, DeviceClock, Gate};
use super::memory::{bytes_of, hot_mut, put_rows, span, span_mut, take_rows, Memory, NewRows};
use crate::device::report::TrafficCounters;
use crate::device::{unknown_kv, HotId, KvId, KvRows, Op, SimSpeed, Span};
use crate::error::{EngineError, Result};

/// What a command answers the host: its result and when it ended on the device's timeline.
pub(super) type Answer<T> = (Result<T>, Duration);

/// A command and the host's time when it issued it.
pub(super) struct Job {
    pub(super) at: Duration,
    pub(super) cmd: Cmd,
}

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
        reply: Sender<Answer<Vec<f32>>>,
    },
    KvWrite {
        kv: KvId,
        layer: usize,
        start: usize,
        k: Vec<u8>,
        v: Vec<u8>,
    },
    KvRead {
        kv: KvId,
        layer: usize,
        start: usize,
        n: usize,
        reply: Sender<Answer<KvRows>>,
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
        /// The copies' time on the timeline.
        reply: Sender<Answer<Duration>>,
    },
    Enabled {
        hot: HotId,
        enabled: Option<Vec<bool>>,
    },
    MirrorWrite {
        layer: usize,
        start: usize,
        k: Vec<u8>,
        v: Vec<u8>,
        /// The copy's time on the timeline.
        reply: Sender<Answer<Duration>>,
    },
    Attend {
        layer: usize,
        q: Vec<f32>,
        n: usize,
        params: AttentionParams,
        /// The part and the device's time on the timeline.
        reply: Sender<Answer<(AttentionPart, Duration)>>,
    },
}

/// An answer a command owes the host, sent once the command's end on the timeline is known.
enum Reply {
    Values(Sender<Answer<Vec<f32>>>, Result<Vec<f32>>),
    Kv(Sender<Answer<KvRows>>, Result<KvRows>),
    /// The command's own time.
    Took(Sender<Answer<Duration>>, Result<()>),
    Part(
        Sender<Answer<(AttentionPart, Duration)>>,
        Result<AttentionPart>,
    ),
}

impl Reply {
    /// Sends the answer of a command that ran from `start` to `end` on the timeline.
    fn send(self, start: Duration, end: Duration) {
        let took = end.saturating_sub(start);
        // A host that stopped waiting is gone: nothing to tell.
        match self {
            Reply::Values(tx, r) => drop(tx.send((r, end))),
            Reply::Kv(tx, r) => drop(tx.send((r, end))),
            Reply::Took(tx, r) => drop(tx.send((r.map(|()| took), end))),
            Reply::Part(tx, r) => drop(tx.send((r.map(|p| (p, took)), end))),
        }
    }
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
    /// The card's time is also made to pass on the wall clock ([`SimOptions::paced`]).
    ///
    /// [`SimOptions::paced`]: crate::device::SimOptions::paced
    pub(super) paced: bool,
    pub(super) origin: Instant,
    pub(super) overruns: Arc<AtomicU64>,
    pub(super) traffic: Arc<TrafficCounters>,
    /// Lets the worker run only while a host waits (a card's clock, not paced).
    pub(super) gate: Option<Arc<Gate>>,
    /// Timing marks, on the device's timeline.
    pub(super) marks: Arc<Mutex<Vec<Option<Duration>>>>,
    pub(super) failed: Arc<Mutex<Option<EngineError>>>,
    pub(super) threads: usize,
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
    pub(super) fn run(self, rx: Receiver<Job>) {
        let pool = ThreadPool::new(self.threads);
        let mm = MatMul::new(&pool);
        let mut st = StepState {
            ids: Vec::new(),
            positions: Vec::new(),
            list: Vec::new(),
            fired: Vec::new(),
            u: Vec::new(),
        };
        let mut clock = DeviceClock::new(self.origin, self.speed);
        while let Ok(job) = wait(&rx, COMMAND_SPIN) {
            if let Some(g) = &self.gate {
                g.pass();
            }
            let wall = Instant::now();
            let start = clock.start(job.at);
            match self.execute(&mm, &mut st, job.cmd, (&clock, start, wall)) {
                Ok((cost, reply)) => {
                    let end = clock.end(start, &cost);
                    self.pace(wall, &cost);
                    if let Some(r) = reply {
                        r.send(start, end);
                    }
                }
                Err(e) => {
                    let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
                    f.get_or_insert(e);
                }
            }
        }
    }

    /// Runs one command (`at`: the device's clock, when it started on it and on the wall
    /// clock); what it cost, and the answer it owes the host.
    fn execute(
        &self,
        mm: &MatMul<'_>,
        st: &mut StepState,
        cmd: Cmd,
        at: (&DeviceClock, Duration, Instant),
    ) -> Result<(Cost, Option<Reply>)> {
        let done = |cost: Cost| Ok((cost, None));
        match cmd {
            Cmd::Ops { ops, graphed } => done(self.program(mm, st, &ops, &graphed, at)?),
            Cmd::Step { ids, positions } => {
                let n = (ids.len() + positions.len()) as u64;
                st.ids = ids;
                st.positions = positions;
                done(Cost::copy(4 * n))
            }
            Cmd::Write { dst, data } => {
                let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
                span_mut(&mut mem.bufs, dst)?.copy_from_slice(&data);
                done(Cost::copy(bytes_of::<f32>(data.len())))
            }
            Cmd::Read { src, reply } => {
                let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
                let got = span(&mem.bufs, src).map(<[f32]>::to_vec);
                let cost = Cost::copy(bytes_of::<f32>(src.len));
                Ok((cost, Some(Reply::Values(reply, got))))
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
                done(Cost::copy((k.len() + v.len()) as u64))
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
                let bytes = (got.as_ref()).map_or(0, |(k, v)| (k.len() + v.len()) as u64);
                Ok((Cost::copy(bytes), Some(Reply::Kv(reply, got))))
            }
            Cmd::KvCopy { from, to, n } => done(self.kv_copy(from, to, n)?),
            Cmd::Replace {
                hot,
                slots,
                rows,
                reply,
            } => Ok(match self.replace(hot, &slots, rows) {
                Ok(cost) => (cost, Some(Reply::Took(reply, Ok(())))),
                Err(e) => (Cost::default(), Some(Reply::Took(reply, Err(e)))),
            }),
            Cmd::Enabled { hot, enabled } => done(self.set_enabled(hot, enabled)?),
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
                let cost = match r {
                    Ok(()) => Cost::copy((k.len() + v.len()) as u64),
                    Err(_) => Cost::default(),
                };
                Ok((cost, Some(Reply::Took(reply, r))))
            }
            Cmd::Attend {
                layer,
                q,
                n,
                params,
                reply,
            } => Ok(match self.attend(layer, &q, n, &params) {
                Ok((part, cost)) => (cost, Some(Reply::Part(reply, Ok(part)))),
                Err(e) => (Cost::default(), Some(Reply::Part(reply, Err(e)))),
            }),
        }
    }

    /// A program's ops in order; a run between marks that replays as a graph is one launch.
    /// A mark records the device's clock where the stream reaches it.
    fn program(
        &self,
        mm: &MatMul<'_>,
        st: &mut StepState,
        ops: &[Op],
        graphed: &[bool],
        (clock, start, wall): (&DeviceClock, Duration, Instant),
    ) -> Result<Cost> {
        let mut cost = Cost::default();
        let (mut run, mut in_run) = (0, false);
        for op in ops {
            if let Op::Mark { slot } = op {
                self.pace(wall, &cost);
                let at = clock.after(start, &cost);
                let mut marks = self.marks.lock().unwrap_or_else(|e| e.into_inner());
                if marks.len() <= *slot {
                    marks.resize(slot + 1, None);
                }
                marks[*slot] = Some(at);
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
            read += (k.len() + v.len()) as u64;
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

    /// With [`Stream::paced`], waits until the card's time for `cost` has passed since `wall`
    /// on the wall clock (counting an overrun when the work itself took longer).
    fn pace(&self, wall: Instant, cost: &Cost) {
        let (true, Some(s)) = (self.paced, self.speed) else {
            return;
        };
        let deadline = wall + cost.on(&s);
        if Instant::now() > deadline && cost.read > 0 {
            self.overruns.fetch_add(1, Ordering::Relaxed);
            return;
        }
        spin_until(deadline);
    }
}
