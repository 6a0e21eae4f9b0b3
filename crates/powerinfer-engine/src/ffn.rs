//! The FFN of one layer for a block of tokens: dense (GGUF files, or `--dense`), sparse
//! (predictor-driven, PowerInfer files) or observed (dense, reporting true activations).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use powerinfer_kernels_cpu::ops::activation::{drelu, reglu, relu, swiglu};
use powerinfer_kernels_cpu::pool::split_range;
use powerinfer_kernels_cpu::{KernelError, MatMul, Weights};

use crate::error::Result;
use crate::forward::{add_bias, ForwardOptions};
use crate::fused::{self, run_threads};
use crate::model::{Ffn, FfnAct, Layer, Model, TensorRef};
use crate::profile::{Laps, Op};

/// In dense mode, zero activations are passed to the axpy kernel as this value so that it does
/// not skip their rows (it skips exact zeros): every neuron's row is then read and added, as a
/// dense product would. `1e-30 · w` is below half an ulp of any output larger than ~1e-22 in
/// magnitude, so the result is unchanged.
const DENSE_TOUCH: f32 = 1e-30;

/// Most threads whose split [`FusedSplit`] learns (more: equal parts).
const SPLIT_MAX_THREADS: usize = 64;

/// Where the one-token sparse FFN's fused dispatch ([`sparse_hidden_fused`]) cuts one layer's
/// neurons among the threads. Each thread computes the predictor scores (`fc2`) of its
/// neurons and then gate/up for those of them that are active, so equal ranges are equal
/// work only where active neurons are spread evenly over the layer. In a file whose neurons
/// are ordered by how often they fire (`powerinfer reorder`) the active ones crowd into the
/// first rows, and equal ranges left one thread with most of the gathering (TinyLlama-shaped
/// Q4_0, 2 threads: 66–68 tok/s instead of 80–82). So the cuts are learned: after each
/// token they are moved to where the work of that token (every neuron's `fc2` row, plus the
/// gate and up rows of the active ones) would have been shared equally, and the next token
/// uses them. Results do not depend on the cuts (every neuron is computed by the same kernel
/// operations whichever thread does it), only the speed does. Shared by every session of an
/// engine through atomics; a stale or torn set of cuts is still a valid split.
#[derive(Debug)]
pub(crate) struct FusedSplit {
    /// Thread count the cuts are for (0: none learned yet).
    n: AtomicUsize,
    /// `cuts[t]`: the first neuron of thread `t + 1`.
    cuts: Box<[AtomicUsize]>,
}

impl Default for FusedSplit {
    fn default() -> Self {
        FusedSplit {
            n: AtomicUsize::new(0),
            cuts: (1..SPLIT_MAX_THREADS)
                .map(|_| AtomicUsize::new(0))
                .collect(),
        }
    }
}

impl FusedSplit {
    /// The neuron ranges of `n` threads over `nff` neurons: the learned cuts when there are
    /// some for `n` threads, else equal parts.
    fn ranges(&self, nff: usize, n: usize) -> Vec<Range<usize>> {
        let equal = || (0..n).map(|t| split_range(nff, n, t)).collect();
        if !(2..=SPLIT_MAX_THREADS).contains(&n) || self.n.load(Ordering::Relaxed) != n {
            return equal();
        }
        let mut out = Vec::with_capacity(n);
        let mut start = 0;
        for t in 0..n {
            let end = if t + 1 == n {
                nff
            } else {
                self.cuts[t].load(Ordering::Relaxed)
            };
            if end < start || end > nff {
                return equal();
            }
            out.push(start..end);
            start = end;
        }
        out
    }

    /// Learns the cuts from one token's dispatch: thread `t` did `ranges[t]` in `times[t]`
    /// ns. Taking each thread's time as spread evenly over its neurons, each cut moves half-way
    /// (and at most `nff / 16`) towards where the threads would have taken equal times.
    fn learn(&self, nff: usize, ranges: &[Range<usize>], times: &[u64]) {
        let n = ranges.len();
        if !(2..=SPLIT_MAX_THREADS).contains(&n) || nff == 0 || times.len() != n {
            return;
        }
        let total: u64 = times.iter().sum();
        if total == 0 {
            return;
        }
        let step = (nff / 16).max(1);
        let (mut k, mut before) = (0usize, 0u64);
        let mut last = 0usize;
        for t in 1..n {
            // Where the cumulative time reaches t/n of the total.
            let target = total as f64 * t as f64 / n as f64;
            while k + 1 < n && (before + times[k]) as f64 <= target {
                before += times[k];
                k += 1;
            }
            let r = &ranges[k];
            let frac = if times[k] > 0 {
                ((target - before as f64) / times[k] as f64).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let ideal = r.start + (frac * r.len() as f64) as usize;
            let old = ranges[t - 1].end;
            let moved = if ideal >= old {
                old + ((ideal - old) / 2).min(step)
            } else {
                old - ((old - ideal) / 2).min(step)
            };
            let cut = moved.clamp(last, nff);
            self.cuts[t - 1].store(cut, Ordering::Relaxed);
            last = cut;
        }
        self.n.store(n, Ordering::Relaxed);
    }
}

/// Sees what each layer's FFN computed, for profiling activations and training or evaluating
/// predictors ([`crate::forward::eval_observed`], [`crate::engine::Session::eval_observed`]).
pub trait FfnObserver {
    /// Called once per layer per evaluated block of `t` tokens, layers in order.
    ///
    /// - `h`: the predictor input, `t × n_embd` (the pre-norm residual `ffn_inp`, spec §4; for
    ///   `falcon` the layer input);
    /// - `act`: the true FFN hidden values after the activation function, `t × n_ff`, every
    ///   neuron computed (a neuron fired for a token when its value is non-zero); for the
    ///   gate-less `falcon` and `opt`, `ReLU(up (+ bias))`;
    /// - `scores`: the predictor scores `t × n_ff` when the layer has a predictor.
    fn observe(&mut self, layer: usize, t: usize, h: &[f32], act: &[f32], scores: Option<&[f32]>);
}

/// Reusable buffers of [`ffn_forward`].
#[derive(Default)]
pub(crate) struct FfnScratch {
    gate: Vec<f32>,
    up: Vec<f32>,
    hidden: Vec<f32>,
    scores: Vec<f32>,
    active: Vec<u32>,
    /// Per thread, the active neurons of its row range (relative to the range start).
    parts: Vec<Mutex<Vec<u32>>>,
    /// The active neurons whose gate fired (see [`gate_fired`]): per thread in the one-token
    /// path, the first entry in the per-token path.
    fired: Vec<Mutex<Vec<u32>>>,
}
fn resize(v: &mut Vec<f32>, n: usize) {
    v.clear();
    v.resize(n, 0.0);
}

fn activate(act: FfnAct, gate: &mut [f32], up: &[f32]) -> Result<()> {
    Ok(activate_k(act, gate, up)?)
}

fn activate_k(act: FfnAct, gate: &mut [f32], up: &[f32]) -> std::result::Result<(), KernelError> {
    match act {
        FfnAct::Reglu => reglu(gate, up)?,
        FfnAct::Drelu => drelu(gate, up)?,
        FfnAct::Swiglu => swiglu(gate, up)?,
        // Gate-less FFNs are activated in place by their callers.
        FfnAct::Relu => relu(gate),
    }
    Ok(())
}

/// Predictor scores `t × n_ff` of `h` into `s.scores`.
fn predict(
    mm: &MatMul<'_>,
    model: &Model,
    layer: &Layer,
    h: &[f32],
    t: usize,
    s: &mut FfnScratch,
) -> Result<()> {
    if let Ffn::Sparse { fc1, fc2, .. } = &layer.ffn {
        resize(&mut s.hidden, t * fc1.rows);
        resize(&mut s.scores, t * fc2.rows);
        mm.gemm(&model.weights(fc1)?, h, t, &mut s.hidden)?;
        relu(&mut s.hidden);
        mm.gemm(&model.weights(fc2)?, &s.hidden, t, &mut s.scores)?;
    }
    Ok(())
}

/// `out = FFN(cur)` for `t` tokens (`h` = `ffn_inp`, the predictor input); adds each token's
/// share of computed neurons (this layer) to `density`. With an observer the FFN is computed
/// densely and reported.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ffn_forward<'o>(
    model: &Model,
    mm: &MatMul<'_>,
    opts: ForwardOptions,
    index: usize,
    layer: &Layer,
    h: &[f32],
    cur: &[f32],
    t: usize,
    s: &mut FfnScratch,
    out: &mut [f32],
    density: &mut [f32],
    observer: Option<&mut (dyn FfnObserver + 'o)>,
    laps: &mut Laps<'_>,
) -> Result<()> {
    let nff = model.hparams.n_ff;
    let gate_up_bytes = || layer.ffn.gate().map_or(0, TensorRef::bytes) + layer.ffn.up().bytes();
    // Bytes of the gate and up rows of one neuron.
    // Bytes of `n_gate` gate rows and `n_up` up rows (the sparse paths read fewer up rows
    // where the gate did not fire, see `gate_fired`).
    let gate_up_rows = |n_gate: u64, n_up: u64| {
        n_gate * layer.ffn.gate().map_or(0, TensorRef::row_bytes)
            + n_up * layer.ffn.up().row_bytes()
    };
    let down_ref = match &layer.ffn {
        Ffn::Dense { down, .. } => down,
        Ffn::Sparse { down_t, .. } => down_t,
    };
    let predictor_bytes = || match &layer.ffn {
        Ffn::Sparse { fc1, fc2, .. } => fc1.bytes() + fc2.bytes(),
        Ffn::Dense { .. } => 0,
    };
    let gate = layer.ffn.gate();
    let fused_sparse = t == 1
        && fused::enabled()
        && observer.is_none()
        && !opts.dense
        && matches!(layer.ffn, Ffn::Sparse { .. });
    if !fused_sparse {
        resize(&mut s.gate, t * nff);
        if gate.is_some() {
            resize(&mut s.up, t * nff);
        }
    }
    if let Some(obs) = observer {
        predict(mm, model, layer, h, t, s)?;
        laps.lap(Op::Predictor, predictor_bytes);
        hidden_dense(model, mm, layer, cur, t, s)?;
        let scores = matches!(layer.ffn, Ffn::Sparse { .. }).then_some(&s.scores[..]);
        obs.observe(index, t, h, &s.gate, scores);
        laps.lap(Op::FfnUpGate, gate_up_bytes);
        down_dense(model, mm, layer, &mut s.gate, t, out)?;
        add_bias(out, layer.down_b.as_deref())?;
        laps.lap(Op::FfnDown, || down_ref.bytes());
        density.iter_mut().for_each(|d| *d += 1.0);
        return Ok(());
    }
    match &layer.ffn {
        Ffn::Dense { .. } => {
            hidden_dense(model, mm, layer, cur, t, s)?;
            laps.lap(Op::FfnUpGate, gate_up_bytes);
            down_dense(model, mm, layer, &mut s.gate, t, out)?;
            add_bias(out, layer.down_b.as_deref())?;
            laps.lap(Op::FfnDown, || down_ref.bytes());
            density.iter_mut().for_each(|d| *d += 1.0);
        }
        Ffn::Sparse { .. } if opts.dense => {
            hidden_dense(model, mm, layer, cur, t, s)?;
            laps.lap(Op::FfnUpGate, gate_up_bytes);
            down_dense(model, mm, layer, &mut s.gate, t, out)?;
            add_bias(out, layer.down_b.as_deref())?;
            laps.lap(Op::FfnDown, || down_ref.bytes());
            density.iter_mut().for_each(|d| *d += 1.0);
        }
        Ffn::Sparse {
            up,
            down_t,
            fc1,
            fc2,
            ..
        } if fused_sparse => {
            // One token: fc1, then fc2 + the active list + gate/up + activation in one
            // dispatch (each thread its own range of neurons), then the axpy.
            resize(&mut s.hidden, fc1.rows);
            mm.gemv(&model.weights(fc1)?, h, &mut s.hidden)?;
            relu(&mut s.hidden);
            laps.lap(Op::Predictor, || fc1.bytes());
            let gate_w = match gate {
                Some(g) => Some(model.weights(g)?),
                None => None,
            };
            let up_w = model.weights(up)?;
            let split = model.fused_split(index);
            let n_up = sparse_hidden_fused(
                mm,
                &model.weights(fc2)?,
                gate_w.as_ref(),
                &up_w,
                layer.up_b.as_deref(),
                model.ffn_act,
                opts.threshold,
                cur,
                split,
                s,
            )?;
            let n_active = s.active.len() as u64;
            laps.lap(Op::FfnUpGate, || {
                fc2.bytes() + gate_up_rows(n_active, n_up as u64)
            });
            out.fill(0.0);
            mm.sparse_axpy_indexed(&model.weights(down_t)?, &s.gate, &s.active, out)?;
            density[0] += s.active.len() as f32 / nff as f32;
            add_bias(out, layer.down_b.as_deref())?;
            // The axpy reads the rows of the active neurons whose activation is not zero.
            laps.lap(Op::FfnDown, || {
                nonzero(&s.gate, &s.active) * down_t.row_bytes()
            });
        }
        Ffn::Sparse { up, down_t, .. } => {
            predict(mm, model, layer, h, t, s)?;
            laps.lap(Op::Predictor, predictor_bytes);
            out.fill(0.0);
            // Token by token: the active list once, then the indexed kernels (the axpy's
            // four-row fast path); the predictor above ran once for all tokens. For blocks
            // this beat the products over the union of the block's active rows
            // (`sparse_gemm`, `sparse_axpy_batch`), paired runs, tinyllama shape, 2 threads:
            // 128-token prompt 1113/835 vs 1529/1035 ms (F16), 656/630 vs 1448/879 ms (Q4_0);
            // 8 sequences decoded together (Q4_0) 136-142 vs 83-93 tok/s.
            let ne = out.len() / t;
            let gate_w = match gate {
                Some(g) => Some(model.weights(g)?),
                None => None,
            };
            let (up_w, down_w) = (model.weights(up)?, model.weights(down_t)?);
            for i in 0..t {
                let scores = &s.scores[i * nff..][..nff];
                s.active.clear();
                s.active
                    .extend((0..nff as u32).filter(|&j| scores[j as usize] >= opts.threshold));
                let x = &cur[i * ne..][..ne];
                let g = &mut s.gate[i * nff..][..nff];
                let mut n_up = 0;
                let y = &mut out[i * ne..][..ne];
                if let Some(gate_w) = &gate_w {
                    let u = &mut s.up[i * nff..][..nff];
                    mm.sparse_gemv_indexed(gate_w, x, &s.active, g)?;
                    if s.fired.is_empty() {
                        s.fired.push(Mutex::new(Vec::new()));
                    }
                    let fired = s.fired[0].get_mut().unwrap_or_else(|e| e.into_inner());
                    let up_rows = gate_fired(model.ffn_act, g, &s.active, fired);
                    mm.sparse_gemv_indexed(&up_w, x, up_rows, u)?;
                    n_up = up_rows.len() as u64;
                    activate(model.ffn_act, g, u)?;
                } else {
                    // ReLU(up + b) on the active neurons (the axpy reads no other).
                    mm.sparse_gemv_indexed(&up_w, x, &s.active, g)?;
                    relu_bias_active(g, &s.active, layer.up_b.as_deref());
                }
                let n_active = s.active.len() as u64;
                if gate_w.is_none() {
                    n_up = n_active;
                }
                laps.lap(Op::FfnUpGate, || gate_up_rows(n_active, n_up));
                mm.sparse_axpy_indexed(&down_w, g, &s.active, y)?;
                density[i] += s.active.len() as f32 / nff as f32;
                laps.lap(Op::FfnDown, || nonzero(g, &s.active) * down_t.row_bytes());
            }
            add_bias(out, layer.down_b.as_deref())?;
            laps.lap(Op::Other, || 0);
        }
    }
    Ok(())
}

/// The FFN hidden values of every neuron into `s.gate`: `act(gate·x, up·x)` for a gated FFN,
/// `ReLU(up·x + b)` for a gate-less one.
fn hidden_dense(
    model: &Model,
    mm: &MatMul<'_>,
    layer: &Layer,
    cur: &[f32],
    t: usize,
    s: &mut FfnScratch,
) -> Result<()> {
    let up = layer.ffn.up();
    match layer.ffn.gate() {
        Some(gate) => {
            if t == 1 && fused::enabled() {
                model.products_one_token(
                    mm,
                    &mut [(gate, cur, &mut s.gate), (up, cur, &mut s.up)],
                )?;
            } else {
                model.product(mm, gate, cur, t, &mut s.gate)?;
                model.product(mm, up, cur, t, &mut s.up)?;
            }
            activate(model.ffn_act, &mut s.gate, &s.up)?;
        }
        None => {
            model.product(mm, up, cur, t, &mut s.gate)?;
            add_bias(&mut s.gate, layer.up_b.as_deref())?;
            relu(&mut s.gate);
        }
    }
    Ok(())
}

/// `out = down · act` for `t` tokens over every neuron: a GEMM for a dense file's `ffn_down`,
/// an axpy walking all `n_ff` rows of a PowerInfer file's `ffn_down_t` (zeros touched, see
/// [`DENSE_TOUCH`]). `act` is clobbered.
fn down_dense(
    model: &Model,
    mm: &MatMul<'_>,
    layer: &Layer,
    act: &mut [f32],
    t: usize,
    out: &mut [f32],
) -> Result<()> {
    let nff = model.hparams.n_ff;
    let ne = model.hparams.n_embd;
    match &layer.ffn {
        Ffn::Dense { down, .. } => model.product(mm, down, act, t, out)?,
        Ffn::Sparse { down_t, .. } => {
            let all: Vec<u32> = (0..nff as u32).collect();
            let down = model.weights(down_t)?;
            out.fill(0.0);
            for (a, y) in act.chunks_exact_mut(nff).zip(out.chunks_exact_mut(ne)) {
                a.iter_mut()
                    .filter(|a| **a == 0.0)
                    .for_each(|a| *a = DENSE_TOUCH);
                mm.sparse_axpy_indexed(&down, a, &all, y)?;
            }
        }
    }
    Ok(())
}

/// One token of a sparse FFN, in one dispatch: each thread takes a contiguous range of neurons
/// (cut where `split` says, see [`FusedSplit`]), computes their predictor scores (`fc2 · hidden` into `s.scores`), lists its active ones
/// (`score ≥ threshold`), computes `gate` for them and `up` for those that need it
/// ([`gate_fired`]) and applies the activation (gate-less: `ReLU(up + b)`) into `s.gate`.
/// Afterwards `s.active` holds all active neurons, increasing. Returns the number of `up`
/// rows read.
/// Only the active entries of `s.gate` are meaningful (the axpy reads no other).
#[allow(clippy::too_many_arguments)]
fn sparse_hidden_fused(
    mm: &MatMul<'_>,
    fc2: &Weights<'_>,
    gate: Option<&Weights<'_>>,
    up: &Weights<'_>,
    up_b: Option<&[f32]>,
    act: FfnAct,
    threshold: f32,
    cur: &[f32],
    split: &FusedSplit,
    s: &mut FfnScratch,
) -> Result<usize> {
    let nff = fc2.rows();
    let n = mm.pool().n_threads();
    let ranges = split.ranges(nff, n);
    if s.scores.len() != nff {
        resize(&mut s.scores, nff);
    }
    if s.gate.len() != nff {
        resize(&mut s.gate, nff);
    }
    if gate.is_some() && s.up.len() != nff {
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
        m.gemv(&fc2.row_range(r.clone())?, hidden, sc)?;
        list.extend((0..r.len() as u32).filter(|&i| sc[i as usize] >= threshold));
        match gate {
            Some(gw) => {
                m.sparse_gemv_indexed(&gw.row_range(r.clone())?, cur, &list, g)?;
                let up_rows = gate_fired(act, g, &list, &mut fired);
                m.sparse_gemv_indexed(&up.row_range(r.clone())?, cur, up_rows, u)?;
                for &i in up_rows {
                    let i = i as usize;
                    activate_k(act, &mut g[i..i + 1], &u[i..i + 1])?;
                }
            }
            None => {
                // ReLU(up + b) on the active neurons.
                m.sparse_gemv_indexed(&up.row_range(r.clone())?, cur, &list, g)?;
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
    Ok(match gate {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Under ReLU-gated activations only the listed neurons whose gate is positive need their
    /// `up` row; the others get an exact 0, and the activation over the fired rows gives what
    /// it gives over every listed row. Other activations need every listed row.
    #[test]
    fn up_rows_only_where_the_gate_fired() {
        let gate0 = [0.5f32, -1.0, 0.0, 2.0, f32::NAN, -0.0, 3.0];
        let up = [2.0f32, 5.0, -7.0, -1.5, 4.0, 1.0, 0.25];
        let active = [0u32, 1, 2, 3, 4, 5];
        for act in [FfnAct::Reglu, FfnAct::Drelu] {
            let mut gate = gate0;
            let mut fired = vec![99];
            let rows = gate_fired(act, &mut gate, &active, &mut fired).to_vec();
            assert_eq!(rows, [0, 3], "{act:?}");
            for i in [1usize, 2, 4, 5] {
                assert_eq!(gate[i].to_bits(), 0f32.to_bits(), "{act:?} neuron {i}");
            }
            assert_eq!(gate[6], 3.0, "unlisted neurons untouched");
            // The activation of the fired rows, against the activation of every listed row.
            let mut all = gate0;
            activate_k(act, &mut all, &up).unwrap();
            for &i in &rows {
                let i = i as usize;
                activate_k(act, &mut gate[i..i + 1], &up[i..i + 1]).unwrap();
            }
            for &i in &active {
                let i = i as usize;
                assert_eq!(gate[i], all[i], "{act:?} neuron {i}");
            }
        }
        let mut gate = gate0;
        let mut fired = Vec::new();
        let rows = gate_fired(FfnAct::Swiglu, &mut gate, &active, &mut fired);
        assert_eq!(rows, active);
        assert_eq!(gate[1], -1.0);
    }

    /// Cuts move half-way (at most `nff / 16`) towards equal times, stay increasing and inside
    /// the layer, and are used only for the thread count they were learned for.
    #[test]
    fn fused_split_moves_towards_equal_times() {
        let split = FusedSplit::default();
        assert_eq!(split.ranges(100, 2), vec![0..50, 50..100]);
        // Thread 0 took 3× as long: equal times at neuron 33 (200 of its 300 ns).
        split.learn(100, &[0..50, 50..100], &[300, 100]);
        assert_eq!(
            split.ranges(100, 2),
            vec![0..44, 44..100],
            "half-way, at most 6"
        );
        assert_eq!(
            split.ranges(100, 3),
            vec![0..34, 34..67, 67..100],
            "other count"
        );
        let r = split.ranges(1000, 2);
        split.learn(1000, &r, &[100, 100]);
        assert_eq!(split.ranges(1000, 2), r, "balanced: no move");
        // Three threads, the last one slow: the cuts move right, in order.
        let r3 = vec![0..300, 300..600, 600..900];
        split.learn(900, &r3, &[100, 100, 400]);
        let got = split.ranges(900, 3);
        assert!(got[0].end > 300 && got[1].end > 600, "{got:?}");
        assert!(got[0].end <= got[1].end && got[1].end <= 900, "{got:?}");
        // Zero times and one thread learn nothing.
        split.learn(900, &got, &[0, 0, 0]);
        assert_eq!(split.ranges(900, 3), got);
        split.learn(900, std::slice::from_ref(&(0..900)), &[5]);
        assert_eq!(split.ranges(900, 1), vec![0..900]);
    }
}
