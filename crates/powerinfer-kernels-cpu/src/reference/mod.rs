//! Plain f64 implementations that define what each operator computes. They favour clarity over
//! speed and are public so that other crates (the CUDA kernels, the engine) test against the same
//! definitions.

pub mod matmul;
pub mod ops;
