//! # powerinfer-predictor
//!
//! This crate will own everything about guessing which FFN neurons fire: the per-layer predictor
//! MLP `fc2(ReLU(fc1(h)))` over `powerinfer-gguf` tensors, per-neuron activation statistics
//! (`ActivationStats`, read from PowerInfer's `activation/activation_N.pt` and from safetensors),
//! profiling of true activations, predictor quality (recall, precision, predicted density) and
//! predictor training, and the small zip + pickle reader that `.pt` files need.
//!
//! Nothing is implemented yet; see `ARCHITECTURE.md`.
