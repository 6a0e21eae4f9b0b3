//! The CUDA device: `powerinfer-kernels-cuda` on an NVIDIA GPU.
//!
//! Everything lives on the GPU and runs on one stream: weights (`DeviceTensor`, and `GpuSlice`
//! for a layer's hot neuron rows in bucket order), the engine's buffers, the KV stores, and the
//! scratch the kernels need (reserved at load, so nothing is allocated while decoding). Each
//! [`Op`] becomes one or a few kernel launches queued on the stream, and `enqueue` returns at
//! once. Copies to the device go through pinned host buffers (`write`); copies to the host
//! land in pinned buffers and are waited for by their event alone (`wait`): the host never
//! synchronizes the whole device inside a step. Marks are timed events.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use half::f16;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ffn::FfnAct;
use powerinfer_kernels_cpu::ops::rope::RopeMode as CpuRope;
use powerinfer_kernels_cpu::Weights;
use powerinfer_kernels_cuda::{
    Binary, CudaError, DeviceBuffer, DeviceTensor, DeviceView, DeviceViewMut, Gate, Gpu, GpuSlice,
    Graph, KvCache, NoGpu, PinnedBuffer, Product, RopeMode, TimedEvent, Unary,
};

use super::{
    converts_activation, entry, entry_mut, free_entry, masked_flags, norm_conversion_run,
    program_launches, shared_activation_run, unknown_kv, BufId, Conversion, Device, GraphCache,
    HotFfnOp, HotId, HotKind, HotSpec, HotSwap, KvId, KvRows, KvShape, MatId, Op, PredictorOp,
    ReadId, RowsOf, ScratchShape, Sighting, Span, Traffic, TrafficCounters,
};
use crate::error::{EngineError, Result};

fn cuda(e: CudaError) -> EngineError {
    e.into()
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> EngineError {
        match e {
            CudaError::Budget(b) => EngineError::DeviceMemory {
                requested: b.requested,
                used: b.used,
                limit: b.limit,
            },
            other => EngineError::Device(other.to_string()),
        }
    }
}

/// The gating kernel of a gated FFN's activation.
fn gate_op(act: FfnAct) -> Binary {
    match act {
        FfnAct::Swiglu => Binary::SiluGate,
        FfnAct::Drelu => Binary::DreluGate,
        _ => Binary::ReluGate,
    }
}

/// The fused gated products' activation for a hot FFN's `act` (as [`gate_op`]).
fn gate_kind(act: FfnAct) -> Gate {
    match act {
        FfnAct::Swiglu => Gate::Silu,
        FfnAct::Drelu => Gate::Drelu,
        _ => Gate::Relu,
    }
}

/// Layer `layer` of KV store `kv`.
fn kv_layer(kvs: &[Vec<KvCache>], kv: KvId, layer: usize) -> Result<&KvCache> {
    kvs.get(kv.0)
        .and_then(|l| l.get(layer))
        .ok_or_else(|| unknown_kv(kv))
}

/// Layer `layer` of KV store `kv`, to write.
fn kv_layer_mut(kvs: &mut [Vec<KvCache>], kv: KvId, layer: usize) -> Result<&mut KvCache> {
    kvs.get_mut(kv.0)
        .and_then(|l| l.get_mut(layer))
        .ok_or_else(|| unknown_kv(kv))
}

/// A layer's hot rows on the GPU.
struct CudaHot {
    gate: Option<GpuSlice>,
    up: GpuSlice,
    down: GpuSlice,
    /// Host copy of the bucket (device row `j` = neuron `bucket[j]`).
    bucket: Vec<u32>,
    /// Per neuron, 0 where the device computes it and NaN where it does not (added to the
    /// scores when `masked`; allocated with the slice, so enabling allocates nothing).
    mask: DeviceBuffer<f32>,
    /// Whether `mask` applies (else the device computes every held neuron).
    masked: bool,
    /// `ffn_up.bias` of every neuron (gate-less FFNs).
    up_bias: Option<DeviceBuffer<f32>>,
    act: FfnAct,
}

impl CudaHot {
    fn kind(&self) -> HotKind {
        HotKind {
            masked: self.masked,
            gated: self.gate.is_some(),
            converts: converts_activation(self.up.weight().ty()),
            up_bias: self.up_bias.is_some(),
            f16_down: self.down.weight().ty() == GgmlType::F16,
        }
    }
}

/// The kernels' own scratch, for steps of up to `t` tokens.
struct Scratch {
    t: usize,
    /// The step's token ids and positions (and the positions on the host, to check ops against).
    ids: DeviceBuffer<i32>,
    pos: DeviceBuffer<i32>,
    host_pos: Vec<u32>,
    /// Attention scores (`t × n_head × ctx`).
    attn: DeviceBuffer<f32>,
    /// The hot FFN's masked scores, up and gate products and activations (`t × n_ff` each).
    masked: DeviceBuffer<f32>,
    up: DeviceBuffer<f32>,
    gate: DeviceBuffer<f32>,
    act: DeviceBuffer<f32>,
}

/// A copy to the host in flight: its pinned buffer.
struct PendingRead {
    buf: PinnedBuffer<f32>,
    /// Values read (the buffer may be longer).
    len: usize,
}

/// Everything on the device, behind one lock: operations queue under it.
#[derive(Default)]
struct State {
    mats: Vec<DeviceTensor>,
    /// `None` while an operation writes it.
    bufs: Vec<Option<DeviceBuffer<f32>>>,
    hots: Vec<Option<CudaHot>>,
    /// Per store, per layer.
    kvs: Vec<Vec<KvCache>>,
    scratch: Option<Scratch>,
    reads: HashMap<u64, PendingRead>,
    next_read: u64,
    /// Pinned buffers by length, free for the next copy (each waits for its last copy before
    /// it is written or read again).
    pinned: HashMap<usize, Vec<PinnedBuffer<f32>>>,
    pinned_i32: HashMap<usize, Vec<PinnedBuffer<i32>>>,
    /// Timed events of the marks.
    marks: HashMap<usize, TimedEvent>,
    /// Captured programs (a decode step has a few per layer; a lookup compares ops, which
    /// differ from the first one for programs of other layers).
    graphs: GraphCache<Graph>,
}

/// Per hot FFN of `ops`, whether its enabled mask applies.
fn masked_of(hots: &[Option<CudaHot>], ops: &[Op]) -> Vec<bool> {
    masked_flags(ops, |h| {
        (hots.get(h.0).and_then(Option::as_ref)).is_some_and(|h| h.masked)
    })
}

/// An NVIDIA GPU through `powerinfer-kernels-cuda`.
pub(crate) struct CudaDevice {
    gpu: Gpu,
    state: Mutex<State>,
    traffic: TrafficCounters,
    /// Programs are captured as CUDA graphs and replayed ([`DeviceOptions::graphs`]).
    ///
    /// [`DeviceOptions::graphs`]: crate::schedule::DeviceOptions::graphs
    graphs: bool,
}

/// Buffer `id`.
fn buf(bufs: &[Option<DeviceBuffer<f32>>], id: BufId) -> Result<&DeviceBuffer<f32>> {
    bufs.get(id.0).and_then(Option::as_ref).ok_or_else(|| {
        EngineError::Device(format!(
            "device buffer {}: unknown, or an operation reads the buffer it writes",
            id.0
        ))
    })
}

fn view(bufs: &[Option<DeviceBuffer<f32>>], s: Span) -> Result<DeviceView<'_, f32>> {
    buf(bufs, s.buf)?.view(s.off, s.len).map_err(cuda)
}

/// The held matrices `ms`.
fn held_mats<'m>(mats: &'m [DeviceTensor], ms: &[MatId]) -> Result<Vec<&'m DeviceTensor>> {
    (ms.iter())
        .map(|m| {
            mats.get(m.0)
                .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", m.0)))
        })
        .collect()
}

/// Runs `f` with the buffers and a write view of `y`, whose buffer is taken out of the table
/// meanwhile (so that `f` cannot read it through the table).
fn with_out<R>(
    bufs: &mut [Option<DeviceBuffer<f32>>],
    y: Span,
    f: impl FnOnce(&[Option<DeviceBuffer<f32>>], DeviceViewMut<'_, f32>) -> Result<R>,
) -> Result<R> {
    let mut out = bufs
        .get_mut(y.buf.0)
        .and_then(Option::take)
        .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", y.buf.0)))?;
    let r = out
        .view_mut(y.off, y.len)
        .map_err(cuda)
        .and_then(|v| f(bufs, v));
    bufs[y.buf.0] = Some(out);
    r
}

/// The scores a hot FFN reads: the masked copy in the scratch when a mask applies, else the
/// scores where they are.
fn hot_scores<'a>(
    bufs: &'a [Option<DeviceBuffer<f32>>],
    masked: Option<&'a DeviceBuffer<f32>>,
    scores: Span,
    tn: usize,
) -> Result<DeviceView<'a, f32>> {
    match masked {
        Some(m) => m.view(0, tn).map_err(cuda),
        None => view(bufs, scores),
    }
}

/// Runs `f` with the buffers and write views of the spans `ys`, each in a buffer of its own,
/// taken out of the table meanwhile (as [`with_out`]).
fn with_outs<R>(
    bufs: &mut [Option<DeviceBuffer<f32>>],
    ys: &[Span],
    f: impl FnOnce(&[Option<DeviceBuffer<f32>>], Vec<DeviceViewMut<'_, f32>>) -> Result<R>,
) -> Result<R> {
    let mut outs = Vec::with_capacity(ys.len());
    for y in ys {
        match bufs.get_mut(y.buf.0).and_then(Option::take) {
            Some(b) => outs.push(b),
            None => {
                for (b, y) in outs.into_iter().zip(ys) {
                    bufs[y.buf.0] = Some(b);
                }
                return Err(EngineError::Device(format!(
                    "unknown (or repeated) device buffer {}",
                    y.buf.0
                )));
            }
        }
    }
    let views: Result<Vec<_>> = (outs.iter_mut().zip(ys))
        .map(|(b, y)| b.view_mut(y.off, y.len).map_err(cuda))
        .collect();
    let r = views.and_then(|v| f(bufs, v));
    for (b, y) in outs.into_iter().zip(ys) {
        bufs[y.buf.0] = Some(b);
    }
    r
}

impl CudaDevice {
    /// Opens GPU `ordinal` with a budget of `budget` bytes (default: 90% of its memory less
    /// 256 MiB, as PowerInfer leaves some room).
    pub(crate) fn open(
        ordinal: usize,
        budget: Option<u64>,
        graphs: bool,
    ) -> std::result::Result<Self, NoGpu> {
        let gpu = Gpu::open(ordinal, None)?;
        let total = gpu.info().total_memory;
        let default = (total / 10 * 9).saturating_sub(256 << 20);
        let limit = budget.unwrap_or(default).min(total / 10 * 9);
        drop(gpu);
        // Everything the device queues goes to the GPU's one stream: its buffers need none of
        // cudarc's per-launch cross-stream events.
        let gpu = Gpu::open_one_stream(ordinal, Some(limit))?;
        Ok(CudaDevice {
            gpu,
            state: Mutex::new(State::default()),
            traffic: TrafficCounters::default(),
            graphs,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn slice(&self, w: &Weights<'_>, bucket: &[u32]) -> Result<GpuSlice> {
        GpuSlice::upload(
            &self.gpu,
            self.gpu.stream(),
            w.ty(),
            w.cols(),
            w.data(),
            w.rows(),
            bucket,
        )
        .map_err(cuda)
    }

    fn pinned(&self, st: &mut State, len: usize) -> Result<PinnedBuffer<f32>> {
        match st.pinned.get_mut(&len).and_then(Vec::pop) {
            Some(b) => Ok(b),
            None => self.gpu.alloc_pinned::<f32>(len).map_err(cuda),
        }
    }

    /// The kernel launches of program `ops` ([`program_launches`]).
    fn launches(&self, st: &State, ops: &[Op]) -> u64 {
        let hot = |h: HotId| {
            (st.hots.get(h.0).and_then(Option::as_ref)).map_or(HotKind::default(), CudaHot::kind)
        };
        program_launches(ops, |m| Self::conversion(st, m), hot)
    }

    /// How a held matrix's products convert their activation.
    fn conversion(st: &State, m: MatId) -> Conversion {
        let d = st.mats.get(m.0)?;
        converts_activation(d.ty()).then(|| (d.ty(), d.cols()))
    }

    /// Queues a program: its ops in order, the products that share an activation
    /// ([`shared_activation_run`]) with one conversion.
    fn run(&self, st: &mut State, ops: &[Op]) -> Result<()> {
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
    fn norm_products(&self, st: &mut State, norm: &Op, products: &[Op]) -> Result<()> {
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
    fn shared_products(&self, st: &mut State, ops: &[Op]) -> Result<()> {
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
    fn op(&self, st: &mut State, op: &Op) -> Result<()> {
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
                let (n_head, n) = (a.params.n_head, a.n);
                let cache = kv_layer_mut(kvs, a.kv, a.layer)?;
                let sc = scratch.as_mut().ok_or_else(no_scratch)?;
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

    /// Queues `ops` with graphs: marks as they are, each run between them as a graph,
    /// captured the first time it is seen (ops and [`masked_of`]) and replayed after (one
    /// launch).
    fn replay(&self, st: &mut State, ops: &[Op]) -> Result<()> {
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
    fn hot_products(
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
    fn hot_ffn(
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

impl Device for CudaDevice {
    fn name(&self) -> String {
        let i = self.gpu.info();
        let graphs = if self.graphs { ", graphs" } else { "" };
        format!("cuda:{} ({}{graphs})", i.ordinal, i.name)
    }

    fn memory(&self) -> (u64, u64, u64) {
        let b = self.gpu.budget();
        (b.limit(), b.used(), b.peak())
    }

    fn supports(&self, ty: GgmlType) -> bool {
        powerinfer_kernels_cuda::tensor::SUPPORTED_TYPES.contains(&ty)
    }

    fn traffic(&self) -> Traffic {
        self.traffic.get()
    }

    fn scratch_bytes(&self, sh: &ScratchShape) -> u64 {
        let t = sh.t.max(1) as u64;
        4 * (2 * t + t * (sh.n_head * sh.ctx) as u64 + 4 * t * sh.n_ff as u64 + t * sh.cols as u64)
    }

    fn reserve_scratch(&self, sh: &ScratchShape) -> Result<()> {
        let (g, s) = (&self.gpu, self.gpu.stream());
        let t = sh.t.max(1);
        let f = |n: usize| g.alloc_zeros::<f32>(s, n).map_err(cuda);
        let scratch = Scratch {
            t,
            ids: g.alloc_zeros::<i32>(s, t).map_err(cuda)?,
            pos: g.alloc_zeros::<i32>(s, t).map_err(cuda)?,
            host_pos: Vec::with_capacity(t),
            attn: f(t * sh.n_head * sh.ctx)?,
            masked: f(t * sh.n_ff)?,
            up: f(t * sh.n_ff)?,
            gate: f(t * sh.n_ff)?,
            act: f(t * sh.n_ff)?,
        };
        g.reserve_activation(s, t * sh.cols).map_err(cuda)?;
        let mut st = self.state();
        // Captured programs point at the scratch they were captured with.
        st.graphs.clear();
        st.scratch = Some(scratch);
        Ok(())
    }

    fn upload(&self, w: &Weights<'_>) -> Result<MatId> {
        let t = DeviceTensor::upload(
            &self.gpu,
            self.gpu.stream(),
            w.ty(),
            w.rows(),
            w.cols(),
            w.data(),
        )
        .map_err(cuda)?;
        let mut st = self.state();
        st.mats.push(t);
        Ok(MatId(st.mats.len() - 1))
    }

    fn upload_vec(&self, v: &[f32]) -> Result<BufId> {
        let b = self.gpu.upload(self.gpu.stream(), v).map_err(cuda)?;
        let mut st = self.state();
        st.bufs.push(Some(b));
        Ok(BufId(st.bufs.len() - 1))
    }

    fn alloc(&self, len: usize) -> Result<BufId> {
        let b = self
            .gpu
            .alloc_zeros::<f32>(self.gpu.stream(), len)
            .map_err(cuda)?;
        let mut st = self.state();
        st.bufs.push(Some(b));
        Ok(BufId(st.bufs.len() - 1))
    }

    fn upload_hot(&self, spec: &HotSpec<'_>) -> Result<HotId> {
        let s = self.gpu.stream();
        let hot = CudaHot {
            gate: spec
                .gate
                .as_ref()
                .map(|g| self.slice(g, spec.bucket))
                .transpose()?,
            up: self.slice(&spec.up, spec.bucket)?,
            down: self.slice(&spec.down_t, spec.bucket)?,
            bucket: spec.bucket.to_vec(),
            mask: self
                .gpu
                .alloc_zeros::<f32>(s, spec.up.rows())
                .map_err(cuda)?,
            masked: false,
            up_bias: spec
                .up_bias
                .map(|b| self.gpu.upload(s, b))
                .transpose()
                .map_err(cuda)?,
            act: spec.act,
        };
        let mut st = self.state();
        st.hots.push(Some(hot));
        Ok(HotId(st.hots.len() - 1))
    }

    fn replace_hot(&self, hot: HotId, swap: &HotSwap<'_>) -> Result<Duration> {
        let (slots, neurons, spec) = (swap.slots(), swap.neurons(), swap.spec);
        let start = Instant::now();
        let mut st = self.state();
        let h = entry_mut(&mut st.hots, hot.0, "hot slice")?;
        if h.gate.is_some() != spec.gate.is_some() || h.up_bias.is_some() != spec.up_bias.is_some()
        {
            return Err(EngineError::Device(
                "replacement rows do not match the hot slice's matrices".into(),
            ));
        }
        let mut bucket = h.bucket.clone();
        for (&s, &n) in slots.iter().zip(neurons) {
            let slot = bucket.get_mut(s as usize).ok_or_else(|| {
                EngineError::Device(format!(
                    "slot {s} outside the hot slice's {}",
                    h.bucket.len()
                ))
            })?;
            *slot = n;
        }
        let s = self.gpu.stream();
        let mut bytes = 4 * slots.len() as u64;
        if let (Some(g), Some(w)) = (h.gate.as_mut(), spec.gate.as_ref()) {
            g.replace_rows(s, w.data(), slots, &bucket).map_err(cuda)?;
            bytes += (slots.len() * w.row_bytes()) as u64;
        }
        h.up.replace_rows(s, spec.up.data(), slots, &bucket)
            .map_err(cuda)?;
        h.down
            .replace_rows(s, spec.down_t.data(), slots, &bucket)
            .map_err(cuda)?;
        bytes += (slots.len() * (spec.up.row_bytes() + spec.down_t.row_bytes())) as u64;
        h.bucket = bucket;
        // The new rows are computed (their neurons' mask entries opened); the old neurons'
        // entries no longer matter (the bucket does not hold them).
        if h.masked {
            let mut host = h.mask.to_host(s).map_err(cuda)?;
            for &n in neurons {
                host[n as usize] = 0.0;
            }
            h.mask.copy_from(s, &host).map_err(cuda)?;
        }
        // The copies are waited for: the measured time prices the next migrations.
        s.synchronize().map_err(cuda)?;
        self.traffic.waited();
        self.traffic.moved(bytes);
        Ok(start.elapsed())
    }

    fn set_enabled(&self, hot: HotId, enabled: Option<&[bool]>) -> Result<()> {
        let s = self.gpu.stream();
        let mut st = self.state();
        let h = entry_mut(&mut st.hots, hot.0, "hot slice")?;
        let Some(e) = enabled else {
            h.masked = false;
            return Ok(());
        };
        if e.len() != h.bucket.len() {
            return Err(EngineError::Device(format!(
                "{} enabled flags for {} slots",
                e.len(),
                h.bucket.len()
            )));
        }
        // NaN, not -inf: a score plus NaN is below every threshold, -inf included.
        let mut host = vec![0f32; h.up.n_neurons()];
        for (&n, &on) in h.bucket.iter().zip(e) {
            if !on {
                host[n as usize] = f32::NAN;
            }
        }
        h.mask.copy_from(s, &host).map_err(cuda)?;
        h.masked = true;
        self.traffic.moved(4 * host.len() as u64);
        Ok(())
    }

    fn drop_hot(&self, hot: HotId) -> Result<()> {
        let mut st = self.state();
        // Captured programs may point at the slice's memory.
        st.graphs.clear();
        free_entry(&mut st.hots, hot.0, "hot slice")
    }

    fn alloc_kv(&self, sh: KvShape) -> Result<KvId> {
        let s = self.gpu.stream();
        let store = (0..sh.layers)
            .map(|_| KvCache::new(&self.gpu, s, sh.positions, sh.n_kv_head, sh.head_dim))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(cuda)?;
        let mut st = self.state();
        st.kvs.push(store);
        Ok(KvId(st.kvs.len() - 1))
    }

    fn write_kv(&self, kv: KvId, layer: usize, start: usize, k: &[f16], v: &[f16]) -> Result<()> {
        let mut st = self.state();
        let cache = kv_layer_mut(&mut st.kvs, kv, layer)?;
        let bits = |x: &[f16]| x.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
        cache
            .write(self.gpu.stream(), start, &bits(k), &bits(v))
            .map_err(cuda)?;
        self.traffic.moved(4 * k.len() as u64);
        Ok(())
    }

    fn read_kv(&self, kv: KvId, layer: usize, start: usize, n: usize) -> Result<KvRows> {
        let st = self.state();
        let cache = kv_layer(&st.kvs, kv, layer)?;
        let (k, v) = cache.read(self.gpu.stream(), start, n).map_err(cuda)?;
        self.traffic.waited();
        self.traffic.moved(4 * k.len() as u64);
        let half = |x: Vec<u16>| x.into_iter().map(f16::from_bits).collect::<Vec<f16>>();
        Ok((half(k), half(v)))
    }

    fn copy_kv(&self, from: KvId, to: KvId, n: usize) -> Result<()> {
        let mut st = self.state();
        if from == to || from.0 >= st.kvs.len() || to.0 >= st.kvs.len() {
            return Err(EngineError::Device("unknown KV store".into()));
        }
        let (a, b) = if from.0 < to.0 {
            let (x, y) = st.kvs.split_at_mut(to.0);
            (&x[from.0], &mut y[0])
        } else {
            let (x, y) = st.kvs.split_at_mut(from.0);
            (&y[0], &mut x[to.0])
        };
        for (src, dst) in a.iter().zip(b.iter_mut()) {
            src.copy_prefix(self.gpu.stream(), dst, n).map_err(cuda)?;
        }
        self.traffic.launched(2 * a.len() as u64);
        Ok(())
    }

    fn set_step(&self, ids: &[u32], positions: &[u32]) -> Result<()> {
        let s = self.gpu.stream();
        let mut st = self.state();
        let t = ids.len();
        let State {
            scratch,
            pinned_i32,
            ..
        } = &mut *st;
        let sc = scratch
            .as_mut()
            .ok_or_else(|| EngineError::Device("no scratch reserved".into()))?;
        if t > sc.t || positions.len() != t {
            return Err(EngineError::Device(format!(
                "a step of {t} tokens ({} positions) for scratch of {}",
                positions.len(),
                sc.t
            )));
        }
        sc.host_pos.clear();
        sc.host_pos.extend_from_slice(positions);
        if t == 0 {
            return Ok(());
        }
        // Two staging buffers taken before either is given back: reusing the first for the
        // positions would wait for its copy of the ids.
        let mut staging = Vec::with_capacity(2);
        for (src, dst) in [(ids, &mut sc.ids), (positions, &mut sc.pos)] {
            let mut p = match pinned_i32.get_mut(&t).and_then(Vec::pop) {
                Some(b) => b,
                None => self.gpu.alloc_pinned::<i32>(t).map_err(cuda)?,
            };
            for (d, &v) in p.as_mut_slice().map_err(cuda)?.iter_mut().zip(src) {
                *d = v as i32;
            }
            dst.view_mut(0, t)
                .map_err(cuda)?
                .copy_from_pinned(s, &p)
                .map_err(cuda)?;
            staging.push(p);
        }
        pinned_i32.entry(t).or_default().extend(staging);
        self.traffic.moved(8 * t as u64);
        Ok(())
    }

    fn enqueue(&self, ops: &[Op]) -> Result<()> {
        let mut st = self.state();
        if self.graphs {
            return self.replay(&mut st, ops);
        }
        let launches = self.launches(&st, ops);
        self.run(&mut st, ops)?;
        self.traffic.launched(launches);
        Ok(())
    }

    fn write(&self, dst: Span, src: &[f32]) -> Result<()> {
        dst.check_write(src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        let mut st = self.state();
        let mut p = self.pinned(&mut st, src.len())?;
        // Waits for the buffer's previous copy (long done: one per layer and step).
        p.as_mut_slice().map_err(cuda)?.copy_from_slice(src);
        let s = self.gpu.stream();
        with_out(&mut st.bufs, dst, |_, mut v| {
            v.copy_from_pinned(s, &p).map_err(cuda)
        })?;
        st.pinned.entry(src.len()).or_default().push(p);
        self.traffic.moved(4 * src.len() as u64);
        Ok(())
    }

    fn read(&self, src: Span) -> Result<ReadId> {
        let mut st = self.state();
        let mut p = self.pinned(&mut st, src.len.max(1))?;
        if src.len > 0 {
            view(&st.bufs, src)?
                .copy_to_pinned(self.gpu.stream(), &mut p)
                .map_err(cuda)?;
        }
        let id = st.next_read;
        st.next_read += 1;
        st.reads.insert(
            id,
            PendingRead {
                buf: p,
                len: src.len,
            },
        );
        self.traffic.moved(4 * src.len as u64);
        Ok(ReadId(id))
    }

    fn wait(&self, read: ReadId, dst: &mut [f32]) -> Result<()> {
        let r = self
            .state()
            .reads
            .remove(&read.0)
            .ok_or_else(|| EngineError::Device(format!("unknown read {}", read.0)))?;
        if dst.len() != r.len {
            return Err(EngineError::Device(format!(
                "a read of {} values into {}",
                r.len,
                dst.len()
            )));
        }
        // The pinned buffer's own event: the host waits for this copy (and what the stream
        // queued before it), not for the whole device; an empty read queued no copy, so it
        // waits for the stream.
        if r.len == 0 {
            self.gpu.stream().synchronize().map_err(cuda)?;
        } else {
            dst.copy_from_slice(&r.buf.as_slice().map_err(cuda)?[..r.len]);
        }
        self.traffic.waited();
        let len = r.buf.len();
        self.state().pinned.entry(len).or_default().push(r.buf);
        Ok(())
    }

    fn elapsed(&self, from: usize, to: usize) -> Result<Duration> {
        let st = self.state();
        match (st.marks.get(&from), st.marks.get(&to)) {
            (Some(a), Some(b)) => a.elapsed(b).map_err(cuda),
            _ => Err(EngineError::Device(format!(
                "marks {from} and {to} were not both recorded"
            ))),
        }
    }
}
