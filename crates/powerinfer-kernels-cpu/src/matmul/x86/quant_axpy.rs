//! Q8_0 and Q4_0 axpy row kernels (x86-64, AVX2 + FMA + F16C): `out += a · row`, one row or
//! four rows per call, with f32 coefficients.

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::common::f16_scalar;
use std::arch::x86_64::*;

// ---------------------------------------------------------------------------------------------
// Q8_0 and Q4_0 weights × Q8_0 activations.

/// `out += Σ_k a[k] · rows[k]` for `N` Q8_0 rows, row after row per element (the roundings of
/// `N` one-row calls): per block, 4 × (8 bytes → i32 → f32) times `a·d_w`.
///
/// # Safety
/// Every row is whole blocks covering `out`; AVX2/FMA/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_q8_0_n<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    let nb = out.len() / 32;
    debug_assert!(rows.iter().all(|r| r.len() >= nb * 34));
    let o = out.as_mut_ptr();
    for b in 0..nb {
        // SAFETY: block `b` < nb is within every row, outputs `32b..32b+32` within `out`.
        unsafe {
            let mut y = [_mm256_setzero_ps(); 4];
            for (g, yg) in y.iter_mut().enumerate() {
                *yg = _mm256_loadu_ps(o.add(b * 32 + 8 * g));
            }
            for k in 0..N {
                let blk = rows[k].as_ptr().add(b * 34);
                let s = _mm256_set1_ps(a[k] * f16_scalar(blk));
                for (g, yg) in y.iter_mut().enumerate() {
                    let q8 = _mm_loadl_epi64(blk.add(2 + 8 * g) as *const __m128i);
                    let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                    *yg = _mm256_fmadd_ps(s, v, *yg);
                }
            }
            for (g, yg) in y.iter().enumerate() {
                _mm256_storeu_ps(o.add(b * 32 + 8 * g), *yg);
            }
        }
    }
}

/// `out += Σ_k a[k] · rows[k]` for `N` Q4_0 rows, row after row per element (the roundings of
/// `N` one-row calls): per block `y = fma(a·d_w, q − 8, y)` with `q − 8` exact in f32.
///
/// The kernel is bound by vector ALU work, not memory, so the decoding is lean: bytes 0..8 and
/// 8..16 of a block zero-extended to dwords hold elements 0..16 in their low nibbles and 16..32
/// in their high ones; a nibble `q` ORed into the bits of 2²³ is the float 2²³ + q, and
/// subtracting 2²³ + 8 leaves `q − 8` exactly (no int→float conversion, no sign handling). The
/// `N` scales `a·d_w` of a block are converted from f16 and multiplied together. Pairs of
/// blocks are interleaved so that the out-of-order core sees independent FMA chains.
///
/// # Safety
/// Every row is whole blocks covering `out`; AVX2/FMA/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_q4_0_n<const N: usize>(rows: [&[u8]; N], a: [f32; N], out: &mut [f32]) {
    const { assert!(N >= 1 && N <= 4) };
    let nb = out.len() / 32;
    debug_assert!(rows.iter().all(|r| r.len() >= nb * 18));
    let o = out.as_mut_ptr();
    let ak = |k: usize| if k < N { a[k] } else { 0.0 };
    let av = _mm256_setr_ps(ak(0), ak(1), ak(2), ak(3), 0.0, 0.0, 0.0, 0.0);
    let p = rows.map(|r| r.as_ptr());
    let mut b = 0;
    while b < nb {
        if b + 2 <= nb {
            // SAFETY: blocks `b`, `b + 1` < nb are within every row, outputs within `out`.
            unsafe { q4_0_axpy_blocks::<N, 2>(p, b, av, o) };
            b += 2;
        } else {
            // SAFETY: block `b` < nb is within every row, outputs within `out`.
            unsafe { q4_0_axpy_blocks::<N, 1>(p, b, av, o) };
            b += 1;
        }
    }
}

/// Blocks `b..b + G` of [`axpy_q4_0_n`] (`av` holds the `N` activations in its first lanes).
///
/// # Safety
/// Blocks `b..b + G` exist in every row at `p[k]` and outputs `32b..32(b + G)` at `o`;
/// AVX2/FMA/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_axpy_blocks<const N: usize, const G: usize>(
    p: [*const u8; N],
    b: usize,
    av: __m256,
    o: *mut f32,
) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        let low = _mm256_set1_epi32(0x0F);
        // 2²³ + q as f32 bits; minus 2²³ + 8 leaves q − 8 exactly.
        let magic = _mm256_set1_epi32(0x4B00_0000);
        let magic_8 = _mm256_set1_ps(8_388_616.0);
        let mut sv = [_mm256_setzero_ps(); G];
        for j in 0..G {
            // The N scales a[k]·d_k of block b + j as one vector (lanes ≥ N unused).
            let mut h = [0i32; 4];
            for k in 0..N {
                h[k] = std::ptr::read_unaligned(p[k].add((b + j) * 18) as *const u16) as i32;
            }
            let mut hv = _mm_cvtsi32_si128(h[0]);
            if N > 1 {
                hv = _mm_insert_epi16::<1>(hv, h[1]);
            }
            if N > 2 {
                hv = _mm_insert_epi16::<2>(hv, h[2]);
            }
            if N > 3 {
                hv = _mm_insert_epi16::<3>(hv, h[3]);
            }
            sv[j] = _mm256_mul_ps(av, _mm256_cvtph_ps(hv));
        }
        let mut y = [[_mm256_setzero_ps(); 4]; G];
        for j in 0..G {
            for g in 0..4 {
                y[j][g] = _mm256_loadu_ps(o.add((b + j) * 32 + 8 * g));
            }
        }
        for k in 0..N {
            for j in 0..G {
                let s = _mm256_permutevar8x32_ps(sv[j], _mm256_set1_epi32(k as i32));
                let q = p[k].add((b + j) * 18 + 2);
                // Bytes 0..8 and 8..16 zero-extended to dwords: the low nibbles are elements
                // 0..16, the high ones 16..32.
                let d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q as *const __m128i));
                let d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.add(8) as *const __m128i));
                let parts = [
                    _mm256_and_si256(d0, low),
                    _mm256_and_si256(d1, low),
                    _mm256_srli_epi32::<4>(d0),
                    _mm256_srli_epi32::<4>(d1),
                ];
                for g in 0..4 {
                    let v = _mm256_sub_ps(
                        _mm256_castsi256_ps(_mm256_or_si256(parts[g], magic)),
                        magic_8,
                    );
                    y[j][g] = _mm256_fmadd_ps(s, v, y[j][g]);
                }
            }
        }
        for j in 0..G {
            for g in 0..4 {
                _mm256_storeu_ps(o.add((b + j) * 32 + 8 * g), y[j][g]);
            }
        }
    }
}

pub(super) fn axpy_q8_0(row: &[u8], a: f32, out: &mut [f32]) {
    // SAFETY: installed only when AVX2/FMA/F16C were detected; the frame passes row bytes of
    // whole blocks covering exactly `out`'s columns.
    unsafe { axpy_q8_0_n::<1>([row], [a], out) }
}
pub(super) fn axpy4_q8_0(rows: [&[u8]; 4], a: [f32; 4], out: &mut [f32]) {
    // SAFETY: as in `axpy_q8_0`, for each of the four rows.
    unsafe { axpy_q8_0_n::<4>(rows, a, out) }
}
pub(super) fn axpy_q4_0(row: &[u8], a: f32, out: &mut [f32]) {
    // SAFETY: as in `axpy_q8_0`.
    unsafe { axpy_q4_0_n::<1>([row], [a], out) }
}
pub(super) fn axpy4_q4_0(rows: [&[u8]; 4], a: [f32; 4], out: &mut [f32]) {
    // SAFETY: as in `axpy_q8_0`, for each of the four rows.
    unsafe { axpy_q4_0_n::<4>(rows, a, out) }
}
