//! AVX-512 building blocks of the one-token and prompt attention (x86-64, AVX-512 F with AVX2,
//! FMA and F16C) for grouped queries: up to sixteen query rows (a (token, head) each) of one
//! kv head share every vector, one row per lane, over tiles of sixteen positions whose K (then
//! V) head rows are widened once for all of them. Scores are FMA chains per lane (no
//! horizontal sums), the softmax runs down the lanes, and V rows are added four rows at a time.
//!
//! Every function is `unsafe` because it requires those CPU features: callers must hold an
//! `Isa` for which `is_avx512()` is true (only built for an available AVX-512 backend). Memory
//! accesses stay inside the slices passed (lengths checked by the callers, as stated).

// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::exp::{EXP_LN2, EXP_MIN_ARG, EXP_POLY};
use core::arch::x86_64::*;
use half::f16;

/// f16 → f32 of head rows: row `r` of `dst` (`d` values) from `src[start + r·stride..][..d]`.
///
/// # Safety
/// AVX-512 F and F16C available; `d` a multiple of 16, `dst.len()` a multiple of `d`, every
/// source row inside `src`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn widen_rows16(
    src: &[f16],
    start: usize,
    stride: usize,
    d: usize,
    dst: &mut [f32],
) {
    debug_assert!(d % 16 == 0 && dst.len() % d.max(1) == 0);
    for (r, row) in dst.chunks_exact_mut(d).enumerate() {
        let from = &src[start + r * stride..][..d];
        let mut i = 0;
        while i + 16 <= d {
            // SAFETY: values `i..i + 16` exist in both rows.
            unsafe {
                let h = _mm256_loadu_si256(from.as_ptr().add(i) as *const __m256i);
                _mm512_storeu_ps(row.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
            i += 16;
        }
    }
}

/// e^x for 16 lanes with x ≤ 0: the operations of `x86::exp_nonpos` (range reduction, the
/// degree-7 polynomial, 2ⁿ in the exponent field) on 512-bit vectors, so each lane gets the
/// bits the 8-lane code gives it; lanes below [`EXP_MIN_ARG`], `-inf` included, give 0.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) fn exp_nonpos16(x: __m512) -> __m512 {
    let underflow = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_MIN_ARG));
    let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN_ARG));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2[0]), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2[1]), r);
    let mut p = _mm512_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let ni = _mm512_cvtps_epi32(n);
    let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        ni,
        _mm512_set1_epi32(127),
    )));
    _mm512_maskz_mul_ps(!underflow, p, pow2)
}

/// Scores of sixteen query rows, one per lane, against the first `np` rows of a K tile:
/// `sc[p·16 + r] = scale · Σ_c qt[c·16 + r] · tile[p·d + c]`, the sum over `c` in order (one
/// FMA chain per (position, row), the position's value broadcast from the tile), so no
/// horizontal sums, and a row's scores do not depend on the other lanes.
///
/// # Safety
/// AVX-512 F available; `np ≤ 16`, `qt.len() ≥ 16·d`, `tile.len() ≥ 16·d` (rows past `np`
/// readable, their scores not stored), `sc.len() ≥ 16·np`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn scores_rows16(
    qt: &[f32],
    tile: &[f32],
    d: usize,
    np: usize,
    scale: f32,
    sc: &mut [f32],
) {
    debug_assert!(np <= 16 && qt.len() >= 16 * d && tile.len() >= 16 * d && sc.len() >= 16 * np);
    let (qp, tp) = (qt.as_ptr(), tile.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 16];
    for c in 0..d {
        // SAFETY: `c < d`: lane block `c` of `qt` and value `c` of each of the 16 rows exist.
        unsafe {
            let qv = _mm512_loadu_ps(qp.add(c * 16));
            for (p, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(qv, _mm512_set1_ps(*tp.add(p * d + c)), *a);
            }
        }
    }
    let sv = _mm512_set1_ps(scale);
    for (p, a) in acc.iter().enumerate().take(np) {
        // SAFETY: `p < np`: values `16p..16p + 16` of `sc` exist.
        unsafe { _mm512_storeu_ps(sc.as_mut_ptr().add(p * 16), _mm512_mul_ps(*a, sv)) };
    }
}

/// Softmax of sixteen rows (lanes) over positions `0..n` of `sc` (16 values per position):
/// per lane the largest score `m`, then `e = exp(s − m)` written over the scores, and the sum
/// of the `e` in position order. Returns `1 / sum` per lane: 0 for a lane whose scores are all
/// `-inf` (its weights are then 0 too).
///
/// # Safety
/// AVX-512 F available; `sc.len() ≥ 16·n`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn softmax_rows16(sc: &mut [f32], n: usize) -> [f32; 16] {
    debug_assert!(sc.len() >= 16 * n);
    let p = sc.as_mut_ptr();
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    for i in 0..n {
        // SAFETY: `i < n`: values `16i..16i + 16` exist.
        m = _mm512_max_ps(m, unsafe { _mm512_loadu_ps(p.add(i * 16)) });
    }
    let empty = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(m, _mm512_set1_ps(f32::NEG_INFINITY));
    // An all `-inf` lane subtracts 0: its exponentials are exp(-inf) = 0.
    let m = _mm512_mask_mov_ps(m, empty, _mm512_setzero_ps());
    let mut sum = _mm512_setzero_ps();
    for i in 0..n {
        // SAFETY: as above.
        unsafe {
            let e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i * 16)), m));
            _mm512_storeu_ps(p.add(i * 16), e);
            sum = _mm512_add_ps(sum, e);
        }
    }
    let inv = _mm512_maskz_div_ps(!empty, _mm512_set1_ps(1.0), sum);
    let mut out = [0f32; 16];
    // SAFETY: `out` holds 16 values.
    unsafe { _mm512_storeu_ps(out.as_mut_ptr(), inv) };
    out
}

/// `acc[r][i] = fma(w[p·16 + lane0 + r], tile[p][i], acc[r][i])` for positions `p` in order,
/// row `r` (of `lim.len()` ≤ 16 rows of `d` values in `acc`) only while `p < lim[r]`
/// (`lim[r] ≤ np`, the tile's rows). Rows go four at a time and values 64 at a time, so each
/// tile vector loaded serves four rows; a row's result does not depend on the others.
///
/// # Safety
/// AVX-512 F available; `d` a multiple of 16; `acc.len() ≥ lim.len()·d`; `tile.len() ≥ np·d`
/// for `np` = the largest `lim`; `w.len() ≥ 16·np`; `lane0 + lim.len() ≤ 16`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_rows(
    acc: &mut [f32],
    d: usize,
    w: &[f32],
    lane0: usize,
    lim: &[usize],
    tile: &[f32],
) {
    debug_assert!(d % 16 == 0 && acc.len() >= lim.len() * d && lane0 + lim.len() <= 16);
    let mut r0 = 0;
    while r0 < lim.len() {
        let g = (lim.len() - r0).min(4);
        let mut c = 0;
        while c < d {
            let cv = ((d - c) / 16).min(4);
            // SAFETY: rows `r0..r0 + g` and values `c..c + 16·cv` lie in `acc` and the tile
            // (caller's lengths); weights of lanes `lane0 + r0..` below 16 (caller).
            unsafe {
                macro_rules! go {
                    ($G:literal, $V:literal) => {
                        axpy_group::<$G, $V>(acc, d, c, r0, w, lane0, &lim[r0..r0 + $G], tile)
                    };
                }
                match (g, cv) {
                    (4, 4) => go!(4, 4),
                    (4, 3) => go!(4, 3),
                    (4, 2) => go!(4, 2),
                    (4, 1) => go!(4, 1),
                    (3, 4) => go!(3, 4),
                    (3, 3) => go!(3, 3),
                    (3, 2) => go!(3, 2),
                    (3, 1) => go!(3, 1),
                    (2, 4) => go!(2, 4),
                    (2, 3) => go!(2, 3),
                    (2, 2) => go!(2, 2),
                    (2, 1) => go!(2, 1),
                    (1, 4) => go!(1, 4),
                    (1, 3) => go!(1, 3),
                    (1, 2) => go!(1, 2),
                    _ => go!(1, 1),
                }
            }
            c += 16 * cv;
        }
        r0 += g;
    }
}

/// [`axpy_rows`] for rows `r0..r0 + G` and values `c..c + 16·V`: the `G·V` accumulators stay in
/// registers over the positions; positions below every row's limit run without checks.
///
/// # Safety
/// As [`axpy_rows`], for these rows and values; `lim.len() == G`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
// The register tile reads closest as indexed loops (rows × vectors).
#[allow(clippy::needless_range_loop)]
unsafe fn axpy_group<const G: usize, const V: usize>(
    acc: &mut [f32],
    d: usize,
    c: usize,
    r0: usize,
    w: &[f32],
    lane0: usize,
    lim: &[usize],
    tile: &[f32],
) {
    let (ap, wp, tp) = (acc.as_mut_ptr(), w.as_ptr(), tile.as_ptr());
    let all = lim.iter().copied().min().unwrap_or(0);
    let most = lim.iter().copied().max().unwrap_or(0);
    let wl = lane0 + r0;
    // SAFETY: the rows, values, weights and tile rows below `most` exist (caller).
    unsafe {
        let mut a = [[_mm512_setzero_ps(); V]; G];
        for r in 0..G {
            for i in 0..V {
                a[r][i] = _mm512_loadu_ps(ap.add((r0 + r) * d + c + 16 * i));
            }
        }
        for p in 0..all {
            let row = tp.add(p * d + c);
            let t: [__m512; V] = std::array::from_fn(|i| _mm512_loadu_ps(row.add(16 * i)));
            for r in 0..G {
                let wv = _mm512_set1_ps(*wp.add(p * 16 + wl + r));
                for i in 0..V {
                    a[r][i] = _mm512_fmadd_ps(wv, t[i], a[r][i]);
                }
            }
        }
        for p in all..most {
            let row = tp.add(p * d + c);
            for r in 0..G {
                if p < lim[r] {
                    let wv = _mm512_set1_ps(*wp.add(p * 16 + wl + r));
                    for i in 0..V {
                        a[r][i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(row.add(16 * i)), a[r][i]);
                    }
                }
            }
        }
        for r in 0..G {
            for i in 0..V {
                _mm512_storeu_ps(ap.add((r0 + r) * d + c + 16 * i), a[r][i]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rnd(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `exp_nonpos16` gives every lane the bits of the 8-lane `x86::exp_nonpos`.
    #[test]
    fn exp16_equals_exp8_bitwise() {
        if !crate::Backend::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let mut seed = 7u64;
        let mut xs: Vec<f32> = (0..4096).map(|_| rnd(&mut seed) * 100.0 - 100.0).collect();
        xs.extend([
            0.0,
            -0.0,
            -87.3,
            -87.4,
            -1e-30,
            f32::NEG_INFINITY,
            -200.0,
            f32::NAN,
        ]);
        xs.resize(xs.len().div_ceil(16) * 16, -1.0);
        for chunk in xs.chunks_exact(16) {
            let mut wide = [0f32; 16];
            let mut narrow = [0f32; 16];
            // SAFETY: AVX-512 F (so AVX2/FMA/F16C) available (checked); 16-value buffers.
            unsafe {
                _mm512_storeu_ps(
                    wide.as_mut_ptr(),
                    exp_nonpos16(_mm512_loadu_ps(chunk.as_ptr())),
                );
                for h in 0..2 {
                    let v =
                        super::super::x86::exp_nonpos(_mm256_loadu_ps(chunk.as_ptr().add(8 * h)));
                    _mm256_storeu_ps(narrow.as_mut_ptr().add(8 * h), v);
                }
            }
            for l in 0..16 {
                assert_eq!(wide[l].to_bits(), narrow[l].to_bits(), "x = {}", chunk[l]);
            }
        }
    }

    /// Scores against plain sums (exact small integers: any order gives the same value), only
    /// the first `np` positions written.
    #[test]
    fn row_scores_land_in_their_lanes() {
        if !crate::Backend::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        for (d, np) in [(48usize, 16usize), (64, 5), (16, 1)] {
            let qt: Vec<f32> = (0..16 * d).map(|i| ((i * 3) % 5) as f32 - 2.0).collect();
            let tile: Vec<f32> = (0..16 * d).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
            let mut sc = vec![99f32; 16 * 16];
            // SAFETY: AVX-512 F available (checked); the lengths as the kernel requires.
            unsafe { scores_rows16(&qt, &tile, d, np, 0.5, &mut sc) };
            for p in 0..16 {
                for r in 0..16 {
                    let want = if p < np {
                        (0..d)
                            .map(|c| qt[c * 16 + r] * tile[p * d + c])
                            .sum::<f32>()
                            * 0.5
                    } else {
                        99.0
                    };
                    assert_eq!(sc[p * 16 + r], want, "d={d} p={p} r={r}");
                }
            }
        }
    }

    /// The weighted sums equal, bit for bit, one `mul_add` per (row, value) over the row's
    /// positions in order, whatever the rows' limits and the lane they start at.
    #[test]
    fn row_axpy_follows_each_rows_limit() {
        if !crate::Backend::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let mut seed = 99u64;
        for d in [16usize, 64, 80, 128] {
            for (lane0, lim) in [
                (0usize, vec![16usize; 16]),
                (3, vec![5, 5, 6, 6, 7, 7, 8]),
                (0, vec![0, 1, 16, 2, 9]),
                (15, vec![3]),
            ] {
                let tile: Vec<f32> = (0..16 * d).map(|_| rnd(&mut seed)).collect();
                let w: Vec<f32> = (0..256).map(|_| rnd(&mut seed)).collect();
                let acc0: Vec<f32> = (0..lim.len() * d).map(|_| rnd(&mut seed)).collect();
                let mut got = acc0.clone();
                // SAFETY: AVX-512 F available (checked); lengths as the kernel requires.
                unsafe { axpy_rows(&mut got, d, &w, lane0, &lim, &tile) };
                for (r, &l) in lim.iter().enumerate() {
                    for i in 0..d {
                        let mut a = acc0[r * d + i];
                        for p in 0..l {
                            a = w[p * 16 + lane0 + r].mul_add(tile[p * d + i], a);
                        }
                        assert_eq!(a.to_bits(), got[r * d + i].to_bits(), "d={d} r={r} i={i}");
                    }
                }
            }
        }
    }

    /// Softmax lanes: the weights of each lane sum (times the returned inverse) to 1 and
    /// equal `exp(s − max)`; an all `-inf` lane gives zeros and a 0 inverse.
    #[test]
    fn row_softmax_per_lane() {
        if !crate::Backend::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let mut seed = 5u64;
        let n = 37;
        let mut sc: Vec<f32> = (0..16 * n).map(|_| rnd(&mut seed) * 8.0).collect();
        for p in 0..n {
            sc[p * 16 + 9] = f32::NEG_INFINITY;
        }
        sc[3 * 16 + 2] = f32::NEG_INFINITY;
        let before = sc.clone();
        // SAFETY: AVX-512 F available (checked); 16·n values.
        let inv = unsafe { softmax_rows16(&mut sc, n) };
        for l in 0..16 {
            let col: Vec<f32> = (0..n).map(|p| before[p * 16 + l]).collect();
            let m = col.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if l == 9 {
                assert_eq!(inv[l], 0.0);
                assert!((0..n).all(|p| sc[p * 16 + l] == 0.0));
                continue;
            }
            let mut sum = 0f32;
            for p in 0..n {
                let e = sc[p * 16 + l];
                assert!((e - (col[p] - m).exp()).abs() <= 2e-6, "lane {l} p {p}");
                sum += e;
            }
            assert_eq!(inv[l], 1.0 / sum, "lane {l}");
        }
    }
}
