//! The scheduling policy of the hybrid engine: what goes on the device at load and how the
//! device and the CPU share each layer's work while decoding. It drives the devices of
//! [`crate::device`] through their trait and reads what they can do from their capabilities;
//! the devices know nothing of it.
//!
//! - `placement`: what goes where at load, through `powerinfer-placement` (the result,
//!   `Hybrid`, is what the executor reads);
//! - `balance`: per layer which held neurons the device computes, moved from measured times,
//!   and the hot-neuron cache ([`BalanceReport`]);
//! - `calibrate`: both sides' row costs measured at load, cached per machine and device
//!   ([`Calibration`]);
//! - `attention`: the attention split, a layer's first KV positions attended on the device
//!   ([`AttentionBalance`]);
//! - `kv`: the sequences' KV rows of the layers the device runs, in stores on the device.

pub(crate) mod attention;
pub(crate) mod balance;
pub(crate) mod calibrate;
pub(crate) mod hybrid;
pub(crate) mod kv;
pub(crate) mod placement;

pub use attention::AttentionBalance;
pub use balance::{BalanceOptions, BalanceReport, LayerBalance};
pub use calibrate::{Calibration, LinearCost};

use crate::device::{DeviceChoice, SimOptions};

/// What to do with PowerInfer's cached neuron placement (`<model>.generated.gpuidx`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuIndexMode {
    /// Reuse it when it matches the model, statistics and budget; else solve and write it.
    #[default]
    Reuse,
    /// Solve and write it again (`--reset-gpu-index`).
    Reset,
    /// Read and write none; every FFN neuron on the CPU (`--disable-gpu-index`).
    Disable,
}

/// Where the model's parts run ([`EngineOptions::device`](crate::EngineOptions::device)).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct DeviceOptions {
    /// The device.
    pub choice: DeviceChoice,
    /// Bytes of device memory the engine may use; `None`: 90% of a GPU's memory less 256 MiB,
    /// or for the simulated device everything the model could place there.
    pub vram_budget: Option<u64>,
    /// Dense GGUF files: offload this many whole layers (the last ones; more than the layer
    /// count also takes the output head), as llama.cpp's `-ngl`. Refused for PowerInfer files,
    /// which place neurons by `vram_budget` instead (as PowerInfer does).
    pub n_gpu_layers: Option<usize>,
    /// The cached neuron placement.
    pub gpu_index: GpuIndexMode,
    /// Activation statistics for the placement (default: `activation/` beside the model).
    pub activation_dir: Option<std::path::PathBuf>,
    /// Sequences whose KV rows the device holds at once (each store holds one sequence's rows
    /// of the layers the device runs, for the whole context); more sequences than this
    /// evaluate on the CPU. `serve --parallel N` sets N.
    pub kv_sequences: usize,
    /// The simulated device.
    pub sim: SimOptions,
    /// How the device and the CPU share each layer's work while decoding.
    pub balance: BalanceOptions,
    /// Capture each device program (the runs between timing marks) as a CUDA graph the first
    /// time it is queued and replay it with one launch after (a decode step's programs are the
    /// same for every token). The simulated device charges one launch per program, as such a
    /// device would. Off by default: not yet measured on a GPU.
    pub graphs: bool,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            choice: DeviceChoice::default(),
            vram_budget: None,
            n_gpu_layers: None,
            gpu_index: GpuIndexMode::default(),
            activation_dir: None,
            kv_sequences: 1,
            sim: SimOptions::default(),
            balance: BalanceOptions::default(),
            graphs: false,
        }
    }
}
