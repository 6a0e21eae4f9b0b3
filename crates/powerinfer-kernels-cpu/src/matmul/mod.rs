//! Dense and neuron-sparse matrix products over ggml weight matrices.
//!
//! A weight matrix ([`Weights`]) is ggml's layout: `rows` rows of `cols` elements, row-major,
//! each row a whole number of blocks of its [`GgmlType`]. Activations are f32, one token per
//! `cols`-long row (`x[t * cols + c]`); outputs are f32, one token per row (`y[t * rows + r]`
//! for products, `y[t * cols + c]` for the axpy kernels, which read the matrix transposed).
//!
//! | method of [`MatMul`] | computes |
//! |---|---|
//! | [`gemv`](MatMul::gemv), [`gemm`](MatMul::gemm) | `y_t = W x_t` for one or `T` tokens |
//! | [`sparse_gemv`](MatMul::sparse_gemv), [`sparse_gemm`](MatMul::sparse_gemm) | rows of `W x_t` where the row is selected ([`RowSelect`]), 0 elsewhere |
//! | [`sparse_gemv_indexed`](MatMul::sparse_gemv_indexed) | rows listed in `active`, 0 elsewhere |
//! | [`sparse_axpy`](MatMul::sparse_axpy), [`sparse_axpy_batch`](MatMul::sparse_axpy_batch) | `y_t += Σ a_t[i] · row_i` over selected `i` with `a_t[i] != 0` |
//! | [`sparse_axpy_indexed`](MatMul::sparse_axpy_indexed) | the same over the rows listed in `active` |
//!
//! Weight types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, for
//! every kernel (Q2_K and Q3_K through the portable kernels of `scalar` on every backend).
//! F32 and BF16 weights take f32 activations; F16 weights take them rounded to f16 (ties to
//! even, as ggml converts them for its F16 dot products; beyond ±65504 a value becomes ±∞), and
//! so do the F16 axpy's coefficients `a_i`; quantized weights take activations quantized on the
//! fly (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants) and use integer dot
//! products. The other axpy kernels use the f32 `a_i` directly.
//!
//! Work split: products split the rows (or the list of active rows) into contiguous parts,
//! one per thread, so every row's result is the same for every thread count (the one-token
//! dense product cuts the parts into grains that an idle thread may take over:
//! [`MatMul::gemv`]). The axpy kernels split the *output* columns (block-aligned),
//! each thread walking every active row over its columns, so no reduction between threads is
//! needed and the summation order never changes; except the one-token axpy over rows of
//! ≥ 2048 bytes on backends with a list kernel (AVX-512 Q4_0/Q8_0), which splits the active
//! rows into per-thread partial sums added in thread order: bit-identical for a given thread
//! count, equal within rounding across thread counts. GEMM walks tokens in blocks sized to the
//! last-level cache; dense products run a two-row × four-token micro-kernel, sparse ones four
//! tokens per pass over a weight row. On AVX-512, dense GEMMs of F32/F16/BF16/Q8_0 weights run
//! cache-blocked 4 × 6 / 4 × 4 tiles instead (`x86::gemm`). Every multi-token kernel variant
//! (four tokens, the 2 × 4 tile, the blocked tiles, `dot_batch`) computes each (row, token) with
//! the same operations in the same order, so a token's result does not depend on the other
//! tokens, and sparse == dense with zeroed rows bit for bit. One-token float products sum in
//! another order (`x86::float`'s wide dot) than multi-token ones, so for float weights GEMM and
//! per-token GEMV agree within rounding; for quantized weights (exact integer sums) bit for bit.
//!
//! The f64 definitions of every kernel are in [`crate::reference::matmul`].
//!
//! Files: `weights` (the weight views), `dense` (GEMV, GEMM), `sparse` (row-sparse products),
//! `axpy` (sparse axpy), `select` (row selection), `frame` (what those frames share: checks,
//! the output pointer, prefetches); the row kernels they call come from the table of
//! `table` / `rowops`: portable ones in `scalar`, x86 ones in `x86/`; `act` prepares the
//! activations, `scratch` pools per-call buffers.

pub(crate) mod act;
mod axpy;
mod dense;
pub(crate) mod frame;
mod handle;
pub(crate) mod rowops;
pub(crate) mod scalar;
pub(crate) mod scratch;
mod select;
mod sparse;
pub(crate) mod table;
pub(crate) mod weights;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

pub use dense::{GemmJob, GemvJob, PackedGemvJob, GEMV_GRAIN_BYTES};
pub use handle::{AxpyCoefficients, MatMul};
pub use select::RowSelect;
pub use weights::{PackedQ4_0, Weights};

pub(crate) use select::check_active;

use act::Act;
use powerinfer_gguf::GgmlType;

/// Whether [`MatMul`] supports weight type `ty` (for every kernel).
pub fn is_supported(ty: GgmlType) -> bool {
    rowops::SUPPORTED.contains(&ty)
}

/// The weight types the matrix kernels support.
pub fn supported_types() -> &'static [GgmlType] {
    &rowops::SUPPORTED
}

/// [`supported_types`] as a constant, in the same order.
pub const SUPPORTED_TYPES: [GgmlType; 13] = rowops::SUPPORTED;

#[allow(dead_code)]
fn _assert_act_is_copy(a: Act<'_>) -> Act<'_> {
    a
}
