//! # powerinfer-predictor
//!
//! Everything about guessing which FFN neurons of a ReLU-family LLM fire, and the per-neuron
//! statistics the placement solver ranks neurons by.
//!
//! Implemented so far:
//!
//! - [`pt`]: PyTorch `.pt` files without torch: a reader (zip archive + a small pickle machine)
//!   for tensors and state dicts, and a writer for 1-D tensors and small state dicts of f32 or
//!   f16 tensors. PowerInfer ships per-layer activation statistics as
//!   `activation/activation_N.pt` (one 1-D tensor of length `n_ff` per layer) and predictors as
//!   `model_N.pt` state dicts (`fc1.weight` torch shape `[r, n_embd]`, `fc2.weight`
//!   `[n_ff, r]`).
//! - [`stats`]: [`ActivationStats`](stats::ActivationStats), per-layer per-neuron activation
//!   statistics, read from and written to an `activation/` folder of `.pt` files (in numeric
//!   layer order, not PowerInfer's lexicographic one) and a single safetensors file.
//!
//! Still to come (see `ARCHITECTURE.md`): the predictor MLP `fc2 · ReLU(fc1 · h)` over model
//! tensors, profiling of true activations and predictor quality metrics.

pub mod pt;
pub mod stats;
