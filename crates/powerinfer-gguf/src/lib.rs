//! # powerinfer-gguf
//!
//! The container format of llama.cpp and PowerInfer model files: GGUF v2/v3 with the `GGUF`
//! magic (dense models) or PowerInfer's `PWRI` magic (sparse models), their metadata, tensor
//! directory and tensor data, the ggml element types with their quantization block codecs, and
//! PowerInfer's GPU-index file (`<model>.generated.gpuidx`).
//!
//! Data flows one way: bytes (usually a memory map) -> [`GgmlType`]-typed tensor views ->
//! kernels. Nothing in this crate knows about models or inference.

pub mod quants;
pub mod types;

pub use types::GgmlType;
