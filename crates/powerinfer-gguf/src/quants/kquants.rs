//! Quantization to the K-quant weight formats Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.
//!
//! These reproduce llama.cpp's reference quantizers without an importance matrix
//! (`quantize_row_q2_K_ref` ... `quantize_row_q6_K_ref`): a per-sub-block search for the scale
//! (and, for Q2_K/Q4_K/Q5_K, the minimum) that minimizes a weighted error (absolute for Q2_K,
//! squared for the others), the sub-block scales then quantized to 4, 6 or 8 bits against f16
//! super-block scales, and the values re-quantized with the scales as stored. Float operations are those of the C
//! reference compiled without contraction into fused multiply-adds (`-ffp-contract=off`, or any
//! x86-64 build without FMA): against such a build the output is byte-identical, infinities and
//! NaNs included, which `tests/kquant_golden.rs` checks on golden files written by llama.cpp
//! itself (`scripts/kquant-golden`). Builds of llama.cpp that fuse them (`-march=native` on FMA
//! hardware) pick different scales in some blocks (a few percent of Q4_K blocks): the reference
//! itself is not platform-independent there. `gguf.quants` has no K-quant quantizers to compare
//! with.

use super::blocks::*;
use super::dequant::{k4_scales_mins, q3k_scales};
use super::quantize::{f16_from_f32, nearest_int};
use super::{f16_bits_to_f32, quantize_blocks, QuantError, QuantizeBlock};
use half::f16;

/// Sub-block maxima below this count as all-zero (llama.cpp's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Search parameters of [`scale_min_search`]: candidate inverse scales
/// `(nmax + rmin + rdelta * i) / (max - min)` for `i` in `0..=nstep`, each judged by the
/// weighted sum of squared errors, or of absolute errors with `absolute_error` (llama.cpp's
/// `use_mad`).
struct Search {
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    absolute_error: bool,
}

impl Search {
    /// The error measure of one value's difference from its reconstruction.
    #[inline(always)]
    fn error(&self, diff: f32) -> f32 {
        if self.absolute_error {
            diff.abs()
        } else {
            diff * diff
        }
    }
}

/// Weighted search for the scale and minimum of one sub-block quantized to `0..=nmax` as
/// `x ~ scale * l - the_min` (llama.cpp's `make_qkx2_quants`). Writes the levels to `l_out`
/// and returns `(scale, the_min)`.
fn scale_min_search(x: &[f32], weights: &[f32], search: &Search, l_out: &mut [u8]) -> (f32, f32) {
    let &Search {
        nmax,
        rmin,
        rdelta,
        nstep,
        ..
    } = search;
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].fill(0);
        return (0.0, -min);
    }
    let fmax = nmax as f32;
    let mut iscale = fmax / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * search.error(diff);
    }
    let mut aux = [0u8; QK_K];
    let aux = &mut aux[..n];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + fmax) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(aux[i]) + this_min - x[i];
                cur_error += weights[i] * search.error(diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(aux);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// The value of largest magnitude in `x` (the first of a tie), or `None` when that magnitude
/// is below [`GROUP_MAX_EPS`] and the sub-block quantizes to zeros.
fn signed_max(x: &[f32]) -> Option<f32> {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        let a = v.abs();
        if a > amax {
            amax = a;
            max = v;
        }
    }
    (amax >= GROUP_MAX_EPS).then_some(max)
}

/// Scale and minimum of each sub-block of `N` values of `x` (`S` of them), searched by
/// [`scale_min_search`] with the weights `weights(xs)` (levels into `levels`), and the largest
/// scale and minimum (0 when none is positive).
fn min_subs<const N: usize, const S: usize>(
    x: &[f32],
    levels: &mut [u8; QK_K],
    search: &Search,
    weights: impl Fn(&[f32]) -> [f32; N],
) -> ([f32; S], [f32; S], f32, f32) {
    let mut scales = [0.0f32; S];
    let mut mins = [0.0f32; S];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for (j, (xs, ls)) in x
        .chunks_exact(N)
        .zip(levels.chunks_exact_mut(N))
        .enumerate()
    {
        let (scale, min) = scale_min_search(xs, &weights(xs), search, ls);
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }
    (scales, mins, max_scale, max_min)
}

/// Signed scale of each sub-block of 16 values of `x` from `search` (levels into `levels`), and
/// the scale of largest magnitude (the first of a tie) with that magnitude.
fn signed_subs(
    x: &[f32],
    levels: &mut [u8; QK_K],
    search: impl Fn(&[f32], &mut [u8]) -> f32,
) -> ([f32; QK_K / 16], f32, f32) {
    let mut scales = [0.0f32; QK_K / 16];
    let mut max_scale = 0.0f32;
    let mut max_abs_scale = 0.0f32;
    for (j, (xs, ls)) in x
        .chunks_exact(16)
        .zip(levels.chunks_exact_mut(16))
        .enumerate()
    {
        let scale = search(xs, ls);
        scales[j] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    (scales, max_scale, max_abs_scale)
}

/// Re-quantizes each sub-block of `N` values of `x` to `0..=nmax` against its scale and
/// minimum as stored, `sub(j)`; a sub-block whose scale is 0 keeps its searched levels.
fn requantize_min<const N: usize>(
    x: &[f32],
    levels: &mut [u8; QK_K],
    nmax: i32,
    sub: impl Fn(usize) -> (f32, f32),
) {
    for (j, (xs, ls)) in x
        .chunks_exact(N)
        .zip(levels.chunks_exact_mut(N))
        .enumerate()
    {
        let (dl, dm) = sub(j);
        if dl == 0.0 {
            continue;
        }
        for (l, &v) in ls.iter_mut().zip(xs) {
            *l = nearest_int((v + dm) / dl).clamp(0, nmax) as u8;
        }
    }
}

/// Re-quantizes each sub-block of 16 values of `x` to `-nmax..nmax` (stored plus `nmax`) against
/// its signed scale as stored, `dl(j)`; a sub-block whose scale is 0 keeps its searched levels.
fn requantize_signed(x: &[f32], levels: &mut [u8; QK_K], nmax: i32, dl: impl Fn(usize) -> f32) {
    for (j, (xs, ls)) in x
        .chunks_exact(16)
        .zip(levels.chunks_exact_mut(16))
        .enumerate()
    {
        let dl = dl(j);
        if dl == 0.0 {
            continue;
        }
        for (l, &v) in ls.iter_mut().zip(xs) {
            *l = (nearest_int(v / dl).clamp(-nmax, nmax - 1) + nmax) as u8;
        }
    }
}

/// Search for the signed scale of one sub-block quantized to `-nmax..nmax` with weights `x^2`
/// (llama.cpp's `make_qx_quants` with `rmse_type` 1 and no importance weights). Writes the
/// levels plus `nmax` to `l_out` and returns the scale.
fn signed_scale_search(x: &[f32], nmax: i32, l_out: &mut [u8]) -> f32 {
    let n = x.len();
    let Some(max) = signed_max(x) else {
        l_out[..n].fill(0);
        return 0.0;
    };
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for i in 0..n {
        let l = level(iscale, x[i]);
        l_out[i] = (l + nmax) as u8;
        let w = x[i] * x[i];
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let lf = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (o, &v) in l_out.iter_mut().zip(x) {
                *o = (level(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Signed scale of one sub-block of Q3_K, levels `-nmax..nmax` (llama.cpp's `make_q3_quants`
/// with `do_rmse`): levels from `nmax / max|x|`, then up to five passes that move single levels
/// where that raises the `x^2`-weighted fit `sum(w x l)^2 / sum(w l^2)`. Writes the levels plus
/// `nmax` to `l_out` and returns the least-squares scale of the final levels.
fn q3_scale_search(x: &[f32], nmax: i32, l_out: &mut [u8]) -> f32 {
    let n = x.len();
    let Some(max) = signed_max(x) else {
        l_out[..n].fill(0);
        return 0.0;
    };
    let iscale = -(nmax as f32) / max;
    let mut levels = [0i32; 16];
    let levels = &mut levels[..n];
    let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
    for (l, &v) in levels.iter_mut().zip(x) {
        *l = nearest_int(iscale * v).clamp(-nmax, nmax - 1);
        let w = v * v;
        let lf = *l as f32;
        sumlx += w * v * lf;
        suml2 += w * lf * lf;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (l, &v) in levels.iter_mut().zip(x) {
            let w = v * v;
            let lf = *l as f32;
            let mut slx = sumlx - w * v * lf;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * lf * lf;
                let new_l = nearest_int(v * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != *l {
                    let nf = new_l as f32;
                    slx += w * v * nf;
                    sl2 += w * nf * nf;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *l = new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    for (o, &l) in l_out.iter_mut().zip(levels.iter()) {
        *o = (l + nmax) as u8;
    }
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// The first half of Q4_K and Q5_K: each sub-block of 32 searched for its scale and minimum
/// (levels `0..=nmax`, candidates from `rmin` in `nstep` steps of 0.1, weights
/// `rms(sub-block) + |x|`), the eight of each packed as 6-bit values against the f16
/// super-block scales `d` and `dmin`, and the values re-quantized with the scales as stored.
/// Returns `(d, dmin, packed scales)`; the levels are in `levels`.
fn k4_scales_and_levels(
    x: &[f32],
    (nmax, rmin, nstep): (i32, f32, i32),
    levels: &mut [u8; QK_K],
) -> (f16, f16, [u8; K_SCALE_SIZE]) {
    let search = Search {
        nmax,
        rmin,
        rdelta: 0.1,
        nstep,
        absolute_error: false,
    };
    let (scales, mins, max_scale, max_min) = min_subs::<32, 8>(x, levels, &search, |xs| {
        let mut sum_x2 = 0.0f32;
        for &v in xs {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        let mut weights = [0.0f32; 32];
        for (w, &v) in weights.iter_mut().zip(xs) {
            *w = av_x + v.abs();
        }
        weights
    });
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; K_SCALE_SIZE];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d = f16_from_f32(max_scale / 63.0);
    let dmin = f16_from_f32(max_min / 63.0);
    let (sc, mn) = k4_scales_mins(&packed);
    let (df, dminf) = (
        f16_bits_to_f32(d.to_bits()),
        f16_bits_to_f32(dmin.to_bits()),
    );
    requantize_min::<32>(x, levels, nmax, |j| {
        (df * f32::from(sc[j]), dminf * f32::from(mn[j]))
    });
    (d, dmin, packed)
}

impl QuantizeBlock for BlockQ4K {
    fn quantize(x: &[f32]) -> Self {
        let mut levels = [0u8; QK_K];
        let (d, dmin, scales) = k4_scales_and_levels(&x[..QK_K], (15, -1.0, 20), &mut levels);
        let mut qs = [0u8; QK_K / 2];
        for (q, l) in qs.chunks_exact_mut(32).zip(levels.chunks_exact(64)) {
            for (i, q) in q.iter_mut().enumerate() {
                *q = l[i] | (l[i + 32] << 4);
            }
        }
        BlockQ4K {
            d,
            dmin,
            scales,
            qs,
        }
    }
}

impl QuantizeBlock for BlockQ5K {
    fn quantize(x: &[f32]) -> Self {
        let mut levels = [0u8; QK_K];
        let (d, dmin, scales) = k4_scales_and_levels(&x[..QK_K], (31, -0.5, 15), &mut levels);
        // Values 64c + i and 64c + 32 + i: low nibbles in qs[32c + i], fifth bits in bits 2c
        // and 2c + 1 of qh[i].
        let mut qs = [0u8; QK_K / 2];
        let mut qh = [0u8; QK_K / 8];
        for (c, (q, l)) in qs
            .chunks_exact_mut(32)
            .zip(levels.chunks_exact(64))
            .enumerate()
        {
            for (i, q) in q.iter_mut().enumerate() {
                let (a, b) = (l[i], l[i + 32]);
                *q = (a & 0x0f) | ((b & 0x0f) << 4);
                qh[i] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1));
            }
        }
        BlockQ5K {
            d,
            dmin,
            scales,
            qh,
            qs,
        }
    }
}

impl QuantizeBlock for BlockQ2K {
    fn quantize(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let search = Search {
            nmax: 3,
            rmin: -0.5,
            rdelta: 0.1,
            nstep: 15,
            absolute_error: true,
        };
        let mut levels = [0u8; QK_K];
        let (scales, mins, max_scale, max_min) =
            min_subs::<16, 16>(x, &mut levels, &search, |xs| {
                let mut weights = [0.0f32; 16];
                for (w, &v) in weights.iter_mut().zip(xs) {
                    *w = v.abs();
                }
                weights
            });
        // Scales in the low nibbles, minimums in the high ones, 4 bits each against f16
        // super-block values.
        let mut packed = [0u8; QK_K / 16];
        let mut d = f16::ZERO;
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for (p, &scale) in packed.iter_mut().zip(&scales) {
                *p = nearest_int(iscale * scale) as u8;
            }
            d = f16_from_f32(max_scale / 15.0);
        }
        let mut dmin = f16::ZERO;
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for (p, &min) in packed.iter_mut().zip(&mins) {
                *p |= (nearest_int(iscale * min) as u8) << 4;
            }
            dmin = f16_from_f32(max_min / 15.0);
        }
        let (df, dminf) = (
            f16_bits_to_f32(d.to_bits()),
            f16_bits_to_f32(dmin.to_bits()),
        );
        requantize_min::<16>(x, &mut levels, 3, |j| {
            let p = packed[j];
            (df * f32::from(p & 0x0f), dminf * f32::from(p >> 4))
        });
        BlockQ2K {
            scales: packed,
            qs: pack_2bit(&levels),
            d,
            dmin,
        }
    }
}

/// Low 2 bits of 256 levels as Q2_K and Q3_K store them: level `128h + 32s + i` in bits
/// `2s..2s + 2` of byte `32h + i`.
fn pack_2bit(levels: &[u8; QK_K]) -> [u8; QK_K / 4] {
    let mut qs = [0u8; QK_K / 4];
    for (q, l) in qs.chunks_exact_mut(32).zip(levels.chunks_exact(128)) {
        for (i, q) in q.iter_mut().enumerate() {
            *q = (l[i] & 3)
                | ((l[i + 32] & 3) << 2)
                | ((l[i + 64] & 3) << 4)
                | ((l[i + 96] & 3) << 6);
        }
    }
    qs
}

impl QuantizeBlock for BlockQ3K {
    fn quantize(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let mut levels = [0u8; QK_K];
        let (scales, max_scale, _) =
            signed_subs(x, &mut levels, |xs, ls| q3_scale_search(xs, 4, ls));
        // Signed 6-bit sub-block scales offset by 32: low nibbles in bytes 0..8 (sub-blocks
        // 0..8 low, 8..16 high), top two bits of sub-block j in bits 2(j / 4).. of byte
        // 8 + j % 4.
        let mut packed = [0u8; 12];
        let mut d = f16::ZERO;
        // NaN counts as nonzero, as in C's `if (max_scale)`.
        if max_scale != 0.0 || max_scale.is_nan() {
            let iscale = -32.0 / max_scale;
            for (j, &scale) in scales.iter().enumerate() {
                let l = ((nearest_int(iscale * scale) as i8).clamp(-32, 31) + 32) as u8;
                if j < 8 {
                    packed[j] = l & 0x0f;
                } else {
                    packed[j - 8] |= (l & 0x0f) << 4;
                }
                packed[8 + j % 4] |= (l >> 4) << (2 * (j / 4));
            }
            d = f16_from_f32(1.0 / iscale);
        }
        let sc = q3k_scales(&packed);
        let df = f16_bits_to_f32(d.to_bits());
        requantize_signed(x, &mut levels, 4, |j| df * f32::from(sc[j] as i8 - 32));
        // The third bit of level j goes to bit j / 32 of hmask[j % 32].
        let mut hmask = [0u8; QK_K / 8];
        for (j, &l) in levels.iter().enumerate() {
            hmask[j % 32] |= (l >> 2) << (j / 32);
        }
        BlockQ3K {
            hmask,
            qs: pack_2bit(&levels),
            scales: packed,
            d,
        }
    }
}

impl QuantizeBlock for BlockQ6K {
    fn quantize(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let mut levels = [0u8; QK_K];
        let (scales, max_scale, max_abs_scale) =
            signed_subs(x, &mut levels, |xs, ls| signed_scale_search(xs, 32, ls));
        let mut block = BlockQ6K {
            ql: [0; QK_K / 2],
            qh: [0; QK_K / 4],
            scales: [0; QK_K / 16],
            d: f16::ZERO,
        };
        if max_abs_scale < GROUP_MAX_EPS {
            return block;
        }
        let iscale = -128.0 / max_scale;
        block.d = f16_from_f32(1.0 / iscale);
        for (s, &scale) in block.scales.iter_mut().zip(&scales) {
            *s = nearest_int(iscale * scale).min(127) as i8;
        }
        let df = f16_bits_to_f32(block.d.to_bits());
        requantize_signed(x, &mut levels, 32, |j| df * f32::from(block.scales[j]));
        for ((ql, qh), l) in block
            .ql
            .chunks_exact_mut(64)
            .zip(block.qh.chunks_exact_mut(32))
            .zip(levels.chunks_exact(128))
        {
            for i in 0..32 {
                let (a, b, c, e) = (l[i], l[i + 32], l[i + 64], l[i + 96]);
                ql[i] = (a & 0x0f) | ((c & 0x0f) << 4);
                ql[i + 32] = (b & 0x0f) | ((e & 0x0f) << 4);
                qh[i] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
            }
        }
        block
    }
}

/// Quantizes `src` into Q2_K blocks; `src.len()` must be `dst.len() * 256`.
pub fn quantize_row_q2_k(src: &[f32], dst: &mut [BlockQ2K]) -> Result<(), QuantError> {
    quantize_blocks(src, dst)
}

/// Quantizes `src` into Q3_K blocks; `src.len()` must be `dst.len() * 256`.
pub fn quantize_row_q3_k(src: &[f32], dst: &mut [BlockQ3K]) -> Result<(), QuantError> {
    quantize_blocks(src, dst)
}

/// Quantizes `src` into Q4_K blocks; `src.len()` must be `dst.len() * 256`.
pub fn quantize_row_q4_k(src: &[f32], dst: &mut [BlockQ4K]) -> Result<(), QuantError> {
    quantize_blocks(src, dst)
}

/// Quantizes `src` into Q5_K blocks; `src.len()` must be `dst.len() * 256`.
pub fn quantize_row_q5_k(src: &[f32], dst: &mut [BlockQ5K]) -> Result<(), QuantError> {
    quantize_blocks(src, dst)
}

/// Quantizes `src` into Q6_K blocks; `src.len()` must be `dst.len() * 256`.
pub fn quantize_row_q6_k(src: &[f32], dst: &mut [BlockQ6K]) -> Result<(), QuantError> {
    quantize_blocks(src, dst)
}
