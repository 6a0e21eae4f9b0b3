//! What a device holds beside its programs: the shapes of its KV stores and scratch, a layer's
//! hot neuron rows to upload or swap, and the tables of ids its implementations keep.

use powerinfer_kernels_cpu::ffn::FfnAct;
use powerinfer_kernels_cpu::ops::kv::KvType;
use powerinfer_kernels_cpu::Weights;

use super::op::KvId;
use crate::error::{EngineError, Result};

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
    /// Values of the widest copy between host and device a step makes (its largest work
    /// buffer), for the host staging made at load.
    pub(crate) io: usize,
}

/// The shape of one sequence's KV store: `layers` layers of `positions` K and V rows of
/// `n_kv_head` heads of `head_dim` values each, K of `types.0` and V of `types.1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KvShape {
    pub(crate) layers: usize,
    pub(crate) positions: usize,
    pub(crate) n_kv_head: usize,
    pub(crate) head_dim: usize,
    pub(crate) types: (KvType, KvType),
}

impl KvShape {
    /// Bytes of the store.
    pub(crate) fn bytes(&self) -> u64 {
        let row = self.n_kv_head * self.head_dim;
        (self.layers * self.positions * (self.types.0.bytes_of(row) + self.types.1.bytes_of(row)))
            as u64
    }
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

/// K and V rows of a KV store, as they cross the link: the canonical bytes of the store's
/// types (row-major, [`powerinfer_kernels_cpu::ops::kv`]), bit for bit.
pub(crate) type KvRows = (Vec<u8>, Vec<u8>);

/// The error of a KV store id a device does not know.
pub(crate) fn unknown_kv(kv: KvId) -> EngineError {
    EngineError::Device(format!("unknown KV store {}", kv.0))
}

/// A copy to the host in flight ([`Device::read`](super::Device::read)).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ReadId(pub(crate) u64);

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

/// Rows a [`Device::replace_hot`](super::Device::replace_hot) call overwrites: device rows `slots` of a hot slice get the
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
