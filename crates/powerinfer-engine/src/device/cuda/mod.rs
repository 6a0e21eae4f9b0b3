//! The CUDA device: `powerinfer-kernels-cuda` on an NVIDIA GPU.
//!
//! Everything lives on the GPU and runs on one stream: weights (`DeviceTensor`, and `GpuSlice`
//! for a layer's hot neuron rows in bucket order), the engine's buffers, the KV stores, and the
//! scratch the kernels need (reserved at load, so nothing is allocated while decoding). Each
//! [`Op`] becomes one or a few kernel launches queued on the stream, and `enqueue` returns at
//! once. Copies to the device go through pinned host buffers (`write`); copies to the host
//! land in pinned buffers and are waited for by their event alone (`wait`): the host never
//! synchronizes the whole device inside a step. Marks are timed events.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ops::kv::KvType;
use powerinfer_kernels_cpu::Weights;
use powerinfer_kernels_cuda::{
    CudaError, DeviceTensor, Gpu, GpuSlice, LayerKv, NoGpu, PinnedBuffer,
};

pub(crate) mod launches;
mod queue;
mod state;

use state::{
    kv_layer, kv_layer_mut, view, with_out, CudaHot, PendingRead, Scratch, Staging, State,
    STAGING_BUFFERS,
};

use super::report::TrafficCounters;
use super::{
    entry, entry_mut, free_entry, BufId, Device, HotId, HotSpec, HotSwap, KvId, KvRows, KvShape,
    MatId, Op, ReadId, ScratchShape, Span, Traffic,
};
use crate::error::{EngineError, Result};

pub(super) fn cuda(e: CudaError) -> EngineError {
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

/// An NVIDIA GPU through `powerinfer-kernels-cuda`.
pub(crate) struct CudaDevice {
    gpu: Gpu,
    state: Mutex<State>,
    traffic: TrafficCounters,
    /// Programs are captured as CUDA graphs and replayed ([`DeviceOptions::graphs`]).
    ///
    /// [`DeviceOptions::graphs`]: crate::schedule::DeviceOptions::graphs
    graphs: bool,
    /// When it was opened (its clock is the wall clock).
    origin: Instant,
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
            origin: Instant::now(),
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

    /// A staging buffer of at least `len` values: the least recently used of the pool, or
    /// one made now (counted as an allocation after load) when none is wide enough.
    fn pinned(&self, st: &mut State, len: usize) -> Result<PinnedBuffer<f32>> {
        let pool = &mut st.staging.f32s;
        match pool.iter().position(|b| b.len() >= len) {
            Some(i) => Ok(pool.remove(i).expect("an index of the pool")),
            None => {
                self.traffic.allocated_late();
                self.gpu.alloc_pinned::<f32>(len.max(1)).map_err(cuda)
            }
        }
    }

    /// Gives a staging buffer back to the pool, as its most recently used.
    fn unpin(&self, st: &mut State, b: PinnedBuffer<f32>) {
        st.staging.f32s.push_back(b);
    }

    /// Queues a copy of hot slice `hot`'s host mask to its device mask through a staging
    /// buffer (no wait); returns the bytes.
    fn send_mask(&self, st: &mut State, hot: HotId) -> Result<u64> {
        let n = entry(&st.hots, hot.0, "hot slice")?.mask_host.len();
        let mut p = self.pinned(st, n)?;
        let h = entry_mut(&mut st.hots, hot.0, "hot slice")?;
        p.as_mut_slice().map_err(cuda)?[..n].copy_from_slice(&h.mask_host);
        let r = (h.mask.view_mut(0, n).map_err(cuda))
            .and_then(|mut v| v.copy_from_pinned(self.gpu.stream(), &p).map_err(cuda));
        self.unpin(st, p);
        r.map(|()| 4 * n as u64)
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
        let mut staging = Staging::default();
        for _ in 0..STAGING_BUFFERS {
            (staging.f32s).push_back(g.alloc_pinned::<f32>(sh.io.max(1)).map_err(cuda)?);
        }
        for _ in 0..2 {
            (staging.i32s).push(g.alloc_pinned::<i32>(t).map_err(cuda)?);
        }
        let mut st = self.state();
        st.staging = staging;
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
            mask_host: vec![0.0; spec.up.rows()],
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
            for &n in neurons {
                h.mask_host[n as usize] = 0.0;
            }
            bytes += self.send_mask(&mut st, hot)?;
        }
        // The copies are waited for: the measured time prices the next migrations. (The one
        // host wait of a migration, at most one per layer every `--cache-interval` decode
        // tokens, counted.)
        s.synchronize().map_err(cuda)?;
        self.traffic.waited();
        self.traffic.moved(bytes);
        Ok(start.elapsed())
    }

    fn set_enabled(&self, hot: HotId, enabled: Option<&[bool]>) -> Result<()> {
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
        h.mask_host.fill(0.0);
        for (&n, &on) in h.bucket.iter().zip(e) {
            if !on {
                h.mask_host[n as usize] = f32::NAN;
            }
        }
        h.masked = true;
        let bytes = self.send_mask(&mut st, hot)?;
        self.traffic.moved(bytes);
        Ok(())
    }

    fn drop_hot(&self, hot: HotId) -> Result<()> {
        let mut st = self.state();
        // Captured programs may point at the slice's memory.
        st.graphs.clear();
        free_entry(&mut st.hots, hot.0, "hot slice")
    }

    fn alloc_kv(&self, sh: KvShape) -> Result<KvId> {
        if sh.types != (KvType::F16, KvType::F16) {
            return Err(EngineError::Invalid(format!(
                "a {}/{} KV cache: the CUDA device keeps its KV stores in F16 only",
                sh.types.0, sh.types.1
            )));
        }
        let s = self.gpu.stream();
        let store = (0..sh.layers)
            .map(|_| LayerKv::new(&self.gpu, s, sh.positions, sh.n_kv_head, sh.head_dim))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(cuda)?;
        let mut st = self.state();
        st.kvs.push(store);
        Ok(KvId(st.kvs.len() - 1))
    }

    fn write_kv(&self, kv: KvId, layer: usize, start: usize, k: &[u8], v: &[u8]) -> Result<()> {
        let mut st = self.state();
        let cache = kv_layer_mut(&mut st.kvs, kv, layer)?;
        // F16 stores: the canonical bytes are the f16 values, little-endian.
        let bits = |x: &[u8]| {
            (x.chunks_exact(2))
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect::<Vec<u16>>()
        };
        cache
            .write(self.gpu.stream(), start, &bits(k), &bits(v))
            .map_err(cuda)?;
        self.traffic.moved((k.len() + v.len()) as u64);
        Ok(())
    }

    fn read_kv(&self, kv: KvId, layer: usize, start: usize, n: usize) -> Result<KvRows> {
        let st = self.state();
        let cache = kv_layer(&st.kvs, kv, layer)?;
        let (k, v) = cache.read(self.gpu.stream(), start, n).map_err(cuda)?;
        self.traffic.waited();
        self.traffic.moved(4 * k.len() as u64);
        let bytes = |x: Vec<u16>| {
            x.into_iter()
                .flat_map(u16::to_le_bytes)
                .collect::<Vec<u8>>()
        };
        Ok((bytes(k), bytes(v)))
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
            scratch, staging, ..
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
        // The two staging buffers of the ids and the positions (made at load for the widest
        // step), each waiting for its previous copy (the last step's) before it is written.
        if staging.i32s.len() < 2 || staging.i32s.iter().any(|b| b.len() < t) {
            self.traffic.allocated_late();
            staging.i32s = vec![
                self.gpu.alloc_pinned::<i32>(t).map_err(cuda)?,
                self.gpu.alloc_pinned::<i32>(t).map_err(cuda)?,
            ];
        }
        let (pi, pp) = staging.i32s.split_at_mut(1);
        for (src, dst, p) in [
            (ids, &mut sc.ids, &mut pi[0]),
            (positions, &mut sc.pos, &mut pp[0]),
        ] {
            for (d, &v) in p.as_mut_slice().map_err(cuda)?.iter_mut().zip(src) {
                *d = v as i32;
            }
            dst.view_mut(0, t)
                .map_err(cuda)?
                .copy_from_pinned(s, p)
                .map_err(cuda)?;
        }
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
        p.as_mut_slice().map_err(cuda)?[..src.len()].copy_from_slice(src);
        let s = self.gpu.stream();
        with_out(&mut st.bufs, dst, |_, mut v| {
            v.copy_from_pinned(s, &p).map_err(cuda)
        })?;
        self.unpin(&mut st, p);
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
        self.unpin(&mut self.state(), r.buf);
        Ok(())
    }

    fn now(&self) -> Duration {
        self.origin.elapsed()
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
