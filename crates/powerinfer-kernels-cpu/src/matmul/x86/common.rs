//! What the x86 kernel files share: the fixed-order horizontal sum, f16 loads, the float
//! element loaders ([`FloatLoad`], [`FloatLoad16`]), the one-token activation dispatch
//! ([`with_act`]), the 512-bit one-token float dot ([`dot_float_rows512`]), the two sides of a
//! Q4_0 pair step ([`q4_0_pair_act`], [`q4_0_pair_weights`]) and the checks of the dense range
//! kernels ([`range_blocks`]).

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
#![deny(unsafe_op_in_unsafe_fn)]

use crate::matmul::act::Act;
use std::arch::x86_64::*;

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

/// The horizontal sums ([`hsum`]) of `N` accumulators: the end of the Q6_K dot kernels.
///
/// # Safety
/// AVX2 available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsums<const N: usize>(acc: [__m256; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for k in 0..N {
        // SAFETY: AVX2 available (caller).
        out[k] = unsafe { hsum(acc[k]) };
    }
    out
}

/// The horizontal sums ([`hsum`]) of `N` accumulators, each less `corr[k]`: the end of the
/// Q4_K/Q5_K dot kernels (`corr`: the minimum terms).
///
/// # Safety
/// AVX2 available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsums_less<const N: usize>(acc: [__m256; N], corr: [f32; N]) -> [f32; N] {
    let mut out = [0f32; N];
    for k in 0..N {
        // SAFETY: AVX2 available (caller).
        out[k] = unsafe { hsum(acc[k]) } - corr[k];
    }
    out
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
/// blocked GEMM of `gemm`).
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

/// Evaluates `body` with the one-token activation `a` as the kernels read it: `bytes` its f16
/// bits and `X = LF16` where it has them (`ActFormat::F16`), else its f32 values and
/// `X = LF32`; `n` its element count. Both give the same f32 values, so the same results.
macro_rules! with_act {
    ($a:expr, |$x:ident, $bytes:ident, $n:ident| $body:expr) => {{
        let a: &$crate::matmul::act::Act<'_> = $a;
        let $n = a.f.len();
        if a.h.is_empty() {
            type $x = $crate::matmul::x86::common::LF32;
            let $bytes: &[u8] = bytemuck::cast_slice(a.f);
            $body
        } else {
            type $x = $crate::matmul::x86::common::LF16;
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

/// `float::dot_float_wide512`'s arithmetic on `R` rows given by their first element and an
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

/// The activation side of a Q4_0 pair step at blocks `b`, `b + 1`: `d_x` of block `b` in lanes
/// 0..4 and of `b + 1` in lanes 4..8, the values that meet the low and the high nibbles, and the
/// pair's offset vector ([`ActFormat::Q8_0Pairs`](crate::matmul::act::ActFormat)).
///
/// # Safety
/// `a` holds values, scales and pair offsets for blocks `b`, `b + 1` (`b` even); AVX2 available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_0_pair_act(a: &Act<'_>, b: usize) -> (__m256, __m256i, __m256i, __m256i) {
    let spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    // SAFETY: the entries of blocks b, b + 1 exist (caller).
    unsafe {
        let dx = _mm_castpd_ps(_mm_load_sd(a.d.as_ptr().add(b) as *const f64));
        let dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dx), spread);
        let xq = a.q.as_ptr().add(b * 32);
        let x0 = _mm256_loadu_si256(xq as *const __m256i);
        let x1 = _mm256_loadu_si256(xq.add(32) as *const __m256i);
        let init = _mm256_loadu_si256(a.po.as_ptr().add(b / 2 * 8) as *const __m256i);
        (dx, x0, x1, init)
    }
}

/// The weight side of a Q4_0 pair step over the two 18-byte blocks at `p`: their nibbles masked
/// to the low four bits (`lo`: the low nibbles, block `b`'s in the low 128 bits; `hi`: the high
/// ones), and `d_w` of the first block in lanes 0..4, of the second in lanes 4..8.
///
/// # Safety
/// 36 readable bytes at `p`; AVX2/F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn q4_0_pair_weights(p: *const u8) -> (__m256i, __m256i, __m256) {
    let mask = _mm256_set1_epi8(0x0F);
    let spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    // SAFETY: the pair's 36 bytes are readable (caller).
    unsafe {
        let raw = _mm256_loadu2_m128i(p.add(18 + 2) as *const __m128i, p.add(2) as *const __m128i);
        let lo = _mm256_and_si256(raw, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
        let h0 = std::ptr::read_unaligned(p as *const u16) as i32;
        let h1 = std::ptr::read_unaligned(p.add(18) as *const u16) as i32;
        // Lanes 0..4: block b's scale, lanes 4..8: block b + 1's.
        let dw = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_cvtph_ps(_mm_insert_epi16::<1>(
                _mm_cvtsi32_si128(h0),
                h1,
            ))),
            spread,
        );
        (lo, hi, dw)
    }
}

#[cfg(powerinfer_avx512)]
/// Blocks per row of a dense range product, after checking what its kernel relies on: rows
/// of whole `block_bytes` blocks, rows `r` inside `data`, one output per row. Panics otherwise
/// (a frame bug).
pub(crate) fn range_blocks(
    data: &[u8],
    row_bytes: usize,
    r: &std::ops::Range<usize>,
    y: &[f32],
    block_bytes: usize,
) -> usize {
    let nb = row_bytes / block_bytes;
    assert!(row_bytes == nb * block_bytes && r.end * row_bytes <= data.len() && y.len() == r.len());
    nb
}
