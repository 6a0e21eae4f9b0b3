//! The forward pass of a block of tokens of one sequence on the CPU kernels.
//!
//! Per layer: RMSNorm → Q/K/V products (GEMM over the block) → RoPE (mode 0) → append K/V to
//! the F16 cache → causal attention (GQA) → `attn_output` → residual (`ffn_inp`) → RMSNorm →
//! FFN → residual. Then the output norm and the output head.
//!
//! FFN of a PowerInfer file (spec §4, §5.4): predictor scores `p = fc2 · ReLU(fc1 · ffn_inp)`
//! (on the pre-norm residual), neuron `i` is active for a token when `p_i ≥ θ`; `up` and `gate`
//! are row-sparse products over the normalized input (for a prompt block, per token over the
//! union of the block's active rows, [`MatMul::sparse_gemm`]), then the activation, then the
//! sparse axpy over `ffn_down_t` restricted to each token's active neurons. With
//! [`ForwardOptions::dense`] every neuron is computed instead (for comparison): `up` and `gate`
//! are full GEMMs and the axpy walks all `n_ff` rows.

use powerinfer_kernels_cpu::ops::activation::{add, drelu, reglu, relu, swiglu};
use powerinfer_kernels_cpu::ops::attention::{attention_block, AttentionParams};
use powerinfer_kernels_cpu::ops::norm::rms_norm;
use powerinfer_kernels_cpu::ops::rope::{rope_block, RopeMode, RopeParams};
use powerinfer_kernels_cpu::{MatMul, RowSelect, ThreadPool};

use crate::error::Result;
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{Ffn, FfnAct, Layer, Model};

/// In dense mode, zero activations are passed to the axpy kernel as this value so that it does
/// not skip their rows (it skips exact zeros): every neuron's row is then read and added, as a
/// dense product would. `1e-30 · w` is below half an ulp of any output larger than ~1e-22 in
/// magnitude, so the result is unchanged.
const DENSE_TOUCH: f32 = 1e-30;

/// How the FFN of a PowerInfer file is computed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForwardOptions {
    /// Predictor threshold θ (a neuron is active when its score is ≥ θ).
    pub threshold: f32,
    /// Compute every neuron (ignore the predictor).
    pub dense: bool,
}

/// The result of evaluating a block.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalOutput {
    /// Logits, `n_vocab` per row: one row per token of the block, or only the last token's.
    pub logits: Vec<f32>,
    /// Per token, the mean over layers of the share of FFN neurons computed (1 for dense FFNs).
    pub density: Vec<f32>,
}

/// Evaluates `tokens` as the next positions of `seq`, appending their keys and values to the
/// cache. `all_logits`: return the logits of every token, else only of the last one.
///
/// On an error the tokens are not counted in the sequence's position, but some layers may hold
/// their K/V rows: clear the sequence before using it again.
pub fn eval(
    model: &Model,
    pool: &ThreadPool,
    opts: ForwardOptions,
    cache: &mut KvCache,
    seq: SeqId,
    tokens: &[u32],
    all_logits: bool,
) -> Result<EvalOutput> {
    let hp = &model.hparams;
    let t = tokens.len();
    if t == 0 {
        return Ok(EvalOutput {
            logits: Vec::new(),
            density: Vec::new(),
        });
    }
    cache.reserve(seq, t)?;
    let p0 = cache.pos(seq)?;
    let positions: Vec<usize> = (p0..p0 + t).collect();
    let ne = hp.n_embd;
    let nkv = hp.n_embd_kv();
    let hd = hp.head_dim();
    let eps = hp.rms_eps;
    let mm = MatMul::new(pool);

    let mut x = vec![0f32; t * ne];
    for (row, &tok) in x.chunks_exact_mut(ne).zip(tokens) {
        model.embed(tok, row)?;
    }
    let mut cur = vec![0f32; t * ne];
    let mut q = vec![0f32; t * ne];
    let mut k = vec![0f32; t * nkv];
    let mut v = vec![0f32; t * nkv];
    let mut attn = vec![0f32; t * ne];
    let mut tmp = vec![0f32; t * ne];
    let rope = RopeParams {
        n_dims: hp.n_rot,
        mode: RopeMode::Normal,
        freq_base: hp.rope_freq_base,
        freq_scale: hp.rope_freq_scale,
    };
    let ap = AttentionParams::new(hp.n_head, hp.n_head_kv, hd);
    let mut density = vec![0f32; t];
    let mut ffn = FfnScratch::default();

    for (l, layer) in model.layers.iter().enumerate() {
        rms_norm(&x, &layer.attn_norm, eps, &mut cur)?;
        mm.gemm(&model.weights(&layer.wq)?, &cur, t, &mut q)?;
        mm.gemm(&model.weights(&layer.wk)?, &cur, t, &mut k)?;
        mm.gemm(&model.weights(&layer.wv)?, &cur, t, &mut v)?;
        rope_block(&mut q, hp.n_head, hd, &positions, &rope)?;
        rope_block(&mut k, hp.n_head_kv, hd, &positions, &rope)?;
        cache.append(seq, l, &k, &v)?;
        let (kc, vc) = cache.layer(seq, l)?;
        attention_block(pool, &q, kc, vc, t, &ap, &mut attn)?;
        mm.gemm(&model.weights(&layer.wo)?, &attn, t, &mut tmp)?;
        add(&mut x, &tmp)?; // x = ffn_inp
        rms_norm(&x, &layer.ffn_norm, eps, &mut cur)?;
        ffn_forward(
            model,
            &mm,
            opts,
            layer,
            &x,
            &cur,
            t,
            &mut ffn,
            &mut tmp,
            &mut density,
        )?;
        add(&mut x, &tmp)?;
    }
    cache.advance(seq, t)?;

    let n_layer = model.layers.len().max(1) as f32;
    density.iter_mut().for_each(|d| *d /= n_layer);
    let first = if all_logits { 0 } else { t - 1 };
    let n_out = t - first;
    let mut normed = vec![0f32; n_out * ne];
    rms_norm(&x[first * ne..], &model.output_norm, eps, &mut normed)?;
    let mut logits = vec![0f32; n_out * hp.n_vocab];
    mm.gemm(&model.weights(&model.output)?, &normed, n_out, &mut logits)?;
    Ok(EvalOutput { logits, density })
}

#[derive(Default)]
struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    hidden: Vec<f32>,
    scores: Vec<f32>,
    active: Vec<u32>,
}

fn resize(v: &mut Vec<f32>, n: usize) {
    v.clear();
    v.resize(n, 0.0);
}

fn activate(act: FfnAct, gate: &mut [f32], up: &[f32]) -> Result<()> {
    match act {
        FfnAct::Reglu => reglu(gate, up)?,
        FfnAct::Drelu => drelu(gate, up)?,
        FfnAct::Swiglu => swiglu(gate, up)?,
    }
    Ok(())
}

/// `out = FFN(cur)` for `t` tokens (`h` = `ffn_inp`, the predictor input); adds each token's
/// share of computed neurons (this layer) to `density`.
#[allow(clippy::too_many_arguments)]
fn ffn_forward(
    model: &Model,
    mm: &MatMul<'_>,
    opts: ForwardOptions,
    layer: &Layer,
    h: &[f32],
    cur: &[f32],
    t: usize,
    s: &mut FfnScratch,
    out: &mut [f32],
    density: &mut [f32],
) -> Result<()> {
    let nff = model.hparams.n_ff;
    let ne = model.hparams.n_embd;
    resize(&mut s.gate, t * nff);
    resize(&mut s.up, t * nff);
    match &layer.ffn {
        Ffn::Dense { gate, up, down } => {
            mm.gemm(&model.weights(gate)?, cur, t, &mut s.gate)?;
            mm.gemm(&model.weights(up)?, cur, t, &mut s.up)?;
            activate(model.ffn_act, &mut s.gate, &s.up)?;
            mm.gemm(&model.weights(down)?, &s.gate, t, out)?;
            density.iter_mut().for_each(|d| *d += 1.0);
        }
        Ffn::Sparse {
            gate, up, down_t, ..
        } if opts.dense => {
            mm.gemm(&model.weights(gate)?, cur, t, &mut s.gate)?;
            mm.gemm(&model.weights(up)?, cur, t, &mut s.up)?;
            activate(model.ffn_act, &mut s.gate, &s.up)?;
            let all: Vec<u32> = (0..nff as u32).collect();
            let down = model.weights(down_t)?;
            out.fill(0.0);
            for (a, y) in s.gate.chunks_exact_mut(nff).zip(out.chunks_exact_mut(ne)) {
                a.iter_mut()
                    .filter(|a| **a == 0.0)
                    .for_each(|a| *a = DENSE_TOUCH);
                mm.sparse_axpy_indexed(&down, a, &all, y)?;
            }
            density.iter_mut().for_each(|d| *d += 1.0);
        }
        Ffn::Sparse {
            gate,
            up,
            down_t,
            fc1,
            fc2,
        } => {
            let r = fc1.rows;
            resize(&mut s.hidden, t * r);
            resize(&mut s.scores, t * nff);
            mm.gemm(&model.weights(fc1)?, h, t, &mut s.hidden)?;
            relu(&mut s.hidden);
            mm.gemm(&model.weights(fc2)?, &s.hidden, t, &mut s.scores)?;
            out.fill(0.0);
            if t == 1 {
                // One token: the active list once, then the indexed kernels (the axpy's
                // four-row fast path).
                s.active.clear();
                s.active
                    .extend((0..nff as u32).filter(|&i| s.scores[i as usize] >= opts.threshold));
                mm.sparse_gemv_indexed(&model.weights(gate)?, cur, &s.active, &mut s.gate)?;
                mm.sparse_gemv_indexed(&model.weights(up)?, cur, &s.active, &mut s.up)?;
                activate(model.ffn_act, &mut s.gate, &s.up)?;
                mm.sparse_axpy_indexed(&model.weights(down_t)?, &s.gate, &s.active, out)?;
            } else {
                let select = RowSelect {
                    scores: &s.scores,
                    threshold: opts.threshold,
                    skip: None,
                };
                mm.sparse_gemm(&model.weights(gate)?, cur, t, &select, &mut s.gate)?;
                mm.sparse_gemm(&model.weights(up)?, cur, t, &select, &mut s.up)?;
                activate(model.ffn_act, &mut s.gate, &s.up)?;
                mm.sparse_axpy_batch(&model.weights(down_t)?, &s.gate, t, &select, out)?;
            }
            for (d, p) in density.iter_mut().zip(s.scores.chunks_exact(nff)) {
                let active = p.iter().filter(|&&p| p >= opts.threshold).count();
                *d += active as f32 / nff as f32;
            }
        }
    }
    Ok(())
}
