//! How the CUDA device turns a program into launches on its stream: fused where the launch
//! rules of `launches.rs` say so, one op after another otherwise, or one graph replayed.

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ffn::FfnAct;
use powerinfer_kernels_cpu::ops::rope::RopeMode as CpuRope;
use powerinfer_kernels_cuda::{
    DeviceBuffer, DeviceView, DeviceViewMut, LayerKv, Product, RopeMode, Unary,
};

use super::launches::{
    converts_activation, norm_conversion_run, program_launches, shared_activation_run, Conversion,
    HotKind,
};
use super::state::*;
use super::{cuda, CudaDevice};
use crate::device::program::Sighting;
use crate::device::{entry, AttentionOp, HotFfnOp, HotId, MatId, Op, PredictorOp, RowsOf};
use crate::error::{EngineError, Result};

impl CudaDevice {
    /// The kernel launches of program `ops` ([`program_launches`]).
    pub(super) fn launches(&self, st: &State, ops: &[Op]) -> u64 {
        let hot = |h: HotId| {
            (st.hots.get(h.0).and_then(Option::as_ref)).map_or(HotKind::default(), CudaHot::kind)
        };
        program_launches(ops, |m| Self::conversion(st, m), hot)
    }

    /// How a held matrix's products convert their activation.
    pub(super) fn conversion(st: &State, m: MatId) -> Conversion {
        let d = st.mats.get(m.0)?;
        converts_activation(d.ty()).then(|| (d.ty(), d.cols()))
    }

    /// Queues a program: its ops in order, the products that share an activation
    /// ([`shared_activation_run`]) with one conversion.
    pub(super) fn run(&self, st: &mut State, ops: &[Op]) -> Result<()> {
        let mut i = 0;
        while i < ops.len() {
            let fused = norm_conversion_run(&ops[i..], |m| Self::conversion(st, m));
            if fused > 0 {
                self.norm_products(st, &ops[i], &ops[i + 1..i + 1 + fused])?;
                i += 1 + fused;
                continue;
            }
            let run = shared_activation_run(&ops[i..], |m| Self::conversion(st, m));
            if run > 1 {
                self.shared_products(st, &ops[i..i + run])?;
                i += run;
            } else {
                self.op(st, &ops[i])?;
                i += 1;
            }
        }
        Ok(())
    }

    /// A norm and the products that read its output ([`norm_conversion_run`]): the norm's
    /// launch also converts its output for them.
    pub(super) fn norm_products(&self, st: &mut State, norm: &Op, products: &[Op]) -> Result<()> {
        let &Op::Norm {
            x,
            add: None,
            w,
            b,
            eps,
            y,
        } = norm
        else {
            return Err(EngineError::Device("not a norm".into()));
        };
        let mut ms = Vec::with_capacity(products.len());
        let mut outs = vec![y];
        for op in products {
            if let Op::MatMul { m, y: o, .. } = *op {
                ms.push(m);
                outs.push(o);
            }
        }
        let State { mats, bufs, .. } = st;
        let ws = held_mats(mats, &ms)?;
        let (g, s) = (&self.gpu, self.gpu.stream());
        with_outs(bufs, &outs, |bf, mut views| {
            let yv = views.remove(0);
            let wb = buf(bf, w)?;
            let n = wb.len();
            let rows = x.len.checked_div(n).unwrap_or(0);
            let wv = wb.view(0, n).map_err(cuda)?;
            let bv = b
                .map(|b| buf(bf, b)?.view(0, n).map_err(cuda))
                .transpose()?;
            let products = (ws.iter().zip(views))
                .map(|(w, dst)| Product::Dense { w, dst })
                .collect();
            g.norm_matmuls(s, view(bf, x)?, Some(wv), bv, eps, rows, n, yv, products)
                .map_err(cuda)
        })
    }

    /// Products of one activation (a run of [`Op::MatMul`]s found by
    /// [`shared_activation_run`]), converted once.
    pub(super) fn shared_products(&self, st: &mut State, ops: &[Op]) -> Result<()> {
        let mut ms = Vec::with_capacity(ops.len());
        let mut ys = Vec::with_capacity(ops.len());
        let (mut x, mut t) = (None, 0);
        for op in ops {
            if let Op::MatMul { m, x: xs, y, t: tt } = *op {
                ms.push(m);
                ys.push(y);
                (x, t) = (Some(xs), tt);
            }
        }
        let x = x.ok_or_else(|| EngineError::Device("no products".into()))?;
        let State { mats, bufs, .. } = st;
        let ws = held_mats(mats, &ms)?;
        let (g, s) = (&self.gpu, self.gpu.stream());
        with_outs(bufs, &ys, |b, outs| {
            let products = (ws.iter().zip(outs))
                .map(|(w, dst)| Product::Dense { w, dst })
                .collect();
            g.matmuls(s, view(b, x)?, t, products).map_err(cuda)
        })
    }

    /// Queues one operation.
    pub(super) fn op(&self, st: &mut State, op: &Op) -> Result<()> {
        let s = self.gpu.stream();
        let g = &self.gpu;
        let State {
            mats,
            bufs,
            hots,
            kvs,
            scratch,
            marks,
            ..
        } = st;
        let mat = |m: MatId| {
            mats.get(m.0)
                .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", m.0)))
        };
        let no_scratch = || EngineError::Device("no scratch reserved".into());
        match op {
            Op::MatMul { m, x, y, t } => with_out(bufs, *y, |b, yv| {
                g.matmul(s, mat(*m)?, view(b, *x)?, *t, yv).map_err(cuda)
            }),
            Op::GetRows {
                m,
                rows,
                from,
                n,
                y,
            } => {
                let sc = scratch.as_ref().ok_or_else(no_scratch)?;
                let (src, offset) = match rows {
                    RowsOf::Ids => (&sc.ids, 0),
                    RowsOf::Positions(off) => (&sc.pos, *off),
                };
                let r = src.view(*from, *n).map_err(cuda)?;
                with_out(bufs, *y, |_, yv| {
                    g.get_rows(s, mat(*m)?, r, offset, yv).map_err(cuda)
                })
            }
            Op::Norm {
                x,
                add: Some(a),
                w,
                b,
                eps,
                y,
            } => with_outs(bufs, &[*x, *y], |bf, mut outs| {
                let (yv, xv) = (outs.pop(), outs.pop());
                let (Some(xv), Some(yv)) = (xv, yv) else {
                    return Err(EngineError::Device("no norm output".into()));
                };
                let wb = buf(bf, *w)?;
                let n = wb.len();
                let rows = x.len.checked_div(n).unwrap_or(0);
                let wv = wb.view(0, n).map_err(cuda)?;
                let av = view(bf, *a)?;
                match b {
                    None => g.add_rms_norm(s, xv, av, Some(wv), *eps, rows, n, yv),
                    Some(b) => {
                        let bv = buf(bf, *b)?.view(0, n).map_err(cuda)?;
                        g.add_layer_norm(s, xv, av, Some(wv), Some(bv), *eps, rows, n, yv)
                    }
                }
                .map_err(cuda)
            }),
            Op::Norm {
                x,
                add: None,
                w,
                b,
                eps,
                y,
            } => with_out(bufs, *y, |bf, yv| {
                let wb = buf(bf, *w)?;
                let n = wb.len();
                let rows = x.len.checked_div(n).unwrap_or(0);
                let wv = wb.view(0, n).map_err(cuda)?;
                let xv = view(bf, *x)?;
                match b {
                    None => g.rms_norm(s, xv, Some(wv), *eps, rows, n, yv),
                    Some(b) => {
                        let bv = buf(bf, *b)?.view(0, n).map_err(cuda)?;
                        g.layer_norm(s, xv, Some(wv), Some(bv), *eps, rows, n, yv)
                    }
                }
                .map_err(cuda)
            }),
            Op::AddRows { y, b } => with_out(bufs, *y, |bf, yv| {
                g.add_rows(s, yv, buf(bf, *b)?).map_err(cuda)
            }),
            Op::Add { y, x } => with_out(bufs, *y, |bf, yv| {
                g.unary(s, Unary::Accumulate, view(bf, *x)?, yv)
                    .map_err(cuda)
            }),
            Op::Zero { y } => with_out(bufs, *y, |_, yv| g.zero(s, yv).map_err(cuda)),
            Op::Copy { x, y } => with_out(bufs, *y, |bf, yv| {
                g.copy(s, view(bf, *x)?, yv).map_err(cuda)
            }),
            Op::Rope(r) => {
                let sc = scratch.as_ref().ok_or_else(no_scratch)?;
                let (p, n) = (&r.params, r.q.len / (r.n_head * r.head_dim).max(1));
                let mode = match p.mode {
                    CpuRope::Normal => RopeMode::Normal,
                    CpuRope::NeoX => RopeMode::Neox,
                };
                let pos = sc.pos.view(0, n).map_err(cuda)?;
                let (base, scale) = (p.freq_base, p.freq_scale);
                with_outs(bufs, &[r.q, r.k], |_, mut qk| {
                    let (kv, qv) = (qk.pop(), qk.pop());
                    let (Some(qv), Some(kv)) = (qv, kv) else {
                        return Err(EngineError::Device("no RoPE views".into()));
                    };
                    let heads = (r.n_head, r.n_head_kv);
                    g.rope_qk(
                        s, qv, kv, pos, n, heads, r.head_dim, p.n_dims, base, scale, mode,
                    )
                    .map_err(cuda)
                })
            }
            Op::Attention(a) => {
                self.attention(bufs, kvs, scratch.as_mut().ok_or_else(no_scratch)?, a)
            }
            Op::Predictor(p) => {
                let PredictorOp {
                    x, hidden, scores, ..
                } = *p;
                let (a, b) = (mat(p.fc1)?, mat(p.fc2)?);
                // hidden and scores: two written buffers, each taken out of the table.
                let mut hid = bufs
                    .get_mut(hidden.buf.0)
                    .and_then(Option::take)
                    .ok_or_else(|| EngineError::Device("unknown predictor buffer".into()))?;
                let r = hid
                    .view_mut(hidden.off, hidden.len)
                    .map_err(cuda)
                    .and_then(|hv| {
                        with_out(bufs, scores, |bf, sv| {
                            g.predictor(s, a, b, view(bf, x)?, p.t, hv, sv)
                                .map_err(cuda)
                        })
                    });
                bufs[hidden.buf.0] = Some(hid);
                r
            }
            Op::HotFfn(f) => {
                let h = entry(hots, f.hot.0, "hot slice")?;
                let sc = scratch.as_mut().ok_or_else(no_scratch)?;
                self.hot_ffn(bufs, h, sc, f)
            }
            Op::Activate { act, gate, up } => {
                if *act == FfnAct::Relu {
                    return with_out(bufs, *gate, |_, gv| g.relu_in_place(s, gv).map_err(cuda));
                }
                let sc = scratch.as_mut().ok_or_else(no_scratch)?;
                {
                    let tmp = sc.act.view_mut(0, gate.len).map_err(cuda)?;
                    let (gv, uv) = (view(bufs, *gate)?, view(bufs, *up)?);
                    g.binary(s, gate_op(*act), gv, uv, tmp).map_err(cuda)?;
                }
                let back = sc.act.view(0, gate.len).map_err(cuda)?;
                with_out(bufs, *gate, |_, gv| g.copy(s, back, gv).map_err(cuda))
            }
            Op::Mark { slot } => {
                let e = match marks.get(slot) {
                    Some(e) => e,
                    None => {
                        let e = g.timed_event().map_err(cuda)?;
                        marks.entry(*slot).or_insert(e)
                    }
                };
                s.record(e).map_err(cuda)
            }
        }
    }

    /// [`Op::Attention`]: the tokens' K and V rows stored, then their attention.
    fn attention(
        &self,
        bufs: &mut [Option<DeviceBuffer<f32>>],
        kvs: &mut [Vec<LayerKv>],
        sc: &mut Scratch,
        a: &AttentionOp,
    ) -> Result<()> {
        let (s, g) = (self.gpu.stream(), &self.gpu);
        let (n_head, n) = (a.params.n_head, a.n);
        let cache = kv_layer_mut(kvs, a.kv, a.layer)?;
        // The kernels read the tokens' positions on the device (one program serves
        // every token); they are checked here against the store.
        let ctx = cache.n_ctx();
        match sc.host_pos.get(a.at..a.at + n) {
            Some(p) if p.iter().all(|&p| (p as usize) < ctx) => {}
            _ => {
                return Err(EngineError::Device(format!(
                    "attention of tokens {}..{} of the step outside a store of {ctx} \
                     positions",
                    a.at,
                    a.at + n
                )))
            }
        }
        let pos = sc.pos.view(a.at, n).map_err(cuda)?;
        g.kv_store(s, cache, view(bufs, a.k)?, view(bufs, a.v)?, pos, n)
            .map_err(cuda)?;
        let pos = sc.pos.view(a.at, n).map_err(cuda)?;
        let sv = sc.attn.view_mut(0, n * n_head * ctx).map_err(cuda)?;
        with_out(bufs, a.out, |bf, ov| {
            let q = view(bf, a.q)?;
            (g.attention(s, q, cache, n_head, pos, n, a.params.scale, ov, sv)).map_err(cuda)
        })
    }
    /// Queues `ops` with graphs: marks as they are, each run between them as a graph,
    /// captured the first time it is seen (ops and [`masked_of`]) and replayed after (one
    /// launch).
    pub(super) fn replay(&self, st: &mut State, ops: &[Op]) -> Result<()> {
        let mut launches = 0;
        let mut rest = ops;
        while let Some(first) = rest.first() {
            if let Op::Mark { .. } = first {
                self.op(st, first)?;
                rest = &rest[1..];
                continue;
            }
            let end = (rest.iter())
                .position(|op| matches!(op, Op::Mark { .. }))
                .unwrap_or(rest.len());
            let (run, after) = rest.split_at(end);
            let masked = masked_of(&st.hots, run);
            match st.graphs.sight(run, &masked) {
                Sighting::First => {
                    launches += self.launches(st, run);
                    self.run(st, run)?;
                }
                Sighting::Capture => {
                    let graph =
                        (self.gpu.stream()).capture(|| -> Result<()> { self.run(st, run) })?;
                    graph.launch().map_err(cuda)?;
                    st.graphs.keep(run, &masked, graph);
                    self.traffic.captured();
                    launches += 1;
                }
                Sighting::Replay => {
                    let graph = st.graphs.last().ok_or_else(|| {
                        EngineError::Device("a replayed program without its graph".into())
                    })?;
                    graph.launch().map_err(cuda)?;
                    launches += 1;
                }
            }
            rest = after;
        }
        self.traffic.launched(launches);
        Ok(())
    }

    /// The hot FFN's up (and gate) products and activation into `act`, as separate launches.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hot_products(
        &self,
        h: &CudaHot,
        xv: DeviceView<'_, f32>,
        p: DeviceView<'_, f32>,
        theta: f32,
        t: usize,
        tn: usize,
        up: &mut DeviceBuffer<f32>,
        gate: &mut DeviceBuffer<f32>,
        act: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let (g, s) = (&self.gpu, self.gpu.stream());
        // Up and gate (when there is one) share the activation, converted once. Their rows
        // outside the bucket are not zeroed: nothing below reads them (the activation of
        // those rows is computed and never used, the axpy reads the bucket's rows).
        let mut products = vec![Product::Sparse {
            slice: &h.up,
            p: p.reborrow(),
            theta,
            dst: up.view_mut(0, tn).map_err(cuda)?,
            clear: false,
        }];
        if let Some(gs) = &h.gate {
            products.push(Product::Sparse {
                slice: gs,
                p: p.reborrow(),
                theta,
                dst: gate.view_mut(0, tn).map_err(cuda)?,
                clear: false,
            });
        }
        g.matmuls(s, xv, t, products).map_err(cuda)?;
        match &h.gate {
            Some(_) => {
                let (gv, uv) = (
                    gate.view(0, tn).map_err(cuda)?,
                    up.view(0, tn).map_err(cuda)?,
                );
                let av = act.view_mut(0, tn).map_err(cuda)?;
                g.binary(s, gate_op(h.act), gv, uv, av).map_err(cuda)?;
            }
            None => {
                if let Some(b) = &h.up_bias {
                    g.add_rows(s, up.view_mut(0, tn).map_err(cuda)?, b)
                        .map_err(cuda)?;
                }
                g.unary(
                    s,
                    Unary::Relu,
                    up.view(0, tn).map_err(cuda)?,
                    act.view_mut(0, tn).map_err(cuda)?,
                )
                .map_err(cuda)?;
            }
        }
        Ok(())
    }

    /// The hot part of a sparse FFN (see [`Op::HotFfn`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hot_ffn(
        &self,
        bufs: &mut [Option<DeviceBuffer<f32>>],
        h: &CudaHot,
        sc: &mut Scratch,
        f: &HotFfnOp,
    ) -> Result<()> {
        let HotFfnOp {
            x,
            scores,
            threshold: theta,
            t,
            y,
            accumulate,
            count,
            ..
        } = *f;
        let (g, s) = (&self.gpu, self.gpu.stream());
        let n = h.up.n_neurons();
        if t > sc.t || scores.len != t * n {
            return Err(EngineError::Device(format!(
                "a hot FFN of {t} tokens and {} scores (scratch for {}, {n} neurons)",
                scores.len, sc.t
            )));
        }
        let tn = t * n;
        // With a mask, the scores of the neurons the device computes (the others below any
        // threshold) in the kernels' own scratch; without, the scores where they are.
        if h.masked {
            g.copy(
                s,
                view(bufs, scores)?,
                sc.masked.view_mut(0, tn).map_err(cuda)?,
            )
            .map_err(cuda)?;
            g.add_rows(s, sc.masked.view_mut(0, tn).map_err(cuda)?, &h.mask)
                .map_err(cuda)?;
        }
        let Scratch {
            masked,
            up,
            gate,
            act,
            ..
        } = sc;
        let mask_scratch = h.masked.then_some(&*masked);
        // One token of a gated FFN: the gate and up products, the activation and the count of
        // neurons in one launch.
        let fused = h.gate.is_some() && t == 1;
        match &h.gate {
            Some(gs) if fused => {
                let av = act.view_mut(0, tn).map_err(cuda)?;
                let run = |b: &[Option<DeviceBuffer<f32>>], cv: Option<DeviceViewMut<'_, f32>>| {
                    let (xv, p) = (view(b, x)?, hot_scores(b, mask_scratch, scores, tn)?);
                    let act = gate_kind(h.act);
                    (g.gated_matmul(s, gs, &h.up, xv, p, theta, t, act, cv, av)).map_err(cuda)
                };
                match count {
                    Some(c) => with_out(bufs, c, |b, cv| run(b, Some(cv)))?,
                    None => run(bufs, None)?,
                }
            }
            _ => {
                let p = hot_scores(bufs, mask_scratch, scores, tn)?;
                let xv = view(bufs, x)?;
                self.hot_products(h, xv, p, theta, t, tn, up, gate, act)?
            }
        }
        // F16 rows multiply activations rounded to f16, as the CPU's axpy does.
        let coeff = if h.down.weight().ty() == GgmlType::F16 {
            g.unary(
                s,
                Unary::RoundF16,
                act.view(0, tn).map_err(cuda)?,
                gate.view_mut(0, tn).map_err(cuda)?,
            )
            .map_err(cuda)?;
            gate.view(0, tn).map_err(cuda)?
        } else {
            act.view(0, tn).map_err(cuda)?
        };
        with_out(bufs, y, |b, yv| {
            let p = hot_scores(b, mask_scratch, scores, tn)?;
            if accumulate {
                g.sparse_axpy_add(s, &h.down, coeff, Some(p), theta, t, yv)
            } else {
                g.sparse_axpy(s, &h.down, coeff, Some(p), theta, t, yv)
            }
            .map_err(cuda)
        })?;
        // The count, written (the fused products added theirs).
        if let Some(c) = count.filter(|_| !fused) {
            with_out(bufs, c, |b, cv| {
                g.count_active(
                    s,
                    &h.up,
                    hot_scores(b, mask_scratch, scores, tn)?,
                    theta,
                    t,
                    cv,
                )
                .map_err(cuda)
            })?;
        }
        Ok(())
    }
}
