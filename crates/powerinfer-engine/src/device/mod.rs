//! Compute devices beside the CPU: where the hot part of each layer runs.
//!
//! A device (the crate-private `Device` trait) holds weights in its own memory, under a byte
//! budget that refuses an allocation before anything is allocated, and runs two kinds of work
//! on them:
//!
//! - dense products `y = W x` of matrices it holds (attention, predictor, output head, the
//!   layers `-ngl` offloads): synchronous, activations copied in and results out;
//! - the hot part of a sparse FFN: the rows of the layer's hottest neurons, held in bucket order
//!   (device row `j` is neuron `bucket[j]`). Submitting copies the inputs and returns at once;
//!   the CPU computes the cold neurons meanwhile; finishing waits and adds the device's partial
//!   sum into the output.
//!
//! Implementations: `sim::SimDevice`, a simulated GPU (own memory arena, own worker threads,
//! explicit copies, optional speed model: [`SimSpeed`]) that runs on every machine, and
//! `cuda::CudaDevice` on an NVIDIA GPU through `powerinfer-kernels-cuda`. What goes where is
//! decided at load by the scheduling policy ([`crate::schedule`]), which reads what a device
//! can do from `Device::supports` and `Device::attention` and never the reverse: this module knows nothing of placement or
//! balancing. [`DeviceChoice`] and [`SimOptions`] choose; [`DeviceReport`] tells.

pub(crate) mod cuda;
pub(crate) mod sim;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use half::f16;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ops::attention::{AttentionParams, AttentionPart};
use powerinfer_kernels_cpu::Weights;

use crate::error::{EngineError, Result};
use crate::model::FfnAct;
use crate::profile::ratio;

/// Which device runs the hot part of each layer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceChoice {
    /// Everything on the CPU.
    #[default]
    None,
    /// CUDA device 0 when one is usable, else the CPU (the reason is in the load report).
    Auto,
    /// CUDA device `N`; loading fails when it is not usable.
    Cuda(usize),
    /// The simulated GPU ([`SimOptions`]).
    Sim,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    /// `auto`, `none`, `sim`, `cuda` or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<DeviceChoice, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "none" | "cpu" => Ok(DeviceChoice::None),
            "sim" => Ok(DeviceChoice::Sim),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| format!("`{s}`: expected auto, cuda, cuda:N, sim or none")),
        }
    }
}

/// A speed to play for the simulated device: each piece of work takes at least the time
/// these figures give it (the work itself runs for real on the device's threads; when that
/// takes longer, the device is slower than asked and [`DeviceReport::overruns`] counts it).
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimSpeed {
    /// Bytes per second the device reads its memory at.
    pub bandwidth: f64,
    /// Time of one kernel launch.
    pub launch: Duration,
    /// Bytes per second of a copy between host and device.
    pub link_bandwidth: f64,
}

impl SimSpeed {
    /// A device reading `bandwidth` bytes/s, with `launch` per kernel and a host link of
    /// `link_bandwidth` bytes/s.
    pub fn new(bandwidth: f64, launch: Duration, link_bandwidth: f64) -> SimSpeed {
        SimSpeed {
            bandwidth,
            launch,
            link_bandwidth,
        }
    }
}

/// Options of the simulated device.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SimOptions {
    /// Its worker threads (its own, not the CPU side's pool).
    pub threads: usize,
    /// The speed it plays; `None`: as fast as its threads compute.
    pub speed: Option<SimSpeed>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            threads: 1,
            speed: None,
        }
    }
}

/// What the device holds and did: [`Engine::device_report`](crate::Engine::device_report).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct DeviceReport {
    /// `none`, `sim` or `cuda:N (name)`.
    pub kind: String,
    /// Why no device runs anything, when none does although one was asked for (`--gpu auto`
    /// without a usable GPU, a budget of 0, ...).
    pub note: Option<String>,
    /// The device memory budget.
    pub budget_bytes: u64,
    /// The most device memory held at once.
    pub peak_bytes: u64,
    /// Dense matrices held on the device, and bytes.
    pub dense_matrices: usize,
    /// Their bytes.
    pub dense_bytes: u64,
    /// Dense matrices of the model that could have been placed there.
    pub dense_total: usize,
    /// FFN neuron rows held on the device, over all layers.
    pub ffn_rows: usize,
    /// FFN neurons of the model.
    pub ffn_total: usize,
    /// Where the neuron placement came from (`reused <file>`, `built <file>: reason`, ...).
    pub placement: String,
    /// Active FFN neurons computed on the device so far (all evaluations).
    pub active_device: u64,
    /// Active FFN neurons computed on the CPU so far.
    pub active_cpu: u64,
    /// Pieces of work the simulated device finished later than its speed model asked.
    pub overruns: u64,
}

impl DeviceReport {
    /// Share of the FFN rows held on the device.
    pub fn resident_share(&self) -> f64 {
        ratio(self.ffn_rows as u64, self.ffn_total as u64)
    }

    /// Share of the active FFN neurons computed on the device.
    pub fn active_share(&self) -> f64 {
        ratio(self.active_device, self.active_device + self.active_cpu)
    }
}

/// What a device's work buffers must hold: up to `t_max` tokens of a model of these widths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WorkShape {
    /// Tokens per chunk.
    pub(crate) t_max: usize,
    /// Residual width.
    pub(crate) n_embd: usize,
    /// Widest FFN.
    pub(crate) n_ff: usize,
    /// Widest predictor hidden layer.
    pub(crate) rank: usize,
    /// Most rows of a matrix the device may hold (the output head's vocabulary).
    pub(crate) max_rows: usize,
    /// Most columns of such a matrix (`ffn_down`'s `n_ff`).
    pub(crate) max_cols: usize,
}

/// A matrix held by a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MatId(pub(crate) usize);

/// A layer's hot FFN slice held by a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HotId(pub(crate) usize);

/// The rows of a layer's hot neurons to upload, in bucket order.
#[derive(Clone, Copy)]
pub(crate) struct HotSpec<'a> {
    /// `ffn_gate` (all rows), if the FFN has one.
    pub(crate) gate: Option<Weights<'a>>,
    /// `ffn_up` (all rows).
    pub(crate) up: Weights<'a>,
    /// `ffn_down_t` (all rows).
    pub(crate) down_t: Weights<'a>,
    /// The neurons to hold, device row `j` = neuron `bucket[j]`.
    pub(crate) bucket: &'a [u32],
    /// `ffn_up.bias` (`opt`), all `n_ff` values.
    pub(crate) up_bias: Option<&'a [f32]>,
    /// The activation.
    pub(crate) act: FfnAct,
}

/// The hot part of one layer's sparse FFN for a block of tokens.
pub(crate) struct HotJob<'a> {
    /// The layer's slice.
    pub(crate) hot: HotId,
    /// The FFN input, `t × n_embd`.
    pub(crate) x: &'a [f32],
    /// The predictor scores, `t × n_ff`.
    pub(crate) scores: &'a [f32],
    /// Tokens.
    pub(crate) t: usize,
    /// Active means `score ≥ threshold`.
    pub(crate) threshold: f32,
}

/// Rows a [`Device::replace_hot`] call overwrites: device rows `slots` of a hot slice get the
/// rows of `neurons`, taken from `spec`'s matrices (its bucket is ignored).
pub(crate) struct HotSwap<'a> {
    slots: &'a [u32],
    neurons: &'a [u32],
    /// Where the new rows come from.
    pub(crate) spec: &'a HotSpec<'a>,
}

impl<'a> HotSwap<'a> {
    /// The swap of `slots` for `neurons`, which must have the same length.
    pub(crate) fn new(
        slots: &'a [u32],
        neurons: &'a [u32],
        spec: &'a HotSpec<'a>,
    ) -> Result<HotSwap<'a>> {
        if slots.len() != neurons.len() {
            return Err(EngineError::Device(format!(
                "{} slots for {} neurons",
                slots.len(),
                neurons.len()
            )));
        }
        Ok(HotSwap {
            slots,
            neurons,
            spec,
        })
    }

    /// The device rows to overwrite.
    pub(crate) fn slots(&self) -> &'a [u32] {
        self.slots
    }

    /// The neuron whose rows go to each slot.
    pub(crate) fn neurons(&self) -> &'a [u32] {
        self.neurons
    }
}

/// One token's attention part over the first `n` mirrored positions of a layer.
pub(crate) struct AttentionJob<'a> {
    /// The layer.
    pub(crate) layer: usize,
    /// The token's query heads.
    pub(crate) q: &'a [f32],
    /// Mirrored positions to attend.
    pub(crate) n: usize,
    /// Heads and scale.
    pub(crate) params: &'a AttentionParams,
}

/// A submitted [`HotJob`] or [`AttentionJob`].
#[derive(Debug)]
pub(crate) struct Ticket(pub(crate) u64);

/// A device's submitted jobs by ticket number, until they are finished.
pub(crate) struct Queue<T>(Mutex<HashMap<u64, T>>);

impl<T> Queue<T> {
    /// No jobs.
    pub(crate) fn new() -> Queue<T> {
        Queue(Mutex::new(HashMap::new()))
    }

    /// Files `job` under ticket number `id`.
    pub(crate) fn push(&self, id: u64, job: T) -> Ticket {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, job);
        Ticket(id)
    }

    /// Takes out the job of `ticket`; an unknown ticket is an error naming the `kind` of job.
    pub(crate) fn take(&self, ticket: Ticket, kind: &str) -> Result<T> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ticket.0)
            .ok_or_else(|| EngineError::Device(format!("unknown {kind} {}", ticket.0)))
    }
}

/// What a finished hot job did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct HotDone {
    /// Active neurons it computed (over its tokens).
    pub(crate) active: u64,
    /// Its time on the device, transfers included.
    pub(crate) busy: Duration,
    /// Of which copies between host and device.
    pub(crate) transfer: Duration,
}

/// A compute device beside the CPU (see the [module docs](self)).
pub(crate) trait Device: Send + Sync {
    /// `sim`, `cuda:0 (NVIDIA H200)`, ...
    fn name(&self) -> String;
    /// What decides its speed, for caches of measurements (the name, and for the simulated
    /// device its speed model).
    fn identity(&self) -> String {
        self.name()
    }
    /// The memory budget: limit, bytes in use, peak.
    fn memory(&self) -> (u64, u64, u64);
    /// Whether its kernels take weights of type `ty`.
    fn supports(&self, ty: GgmlType) -> bool;
    /// Bytes of the work buffers the device holds for `shape` (reserved by
    /// [`reserve_work`](Device::reserve_work)); longer batches run in chunks of them.
    fn work_bytes(&self, shape: &WorkShape) -> u64;
    /// Allocates the work buffers of [`work_bytes`](Device::work_bytes).
    fn reserve_work(&self, shape: &WorkShape) -> Result<()>;
    /// Copies a whole matrix into device memory.
    fn upload(&self, w: &Weights<'_>) -> Result<MatId>;
    /// Copies a layer's hot neuron rows into device memory.
    fn upload_hot(&self, spec: &HotSpec<'_>) -> Result<HotId>;
    /// `y = W x` for `t` tokens of a held matrix; returns when `y` is on the host.
    fn product(&self, m: MatId, x: &[f32], t: usize, y: &mut [f32]) -> Result<()>;
    /// Predictor scores `fc2 · ReLU(fc1 · h)` of `t` tokens of held matrices, into `out`.
    fn scores(&self, fc1: MatId, fc2: MatId, h: &[f32], t: usize, out: &mut [f32]) -> Result<()>;
    /// Overwrites rows of a hot slice as `swap` says: a dynamic neuron cache moving neurons in
    /// and out of the slice without allocating. Returns the time the copies took.
    fn replace_hot(&self, hot: HotId, swap: &HotSwap<'_>) -> Result<Duration>;
    /// Frees a hot slice: its memory goes back to the budget and its id becomes unknown.
    fn drop_hot(&self, hot: HotId) -> Result<()>;
    /// Copies a hot job's inputs to the device and queues it; returns at once.
    fn submit(&self, job: &HotJob<'_>) -> Result<Ticket>;
    /// Waits for a submitted job and adds its output (`t × n_embd`) into `out`.
    fn finish(&self, ticket: Ticket, out: &mut [f32]) -> Result<HotDone>;
    /// The attention split's side of the device, when it runs attention (a capability the
    /// scheduling policy reads before it reserves anything).
    fn attention(&self) -> Option<&dyn AttentionDevice> {
        None
    }

    /// Pieces of work finished later than a speed model asked (0 for real devices).
    fn overruns(&self) -> u64 {
        0
    }
}

/// A device that attends over a mirror of a sequence's first KV rows (the attention split):
/// what [`Device::attention`] returns where a device has it.
pub(crate) trait AttentionDevice {
    /// Reserves memory for a mirror of one sequence's first `positions` KV rows in each of
    /// `n_layer` layers (`kv_row` F16 values per K and V row).
    fn reserve_kv(&self, n_layer: usize, positions: usize, kv_row: usize) -> Result<()>;
    /// Copies K and V rows (whole rows) into layer `layer`'s mirror from position `start`;
    /// returns the copy's time.
    fn write_kv(&self, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<Duration>;
    /// Queues one token's attention part.
    fn submit_attention(&self, job: &AttentionJob<'_>) -> Result<Ticket>;
    /// Waits for a queued attention part; returns it and the device's busy time.
    fn finish_attention(&self, ticket: Ticket) -> Result<(AttentionPart, Duration)>;
}
