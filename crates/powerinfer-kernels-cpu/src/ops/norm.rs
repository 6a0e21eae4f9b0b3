//! RMSNorm and LayerNorm over rows of activations.
//!
//! Both take `x` as one or more rows of length `weight.len()` (a block of `T` tokens is
//! `T · n_embd` values) and write `out` of the same length.
//!
//! Rounding points follow ggml's CPU kernels so that results agree with llama.cpp's to the last
//! bit in almost every case:
//! - RMSNorm: each square `x·x` is rounded to f32 and the squares are summed in f64; the mean is
//!   rounded to f32, `scale = 1 / sqrt(mean + eps)` is computed in f32, then
//!   `out = (x · scale) · w` with two f32 roundings (ggml applies the weight as a separate `mul`).
//!   The AVX2 path sums the f64 squares in a different order, which can only change the f32
//!   mean by one rounding in rare cases.
//! - LayerNorm: the mean is summed in f64 and rounded to f32, `v = x - mean` in f32, the variance
//!   sums `v·v` (rounded to f32) in f64 and is rounded to f32, `scale = 1 / sqrt(var + eps)` in
//!   f32, then `out = ((v · scale) · w) + b`.

use super::check_len;
use super::isa::Isa;
use crate::{Backend, KernelError};

fn check_rows(x: &[f32], n: usize, out_len: usize) -> Result<(), KernelError> {
    if n == 0 {
        return Err(KernelError::Shape("norm: weight is empty".into()));
    }
    if x.len() % n != 0 {
        return Err(KernelError::Shape(format!(
            "norm: input length {} is not a whole number of rows of {}",
            x.len(),
            n
        )));
    }
    check_len("norm: out", x.len(), out_len)
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) · weight`, for each row of `weight.len()` values of
/// `x`. Uses the best instruction set of this CPU.
///
/// Errors: `weight` empty, `x.len()` not a multiple of `weight.len()`, or `out.len() != x.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), KernelError> {
    rms_norm_isa(Isa::detect(), x, weight, eps, out)
}

/// [`rms_norm`] on an explicit backend (errors if this CPU cannot run it).
pub fn rms_norm_with(
    backend: Backend,
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    rms_norm_isa(Isa::new(backend)?, x, weight, eps, out)
}

fn rms_norm_isa(
    isa: Isa,
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n = weight.len();
    check_rows(x, n, out.len())?;
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        rms_norm_row(isa, xr, weight, eps, or);
    }
    Ok(())
}

fn rms_norm_row(isa: Isa, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: an `Isa` with `is_avx2()` is only built for an available AVX2 backend (AVX2, FMA, F16C);
        // `x`, `w` and `out` all have length `w.len()` (checked by the caller).
        unsafe {
            let sum = super::x86::sum_squares_f64(x);
            let scale = rms_scale(sum, x.len(), eps);
            super::x86::scale_mul(x, scale, w, out);
        }
        return;
    }
    let _ = isa;
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let scale = rms_scale(sum, x.len(), eps);
    for ((o, &v), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = (v * scale) * wv;
    }
}

#[inline]
fn rms_scale(sum_sq: f64, n: usize, eps: f32) -> f32 {
    let mean = (sum_sq / n as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// LayerNorm with bias: `out = (x - mean(x)) / sqrt(var(x) + eps) · weight + bias` for each row
/// of `weight.len()` values of `x` (population variance, as ggml and PyTorch).
///
/// Errors: `weight` empty, `bias.len() != weight.len()`, `x.len()` not a multiple of
/// `weight.len()`, or `out.len() != x.len()`.
pub fn layer_norm(
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let n = weight.len();
    check_rows(x, n, out.len())?;
    check_len("layer_norm: bias", n, bias.len())?;
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum: f64 = xr.iter().map(|&v| f64::from(v)).sum();
        let mean = (sum / n as f64) as f32;
        let mut sum2 = 0f64;
        for (o, &v) in or.iter_mut().zip(xr) {
            let d = v - mean;
            *o = d;
            sum2 += f64::from(d * d);
        }
        let var = (sum2 / n as f64) as f32;
        let scale = 1.0 / (var + eps).sqrt();
        for ((o, &wv), &bv) in or.iter_mut().zip(weight).zip(bias) {
            *o = ((*o * scale) * wv) + bv;
        }
    }
    Ok(())
}
