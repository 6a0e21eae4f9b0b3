//! What the CUDA device holds on the GPU (behind one lock) and the checked views its launches
//! take of it.

use std::collections::HashMap;

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ffn::FfnAct;
use powerinfer_kernels_cuda::{
    Binary, DeviceBuffer, DeviceTensor, DeviceView, DeviceViewMut, Gate, GpuSlice, Graph, LayerKv,
    PinnedBuffer, TimedEvent,
};

use super::cuda;
use super::launches::{converts_activation, HotKind};
use crate::device::program::{masked_flags, GraphCache};
use crate::device::{unknown_kv, BufId, KvId, MatId, Op, Span};
use crate::error::{EngineError, Result};

/// The gating kernel of a gated FFN's activation.
pub(super) fn gate_op(act: FfnAct) -> Binary {
    match act {
        FfnAct::Swiglu => Binary::SiluGate,
        FfnAct::Drelu => Binary::DreluGate,
        _ => Binary::ReluGate,
    }
}

/// The fused gated products' activation for a hot FFN's `act` (as [`gate_op`]).
pub(super) fn gate_kind(act: FfnAct) -> Gate {
    match act {
        FfnAct::Swiglu => Gate::Silu,
        FfnAct::Drelu => Gate::Drelu,
        _ => Gate::Relu,
    }
}

/// Layer `layer` of KV store `kv`.
pub(super) fn kv_layer(kvs: &[Vec<LayerKv>], kv: KvId, layer: usize) -> Result<&LayerKv> {
    kvs.get(kv.0)
        .and_then(|l| l.get(layer))
        .ok_or_else(|| unknown_kv(kv))
}

/// Layer `layer` of KV store `kv`, to write.
pub(super) fn kv_layer_mut(
    kvs: &mut [Vec<LayerKv>],
    kv: KvId,
    layer: usize,
) -> Result<&mut LayerKv> {
    kvs.get_mut(kv.0)
        .and_then(|l| l.get_mut(layer))
        .ok_or_else(|| unknown_kv(kv))
}

/// A layer's hot rows on the GPU.
pub(super) struct CudaHot {
    pub(super) gate: Option<GpuSlice>,
    pub(super) up: GpuSlice,
    pub(super) down: GpuSlice,
    /// Host copy of the bucket (device row `j` = neuron `bucket[j]`).
    pub(super) bucket: Vec<u32>,
    /// Per neuron, 0 where the device computes it and NaN where it does not (added to the
    /// scores when `masked`; allocated with the slice, so enabling allocates nothing).
    pub(super) mask: DeviceBuffer<f32>,
    /// The host's copy of `mask` (what it last sent: the mask is never read back).
    pub(super) mask_host: Vec<f32>,
    /// Whether `mask` applies (else the device computes every held neuron).
    pub(super) masked: bool,
    /// `ffn_up.bias` of every neuron (gate-less FFNs).
    pub(super) up_bias: Option<DeviceBuffer<f32>>,
    pub(super) act: FfnAct,
}

impl CudaHot {
    pub(super) fn kind(&self) -> HotKind {
        HotKind {
            masked: self.masked,
            gated: self.gate.is_some(),
            converts: converts_activation(self.up.weight().ty()),
            up_bias: self.up_bias.is_some(),
            f16_down: self.down.weight().ty() == GgmlType::F16,
        }
    }
}

/// The kernels' own scratch, for steps of up to `t` tokens.
pub(super) struct Scratch {
    pub(super) t: usize,
    /// The step's token ids and positions (and the positions on the host, to check ops against).
    pub(super) ids: DeviceBuffer<i32>,
    pub(super) pos: DeviceBuffer<i32>,
    pub(super) host_pos: Vec<u32>,
    /// Attention scores (`t × n_head × ctx`).
    pub(super) attn: DeviceBuffer<f32>,
    /// The hot FFN's masked scores, up and gate products and activations (`t × n_ff` each).
    pub(super) masked: DeviceBuffer<f32>,
    pub(super) up: DeviceBuffer<f32>,
    pub(super) gate: DeviceBuffer<f32>,
    pub(super) act: DeviceBuffer<f32>,
}

/// A copy to the host in flight: its pinned buffer.
pub(super) struct PendingRead {
    pub(super) buf: PinnedBuffer<f32>,
    /// Values read (the buffer may be longer).
    pub(super) len: usize,
}

/// Everything on the device, behind one lock: operations queue under it.
#[derive(Default)]
pub(super) struct State {
    pub(super) mats: Vec<DeviceTensor>,
    /// `None` while an operation writes it.
    pub(super) bufs: Vec<Option<DeviceBuffer<f32>>>,
    pub(super) hots: Vec<Option<CudaHot>>,
    /// Per store, per layer.
    pub(super) kvs: Vec<Vec<LayerKv>>,
    pub(super) scratch: Option<Scratch>,
    pub(super) reads: HashMap<u64, PendingRead>,
    pub(super) next_read: u64,
    /// The pinned buffers copies go through.
    pub(super) staging: Staging,
    /// Timed events of the marks.
    pub(super) marks: HashMap<usize, TimedEvent>,
    /// Captured programs (a decode step has a few per layer; a lookup compares ops, which
    /// differ from the first one for programs of other layers).
    pub(super) graphs: GraphCache<Graph>,
}

/// Per hot FFN of `ops`, whether its enabled mask applies.
pub(super) fn masked_of(hots: &[Option<CudaHot>], ops: &[Op]) -> Vec<bool> {
    masked_flags(ops, |h| {
        (hots.get(h.0).and_then(Option::as_ref)).is_some_and(|h| h.masked)
    })
}

/// Buffer `id`.
pub(super) fn buf(bufs: &[Option<DeviceBuffer<f32>>], id: BufId) -> Result<&DeviceBuffer<f32>> {
    bufs.get(id.0).and_then(Option::as_ref).ok_or_else(|| {
        EngineError::Device(format!(
            "device buffer {}: unknown, or an operation reads the buffer it writes",
            id.0
        ))
    })
}

pub(super) fn view(bufs: &[Option<DeviceBuffer<f32>>], s: Span) -> Result<DeviceView<'_, f32>> {
    buf(bufs, s.buf)?.view(s.off, s.len).map_err(cuda)
}

/// The held matrices `ms`.
pub(super) fn held_mats<'m>(
    mats: &'m [DeviceTensor],
    ms: &[MatId],
) -> Result<Vec<&'m DeviceTensor>> {
    (ms.iter())
        .map(|m| {
            mats.get(m.0)
                .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", m.0)))
        })
        .collect()
}

/// Runs `f` with the buffers and a write view of `y`, whose buffer is taken out of the table
/// meanwhile (so that `f` cannot read it through the table).
pub(super) fn with_out<R>(
    bufs: &mut [Option<DeviceBuffer<f32>>],
    y: Span,
    f: impl FnOnce(&[Option<DeviceBuffer<f32>>], DeviceViewMut<'_, f32>) -> Result<R>,
) -> Result<R> {
    let mut out = bufs
        .get_mut(y.buf.0)
        .and_then(Option::take)
        .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", y.buf.0)))?;
    let r = out
        .view_mut(y.off, y.len)
        .map_err(cuda)
        .and_then(|v| f(bufs, v));
    bufs[y.buf.0] = Some(out);
    r
}

/// The scores a hot FFN reads: the masked copy in the scratch when a mask applies, else the
/// scores where they are.
pub(super) fn hot_scores<'a>(
    bufs: &'a [Option<DeviceBuffer<f32>>],
    masked: Option<&'a DeviceBuffer<f32>>,
    scores: Span,
    tn: usize,
) -> Result<DeviceView<'a, f32>> {
    match masked {
        Some(m) => m.view(0, tn).map_err(cuda),
        None => view(bufs, scores),
    }
}

/// Runs `f` with the buffers and write views of the spans `ys`, each in a buffer of its own,
/// taken out of the table meanwhile (as [`with_out`]).
pub(super) fn with_outs<R>(
    bufs: &mut [Option<DeviceBuffer<f32>>],
    ys: &[Span],
    f: impl FnOnce(&[Option<DeviceBuffer<f32>>], Vec<DeviceViewMut<'_, f32>>) -> Result<R>,
) -> Result<R> {
    let mut outs = Vec::with_capacity(ys.len());
    for y in ys {
        match bufs.get_mut(y.buf.0).and_then(Option::take) {
            Some(b) => outs.push(b),
            None => {
                for (b, y) in outs.into_iter().zip(ys) {
                    bufs[y.buf.0] = Some(b);
                }
                return Err(EngineError::Device(format!(
                    "unknown (or repeated) device buffer {}",
                    y.buf.0
                )));
            }
        }
    }
    let views: Result<Vec<_>> = (outs.iter_mut().zip(ys))
        .map(|(b, y)| b.view_mut(y.off, y.len).map_err(cuda))
        .collect();
    let r = views.and_then(|v| f(bufs, v));
    for (b, y) in outs.into_iter().zip(ys) {
        bufs[y.buf.0] = Some(b);
    }
    r
}

/// Pinned host buffers for the copies between host and device, made at load
/// (`reserve_scratch`) for the widest copy of a step: each copy takes the one whose last use
/// is the oldest, which waits for its previous copy (long done) before it is written. A copy
/// wider than the reserve, or one while all are held, makes a buffer then (counted, kept).
#[derive(Default)]
pub(super) struct Staging {
    pub(super) f32s: std::collections::VecDeque<PinnedBuffer<f32>>,
    /// The step's token ids and positions.
    pub(super) i32s: Vec<PinnedBuffer<i32>>,
}

/// Buffers of the staging pool: a read in flight, the copies in of a layer, one spare.
pub(super) const STAGING_BUFFERS: usize = 4;
