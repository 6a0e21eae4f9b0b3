//! What every layer of one evaluation shares ([`Step`]: the kernels, the options, the batch's
//! layout, buffers), and the small helpers both halves of a layer use.

use powerinfer_kernels_cpu::ops::activation::add;
use powerinfer_kernels_cpu::ops::attention::AttentionParams;
use powerinfer_kernels_cpu::ops::norm::{layer_norm, rms_norm};
use powerinfer_kernels_cpu::ops::rope::{RopeMode, RopeParams};
use powerinfer_kernels_cpu::{AxpyCoefficients, MatMul};

use std::ops::Range;
use std::sync::Mutex;

use powerinfer_kernels_cpu::KernelError;

use super::batch::Segment;
use super::fused::{run_threads, FusedSplit};
use super::weights::LayerMats;
use crate::device::AttentionDevice;
use crate::error::Result;
use crate::model::{Arch, FfnAct, Hparams, Layer, Model, Norm};
use crate::observer::FfnObserver;
use crate::profile::Laps;
use crate::schedule::balance::Balance;

/// How the executor computes the FFN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ExecOptions {
    /// Predictor threshold θ (a neuron is active when its score is ≥ θ).
    pub(crate) threshold: f32,
    /// Compute every neuron of a PowerInfer file (ignore the predictor).
    pub(crate) dense: bool,
    /// Put a token's several row-parallel products in one thread-pool dispatch.
    pub(crate) fuse: bool,
    /// How the sparse axpy multiplies the FFN's hidden values into the down rows.
    pub(crate) axpy: AxpyCoefficients,
}

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
    /// The device's side of the attention split, if it has one.
    pub(crate) mirror: Option<&'a dyn AttentionDevice>,
    /// The run-time scheduling's state (held locked for the evaluation): the attention split.
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
            mirror: None,
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

/// Values below which the row-wise helpers ([`for_row_parts`]) run on the calling thread alone
/// (a decode step's few rows: a dispatch would cost more than the work).
pub(crate) const PARALLEL_ROW_VALUES: usize = 1 << 15;

/// Runs `f(rows, out_rows)` over `out` (rows of `width` values): split into one contiguous run
/// of rows per pool thread when `out` holds at least [`PARALLEL_ROW_VALUES`] values, else in one
/// call. Every row is computed by the same `f` whichever thread takes it, so the results do not
/// depend on the split. Returns the first error of any call.
pub(crate) fn for_row_parts<F>(mm: &MatMul<'_>, out: &mut [f32], width: usize, f: F) -> Result<()>
where
    F: Fn(Range<usize>, &mut [f32]) -> std::result::Result<(), KernelError> + Sync,
{
    let rows = out.len().checked_div(width).unwrap_or(0);
    let n = mm.pool().n_threads();
    if n == 1 || out.len() < PARALLEL_ROW_VALUES || rows < 2 || rows * width != out.len() {
        return Ok(f(0..rows, out)?);
    }
    let per = rows.div_ceil(n);
    let parts: Vec<Mutex<(usize, &mut [f32])>> = out
        .chunks_mut(per * width)
        .enumerate()
        .map(|(i, o)| Mutex::new((i * per, o)))
        .collect();
    run_threads(mm, |tid, _| match parts.get(tid) {
        Some(part) => {
            let mut part = part.lock().unwrap_or_else(|e| e.into_inner());
            let (r0, o) = &mut *part;
            let r0 = *r0;
            f(r0..r0 + o.len() / width, o)
        }
        None => Ok(()),
    })
}

/// RMSNorm (a norm without bias) or LayerNorm (with bias) of every row of `x`, the rows split
/// between the pool's threads when there are many ([`for_row_parts`]).
pub(crate) fn norm(mm: &MatMul<'_>, x: &[f32], n: &Norm, eps: f32, out: &mut [f32]) -> Result<()> {
    let one = |x: &[f32], out: &mut [f32]| match &n.bias {
        None => rms_norm(x, &n.weight, eps, out),
        Some(b) => layer_norm(x, &n.weight, b, eps, out),
    };
    let w = n.weight.len();
    if x.len() != out.len() || w == 0 {
        // The kernel's own error.
        return Ok(one(x, out)?);
    }
    for_row_parts(mm, out, w, |r, o| one(&x[r.start * w..r.end * w], o))
}

/// `a += b`, split between the pool's threads when the vectors are long ([`for_row_parts`]).
pub(crate) fn add_par(mm: &MatMul<'_>, a: &mut [f32], b: &[f32]) -> Result<()> {
    if a.len() != b.len() {
        // The kernel's own error.
        return Ok(add(a, b)?);
    }
    for_row_parts(mm, a, 1, |r, o| add(o, &b[r]))
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
