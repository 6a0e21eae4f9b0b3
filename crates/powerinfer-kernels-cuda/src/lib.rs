//! # powerinfer-kernels-cuda
//!
//! This crate will own PowerInfer's operators on NVIDIA GPUs, driven through `cudarc` with the
//! driver loaded at run time so that it builds and its tests run on machines without CUDA:
//! device detection, a byte-budgeted device allocator, uploads of neuron-row buckets, and the
//! dense and neuron-sparse kernels (row-sparse product with bucket indirection, sparse axpy,
//! dense GEMV/GEMM, RMSNorm, RoPE, softmax, attention over a device KV cache, the predictor MLP)
//! compiled ahead of time to PTX/CUBIN. Their semantics are those of `powerinfer-kernels-cpu`.
//!
//! Nothing is implemented yet; see `ARCHITECTURE.md`.
