//! AVX2 + FMA + F16C row kernels (x86-64).
//!
//! Every kernel is an `unsafe fn` with `#[target_feature]`; the safe wrappers that
//! [`override_avx2`] installs in the kernel table are installed only after
//! [`Backend::Avx2`](crate::Backend) (or `Avx512`, which implies it) was detected on this CPU, which is what makes calling them
//! sound. Loads are unaligned (`loadu`), so rows need no alignment.
//!
//! Float weights have two dot products. One-token products (GEMV, row-sparse GEMV) use the
//! "wide" order of [`dot_float_wide`]: four 16-lane accumulators per row, so one row streams
//! with four independent FMA chains (F16 GEMVs of 2048-element rows, 2 threads: 1.2–1.3× the
//! speed of four rows per pass with one 8-lane accumulator each). Multi-token products (`dot4`, `tile`,
//! `dot_batch`, and the blocked GEMM of `x86_gemm`) use [`dot_float_tile`]'s order, one 8-lane
//! accumulator per (row, token) (the blocked GEMM keeps two tokens per 512-bit register, one per
//! 256-bit half, in a 4 rows × 6 pairs tile). Within each family a
//! result never depends on how rows, tokens or threads were grouped; the two families differ by
//! rounding only. The quantized kernels have one (exact integer) order for both.

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::act::Act;
use super::table::RowOps;
use powerinfer_gguf::GgmlType;
use std::arch::x86_64::*;

/// Replaces the scalar kernels of `ty` in `ops` by AVX2 ones where they exist (with `vnni`, the
/// quantized dot products use the AVX-512 VNNI kernels of [`super::x86_int`]). The caller has
/// checked that AVX2, FMA and F16C (and, with `vnni`, [`Backend::Avx512`](crate::Backend)) are
/// available.
pub(crate) fn override_avx2(ty: GgmlType, ops: &mut RowOps, vnni: bool) {
    use GgmlType as T;
    super::x86_int::override_int(ty, ops, vnni);
    #[cfg(powerinfer_avx512)]
    if vnni {
        super::x86_sparse::override_sparse(ty, ops);
        super::x86_kquant::override_kquant(ty, ops);
    }
    match ty {
        T::F32 => {
            ops.dot = dot_f32;
            ops.dot_batch = dot_batch_f32;
            ops.dot4 = dot4_f32;
            ops.rows4 = Some(rows4_f32);
            ops.tile = Some(tile_f32);
            ops.axpy = axpy_f32;
            ops.axpy4 = Some(axpy4_f32);
        }
        T::F16 => {
            ops.dot = dot_f16;
            ops.dot_batch = dot_batch_f16;
            ops.dot4 = dot4_f16;
            ops.rows4 = Some(rows4_f16);
            ops.tile = Some(tile_f16);
            ops.axpy = axpy_f16;
            ops.axpy4 = Some(axpy4_f16);
        }
        T::BF16 => {
            ops.dot = dot_bf16;
            ops.dot_batch = dot_batch_bf16;
            ops.dot4 = dot4_bf16;
            ops.rows4 = Some(rows4_bf16);
            ops.tile = Some(tile_bf16);
            ops.axpy = axpy_bf16;
            ops.axpy4 = Some(axpy4_bf16);
        }
        T::Q8_0 => {
            ops.axpy = axpy_q8_0;
            ops.axpy4 = Some(axpy4_q8_0);
        }
        T::Q4_0 => {
            ops.axpy = axpy_q4_0;
            ops.axpy4 = Some(axpy4_q4_0);
        }
        _ => {}
    }
    // The same one-token float dots with 512-bit registers (bit-identical to the AVX2 ones).
    #[cfg(powerinfer_avx512)]
    if vnni {
        match ty {
            T::F32 => {
                (ops.dot, ops.rows4) = (dot512_f32, Some(rows4_512_f32 as super::table::Rows4Fn))
            }
            T::F16 => {
                (ops.dot, ops.rows4) = (dot512_f16, Some(rows4_512_f16 as super::table::Rows4Fn))
            }
            T::BF16 => {
                (ops.dot, ops.rows4) = (dot512_bf16, Some(rows4_512_bf16 as super::table::Rows4Fn))
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// Horizontal sum of 8 lanes in a fixed order.
#[inline]
///
/// # Safety
/// AVX2 available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// f16 (little-endian bytes at `p`) to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn f16_scalar(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// How the float kernels turn 8 stored elements at `p` into 8 f32 lanes (also used by the
/// blocked GEMM of `x86_gemm`).
pub(crate) trait FloatLoad {
    /// Bytes per element.
    const SIZE: usize;
    /// # Safety
    /// 8 elements readable at `p`; AVX2, FMA and F16C available.
    unsafe fn load8(p: *const u8) -> __m256;
    /// # Safety
    /// One element readable at `p`.
    unsafe fn load1(p: *const u8) -> f32;
}

/// f32 elements.
pub(crate) struct LF32;
/// IEEE half elements.
pub(crate) struct LF16;
/// bfloat16 elements.
pub(crate) struct LBF16;

impl FloatLoad for LF32 {
    const SIZE: usize = 4;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 32 readable bytes at `p` (caller).
        unsafe { _mm256_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: 4 readable bytes at `p` (caller).
        unsafe { std::ptr::read_unaligned(p as *const f32) }
    }
}

impl FloatLoad for LF16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at `p`; F16C available (caller).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: 2 readable bytes at `p`; F16C available (caller).
        unsafe { f16_scalar(p) }
    }
}

impl FloatLoad for LBF16 {
    const SIZE: usize = 2;
    #[inline(always)]
    unsafe fn load8(p: *const u8) -> __m256 {
        // SAFETY: 16 readable bytes at `p`; AVX2 available (caller).
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }
    #[inline(always)]
    unsafe fn load1(p: *const u8) -> f32 {
        // SAFETY: 2 readable bytes at `p` (caller).
        let bits = unsafe { std::ptr::read_unaligned(p as *const u16) };
        f32::from_bits((bits as u32) << 16)
    }
}

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

/// Evaluates `body` with the one-token activation `a` as the kernels read it: `bytes` its f16
/// bits and `X = LF16` where it has them (`ActFormat::F16`), else its f32 values and
/// `X = LF32`; `n` its element count. Both give the same f32 values, so the same results.
macro_rules! with_act {
    ($a:expr, |$x:ident, $bytes:ident, $n:ident| $body:expr) => {{
        let a: &Act<'_> = $a;
        let $n = a.f.len();
        if a.h.is_empty() {
            type $x = LF32;
            let $bytes: &[u8] = bytemuck::cast_slice(a.f);
            $body
        } else {
            type $x = LF16;
            let $bytes: &[u8] = bytemuck::cast_slice(a.h);
            $body
        }
    }};
}
pub(crate) use with_act;

/// How the 512-bit one-token float dot turns 16 stored elements into 16 f32 lanes.
#[cfg(powerinfer_avx512)]
pub(crate) trait FloatLoad16: FloatLoad {
    /// # Safety
    /// 16 elements readable at `p`; AVX-512F available.
    unsafe fn load16(p: *const u8) -> __m512;
    /// The 8 elements at `p` in both 256-bit halves (each half equal to [`FloatLoad::load8`]).
    ///
    /// # Safety
    /// 8 elements readable at `p`; AVX-512F available.
    unsafe fn load8x2(p: *const u8) -> __m512;
}

#[cfg(powerinfer_avx512)] // set by build.rs on Rust ≥ 1.89 only
#[allow(clippy::incompatible_msrv)]
impl FloatLoad16 for LF32 {
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 64 readable bytes at `p` (caller).
        unsafe { _mm512_loadu_ps(p as *const f32) }
    }
    #[inline(always)]
    unsafe fn load8x2(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at `p`; AVX-512F available (caller).
        unsafe { _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(p as *const f64))) }
    }
}

#[cfg(powerinfer_avx512)] // set by build.rs on Rust ≥ 1.89 only
#[allow(clippy::incompatible_msrv)]
impl FloatLoad16 for LF16 {
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at `p`; AVX-512F available (caller).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
    #[inline(always)]
    unsafe fn load8x2(p: *const u8) -> __m512 {
        // SAFETY: 16 readable bytes at `p`; AVX-512F available (caller).
        unsafe {
            _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(
                p as *const __m128i,
            )))
        }
    }
}

#[cfg(powerinfer_avx512)] // set by build.rs on Rust ≥ 1.89 only
#[allow(clippy::incompatible_msrv)]
impl FloatLoad16 for LBF16 {
    #[inline(always)]
    unsafe fn load16(p: *const u8) -> __m512 {
        // SAFETY: 32 readable bytes at `p`; AVX-512F available (caller).
        unsafe {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
    #[inline(always)]
    unsafe fn load8x2(p: *const u8) -> __m512 {
        // SAFETY: 16 readable bytes at `p`; AVX-512F available (caller).
        unsafe {
            let h = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }
}

/// Bytes ahead of the elements being read that [`dot_float_wide512`] asks to have in L1, in
/// each of its rows, on Intel CPUs. Xeon, TinyLlama-shaped F16 dense decode, 2 threads,
/// alternated runs (tok/s): none 11.85–12.12, 768 bytes 12.95–12.97, 1024 12.81–12.91, 1536
/// 12.68–13.12, 2048 12.74–12.92, 3072 12.28–12.47, 4096 10.49–10.56, 8192 9.93–10.04. Sparse
/// decode (rows scattered, so some lines past a row's end go unused) was no slower: 29.5–30.0
/// vs 29.4–29.5 tok/s with the prefetches kept inside each row.
#[cfg(powerinfer_avx512)]
const FLOAT_AHEAD_INTEL: usize = 1536;

/// [`FLOAT_AHEAD_INTEL`] on AMD CPUs, for the one-row dot (rows of up to 4096 elements in the
/// dense GEMV): 0, no software prefetches (the hardware prefetchers already run ahead and the
/// requests only compete with them). Zen 4 (2 vCPUs), TinyLlama F16 dense decode, 3 alternated
/// rounds (tok/s): 256 bytes 14.3, 11.0, 16.7; 768 12.5, 10.8, 10.7; 1024 10.8, 11.7, 10.6;
/// 1536 10.1, 10.9; none 13.6–14.5. Then, with the distances alternated pass by pass in one
/// process over the file's 154 mapped matrices (12 passes, medians): none 27.3, 32.8, 32.9,
/// 33.6 GB/s against 256 bytes 23.1, 27.2, 28.9, 29.1 (128: 29.4, 31.1); copies in base pages,
/// 5632×2048 38.1 vs 32.5, 2048×2048 41.3 vs 37.4. Decode, 4 alternated pairs: dense
/// 13.19–13.95 vs 12.27–13.78 tok/s, sparse 30.5–33.8 vs 26.8–30.4.
#[cfg(powerinfer_avx512)]
const FLOAT_AHEAD_AMD_ONE_ROW: usize = 0;

/// [`FLOAT_AHEAD_AMD_ONE_ROW`] for the four-row dot (longer dense rows; the sparse GEMV's rows
/// over 4 KiB): four streams at once, where 256 bytes still helps a little. Zen 4, copies in
/// base pages, passes alternated (20, medians): 4096×11008 31.6 GB/s vs 28.4 without
/// prefetches (512 bytes: 29.8), 2048×5632 23.8 vs 23.2 (512: 24.1).
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

/// [`dot_float_wide512`]'s arithmetic on `R` rows given by their first element and an
/// activation of `n` elements of `X` at `xp`, calling `ahead(i)` before each step of 64
/// elements (`i` the step's first element): the caller's prefetches.
///
/// # Safety
/// `n` elements of `L` readable at every `w[r]`, `n` elements of `X` at `xp`; AVX2/FMA/F16C
/// and AVX-512F/VL available.
#[cfg(powerinfer_avx512)]
#[allow(clippy::incompatible_msrv)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
pub(crate) unsafe fn dot_float_rows512<L: FloatLoad16, X: FloatLoad16, const R: usize>(
    w: [*const u8; R],
    xp: *const u8,
    n: usize,
    mut ahead: impl FnMut(usize),
) -> [f32; R] {
    let mut acc = [[_mm512_setzero_ps(); 4]; R];
    let mut i = 0;
    // SAFETY (all loads): element indices below `n`, in bounds of every row and of `x`.
    unsafe {
        while i + 64 <= n {
            ahead(i);
            for c in 0..4 {
                let j = i + 16 * c;
                let xv = X::load16(xp.add(j * X::SIZE));
                for r in 0..R {
                    acc[r][c] = _mm512_fmadd_ps(L::load16(w[r].add(j * L::SIZE)), xv, acc[r][c]);
                }
            }
            i += 64;
        }
        let mut c = 0;
        while i + 16 <= n {
            let xv = X::load16(xp.add(i * X::SIZE));
            for r in 0..R {
                acc[r][c] = _mm512_fmadd_ps(L::load16(w[r].add(i * L::SIZE)), xv, acc[r][c]);
            }
            c += 1;
            i += 16;
        }
        let mut out = [0f32; R];
        for r in 0..R {
            let a = &acc[r];
            let v = _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            let mut s = hsum(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
            for j in i..n {
                s = L::load1(w[r].add(j * L::SIZE)).mul_add(X::load1(xp.add(j * X::SIZE)), s);
            }
            out[r] = s;
        }
        out
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
        fn $rows4(rows: [&[u8]; 4], a: &Act<'_>) -> [f32; 4] {
            // SAFETY: installed only when AVX2/FMA/F16C were detected; the frame passes four
            // whole rows and an activation of the row length.
            with_act!(a, |X, x, n| rows
                .map(|r| unsafe { dot_float_wide::<$l, X>(r, x, n) }))
        }
        fn $dot_batch(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: as above, a whole row and an activation of its length.
            unsafe { dot_float_tile::<$l, 1, 1>([row], [a.f])[0][0] }
        }
        fn $tile(rows: [&[u8]; 2], acts: &[Act<'_>; 4], out: &mut [[f32; 4]; 2]) {
            // SAFETY: as above, two whole rows and four activations of the row length.
            *out = unsafe {
                dot_float_tile::<$l, 2, 4>(rows, [acts[0].f, acts[1].f, acts[2].f, acts[3].f])
            };
        }
        fn $dot(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: installed only when AVX2/FMA/F16C were detected; the frame passes a whole
            // row (`a.f.len()` elements) and an activation of the same length.
            with_act!(a, |X, x, n| unsafe { dot_float_wide::<$l, X>(row, x, n) })
        }
        fn $dot4(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
            // SAFETY: as above, four activations of the row's length.
            *out = unsafe {
                dot_float_tile::<$l, 1, 4>([row], [acts[0].f, acts[1].f, acts[2].f, acts[3].f])[0]
            };
        }
        fn $axpy(row: &[u8], a: f32, out: &mut [f32]) {
            // SAFETY: as above; the frame passes row bytes covering exactly `out`'s columns.
            unsafe { axpy_float::<$l>(row, a, out) }
        }
        fn $axpy4(rows: [&[u8]; 4], a: [f32; 4], out: &mut [f32]) {
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
        fn $dot(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: installed only on the Avx512 backend (AVX-512F/VL detected); the frame
            // passes a whole row and an activation of its length.
            with_act!(a, |X, x, n| unsafe {
                dot_float_wide512::<$l, X, 1>([row], x, n)[0]
            })
        }
        fn $rows4(rows: [&[u8]; 4], a: &Act<'_>) -> [f32; 4] {
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

fn axpy_q8_0(row: &[u8], a: f32, out: &mut [f32]) {
    // SAFETY: installed only when AVX2/FMA/F16C were detected; the frame passes row bytes of
    // whole blocks covering exactly `out`'s columns.
    unsafe { axpy_q8_0_n::<1>([row], [a], out) }
}
fn axpy4_q8_0(rows: [&[u8]; 4], a: [f32; 4], out: &mut [f32]) {
    // SAFETY: as in `axpy_q8_0`, for each of the four rows.
    unsafe { axpy_q8_0_n::<4>(rows, a, out) }
}
fn axpy_q4_0(row: &[u8], a: f32, out: &mut [f32]) {
    // SAFETY: as in `axpy_q8_0`.
    unsafe { axpy_q4_0_n::<1>([row], [a], out) }
}
fn axpy4_q4_0(rows: [&[u8]; 4], a: [f32; 4], out: &mut [f32]) {
    // SAFETY: as in `axpy_q8_0`, for each of the four rows.
    unsafe { axpy_q4_0_n::<4>(rows, a, out) }
}
