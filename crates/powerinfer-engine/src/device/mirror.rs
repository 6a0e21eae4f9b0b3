//! The attention split's side of a device: attention over a mirror of a sequence's first KV
//! rows, for layers attended on the host ([`crate::schedule::attention`]).

use std::time::Duration;

use half::f16;
use powerinfer_kernels_cpu::ops::attention::{AttentionParams, AttentionPart};

use crate::error::Result;

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

/// A device that attends over a mirror of a sequence's first KV rows (the attention split):
/// what [`Device::attention`](super::Device::attention) returns where a device has it.
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
