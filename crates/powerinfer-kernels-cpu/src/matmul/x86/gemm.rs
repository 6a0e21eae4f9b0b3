//! Cache-blocked dense GEMM kernels (x86-64, [`Backend::Avx512`]) for F32, F16, BF16, Q8_0 and
//! Q4_0 weights, used by [`MatMul::gemm`](crate::MatMul::gemm) for at least [`MIN_TOKENS`] tokens
//! (Q8_0: [`MIN_TOKENS_Q8_0`], Q4_0: [`MIN_TOKENS_Q4_0`]); other types, backends and sizes take
//! the general GEMM frame.
//! Compiled only with Rust ≥ 1.89 (stable AVX-512 intrinsics; `cfg(powerinfer_avx512)` from the
//! crate's build.rs), so the crate keeps building with its MSRV.
//!
//! They beat the general frame, whose 2 × 4 tile re-reads the f32 activations from L3 per pair
//! of rows (measurements of this file's kernels and constants: `docs/tuning.md`).
//!
//! Loop order per thread (each thread owns a contiguous run of row blocks, and takes others'
//! when done): a block of rows whose weights stay in L2 ([`ROW_BLOCK_BYTES`]); inside it, groups
//! of `N` tokens whose activations stay in L1/L2; inside that, tiles of `R` rows × `N` tokens
//! through one micro-kernel call over the whole row. Each activation byte fetched from L3 thus
//! serves a whole row block, and each weight vector loaded into a register serves `N` tokens.
//! The float kernel takes several matrices in one call ([`dense_gemm_multi`]): their row blocks
//! are shared out together, and matrices with the same input prepare it once.
//!
//! The micro-kernels keep the exact arithmetic of the one-row multi-token kernels
//! (`RowOps::dot_batch`) of [`super::float`] and [`super::int`] per (row, token), so every
//! result is bit-identical to the frame's other multi-token paths, and for Q8_0 to the GEMV
//! (float GEMVs sum in the "wide" order of [`super::float`] instead):
//! * float types: one 8-lane f32 accumulator per (row, token) over 8-element steps in order, the
//!   fixed-order horizontal sum [`hsum`] (here the same tree of additions for four rows and two
//!   tokens at once: [`hsum_rows4`]), then scalar FMAs over the last `cols % 8` elements.
//!   Two tokens share one 512-bit register (one per 256-bit half, the weights loaded into both
//!   halves), so a core with two 512-bit FMA units runs twice the 8-lane FMAs per cycle: the
//!   4 rows × 6 pairs tile holds 24 such registers (6 pairs were faster than 5).
//! * Q8_0: per block an exact i32 dot product in 8 lanes of four bytes each, converted to f32,
//!   times `d_w·d_x`, added with one FMA to the accumulator of even or of odd blocks; at the end
//!   `hsum(even + odd)`. Here one 512-bit accumulator holds both (even blocks in the low half,
//!   odd ones in the high half) and one `vpdpbusd` serves a pair of blocks. The activation is
//!   stored as `q + 128` (unsigned), so `vpdpbusd(q + 128, w)` needs no sign handling; the
//!   excess `128·Σw` (per four bytes) is subtracted exactly by starting the integer sum at
//!   `−128·Σw`, computed once per row block when the weights are repacked.
//! * Q4_0 ("outer product" layout): each group of 16 rows is repacked per row block so that one
//!   512-bit vector holds four consecutive values (nibbles unpacked to `0..=15`) of each of the
//!   16 rows; a `vpdpbusd` of it with four activation bytes broadcast to every lane adds four
//!   products to each row's integer sum, so one instruction serves 16 rows and each weight
//!   vector serves 2 tokens. The GEMV's 8-lane accumulator per (row, token)
//!   (`int::dot_q4_0_tile`: per pair of blocks, lane `l < 4` sums elements `4l..4l + 4` and
//!   `16 + 4l..16 + 4l + 4` of the even block, lanes `4..8` those of the odd one, lane 0/4
//!   starting from `−8·Σq_x` of its block; an odd last block one group of four per lane) becomes
//!   8 vectors per token here, one row per element: the same exact integers, the same f32
//!   products `d_w·d_x`, FMAs and final sums in `hsum`'s order, so the results equal the
//!   GEMV's bit for bit.

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::common::{hsum, FloatLoad16, LBF16, LF16, LF32};
use crate::backend::Backend;
use crate::matmul::act;
use crate::matmul::frame::OutPtr;
use crate::matmul::scratch::ScratchVec;
use crate::matmul::weights::Weights;
use crate::pool::ThreadPool;
use powerinfer_gguf::quants::{f16_bits_to_f32, f32_to_f16_bits};
use powerinfer_gguf::GgmlType;
use std::arch::x86_64::*;

/// Float GEMMs of fewer tokens (one) go through the GEMV.
pub(crate) const MIN_TOKENS: usize = 2;
/// Q8_0 GEMMs of fewer tokens go through the few-token kernel over the file layout
/// ([`few`](super::few)): the weight repacking costs about as much as 4 tokens' dot products,
/// and the few-token kernel stays ahead up to 12 tokens.
const MIN_TOKENS_Q8_0: usize = 16;
/// Q4_0 GEMMs of fewer tokens go through the few-token kernel over the file layout
/// ([`few`](super::few)): repacking reads every weight from memory with 16 rows as 16 streams,
/// which costs more than a few tokens' dot products.
const MIN_TOKENS_Q4_0: usize = 8;

/// Weight bytes (as the micro-kernel reads them) per row block: the block's weights stay in L2
/// (at least 1 MiB per core on the AVX-512 cores this targets) while every token group passes
/// over them.
const ROW_BLOCK_BYTES: usize = 384 << 10;

/// Rows per float micro-kernel tile.
const FR: usize = 4;
/// Pairs of tokens per float micro-kernel tile.
const FP: usize = 6;
/// Tokens per float micro-kernel tile.
const FN: usize = 2 * FP;
/// Rows per Q8_0 micro-kernel tile.
const QR: usize = 4;
/// Tokens per Q8_0 micro-kernel tile.
const QN: usize = 4;

/// Computes `y_t = W x_t` for `n_tokens` tokens with the blocked kernels if they serve this
/// (type, backend, size); returns `false` (and touches nothing) otherwise. The lengths of `x`
/// and `y` have been checked by the caller.
pub(crate) fn dense_gemm(
    pool: &ThreadPool,
    backend: Backend,
    w: &Weights<'_>,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> bool {
    if backend != Backend::Avx512 || !backend.is_available() || n_tokens < MIN_TOKENS {
        return false;
    }
    if w.rows == 0 || w.cols == 0 {
        return false;
    }
    match w.ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            float_gemm(pool, &mut [FloatJob { w: *w, x, y }], n_tokens)
        }
        GgmlType::Q8_0 if w.cols % 32 == 0 && n_tokens >= MIN_TOKENS_Q8_0 => {
            q8_0_gemm(pool, w, x, n_tokens, y)
        }
        GgmlType::Q8_0 if super::few::fits(w.ty, w.cols) => {
            super::few::gemm(pool, w, x, n_tokens, None, y)
        }
        GgmlType::Q4_0 if w.cols % 32 == 0 && n_tokens >= MIN_TOKENS_Q4_0 => {
            q4_0_gemm(pool, w, x, n_tokens, y)
        }
        GgmlType::Q4_0 if super::few::fits(w.ty, w.cols) => {
            super::few::gemm(pool, w, x, n_tokens, None, y)
        }
        _ => return false,
    }
    true
}

/// [`dense_gemm`] of several jobs in one dispatch, where every job has float weights (F32,
/// F16, BF16) that the blocked kernel serves; returns `false` (and touches nothing) otherwise.
/// The lengths have been checked by the caller.
pub(crate) fn dense_gemm_multi(
    pool: &ThreadPool,
    backend: Backend,
    jobs: &mut [crate::matmul::GemmJob<'_>],
    n_tokens: usize,
) -> bool {
    if backend != Backend::Avx512 || !backend.is_available() || n_tokens < MIN_TOKENS {
        return false;
    }
    let float = |j: &crate::matmul::GemmJob<'_>| {
        matches!(j.w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
            && j.w.rows > 0
            && j.w.cols > 0
    };
    if !jobs.iter().all(float) {
        return false;
    }
    let mut fj: Vec<FloatJob<'_, '_>> = jobs
        .iter_mut()
        .map(|j| FloatJob {
            w: j.w,
            x: j.x,
            y: &mut *j.y,
        })
        .collect();
    float_gemm(pool, &mut fj, n_tokens);
    true
}

// ---------------------------------------------------------------------------------------------
// Float weights.

/// `R` float rows (`w[r]`, `n` elements) · `2P` tokens, written to
/// `out[(t0 + k)·stride + i0 + r]` for the first `nt` tokens (`x[k]`: token `k`'s last
/// `n % 8` values, those the pairs leave out): the arithmetic of
/// `float::dot_float_tile` per (row, token). Two tokens share each 512-bit accumulator, token
/// `2p` in the low 256 bits and `2p + 1` in the high ones, each half doing the 8-lane kernel's
/// FMAs in its order (so the same bits); a weight vector is loaded into both halves
/// ([`FloatLoad16::load8x2`]) and the activations of a pair come interleaved from `xp[p]`
/// (16 values per 8-element step: the pair's first token's 8, then its second's). On a core
/// with two 512-bit FMA units this doubles the FMA throughput of 256-bit accumulators.
/// `next`: where the rows of the tile after this one start, requested ahead (a hint).
///
/// # Safety
/// The weight pointers are valid for `n` elements, `xp[p]` for `16·(n / 8)` values, `x[k]` for
/// `n % 8` values (`k < nt`); the outputs are in bounds and written by this thread only; AVX2,
/// FMA, F16C, AVX-512 F and VL available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
#[allow(clippy::too_many_arguments)]
unsafe fn float_tile<L: FloatLoad16, const R: usize, const P: usize>(
    w: [*const u8; R],
    xp: [*const f32; P],
    x: &[*const f32; FN],
    nt: usize,
    n: usize,
    next: Option<*const u8>,
    out: OutPtr,
    stride: usize,
    i0: usize,
    t0: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    let steps = n / 8;
    // SAFETY: every load is at an element index below `n` (weights, `x`) or below
    // `16·(n / 8)` (`xp`) (caller); the writes are in bounds and this thread's own (caller);
    // prefetches never fault.
    unsafe {
        for st in 0..steps {
            if let Some(next) = next {
                // The next tile's share of this step (`R` rows of `n` elements read in `n / 8`
                // steps: `R·8` elements per step) into L2 (into L1 it evicted the tile being
                // read once rows reach 4 KiB).
                let at = next.wrapping_add(st * R * 8 * L::SIZE);
                let mut o = 0;
                while o < R * 8 * L::SIZE {
                    _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(o) as *const i8);
                    o += 64;
                }
            }
            let mut wv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                wv[r] = L::load8x2(w[r].add(st * 8 * L::SIZE));
            }
            for p in 0..P {
                let xv = _mm512_loadu_ps(xp[p].add(st * 16));
                for r in 0..R {
                    acc[r][p] = _mm512_fmadd_ps(wv[r], xv, acc[r][p]);
                }
            }
        }
        let i = steps * 8;
        // Every pair's sums first, in a loop the compiler unrolls, so the accumulators are
        // never indexed by a run-time pair (which would keep them in memory).
        let mut all = [_mm512_setzero_ps(); P];
        for p in 0..P {
            // The tile's rows (zeros past `R`, never written) for this pair of tokens.
            let mut v = [_mm512_setzero_ps(); 4];
            for r in 0..R {
                v[r] = acc[r][p];
            }
            all[p] = hsum_rows4(v);
        }
        for p in 0..P {
            let sums = all[p];
            for h in 0..2 {
                let k = 2 * p + h;
                if k >= nt {
                    continue;
                }
                let at = (t0 + k) * stride + i0;
                if i == n {
                    // The R rows of token k are R consecutive outputs.
                    let q = if h == 0 {
                        _mm512_castps512_ps128(sums)
                    } else {
                        _mm512_extractf32x4_ps::<1>(sums)
                    };
                    let dst = out.slice(at..at + R);
                    _mm_mask_storeu_ps(dst.as_mut_ptr(), (1u8 << R) - 1, q);
                    continue;
                }
                let mut lanes = [0f32; 16];
                _mm512_storeu_ps(lanes.as_mut_ptr(), sums);
                for r in 0..R {
                    let mut s = lanes[4 * h + r];
                    for j in i..n {
                        s = L::load1(w[r].add(j * L::SIZE)).mul_add(*x[k].add(j - i), s);
                    }
                    out.write(at + r, s);
                }
            }
        }
    }
}

/// The [`hsum`]s of a float tile's accumulators for one pair of tokens: `v[r]` holds row `r`'s
/// 8 lanes of the pair's first token in its low 256 bits, of the second in its high ones.
/// Returns the four rows' sums of the first token in lanes 0..4 and of the second in lanes
/// 4..8. Each sum is built by the same tree of additions as `hsum` (lanes `l` and `l + 4`,
/// then the pairs' `0 + 2` and `1 + 3`, then those two), so it has the same bits; four rows
/// and two tokens share each instruction.
///
/// # Safety
/// AVX-512 F available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn hsum_rows4(v: [__m512; 4]) -> __m512 {
    // 128-bit quarters of `v[r]`: [first token's lanes 0..4, its 4..8, second's 0..4, 4..8].
    // Level 1 (`x_l = lane l + lane l + 4`): quarters [r0 first, r0 second, r1 first, r1
    // second] (and rows 2, 3).
    let level1 = |a: __m512, b: __m512| {
        let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
        _mm512_add_ps(lo, hi)
    };
    let (s01, s23) = (level1(v[0], v[1]), level1(v[2], v[3]));
    // Level 2 (`x0 + x2`, `x1 + x3`): per quarter, two of rows 0/1 then two of rows 2/3.
    let (a, b) = (_mm512_castps_pd(s01), _mm512_castps_pd(s23));
    let u = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
        _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)),
    );
    // Level 3: element 0 of a quarter plus element 1, element 2 plus element 3.
    let f = _mm512_add_ps(u, _mm512_movehdup_ps(u));
    // Lane of (row, token): quarter 0: r0/r2 first token (lanes 0, 2), quarter 1: r0/r2
    // second (4, 6), quarter 2: r1/r3 first (8, 10), quarter 3: r1/r3 second (12, 14).
    let idx = _mm512_setr_epi32(0, 8, 2, 10, 4, 12, 6, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(idx, f)
}

/// Activation values per prepared part below which [`FloatActs::new`] works on the calling
/// thread alone (a decode step's few tokens: a dispatch would cost more than the copy).
const PARALLEL_PREP_VALUES: usize = 1 << 16;

/// The activations of [`float_tile`], prepared once per distinct input of a call: the values
/// the products multiply (for F16 weights `x` rounded to f16, `ActFormat::F16`; else `x`),
/// tokens in pairs, per pair and 8-element step the first token's 8 values then the second's
/// (an odd last token paired with zeros); and per token its last `cols % 8` values, which the
/// tile multiplies one by one.
struct FloatActs<'a> {
    /// The input these were made from (jobs with the same input share them).
    src: &'a [f32],
    /// Whether the values are rounded to f16.
    rounded: bool,
    /// `pairs · 16·(cols / 8)` values.
    paired: ScratchVec<f32>,
    /// `n_tokens · (cols % 8)` values.
    tail: ScratchVec<f32>,
}

impl<'a> FloatActs<'a> {
    /// Prepares `x` (`n_tokens` × `cols`); the pairs are split between the pool's threads when
    /// there are many values.
    fn new(pool: &ThreadPool, x: &'a [f32], cols: usize, n_tokens: usize, rounded: bool) -> Self {
        let steps = cols / 8;
        let pair_len = steps * 16;
        let pairs = n_tokens.div_ceil(2);
        let tl = cols % 8;
        let mut paired = ScratchVec::overwritten(pairs * pair_len);
        let mut tail = ScratchVec::overwritten(n_tokens * tl);
        let round = |v: f32| {
            if rounded {
                f16_bits_to_f32(f32_to_f16_bits(v))
            } else {
                v
            }
        };
        for (t, dst) in tail.chunks_exact_mut(tl.max(1)).take(n_tokens).enumerate() {
            for (d, &v) in dst.iter_mut().zip(&x[t * cols + steps * 8..(t + 1) * cols]) {
                *d = round(v);
            }
        }
        let fill = |ps: std::ops::Range<usize>, dst: &mut [f32]| {
            for (p, dst) in ps.zip(dst.chunks_exact_mut(pair_len.max(1))) {
                for h in 0..2 {
                    let t = 2 * p + h;
                    if t < n_tokens {
                        let src = &x[t * cols..t * cols + steps * 8];
                        // SAFETY: `dense_gemm` checked that the CPU has AVX-512 F, so AVX2 and
                        // F16C too (Backend::Avx512).
                        unsafe { interleave_half(src, dst, h, rounded) };
                    } else {
                        // An odd last token's partner: zeros (its products are not written).
                        for st in 0..steps {
                            dst[st * 16 + h * 8..st * 16 + h * 8 + 8].fill(0.0);
                        }
                    }
                }
            }
        };
        if pool.n_threads() == 1 || pairs * pair_len < PARALLEL_PREP_VALUES {
            fill(0..pairs, &mut paired);
        } else {
            let out = OutPtr::new(&mut paired);
            pool.for_chunks(pairs, |ps| {
                // SAFETY: `for_chunks` hands out disjoint ranges of pairs, so these element
                // ranges of `paired` are disjoint and in bounds (`pairs · pair_len` long).
                let dst = unsafe { out.slice(ps.start * pair_len..ps.end * pair_len) };
                fill(ps, dst);
            });
        }
        FloatActs {
            src: x,
            rounded,
            paired,
            tail,
        }
    }
}

/// Copies the 8-value steps of `src` into half `h` (0 or 1) of the 16-value steps of `dst`,
/// rounded to f16 and widened back (as `act::round_f16`, by the same F16C conversions) if
/// `rounded`.
///
/// # Safety
/// AVX2 and F16C available.
#[target_feature(enable = "avx2,f16c")]
unsafe fn interleave_half(src: &[f32], dst: &mut [f32], h: usize, rounded: bool) {
    assert!(h < 2 && dst.len() >= src.len() / 8 * 16);
    for (st, v) in src.chunks_exact(8).enumerate() {
        let o = &mut dst[st * 16 + h * 8..st * 16 + h * 8 + 8];
        // SAFETY: `v` and `o` hold 8 values each; AVX2/F16C available (caller).
        unsafe {
            let mut a = _mm256_loadu_ps(v.as_ptr());
            if rounded {
                a = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(a));
            }
            _mm256_storeu_ps(o.as_mut_ptr(), a);
        }
    }
}

/// One product of [`float_gemm`]: `y_t = W x_t` for every token.
pub(crate) struct FloatJob<'a, 'b> {
    pub(crate) w: Weights<'a>,
    pub(crate) x: &'b [f32],
    pub(crate) y: &'b mut [f32],
}

/// Evaluates `$call` with the runtime tile size `($r, $n)` as the constants `$R` and `$N`: `r`
/// in `1..=4`, `n` one of the listed token counts.
macro_rules! dispatch_tile {
    ($r:expr, $n:expr, [$($nn:literal),*], |$R:ident, $N:ident| $call:expr) => {
        match ($r, $n) {
            $((4, $nn) => { const $R: usize = 4; const $N: usize = $nn; $call })*
            $((3, $nn) => { const $R: usize = 3; const $N: usize = $nn; $call })*
            $((2, $nn) => { const $R: usize = 2; const $N: usize = $nn; $call })*
            $((1, $nn) => { const $R: usize = 1; const $N: usize = $nn; $call })*
            _ => unreachable!("tile sizes are 1..=4 rows × the listed tokens"),
        }
    };
}

/// The first `K` of the `M` pointers of a full-size tile array.
#[inline(always)]
fn first<T: Copy, const M: usize, const K: usize>(a: &[T; M]) -> [T; K] {
    std::array::from_fn(|k| a[k])
}

/// `(start, len)` of the consecutive pieces of at most `step` (> 0) that cover `r`, in order:
/// the row blocks, token groups and row tiles of the blocked loops.
#[inline(always)]
fn steps(r: std::ops::Range<usize>, step: usize) -> impl Iterator<Item = (usize, usize)> {
    let end = r.end;
    r.step_by(step).map(move |s| (s, step.min(end - s)))
}

/// `R` pointers `base + (i + r)·step`, clamped to the last valid `i + r < end` (the unused
/// ones are never read).
#[inline(always)]
fn ptrs<T, const R: usize>(base: *const T, step: usize, i: usize, count: usize) -> [*const T; R] {
    std::array::from_fn(|r| base.wrapping_add((i + r.min(count - 1)) * step))
}

/// The float GEMM (see the [module docs](self)) of every job, float weights all (F32, F16 or
/// BF16, any mix), in one dispatch of the pool: the row blocks of all jobs are the grains, so
/// small matrices (a layer's K and V) do not leave a thread idle, and jobs with the same input
/// (a layer's Q, K and V; an FFN's gate and up) share its prepared activations. The weights are
/// read in place: converting F16/BF16 rows to f32 once per row block was no faster (the kernel
/// is FMA-bound, the conversions run beside the FMAs). The lengths have been checked.
fn float_gemm(pool: &ThreadPool, jobs: &mut [FloatJob<'_, '_>], n_tokens: usize) {
    struct Part<'w> {
        w: Weights<'w>,
        acts: usize,
        out: OutPtr,
    }
    let mut acts: Vec<FloatActs<'_>> = Vec::new();
    let mut parts = Vec::with_capacity(jobs.len());
    // The token chunks every row block is cut into (one chunk up to `TOKEN_CHUNK` tokens).
    let chunk = token_chunk(n_tokens);
    // Grains, row block after row block of every job, each block's token chunks in order:
    // (part, first row, rows, first token, tokens).
    let mut blocks: Vec<(usize, usize, usize, usize, usize)> = Vec::new();
    for (k, j) in jobs.iter_mut().enumerate() {
        let w = &j.w;
        let (rows, cols, rb_bytes) = (w.rows, w.cols, w.row_bytes);
        let size = if w.ty == GgmlType::F32 { 4 } else { 2 };
        debug_assert!(rb_bytes >= cols * size && w.data.len() >= rows * rb_bytes);
        debug_assert!(j.x.len() >= n_tokens * cols && j.y.len() >= n_tokens * rows);
        // The values every F16 product multiplies (`ActFormat::F16`): x rounded to f16.
        let rounded = w.ty == GgmlType::F16;
        let a = match acts
            .iter()
            .position(|a| std::ptr::eq(a.src, j.x) && a.rounded == rounded)
        {
            Some(a) => a,
            None => {
                acts.push(FloatActs::new(pool, j.x, cols, n_tokens, rounded));
                acts.len() - 1
            }
        };
        let block_rows = (ROW_BLOCK_BYTES / rb_bytes.max(1)).clamp(FR, 256) / FR * FR;
        for (b0, bn) in steps(0..rows, block_rows) {
            blocks.extend(steps(0..n_tokens, chunk).map(|(t0, tn)| (k, b0, bn, t0, tn)));
        }
        parts.push(Part {
            w: j.w,
            acts: a,
            out: OutPtr::new(j.y),
        });
    }
    // One grain each: a thread done with its own takes the others' last ones.
    pool.for_grains(blocks.len(), 1, |_, range| {
        for &(k, b0, bn, t0, tn) in &blocks[range] {
            let (part, a) = (&parts[k], &acts[parts[k].acts]);
            let ts = t0..t0 + tn;
            match part.w.ty {
                GgmlType::F32 => float_block::<LF32>(&part.w, part.out, a, b0, bn, ts, n_tokens),
                GgmlType::F16 => float_block::<LF16>(&part.w, part.out, a, b0, bn, ts, n_tokens),
                _ => float_block::<LBF16>(&part.w, part.out, a, b0, bn, ts, n_tokens),
            }
        }
    });
}

/// Most tokens of one grain of [`float_gemm`]. A long prompt's row blocks are cut into token
/// chunks, so that the last grains, which decide when the dispatch ends, are short, and a
/// grain's activations stay near the L2 size.
const TOKEN_CHUNK: usize = 128;

/// The token chunk of an `n_tokens` product: `n_tokens` cut into equal chunks of at most about
/// [`TOKEN_CHUNK`], rounded up to whole token groups (`FN`, even, so chunks start on a pair).
fn token_chunk(n_tokens: usize) -> usize {
    let chunks = n_tokens.div_ceil(TOKEN_CHUNK).max(1);
    n_tokens.div_ceil(chunks).div_ceil(FN) * FN
}

/// Rows `b0..b0 + bn` of one float product for the tokens `tokens` (of `n_tokens`; the
/// first one even): inside the block, groups of `FN` tokens whose activations stay in L1/L2;
/// inside that, tiles of `FR` rows through one [`float_tile`] call over the whole row.
fn float_block<L: FloatLoad16>(
    w: &Weights<'_>,
    out: OutPtr,
    a: &FloatActs<'_>,
    b0: usize,
    bn: usize,
    tokens: std::ops::Range<usize>,
    n_tokens: usize,
) {
    let (rows, cols, rb_bytes, wp) = (w.rows, w.cols, w.row_bytes, w.data.as_ptr());
    let pair_len = cols / 8 * 16;
    let tl = cols % 8;
    let (pp, tp) = (a.paired.as_ptr(), a.tail.as_ptr());
    debug_assert!(tokens.start % 2 == 0 && tokens.end <= n_tokens);
    for (t0, nt) in steps(tokens, FN) {
        let np = nt.div_ceil(2);
        let xs = ptrs::<f32, FN>(tp, tl, t0, nt);
        let pairs = ptrs::<f32, FP>(pp, pair_len, t0 / 2, np);
        for (i, nr) in steps(b0..b0 + bn, FR) {
            let ws = ptrs::<u8, FR>(wp, rb_bytes, i, nr);
            // One token group (a decode step's few tokens): the tile's rows are read once, as
            // interleaved streams the hardware prefetchers left waiting on memory, so the next
            // tile (the rows after these) is requested ahead.
            let next = (n_tokens <= FN).then(|| wp.wrapping_add((i + nr) * rb_bytes));
            // SAFETY: rows `i..i + nr` < rows (the block lies in the matrix) and tokens
            // `t0..t0 + nt` < n_tokens, so every weight pointer is valid for `cols` elements,
            // every tail pointer for `cols % 8` values and every pair pointer (pairs
            // `t0 / 2..t0 / 2 + np`, `t0` even) for `pair_len` values (checked lengths, the
            // activations prepared for `n_tokens` tokens of `cols`); outputs
            // `(t0 + k)·rows + i + r` are in bounds and belong to this block, which one thread
            // computes (`for_grains` hands out each grain once); `dense_gemm` checked that the
            // CPU has AVX-512 F/VL (Backend::Avx512 implies AVX2/FMA/F16C).
            unsafe {
                dispatch_tile!(nr, np, [6, 5, 4, 3, 2, 1], |R, P| {
                    float_tile::<L, R, P>(
                        first(&ws),
                        first(&pairs),
                        &xs,
                        nt,
                        cols,
                        next,
                        out,
                        rows,
                        i,
                        t0,
                    )
                })
            };
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Q8_0 weights.

/// Bytes of one repacked pair of Q8_0 blocks: 64 weights (i8), 16 i32 start values
/// `−128·Σw` (one per four bytes), 16 f32 scales (block `2p`'s ×8, block `2p + 1`'s ×8).
const QPAIR: usize = 192;

/// Activations for [`q8_0_gemm`]: per token, `u = q + 128` in pairs of blocks (64 bytes a pair,
/// an odd last block padded with zeros) and the scales spread to 16 lanes a pair (block `2p`'s
/// ×8, block `2p + 1`'s ×8; 0 for a missing block).
struct Q8Acts {
    /// `npairs·64` bytes per token.
    u: ScratchVec<u8>,
    /// `npairs·16` values per token.
    d: ScratchVec<f32>,
    /// Pairs of blocks per token.
    npairs: usize,
}

impl Q8Acts {
    /// Quantizes `x` (`n_tokens` × `cols`, `cols` a multiple of 32) exactly as the GEMV does
    /// ([`act::ActBuf`]) and stores it in this layout.
    fn new(x: &[f32], cols: usize, n_tokens: usize) -> Self {
        let acts = act::ActBuf::new(act::ActFormat::Q8_0, x, cols);
        let nb = cols / 32;
        let npairs = nb.div_ceil(2);
        let mut u = ScratchVec::zeroed(n_tokens * npairs * 64);
        let mut d = ScratchVec::zeroed(n_tokens * npairs * 16);
        for t in 0..n_tokens {
            let a = acts.get(t);
            let ut = &mut u[t * npairs * 64..(t + 1) * npairs * 64];
            for (o, &q) in ut.iter_mut().zip(a.q) {
                *o = (q as u8) ^ 0x80;
            }
            let dt = &mut d[t * npairs * 16..(t + 1) * npairs * 16];
            for (b, &db) in a.d.iter().enumerate() {
                dt[b * 8..b * 8 + 8].fill(db);
            }
        }
        Q8Acts { u, d, npairs }
    }
}

/// Repacks rows `rows` of the Q8_0 matrix `w` into `out` (`QPAIR` bytes per pair of blocks,
/// row after row; see [`QPAIR`]).
///
/// # Safety
/// `out` holds `rows.len()·npairs·QPAIR` bytes; AVX-512 F/BW/VL/VNNI and F16C available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_pack(w: &Weights<'_>, rows: std::ops::Range<usize>, out: &mut [u8]) {
    let nb = w.cols / 32;
    let npairs = nb.div_ceil(2);
    debug_assert!(out.len() >= rows.len() * npairs * QPAIR);
    let c128 = _mm512_set1_epi8(-128);
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    let mut o = out.as_mut_ptr();
    for i in rows {
        let row = w.row(i);
        let p = row.as_ptr();
        for pr in 0..npairs {
            let b = 2 * pr;
            let two = b + 1 < nb;
            // SAFETY: blocks `b` (and `b + 1` when `two`) lie within the row (`nb` whole
            // 34-byte blocks); the `QPAIR` bytes at `o` lie within `out` (one pair of one row
            // of the range per step, checked above).
            unsafe {
                let blk = p.add(b * 34);
                let lo = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                let (hi, h1) = if two {
                    (
                        _mm256_loadu_si256(blk.add(36) as *const __m256i),
                        std::ptr::read_unaligned(blk.add(34) as *const u16),
                    )
                } else {
                    (_mm256_setzero_si256(), 0)
                };
                let wv = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                let h0 = std::ptr::read_unaligned(blk as *const u16);
                // 128·Σw per four bytes, negated: the start of the integer sum.
                let c = _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv),
                );
                let hv = _mm_insert_epi16::<1>(_mm_cvtsi32_si128(h0 as i32), h1 as i32);
                let dv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(hv)));
                let dv = if two {
                    dv
                } else {
                    _mm512_maskz_mov_ps(0x00FF, dv)
                };
                _mm512_storeu_si512(o as *mut __m512i, wv);
                _mm512_storeu_si512(o.add(64) as *mut __m512i, c);
                _mm512_storeu_ps(o.add(128) as *mut f32, dv);
                o = o.add(QPAIR);
            }
        }
    }
}

/// `R` repacked Q8_0 rows (`w[r]`, `npairs` pairs) · `N` tokens of [`Q8Acts`] (`u[k]`, `d[k]`),
/// written to `out[(t0 + k)·stride + i0 + r]`: per (row, token) the arithmetic of
/// `int::dot_q8_0_tile` (see the [module docs](self)).
///
/// # Safety
/// The pointers are valid for `npairs` pairs; the outputs are in bounds and written by this
/// thread only; AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn q8_0_tile<const R: usize, const N: usize>(
    w: [*const u8; R],
    u: [*const u8; N],
    d: [*const f32; N],
    npairs: usize,
    out: OutPtr,
    stride: usize,
    i0: usize,
    t0: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    // SAFETY: every load is within pair `p < npairs` of its row or token (caller); the writes
    // are in bounds and this thread's own (caller).
    unsafe {
        for p in 0..npairs {
            let mut wv = [_mm512_setzero_si512(); R];
            let mut cv = [_mm512_setzero_si512(); R];
            let mut dv = [_mm512_setzero_ps(); R];
            for r in 0..R {
                let q = w[r].add(p * QPAIR);
                wv[r] = _mm512_loadu_si512(q as *const __m512i);
                cv[r] = _mm512_loadu_si512(q.add(64) as *const __m512i);
                dv[r] = _mm512_loadu_ps(q.add(128) as *const f32);
            }
            for k in 0..N {
                let uv = _mm512_loadu_si512(u[k].add(p * 64) as *const __m512i);
                let dx = _mm512_loadu_ps(d[k].add(p * 16));
                for r in 0..R {
                    let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv[r], uv, wv[r]));
                    // d_w·d_x in every lane: the same product as in the GEMV.
                    acc[r][k] = _mm512_fmadd_ps(s, _mm512_mul_ps(dv[r], dx), acc[r][k]);
                }
            }
        }
        for r in 0..R {
            for k in 0..N {
                let a = acc[r][k];
                let even = _mm512_castps512_ps256(a);
                let odd = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
                out.write((t0 + k) * stride + i0 + r, hsum(_mm256_add_ps(even, odd)));
            }
        }
    }
}

/// The Q8_0 GEMM (see the [module docs](self)); `cols` is a multiple of 32.
fn q8_0_gemm(pool: &ThreadPool, w: &Weights<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let acts = Q8Acts::new(x, cols, n_tokens);
    let npairs = acts.npairs;
    let packed_row = npairs * QPAIR;
    let block_rows = (ROW_BLOCK_BYTES / packed_row).clamp(QR, 256) / QR * QR;
    let out = OutPtr::new(y);
    let n_tiles = rows.div_ceil(QR);
    // One row block per grain, as in `float_gemm`.
    pool.for_grains(n_tiles, block_rows / QR, |_, tiles| {
        let (up, dp) = (acts.u.as_ptr(), acts.d.as_ptr());
        let (r0, r1) = (tiles.start * QR, (tiles.end * QR).min(rows));
        // The thread's packing buffer, kept between grains and calls (as `Q4_PACKED`).
        let mut packed = Q8_PACKED.take();
        let need = block_rows.min(r1 - r0) * packed_row;
        if packed.len() < need {
            packed.resize(need, 0);
        }
        for (b0, bn) in steps(r0..r1, block_rows) {
            // SAFETY: `packed` holds `block_rows ≥ bn` packed rows; `dense_gemm` checked that
            // the CPU has AVX-512 F/BW/VL/VNNI (Backend::Avx512, which implies F16C).
            unsafe { q8_0_pack(w, b0..b0 + bn, &mut packed) };
            let pp = packed.as_ptr();
            for (t0, nt) in steps(0..n_tokens, QN) {
                let us = ptrs::<u8, QN>(up, npairs * 64, t0, nt);
                let ds = ptrs::<f32, QN>(dp, npairs * 16, t0, nt);
                for (i, nr) in steps(b0..b0 + bn, QR) {
                    let ws = ptrs::<u8, QR>(pp, packed_row, i - b0, nr);
                    // SAFETY: packed rows `i − b0 + r` < `bn` and tokens `t0 + k` < n_tokens
                    // hold `npairs` pairs each; outputs `(t0 + k)·rows + i + r` are in bounds
                    // and belong to this thread's rows (disjoint parts); CPU features as above.
                    unsafe {
                        dispatch_tile!(nr, nt, [4, 3, 2, 1], |R, N| {
                            q8_0_tile::<R, N>(
                                first(&ws),
                                first(&us),
                                first(&ds),
                                npairs,
                                out,
                                rows,
                                i,
                                t0,
                            )
                        })
                    };
                }
            }
        }
        Q8_PACKED.set(packed);
    });
}

thread_local! {
    /// Each thread's packing buffer of [`q8_0_gemm`].
    static Q8_PACKED: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

// ---------------------------------------------------------------------------------------------
// Q4_0 weights.

/// Rows per Q4_0 micro-kernel tile: one 512-bit vector holds 4 bytes of each of 16 rows.
const Q4R: usize = 16;
/// Tokens per Q4_0 micro-kernel tile (8 accumulators per token: 16 of the 32 registers).
const Q4N: usize = 2;
/// Bytes of one repacked Q4_0 block of [`Q4R`] rows: 8 vectors of 64 bytes, then the 16 rows'
/// scales as f32. Vector `j` holds, in dword `r`, the unpacked values `0..=15` of four elements
/// of row `r`: for `j < 4` elements `4j..4j + 4` (the low nibbles of bytes `4j..4j + 4`), for
/// `j ≥ 4` elements `16 + 4(j − 4)..` (the high nibbles of bytes `4(j − 4)..4(j − 4) + 4`).
const Q4BLK: usize = 576;
/// Bytes ahead of the block being repacked that [`q4_0_pack`] prefetches in each row.
const Q4_PREFETCH: usize = 256;

/// Activations for [`q4_0_gemm`]: the GEMV's Q8_0 values and scales ([`act::ActBuf`]
/// in [`ActFormat::Q8_0`](act::ActFormat::Q8_0) order, the same numbers as the
/// `Q8_0Pairs` order the GEMV reads), plus per token `nb + 8` i32 offsets: `−8·Σq` of each
/// block, then `−8·Σq` of each group of four values of the last block (the GEMV's offsets for a
/// pair of blocks and for an odd last block).
struct Q4Acts<'a> {
    acts: act::ActBuf<'a>,
    /// `nb + 8` values per token.
    off: ScratchVec<i32>,
}

impl<'a> Q4Acts<'a> {
    /// Quantizes `x` (`n_tokens` × `cols`, `cols` a multiple of 32) exactly as the GEMV does.
    fn new(x: &'a [f32], cols: usize, n_tokens: usize) -> Self {
        let acts = act::ActBuf::new(act::ActFormat::Q8_0, x, cols);
        let nb = cols / 32;
        let mut off = ScratchVec::zeroed(n_tokens * (nb + 8));
        for t in 0..n_tokens {
            let q = acts.get(t).q;
            let o = &mut off[t * (nb + 8)..(t + 1) * (nb + 8)];
            for b in 0..nb {
                o[b] = -8
                    * q[b * 32..b * 32 + 32]
                        .iter()
                        .map(|&v| v as i32)
                        .sum::<i32>();
            }
            for g in 0..8 {
                let s = (nb - 1) * 32 + 4 * g;
                o[nb + g] = -8 * q[s..s + 4].iter().map(|&v| v as i32).sum::<i32>();
            }
        }
        Q4Acts { acts, off }
    }
}

/// Repacks the row groups of rows `rows` (`rows.start` a multiple of [`Q4R`]) of the Q4_0 matrix
/// `w` into `out` (`nb·Q4BLK` bytes per group of [`Q4R`] rows, block after block; rows past the
/// matrix are zero with scale 0).
///
/// # Safety
/// `out` holds `rows.len().div_ceil(Q4R)·nb·Q4BLK` bytes; AVX-512 F/BW/VL and F16C available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn q4_0_pack(w: &Weights<'_>, rows: std::ops::Range<usize>, out: &mut [u8]) {
    let nb = w.cols / 32;
    let groups = rows.len().div_ceil(Q4R);
    debug_assert!(out.len() >= groups * nb * Q4BLK);
    let zero = [0u8; 18];
    let mask = _mm512_set1_epi8(0x0F);
    let mut o = out.as_mut_ptr();
    for g in 0..groups {
        let i0 = rows.start + g * Q4R;
        // Block 0 of each of the group's rows (a zero block, read again for every block, for
        // rows past the range).
        let (p, step): ([*const u8; Q4R], [usize; Q4R]) = (
            std::array::from_fn(|r| {
                if i0 + r < rows.end {
                    w.row(i0 + r).as_ptr()
                } else {
                    zero.as_ptr()
                }
            }),
            std::array::from_fn(|r| if i0 + r < rows.end { 18 } else { 0 }),
        );
        for b in 0..nb {
            // SAFETY: block `b < nb` of every row of the range lies within that row (whole
            // 18-byte blocks), the zero block is 18 bytes; the `Q4BLK` bytes at `o` lie within
            // `out` (one block of one group per step, checked above).
            unsafe {
                // (A macro: a closure would not inherit this function's target features.)
                macro_rules! q {
                    ($r:expr) => {
                        _mm_loadu_si128(p[$r].add(b * step[$r] + 2) as *const __m128i)
                    };
                }
                // The 16 rows are 16 streams from memory: prefetch ~4 lines ahead in each (the
                // hardware prefetchers kept the packing latency-bound).
                for r in 0..Q4R {
                    _mm_prefetch::<_MM_HINT_T0>(
                        p[r].wrapping_add((b * 18 + Q4_PREFETCH) * (step[r] / 18)) as *const i8,
                    );
                }
                // Register `i`, 128-bit lane `l`: the 16 bytes of row `4l + i`; after the
                // in-lane 4 × 4 transposition of dwords, register `j` lane `l` holds dword `j`
                // of rows `4l..4l + 4`, i.e. dword `r` of register `j` is row `r`'s dword `j`.
                let mut v = [_mm512_setzero_si512(); 4];
                for i in 0..4 {
                    let z = _mm512_castsi128_si512(q!(i));
                    let z = _mm512_inserti32x4::<1>(z, q!(4 + i));
                    let z = _mm512_inserti32x4::<2>(z, q!(8 + i));
                    v[i] = _mm512_inserti32x4::<3>(z, q!(12 + i));
                }
                let t0 = _mm512_unpacklo_epi32(v[0], v[1]);
                let t1 = _mm512_unpackhi_epi32(v[0], v[1]);
                let t2 = _mm512_unpacklo_epi32(v[2], v[3]);
                let t3 = _mm512_unpackhi_epi32(v[2], v[3]);
                let d = [
                    _mm512_unpacklo_epi64(t0, t2),
                    _mm512_unpackhi_epi64(t0, t2),
                    _mm512_unpacklo_epi64(t1, t3),
                    _mm512_unpackhi_epi64(t1, t3),
                ];
                for j in 0..4 {
                    let lo = _mm512_and_si512(d[j], mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(d[j]), mask);
                    _mm512_storeu_si512(o.add(j * 64) as *mut __m512i, lo);
                    _mm512_storeu_si512(o.add((4 + j) * 64) as *mut __m512i, hi);
                }
                let mut h = [0u16; Q4R];
                for r in 0..Q4R {
                    h[r] = std::ptr::read_unaligned(p[r].add(b * step[r]) as *const u16);
                }
                let dv = _mm512_cvtph_ps(_mm256_loadu_si256(h.as_ptr() as *const __m256i));
                _mm512_storeu_ps(o.add(512) as *mut f32, dv);
                o = o.add(Q4BLK);
            }
        }
    }
}

/// One group of [`Q4R`] repacked Q4_0 rows (`w`, `nb` blocks) · `N` tokens (values `xq[k]`,
/// scales `xd[k]`, offsets `xo[k]` of [`Q4Acts`]), the first `nr` rows written to
/// `out[(t0 + k)·stride + i0 + r]`. Per (row, token) the arithmetic of
/// `int::dot_q4_0_tile` (see the [module docs](self)): lane `l` of its 8-lane accumulator
/// is the vector `acc[k][l]` here, one row per 32-bit element.
///
/// # Safety
/// `w` is valid for `nb` packed blocks, each token's pointers for `nb` blocks (`nb + 8`
/// offsets); the outputs are in bounds and written by this thread only; AVX-512 F/BW/VL/VNNI,
/// AVX2, FMA and F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[allow(clippy::too_many_arguments)]
unsafe fn q4_0_tile<const N: usize>(
    w: *const u8,
    nb: usize,
    xq: [*const i8; N],
    xd: [*const f32; N],
    xo: [*const i32; N],
    out: OutPtr,
    stride: usize,
    i0: usize,
    nr: usize,
    t0: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); 8]; N];
    let zero = _mm512_setzero_si512();
    // SAFETY: every load is within block `b < nb` of the group or of a token (`nb + 8`
    // offsets); the writes are in bounds and this thread's own (caller).
    unsafe {
        // Four bytes of token `k`'s values at element `e` of block `b`, in every dword. (Macros:
        // closures would not inherit this function's target features.)
        macro_rules! bx {
            ($k:expr, $b:expr, $e:expr) => {
                _mm512_set1_epi32(std::ptr::read_unaligned(
                    xq[$k].add($b * 32 + $e) as *const i32
                ))
            };
        }
        // Packed block `b`: its 8 value vectors and its scales.
        macro_rules! load {
            ($b:expr) => {{
                let q = w.add($b * Q4BLK);
                let mut wv = [_mm512_setzero_si512(); 8];
                for j in 0..8 {
                    wv[j] = _mm512_loadu_si512(q.add(j * 64) as *const __m512i);
                }
                (wv, _mm512_loadu_ps(q.add(512) as *const f32))
            }};
        }
        let mut b = 0;
        // Pairs of blocks: lanes 0..4 (block b) and 4..8 (block b + 1) of the GEMV's
        // accumulator; lane l sums elements 4l..4l + 4 and 16 + 4l..16 + 4l + 4, lane 0 (4)
        // starts from the block's −8·Σq.
        while b + 2 <= nb {
            for h in 0..2 {
                let bb = b + h;
                let (wv, dw) = load!(bb);
                for k in 0..N {
                    let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*xd[k].add(bb)));
                    for l in 0..4 {
                        let init = if l == 0 {
                            _mm512_set1_epi32(*xo[k].add(bb))
                        } else {
                            zero
                        };
                        let s = _mm512_dpbusd_epi32(init, wv[l], bx!(k, bb, 4 * l));
                        let s = _mm512_dpbusd_epi32(s, wv[4 + l], bx!(k, bb, 16 + 4 * l));
                        let a = &mut acc[k][4 * h + l];
                        *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, *a);
                    }
                }
            }
            b += 2;
        }
        // An odd last block: lane l sums elements 4l..4l + 4, starting from their −8·Σq.
        if b < nb {
            let (wv, dw) = load!(b);
            for k in 0..N {
                let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*xd[k].add(b)));
                for l in 0..8 {
                    // Vector j holds elements 4l (l < 4) or 16 + 4(l − 4) (l ≥ 4): lane l of
                    // the GEMV's last block reads elements 4l..4l + 4 = vector l.
                    let init = _mm512_set1_epi32(*xo[k].add(nb + l));
                    let s = _mm512_dpbusd_epi32(init, wv[l], bx!(k, b, 4 * l));
                    acc[k][l] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc[k][l]);
                }
            }
        }
        for k in 0..N {
            // `hsum`'s order: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
            let a = &acc[k];
            let mut s = [_mm512_setzero_ps(); 4];
            for l in 0..4 {
                s[l] = _mm512_add_ps(a[l], a[4 + l]);
            }
            let y = _mm512_add_ps(_mm512_add_ps(s[0], s[2]), _mm512_add_ps(s[1], s[3]));
            let mut v = [0f32; Q4R];
            _mm512_storeu_ps(v.as_mut_ptr(), y);
            for r in 0..nr {
                out.write((t0 + k) * stride + i0 + r, v[r]);
            }
        }
    }
}

/// The Q4_0 GEMM (see the [module docs](self)).
fn q4_0_gemm(pool: &ThreadPool, w: &Weights<'_>, x: &[f32], n_tokens: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let nb = cols / 32;
    let acts = Q4Acts::new(x, cols, n_tokens);
    let packed_group = nb * Q4BLK;
    let block_groups = (ROW_BLOCK_BYTES / packed_group).clamp(1, 16);
    let out = OutPtr::new(y);
    let n_groups = rows.div_ceil(Q4R);
    // One row block per grain, as in `float_gemm`.
    pool.for_grains(n_groups, block_groups, |_, groups| {
        // The thread's packing buffer, kept between calls: a fresh allocation per call cost page
        // faults worth a large part of a few-token product (every byte read is packed first).
        let mut packed = Q4_PACKED.take();
        let need = block_groups.min(groups.len()) * packed_group;
        if packed.len() < need {
            packed.resize(need, 0);
        }
        for (g0, gn) in steps(groups, block_groups) {
            let g1 = g0 + gn;
            let (r0, r1) = (g0 * Q4R, (g1 * Q4R).min(rows));
            // SAFETY: `packed` holds `block_groups ≥ g1 − g0` packed groups; `dense_gemm`
            // checked that the CPU has AVX-512 F/BW/VL (Backend::Avx512, which implies F16C).
            unsafe { q4_0_pack(w, r0..r1, &mut packed) };
            for (t0, nt) in steps(0..n_tokens, Q4N) {
                let tok = |k: usize| acts.acts.get(t0 + k.min(nt - 1));
                let xq: [*const i8; Q4N] = std::array::from_fn(|k| tok(k).q.as_ptr());
                let xd: [*const f32; Q4N] = std::array::from_fn(|k| tok(k).d.as_ptr());
                let xo: [*const i32; Q4N] =
                    std::array::from_fn(|k| acts.off[(t0 + k.min(nt - 1)) * (nb + 8)..].as_ptr());
                for g in g0..g1 {
                    let i = g * Q4R;
                    let nr = (rows - i).min(Q4R);
                    let wp = packed[(g - g0) * packed_group..].as_ptr();
                    // SAFETY: packed group `g − g0` < `g1 − g0` holds `nb` blocks; tokens
                    // `t0 + k` < n_tokens have `nb` blocks of values and scales and `nb + 8`
                    // offsets; outputs `(t0 + k)·rows + i + r` (r < nr) are in bounds and
                    // belong to this thread's rows (disjoint groups); `dense_gemm` checked that
                    // the CPU has AVX-512 F/BW/VL/VNNI.
                    unsafe {
                        match nt {
                            2 => q4_0_tile::<2>(wp, nb, xq, xd, xo, out, rows, i, nr, t0),
                            _ => q4_0_tile::<1>(
                                wp,
                                nb,
                                [xq[0]],
                                [xd[0]],
                                [xo[0]],
                                out,
                                rows,
                                i,
                                nr,
                                t0,
                            ),
                        }
                    };
                }
            }
        }
        Q4_PACKED.set(packed);
    });
}

thread_local! {
    /// [`q4_0_gemm`]'s packing buffer of this thread (empty while in use or before the first
    /// call).
    static Q4_PACKED: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::MatMul;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    /// Raw weight bytes of `n` pseudo-random elements of `ty` (Q8_0 values span all of i8, Q4_0
    /// all 16 nibbles).
    fn weight_bytes(ty: GgmlType, n: usize) -> Vec<u8> {
        let v = vals(n, 7);
        match ty {
            GgmlType::F32 => v.iter().flat_map(|f| f.to_le_bytes()).collect(),
            GgmlType::F16 => v
                .iter()
                .flat_map(|&f| half::f16::from_f32(f).to_le_bytes())
                .collect(),
            GgmlType::BF16 => v
                .iter()
                .flat_map(|&f| half::bf16::from_f32(f).to_le_bytes())
                .collect(),
            GgmlType::Q8_0 => v
                .chunks_exact(32)
                .flat_map(|b| {
                    let mut blk = half::f16::from_f32(b[0].abs() / 64.0)
                        .to_le_bytes()
                        .to_vec();
                    blk.extend(
                        b.iter()
                            .map(|&f| ((f * 128.0) as i32).clamp(-128, 127) as i8 as u8),
                    );
                    blk
                })
                .collect(),
            GgmlType::Q4_0 => v
                .chunks_exact(32)
                .flat_map(|b| {
                    let mut blk = half::f16::from_f32(b[0].abs() / 8.0).to_le_bytes().to_vec();
                    blk.extend(b[..16].iter().zip(&b[16..]).map(|(&l, &h)| {
                        ((l * 8.0 + 8.0) as u8 & 15) | (((h * 8.0 + 8.0) as u8 & 15) << 4)
                    }));
                    blk
                })
                .collect(),
            _ => unreachable!(),
        }
    }

    /// `steps` visits the pieces the hand-written loops did: `(s, min(step, end − s))` from the
    /// start, in order, covering the range once.
    #[test]
    fn steps_cover_the_range_in_order() {
        for (r, step) in [
            (0..0, 4),
            (0..1, 4),
            (3..11, 4),
            (3..12, 4),
            (5..6, 1),
            (0..7, 16),
        ] {
            let mut want = Vec::new();
            let mut s = r.start;
            while s < r.end {
                let n = (r.end - s).min(step);
                want.push((s, n));
                s += n;
            }
            assert_eq!(
                steps(r.clone(), step).collect::<Vec<_>>(),
                want,
                "{r:?} by {step}"
            );
        }
    }

    /// Shapes that exercise several row blocks, partial tiles of rows and tokens, and float
    /// tails: the blocked GEMM equals, bit for bit, the backend's `dot_batch` (one (row, token)
    /// of a multi-token product, the order the frame's leftovers and sparse products use); for
    /// Q8_0 and Q4_0 that is also the GEMV's dot.
    #[test]
    fn token_chunks_are_whole_groups_near_the_limit() {
        for n in [1usize, 2, 12, 13, 128, 129, 256, 291, 512, 515, 4096] {
            let c = token_chunk(n);
            assert!(c % FN == 0 && c > 0, "{n}: {c}");
            assert!(c < TOKEN_CHUNK + FN, "{n}: {c}");
            // As many chunks as the limit asks for, the last one not empty.
            assert_eq!(n.div_ceil(c), n.div_ceil(TOKEN_CHUNK), "{n}: {c}");
        }
    }

    #[test]
    fn blocked_gemm_equals_gemv() {
        if !Backend::Avx512.is_available() {
            return;
        }
        let types = [
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
        ];
        for ty in types {
            for &(rows, cols, t) in &[
                (203usize, 1000usize, 13usize),
                (37, 4096 + 64, 7),
                (17, 32, 2),
                (16, 64, 5),
                (600, 4096 + 64, 5),
                (18, 128, 2),
                (19, 2048, 3),
                (22, 2048, 4),
                (40, 512, 17),
                // Float row blocks cut into token chunks (108, 108, 75 tokens).
                (21, 256, 291),
            ] {
                let cols = if ty.block_size() == 32 {
                    cols / 32 * 32
                } else {
                    cols + 3
                };
                let data = weight_bytes(ty, rows * cols);
                let w = Weights::new(ty, rows, cols, &data).unwrap();
                let x = vals(cols * t, 11);
                let ops = crate::matmul::table::row_ops(ty, Backend::Avx512).unwrap();
                let acts = crate::matmul::act::ActBuf::new(ops.act, &x, cols);
                for threads in [1, 2, 3] {
                    let pool = ThreadPool::new(threads);
                    let mm = MatMul::with_backend(&pool, Backend::Avx512).unwrap();
                    let mut y = vec![f32::NAN; rows * t];
                    mm.gemm(&w, &x, t, &mut y).unwrap();
                    for k in 0..t {
                        let yk: Vec<f32> = (0..rows)
                            .map(|r| (ops.dot_batch)(w.row(r), &acts.get(k)))
                            .collect();
                        if ty.block_size() == 32 {
                            let mut yv = vec![f32::NAN; rows];
                            mm.gemv(&w, &x[k * cols..(k + 1) * cols], &mut yv).unwrap();
                            assert_eq!(yv, yk, "{ty:?} {threads}t token {k}: gemv");
                        }
                        for r in 0..rows {
                            assert_eq!(
                                yk[r].to_bits(),
                                y[k * rows + r].to_bits(),
                                "{ty:?} {rows}x{cols} T={t} {threads}t row {r} token {k}"
                            );
                        }
                    }
                }
            }
        }
    }
}
