//! The forward pass of a block of tokens of one sequence on the CPU kernels.
//!
//! `llama`/`bamboo`, per layer: RMSNorm → Q/K/V products (GEMM over the block) → RoPE (mode 0)
//! → append K/V to the F16 cache → causal attention (GQA) → `attn_output` → residual
//! (`ffn_inp`) → RMSNorm → FFN → residual. Then the output norm and the output head.
//!
//! `opt`: the token embedding plus the learned position embedding (row `pos + 2`, see
//! [`Model::position_row`]), then per layer as above with LayerNorm (bias), biases on the
//! Q/K/V/output products, no RoPE, FFN `down(ReLU(up·n + b_up)) + b_down`; output head tied to
//! `token_embd`.
//!
//! `falcon` (parallel block): `n = LayerNorm(x)` (`attn_norm`); the attention reads
//! `LayerNorm_2(x)` (`attn_norm_2`) if the layer has one, else `n`; fused QKV product, NeoX
//! RoPE, attention, `attn_output`; the FFN reads `n`; `x ← (ffn + attn) + x`. The predictor
//! reads the layer input `x` (spec §4).
//!
//! FFN of a PowerInfer file (spec §4, §5.4): predictor scores `p = fc2 · ReLU(fc1 · ffn_inp)`
//! (on the pre-norm residual), neuron `i` is active for a token when `p_i ≥ θ`; `up` and `gate`
//! are row-sparse products over the normalized input (token by token over each token's list of
//! active rows, also in a block: the predictor runs once over the block), then the activation,
//! then the sparse axpy over `ffn_down_t` restricted to each token's active neurons. With
//! [`ForwardOptions::dense`] every neuron is computed instead (for comparison): `up` and `gate`
//! are full GEMMs and the axpy walks all `n_ff` rows.

use powerinfer_kernels_cpu::ops::activation::add;
use powerinfer_kernels_cpu::ops::attention::{attention_block, AttentionParams};
use powerinfer_kernels_cpu::ops::norm::{layer_norm, rms_norm};
use powerinfer_kernels_cpu::ops::rope::{rope_block, RopeMode, RopeParams};
use powerinfer_kernels_cpu::{MatMul, ThreadPool};

use crate::error::{EngineError, Result};
pub use crate::ffn::FfnObserver;
use crate::ffn::{ffn_forward, FfnScratch};
use crate::fused;
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{Arch, Model, Norm, Qkv};
use crate::profile::{Laps, Op, OpProfile};

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

/// A block of consecutive new tokens of one sequence: one entry of a batch
/// ([`eval_batch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment<'a> {
    /// The sequence the tokens continue.
    pub seq: SeqId,
    /// The tokens, evaluated as the next positions of `seq`.
    pub tokens: &'a [u32],
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
    eval_observed(model, pool, opts, cache, seq, tokens, all_logits, None)
}

/// [`eval`] with an [`FfnObserver`] that sees every layer's FFN input, true activations and
/// predictor scores. With an observer every FFN neuron is computed (the FFN runs densely, so
/// that the true activations are known); the result is that of the dense forward pass.
#[allow(clippy::too_many_arguments)]
pub fn eval_observed(
    model: &Model,
    pool: &ThreadPool,
    opts: ForwardOptions,
    cache: &mut KvCache,
    seq: SeqId,
    tokens: &[u32],
    all_logits: bool,
    observer: Option<&mut dyn FfnObserver>,
) -> Result<EvalOutput> {
    eval_one(
        model, pool, opts, cache, seq, tokens, all_logits, observer, None,
    )
}

/// [`eval`], adding the time, calls and bytes read of each operation to `prof` (see
/// [`crate::profile`]). The results are those of [`eval`].
#[allow(clippy::too_many_arguments)]
pub fn eval_profiled(
    model: &Model,
    pool: &ThreadPool,
    opts: ForwardOptions,
    cache: &mut KvCache,
    seq: SeqId,
    tokens: &[u32],
    all_logits: bool,
    prof: &mut OpProfile,
) -> Result<EvalOutput> {
    eval_one(
        model,
        pool,
        opts,
        cache,
        seq,
        tokens,
        all_logits,
        None,
        Some(prof),
    )
}

/// [`eval_segments`] on one segment.
#[allow(clippy::too_many_arguments)]
fn eval_one(
    model: &Model,
    pool: &ThreadPool,
    opts: ForwardOptions,
    cache: &mut KvCache,
    seq: SeqId,
    tokens: &[u32],
    all_logits: bool,
    observer: Option<&mut dyn FfnObserver>,
    prof: Option<&mut OpProfile>,
) -> Result<EvalOutput> {
    let segment = [Segment { seq, tokens }];
    let mut out = eval_segments(
        model, pool, opts, cache, &segment, all_logits, observer, prof,
    )?;
    Ok(out.pop().expect("one output per segment"))
}

/// Evaluates several sequences' new tokens in one pass (a decode step of many sequences, or
/// prompt blocks beside decode tokens): every weight product runs once over all the batch's
/// tokens, so each weight is read once per step instead of once per sequence; RoPE, the KV
/// cache and attention are per sequence. Returns one [`EvalOutput`] per segment, in order
/// (`all_logits`: every token's logits, else each segment's last token's).
///
/// A token's result equals that of evaluating its sequence alone up to rounding: for float
/// weights the products of several tokens sum in another order than one token's (bounds in
/// `powerinfer_kernels_cpu::matmul`); for quantized weights they are bit-identical.
///
/// Errors: a sequence twice in the batch, an unknown sequence, or a segment that does not fit
/// its context; nothing is evaluated then. On a later error, as [`eval`]: clear the batch's
/// sequences before using them again.
pub fn eval_batch(
    model: &Model,
    pool: &ThreadPool,
    opts: ForwardOptions,
    cache: &mut KvCache,
    segments: &[Segment<'_>],
    all_logits: bool,
) -> Result<Vec<EvalOutput>> {
    eval_segments(model, pool, opts, cache, segments, all_logits, None, None)
}

#[allow(clippy::too_many_arguments)]
fn eval_segments(
    model: &Model,
    pool: &ThreadPool,
    opts: ForwardOptions,
    cache: &mut KvCache,
    segments: &[Segment<'_>],
    all_logits: bool,
    mut observer: Option<&mut dyn FfnObserver>,
    prof: Option<&mut OpProfile>,
) -> Result<Vec<EvalOutput>> {
    let mut laps = Laps::new(prof);
    let hp = &model.hparams;
    // Token offsets of the segments, positions of every token.
    let mut starts = Vec::with_capacity(segments.len());
    let mut positions = Vec::new();
    let mut tokens = Vec::new();
    for (i, sg) in segments.iter().enumerate() {
        if segments[..i].iter().any(|o| o.seq == sg.seq) {
            return Err(EngineError::Invalid(format!(
                "sequence {} appears twice in one batch",
                sg.seq
            )));
        }
        cache.reserve(sg.seq, sg.tokens.len())?;
        let p0 = cache.pos(sg.seq)?;
        starts.push(tokens.len());
        positions.extend(p0..p0 + sg.tokens.len());
        tokens.extend_from_slice(sg.tokens);
    }
    let t = tokens.len();
    let empty = || EvalOutput {
        logits: Vec::new(),
        density: Vec::new(),
    };
    if t == 0 {
        return Ok(segments.iter().map(|_| empty()).collect());
    }
    let ne = hp.n_embd;
    let nkv = hp.n_embd_kv();
    let hd = hp.head_dim();
    let eps = hp.rms_eps;
    let mm = MatMul::new(pool);

    let mut x = vec![0f32; t * ne];
    for (row, &tok) in x.chunks_exact_mut(ne).zip(&tokens) {
        model.embed(tok, row)?;
    }
    let mut cur = vec![0f32; t * ne];
    if model.pos_embd.is_some() {
        for (row, &pos) in x.chunks_exact_mut(ne).zip(&positions) {
            model.add_position(pos, row, &mut cur[..ne])?;
        }
    }
    let mut q = vec![0f32; t * ne];
    let mut k = vec![0f32; t * nkv];
    let mut v = vec![0f32; t * nkv];
    let mut attn = vec![0f32; t * ne];
    let mut tmp = vec![0f32; t * ne];
    // Only for the architectures that need them (empty vectors do not allocate).
    let parallel = hp.arch == Arch::Falcon;
    let mut ffn_out = if parallel {
        vec![0f32; t * ne]
    } else {
        Vec::new()
    };
    let mut cur2 = Vec::new();
    let mut qkv = Vec::new();
    let rope = match hp.arch {
        Arch::Llama | Arch::Bamboo => Some(RopeMode::Normal),
        Arch::Falcon => Some(RopeMode::NeoX),
        Arch::Opt => None,
    }
    .map(|mode| RopeParams {
        n_dims: hp.n_rot,
        mode,
        freq_base: hp.rope_freq_base,
        freq_scale: hp.rope_freq_scale,
    });
    let ap = AttentionParams::new(hp.n_head, hp.n_head_kv, hd);
    let mut density = vec![0f32; t];
    let mut ffn = FfnScratch::default();
    laps.eval(t);
    laps.lap(Op::Other, || 0);

    for (l, layer) in model.layers.iter().enumerate() {
        norm(&x, &layer.attn_norm, eps, &mut cur)?;
        let attn_in: &[f32] = match &layer.attn_norm_2 {
            Some(n2) => {
                cur2.resize(t * ne, 0.0);
                norm(&x, n2, eps, &mut cur2)?;
                &cur2
            }
            None => &cur,
        };
        laps.lap(Op::Norm, || 0);
        match &layer.qkv {
            Qkv::Separate {
                wq,
                wk,
                wv,
                bq,
                bk,
                bv,
            } => {
                if t == 1 && fused::enabled() {
                    // One token: the three products in one dispatch.
                    model.products_one_token(
                        &mm,
                        &mut [
                            (wq, attn_in, &mut q),
                            (wk, attn_in, &mut k),
                            (wv, attn_in, &mut v),
                        ],
                    )?;
                } else {
                    model.product(&mm, wq, attn_in, t, &mut q)?;
                    model.product(&mm, wk, attn_in, t, &mut k)?;
                    model.product(&mm, wv, attn_in, t, &mut v)?;
                }
                add_bias(&mut q, bq.as_deref())?;
                add_bias(&mut k, bk.as_deref())?;
                add_bias(&mut v, bv.as_deref())?;
                laps.lap(Op::Qkv, || wq.bytes() + wk.bytes() + wv.bytes());
            }
            Qkv::Fused(w) => {
                let width = ne + 2 * nkv;
                qkv.resize(t * width, 0.0);
                model.product(&mm, w, attn_in, t, &mut qkv)?;
                for (i, row) in qkv.chunks_exact(width).enumerate() {
                    q[i * ne..(i + 1) * ne].copy_from_slice(&row[..ne]);
                    k[i * nkv..(i + 1) * nkv].copy_from_slice(&row[ne..ne + nkv]);
                    v[i * nkv..(i + 1) * nkv].copy_from_slice(&row[ne + nkv..]);
                }
                laps.lap(Op::Qkv, || w.bytes());
            }
        }
        let mut kv_bytes = 0u64;
        if let Some(rope) = &rope {
            rope_block(&mut q, hp.n_head, hd, &positions, rope)?;
            rope_block(&mut k, hp.n_head_kv, hd, &positions, rope)?;
        }
        for (sg, &s0) in segments.iter().zip(&starts) {
            let n = sg.tokens.len();
            if n == 0 {
                continue;
            }
            cache.append(
                sg.seq,
                l,
                &k[s0 * nkv..][..n * nkv],
                &v[s0 * nkv..][..n * nkv],
            )?;
            let (kc, vc) = cache.layer(sg.seq, l)?;
            kv_bytes += ((kc.len() + vc.len()) * 2) as u64;
            let (q_s, out_s) = (&q[s0 * ne..][..n * ne], &mut attn[s0 * ne..][..n * ne]);
            attention_block(pool, q_s, kc, vc, n, &ap, out_s)?;
        }
        laps.lap(Op::Attention, || kv_bytes);
        model.product(&mm, &layer.wo, &attn, t, &mut tmp)?;
        add_bias(&mut tmp, layer.bo.as_deref())?;
        laps.lap(Op::AttnOutput, || layer.wo.bytes());
        if parallel {
            // Falcon: the FFN reads attn_norm(x), the predictor the layer input x.
            ffn_forward(
                model,
                &mm,
                opts,
                l,
                layer,
                &x,
                &cur,
                t,
                &mut ffn,
                &mut ffn_out,
                &mut density,
                observer.as_deref_mut(),
                &mut laps,
            )?;
            add(&mut ffn_out, &tmp)?;
            add(&mut x, &ffn_out)?;
            laps.lap(Op::Other, || 0);
            continue;
        }
        add(&mut x, &tmp)?; // x = ffn_inp
        laps.lap(Op::Other, || 0);
        if let Some(n) = &layer.ffn_norm {
            norm(&x, n, eps, &mut cur)?;
            laps.lap(Op::Norm, || 0);
        }
        ffn_forward(
            model,
            &mm,
            opts,
            l,
            layer,
            &x,
            &cur,
            t,
            &mut ffn,
            &mut tmp,
            &mut density,
            observer.as_deref_mut(),
            &mut laps,
        )?;
        add(&mut x, &tmp)?;
        laps.lap(Op::Other, || 0);
    }
    for sg in segments {
        cache.advance(sg.seq, sg.tokens.len())?;
    }

    let n_layer = model.layers.len().max(1) as f32;
    density.iter_mut().for_each(|d| *d /= n_layer);
    // The rows whose logits are returned: every token, or each segment's last.
    let rows: Vec<usize> = if all_logits {
        (0..t).collect()
    } else {
        segments
            .iter()
            .zip(&starts)
            .filter(|(sg, _)| !sg.tokens.is_empty())
            .map(|(sg, &s0)| s0 + sg.tokens.len() - 1)
            .collect()
    };
    let n_out = rows.len();
    laps.lap(Op::Other, || 0);
    let mut normed = vec![0f32; n_out * ne];
    if rows.len() == t {
        norm(&x, &model.output_norm, eps, &mut normed)?;
    } else {
        let mut picked = vec![0f32; n_out * ne];
        for (dst, &r) in picked.chunks_exact_mut(ne).zip(&rows) {
            dst.copy_from_slice(&x[r * ne..][..ne]);
        }
        norm(&picked, &model.output_norm, eps, &mut normed)?;
    }
    laps.lap(Op::Norm, || 0);
    let nv = hp.n_vocab;
    let mut logits = vec![0f32; n_out * nv];
    model.product(&mm, &model.output, &normed, n_out, &mut logits)?;
    laps.lap(Op::OutputHead, || model.output.bytes());
    let mut outs = Vec::with_capacity(segments.len());
    let mut row = 0;
    for (sg, &s0) in segments.iter().zip(&starts) {
        let n = sg.tokens.len();
        if n == 0 {
            outs.push(empty());
            continue;
        }
        let k = if all_logits { n } else { 1 };
        outs.push(EvalOutput {
            logits: logits[row * nv..(row + k) * nv].to_vec(),
            density: density[s0..s0 + n].to_vec(),
        });
        row += k;
    }
    laps.lap(Op::Other, || 0);
    Ok(outs)
}

/// RMSNorm (a norm without bias) or LayerNorm (with bias) of every row of `x`.
fn norm(x: &[f32], n: &Norm, eps: f32, out: &mut [f32]) -> Result<()> {
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
