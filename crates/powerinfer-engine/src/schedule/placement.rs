//! What goes on the device, decided at load ([`place`]), and the result the executor reads
//! ([`Hybrid`]).
//!
//! Everything the device will hold is counted in the budget before it is taken, in this order:
//!
//! 1. the work buffers of a device step (`t_max` tokens of every activation the layers pass
//!    between them): without them nothing runs on the device;
//! 2. whole layers: a layer is **resident** when its attention (norms, Q/K/V, output and
//!    biases) and its share of the KV stores (`DeviceOptions::kv_sequences` sequences of the
//!    context length) are on the device, since attention runs where its KV rows are. PowerInfer
//!    files take layers from the first; dense files the last `n_gpu_layers` (llama.cpp's
//!    `-ngl`), their dense FFN with them, and the output head past the layer count;
//! 3. PowerInfer files with every layer resident: the predictors, the FFN norms and biases, the
//!    output norm and head, the token embeddings, each class in layer order as PowerInfer
//!    orders them; the first that does not fit ends the dense part (PowerInfer's rule: the FFN
//!    then stays on the CPU);
//! 4. the rest: the hottest neurons' rows (`powerinfer-placement`'s solver over `activation/`
//!    statistics, through the `.generated.gpuidx` cache) and their buckets.
//!
//! So a budget sized to any share never overflows while decoding: nothing is allocated after
//! loading. PowerInfer counts the KV cache after all dense tensors; here a layer's KV share
//! comes with its attention, because a resident layer needs both.

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use powerinfer_kernels_cpu::{MatMul, Weights};
use powerinfer_placement::{
    activation_probabilities, plan_model_with, IndexSource, KvTypes, PlanOptions, VramBudget,
};

use super::attention::AttentionSplit;
use super::balance::{Balance, LayerBalanceState};
use super::calibrate::{calibrate, Calibration, Subject};
use super::hybrid::{
    layer_spec, view, DevAttention, DevDenseFfn, DevEmbed, DevNorm, DevOutput, Hybrid, HybridLayer,
    Work,
};
use super::kv::KvStores;
use super::{DeviceOptions, GpuIndexMode};
use crate::device::cuda::CudaDevice;
use crate::device::sim::SimDevice;
use crate::device::{
    hot_slice_overhead, BufId, Device, DeviceChoice, DeviceReport, HotSpec, MatId, ScratchShape,
};
use crate::error::{EngineError, Result};
use crate::kv_cache::KvType;
use crate::model::{Ffn, Layer, Model, Norm, Qkv, TensorRef};

/// Neurons per placement group (PowerInfer's solver batch).
const GROUP: usize = 256;

/// Most tokens of one device step: longer batches run in chunks of this many.
pub(crate) const DEVICE_TOKENS: usize = 64;

/// The device [`DeviceOptions::choice`] asks for, or why there is none.
pub(crate) enum Opened {
    /// A device to place the model on.
    Device(Box<dyn Device>),
    /// None; `Some` says why although one was asked for.
    Cpu(Option<String>),
}

/// Opens the device of `opts` for `model`.
pub(crate) fn open(
    opts: &DeviceOptions,
    model: &Model,
    ctx_len: usize,
    types: (KvType, KvType),
) -> Result<Opened> {
    match opts.choice {
        DeviceChoice::None => Ok(Opened::Cpu(None)),
        DeviceChoice::Sim => {
            // By default everything it could hold, on a card of its memory what CUDA's default
            // budget would be there (90% less 256 MiB).
            let budget = match (opts.vram_budget, opts.sim.speed) {
                (Some(b), _) => b,
                (None, Some(card)) => everything(model, opts, ctx_len, types)
                    .min((card.memory / 10 * 9).saturating_sub(256 << 20)),
                (None, None) => everything(model, opts, ctx_len, types),
            };
            let sim = SimDevice::new(budget, &opts.sim, opts.graphs)?;
            Ok(Opened::Device(Box::new(sim)))
        }
        DeviceChoice::Cuda(n) => match CudaDevice::open(n, opts.vram_budget, opts.graphs) {
            Ok(d) => Ok(Opened::Device(Box::new(d))),
            Err(e) => Err(EngineError::NoGpu(format!("cuda:{n}: {e}"))),
        },
        DeviceChoice::Auto if types != (KvType::F16, KvType::F16) => {
            Ok(Opened::Cpu(Some(format!(
            "a {}/{} KV cache: a CUDA device keeps F16 KV stores only; everything runs on the CPU",
            types.0, types.1
        ))))
        }
        DeviceChoice::Auto => match CudaDevice::open(0, opts.vram_budget, opts.graphs) {
            Ok(d) => Ok(Opened::Device(Box::new(d))),
            Err(e) => Ok(Opened::Cpu(Some(format!(
                "no usable GPU ({e}): everything runs on the CPU"
            )))),
        },
    }
}

/// Tokens of the work buffers for batches of `batch` tokens.
pub(crate) fn work_tokens(batch: usize) -> usize {
    batch.clamp(1, DEVICE_TOKENS)
}

/// Bytes the simulated device needs to hold everything it could hold of `model`: the work
/// buffers, the KV stores, every matrix, norm and bias, and the bucket entry of every neuron.
fn everything(model: &Model, opts: &DeviceOptions, ctx_len: usize, types: (KvType, KvType)) -> u64 {
    let hp = &model.hparams;
    let mats: u64 = model.matrices().map(|t| t.info.n_bytes()).sum();
    let embd =
        model.tok_embd.info.n_bytes() + model.pos_embd.as_ref().map_or(0, |p| p.info.n_bytes());
    let vectors: u64 =
        model.layers.iter().map(layer_vector_bytes).sum::<u64>() + norm_bytes(&model.output_norm);
    let kv = KvStores::bytes(
        opts.kv_sequences.max(1),
        model.layers.len(),
        ctx_len,
        hp.n_embd_kv(),
        types,
    );
    work_bytes(model, work_tokens(DEVICE_TOKENS))
        + kv
        + hot_overheads(model)
        + mats
        + embd
        + vectors
}

/// What the layers' hot slices hold beside their rows, at most (every neuron held).
fn hot_overheads(model: &Model) -> u64 {
    (model.layers.iter())
        .map(|layer| match &layer.ffn {
            Ffn::Sparse { gate, up, .. } => {
                hot_slice_overhead(up.rows, up.rows, gate.is_some(), layer.up_b.is_some())
            }
            Ffn::Dense { .. } => 0,
        })
        .sum()
}

fn norm_bytes(n: &Norm) -> u64 {
    4 * (n.weight.len() + n.bias.as_ref().map_or(0, Vec::len)) as u64
}

/// Bytes of a layer's norms and biases.
fn layer_vector_bytes(l: &Layer) -> u64 {
    let v = |b: &Option<Vec<f32>>| 4 * b.as_ref().map_or(0, Vec::len) as u64;
    let qkv_b = match &l.qkv {
        Qkv::Separate { bq, bk, bv, .. } => v(bq) + v(bk) + v(bv),
        Qkv::Fused(_) => 0,
    };
    norm_bytes(&l.attn_norm)
        + l.attn_norm_2.as_ref().map_or(0, norm_bytes)
        + l.ffn_norm.as_ref().map_or(0, norm_bytes)
        + qkv_b
        + v(&l.bo)
        + v(&l.up_b)
        + v(&l.down_b)
}

/// Widest predictor hidden layer.
fn rank(model: &Model) -> usize {
    (model.layers.iter())
        .map(|l| l.ffn.predictor_rank())
        .max()
        .unwrap_or(0)
}

/// The lengths of the work buffers (in [`Work`]'s order) for `t` tokens.
fn work_lens(model: &Model, t: usize) -> Vec<(&'static str, usize)> {
    let hp = &model.hparams;
    let (ne, nkv, nff) = (hp.n_embd, hp.n_embd_kv(), hp.n_ff);
    let falcon2 = model.layers.iter().any(|l| l.attn_norm_2.is_some());
    let dense = model
        .layers
        .iter()
        .any(|l| matches!(l.ffn, Ffn::Dense { .. }));
    let mut v = vec![
        ("x", t * ne),
        ("acur", t * ne),
        ("q", t * ne),
        ("k", t * nkv),
        ("v", t * nkv),
        ("heads", t * ne),
        ("attn_out", t * ne),
        ("exchange", t * (ne + nff)),
        ("hidden", t * rank(model).max(1)),
        ("hot_y", t * ne),
        ("cpu_y", t * ne),
        ("out", t * hp.n_vocab.max(ne) + t * model.layers.len()),
    ];
    if falcon2 {
        v.push(("acur2", t * ne));
    }
    if dense {
        v.push(("gate", t * nff));
        v.push(("up", t * nff));
    }
    v
}

/// Bytes of the work buffers for `t` tokens.
fn work_bytes(model: &Model, t: usize) -> u64 {
    work_lens(model, t).iter().map(|(_, n)| 4 * *n as u64).sum()
}

fn alloc_work(device: &dyn Device, model: &Model, t: usize) -> Result<Work> {
    let lens = work_lens(model, t);
    let mut ids = std::collections::HashMap::new();
    for (name, n) in &lens {
        ids.insert(*name, device.alloc(*n)?);
    }
    let id = |n: &str| ids[n];
    Ok(Work {
        t_max: t,
        x: id("x"),
        acur: id("acur"),
        acur2: ids.get("acur2").copied(),
        q: id("q"),
        k: id("k"),
        v: id("v"),
        heads: id("heads"),
        attn_out: id("attn_out"),
        exchange: id("exchange"),
        hidden: id("hidden"),
        hot_y: id("hot_y"),
        cpu_y: id("cpu_y"),
        gate: ids.get("gate").copied(),
        up: ids.get("up").copied(),
        out: id("out"),
    })
}

/// Rows `rows` of a matrix, as a view of their bytes.
fn row_view<'m>(
    model: &'m Model,
    t: &TensorRef,
    rows: std::ops::Range<usize>,
) -> Result<Weights<'m>> {
    let data = model.file().data_of(&t.info);
    let rb = data.len() / t.rows.max(1);
    Ok(Weights::new(
        t.ty,
        rows.len(),
        t.cols,
        &data[rows.start * rb..rows.end * rb],
    )?)
}

/// Uploads under the budget, counting what went there.
struct Uploader<'a> {
    model: &'a Model,
    device: &'a dyn Device,
    report: &'a mut DeviceReport,
}

impl Uploader<'_> {
    /// Bytes left in the budget.
    fn left(&self) -> u64 {
        let (limit, used, _) = self.device.memory();
        limit.saturating_sub(used)
    }

    fn mat(&mut self, t: &TensorRef) -> Result<MatId> {
        let id = self.device.upload(&view(self.model, t)?)?;
        self.report.dense_matrices += 1;
        self.report.dense_bytes += t.info.n_bytes();
        Ok(id)
    }

    fn vec(&mut self, v: &[f32]) -> Result<BufId> {
        self.device.upload_vec(v)
    }

    fn opt_vec(&mut self, v: &Option<Vec<f32>>) -> Result<Option<BufId>> {
        v.as_deref().map(|v| self.vec(v)).transpose()
    }

    fn norm(&mut self, n: &Norm) -> Result<DevNorm> {
        Ok(DevNorm {
            w: self.vec(&n.weight)?,
            b: self.opt_vec(&n.bias)?,
        })
    }

    /// A layer's attention (a fused QKV as three row ranges).
    fn attention(&mut self, l: &Layer) -> Result<DevAttention> {
        let hp = &self.model.hparams;
        let (qkv, bias) = match &l.qkv {
            Qkv::Separate {
                wq,
                wk,
                wv,
                bq,
                bk,
                bv,
            } => (
                [self.mat(wq)?, self.mat(wk)?, self.mat(wv)?],
                [self.opt_vec(bq)?, self.opt_vec(bk)?, self.opt_vec(bv)?],
            ),
            Qkv::Fused(w) => {
                let (ne, nkv) = (hp.n_embd, hp.n_embd_kv());
                let part = |r: std::ops::Range<usize>| -> Result<MatId> {
                    self.device.upload(&row_view(self.model, w, r)?)
                };
                let ids = [
                    part(0..ne)?,
                    part(ne..ne + nkv)?,
                    part(ne + nkv..ne + 2 * nkv)?,
                ];
                self.report.dense_matrices += 1;
                self.report.dense_bytes += w.info.n_bytes();
                (ids, [None, None, None])
            }
        };
        Ok(DevAttention {
            norm: self.norm(&l.attn_norm)?,
            norm2: l.attn_norm_2.as_ref().map(|n| self.norm(n)).transpose()?,
            qkv,
            bias,
            wo: self.mat(&l.wo)?,
            bo: self.opt_vec(&l.bo)?,
        })
    }
}

/// Bytes of a layer's attention on the device.
fn attention_bytes(l: &Layer) -> u64 {
    let qkv = match &l.qkv {
        Qkv::Separate { wq, wk, wv, .. } => {
            wq.info.n_bytes() + wk.info.n_bytes() + wv.info.n_bytes()
        }
        Qkv::Fused(w) => w.info.n_bytes(),
    };
    qkv + l.wo.info.n_bytes() + layer_vector_bytes(l)
}

/// Bytes of a dense layer's FFN matrices.
fn dense_ffn_bytes(l: &Layer) -> u64 {
    match &l.ffn {
        Ffn::Dense { gate, up, down } => {
            gate.as_ref().map_or(0, |g| g.info.n_bytes()) + up.info.n_bytes() + down.info.n_bytes()
        }
        Ffn::Sparse { .. } => 0,
    }
}

/// Places `model` (the file at `path`) on `device` (see the [module docs](self)); `mm` (the
/// CPU's kernels) and `threshold` (the predictor's) for the calibration; `batch`: the most
/// tokens an evaluation's block holds.
#[allow(clippy::too_many_arguments)]
pub(crate) fn place(
    model: &Model,
    path: &Path,
    opts: &DeviceOptions,
    device: Box<dyn Device>,
    batch: usize,
    (ctx_len, types): (usize, (KvType, KvType)),
    mm: &MatMul<'_>,
    threshold: f32,
) -> Result<Hybrid> {
    let n_layer = model.layers.len();
    let mut h = Hybrid {
        layers: model
            .layers
            .iter()
            .map(|_| HybridLayer::default())
            .collect(),
        output: None,
        embed: None,
        work: None,
        kv: KvStores::none(n_layer),
        report: DeviceReport {
            kind: device.name(),
            ffn_total: model.layers.len() * model.hparams.n_ff,
            layers_total: n_layer,
            ..DeviceReport::default()
        },
        counters: (AtomicU64::new(0), AtomicU64::new(0)),
        tokens: AtomicU64::new(0),
        eval_ns: AtomicU64::new(0),
        decode: (AtomicU64::new(0), AtomicU64::new(0)),
        balance: Mutex::new(Balance {
            options: opts.balance.clone(),
            ..Balance::default()
        }),
        device,
    };
    if model.is_sparse() {
        if let Some(n) = opts.n_gpu_layers {
            return Err(EngineError::Invalid(format!(
                "-ngl {n}: a PowerInfer file places neurons by the VRAM budget (--vram-budget), \
                 not by layers (PowerInfer refuses -ngl too)"
            )));
        }
    }
    let dense_total = count_dense(model);
    h.report.dense_total = dense_total;
    // 1. The work buffers, and the scratch of the device's own kernels.
    let t = work_tokens(batch);
    let hp = &model.hparams;
    let scratch = ScratchShape {
        t,
        cols: hp.n_embd.max(hp.n_ff),
        n_head: hp.n_head,
        ctx: ctx_len,
        n_ff: hp.n_ff,
        io: work_lens(model, t)
            .iter()
            .map(|&(_, n)| n)
            .max()
            .unwrap_or(0),
    };
    let need = work_bytes(model, t) + h.device.scratch_bytes(&scratch);
    let (limit, used, _) = h.device.memory();
    if limit.saturating_sub(used) < need {
        h.report.note = Some(format!(
            "the VRAM budget of {limit} bytes is below the device's work buffers ({need} \
             bytes): everything runs on the CPU"
        ));
        h.report.link_bytes = h.device.traffic().link_bytes;
        return Ok(h);
    }
    h.work = Some(alloc_work(h.device.as_ref(), model, t)?);
    h.device.reserve_scratch(&scratch)?;
    h.report.work_bytes = need;
    // The attention split's KV mirror (for layers attended on the host).
    let mut notes = Vec::new();
    if opts.balance.attention_split && types != (KvType::F16, KvType::F16) {
        notes.push(format!(
            "no attention split: it mirrors F16 KV caches, these are {}/{}",
            types.0, types.1
        ));
    } else if opts.balance.attention_split {
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
            Err(e) => notes.push(format!("no attention split: {e}")),
        }
    }
    let supported = |t: &TensorRef| h.device.supports(t.ty);
    let layer_ok = |l: &Layer| {
        let mats: Vec<&TensorRef> = match &l.qkv {
            Qkv::Separate { wq, wk, wv, .. } => vec![wq, wk, wv],
            Qkv::Fused(w) => vec![w],
        };
        let ffn: Vec<&TensorRef> = match &l.ffn {
            Ffn::Dense { gate, up, down } => gate.iter().chain([up, down]).collect(),
            Ffn::Sparse { .. } => Vec::new(),
        };
        mats.into_iter().chain([&l.wo]).chain(ffn).all(supported)
    };
    // 2. Whole layers, with their KV share.
    let kv_n = opts.kv_sequences.max(1);
    let kv_row = model.hparams.n_embd_kv();
    let kv_layer = KvStores::bytes(kv_n, 1, ctx_len, kv_row, types);
    let order: Vec<usize> = if model.is_sparse() {
        (0..n_layer).collect()
    } else {
        let n = opts.n_gpu_layers.unwrap_or(0).min(n_layer);
        (n_layer - n..n_layer).collect()
    };
    let mut held = vec![false; n_layer];
    let mut unsupported = None;
    // The KV shares of the layers taken so far, allocated after the loop.
    let mut kv_pending = 0u64;
    {
        let mut up = Uploader {
            model,
            device: h.device.as_ref(),
            report: &mut h.report,
        };
        for &l in &order {
            let layer = &model.layers[l];
            if !layer_ok(layer) {
                unsupported = Some(l);
                break;
            }
            let need = attention_bytes(layer) + dense_ffn_bytes(layer) + kv_layer;
            if up.left().saturating_sub(kv_pending) < need {
                break;
            }
            kv_pending += kv_layer;
            h.layers[l].attn = Some(up.attention(layer)?);
            if let Ffn::Dense { gate, up: u, down } = &layer.ffn {
                h.layers[l].dense_ffn = Some(DevDenseFfn {
                    gate: gate.as_ref().map(|g| up.mat(g)).transpose()?,
                    up: up.mat(u)?,
                    down: up.mat(down)?,
                });
                h.layers[l].ffn_norm = layer.ffn_norm.as_ref().map(|n| up.norm(n)).transpose()?;
                h.layers[l].up_b = up.opt_vec(&layer.up_b)?;
                h.layers[l].down_b = up.opt_vec(&layer.down_b)?;
            }
            held[l] = true;
        }
    }
    let resident = held.iter().filter(|&&x| x).count();
    let heads = (model.hparams.n_head_kv, model.hparams.head_dim());
    h.kv = KvStores::new(h.device.as_ref(), held, kv_n, ctx_len, heads, types)?;
    h.report.layers = resident;
    h.report.kv_bytes = if resident > 0 {
        KvStores::bytes(kv_n, resident, ctx_len, kv_row, types)
    } else {
        0
    };
    if let Some(l) = unsupported {
        notes.push(format!(
            "layer {l}: the device's kernels do not take its weights' type; it runs on the CPU"
        ));
    }
    if model.is_sparse() {
        place_sparse(
            model,
            path,
            opts,
            &mut h,
            resident == n_layer,
            mm,
            threshold,
            &mut notes,
        )?;
    } else {
        let n = opts.n_gpu_layers.unwrap_or(0);
        if n > n_layer && resident == n_layer {
            place_output(model, &mut h)?;
        }
        h.report.placement = if n == 0 {
            "dense file: no layer offloaded (-ngl N offloads the last N layers)".into()
        } else {
            format!("{resident} of {n_layer} layers offloaded")
        };
    }
    if resident < order.len() && unsupported.is_none() {
        notes.push(format!(
            "the VRAM budget of {} bytes holds {resident} of {} layers (with their KV rows); \
             the others run on the CPU",
            h.device.memory().0,
            order.len()
        ));
    }
    if !notes.is_empty() {
        h.report.note = Some(notes.join("; "));
    }
    // Copies at load (weights) are not per-token traffic.
    h.report.link_bytes = h.device.traffic().link_bytes;
    Ok(h)
}

/// The matrices a device could hold of `model`.
fn count_dense(model: &Model) -> usize {
    let per_layer: usize = model
        .layers
        .iter()
        .map(|l| {
            let qkv = match &l.qkv {
                Qkv::Separate { .. } => 3,
                Qkv::Fused(_) => 1,
            };
            let ffn = match &l.ffn {
                Ffn::Dense { gate, .. } => 2 + usize::from(gate.is_some()),
                Ffn::Sparse { .. } => 2,
            };
            qkv + 1 + ffn
        })
        .sum();
    per_layer + usize::from(model.output.name == "output.weight")
}

/// The output norm and head (a tied head, `token_embd`, stays on the host as PowerInfer keeps
/// it), when they fit.
fn place_output(model: &Model, h: &mut Hybrid) -> Result<bool> {
    if model.output.name != "output.weight" || !h.device.supports(model.output.ty) {
        return Ok(false);
    }
    let mut up = Uploader {
        model,
        device: h.device.as_ref(),
        report: &mut h.report,
    };
    if up.left() < model.output.info.n_bytes() + norm_bytes(&model.output_norm) {
        return Ok(false);
    }
    let head = up.mat(&model.output)?;
    h.output = Some(DevOutput {
        norm: up.norm(&model.output_norm)?,
        head,
    });
    Ok(true)
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
    let (Some(spec), Some(w)) = (layer_spec(model, l)?, h.work.as_ref()) else {
        return Ok(None);
    };
    let (ne, nff) = (model.hparams.n_embd, spec.up.rows());
    let subject = Subject {
        spec,
        bufs: [
            w.acur.span(0, ne),
            w.exchange.span(ne, nff),
            w.hot_y.span(0, ne),
        ],
        n_ff: nff,
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
/// at calibrated costs: `device(x) = cpu(held + outside − x)`. A layer the device holds whole
/// stays whole on it while the device's time is below `floor` (seconds), what the CPU's share
/// would cost whatever its rows (the balancer's own rule).
fn balanced_share(c: &Calibration, held: f64, outside: f64, floor: f64) -> f64 {
    if held <= 0.0 {
        return 1.0;
    }
    let (d, p) = (&c.device, &c.cpu);
    if outside <= 0.0 && (d.fixed_us + d.per_row_us * held) * 1e-6 <= floor {
        return 1.0;
    }
    let x = (p.fixed_us - d.fixed_us + p.per_row_us * (held + outside))
        / (d.per_row_us + p.per_row_us).max(1e-12);
    (x / held).clamp(0.0, 1.0)
}

/// A PowerInfer file's dense parts past the attention (when every layer is resident) and its
/// neurons' rows.
#[allow(clippy::too_many_arguments)]
fn place_sparse(
    model: &Model,
    path: &Path,
    opts: &DeviceOptions,
    h: &mut Hybrid,
    all_resident: bool,
    mm: &MatMul<'_>,
    threshold: f32,
    notes: &mut Vec<String>,
) -> Result<()> {
    let ffn_ok = model.layers.iter().all(|l| match &l.ffn {
        Ffn::Sparse {
            gate, up, down_t, ..
        } => gate
            .iter()
            .chain([up, down_t])
            .all(|t| h.device.supports(t.ty)),
        Ffn::Dense { .. } => false,
    });
    // 3. Predictors, FFN norms and biases, output, embeddings: PowerInfer's classes in order.
    let mut complete = all_resident;
    if complete {
        let mut up = Uploader {
            model,
            device: h.device.as_ref(),
            report: &mut h.report,
        };
        for (l, layer) in model.layers.iter().enumerate() {
            let Some((fc1, fc2)) = layer.ffn.predictor() else {
                continue;
            };
            if !h.device.supports(fc1.ty)
                || !h.device.supports(fc2.ty)
                || up.left() < fc1.info.n_bytes() + fc2.info.n_bytes()
            {
                complete = false;
                break;
            }
            h.layers[l].predictor = Some((up.mat(fc1)?, up.mat(fc2)?));
        }
    }
    if complete {
        let mut up = Uploader {
            model,
            device: h.device.as_ref(),
            report: &mut h.report,
        };
        for (l, layer) in model.layers.iter().enumerate() {
            let v = |b: &Option<Vec<f32>>| 4 * b.as_ref().map_or(0, Vec::len) as u64;
            let need =
                layer.ffn_norm.as_ref().map_or(0, norm_bytes) + v(&layer.up_b) + v(&layer.down_b);
            if up.left() < need {
                complete = false;
                break;
            }
            h.layers[l].ffn_norm = layer.ffn_norm.as_ref().map(|n| up.norm(n)).transpose()?;
            h.layers[l].up_b = up.opt_vec(&layer.up_b)?;
            h.layers[l].down_b = up.opt_vec(&layer.down_b)?;
        }
    }
    if complete {
        place_output(model, h)?;
        let te = &model.tok_embd;
        let pe_bytes = model.pos_embd.as_ref().map_or(0, |p| p.info.n_bytes());
        let fits = h.device.supports(te.ty)
            && model
                .pos_embd
                .as_ref()
                .is_none_or(|p| h.device.supports(p.ty));
        let up = Uploader {
            model,
            device: h.device.as_ref(),
            report: &mut h.report,
        };
        if fits && up.left() >= te.info.n_bytes() + pe_bytes {
            h.embed = Some(DevEmbed {
                tok: h.device.upload(&view(model, te)?)?,
                pos: model
                    .pos_embd
                    .as_ref()
                    .map(|p| h.device.upload(&view(model, p)?))
                    .transpose()?,
            });
        }
    }
    // 4. The neurons' rows.
    // What each layer's hot slice holds beside its rows, at most (every neuron held).
    let index_bytes = hot_overheads(model);
    let (limit, used, _) = h.device.memory();
    let left = if complete {
        limit.saturating_sub(used + index_bytes)
    } else {
        0
    };
    let mode = if ffn_ok {
        opts.gpu_index
    } else {
        GpuIndexMode::Disable
    };
    let calib = if complete && ffn_ok && opts.balance.calibrate && mode != GpuIndexMode::Disable {
        calibration(model, opts, h, mm, threshold)?
    } else {
        None
    };
    let balanced = match (&calib, opts.balance.balanced_placement) {
        (Some(c), true) if c.ratio().is_finite() && c.ratio() > 0.0 => Some(c.ratio()),
        _ => None,
    };
    let mut acct = VramBudget::from_gguf(model.file())?;
    // The dense parts are placed above; the solver spends what is left on neurons.
    acct.dense.clear();
    let plan = plan_model_with(
        path,
        acct,
        &PlanOptions {
            budget_bytes: left,
            n_ctx: 0,
            kv: KvTypes::F16,
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
    let mut balance = h.balance.lock().unwrap_or_else(|e| e.into_inner());
    balance.layers = model.layers.iter().map(|_| None).collect();
    for (l, ls) in plan.split.layers.iter().enumerate() {
        if ls.bucket.is_empty() || !complete {
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
        // The CPU's fixed cost, and a link's round trip of the share's input and output.
        let floor = calib
            .as_ref()
            .map(|c| (c.cpu.fixed_us + c.device.fixed_us) * 1e-6 + 50e-6);
        if let Some(f) = floor {
            state.set_cpu_floor(f);
        }
        if let (Some(c), Some(f), true, false) =
            (&calib, floor, opts.balance.balance, prior.is_empty())
        {
            let held: f64 = ls.bucket.iter().map(|&j| prior[j as usize] as f64).sum();
            let all: f64 = prior.iter().map(|&p| p as f64).sum();
            state.enable_share(balanced_share(c, held, all - held, f));
            h.device.set_enabled(id, state.enabled_slots().as_deref())?;
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
    if all_resident && !complete {
        notes.push(format!(
            "the VRAM budget of {limit} bytes holds the layers but not every predictor, norm \
             and the output head; the FFN stays on the CPU"
        ));
    }
    Ok(())
}

fn shown(p: &Option<std::path::PathBuf>) -> String {
    p.as_ref()
        .map_or_else(|| "-".to_string(), |p| p.display().to_string())
}
