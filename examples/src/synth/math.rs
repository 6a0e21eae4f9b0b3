//! Counter-based random numbers, the normal distribution and the power-law activation
//! probabilities of the generator.
//!
//! Every random weight is a pure function of `(seed, tensor, element index)`, so tensors can be
//! generated row by row, in any order and in parallel, and a transposed copy (the dense
//! `ffn_down`) has exactly the values of the original (`ffn_down_t`).

/// SplitMix64's output function: a bijective 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A stream key for one tensor (or one use of random numbers) of one model.
pub fn stream_key(seed: u64, name: &str) -> u64 {
    // FNV-1a of the name, then mixed with the seed.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix64(seed.wrapping_add(mix64(h)))
}

/// Uniform in `[0, 1)` with 24 random bits, element `idx` of stream `key`.
#[inline]
pub(crate) fn uniform(key: u64, idx: u64) -> f32 {
    let h = mix64(key ^ idx.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    (h >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// Mean 0, variance 1 (uniform on `[-√3, √3)`): element `idx` of stream `key`. The weights
/// need not be Gaussian: every quantity the generator controls is a sum over hundreds of
/// products, which the central limit theorem makes Gaussian.
#[inline]
pub(crate) fn unit(key: u64, idx: u64) -> f32 {
    const SQRT12: f32 = 3.464_101_6;
    (uniform(key, idx) - 0.5) * SQRT12
}

/// Standard normal (Box-Muller, f64), element `idx` of stream `key`: a deterministic source
/// of Gaussian test inputs.
pub fn gaussian(key: u64, idx: u64) -> f64 {
    let a = mix64(key ^ (2 * idx).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let b = mix64(key ^ (2 * idx + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let u1 = ((a >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = (b >> 11) as f64 / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Complementary error function, relative error below 1.2e-7 (the Chebyshev-fitted
/// exponential form given in Numerical Recipes, 2nd ed., §6.2).
pub(crate) fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 {
        r
    } else {
        2.0 - r
    }
}

/// Standard normal CDF Φ(x).
pub fn normal_cdf(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

/// Standard normal density φ(x).
pub fn normal_pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Inverse of Φ for `p` in (0, 1): Acklam's rational approximation refined by one Halley step
/// (absolute error about 1e-9 in the tails we use).
pub fn normal_ppf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    let p_low = 0.02425;
    let x = if p < p_low {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - p_low {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        let q = (-2.0 * (1.0 - p).ln()).sqrt();
        -(((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    // Halley refinement.
    let e = normal_cdf(x) - p;
    let u = e * (2.0 * std::f64::consts::PI).sqrt() * (0.5 * x * x).exp();
    x - u / (1.0 + 0.5 * x * u)
}

/// `E[ReLU(z)^2]` for `z ~ N(mu, 1)`.
pub(crate) fn relu_second_moment(mu: f64) -> f64 {
    (mu * mu + 1.0) * normal_cdf(mu) + mu * normal_pdf(mu)
}

/// Largest activation probability a neuron is given.
pub const P_MAX: f64 = 0.995;
/// Smallest activation probability a neuron is given.
pub const P_MIN: f64 = 1e-5;

/// Share of the activations carried by the top 20 % of the neurons, for probabilities sorted
/// in descending order.
pub fn top20_share(sorted_desc: &[f64]) -> f64 {
    let k = (sorted_desc.len() as f64 * 0.2).round() as usize;
    let total: f64 = sorted_desc.iter().sum();
    if total <= 0.0 {
        return 0.0;
    }
    sorted_desc[..k].iter().sum::<f64>() / total
}

fn power_law(n: usize, a: f64, density: f64) -> Vec<f64> {
    let shape: Vec<f64> = (0..n).map(|k| ((k + 1) as f64).powf(-a)).collect();
    // Find the scale whose clamped mean is `density` (monotone in the scale).
    let mean = |c: f64| {
        shape
            .iter()
            .map(|&s| (c * s).clamp(P_MIN, P_MAX))
            .sum::<f64>()
            / n as f64
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while mean(hi) < density && hi < 1e300 {
        hi *= 2.0;
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if mean(mid) < density {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    shape
        .iter()
        .map(|&s| (hi * s).clamp(P_MIN, P_MAX))
        .collect()
}

/// `n` activation probabilities in descending order following a power law `c·(k+1)^-a`
/// (clamped to `[P_MIN, P_MAX]`) whose mean is `density` and whose top 20 % carry a share
/// `skew` of the total. `None` when no power law meets both (e.g. skew 0.9 at density 0.5).
pub fn power_law_probabilities(n: usize, density: f64, skew: f64) -> Option<Vec<f64>> {
    if n == 0 || !(P_MIN..=P_MAX).contains(&density) {
        return None;
    }
    let ok = |p: &[f64]| {
        let mean = p.iter().sum::<f64>() / n as f64;
        (mean - density).abs() <= 1e-6 * density.max(1e-3) && (top20_share(p) - skew).abs() <= 2e-3
    };
    let (mut lo, mut hi) = (0.0f64, 8.0f64);
    let mut best = power_law(n, 0.0, density);
    if ok(&best) {
        return Some(best);
    }
    for _ in 0..100 {
        let mid = 0.5 * (lo + hi);
        best = power_law(n, mid, density);
        if top20_share(&best) < skew {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    ok(&best).then_some(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ppf_inverts_cdf() {
        for &p in &[1e-5, 1e-3, 0.02, 0.1, 0.5, 0.9, 0.99, 0.995] {
            let x = normal_ppf(p);
            assert!(
                (normal_cdf(x) - p).abs() < 1e-7 * p.max(1e-2),
                "p={p} x={x}"
            );
        }
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.959_963_985) - 0.975).abs() < 1e-6);
    }

    #[test]
    fn relu_moment_matches_monte_carlo() {
        for &mu in &[-2.0, -0.5, 0.0, 1.0] {
            let n = 200_000;
            let mc: f64 = (0..n)
                .map(|i| {
                    let z = mu + gaussian(7, i);
                    z.max(0.0).powi(2)
                })
                .sum::<f64>()
                / n as f64;
            let exact = relu_second_moment(mu);
            assert!(
                (mc - exact).abs() < 0.02 * exact.max(0.05),
                "mu={mu}: {mc} vs {exact}"
            );
        }
    }

    #[test]
    fn unit_has_mean_zero_variance_one() {
        let n = 100_000u64;
        let xs: Vec<f64> = (0..n).map(|i| f64::from(unit(42, i))).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| x * x).sum::<f64>() / n as f64;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.02,
            "{mean} {var}"
        );
    }

    #[test]
    fn power_law_meets_density_and_skew() {
        let p = power_law_probabilities(1024, 0.1, 0.8).unwrap();
        let mean = p.iter().sum::<f64>() / 1024.0;
        assert!((mean - 0.1).abs() < 1e-6);
        assert!((top20_share(&p) - 0.8).abs() < 2e-3);
        assert!(p.windows(2).all(|w| w[0] >= w[1]));
        // Uniform is skew 0.2.
        let u = power_law_probabilities(1000, 0.3, 0.2).unwrap();
        assert!(u.iter().all(|&x| (x - 0.3).abs() < 1e-9));
        assert!(power_law_probabilities(1024, 0.5, 0.95).is_none());
    }
}
