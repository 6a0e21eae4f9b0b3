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

mod device_step;
pub(crate) mod ffn;
pub(crate) mod fused;
pub(crate) mod layer;
pub(crate) mod step;
pub(crate) mod weights;

use powerinfer_kernels_cpu::ops::activation::add;
use powerinfer_kernels_cpu::{AxpyCoefficients, Backend, MatMul, ThreadPool};

use crate::device::DeviceReport;
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{Arch, Model, OPT_POSITION_OFFSET};
use crate::observer::FfnObserver;
use crate::profile::{Laps, Op, OpProfile};
use crate::schedule::placement::Hybrid;
use crate::schedule::BalanceReport;

use fused::FusedSplit;
use step::{add_par, norm, LayerRun, Step};
use weights::{product, ModelMats, Repacked};

/// A block of consecutive new tokens of one sequence: one entry of a [`Batch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment<'a> {
    /// The sequence the tokens continue.
    pub seq: SeqId,
    /// The tokens, evaluated as the next positions of `seq`.
    pub tokens: &'a [u32],
}

/// The work of one evaluation: new tokens of one or several sequences (prompt blocks and
/// decode tokens side by side), each weight read once for all of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch<'a> {
    segments: Vec<Segment<'a>>,
}

impl<'a> Batch<'a> {
    /// An empty batch.
    pub fn new() -> Batch<'a> {
        Batch::default()
    }

    /// A batch of `tokens` of one sequence.
    pub fn one(seq: SeqId, tokens: &'a [u32]) -> Batch<'a> {
        Batch {
            segments: vec![Segment { seq, tokens }],
        }
    }

    /// One decode step: one token of each listed sequence.
    pub fn decode(step: &'a [(SeqId, u32)]) -> Batch<'a> {
        Batch {
            segments: step
                .iter()
                .map(|(seq, tok)| Segment {
                    seq: *seq,
                    tokens: std::slice::from_ref(tok),
                })
                .collect(),
        }
    }

    /// Adds `tokens` of sequence `seq`.
    pub fn push(&mut self, seq: SeqId, tokens: &'a [u32]) -> &mut Self {
        self.segments.push(Segment { seq, tokens });
        self
    }

    /// The segments, in order.
    pub fn segments(&self) -> &[Segment<'a>] {
        &self.segments
    }

    /// Tokens in all segments.
    pub fn n_tokens(&self) -> usize {
        self.segments.iter().map(|s| s.tokens.len()).sum()
    }
}

/// Which logits an evaluation returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Logits {
    /// Each segment's last token's (what sampling needs).
    #[default]
    Last,
    /// Every token's (scoring a text, perplexity).
    All,
    /// None: the output head is skipped (a prompt's blocks before its last, whose logits
    /// nobody reads); every [`EvalOutput::logits`] is empty.
    None,
}

/// How one evaluation runs and what it reports ([`Engine::eval`](crate::Engine::eval)).
#[derive(Default)]
#[non_exhaustive]
pub struct EvalOptions<'a> {
    /// Which logits to return.
    pub logits: Logits,
    /// Sees every layer's FFN (which is then computed densely): profiling activations,
    /// training and evaluating predictors.
    pub observer: Option<&'a mut dyn FfnObserver>,
    /// Receives each operation's time, calls and bytes read.
    pub profile: Option<&'a mut OpProfile>,
}

impl<'a> EvalOptions<'a> {
    /// The defaults: the last token's logits, nothing observed or profiled.
    pub fn new() -> EvalOptions<'a> {
        EvalOptions::default()
    }

    /// Returns every token's logits.
    pub fn all_logits(mut self) -> Self {
        self.logits = Logits::All;
        self
    }

    /// Returns no logits and skips the output head ([`Logits::None`]).
    pub fn no_logits(mut self) -> Self {
        self.logits = Logits::None;
        self
    }

    /// Reports every layer's FFN to `observer` (computed densely).
    pub fn observe(mut self, observer: &'a mut dyn FfnObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Adds each operation's time, calls and bytes read to `profile`.
    pub fn profile(mut self, profile: &'a mut OpProfile) -> Self {
        self.profile = Some(profile);
        self
    }
}

impl std::fmt::Debug for EvalOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EvalOptions")
            .field("logits", &self.logits)
            .field("observer", &self.observer.is_some())
            .field("profile", &self.profile.is_some())
            .finish()
    }
}

/// The result of evaluating one segment.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct EvalOutput {
    /// Logits, `n_vocab` per row: one row per token of the segment, or only the last token's.
    pub logits: Vec<f32>,
    /// Per token, the mean over layers of the share of FFN neurons computed (1 for dense FFNs).
    pub density: Vec<f32>,
}

/// How the executor computes the FFN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ExecOptions {
    /// Predictor threshold θ (a neuron is active when its score is ≥ θ).
    pub(crate) threshold: f32,
    /// Compute every neuron of a PowerInfer file (ignore the predictor).
    pub(crate) dense: bool,
    /// Put a token's several row-parallel products in one thread-pool dispatch.
    pub(crate) fuse: bool,
    /// How the sparse axpy multiplies the FFN's hidden values into the down rows.
    pub(crate) axpy: AxpyCoefficients,
}

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
    #[cfg(test)]
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
        step.laps.lap(Op::Other, || 0);
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
        step.laps.lap(Op::Other, || 0);
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
            step.laps.lap(Op::Other, || 0);
            let mut cur = std::mem::take(&mut step.buf.cur);
            if let Some(n) = &layer.ffn_norm {
                norm(mm, x, n, model.hparams.rms_eps, &mut cur)?;
                step.laps.lap(Op::Norm, || 0);
            }
            let mut out = attn;
            ffn::forward(step, &run, x, &cur, &mut out)?;
            step.buf.cur = cur;
            add_par(mm, x, &out)?;
            step.buf.tmp = out;
        }
        step.laps.lap(Op::Other, || 0);
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

/// Where a batch's tokens are: each segment's first token, each token's position, the tokens.
pub(crate) struct Layout {
    pub(crate) starts: Vec<usize>,
    pub(crate) positions: Vec<usize>,
    pub(crate) tokens: Vec<u32>,
}

/// Checks `segments` against `cache` (no sequence twice, each known and fitting its context)
/// and lays them out.
fn layout(cache: &KvCache, segments: &[Segment<'_>]) -> Result<Layout> {
    let mut lay = Layout {
        starts: Vec::with_capacity(segments.len()),
        positions: Vec::new(),
        tokens: Vec::new(),
    };
    for (i, sg) in segments.iter().enumerate() {
        if segments[..i].iter().any(|o| o.seq == sg.seq) {
            return Err(EngineError::Invalid(format!(
                "sequence {} appears twice in one batch",
                sg.seq
            )));
        }
        cache.reserve(sg.seq, sg.tokens.len())?;
        let p0 = cache.pos(sg.seq)?;
        lay.starts.push(lay.tokens.len());
        lay.positions.extend(p0..p0 + sg.tokens.len());
        lay.tokens.extend_from_slice(sg.tokens);
    }
    Ok(lay)
}

/// The rows (batch token indices) whose logits an evaluation returns: every token, each
/// segment's last, or none.
pub(crate) fn logit_rows(
    which: Logits,
    segments: &[Segment<'_>],
    starts: &[usize],
    t: usize,
) -> Vec<usize> {
    match which {
        Logits::All => (0..t).collect(),
        Logits::Last => segments
            .iter()
            .zip(starts)
            .filter(|(sg, _)| !sg.tokens.is_empty())
            .map(|(sg, &s0)| s0 + sg.tokens.len() - 1)
            .collect(),
        Logits::None => Vec::new(),
    }
}

/// The logits of `rows` of the hidden states `x` on the CPU: output norm, then the head.
pub(crate) fn host_logits(
    step: &mut Step<'_>,
    model: &Model,
    mats: &ModelMats<'_>,
    x: &[f32],
    rows: &[usize],
) -> Result<Vec<f32>> {
    let hp = &model.hparams;
    let (ne, nv, mm) = (hp.n_embd, hp.n_vocab, step.mm);
    let n_out = rows.len();
    let mut logits = vec![0f32; n_out * nv];
    if n_out == 0 {
        return Ok(logits);
    }
    let mut normed = vec![0f32; n_out * ne];
    if n_out * ne == x.len() {
        norm(mm, x, &model.output_norm, hp.rms_eps, &mut normed)?;
    } else {
        let mut picked = vec![0f32; n_out * ne];
        for (dst, &r) in picked.chunks_exact_mut(ne).zip(rows) {
            dst.copy_from_slice(&x[r * ne..][..ne]);
        }
        norm(mm, &picked, &model.output_norm, hp.rms_eps, &mut normed)?;
    }
    step.laps.lap(Op::Norm, || 0);
    product(mm, &mats.output, &normed, n_out, &mut logits)?;
    step.laps.lap(Op::OutputHead, || mats.output.bytes());
    Ok(logits)
}

/// One [`EvalOutput`] per segment from the logits of the rows [`logit_rows`] chose and every
/// token's density.
pub(crate) fn outputs(
    which: Logits,
    segments: &[Segment<'_>],
    starts: &[usize],
    nv: usize,
    logits: &[f32],
    density: &[f32],
) -> Vec<EvalOutput> {
    let mut outs = Vec::with_capacity(segments.len());
    let mut row = 0;
    for (sg, &s0) in segments.iter().zip(starts) {
        let n = sg.tokens.len();
        if n == 0 {
            outs.push(EvalOutput::empty());
            continue;
        }
        let k = match which {
            Logits::All => n,
            Logits::Last => 1,
            Logits::None => 0,
        };
        outs.push(EvalOutput {
            logits: logits[row * nv..(row + k) * nv].to_vec(),
            density: density[s0..s0 + n].to_vec(),
        });
        row += k;
    }
    outs
}

impl EvalOutput {
    fn empty() -> EvalOutput {
        EvalOutput {
            logits: Vec::new(),
            density: Vec::new(),
        }
    }
}

/// The embeddings of `tokens` into `x` (`n_embd` each): rows of `token_embd`, plus, for `opt`,
/// the learned position embedding of each token's position.
pub(crate) fn embed(
    model: &Model,
    tokens: &[u32],
    positions: &[usize],
    x: &mut [f32],
) -> Result<()> {
    let ne = model.hparams.n_embd;
    let file = model.file();
    let row_of = |t: &crate::model::TensorRef, row: usize, out: &mut [f32]| -> Result<()> {
        let data = file.data_of(&t.info);
        let row_bytes = data.len() / t.rows;
        let bytes = &data[row * row_bytes..][..row_bytes];
        powerinfer_gguf::quants::dequantize(t.ty, bytes, out)?;
        Ok(())
    };
    let te = &model.tok_embd;
    for (out, &tok) in x.chunks_exact_mut(ne).zip(tokens) {
        if tok as usize >= te.rows {
            return Err(EngineError::InvalidToken {
                id: tok,
                n_vocab: te.rows,
            });
        }
        row_of(te, tok as usize, out)?;
    }
    if let Some(pe) = &model.pos_embd {
        let mut scratch = vec![0f32; ne];
        for (out, &pos) in x.chunks_exact_mut(ne).zip(positions) {
            let row = pos + OPT_POSITION_OFFSET;
            if row >= pe.rows {
                return Err(EngineError::ContextFull {
                    needed: pos + 1,
                    ctx_len: pe.rows - OPT_POSITION_OFFSET,
                });
            }
            row_of(pe, row, &mut scratch)?;
            add(out, &scratch)?;
        }
    }
    Ok(())
}
