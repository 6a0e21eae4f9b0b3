//! The FFN of one layer for a block of tokens: dense (GGUF files, or `--dense`), sparse
//! (predictor-driven, PowerInfer files) or observed (dense, reporting true activations).
//!
//! Sparse FFN of a PowerInfer file (spec §4, §5.4): predictor scores `p = fc2 · ReLU(fc1 · h)`
//! (on the pre-norm residual), neuron `i` is active for a token when `p_i ≥ θ`; `up` and `gate`
//! are row-sparse products over the normalized input, then the activation, then the sparse
//! axpy over `ffn_down_t` restricted to the active neurons. [`sparse`] is where a layer's
//! neurons are divided between devices.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use powerinfer_kernels_cpu::ops::activation::{drelu, reglu, relu, swiglu};
use powerinfer_kernels_cpu::{GemvJob, KernelError, MatMul, Weights};
use powerinfer_predictor::predictor::Predictor;

use super::fused::{run_threads, FusedSplit};
use super::step::{add_bias, FfnScratch, LayerRun, Step};
use super::weights::{product, products_one_token, FfnMats};
use crate::error::Result;
use crate::model::{FfnAct, Layer};
use crate::profile::Op;

/// In dense mode, zero activations are passed to the axpy kernel as this value so that it does
/// not skip their rows (it skips exact zeros): every neuron's row is then read and added, as a
/// dense product would. `1e-30 · w` is below half an ulp of any output larger than ~1e-22 in
/// magnitude, so the result is unchanged.
const DENSE_TOUCH: f32 = 1e-30;

fn resize(v: &mut Vec<f32>, n: usize) {
    v.clear();
    v.resize(n, 0.0);
}

fn activate(act: FfnAct, gate: &mut [f32], up: &[f32]) -> std::result::Result<(), KernelError> {
    match act {
        FfnAct::Reglu => reglu(gate, up)?,
        FfnAct::Drelu => drelu(gate, up)?,
        FfnAct::Swiglu => swiglu(gate, up)?,
        // Gate-less FFNs are activated in place by their callers.
        FfnAct::Relu => relu(gate),
    }
    Ok(())
}

/// `out = FFN(cur)` for the batch's tokens (`h` = the predictor input: `ffn_inp`, or for
/// `falcon` the layer input); adds each token's share of computed neurons to `step.density`.
/// With an observer the FFN is computed densely and reported.
pub(crate) fn forward(
    step: &mut Step<'_>,
    run: &LayerRun<'_, '_>,
    h: &[f32],
    cur: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let (index, layer, mats) = (run.index, run.layer, &run.mats.ffn);
    let s = &mut step.buf.ffn;
    let laps = &mut step.laps;
    let t = step.t;
    let nff = step.hp.n_ff;
    if let Some(obs) = step.observer.as_deref_mut() {
        let scores = match mats {
            FfnMats::Sparse { predictor, .. } => {
                resize(&mut s.scores, t * nff);
                predictor.scores_with(step.mm, h, t, &mut s.hidden, &mut s.scores)?;
                laps.lap(Op::Predictor, || predictor.bytes_per_token() as u64);
                Some(&s.scores[..])
            }
            FfnMats::Dense { .. } => None,
        };
        hidden_dense(
            step.mm,
            step.act,
            step.opts.fuse,
            layer,
            mats,
            cur,
            t,
            &mut s.gate,
            &mut s.up,
        )?;
        obs.observe(index, t, h, &s.gate, scores);
        laps.lap(Op::FfnUpGate, || mats.gate_up_bytes());
        down_dense(step.mm, layer, mats, nff, &mut s.gate, t, out)?;
        laps.lap(Op::FfnDown, || mats.down_bytes());
        step.density.iter_mut().for_each(|d| *d += 1.0);
        return Ok(());
    }
    match mats {
        FfnMats::Sparse {
            gate,
            up,
            down_t,
            predictor,
        } if !step.opts.dense => {
            let w = SparseMats {
                gate: gate.as_ref(),
                up,
                down_t,
                predictor,
            };
            sparse(step, layer, &w, run.split, h, cur, out)
        }
        _ => {
            let (mm, act, fuse) = (step.mm, step.act, step.opts.fuse);
            hidden_dense(mm, act, fuse, layer, mats, cur, t, &mut s.gate, &mut s.up)?;
            laps.lap(Op::FfnUpGate, || mats.gate_up_bytes());
            down_dense(mm, layer, mats, nff, &mut s.gate, t, out)?;
            laps.lap(Op::FfnDown, || mats.down_bytes());
            step.density.iter_mut().for_each(|d| *d += 1.0);
            Ok(())
        }
    }
}

/// A sparse layer's matrices.
struct SparseMats<'a, 'm> {
    gate: Option<&'a Weights<'m>>,
    up: &'a Weights<'m>,
    down_t: &'a Weights<'m>,
    predictor: &'a Predictor<'m>,
}

/// The sparse FFN of one layer: the one place where its neurons are divided between the
/// devices that compute them. Today every neuron runs on the CPU: one token in one fused
/// dispatch ([`sparse_hidden_fused`]), a block token by token over each token's active list
/// (the predictor runs once for the block).
fn sparse(
    step: &mut Step<'_>,
    layer: &Layer,
    w: &SparseMats<'_, '_>,
    split: &FusedSplit,
    h: &[f32],
    cur: &[f32],
    out: &mut [f32],
) -> Result<()> {
    let s = &mut step.buf.ffn;
    let laps = &mut step.laps;
    let (t, mm, act, theta) = (step.t, step.mm, step.act, step.opts.threshold);
    let nff = step.hp.n_ff;
    let ne = step.hp.n_embd;
    let (gate_row, up_row) = (
        w.gate.map_or(0, |g| g.row_bytes() as u64),
        w.up.row_bytes() as u64,
    );
    let down_row = w.down_t.row_bytes() as u64;
    let fc1_bytes = w.predictor.fc1().data().len() as u64;
    let fc2_bytes = w.predictor.fc2().data().len() as u64;
    if t == 1 && step.opts.fuse {
        // One token: fc1, then fc2 + the active list + gate/up + activation in one dispatch
        // (each thread its own range of neurons), then the axpy.
        w.predictor.hidden(mm, h, 1, &mut s.hidden)?;
        laps.lap(Op::Predictor, || fc1_bytes);
        let n_up = sparse_hidden_fused(mm, w, layer.up_b.as_deref(), act, theta, cur, split, s)?;
        let n_active = s.active.len() as u64;
        laps.lap(Op::FfnUpGate, || {
            fc2_bytes + n_active * gate_row + n_up as u64 * up_row
        });
        out.fill(0.0);
        mm.sparse_axpy_indexed(w.down_t, &s.gate, &s.active, out)?;
        step.density[0] += s.active.len() as f32 / nff as f32;
        add_bias(out, layer.down_b.as_deref())?;
        // The axpy reads the rows of the active neurons whose activation is not zero.
        laps.lap(Op::FfnDown, || nonzero(&s.gate, &s.active) * down_row);
        return Ok(());
    }
    resize(&mut s.scores, t * nff);
    w.predictor
        .scores_with(mm, h, t, &mut s.hidden, &mut s.scores)?;
    laps.lap(Op::Predictor, || fc1_bytes + fc2_bytes);
    resize(&mut s.gate, t * nff);
    if w.gate.is_some() {
        resize(&mut s.up, t * nff);
    }
    out.fill(0.0);
    // Token by token: the active list once, then the indexed kernels (the axpy's four-row
    // fast path); the predictor above ran once for all tokens.
    for i in 0..t {
        let scores = &s.scores[i * nff..][..nff];
        s.active.clear();
        s.active
            .extend((0..nff as u32).filter(|&j| scores[j as usize] >= theta));
        let x = &cur[i * ne..][..ne];
        let g = &mut s.gate[i * nff..][..nff];
        let y = &mut out[i * ne..][..ne];
        let n_up = match w.gate {
            Some(gate_w) => {
                let u = &mut s.up[i * nff..][..nff];
                mm.sparse_gemv_indexed(gate_w, x, &s.active, g)?;
                if s.fired.is_empty() {
                    s.fired.push(Mutex::new(Vec::new()));
                }
                let fired = s.fired[0].get_mut().unwrap_or_else(|e| e.into_inner());
                let up_rows = gate_fired(act, g, &s.active, fired);
                mm.sparse_gemv_indexed(w.up, x, up_rows, u)?;
                activate(act, g, u)?;
                up_rows.len() as u64
            }
            None => {
                // ReLU(up + b) on the active neurons (the axpy reads no other).
                mm.sparse_gemv_indexed(w.up, x, &s.active, g)?;
                relu_bias_active(g, &s.active, layer.up_b.as_deref());
                s.active.len() as u64
            }
        };
        let n_active = s.active.len() as u64;
        laps.lap(Op::FfnUpGate, || n_active * gate_row + n_up * up_row);
        mm.sparse_axpy_indexed(w.down_t, g, &s.active, y)?;
        step.density[i] += s.active.len() as f32 / nff as f32;
        laps.lap(Op::FfnDown, || nonzero(g, &s.active) * down_row);
    }
    add_bias(out, layer.down_b.as_deref())?;
    laps.lap(Op::Other, || 0);
    Ok(())
}

/// The FFN hidden values of every neuron into `gate`: `act(gate·x, up·x)` for a gated FFN,
/// `ReLU(up·x + b)` for a gate-less one.
#[allow(clippy::too_many_arguments)]
fn hidden_dense(
    mm: &MatMul<'_>,
    act: FfnAct,
    fuse: bool,
    layer: &Layer,
    mats: &FfnMats<'_>,
    cur: &[f32],
    t: usize,
    gate: &mut Vec<f32>,
    up: &mut Vec<f32>,
) -> Result<()> {
    let n = match mats {
        FfnMats::Dense { up, .. } => up.w.rows(),
        FfnMats::Sparse { up, .. } => up.rows(),
    };
    resize(gate, t * n);
    match mats {
        FfnMats::Dense {
            gate: Some(g),
            up: u,
            ..
        } => {
            resize(up, t * n);
            if t == 1 && fuse {
                products_one_token(mm, &mut [(g, cur, gate), (u, cur, up)])?;
            } else {
                product(mm, g, cur, t, gate)?;
                product(mm, u, cur, t, up)?;
            }
            activate(act, gate, up)?;
        }
        FfnMats::Sparse {
            gate: Some(g),
            up: u,
            ..
        } => {
            resize(up, t * n);
            if t == 1 && fuse {
                mm.gemv_multi(&mut [
                    GemvJob {
                        w: *g,
                        x: cur,
                        y: gate,
                    },
                    GemvJob {
                        w: *u,
                        x: cur,
                        y: up,
                    },
                ])?;
            } else {
                mm.gemm(g, cur, t, gate)?;
                mm.gemm(u, cur, t, up)?;
            }
            activate(act, gate, up)?;
        }
        FfnMats::Dense { gate: None, up, .. } => {
            product(mm, up, cur, t, gate)?;
            add_bias(gate, layer.up_b.as_deref())?;
            relu(gate);
        }
        FfnMats::Sparse { gate: None, up, .. } => {
            mm.gemm(up, cur, t, gate)?;
            add_bias(gate, layer.up_b.as_deref())?;
            relu(gate);
        }
    }
    Ok(())
}

/// `out = down · act + b` for `t` tokens over every neuron: a GEMM for a dense file's
/// `ffn_down`, an axpy walking all `n_ff` rows of a PowerInfer file's `ffn_down_t` (zeros
/// touched, see [`DENSE_TOUCH`]). `act` is clobbered.
fn down_dense(
    mm: &MatMul<'_>,
    layer: &Layer,
    mats: &FfnMats<'_>,
    nff: usize,
    act: &mut [f32],
    t: usize,
    out: &mut [f32],
) -> Result<()> {
    match mats {
        FfnMats::Dense { down, .. } => product(mm, down, act, t, out)?,
        FfnMats::Sparse { down_t, .. } => {
            let ne = down_t.cols();
            let all: Vec<u32> = (0..nff as u32).collect();
            out.fill(0.0);
            for (a, y) in act.chunks_exact_mut(nff).zip(out.chunks_exact_mut(ne)) {
                a.iter_mut()
                    .filter(|a| **a == 0.0)
                    .for_each(|a| *a = DENSE_TOUCH);
                mm.sparse_axpy_indexed(down_t, a, &all, y)?;
            }
        }
    }
    add_bias(out, layer.down_b.as_deref())
}

/// One token of a sparse FFN, in one dispatch: each thread takes a contiguous range of neurons
/// (cut where `split` says, see [`FusedSplit`]), computes their predictor scores (`fc2 ·
/// hidden` into `s.scores`), lists its active ones (`score ≥ threshold`), computes `gate` for
/// them and `up` for those that need it ([`gate_fired`]) and applies the activation
/// (gate-less: `ReLU(up + b)`) into `s.gate`. Afterwards `s.active` holds all active neurons,
/// increasing. Returns the number of `up` rows read. Only the active entries of `s.gate` are
/// meaningful (the axpy reads no other).
#[allow(clippy::too_many_arguments)]
fn sparse_hidden_fused(
    mm: &MatMul<'_>,
    w: &SparseMats<'_, '_>,
    up_b: Option<&[f32]>,
    act: FfnAct,
    threshold: f32,
    cur: &[f32],
    split: &FusedSplit,
    s: &mut FfnScratch,
) -> Result<usize> {
    let nff = w.predictor.n_ff();
    let n = mm.pool().n_threads();
    let ranges = split.ranges(nff, n);
    if s.scores.len() != nff {
        resize(&mut s.scores, nff);
    }
    if s.gate.len() != nff {
        resize(&mut s.gate, nff);
    }
    if w.gate.is_some() && s.up.len() != nff {
        resize(&mut s.up, nff);
    }
    if s.parts.len() != n {
        s.parts = (0..n).map(|_| Mutex::new(Vec::new())).collect();
    }
    if s.fired.len() != n {
        s.fired = (0..n).map(|_| Mutex::new(Vec::new())).collect();
    }
    // Per thread: its range and disjoint parts of the three buffers.
    type Part<'b> = (Range<usize>, &'b mut [f32], &'b mut [f32], &'b mut [f32]);
    let mut parts: Vec<Mutex<Part<'_>>> = Vec::with_capacity(n);
    {
        let (mut sc, mut g, mut u) = (&mut s.scores[..], &mut s.gate[..], &mut s.up[..]);
        for r in &ranges {
            let r = r.clone();
            let (a, sc_rest) = sc.split_at_mut(r.len());
            let (b, g_rest) = g.split_at_mut(r.len());
            let ul = r.len().min(u.len());
            let (c, u_rest) = u.split_at_mut(ul);
            sc = sc_rest;
            g = g_rest;
            u = u_rest;
            parts.push(Mutex::new((r, a, b, c)));
        }
    }
    let hidden = &s.hidden[..];
    let lists = &s.parts;
    let fired_lists = &s.fired;
    // Each thread's part: fc2 scores of its neurons, its active list, gate/up, activation.
    let fused_part = |tid: usize, m: &MatMul<'_>| -> std::result::Result<(), KernelError> {
        let mut p = parts[tid].lock().unwrap_or_else(|e| e.into_inner());
        let (r, sc, g, u) = &mut *p;
        let mut list = lists[tid].lock().unwrap_or_else(|e| e.into_inner());
        list.clear();
        let mut fired = fired_lists[tid].lock().unwrap_or_else(|e| e.into_inner());
        fired.clear();
        if r.start == r.end {
            return Ok(());
        }
        m.gemv(&w.predictor.fc2().row_range(r.clone())?, hidden, sc)?;
        list.extend((0..r.len() as u32).filter(|&i| sc[i as usize] >= threshold));
        match w.gate {
            Some(gw) => {
                m.sparse_gemv_indexed(&gw.row_range(r.clone())?, cur, &list, g)?;
                let up_rows = gate_fired(act, g, &list, &mut fired);
                m.sparse_gemv_indexed(&w.up.row_range(r.clone())?, cur, up_rows, u)?;
                for &i in up_rows {
                    let i = i as usize;
                    activate(act, &mut g[i..i + 1], &u[i..i + 1])?;
                }
            }
            None => {
                // ReLU(up + b) on the active neurons.
                m.sparse_gemv_indexed(&w.up.row_range(r.clone())?, cur, &list, g)?;
                relu_bias_active(g, &list, up_b.map(|b| &b[r.clone()]));
            }
        }
        Ok(())
    };
    // Each thread's time, from which the split of the next token is learned.
    let times: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
    run_threads(mm, |tid, m| {
        let t0 = Instant::now();
        let r = fused_part(tid, m);
        times[tid].store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    })?;
    let times: Vec<u64> = times.into_iter().map(AtomicU64::into_inner).collect();
    split.learn(nff, &ranges, &times);
    drop(parts);
    s.active.clear();
    for (tid, list) in s.parts.iter().enumerate() {
        let start = ranges[tid].start as u32;
        let list = list.lock().unwrap_or_else(|e| e.into_inner());
        s.active.extend(list.iter().map(|&i| i + start));
    }
    // The up rows read: the listed ones, or those whose gate fired.
    Ok(match w.gate {
        Some(_) if matches!(act, FfnAct::Reglu | FfnAct::Drelu) => s
            .fired
            .iter()
            .map(|f| f.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum(),
        _ => s.active.len(),
    })
}

/// The rows of `active` whose `up` product is needed once `gate` holds their gate products.
/// Where the activation is ReLU on the gate (ReGLU, dReLU), a neuron whose gate is not
/// positive has output 0 whatever its `up`: its gate value becomes 0 here, and only the others
/// are returned (collected in `fired`), so the `up` rows of the predictor's false positives
/// are never read. The outputs are those of computing every listed `up` row, but for the sign
/// of a zero (which no later step reads: the axpy skips zeros) and for a non-finite `up`
/// product of a neuron whose gate did not fire (0 here, NaN from the full product). Other
/// activations need every listed row: `active` itself.
fn gate_fired<'a>(
    act: FfnAct,
    gate: &mut [f32],
    active: &'a [u32],
    fired: &'a mut Vec<u32>,
) -> &'a [u32] {
    if !matches!(act, FfnAct::Reglu | FfnAct::Drelu) {
        return active;
    }
    fired.clear();
    for &i in active {
        let g = &mut gate[i as usize];
        if *g > 0.0 {
            fired.push(i);
        } else {
            *g = 0.0;
        }
    }
    fired
}

/// How many of the listed neurons have a non-zero activation (the rows the axpy reads).
fn nonzero(act: &[f32], active: &[u32]) -> u64 {
    active.iter().filter(|&&i| act[i as usize] != 0.0).count() as u64
}

/// `h[i] = ReLU(h[i] + b[i])` for the listed neurons (the gate-less FFN's activation; `bias`
/// indexed like `h`).
fn relu_bias_active(h: &mut [f32], active: &[u32], bias: Option<&[f32]>) {
    for &i in active {
        let i = i as usize;
        let v = h[i] + bias.map_or(0.0, |b| b[i]);
        h[i] = if v > 0.0 { v } else { 0.0 };
    }
}
