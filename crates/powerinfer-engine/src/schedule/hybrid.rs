//! The executor's view of a placement: what the device holds of each layer ([`Hybrid`]), the
//! work buffers of a device step, and a layer's host matrices as a device takes them. Made at
//! load by [`super::placement::place`]; read by the executor, never changed by it but for the
//! run-time state behind its locks and counters.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use powerinfer_kernels_cpu::Weights;

use super::balance::Balance;
use super::kv::KvStores;
use crate::device::{BufId, Device, DeviceReport, HotSpec, MatId};
use crate::error::Result;
use crate::model::{Ffn, Model, TensorRef};

/// A norm on the device: its weight, and its bias for a LayerNorm.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevNorm {
    pub(crate) w: BufId,
    pub(crate) b: Option<BufId>,
}

/// A resident layer's attention on the device.
#[derive(Debug)]
pub(crate) struct DevAttention {
    /// `attn_norm`.
    pub(crate) norm: DevNorm,
    /// `attn_norm_2` (the attention's own norm, `falcon`).
    pub(crate) norm2: Option<DevNorm>,
    /// Q, K and V (a fused QKV is held as its three row ranges).
    pub(crate) qkv: [MatId; 3],
    /// Their biases.
    pub(crate) bias: [Option<BufId>; 3],
    /// `attn_output` and its bias.
    pub(crate) wo: MatId,
    pub(crate) bo: Option<BufId>,
}

/// A dense FFN on the device (`-ngl`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DevDenseFfn {
    pub(crate) gate: Option<MatId>,
    pub(crate) up: MatId,
    pub(crate) down: MatId,
}

/// What the device holds of one layer.
#[derive(Debug, Default)]
pub(crate) struct HybridLayer {
    /// The attention: `Some` makes the layer resident (its KV rows are in the stores).
    pub(crate) attn: Option<DevAttention>,
    /// `ffn_norm`.
    pub(crate) ffn_norm: Option<DevNorm>,
    /// `fc1` and `fc2`.
    pub(crate) predictor: Option<(MatId, MatId)>,
    /// A dense FFN's matrices.
    pub(crate) dense_ffn: Option<DevDenseFfn>,
    /// `ffn_up.bias` and `ffn_down.bias` (`opt`).
    pub(crate) up_b: Option<BufId>,
    pub(crate) down_b: Option<BufId>,
}

/// The output norm and head on the device.
#[derive(Debug)]
pub(crate) struct DevOutput {
    pub(crate) norm: DevNorm,
    pub(crate) head: MatId,
}

/// The embedding tables on the device.
#[derive(Debug)]
pub(crate) struct DevEmbed {
    pub(crate) tok: MatId,
    pub(crate) pos: Option<MatId>,
}

/// The device's work buffers: every activation a device step passes between its operations,
/// for up to `t_max` tokens.
#[derive(Debug)]
pub(crate) struct Work {
    pub(crate) t_max: usize,
    /// The residual stream.
    pub(crate) x: BufId,
    /// The attention's normalized input (`falcon`'s FFN input too).
    pub(crate) acur: BufId,
    /// `attn_norm_2`'s output (`falcon`).
    pub(crate) acur2: Option<BufId>,
    pub(crate) q: BufId,
    pub(crate) k: BufId,
    pub(crate) v: BufId,
    pub(crate) heads: BufId,
    pub(crate) attn_out: BufId,
    /// What the CPU's share of a layer's FFN reads, one copy: the FFN input (`t × n_embd`)
    /// then the scores (`t × n_ff`).
    pub(crate) exchange: BufId,
    /// The predictor's hidden layer.
    pub(crate) hidden: BufId,
    /// The device's part of an FFN.
    pub(crate) hot_y: BufId,
    /// The CPU's part of an FFN (or a whole FFN computed on the CPU), written by the host.
    pub(crate) cpu_y: BufId,
    /// A dense FFN's gate and up products.
    pub(crate) gate: Option<BufId>,
    pub(crate) up: Option<BufId>,
    /// What a step returns, one copy: each layer's count of neurons the device computed per
    /// token (`n_layer × t`), then logits or hidden rows.
    pub(crate) out: BufId,
}

/// A device and what it holds: the executor runs each piece of work where this says.
pub(crate) struct Hybrid {
    /// The device.
    pub(crate) device: Box<dyn Device>,
    /// Per layer.
    pub(crate) layers: Vec<HybridLayer>,
    /// The output norm and head.
    pub(crate) output: Option<DevOutput>,
    /// The embedding tables.
    pub(crate) embed: Option<DevEmbed>,
    /// The work buffers (`None`: the budget could not hold them; nothing runs there).
    pub(crate) work: Option<Work>,
    /// The sequences' KV rows of the resident layers.
    pub(crate) kv: KvStores,
    pub(super) report: DeviceReport,
    /// Active neurons computed so far on the device and on the CPU.
    pub(crate) counters: (AtomicU64, AtomicU64),
    /// Tokens evaluated with the device.
    pub(crate) tokens: AtomicU64,
    /// Their evaluations' time on the device's timeline, in nanoseconds.
    pub(crate) eval_ns: AtomicU64,
    /// Of which decode steps (one token of each sequence): tokens, nanoseconds.
    pub(crate) decode: (AtomicU64, AtomicU64),
    /// Which neurons the device holds and computes in each layer, moved while decoding.
    pub(crate) balance: Mutex<Balance>,
}

impl Hybrid {
    /// What the device holds and did.
    pub(crate) fn report(&self) -> DeviceReport {
        let (limit, _, peak) = self.device.memory();
        let t = self.device.traffic();
        DeviceReport {
            budget_bytes: limit,
            peak_bytes: peak,
            active_device: self.counters.0.load(Ordering::Relaxed),
            active_cpu: self.counters.1.load(Ordering::Relaxed),
            overruns: self.device.overruns(),
            tokens: self.tokens.load(Ordering::Relaxed),
            launches: t.launches,
            host_waits: t.waits,
            link_bytes: t.link_bytes.saturating_sub(self.report.link_bytes),
            eval_secs: self.eval_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            decode_tokens: self.decode.0.load(Ordering::Relaxed),
            decode_secs: self.decode.1.load(Ordering::Relaxed) as f64 * 1e-9,
            graphs_captured: t.captures,
            late_allocations: t.late_allocs,
            ..self.report.clone()
        }
    }

    /// Whether any layer runs on the device.
    pub(crate) fn runs_layers(&self) -> bool {
        self.work.is_some() && self.layers.iter().any(|l| l.attn.is_some())
    }
}

/// The host matrices of a sparse layer as a device takes them (`bucket` empty).
pub(crate) fn layer_spec<'m>(model: &'m Model, l: usize) -> Result<Option<HotSpec<'m>>> {
    let layer = &model.layers[l];
    let Ffn::Sparse {
        gate, up, down_t, ..
    } = &layer.ffn
    else {
        return Ok(None);
    };
    Ok(Some(HotSpec {
        gate: gate.as_ref().map(|g| view(model, g)).transpose()?,
        up: view(model, up)?,
        down_t: view(model, down_t)?,
        bucket: &[],
        up_bias: layer.up_b.as_deref(),
        act: model.ffn_act,
    }))
}

pub(super) fn view<'m>(model: &'m Model, t: &TensorRef) -> Result<Weights<'m>> {
    Ok(Weights::new(
        t.ty,
        t.rows,
        t.cols,
        model.file().data_of(&t.info),
    )?)
}
