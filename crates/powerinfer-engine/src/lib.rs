//! # powerinfer-engine
//!
//! This crate will own the product: loading PowerInfer (`PWRI`) and llama.cpp (`GGUF`) model
//! files, the tokenizers built from GGUF metadata, sampling, the KV cache, the CPU and GPU
//! backends, the hybrid scheduler that splits each sparse FFN between them, and the generation
//! API (`Engine`, sessions, streamed tokens, logits).
//!
//! Nothing is implemented yet; see `ARCHITECTURE.md`.
