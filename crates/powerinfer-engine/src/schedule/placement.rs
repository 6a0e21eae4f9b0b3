//! What goes on the device, decided at load ([`place`]), and the result the executor reads
//! ([`Hybrid`]).
//!
//! PowerInfer files: `powerinfer-placement` splits the VRAM budget in PowerInfer's order,
//! counting exactly what this engine uploads: the matrices of attention (Q/K/V or the fused
//! QKV, `attn_output`), the predictors (`fc1`, `fc2`), the output head, then the device's
//! work buffers and the buckets, and spends the rest on the hottest neurons' rows (from
//! `activation/` statistics, through the `.generated.gpuidx` cache). Norms, biases, embeddings
//! and the KV cache stay in host memory, where the CPU uses them. Dense GGUF files:
//! `n_gpu_layers` whole layers (the last ones, as llama.cpp offloads them), and the output
//! head when it exceeds the layer count.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use powerinfer_kernels_cpu::{MatMul, Weights};
use powerinfer_placement::{
    activation_probabilities, plan_model_with, IndexSource, PlanOptions, VramBudget,
};

use super::attention::AttentionSplit;
use super::balance::{Balance, LayerBalanceState};
use super::calibrate::{calibrate, Calibration, Subject};
use super::{DeviceOptions, GpuIndexMode};
use crate::device::cuda::CudaDevice;
use crate::device::sim::SimDevice;
use crate::device::{Device, DeviceChoice, DeviceReport, HotSpec, MatId, WorkShape};
use crate::error::{EngineError, Result};
use crate::model::{Ffn, Model, Qkv, TensorRef};

/// Neurons per placement group (PowerInfer's solver batch).
const GROUP: usize = 256;

/// A dense matrix of a layer: the ones one-token products may read repacked, and the ones
/// a device may hold.
#[derive(Clone, Copy)]
pub(crate) enum Slot {
    Q,
    K,
    V,
    Qkv,
    Wo,
    Gate,
    Up,
    Down,
}

/// Number of [`Slot`]s.
pub(crate) const SLOTS: usize = 8;

/// What the device holds of one layer.
#[derive(Default)]
pub(crate) struct HybridLayer {
    /// Dense matrices by [`Slot`].
    pub(crate) mats: [Option<MatId>; SLOTS],
    /// `fc1` and `fc2`.
    pub(crate) predictor: Option<(MatId, MatId)>,
}

/// A device and what it holds: the executor runs each piece of work where this says.
pub(crate) struct Hybrid {
    /// The device.
    pub(crate) device: Box<dyn Device>,
    /// Per layer.
    pub(crate) layers: Vec<HybridLayer>,
    /// The output head.
    pub(crate) output: Option<MatId>,
    report: DeviceReport,
    /// Active neurons computed so far on the device and on the CPU.
    pub(crate) counters: (AtomicU64, AtomicU64),
    /// Which neurons the device holds and computes in each layer, moved while decoding.
    pub(crate) balance: Mutex<Balance>,
}

impl Hybrid {
    /// What the device holds and did.
    pub(crate) fn report(&self) -> DeviceReport {
        let (limit, _, peak) = self.device.memory();
        DeviceReport {
            budget_bytes: limit,
            peak_bytes: peak,
            active_device: self.counters.0.load(Ordering::Relaxed),
            active_cpu: self.counters.1.load(Ordering::Relaxed),
            overruns: self.device.overruns(),
            ..self.report.clone()
        }
    }
}

/// The device [`DeviceOptions::choice`] asks for, or why there is none.
pub(crate) enum Opened {
    /// A device to place the model on.
    Device(Box<dyn Device>),
    /// None; `Some` says why although one was asked for.
    Cpu(Option<String>),
}

/// Opens the device of `opts` for `model`.
pub(crate) fn open(opts: &DeviceOptions, model: &Model, t_max: usize) -> Result<Opened> {
    match opts.choice {
        DeviceChoice::None => Ok(Opened::Cpu(None)),
        DeviceChoice::Sim => {
            let budget = match opts.vram_budget {
                Some(b) => b,
                None => everything(model, t_max),
            };
            Ok(Opened::Device(Box::new(SimDevice::new(budget, &opts.sim)?)))
        }
        DeviceChoice::Cuda(n) => match CudaDevice::open(n, opts.vram_budget) {
            Ok(d) => Ok(Opened::Device(Box::new(d))),
            Err(e) => Err(EngineError::NoGpu(format!("cuda:{n}: {e}"))),
        },
        DeviceChoice::Auto => match CudaDevice::open(0, opts.vram_budget) {
            Ok(d) => Ok(Opened::Device(Box::new(d))),
            Err(e) => Ok(Opened::Cpu(Some(format!(
                "no usable GPU ({e}): everything runs on the CPU"
            )))),
        },
    }
}

/// Bytes the simulated device needs to hold everything it could hold of `model`: the work
/// buffers, every weight matrix and the u32 bucket entry of each neuron of a sparse layer.
fn everything(model: &Model, t_max: usize) -> u64 {
    let buckets: u64 = (model.layers.iter())
        .filter_map(|layer| match &layer.ffn {
            Ffn::Sparse { up, .. } => Some(4 * up.rows as u64),
            Ffn::Dense { .. } => None,
        })
        .sum();
    let mats: u64 = model.matrices().map(|t| t.info.n_bytes()).sum();
    work_shape(model, t_max).bytes_upper() + buckets + mats
}

/// Tokens the work buffers hold (longer batches run in chunks).
const WORK_TOKENS: usize = 16;

fn work_shape(model: &Model, t_max: usize) -> WorkShape {
    let hp = &model.hparams;
    let rank = model
        .layers
        .iter()
        .map(|l| match &l.ffn {
            Ffn::Sparse { fc1, .. } => fc1.rows,
            Ffn::Dense { .. } => 0,
        })
        .max()
        .unwrap_or(0);
    WorkShape {
        t_max: t_max.clamp(1, WORK_TOKENS),
        n_embd: hp.n_embd,
        n_ff: hp.n_ff,
        rank,
        max_rows: hp.n_vocab.max(hp.n_ff).max(hp.n_embd + 2 * hp.n_embd_kv()),
        max_cols: hp.n_embd.max(hp.n_ff),
    }
}

impl WorkShape {
    /// An upper bound of any device's work buffers for this shape.
    fn bytes_upper(&self) -> u64 {
        let t = self.t_max as u64;
        4 * t
            * (self.max_cols as u64
                + self.max_rows as u64
                + 2 * self.n_embd as u64
                + 5 * self.n_ff as u64
                + 2 * self.rank as u64)
            + t * self.n_ff as u64
            + 8 * self.n_ff as u64
            + (64 << 10)
    }
}

fn view<'m>(model: &'m Model, t: &TensorRef) -> Result<Weights<'m>> {
    Ok(Weights::new(
        t.ty,
        t.rows,
        t.cols,
        model.file().data_of(&t.info),
    )?)
}

/// Where a dense tensor goes in a [`Hybrid`].
#[derive(Clone, Copy)]
enum Target {
    Slot(usize, Slot),
    Fc1(usize),
    Fc2(usize),
    Output,
}

/// The matrices this engine can run on a device, by tensor name.
fn targets<'m>(model: &'m Model) -> HashMap<&'m str, (Target, &'m TensorRef)> {
    let mut map = HashMap::new();
    for (l, layer) in model.layers.iter().enumerate() {
        let mut put = |t: &'m TensorRef, target: Target| {
            map.insert(t.name.as_str(), (target, t));
        };
        match &layer.qkv {
            Qkv::Separate { wq, wk, wv, .. } => {
                put(wq, Target::Slot(l, Slot::Q));
                put(wk, Target::Slot(l, Slot::K));
                put(wv, Target::Slot(l, Slot::V));
            }
            Qkv::Fused(w) => put(w, Target::Slot(l, Slot::Qkv)),
        }
        put(&layer.wo, Target::Slot(l, Slot::Wo));
        match &layer.ffn {
            Ffn::Dense { gate, up, down } => {
                if let Some(g) = gate {
                    put(g, Target::Slot(l, Slot::Gate));
                }
                put(up, Target::Slot(l, Slot::Up));
                put(down, Target::Slot(l, Slot::Down));
            }
            Ffn::Sparse { fc1, fc2, .. } => {
                put(fc1, Target::Fc1(l));
                put(fc2, Target::Fc2(l));
            }
        }
    }
    // A tied head (`token_embd`) stays in host memory, as PowerInfer keeps it.
    if model.output.name == "output.weight" {
        map.insert(model.output.name.as_str(), (Target::Output, &model.output));
    }
    map
}

/// Places `model` (the file at `path`) on `device` (see the [module docs](self)); `mm` (the
/// CPU's kernels) and `threshold` (the predictor's) for the calibration.
#[allow(clippy::too_many_arguments)]
pub(crate) fn place(
    model: &Model,
    path: &Path,
    opts: &DeviceOptions,
    device: Box<dyn Device>,
    t_max: usize,
    ctx_len: usize,
    mm: &MatMul<'_>,
    threshold: f32,
) -> Result<Hybrid> {
    let shape = work_shape(model, t_max);
    let work = device.reserve_work(&shape);
    let mut h = Hybrid {
        layers: model
            .layers
            .iter()
            .map(|_| HybridLayer::default())
            .collect(),
        output: None,
        report: DeviceReport {
            kind: device.name(),
            ffn_total: model.layers.len() * model.hparams.n_ff,
            ..DeviceReport::default()
        },
        counters: (AtomicU64::new(0), AtomicU64::new(0)),
        balance: Mutex::new(Balance {
            options: opts.balance.clone(),
            ..Balance::default()
        }),
        device,
    };
    // The attention split's KV mirror comes before the FFN's rows (PowerInfer counts the KV
    // cache in the budget before them too).
    let mut attention_note = None;
    if work.is_ok() && opts.balance.attention_split {
        let n_layer = model.layers.len();
        let reserved = match h.device.attention() {
            Some(a) => a.reserve_kv(n_layer, ctx_len, model.hparams.n_embd_kv()),
            None => Err(EngineError::Device(format!(
                "{} does not run attention",
                h.device.name()
            ))),
        };
        match reserved {
            Ok(()) => {
                h.balance
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .attention = Some(AttentionSplit::new(n_layer, ctx_len));
            }
            Err(e) => attention_note = Some(format!("no attention split: {e}")),
        }
    }
    match work {
        Ok(()) if model.is_sparse() => {
            place_sparse(model, path, opts, &mut h, &shape, mm, threshold)?
        }
        Ok(()) => place_layers(model, opts, &mut h)?,
        Err(EngineError::DeviceMemory { requested, .. }) => {
            h.report.note = Some(format!(
                "the VRAM budget of {} bytes is below the device's work buffers ({requested} \
                 bytes): everything runs on the CPU",
                h.device.memory().0
            ));
        }
        Err(e) => return Err(e),
    }
    if let Some(n) = attention_note {
        h.report.note = Some(match h.report.note.take() {
            Some(old) => format!("{old}; {n}"),
            None => n,
        });
    }
    Ok(h)
}

/// Uploads a dense tensor and records where it went.
fn put_dense(model: &Model, h: &mut Hybrid, target: Target, t: &TensorRef) -> Result<()> {
    let id = h.device.upload(&view(model, t)?)?;
    h.report.dense_matrices += 1;
    h.report.dense_bytes += t.info.n_bytes();
    match target {
        Target::Slot(l, s) => h.layers[l].mats[s as usize] = Some(id),
        Target::Output => h.output = Some(id),
        Target::Fc1(l) => {
            let p = h.layers[l].predictor.get_or_insert((id, id));
            p.0 = id;
        }
        Target::Fc2(l) => {
            let p = h.layers[l].predictor.get_or_insert((id, id));
            p.1 = id;
        }
    }
    Ok(())
}

/// The host matrices of a sparse layer as a device takes them (`bucket` empty).
pub(crate) fn layer_spec<'m>(model: &'m Model, l: usize) -> Result<Option<HotSpec<'m>>> {
    let layer = &model.layers[l];
    let Ffn::Sparse {
        gate, up, down_t, ..
    } = &layer.ffn
    else {
        return Ok(None);
    };
    Ok(Some(HotSpec {
        gate: gate.as_ref().map(|g| view(model, g)).transpose()?,
        up: view(model, up)?,
        down_t: view(model, down_t)?,
        bucket: &[],
        up_bias: layer.up_b.as_deref(),
        act: model.ffn_act,
    }))
}

/// Measures both sides on the middle layer (see `calibrate`); `None` when the device cannot
/// hold the measurement's rows.
fn calibration(
    model: &Model,
    opts: &DeviceOptions,
    h: &Hybrid,
    mm: &MatMul<'_>,
    threshold: f32,
) -> Result<Option<Calibration>> {
    let l = model.layers.len() / 2;
    let Some(spec) = layer_spec(model, l)? else {
        return Ok(None);
    };
    let subject = Subject {
        spec,
        n_ff: spec.up.rows(),
        t: 1,
        threshold,
    };
    match calibrate(
        h.device.as_ref(),
        mm,
        &subject,
        opts.balance.calibration_cache.as_deref(),
    ) {
        Ok(c) => Ok(Some(c)),
        Err(EngineError::DeviceMemory { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The share of a layer's held activity whose device time equals the CPU's time on the rest,
/// at calibrated costs: `device(x) = cpu(held + outside − x)`.
fn balanced_share(c: &Calibration, held: f64, outside: f64) -> f64 {
    if held <= 0.0 {
        return 1.0;
    }
    let (d, p) = (&c.device, &c.cpu);
    let x = (p.fixed_us - d.fixed_us + p.per_row_us * (held + outside))
        / (d.per_row_us + p.per_row_us).max(1e-12);
    (x / held).clamp(0.0, 1.0)
}

fn place_sparse(
    model: &Model,
    path: &Path,
    opts: &DeviceOptions,
    h: &mut Hybrid,
    shape: &WorkShape,
    mm: &MatMul<'_>,
    threshold: f32,
) -> Result<()> {
    if let Some(n) = opts.n_gpu_layers {
        return Err(EngineError::Invalid(format!(
            "-ngl {n}: a PowerInfer file places neurons by the VRAM budget (--vram-budget), \
             not by layers (PowerInfer refuses -ngl too)"
        )));
    }
    let targets = targets(model);
    let mut acct = VramBudget::from_gguf(model.file())?;
    // Only what this engine uploads: matrices it runs on the device, of types its kernels take.
    acct.dense.retain(|t| {
        targets
            .get(t.name.as_str())
            .is_some_and(|(_, r)| h.device.supports(r.ty))
    });
    h.report.dense_total = targets.len();
    let ffn_ok = model.layers.iter().all(|l| match &l.ffn {
        Ffn::Sparse {
            gate, up, down_t, ..
        } => gate
            .iter()
            .chain([up, down_t])
            .all(|t| h.device.supports(t.ty)),
        Ffn::Dense { .. } => false,
    });
    let index_bytes: u64 = 4 * (model.layers.len() * model.hparams.n_ff) as u64;
    // The work buffers are held already; the plan splits what is left.
    let (limit, used, _) = h.device.memory();
    let left = limit.saturating_sub(used.max(h.device.work_bytes(shape)) + index_bytes);
    let mode = if ffn_ok {
        opts.gpu_index
    } else {
        GpuIndexMode::Disable
    };
    let calib = if ffn_ok && opts.balance.calibrate && mode != GpuIndexMode::Disable {
        calibration(model, opts, h, mm, threshold)?
    } else {
        None
    };
    let balanced = match (&calib, opts.balance.balanced_placement) {
        (Some(c), true) if c.ratio().is_finite() && c.ratio() > 0.0 => Some(c.ratio()),
        _ => None,
    };
    let plan = plan_model_with(
        path,
        acct,
        &PlanOptions {
            budget_bytes: left,
            n_ctx: 0,
            scratch_bytes: 0,
            group: GROUP,
            balanced,
            min_neurons: 0,
            cap_neurons: None,
            activation: opts.activation_dir.clone(),
            reset: mode == GpuIndexMode::Reset,
            disable: mode == GpuIndexMode::Disable,
        },
    )?;
    for t in &plan.budget.dense[..plan.vram.dense_gpu_count] {
        if let Some(&(target, r)) = targets.get(t.name.as_str()) {
            put_dense(model, h, target, r)?;
        }
    }
    // A predictor needs both matrices on the device.
    for l in &mut h.layers {
        if l.predictor.is_some_and(|(a, b)| a == b) {
            l.predictor = None;
        }
    }
    let mut balance = h.balance.lock().unwrap_or_else(|e| e.into_inner());
    balance.layers = model.layers.iter().map(|_| None).collect();
    for (l, ls) in plan.split.layers.iter().enumerate() {
        if ls.bucket.is_empty() {
            continue;
        }
        let Some(spec) = layer_spec(model, l)? else {
            continue;
        };
        let n_ff = spec.up.rows();
        let id = h.device.upload_hot(&HotSpec {
            bucket: &ls.bucket,
            ..spec
        })?;
        h.report.ffn_rows += ls.bucket.len();
        let prior = plan
            .stats
            .as_ref()
            .and_then(|s| s.layers.get(l))
            .map(|s| activation_probabilities(s))
            .unwrap_or_default();
        let mut state =
            LayerBalanceState::new(l, id, n_ff, &ls.bucket, prior.clone(), opts.balance.window);
        if let (Some(c), true, false) = (&calib, opts.balance.balance, prior.is_empty()) {
            let held: f64 = ls.bucket.iter().map(|&j| prior[j as usize] as f64).sum();
            let all: f64 = prior.iter().map(|&p| p as f64).sum();
            state.enable_share(balanced_share(c, held, all - held));
        }
        balance.layers[l] = Some(state);
    }
    balance.calibration = calib;
    drop(balance);
    h.report.placement = match &plan.source {
        IndexSource::Reused => format!("reused {}", shown(&plan.gpuidx)),
        IndexSource::Built { reason, .. } => format!("wrote {} ({reason})", shown(&plan.gpuidx)),
        IndexSource::Disabled if !ffn_ok => {
            "every FFN neuron on the CPU: the device's kernels do not take the FFN's type".into()
        }
        IndexSource::Disabled => "GPU index disabled: every FFN neuron on the CPU".into(),
        IndexSource::NoStatistics { looked_in } => format!(
            "no activation statistics in {}: every FFN neuron on the CPU",
            looked_in.display()
        ),
    };
    if !plan.vram.dense_complete {
        h.report.note = Some(format!(
            "the VRAM budget of {} bytes holds {} of {} dense matrices; the FFN stays on the CPU",
            limit,
            plan.vram.dense_gpu_count,
            plan.budget.dense.len()
        ));
    }
    Ok(())
}

fn shown(p: &Option<std::path::PathBuf>) -> String {
    p.as_ref()
        .map_or_else(|| "-".to_string(), |p| p.display().to_string())
}

/// Dense files: the last `n_gpu_layers` layers whole, and the output head past the layer
/// count (llama.cpp's `-ngl`).
fn place_layers(model: &Model, opts: &DeviceOptions, h: &mut Hybrid) -> Result<()> {
    let targets = targets(model);
    h.report.dense_total = targets.len();
    let n_layer = model.layers.len();
    let n = opts.n_gpu_layers.unwrap_or(0);
    let first = n_layer - n.min(n_layer);
    let mut chosen: Vec<(Target, &TensorRef)> = targets
        .values()
        .copied()
        .filter(|(t, _)| match t {
            Target::Slot(l, _) | Target::Fc1(l) | Target::Fc2(l) => *l >= first,
            Target::Output => n > n_layer,
        })
        .collect();
    chosen.sort_by_key(|(_, r)| r.info.offset());
    if let Some((_, r)) = chosen.iter().find(|(_, r)| !h.device.supports(r.ty)) {
        return Err(EngineError::Device(format!(
            "{}: the device's kernels do not take {} weights",
            r.name, r.ty
        )));
    }
    for (target, r) in chosen {
        put_dense(model, h, target, r)?;
    }
    h.report.placement = if n == 0 {
        "dense file: no layer offloaded (-ngl N offloads the last N layers)".into()
    } else {
        format!("{} of {n_layer} layers offloaded", n.min(n_layer))
    };
    Ok(())
}
