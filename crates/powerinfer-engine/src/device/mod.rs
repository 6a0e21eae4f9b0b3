//! Compute devices beside the CPU: where the hot part of each layer runs.
//!
//! A device (the crate-private `Device` trait) holds weights, work buffers and KV stores in its
//! own memory, under a byte budget that refuses an allocation before anything is allocated, and
//! runs **programs**: `Op`s on its own buffers, queued in order on one stream and returning
//! at once. Nothing comes back to the host but what the engine reads on purpose
//! (`Device::read`, then `Device::wait`, the only host wait); inputs go in by
//! `Device::write`. So a layer whose attention and dense matrices the device holds keeps its
//! hidden state there from the attention norm to the FFN's residual add, and a token costs the
//! link only what the CPU's share of the FFN needs.
//!
//! Every device counts what a GPU would charge (`Device::traffic`): kernel launches, host
//! waits and bytes over the link. Implementations: `sim::SimDevice`, a simulated GPU (own memory
//! arena, own worker thread and kernel pool, an optional speed model [`SimSpeed`] that charges
//! launches, host waits and link transfers) that runs on every machine, and `cuda::CudaDevice`
//! on an NVIDIA GPU through `powerinfer-kernels-cuda`. What goes where is decided at load by the
//! scheduling policy ([`crate::schedule`]), which reads what a device can do from
//! `Device::supports` and `Device::attention` and never the reverse: this module knows nothing
//! of placement or balancing. [`DeviceChoice`] and [`SimOptions`] choose; [`DeviceReport`]
//! tells.

pub(crate) mod cuda;
pub(crate) mod sim;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use half::f16;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ffn::FfnAct;
use powerinfer_kernels_cpu::ops::attention::{AttentionParams, AttentionPart};
use powerinfer_kernels_cpu::ops::rope::RopeParams;
use powerinfer_kernels_cpu::Weights;

use crate::error::{EngineError, Result};
use crate::profile::ratio;

/// Which device runs the hot part of each layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceChoice {
    /// Everything on the CPU.
    #[default]
    None,
    /// CUDA device 0 when one is usable, else the CPU (the reason is in the load report).
    Auto,
    /// CUDA device `N`; loading fails when it is not usable.
    Cuda(usize),
    /// The simulated GPU ([`SimOptions`]).
    Sim,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    /// `auto`, `none`, `sim`, `cuda` or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<DeviceChoice, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "none" | "cpu" => Ok(DeviceChoice::None),
            "sim" => Ok(DeviceChoice::Sim),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("`{s}`: expected auto, cuda, cuda:N, sim or none")),
        }
    }
}

/// A speed to play for the simulated device: each piece of work takes at least the time
/// these figures give it (the work itself runs for real on the device's threads; when that
/// takes longer, the device is slower than asked and [`DeviceReport::overruns`] counts it).
/// It charges what a GPU charges: every kernel launch, every copy over the host link (a
/// latency and the bytes at the link's bandwidth, on the device's stream), and every time the
/// host waits for the device.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimSpeed {
    /// Bytes per second the device reads its memory at.
    pub bandwidth: f64,
    /// Time of one kernel launch.
    pub launch: Duration,
    /// Bytes per second of a copy between host and device.
    pub link_bandwidth: f64,
    /// Time of one copy between host and device before its bytes move.
    pub link_latency: Duration,
    /// Time the host loses each time it waits for the device (the wake-up after a
    /// synchronization).
    pub host_wait: Duration,
}

impl SimSpeed {
    /// A device reading `bandwidth` bytes/s, with `launch` per kernel and a host link of
    /// `link_bandwidth` bytes/s (the link latency and the host's wait as [`SimSpeed::h200`]).
    pub fn new(bandwidth: f64, launch: Duration, link_bandwidth: f64) -> SimSpeed {
        SimSpeed {
            bandwidth,
            launch,
            link_bandwidth,
            ..SimSpeed::h200()
        }
    }

    /// The figures of one H200 as the project measured it (`docs/tuning.md`, "The simulated
    /// GPU's speed model"): 4.3 TB/s of memory, 5 µs per launch, a host link of 25 GB/s with
    /// 10 µs per copy, 10 µs per host wait.
    pub fn h200() -> SimSpeed {
        SimSpeed {
            bandwidth: 4.3e12,
            launch: Duration::from_micros(5),
            link_bandwidth: 25e9,
            link_latency: Duration::from_micros(10),
            host_wait: Duration::from_micros(10),
        }
    }

    /// This speed with `link_latency` per copy and `host_wait` per wait of the host.
    pub fn with_latencies(mut self, link_latency: Duration, host_wait: Duration) -> SimSpeed {
        self.link_latency = link_latency;
        self.host_wait = host_wait;
        self
    }
}

/// Options of the simulated device.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimOptions {
    /// Its worker threads (its own, not the CPU side's pool).
    pub threads: usize,
    /// The speed it plays; `None`: as fast as its threads compute.
    pub speed: Option<SimSpeed>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            threads: 1,
            speed: None,
        }
    }
}

/// What the device holds and did: [`Engine::device_report`](crate::Engine::device_report).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct DeviceReport {
    /// `none`, `sim` or `cuda:N (name)`.
    pub kind: String,
    /// Why no device runs anything, when none does although one was asked for (`--gpu auto`
    /// without a usable GPU, a budget of 0, ...).
    pub note: Option<String>,
    /// The device memory budget.
    pub budget_bytes: u64,
    /// The most device memory held at once.
    pub peak_bytes: u64,
    /// Bytes of the device's work buffers (the activations of a device step).
    pub work_bytes: u64,
    /// Bytes of the sequences' KV stores of the layers the device runs.
    pub kv_bytes: u64,
    /// Layers the device runs whole (attention, and the FFN where it holds it), of
    /// `layers_total`.
    pub layers: usize,
    /// Layers of the model.
    pub layers_total: usize,
    /// Dense matrices held on the device, and bytes.
    pub dense_matrices: usize,
    /// Their bytes.
    pub dense_bytes: u64,
    /// Dense matrices of the model that could have been placed there.
    pub dense_total: usize,
    /// FFN neuron rows held on the device, over all layers.
    pub ffn_rows: usize,
    /// FFN neurons of the model.
    pub ffn_total: usize,
    /// Where the neuron placement came from (`reused <file>`, `built <file>: reason`, ...).
    pub placement: String,
    /// Active FFN neurons computed on the device so far (all evaluations).
    pub active_device: u64,
    /// Active FFN neurons computed on the CPU so far.
    pub active_cpu: u64,
    /// Pieces of work the simulated device finished later than its speed model asked.
    pub overruns: u64,
    /// Tokens evaluated with the device (all evaluations), the denominator of the per-token
    /// figures below.
    pub tokens: u64,
    /// Kernels launched on the device so far.
    pub launches: u64,
    /// Times the host waited for the device so far.
    pub host_waits: u64,
    /// Bytes copied between host and device so far after loading (inputs, outputs, KV
    /// copies, parameters of the steps).
    pub link_bytes: u64,
}

impl DeviceReport {
    /// Share of the FFN rows held on the device.
    pub fn resident_share(&self) -> f64 {
        ratio(self.ffn_rows as u64, self.ffn_total as u64)
    }

    /// Share of the active FFN neurons computed on the device.
    pub fn active_share(&self) -> f64 {
        ratio(self.active_device, self.active_device + self.active_cpu)
    }

    /// Kernel launches per token evaluated.
    pub fn launches_per_token(&self) -> f64 {
        per_token(self.launches, self.tokens)
    }

    /// Host waits (synchronizations) per token evaluated.
    pub fn syncs_per_token(&self) -> f64 {
        per_token(self.host_waits, self.tokens)
    }

    /// Bytes over the host link per token evaluated.
    pub fn link_bytes_per_token(&self) -> f64 {
        per_token(self.link_bytes, self.tokens)
    }
}

fn per_token(n: u64, tokens: u64) -> f64 {
    if tokens == 0 {
        0.0
    } else {
        n as f64 / tokens as f64
    }
}

/// What a device's program reads and writes: f32 values `off .. off + len` of buffer `buf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    /// The buffer.
    pub(crate) buf: BufId,
    /// First value.
    pub(crate) off: usize,
    /// Values.
    pub(crate) len: usize,
}

impl Span {
    /// Whether `n` host values fit this span exactly (a write of `n` values into it).
    pub(crate) fn check_write(self, n: usize) -> Result<()> {
        if n == self.len {
            Ok(())
        } else {
            Err(EngineError::Device(format!(
                "a write of {n} values into a span of {}",
                self.len
            )))
        }
    }

    /// Values `off .. off + len` of this span (`off + len` must not exceed its length; the
    /// device checks every span against its buffer).
    pub(crate) fn part(self, off: usize, len: usize) -> Span {
        Span {
            buf: self.buf,
            off: self.off + off,
            len,
        }
    }
}

/// The widths of a device step, for the scratch a device's kernels need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScratchShape {
    /// Most tokens of a step.
    pub(crate) t: usize,
    /// Widest input of a product.
    pub(crate) cols: usize,
    /// Query heads.
    pub(crate) n_head: usize,
    /// Most positions attended.
    pub(crate) ctx: usize,
    /// FFN neurons.
    pub(crate) n_ff: usize,
}

/// A weight matrix held by a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MatId(pub(crate) usize);

/// A layer's hot FFN slice held by a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct HotId(pub(crate) usize);

/// An f32 buffer in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BufId(pub(crate) usize);

impl BufId {
    /// Values `off .. off + len` of the buffer.
    pub(crate) fn span(self, off: usize, len: usize) -> Span {
        Span {
            buf: self,
            off,
            len,
        }
    }
}

/// The shape of one sequence's KV store: `layers` layers of `positions` K and V rows of
/// `n_kv_head` heads of `head_dim` F16 values each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KvShape {
    pub(crate) layers: usize,
    pub(crate) positions: usize,
    pub(crate) n_kv_head: usize,
    pub(crate) head_dim: usize,
}

/// Bytes a hot slice of `k` of a layer's `n_ff` neurons holds beside its rows: each matrix's
/// copy of the neuron indices (`gated`: three matrices, else two), the enabled mask over every
/// neuron, and the up bias of every neuron where the FFN has one. What the CUDA device
/// allocates, the simulated one charges, and placement sets aside (at `k = n_ff`) before the
/// solver spends the rest on rows.
pub(crate) fn hot_slice_overhead(n_ff: usize, k: usize, gated: bool, up_bias: bool) -> u64 {
    let indices = (2 + usize::from(gated)) * k;
    let per_neuron = n_ff * (1 + usize::from(up_bias));
    4 * (indices + per_neuron) as u64
}

/// Entry `id` of a device's table of `what`s; an unknown or freed id is an error.
pub(crate) fn entry<'a, T>(table: &'a [Option<T>], id: usize, what: &str) -> Result<&'a T> {
    (table.get(id).and_then(Option::as_ref))
        .ok_or_else(|| EngineError::Device(format!("unknown {what} {id}")))
}

/// Entry `id` of a device's table of `what`s, to change.
pub(crate) fn entry_mut<'a, T>(
    table: &'a mut [Option<T>],
    id: usize,
    what: &str,
) -> Result<&'a mut T> {
    (table.get_mut(id).and_then(Option::as_mut))
        .ok_or_else(|| EngineError::Device(format!("unknown {what} {id}")))
}

/// Frees entry `id` of a device's table of `what`s (its memory goes back to the budget when the
/// entry drops); an unknown or freed id is an error.
pub(crate) fn free_entry<T>(table: &mut [Option<T>], id: usize, what: &str) -> Result<()> {
    match table.get_mut(id) {
        Some(e @ Some(_)) => {
            *e = None;
            Ok(())
        }
        _ => Err(EngineError::Device(format!("unknown {what} {id}"))),
    }
}

/// One sequence's keys and values in device memory, for some layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct KvId(pub(crate) usize);

/// K and V rows of a KV store read back to the host.
pub(crate) type KvRows = (Vec<f16>, Vec<f16>);

/// The error of a KV store id a device does not know.
pub(crate) fn unknown_kv(kv: KvId) -> EngineError {
    EngineError::Device(format!("unknown KV store {}", kv.0))
}

/// A copy to the host in flight ([`Device::read`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ReadId(pub(crate) u64);

/// Which rows of a table [`Op::GetRows`] takes, from the step's parameters
/// ([`Device::set_step`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowsOf {
    /// The tokens' ids.
    Ids,
    /// The tokens' positions plus an offset (OPT's learned position embeddings).
    Positions(usize),
}

/// One operation of a device program. Each runs after the ones queued before it, on the
/// device's buffers; none returns anything to the host. Token ranges (`from`, `n`) index the
/// tokens of the step's parameters ([`Device::set_step`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Op {
    /// `y = W x` for `t` tokens (`x`: `t × cols`, `y`: `t × rows`).
    MatMul {
        m: MatId,
        x: Span,
        y: Span,
        t: usize,
    },
    /// Rows of a held matrix as f32 (`y`: `n × cols`), one per token `from .. from + n`.
    GetRows {
        m: MatId,
        rows: RowsOf,
        from: usize,
        n: usize,
        y: Span,
    },
    /// RMSNorm (no bias) or LayerNorm (with bias) of the rows of `x` into `y`; `w` (and `b`)
    /// of the rows' width. With `add`, first `x += add` (the residual add before a norm, in the
    /// same launch), written back to `x`.
    Norm {
        x: Span,
        add: Option<Span>,
        w: BufId,
        b: Option<BufId>,
        eps: f32,
        y: Span,
    },
    /// Adds `b` to every row of `y` (a bias; rows of `b`'s width).
    AddRows { y: Span, b: BufId },
    /// `y += x`.
    Add { y: Span, x: Span },
    /// `y = x`.
    Copy { x: Span, y: Span },
    /// `y = 0`.
    Zero { y: Span },
    /// RoPE in place ([`RopeOp`]).
    Rope(RopeOp),
    /// K and V rows stored in a KV store, then causal attention over it ([`AttentionOp`]).
    Attention(AttentionOp),
    /// Predictor scores ([`PredictorOp`]).
    Predictor(PredictorOp),
    /// The hot part of a sparse FFN ([`HotFfnOp`]).
    HotFfn(HotFfnOp),
    /// `gate = act(gate, up)` element-wise (a dense FFN's activation; `Relu` reads no `up`).
    Activate { act: FfnAct, gate: Span, up: Span },
    /// Records the time the stream reaches this point in mark `slot` ([`Device::elapsed`]).
    Mark { slot: usize },
}

/// The programs a device with graphs captures once and replays with one launch each: the
/// runs of `ops` between marks (a mark records a timed event on the stream itself).
pub(crate) fn graph_segments(ops: &[Op]) -> impl Iterator<Item = &[Op]> {
    (ops.split(|op| matches!(op, Op::Mark { .. }))).filter(|s| !s.is_empty())
}

/// A program as a device with graphs knows it: its ops, and per hot FFN in them whether its
/// enabled mask applies (that adds kernels). Buffers never move after load, so the ops' ids
/// stand for the memory a graph points at.
pub(crate) type GraphKey = (Vec<Op>, Vec<bool>);

/// Per hot FFN of `ops`, whether its enabled mask applies (`masked`).
pub(crate) fn masked_flags(ops: &[Op], masked: impl Fn(HotId) -> bool) -> Vec<bool> {
    (ops.iter())
        .filter_map(|op| match op {
            Op::HotFfn(f) => Some(masked(f.hot)),
            _ => None,
        })
        .collect()
}

/// Captured programs kept (least recently used dropped first): a server's batches make new
/// programs for a while, and each lookup compares ops.
const MAX_GRAPHS: usize = 64;
/// Programs seen once and not captured, remembered.
const MAX_SIGHTED: usize = 64;

/// What a device with graphs does with a program ([`GraphCache::sight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sighting {
    /// The first time: run as it is (a prompt's last chunk, a batch layout seen once).
    First,
    /// The second time: capture it, then launch the graph.
    Capture,
    /// Captured before: launch the graph ([`GraphCache::last`]).
    Replay,
}

/// Which programs a device with graphs captures and replays: a program is captured the second
/// time it is seen, and the [`MAX_GRAPHS`] most recently used are kept. Both devices use it,
/// so that the simulated one counts the launches the CUDA one makes (`G`: the captured graph,
/// `()` on sim).
pub(crate) struct GraphCache<G> {
    sighted: Vec<GraphKey>,
    kept: Vec<(GraphKey, G)>,
}

impl<G> Default for GraphCache<G> {
    fn default() -> Self {
        GraphCache {
            sighted: Vec::new(),
            kept: Vec::new(),
        }
    }
}

impl<G> GraphCache<G> {
    /// What to do with program `ops` (`masked`: [`masked_flags`]). For [`Sighting::Replay`]
    /// its graph is now [`GraphCache::last`].
    pub(crate) fn sight(&mut self, ops: &[Op], masked: &[bool]) -> Sighting {
        let is = |k: &GraphKey| k.0[..] == *ops && k.1[..] == *masked;
        if let Some(i) = self.kept.iter().position(|(k, _)| is(k)) {
            let e = self.kept.remove(i);
            self.kept.push(e);
            return Sighting::Replay;
        }
        if let Some(i) = self.sighted.iter().position(is) {
            self.sighted.remove(i);
            return Sighting::Capture;
        }
        if self.sighted.len() >= MAX_SIGHTED {
            self.sighted.remove(0);
        }
        self.sighted.push((ops.to_vec(), masked.to_vec()));
        Sighting::First
    }

    /// Keeps the graph captured for program `ops` as the most recently used (dropping the least
    /// recently used beyond [`MAX_GRAPHS`]; a graph still running is freed when it completes).
    pub(crate) fn keep(&mut self, ops: &[Op], masked: &[bool], graph: G) {
        if self.kept.len() >= MAX_GRAPHS {
            self.kept.remove(0);
        }
        self.kept.push(((ops.to_vec(), masked.to_vec()), graph));
    }

    /// The most recently used graph.
    pub(crate) fn last(&self) -> Option<&G> {
        self.kept.last().map(|(_, g)| g)
    }

    /// Forgets every program (their memory moved or was freed).
    pub(crate) fn clear(&mut self) {
        self.sighted.clear();
        self.kept.clear();
    }
}

/// Whether a product with a matrix of type `ty` first converts its activations in a launch of
/// its own (quantized to Q8_0 for the quantized types, rounded to f16 for F16).
pub(crate) fn converts_activation(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::F16)
}

/// [`Op::Rope`]: RoPE in place, in one launch, over the step's first `n` tokens of Q
/// (`n_head` heads of `head_dim`, `n` = `q.len / (n_head · head_dim)`) and of K (`n_head_kv`
/// heads) at their positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RopeOp {
    pub(crate) q: Span,
    pub(crate) k: Span,
    pub(crate) n_head: usize,
    pub(crate) n_head_kv: usize,
    pub(crate) head_dim: usize,
    pub(crate) params: RopeParams,
}

/// [`Op::Predictor`]: predictor scores `fc2 · ReLU(fc1 · x)` of `t` tokens (`hidden`:
/// `t × rank` scratch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PredictorOp {
    pub(crate) fc1: MatId,
    pub(crate) fc2: MatId,
    pub(crate) x: Span,
    pub(crate) hidden: Span,
    pub(crate) scores: Span,
    pub(crate) t: usize,
}

/// [`Op::Attention`]: K and V of the step's tokens `at .. at + n` stored at their positions
/// (the step's, [`Device::set_step`]) of layer `layer` of `kv`, then causal attention of their
/// queries `q` into `out`: token `i` sees positions `0 ..= position(i)`. The positions are not
/// part of the op, so a decode step's program is the same for every token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttentionOp {
    pub(crate) kv: KvId,
    pub(crate) layer: usize,
    pub(crate) k: Span,
    pub(crate) v: Span,
    pub(crate) q: Span,
    pub(crate) out: Span,
    pub(crate) at: usize,
    pub(crate) n: usize,
    pub(crate) params: AttentionParams,
}

/// [`Op::HotFfn`]: the hot part of a sparse FFN for `t` tokens: the sum over the slice's
/// enabled neurons with `score ≥ threshold` of `act(gate·x, up·x (+ bias)) · down` is written
/// to `y` (`t × n_embd`), or added to it with `accumulate` (the FFN's residual add, no zeroing
/// first); `count` (`t` values), if given, gets how many neurons each token computed: written,
/// or, for one token of a gated FFN, added to it (the fused products count while they run; the
/// caller zeroes the counts first, one [`Op::Zero`] for every layer's counts of a step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct HotFfnOp {
    pub(crate) hot: HotId,
    pub(crate) x: Span,
    pub(crate) scores: Span,
    pub(crate) threshold: f32,
    pub(crate) t: usize,
    pub(crate) y: Span,
    pub(crate) accumulate: bool,
    pub(crate) count: Option<Span>,
}

/// What the launches of a hot FFN depend on, besides the op ([`launches_of`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HotKind {
    /// Its enabled mask applies.
    pub(crate) masked: bool,
    /// It has gate rows.
    pub(crate) gated: bool,
    /// Its up (and gate) products convert their activation.
    pub(crate) converts: bool,
    /// It adds an up bias (gate-less FFNs).
    pub(crate) up_bias: bool,
    /// Its down rows are F16 (the activation is rounded to f16 first).
    pub(crate) f16_down: bool,
}

/// Kernel launches of `op` on a GPU with this project's kernels: what every device counts
/// (`conv`: how a matrix's products convert their activations first; `hot`: what a
/// hot slice's FFN launches depend on). Memsets count as launches.
pub(crate) fn launches_of(
    op: &Op,
    conv: impl Fn(MatId) -> Conversion,
    hot: impl Fn(HotId) -> HotKind,
) -> u64 {
    let mm = |m: MatId| 1 + u64::from(conv(m).is_some());
    match op {
        Op::MatMul { m, .. } => mm(*m),
        // fc1, the ReLU, fc2; an F16 fc2's rounding is the ReLU's launch.
        Op::Predictor(p) => match conv(p.fc2) {
            Some((GgmlType::F16, _)) => mm(p.fc1) + 2,
            _ => mm(p.fc1) + 1 + mm(p.fc2),
        },
        // What the CUDA device queues: the scores copied and masked when a mask applies (else
        // read where they are); the activation converted once; for one token of a gated FFN
        // the fused gate/up products and activation, else the up (and gate) products, the up
        // bias, the activation; the f16 rounding for F16 down rows; the output zeroed unless
        // the axpy adds to it; the axpy; the count.
        Op::HotFfn(f) => {
            let k = hot(f.hot);
            let products = match (k.gated, f.t == 1) {
                (true, true) => 1,
                (true, false) => 3,
                (false, _) => 2 + u64::from(k.up_bias),
            };
            // The fused products count the neurons too.
            let fused = k.gated && f.t == 1;
            2 * u64::from(k.masked)
                + u64::from(k.converts)
                + products
                + u64::from(k.f16_down)
                + u64::from(!f.accumulate)
                + 1
                + u64::from(f.count.is_some() && !fused)
        }
        // The rows stored, then the attention.
        Op::Attention(_) => 2,
        // A gated activation into the scratch, copied back over the gate.
        Op::Activate { act, .. } if *act != FfnAct::Relu => 2,
        Op::Mark { .. } => 0,
        _ => 1,
    }
}

/// How a matrix's products convert their activation: its type and width when they convert it
/// (quantize or round), `None` when they read it as it is.
pub(crate) type Conversion = Option<(GgmlType, usize)>;

/// How many ops from `ops[0]` on are products that share one converted activation: consecutive
/// [`Op::MatMul`]s of one `x` and `t` whose matrices convert it alike (`conv`), each writing a
/// buffer of its own (neither `x`'s nor another's of the run). Q, K and V of an attention, gate
/// and up of a dense FFN. 0 when `ops[0]` is not a converting product.
pub(crate) fn shared_activation_run(ops: &[Op], conv: impl Fn(MatId) -> Conversion) -> usize {
    let Some(&Op::MatMul { m, x, y, t }) = ops.first() else {
        return 0;
    };
    let Some(c) = conv(m) else {
        return 0;
    };
    let mut outs = vec![y.buf];
    if y.buf == x.buf {
        return 1;
    }
    for op in &ops[1..] {
        match *op {
            Op::MatMul {
                m: m2,
                x: x2,
                y: y2,
                t: t2,
            } if x2 == x
                && t2 == t
                && conv(m2) == Some(c)
                && y2.buf != x.buf
                && !outs.contains(&y2.buf) =>
            {
                outs.push(y2.buf)
            }
            _ => break,
        }
    }
    outs.len()
}

/// How many products after `ops[0]` read its output converted by its own launch: when `ops[0]`
/// is a norm without a residual add whose output is the activation of the run of products
/// after it ([`shared_activation_run`]), its input in a buffer of its own (neither its output's
/// nor a product's). The attention norm and Q, K, V; the output norm and the head. 0 otherwise.
pub(crate) fn norm_conversion_run(ops: &[Op], conv: impl Fn(MatId) -> Conversion) -> usize {
    let Some(&Op::Norm {
        x: nx,
        add: None,
        y: ny,
        ..
    }) = ops.first()
    else {
        return 0;
    };
    let rest = &ops[1..];
    let run = shared_activation_run(rest, conv);
    let fits = rest[..run].iter().all(|op| match *op {
        Op::MatMul { x, y, .. } => x == ny && y.buf != nx.buf,
        _ => false,
    });
    if run > 0 && fits && nx.buf != ny.buf {
        run
    } else {
        0
    }
}

/// Kernel launches of a program: [`launches_of`] every op, less the conversions that products
/// sharing an activation ([`shared_activation_run`]) do not repeat and those a norm writes in
/// its own launch ([`norm_conversion_run`]).
pub(crate) fn program_launches(
    ops: &[Op],
    conv: impl Fn(MatId) -> Conversion,
    hot: impl Fn(HotId) -> HotKind,
) -> u64 {
    let mut n: u64 = ops.iter().map(|op| launches_of(op, &conv, &hot)).sum();
    let mut i = 0;
    while i < ops.len() {
        let fused = norm_conversion_run(&ops[i..], &conv);
        if fused > 0 {
            n -= fused as u64;
            i += 1 + fused;
            continue;
        }
        let run = shared_activation_run(&ops[i..], &conv).max(1);
        n -= run as u64 - 1;
        i += run;
    }
    n
}

/// What a device has charged since it started: kernel launches, host waits and bytes over the
/// host link.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Traffic {
    pub(crate) launches: u64,
    pub(crate) waits: u64,
    pub(crate) link_bytes: u64,
}

impl std::ops::Sub for Traffic {
    type Output = Traffic;

    fn sub(self, o: Traffic) -> Traffic {
        Traffic {
            launches: self.launches - o.launches,
            waits: self.waits - o.waits,
            link_bytes: self.link_bytes - o.link_bytes,
        }
    }
}

/// The counters of [`Traffic`], shared by a device's threads.
#[derive(Debug, Default)]
pub(crate) struct TrafficCounters {
    launches: std::sync::atomic::AtomicU64,
    waits: std::sync::atomic::AtomicU64,
    link_bytes: std::sync::atomic::AtomicU64,
}

impl TrafficCounters {
    pub(crate) fn launched(&self, n: u64) {
        self.launches
            .fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn waited(&self) {
        self.waits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn moved(&self, bytes: u64) {
        self.link_bytes
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> Traffic {
        let o = std::sync::atomic::Ordering::Relaxed;
        Traffic {
            launches: self.launches.load(o),
            waits: self.waits.load(o),
            link_bytes: self.link_bytes.load(o),
        }
    }
}

/// The rows of a layer's hot neurons to upload, in bucket order.
#[derive(Clone, Copy)]
pub(crate) struct HotSpec<'a> {
    /// `ffn_gate` (all rows), if the FFN has one.
    pub(crate) gate: Option<Weights<'a>>,
    /// `ffn_up` (all rows).
    pub(crate) up: Weights<'a>,
    /// `ffn_down_t` (all rows).
    pub(crate) down_t: Weights<'a>,
    /// The neurons to hold, device row `j` = neuron `bucket[j]`.
    pub(crate) bucket: &'a [u32],
    /// `ffn_up.bias` (`opt`), all `n_ff` values.
    pub(crate) up_bias: Option<&'a [f32]>,
    /// The activation.
    pub(crate) act: FfnAct,
}

/// Rows a [`Device::replace_hot`] call overwrites: device rows `slots` of a hot slice get the
/// rows of `neurons`, taken from `spec`'s matrices (its bucket is ignored).
pub(crate) struct HotSwap<'a> {
    slots: &'a [u32],
    neurons: &'a [u32],
    /// Where the new rows come from.
    pub(crate) spec: &'a HotSpec<'a>,
}

impl<'a> HotSwap<'a> {
    /// The swap of `slots` for `neurons`, which must have the same length.
    pub(crate) fn new(
        slots: &'a [u32],
        neurons: &'a [u32],
        spec: &'a HotSpec<'a>,
    ) -> Result<HotSwap<'a>> {
        if slots.len() != neurons.len() {
            return Err(EngineError::Device(format!(
                "{} slots for {} neurons",
                slots.len(),
                neurons.len()
            )));
        }
        Ok(HotSwap {
            slots,
            neurons,
            spec,
        })
    }

    /// The device rows to overwrite.
    pub(crate) fn slots(&self) -> &'a [u32] {
        self.slots
    }

    /// The neuron whose rows go to each slot.
    pub(crate) fn neurons(&self) -> &'a [u32] {
        self.neurons
    }
}

/// One token's attention part over the first `n` mirrored positions of a layer.
pub(crate) struct AttentionJob<'a> {
    /// The layer.
    pub(crate) layer: usize,
    /// The token's query heads.
    pub(crate) q: &'a [f32],
    /// Mirrored positions to attend.
    pub(crate) n: usize,
    /// Heads and scale.
    pub(crate) params: &'a AttentionParams,
}

/// A submitted [`AttentionJob`].
#[derive(Debug)]
pub(crate) struct Ticket(pub(crate) u64);

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

/// A compute device beside the CPU (see the [module docs](self)).
pub(crate) trait Device: Send + Sync {
    /// `sim`, `cuda:0 (NVIDIA H200)`, ...
    fn name(&self) -> String;
    /// What decides its speed, for caches of measurements (the name, and for the simulated
    /// device its speed model).
    fn identity(&self) -> String {
        self.name()
    }
    /// The memory budget: limit, bytes in use, peak.
    fn memory(&self) -> (u64, u64, u64);
    /// Whether its kernels take weights of type `ty`.
    fn supports(&self, ty: GgmlType) -> bool;
    /// What it has charged so far.
    fn traffic(&self) -> Traffic;
    /// Pieces of work finished later than a speed model asked (0 for real devices).
    fn overruns(&self) -> u64 {
        0
    }

    /// Bytes the device's own kernels need beside the engine's buffers for steps of `s`
    /// (scratch the placement counts before anything else).
    fn scratch_bytes(&self, s: &ScratchShape) -> u64 {
        let _ = s;
        0
    }
    /// Allocates that scratch.
    fn reserve_scratch(&self, s: &ScratchShape) -> Result<()> {
        let _ = s;
        Ok(())
    }

    /// Copies a whole matrix into device memory.
    fn upload(&self, w: &Weights<'_>) -> Result<MatId>;
    /// Copies a vector (a norm's weights, a bias) into a new buffer.
    fn upload_vec(&self, v: &[f32]) -> Result<BufId>;
    /// A new buffer of `len` values (zeros).
    fn alloc(&self, len: usize) -> Result<BufId>;
    /// Copies a layer's hot neuron rows into device memory (every slot enabled).
    fn upload_hot(&self, spec: &HotSpec<'_>) -> Result<HotId>;
    /// Overwrites rows of a hot slice as `swap` says: a dynamic neuron cache moving neurons in
    /// and out of the slice without allocating; the new slots are enabled. Returns the time
    /// the copies took (it waits for them).
    fn replace_hot(&self, hot: HotId, swap: &HotSwap<'_>) -> Result<Duration>;
    /// Which slots of a hot slice the device computes (`None`: all), from the next program on.
    fn set_enabled(&self, hot: HotId, enabled: Option<&[bool]>) -> Result<()>;
    /// Frees a hot slice: its memory goes back to the budget and its id becomes unknown.
    fn drop_hot(&self, hot: HotId) -> Result<()>;

    /// A KV store for one sequence, of shape `s`.
    fn alloc_kv(&self, s: KvShape) -> Result<KvId>;
    /// Copies host rows into layer `layer` of `kv` from position `start` (queued).
    fn write_kv(&self, kv: KvId, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<()>;
    /// Copies rows `start .. start + n` of layer `layer` of `kv` to the host (waits).
    fn read_kv(&self, kv: KvId, layer: usize, start: usize, n: usize) -> Result<KvRows>;
    /// Copies the first `n` positions of every layer of `from` into `to` (queued).
    fn copy_kv(&self, from: KvId, to: KvId, n: usize) -> Result<()>;

    /// The step's parameters: each token's id and position (one copy to the device).
    fn set_step(&self, ids: &[u32], positions: &[u32]) -> Result<()>;
    /// Queues `ops`; returns at once.
    fn enqueue(&self, ops: &[Op]) -> Result<()>;
    /// Queues a copy of `src` into `dst` (the host may reuse `src` at once).
    fn write(&self, dst: Span, src: &[f32]) -> Result<()>;
    /// Queues a copy of `src` to the host; [`Device::wait`] takes it.
    fn read(&self, src: Span) -> Result<ReadId>;
    /// Waits for a read (and so for everything queued before it) and copies it into `dst`.
    fn wait(&self, read: ReadId, dst: &mut [f32]) -> Result<()>;
    /// The device time from mark `from` to mark `to` ([`Op::Mark`]), once a wait covered both.
    fn elapsed(&self, from: usize, to: usize) -> Result<Duration>;

    /// The attention split's side of the device, when it runs attention over a mirror of the
    /// host's KV rows (a capability the scheduling policy reads before it reserves anything).
    fn attention(&self) -> Option<&dyn AttentionDevice> {
        None
    }
}

/// A device that attends over a mirror of a sequence's first KV rows (the attention split):
/// what [`Device::attention`] returns where a device has it.
pub(crate) trait AttentionDevice {
    /// Reserves memory for a mirror of one sequence's first `positions` KV rows in each of
    /// `n_layer` layers (`kv_row` F16 values per K and V row).
    fn reserve_kv(&self, n_layer: usize, positions: usize, kv_row: usize) -> Result<()>;
    /// Copies K and V rows (whole rows) into layer `layer`'s mirror from position `start`;
    /// returns the copy's time.
    fn write_mirror(&self, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<Duration>;
    /// Queues one token's attention part.
    fn submit_attention(&self, job: &AttentionJob<'_>) -> Result<Ticket>;
    /// Waits for a queued attention part; returns it and the device's busy time.
    fn finish_attention(&self, ticket: Ticket) -> Result<(AttentionPart, Duration)>;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(buf: usize, len: usize) -> Span {
        Span {
            buf: BufId(buf),
            off: 0,
            len,
        }
    }

    fn mm(m: usize, x: Span, y: Span, t: usize) -> Op {
        Op::MatMul {
            m: MatId(m),
            x,
            y,
            t,
        }
    }

    #[test]
    fn a_program_is_captured_the_second_time_and_kept_while_used() {
        let mut c = GraphCache::<u32>::default();
        let prog = |i: usize| {
            vec![Op::Copy {
                x: span(0, i + 1),
                y: span(1, i + 1),
            }]
        };
        assert_eq!(c.sight(&prog(0), &[]), Sighting::First);
        assert_eq!(c.sight(&prog(0), &[true]), Sighting::First, "another mask");
        assert_eq!(c.sight(&prog(0), &[]), Sighting::Capture);
        c.keep(&prog(0), &[], 7);
        assert_eq!(c.sight(&prog(0), &[]), Sighting::Replay);
        assert_eq!(c.last(), Some(&7));
        // 64 more programs captured push the least recently used out.
        for i in 1..=MAX_GRAPHS {
            assert_eq!(c.sight(&prog(i), &[]), Sighting::First);
            assert_eq!(c.sight(&prog(i), &[]), Sighting::Capture);
            c.keep(&prog(i), &[], i as u32);
        }
        assert_eq!(c.sight(&prog(1), &[]), Sighting::Replay);
        assert_eq!(c.sight(&prog(0), &[]), Sighting::First, "dropped");
        c.clear();
        assert_eq!(c.sight(&prog(1), &[]), Sighting::First);
    }

    #[test]
    fn products_of_one_activation_convert_it_once() {
        // Matrices 0-2: Q4_0 of width 8; 3: F16 of width 8; 4: F32 (no conversion).
        let conv = |m: MatId| match m.0 {
            0..=2 => Some((GgmlType::Q4_0, 8)),
            3 => Some((GgmlType::F16, 8)),
            _ => None,
        };
        let x = span(0, 16);
        let (q, k, v) = (span(1, 16), span(2, 8), span(3, 8));
        let qkv = [mm(0, x, q, 2), mm(1, x, k, 2), mm(2, x, v, 2)];
        let mut ops = qkv.to_vec();
        ops.push(Op::AddRows { y: q, b: BufId(9) });
        assert_eq!(shared_activation_run(&ops, conv), 3);
        // Three conversions before: 3 × 2 + 1; one now.
        assert_eq!(
            program_launches(&ops, conv, |_| HotKind::default()),
            3 + 1 + 1
        );
        // What breaks a run: another activation, token count or conversion, an output in the
        // activation's buffer or in another output's buffer, any other op between.
        for (i, other) in [
            mm(1, span(4, 16), k, 2),
            mm(1, x, k, 1),
            mm(3, x, k, 2),
            mm(1, x, span(0, 8), 2),
            mm(1, x, span(1, 8), 2),
        ]
        .into_iter()
        .enumerate()
        {
            let ops = [qkv[0].clone(), other];
            assert_eq!(shared_activation_run(&ops, conv), 1, "case {i}");
            assert_eq!(
                program_launches(&ops, conv, |_| HotKind::default()),
                4,
                "case {i}"
            );
        }
        let ops = [
            qkv[0].clone(),
            Op::Copy { x, y: span(5, 16) },
            qkv[1].clone(),
        ];
        assert_eq!(program_launches(&ops, conv, |_| HotKind::default()), 5);
        // Products that read the activation as it is share nothing.
        let ops = [mm(4, x, q, 2), mm(4, x, k, 2)];
        assert_eq!(shared_activation_run(&ops, conv), 0);
        assert_eq!(program_launches(&ops, conv, |_| HotKind::default()), 2);
        // A product writing into its own activation's buffer stands alone.
        assert_eq!(shared_activation_run(&[mm(0, x, span(0, 8), 2)], conv), 1);
        // A norm whose output the products read writes their conversion too: one launch for
        // the norm and the conversion, one per product.
        let norm = |input: Span, add: Option<Span>| Op::Norm {
            x: input,
            add,
            w: BufId(8),
            b: None,
            eps: 1e-5,
            y: x,
        };
        let mut ops = vec![norm(span(6, 16), None)];
        ops.extend(qkv.iter().cloned());
        assert_eq!(norm_conversion_run(&ops, conv), 3);
        assert_eq!(program_launches(&ops, conv, |_| HotKind::default()), 1 + 3);
        // Not with a residual add, nor when the norm's input is a product's output or its own.
        for first in [
            norm(span(6, 16), Some(span(7, 16))),
            norm(span(1, 16), None),
            norm(span(0, 16), None),
        ] {
            ops[0] = first;
            assert_eq!(norm_conversion_run(&ops, conv), 0);
            assert_eq!(
                program_launches(&ops, conv, |_| HotKind::default()),
                1 + 1 + 3
            );
        }
    }
}
