//! F16 and BF16 encoding and decoding.

use super::{check_len, QuantError};
use crate::GgmlType;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// f32 to IEEE half precision, rounding to nearest, ties to even (as numpy's `astype(float16)`
/// and ggml's `GGML_FP32_TO_FP16`). Out-of-range values become infinities.
#[inline]
pub fn f32_to_f16(x: f32) -> f16 {
    f16::from_f32(x)
}

/// f32 to bfloat16 as ggml does it: NaNs become quiet NaNs that keep the sign and the top
/// payload bits, everything else is rounded to nearest, ties to even (overflow gives infinity).
#[inline]
pub fn f32_to_bf16(x: f32) -> bf16 {
    let n = x.to_bits();
    let n = if n & 0x7fff_ffff > 0x7f80_0000 {
        (n & 0xffff_0000) | 0x0040_0000
    } else {
        n
    };
    // Cannot overflow: the largest finite pattern 0xff7f_ffff plus 0x8000 stays below 2^32,
    // and a NaN's low half is zero here.
    let rounded = n + 0x7fff + ((n >> 16) & 1);
    bf16::from_bits((rounded >> 16) as u16)
}

/// f32 to IEEE half-precision bits, rounding to nearest, ties to even; the same result as
/// [`f32_to_f16`] (and x86's `vcvtps2ph`): overflow gives infinity, NaNs stay NaNs of the same
/// sign with the quiet bit set and the top payload bits kept.
///
/// Plain integer code that inlines: the block quantizers convert one scale per block, where
/// `half`'s run-time dispatch to an out-of-line F16C routine would cost more than the rest.
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let a = bits & 0x7fff_ffff;
    if a >= 0x7f80_0000 {
        // Infinity, or NaN: quiet, top payload bits.
        let nan = if a > 0x7f80_0000 {
            0x0200 | ((a >> 13) & 0x03ff) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    if a >= 0x4780_0000 {
        // 2^16 and above: beyond the largest finite half even before rounding.
        return sign | 0x7c00;
    }
    if a >= 0x3880_0000 {
        // Normal half (2^-14 and above): rebias the exponent by 127 - 15 and round off 13 bits.
        // A carry out of the mantissa correctly bumps the exponent, up to infinity.
        let r = a - 0x3800_0000;
        let h = r >> 13;
        let rem = r & 0x1fff;
        let up = u32::from(rem > 0x1000 || (rem == 0x1000 && h & 1 == 1));
        return sign | (h + up) as u16;
    }
    if a < 0x3300_0000 {
        // Below 2^-25 (half the smallest subnormal): rounds to zero.
        return sign;
    }
    // Half subnormal: the value in units of 2^-24 is the 24-bit significand shifted right by
    // 126 - exponent (14..=24 places), rounded to nearest even. A carry gives the smallest normal.
    let e = a >> 23;
    let m = (a & 0x007f_ffff) | 0x0080_0000;
    let shift = 126 - e;
    let h = m >> shift;
    let rem = m & ((1 << shift) - 1);
    let halfway = 1 << (shift - 1);
    let up = u32::from(rem > halfway || (rem == halfway && h & 1 == 1));
    sign | (h + up) as u16
}

/// IEEE half-precision bits to f32, exactly (NaN payloads are kept as they are, not quieted).
///
/// Inlined integer code with two selects; used for the block scales instead of `half`'s
/// conversion, which dispatches at run time to an out-of-line routine on every call. No
/// subnormal f32 is ever an operand, so a flush-to-zero/denormals-are-zero FPU mode cannot
/// change the result.
#[inline(always)]
pub fn f16_bits_to_f32(h: u16) -> f32 {
    let h = u32::from(h);
    let sign = (h & 0x8000) << 16;
    // Exponent and mantissa moved into f32 position, exponent rebiased from 15 to 127.
    let shifted = (h & 0x7fff) << 13;
    let exponent = shifted & 0x0f80_0000;
    let mut bits = shifted + 0x3800_0000;
    if exponent == 0x0f80_0000 {
        // Infinity or NaN: on to the all-ones exponent.
        bits += 0x3800_0000;
    }
    if exponent == 0 {
        // Zero or subnormal: read as 2^-14 * (1 + m / 1024) and subtract 2^-14, exactly.
        bits = (f32::from_bits(bits + 0x0080_0000) - f32::from_bits(0x3880_0000)).to_bits();
    }
    f32::from_bits(bits | sign)
}

/// bfloat16 to f32 (exact).
#[inline]
pub fn bf16_to_f32(x: bf16) -> f32 {
    f32::from_bits(u32::from(x.to_bits()) << 16)
}

/// Converts `src` to f32 into `dst`, which must have the same length.
pub fn f16_to_f32_slice(src: &[f16], dst: &mut [f32]) -> Result<(), QuantError> {
    check_len(GgmlType::F16, src.len(), dst.len(), "values")?;
    src.convert_to_f32_slice(dst);
    Ok(())
}

/// Converts `src` to f16 ([`f32_to_f16`]) into `dst`, which must have the same length.
pub fn f32_to_f16_slice(src: &[f32], dst: &mut [f16]) -> Result<(), QuantError> {
    check_len(GgmlType::F16, src.len(), dst.len(), "values")?;
    dst.convert_from_f32_slice(src);
    Ok(())
}

/// Converts `src` to f32 into `dst`, which must have the same length.
pub fn bf16_to_f32_slice(src: &[bf16], dst: &mut [f32]) -> Result<(), QuantError> {
    check_len(GgmlType::BF16, src.len(), dst.len(), "values")?;
    for (o, x) in dst.iter_mut().zip(src) {
        *o = bf16_to_f32(*x);
    }
    Ok(())
}

/// Converts `src` to bfloat16 ([`f32_to_bf16`]) into `dst`, which must have the same length.
pub fn f32_to_bf16_slice(src: &[f32], dst: &mut [bf16]) -> Result<(), QuantError> {
    check_len(GgmlType::BF16, src.len(), dst.len(), "values")?;
    for (o, x) in dst.iter_mut().zip(src) {
        *o = f32_to_bf16(*x);
    }
    Ok(())
}

/// Applies `f` to each little-endian u16 of `src` (any alignment), writing `dst`;
/// `src.len() == 2 * dst.len()` (checked by the caller). Misaligned input goes through a small
/// aligned buffer, so both paths are plain vectorizable loops.
#[inline(always)]
fn map_u16_bytes(src: &[u8], dst: &mut [f32], f: impl Fn(u16) -> f32) {
    match bytemuck::try_cast_slice::<u8, u16>(src) {
        Ok(words) => {
            for (o, &w) in dst.iter_mut().zip(words) {
                *o = f(w);
            }
        }
        Err(_) => {
            let mut buf = [0u16; 256];
            for (out, bytes) in dst.chunks_mut(256).zip(src.chunks(512)) {
                let words = &mut buf[..out.len()];
                bytemuck::cast_slice_mut::<u16, u8>(words).copy_from_slice(bytes);
                for (o, &w) in out.iter_mut().zip(words.iter()) {
                    *o = f(w);
                }
            }
        }
    }
}

/// Little-endian f16 bytes of any alignment to f32; `src.len() == 2 * dst.len()` (checked by
/// the caller). Uses `half`'s slice conversion (F16C instructions where the CPU has them, 8
/// values per dispatch), which is about twice as fast as a loop over [`f16_bits_to_f32`].
pub(crate) fn f16_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, f16>(src) {
        Ok(halves) => halves.convert_to_f32_slice(dst),
        Err(_) => {
            let mut buf = [f16::ZERO; 256];
            for (out, bytes) in dst.chunks_mut(256).zip(src.chunks(512)) {
                let halves = &mut buf[..out.len()];
                bytemuck::cast_slice_mut::<f16, u8>(halves).copy_from_slice(bytes);
                halves.convert_to_f32_slice(out);
            }
        }
    }
}

/// Little-endian bf16 bytes of any alignment to f32; `src.len() == 2 * dst.len()`.
pub(crate) fn bf16_bytes_to_f32(src: &[u8], dst: &mut [f32]) {
    map_u16_bytes(src, dst, |w| f32::from_bits(u32::from(w) << 16));
}

/// f32 to little-endian f16 bytes of any alignment; `dst.len() == 2 * src.len()`.
pub(crate) fn f32_to_f16_bytes(src: &[f32], dst: &mut [u8]) {
    match bytemuck::try_cast_slice_mut::<u8, f16>(dst) {
        Ok(halves) => halves.convert_from_f32_slice(src),
        Err(_) => {
            for (c, x) in dst.chunks_exact_mut(2).zip(src) {
                c.copy_from_slice(&f32_to_f16(*x).to_le_bytes());
            }
        }
    }
}

/// f32 to little-endian bf16 bytes of any alignment; `dst.len() == 2 * src.len()`.
pub(crate) fn f32_to_bf16_bytes(src: &[f32], dst: &mut [u8]) {
    for (c, x) in dst.chunks_exact_mut(2).zip(src) {
        c.copy_from_slice(&f32_to_bf16(*x).to_le_bytes());
    }
}
