//! # powerinfer-kernels-cpu
//!
//! This crate will own the CPU kernels: dense GEMV/GEMM over the ggml weight types, PowerInfer's
//! row-sparse product and sparse axpy over neuron rows, and the rest of a transformer layer
//! (norms, RoPE, softmax, activations, attention over an F16 KV cache), on plain slices and the
//! block types of `powerinfer-gguf`, with SIMD chosen at run time and a caller-sized thread pool.
