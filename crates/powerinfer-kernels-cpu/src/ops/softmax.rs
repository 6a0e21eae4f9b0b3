//! Numerically stable softmax, in place, with an optional scale, and a causal-mask helper.
//!
//! `softmax(x)_i = exp(s·x_i − m) / Σ_j exp(s·x_j − m)` with `m = max_j s·x_j`. Entries equal to
//! `-inf` (masked) give exactly 0. A row whose entries are all `-inf` has no defined softmax; it
//! is set to all zeros (so a fully masked row contributes nothing), and an empty row is left as
//! is. NaN inputs are not detected (garbage in, garbage out).
//!
//! Scalar path: `f32::exp` per element, sum in f64, then multiplication by `(1/sum) as f32`
//! (ggml's order; ggml's old table-based exp rounds through f16, which this does not copy).
//! AVX2 path: a vectorised exp accurate to a few ulp and an f32 sum over 8 lanes; the tests bound
//! its difference to the f64 reference at a few 1e-7 relative.

use super::check_len;
use super::isa::Isa;
use crate::{Backend, KernelError};

/// Softmax of one row in place: `x ← softmax(scale · x)`. Pass `scale = 1.0` for a plain softmax.
pub fn softmax(x: &mut [f32], scale: f32) {
    softmax_isa(Isa::detect(), x, scale);
}

/// [`softmax`] on an explicit backend (errors if this CPU cannot run it).
pub fn softmax_with(backend: Backend, x: &mut [f32], scale: f32) -> Result<(), KernelError> {
    softmax_isa(Isa::new(backend)?, x, scale);
    Ok(())
}

fn softmax_isa(isa: Isa, x: &mut [f32], scale: f32) {
    if x.is_empty() {
        return;
    }
    if scale != 1.0 {
        scale_in_place(isa, x, scale);
    }
    let m = max_with(isa, x);
    if m == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    let sum = exp_sub_sum_with(isa, x, m);
    scale_in_place(isa, x, (1.0 / sum) as f32);
}

/// Softmax of every row of `row_len` values of `x`, in place (see [`softmax`]).
///
/// Errors: `row_len == 0` with a non-empty `x`, or `x.len()` not a multiple of `row_len`.
pub fn softmax_rows(x: &mut [f32], row_len: usize, scale: f32) -> Result<(), KernelError> {
    softmax_rows_isa(Isa::detect(), x, row_len, scale)
}

/// [`softmax_rows`] on an explicit backend (errors if this CPU cannot run it).
pub fn softmax_rows_with(
    backend: Backend,
    x: &mut [f32],
    row_len: usize,
    scale: f32,
) -> Result<(), KernelError> {
    softmax_rows_isa(Isa::new(backend)?, x, row_len, scale)
}

fn softmax_rows_isa(
    isa: Isa,
    x: &mut [f32],
    row_len: usize,
    scale: f32,
) -> Result<(), KernelError> {
    if x.is_empty() {
        return Ok(());
    }
    if row_len == 0 || x.len() % row_len != 0 {
        return Err(KernelError::Shape(format!(
            "softmax: length {} is not a whole number of rows of {}",
            x.len(),
            row_len
        )));
    }
    for row in x.chunks_exact_mut(row_len) {
        softmax_isa(isa, row, scale);
    }
    Ok(())
}

/// Causal mask for a block of queries: `scores` holds `n_rows` rows of `n_cols` key positions;
/// row `t` is the query at position `p0 + t` and its entries at key positions `> p0 + t` are set
/// to `-inf` (the others are left as they are).
///
/// Errors: `scores.len() != n_rows · n_cols`.
pub fn causal_mask(
    scores: &mut [f32],
    n_rows: usize,
    n_cols: usize,
    p0: usize,
) -> Result<(), KernelError> {
    let expected = n_rows
        .checked_mul(n_cols)
        .ok_or_else(|| KernelError::Shape("causal_mask: n_rows · n_cols overflows".into()))?;
    check_len("causal_mask: scores", expected, scores.len())?;
    if n_cols == 0 {
        return Ok(());
    }
    for (t, row) in scores.chunks_exact_mut(n_cols).enumerate() {
        let first_masked = p0.saturating_add(t).saturating_add(1).min(n_cols);
        row[first_masked..].fill(f32::NEG_INFINITY);
    }
    Ok(())
}

/// `x[i] *= s`.
pub(crate) fn scale_in_place(isa: Isa, x: &mut [f32], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C).
        unsafe { super::x86::scale_in_place(x, s) };
        return;
    }
    let _ = isa;
    for v in x {
        *v *= s;
    }
}

/// Largest element of `x` (`-inf` when empty).
pub(crate) fn max_with(isa: Isa, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C).
        return unsafe { super::x86::max(x) };
    }
    let _ = isa;
    x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// `x[i] ← exp(x[i] − m)`, returning the sum of the new values. `m` must be the maximum of `x`
/// and finite.
pub(crate) fn exp_sub_sum_with(isa: Isa, x: &mut [f32], m: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C).
        return f64::from(unsafe { super::x86::exp_sub_sum(x, m) });
    }
    let _ = isa;
    let mut sum = 0f64;
    for v in x {
        let e = (*v - m).exp();
        *v = e;
        sum += f64::from(e);
    }
    sum
}
