//! The CUDA device: `powerinfer-kernels-cuda` on an NVIDIA GPU.
//!
//! Weights are uploaded once (`DeviceTensor`, and `GpuSlice` for a layer's hot neuron rows in
//! bucket order); every buffer is held against the GPU's byte budget, which refuses before the
//! driver is asked. A hot job queues its copies and kernels on the device's stream and returns;
//! [`Device::finish`] waits for the stream and copies the output back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::Instant;

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::Weights;
use powerinfer_kernels_cuda::{CudaError, DeviceBuffer, DeviceTensor, Gpu, GpuSlice, NoGpu};

use super::{Device, HotDone, HotId, HotJob, HotSpec, HotSwap, MatId, Queue, Ticket, WorkShape};
use crate::error::{EngineError, Result};
use crate::model::FfnAct;

/// A layer's hot rows on the GPU.
struct CudaHot {
    gate: Option<GpuSlice>,
    up: GpuSlice,
    down: GpuSlice,
    /// Host copy of the bucket (device row `j` = neuron `bucket[j]`), to count active rows.
    bucket: Vec<u32>,
    /// `ffn_up.bias` of all neurons (gate-less FFNs).
    up_bias: Option<Vec<f32>>,
    act: FfnAct,
}

/// A queued hot job: its output and the inputs its kernels still read.
struct Queued {
    /// Per chunk of tokens: the output buffer and its token count.
    outputs: Vec<DeviceBuffer<f32>>,
    _inputs: Vec<DeviceBuffer<f32>>,
    active: u64,
    start: Instant,
}

/// An NVIDIA GPU through `powerinfer-kernels-cuda`.
pub(crate) struct CudaDevice {
    gpu: Gpu,
    mats: RwLock<Vec<DeviceTensor>>,
    /// `None`: freed.
    hots: RwLock<Vec<Option<CudaHot>>>,
    queued: Queue<Queued>,
    next: AtomicU64,
    t_max: AtomicU64,
}

fn cuda(e: CudaError) -> EngineError {
    match e {
        CudaError::Budget(b) => EngineError::DeviceMemory {
            requested: b.requested,
            used: b.used,
            limit: b.limit,
        },
        other => EngineError::Device(other.to_string()),
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` with a budget of `budget` bytes (default: 90% of its memory less
    /// 256 MiB, as PowerInfer leaves some room).
    pub(crate) fn open(ordinal: usize, budget: Option<u64>) -> std::result::Result<Self, NoGpu> {
        let gpu = Gpu::open(ordinal, None)?;
        let total = gpu.info().total_memory;
        let default = (total / 10 * 9).saturating_sub(256 << 20);
        let limit = budget.unwrap_or(default).min(total / 10 * 9);
        drop(gpu);
        let gpu = Gpu::open(ordinal, Some(limit))?;
        Ok(CudaDevice {
            gpu,
            mats: RwLock::new(Vec::new()),
            hots: RwLock::new(Vec::new()),
            queued: Queue::new(),
            next: AtomicU64::new(0),
            t_max: AtomicU64::new(64),
        })
    }

    fn chunks(&self, t: usize) -> Vec<std::ops::Range<usize>> {
        let step = (self.t_max.load(Ordering::Relaxed) as usize).max(1);
        (0..t).step_by(step).map(|a| a..(a + step).min(t)).collect()
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

    /// Queues the hot part of `n` tokens; returns the output buffer and the inputs to keep.
    #[allow(clippy::too_many_arguments)]
    fn queue_chunk(
        &self,
        h: &CudaHot,
        x: &[f32],
        scores: &[f32],
        n: usize,
        theta: f32,
        keep: &mut Vec<DeviceBuffer<f32>>,
    ) -> std::result::Result<DeviceBuffer<f32>, CudaError> {
        let (gpu, s) = (&self.gpu, self.gpu.stream());
        let nff = h.up.n_neurons();
        let ne = h.down.weight().cols();
        let x_d = gpu.upload(s, x)?;
        let p_d = gpu.upload(s, scores)?;
        let mut up = gpu.alloc_zeros::<f32>(s, n * nff)?;
        gpu.sparse_matmul(s, &h.up, &x_d, &p_d, theta, n, &mut up)?;
        let mut act = gpu.alloc_zeros::<f32>(s, n * nff)?;
        match &h.gate {
            Some(gate) => {
                let mut g = gpu.alloc_zeros::<f32>(s, n * nff)?;
                gpu.sparse_matmul(s, gate, &x_d, &p_d, theta, n, &mut g)?;
                gpu.relu_gate(s, &g, &up, h.act == FfnAct::Drelu, &mut act)?;
                keep.push(g);
            }
            None => match &h.up_bias {
                Some(b) => {
                    let rep: Vec<f32> = (0..n).flat_map(|_| b.iter().copied()).collect();
                    let b_d = gpu.upload(s, &rep)?;
                    let mut sum = gpu.alloc_zeros::<f32>(s, n * nff)?;
                    gpu.add(s, &up, &b_d, &mut sum)?;
                    gpu.relu(s, &sum, &mut act)?;
                    keep.extend([b_d, sum]);
                }
                None => gpu.relu(s, &up, &mut act)?,
            },
        }
        let mut y = gpu.alloc_zeros::<f32>(s, n * ne)?;
        gpu.sparse_axpy(s, &h.down, &act, Some(&p_d), theta, n, &mut y)?;
        keep.extend([x_d, p_d, up, act]);
        Ok(y)
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        let i = self.gpu.info();
        format!("cuda:{} ({})", i.ordinal, i.name)
    }

    fn memory(&self) -> (u64, u64, u64) {
        let b = self.gpu.budget();
        (b.limit(), b.used(), b.peak())
    }

    fn supports(&self, ty: GgmlType) -> bool {
        powerinfer_kernels_cuda::tensor::SUPPORTED_TYPES.contains(&ty)
    }

    fn work_bytes(&self, s: &WorkShape) -> u64 {
        // Per chunk: inputs and scores, gate/up/activation over all neurons, the output; the
        // quantized activation and the predictor's hidden layers; products' outputs.
        let t = s.t_max.max(1) as u64;
        let f = 4u64;
        t * f
            * (s.max_cols.max(s.n_embd) as u64
                + s.max_rows as u64
                + 2 * s.n_embd as u64
                + 5 * s.n_ff as u64
                + 2 * s.rank as u64)
            + t * s.n_ff as u64
            + (64 << 10)
    }

    fn reserve_work(&self, s: &WorkShape) -> Result<()> {
        self.t_max.store(s.t_max.max(1) as u64, Ordering::Relaxed);
        let need = self.work_bytes(s);
        let free = self.gpu.budget().available();
        if need > free {
            return Err(EngineError::DeviceMemory {
                requested: need,
                used: self.gpu.budget().used(),
                limit: self.gpu.budget().limit(),
            });
        }
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
        let mut mats = self.mats.write().unwrap_or_else(|e| e.into_inner());
        mats.push(t);
        Ok(MatId(mats.len() - 1))
    }

    fn upload_hot(&self, spec: &HotSpec<'_>) -> Result<HotId> {
        let hot = CudaHot {
            gate: spec
                .gate
                .as_ref()
                .map(|g| self.slice(g, spec.bucket))
                .transpose()?,
            up: self.slice(&spec.up, spec.bucket)?,
            down: self.slice(&spec.down_t, spec.bucket)?,
            bucket: spec.bucket.to_vec(),
            up_bias: spec.up_bias.map(<[f32]>::to_vec),
            act: spec.act,
        };
        let mut hots = self.hots.write().unwrap_or_else(|e| e.into_inner());
        hots.push(Some(hot));
        Ok(HotId(hots.len() - 1))
    }

    fn replace_hot(&self, hot: HotId, swap: &HotSwap<'_>) -> Result<std::time::Duration> {
        let (slots, neurons, spec) = (swap.slots(), swap.neurons(), swap.spec);
        let start = Instant::now();
        let mut hots = self.hots.write().unwrap_or_else(|e| e.into_inner());
        let h = hots
            .get_mut(hot.0)
            .and_then(Option::as_mut)
            .ok_or_else(|| EngineError::Device(format!("unknown hot slice {}", hot.0)))?;
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
        if let (Some(g), Some(w)) = (h.gate.as_mut(), spec.gate.as_ref()) {
            g.replace_rows(s, w.data(), slots, &bucket).map_err(cuda)?;
        }
        h.up.replace_rows(s, spec.up.data(), slots, &bucket)
            .map_err(cuda)?;
        h.down
            .replace_rows(s, spec.down_t.data(), slots, &bucket)
            .map_err(cuda)?;
        s.synchronize().map_err(cuda)?;
        h.bucket = bucket;
        Ok(start.elapsed())
    }

    fn drop_hot(&self, hot: HotId) -> Result<()> {
        let mut hots = self.hots.write().unwrap_or_else(|e| e.into_inner());
        match hots.get_mut(hot.0) {
            Some(h @ Some(_)) => {
                *h = None;
                Ok(())
            }
            _ => Err(EngineError::Device(format!("unknown hot slice {}", hot.0))),
        }
    }

    fn product(&self, m: MatId, x: &[f32], t: usize, y: &mut [f32]) -> Result<()> {
        let mats = self.mats.read().unwrap_or_else(|e| e.into_inner());
        let w = mats
            .get(m.0)
            .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", m.0)))?;
        let (rows, cols) = (w.rows(), w.cols());
        if x.len() != t * cols || y.len() != t * rows {
            return Err(EngineError::Device(format!(
                "product of {t} tokens: {} inputs, {} outputs for a {rows}×{cols} matrix",
                x.len(),
                y.len()
            )));
        }
        let (gpu, s) = (&self.gpu, self.gpu.stream());
        for c in self.chunks(t) {
            let n = c.len();
            let run = || -> std::result::Result<Vec<f32>, CudaError> {
                let x_d = gpu.upload(s, &x[c.start * cols..c.end * cols])?;
                let mut y_d = gpu.alloc_zeros::<f32>(s, n * rows)?;
                gpu.matmul(s, w, &x_d, n, &mut y_d)?;
                y_d.to_host(s)
            };
            y[c.start * rows..c.end * rows].copy_from_slice(&run().map_err(cuda)?);
        }
        Ok(())
    }

    fn scores(&self, fc1: MatId, fc2: MatId, h: &[f32], t: usize, out: &mut [f32]) -> Result<()> {
        let mats = self.mats.read().unwrap_or_else(|e| e.into_inner());
        let get = |id: MatId| {
            mats.get(id.0)
                .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", id.0)))
        };
        let (a, b) = (get(fc1)?, get(fc2)?);
        let (ne, nff) = (a.cols(), b.rows());
        if h.len() != t * ne || out.len() != t * nff {
            return Err(EngineError::Device(format!(
                "predictor of {t} tokens: {} inputs, {} scores",
                h.len(),
                out.len()
            )));
        }
        let (gpu, s) = (&self.gpu, self.gpu.stream());
        for c in self.chunks(t) {
            let n = c.len();
            let run = || -> std::result::Result<Vec<f32>, CudaError> {
                let h_d = gpu.upload(s, &h[c.start * ne..c.end * ne])?;
                let mut p = gpu.alloc_zeros::<f32>(s, n * nff)?;
                let mut mask = gpu.alloc_zeros::<u8>(s, n * nff)?;
                gpu.predictor(s, a, b, &h_d, n, 0.0, &mut p, &mut mask)?;
                p.to_host(s)
            };
            out[c.start * nff..c.end * nff].copy_from_slice(&run().map_err(cuda)?);
        }
        Ok(())
    }

    fn submit(&self, job: &HotJob<'_>) -> Result<Ticket> {
        let hots = self.hots.read().unwrap_or_else(|e| e.into_inner());
        let h = hots
            .get(job.hot.0)
            .and_then(Option::as_ref)
            .ok_or_else(|| EngineError::Device(format!("unknown hot slice {}", job.hot.0)))?;
        let nff = h.up.n_neurons();
        let ne = h.down.weight().cols();
        let t = job.t;
        if job.x.len() != t * ne || job.scores.len() != t * nff {
            return Err(EngineError::Device(format!(
                "hot job of {t} tokens: {} inputs, {} scores",
                job.x.len(),
                job.scores.len()
            )));
        }
        let start = Instant::now();
        let active = (0..t)
            .map(|i| {
                let sc = &job.scores[i * nff..][..nff];
                h.bucket
                    .iter()
                    .filter(|&&j| sc[j as usize] >= job.threshold)
                    .count() as u64
            })
            .sum();
        let mut outputs = Vec::new();
        let mut keep = Vec::new();
        for c in self.chunks(t) {
            let y = self
                .queue_chunk(
                    h,
                    &job.x[c.start * ne..c.end * ne],
                    &job.scores[c.start * nff..c.end * nff],
                    c.len(),
                    job.threshold,
                    &mut keep,
                )
                .map_err(cuda)?;
            outputs.push(y);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let queued = Queued {
            outputs,
            _inputs: keep,
            active,
            start,
        };
        Ok(self.queued.push(id, queued))
    }

    fn finish(&self, ticket: Ticket, out: &mut [f32]) -> Result<HotDone> {
        let q = self.queued.take(ticket, "device job")?;
        let s = self.gpu.stream();
        let mut at = 0;
        for y in &q.outputs {
            let host = y.to_host(s).map_err(cuda)?;
            let dst = out.get_mut(at..at + host.len()).ok_or_else(|| {
                EngineError::Device("the device's output is longer than the FFN's".into())
            })?;
            dst.iter_mut().zip(&host).for_each(|(o, d)| *o += d);
            at += host.len();
        }
        Ok(HotDone {
            active: q.active,
            busy: q.start.elapsed(),
            transfer: std::time::Duration::ZERO,
        })
    }
}
