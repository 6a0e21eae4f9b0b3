//! The executor: runs a batch of tokens through a model, layer by layer, on the CPU kernels.
//!
//! [`Executor`] holds everything about *how* a model is run (the predictor threshold, dense
//! or sparse FFN, the repacked copies, the learned thread splits of the sparse FFN), while
//! [`Model`] holds only what the file says. A decode step walks:
//!
//! 1. [`Executor::eval`] (this file): embeddings, then each layer, then the output head;
//! 2. [`layer::attention`] (with the shared state of [`step::Step`]): norm, Q/K/V, RoPE, KV cache, attention, `attn_output`;
//! 3. [`ffn::forward`]: the layer's FFN, where `ffn::sparse` divides a sparse layer's
//!    neurons between the devices;
//! 4. back here for the residual and the next layer.

mod batch;
mod device_step;
mod ends;
pub(crate) mod ffn;
pub(crate) mod fused;
pub(crate) mod layer;
pub(crate) mod step;
pub(crate) mod weights;

use powerinfer_kernels_cpu::{Backend, MatMul, ThreadPool};

pub use batch::{Batch, EvalOptions, EvalOutput, Logits, Segment};

use crate::device::DeviceReport;
use crate::error::Result;
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{Arch, Model};
use crate::observer::FfnObserver;
use crate::profile::{Laps, OpKind};
use crate::schedule::hybrid::Hybrid;
use crate::schedule::BalanceReport;
use ends::{embed, host_logits, layout, logit_rows, outputs, Layout};
use fused::FusedSplit;
pub(crate) use step::ExecOptions;
use step::{add_par, norm, LayerRun, Step};
use weights::{ModelMats, Repacked};

/// Execution state of a model: options, repacked copies, learned splits, and the device
/// with what it holds.
pub(crate) struct Executor {
    opts: ExecOptions,
    backend: Backend,
    repacked: Repacked,
    /// Per layer: where the one-token sparse FFN cuts its neurons among threads.
    splits: Vec<FusedSplit>,
    hybrid: Option<Hybrid>,
}

impl Executor {
    /// An executor for `model` on `mm`'s backend; `repack`: make repacked copies of the dense
    /// Q4_0 matrices of one-token products; `hybrid`: a device and what it holds.
    pub(crate) fn new(
        model: &Model,
        mm: &MatMul<'_>,
        opts: ExecOptions,
        repack: bool,
        hybrid: Option<Hybrid>,
    ) -> Executor {
        Executor {
            opts,
            backend: mm.backend(),
            repacked: Repacked::new(model, mm, repack),
            splits: model.layers.iter().map(|_| FusedSplit::default()).collect(),
            hybrid,
        }
    }

    /// What the device holds and did (`None` without a device).
    pub(crate) fn device_report(&self) -> Option<DeviceReport> {
        self.hybrid.as_ref().map(Hybrid::report)
    }

    /// The device and what it holds (tests).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn hybrid(&self) -> Option<&Hybrid> {
        self.hybrid.as_ref()
    }

    /// What the run-time scheduling did (`None` without a device).
    pub(crate) fn balance_report(&self) -> Option<BalanceReport> {
        self.hybrid
            .as_ref()
            .map(|h| h.balance.lock().unwrap_or_else(|e| e.into_inner()).report())
    }

    /// The options.
    pub(crate) fn options(&self) -> ExecOptions {
        self.opts
    }

    /// Makes every repacked copy now.
    pub(crate) fn repack_now(&self, model: &Model, pool: &ThreadPool) -> Result<()> {
        let mm = MatMul::with_backend(pool, self.backend)?.with_axpy(self.opts.axpy);
        let mats = ModelMats::new(model, &self.repacked)?;
        self.repacked.make_all(&mats, &mm);
        Ok(())
    }

    /// Bytes of repacked copies held.
    pub(crate) fn packed_bytes(&self) -> usize {
        self.repacked.bytes()
    }

    /// Evaluates `batch`: every weight product runs once over all its tokens, RoPE, the KV
    /// cache and attention are per sequence. Returns one [`EvalOutput`] per segment, in order.
    /// With a device that runs layers, the batch runs there ([`device_step`]) when every
    /// sequence gets a KV store on it; else (and with an observer) on the CPU, every row of
    /// the batch's sequences read back to the host first.
    ///
    /// A token's result equals that of evaluating its sequence alone up to rounding: for float
    /// weights the products of several tokens sum in another order than one token's; for
    /// quantized weights they are bit-identical.
    ///
    /// Errors: a sequence twice in the batch, an unknown sequence, or a segment that does not
    /// fit its context; nothing is evaluated then. After an error the cache may hold some of
    /// the batch's rows: the caller ([`Engine::eval`](crate::Engine::eval)) rolls them back.
    pub(crate) fn eval(
        &self,
        model: &Model,
        pool: &ThreadPool,
        cache: &mut KvCache,
        batch: &Batch<'_>,
        opts: EvalOptions<'_>,
    ) -> Result<Vec<EvalOutput>> {
        let segments = batch.segments();
        let lay = layout(cache, segments)?;
        if lay.tokens.is_empty() {
            return Ok(segments.iter().map(|_| EvalOutput::empty()).collect());
        }
        let mm = MatMul::with_backend(pool, self.backend)?.with_axpy(self.opts.axpy);
        let mats = ModelMats::new(model, &self.repacked)?;
        if let Some(h) = &self.hybrid {
            let seqs = segments.iter().map(|sg| sg.seq);
            if h.runs_layers() && opts.observer.is_none() && h.kv.fit(cache, seqs)? {
                let mut stores = Vec::with_capacity(segments.len());
                for sg in segments {
                    match h.kv.bind(h.device.as_ref(), cache, sg.seq)? {
                        Some(kv) => stores.push(kv),
                        None => break,
                    }
                }
                if stores.len() == segments.len() {
                    let run = device_step::Run {
                        exec: self,
                        h,
                        model,
                        mm: &mm,
                        mats: &mats,
                        segments,
                        lay: &lay,
                        stores: &stores,
                    };
                    return run.eval(cache, opts);
                }
            }
            // The CPU reads every row: what only the device holds comes back first.
            for sg in segments {
                h.kv.unbind(h.device.as_ref(), cache, sg.seq)?;
            }
        }
        self.eval_host(model, &mm, &mats, cache, segments, lay, opts)
    }

    /// [`Executor::eval`] on the CPU.
    #[allow(clippy::too_many_arguments)]
    fn eval_host(
        &self,
        model: &Model,
        mm: &MatMul<'_>,
        mats: &ModelMats<'_>,
        cache: &mut KvCache,
        segments: &[Segment<'_>],
        lay: Layout,
        opts: EvalOptions<'_>,
    ) -> Result<Vec<EvalOutput>> {
        let hp = &model.hparams;
        let t = lay.tokens.len();
        let EvalOptions {
            logits: which,
            observer,
            profile,
        } = opts;
        let mut balance = self
            .hybrid
            .as_ref()
            .map(|h| h.balance.lock().unwrap_or_else(|e| e.into_inner()));
        let mut step = Step::new(model, mm, self.opts, t, lay.positions, segments, lay.starts);
        step.laps = Laps::new(profile);
        step.observer = observer.map(|o| o as &mut dyn FfnObserver);
        step.mirror = self.hybrid.as_ref().and_then(|h| h.device.attention());
        step.balance = balance.as_deref_mut();
        step.laps.eval(t);

        let mut x = vec![0f32; t * hp.n_embd];
        embed(model, &lay.tokens, &step.positions, &mut x)?;
        step.laps.lap(OpKind::Other, || 0);
        for l in 0..model.layers.len() {
            self.host_layer(&mut step, cache, model, mats, l, &mut x)?;
        }
        for sg in segments {
            cache.advance(sg.seq, sg.tokens.len())?;
        }
        let rows = logit_rows(which, segments, &step.starts, t);
        let logits = host_logits(&mut step, model, mats, &x, &rows)?;
        let mut density = std::mem::take(&mut step.density);
        let n_layer = model.layers.len().max(1) as f32;
        density.iter_mut().for_each(|d| *d /= n_layer);
        let outs = outputs(which, segments, &step.starts, hp.n_vocab, &logits, &density);
        step.laps.lap(OpKind::Other, || 0);
        Ok(outs)
    }

    /// Layer `l` on the CPU over `step`'s tokens: attention, FFN and residual, `x` updated.
    pub(crate) fn host_layer(
        &self,
        step: &mut Step<'_>,
        cache: &mut KvCache,
        model: &Model,
        mats: &ModelMats<'_>,
        l: usize,
        x: &mut [f32],
    ) -> Result<()> {
        let (t, ne, mm) = (step.t, model.hparams.n_embd, step.mm);
        let layer = &model.layers[l];
        let run = LayerRun {
            index: l,
            layer,
            mats: &mats.layers[l],
            split: &self.splits[l],
        };
        let attn = layer::attention(step, cache, &run, x)?;
        if model.hparams.arch == Arch::Falcon {
            // Parallel block: the FFN reads attn_norm(x), the predictor the layer input x.
            let mut out = std::mem::take(&mut step.buf.ffn_out);
            out.resize(t * ne, 0.0);
            let cur = std::mem::take(&mut step.buf.cur);
            ffn::forward(step, &run, x, &cur, &mut out)?;
            step.buf.cur = cur;
            add_par(mm, &mut out, &attn)?;
            add_par(mm, x, &out)?;
            step.buf.ffn_out = out;
            step.buf.tmp = attn;
        } else {
            add_par(mm, x, &attn)?; // x = ffn_inp
            step.laps.lap(OpKind::Other, || 0);
            let mut cur = std::mem::take(&mut step.buf.cur);
            if let Some(n) = &layer.ffn_norm {
                norm(mm, x, n, model.hparams.rms_eps, &mut cur)?;
                step.laps.lap(OpKind::Norm, || 0);
            }
            let mut out = attn;
            ffn::forward(step, &run, x, &cur, &mut out)?;
            step.buf.cur = cur;
            add_par(mm, x, &out)?;
            step.buf.tmp = out;
        }
        step.laps.lap(OpKind::Other, || 0);
        Ok(())
    }

    /// A copy of sequence `src` of `cache` (see [`KvStores::fork`](crate::schedule::kv::KvStores::fork)).
    pub(crate) fn fork(&self, cache: &mut KvCache, src: SeqId) -> Result<SeqId> {
        match &self.hybrid {
            Some(h) => h.kv.fork(h.device.as_ref(), cache, src),
            None => cache.fork(src),
        }
    }

    /// Makes the host hold every KV row of `seq` (reading back what only the device holds).
    pub(crate) fn unbind(&self, cache: &mut KvCache, seq: SeqId) -> Result<()> {
        match &self.hybrid {
            Some(h) => h.kv.unbind(h.device.as_ref(), cache, seq),
            None => Ok(()),
        }
    }

    /// The splits of the one-token sparse FFN (the device step's CPU parts use them too).
    pub(crate) fn split(&self, l: usize) -> &FusedSplit {
        &self.splits[l]
    }
}
