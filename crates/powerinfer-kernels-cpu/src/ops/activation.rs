//! Element-wise activations and gated-FFN helpers, in place on f32 slices.
//!
//! Formulas (f32, as ggml's CPU code):
//! - ReLU: `x > 0 ? x : 0` (so `-0.0` and NaN give `+0.0`, as ggml);
//! - SiLU: `x / (1 + exp(-x))`;
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
use crate::KernelError;

#[inline]
fn relu1(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

#[inline]
fn silu1(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
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

/// SwiGLU: `gate ← silu(gate) · up`. Errors: `up.len() != gate.len()`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) -> Result<(), KernelError> {
    zip_with("swiglu: up", gate, up, |g, u| silu1(g) * u)
}
