//! # powerinfer-engine
//!
//! The inference engine of powerinfer-rs. So far it holds:
//!
//! - [`tokenizer`]: the tokenizers built from GGUF metadata (SentencePiece and byte-level BPE,
//!   matching llama.cpp token for token);
//! - [`synth`]: model-file tools (synthetic ReLU-sparse models, quantization).
//!
//! Model loading, sampling, the KV cache, the CPU/GPU backends, the hybrid scheduler and the
//! generation API are not written yet (see `ARCHITECTURE.md`).

pub mod synth;
pub mod tokenizer;
