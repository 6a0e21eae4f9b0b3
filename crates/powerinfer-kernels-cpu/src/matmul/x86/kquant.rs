//! K-quant row dots (Q4_K, Q5_K, Q6_K · Q8_K) on 512-bit vectors (x86-64, AVX-512
//! F/VL/BW/VNNI), installed for [`Backend::Avx512`](crate::Backend) in place of the 256-bit
//! kernels of [`super::int`].
//!
//! The 256-bit kernels are bound by their arithmetic, not by memory: per 256-value super-block
//! they unpack the eight 6-bit scales and mins one at a time, broadcast each scale from a
//! general register, and do every product in two steps (`maddubs`, then `madd` with the scale).
//! These kernels do the same sums with fewer instructions:
//! - the 12 packed scale bytes are unpacked with word operations on three `u32`s, and
//!   `vpermd` spreads each scale to the lanes of its values;
//! - one 32-byte nibble load, broadcast to both halves of a 512-bit vector and shifted by 0 and
//!   4 bits, gives 64 values whose activations are 64 contiguous bytes (Q4_K/Q5_K); Q6_K's low
//!   bits come in 64-byte loads;
//! - one `vpdpbusd` sums four products per lane, and one `vpmaddwd` multiplies each lane by its
//!   scale (a lane's sum fits in 16 bits: at most 4 · 63 · 128);
//! - the mins (Q4_K/Q5_K) and the −32 offset (Q6_K) against the activation's group sums are one
//!   `vpmaddwd` and a horizontal integer sum.
//!
//! The dense one-token product over long rows takes `RowOps::dot_range` ([`dot_range_k`]): one
//! row after another, each thread one sequential stream, with L1 line requests
//! [`STREAM_AHEAD`] bytes ahead running on into the next rows (the sparse product's scattered
//! rows use the plain dots).
//!
//! Every integer sum is exact, and the 16 lanes fold into the 8 lanes of the 256-bit kernels
//! before the same float steps in the same order (conversion, FMA with `d · d_x` into the row's
//! accumulator, the scalar mins FMA, the final horizontal sum), so the results equal
//! [`super::int`]'s bit for bit (test `avx512_matches_avx2_bitwise`).

// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
// Block formats are defined by chunk and lane index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::common::{f16_scalar, hsums, hsums_less, range_blocks};
use crate::matmul::act::Act;
use std::arch::x86_64::*;

/// The eight 6-bit scales and the eight 6-bit mins of a Q4_K/Q5_K super-block, one per byte,
/// from its 12 packed scale bytes at `p` (ggml's layout: scales 0–3 and mins 0–3 in the low six
/// bits of bytes 0–3 and 4–7; scales and mins 4–7 from the nibbles of bytes 8–11 and the top two
/// bits of bytes 0–7).
///
/// # Safety
/// 12 readable bytes at `p`.
#[inline(always)]
unsafe fn k4_scales_mins(p: *const u8) -> (u64, u64) {
    const LOW6: u32 = 0x3f3f_3f3f;
    const LOW4: u32 = 0x0f0f_0f0f;
    const LOW2: u32 = 0x0303_0303;
    // SAFETY: 12 readable bytes at `p` (caller).
    let (u0, u1, u2) = unsafe {
        (
            std::ptr::read_unaligned(p as *const u32),
            std::ptr::read_unaligned(p.add(4) as *const u32),
            std::ptr::read_unaligned(p.add(8) as *const u32),
        )
    };
    let scales_lo = u0 & LOW6;
    let mins_lo = u1 & LOW6;
    let scales_hi = (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4);
    let mins_hi = ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4);
    (
        scales_lo as u64 | (scales_hi as u64) << 32,
        mins_lo as u64 | (mins_hi as u64) << 32,
    )
}

/// The sum of the eight i32 lanes of `v` (exact, wrapping as integer addition does).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<1>(s));
    _mm_cvtsi128_si32(s)
}

/// `Σ_g w[g] · bs[g]` over the 16 group sums of activation `a`'s super-block `b` and the 16 i16
/// lanes of `w` (exact: the products and their sum fit in i32).
///
/// # Safety
/// `a` has the group sums of super-block `b`; AVX2 available.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn group_sums_dot(a: &Act<'_>, b: usize, w: __m256i) -> i32 {
    // SAFETY: 16 i16 group sums at `b * 16` (caller).
    let bs = unsafe { _mm256_loadu_si256(a.bs.as_ptr().add(b * 16) as *const __m256i) };
    hsum_i32(_mm256_madd_epi16(bs, w))
}

/// The low and high 256-bit halves of `v` added lane by lane.
#[inline]
#[target_feature(enable = "avx512f")]
fn fold_i32(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// Adds to each `sumi[k]` the products of 64 unsigned values `q` with activation `k`'s values
/// `at..at + 64`, four per lane (`vpdpbusd`), each lane times its `scale` lane (`vpmaddwd`:
/// `scale` holds the scale in the low 16 bits of each i32 lane and 0 above, and a lane's sum
/// fits in 16 bits).
///
/// # Safety
/// Every activation holds values `at..at + 64`; AVX-512 F/BW/VNNI available.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn add_chunk<const N: usize>(
    sumi: &mut [__m512i; N],
    q: __m512i,
    scale: __m512i,
    acts: &[&Act<'_>; N],
    at: usize,
) {
    for k in 0..N {
        // SAFETY: 64 values at `at` (caller).
        let x = unsafe { _mm512_loadu_si512(acts[k].q.as_ptr().add(at) as *const __m512i) };
        let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x);
        sumi[k] = _mm512_add_epi32(sumi[k], _mm512_madd_epi16(dot, scale));
    }
}

/// `vpermd` indices for 64-value chunk `c` (0..4) of a super-block whose scales cover `per`
/// lanes (four values each) in turn, from scale `c · 16 / per` on.
const fn spread_table(per: usize) -> [[i32; 16]; 4] {
    let mut t = [[0i32; 16]; 4];
    let mut c = 0;
    while c < 4 {
        let mut l = 0;
        while l < 16 {
            t[c][l] = (c * 16 / per + l / per) as i32;
            l += 1;
        }
        c += 1;
    }
    t
}

/// Q4_K/Q5_K: chunk `c` holds sub-blocks `2c` (lanes 0–7) and `2c + 1` (lanes 8–15).
const K4_SPREAD: [[i32; 16]; 4] = spread_table(8);

/// Q6_K: chunk `c` holds groups `4c .. 4c + 4` of 16 values, four lanes each.
const K6_SPREAD: [[i32; 16]; 4] = spread_table(4);

/// Q4_K (`FIVE = false`, 144-byte super-blocks) or Q5_K (176 bytes) row · `N` Q8_K
/// activations. Values are unsigned (0..15 or 0..31) times the sub-block scale, minus
/// `dmin · min` times the activation's sub-block sum.
///
/// # Safety
/// `row` is whole super-blocks; every act has values, scales and group sums for each; this
/// module's CPU features available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_q45k<const N: usize, const FIVE: bool, const STREAM: bool>(
    row: &[u8],
    acts: [&Act<'_>; N],
) -> [f32; N] {
    let bytes = if FIVE { 176 } else { 144 };
    let nb = row.len() / bytes;
    debug_assert!(acts
        .iter()
        .all(|a| a.q.len() >= nb * 256 && a.bs.len() >= nb * 16 && a.d.len() >= nb));
    let mut acc = [_mm256_setzero_ps(); N];
    let mut corr = [0f32; N];
    let low = _mm512_set1_epi8(0x0F);
    let one = _mm512_set1_epi8(1);
    // The broadcast nibble bytes shifted by 0 (low half: low nibbles) and 4 (high half).
    let nibble_shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    // SAFETY: the tables are 16 i32 each.
    let spread: [__m512i; 4] =
        std::array::from_fn(|c| unsafe { _mm512_loadu_si512(K4_SPREAD[c].as_ptr().cast()) });
    for b in 0..nb {
        // SAFETY: super-block `b` < nb lies within `row`; the act entries for it exist (caller).
        unsafe {
            let blk = row.as_ptr().add(b * bytes);
            if STREAM {
                stream_ahead(blk, bytes);
            }
            let d = f16_scalar(blk);
            let dmin = f16_scalar(blk.add(2));
            let (scales, mins) = k4_scales_mins(blk.add(4));
            // Scales as i32 lanes 0..8 (high 16 bits 0, as `vpmaddwd` needs), lanes 8..16 zero.
            let sc = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128(scales as i64));
            // Each min twice, as i16: `vpmaddwd` with the 16 group sums gives min_j · (sum of
            // sub-block j's two groups).
            let mv = _mm_cvtsi64_si128(mins as i64);
            let mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
            let (qh, qs) = if FIVE {
                (
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(16) as *const __m256i)),
                    blk.add(48),
                )
            } else {
                (_mm512_setzero_si512(), blk.add(16))
            };
            let mut sumi = [_mm512_setzero_si512(); N];
            for c in 0..4 {
                let raw =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * c) as *const __m256i));
                let mut q = _mm512_and_si512(_mm512_srlv_epi64(raw, nibble_shift), low);
                if FIVE {
                    // Bit 2c (low half) and 2c + 1 (high half) of each qh byte is the fifth bit.
                    let s = 2 * c as i64;
                    let shift = _mm512_setr_epi64(s, s, s, s, s + 1, s + 1, s + 1, s + 1);
                    let h = _mm512_and_si512(_mm512_srlv_epi64(qh, shift), one);
                    q = _mm512_or_si512(q, _mm512_slli_epi16::<4>(h));
                }
                let scale = _mm512_permutexvar_epi32(spread[c], sc);
                add_chunk(&mut sumi, q, scale, &acts, b * 256 + 64 * c);
            }
            for k in 0..N {
                let a = acts[k];
                let sum_m = group_sums_dot(a, b, mins16);
                let dx = *a.d.get_unchecked(b);
                acc[k] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(fold_i32(sumi[k])),
                    _mm256_set1_ps(d * dx),
                    acc[k],
                );
                corr[k] = (dmin * dx).mul_add(sum_m as f32, corr[k]);
            }
        }
    }
    // SAFETY: this function's CPU features are available (its contract).
    unsafe { hsums_less(acc, corr) }
}

/// Q6_K row · `N` Q8_K activations: unsigned 6-bit values (0..63) times the signed 16-value
/// group scales, the −32 offset through the activation's group sums.
///
/// # Safety
/// `row` is whole super-blocks; every act has values, scales and group sums for each; this
/// module's CPU features available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_q6k_n<const N: usize, const STREAM: bool>(
    row: &[u8],
    acts: [&Act<'_>; N],
) -> [f32; N] {
    let nb = row.len() / 210;
    debug_assert!(acts
        .iter()
        .all(|a| a.q.len() >= nb * 256 && a.bs.len() >= nb * 16 && a.d.len() >= nb));
    let mut acc = [_mm256_setzero_ps(); N];
    let low = _mm512_set1_epi8(0x0F);
    let three = _mm512_set1_epi8(3);
    // The two high bits of a 32-value quarter sit at bits 0, 2, 4, 6 of the qh bytes: chunk
    // `2n` (quarters 0 and 1 of half n) takes shifts 0 and 2, chunk `2n + 1` 4 and 6.
    let qh_shift = [
        _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2),
        _mm512_setr_epi64(4, 4, 4, 4, 6, 6, 6, 6),
    ];
    // SAFETY: the tables are 16 i32 each.
    let spread: [__m512i; 4] =
        std::array::from_fn(|c| unsafe { _mm512_loadu_si512(K6_SPREAD[c].as_ptr().cast()) });
    for b in 0..nb {
        // SAFETY: super-block `b` < nb lies within `row`; the act entries for it exist (caller).
        unsafe {
            let blk = row.as_ptr().add(b * 210);
            if STREAM {
                stream_ahead(blk, 210);
            }
            let d = f16_scalar(blk.add(208));
            let sc8 = _mm_loadu_si128(blk.add(192) as *const __m128i);
            // The 16 signed scales as i16, and as i32 lanes whose high 16 bits are 0 (what
            // `vpmaddwd` needs to multiply a lane by its scale).
            let sc16 = _mm256_cvtepi8_epi16(sc8);
            let sc = _mm512_cvtepu16_epi32(sc16);
            let mut sumi = [_mm512_setzero_si512(); N];
            for n in 0..2 {
                let ql = _mm512_loadu_si512(blk.add(64 * n) as *const __m512i);
                let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    blk.add(128 + 32 * n) as *const __m256i
                ));
                let lows = [
                    _mm512_and_si512(ql, low),
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), low),
                ];
                for (part, lo) in lows.into_iter().enumerate() {
                    let c = 2 * n + part;
                    let h = _mm512_and_si512(_mm512_srlv_epi64(qh, qh_shift[part]), three);
                    let q = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(h));
                    let scale = _mm512_permutexvar_epi32(spread[c], sc);
                    add_chunk(&mut sumi, q, scale, &acts, b * 256 + 64 * c);
                }
            }
            for k in 0..N {
                let a = acts[k];
                let off = group_sums_dot(a, b, sc16);
                let total = _mm256_sub_epi32(
                    fold_i32(sumi[k]),
                    _mm256_setr_epi32(32 * off, 0, 0, 0, 0, 0, 0, 0),
                );
                let dx = *a.d.get_unchecked(b);
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * dx), acc[k]);
            }
        }
    }
    // SAFETY: this function's CPU features are available (its contract).
    unsafe { hsums(acc) }
}

pub(super) fn dot_q4_k(row: &[u8], a: &Act<'_>) -> f32 {
    // SAFETY: installed only for Backend::Avx512 (features detected); the frame passes whole
    // rows and Q8_K activations prepared for the row length.
    unsafe { dot_q45k::<1, false, false>(row, [a])[0] }
}
pub(super) fn dot4_q4_k(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
    // SAFETY: as in `dot_q4_k`.
    *out = unsafe { dot_q45k::<4, false, false>(row, [&acts[0], &acts[1], &acts[2], &acts[3]]) };
}
pub(super) fn dot_q5_k(row: &[u8], a: &Act<'_>) -> f32 {
    // SAFETY: as in `dot_q4_k`.
    unsafe { dot_q45k::<1, true, false>(row, [a])[0] }
}
pub(super) fn dot4_q5_k(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
    // SAFETY: as in `dot_q4_k`.
    *out = unsafe { dot_q45k::<4, true, false>(row, [&acts[0], &acts[1], &acts[2], &acts[3]]) };
}
pub(super) fn dot_q6_k(row: &[u8], a: &Act<'_>) -> f32 {
    // SAFETY: as in `dot_q4_k`.
    unsafe { dot_q6k_n::<1, false>(row, [a])[0] }
}
pub(super) fn dot4_q6_k(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
    // SAFETY: as in `dot_q4_k`.
    *out = unsafe { dot_q6k_n::<4, false>(row, [&acts[0], &acts[1], &acts[2], &acts[3]]) };
}

/// Bytes ahead of the super-block being computed whose lines the dense range kernels request
/// into L1: the best of the distances swept (measurements: `docs/tuning.md`).
const STREAM_AHEAD: usize = 2048;

/// Requests the lines of the super-block [`STREAM_AHEAD`] bytes past `blk` (`bytes` long) into
/// L1. Never faults: past the matrix it touches nothing.
#[inline(always)]
fn stream_ahead(blk: *const u8, bytes: usize) {
    let p = blk.wrapping_add(STREAM_AHEAD);
    let mut off = 0;
    while off < bytes + 63 {
        // SAFETY: a prefetch never faults and changes no state the program can observe; SSE
        // is part of the x86-64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8) };
        off += 64;
    }
}

/// The dense product over rows `r` of `data` (K-quant rows of `row_bytes`, super-blocks of
/// `BYTES`: 144 Q4_K, 176 Q5_K, 210 Q6_K), one row after another with a prefetch stream that
/// runs on into the next rows.
pub(super) fn dot_range_k<const BYTES: usize>(
    data: &[u8],
    row_bytes: usize,
    r: std::ops::Range<usize>,
    a: &Act<'_>,
    y: &mut [f32],
) {
    let nb = range_blocks(data, row_bytes, &r, y, BYTES);
    assert!(a.q.len() >= nb * 256 && a.bs.len() >= nb * 16 && a.d.len() >= nb);
    for (yi, i) in y.iter_mut().zip(r) {
        let row = &data[i * row_bytes..][..row_bytes];
        // SAFETY: installed only for Backend::Avx512 (features detected); the row is `nb`
        // whole super-blocks and the activation holds `nb` (checked above).
        *yi = unsafe {
            match BYTES {
                144 => dot_q45k::<1, false, true>(row, [a])[0],
                176 => dot_q45k::<1, true, true>(row, [a])[0],
                _ => dot_q6k_n::<1, true>(row, [a])[0],
            }
        };
    }
}
