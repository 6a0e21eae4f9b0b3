//! The error type of the safe kernel API. Arguments are checked once per call, never per element.

use powerinfer_gguf::GgmlType;
use thiserror::Error;

/// Why a kernel refused its arguments.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum KernelError {
    /// A slice has the wrong length for the shape given.
    #[error("{what}: expected length {expected}, got {got}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// The length the shape implies.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// A neuron or row index is outside the matrix.
    #[error("{what}: index {index} out of range 0..{len}")]
    IndexOutOfRange {
        /// Which argument.
        what: &'static str,
        /// The offending index.
        index: usize,
        /// The number of rows.
        len: usize,
    },
    /// The kernel has no implementation for this weight type.
    #[error("weight type {0} is not supported by this kernel")]
    UnsupportedType(GgmlType),
    /// A shape that the kernel cannot take (e.g. a row length that is not a whole number of blocks).
    #[error("invalid shape: {0}")]
    Shape(String),
    /// A list of indices that must be strictly increasing is not.
    #[error("{what}: indices must be strictly increasing (position {position})")]
    IndicesNotIncreasing {
        /// Which argument.
        what: &'static str,
        /// The first position whose index is not greater than the one before.
        position: usize,
    },
    /// The requested instruction-set backend cannot run on this CPU.
    #[error("backend {0} is not available on this CPU")]
    BackendUnavailable(&'static str),
}

/// Returns a [`KernelError::Length`] unless `got == expected` (every kernel's length check).
#[inline]
pub(crate) fn check_len(
    what: &'static str,
    expected: usize,
    got: usize,
) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::Length {
            what,
            expected,
            got,
        })
    }
}
