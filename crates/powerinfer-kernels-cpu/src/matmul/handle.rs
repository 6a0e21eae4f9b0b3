//! [`MatMul`], the handle the matrix products are methods of (a thread pool and a backend);
//! the methods live in the files of their kind (`dense`, `sparse`, `axpy`).

use super::rowops::RowOps;
use super::table;
use super::weights::Weights;
use crate::backend::Backend;
use crate::error::KernelError;
use crate::pool::ThreadPool;

/// Runs the matrix kernels on a thread pool with one backend. Cheap to make; make one per pool.
#[derive(Clone, Copy, Debug)]
pub struct MatMul<'p> {
    pub(super) pool: &'p ThreadPool,
    pub(super) backend: Backend,
}

impl<'p> MatMul<'p> {
    /// Kernels on `pool` with the best backend of this CPU ([`Backend::detect`]).
    pub fn new(pool: &'p ThreadPool) -> Self {
        MatMul {
            pool,
            backend: Backend::detect(),
        }
    }

    /// Kernels on `pool` with a chosen backend; [`KernelError::BackendUnavailable`] if this CPU
    /// cannot run it.
    pub fn with_backend(pool: &'p ThreadPool, backend: Backend) -> Result<Self, KernelError> {
        if !backend.is_available() {
            return Err(KernelError::BackendUnavailable(backend.name()));
        }
        Ok(MatMul { pool, backend })
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
        table::row_ops(w.ty, self.backend).ok_or(KernelError::UnsupportedType(w.ty))
    }
}
