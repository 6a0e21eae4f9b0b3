//! AVX-512 building blocks of the one-token and prompt attention (x86-64, AVX-512 F with AVX2,
//! FMA and F16C): sixteen positions per tile, whose K (then V) head rows are widened once for
//! all the query heads of a group, as the AVX2 tile path does with eight; the `_pair` kernels
//! take two query heads per pass, so each row of the tile is loaded once for both.
//!
//! Every function is `unsafe` because it requires those CPU features: callers must hold an
//! `Isa` for which `is_avx512()` is true (only built for an available AVX-512 backend). Memory
//! accesses stay inside the slices passed (lengths checked by the callers, as stated).

// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
#![deny(unsafe_op_in_unsafe_fn)]

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

/// The sums of the sixteen lanes of each `v[r]`, in one vector: the sum of `v[r]` lands in
/// lane [`SUM16_LANE`]`[r]`. Each level adds pairs of vectors so that every lane keeps partial
/// sums of one input only:
/// 1. `(v[2k], v[2k+1])`: 256-bit halves added; 8 partials of `v[2k]` in lanes 0..8, of
///    `v[2k+1]` in 8..16.
/// 2. 128-bit quarters added; quarter `t` of `b[j]` holds 4 partials of input `4j + t`.
/// 3. 64-bit halves of each quarter added; quarter `t` of `c[i]` holds 2 partials of input
///    `8i + t` then 2 of `8i + 4 + t`.
/// 4. Neighbours added; element `m` of quarter `t` is the sum of input `4m + t`.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
fn transpose_sum16(v: [__m512; 16]) -> __m512 {
    let a: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (v[2 * k], v[2 * k + 1]);
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y);
        _mm512_add_ps(lo, hi)
    });
    let b: [__m512; 4] = std::array::from_fn(|j| {
        let (x, y) = (a[2 * j], a[2 * j + 1]);
        let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y);
        let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y);
        _mm512_add_ps(lo, hi)
    });
    let c: [__m512; 2] = std::array::from_fn(|i| {
        let (x, y) = (_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
        let lo = _mm512_castpd_ps(_mm512_unpacklo_pd(x, y));
        let hi = _mm512_castpd_ps(_mm512_unpackhi_pd(x, y));
        _mm512_add_ps(lo, hi)
    });
    let lo = _mm512_shuffle_ps::<0b10_00_10_00>(c[0], c[1]);
    let hi = _mm512_shuffle_ps::<0b11_01_11_01>(c[0], c[1]);
    _mm512_add_ps(lo, hi)
}

/// The lane of [`transpose_sum16`]'s result that holds the sum of input `r` (input `4m + t`
/// ends in element `m` of 128-bit quarter `t`).
const SUM16_LANE: [usize; 16] = {
    let mut out = [0usize; 16];
    let mut r = 0;
    while r < 16 {
        out[r] = 4 * (r % 4) + r / 4;
        r += 1;
    }
    out
};

/// `scale · (q · tile[r])` for the sixteen rows `r` of `tile` (`16 × q.len()` values,
/// row-major; `q.len()` a multiple of 16): one accumulator per row over the sixteen-value
/// chunks in order, then the sixteen accumulators reduced together ([`transpose_sum16`]).
///
/// # Safety
/// AVX-512 F available; the lengths as above.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dots16(q: &[f32], tile: &[f32], scale: f32) -> [f32; 16] {
    let d = q.len();
    debug_assert!(tile.len() == 16 * d && d % 16 == 0);
    let (qp, tp) = (q.as_ptr(), tile.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 16];
    let mut c = 0;
    while c + 16 <= d {
        // SAFETY: values `c..c + 16` of `q` and of every row of `tile` exist.
        unsafe {
            let qv = _mm512_loadu_ps(qp.add(c));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(qv, _mm512_loadu_ps(tp.add(r * d + c)), *a);
            }
        }
        c += 16;
    }
    let s = _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 values.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s) };
    std::array::from_fn(|r| lanes[SUM16_LANE[r]])
}

/// `acc[i] = fma(w[r], tile[r][i], acc[i])` for `r = 0, 1, …` in order (`w.len() ≤ 16` rows of
/// `acc.len()` values in `tile`, row-major; `acc.len()` a multiple of 16).
///
/// # Safety
/// AVX-512 F available; the lengths as above.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_tile16(acc: &mut [f32], w: &[f32], tile: &[f32]) {
    let d = acc.len();
    debug_assert!(w.len() <= 16 && tile.len() >= w.len() * d && d % 16 == 0);
    let (ap, tp) = (acc.as_mut_ptr(), tile.as_ptr());
    let mut c = 0;
    // Four vectors of outputs at a time: four independent FMA chains.
    while c + 64 <= d {
        // SAFETY: values `c..c + 64` of `acc` and of the first `w.len()` rows of `tile` exist.
        unsafe {
            let mut r = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(ap.add(c + o)));
            for (p, &wp) in w.iter().enumerate() {
                let wv = _mm512_set1_ps(wp);
                let row = tp.add(p * d + c);
                for (i, ri) in r.iter_mut().enumerate() {
                    *ri = _mm512_fmadd_ps(wv, _mm512_loadu_ps(row.add(16 * i)), *ri);
                }
            }
            for (i, ri) in r.iter().enumerate() {
                _mm512_storeu_ps(ap.add(c + 16 * i), *ri);
            }
        }
        c += 64;
    }
    while c + 16 <= d {
        // SAFETY: values `c..c + 16` of `acc` and of the first `w.len()` rows of `tile` exist.
        unsafe {
            let mut r = _mm512_loadu_ps(ap.add(c));
            for (p, &wp) in w.iter().enumerate() {
                r = _mm512_fmadd_ps(_mm512_set1_ps(wp), _mm512_loadu_ps(tp.add(p * d + c)), r);
            }
            _mm512_storeu_ps(ap.add(c), r);
        }
        c += 16;
    }
}

/// [`dots16`] of two query heads over the same sixteen rows: `(scale · (qa · tile[r]),
/// scale · (qb · tile[r]))`. Each row's chunk of values is loaded once for both heads; every
/// score is the same accumulator over the same chunks, reduced by the same tree
/// ([`transpose_sum16`] reduces each input alike wherever it sits), so the bits equal two
/// calls of `dots16`.
///
/// # Safety
/// AVX-512 F available; `qa.len() == qb.len()`, a multiple of 16; `tile.len() == 16 · qa.len()`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn dots16_pair(
    qa: &[f32],
    qb: &[f32],
    tile: &[f32],
    scale: f32,
) -> ([f32; 16], [f32; 16]) {
    let d = qa.len();
    debug_assert!(qb.len() == d && tile.len() == 16 * d && d % 16 == 0);
    let (ap, bp, tp) = (qa.as_ptr(), qb.as_ptr(), tile.as_ptr());
    let mut out = ([0f32; 16], [0f32; 16]);
    // Rows 0..8, then 8..16: sixteen accumulators, head a's eight rows then head b's.
    for half in 0..2 {
        let mut acc = [_mm512_setzero_ps(); 16];
        let mut c = 0;
        while c + 16 <= d {
            // SAFETY: values `c..c + 16` of both heads and of every row of `tile` exist.
            unsafe {
                let (qav, qbv) = (_mm512_loadu_ps(ap.add(c)), _mm512_loadu_ps(bp.add(c)));
                for r in 0..8 {
                    let row = _mm512_loadu_ps(tp.add((8 * half + r) * d + c));
                    acc[r] = _mm512_fmadd_ps(qav, row, acc[r]);
                    acc[8 + r] = _mm512_fmadd_ps(qbv, row, acc[8 + r]);
                }
            }
            c += 16;
        }
        let s = _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
        let mut lanes = [0f32; 16];
        // SAFETY: `lanes` holds 16 values.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), s) };
        for r in 0..8 {
            out.0[8 * half + r] = lanes[SUM16_LANE[r]];
            out.1[8 * half + r] = lanes[SUM16_LANE[8 + r]];
        }
    }
    out
}

/// [`axpy_tile16`] of two query heads over the same rows: `acc_a[i] = fma(wa[r], tile[r][i],
/// acc_a[i])` and the same for `b`, for `r = 0, 1, …` in order. Each row's values are loaded
/// once for both heads; every output gets the same FMAs in the same order as from
/// `axpy_tile16` (the same bits).
///
/// # Safety
/// AVX-512 F available; `acc_a.len() == acc_b.len()`, a multiple of 16; `wa.len() == wb.len()
/// ≤ 16`; `tile` holds `wa.len()` rows of `acc_a.len()` values.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(crate) unsafe fn axpy_tile16_pair(
    acc_a: &mut [f32],
    acc_b: &mut [f32],
    wa: &[f32],
    wb: &[f32],
    tile: &[f32],
) {
    let d = acc_a.len();
    debug_assert!(acc_b.len() == d && wa.len() == wb.len() && wa.len() <= 16);
    debug_assert!(tile.len() >= wa.len() * d && d % 16 == 0);
    let (ap, bp, tp) = (acc_a.as_mut_ptr(), acc_b.as_mut_ptr(), tile.as_ptr());
    let mut c = 0;
    // Four vectors of outputs per head at a time: eight independent FMA chains.
    while c + 64 <= d {
        // SAFETY: values `c..c + 64` of both outputs and of the first `wa.len()` rows of
        // `tile` exist.
        unsafe {
            let mut ra = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(ap.add(c + o)));
            let mut rb = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(bp.add(c + o)));
            for (p, (&xa, &xb)) in wa.iter().zip(wb).enumerate() {
                let (va, vb) = (_mm512_set1_ps(xa), _mm512_set1_ps(xb));
                let row = tp.add(p * d + c);
                for i in 0..4 {
                    let t = _mm512_loadu_ps(row.add(16 * i));
                    ra[i] = _mm512_fmadd_ps(va, t, ra[i]);
                    rb[i] = _mm512_fmadd_ps(vb, t, rb[i]);
                }
            }
            for i in 0..4 {
                _mm512_storeu_ps(ap.add(c + 16 * i), ra[i]);
                _mm512_storeu_ps(bp.add(c + 16 * i), rb[i]);
            }
        }
        c += 64;
    }
    while c + 16 <= d {
        // SAFETY: values `c..c + 16` of both outputs and of the first `wa.len()` rows of
        // `tile` exist.
        unsafe {
            let (mut ra, mut rb) = (_mm512_loadu_ps(ap.add(c)), _mm512_loadu_ps(bp.add(c)));
            for (p, (&xa, &xb)) in wa.iter().zip(wb).enumerate() {
                let t = _mm512_loadu_ps(tp.add(p * d + c));
                ra = _mm512_fmadd_ps(_mm512_set1_ps(xa), t, ra);
                rb = _mm512_fmadd_ps(_mm512_set1_ps(xb), t, rb);
            }
            _mm512_storeu_ps(ap.add(c), ra);
            _mm512_storeu_ps(bp.add(c), rb);
        }
        c += 16;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input of the reduction tree lands in its own lane (a permutation).
    #[test]
    fn sum16_lanes_are_a_permutation() {
        let mut seen = [false; 16];
        for (r, &l) in SUM16_LANE.iter().enumerate() {
            assert!(l < 16 && !seen[l], "input {r} → lane {l}");
            seen[l] = true;
        }
    }

    /// The two-head kernels give each head exactly what the one-head kernels give it
    /// (random values: the same operations in the same order, so the same bits).
    #[test]
    fn pair_kernels_equal_one_head_kernels_bitwise() {
        if !crate::Backend::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let mut seed = 12345u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        for d in [16usize, 64, 80, 128] {
            let qa: Vec<f32> = (0..d).map(|_| rnd()).collect();
            let qb: Vec<f32> = (0..d).map(|_| rnd()).collect();
            let tile: Vec<f32> = (0..16 * d).map(|_| rnd()).collect();
            // SAFETY: AVX-512 F available (checked); the lengths are as the kernels require.
            let (a, b) = unsafe { dots16_pair(&qa, &qb, &tile, 0.125) };
            let (wa, wb) = unsafe { (dots16(&qa, &tile, 0.125), dots16(&qb, &tile, 0.125)) };
            assert_eq!(a.map(f32::to_bits), wa.map(f32::to_bits), "d={d} head a");
            assert_eq!(b.map(f32::to_bits), wb.map(f32::to_bits), "d={d} head b");
            for n in [1usize, 7, 16] {
                let (ws_a, ws_b): (Vec<f32>, Vec<f32>) = (0..n).map(|_| (rnd(), rnd())).unzip();
                let acc0: Vec<f32> = (0..d).map(|_| rnd()).collect();
                let acc1: Vec<f32> = (0..d).map(|_| rnd()).collect();
                let (mut pa, mut pb) = (acc0.clone(), acc1.clone());
                let (mut sa, mut sb) = (acc0.clone(), acc1.clone());
                // SAFETY: as above; `tile` holds 16 ≥ n rows of d.
                unsafe {
                    axpy_tile16_pair(&mut pa, &mut pb, &ws_a, &ws_b, &tile);
                    axpy_tile16(&mut sa, &ws_a, &tile);
                    axpy_tile16(&mut sb, &ws_b, &tile);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&pa), bits(&sa), "d={d} n={n} head a");
                assert_eq!(bits(&pb), bits(&sb), "d={d} n={n} head b");
            }
        }
    }

    /// `dots16` against plain sums (exact small integers: any order gives the same value).
    #[test]
    fn dots16_rows_land_in_order() {
        if !crate::Backend::Avx512.is_available() {
            eprintln!("skipped: no AVX-512 on this CPU");
            return;
        }
        let d = 48;
        let q: Vec<f32> = (0..d).map(|c| (c % 5) as f32 - 2.0).collect();
        let tile: Vec<f32> = (0..16 * d).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        // SAFETY: AVX-512 F available (checked); tile holds 16 rows of d (a multiple of 16).
        let got = unsafe { dots16(&q, &tile, 0.5) };
        for r in 0..16 {
            let want: f32 = (0..d).map(|c| q[c] * tile[r * d + c]).sum::<f32>() * 0.5;
            assert_eq!(got[r], want, "row {r}");
        }
    }
}
