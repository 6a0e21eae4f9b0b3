//! What every layer of one evaluation shares ([`Step`]: the kernels, the options, the batch's
//! layout, buffers), and the small helpers both halves of a layer use.

use powerinfer_kernels_cpu::ops::activation::add;
use powerinfer_kernels_cpu::ops::attention::AttentionParams;
use powerinfer_kernels_cpu::ops::norm::{layer_norm, rms_norm};
use powerinfer_kernels_cpu::ops::rope::{RopeMode, RopeParams};
use powerinfer_kernels_cpu::MatMul;

use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use super::fused::FusedSplit;
use super::weights::LayerMats;
use super::{ExecOptions, Segment};
use crate::device::balance::Balance;
use crate::device::Device;
use crate::error::Result;
use crate::model::{Arch, FfnAct, Hparams, Layer, Model, Norm};
use crate::observer::FfnObserver;
use crate::profile::Laps;

/// Buffers reused from layer to layer.
#[derive(Default)]
pub(crate) struct Buffers {
    /// The normalized layer input.
    pub(crate) cur: Vec<f32>,
    /// The attention's normalized input where it has its own norm (`attn_norm_2`).
    pub(crate) cur2: Vec<f32>,
    pub(crate) q: Vec<f32>,
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    /// A fused QKV product.
    pub(crate) qkv: Vec<f32>,
    /// Attention heads' outputs.
    pub(crate) heads: Vec<f32>,
    /// The attention's output (after `attn_output`).
    pub(crate) tmp: Vec<f32>,
    /// The FFN's output of a parallel block.
    pub(crate) ffn_out: Vec<f32>,
    /// The FFN's buffers.
    pub(crate) ffn: FfnScratch,
}

/// Reusable buffers of the FFN (`ffn.rs`).
#[derive(Default)]
pub(crate) struct FfnScratch {
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    pub(crate) hidden: Vec<f32>,
    pub(crate) scores: Vec<f32>,
    /// The scores as the device gets them (held neurons it does not compute hidden).
    pub(crate) dev_scores: Vec<f32>,
    pub(crate) active: Vec<u32>,
    /// Per thread, the active neurons of its row range (relative to the range start).
    pub(crate) parts: Vec<Mutex<Vec<u32>>>,
    /// The active neurons whose gate fired (see `ffn::gate_fired`): per thread in the one-token
    /// path, the first entry in the per-token path.
    pub(crate) fired: Vec<Mutex<Vec<u32>>>,
    /// Which neurons some token of a block activates (profiles only).
    pub(crate) mark: Vec<bool>,
}

/// One evaluation's shared state: the kernels, the options, the batch's layout, per-token
/// FFN density and the observer.
pub(crate) struct Step<'a> {
    /// The CPU kernels.
    pub(crate) mm: &'a MatMul<'a>,
    /// How the FFN runs.
    pub(crate) opts: ExecOptions,
    /// The model's hyper-parameters.
    pub(crate) hp: &'a Hparams,
    /// The FFN activation.
    pub(crate) act: FfnAct,
    /// Tokens in the batch.
    pub(crate) t: usize,
    /// Each token's position in its sequence.
    pub(crate) positions: Vec<usize>,
    /// The batch.
    pub(crate) segments: &'a [Segment<'a>],
    /// Each segment's first token.
    pub(crate) starts: Vec<usize>,
    /// RoPE of the model (`None` for `opt`).
    pub(crate) rope: Option<RopeParams>,
    /// The attention's head layout.
    pub(crate) ap: AttentionParams,
    /// Per token, the sum over layers of the share of FFN neurons computed.
    pub(crate) density: Vec<f32>,
    /// Sees every layer's FFN.
    pub(crate) observer: Option<&'a mut dyn FfnObserver>,
    /// Where the time goes, when profiling.
    pub(crate) laps: Laps<'a>,
    /// The device beside the CPU, if any.
    pub(crate) device: Option<&'a dyn Device>,
    /// Active neurons computed on the device and on the CPU (the engine's running totals).
    pub(crate) counters: Option<&'a (AtomicU64, AtomicU64)>,
    /// Which neurons the device holds and computes in each layer (held locked for the
    /// evaluation).
    pub(crate) balance: Option<&'a mut Balance>,
    /// Buffers.
    pub(crate) buf: Buffers,
}

impl<'a> Step<'a> {
    /// The state of evaluating `t` tokens at `positions` of `model`.
    pub(crate) fn new(
        model: &'a Model,
        mm: &'a MatMul<'a>,
        opts: ExecOptions,
        t: usize,
        positions: Vec<usize>,
        segments: &'a [Segment<'a>],
        starts: Vec<usize>,
    ) -> Step<'a> {
        let hp = &model.hparams;
        let rope = rope_of(hp);
        Step {
            mm,
            opts,
            hp,
            act: model.ffn_act,
            t,
            positions,
            segments,
            starts,
            rope,
            ap: AttentionParams::new(hp.n_head, hp.n_head_kv, hp.head_dim()),
            density: vec![0.0; t],
            observer: None,
            laps: Laps::new(None),
            device: None,
            counters: None,
            balance: None,
            buf: Buffers::default(),
        }
    }
}

/// The model's RoPE (`None` for `opt`, whose positions are learned embeddings).
pub(crate) fn rope_of(hp: &Hparams) -> Option<RopeParams> {
    match hp.arch {
        Arch::Llama | Arch::Bamboo => Some(RopeMode::Normal),
        Arch::Falcon => Some(RopeMode::NeoX),
        Arch::Opt => None,
    }
    .map(|mode| RopeParams {
        n_dims: hp.n_rot,
        mode,
        freq_base: hp.rope_freq_base,
        freq_scale: hp.rope_freq_scale,
    })
}

/// One layer as the executor runs it: its index, the file's data, the kernel views and the
/// learned thread split.
pub(crate) struct LayerRun<'a, 'm> {
    /// Layer index.
    pub(crate) index: usize,
    /// Norms and biases.
    pub(crate) layer: &'a Layer,
    /// Kernel views of its matrices.
    pub(crate) mats: &'a LayerMats<'m>,
    /// Where its one-token sparse FFN cuts the neurons among threads.
    pub(crate) split: &'a FusedSplit,
}

/// RMSNorm (a norm without bias) or LayerNorm (with bias) of every row of `x`.
pub(crate) fn norm(x: &[f32], n: &Norm, eps: f32, out: &mut [f32]) -> Result<()> {
    match &n.bias {
        None => rms_norm(x, &n.weight, eps, out)?,
        Some(b) => layer_norm(x, &n.weight, b, eps, out)?,
    }
    Ok(())
}

/// Adds `bias` (if any) to every row of `rows`.
pub(crate) fn add_bias(rows: &mut [f32], bias: Option<&[f32]>) -> Result<()> {
    if let Some(b) = bias {
        for r in rows.chunks_exact_mut(b.len()) {
            add(r, b)?;
        }
    }
    Ok(())
}
