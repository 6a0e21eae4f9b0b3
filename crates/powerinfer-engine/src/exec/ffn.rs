//! The FFN of one layer for a block of tokens: dense (GGUF files, or `--dense`), sparse
//! (predictor-driven, PowerInfer files) or observed (dense, reporting true activations).
//!
//! Sparse FFN of a PowerInfer file (spec §4, §5.4): predictor scores `p = fc2 · ReLU(fc1 · h)`
//! (on the pre-norm residual), neuron `i` is active for a token when `p_i ≥ θ`; `up` and `gate`
//! are row-sparse products over the normalized input, then the activation, then the sparse
//! axpy over `ffn_down_t` restricted to the active neurons. [`sparse`] is where a layer's
//! neurons are divided between the CPU and a device.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use powerinfer_kernels_cpu::ffn::{activate, hidden, nonzero, NeuronRows, TokenBufs};
use powerinfer_kernels_cpu::ops::activation::relu;
use powerinfer_kernels_cpu::{GemmJob, KernelError, MatMul};
use powerinfer_predictor::predictor::Predictor;

use super::fused::{run_threads, FusedSplit};
use super::step::{add_bias, for_row_parts, FfnScratch, LayerRun, Step};
use super::weights::{product, products, FfnMats};
use crate::error::Result;
use crate::model::{FfnAct, Layer};
use crate::profile::{BatchDensity, OpKind};

/// In dense mode, zero activations are passed to the axpy kernel as this value so that it does
/// not skip their rows (it skips exact zeros): every neuron's row is then read and added, as a
/// dense product would. `1e-30 · w` is below half an ulp of any output larger than ~1e-22 in
/// magnitude, so the result is unchanged.
const DENSE_TOUCH: f32 = 1e-30;

fn resize(v: &mut Vec<f32>, n: usize) {
    v.clear();
    v.resize(n, 0.0);
}

/// `v` at length `n` for a product that writes every value: old values stay where the length
/// allows (clearing a prompt block's `n_ff`-wide buffers took as long as a norm).
fn fit_overwritten(v: &mut Vec<f32>, n: usize) {
    v.resize(n, 0.0);
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
    let t = step.t;
    let nff = step.hp.n_ff;
    let s = &mut step.buf.ffn;
    let laps = &mut step.laps;
    if let Some(obs) = step.observer.as_deref_mut() {
        let scores = match mats {
            FfnMats::Sparse { predictor, .. } => {
                resize(&mut s.scores, t * nff);
                predictor.scores_with(step.mm, h, t, &mut s.hidden, &mut s.scores)?;
                laps.lap(OpKind::Predictor, || predictor.bytes_per_token() as u64);
                Some(&s.scores[..])
            }
            FfnMats::Dense { .. } => None,
        };
        let (g, u) = (&mut s.gate, &mut s.up);
        hidden_dense(step.mm, step.act, step.opts.fuse, layer, mats, cur, t, g, u)?;
        obs.observe(index, t, h, &s.gate, scores);
        laps.lap(OpKind::FfnUpGate, || mats.gate_up_bytes());
        down_dense(step.mm, layer, mats, nff, &mut s.gate, t, out)?;
        laps.lap(OpKind::FfnDown, || mats.down_bytes());
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
                rows: NeuronRows {
                    gate: gate.as_ref(),
                    up,
                    down: down_t,
                    up_bias: layer.up_b.as_deref(),
                    act: step.act,
                },
                predictor,
            };
            sparse(step, index, layer, &w, run.split, h, cur, out, None).map(|_| ())
        }
        _ => {
            let (mm, act, fuse) = (step.mm, step.act, step.opts.fuse);
            hidden_dense(mm, act, fuse, layer, mats, cur, t, &mut s.gate, &mut s.up)?;
            laps.lap(OpKind::FfnUpGate, || mats.gate_up_bytes());
            down_dense(mm, layer, mats, nff, &mut s.gate, t, out)?;
            laps.lap(OpKind::FfnDown, || mats.down_bytes());
            step.density.iter_mut().for_each(|d| *d += 1.0);
            Ok(())
        }
    }
}

/// A sparse layer's matrices.
struct SparseMats<'a, 'm> {
    rows: NeuronRows<'a>,
    predictor: &'a Predictor<'m>,
}

/// The CPU's share of a sparse FFN whose scores a device computed: the active neurons of
/// `scores` (`t × n_ff`) that `skip` does not mark (the device computes those), into `out`
/// (overwritten; no down bias: the device adds it once). Returns the active neurons computed.
pub(crate) fn cold_part(
    step: &mut Step<'_>,
    run: &LayerRun<'_, '_>,
    cur: &[f32],
    scores: &[f32],
    skip: Option<&[bool]>,
    out: &mut [f32],
) -> Result<u64> {
    let FfnMats::Sparse {
        gate,
        up,
        down_t,
        predictor,
    } = &run.mats.ffn
    else {
        return Err(crate::error::EngineError::Device(
            "a device's scores for a dense FFN".into(),
        ));
    };
    let w = SparseMats {
        rows: NeuronRows {
            gate: gate.as_ref(),
            up,
            down: down_t,
            up_bias: run.layer.up_b.as_deref(),
            act: step.act,
        },
        predictor,
    };
    sparse(
        step,
        run.index,
        run.layer,
        &w,
        run.split,
        &[],
        cur,
        out,
        Some((scores, skip)),
    )
}

/// How the fused one-token dispatch gets the scores.
#[derive(Clone, Copy)]
enum Scores<'a> {
    /// Each thread computes `fc2` for its neurons from the predictor's hidden layer.
    Compute(&'a Predictor<'a>),
    /// Already in `s.scores`.
    Given,
}

/// The sparse FFN of one layer on the CPU: predictor scores (unless `given`, with the neurons
/// a device computes marked to skip), then the active neurons: one token in one fused dispatch
/// ([`sparse_hidden_fused`]), a block token by token over each token's active list. Returns
/// the active neurons computed; adds the down bias unless the scores were given.
#[allow(clippy::too_many_arguments)]
fn sparse(
    step: &mut Step<'_>,
    index: usize,
    layer: &Layer,
    w: &SparseMats<'_, '_>,
    split: &FusedSplit,
    h: &[f32],
    cur: &[f32],
    out: &mut [f32],
    given: Option<(&[f32], Option<&[bool]>)>,
) -> Result<u64> {
    let (t, mm, theta) = (step.t, step.mm, step.opts.threshold);
    let nff = step.hp.n_ff;
    let ne = step.hp.n_embd;
    let s = &mut step.buf.ffn;
    let laps = &mut step.laps;
    let gate_row = w.rows.gate.map_or(0, |g| g.row_bytes() as u64);
    let up_row = w.rows.up.row_bytes() as u64;
    let down_row = w.rows.down.row_bytes() as u64;
    let fc1_bytes = w.predictor.fc1().data().len() as u64;
    let fc2_bytes = w.predictor.fc2().data().len() as u64;
    let fuse = t == 1 && step.opts.fuse;
    // 1. Scores: given by a device, or on the CPU (for one token the CPU computes `fc2`
    //    inside the fused dispatch).
    let skip = given.and_then(|g| g.1);
    let scores_ready = match given {
        Some((sc, _)) => {
            if sc.len() != t * nff {
                return Err(crate::error::EngineError::Device(format!(
                    "{} scores for {t} tokens of {nff} neurons",
                    sc.len()
                )));
            }
            fit_overwritten(&mut s.scores, t * nff);
            s.scores.copy_from_slice(sc);
            true
        }
        None if !fuse => {
            resize(&mut s.scores, t * nff);
            w.predictor
                .scores_with(mm, h, t, &mut s.hidden, &mut s.scores)?;
            true
        }
        None => {
            w.predictor.hidden(mm, h, 1, &mut s.hidden)?;
            false
        }
    };
    laps.lap(OpKind::Predictor, || {
        if given.is_some() {
            0
        } else if scores_ready {
            fc1_bytes + fc2_bytes
        } else {
            fc1_bytes
        }
    });
    // 3. The CPU's active neurons.
    let mut cpu_active = 0u64;
    if fuse {
        let given = if scores_ready {
            Scores::Given
        } else {
            Scores::Compute(w.predictor)
        };
        let n_up = sparse_hidden_fused(mm, &w.rows, theta, cur, split, s, given, skip)?;
        let n_active = s.active.len() as u64;
        laps.lap(OpKind::FfnUpGate, || {
            let fc2 = if scores_ready { 0 } else { fc2_bytes };
            fc2 + n_active * gate_row + n_up as u64 * up_row
        });
        out.fill(0.0);
        mm.sparse_axpy_indexed(w.rows.down, &s.gate, &s.active, out)?;
        cpu_active = n_active;
        laps.lap(OpKind::FfnDown, || nonzero(&s.gate, &s.active) * down_row);
    } else {
        resize(&mut s.gate, t * nff);
        if w.rows.gate.is_some() {
            resize(&mut s.up, t * nff);
        }
        out.fill(0.0);
        if s.fired.is_empty() {
            s.fired.push(Mutex::new(Vec::new()));
        }
        // Token by token: the active list once, then the indexed kernels (the axpy's four-row
        // fast path), each timed as its own operation; the predictor above ran once for all
        // tokens. A profile also counts the union of the tokens' lists (`BatchDensity`).
        let count_union = laps.on();
        if count_union {
            s.mark.clear();
            s.mark.resize(nff, false);
        }
        for i in 0..t {
            let scores = &s.scores[i * nff..][..nff];
            s.active.clear();
            match skip {
                Some(on_dev) => s.active.extend(
                    (0..nff as u32).filter(|&j| scores[j as usize] >= theta && !on_dev[j as usize]),
                ),
                None => s
                    .active
                    .extend((0..nff as u32).filter(|&j| scores[j as usize] >= theta)),
            }
            if count_union {
                for &j in &s.active {
                    s.mark[j as usize] = true;
                }
            }
            let g = &mut s.gate[i * nff..][..nff];
            let u: &mut [f32] = if w.rows.gate.is_some() {
                &mut s.up[i * nff..][..nff]
            } else {
                &mut []
            };
            let fired = s.fired[0].get_mut().unwrap_or_else(|e| e.into_inner());
            let x = &cur[i * ne..][..ne];
            let y = &mut out[i * ne..][..ne];
            let mut bufs = TokenBufs { g, u, fired };
            let n_up = hidden(mm, &w.rows, x, &s.active, &mut bufs)? as u64;
            let n_active = s.active.len() as u64;
            laps.lap(OpKind::FfnUpGate, || n_active * gate_row + n_up * up_row);
            let g = &*bufs.g;
            mm.sparse_axpy_indexed(w.rows.down, g, &s.active, y)?;
            cpu_active += n_active;
            step.density[i] += n_active as f32 / nff as f32;
            laps.lap(OpKind::FfnDown, || nonzero(g, &s.active) * down_row);
        }
        if count_union {
            laps.batch(
                index,
                BatchDensity {
                    blocks: 1,
                    tokens: t as u64,
                    active: cpu_active,
                    union: s.mark.iter().filter(|&&m| m).count() as u64,
                    neurons: nff as u64,
                },
            );
        }
    }
    if fuse {
        step.density[0] += cpu_active as f32 / nff as f32;
    }
    if given.is_none() {
        add_bias(out, layer.down_b.as_deref())?;
    }
    laps.lap(OpKind::Other, || 0);
    Ok(cpu_active)
}

/// The FFN hidden values of every neuron into `s.gate`: `act(gate·x, up·x)` for a gated FFN,
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
    fit_overwritten(gate, t * n);
    match mats {
        FfnMats::Dense {
            gate: Some(g),
            up: u,
            ..
        } => {
            fit_overwritten(up, t * n);
            if fuse {
                products(mm, &mut [(g, cur, gate), (u, cur, up)], t)?;
            } else {
                product(mm, g, cur, t, gate)?;
                product(mm, u, cur, t, up)?;
            }
            activate_all(mm, act, gate, up)?;
        }
        FfnMats::Sparse {
            gate: Some(g),
            up: u,
            ..
        } => {
            fit_overwritten(up, t * n);
            if fuse {
                mm.gemm_multi(
                    &mut [
                        GemmJob {
                            w: *g,
                            x: cur,
                            y: gate,
                        },
                        GemmJob {
                            w: *u,
                            x: cur,
                            y: up,
                        },
                    ],
                    t,
                )?;
            } else {
                mm.gemm(g, cur, t, gate)?;
                mm.gemm(u, cur, t, up)?;
            }
            activate_all(mm, act, gate, up)?;
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
#[allow(clippy::too_many_arguments)]
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

/// One token of a sparse FFN's CPU part, in one dispatch: each thread takes a contiguous
/// range of neurons (cut where `split` says, see [`FusedSplit`]), computes their predictor
/// scores (`fc2 · hidden` into `s.scores`) unless they are [`Scores::Given`], lists its
/// active ones (`score ≥ threshold`, not held by the device: `skip`), computes `gate` for
/// them and `up` for those that need it and applies the activation (gate-less:
/// `ReLU(up + b)`) into `s.gate`. Afterwards `s.active` holds the CPU's active neurons,
/// increasing. Returns the number of `up` rows read. Only the active entries of `s.gate` are
/// meaningful (the axpy reads no other).
#[allow(clippy::too_many_arguments)]
fn sparse_hidden_fused(
    mm: &MatMul<'_>,
    rows: &NeuronRows<'_>,
    threshold: f32,
    cur: &[f32],
    split: &FusedSplit,
    s: &mut FfnScratch,
    scores: Scores<'_>,
    skip: Option<&[bool]>,
) -> Result<usize> {
    let nff = rows.up.rows();
    let n = mm.pool().n_threads();
    let ranges = split.ranges(nff, n);
    if s.scores.len() != nff {
        resize(&mut s.scores, nff);
    }
    if s.gate.len() != nff {
        resize(&mut s.gate, nff);
    }
    if rows.gate.is_some() && s.up.len() != nff {
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
    let predictor_hidden = &s.hidden[..];
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
        if let Scores::Compute(p) = scores {
            m.gemv(&p.fc2().row_range(r.clone())?, predictor_hidden, sc)?;
        }
        match skip {
            Some(on_dev) => {
                let on_dev = &on_dev[r.clone()];
                list.extend(
                    (0..r.len() as u32)
                        .filter(|&i| sc[i as usize] >= threshold && !on_dev[i as usize]),
                );
            }
            None => list.extend((0..r.len() as u32).filter(|&i| sc[i as usize] >= threshold)),
        }
        let gate = rows.gate.map(|g| g.row_range(r.clone())).transpose()?;
        let up = rows.up.row_range(r.clone())?;
        let part = NeuronRows {
            gate: gate.as_ref(),
            up: &up,
            up_bias: rows.up_bias.map(|b| &b[r.clone()]),
            ..*rows
        };
        let mut bufs = TokenBufs {
            g,
            u,
            fired: &mut fired,
        };
        hidden(m, &part, cur, &list, &mut bufs)?;
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
    Ok(match rows.gate {
        Some(_) if matches!(rows.act, FfnAct::Reglu | FfnAct::Drelu) => s
            .fired
            .iter()
            .map(|f| f.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum(),
        _ => s.active.len(),
    })
}

/// [`activate`] over a block of tokens' whole FFN (a dense FFN of a prompt), split between the
/// pool's threads when there are many values ([`for_row_parts`]); each value is computed as by
/// `activate` alone.
pub(crate) fn activate_all(
    mm: &MatMul<'_>,
    act: FfnAct,
    gate: &mut [f32],
    up: &[f32],
) -> Result<()> {
    if up.len() != gate.len() {
        // ReLU reads no `up`; the others return the kernel's length error.
        return Ok(activate(act, gate, up)?);
    }
    for_row_parts(mm, gate, 1, |r, g| activate(act, g, &up[r]))
}
