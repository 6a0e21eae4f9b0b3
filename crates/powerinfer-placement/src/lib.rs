//! # powerinfer-placement
//!
//! This crate will own the decision of which neuron rows live in VRAM: exact byte accounting of
//! a VRAM budget (`VramBudget`: dense tensors in PowerInfer's priority order, KV cache, scratch,
//! per-neuron row bytes), the greedy hot/cold solver over activation statistics with neuron
//! groups, Q-Infer's throughput-balanced mode, and the resulting `GpuSplit`, stored as
//! `<model>.generated.gpuidx` through `powerinfer-gguf`.
//!
//! Nothing is implemented yet; see `ARCHITECTURE.md`.
