//! Error types.

use cudarc::driver::DriverError;
use powerinfer_gguf::GgmlType;
use thiserror::Error;

/// Why no GPU can be used. [`crate::Gpu::detect`] returns it instead of panicking.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum NoGpu {
    /// The CUDA driver library (libcuda.so) could not be loaded.
    #[error("the CUDA driver library (libcuda) is not installed")]
    NoDriver,
    /// The driver is there but reports no device (or not the requested ordinal).
    #[error("the CUDA driver reports no device with ordinal {ordinal} ({count} device(s))")]
    NoDevice {
        /// Requested ordinal.
        ordinal: usize,
        /// Devices the driver reports.
        count: usize,
    },
    /// The driver failed to initialise or to create a context.
    #[error("the CUDA driver failed: {0}")]
    Driver(String),
    /// The device is older than the kernels' minimum compute capability (8.0).
    #[error("compute capability {major}.{minor} is below the required 8.0")]
    TooOld {
        /// Major compute capability.
        major: i32,
        /// Minor compute capability.
        minor: i32,
    },
}

/// Why a device byte budget refused an allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("device memory budget exceeded: {requested} bytes requested, {used} of {limit} in use")]
pub struct BudgetError {
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes in use when asked.
    pub used: u64,
    /// The budget.
    pub limit: u64,
}

/// Errors of the device API.
#[derive(Debug, Error)]
pub enum CudaError {
    /// No usable GPU.
    #[error("no GPU: {0}")]
    NoGpu(#[from] NoGpu),
    /// The byte budget refused an allocation; nothing was allocated.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0:?}")]
    Driver(#[from] DriverError),
    /// Loading the embedded kernels failed (e.g. a driver too old for PTX ISA 8.4).
    #[error("loading kernel module {module}: {source:?}")]
    Load {
        /// Kernel module.
        module: &'static str,
        /// Driver error.
        source: DriverError,
    },
    /// A buffer has the wrong length for the shape given.
    #[error("{what}: expected length {expected}, got {got}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// The length the shape implies.
        expected: usize,
        /// The length passed.
        got: usize,
    },
    /// A neuron or row index is out of range, or repeated in a bucket.
    #[error("{what}: index {index} invalid for 0..{len}")]
    Index {
        /// Which argument.
        what: &'static str,
        /// The offending index.
        index: usize,
        /// The valid range.
        len: usize,
    },
    /// The operator has no kernel for this weight type.
    #[error("weight type {0} is not supported by this operator")]
    UnsupportedType(GgmlType),
    /// Internal error: a launch whose arguments do not match the kernel's parameters (refused
    /// before reaching the driver).
    #[error("kernel {kernel}: launch arguments do not match its parameters ({detail})")]
    Launch {
        /// Kernel name.
        kernel: &'static str,
        /// What was pushed and what was expected.
        detail: String,
    },
    /// A shape the kernels cannot take.
    #[error("invalid shape: {0}")]
    Shape(String),
}

/// Result of the device API.
pub type Result<T, E = CudaError> = std::result::Result<T, E>;
