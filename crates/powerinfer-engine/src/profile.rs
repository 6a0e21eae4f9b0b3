//! Where evaluation time goes: wall time, calls and bytes read per operation of the forward pass
//! ([`OpProfile`]), recorded when asked for ([`Session::set_profiling`],
//! [`EvalOptions::profile`]).
//!
//! The times are the calling thread's wall clock between the ends of consecutive operations,
//! so they add up to the time of the whole pass (worker threads run inside the operations that
//! dispatch them). `bytes` are the bytes each operation had to read from weights (only the
//! active rows of a sparse product) and, for attention, from the KV cache: bytes over time is
//! the operation's achieved read bandwidth, to set against the machine's.
//!
//! [`Session::set_profiling`]: crate::Session::set_profiling
//! [`EvalOptions::profile`]: crate::EvalOptions::profile

use std::time::{Duration, Instant};

/// `part / whole`, or 0 when `whole` is 0: the shares the reports print.
pub(crate) fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// An operation of the forward pass, as [`OpProfile`] counts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum OpKind {
    /// RMSNorm / LayerNorm before attention, before the FFN and before the output head.
    Norm,
    /// The Q, K and V products (separate or fused) and their biases.
    Qkv,
    /// RoPE, appending K and V to the cache, and attention over the cache (bytes: the K and V
    /// rows read).
    Attention,
    /// The attention output product and its bias.
    AttnOutput,
    /// The predictor of a PowerInfer layer: `fc1` (and `fc2` where the scores of a block are
    /// computed together; a one-token sparse FFN computes `fc2` inside [`OpKind::FfnUpGate`]).
    Predictor,
    /// The FFN's up and gate products and the activation: every neuron (dense), or the active
    /// ones (sparse; for one token together with the predictor's `fc2` scores and the active
    /// list, which run in the same dispatch).
    FfnUpGate,
    /// The FFN's down product (dense) or the axpy over the active rows of `ffn_down_t`, and its
    /// bias.
    FfnDown,
    /// The CPU waiting for the device (its copies to the host).
    DeviceWait,
    /// Queueing the device's work and copies (its kernels run meanwhile, asynchronously).
    Device,
    /// The output head (logits).
    OutputHead,
    /// Everything else: embedding, residual additions, copying out logits.
    Other,
}

impl OpKind {
    /// Every operation, in the order of a layer.
    pub const ALL: [OpKind; 11] = [
        OpKind::Norm,
        OpKind::Qkv,
        OpKind::Attention,
        OpKind::AttnOutput,
        OpKind::Predictor,
        OpKind::FfnUpGate,
        OpKind::FfnDown,
        OpKind::Device,
        OpKind::DeviceWait,
        OpKind::OutputHead,
        OpKind::Other,
    ];

    /// A short name (`qkv`, `ffn_up_gate`, ...).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Norm => "norm",
            OpKind::Qkv => "qkv",
            OpKind::Attention => "attention",
            OpKind::AttnOutput => "attn_output",
            OpKind::Predictor => "predictor",
            OpKind::FfnUpGate => "ffn_up_gate",
            OpKind::FfnDown => "ffn_down",
            OpKind::DeviceWait => "device_wait",
            OpKind::Device => "device",
            OpKind::OutputHead => "output_head",
            OpKind::Other => "other",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Totals of one [`OpKind`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpTime {
    /// Wall time.
    pub time: Duration,
    /// Times the operation ran (per layer per evaluation for layer operations).
    pub calls: u64,
    /// Bytes read from weights and, for attention, the KV cache.
    pub bytes: u64,
}

impl OpTime {
    /// Bytes per second (0 when no time was recorded).
    pub fn bytes_per_second(&self) -> f64 {
        let s = self.time.as_secs_f64();
        if s > 0.0 {
            self.bytes as f64 / s
        } else {
            0.0
        }
    }
}

/// How one layer's hybrid FFN shared its work between the CPU and the device, summed over
/// the evaluations recorded (see [`OpProfile::layers`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LayerSplit {
    /// Evaluations of the layer.
    pub calls: u64,
    /// Tokens in them.
    pub tokens: u64,
    /// The CPU computing its neurons, from the device's job being queued to its own part
    /// done.
    pub cpu: Duration,
    /// The CPU waiting for the device after its own part.
    pub wait: Duration,
    /// The device's job, from queued to done (copies included).
    pub device: Duration,
    /// Of which copies between host and device.
    pub transfer: Duration,
    /// Active neurons the CPU computed.
    pub active_cpu: u64,
    /// Active neurons the device computed.
    pub active_device: u64,
}

impl LayerSplit {
    /// The device idle while the CPU still worked: `cpu + wait − device` (0 when the device
    /// took longer).
    pub fn device_idle(&self) -> Duration {
        (self.cpu + self.wait).saturating_sub(self.device)
    }

    /// Share of the active neurons the device computed.
    pub fn device_share(&self) -> f64 {
        ratio(self.active_device, self.active_cpu + self.active_device)
    }

    fn add(&mut self, o: &LayerSplit) {
        self.calls += o.calls;
        self.tokens += o.tokens;
        self.cpu += o.cpu;
        self.wait += o.wait;
        self.device += o.device;
        self.transfer += o.transfer;
        self.active_cpu += o.active_cpu;
        self.active_device += o.active_device;
    }
}

/// What blocks of several tokens asked of one layer's sparse FFN on the CPU, summed over the
/// blocks recorded (see [`OpProfile::batch_density`]): each token's own active neurons
/// against the union of the block's, the rows a block would read once for all its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BatchDensity {
    /// Blocks (evaluations of more than one token).
    pub blocks: u64,
    /// Tokens in them.
    pub tokens: u64,
    /// Active neurons, summed over the tokens.
    pub active: u64,
    /// Neurons active for some token of a block, summed over the blocks.
    pub union: u64,
    /// The layer's neurons (FFN width).
    pub neurons: u64,
}

impl BatchDensity {
    /// Mean share of the neurons one token activates.
    pub fn token_density(&self) -> f64 {
        ratio(self.active, self.tokens * self.neurons)
    }

    /// Mean share of the neurons some token of a block activates.
    pub fn union_density(&self) -> f64 {
        ratio(self.union, self.blocks * self.neurons)
    }

    /// Mean tokens per block.
    pub fn tokens_per_block(&self) -> f64 {
        ratio(self.tokens, self.blocks)
    }

    fn add(&mut self, o: &BatchDensity) {
        self.blocks += o.blocks;
        self.tokens += o.tokens;
        self.active += o.active;
        self.union += o.union;
        self.neurons = self.neurons.max(o.neurons);
    }
}

/// What a device charged over the evaluations recorded: kernel launches, host waits
/// (synchronizations) and bytes over the host link; and the evaluations' time on the device's
/// timeline (the modelled card's for a simulated device playing one, else the wall clock).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceTraffic {
    /// Kernels launched.
    pub launches: u64,
    /// Times the host waited for the device.
    pub syncs: u64,
    /// Bytes copied between host and device.
    pub link_bytes: u64,
    /// The evaluations' time on the device's timeline
    /// ([`DeviceReport::eval_secs`](crate::DeviceReport::eval_secs)).
    pub time: Duration,
}

impl DeviceTraffic {
    /// These counts, over `time` on the device's timeline.
    pub fn new(launches: u64, syncs: u64, link_bytes: u64, time: Duration) -> DeviceTraffic {
        DeviceTraffic {
            launches,
            syncs,
            link_bytes,
            time,
        }
    }

    fn add(&mut self, o: &DeviceTraffic) {
        self.launches += o.launches;
        self.syncs += o.syncs;
        self.link_bytes += o.link_bytes;
        self.time += o.time;
    }
}

/// Per-operation totals over the evaluations recorded into it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpProfile {
    /// Evaluations (forward passes) recorded.
    pub evals: u64,
    /// Tokens evaluated in them.
    pub tokens: u64,
    /// What the device charged in them (zero without a device).
    pub device: DeviceTraffic,
    ops: [OpTime; OpKind::ALL.len()],
    layers: Vec<LayerSplit>,
    batch: Vec<BatchDensity>,
}

impl OpProfile {
    /// An empty profile.
    pub fn new() -> OpProfile {
        OpProfile::default()
    }

    /// The totals of `op`.
    pub fn get(&self, op: OpKind) -> &OpTime {
        &self.ops[op.index()]
    }

    /// Every operation with its totals, in [`OpKind::ALL`] order.
    pub fn iter(&self) -> impl Iterator<Item = (OpKind, &OpTime)> + '_ {
        OpKind::ALL.iter().map(|&op| (op, self.get(op)))
    }

    /// The sum of all operations' times (the evaluations' wall time).
    pub fn total_time(&self) -> Duration {
        self.ops.iter().map(|o| o.time).sum()
    }

    /// The sum of all operations' bytes.
    pub fn total_bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.bytes).sum()
    }

    /// Per layer, how its hybrid FFN shared the work between CPU and device (empty when no
    /// device computed any of it).
    pub fn layers(&self) -> &[LayerSplit] {
        &self.layers
    }

    /// Per layer, the sparse FFN's per-token and union densities over blocks of several
    /// tokens (empty when no such block ran the sparse FFN on the CPU).
    pub fn batch_density(&self) -> &[BatchDensity] {
        &self.batch
    }

    /// Adds `other`'s counts to these.
    pub fn merge(&mut self, other: &OpProfile) {
        self.evals += other.evals;
        self.tokens += other.tokens;
        self.device.add(&other.device);
        for (a, b) in self.ops.iter_mut().zip(&other.ops) {
            a.time += b.time;
            a.calls += b.calls;
            a.bytes += b.bytes;
        }
        for (l, s) in other.layers.iter().enumerate() {
            self.split_mut(l).add(s);
        }
        for (l, b) in other.batch.iter().enumerate() {
            self.batch_mut(l).add(b);
        }
    }

    fn batch_mut(&mut self, layer: usize) -> &mut BatchDensity {
        if self.batch.len() <= layer {
            self.batch.resize(layer + 1, BatchDensity::default());
        }
        &mut self.batch[layer]
    }

    fn split_mut(&mut self, layer: usize) -> &mut LayerSplit {
        if self.layers.len() <= layer {
            self.layers.resize(layer + 1, LayerSplit::default());
        }
        &mut self.layers[layer]
    }

    fn add(&mut self, op: OpKind, time: Duration, bytes: u64) {
        let o = &mut self.ops[op.index()];
        o.time += time;
        o.calls += 1;
        o.bytes += bytes;
    }
}

/// Records the time since the previous lap into an operation of a profile; does nothing (not
/// even read the clock) without one.
pub(crate) struct Laps<'p> {
    prof: Option<&'p mut OpProfile>,
    last: Option<Instant>,
}

impl<'p> Laps<'p> {
    /// Laps into `prof` (if any), starting now.
    pub(crate) fn new(prof: Option<&'p mut OpProfile>) -> Laps<'p> {
        let last = prof.is_some().then(Instant::now);
        Laps { prof, last }
    }

    /// Charges the time since the previous lap to `op`, with `bytes` read.
    #[inline]
    pub(crate) fn lap(&mut self, op: OpKind, bytes: impl FnOnce() -> u64) {
        if let (Some(p), Some(last)) = (self.prof.as_deref_mut(), self.last.as_mut()) {
            let now = Instant::now();
            p.add(op, now - *last, bytes());
            *last = now;
        }
    }

    /// Adds a hybrid FFN's split of layer `layer`.
    pub(crate) fn split(&mut self, layer: usize, s: LayerSplit) {
        if let Some(p) = self.prof.as_deref_mut() {
            p.split_mut(layer).add(&s);
        }
    }

    /// Whether a profile is being recorded (so callers can skip counting for it).
    pub(crate) fn on(&self) -> bool {
        self.prof.is_some()
    }

    /// Adds a block's densities of layer `layer`.
    pub(crate) fn batch(&mut self, layer: usize, b: BatchDensity) {
        if let Some(p) = self.prof.as_deref_mut() {
            p.batch_mut(layer).add(&b);
        }
    }

    /// Adds what a device charged.
    pub(crate) fn traffic(&mut self, t: DeviceTraffic) {
        if let Some(p) = self.prof.as_deref_mut() {
            p.device.add(&t);
        }
    }

    /// Counts one evaluation of `tokens` tokens.
    pub(crate) fn eval(&mut self, tokens: usize) {
        if let Some(p) = self.prof.as_deref_mut() {
            p.evals += 1;
            p.tokens += tokens as u64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_add_up_and_merge() {
        let mut p = OpProfile::new();
        {
            let mut l = Laps::new(Some(&mut p));
            l.eval(3);
            std::thread::sleep(Duration::from_millis(2));
            l.lap(OpKind::Qkv, || 100);
            l.lap(OpKind::Qkv, || 20);
            l.lap(OpKind::FfnDown, || 7);
        }
        assert_eq!((p.evals, p.tokens), (1, 3));
        let q = p.get(OpKind::Qkv);
        assert_eq!((q.calls, q.bytes), (2, 120));
        assert!(q.time >= Duration::from_millis(2));
        assert_eq!(p.get(OpKind::FfnDown).bytes, 7);
        assert_eq!(p.get(OpKind::Norm), &OpTime::default());
        assert_eq!(p.total_bytes(), 127);
        assert_eq!(
            p.total_time(),
            p.iter().map(|(_, o)| o.time).sum::<Duration>()
        );
        let mut twice = p.clone();
        twice.merge(&p);
        assert_eq!((twice.evals, twice.tokens), (2, 6));
        assert_eq!(twice.get(OpKind::Qkv).bytes, 240);
        assert_eq!(twice.total_time(), p.total_time() * 2);
        // Without a profile nothing is computed.
        let mut off = Laps::new(None);
        off.lap(OpKind::Qkv, || {
            unreachable!("bytes computed without a profile")
        });
    }
}
