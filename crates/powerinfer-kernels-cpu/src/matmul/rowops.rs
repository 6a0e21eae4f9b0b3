//! The kernel table's types: the row kernel signatures, [`RowOps`] (the kernels of one weight
//! type on one backend, filled by `table::row_ops`), [`ListedRows`] (the rows a list kernel
//! visits) and the weight types the kernels take.

use super::act::{Act, ActFormat};
use powerinfer_gguf::GgmlType;

/// One dot product of a weight row (raw bytes, whole blocks) with a prepared activation.
pub(crate) type DotFn = fn(&[u8], &Act<'_>) -> f32;
/// Four dot products of one weight row with four activations, each as `RowOps::dot_batch`
/// computes it.
pub(crate) type Dot4Fn = fn(&[u8], &[Act<'_>; 4], &mut [f32; 4]);
/// Dot products of four weight rows with one activation, each exactly as `RowOps::dot`
/// computes it.
pub(crate) type Rows4Fn = fn([&[u8]; 4], &Act<'_>) -> [f32; 4];
/// Dot products of two weight rows with four activations (`out[r][t]`), each exactly as
/// `RowOps::dot_batch` computes it: the GEMM micro-kernel (weights decoded once per 4 tokens, activations
/// loaded once per 2 rows).
pub(crate) type TileFn = fn([&[u8]; 2], &[Act<'_>; 4], &mut [[f32; 4]; 2]);
/// `out += a · row` (row bytes and `out` cover the same columns).
pub(crate) type AxpyFn = fn(&[u8], f32, &mut [f32]);
/// `out += a[0]·rows[0] + … + a[3]·rows[3]`, with the roundings of four [`AxpyFn`] calls in order.
pub(crate) type Axpy4Fn = fn([&[u8]; 4], [f32; 4], &mut [f32]);

/// Rows of a weight matrix picked by a list (strictly increasing, as the sparse frames build
/// it), each cut to the byte range `start..end` (whole blocks).
#[derive(Clone, Copy)]
#[cfg_attr(
    not(all(target_arch = "x86_64", powerinfer_avx512)),
    allow(dead_code) // only the AVX-512 list kernels read the fields
)]
pub(crate) struct ListedRows<'a> {
    /// The whole matrix (`rows · row_bytes` bytes).
    pub data: &'a [u8],
    /// Bytes per row.
    pub row_bytes: usize,
    /// The byte range of every row to read (a thread's columns, for axpy).
    pub start: usize,
    pub end: usize,
    /// The row indices, in the order to visit them.
    pub list: &'a [u32],
    /// Rows the same thread will probably read next (only prefetched, never computed): lets a
    /// kernel called on one grain of a longer run keep its prefetch stream going past the end
    /// of `list` instead of starting cold on the next call.
    pub then: &'a [u32],
}
impl<'a> ListedRows<'a> {
    /// The whole rows `list` of a matrix of `row_bytes`-byte rows held in `data`.
    pub(crate) fn whole(data: &'a [u8], row_bytes: usize, list: &'a [u32]) -> ListedRows<'a> {
        ListedRows {
            data,
            row_bytes,
            start: 0,
            end: row_bytes,
            list,
            then: &[],
        }
    }
    /// The same rows, followed (for the prefetch stream only) by `then`.
    pub(crate) fn then(self, then: &'a [u32]) -> ListedRows<'a> {
        ListedRows { then, ..self }
    }
}

/// Dot products of every listed (whole) row with one activation into `res`, in list order,
/// each exactly as `RowOps::dot` computes it: the row-sparse GEMV of one thread.
pub(crate) type DotListFn = fn(&ListedRows<'_>, &Act<'_>, &mut [f32]);
/// `out += Σ a[i] · row_i[start..end]` over the listed rows (every `a[i]` nonzero), with the
/// roundings of one [`AxpyFn`] call per row in list order: the sparse axpy of one thread.
pub(crate) type AxpyListFn = fn(&ListedRows<'_>, &[f32], &mut [f32]);
/// Dot products of the consecutive rows `rows` of `data` (rows of `row_bytes`) with one
/// activation into `res` (`rows.len()` values), each exactly as `RowOps::dot` computes it: the
/// dense GEMV of one thread over one grain.
pub(crate) type DotRangeFn = fn(&[u8], usize, std::ops::Range<usize>, &Act<'_>, &mut [f32]);

/// The row kernels of one weight type on one backend.
#[derive(Clone, Copy)]
pub(crate) struct RowOps {
    /// One row with one token's activation: the one-token products (GEMV, row-sparse GEMV).
    pub dot: DotFn,
    /// One (row, token) of a multi-token product, with the arithmetic of `dot4` and `tile`
    /// (float weights on x86 sum in another order than `dot`; elsewhere the same function).
    pub dot_batch: DotFn,
    pub dot4: Dot4Fn,
    /// Four rows at once (same results as four `dot` calls), where the backend has it.
    pub rows4: Option<Rows4Fn>,
    /// Two rows × four tokens (same results as eight `dot_batch` calls), where the backend has
    /// it.
    pub tile: Option<TileFn>,
    pub axpy: AxpyFn,
    /// Four rows at once, where the backend has such a kernel.
    pub axpy4: Option<Axpy4Fn>,
    /// A whole thread's row-sparse GEMV, where the backend has such a kernel.
    pub dot_list: Option<DotListFn>,
    /// A dense GEMV over a range of rows, where the backend has such a kernel (taken before
    /// `dot_list` for the rows of at least `LIST_GEMV_ROW_BYTES`).
    pub dot_range: Option<DotRangeFn>,
    /// A whole thread's sparse axpy, where the backend has such a kernel.
    pub axpy_list: Option<AxpyListFn>,
    /// `axpy_list` with each pass's coefficients quantized to int8 per block and integer dot
    /// instructions ([`AxpyCoefficients::Int8`](crate::AxpyCoefficients::Int8)), where the
    /// backend has it.
    pub axpy_list_int8: Option<AxpyListFn>,
    pub act: ActFormat,
}

/// The weight types the matrix kernels take.
pub(crate) const SUPPORTED: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];
