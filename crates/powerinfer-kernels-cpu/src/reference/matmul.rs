//! f64 definitions of the matrix kernels of [`crate::matmul`], plus the decoding of every
//! supported weight type and of the on-the-fly activation quantization.
//!
//! Matrices are `rows × cols` row-major `f64` (decode ggml data with [`dequantize`]);
//! activations and outputs use the layouts of [`crate::matmul`]: `x[t * cols + c]`,
//! products `y[t * rows + r]`, axpy outputs `y[t * cols + c]`.

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]

use half::{bf16, f16};
use powerinfer_gguf::GgmlType;

fn h(b: &[u8], off: usize) -> f64 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f64()
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K / Q5_K super-block.
fn k4_scale_min(j: usize, q: &[u8]) -> (f64, f64) {
    let (s, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (s as f64, m as f64)
}

/// Decodes one block of `ty` (its `type_size()` bytes) into its `block_size()` values, in f64
/// (products of the stored scales and integers are exact). Types outside the kernels' list
/// return `None`.
pub fn dequantize_block(ty: GgmlType, b: &[u8]) -> Option<Vec<f64>> {
    use GgmlType as T;
    let mut out = vec![0f64; ty.block_size()];
    match ty {
        T::F32 => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64,
        T::F16 => out[0] = h(b, 0),
        T::BF16 => out[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64(),
        T::Q8_0 => {
            for j in 0..32 {
                out[j] = h(b, 0) * (b[2 + j] as i8) as f64;
            }
        }
        T::Q4_0 | T::Q4_1 => {
            // Q4_0: d·(q−8); Q4_1: d·q + m. Element j: low nibble of qs[j], j+16: high nibble.
            let (off, bias, m) = if ty == T::Q4_0 {
                (2, 8.0, 0.0)
            } else {
                (4, 0.0, h(b, 2))
            };
            for j in 0..16 {
                out[j] = h(b, 0) * ((b[off + j] & 0xF) as f64 - bias) + m;
                out[j + 16] = h(b, 0) * ((b[off + j] >> 4) as f64 - bias) + m;
            }
        }
        T::Q5_0 | T::Q5_1 => {
            // Fifth bit of element j is bit j of the little-endian u32 qh.
            let (qh_off, bias, m) = if ty == T::Q5_0 {
                (2, 16.0, 0.0)
            } else {
                (4, 0.0, h(b, 2))
            };
            let qh = u32::from_le_bytes([b[qh_off], b[qh_off + 1], b[qh_off + 2], b[qh_off + 3]]);
            let qs = &b[qh_off + 4..qh_off + 20];
            for j in 0..32 {
                let low = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                let q = low as u32 | (((qh >> j) & 1) << 4);
                out[j] = h(b, 0) * (q as f64 - bias) + m;
            }
        }
        T::Q2_K | T::Q3_K => {
            // Element 128n + 32s + l: 2 low bits at bits 2s.. of qs[32n + l]; sub-block of 16:
            // element / 16. Q2_K (scales, qs, d, dmin): d·(scale nibble)·q − dmin·(min nibble).
            // Q3_K (hmask, qs, scales, d): d·(6-bit scale − 32)·(q − 4 + 4·bit 4n+s of
            // hmask[l]), the scale's low 4 bits in nibble g/8 of byte g%8, high 2 bits at bits
            // 2(g/4).. of byte 8 + g%4.
            let qs = if ty == T::Q2_K {
                &b[16..80]
            } else {
                &b[32..96]
            };
            for e in 0..256 {
                let (n, s, l, g) = (e / 128, (e % 128) / 32, e % 32, e / 16);
                let q = ((qs[32 * n + l] >> (2 * s)) & 3) as f64;
                out[e] = if ty == T::Q2_K {
                    let sc = b[g];
                    h(b, 80) * (sc & 0xF) as f64 * q - h(b, 82) * (sc >> 4) as f64
                } else {
                    let low = if g < 8 {
                        b[96 + g] & 0xF
                    } else {
                        b[96 + g - 8] >> 4
                    };
                    let high = (b[104 + g % 4] >> (2 * (g / 4))) & 3;
                    let sc = (low | (high << 4)) as f64 - 32.0;
                    let hbit = ((b[l] >> (4 * n + s)) & 1) as f64;
                    h(b, 108) * sc * (q - 4.0 + 4.0 * hbit)
                };
            }
        }
        T::Q4_K | T::Q5_K => {
            // 4 chunks of 64: sub-block 2c = low nibbles of qs[32c..32c+32], 2c+1 = high
            // nibbles; Q5_K's fifth bits: bit 2c / 2c+1 of qh[l].
            let (d, dmin) = (h(b, 0), h(b, 2));
            let scales = &b[4..16];
            let (qh, qs): (&[u8], &[u8]) = if ty == T::Q5_K {
                (&b[16..48], &b[48..176])
            } else {
                (&[], &b[16..144])
            };
            for c in 0..4 {
                for half_ in 0..2 {
                    let (sc, mn) = k4_scale_min(2 * c + half_, scales);
                    for l in 0..32 {
                        let v = qs[32 * c + l];
                        let mut q = if half_ == 0 { v & 0xF } else { v >> 4 } as u32;
                        if !qh.is_empty() {
                            q |= (((qh[l] >> (2 * c + half_)) & 1) as u32) << 4;
                        }
                        out[64 * c + 32 * half_ + l] = d * sc * q as f64 - dmin * mn;
                    }
                }
            }
        }
        T::Q6_K => {
            // Two halves of 128; in each, quarter k (0..4) of 32 takes its low 4 bits from
            // ql[64n + 32(k%2) + l] (low nibble for k<2, high for k≥2) and its high 2 bits from
            // bits 2k..2k+2 of qh[32n + l]; value − 32, times d and the i8 scale of its 16.
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(b, 208);
            for n in 0..2 {
                for k in 0..4 {
                    for l in 0..32 {
                        let byte = ql[64 * n + 32 * (k % 2) + l];
                        let low = if k < 2 { byte & 0xF } else { byte >> 4 };
                        let high = (qh[32 * n + l] >> (2 * k)) & 3;
                        let q = (low | (high << 4)) as f64 - 32.0;
                        let s = sc[8 * n + 2 * k + l / 16] as i8 as f64;
                        out[128 * n + 32 * k + l] = d * s * q;
                    }
                }
            }
        }
        _ => return None,
    }
    Some(out)
}

/// Decodes `data` (whole blocks of `ty`) into f64 values; `None` for an unsupported type or a
/// length that is not a whole number of blocks.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Option<Vec<f64>> {
    let ts = ty.type_size();
    if ts == 0 || data.len() % ts != 0 {
        return None;
    }
    let mut v = Vec::with_capacity(data.len() / ts * ty.block_size());
    for blk in data.chunks_exact(ts) {
        v.extend(dequantize_block(ty, blk)?);
    }
    Some(v)
}

/// The activation format the kernels quantize to for a weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationQuant {
    /// Activations stay f32 (F32, BF16 weights).
    None,
    /// Every value rounded to the nearest f16, ties to even (F16 weights, as ggml converts the
    /// activation of an F16 product to F16; beyond ±65504 a value becomes ±∞ as there).
    F16,
    /// Blocks of 32 (Q8_0: Q4_0, Q5_0, Q8_0 weights; Q8_1: Q4_1, Q5_1 — same values).
    Q8Blocks32,
    /// Blocks of 256 (Q8_K: K-quant weights).
    Q8Blocks256,
}

/// The activation format the product kernels use for weights of type `ty`.
pub fn activation_quant(ty: GgmlType) -> ActivationQuant {
    use GgmlType as T;
    match ty {
        T::Q8_0 | T::Q4_0 | T::Q5_0 | T::Q4_1 | T::Q5_1 => ActivationQuant::Q8Blocks32,
        T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K => ActivationQuant::Q8Blocks256,
        T::F16 => ActivationQuant::F16,
        _ => ActivationQuant::None,
    }
}

/// The activation values the product kernels actually multiply for weights of type `ty`: `x`
/// itself for F32 and BF16 weights, `x` rounded to f16 for F16 weights, else per block `d · q` with `d = max|x| / 127` (f32) and
/// `q = round(x · (1/d))` (f32 arithmetic, round half away from zero, clamped to ±127; all zero
/// when `max|x| = 0`). `x.len()` must be a multiple of the block.
pub fn quantize_activation(ty: GgmlType, x: &[f32]) -> Vec<f64> {
    let qk = match activation_quant(ty) {
        ActivationQuant::None => return x.iter().map(|&v| v as f64).collect(),
        ActivationQuant::F16 => return x.iter().map(|&v| f16::from_f32(v).to_f64()).collect(),
        ActivationQuant::Q8Blocks32 => 32,
        ActivationQuant::Q8Blocks256 => 256,
    };
    let mut out = Vec::with_capacity(x.len());
    for blk in x.chunks(qk) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for &v in blk {
            let q = (v * id).round().clamp(-127.0, 127.0);
            out.push(d as f64 * q as f64);
        }
    }
    out
}

/// The coefficients the sparse axpy multiplies the rows of a `ty` matrix by: `a` rounded to
/// f16 for F16 weights (as PowerInfer's F16 axpy converts them; a value that rounds to 0 is
/// skipped), `a` itself for every other type (the quantized axpy kernels keep f32 coefficients).
pub fn axpy_coefficients(ty: GgmlType, a: &[f32]) -> Vec<f64> {
    match activation_quant(ty) {
        ActivationQuant::F16 => quantize_activation(ty, a),
        _ => a.iter().map(|&v| v as f64).collect(),
    }
}

/// A bound on `|x[i] − quantize_activation(ty, x)[i]|` for each `i`, known without quantizing:
/// half a quantization step, `max|x_block| / 254`, plus slack for the f32 arithmetic of the
/// quantizer (relative 2⁻²⁰ of the block maximum); for F16 rounding half an f16 step,
/// `|x| · 2⁻¹¹ + 2⁻²⁵` (the second term for subnormal results; values of magnitude 65520 and
/// more, which round to infinity, are outside the bound).
pub fn activation_error_bound(ty: GgmlType, x: &[f32]) -> Vec<f64> {
    let qk = match activation_quant(ty) {
        ActivationQuant::None => return vec![0.0; x.len()],
        ActivationQuant::F16 => {
            return x
                .iter()
                .map(|&v| (v as f64).abs() * 2f64.powi(-11) + 2f64.powi(-25))
                .collect()
        }
        ActivationQuant::Q8Blocks32 => 32,
        ActivationQuant::Q8Blocks256 => 256,
    };
    let mut out = Vec::with_capacity(x.len());
    for blk in x.chunks(qk) {
        let amax = blk.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
        out.extend(std::iter::repeat_n(
            amax / 254.0 + amax * 2f64.powi(-20),
            blk.len(),
        ));
    }
    out
}

/// Whether row `i` is selected for token `t`: `scores[t·rows + i] ≥ threshold` and not
/// `skip[i]` (the definition behind [`crate::matmul::RowSelect`]).
pub fn is_selected(
    scores: &[f32],
    rows: usize,
    threshold: f32,
    skip: Option<&[bool]>,
    t: usize,
    i: usize,
) -> bool {
    scores[t * rows + i] >= threshold && !skip.is_some_and(|s| s[i])
}

/// Dense product: `y[t·rows + r] = Σ_c w[r·cols + c] · x[t·cols + c]`.
pub fn gemm(w: &[f64], rows: usize, cols: usize, x: &[f64], n_tokens: usize) -> Vec<f64> {
    let mut y = vec![0f64; rows * n_tokens];
    for t in 0..n_tokens {
        for r in 0..rows {
            y[t * rows + r] = (0..cols).map(|c| w[r * cols + c] * x[t * cols + c]).sum();
        }
    }
    y
}

/// Row-sparse product: as [`gemm`] where [`is_selected`]`(t, r)`, 0 elsewhere.
#[allow(clippy::too_many_arguments)]
pub fn sparse_gemm(
    w: &[f64],
    rows: usize,
    cols: usize,
    x: &[f64],
    n_tokens: usize,
    scores: &[f32],
    threshold: f32,
    skip: Option<&[bool]>,
) -> Vec<f64> {
    let mut y = gemm(w, rows, cols, x, n_tokens);
    for t in 0..n_tokens {
        for r in 0..rows {
            if !is_selected(scores, rows, threshold, skip, t, r) {
                y[t * rows + r] = 0.0;
            }
        }
    }
    y
}

/// Row-sparse product for one token over a list of rows: `y[r] = row_r · x` for `r` in
/// `active`, 0 elsewhere.
pub fn sparse_gemv_indexed(
    w: &[f64],
    rows: usize,
    cols: usize,
    x: &[f64],
    active: &[u32],
) -> Vec<f64> {
    let mut y = vec![0f64; rows];
    for &r in active {
        let r = r as usize;
        y[r] = (0..cols).map(|c| w[r * cols + c] * x[c]).sum();
    }
    y
}

/// Sparse axpy over the transposed matrix `w_t` (`rows` neurons × `cols` outputs):
/// `y[t·cols + c] = y0[t·cols + c] + Σ_i a[t·rows + i] · w_t[i·cols + c]` over `i` selected for
/// token `t` ([`is_selected`]) with `a[t·rows + i] ≠ 0`.
#[allow(clippy::too_many_arguments)]
pub fn sparse_axpy(
    w_t: &[f64],
    rows: usize,
    cols: usize,
    a: &[f64],
    n_tokens: usize,
    scores: &[f32],
    threshold: f32,
    skip: Option<&[bool]>,
    y0: &[f64],
) -> Vec<f64> {
    let mut y = y0.to_vec();
    for t in 0..n_tokens {
        for i in 0..rows {
            let ai = a[t * rows + i];
            if ai == 0.0 || !is_selected(scores, rows, threshold, skip, t, i) {
                continue;
            }
            for c in 0..cols {
                y[t * cols + c] += ai * w_t[i * cols + c];
            }
        }
    }
    y
}

/// Sparse axpy for one token over a list of rows: `y = y0 + Σ_{i in active, a[i] ≠ 0}
/// a[i] · w_t[i, :]`.
pub fn sparse_axpy_indexed(
    w_t: &[f64],
    cols: usize,
    a: &[f64],
    active: &[u32],
    y0: &[f64],
) -> Vec<f64> {
    let mut y = y0.to_vec();
    for &i in active {
        let i = i as usize;
        if a[i] == 0.0 {
            continue;
        }
        for c in 0..cols {
            y[c] += a[i] * w_t[i * cols + c];
        }
    }
    y
}
