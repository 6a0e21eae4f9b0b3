//! # powerinfer-predictor
//!
//! Everything about guessing which FFN neurons of a ReLU-family LLM fire, and the per-neuron
//! statistics the placement solver ranks neurons by.
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
//! - [`predictor`]: the predictor MLP `p = fc2 · ReLU(fc1 · h)` of one layer.
//!   [`Predictor`](predictor::Predictor) borrows `fc1`/`fc2` as CPU-kernel weight views of any
//!   supported type (a model file's F16/Q8_0/Q4_0 tensors, no copy) and scores a block of
//!   tokens with two GEMMs; neuron `i` is active when `p_i ≥ θ`
//!   ([`active_set`](predictor::active_set)). [`F32Predictor`](predictor::F32Predictor) owns
//!   f32 weights and reads/writes `model_N.safetensors` (F32/F16) and reads `model_N.pt`.
//! - [`quality`]: [`PredictorQuality`](quality::PredictorQuality), per-layer recall, precision,
//!   predicted and true density of a predictor against true activations (active = `!= 0`).
//! - [`storage`]: the type a predictor is stored in, measured on held-out inputs against its
//!   F32 form ([`stored_quality`](storage::stored_quality)); the cheapest type within a margin
//!   ([`choose_storage`](storage::choose_storage)).
//! - [`profile`]: [`ActivationProfile`](profile::ActivationProfile), per-layer per-neuron
//!   activation counts over a corpus (one vectorized compare-and-add per neuron per token),
//!   turned into [`ActivationStats`](stats::ActivationStats) (counts or frequencies).
//! - [`train`]: fitting a predictor per layer from (FFN input, true active set) pairs
//!   ([`LayerSamples`](train::LayerSamples)): BCE on logits, Adam, minibatches, all products on
//!   the CPU kernels (deterministic for a seed), then a per-layer threshold calibrated to a
//!   target recall on the training tokens and folded into `fc2` so one model-wide threshold
//!   works; quality is reported on held-out tokens. [`write_predictor_dir`](train::write_predictor_dir)
//!   writes `model_N.safetensors` + `config.json` (`sparse_threshold`) for `powerinfer convert`.
//!
//! The engine (`powerinfer-engine`) feeds these from its forward pass through an observer
//! (CLI: `powerinfer profile`, `powerinfer train-predictor`); this crate does not depend on it.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod predictor;
pub mod profile;
pub mod pt;
pub mod quality;
pub mod stats;
pub mod storage;
pub mod train;
