//! The device-resident step: a batch evaluated with every layer the device holds running there.
//!
//! The batch runs in chunks of at most `t_max` tokens (the device's work buffers). For each
//! chunk the tokens' ids and positions go to the device in one copy; then layer by layer:
//!
//! - a **resident** layer ([`HybridLayer::attn`](crate::schedule::placement::HybridLayer::attn)) runs as one device program: norm, Q/K/V,
//!   RoPE, the K and V rows stored in the sequence's KV store, attention, `attn_output` and the
//!   residual, all on the device. Its FFN runs there too where the device holds the predictor
//!   and the FFN norm: the predictor's scores, the hot neurons of the layer's slice, the
//!   residual. Only when the CPU has neurons of its own to compute (the cold ones, or hot ones
//!   the balancer gave it) does the FFN's input and the scores come over in one copy, the
//!   CPU computes its share while the device computes the hot neurons, and the CPU's partial
//!   sum goes back to be added on the device: per layer and token `2·n_embd + n_ff` values and
//!   one host wait. Where the device holds no predictor (a small budget), the FFN runs on the
//!   CPU from the layer's hidden state and its output goes back;
//! - a layer the device does not hold runs on the CPU ([`Executor::host_layer`]), the hidden
//!   state copied across where the run changes sides.
//!
//! The chunk ends with one copy to the host: the logits (or the hidden rows whose logits the
//! CPU computes) and the device's per-layer counts of computed neurons. With the whole model
//! on the device a token costs its id and position in and its logits out, and one host wait.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use powerinfer_gguf::conventions::OPT_POSITION_OFFSET;
use powerinfer_kernels_cpu::MatMul;

use super::ffn;
use super::step::{norm, Buffers, LayerRun, Step};
use super::weights::ModelMats;
use super::Segment;
use super::{embed, host_logits, logit_rows, outputs, EvalOptions, EvalOutput, Executor, Layout};
use crate::device::{
    AttentionOp, BufId, Device, HotFfnOp, KvId, Op as DevOp, PredictorOp, RopeOp, RowsOf,
};
use crate::error::{EngineError, Result};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::{Arch, Ffn, Model};
use crate::profile::{DeviceTraffic, Laps, LayerSplit, Op};
use crate::schedule::balance::{Balance, Measured, DECODE_MAX_TOKENS};
use crate::schedule::placement::{layer_spec, Hybrid, Work};

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
        let hp = &model.hparams;
        let dev = h.device.as_ref();
        let work = h
            .work
            .as_ref()
            .ok_or_else(|| EngineError::Device("the device has no work buffers".into()))?;
        let t_all = self.lay.tokens.len();
        let EvalOptions {
            logits: which,
            mut profile,
            ..
        } = opts;
        let rows_all = logit_rows(which, self.segments, &self.lay.starts, t_all);
        let nv = hp.n_vocab;
        let mut logits = vec![0f32; rows_all.len() * nv];
        let mut density = vec![0f32; t_all];
        let before = dev.traffic();
        Laps::new(profile.as_deref_mut()).eval(t_all);
        let mut bufs = Buffers::default();
        let mut balance = h.balance.lock().unwrap_or_else(|e| e.into_inner());
        let mut row = 0;
        for c in self.chunks(work.t_max) {
            let ids = &self.lay.tokens[c.start..c.start + c.t];
            let positions = &self.lay.positions[c.start..c.start + c.t];
            let pos32: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
            dev.set_step(ids, &pos32)?;
            let segs: Vec<Segment<'_>> = c
                .parts
                .iter()
                .map(|p| Segment {
                    seq: p.seq,
                    tokens: &ids[p.at..p.at + p.n],
                })
                .collect();
            let starts = c.parts.iter().map(|p| p.at).collect();
            let mut step = Step::new(
                model,
                self.mm,
                self.exec.options(),
                c.t,
                positions.to_vec(),
                &segs,
                starts,
            );
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
        h.tokens.fetch_add(t_all as u64, Ordering::Relaxed);
        let traffic = dev.traffic() - before;
        Laps::new(profile).traffic(DeviceTraffic::new(
            traffic.launches,
            traffic.waits,
            traffic.link_bytes,
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
        let hp = &model.hparams;
        let dev = h.device.as_ref();
        let (t, ne, nl) = (c.t, hp.n_embd, model.layers.len());
        let x = w.x.span(0, t * ne);
        let mut host_x = Vec::new();
        // Every layer's neuron counts, zeroed in the chunk's first program when the hot FFNs
        // add to them (one token of a gated FFN: the fused products count).
        let zero_counts = DevOp::Zero {
            y: w.out.span(0, nl * t),
        };
        let gated =
            (model.layers.iter()).any(|l| matches!(l.ffn, Ffn::Sparse { gate: Some(_), .. }));
        let mut counts_zeroed = !(gated && t == 1);
        // The device's ops not sent yet (see `flush`).
        let mut pending: Vec<DevOp> = Vec::new();
        // The embeddings: on the device when it runs the first layer and holds the tables.
        let mut on_device = match (&h.embed, h.layers.first().and_then(|l| l.attn.as_ref())) {
            (Some(e), Some(_)) => {
                let mut ops = vec![DevOp::GetRows {
                    m: e.tok,
                    rows: RowsOf::Ids,
                    from: 0,
                    n: t,
                    y: x,
                }];
                if let Some(pe) = e.pos {
                    let scratch = w.acur.span(0, t * ne);
                    ops.push(DevOp::GetRows {
                        m: pe,
                        rows: RowsOf::Positions(OPT_POSITION_OFFSET),
                        from: 0,
                        n: t,
                        y: scratch,
                    });
                    ops.push(DevOp::Add { y: x, x: scratch });
                }
                check_rows(
                    model,
                    &self.lay.tokens[c.start..c.start + t],
                    &step.positions,
                )?;
                if !counts_zeroed {
                    ops.push(zero_counts.clone());
                    counts_zeroed = true;
                }
                pending.extend(ops);
                true
            }
            _ => {
                host_x.resize(t * ne, 0.0);
                embed(
                    model,
                    &self.lay.tokens[c.start..c.start + t],
                    &step.positions,
                    &mut host_x,
                )?;
                false
            }
        };
        step.laps.lap(Op::Other, || 0);
        let mut counted = vec![false; nl];
        let mut shares: Vec<Option<CpuShare>> = (0..nl).map(|_| None).collect();
        for l in 0..nl {
            if h.layers[l].attn.is_some() {
                if !on_device {
                    flush(dev, &mut pending)?;
                    dev.write(x, &host_x)?;
                    on_device = true;
                }
                if !counts_zeroed {
                    pending.push(zero_counts.clone());
                    counts_zeroed = true;
                }
                self.device_layer(
                    step,
                    c,
                    w,
                    l,
                    balance,
                    &mut counted,
                    &mut shares,
                    &mut pending,
                )?;
            } else {
                if on_device {
                    flush(dev, &mut pending)?;
                    let r = dev.read(x)?;
                    step.laps.lap(Op::Device, || 0);
                    host_x.resize(t * ne, 0.0);
                    dev.wait(r, &mut host_x)?;
                    step.laps.lap(Op::DeviceWait, || 0);
                    on_device = false;
                }
                self.exec
                    .host_layer(step, cache, model, self.mats, l, &mut host_x)?;
            }
        }
        // The chunk's one copy back: counts, then logits or hidden rows.
        let counts_len = nl * t;
        let n_out = rows.len();
        let nv = hp.n_vocab;
        let mut counts = vec![0f32; counts_len];
        let any_counted = counted.iter().any(|&c| c);
        if on_device {
            let normed = w.acur;
            let mut ops = Vec::new();
            let all_rows = n_out == t;
            let pick = |ops: &mut Vec<DevOp>, dst: BufId, at: usize| {
                if all_rows {
                    ops.push(DevOp::Copy {
                        x,
                        y: dst.span(at, t * ne),
                    });
                } else {
                    for (i, &r) in rows.iter().enumerate() {
                        ops.push(DevOp::Copy {
                            x: x.part(r * ne, ne),
                            y: dst.span(at + i * ne, ne),
                        });
                    }
                }
            };
            match &h.output {
                Some(o) if n_out > 0 => {
                    pick(&mut ops, normed, 0);
                    let picked = normed.span(0, n_out * ne);
                    let nx = w.heads.span(0, n_out * ne);
                    ops.push(DevOp::Norm {
                        add: None,
                        x: picked,
                        w: o.norm.w,
                        b: o.norm.b,
                        eps: hp.rms_eps,
                        y: nx,
                    });
                    ops.push(DevOp::MatMul {
                        m: o.head,
                        x: nx,
                        y: w.out.span(counts_len, n_out * nv),
                        t: n_out,
                    });
                    pending.extend(ops);
                    flush(dev, &mut pending)?;
                    step.laps.lap(Op::Device, || 0);
                    let mut got = vec![0f32; counts_len + n_out * nv];
                    let r = dev.read(w.out.span(0, got.len()))?;
                    dev.wait(r, &mut got)?;
                    step.laps.lap(Op::DeviceWait, || 0);
                    counts.copy_from_slice(&got[..counts_len]);
                    out.copy_from_slice(&got[counts_len..]);
                }
                _ => {
                    pick(&mut ops, w.out, counts_len);
                    pending.extend(ops);
                    flush(dev, &mut pending)?;
                    let mut got = vec![0f32; counts_len + n_out * ne];
                    let r = dev.read(w.out.span(0, got.len()))?;
                    step.laps.lap(Op::Device, || 0);
                    dev.wait(r, &mut got)?;
                    step.laps.lap(Op::DeviceWait, || 0);
                    counts.copy_from_slice(&got[..counts_len]);
                    let xr = &got[counts_len..];
                    let all: Vec<usize> = (0..n_out).collect();
                    let l = host_logits(step, model, self.mats, xr, &all)?;
                    out.copy_from_slice(&l);
                }
            }
        } else {
            flush(dev, &mut pending)?;
            step.laps.lap(Op::Device, || 0);
            if any_counted {
                let r = dev.read(w.out.span(0, counts_len))?;
                dev.wait(r, &mut counts)?;
                step.laps.lap(Op::DeviceWait, || 0);
            }
            let l = host_logits(step, model, self.mats, &host_x, rows)?;
            out.copy_from_slice(&l);
        }
        // The device's counts, and the balancer's measurements.
        let nff = hp.n_ff;
        let (mut dev_total, mut cpu_total) = (0u64, 0u64);
        for l in 0..nl {
            let dev_active: u64 = if counted[l] {
                let c = &counts[l * t..(l + 1) * t];
                for (d, &n) in step.density.iter_mut().zip(c) {
                    *d += n / nff as f32;
                }
                c.iter().map(|&n| n as u64).sum()
            } else {
                0
            };
            dev_total += dev_active;
            if let Some(share) = shares[l].take() {
                cpu_total += share.active;
                let timed = counted[l].then_some(dev_active);
                self.measured(step, (l, t), share, timed, balance)?;
            }
        }
        self.h.counters.0.fetch_add(dev_total, Ordering::Relaxed);
        self.h.counters.1.fetch_add(cpu_total, Ordering::Relaxed);
        step.laps.lap(Op::Other, || 0);
        Ok(())
    }

    /// Resident layer `l` of a chunk (see the [module docs](self)).
    #[allow(clippy::too_many_arguments)]
    fn device_layer(
        &self,
        step: &mut Step<'_>,
        c: &Chunk,
        w: &Work,
        l: usize,
        balance: &mut Balance,
        counted: &mut [bool],
        shares: &mut [Option<CpuShare>],
        pending: &mut Vec<DevOp>,
    ) -> Result<()> {
        let (model, h) = (self.model, self.h);
        let hp = &model.hparams;
        let dev = h.device.as_ref();
        let hl = &h.layers[l];
        let Some(a) = &hl.attn else {
            return Err(EngineError::Device(format!(
                "layer {l} is not on the device"
            )));
        };
        let layer = &model.layers[l];
        let store_layer = h.kv.layer_in_store(l).ok_or_else(|| {
            EngineError::Device(format!("layer {l} has no KV rows on the device"))
        })?;
        let (t, ne, nkv, nff) = (c.t, hp.n_embd, hp.n_embd_kv(), hp.n_ff);
        let eps = hp.rms_eps;
        let x = w.x.span(0, t * ne);
        let acur = w.acur.span(0, t * ne);
        let mut ops = vec![DevOp::Norm {
            add: None,
            x,
            w: a.norm.w,
            b: a.norm.b,
            eps,
            y: acur,
        }];
        let ain = match (a.norm2, w.acur2) {
            (Some(n2), Some(b2)) => {
                let c2 = b2.span(0, t * ne);
                ops.push(DevOp::Norm {
                    add: None,
                    x,
                    w: n2.w,
                    b: n2.b,
                    eps,
                    y: c2,
                });
                c2
            }
            _ => acur,
        };
        let (q, k, v) = (
            w.q.span(0, t * ne),
            w.k.span(0, t * nkv),
            w.v.span(0, t * nkv),
        );
        // The three products first, so that they share one converted activation.
        for (m, y) in a.qkv.iter().zip([q, k, v]) {
            ops.push(DevOp::MatMul {
                m: *m,
                x: ain,
                y,
                t,
            });
        }
        for (y, b) in [q, k, v].into_iter().zip(a.bias) {
            if let Some(b) = b {
                ops.push(DevOp::AddRows { y, b });
            }
        }
        if let Some(rope) = step.rope {
            ops.push(DevOp::Rope(RopeOp {
                q,
                k,
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim(),
                params: rope,
            }));
        }
        let heads = w.heads.span(0, t * ne);
        for p in &c.parts {
            ops.push(DevOp::Attention(AttentionOp {
                kv: p.kv,
                layer: store_layer,
                k: k.part(p.at * nkv, p.n * nkv),
                v: v.part(p.at * nkv, p.n * nkv),
                q: q.part(p.at * ne, p.n * ne),
                out: heads.part(p.at * ne, p.n * ne),
                at: p.at,
                n: p.n,
                params: step.ap,
            }));
        }
        let attn_out = w.attn_out.span(0, t * ne);
        ops.push(DevOp::MatMul {
            m: a.wo,
            x: heads,
            y: attn_out,
            t,
        });
        if let Some(bo) = a.bo {
            ops.push(DevOp::AddRows { y: attn_out, b: bo });
        }
        let falcon = hp.arch == Arch::Falcon;
        let residual = DevOp::Add { y: x, x: attn_out };
        let ex_cur = w.exchange.span(0, t * ne);
        let scores = w.exchange.span(t * ne, t * nff);
        let run = LayerRun {
            index: l,
            layer,
            mats: &self.mats.layers[l],
            split: self.exec.split(l),
        };
        // The FFN.
        if let Some(d) = hl.dense_ffn {
            let fin = if falcon {
                acur
            } else {
                // The residual add and the FFN norm in one launch.
                match hl.ffn_norm {
                    Some(n) => {
                        ops.push(DevOp::Norm {
                            add: Some(attn_out),
                            x,
                            w: n.w,
                            b: n.b,
                            eps,
                            y: ex_cur,
                        });
                        ex_cur
                    }
                    None => {
                        ops.push(residual.clone());
                        x
                    }
                }
            };
            let (Some(gb), Some(ub)) = (w.gate, w.up) else {
                return Err(EngineError::Device("no buffers for a dense FFN".into()));
            };
            let (g, u) = (gb.span(0, t * nff), ub.span(0, t * nff));
            match d.gate {
                Some(gm) => {
                    ops.push(DevOp::MatMul {
                        m: gm,
                        x: fin,
                        y: g,
                        t,
                    });
                    ops.push(DevOp::MatMul {
                        m: d.up,
                        x: fin,
                        y: u,
                        t,
                    });
                    ops.push(DevOp::Activate {
                        act: model.ffn_act,
                        gate: g,
                        up: u,
                    });
                }
                None => {
                    ops.push(DevOp::MatMul {
                        m: d.up,
                        x: fin,
                        y: g,
                        t,
                    });
                    if let Some(b) = hl.up_b {
                        ops.push(DevOp::AddRows { y: g, b });
                    }
                    ops.push(DevOp::Activate {
                        act: powerinfer_kernels_cpu::ffn::FfnAct::Relu,
                        gate: g,
                        up: u,
                    });
                }
            }
            let y = w.hot_y.span(0, t * ne);
            ops.push(DevOp::MatMul {
                m: d.down,
                x: g,
                y,
                t,
            });
            if let Some(b) = hl.down_b {
                ops.push(DevOp::AddRows { y, b });
            }
            ops.push(DevOp::Add { y: x, x: y });
            if falcon {
                ops.push(residual);
            }
            pending.extend(ops);
            step.laps.lap(Op::Device, || 0);
            return Ok(());
        }
        let sparse = matches!(layer.ffn, Ffn::Sparse { .. });
        let device_ffn = sparse
            && !self.exec.options().dense
            && hl.predictor.is_some()
            && (falcon || hl.ffn_norm.is_some() || layer.ffn_norm.is_none());
        if device_ffn {
            let (fc1, fc2) = hl.predictor.expect("checked above");
            let hidden = w.hidden.span(0, t * layer.ffn.predictor_rank());
            let predictor = DevOp::Predictor(PredictorOp {
                fc1,
                fc2,
                x,
                hidden,
                scores,
                t,
            });
            let state = balance.layers.get(l).and_then(Option::as_ref);
            let cpu_part = state.is_none_or(|s| s.cpu_has_neurons());
            // The FFN's input: attn_norm(x) for falcon (its predictor reads the layer input),
            // ffn_norm(x + attn) for the others.
            let fin = if falcon {
                ops.push(predictor);
                if cpu_part {
                    ops.push(DevOp::Copy { x: acur, y: ex_cur });
                }
                ops.push(residual);
                acur
            } else {
                // The residual add and the FFN norm in one launch.
                match hl.ffn_norm {
                    Some(n) => ops.push(DevOp::Norm {
                        add: Some(attn_out),
                        x,
                        w: n.w,
                        b: n.b,
                        eps,
                        y: ex_cur,
                    }),
                    None => {
                        ops.push(residual);
                        ops.push(DevOp::Copy { x, y: ex_cur });
                    }
                }
                ops.push(predictor);
                ex_cur
            };
            let read = if cpu_part {
                pending.append(&mut ops);
                flush(dev, pending)?;
                Some(dev.read(w.exchange.span(0, t * (ne + nff)))?)
            } else {
                None
            };
            if let Some(s) = state {
                // The hot part is added to the hidden state by its own axpy (the residual add).
                let hot = DevOp::HotFfn(HotFfnOp {
                    hot: s.hot,
                    x: fin,
                    scores,
                    threshold: self.exec.options().threshold,
                    t,
                    y: x,
                    accumulate: true,
                    count: Some(w.out.span(l * t, t)),
                });
                if balance.options.balance || read.is_some() {
                    // Timed between marks for the balancer and the layer split; the CPU's share
                    // is added in one program after it (graphs: three a layer).
                    pending.append(&mut ops);
                    flush(dev, pending)?;
                    dev.enqueue(&[
                        DevOp::Mark { slot: 2 * l },
                        hot,
                        DevOp::Mark { slot: 2 * l + 1 },
                    ])?;
                } else {
                    // Nothing reads its time: the layer is one program.
                    ops.push(hot);
                }
                counted[l] = true;
            }
            step.laps.lap(Op::Device, || 0);
            if read.is_none() && state.is_some() && balance.options.balance {
                // The device computes the layer whole: its time alone tells the balancer.
                shares[l] = Some(CpuShare {
                    time: Duration::ZERO,
                    active: 0,
                    scores: Vec::new(),
                });
            }
            if let Some(r) = read {
                let mut exh = vec![0f32; t * (ne + nff)];
                dev.wait(r, &mut exh)?;
                step.laps.lap(Op::DeviceWait, || 0);
                let t0 = Instant::now();
                let (cur_h, sc_h) = exh.split_at(t * ne);
                let skip = state.map(|s| &s.on_device[..]);
                let mut out_h = vec![0f32; t * ne];
                let active = ffn::cold_part(step, &run, cur_h, sc_h, skip, &mut out_h)?;
                let time = t0.elapsed();
                let cy = w.cpu_y.span(0, t * ne);
                flush(dev, pending)?;
                dev.write(cy, &out_h)?;
                ops.push(DevOp::Add { y: x, x: cy });
                shares[l] = Some(CpuShare {
                    time,
                    active,
                    scores: sc_h.to_vec(),
                });
            }
            if let Some(b) = hl.down_b {
                ops.push(DevOp::AddRows { y: x, b });
            }
            pending.extend(ops);
            step.laps.lap(Op::Device, || 0);
            return Ok(());
        }
        // The FFN on the CPU, from the layer's hidden state.
        if !falcon {
            ops.push(residual.clone());
        }
        pending.extend(ops);
        flush(dev, pending)?;
        let r = dev.read(x)?;
        if falcon {
            // After the read: the CPU's FFN reads the layer's input.
            pending.push(residual);
        }
        step.laps.lap(Op::Device, || 0);
        let mut xh = vec![0f32; t * ne];
        dev.wait(r, &mut xh)?;
        step.laps.lap(Op::DeviceWait, || 0);
        let mut cur = vec![0f32; t * ne];
        let norm_of = if falcon {
            Some(&layer.attn_norm)
        } else {
            layer.ffn_norm.as_ref()
        };
        match norm_of {
            Some(n) => norm(step.mm, &xh, n, eps, &mut cur)?,
            None => cur.copy_from_slice(&xh),
        }
        let mut out_h = vec![0f32; t * ne];
        ffn::forward(step, &run, &xh, &cur, &mut out_h)?;
        let cy = w.cpu_y.span(0, t * ne);
        flush(dev, pending)?;
        dev.write(cy, &out_h)?;
        pending.push(DevOp::Add { y: x, x: cy });
        step.laps.lap(Op::Device, || 0);
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
        let dev = self.h.device.as_ref();
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

/// Sends the ops queued for the device as one program. The step queues ops as it builds them
/// and sends them when the host next needs the device (before a read, a copy in, or a timed
/// run) and at the chunk's end, so that a chunk the device holds whole is one program (one
/// launch with graphs).
fn flush(dev: &dyn Device, pending: &mut Vec<DevOp>) -> Result<()> {
    if !pending.is_empty() {
        dev.enqueue(pending)?;
        pending.clear();
    }
    Ok(())
}
