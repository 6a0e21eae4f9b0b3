//! # powerinfer-placement
//!
//! Which FFN neuron rows live in VRAM.
//!
//! - [`budget`]: exact byte accounting of a VRAM budget ([`VramBudget`]): dense tensors in
//!   PowerInfer's priority order (attention, predictors, FFN norms, output), the f16 KV cache for
//!   a context length, a scratch reserve, and the bytes of one neuron (its `ffn_up`, `ffn_gate`
//!   and `ffn_down_t` rows in the file's types). What is left is the FFN budget.
//! - [`solver`]: maximise the activation mass held on the GPU under the FFN budget, neurons in
//!   groups (PowerInfer's 256 by default), with an optional per-layer minimum and cap. Greedy
//!   where greedy is exact, a dynamic program over layers × budget otherwise; also Q-Infer's
//!   balanced mode (each layer's GPU share of mass = r/(1+r)).
//! - [`split`]: the result ([`GpuSplit`]), its conversion to PowerInfer's GPU-index file
//!   (`<model>.generated.gpuidx`) with provenance keys, and the cache lifecycle (reuse, rebuild
//!   when stale, disable, no statistics → all-CPU FFN).
//! - [`lifecycle`]: all of the above for a model file ([`plan_model`]), as `powerinfer plan`
//!   and the engine use it.
//! - [`cost`]: a model of a decode step's time on given hardware for a placement
//!   ([`predict`]): PowerInfer's static split against the balanced one.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod budget;
pub mod cost;
pub mod error;
pub mod lifecycle;
pub mod solver;
pub mod split;

pub use budget::{DenseClass, DenseTensor, KvTypes, ModelShape, VramBudget, VramPlan};
pub use cost::{
    activation_probabilities, predict, Hardware, LayerCost, Policy, StepCost, Workload,
};
pub use error::{PlacementError, Result};
pub use lifecycle::{plan_model, plan_model_with, IndexSource, ModelPlan, PlanOptions};
pub use solver::{solve, solve_balanced, Method, Problem, Solution};
pub use split::{
    check_cached, fnv1a64, gpuidx_path, stats_digest, GpuSplit, LayerSplit, Provenance,
};
