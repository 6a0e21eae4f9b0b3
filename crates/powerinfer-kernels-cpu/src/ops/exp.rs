//! The exponential of non-positive arguments that SiLU and the softmax of attention share: one
//! definition of its constants and of its scalar form, which the vector forms
//! (`x86::exp_nonpos`, `x86_512::exp_nonpos16`) follow operation by operation, so every path
//! gives the same bits. A leaf: it imports nothing of this crate.

/// Below this argument [`exp_nonpos1`] (and the vector codes' `exp_nonpos`) flush to zero
/// (`exp(-87.33) ≈ 1.2e-38`, the smallest normal f32).
pub(crate) const EXP_MIN_ARG: f32 = -87.336_54;

/// ln 2 = `EXP_LN2[0] + EXP_LN2[1]`, the first 355/512 (9 bits, so `n·EXP_LN2[0]` is exact).
pub(crate) const EXP_LN2: [f32; 2] = [0.693_359_4, -2.121_944_4e-4];

/// The Taylor coefficients of e^r, highest degree (7) first, for Horner's rule.
pub(crate) const EXP_POLY: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// e^x for x ≤ 0 (about 2 ulp; below [`EXP_MIN_ARG`], `-inf` included, exactly 0): range
/// reduction x = n·ln2 + r, the degree-7 polynomial of e^r, 2ⁿ in the exponent field. The
/// vector codes (`x86::exp_nonpos`, `x86_512::exp_nonpos16`) do the same operations per lane,
/// so every path gives the same bits.
#[inline]
pub(crate) fn exp_nonpos1(x: f32) -> f32 {
    let underflow = x < EXP_MIN_ARG;
    // As the vector `max(x, MIN)`: MIN for a NaN.
    let x = if x > EXP_MIN_ARG { x } else { EXP_MIN_ARG };
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(EXP_LN2[0], x);
    let r = (-n).mul_add(EXP_LN2[1], r);
    let mut p = EXP_POLY[0];
    for &c in &EXP_POLY[1..] {
        p = p.mul_add(r, c);
    }
    let pow2 = f32::from_bits((((n as i32) + 127) as u32) << 23);
    if underflow {
        0.0
    } else {
        p * pow2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `exp_nonpos1` against f64's exp: within 3 ulp over its range, 0 below it.
    #[test]
    fn exp_nonpos1_is_close() {
        for i in 0..=20000 {
            let x = -87.0 * i as f32 / 20000.0;
            let want = (x as f64).exp();
            let got = exp_nonpos1(x) as f64;
            assert!(
                (got - want).abs() <= 3.0 * f32::EPSILON as f64 * want,
                "x = {x}"
            );
        }
        assert_eq!(exp_nonpos1(-88.0), 0.0);
        assert_eq!(exp_nonpos1(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_nonpos1(0.0), 1.0);
    }
}
