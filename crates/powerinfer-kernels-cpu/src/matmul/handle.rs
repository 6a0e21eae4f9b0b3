//! [`MatMul`], the handle the matrix products are methods of (a thread pool and a backend);
//! the methods live in the files of their kind (`dense`, `sparse`, `axpy`).

use super::rowops::RowOps;
use super::table;
use super::weights::Weights;
use crate::backend::Backend;
use crate::error::KernelError;
use crate::pool::ThreadPool;

/// How the one-token sparse axpy multiplies its coefficients (the FFN's hidden values) into
/// quantized down rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AxpyCoefficients {
    /// f32 coefficients, one FMA per weight (PowerInfer's arithmetic).
    #[default]
    Float,
    /// Per block of a pass of rows, the coefficients quantized to int8 against their largest
    /// magnitude and the rows summed by integer dot instructions: less arithmetic per weight,
    /// with a per-element error of at most `max|c| / 254 · Σ |q − 8|` per pass (up to eight
    /// rows) and block, `c` the pass's `a_i · d_i` and `q` the nibbles, plus f32 roundings. Used
    /// by the one-token [`MatMul::sparse_axpy`] and [`MatMul::sparse_axpy_indexed`] on Q4_0
    /// rows on AVX-512 with VBMI and VNNI; elsewhere (and by `sparse_axpy_batch`) `Float`.
    Int8,
}

/// Runs the matrix kernels on a thread pool with one backend. Cheap to make; make one per pool.
#[derive(Clone, Copy, Debug)]
pub struct MatMul<'p> {
    pub(super) pool: &'p ThreadPool,
    pub(super) backend: Backend,
    pub(super) axpy: AxpyCoefficients,
}

impl<'p> MatMul<'p> {
    /// Kernels on `pool` with the best backend of this CPU ([`Backend::detect`]).
    pub fn new(pool: &'p ThreadPool) -> Self {
        MatMul {
            pool,
            backend: Backend::detect(),
            axpy: AxpyCoefficients::Float,
        }
    }

    /// Kernels on `pool` with a chosen backend; [`KernelError::BackendUnavailable`] if this CPU
    /// cannot run it.
    pub fn with_backend(pool: &'p ThreadPool, backend: Backend) -> Result<Self, KernelError> {
        if !backend.is_available() {
            return Err(KernelError::BackendUnavailable(backend.name()));
        }
        Ok(MatMul {
            pool,
            backend,
            axpy: AxpyCoefficients::Float,
        })
    }

    /// The same kernels with the sparse axpy's coefficients as `c` (default
    /// [`AxpyCoefficients::Float`]).
    pub fn with_axpy(self, c: AxpyCoefficients) -> Self {
        MatMul { axpy: c, ..self }
    }

    /// Whether this backend has the int8-coefficient axpy ([`AxpyCoefficients::Int8`]) for
    /// weights of type `ty` (elsewhere that mode runs the float kernel).
    pub fn has_int8_axpy(&self, ty: powerinfer_gguf::GgmlType) -> bool {
        table::row_ops(ty, self.backend).is_some_and(|o| o.axpy_list_int8.is_some())
    }

    /// How the sparse axpy multiplies its coefficients.
    pub fn axpy_mode(&self) -> AxpyCoefficients {
        self.axpy
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The pool in use.
    pub fn pool(&self) -> &'p ThreadPool {
        self.pool
    }

    /// The row kernels of `w`'s type on this backend.
    pub(super) fn ops(&self, w: &Weights<'_>) -> Result<RowOps, KernelError> {
        let mut ops =
            table::row_ops(w.ty, self.backend).ok_or(KernelError::UnsupportedType(w.ty))?;
        if let (AxpyCoefficients::Int8, Some(k)) = (self.axpy, ops.axpy_list_int8) {
            ops.axpy_list = Some(k);
        }
        Ok(ops)
    }
}
