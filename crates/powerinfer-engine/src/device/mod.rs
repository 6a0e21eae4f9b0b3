//! Compute devices beside the CPU: where the hot part of each layer runs.
//!
//! A device (the crate-private `Device` trait) holds weights, work buffers and KV stores in
//! its own memory, under a byte budget that refuses an allocation before anything is
//! allocated, and runs **programs**: `Op`s on its own buffers, queued in order on one stream
//! and returning at once. Nothing comes back to the host but what the engine reads on purpose
//! (`Device::read`, then `Device::wait`); inputs go in by `Device::write`. So a layer whose
//! attention and dense matrices the device holds keeps its hidden state there from the
//! attention norm to the FFN's residual add, and a token costs the link only what the CPU's
//! share of the FFN needs.
//!
//! Every device counts what a GPU would charge (`Device::traffic`): kernel launches, host
//! waits, bytes over the link and programs captured as graphs. Implementations:
//! `sim::SimDevice`, a simulated GPU (own memory arena, own worker thread and kernel pool, an
//! optional speed model [`SimSpeed`] that charges launches, host waits and link transfers)
//! that runs on every machine, and `cuda::CudaDevice` on an NVIDIA GPU through
//! `powerinfer-kernels-cuda`. What goes where is decided at load by the scheduling policy
//! ([`crate::schedule`]), which reads what a device can do from `Device::supports` and
//! `Device::attention` and never the reverse: this module knows nothing of placement or
//! balancing. [`DeviceChoice`] and [`SimOptions`] choose; [`DeviceReport`] tells.
//!
//! The rooms: `op.rs` (the operations and the ids they name), `program.rs` (a step's queued
//! ops, `Program`, and the graph cache), `held.rs` (what a device holds beside programs),
//! `mirror.rs` (the attention split's side), `options.rs` and `report.rs` (the public
//! choice and report), `cuda/` (with `launches.rs`, the CUDA kernels' fusion and launch
//! rules, which the simulated device counts by too) and `sim/`.

pub(crate) mod cuda;
mod held;
mod mirror;
mod op;
mod options;
mod program;
mod report;
pub(crate) mod sim;

use std::time::Duration;

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::Weights;

use crate::error::Result;

pub(crate) use held::{
    entry, entry_mut, free_entry, hot_slice_overhead, unknown_kv, HotSpec, HotSwap, KvRows,
    KvShape, ReadId, ScratchShape,
};
pub(crate) use mirror::{AttentionDevice, AttentionJob, Ticket};
pub(crate) use op::{
    AttentionOp, BufId, HotFfnOp, HotId, KvId, MatId, Op, PredictorOp, RopeOp, RowsOf, Span,
};
pub use options::{DeviceChoice, SimOptions, SimSpeed};
pub(crate) use program::Program;
pub use report::DeviceReport;
pub(crate) use report::Traffic;

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
    /// Copies host rows (the canonical bytes of the store's types) into layer `layer` of `kv`
    /// from position `start` (queued).
    fn write_kv(&self, kv: KvId, layer: usize, start: usize, k: &[u8], v: &[u8]) -> Result<()>;
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
    /// The device time from mark `from` to mark `to` ([`Op::Mark`]), once a wait covered both:
    /// on the device's timeline ([`Device::now`]).
    fn elapsed(&self, from: usize, to: usize) -> Result<Duration>;
    /// The host's time on the device's timeline: for a simulated device playing a card, the
    /// modelled card's (the host's real work between device calls, the card's modelled work,
    /// the waits between); else the wall clock. Differences of it time an evaluation.
    fn now(&self) -> Duration;

    /// The attention split's side of the device, when it runs attention over a mirror of the
    /// host's KV rows (a capability the scheduling policy reads before it reserves anything).
    fn attention(&self) -> Option<&dyn AttentionDevice> {
        None
    }
}
