//! The operators. Each queues kernels on the given stream and returns without waiting.
//!
//! Layouts (all row-major, f32 unless said): a batch of T tokens of width n is `T * n` floats,
//! token-major. Scores `p` and activations of a sparse FFN are `T * N` (N = neurons).
//! Semantics are those of the plain f64 references in `powerinfer-kernels-cpu`.

// Operators take the stream, every buffer and every shape number explicitly, like the kernels.
#![allow(clippy::too_many_arguments)]

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};

use crate::device::{check_len, DeviceBuffer, Gpu, Stream};
use crate::error::{CudaError, Result};
use crate::geometry::{self, Launch};
use crate::kernels::{self, Param};
use crate::tensor::{DeviceTensor, GpuSlice};

fn i32_arg(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} = {v} exceeds i32")))
}

/// The key-value cache of one layer on the device: f16, position-major (`n_ctx` positions of
/// `n_kv_head * head_dim` values).
#[derive(Debug)]
pub struct KvCache {
    k: DeviceBuffer<u16>,
    v: DeviceBuffer<u16>,
    n_ctx: usize,
    n_kv_head: usize,
    head_dim: usize,
}

impl KvCache {
    /// A zeroed cache.
    pub fn new(
        gpu: &Gpu,
        stream: &Stream,
        n_ctx: usize,
        n_kv_head: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let n = n_ctx * n_kv_head * head_dim;
        let k = gpu.alloc_zeros(stream, n)?;
        let v = gpu.alloc_zeros(stream, n)?;
        Ok(KvCache {
            k,
            v,
            n_ctx,
            n_kv_head,
            head_dim,
        })
    }

    /// Positions the cache holds.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// The raw f16 bits of K and V, for tests and debugging.
    pub fn to_host(&self, stream: &Stream) -> Result<(Vec<u16>, Vec<u16>)> {
        Ok((self.k.to_host(stream)?, self.v.to_host(stream)?))
    }
}

/// Rotary embedding variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// LLaMA (ggml mode 0): rotates pairs (2i, 2i+1).
    Normal,
    /// NeoX / Falcon (ggml mode 2): rotates pairs (i, i + n_rot/2).
    Neox,
}

/// A kernel launch being built: pushes arguments to cudarc and records their kinds, and refuses
/// to launch unless they match the kernel's declared parameters ([`kernels::params`], which a
/// test checks against the PTX).
struct Args<'a> {
    b: LaunchArgs<'a>,
    kernel: &'static str,
    pushed: Vec<Param>,
}

/// Scalars a kernel takes.
trait Scalar: DeviceRepr {
    const KIND: Param;
}
impl Scalar for i32 {
    const KIND: Param = Param::I32;
}
impl Scalar for i64 {
    const KIND: Param = Param::I64;
}
impl Scalar for f32 {
    const KIND: Param = Param::F32;
}

/// The null device pointer passed for an absent optional buffer.
static NULL_PTR: u64 = 0;

impl<'a> Args<'a> {
    fn new(gpu: &'a Gpu, stream: &'a Stream, kernel: &'static str) -> Self {
        Args {
            b: stream.inner.launch_builder(gpu.function(kernel)),
            kernel,
            pushed: Vec::new(),
        }
    }

    fn ptr<T>(&mut self, s: &'a CudaSlice<T>) -> &mut Self {
        self.b.arg(s);
        self.pushed.push(Param::Ptr);
        self
    }

    fn ptr_mut<T>(&mut self, s: &'a mut CudaSlice<T>) -> &mut Self {
        self.b.arg(s);
        self.pushed.push(Param::Ptr);
        self
    }

    fn null(&mut self) -> &mut Self {
        self.b.arg(&NULL_PTR);
        self.pushed.push(Param::Ptr);
        self
    }

    fn scalar<T: Scalar>(&mut self, v: &'a T) -> &mut Self {
        self.b.arg(v);
        self.pushed.push(T::KIND);
        self
    }

    /// Launches after checking the arguments against the kernel's parameters.
    ///
    /// # Safety
    /// The buffers must be large enough for every access the kernel makes with these arguments
    /// and this geometry (the operators check lengths against the shape before calling).
    unsafe fn launch(&mut self, l: Launch) -> Result<()> {
        let expected = kernels::params(self.kernel).unwrap_or(&[]);
        if self.pushed != expected || l.kernel != self.kernel {
            return Err(CudaError::Launch {
                kernel: self.kernel,
                detail: format!("arguments {:?}, parameters {expected:?}", self.pushed),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: l.grid,
            block_dim: (l.block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument kinds match the kernel's parameters (checked above); the caller
        // guarantees the buffer sizes.
        unsafe { self.b.launch(cfg) }?;
        Ok(())
    }
}

impl Gpu {
    fn launch_rows(
        &self,
        stream: &Stream,
        l: Launch,
        w: &DeviceTensor,
        bucket: Option<&DeviceBuffer<u32>>,
        x: &DeviceBuffer<f32>,
        t: usize,
        p: Option<&DeviceBuffer<f32>>,
        theta: f32,
        n: usize,
        dst: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        if w.rows() == 0 || t == 0 {
            return Ok(());
        }
        let row_bytes = w.row_bytes() as i64;
        let (rows, k, t32, n32) = (
            i32_arg("rows", w.rows())?,
            i32_arg("cols", w.cols())?,
            i32_arg("tokens", t)?,
            i32_arg("neurons", n)?,
        );
        let mut b = Args::new(self, stream, l.kernel);
        b.ptr(&w.data.slice)
            .scalar(&row_bytes)
            .scalar(&rows)
            .scalar(&k)
            .ptr(&x.slice)
            .scalar(&t32);
        match p {
            Some(p) => b.ptr(&p.slice),
            None => b.null(),
        };
        match bucket {
            Some(bk) => b.ptr(&bk.slice),
            None => b.null(),
        };
        b.scalar(&theta).scalar(&n32).ptr_mut(&mut dst.slice);
        // SAFETY: the kernel's parameters match the argument list above (see kernels/matmul.cu and
        // kernels/axpy.cu); the callers checked every buffer length against the shape, and the
        // bucket was validated (unique, < n) when the slice was made, so all accesses are in bounds.
        unsafe { b.launch(l) }?;
        Ok(())
    }

    /// Dense product: `dst[t, i] = W_i · x_t` for the `rows` rows of `w`, `t` tokens
    /// (`x`: t × cols, `dst`: t × rows). For Q8_0/Q4_0 weights `x` is first quantized to Q8_0
    /// blocks (f32 scales) in a scratch buffer, as the CPU kernels do
    /// (`powerinfer_kernels_cpu::reference::matmul::quantize_activation`). For F16 weights `x`
    /// is multiplied as f32, where the CPU kernels first round it to f16 (as ggml's CPU backend
    /// does): the two sides of a hybrid FFN then differ by that rounding.
    pub fn matmul(
        &self,
        stream: &Stream,
        w: &DeviceTensor,
        x: &DeviceBuffer<f32>,
        t: usize,
        dst: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        check_len("x", t * w.cols(), x.len())?;
        check_len("dst", t * w.rows(), dst.len())?;
        let l = geometry::matmul(w.ty(), w.rows(), t)?;
        if w.rows() == 0 || t == 0 {
            return Ok(());
        }
        self.with_activation(stream, w, x, t, |x| {
            self.launch_rows(stream, l, w, None, x, t, None, 0.0, w.rows(), dst)
        })
    }

    /// Queues `launch` with what the product kernels for `w` read: `x` itself for float
    /// weights; for Q8_0/Q4_0 weights `x` (t × cols) quantized by `quantize_q8` into the
    /// stream's cached scratch buffer (t·cols int8 values, then t·cols/32 f32 scales, viewed as
    /// floats; [`Gpu::activation_scratch`]). The scratch lock is held until `launch` has queued
    /// its kernel, so concurrent calls on one stream cannot overwrite each other's activation;
    /// after the first call of a size on a stream nothing is allocated.
    fn with_activation(
        &self,
        stream: &Stream,
        w: &DeviceTensor,
        x: &DeviceBuffer<f32>,
        t: usize,
        launch: impl FnOnce(&DeviceBuffer<f32>) -> Result<()>,
    ) -> Result<()> {
        if !geometry::quantized_activation(w.ty()) || t == 0 || w.cols() == 0 {
            return launch(x);
        }
        // Quantized tensors have cols % 32 == 0 (checked when they are made).
        let blocks = t * w.cols() / 32;
        let (mut cache, i) = self.activation_scratch(stream, blocks * 8 + blocks)?;
        let xq = &mut cache[i].buf;
        let nb = blocks as i64;
        let mut b = Args::new(self, stream, "quantize_q8");
        b.ptr(&x.slice).scalar(&nb).ptr_mut(&mut xq.slice);
        // SAFETY: parameters match quantize_q8 in kernels/matmul.cu; x holds t·cols = 32·blocks
        // floats (checked by the caller), xq at least 32·blocks bytes plus `blocks` floats. It
        // writes all that the product kernel queued next reads.
        unsafe { b.launch(geometry::quantize_q8(blocks)?) }?;
        launch(&cache[i].buf)
    }

    /// Row-sparse product over a GPU slice ("upscale"): `dst` (t × N) becomes zero except
    /// `dst[t, bucket[j]] = W_j · x_t` where `p[t, bucket[j]] >= theta`. `x`: t × cols,
    /// `p`: t × N scores. Quantized weights quantize `x` as [`Gpu::matmul`] does.
    pub fn sparse_matmul(
        &self,
        stream: &Stream,
        slice: &GpuSlice,
        x: &DeviceBuffer<f32>,
        p: &DeviceBuffer<f32>,
        theta: f32,
        t: usize,
        dst: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let w = &slice.weight;
        let n = slice.n_neurons();
        check_len("x", t * w.cols(), x.len())?;
        check_len("scores", t * n, p.len())?;
        check_len("dst", t * n, dst.len())?;
        stream.inner.memset_zeros(&mut dst.slice)?;
        let l = geometry::matmul(w.ty(), w.rows(), t)?;
        if w.rows() == 0 || t == 0 {
            return Ok(());
        }
        self.with_activation(stream, w, x, t, |x| {
            self.launch_rows(
                stream,
                l,
                w,
                slice.bucket.as_ref(),
                x,
                t,
                Some(p),
                theta,
                n,
                dst,
            )
        })
    }

    /// Sparse axpy over the down rows of a GPU slice: `dst` (t × cols) becomes
    /// `dst[t] = Σ_j a[t, bucket[j]] · W_j` over the rows whose neuron is selected for token t
    /// (`p[t, bucket[j]] >= theta`, or every row when `p` is `None`) and whose activation is
    /// non-zero. `a` and `p`: t × N. Up to [`geometry::AXPY_SPARSE_MAX_TOKENS`] tokens a per-token sparse
    /// kernel runs, above it a kernel tiled over 8 tokens.
    pub fn sparse_axpy(
        &self,
        stream: &Stream,
        slice: &GpuSlice,
        a: &DeviceBuffer<f32>,
        p: Option<&DeviceBuffer<f32>>,
        theta: f32,
        t: usize,
        dst: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let w = &slice.weight;
        let n = slice.n_neurons();
        let m = w.cols();
        check_len("activations", t * n, a.len())?;
        if let Some(p) = p {
            check_len("scores", t * n, p.len())?;
        }
        check_len("dst", t * m, dst.len())?;
        stream.inner.memset_zeros(&mut dst.slice)?;
        let l = geometry::axpy(w.ty(), m, w.rows(), t)?;
        if m == 0 {
            return Ok(());
        }
        self.launch_rows(stream, l, w, slice.bucket.as_ref(), a, t, p, theta, n, dst)
    }

    /// RMSNorm of `rows` rows of `n`: `y = x / sqrt(mean(x²) + eps) * w` (`w` of length n, or 1).
    pub fn rms_norm(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<f32>,
        w: Option<&DeviceBuffer<f32>>,
        eps: f32,
        rows: usize,
        n: usize,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        check_len("x", rows * n, x.len())?;
        check_len("y", rows * n, y.len())?;
        if let Some(w) = w {
            check_len("weight", n, w.len())?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let n32 = i32_arg("n", n)?;
        let mut b = Args::new(self, stream, "rms_norm");
        b.ptr(&x.slice);
        match w {
            Some(w) => b.ptr(&w.slice),
            None => b.null(),
        };
        b.ptr_mut(&mut y.slice).scalar(&n32).scalar(&eps);
        // SAFETY: parameters match rms_norm in kernels/ops.cu; lengths checked above.
        unsafe { b.launch(geometry::per_row("rms_norm", rows)?) }?;
        Ok(())
    }

    /// LayerNorm of `rows` rows of `n`: `y = (x - mean) / sqrt(var + eps) * w + b` (population
    /// variance; `w` and `b` of length n, or 1 and 0).
    pub fn layer_norm(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<f32>,
        w: Option<&DeviceBuffer<f32>>,
        bias: Option<&DeviceBuffer<f32>>,
        eps: f32,
        rows: usize,
        n: usize,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        check_len("x", rows * n, x.len())?;
        check_len("y", rows * n, y.len())?;
        for v in [w, bias].into_iter().flatten() {
            check_len("weight/bias", n, v.len())?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let n32 = i32_arg("n", n)?;
        let mut b = Args::new(self, stream, "layer_norm");
        b.ptr(&x.slice);
        match w {
            Some(w) => b.ptr(&w.slice),
            None => b.null(),
        };
        match bias {
            Some(v) => b.ptr(&v.slice),
            None => b.null(),
        };
        b.ptr_mut(&mut y.slice).scalar(&n32).scalar(&eps);
        // SAFETY: parameters match layer_norm in kernels/ops.cu; lengths checked above.
        unsafe { b.launch(geometry::per_row("layer_norm", rows)?) }?;
        Ok(())
    }

    /// RoPE in place on `t` tokens of `n_head` heads of `head_dim` (`pos`: t positions).
    pub fn rope(
        &self,
        stream: &Stream,
        x: &mut DeviceBuffer<f32>,
        pos: &DeviceBuffer<i32>,
        t: usize,
        n_head: usize,
        head_dim: usize,
        n_rot: usize,
        base: f32,
        mode: RopeMode,
    ) -> Result<()> {
        check_len("x", t * n_head * head_dim, x.len())?;
        check_len("positions", t, pos.len())?;
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(CudaError::Shape(format!(
                "n_rot {n_rot} must be even and at most head_dim {head_dim}"
            )));
        }
        let pairs = n_head * n_rot / 2;
        if t == 0 || pairs == 0 {
            return Ok(());
        }
        let (h, d, r) = (
            i32_arg("n_head", n_head)?,
            i32_arg("head_dim", head_dim)?,
            i32_arg("n_rot", n_rot)?,
        );
        let neox = i32::from(mode == RopeMode::Neox);
        let mut b = Args::new(self, stream, "rope");
        b.ptr_mut(&mut x.slice)
            .ptr(&pos.slice)
            .scalar(&h)
            .scalar(&d)
            .scalar(&r)
            .scalar(&base)
            .scalar(&neox);
        // SAFETY: parameters match rope in kernels/ops.cu; lengths checked above.
        unsafe { b.launch(geometry::rope(t, n_head, n_rot)?) }?;
        Ok(())
    }

    /// Softmax of `scale * x` over each of `rows` rows of `n`, in place.
    pub fn softmax(
        &self,
        stream: &Stream,
        x: &mut DeviceBuffer<f32>,
        rows: usize,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        check_len("x", rows * n, x.len())?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let n32 = i32_arg("n", n)?;
        let mut b = Args::new(self, stream, "softmax");
        b.ptr_mut(&mut x.slice).scalar(&n32).scalar(&scale);
        // SAFETY: parameters match softmax in kernels/ops.cu; length checked above.
        unsafe { b.launch(geometry::per_row("softmax", rows)?) }?;
        Ok(())
    }

    fn elementwise(
        &self,
        stream: &Stream,
        name: &'static str,
        a: &DeviceBuffer<f32>,
        b2: Option<&DeviceBuffer<f32>>,
        y: &mut DeviceBuffer<f32>,
        extra: Option<i32>,
    ) -> Result<()> {
        let n = a.len();
        if let Some(b2) = b2 {
            check_len("second operand", n, b2.len())?;
        }
        check_len("y", n, y.len())?;
        if n == 0 {
            return Ok(());
        }
        let n64 = n as i64;
        let mut b = Args::new(self, stream, name);
        b.ptr(&a.slice);
        if let Some(b2) = b2 {
            b.ptr(&b2.slice);
        }
        b.ptr_mut(&mut y.slice).scalar(&n64);
        if let Some(e) = extra.as_ref() {
            b.scalar(e);
        }
        // SAFETY: parameters match the element-wise kernels in kernels/ops.cu; lengths checked.
        unsafe { b.launch(geometry::per_element(name, n)?) }?;
        Ok(())
    }

    /// `y = max(x, 0)`.
    pub fn relu(
        &self,
        stream: &Stream,
        x: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        self.elementwise(stream, "relu", x, None, y, None)
    }

    /// `y = a + b`.
    pub fn add(
        &self,
        stream: &Stream,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        self.elementwise(stream, "add", a, Some(b), y, None)
    }

    /// ReLU gating: `y = max(g, 0) * u`, or `max(g, 0) * max(u, 0)` when `relu_u` (Bamboo).
    pub fn relu_gate(
        &self,
        stream: &Stream,
        g: &DeviceBuffer<f32>,
        u: &DeviceBuffer<f32>,
        relu_u: bool,
        y: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        self.elementwise(stream, "relu_gate", g, Some(u), y, Some(i32::from(relu_u)))
    }

    /// Stores K and V of `t` tokens (`t * n_kv_head * head_dim` floats each, token-major) at
    /// positions `pos .. pos + t` of the cache, as f16.
    pub fn kv_store(
        &self,
        stream: &Stream,
        cache: &mut KvCache,
        k: &DeviceBuffer<f32>,
        v: &DeviceBuffer<f32>,
        pos: usize,
        t: usize,
    ) -> Result<()> {
        let row = cache.n_kv_head * cache.head_dim;
        check_len("k", t * row, k.len())?;
        check_len("v", t * row, v.len())?;
        if pos + t > cache.n_ctx {
            return Err(CudaError::Index {
                what: "KV position",
                index: pos + t,
                len: cache.n_ctx,
            });
        }
        let n = t * row;
        if n == 0 {
            return Ok(());
        }
        let offset = (pos * row) as i64;
        let n32 = i32_arg("n", n)?;
        let mut b = Args::new(self, stream, "kv_store");
        b.ptr(&k.slice)
            .ptr(&v.slice)
            .ptr_mut(&mut cache.k.slice)
            .ptr_mut(&mut cache.v.slice)
            .scalar(&offset)
            .scalar(&n32);
        // SAFETY: parameters match kv_store in kernels/ops.cu; pos + t <= n_ctx, so the n
        // elements from offset lie in the caches; k and v hold n floats.
        unsafe { b.launch(geometry::per_element("kv_store", n)?) }?;
        Ok(())
    }

    /// Causal attention of the `t` query tokens at positions `len - t .. len` over positions
    /// `0..len` of the cache (token i sees `0 ..= len - t + i`), with grouped-query heads
    /// (n_head a multiple of the cache's n_kv_head). `q`, `out`: t × n_head × head_dim.
    /// Decoding is `t = 1`.
    pub fn attention(
        &self,
        stream: &Stream,
        q: &DeviceBuffer<f32>,
        cache: &KvCache,
        n_head: usize,
        len: usize,
        t: usize,
        scale: f32,
        out: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let hd = cache.head_dim;
        check_len("q", t * n_head * hd, q.len())?;
        check_len("out", t * n_head * hd, out.len())?;
        if cache.n_kv_head == 0 || n_head % cache.n_kv_head != 0 {
            return Err(CudaError::Shape(format!(
                "{n_head} heads over {} KV heads",
                cache.n_kv_head
            )));
        }
        if len > cache.n_ctx || t > len {
            return Err(CudaError::Index {
                what: "attention length",
                index: len,
                len: cache.n_ctx,
            });
        }
        if n_head == 0 || hd == 0 || t == 0 {
            return Ok(());
        }
        let mut scratch = self.alloc_zeros::<f32>(stream, t * n_head * len)?;
        let (h, kvh, d, l, t32) = (
            i32_arg("n_head", n_head)?,
            i32_arg("n_kv", cache.n_kv_head)?,
            i32_arg("head_dim", hd)?,
            i32_arg("len", len)?,
            i32_arg("tokens", t)?,
        );
        let mut b = Args::new(self, stream, "attention_f16kv");
        b.ptr(&q.slice)
            .ptr(&cache.k.slice)
            .ptr(&cache.v.slice)
            .ptr_mut(&mut out.slice)
            .ptr_mut(&mut scratch.slice);
        b.scalar(&h)
            .scalar(&kvh)
            .scalar(&d)
            .scalar(&l)
            .scalar(&t32)
            .scalar(&scale);
        // SAFETY: parameters match attention_f16kv in kernels/ops.cu; t <= len <= n_ctx, scratch
        // has t * n_head * len floats, q and out lengths checked above.
        unsafe { b.launch(geometry::attention(n_head, t)?) }?;
        Ok(())
    }

    /// `mask[i] = p[i] >= theta` (1 or 0) for every score.
    pub fn threshold_mask(
        &self,
        stream: &Stream,
        p: &DeviceBuffer<f32>,
        theta: f32,
        mask: &mut DeviceBuffer<u8>,
    ) -> Result<()> {
        check_len("mask", p.len(), mask.len())?;
        if p.is_empty() {
            return Ok(());
        }
        let n = p.len() as i64;
        let mut b = Args::new(self, stream, "threshold_mask");
        b.ptr(&p.slice)
            .ptr_mut(&mut mask.slice)
            .scalar(&n)
            .scalar(&theta);
        // SAFETY: parameters match threshold_mask in kernels/ops.cu; lengths checked.
        unsafe { b.launch(geometry::per_element("threshold_mask", p.len())?) }?;
        Ok(())
    }

    /// The ascending indices i with `p[i] >= theta` of one token's scores: writes them to the
    /// front of `idx` (length ≥ p.len()) and their number to `count[0]`.
    pub fn active_list(
        &self,
        stream: &Stream,
        p: &DeviceBuffer<f32>,
        theta: f32,
        idx: &mut DeviceBuffer<u32>,
        count: &mut DeviceBuffer<u32>,
    ) -> Result<()> {
        check_len("index buffer", p.len(), idx.len())?;
        check_len("count", 1, count.len())?;
        let n = i32_arg("n", p.len())?;
        let mut b = Args::new(self, stream, "active_list");
        b.ptr(&p.slice)
            .scalar(&n)
            .scalar(&theta)
            .ptr_mut(&mut idx.slice)
            .ptr_mut(&mut count.slice);
        // SAFETY: parameters match active_list in kernels/ops.cu; idx holds n entries.
        unsafe { b.launch(geometry::active_list()) }?;
        Ok(())
    }

    /// The predictor MLP: `scores = fc2 · ReLU(fc1 · h)` for `t` tokens (`fc1`: hidden × d,
    /// `fc2`: N × hidden, `h`: t × d, `scores`: t × N), then `mask = scores >= theta`.
    pub fn predictor(
        &self,
        stream: &Stream,
        fc1: &DeviceTensor,
        fc2: &DeviceTensor,
        h: &DeviceBuffer<f32>,
        t: usize,
        theta: f32,
        scores: &mut DeviceBuffer<f32>,
        mask: &mut DeviceBuffer<u8>,
    ) -> Result<()> {
        if fc2.cols() != fc1.rows() {
            return Err(CudaError::Shape(format!(
                "fc2 takes {} inputs, fc1 gives {}",
                fc2.cols(),
                fc1.rows()
            )));
        }
        let mut hidden = self.alloc_zeros::<f32>(stream, t * fc1.rows())?;
        self.matmul(stream, fc1, h, t, &mut hidden)?;
        let mut relu = self.alloc_zeros::<f32>(stream, t * fc1.rows())?;
        self.relu(stream, &hidden, &mut relu)?;
        self.matmul(stream, fc2, &relu, t, scores)?;
        self.threshold_mask(stream, scores, theta, mask)
    }
}
