//! The builders of one resident layer's ops, in the order a layer runs: the attention, then
//! one of the FFNs (dense on the device, sparse on the device with the CPU's share beside it,
//! or on the CPU from the layer's hidden state). Each pushes its ops into the chunk's
//! [`Program`] and sends it only where the host needs the device (a read, a copy in, a timed
//! run).

use std::time::Instant;

use powerinfer_kernels_cpu::ffn::FfnAct;

use super::{Chunk, CpuShare, Run, Tally};
use crate::device::{
    AttentionOp, Device, HotFfnOp, Op, PredictorOp, Program, ReadId, RopeOp, Span,
};
use crate::error::{EngineError, Result};
use crate::exec::ffn;
use crate::exec::step::{norm, LayerRun, Step};
use crate::model::{Arch, Ffn};
use crate::profile::OpKind;
use crate::schedule::balance::{Balance, LayerBalanceState};
use crate::schedule::hybrid::{DevAttention, DevDenseFfn, DevNorm, HybridLayer, Work};

/// Layer `l` of chunk `c` being built into `prog`.
pub(super) struct LayerBuild<'b, 'r, 's> {
    pub(super) run: &'b Run<'r>,
    pub(super) c: &'b Chunk,
    pub(super) w: &'b Work,
    pub(super) l: usize,
    pub(super) step: &'b mut Step<'s>,
    pub(super) prog: &'b mut Program,
}

/// The spans the attention leaves for the FFN.
struct Attended {
    /// The residual stream (`t × n_embd`), the layer's input until the residual add.
    x: Span,
    /// The attention's normalized input (`falcon`'s FFN input too).
    acur: Span,
    /// The attention's output, not yet added to `x`.
    attn_out: Span,
}

impl<'b, 'r> LayerBuild<'b, 'r, '_> {
    /// The layer: its attention, then its FFN where the device holds it (see the
    /// [module docs](self)).
    pub(super) fn build(&mut self, balance: &mut Balance, tally: &mut Tally) -> Result<()> {
        let h = self.run.h;
        let hl = &h.layers[self.l];
        let Some(a) = &hl.attn else {
            return Err(EngineError::Device(format!(
                "layer {} is not on the device",
                self.l
            )));
        };
        let at = self.attention(a)?;
        if let Some(d) = &hl.dense_ffn {
            self.dense_ffn(hl, d, &at)
        } else if self.ffn_on_device(hl) {
            self.sparse_ffn(hl, &at, balance, tally)
        } else {
            self.host_ffn(&at)
        }
    }

    fn dev(&self) -> &'b dyn Device {
        let run: &'b Run<'r> = self.run;
        run.h.device.as_ref()
    }

    fn falcon(&self) -> bool {
        self.run.model.hparams.arch == Arch::Falcon
    }

    /// `x += attn_out`.
    fn residual(&self, at: &Attended) -> Op {
        Op::Add {
            y: at.x,
            x: at.attn_out,
        }
    }

    /// Norm, Q/K/V and their biases, RoPE, the K and V rows stored and attention per
    /// sequence, `attn_output` and its bias.
    fn attention(&mut self, a: &DevAttention) -> Result<Attended> {
        let (model, w, l) = (self.run.model, self.w, self.l);
        let hp = &model.hparams;
        let store_layer = (self.run.h.kv.layer_in_store(l)).ok_or_else(|| {
            EngineError::Device(format!("layer {l} has no KV rows on the device"))
        })?;
        let (t, ne, nkv, eps) = (self.c.t, hp.n_embd, hp.n_embd_kv(), hp.rms_eps);
        let x = w.x.span(0, t * ne);
        let acur = w.acur.span(0, t * ne);
        let prog = &mut *self.prog;
        prog.push(Op::Norm {
            add: None,
            x,
            w: a.norm.w,
            b: a.norm.b,
            eps,
            y: acur,
        });
        let ain = match (a.norm2, w.acur2) {
            (Some(n2), Some(b2)) => {
                let c2 = b2.span(0, t * ne);
                prog.push(Op::Norm {
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
            prog.push(Op::MatMul {
                m: *m,
                x: ain,
                y,
                t,
            });
        }
        for (y, b) in [q, k, v].into_iter().zip(a.bias) {
            if let Some(b) = b {
                prog.push(Op::AddRows { y, b });
            }
        }
        if let Some(rope) = self.step.rope {
            prog.push(Op::Rope(RopeOp {
                q,
                k,
                n_head: hp.n_head,
                n_head_kv: hp.n_head_kv,
                head_dim: hp.head_dim(),
                params: rope,
            }));
        }
        let heads = w.heads.span(0, t * ne);
        for p in &self.c.parts {
            prog.push(Op::Attention(AttentionOp {
                kv: p.kv,
                layer: store_layer,
                k: k.part(p.at * nkv, p.n * nkv),
                v: v.part(p.at * nkv, p.n * nkv),
                q: q.part(p.at * ne, p.n * ne),
                out: heads.part(p.at * ne, p.n * ne),
                at: p.at,
                n: p.n,
                params: self.step.ap,
            }));
        }
        let attn_out = w.attn_out.span(0, t * ne);
        prog.push(Op::MatMul {
            m: a.wo,
            x: heads,
            y: attn_out,
            t,
        });
        if let Some(bo) = a.bo {
            prog.push(Op::AddRows { y: attn_out, b: bo });
        }
        Ok(Attended { x, acur, attn_out })
    }

    /// A dense FFN on the device (`-ngl`): the residual add and the FFN norm in one launch,
    /// gate and up, the activation, down, the FFN's residual add (`falcon`: the parallel
    /// block's two adds after it).
    fn dense_ffn(&mut self, hl: &HybridLayer, d: &DevDenseFfn, at: &Attended) -> Result<()> {
        let (model, w) = (self.run.model, self.w);
        let hp = &model.hparams;
        let (t, ne, nff) = (self.c.t, hp.n_embd, hp.n_ff);
        let falcon = self.falcon();
        let residual = self.residual(at);
        let ex_cur = w.exchange.span(0, t * ne);
        let prog = &mut *self.prog;
        let fin = if falcon {
            at.acur
        } else {
            match hl.ffn_norm {
                Some(n) => {
                    prog.push(added_norm(at, n, hp.rms_eps, ex_cur));
                    ex_cur
                }
                None => {
                    prog.push(residual.clone());
                    at.x
                }
            }
        };
        let (Some(gb), Some(ub)) = (w.gate, w.up) else {
            return Err(EngineError::Device("no buffers for a dense FFN".into()));
        };
        let (g, u) = (gb.span(0, t * nff), ub.span(0, t * nff));
        let product = |m, y| Op::MatMul { m, x: fin, y, t };
        match d.gate {
            Some(gm) => {
                prog.push(product(gm, g));
                prog.push(product(d.up, u));
                prog.push(Op::Activate {
                    act: model.ffn_act,
                    gate: g,
                    up: u,
                });
            }
            None => {
                prog.push(product(d.up, g));
                if let Some(b) = hl.up_b {
                    prog.push(Op::AddRows { y: g, b });
                }
                prog.push(Op::Activate {
                    act: FfnAct::Relu,
                    gate: g,
                    up: u,
                });
            }
        }
        let y = w.hot_y.span(0, t * ne);
        prog.push(Op::MatMul {
            m: d.down,
            x: g,
            y,
            t,
        });
        if let Some(b) = hl.down_b {
            prog.push(Op::AddRows { y, b });
        }
        prog.push(Op::Add { y: at.x, x: y });
        if falcon {
            prog.push(residual);
        }
        self.step.laps.lap(OpKind::Device, || 0);
        Ok(())
    }

    /// Whether the layer's sparse FFN runs on the device: it holds the predictor and the FFN
    /// norm the FFN reads.
    fn ffn_on_device(&self, hl: &HybridLayer) -> bool {
        let layer = &self.run.model.layers[self.l];
        matches!(layer.ffn, Ffn::Sparse { .. })
            && !self.run.exec.options().dense
            && hl.predictor.is_some()
            && (self.falcon() || hl.ffn_norm.is_some() || layer.ffn_norm.is_none())
    }

    /// The sparse FFN on the device: the FFN's input and the predictor's scores, the hot
    /// neurons of the layer's slice added to the residual; where the CPU computes neurons of
    /// its own, its share beside them ([`LayerBuild::cpu_share`]).
    fn sparse_ffn(
        &mut self,
        hl: &HybridLayer,
        at: &Attended,
        balance: &mut Balance,
        tally: &mut Tally,
    ) -> Result<()> {
        let (model, w, l) = (self.run.model, self.w, self.l);
        let hp = &model.hparams;
        let layer = &model.layers[l];
        let (t, ne, nff) = (self.c.t, hp.n_embd, hp.n_ff);
        let ex_cur = w.exchange.span(0, t * ne);
        let scores = w.exchange.span(t * ne, t * nff);
        let Some((fc1, fc2)) = hl.predictor else {
            return Err(EngineError::Device(format!("layer {l}: no predictor")));
        };
        let predictor = Op::Predictor(PredictorOp {
            fc1,
            fc2,
            x: at.x,
            hidden: w.hidden.span(0, t * layer.ffn.predictor_rank()),
            scores,
            t,
        });
        let state = balance.layers.get(l).and_then(Option::as_ref);
        let cpu_part = state.is_none_or(|s| s.cpu_has_neurons());
        let residual = self.residual(at);
        let falcon = self.falcon();
        let prog = &mut *self.prog;
        // The FFN's input: attn_norm(x) for falcon (its predictor reads the layer input),
        // ffn_norm(x + attn) for the others.
        let fin = if falcon {
            prog.push(predictor);
            if cpu_part {
                prog.push(Op::Copy {
                    x: at.acur,
                    y: ex_cur,
                });
            }
            prog.push(residual);
            at.acur
        } else {
            // The residual add and the FFN norm in one launch.
            match hl.ffn_norm {
                Some(n) => prog.push(added_norm(at, n, hp.rms_eps, ex_cur)),
                None => {
                    prog.push(residual);
                    prog.push(Op::Copy { x: at.x, y: ex_cur });
                }
            }
            prog.push(predictor);
            ex_cur
        };
        let dev = self.run.h.device.as_ref();
        let read = if cpu_part {
            Some(prog.read(dev, w.exchange.span(0, t * (ne + nff)))?)
        } else {
            None
        };
        if let Some(s) = state {
            // The hot part is added to the hidden state by its own axpy (the residual add).
            let hot = Op::HotFfn(HotFfnOp {
                hot: s.hot,
                x: fin,
                scores,
                threshold: self.run.exec.options().threshold,
                t,
                y: at.x,
                accumulate: true,
                count: Some(w.out.span(l * t, t)),
            });
            if balance.options.balance || read.is_some() {
                // Timed between marks for the balancer and the layer split; the CPU's share
                // is added in one program after it (graphs: three a layer).
                prog.timed(dev, l, hot)?;
            } else {
                // Nothing reads its time: the layer is one program.
                prog.push(hot);
            }
            tally.counted[l] = true;
        }
        self.step.laps.lap(OpKind::Device, || 0);
        if read.is_none() && state.is_some() && balance.options.balance {
            // The device computes the layer whole: its time alone tells the balancer.
            tally.shares[l] = Some(CpuShare {
                time: std::time::Duration::ZERO,
                active: 0,
                scores: Vec::new(),
            });
        }
        if let Some(r) = read {
            tally.shares[l] = Some(self.cpu_share(r, state, at.x)?);
        }
        if let Some(b) = hl.down_b {
            self.prog.push(Op::AddRows { y: at.x, b });
        }
        self.step.laps.lap(OpKind::Device, || 0);
        Ok(())
    }

    /// The CPU's share of a sparse FFN the device runs: waits for the FFN's input and scores
    /// (`read`), computes the neurons the device does not (`state`'s split), and sends the sum
    /// back to be added to `x`.
    fn cpu_share(
        &mut self,
        read: ReadId,
        state: Option<&LayerBalanceState>,
        x: Span,
    ) -> Result<CpuShare> {
        let (model, w) = (self.run.model, self.w);
        let (t, ne, nff) = (self.c.t, model.hparams.n_embd, model.hparams.n_ff);
        let mut exh = vec![0f32; t * (ne + nff)];
        self.dev().wait(read, &mut exh)?;
        self.step.laps.lap(OpKind::DeviceWait, || 0);
        let t0 = Instant::now();
        let (cur_h, sc_h) = exh.split_at(t * ne);
        let skip = state.map(|s| &s.on_device[..]);
        let mut out_h = vec![0f32; t * ne];
        let run = self.layer_run();
        let active = ffn::cold_part(self.step, &run, cur_h, sc_h, skip, &mut out_h)?;
        let time = t0.elapsed();
        let cy = w.cpu_y.span(0, t * ne);
        self.prog.write(self.dev(), cy, &out_h)?;
        self.prog.push(Op::Add { y: x, x: cy });
        Ok(CpuShare {
            time,
            active,
            scores: sc_h.to_vec(),
        })
    }

    /// The FFN on the CPU, from the layer's hidden state read back (a device without the
    /// layer's predictor); its output goes back to be added.
    fn host_ffn(&mut self, at: &Attended) -> Result<()> {
        let (model, w, l) = (self.run.model, self.w, self.l);
        let layer = &model.layers[l];
        let (t, ne) = (self.c.t, model.hparams.n_embd);
        let falcon = self.falcon();
        let residual = self.residual(at);
        if !falcon {
            self.prog.push(residual.clone());
        }
        let r = self.prog.read(self.dev(), at.x)?;
        if falcon {
            // After the read: the CPU's FFN reads the layer's input.
            self.prog.push(residual);
        }
        self.step.laps.lap(OpKind::Device, || 0);
        let mut xh = vec![0f32; t * ne];
        self.dev().wait(r, &mut xh)?;
        self.step.laps.lap(OpKind::DeviceWait, || 0);
        let mut cur = vec![0f32; t * ne];
        let norm_of = if falcon {
            Some(&layer.attn_norm)
        } else {
            layer.ffn_norm.as_ref()
        };
        match norm_of {
            Some(n) => norm(self.step.mm, &xh, n, model.hparams.rms_eps, &mut cur)?,
            None => cur.copy_from_slice(&xh),
        }
        let mut out_h = vec![0f32; t * ne];
        let run = self.layer_run();
        ffn::forward(self.step, &run, &xh, &cur, &mut out_h)?;
        let cy = w.cpu_y.span(0, t * ne);
        self.prog.write(self.dev(), cy, &out_h)?;
        self.prog.push(Op::Add { y: at.x, x: cy });
        self.step.laps.lap(OpKind::Device, || 0);
        Ok(())
    }

    /// The layer as the CPU's FFN takes it.
    fn layer_run(&self) -> LayerRun<'b, 'r> {
        let run: &'b Run<'r> = self.run;
        let l = self.l;
        LayerRun {
            index: l,
            layer: &run.model.layers[l],
            mats: &run.mats.layers[l],
            split: run.exec.split(l),
        }
    }
}

/// The attention's residual add and the FFN norm `n` of its sum into `y`, in one launch.
fn added_norm(at: &Attended, n: DevNorm, eps: f32, y: Span) -> Op {
    Op::Norm {
        add: Some(at.attn_out),
        x: at.x,
        w: n.w,
        b: n.b,
        eps,
        y,
    }
}
