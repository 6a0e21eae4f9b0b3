//! The simulated device's interpreter: each op of a program on the device's memory, with the
//! CPU kernels (so a layer computed here gives the CPU's bits), and what it cost.

use powerinfer_kernels_cpu::ffn::{activate, token_ffn, FfnAct, NeuronRows, TokenBufs};
use powerinfer_kernels_cpu::ops::activation::{add, relu};
use powerinfer_kernels_cpu::ops::attention::{attention_part, AttentionParams, AttentionPart};
use powerinfer_kernels_cpu::ops::attention_kv::{attention_kv_with, kv_bytes_read};
use powerinfer_kernels_cpu::ops::norm::{layer_norm, rms_norm};
use powerinfer_kernels_cpu::ops::rope::rope_block;
use powerinfer_kernels_cpu::MatMul;
use powerinfer_predictor::predictor::Predictor;

use super::clock::Cost;
use super::memory::{
    buf, bytes_of, hot_mut, io, mat, put_rows_f32, span, span_mut, span_vec, DevHot, DevMat,
    Memory, NewRows,
};
use super::stream::{StepState, Stream};
use crate::device::{
    entry, unknown_kv, AttentionOp, BufId, HotFfnOp, HotId, MatId, Op, PredictorOp, RopeOp, RowsOf,
    Span,
};
use crate::error::{EngineError, Result};

impl Stream {
    /// One operation of a program.
    pub(super) fn op(&self, mm: &MatMul<'_>, st: &mut StepState, op: &Op) -> Result<Cost> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let mem = &mut *mem;
        match op {
            Op::MatMul { m, x, y, t } => {
                let dm = mat(&mem.mats, *m)?;
                let w = dm.view()?;
                let (ins, out) = io(&mut mem.bufs, &[*x], *y)?;
                mm.gemm(&w, ins[0], *t, out)?;
                Ok(one(dm.bytes.len() as u64))
            }
            Op::GetRows {
                m,
                rows,
                from,
                n,
                y,
            } => get_rows(mem, st, *m, *rows, *from, *n, *y),
            Op::Norm {
                x,
                add: residual,
                w,
                b,
                eps,
                y,
            } => norm(mem, *x, *residual, *w, *b, *eps, *y),
            Op::AddRows { y, b } => {
                let bv = buf(&mem.bufs, *b)?.to_vec();
                let out = span_mut(&mut mem.bufs, *y)?;
                if bv.is_empty() || out.len() % bv.len() != 0 {
                    return Err(EngineError::Device(format!(
                        "a bias of {} values over {}",
                        bv.len(),
                        out.len()
                    )));
                }
                for r in out.chunks_exact_mut(bv.len()) {
                    add(r, &bv)?;
                }
                Ok(one(8 * y.len as u64))
            }
            Op::Add { y, x } => {
                let (ins, out) = io(&mut mem.bufs, &[*x], *y)?;
                add(out, ins[0])?;
                Ok(one(8 * y.len as u64))
            }
            Op::Zero { y } => {
                span_mut(&mut mem.bufs, *y)?.fill(0.0);
                Ok(one(4 * y.len as u64))
            }
            Op::Copy { x, y } => {
                let (ins, out) = io(&mut mem.bufs, &[*x], *y)?;
                if ins[0].len() != out.len() {
                    return Err(EngineError::Device(format!(
                        "a copy of {} values into {}",
                        ins[0].len(),
                        out.len()
                    )));
                }
                out.copy_from_slice(ins[0]);
                Ok(one(8 * y.len as u64))
            }
            Op::Rope(r) => rope(mem, st, r),
            Op::Attention(a) => attention(mm, mem, st, a),
            Op::Predictor(p) => predictor(mm, mem, p),
            Op::HotFfn(f) => hot_ffn_op(mm, mem, st, f),
            Op::Activate { act, gate, up } => {
                if *act == FfnAct::Relu {
                    relu(span_mut(&mut mem.bufs, *gate)?);
                } else {
                    let (ins, out) = io(&mut mem.bufs, &[*up], *gate)?;
                    activate(*act, out, ins[0])?;
                }
                Ok(one(12 * gate.len as u64))
            }
            Op::Mark { .. } => Ok(Cost::default()),
        }
    }

    /// Copies staged rows into slots of a hot slice (the bucket stays unique: a neuron the
    /// slice holds in another slot is refused); the new slots are enabled.
    pub(super) fn replace(&self, hot: HotId, slots: &[u32], rows: NewRows) -> Result<Cost> {
        let mut mem = self.memory.write().unwrap_or_else(|e| e.into_inner());
        let h = hot_mut(&mut mem, hot)?;
        let k = h.bucket.len();
        let mut bucket = h.bucket.clone();
        for (&s, &n) in slots.iter().zip(&rows.neurons) {
            let s = s as usize;
            if s >= k {
                return Err(EngineError::Device(format!(
                    "slot {s} outside the hot slice's {k}"
                )));
            }
            bucket[s] = n;
        }
        let mut seen = std::collections::HashSet::with_capacity(k);
        if !bucket.iter().all(|n| seen.insert(*n)) {
            return Err(EngineError::Device(
                "the replaced rows would hold a neuron twice".into(),
            ));
        }
        if h.gate.is_some() != rows.gate.is_some() || h.up_bias.is_some() != rows.up_bias.is_some()
        {
            return Err(EngineError::Device(
                "replacement rows do not match the hot slice's matrices".into(),
            ));
        }
        let mut copied = 0u64;
        let mut put = |m: &mut DevMat, src: &[u8]| -> Result<()> {
            let rb = m.bytes.len() / k.max(1);
            if src.len() != slots.len() * rb {
                return Err(EngineError::Device(
                    "replacement rows of the wrong size".into(),
                ));
            }
            for (i, &s) in slots.iter().enumerate() {
                m.bytes[s as usize * rb..][..rb].copy_from_slice(&src[i * rb..][..rb]);
            }
            copied += src.len() as u64;
            Ok(())
        };
        if let (Some(g), Some(src)) = (h.gate.as_mut(), rows.gate.as_deref()) {
            put(g, src)?;
        }
        put(&mut h.up, &rows.up)?;
        put(&mut h.down, &rows.down)?;
        if let (Some(b), Some(src)) = (h.up_bias.as_mut(), rows.up_bias.as_deref()) {
            for (&s, &v) in slots.iter().zip(src) {
                b[s as usize] = v;
            }
        }
        if let Some(e) = h.enabled.as_mut() {
            for &s in slots {
                e[s as usize] = true;
            }
        }
        h.bucket = bucket;
        let copied = copied + bytes_of::<u32>(slots.len());
        self.traffic.moved(copied);
        Ok(Cost {
            launches: 1,
            copied,
            copies: 1,
            ..Cost::default()
        })
    }

    /// One token's attention part over the first `n` mirrored positions of `layer`.
    pub(super) fn attend(
        &self,
        layer: usize,
        q: &[f32],
        n: usize,
        params: &AttentionParams,
    ) -> Result<(AttentionPart, Cost)> {
        let mem = self.memory.read().unwrap_or_else(|e| e.into_inner());
        let kv = &mem
            .mirror
            .as_ref()
            .ok_or_else(|| EngineError::Device("no KV mirror reserved".into()))?
            .kv;
        let row = params.kv_row_len();
        let rows = (kv.k.get(layer).and_then(|b| b.as_f16()))
            .zip(kv.v.get(layer).and_then(|b| b.as_f16()));
        let Some((k, v)) = rows.filter(|(k, _)| n * row <= k.len()) else {
            return Err(EngineError::Device(format!(
                "attention over {n} positions of layer {layer}: the mirror has {} layers of \
                 {} positions of {row} values",
                kv.k.len(),
                kv.positions
            )));
        };
        let mut part = AttentionPart::default();
        attention_part(q, &k[..n * row], &v[..n * row], params, &mut part)?;
        let out = part.max.len() + part.sum.len() + part.acc.len();
        Ok((
            part,
            Cost {
                launches: 1,
                read: 4 * (n * row) as u64,
                copied: bytes_of::<f32>(q.len() + out),
                copies: 2,
            },
        ))
    }
}

/// The hot part of a sparse FFN over `t` tokens: per token the enabled slots whose neuron's
/// score is at least `threshold`, through [`token_ffn`]. Returns the outputs (`t × n_embd`),
/// the bytes read and each token's count of computed neurons.
#[allow(clippy::too_many_arguments)]
fn hot_ffn(
    mm: &MatMul<'_>,
    st: &mut StepState,
    h: &DevHot,
    x: &[f32],
    scores: &[f32],
    threshold: f32,
    t: usize,
) -> Result<(Vec<f32>, u64, Vec<u32>)> {
    let (up, down) = (h.up.view()?, h.down.view()?);
    let gate = h.gate.as_ref().map(DevMat::view).transpose()?;
    let ne = down.cols();
    let k = h.bucket.len();
    let nff = scores.len().checked_div(t).unwrap_or(0);
    if x.len() != t * ne || scores.len() != t * nff {
        return Err(EngineError::Device(format!(
            "hot FFN: {} inputs and {} scores for {t} tokens of width {ne}",
            x.len(),
            scores.len()
        )));
    }
    if h.bucket.iter().any(|&j| j as usize >= nff) {
        return Err(EngineError::Device(
            "the hot slice holds neurons outside the scores".into(),
        ));
    }
    let rows = NeuronRows {
        gate: gate.as_ref(),
        up: &up,
        down: &down,
        up_bias: h.up_bias.as_deref(),
        act: h.act,
    };
    let per_row = |m: &DevMat| (m.bytes.len() / k.max(1)) as u64;
    let gate_row = h.gate.as_ref().map_or(0, per_row);
    let (up_row, down_row) = (per_row(&h.up), per_row(&h.down));
    st.u.resize(k, 0.0);
    let mut g = vec![0f32; k];
    let mut y = vec![0f32; t * ne];
    let mut read = 0u64;
    let mut counts = Vec::with_capacity(t);
    for i in 0..t {
        let sc = &scores[i * nff..][..nff];
        st.list.clear();
        st.list.extend((0..k as u32).filter(|&j| {
            h.enabled.as_ref().is_none_or(|e| e[j as usize])
                && sc[h.bucket[j as usize] as usize] >= threshold
        }));
        let mut bufs = TokenBufs {
            g: &mut g,
            u: &mut st.u[..k],
            fired: &mut st.fired,
        };
        let yi = &mut y[i * ne..][..ne];
        let n_up = token_ffn(mm, &rows, &x[i * ne..][..ne], &st.list, &mut bufs, yi)?;
        let a = st.list.len() as u64;
        counts.push(a as u32);
        read += a * (gate_row + down_row) + n_up as u64 * up_row;
    }
    Ok((y, read, counts))
}

/// One launch reading `read` bytes.
fn one(read: u64) -> Cost {
    Cost {
        launches: 1,
        read,
        ..Cost::default()
    }
}

/// [`Op::GetRows`]: rows of a held table, one per token `from .. from + n`.
#[allow(clippy::too_many_arguments)]
fn get_rows(
    mem: &mut Memory,
    st: &StepState,
    m: MatId,
    rows: RowsOf,
    from: usize,
    n: usize,
    y: Span,
) -> Result<Cost> {
    let dm = mat(&mem.mats, m)?;
    let out = span_mut(&mut mem.bufs, y)?;
    let rb = dm.bytes.len() / dm.rows.max(1);
    if out.len() != n * dm.cols || from + n > st.ids.len() {
        return Err(EngineError::Device(format!(
            "rows of {n} tokens from {from} into {} values",
            out.len()
        )));
    }
    for (i, o) in out.chunks_exact_mut(dm.cols).enumerate() {
        let r = match rows {
            RowsOf::Ids => st.ids[from + i] as usize,
            RowsOf::Positions(off) => st.positions[from + i] + off,
        };
        if r >= dm.rows {
            return Err(EngineError::Device(format!(
                "row {r} of a table of {}",
                dm.rows
            )));
        }
        powerinfer_gguf::quants::dequantize(dm.ty, &dm.bytes[r * rb..][..rb], o)?;
    }
    Ok(one((n * rb) as u64))
}

/// [`Op::Norm`]: RMSNorm or LayerNorm of `x` into `y`, after `x += residual`.
fn norm(
    mem: &mut Memory,
    x: Span,
    residual: Option<Span>,
    w: BufId,
    b: Option<BufId>,
    eps: f32,
    y: Span,
) -> Result<Cost> {
    if let Some(a) = residual {
        let (ins, out) = io(&mut mem.bufs, &[a], x)?;
        add(out, ins[0])?;
    }
    let wv = buf(&mem.bufs, w)?.to_vec();
    let bv = b
        .map(|b| buf(&mem.bufs, b).map(<[f32]>::to_vec))
        .transpose()?;
    let (ins, out) = io(&mut mem.bufs, &[x], y)?;
    match &bv {
        None => rms_norm(ins[0], &wv, eps, out)?,
        Some(bv) => layer_norm(ins[0], &wv, bv, eps, out)?,
    }
    let added = if residual.is_some() { 12 } else { 8 };
    Ok(one(added * x.len as u64))
}

/// [`Op::Rope`]: Q and K rotated at the step's positions.
fn rope(mem: &mut Memory, st: &StepState, r: &RopeOp) -> Result<Cost> {
    let n = r.q.len / (r.n_head * r.head_dim).max(1);
    let pos = (st.positions.get(..n))
        .ok_or_else(|| EngineError::Device("RoPE of tokens outside the step".into()))?;
    if r.k.len != n * r.n_head_kv * r.head_dim {
        return Err(EngineError::Device(format!(
            "RoPE of {n} tokens' Q with {} values of K",
            r.k.len
        )));
    }
    for (x, heads) in [(r.q, r.n_head), (r.k, r.n_head_kv)] {
        let out = span_mut(&mut mem.bufs, x)?;
        rope_block(out, heads, r.head_dim, pos, &r.params)?;
    }
    Ok(one(8 * (r.q.len + r.k.len) as u64))
}

/// [`Op::Attention`]: the tokens' K and V rows stored, then their causal attention.
fn attention(mm: &MatMul<'_>, mem: &mut Memory, st: &StepState, a: &AttentionOp) -> Result<Cost> {
    // The step's positions of the tokens: consecutive for one sequence's part.
    let pos = match st.positions.get(a.at..a.at + a.n) {
        Some(p) if p.iter().enumerate().all(|(i, &q)| q == p[0] + i) => p[0],
        Some([]) => 0,
        _ => {
            return Err(EngineError::Device(format!(
                "attention of tokens {}..{} of the step: not consecutive positions of the step",
                a.at,
                a.at + a.n
            )))
        }
    };
    let (n, kf) = (a.n, span(&mem.bufs, a.k)?);
    let vf = span(&mem.bufs, a.v)?;
    let store = mem.kvs.get_mut(a.kv.0).ok_or_else(|| unknown_kv(a.kv))?;
    // Converted to the store's types here, as the host's cache converts its rows.
    put_rows_f32(store, a.layer, pos, kf, vf)?;
    let (k, v) = (&store.k[a.layer], &store.v[a.layer]);
    let written = (k.row_bytes() + v.row_bytes()) as u64 * n as u64;
    let len = pos + n;
    let read = kv_bytes_read(k.ty(), v.ty(), len, k.row_values()) as u64;
    let (kview, vview) = (k.view(), v.view());
    let qv = span(&mem.bufs, a.q)?.to_vec();
    let out = span_mut(&mut mem.bufs, a.out)?;
    attention_kv_with(
        mm.backend(),
        mm.pool(),
        &qv,
        kview,
        vview,
        n,
        &a.params,
        out,
    )?;
    Ok(Cost {
        launches: 2,
        ..one(written + read)
    })
}

/// [`Op::Predictor`]: the scores `fc2 · ReLU(fc1 · x)`.
fn predictor(mm: &MatMul<'_>, mem: &mut Memory, pr: &PredictorOp) -> Result<Cost> {
    let PredictorOp {
        x, hidden, scores, ..
    } = *pr;
    let t = pr.t;
    let (a, b) = (mat(&mem.mats, pr.fc1)?, mat(&mem.mats, pr.fc2)?);
    let p = Predictor::new(a.view()?, b.view()?)?;
    if hidden.len != t * p.rank() {
        return Err(EngineError::Device(format!(
            "a predictor's hidden span of {} values for {t} tokens of rank {}",
            hidden.len,
            p.rank()
        )));
    }
    let xv = span(&mem.bufs, x)?.to_vec();
    // The span checked, the product uses the buffer as its scratch; its length is given back
    // as it was.
    let mut h = std::mem::take(span_vec(&mut mem.bufs, hidden)?);
    let len = h.len();
    let out = span_mut(&mut mem.bufs, scores)?;
    let r = p.scores_with(mm, &xv, t, &mut h, out);
    h.resize(len, 0.0);
    *span_vec(&mut mem.bufs, hidden)? = h;
    r?;
    Ok(Cost {
        launches: 3,
        read: (a.bytes.len() + b.bytes.len()) as u64,
        ..Cost::default()
    })
}

/// [`Op::HotFfn`]: the hot slice's part of a sparse FFN into (or added to) `y`, and the counts.
fn hot_ffn_op(mm: &MatMul<'_>, mem: &mut Memory, st: &mut StepState, f: &HotFfnOp) -> Result<Cost> {
    let h = entry(&mem.hots, f.hot.0, "hot slice")?;
    let xv = span(&mem.bufs, f.x)?.to_vec();
    let sv = span(&mem.bufs, f.scores)?.to_vec();
    let (ys, read, counts) = hot_ffn(mm, st, h, &xv, &sv, f.threshold, f.t)?;
    let out = span_mut(&mut mem.bufs, f.y)?;
    if out.len() != ys.len() {
        return Err(EngineError::Device(format!(
            "a hot FFN of {} values into {}",
            ys.len(),
            out.len()
        )));
    }
    if f.accumulate {
        add(out, &ys)?;
    } else {
        out.copy_from_slice(&ys);
    }
    if let Some(c) = f.count {
        let out = span_mut(&mut mem.bufs, c)?;
        if out.len() != counts.len() {
            return Err(EngineError::Device("a count span of the wrong size".into()));
        }
        // Added for one token of a gated FFN (as a GPU's fused products count).
        let adds = h.gate.is_some() && f.t == 1;
        for (o, &n) in out.iter_mut().zip(&counts) {
            *o = if adds { *o + n as f32 } else { n as f32 };
        }
    }
    Ok(Cost {
        launches: 5,
        read,
        ..Cost::default()
    })
}
