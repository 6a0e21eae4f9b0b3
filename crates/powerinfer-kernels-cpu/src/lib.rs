//! # powerinfer-kernels-cpu
//!
//! CPU kernels for LLM inference on plain slices and the block types of `powerinfer-gguf`:
//! dense GEMV/GEMM over the ggml weight types, PowerInfer's row-sparse product and sparse axpy
//! over neuron rows, and the rest of a transformer layer (norms, RoPE, softmax, activations,
//! attention over an F16 KV cache), with SIMD chosen at run time and a caller-sized thread pool.
//!
//! [`reference`](mod@reference) holds plain f64 implementations that define what every operator
//! computes; the tests of this crate and of `powerinfer-kernels-cuda` check the fast kernels
//! against them.
//!
//! Matrix kernels: [`MatMul`] over a [`Weights`] view ([`matmul`] lists the operators), on a
//! caller-sized [`ThreadPool`], with the instruction set chosen at run time ([`Backend`]).
//! [`ffn`]: the FFN of a set of neuron rows for one token (gate/up rows, the activation, the
//! sparse axpy), the arithmetic of PowerInfer's sparse FFN wherever it runs on these kernels.
//! [`probe`] holds the memory-read probes that benchmarks compare the kernels with.

pub mod backend;
pub mod error;
pub mod ffn;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod probe;
pub mod reference;

pub use backend::{Backend, CpuVendor};
pub use error::KernelError;
pub use matmul::{
    AxpyCoefficients, GemmJob, GemvJob, MatMul, PackedGemvJob, PackedQ4_0, RowSelect, Weights,
};
pub use pool::{PoolKind, ThreadPool};
