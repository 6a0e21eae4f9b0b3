//! AVX2 + FMA + F16C building blocks of the operators (x86-64 only).
//!
//! Every function is `unsafe` because it requires those three CPU features: callers must hold an
//! `Isa` for which `is_avx2()` is true (only built for an available AVX2 or AVX-512 backend).
//! Memory accesses stay inside the slices passed: vector loads read `ptr.add(i)` for
//! `i + LANES <= len` and the tails fall back to indexed scalar code.

use core::arch::x86_64::*;
use half::f16;

/// Horizontal sum of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps::<0x55>(s, s));
    _mm_cvtss_f32(s)
}

/// Horizontal max of the 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hmax(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_max_ps(lo, hi);
    let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_max_ss(s, _mm_shuffle_ps::<0x55>(s, s));
    _mm_cvtss_f32(s)
}

/// Loads 8 f16 values from `p` and widens them to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16x8(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Σ `x[i]·x[i]`, each square rounded to f32 (as the scalar path), accumulated in f64.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn sum_squares_f64(x: &[f32]) -> f64 {
    let n = x.len();
    let p = x.as_ptr();
    let mut a0 = _mm256_setzero_pd();
    let mut a1 = _mm256_setzero_pd();
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_loadu_ps(p.add(i));
        let sq = _mm256_mul_ps(v, v);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(sq)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(sq)));
        i += 8;
    }
    let a = _mm256_add_pd(a0, a1);
    let mut lanes = [0f64; 4];
    _mm256_storeu_pd(lanes.as_mut_ptr(), a);
    let mut sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for &v in &x[i..] {
        sum += f64::from(v * v);
    }
    sum
}

/// `out[i] = (x[i] * scale) * w[i]` with the two roundings of the scalar path (no FMA).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `x`, `w` and `out` have the same length.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scale_mul(x: &[f32], scale: f32, w: &[f32], out: &mut [f32]) {
    let n = out.len();
    debug_assert!(x.len() == n && w.len() == n);
    let s = _mm256_set1_ps(scale);
    let mut i = 0;
    while i + 8 <= n {
        let v = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(i)), s);
        let v = _mm256_mul_ps(v, _mm256_loadu_ps(w.as_ptr().add(i)));
        _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        i += 8;
    }
    for j in i..n {
        out[j] = (x[j] * scale) * w[j];
    }
}

/// Σ `q[i]·k[i]` over an f32 vector and an f16 vector of the same length, in f32 with FMA (four
/// independent accumulator chains).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `q.len() == k.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32_f16(q: &[f32], k: &[f16]) -> f32 {
    let n = q.len();
    debug_assert_eq!(k.len(), n);
    let qp = q.as_ptr();
    let kp = k.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (j, a) in acc.iter_mut().enumerate() {
            let o = i + 8 * j;
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(o)), load_f16x8(kp.add(o)), *a);
        }
        i += 32;
    }
    let mut j = 0;
    while i + 8 <= n {
        acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(i)), load_f16x8(kp.add(i)), acc[j]);
        i += 8;
        j += 1;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut sum = hsum(v);
    for j in i..n {
        sum += q[j] * k[j].to_f32();
    }
    sum
}

/// `acc[i] += a · v[i]` with `v` in f16, using FMA.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `acc.len() == v.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy_f16(acc: &mut [f32], a: f32, v: &[f16]) {
    let n = acc.len();
    debug_assert_eq!(v.len(), n);
    let ap = acc.as_mut_ptr();
    let vp = v.as_ptr();
    let av = _mm256_set1_ps(a);
    let mut i = 0;
    while i + 8 <= n {
        let r = _mm256_fmadd_ps(av, load_f16x8(vp.add(i)), _mm256_loadu_ps(ap.add(i)));
        _mm256_storeu_ps(ap.add(i), r);
        i += 8;
    }
    for j in i..n {
        acc[j] = a.mul_add(v[j].to_f32(), acc[j]);
    }
}

/// `acc[i] += a[0]·v[0][i] + a[1]·v[1][i] + a[2]·v[2][i] + a[3]·v[3][i]`, added in that order
/// (the same roundings as four [`axpy_f16`] calls), with one load and store of `acc` instead of
/// four.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; every `v[r].len() == acc.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy4_f16(acc: &mut [f32], a: [f32; 4], v: [&[f16]; 4]) {
    let n = acc.len();
    debug_assert!(v.iter().all(|r| r.len() == n));
    let ap = acc.as_mut_ptr();
    let w = a.map(|x| _mm256_set1_ps(x));
    let vp = v.map(|r| r.as_ptr());
    let mut i = 0;
    while i + 8 <= n {
        let mut r = _mm256_loadu_ps(ap.add(i));
        for j in 0..4 {
            r = _mm256_fmadd_ps(w[j], load_f16x8(vp[j].add(i)), r);
        }
        _mm256_storeu_ps(ap.add(i), r);
        i += 8;
    }
    for t in i..n {
        let mut x = acc[t];
        for j in 0..4 {
            x = a[j].mul_add(v[j][t].to_f32(), x);
        }
        acc[t] = x;
    }
}

/// Row `r` of `dst` (rows of `d` values, a multiple of 8) = `src[start + r·stride..][..d]`
/// widened from f16, for every row of `dst`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `dst.len()` a multiple of `d`, `d` of 8, and every
/// source row inside `src`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn widen_rows_f16(
    src: &[f16],
    start: usize,
    stride: usize,
    d: usize,
    dst: &mut [f32],
) {
    debug_assert!(d % 8 == 0 && dst.len() % d.max(1) == 0);
    for (r, row) in dst.chunks_exact_mut(d).enumerate() {
        let from = &src[start + r * stride..][..d];
        let mut i = 0;
        while i + 8 <= d {
            // SAFETY: values `i..i + 8` exist in both rows.
            unsafe { _mm256_storeu_ps(row.as_mut_ptr().add(i), load_f16x8(from.as_ptr().add(i))) };
            i += 8;
        }
    }
}

/// `scale · (q · tile[r])` for the eight rows `r` of `tile` (`8 × q.len()` values, row-major;
/// `q.len()` a multiple of 8), lane `r` of the result: one accumulator per row over the
/// eight-value chunks in order, then the eight accumulators reduced together (a `hadd` tree)
/// instead of one horizontal sum per row.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the lengths as above.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dots8(q: &[f32], tile: &[f32], scale: f32) -> [f32; 8] {
    let d = q.len();
    debug_assert!(tile.len() == 8 * d && d % 8 == 0);
    let (qp, tp) = (q.as_ptr(), tile.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut c = 0;
    while c + 8 <= d {
        // SAFETY: values `c..c + 8` of `q` and of every row of `tile` exist.
        unsafe {
            let qv = _mm256_loadu_ps(qp.add(c));
            for (r, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(tp.add(r * d + c)), *a);
            }
        }
        c += 8;
    }
    // Lane r of `s` = the sum of the lanes of acc[r].
    let t0 = _mm256_hadd_ps(acc[0], acc[1]);
    let t1 = _mm256_hadd_ps(acc[2], acc[3]);
    let t2 = _mm256_hadd_ps(acc[4], acc[5]);
    let t3 = _mm256_hadd_ps(acc[6], acc[7]);
    let u0 = _mm256_hadd_ps(t0, t1);
    let u1 = _mm256_hadd_ps(t2, t3);
    let lo = _mm256_permute2f128_ps::<0x20>(u0, u1);
    let hi = _mm256_permute2f128_ps::<0x31>(u0, u1);
    let s = _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale));
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 values.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// `acc[i] = fma(w[r], tile[r][i], acc[i])` for `r = 0, 1, …` in order (`w.len() ≤ 8` rows of
/// `acc.len()` values in `tile`, row-major; `acc.len()` a multiple of 8): the operations of
/// [`axpy4_f16`] / [`axpy_f16`] position after position, so the same bits.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; the lengths as above.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn axpy_tile(acc: &mut [f32], w: &[f32], tile: &[f32]) {
    let d = acc.len();
    debug_assert!(w.len() <= 8 && tile.len() >= w.len() * d && d % 8 == 0);
    let (ap, tp) = (acc.as_mut_ptr(), tile.as_ptr());
    let mut c = 0;
    // Four chunks of eight outputs at a time: four independent FMA chains (one chain would run
    // at the FMA latency per position).
    while c + 32 <= d {
        // SAFETY: values `c..c + 32` of `acc` and of the first `w.len()` rows of `tile` exist.
        unsafe {
            let mut r = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(ap.add(c + o)));
            for (p, &wp) in w.iter().enumerate() {
                let wv = _mm256_set1_ps(wp);
                let row = tp.add(p * d + c);
                for (i, ri) in r.iter_mut().enumerate() {
                    *ri = _mm256_fmadd_ps(wv, _mm256_loadu_ps(row.add(8 * i)), *ri);
                }
            }
            for (i, ri) in r.iter().enumerate() {
                _mm256_storeu_ps(ap.add(c + 8 * i), *ri);
            }
        }
        c += 32;
    }
    while c + 8 <= d {
        // SAFETY: values `c..c + 8` of `acc` and of the first `w.len()` rows of `tile` exist.
        unsafe {
            let mut r = _mm256_loadu_ps(ap.add(c));
            for (p, &wp) in w.iter().enumerate() {
                r = _mm256_fmadd_ps(_mm256_set1_ps(wp), _mm256_loadu_ps(tp.add(p * d + c)), r);
            }
            _mm256_storeu_ps(ap.add(c), r);
        }
        c += 8;
    }
}

/// `x[i] *= s`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scale_in_place(x: &mut [f32], s: f32) {
    let n = x.len();
    let p = x.as_mut_ptr();
    let sv = _mm256_set1_ps(s);
    let mut i = 0;
    while i + 8 <= n {
        _mm256_storeu_ps(p.add(i), _mm256_mul_ps(_mm256_loadu_ps(p.add(i)), sv));
        i += 8;
    }
    for v in &mut x[i..] {
        *v *= s;
    }
}

/// Largest element (`-inf` for an empty slice). NaNs are not propagated reliably.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn max(x: &[f32]) -> f32 {
    let n = x.len();
    let p = x.as_ptr();
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 8 <= n {
        m = _mm256_max_ps(m, _mm256_loadu_ps(p.add(i)));
        i += 8;
    }
    let mut r = hmax(m);
    for &v in &x[i..] {
        r = r.max(v);
    }
    r
}

/// e^x for 8 lanes with x ≤ 0 (an error of about 2 ulp); lanes below [`EXP_MIN_ARG`](super::exp::EXP_MIN_ARG), `-inf`
/// included, give exactly 0.
///
/// Range reduction x = n·ln2 + r with |r| ≤ ln2/2 (ln2 split in a high and a low part), a
/// degree-7 Taylor polynomial for e^r (truncation error below 2⁻²⁷ relative), and 2ⁿ built in the
/// exponent field.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn exp_nonpos(x: __m256) -> __m256 {
    use super::exp::{EXP_LN2, EXP_MIN_ARG, EXP_POLY};
    let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN_ARG));
    let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN_ARG));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2[0]), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2[1]), r);
    let mut p = _mm256_set1_ps(EXP_POLY[0]);
    for &c in &EXP_POLY[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    // 2^n for n in [-126, 0]: the biased exponent n + 127 is in [1, 127].
    let ni = _mm256_cvtps_epi32(n);
    let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        ni,
        _mm256_set1_epi32(127),
    )));
    _mm256_andnot_ps(underflow, _mm256_mul_ps(p, pow2))
}

/// SwiGLU, `gate[i] = silu(gate[i]) · up[i]`, eight values at a time (`gate.len()` a multiple
/// of 8, `up` at least as long): per lane the operations of `activation::silu1`,
/// `x · ((x ≥ 0 ? 1 : e) / (1 + e))` with `e = exp(−|x|)` ([`exp_nonpos`]), so the same bits.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn swiglu8(gate: &mut [f32], up: &[f32]) {
    assert!(gate.len() % 8 == 0 && up.len() >= gate.len());
    let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
    for (g, u) in gate.chunks_exact_mut(8).zip(up.chunks_exact(8)) {
        // SAFETY: 8 values in each chunk; the features are available (caller).
        unsafe {
            let x = _mm256_loadu_ps(g.as_ptr());
            let e = exp_nonpos(_mm256_or_ps(x, sign));
            let ge = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_setzero_ps());
            let s = _mm256_div_ps(_mm256_blendv_ps(e, one, ge), _mm256_add_ps(one, e));
            let y = _mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(u.as_ptr()));
            _mm256_storeu_ps(g.as_mut_ptr(), y);
        }
    }
}

/// `x[i] = e^(x[i] - m)` for every element, returning the sum of the results (f32 lanes).
/// Requires `x[i] - m ≤ 0`, i.e. `m` is the maximum (or larger); `-inf` elements become 0.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn exp_sub_sum(x: &mut [f32], m: f32) -> f32 {
    let n = x.len();
    let p = x.as_mut_ptr();
    let mv = _mm256_set1_ps(m);
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        let e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), mv));
        _mm256_storeu_ps(p.add(i), e);
        acc = _mm256_add_ps(acc, e);
        i += 8;
    }
    let mut sum = hsum(acc);
    if i < n {
        // The tail goes through the same vector code, via a padded copy.
        let mut buf = [f32::NEG_INFINITY; 8];
        let tail = n - i;
        buf[..tail].copy_from_slice(&x[i..]);
        let e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), mv));
        _mm256_storeu_ps(buf.as_mut_ptr(), e);
        for (d, s) in x[i..].iter_mut().zip(&buf[..tail]) {
            *d = *s;
            sum += *s;
        }
    }
    sum
}
