//! # powerinfer-engine
//!
//! The inference engine of powerinfer-rs. So far it holds:
//!
//! - [`tokenizer`]: the tokenizers built from GGUF metadata (SentencePiece and byte-level BPE,
//!   matching llama.cpp token for token);
//! - [`convert`]: Hugging Face checkpoints + predictors to PowerInfer files (`convert.py`);
//! - [`synth`]: model-file tools (synthetic ReLU-sparse models, quantization);
//! - [`model`]: loading `llama` / `bamboo` / `falcon` / `opt` GGUF and PowerInfer files (tensors are views of the
//!   memory map);
//! - [`forward`]: the CPU forward pass on `powerinfer-kernels-cpu`, and [`ffn`]: each layer's
//!   FFN (dense, predictor-driven sparse, or observed for profiling: [`ffn::FfnObserver`]);
//! - [`profile`]: time, calls and bytes read per operation of the forward pass;
//! - [`kv_cache`]: an F16 KV cache for several sequences;
//! - [`sampling`]: greedy, temperature, top-k/top-p/min-p, penalties, seeded RNG;
//! - [`engine`]: the generation API ([`engine::Engine`], [`engine::Session`]).
//!
//! The GPU backend and the hybrid GPU-CPU scheduler are not written yet (see
//! `ARCHITECTURE.md`).

pub mod convert;
pub mod engine;
pub mod error;
pub mod ffn;
pub mod forward;
mod fused;
pub mod kv_cache;
pub mod model;
pub mod profile;
pub mod reorder;
pub mod sampling;
pub mod synth;
pub mod tokenizer;
