//! f64 definitions of the non-matrix operators of [`crate::ops`].
//!
//! Inputs are the f32 / f16 values the kernels receive, widened exactly to f64; every operation
//! then runs in f64 with the textbook formula, and results are returned as `Vec<f64>`. Where a
//! kernel deliberately copies a rounding point of llama.cpp (RoPE angles, see
//! [`crate::ops::rope`]), the reference still uses the exact formula and the tests bound the
//! difference.

use half::f16;

use crate::ops::rope::RopeMode;

/// RMSNorm of each row of `weight.len()` values of `x`: `x_i / sqrt(mean(x²) + eps) · w_i`.
/// `weight` must be non-empty and divide `x.len()` (this reference does not validate).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64) -> Vec<f64> {
    let n = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
        let r = 1.0 / (ms + eps).sqrt();
        out.extend(
            row.iter()
                .zip(weight)
                .map(|(&v, &w)| f64::from(v) * r * f64::from(w)),
        );
    }
    out
}

/// LayerNorm of each row of `weight.len()` values of `x`:
/// `(x_i − mean) / sqrt(var + eps) · w_i + b_i` with the population variance.
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f64) -> Vec<f64> {
    let n = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n as f64;
        let r = 1.0 / (var + eps).sqrt();
        out.extend(
            row.iter()
                .zip(weight.iter().zip(bias))
                .map(|(&v, (&w, &b))| (f64::from(v) - mean) * r * f64::from(w) + f64::from(b)),
        );
    }
    out
}

/// The exact RoPE angle of pair `i`: `pos · freq_scale · freq_base^(−2i / n_dims)`.
pub fn rope_theta(pos: usize, i: usize, n_dims: usize, freq_base: f64, freq_scale: f64) -> f64 {
    pos as f64 * freq_scale * freq_base.powf(-2.0 * i as f64 / n_dims as f64)
}

/// RoPE of one token at position `pos`: `x` holds `n_heads × head_dim` values; in each head the
/// first `n_dims` are rotated pairwise by [`rope_theta`] (pairs `(2i, 2i+1)` for
/// [`RopeMode::Normal`], `(i, i + n_dims/2)` for [`RopeMode::NeoX`]) and the rest are copied.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    x: &[f32],
    n_heads: usize,
    head_dim: usize,
    pos: usize,
    n_dims: usize,
    mode: RopeMode,
    freq_base: f64,
    freq_scale: f64,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
    let half = n_dims / 2;
    for h in 0..n_heads {
        let head = &mut out[h * head_dim..(h + 1) * head_dim];
        for i in 0..half {
            let theta = rope_theta(pos, i, n_dims, freq_base, freq_scale);
            let (c, s) = (theta.cos(), theta.sin());
            let (ia, ib) = match mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::NeoX => (i, i + half),
            };
            let (a, b) = (head[ia], head[ib]);
            head[ia] = a * c - b * s;
            head[ib] = a * s + b * c;
        }
    }
    out
}

/// Softmax of `scale · x`: `exp(scale·x_i − m) / Σ exp(scale·x_j − m)`; `-inf` entries give 0 and
/// a row of only `-inf` gives zeros.
pub fn softmax(x: &[f32], scale: f64) -> Vec<f64> {
    let s: Vec<f64> = x.iter().map(|&v| f64::from(v) * scale).collect();
    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return vec![0.0; x.len()];
    }
    let e: Vec<f64> = s.iter().map(|&v| (v - m).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|v| v / sum).collect()
}

/// ReLU: `max(x, 0)`.
pub fn relu(x: f64) -> f64 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// SiLU: `x / (1 + e^(−x))`.
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation: `0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh(x: f64) -> f64 {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
}

/// Attention of one token over every row of the caches: for query head `h`, kv head
/// `h / (n_head / n_kv_head)`, `s_p = scale · q_h · K[p]`, `w = softmax(s)`, `out_h = Σ w_p V[p]`.
/// `k` and `v` are `[n_pos][n_kv_head][head_dim]` (see [`crate::ops::attention`]); the result
/// has `n_head · head_dim` values. The same as [`attention_block`] of one token.
pub fn attention(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    scale: f64,
) -> Vec<f64> {
    attention_block(q, k, v, 1, n_head, n_kv_head, head_dim, scale)
}

/// Causal attention of the last `n_tokens` rows of the caches: token `t` (queries
/// `q[t·n_head·head_dim ..]`) attends to rows `0..=n_pos − n_tokens + t` as [`attention`]
/// describes.
#[allow(clippy::too_many_arguments)]
pub fn attention_block(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    n_tokens: usize,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    scale: f64,
) -> Vec<f64> {
    let kv_row = n_kv_head * head_dim;
    let n_pos = k.len() / kv_row;
    let p0 = n_pos - n_tokens;
    let q_len = n_head * head_dim;
    let group = n_head / n_kv_head;
    let mut out = vec![0f64; n_tokens * q_len];
    for (t, (q, out)) in q
        .chunks_exact(q_len)
        .zip(out.chunks_exact_mut(q_len))
        .enumerate()
    {
        let n_pos = p0 + t + 1;
        for h in 0..n_head {
            let off = (h / group) * head_dim;
            let qh = &q[h * head_dim..(h + 1) * head_dim];
            let s: Vec<f64> = (0..n_pos)
                .map(|p| {
                    let kh = &k[p * kv_row + off..][..head_dim];
                    scale
                        * qh.iter()
                            .zip(kh)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b.to_f32()))
                            .sum::<f64>()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            let oh = &mut out[h * head_dim..(h + 1) * head_dim];
            for (p, &wp) in w.iter().enumerate() {
                let vh = &v[p * kv_row + off..][..head_dim];
                for (o, &x) in oh.iter_mut().zip(vh) {
                    *o += wp / sum * f64::from(x.to_f32());
                }
            }
        }
    }
    out
}

/// Causal attention over KV caches of any type ([`crate::ops::attention_kv::attention_kv`]):
/// `k` and `v` are the caches' exact values (dequantized, row-major
/// `[n_pos][n_kv_head][head_dim]`) and `k_ty` K's type, which fixes the queries the scores
/// multiply: per head quantized as the activation of a `k_ty` matrix
/// ([`super::matmul::quantize_activation`]: 8-bit blocks for Q8_0 and Q4_0) or exact (F16, F32,
/// BF16 caches). Token `t` attends to rows `0..=n_pos − n_tokens + t`.
#[allow(clippy::too_many_arguments)]
pub fn attention_kv(
    q: &[f32],
    k_ty: powerinfer_gguf::GgmlType,
    k: &[f64],
    v: &[f64],
    n_tokens: usize,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    scale: f64,
) -> Vec<f64> {
    let kv_row = n_kv_head * head_dim;
    let n_pos = k.len() / kv_row;
    let p0 = n_pos - n_tokens;
    let q_len = n_head * head_dim;
    let group = n_head / n_kv_head;
    let exact = matches!(
        k_ty,
        powerinfer_gguf::GgmlType::F16
            | powerinfer_gguf::GgmlType::F32
            | powerinfer_gguf::GgmlType::BF16
    );
    let mut out = vec![0f64; n_tokens * q_len];
    for t in 0..n_tokens {
        let n = p0 + t + 1;
        for h in 0..n_head {
            let off = (h / group) * head_dim;
            let qh = &q[t * q_len + h * head_dim..][..head_dim];
            let qh: Vec<f64> = if exact {
                qh.iter().map(|&x| f64::from(x)).collect()
            } else {
                super::matmul::quantize_activation(k_ty, qh)
            };
            let s: Vec<f64> = (0..n)
                .map(|p| {
                    let kh = &k[p * kv_row + off..][..head_dim];
                    scale * qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|&x| (x - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            let oh = &mut out[t * q_len + h * head_dim..][..head_dim];
            for (p, &wp) in w.iter().enumerate() {
                let vh = &v[p * kv_row + off..][..head_dim];
                for (o, &x) in oh.iter_mut().zip(vh) {
                    *o += wp / sum * x;
                }
            }
        }
    }
    out
}
