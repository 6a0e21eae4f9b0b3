//! Float row kernels (F32, F16, BF16 weights; x86-64, AVX2 + FMA + F16C, and 512-bit
//! one-token dots for [`Backend::Avx512`](crate::Backend)).
//!
//! Float weights have two dot products. One-token products (GEMV, row-sparse GEMV) use the
//! "wide" order of [`dot_float_wide`]: four 16-lane accumulators per row, so one row streams
//! with four independent FMA chains (faster than four rows per pass with one 8-lane accumulator
//! each; measurements: `docs/tuning.md`). Multi-token products (`dot4`, `tile`,
//! `dot_batch`, and the blocked GEMM of [`super::gemm`]) use [`dot_float_tile`]'s order, one 8-lane
//! accumulator per (row, token) (the blocked GEMM keeps two tokens per 512-bit register, one per
//! 256-bit half, in a 4 rows × 6 pairs tile). Within each family a
//! result never depends on how rows, tokens or threads were grouped; the two families differ by
//! rounding only.

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(powerinfer_avx512)]
use super::common::{dot_float_rows512, FloatLoad16};
use super::common::{hsum, with_act, FloatLoad, LBF16, LF16, LF32};
use crate::matmul::act::Act;
use std::arch::x86_64::*;

// ---------------------------------------------------------------------------------------------
// Float weights × f32 activations.

/// Dot products of `R` float rows with `N` activations (`out[r][t]`): one 8-lane accumulator
/// per (row, token) over 8-element steps, a fixed-order horizontal sum, then the last `n % 8`
/// elements with scalar FMAs. Every (row, token) result is the same for any `R` and `N`; a
/// step loads each row's 8 weights once for all tokens and each token's 8 activations once for
/// all rows (GEMM: fewer activation reloads from L2 per FMA; GEMV: `R` independent FMA chains).
///
/// # Safety
/// Every row holds `n` elements of `L`, every `xs[k]` has `n` values; AVX2/FMA/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float_tile<L: FloatLoad, const R: usize, const N: usize>(
    rows: [&[u8]; R],
    xs: [&[f32]; N],
) -> [[f32; N]; R] {
    let n = xs[0].len();
    debug_assert!(rows.iter().all(|r| r.len() >= n * L::SIZE) && xs.iter().all(|x| x.len() == n));
    let w = rows.map(|r| r.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); N]; R];
    let mut i = 0;
    // SAFETY (all loads below): `i + 8 <= n` (or `j < n`) elements, in bounds of every row (n
    // elements of L::SIZE bytes) and of every `xs[k]` (n values).
    unsafe {
        while i + 8 <= n {
            let mut wv = [_mm256_setzero_ps(); R];
            for r in 0..R {
                wv[r] = L::load8(w[r].add(i * L::SIZE));
            }
            for k in 0..N {
                let x = _mm256_loadu_ps(xs[k].as_ptr().add(i));
                for r in 0..R {
                    acc[r][k] = _mm256_fmadd_ps(wv[r], x, acc[r][k]);
                }
            }
            i += 8;
        }
        let mut out = [[0f32; N]; R];
        for r in 0..R {
            for k in 0..N {
                let mut s = hsum(acc[r][k]);
                for j in i..n {
                    s = L::load1(w[r].add(j * L::SIZE)).mul_add(*xs[k].get_unchecked(j), s);
                }
                out[r][k] = s;
            }
        }
        out
    }
}

/// The one-token float dot ("wide" order): four accumulators of 16 lanes, accumulator `c`
/// taking the 16-element chunks `4k + c` (held here as 8 ymm registers, two per accumulator);
/// the chunks after the last whole 64 go to accumulators 0, 1, 2 in turn. Then
/// `(acc0 + acc1) + (acc2 + acc3)`, its low 8 lanes plus its high 8, a fixed-order horizontal
/// sum, and scalar FMAs for the last `n % 16` elements. [`dot_float_wide512`] computes the
/// same operations with zmm registers. The activation is `n` elements of `X` (f32, or the f16
/// bits of an `ActFormat::F16` activation, widened exactly: the same f32 values, the same bits
/// as from its f32 copy).
///
/// # Safety
/// `row` holds `n` elements of `L`, `x` holds `n` elements of `X`; AVX2/FMA/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_float_wide<L: FloatLoad, X: FloatLoad>(row: &[u8], x: &[u8], n: usize) -> f32 {
    debug_assert!(row.len() >= n * L::SIZE && x.len() >= n * X::SIZE);
    let (w, xp) = (row.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    // SAFETY (all loads): element indices below `n`, in bounds of `row` (n elements of
    // L::SIZE bytes) and of `x` (n elements of X::SIZE bytes).
    unsafe {
        while i + 64 <= n {
            for c in 0..8 {
                let j = i + 8 * c;
                acc[c] = _mm256_fmadd_ps(
                    L::load8(w.add(j * L::SIZE)),
                    X::load8(xp.add(j * X::SIZE)),
                    acc[c],
                );
            }
            i += 64;
        }
        let mut c = 0;
        while i + 16 <= n {
            for h in 0..2 {
                let j = i + 8 * h;
                acc[c + h] = _mm256_fmadd_ps(
                    L::load8(w.add(j * L::SIZE)),
                    X::load8(xp.add(j * X::SIZE)),
                    acc[c + h],
                );
            }
            c += 2;
            i += 16;
        }
        let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[4], acc[6]));
        let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[3]), _mm256_add_ps(acc[5], acc[7]));
        let mut s = hsum(_mm256_add_ps(lo, hi));
        for j in i..n {
            s = L::load1(w.add(j * L::SIZE)).mul_add(X::load1(xp.add(j * X::SIZE)), s);
        }
        s
    }
}

/// Bytes ahead of the elements being read that [`dot_float_wide512`] asks to have in L1, in
/// each of its rows, on Intel CPUs: the best of the distances swept in F16 decode, where the
/// hardware prefetchers alone fell short (measurements of this and the AMD distances:
/// `docs/tuning.md`).
#[cfg(powerinfer_avx512)]
const FLOAT_AHEAD_INTEL: usize = 1536;

/// [`FLOAT_AHEAD_INTEL`] on AMD CPUs, for the one-row dot (rows of up to 4096 elements in the
/// dense GEMV): 0, no software prefetches (the hardware prefetchers already run ahead and the
/// requests only compete with them).
#[cfg(powerinfer_avx512)]
const FLOAT_AHEAD_AMD_ONE_ROW: usize = 0;

/// [`FLOAT_AHEAD_AMD_ONE_ROW`] for the four-row dot (longer dense rows; the sparse GEMV's rows
/// over 4 KiB): four streams at once, where 256 bytes still helps a little.
#[cfg(powerinfer_avx512)]
const FLOAT_AHEAD_AMD_ROWS: usize = 256;

/// The prefetch distance of [`dot_float_wide512`] over `rows` rows at once on this CPU (see
/// [`FLOAT_AHEAD_INTEL`]); 0: no prefetches.
#[cfg(powerinfer_avx512)]
#[inline]
fn float_ahead(rows: usize) -> usize {
    // `detect` is cached: one atomic load per call.
    match crate::backend::CpuVendor::detect() {
        crate::backend::CpuVendor::Amd if rows == 1 => FLOAT_AHEAD_AMD_ONE_ROW,
        crate::backend::CpuVendor::Amd => FLOAT_AHEAD_AMD_ROWS,
        _ => FLOAT_AHEAD_INTEL,
    }
}

/// [`dot_float_wide`] for `R` rows at once with four zmm accumulators per row (`4R` of the 32
/// registers): the same FMAs per lane and the same additions as the AVX2 kernel, so the same
/// bits for any `R`; each 16-activation load serves all `R` rows.
///
/// # Safety
/// Every row holds `n` elements of `L`, `x` holds `n` elements of `X`; AVX2/FMA/F16C and
/// AVX-512F/VL available.
#[cfg(powerinfer_avx512)] // set by build.rs on Rust ≥ 1.89 only
#[allow(clippy::incompatible_msrv)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn dot_float_wide512<L: FloatLoad16, X: FloatLoad16, const R: usize>(
    rows: [&[u8]; R],
    x: &[u8],
    n: usize,
) -> [f32; R] {
    debug_assert!(rows.iter().all(|r| r.len() >= n * L::SIZE) && x.len() >= n * X::SIZE);
    let w = rows.map(|r| r.as_ptr());
    let ahead = float_ahead(R);
    // SAFETY: every row holds `n` elements, `x` too (caller); features available (caller).
    unsafe {
        dot_float_rows512::<L, X, R>(w, x.as_ptr(), n, |i| {
            if ahead == 0 {
                return;
            }
            // The lines `ahead` bytes on in every row, into L1 (prefetches never fault:
            // past a row's end they touch the next row or nothing).
            for r in 0..R {
                let q = w[r].wrapping_add(i * L::SIZE + ahead);
                for l in 0..L::SIZE {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(64 * l) as *const i8);
                }
            }
        })
    }
}

/// `out += a · row` for a float row: 8-lane FMAs, then scalar FMAs for the last `n % 8`.
///
/// # Safety
/// `row` holds `out.len()` elements of `L`; AVX2/FMA/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_float<L: FloatLoad>(row: &[u8], a: f32, out: &mut [f32]) {
    let n = out.len();
    debug_assert!(row.len() >= n * L::SIZE);
    let w = row.as_ptr();
    let o = out.as_mut_ptr();
    let va = _mm256_set1_ps(a);
    let mut i = 0;
    // SAFETY: indices below `n` for `out` and for `row` (n elements of L::SIZE bytes).
    unsafe {
        while i + 16 <= n {
            let y0 = _mm256_fmadd_ps(va, L::load8(w.add(i * L::SIZE)), _mm256_loadu_ps(o.add(i)));
            let y1 = _mm256_fmadd_ps(
                va,
                L::load8(w.add((i + 8) * L::SIZE)),
                _mm256_loadu_ps(o.add(i + 8)),
            );
            _mm256_storeu_ps(o.add(i), y0);
            _mm256_storeu_ps(o.add(i + 8), y1);
            i += 16;
        }
        if i + 8 <= n {
            let y0 = _mm256_fmadd_ps(va, L::load8(w.add(i * L::SIZE)), _mm256_loadu_ps(o.add(i)));
            _mm256_storeu_ps(o.add(i), y0);
            i += 8;
        }
        for j in i..n {
            *o.add(j) = a.mul_add(L::load1(w.add(j * L::SIZE)), *o.add(j));
        }
    }
}

/// `out += a[0]·rows[0] + … + a[3]·rows[3]` for float rows, applied row after row to each
/// element (the same roundings as four [`axpy_float`] calls) while `out` stays in registers.
///
/// # Safety
/// Every row holds `out.len()` elements of `L`; AVX2/FMA/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy4_float<L: FloatLoad>(rows: [&[u8]; 4], a: [f32; 4], out: &mut [f32]) {
    let n = out.len();
    debug_assert!(rows.iter().all(|r| r.len() >= n * L::SIZE));
    let w = rows.map(|r| r.as_ptr());
    let o = out.as_mut_ptr();
    let va = a.map(|v| _mm256_set1_ps(v));
    let mut i = 0;
    // SAFETY: indices below `n` for `out` and for every row (n elements of L::SIZE bytes).
    unsafe {
        while i + 16 <= n {
            let mut y0 = _mm256_loadu_ps(o.add(i));
            let mut y1 = _mm256_loadu_ps(o.add(i + 8));
            for k in 0..4 {
                y0 = _mm256_fmadd_ps(va[k], L::load8(w[k].add(i * L::SIZE)), y0);
                y1 = _mm256_fmadd_ps(va[k], L::load8(w[k].add((i + 8) * L::SIZE)), y1);
            }
            _mm256_storeu_ps(o.add(i), y0);
            _mm256_storeu_ps(o.add(i + 8), y1);
            i += 16;
        }
        if i + 8 <= n {
            let mut y0 = _mm256_loadu_ps(o.add(i));
            for k in 0..4 {
                y0 = _mm256_fmadd_ps(va[k], L::load8(w[k].add(i * L::SIZE)), y0);
            }
            _mm256_storeu_ps(o.add(i), y0);
            i += 8;
        }
        for j in i..n {
            let mut y = *o.add(j);
            for k in 0..4 {
                y = a[k].mul_add(L::load1(w[k].add(j * L::SIZE)), y);
            }
            *o.add(j) = y;
        }
    }
}

macro_rules! float_wrappers {
    (
        $l:ty, $dot:ident, $dot_batch:ident, $dot4:ident, $rows4:ident, $tile:ident,
        $axpy:ident, $axpy4:ident
    ) => {
        pub(super) fn $rows4(rows: [&[u8]; 4], a: &Act<'_>) -> [f32; 4] {
            // SAFETY: installed only when AVX2/FMA/F16C were detected; the frame passes four
            // whole rows and an activation of the row length.
            with_act!(a, |X, x, n| rows
                .map(|r| unsafe { dot_float_wide::<$l, X>(r, x, n) }))
        }
        pub(super) fn $dot_batch(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: as above, a whole row and an activation of its length.
            unsafe { dot_float_tile::<$l, 1, 1>([row], [a.f])[0][0] }
        }
        pub(super) fn $tile(rows: [&[u8]; 2], acts: &[Act<'_>; 4], out: &mut [[f32; 4]; 2]) {
            // SAFETY: as above, two whole rows and four activations of the row length.
            *out = unsafe {
                dot_float_tile::<$l, 2, 4>(rows, [acts[0].f, acts[1].f, acts[2].f, acts[3].f])
            };
        }
        pub(super) fn $dot(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: installed only when AVX2/FMA/F16C were detected; the frame passes a whole
            // row (`a.f.len()` elements) and an activation of the same length.
            with_act!(a, |X, x, n| unsafe { dot_float_wide::<$l, X>(row, x, n) })
        }
        pub(super) fn $dot4(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
            // SAFETY: as above, four activations of the row's length.
            *out = unsafe {
                dot_float_tile::<$l, 1, 4>([row], [acts[0].f, acts[1].f, acts[2].f, acts[3].f])[0]
            };
        }
        pub(super) fn $axpy(row: &[u8], a: f32, out: &mut [f32]) {
            // SAFETY: as above; the frame passes row bytes covering exactly `out`'s columns.
            unsafe { axpy_float::<$l>(row, a, out) }
        }
        pub(super) fn $axpy4(rows: [&[u8]; 4], a: [f32; 4], out: &mut [f32]) {
            // SAFETY: as above, four rows each covering `out`'s columns.
            unsafe { axpy4_float::<$l>(rows, a, out) }
        }
    };
}
float_wrappers!(
    LF32,
    dot_f32,
    dot_batch_f32,
    dot4_f32,
    rows4_f32,
    tile_f32,
    axpy_f32,
    axpy4_f32
);
float_wrappers!(
    LF16,
    dot_f16,
    dot_batch_f16,
    dot4_f16,
    rows4_f16,
    tile_f16,
    axpy_f16,
    axpy4_f16
);
float_wrappers!(
    LBF16,
    dot_bf16,
    dot_batch_bf16,
    dot4_bf16,
    rows4_bf16,
    tile_bf16,
    axpy_bf16,
    axpy4_bf16
);

#[cfg(powerinfer_avx512)]
macro_rules! float_wrappers512 {
    ($l:ty, $dot:ident, $rows4:ident) => {
        pub(super) fn $dot(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: installed only on the Avx512 backend (AVX-512F/VL detected); the frame
            // passes a whole row and an activation of its length.
            with_act!(a, |X, x, n| unsafe {
                dot_float_wide512::<$l, X, 1>([row], x, n)[0]
            })
        }
        pub(super) fn $rows4(rows: [&[u8]; 4], a: &Act<'_>) -> [f32; 4] {
            // SAFETY: as above, four whole rows.
            with_act!(a, |X, x, n| unsafe {
                dot_float_wide512::<$l, X, 4>(rows, x, n)
            })
        }
    };
}
#[cfg(powerinfer_avx512)]
float_wrappers512!(LF32, dot512_f32, rows4_512_f32);
#[cfg(powerinfer_avx512)]
float_wrappers512!(LF16, dot512_f16, rows4_512_f16);
#[cfg(powerinfer_avx512)]
float_wrappers512!(LBF16, dot512_bf16, rows4_512_bf16);
