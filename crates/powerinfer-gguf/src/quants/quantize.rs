//! Quantization from f32: the 32-wide formats (weights and Q8_0/Q8_1 activations) and Q8_K
//! (activations for K-quant dot products).
//!
//! Q4_0 ... Q8_0 follow `gguf.quants` exactly (see the module docs of [`super`]), including its
//! NaN handling: a NaN in a block makes its scale (and Q4_1/Q5_1 minimum) NaN and all its quants
//! 0. Only the sign and payload of such a NaN are unspecified: numpy's reductions pick them
//! differently depending on the NaN's position. Q8_1 follows llama.cpp's
//! `quantize_row_q8_1_ref`: Q8_0's arithmetic plus `s = f16(d * sum(q))`, with that code's NaN
//! handling (see `absmax_c`); Q8_K follows `quantize_row_q8_K_ref` (round half to even,
//! `-127 / max` scale, values capped at 127, NaNs skipped).

use super::blocks::*;
use super::{f32_to_f16_bits, quantize_blocks, QuantError, QuantizeBlock};
use half::f16;

/// f32 to f16, round to nearest even, inlined ([`f32_to_f16_bits`]).
#[inline(always)]
pub(crate) fn f16_from_f32(x: f32) -> f16 {
    f16::from_bits(f32_to_f16_bits(x))
}

/// Truncating f32 -> i32 conversion as x86-64's `cvttss2si` does it, which is what numpy's
/// float -> integer casts do on that platform: NaN and values outside the i32 range give
/// `i32::MIN`. Narrower integer types then take the low bits (`as u8`, `as i8`).
#[inline(always)]
fn trunc_i32(v: f32) -> i32 {
    // Computed unconditionally so that the choice below is a select, not a branch.
    let t = v as i32;
    // -2147483904 is the f32 just below -2^31.
    if v > -2_147_483_904.0 && v < 2_147_483_648.0 {
        t
    } else {
        i32::MIN
    }
}

/// `gguf.quants.np_roundf` (round half away from zero) followed by the reference's cast to
/// int8 (which wraps to the low byte), for the products `x * id` of Q8_0/Q8_1.
///
/// Those are either below 191 in magnitude (127 up to the rounding of a subnormal scale) or
/// NaN/infinite (an infinite `id` from a scale below 2^-128), where the reference's cast gives 0
/// (the low byte of `i32::MIN`). Magnitudes of 2^23 and more also give 0 here, which matches the
/// reference from 2^31 on; in between it would keep the low byte, but such products cannot
/// occur. Branch-free and without float-to-int conversions, so loops over it vectorize.
#[inline(always)]
fn round_away_i8(v: f32) -> i8 {
    const TWO23: f32 = 8_388_608.0;
    let a = v.abs();
    // For a < 2^23, a + 2^23 rounds a to an integer (ties to even) and holds it in its low
    // mantissa bits.
    let m = a + TWO23;
    let even = (m.to_bits() as i32).wrapping_sub(0x4b00_0000);
    // A tie that went down to the even neighbour goes up instead (away from zero); the
    // subtractions are exact.
    let r = even.wrapping_add(i32::from(a - (m - TWO23) == 0.5));
    let r = if v < 0.0 { r.wrapping_neg() } else { r };
    if a < TWO23 {
        r as i8
    } else {
        0
    }
}

/// llama.cpp's `nearest_int`: round half to even through the 1.5 * 2^23 magic constant
/// (exact for |v| <= 2^22; other inputs give whatever the bit trick gives, deterministically).
#[inline(always)]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let val = v + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// The value of largest magnitude, keeping its sign; the first one on ties. As numpy's
/// `argmax(abs(x))`, a NaN wins over everything (the first NaN).
#[inline(always)]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = -1.0f32;
    let mut max = 0.0f32;
    for &v in x {
        let a = v.abs();
        if a > amax || (a.is_nan() && !amax.is_nan()) {
            amax = a;
            max = v;
        }
    }
    max
}

/// Largest |x|, or a NaN if any element is NaN (as numpy's `abs(x).max()`).
///
/// Works on the bit patterns: for |x| they order as the values do, with every NaN above
/// infinity, and an integer max reduction vectorizes where a float one would not.
#[inline(always)]
fn absmax(x: &[f32]) -> f32 {
    let bits = x.iter().fold(0u32, |m, v| m.max(v.to_bits() & 0x7fff_ffff));
    f32::from_bits(bits)
}

/// Minimum and maximum, both a NaN if any element is NaN (as numpy's `min` / `max`).
#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    if min.is_nan() {
        return (min, min);
    }
    for &v in &x[1..] {
        if v.is_nan() {
            return (v, v);
        }
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// `id = 1 / d`, or 0 when `d` is zero.
#[inline(always)]
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Packs the quants `q(v)` of the 32 values of a 32-wide block: the low 4 bits of values j and
/// j + 16 in the low and high nibble of byte j, their fifth bits in bits j and j + 16 of the
/// returned u32 (Q5_0, Q5_1; always 0 for Q4_0, Q4_1, whose quants fit in 4 bits).
#[inline(always)]
fn pack_nibbles(x: &[f32], q: impl Fn(f32) -> u8) -> ([u8; QK / 2], u32) {
    let mut qs = [0u8; QK / 2];
    let mut qh = 0u32;
    for (j, ((b, &v0), &v1)) in qs
        .iter_mut()
        .zip(&x[..QK / 2])
        .zip(&x[QK / 2..QK])
        .enumerate()
    {
        let (q0, q1) = (q(v0), q(v1));
        *b = (q0 & 0x0f) | (q1 << 4);
        qh |= u32::from(q0 >> 4) << j;
        qh |= u32::from(q1 >> 4) << (j + QK / 2);
    }
    (qs, qh)
}

/// Q4_0 and Q5_0: scale `d = signed_absmax / -half` and the packed quants of
/// `min(trunc(v / d + half + 0.5), 2 * half - 1)` ([`pack_nibbles`]).
#[inline(always)]
fn quantize_offset(x: &[f32], half: u8) -> (f32, [u8; QK / 2], u32) {
    let d = signed_absmax(&x[..QK]) / -f32::from(half);
    let id = inverse(d);
    let bias = f32::from(half) + 0.5;
    let (qs, qh) = pack_nibbles(x, |v| (trunc_i32(v * id + bias) as u8).min(2 * half - 1));
    (d, qs, qh)
}

/// Q4_1 and Q5_1: scale `d = (max - min) / nmax`, minimum `min` and the packed quants of
/// `min(trunc((v - min) / d + 0.5), nmax)` ([`pack_nibbles`]).
#[inline(always)]
fn quantize_min(x: &[f32], nmax: u8) -> (f32, f32, [u8; QK / 2], u32) {
    let (min, max) = min_max(&x[..QK]);
    let d = (max - min) / f32::from(nmax);
    let id = inverse(d);
    let (qs, qh) = pack_nibbles(x, |v| (trunc_i32((v - min) * id + 0.5) as u8).min(nmax));
    (d, min, qs, qh)
}

impl QuantizeBlock for BlockQ4_0 {
    fn quantize(x: &[f32]) -> Self {
        let (d, qs, _) = quantize_offset(x, 8);
        BlockQ4_0 {
            d: f16_from_f32(d),
            qs,
        }
    }
}

impl QuantizeBlock for BlockQ4_1 {
    fn quantize(x: &[f32]) -> Self {
        let (d, min, qs, _) = quantize_min(x, 15);
        BlockQ4_1 {
            d: f16_from_f32(d),
            m: f16_from_f32(min),
            qs,
        }
    }
}

impl QuantizeBlock for BlockQ5_0 {
    fn quantize(x: &[f32]) -> Self {
        let (d, qs, qh) = quantize_offset(x, 16);
        BlockQ5_0 {
            d: f16_from_f32(d),
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

impl QuantizeBlock for BlockQ5_1 {
    fn quantize(x: &[f32]) -> Self {
        let (d, min, qs, qh) = quantize_min(x, 31);
        BlockQ5_1 {
            d: f16_from_f32(d),
            m: f16_from_f32(min),
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

/// Largest |x| as llama.cpp's `amax = MAX(amax, fabsf(v))` loop computes it: a NaN makes it
/// NaN, and the next element replaces that NaN again, so the result is NaN if the last element
/// is, else the largest magnitude after the last NaN. Vectorized fast path without NaNs.
#[inline(always)]
fn absmax_c(x: &[f32]) -> f32 {
    // `absmax` orders bit patterns, NaNs above everything: it is NaN iff there is a NaN.
    let amax = absmax(x);
    if !amax.is_nan() {
        return amax;
    }
    x.iter().fold(
        0.0f32,
        |amax, v| if amax > v.abs() { amax } else { v.abs() },
    )
}

/// Q8_0's scale and quants (shared with Q8_1, whose reference computes `amax` as `amax_fn`).
#[inline(always)]
fn q8_32(x: &[f32], amax_fn: impl Fn(&[f32]) -> f32) -> (f32, [i8; QK]) {
    let x = &x[..QK];
    let d = amax_fn(x) / 127.0;
    let id = inverse(d);
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = round_away_i8(v * id);
    }
    (d, qs)
}

impl QuantizeBlock for BlockQ8_0 {
    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = q8_32(x, absmax);
        BlockQ8_0 {
            d: f16_from_f32(d),
            qs,
        }
    }
}

impl QuantizeBlock for BlockQ8_1 {
    fn quantize(x: &[f32]) -> Self {
        let (d, qs) = q8_32(x, absmax_c);
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        BlockQ8_1 {
            d: f16_from_f32(d),
            s: f16_from_f32(sum as f32 * d),
            qs,
        }
    }
}

impl QuantizeBlock for BlockQ8K {
    fn quantize(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        // First value of largest magnitude; NaNs are skipped as in the C reference. Found on
        // bit patterns (see `absmax`; i32 so that SSE2's signed compares do the max), with NaNs
        // mapped to 0, then the sign: the first one on a +/- tie.
        let key = |v: &f32| {
            let b = (v.to_bits() & 0x7fff_ffff) as i32;
            if b > 0x7f80_0000 {
                0
            } else {
                b
            }
        };
        let amax = x.iter().map(key).fold(0i32, i32::max) as u32;
        let (mut pos, mut neg) = (false, false);
        for v in x {
            pos |= v.to_bits() == amax;
            neg |= v.to_bits() == amax | 0x8000_0000;
        }
        let max_bits = if pos && neg {
            x.iter()
                .map(|v| v.to_bits())
                .find(|b| b & 0x7fff_ffff == amax)
                .unwrap_or(amax)
        } else if neg {
            amax | 0x8000_0000
        } else {
            amax
        };
        let max = f32::from_bits(max_bits);
        let mut block = BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        };
        if amax == 0 {
            return block;
        }
        let iscale = -127.0 / max;
        for (q, &v) in block.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (s, qs) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
            *s = qs.iter().map(|&q| i16::from(q)).sum();
        }
        block.d = 1.0 / iscale;
        block
    }
}

macro_rules! row_fns {
    ($($name:ident: $block:ty),* $(,)?) => {
        $(
            #[doc = concat!(
                "Quantizes `src` into `", stringify!($block), "` blocks; `src.len()` must be ",
                "`dst.len() * ", stringify!($block), "::BLOCK`."
            )]
            pub fn $name(src: &[f32], dst: &mut [$block]) -> Result<(), QuantError> {
                quantize_blocks(src, dst)
            }
        )*
    };
}

row_fns!(
    quantize_row_q4_0: BlockQ4_0,
    quantize_row_q4_1: BlockQ4_1,
    quantize_row_q5_0: BlockQ5_0,
    quantize_row_q5_1: BlockQ5_1,
    quantize_row_q8_0: BlockQ8_0,
    quantize_row_q8_1: BlockQ8_1,
    quantize_row_q8_k: BlockQ8K,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_away_matches_definition() {
        let cases = [
            (0.5, 1),
            (-0.5, -1),
            (1.5, 2),
            (2.5, 3),
            (0.49999997, 0),
            (-2.4999998, -2),
            (126.5, 127),
            (-127.4, -127),
            (200.0, -56),
            (f32::NAN, 0),
            (f32::INFINITY, 0),
            (-3e9, 0),
            (-2_147_483_648.0, 0),
            (8_388_607.5, 0),
            (4_194_303.5, 0),
            (254.5, -1),
            (-152.5, 103),
            (-0.0, 0),
        ];
        for (v, want) in cases {
            assert_eq!(round_away_i8(v), want, "{v}");
        }
    }

    #[test]
    fn trunc_matches_x86_semantics() {
        assert_eq!(trunc_i32(16.99), 16);
        assert_eq!(trunc_i32(-0.7), 0);
        assert_eq!(trunc_i32(f32::NAN), i32::MIN);
        assert_eq!(trunc_i32(f32::NEG_INFINITY), i32::MIN);
        assert_eq!(trunc_i32(-2_147_483_648.0), i32::MIN);
        assert_eq!(trunc_i32(2_147_483_520.0), 2_147_483_520);
        assert_eq!(trunc_i32(2_147_483_648.0), i32::MIN);
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        for (v, want) in [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.7, 127),
        ] {
            assert_eq!(nearest_int(v), want, "{v}");
        }
    }

    #[test]
    fn absmax_c_follows_the_c_max_macro() {
        let nan = f32::NAN;
        assert_eq!(absmax_c(&[1.0, -4.0, 3.0]), 4.0);
        // A NaN is replaced by the next element; only a trailing NaN survives.
        assert_eq!(absmax_c(&[5.0, nan, 2.0, -3.0]), 3.0);
        assert!(absmax_c(&[5.0, 2.0, nan]).is_nan());
        assert_eq!(absmax_c(&[nan, 1.0]), 1.0);
    }

    #[test]
    fn q8_k_sign_of_max_is_the_first_ones() {
        let mut x = [0.25f32; 256];
        x[9] = -2.0;
        x[200] = 2.0;
        let b = BlockQ8K::quantize(&x);
        assert_eq!(b.d, 1.0 / (-127.0 / -2.0));
        assert_eq!((b.qs[9], b.qs[200]), (-127, 127));
        x[9] = 2.0;
        x[200] = -2.0;
        let b = BlockQ8K::quantize(&x);
        assert_eq!((b.qs[9], b.qs[200]), (-127, 127));
        assert!(b.d < 0.0);
        x[9] = f32::NAN;
        let b = BlockQ8K::quantize(&x);
        assert!(b.d > 0.0, "NaN is skipped, -2 is the max");
    }

    #[test]
    fn signed_absmax_keeps_sign_and_first_tie() {
        assert_eq!(signed_absmax(&[1.0, -3.0, 3.0, 2.0]), -3.0);
        assert_eq!(signed_absmax(&[3.0, -3.0]), 3.0);
        assert!(signed_absmax(&[1.0, f32::NAN, 5.0]).is_nan());
        assert_eq!(absmax(&[1.0, -4.0, 3.0]), 4.0);
        let payload = f32::from_bits(0xffc1_2345);
        assert!(absmax(&[1.0, payload, 5.0]).is_nan());
        let (min, max) = min_max(&[2.0, payload, 1.0]);
        assert!(min.is_nan() && max.is_nan());
        assert_eq!(
            signed_absmax(&[1.0, payload, -f32::NAN]).to_bits(),
            0xffc1_2345
        );
    }
}
