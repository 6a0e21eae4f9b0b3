//! Norms, RoPE, softmax and activations against the f64 definitions of `reference::ops`, on
//! every instruction set of this CPU, with random shapes including odd lengths and SIMD tails.

use powerinfer_kernels_cpu::ops::activation;
use powerinfer_kernels_cpu::ops::norm::{layer_norm, rms_norm, rms_norm_with};
use powerinfer_kernels_cpu::ops::rope::{rope, rope_block, rope_shift, RopeMode, RopeParams};
use powerinfer_kernels_cpu::ops::softmax::{causal_mask, softmax_rows_with, softmax_with};
use powerinfer_kernels_cpu::reference::ops as r;
use powerinfer_kernels_cpu::Backend;
use powerinfer_kernels_cpu::KernelError;
use proptest::prelude::*;

/// Unit roundoff of f32.
const U: f64 = 1.0 / (1u64 << 24) as f64;

fn vec_f32(
    len: impl Into<prop::collection::SizeRange>,
    lo: f32,
    hi: f32,
) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(lo..hi, len)
}

fn assert_close(what: &str, got: &[f32], want: &[f64], tol: impl Fn(usize) -> f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (f64::from(g) - w).abs();
        let t = tol(i);
        assert!(
            err <= t,
            "{what}[{i}]: got {g}, want {w}, error {err:e} > bound {t:e}"
        );
    }
}

// ---------------------------------------------------------------- norms

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn rms_norm_matches_reference(
        (n, rows, x, w) in (1usize..300, 1usize..4).prop_flat_map(|(n, rows)| {
            (Just(n), Just(rows), vec_f32(n * rows, -10.0, 10.0), vec_f32(n, -2.0, 2.0))
        }),
        eps in prop::sample::select(vec![1e-5f32, 1e-6, 1e-12]),
    ) {
        let want = r::rms_norm(&x, &w, f64::from(eps));
        for isa in Backend::available() {
            let mut out = vec![f32::NAN; n * rows];
            rms_norm_with(isa, &x, &w, eps, &mut out).unwrap();
            // mean, eps add, sqrt, division and two products: a few roundings, relative.
            assert_close(isa.name(), &out, &want, |i| 8.0 * U * want[i].abs() + 1e-30);
        }
    }

    #[test]
    fn rms_norm_simd_equals_scalar_to_one_rounding(
        (x, w) in (1usize..600).prop_flat_map(|n| (vec_f32(n, -100.0, 100.0), vec_f32(n, -3.0, 3.0))),
    ) {
        let mut a = vec![0f32; x.len()];
        rms_norm_with(Backend::Scalar, &x, &w, 1e-6, &mut a).unwrap();
        for isa in Backend::available() {
            let mut b = vec![0f32; x.len()];
            rms_norm_with(isa, &x, &w, 1e-6, &mut b).unwrap();
            for (p, q) in a.iter().zip(&b) {
                prop_assert!((p - q).abs() <= 4.0 * f32::EPSILON * p.abs(), "{} vs {}", p, q);
            }
        }
    }

    #[test]
    fn layer_norm_matches_reference(
        (n, rows, x, w, b) in (2usize..300, 1usize..4).prop_flat_map(|(n, rows)| {
            (Just(n), Just(rows), vec_f32(n * rows, -5.0, 15.0), vec_f32(n, -2.0, 2.0), vec_f32(n, -1.0, 1.0))
        }),
    ) {
        let eps = 1e-5f32;
        let want = r::layer_norm(&x, &w, &b, f64::from(eps));
        let mut out = vec![f32::NAN; n * rows];
        layer_norm(&x, &w, &b, eps, &mut out).unwrap();
        for (row, xr) in x.chunks(n).enumerate() {
            let mean = xr.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
            let var = xr.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / n as f64;
            let sd = (var + f64::from(eps)).sqrt();
            for j in 0..n {
                let i = row * n + j;
                // Rounding of the mean and of x - mean is absolute (relative to |x| + |mean|),
                // the rest relative to the normalised value; the bias add is one more rounding.
                let t = 8.0 * U * (want[i].abs() + f64::from(b[j]).abs())
                    + 4.0 * U * f64::from(w[j]).abs() * (f64::from(xr[j]).abs() + mean.abs()) / sd
                    + 1e-30;
                let err = (f64::from(out[i]) - want[i]).abs();
                prop_assert!(err <= t, "[{}] got {} want {} err {:e} > {:e}", i, out[i], want[i], err, t);
            }
        }
    }
}

#[test]
fn unavailable_backends_are_refused() {
    for b in Backend::ALL {
        let mut x = [1.0f32; 4];
        let mut out = [0f32; 4];
        let r1 = rms_norm_with(b, &[1.0; 4], &[1.0; 4], 1e-5, &mut out);
        let r2 = softmax_with(b, &mut x, 1.0);
        if b.is_available() {
            assert!(r1.is_ok() && r2.is_ok(), "{b}");
        } else {
            assert_eq!(r1, Err(KernelError::BackendUnavailable(b.name())));
            assert_eq!(r2, Err(KernelError::BackendUnavailable(b.name())));
        }
    }
}

#[test]
fn norms_reject_bad_lengths() {
    let x = [1.0f32; 10];
    let mut out = [0f32; 10];
    assert!(matches!(
        rms_norm(&x, &[], 1e-5, &mut out),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        rms_norm(&x, &[1.0; 3], 1e-5, &mut out),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        rms_norm(&x, &[1.0; 5], 1e-5, &mut out[..9]),
        Err(KernelError::Length {
            expected: 10,
            got: 9,
            ..
        })
    ));
    assert!(matches!(
        layer_norm(&x, &[1.0; 5], &[0.0; 4], 1e-5, &mut out),
        Err(KernelError::Length {
            expected: 5,
            got: 4,
            ..
        })
    ));
    // Two rows of five: each normalised on its own.
    rms_norm(&x, &[1.0; 5], 0.0, &mut out).unwrap();
    assert!(out.iter().all(|&v| v == 1.0));
}

// ---------------------------------------------------------------- RoPE

/// Bound on |kernel − exact| for one rotated element whose pair has norm `pair`: the iterated f32
/// angle drifts by about (i + 2) roundings per step plus the rounding of theta_scale (whose
/// exponent -2/n_dims is itself rounded), then cos/sin and the rotation add a few roundings.
fn rope_tol(pair: f64, i: usize, theta: f64, n_dims: usize, base: f64) -> f64 {
    let ts_err = (2.0 + 2.0 * base.ln().abs() / n_dims as f64) * U;
    let dtheta = theta * (i as f64 * (ts_err + U) + 2.0 * U);
    pair * (2.0 * dtheta + 8.0 * U) + 1e-30
}

fn rope_case() -> impl Strategy<Value = (usize, usize, usize, Vec<f32>, usize, f32, f32)> {
    (1usize..4, 1usize..66).prop_flat_map(|(n_heads, half_head)| {
        let head_dim = 2 * half_head + usize::from(half_head % 3 == 0); // some odd head sizes
        (
            Just(n_heads),
            Just(head_dim),
            (1..=head_dim / 2).prop_map(|h| 2 * h),
            vec_f32(n_heads * head_dim, -4.0, 4.0),
            prop_oneof![0usize..64, 0usize..5000],
            prop::sample::select(vec![10000.0f32, 500000.0, 10.0]),
            prop::sample::select(vec![1.0f32, 0.5, 0.25]),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn rope_matches_reference((n_heads, head_dim, n_dims, x, pos, base, fscale) in rope_case()) {
        for mode in [RopeMode::Normal, RopeMode::NeoX] {
            let params = RopeParams { n_dims, mode, freq_base: base, freq_scale: fscale };
            let mut got = x.clone();
            rope(&mut got, n_heads, head_dim, pos, &params).unwrap();
            let want = r::rope(&x, n_heads, head_dim, pos, n_dims, mode, f64::from(base), f64::from(fscale));
            let half = n_dims / 2;
            for h in 0..n_heads {
                let o = h * head_dim;
                for i in 0..half {
                    let (ia, ib) = match mode {
                        RopeMode::Normal => (o + 2 * i, o + 2 * i + 1),
                        RopeMode::NeoX => (o + i, o + i + half),
                    };
                    let pair = f64::from(x[ia]).hypot(f64::from(x[ib]));
                    let theta = r::rope_theta(pos, i, n_dims, f64::from(base), f64::from(fscale));
                    let t = rope_tol(pair, i, theta, n_dims, f64::from(base));
                    for j in [ia, ib] {
                        let err = (f64::from(got[j]) - want[j]).abs();
                        prop_assert!(err <= t, "{:?} pos {} pair {} elem {}: err {:e} > {:e}", mode, pos, i, j, err, t);
                    }
                    // Rotation preserves the pair's norm.
                    let after = f64::from(got[ia]).hypot(f64::from(got[ib]));
                    prop_assert!((after - pair).abs() <= 8.0 * U * pair + 1e-30);
                }
                // Partial rotary: the tail is untouched, bit for bit.
                prop_assert_eq!(&got[o + n_dims..o + head_dim], &x[o + n_dims..o + head_dim]);
            }
        }
    }

    /// A key rotated at `pos` and then shifted by `−d` (the KV cache's context shift) is the
    /// key rotated at `pos − d`, within the rounding of both angles; tails stay untouched.
    #[test]
    fn rope_shift_moves_positions((n_heads, head_dim, n_dims, x, pos, base, fscale) in rope_case(), d in 0usize..3000, tokens in 1usize..3) {
        let d = d.min(pos);
        for mode in [RopeMode::Normal, RopeMode::NeoX] {
            let params = RopeParams { n_dims, mode, freq_base: base, freq_scale: fscale };
            let xs: Vec<f32> = (0..tokens).flat_map(|_| x.iter().copied()).collect();
            let mut got = xs.clone();
            rope_block(&mut got, n_heads, head_dim, &vec![pos; tokens], &params).unwrap();
            rope_shift(&mut got, n_heads, head_dim, -(d as i64), &params).unwrap();
            let want = r::rope(&x, n_heads, head_dim, pos - d, n_dims, mode, f64::from(base), f64::from(fscale));
            let half = n_dims / 2;
            for tok in got.chunks(n_heads * head_dim) {
                for h in 0..n_heads {
                    let o = h * head_dim;
                    for i in 0..half {
                        let (ia, ib) = match mode {
                            RopeMode::Normal => (o + 2 * i, o + 2 * i + 1),
                            RopeMode::NeoX => (o + i, o + i + half),
                        };
                        let pair = f64::from(x[ia]).hypot(f64::from(x[ib]));
                        let th = |p: usize| r::rope_theta(p, i, n_dims, f64::from(base), f64::from(fscale));
                        let t = rope_tol(pair, i, th(pos), n_dims, f64::from(base))
                            + rope_tol(pair, i, th(d), n_dims, f64::from(base));
                        for j in [ia, ib] {
                            let err = (f64::from(tok[j]) - want[j]).abs();
                            prop_assert!(err <= t, "{:?} pos {} - {} pair {}: err {:e} > {:e}", mode, pos, d, i, err, t);
                        }
                    }
                    prop_assert_eq!(&tok[o + n_dims..o + head_dim], &x[o + n_dims..o + head_dim]);
                }
            }
        }
        let mut odd = x.clone();
        odd.push(1.0);
        prop_assert!(rope_shift(&mut odd, n_heads, head_dim, 1, &RopeParams::new(head_dim - head_dim % 2, RopeMode::Normal)).is_err() || head_dim < 2);
    }

    #[test]
    fn neox_is_normal_on_deinterleaved_pairs((n_heads, head_dim, n_dims, x, pos, base, fscale) in rope_case()) {
        // Moving element i+half next to element i turns NeoX pairs into adjacent pairs.
        let half = n_dims / 2;
        let perm: Vec<usize> = (0..head_dim)
            .map(|j| if j < n_dims { if j % 2 == 0 { j / 2 } else { half + j / 2 } } else { j })
            .collect();
        let permuted: Vec<f32> = (0..x.len()).map(|j| x[(j / head_dim) * head_dim + perm[j % head_dim]]).collect();
        let mut neox = x.clone();
        rope(&mut neox, n_heads, head_dim, pos, &RopeParams { n_dims, mode: RopeMode::NeoX, freq_base: base, freq_scale: fscale }).unwrap();
        let mut normal = permuted;
        rope(&mut normal, n_heads, head_dim, pos, &RopeParams { n_dims, mode: RopeMode::Normal, freq_base: base, freq_scale: fscale }).unwrap();
        for j in 0..x.len() {
            prop_assert_eq!(normal[j].to_bits(), neox[(j / head_dim) * head_dim + perm[j % head_dim]].to_bits());
        }
    }

    #[test]
    fn rope_block_equals_per_token(
        (n_heads, head_dim, n_dims, x, pos, base, fscale) in rope_case(),
        extra in prop::collection::vec(0usize..3000, 1..5),
    ) {
        let tok = n_heads * head_dim;
        let mut positions = vec![pos];
        positions.extend(extra);
        let block: Vec<f32> = (0..positions.len() * tok).map(|i| x[i % tok] * (1.0 + (i / tok) as f32)).collect();
        for mode in [RopeMode::Normal, RopeMode::NeoX] {
            let params = RopeParams { n_dims, mode, freq_base: base, freq_scale: fscale };
            let mut got = block.clone();
            rope_block(&mut got, n_heads, head_dim, &positions, &params).unwrap();
            for (t, &p) in positions.iter().enumerate() {
                let mut one = block[t * tok..(t + 1) * tok].to_vec();
                rope(&mut one, n_heads, head_dim, p, &params).unwrap();
                prop_assert_eq!(&got[t * tok..(t + 1) * tok], &one[..]);
            }
        }
    }
}

#[test]
fn rope_at_position_zero_is_identity_and_scaling_is_linear() {
    let x: Vec<f32> = (0..2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut y = x.clone();
    rope(&mut y, 2, 64, 0, &RopeParams::new(64, RopeMode::Normal)).unwrap();
    assert_eq!(x, y);
    // freq_scale 0.5 at position 8 is the unscaled rotation at position 4 (both angles exact).
    let scaled = RopeParams {
        freq_scale: 0.5,
        ..RopeParams::new(64, RopeMode::NeoX)
    };
    let mut a = x.clone();
    rope(&mut a, 2, 64, 8, &scaled).unwrap();
    let mut b = x.clone();
    rope(&mut b, 2, 64, 4, &RopeParams::new(64, RopeMode::NeoX)).unwrap();
    assert_eq!(a, b);
}

#[test]
fn rope_rejects_bad_arguments() {
    let mut x = vec![0f32; 2 * 8];
    let p = |n_dims| RopeParams::new(n_dims, RopeMode::Normal);
    assert!(matches!(
        rope(&mut x, 2, 8, 1, &p(7)),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        rope(&mut x, 2, 8, 1, &p(10)),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        rope(&mut x, 2, 8, 1, &p(0)),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        rope(&mut x, 3, 8, 1, &p(8)),
        Err(KernelError::Length {
            expected: 24,
            got: 16,
            ..
        })
    ));
    assert!(matches!(
        rope_block(&mut x, 2, 8, &[0, 1], &p(8)),
        Err(KernelError::Length { .. })
    ));
    let bad_base = RopeParams {
        freq_base: 0.0,
        ..p(8)
    };
    assert!(matches!(
        rope(&mut x, 2, 8, 1, &bad_base),
        Err(KernelError::Shape(_))
    ));
}

// ---------------------------------------------------------------- softmax

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn softmax_matches_reference(
        x in vec_f32(1..300, -20.0, 20.0),
        masked in prop::collection::vec(any::<bool>(), 300),
        scale in prop::sample::select(vec![1.0f32, 0.125, 0.088_388_35, 2.0]),
    ) {
        let mut x = x;
        // Mask about a quarter of the entries, but never all of them.
        for (i, v) in x.iter_mut().enumerate().skip(1) {
            if masked[i] && masked[(i * 7) % 300] {
                *v = f32::NEG_INFINITY;
            }
        }
        let want = r::softmax(&x, f64::from(scale));
        let big = x.iter().filter(|v| v.is_finite()).fold(0f64, |a, &v| a.max((f64::from(v) * f64::from(scale)).abs()));
        for isa in Backend::available() {
            let mut got = x.clone();
            softmax_with(isa, &mut got, scale).unwrap();
            // The exponent's argument carries a rounding relative to its size; exp and the sum a
            // few more; values below 1.2e-38 may be flushed to zero.
            let rel = U * (4.0 * big + 16.0 + x.len() as f64 / 4.0);
            assert_close(isa.name(), &got, &want, |i| rel * want[i] + 1.2e-38);
            for (g, v) in got.iter().zip(&x) {
                if *v == f32::NEG_INFINITY {
                    prop_assert_eq!(*g, 0.0);
                }
            }
        }
    }
}

#[test]
fn softmax_edge_cases() {
    for isa in Backend::available() {
        let mut all_masked = vec![f32::NEG_INFINITY; 11];
        softmax_with(isa, &mut all_masked, 1.0).unwrap();
        assert!(all_masked.iter().all(|&v| v == 0.0), "{}", isa.name());
        let mut one = [3.5f32];
        softmax_with(isa, &mut one, 1.0).unwrap();
        assert_eq!(one, [1.0]);
        let mut empty: [f32; 0] = [];
        softmax_with(isa, &mut empty, 1.0).unwrap();
        // Huge spreads: exp underflows to exactly zero, no NaN.
        let mut wide: Vec<f32> = (0..19).map(|i| i as f32 * -200.0).collect();
        softmax_with(isa, &mut wide, 1.0).unwrap();
        assert_eq!(wide[0], 1.0);
        assert!(wide[1..].iter().all(|&v| v == 0.0));
        let mut rows = vec![0f32; 12];
        assert!(matches!(
            softmax_rows_with(isa, &mut rows, 5, 1.0),
            Err(KernelError::Shape(_))
        ));
        softmax_rows_with(isa, &mut rows, 4, 1.0).unwrap();
        assert!(rows.iter().all(|&v| v == 0.25));
    }
}

#[test]
fn causal_mask_masks_future_positions() {
    // 3 queries at positions 2, 3, 4 over 6 key positions.
    let mut s = vec![1f32; 18];
    causal_mask(&mut s, 3, 6, 2).unwrap();
    for t in 0..3 {
        for c in 0..6 {
            let masked = s[t * 6 + c] == f32::NEG_INFINITY;
            assert_eq!(masked, c > 2 + t, "row {t} col {c}");
        }
    }
    assert!(matches!(
        causal_mask(&mut s, 4, 6, 0),
        Err(KernelError::Length { .. })
    ));
}

// ---------------------------------------------------------------- activations

/// An in-place binary operator of `ops::activation`.
type BinaryOp = fn(&mut [f32], &[f32]) -> Result<(), KernelError>;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn activations_match_reference(x in vec_f32(0..200, -100.0, 100.0), small in vec_f32(0..200, -6.0, 6.0)) {
        for xs in [&x, &small] {
            let mut v = xs.clone();
            activation::relu(&mut v);
            assert_close("relu", &v, &xs.iter().map(|&a| r::relu(a.into())).collect::<Vec<_>>(), |_| 0.0);
            let mut v = xs.clone();
            activation::silu(&mut v);
            let want: Vec<f64> = xs.iter().map(|&a| r::silu(a.into())).collect();
            assert_close("silu", &v, &want, |i| 6.0 * U * want[i].abs() + 1e-30);
            let mut v = xs.clone();
            activation::gelu(&mut v);
            let want: Vec<f64> = xs.iter().map(|&a| r::gelu_tanh(a.into())).collect();
            // 1 + tanh(u) cancels for negative x: the tanh rounding is absolute, scaled by x/2.
            assert_close("gelu", &v, &want, |i| 8.0 * U * want[i].abs() + 2.0 * U * f64::from(xs[i]).abs() + 1e-30);
        }
    }

    #[test]
    fn gated_and_elementwise_match_reference(
        (g, u) in (0usize..200).prop_flat_map(|n| (vec_f32(n, -8.0, 8.0), vec_f32(n, -8.0, 8.0))),
    ) {
        let pairs = || g.iter().zip(&u).map(|(&a, &b)| (f64::from(a), f64::from(b)));
        let cases: [(&str, BinaryOp, Vec<f64>); 5] = [
            ("reglu", activation::reglu, pairs().map(|(a, b)| r::relu(a) * b).collect()),
            ("drelu", activation::drelu, pairs().map(|(a, b)| r::relu(a) * r::relu(b)).collect()),
            ("swiglu", activation::swiglu, pairs().map(|(a, b)| r::silu(a) * b).collect()),
            ("add", activation::add, pairs().map(|(a, b)| a + b).collect()),
            ("mul", activation::mul, pairs().map(|(a, b)| a * b).collect()),
        ];
        for (name, f, want) in cases {
            let mut v = g.clone();
            f(&mut v, &u).unwrap();
            assert_close(name, &v, &want, |i| 8.0 * U * want[i].abs() + 1e-30);
            let mut w = vec![0f32; g.len() + 1];
            let bad = matches!(f(&mut w, &u), Err(KernelError::Length { .. }));
            prop_assert!(bad, "{} accepted a length mismatch", name);
        }
    }
}
