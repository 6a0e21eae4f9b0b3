//! The device-resident step: a batch evaluated with every layer the device holds running there.
//!
//! The batch runs in chunks of at most `t_max` tokens (the device's work buffers). For each
//! chunk the tokens' ids and positions go to the device in one copy; then layer by layer:
//!
//! - a **resident** layer ([`HybridLayer::attn`](crate::schedule::hybrid::HybridLayer::attn))
//!   is built by the builders of `layer.rs`, in order: the attention (norm, Q/K/V, RoPE, the K
//!   and V rows stored in the sequence's KV store, attention, `attn_output`), then one FFN:
//!   a dense FFN on the device (`-ngl`), the sparse FFN on the device (the predictor's scores
//!   and the hot neurons of the layer's slice; only when the CPU has neurons of its own to
//!   compute do the FFN's input and the scores come over in one copy, the CPU computes its
//!   share while the device computes the hot neurons, and the CPU's partial sum goes back to
//!   be added: per layer and token `2·n_embd + n_ff` values and one host wait), or, where the
//!   device holds no predictor (a small budget), the FFN on the CPU from the layer's hidden
//!   state, its output sent back;
//! - a layer the device does not hold runs on the CPU ([`Executor::host_layer`]), the hidden
//!   state copied across where the run changes sides.
//!
//! Every op goes into the chunk's [`Program`], which sends them as one program when the host
//! next needs the device and at the chunk's end. The chunk ends with one copy to the host: the
//! logits (or the hidden rows whose logits the CPU computes) and the device's per-layer counts
//! of computed neurons. With the whole model on the device a token costs its id and position
//! in and its logits out, and one host wait.

mod layer;

use std::sync::atomic::Ordering;
use std::time::Duration;

use powerinfer_gguf::conventions::OPT_POSITION_OFFSET;
use powerinfer_kernels_cpu::MatMul;

use super::batch::{EvalOptions, EvalOutput, Segment};
use super::ends::{embed, host_logits, logit_rows, outputs, Layout};
use super::step::{Buffers, Step};
use super::weights::ModelMats;
use super::Executor;
use crate::device::{Device, KvId, Op, Program, RowsOf, Span};
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{Ffn, Model};
use crate::profile::{DeviceTraffic, Laps, LayerSplit, OpKind};
use crate::schedule::balance::{Balance, Measured, DECODE_MAX_TOKENS};
use crate::schedule::hybrid::{layer_spec, Hybrid, Work};

/// One evaluation on the device (see the [module docs](self)).
pub(crate) struct Run<'a> {
    pub(crate) exec: &'a Executor,
    pub(crate) h: &'a Hybrid,
    pub(crate) model: &'a Model,
    pub(crate) mm: &'a MatMul<'a>,
    pub(crate) mats: &'a ModelMats<'a>,
    pub(crate) segments: &'a [Segment<'a>],
    pub(crate) lay: &'a Layout,
    /// Each segment's KV store on the device.
    pub(crate) stores: &'a [KvId],
}

/// A segment's tokens inside a chunk.
struct Part {
    seq: SeqId,
    kv: KvId,
    /// First token in the chunk.
    at: usize,
    /// Tokens.
    n: usize,
}

/// Tokens `start .. start + t` of the batch.
struct Chunk {
    start: usize,
    t: usize,
    parts: Vec<Part>,
}

/// What the CPU's share of a layer's FFN did in a chunk, for the balancer.
struct CpuShare {
    time: Duration,
    active: u64,
    scores: Vec<f32>,
}

/// What a chunk's layers leave for its end: per layer whether the device counted its
/// computed neurons (and timed them), and what the CPU's share did.
struct Tally {
    counted: Vec<bool>,
    shares: Vec<Option<CpuShare>>,
}

/// Where a chunk's hidden state is between layers.
enum Hidden {
    /// In the device's residual buffer.
    Device,
    /// In this host buffer.
    Host(Vec<f32>),
}

impl Run<'_> {
    /// Evaluates the batch; after an error the sequences are back at their positions.
    pub(crate) fn eval(
        &self,
        cache: &mut KvCache,
        opts: EvalOptions<'_>,
    ) -> Result<Vec<EvalOutput>> {
        let start: Vec<usize> = self
            .segments
            .iter()
            .map(|sg| cache.pos(sg.seq))
            .collect::<Result<_>>()?;
        let r = self.eval_chunks(cache, opts);
        if r.is_err() {
            for (sg, &p) in self.segments.iter().zip(&start) {
                let _ = cache.truncate(sg.seq, p);
            }
        }
        r
    }

    fn dev(&self) -> &dyn Device {
        self.h.device.as_ref()
    }

    fn chunks(&self, t_max: usize) -> Vec<Chunk> {
        let mut chunks = Vec::new();
        let mut cur = Chunk {
            start: 0,
            t: 0,
            parts: Vec::new(),
        };
        for (i, sg) in self.segments.iter().enumerate() {
            let mut off = 0;
            while off < sg.tokens.len() {
                let n = (t_max - cur.t).min(sg.tokens.len() - off);
                cur.parts.push(Part {
                    seq: sg.seq,
                    kv: self.stores[i],
                    at: cur.t,
                    n,
                });
                cur.t += n;
                off += n;
                if cur.t == t_max {
                    let next = cur.start + cur.t;
                    chunks.push(std::mem::replace(
                        &mut cur,
                        Chunk {
                            start: next,
                            t: 0,
                            parts: Vec::new(),
                        },
                    ));
                }
            }
        }
        if cur.t > 0 {
            chunks.push(cur);
        }
        chunks
    }

    fn eval_chunks(&self, cache: &mut KvCache, opts: EvalOptions<'_>) -> Result<Vec<EvalOutput>> {
        let (model, h) = (self.model, self.h);
        let work = (h.work.as_ref())
            .ok_or_else(|| EngineError::Device("the device has no work buffers".into()))?;
        let t_all = self.lay.tokens.len();
        let EvalOptions {
            logits: which,
            mut profile,
            ..
        } = opts;
        let rows_all = logit_rows(which, self.segments, &self.lay.starts, t_all);
        let nv = model.hparams.n_vocab;
        let mut logits = vec![0f32; rows_all.len() * nv];
        let mut density = vec![0f32; t_all];
        let before = self.dev().traffic();
        let began = self.dev().now();
        Laps::new(profile.as_deref_mut()).eval(t_all);
        let mut bufs = Buffers::default();
        let mut balance = h.balance.lock().unwrap_or_else(|e| e.into_inner());
        let mut row = 0;
        for c in self.chunks(work.t_max) {
            let ids = &self.lay.tokens[c.start..c.start + c.t];
            let positions = &self.lay.positions[c.start..c.start + c.t];
            let pos32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
            self.dev().set_step(ids, &pos32)?;
            let segs: Vec<Segment<'_>> = (c.parts.iter())
                .map(|p| Segment {
                    seq: p.seq,
                    tokens: &ids[p.at..p.at + p.n],
                })
                .collect();
            let starts = c.parts.iter().map(|p| p.at).collect();
            let opts = self.exec.options();
            let mut step = Step::new(model, self.mm, opts, c.t, positions.to_vec(), &segs, starts);
            step.laps = Laps::new(profile.as_deref_mut());
            step.buf = bufs;
            // The chunk's rows whose logits are returned.
            let first = row;
            while row < rows_all.len() && rows_all[row] < c.start + c.t {
                row += 1;
            }
            let rows: Vec<usize> = rows_all[first..row].iter().map(|r| r - c.start).collect();
            let out = &mut logits[first * nv..row * nv];
            let r = self.chunk(&mut step, cache, &c, work, &rows, out, &mut balance);
            for (d, s) in density[c.start..c.start + c.t]
                .iter_mut()
                .zip(&step.density)
            {
                *d += s;
            }
            bufs = std::mem::take(&mut step.buf);
            drop(step);
            r?;
            for p in &c.parts {
                cache.advance(p.seq, p.n)?;
            }
        }
        let took = self.dev().now().saturating_sub(began);
        h.tokens.fetch_add(t_all as u64, Ordering::Relaxed);
        h.eval_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        if self.segments.iter().all(|sg| sg.tokens.len() == 1) {
            h.decode.0.fetch_add(t_all as u64, Ordering::Relaxed);
            (h.decode.1).fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        }
        let traffic = self.dev().traffic() - before;
        Laps::new(profile).traffic(DeviceTraffic::new(
            traffic.launches,
            traffic.waits,
            traffic.link_bytes,
            took,
        ));
        let n_layer = model.layers.len().max(1) as f32;
        density.iter_mut().for_each(|d| *d /= n_layer);
        Ok(outputs(
            which,
            self.segments,
            &self.lay.starts,
            nv,
            &logits,
            &density,
        ))
    }

    /// One chunk through every layer; the logits of `rows` (chunk tokens) into `out`.
    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &self,
        step: &mut Step<'_>,
        cache: &mut KvCache,
        c: &Chunk,
        w: &Work,
        rows: &[usize],
        out: &mut [f32],
        balance: &mut Balance,
    ) -> Result<()> {
        let (model, h) = (self.model, self.h);
        let (t, ne, nl) = (c.t, model.hparams.n_embd, model.layers.len());
        let x = w.x.span(0, t * ne);
        let mut prog = Program::default();
        // Every layer's neuron counts, zeroed in the chunk's first program when the hot FFNs
        // add to them (one token of a gated FFN: the fused products count).
        let gated =
            (model.layers.iter()).any(|l| matches!(l.ffn, Ffn::Sparse { gate: Some(_), .. }));
        let mut zero_counts = (gated && t == 1).then_some(Op::Zero {
            y: w.out.span(0, nl * t),
        });
        let mut hidden = self.embeddings(step, c, w, &mut prog)?;
        if matches!(hidden, Hidden::Device) {
            prog.extend(zero_counts.take());
        }
        step.laps.lap(OpKind::Other, || 0);
        let mut tally = Tally {
            counted: vec![false; nl],
            shares: (0..nl).map(|_| None).collect(),
        };
        for l in 0..nl {
            if h.layers[l].attn.is_some() {
                if let Hidden::Host(host_x) = &hidden {
                    prog.write(self.dev(), x, host_x)?;
                    hidden = Hidden::Device;
                }
                prog.extend(zero_counts.take());
                let mut lb = layer::LayerBuild {
                    run: self,
                    c,
                    w,
                    l,
                    step: &mut *step,
                    prog: &mut prog,
                };
                lb.build(balance, &mut tally)?;
            } else {
                if let Hidden::Device = hidden {
                    hidden = Hidden::Host(self.read_back(step, &mut prog, x)?);
                }
                let Hidden::Host(host_x) = &mut hidden else {
                    unreachable!("the hidden state was just read back")
                };
                self.exec
                    .host_layer(step, cache, model, self.mats, l, host_x)?;
            }
        }
        let counts = self.finish(step, w, t, hidden, &tally, rows, out, &mut prog)?;
        self.tally(step, t, &counts, tally, balance)
    }

    /// The chunk's embeddings: on the device when it runs the first layer and holds the tables
    /// (ops queued in `prog`), else on the host.
    fn embeddings(
        &self,
        step: &Step<'_>,
        c: &Chunk,
        w: &Work,
        prog: &mut Program,
    ) -> Result<Hidden> {
        let (t, ne) = (c.t, self.model.hparams.n_embd);
        let tokens = &self.lay.tokens[c.start..c.start + t];
        let first_resident = self.h.layers.first().and_then(|l| l.attn.as_ref());
        let (Some(e), Some(_)) = (&self.h.embed, first_resident) else {
            let mut host_x = vec![0f32; t * ne];
            embed(self.model, tokens, &step.positions, &mut host_x)?;
            return Ok(Hidden::Host(host_x));
        };
        let x = w.x.span(0, t * ne);
        check_rows(self.model, tokens, &step.positions)?;
        prog.push(Op::GetRows {
            m: e.tok,
            rows: RowsOf::Ids,
            from: 0,
            n: t,
            y: x,
        });
        if let Some(pe) = e.pos {
            let scratch = w.acur.span(0, t * ne);
            prog.push(Op::GetRows {
                m: pe,
                rows: RowsOf::Positions(OPT_POSITION_OFFSET),
                from: 0,
                n: t,
                y: scratch,
            });
            prog.push(Op::Add { y: x, x: scratch });
        }
        Ok(Hidden::Device)
    }

    /// Sends what `prog` holds and reads the hidden state `x` back to the host.
    fn read_back(&self, step: &mut Step<'_>, prog: &mut Program, x: Span) -> Result<Vec<f32>> {
        let r = prog.read(self.dev(), x)?;
        step.laps.lap(OpKind::Device, || 0);
        let mut host_x = vec![0f32; x.len];
        self.dev().wait(r, &mut host_x)?;
        step.laps.lap(OpKind::DeviceWait, || 0);
        Ok(host_x)
    }

    /// The chunk's end: the output head where the hidden state is (on the device when it holds
    /// the head), the logits of `rows` into `out`, and in the same copy back the device's
    /// per-layer counts of computed neurons, which it returns (`n_layer × t`).
    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        step: &mut Step<'_>,
        w: &Work,
        t: usize,
        hidden: Hidden,
        tally: &Tally,
        rows: &[usize],
        out: &mut [f32],
        prog: &mut Program,
    ) -> Result<Vec<f32>> {
        let hp = &self.model.hparams;
        let (ne, nv, nl) = (hp.n_embd, hp.n_vocab, self.model.layers.len());
        let counts_len = nl * t;
        let n_out = rows.len();
        let mut counts = vec![0f32; counts_len];
        let dev = self.dev();
        let host_x = match hidden {
            Hidden::Host(host_x) => host_x,
            Hidden::Device => {
                let x = w.x.span(0, t * ne);
                let head = self.h.output.as_ref().filter(|_| n_out > 0);
                let dst = if head.is_some() { w.acur } else { w.out };
                let at = if head.is_some() { 0 } else { counts_len };
                // The rows whose logits are returned, picked into `dst`.
                if n_out == t {
                    prog.push(Op::Copy {
                        x,
                        y: dst.span(at, t * ne),
                    });
                } else {
                    for (i, &r) in rows.iter().enumerate() {
                        prog.push(Op::Copy {
                            x: x.part(r * ne, ne),
                            y: dst.span(at + i * ne, ne),
                        });
                    }
                }
                let width = match head {
                    Some(o) => {
                        let nx = w.heads.span(0, n_out * ne);
                        prog.push(Op::Norm {
                            add: None,
                            x: w.acur.span(0, n_out * ne),
                            w: o.norm.w,
                            b: o.norm.b,
                            eps: hp.rms_eps,
                            y: nx,
                        });
                        prog.push(Op::MatMul {
                            m: o.head,
                            x: nx,
                            y: w.out.span(counts_len, n_out * nv),
                            t: n_out,
                        });
                        nv
                    }
                    None => ne,
                };
                let mut got = vec![0f32; counts_len + n_out * width];
                let r = prog.read(dev, w.out.span(0, got.len()))?;
                step.laps.lap(OpKind::Device, || 0);
                dev.wait(r, &mut got)?;
                step.laps.lap(OpKind::DeviceWait, || 0);
                counts.copy_from_slice(&got[..counts_len]);
                if head.is_some() {
                    out.copy_from_slice(&got[counts_len..]);
                } else {
                    let all: Vec<usize> = (0..n_out).collect();
                    let l = host_logits(step, self.model, self.mats, &got[counts_len..], &all)?;
                    out.copy_from_slice(&l);
                }
                return Ok(counts);
            }
        };
        prog.flush(dev)?;
        step.laps.lap(OpKind::Device, || 0);
        if tally.counted.iter().any(|&c| c) {
            let r = prog.read(dev, w.out.span(0, counts_len))?;
            dev.wait(r, &mut counts)?;
            step.laps.lap(OpKind::DeviceWait, || 0);
        }
        let l = host_logits(step, self.model, self.mats, &host_x, rows)?;
        out.copy_from_slice(&l);
        Ok(counts)
    }

    /// The device's counts into the tokens' densities and the engine's counters, and each
    /// layer's measurements to the balancer.
    fn tally(
        &self,
        step: &mut Step<'_>,
        t: usize,
        counts: &[f32],
        mut tally: Tally,
        balance: &mut Balance,
    ) -> Result<()> {
        let nff = self.model.hparams.n_ff;
        let (mut dev_total, mut cpu_total) = (0u64, 0u64);
        for l in 0..self.model.layers.len() {
            let dev_active: u64 = if tally.counted[l] {
                let c = &counts[l * t..(l + 1) * t];
                for (d, &n) in step.density.iter_mut().zip(c) {
                    *d += n / nff as f32;
                }
                c.iter().map(|&n| n as u64).sum()
            } else {
                0
            };
            dev_total += dev_active;
            if let Some(share) = tally.shares[l].take() {
                cpu_total += share.active;
                let timed = tally.counted[l].then_some(dev_active);
                self.measured(step, (l, t), share, timed, balance)?;
            }
        }
        self.h.counters.0.fetch_add(dev_total, Ordering::Relaxed);
        self.h.counters.1.fetch_add(cpu_total, Ordering::Relaxed);
        step.laps.lap(OpKind::Other, || 0);
        Ok(())
    }

    /// Feeds layer `l`'s measurements of a chunk of `t` tokens to the balancer (`counted`: the
    /// neurons the device computed, when it counted them and timed the layer); moves the
    /// device's enabled set and its hot-neuron cache as it decides.
    fn measured(
        &self,
        step: &mut Step<'_>,
        (l, t): (usize, usize),
        share: CpuShare,
        counted: Option<u64>,
        balance: &mut Balance,
    ) -> Result<()> {
        let dev_active = counted.unwrap_or(0);
        let dev = self.dev();
        let opts = balance.options.clone();
        let Some(state) = balance.layers.get_mut(l).and_then(Option::as_mut) else {
            return Ok(());
        };
        let device_time = match counted {
            Some(_) => dev.elapsed(2 * l, 2 * l + 1)?,
            None => Duration::ZERO,
        };
        step.laps.split(
            l,
            LayerSplit {
                calls: 1,
                tokens: t as u64,
                cpu: share.time,
                wait: Duration::ZERO,
                device: device_time,
                transfer: Duration::ZERO,
                active_cpu: share.active,
                active_device: dev_active,
            },
        );
        let decode = t <= DECODE_MAX_TOKENS;
        if !share.scores.is_empty() {
            state.observe(&share.scores, t, self.exec.options().threshold);
        }
        let moved = state.measured(
            Measured {
                t,
                cpu: share.time,
                device: device_time,
                active_cpu: share.active,
                active_device: dev_active,
            },
            &opts,
            decode,
        );
        if moved != 0 {
            dev.set_enabled(state.hot, state.enabled_slots().as_deref())?;
        }
        if decode {
            if let Some(spec) = layer_spec(self.model, l)? {
                state.maybe_migrate(dev, &spec, t, &opts)?;
            }
        }
        Ok(())
    }
}

/// Token ids past the vocabulary, and positions past a learned position table, are the
/// caller's errors, as on the CPU.
fn check_rows(model: &Model, tokens: &[u32], positions: &[usize]) -> Result<()> {
    let n_vocab = model.tok_embd.rows;
    if let Some(&id) = tokens.iter().find(|&&t| t as usize >= n_vocab) {
        return Err(EngineError::InvalidToken { id, n_vocab });
    }
    if let Some(pe) = &model.pos_embd {
        if let Some(&pos) = positions
            .iter()
            .find(|&&p| p + OPT_POSITION_OFFSET >= pe.rows)
        {
            return Err(EngineError::ContextFull {
                needed: pos + 1,
                ctx_len: pe.rows - OPT_POSITION_OFFSET,
            });
        }
    }
    Ok(())
}
