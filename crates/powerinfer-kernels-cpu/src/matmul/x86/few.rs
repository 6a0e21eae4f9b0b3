//! The Q4_0 and Q8_0 products of a few tokens (a decode step of a small batch) straight from
//! the file layout (x86-64, AVX-512 F/VL/BW/VNNI): no repacked copy, so no per-call packing
//! pass. Described here for Q4_0; Q8_0 in [`tile_rows_q8_0`].
//!
//! Two rows share a 512-bit vector, row `r` in the low 256 bits and row `r + 1` in the high
//! ones; each half does, lane for lane, what the one-token kernel (`int::vnni`'s pair step over
//! [`ActFormat::Q8_0Pairs`] activations, then
//! `hsum`) does for its row, so every (row, token) result equals
//! [`MatMul::gemv`](crate::MatMul::gemv)'s on that token bit for bit. A tile is [`TR`] rows ×
//! up to [`TN`] tokens: the nibbles and scales of its rows are decoded once per pair of blocks
//! and serve every token, which is what makes a batch cheaper than one GEMV per token (the
//! one-token product on these cores is bound by that decoding, not by memory).

// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
#![deny(unsafe_op_in_unsafe_fn)]
// Row and token indices address several arrays at once; indexed loops read closest.
#![allow(clippy::needless_range_loop)]

use super::common::hsum;
use crate::matmul::act::{Act, ActBuf, ActFormat};
use crate::matmul::frame::OutPtr;
use crate::matmul::weights::Weights;
use crate::matmul::GEMV_GRAIN_BYTES;
use crate::pool::ThreadPool;
use powerinfer_gguf::GgmlType;
use std::arch::x86_64::*;

/// Rows per tile: two 512-bit vectors of two rows each.
const TR: usize = 4;
/// Tokens per tile (2 × 4 accumulators, with the decoded weights and one token's activation
/// vectors, fit the 32 registers).
const TN: usize = 4;

/// Whether [`gemm`] serves a matrix of type `ty` and `cols` columns: Q4_0 in whole pairs of
/// blocks, Q8_0 in whole blocks.
pub(crate) fn fits(ty: GgmlType, cols: usize) -> bool {
    match ty {
        GgmlType::Q4_0 => cols > 0 && cols % 64 == 0,
        GgmlType::Q8_0 => cols > 0 && cols % 32 == 0,
        _ => false,
    }
}

/// `y_t = W x_t` for the `n_tokens` tokens of `x`, over every row of `w` (`rows: None`) or over
/// the listed ones (strictly increasing, below `w.rows`; other outputs untouched), threads
/// splitting the rows (`w` of a type and width that [`fits`]; the lengths checked by the
/// caller).
///
/// Panics if `w` does not [`fit`](fits) (a frame bug).
pub(crate) fn gemm(
    pool: &ThreadPool,
    w: &Weights<'_>,
    x: &[f32],
    n_tokens: usize,
    rows: Option<&[u32]>,
    y: &mut [f32],
) {
    assert!(fits(w.ty, w.cols));
    let q8 = w.ty == GgmlType::Q8_0;
    let n = rows.map_or(w.rows, <[u32]>::len);
    debug_assert!(rows.is_none_or(|r| r.iter().all(|&i| (i as usize) < w.rows)));
    let index = |k: usize| rows.map_or(k, |r| r[k] as usize);
    let nb = w.cols / 32;
    let fmt = if q8 {
        ActFormat::Q8_0
    } else {
        ActFormat::Q8_0Pairs
    };
    let acts = ActBuf::new(fmt, x, w.cols);
    let acts: Vec<Act<'_>> = (0..n_tokens).map(|t| acts.get(t)).collect();
    // Q8_0: per token and block, the start values −128·Σx of each group of four values (the
    // weights enter `vpdpbusd` as q + 128).
    let off: Vec<i32> = if q8 {
        acts.iter()
            .flat_map(|a| a.q[..nb * 32].chunks_exact(4))
            .map(|g| -128 * g.iter().map(|&v| v as i32).sum::<i32>())
            .collect()
    } else {
        Vec::new()
    };
    let out = OutPtr::new(y);
    let tiles = n.div_ceil(TR);
    // Grains of weight bytes as the one-token GEMV's.
    let grain = (GEMV_GRAIN_BYTES / (TR * w.row_bytes)).max(1);
    pool.for_grains(tiles, grain, |_, r| {
        for tile in r {
            let k0 = tile * TR;
            let nr = (n - k0).min(TR);
            // Missing rows of the last tile repeat its first row (computed, not written).
            let idx: [usize; TR] = std::array::from_fn(|k| index(k0 + if k < nr { k } else { 0 }));
            let p = idx.map(|i| w.row(i).as_ptr());
            // The next tile's rows, requested while this one is computed (the last tile's
            // own rows again: a harmless hint).
            let next: [*const u8; TR] =
                std::array::from_fn(|k| w.row(index((k0 + TR + k).min(n - 1))).as_ptr());
            for (c, chunk) in acts.chunks(TN).enumerate() {
                let t0 = c * TN;
                let at = Tile {
                    next,
                    out,
                    stride: w.rows,
                    idx,
                    nr,
                    t0,
                };
                let off = if q8 { &off[t0 * nb * 8..] } else { &[][..] };
                // SAFETY: each row holds nb whole blocks (nb even for Q4_0) and each token nb
                // blocks of values and scales (and for Q4_0 nb / 2 pair offsets: ActBuf in
                // Q8_0Pairs order for `w.cols`; for Q8_0 `off` has 8 per block and token);
                // the outputs `(t0 + k)·rows + idx[j]` (j < nr) are in bounds and belong to this
                // thread's tiles only (distinct rows: a strictly increasing list, or all rows);
                // the callers checked for Backend::Avx512 (AVX-512 F/VL/BW/VNNI, AVX2, FMA,
                // F16C).
                unsafe {
                    match (q8, chunk.len()) {
                        (false, 4) => tile_rows::<4>(p, nb, chunk, &at),
                        (false, 3) => tile_rows::<3>(p, nb, chunk, &at),
                        (false, 2) => tile_rows::<2>(p, nb, chunk, &at),
                        (false, _) => tile_rows::<1>(p, nb, chunk, &at),
                        (true, 4) => tile_rows_q8_0::<4>(p, nb, chunk, off, &at),
                        (true, 3) => tile_rows_q8_0::<3>(p, nb, chunk, off, &at),
                        (true, 2) => tile_rows_q8_0::<2>(p, nb, chunk, off, &at),
                        (true, _) => tile_rows_q8_0::<1>(p, nb, chunk, off, &at),
                    }
                }
            }
        }
    });
}

/// Where a tile's results go, and the rows of the tile after it.
struct Tile {
    /// The next tile's rows (requested ahead, a hint).
    next: [*const u8; TR],
    out: OutPtr,
    /// Outputs per token.
    stride: usize,
    /// The output index of each row.
    idx: [usize; TR],
    /// Rows written (the first `nr`).
    nr: usize,
    /// The first token.
    t0: usize,
}

/// [`TR`] rows (`p`, `nb` blocks each, `nb` even) · `N` tokens (`acts`), the first `at.nr`
/// rows' results written to `at.out[(at.t0 + k)·at.stride + at.idx[j]]`.
///
/// # Safety
/// Every `p[j]` is valid for `nb` 18-byte blocks; every act has values, scales and pair
/// offsets for `nb` blocks; the outputs are in bounds and written by this thread only;
/// AVX-512 F/VL/BW/VNNI, AVX2, FMA and F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn tile_rows<const N: usize>(p: [*const u8; TR], nb: usize, acts: &[Act<'_>], at: &Tile) {
    const V: usize = TR / 2;
    let mask = _mm512_set1_epi8(0x0F);
    // Lanes 0..4: the first scale, 4..8 the second, 8..12 the third, 12..16 the fourth.
    let spread4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    // Lanes 0..4 and 8..12: the first of two scales, 4..8 and 12..16 the second.
    let spread2 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    let mut acc = [[_mm512_setzero_ps(); N]; V];
    // SAFETY: blocks b, b + 1 < nb of every row and of every act exist (caller); prefetches
    // never fault.
    unsafe {
        let mut b = 0;
        while b + 2 <= nb {
            let off = b * 18;
            // The next tile's lines at this step's offset into L1 (a tile ahead: the hardware
            // prefetchers left the tile's interleaved row streams waiting on memory).
            for q in at.next {
                _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(off) as *const i8);
            }
            let mut lo = [_mm512_setzero_si512(); V];
            let mut hi = [_mm512_setzero_si512(); V];
            let mut dw = [_mm512_setzero_ps(); V];
            for v in 0..V {
                let (r0, r1) = (p[2 * v].add(off), p[2 * v + 1].add(off));
                // Row r0's nibbles of blocks b, b + 1 in the low 256 bits, row r1's in the
                // high ones (as the one-token kernel's `loadu2` per row).
                let ld = |q: *const u8| _mm_loadu_si128(q as *const __m128i);
                let raw = _mm512_castsi128_si512(ld(r0.add(2)));
                let raw = _mm512_inserti32x4::<1>(raw, ld(r0.add(20)));
                let raw = _mm512_inserti32x4::<2>(raw, ld(r1.add(2)));
                let raw = _mm512_inserti32x4::<3>(raw, ld(r1.add(20)));
                lo[v] = _mm512_and_si512(raw, mask);
                hi[v] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                let h = |q: *const u8| std::ptr::read_unaligned(q as *const u16) as i16;
                let s = _mm_setr_epi16(h(r0), h(r0.add(18)), h(r1), h(r1.add(18)), 0, 0, 0, 0);
                dw[v] = _mm512_permutexvar_ps(spread4, _mm512_castps128_ps512(_mm_cvtph_ps(s)));
            }
            for k in 0..N {
                let a = &acts[k];
                let dx = _mm_castpd_ps(_mm_load_sd(a.d.as_ptr().add(b) as *const f64));
                let dx = _mm512_permutexvar_ps(spread2, _mm512_castps128_ps512(dx));
                let xq = a.q.as_ptr().add(b * 32);
                let x0 = _mm512_broadcast_i64x4(_mm256_loadu_si256(xq as *const __m256i));
                let x1 = _mm512_broadcast_i64x4(_mm256_loadu_si256(xq.add(32) as *const __m256i));
                let init = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    a.po.as_ptr().add(b / 2 * 8) as *const __m256i
                ));
                for v in 0..V {
                    // The one-token kernel's operations per lane: d_w·d_x, exact integer sums,
                    // one FMA per pair.
                    let sc = _mm512_mul_ps(dw[v], dx);
                    let si = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, lo[v], x0), hi[v], x1);
                    acc[v][k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), sc, acc[v][k]);
                }
            }
            b += 2;
        }
        for v in 0..V {
            for k in 0..N {
                let low = hsum(_mm512_castps512_ps256(acc[v][k]));
                let high = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(acc[v][k]),
                )));
                for (j, s) in [(2 * v, low), (2 * v + 1, high)] {
                    if j < at.nr {
                        at.out.write((at.t0 + k) * at.stride + at.idx[j], s);
                    }
                }
            }
        }
    }
}

/// [`TR`] Q8_0 rows (`p`, `nb` blocks each) · `N` tokens (`acts`, with the start values `off`:
/// 8 per block, token after token), as [`tile_rows`] for Q4_0. Per lane the one-token kernel's
/// operations (`int::vnni`'s Q8_0 block step: the exact i32 sum of four products, converted,
/// times `d_w·d_x`, even blocks into one accumulator and odd ones into another, then `hsum`
/// of their sum), the i32 sum taken here as `Σ (q + 128)·x − 128·Σx`, the same integer.
///
/// # Safety
/// Every `p[j]` is valid for `nb` 34-byte blocks; every act has values and scales for `nb`
/// blocks, `off` `8·nb` values per token; the outputs are in bounds and written by this thread
/// only; AVX-512 F/VL/BW/VNNI, AVX2, FMA and F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn tile_rows_q8_0<const N: usize>(
    p: [*const u8; TR],
    nb: usize,
    acts: &[Act<'_>],
    off: &[i32],
    at: &Tile,
) {
    const V: usize = TR / 2;
    let flip = _mm512_set1_epi8(-128);
    // Lanes 0..8: the first of two scales, 8..16 the second.
    let spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    // Even blocks, odd blocks.
    let mut acc = [[[_mm512_setzero_ps(); N]; V]; 2];
    // SAFETY: block b < nb of every row and of every act exists, `off` holds 8·nb values per
    // token (caller); prefetches never fault.
    unsafe {
        for b in 0..nb {
            let o = b * 34;
            if b % 2 == 0 {
                // The next tile's lines at this pair of blocks' offset (68 bytes a row).
                for q in at.next {
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(o) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(o + 64) as *const i8);
                }
            }
            let mut u = [_mm512_setzero_si512(); V];
            let mut dw = [_mm512_setzero_ps(); V];
            for v in 0..V {
                let (r0, r1) = (p[2 * v].add(o), p[2 * v + 1].add(o));
                let ld = |q: *const u8| _mm256_loadu_si256(q.add(2) as *const __m256i);
                let raw = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld(r0)), ld(r1));
                u[v] = _mm512_xor_si512(raw, flip);
                let h = |q: *const u8| std::ptr::read_unaligned(q as *const u16) as i16;
                let sc = _mm_setr_epi16(h(r0), h(r1), 0, 0, 0, 0, 0, 0);
                dw[v] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_cvtph_ps(sc)));
            }
            let e = b % 2;
            for k in 0..N {
                let a = &acts[k];
                let dx = _mm512_set1_ps(*a.d.get_unchecked(b));
                let x = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    a.q.as_ptr().add(b * 32) as *const __m256i
                ));
                let init = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    off.as_ptr().add((k * nb + b) * 8) as *const __m256i,
                ));
                for v in 0..V {
                    let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u[v], x));
                    acc[e][v][k] = _mm512_fmadd_ps(s, _mm512_mul_ps(dw[v], dx), acc[e][v][k]);
                }
            }
        }
        for v in 0..V {
            for k in 0..N {
                let sum = _mm512_add_ps(acc[0][v][k], acc[1][v][k]);
                let low = hsum(_mm512_castps512_ps256(sum));
                let high = hsum(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
                    _mm512_castps_pd(sum),
                )));
                for (j, s) in [(2 * v, low), (2 * v + 1, high)] {
                    if j < at.nr {
                        at.out.write((at.t0 + k) * at.stride + at.idx[j], s);
                    }
                }
            }
        }
    }
}
