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
use super::exp::exp_nonpos1;
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
}
