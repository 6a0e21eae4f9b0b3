//! Element-wise activations and gated-FFN helpers, in place on f32 slices.
//!
//! Formulas (f32, as ggml's CPU code):
//! - ReLU: `x > 0 ? x : 0` (so `-0.0` and NaN give `+0.0`, as ggml);
//! - SiLU: `x · sigmoid(x)`, with `sigmoid(x) = (x ≥ 0 ? 1 : e) / (1 + e)`, `e = exp(−|x|)` from
//!   this crate's exponential of non-positive arguments (about 2 ulp; the same bits in its
//!   scalar and vector codes);
//! - GELU, tanh approximation: `0.5·x·(1 + tanh(sqrt(2/π)·x·(1 + 0.044715·x²)))`.
//!   The erf form (`0.5·x·(1 + erf(x/√2))`) is not provided: no supported model uses it.
//!
//! The ggml inside PowerInfer (built with `GGML_SILU_FP16` and `GGML_GELU_FP16`) evaluates SiLU
//! and GELU through 65536-entry tables indexed by the f16 rounding of `x`, so its outputs are f16
//! values (relative differences up to ~1e-3); this crate evaluates the formulas in f32, closer
//! to the exact functions. ReLU, the ReLU-gated products and add/mul agree bit for bit.
//!
//! Gated FFN helpers write into `gate`: ReGLU `relu(gate)·up` (LLaMA-ReLU, ProSparse), dReLU
//! `relu(gate)·relu(up)` (Bamboo) and SwiGLU `silu(gate)·up` (SiLU LLaMA).

use super::check_len;
use super::isa::Isa;
use crate::KernelError;

#[inline]
fn relu1(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

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

/// `silu(x) = x · sigmoid(x)`, with `sigmoid(x) = (x ≥ 0 ? 1 : e) / (1 + e)` and
/// `e = exp(−|x|)` ([`exp_nonpos1`]): the exponential's argument is never positive, so it
/// cannot overflow, and the vector code computes the same operations.
#[inline]
fn silu1(x: f32) -> f32 {
    let e = exp_nonpos1(-x.abs());
    let num = if x >= 0.0 { 1.0 } else { e };
    x * (num / (1.0 + e))
}

const GELU_COEF_A: f32 = 0.044_715;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

#[inline]
fn gelu1(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + GELU_COEF_A * x * x)).tanh())
}

/// `x ← relu(x)`.
pub fn relu(x: &mut [f32]) {
    for v in x {
        *v = relu1(*v);
    }
}

/// `x ← silu(x) = x · sigmoid(x)`.
pub fn silu(x: &mut [f32]) {
    for v in x {
        *v = silu1(*v);
    }
}

/// `x ← gelu(x)`, tanh approximation.
pub fn gelu(x: &mut [f32]) {
    for v in x {
        *v = gelu1(*v);
    }
}

/// `a[i] ← f(a[i], b[i])` for every element, once `b` (named `what` in the error) is checked to
/// be as long as `a`: the body of the two-operand operators below.
#[inline]
fn zip_with(
    what: &'static str,
    a: &mut [f32],
    b: &[f32],
    f: impl Fn(f32, f32) -> f32,
) -> Result<(), KernelError> {
    check_len(what, a.len(), b.len())?;
    for (x, &y) in a.iter_mut().zip(b) {
        *x = f(*x, y);
    }
    Ok(())
}

/// `a ← a + b`. Errors: `b.len() != a.len()`.
pub fn add(a: &mut [f32], b: &[f32]) -> Result<(), KernelError> {
    zip_with("add: b", a, b, |x, y| x + y)
}

/// `a ← a · b` (element-wise). Errors: `b.len() != a.len()`.
pub fn mul(a: &mut [f32], b: &[f32]) -> Result<(), KernelError> {
    zip_with("mul: b", a, b, |x, y| x * y)
}

/// ReGLU: `gate ← relu(gate) · up`. Errors: `up.len() != gate.len()`.
pub fn reglu(gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
    zip_with("reglu: up", gate, up, |g, u| relu1(g) * u)
}

/// dReLU: `gate ← relu(gate) · relu(up)`. Errors: `up.len() != gate.len()`.
pub fn drelu(gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
    zip_with("drelu: up", gate, up, |g, u| relu1(g) * relu1(u))
}

/// SwiGLU: `gate ← silu(gate) · up`, eight values at a time where the CPU has AVX2 (the same
/// bits as one at a time). Errors: `up.len() != gate.len()`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
    check_len("swiglu: up", gate.len(), up.len())?;
    swiglu_isa(Isa::detect(), gate, up);
    Ok(())
}

/// [`swiglu`] on the path `isa` (lengths checked).
fn swiglu_isa(isa: Isa, gate: &mut [f32], up: &[f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        done = gate.len() / 8 * 8;
        // SAFETY: `is_avx2()` is only true for an available AVX2+FMA+F16C backend; `done` is a
        // multiple of 8 and `up` as long as `gate`.
        unsafe { super::x86::swiglu8(&mut gate[..done], &up[..done]) };
    }
    let _ = isa;
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = silu1(*g) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector SwiGLU gives the scalar one's bits on every path this CPU has (random values,
    /// zeros of both signs, infinities, NaN, values past the exponential's range), tails
    /// included.
    #[test]
    fn swiglu_paths_agree_bitwise() {
        let mut seed = 3u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        let mut g: Vec<f32> = (0..1000)
            .map(|i| rnd() * [1.0, 10.0, 100.0][i % 3])
            .collect();
        g.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            88.0,
            -88.0,
            -1e-40,
            1e-40,
        ]);
        let u: Vec<f32> = (0..g.len()).map(|_| rnd()).collect();
        let mut want = g.clone();
        for (w, &b) in want.iter_mut().zip(&u) {
            *w = silu1(*w) * b;
        }
        for backend in crate::Backend::available() {
            let isa = Isa::new(backend).unwrap();
            for len in [g.len(), 13, 8, 7] {
                let mut got = g[..len].to_vec();
                swiglu_isa(isa, &mut got, &u[..len]);
                for i in 0..len {
                    assert_eq!(
                        got[i].to_bits(),
                        want[i].to_bits(),
                        "{backend:?} x = {}",
                        g[i]
                    );
                }
            }
        }
    }

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
