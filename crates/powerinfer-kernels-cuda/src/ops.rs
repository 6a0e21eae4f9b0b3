//! The operators. Each queues kernels on the given stream and returns without waiting.
//!
//! Layouts (all row-major, f32 unless said): a batch of T tokens of width n is `T * n` floats,
//! token-major. Scores `p` and activations of a sparse FFN are `T * N` (N = neurons).
//! Semantics are those of the plain f64 references in `powerinfer-kernels-cpu`.

// Operators take the stream, every buffer and every shape number explicitly, like the kernels.
#![allow(clippy::too_many_arguments)]

use cudarc::driver::{CudaSlice, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};

use crate::device::{check_len, DeviceBuffer, DeviceView, DeviceViewMut, Gpu, Stream};
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
pub struct LayerKv {
    k: DeviceBuffer<u16>,
    v: DeviceBuffer<u16>,
    n_ctx: usize,
    n_kv_head: usize,
    head_dim: usize,
}

impl LayerKv {
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
        Ok(LayerKv {
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

    /// Values per position.
    fn row(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    /// Writes host rows (f16 bits, whole positions) from position `start`, on `stream`.
    pub fn write(&mut self, stream: &Stream, start: usize, k: &[u16], v: &[u16]) -> Result<()> {
        let row = self.row();
        check_len("v rows", k.len(), v.len())?;
        if row == 0 || k.len() % row != 0 || start + k.len() / row > self.n_ctx {
            return Err(CudaError::Index {
                what: "KV rows",
                index: start + k.len() / row.max(1),
                len: self.n_ctx,
            });
        }
        if k.is_empty() {
            return Ok(());
        }
        let (a, n) = (start * row, k.len());
        stream
            .inner
            .memcpy_htod(k, &mut self.k.slice.slice_mut(a..a + n))?;
        stream
            .inner
            .memcpy_htod(v, &mut self.v.slice.slice_mut(a..a + n))?;
        Ok(())
    }

    /// Positions `start .. start + n` (f16 bits), waiting for `stream`.
    pub fn read(&self, stream: &Stream, start: usize, n: usize) -> Result<(Vec<u16>, Vec<u16>)> {
        let row = self.row();
        if start + n > self.n_ctx {
            return Err(CudaError::Index {
                what: "KV rows",
                index: start + n,
                len: self.n_ctx,
            });
        }
        if n == 0 || row == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let r = start * row..(start + n) * row;
        let k = stream.inner.clone_dtoh(&self.k.slice.slice(r.clone()))?;
        let v = stream.inner.clone_dtoh(&self.v.slice.slice(r))?;
        stream.inner.synchronize()?;
        Ok((k, v))
    }

    /// Copies the first `n` positions into `to` (same shape), on `stream`.
    pub fn copy_prefix(&self, stream: &Stream, to: &mut LayerKv, n: usize) -> Result<()> {
        let row = self.row();
        if row != to.row() || n > self.n_ctx || n > to.n_ctx {
            return Err(CudaError::Shape(format!(
                "copying {n} positions of rows of {row} into rows of {}",
                to.row()
            )));
        }
        if n == 0 || row == 0 {
            return Ok(());
        }
        let m = n * row;
        stream
            .inner
            .memcpy_dtod(&self.k.slice.slice(..m), &mut to.k.slice.slice_mut(..m))?;
        stream
            .inner
            .memcpy_dtod(&self.v.slice.slice(..m), &mut to.v.slice.slice_mut(..m))?;
        Ok(())
    }
}

/// The ratio of consecutive rotary frequencies, `base^(-2 / n_rot)` in f32, as the CPU kernels
/// compute it (the kernel then takes its powers by repeated products, as they do).
pub fn rope_theta_scale(base: f32, n_rot: usize) -> f32 {
    base.powf(-2.0f32 / n_rot as f32)
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

    fn view<T>(&mut self, v: &'a DeviceView<'_, T>) -> &mut Self {
        self.b.arg(&v.inner);
        self.pushed.push(Param::Ptr);
        self
    }

    fn view_mut<T>(&mut self, v: &'a mut DeviceViewMut<'_, T>) -> &mut Self {
        self.b.arg(&mut v.inner);
        self.pushed.push(Param::Ptr);
        self
    }

    fn null(&mut self) -> &mut Self {
        self.b.arg(&NULL_PTR);
        self.pushed.push(Param::Ptr);
        self
    }

    /// `v`'s pointer, or null.
    fn view_or_null<T>(&mut self, v: Option<&'a DeviceView<'_, T>>) -> &mut Self {
        match v {
            Some(v) => self.view(v),
            None => self.null(),
        }
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
        // A grid without a block has no work, and the driver refuses to launch it.
        if l.grid.0 == 0 || l.grid.1 == 0 || l.grid.2 == 0 {
            return Ok(());
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

/// A buffer or a view of one, read by an operator.
pub type In<'a> = DeviceView<'a, f32>;

/// A buffer or a view of one, written by an operator.
pub type Out<'a> = DeviceViewMut<'a, f32>;

/// The activation of [`Gpu::gated_matmul`]: of a gated FFN neuron's gate and up products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    /// `ReLU(gate) · up`.
    Relu,
    /// `ReLU(gate) · ReLU(up)` (dReLU, Bamboo / ProSparse).
    Drelu,
    /// `SiLU(gate) · up` (SwiGLU).
    Silu,
}

impl Gate {
    /// The kernels' GATE_* constant.
    fn kind(self) -> i32 {
        match self {
            Gate::Relu => 0,
            Gate::Drelu => 1,
            Gate::Silu => 2,
        }
    }
}

/// One product of [`Gpu::matmuls`].
pub enum Product<'w, 'p, 'y> {
    /// `dst = W x` ([`Gpu::matmul`]).
    Dense {
        /// The weight.
        w: &'w DeviceTensor,
        /// t × rows.
        dst: Out<'y>,
    },
    /// The row-sparse product over a GPU slice ([`Gpu::sparse_matmul`]).
    Sparse {
        /// The slice.
        slice: &'w GpuSlice,
        /// t × N scores.
        p: In<'p>,
        /// Rows with a score below it are 0.
        theta: f32,
        /// t × N.
        dst: Out<'y>,
        /// Whether the rows outside the slice's bucket are zeroed first (one memset); else
        /// they keep what they held, for a caller that reads the bucket's rows only.
        clear: bool,
    },
}

impl<'w> Product<'w, '_, '_> {
    fn weight(&self) -> &'w DeviceTensor {
        match self {
            Product::Dense { w, .. } => w,
            Product::Sparse { slice, .. } => &slice.weight,
        }
    }
}

/// An element-wise operator of one operand ([`Gpu::unary`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Unary {
    /// `y = max(x, 0)`.
    Relu,
    /// `y = x` rounded to f16 and back (what the CPU kernels multiply F16 rows by).
    RoundF16,
    /// `y += x`.
    Accumulate,
}

impl Unary {
    fn kernel(self) -> &'static str {
        match self {
            Unary::Relu => "relu",
            Unary::RoundF16 => "round_f16",
            Unary::Accumulate => "add_inplace",
        }
    }
}

/// An element-wise operator of two operands ([`Gpu::binary`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Binary {
    /// `y = a + b`.
    Add,
    /// SwiGLU: `y = silu(a) * b`, SiLU in the CPU kernels' form.
    SiluGate,
    /// ReLU gating: `y = max(a, 0) * b`.
    ReluGate,
    /// dReLU gating (Bamboo): `y = max(a, 0) * max(b, 0)`.
    DreluGate,
}

impl Binary {
    /// The kernel and its trailing integer argument.
    fn kernel(self) -> (&'static str, Option<i32>) {
        match self {
            Binary::Add => ("add", None),
            Binary::SiluGate => ("silu_gate", None),
            Binary::ReluGate => ("relu_gate", Some(0)),
            Binary::DreluGate => ("relu_gate", Some(1)),
        }
    }
}

/// What a norm kernel reads: `x`, or `x` that it first adds the residual `a` to.
enum NormInput<'x, 'a> {
    Plain(In<'x>),
    Residual(Out<'x>, In<'a>),
}

/// The shape of a norm: `rows` rows of `n`, and its epsilon.
#[derive(Clone, Copy, Debug)]
struct NormShape {
    eps: f32,
    rows: usize,
    n: usize,
}

impl Gpu {
    fn launch_rows(
        &self,
        stream: &Stream,
        l: Launch,
        w: &DeviceTensor,
        bucket: Option<&DeviceBuffer<u32>>,
        x: &In<'_>,
        t: usize,
        p: Option<&In<'_>>,
        theta: f32,
        n: usize,
        dst: &mut Out<'_>,
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
            .view(x)
            .scalar(&t32);
        b.view_or_null(p);
        match bucket {
            Some(bk) => b.ptr(&bk.slice),
            None => b.null(),
        };
        b.scalar(&theta).scalar(&n32).view_mut(dst);
        // SAFETY: the kernel's parameters match the argument list above (see kernels/matmul.cu and
        // kernels/axpy.cu); the callers checked every buffer length against the shape, and the
        // bucket was validated (unique, < n) when the slice was made, so all accesses are in bounds.
        unsafe { b.launch(l) }
    }

    /// Dense product: `dst[t, i] = W_i · x_t` for the `rows` rows of `w`, `t` tokens
    /// (`x`: t × cols, `dst`: t × rows). For Q8_0/Q4_0 weights `x` is first quantized to Q8_0
    /// blocks (f32 scales) in a scratch buffer, as the CPU kernels do
    /// (`powerinfer_kernels_cpu::reference::matmul::quantize_activation`); for F16 weights it
    /// is first rounded to f16, as the CPU kernels (and ggml's CPU backend) do: both sides of a
    /// hybrid FFN multiply the same operands.
    pub fn matmul<'x, 'y>(
        &self,
        stream: &Stream,
        w: &DeviceTensor,
        x: impl Into<In<'x>>,
        t: usize,
        dst: impl Into<Out<'y>>,
    ) -> Result<()> {
        self.matmuls(stream, x, t, vec![Product::Dense { w, dst: dst.into() }])
    }

    /// Row-sparse product over a GPU slice ("upscale"): `dst` (t × N) becomes zero except
    /// `dst[t, bucket[j]] = W_j · x_t` where `p[t, bucket[j]] >= theta`. `x`: t × cols,
    /// `p`: t × N scores. Quantized weights quantize `x` as [`Gpu::matmul`] does.
    pub fn sparse_matmul<'x, 'p, 'y>(
        &self,
        stream: &Stream,
        slice: &GpuSlice,
        x: impl Into<In<'x>>,
        p: impl Into<In<'p>>,
        theta: f32,
        t: usize,
        dst: impl Into<Out<'y>>,
    ) -> Result<()> {
        let product = Product::Sparse {
            slice,
            p: p.into(),
            theta,
            dst: dst.into(),
            clear: true,
        };
        self.matmuls(stream, x, t, vec![product])
    }

    /// Products of several matrices of one type and width with the same activation `x`
    /// (t × cols), which is converted once (quantized for Q8_0/Q4_0, rounded to f16 for F16)
    /// for all of them: Q, K and V of an attention, gate and up of an FFN. Each product is
    /// what [`Gpu::matmul`] or [`Gpu::sparse_matmul`] computes.
    pub fn matmuls<'x>(
        &self,
        stream: &Stream,
        x: impl Into<In<'x>>,
        t: usize,
        mut products: Vec<Product<'_, '_, '_>>,
    ) -> Result<()> {
        let x = x.into();
        if let Some(w0) = products.first().map(Product::weight) {
            check_len("x", t * w0.cols(), x.len())?;
        }
        let Some(w0) = self.prepare_products(stream, t, &mut products)? else {
            return Ok(());
        };
        if t == 0 || products.iter().all(|pr| pr.weight().rows() == 0) {
            return Ok(());
        }
        self.with_activation(stream, w0, &x, t, |x| {
            self.launch_products(stream, x, t, &mut products)
        })
    }

    /// A norm of `rows` rows of `n` into `y` (RMSNorm without `bias`, LayerNorm with) and the
    /// products that read `y` ([`Gpu::matmuls`], `t` = `rows`, their width `n`): the norm's
    /// own launch also writes `y` converted for them (quantized or rounded as the products
    /// would convert it), so the conversion is not a launch of its own.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_matmuls<'x, 'w, 'b, 'y>(
        &self,
        stream: &Stream,
        x: impl Into<In<'x>>,
        w: Option<In<'w>>,
        bias: Option<In<'b>>,
        eps: f32,
        rows: usize,
        n: usize,
        y: impl Into<Out<'y>>,
        mut products: Vec<Product<'_, '_, '_>>,
    ) -> Result<()> {
        let (x, mut y) = (x.into(), y.into());
        let Some(w0) = self.prepare_products(stream, rows, &mut products)? else {
            let shape = NormShape { eps, rows, n };
            let kernel = if bias.is_some() {
                "layer_norm"
            } else {
                "rms_norm"
            };
            let params = [w.as_ref(), bias.as_ref()];
            let params = &params[..1 + usize::from(bias.is_some())];
            return self.norm(stream, kernel, NormInput::Plain(x), params, shape, y);
        };
        check_len("x", rows * n, x.len())?;
        check_len("y", rows * n, y.len())?;
        check_len("product width", n, w0.cols())?;
        for v in [&w, &bias].into_iter().flatten() {
            check_len("weight/bias", n, v.len())?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let ty = w0.ty();
        let conv: i32 = if geometry::quantized_activation(ty) {
            1
        } else if ty == powerinfer_gguf::GgmlType::F16 {
            2
        } else {
            0
        };
        let total = rows * n;
        if conv == 0 {
            let shape = NormShape { eps, rows, n };
            let kernel = if bias.is_some() {
                "layer_norm"
            } else {
                "rms_norm"
            };
            let params = [w.as_ref(), bias.as_ref()];
            let params = &params[..1 + usize::from(bias.is_some())];
            self.norm(
                stream,
                kernel,
                NormInput::Plain(x),
                params,
                shape,
                y.as_mut(),
            )?;
            return self.launch_products(stream, &y.as_view(), rows, &mut products);
        }
        // Quantized types have widths of whole blocks (checked when the tensors are made).
        let len = if conv == 1 { total / 32 * 9 } else { total };
        let (mut cache, i) = self.activation_scratch(stream, len)?;
        let kernel = if bias.is_some() {
            "layer_norm_conv"
        } else {
            "rms_norm_conv"
        };
        let (n32, rows32) = (i32_arg("n", n)?, i32_arg("rows", rows)?);
        {
            let out = &mut cache[i].buf;
            let mut b = Args::new(self, stream, kernel);
            b.view(&x).view_or_null(w.as_ref());
            if bias.is_some() {
                b.view_or_null(bias.as_ref());
            }
            b.view_mut(&mut y)
                .scalar(&n32)
                .scalar(&eps)
                .scalar(&rows32)
                .scalar(&conv)
                .ptr_mut(&mut out.slice);
            // SAFETY: parameters match rms_norm_conv / layer_norm_conv in kernels/ops.cu; x and
            // y hold rows × n floats, the parameters n (checked above); the scratch holds the
            // conversion: rows·n int8 values and rows·n/32 scales (Q8, n a multiple of 32) or
            // rows·n floats (F16).
            unsafe { b.launch(geometry::per_row(kernel, rows)?) }?;
        }
        let v = if conv == 1 {
            DeviceView::from(&cache[i].buf)
        } else {
            cache[i].buf.view(0, total)?
        };
        self.launch_products(stream, &v, rows, &mut products)
    }

    /// Checks products of one activation of `t` tokens (one type and width, their outputs' and
    /// scores' lengths) and zeroes the sparse outputs that ask for it. Returns the first
    /// product's weight, `None` when there is no product.
    fn prepare_products<'w>(
        &self,
        stream: &Stream,
        t: usize,
        products: &mut [Product<'w, '_, '_>],
    ) -> Result<Option<&'w DeviceTensor>> {
        let Some(w0) = products.first().map(Product::weight) else {
            return Ok(None);
        };
        let (ty, cols) = (w0.ty(), w0.cols());
        for pr in products.iter_mut() {
            let w = pr.weight();
            if (w.ty(), w.cols()) != (ty, cols) {
                return Err(CudaError::Shape(format!(
                    "products with one activation need one type and width: {} x {} and {} x {}",
                    ty.name(),
                    cols,
                    w.ty().name(),
                    w.cols()
                )));
            }
            match pr {
                Product::Dense { w, dst } => check_len("dst", t * w.rows(), dst.len())?,
                Product::Sparse {
                    slice,
                    p,
                    dst,
                    clear,
                    ..
                } => {
                    let n = slice.n_neurons();
                    check_len("scores", t * n, p.len())?;
                    check_len("dst", t * n, dst.len())?;
                    // An empty view's memory is not its own (it may stand at another view's
                    // start).
                    if *clear && !dst.is_empty() {
                        stream.inner.memset_zeros(&mut dst.inner)?;
                    }
                }
            }
        }
        Ok(Some(w0))
    }

    /// Launches checked products ([`Gpu::prepare_products`]) on their converted activation.
    fn launch_products(
        &self,
        stream: &Stream,
        x: &In<'_>,
        t: usize,
        products: &mut [Product<'_, '_, '_>],
    ) -> Result<()> {
        for pr in products.iter_mut() {
            match pr {
                Product::Dense { w, dst } => {
                    let l = geometry::matmul(w.ty(), w.rows(), t)?;
                    self.launch_rows(stream, l, w, None, x, t, None, 0.0, w.rows(), dst)?;
                }
                Product::Sparse {
                    slice,
                    p,
                    theta,
                    dst,
                    ..
                } => {
                    let w = &slice.weight;
                    if dst.is_empty() {
                        continue;
                    }
                    let l = geometry::matmul(w.ty(), w.rows(), t)?;
                    let n = slice.n_neurons();
                    let bucket = slice.bucket.as_ref();
                    self.launch_rows(stream, l, w, bucket, x, t, Some(p), *theta, n, dst)?;
                }
            }
        }
        Ok(())
    }

    /// A gated FFN's hot neurons in one launch a token: for the rows of two GPU slices of one
    /// bucket (`gate`, `up`: one type, width and bucket; the gate's bucket places both, so an
    /// `up` of another bucket gives wrong rows, never an access outside them), `dst[t, bucket[j]] =
    /// act(gate_j · x_t, up_j · x_t)` where `p[t, bucket[j]] >= theta`, else 0; rows outside the
    /// bucket keep what they held. `x`: t × cols, converted as [`Gpu::matmul`] converts it;
    /// `p`, `dst`: t × N. Each token's products are the one-token kernels' (weights read once
    /// a token: for decode steps). With `count` (t values), the number of neurons each token
    /// computed ([`Gpu::count_active`]'s) is added to it.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_matmul<'x, 'p, 'c, 'y>(
        &self,
        stream: &Stream,
        gate: &GpuSlice,
        up: &GpuSlice,
        x: impl Into<In<'x>>,
        p: impl Into<In<'p>>,
        theta: f32,
        t: usize,
        act: Gate,
        count: Option<Out<'c>>,
        dst: impl Into<Out<'y>>,
    ) -> Result<()> {
        let (x, p, mut dst) = (x.into(), p.into(), dst.into());
        let mut count = count;
        if let Some(c) = &count {
            check_len("count", t, c.len())?;
        }
        let (wg, wu) = (&gate.weight, &up.weight);
        let n = gate.n_neurons();
        if (wg.ty(), wg.cols(), wg.rows(), wg.row_bytes(), n)
            != (
                wu.ty(),
                wu.cols(),
                wu.rows(),
                wu.row_bytes(),
                up.n_neurons(),
            )
        {
            return Err(CudaError::Shape(format!(
                "gate and up slices differ: {} x {} of {} and {} x {} of {}",
                wg.rows(),
                wg.cols(),
                wg.ty().name(),
                wu.rows(),
                wu.cols(),
                wu.ty().name()
            )));
        }
        check_len("x", t * wg.cols(), x.len())?;
        check_len("scores", t * n, p.len())?;
        check_len("dst", t * n, dst.len())?;
        if wg.rows() == 0 || t == 0 {
            return Ok(());
        }
        let l = geometry::gated(wg.ty(), wg.rows(), t)?;
        let row_bytes = wg.row_bytes() as i64;
        let (rows, k, t32, n32) = (
            i32_arg("rows", wg.rows())?,
            i32_arg("cols", wg.cols())?,
            i32_arg("tokens", t)?,
            i32_arg("neurons", n)?,
        );
        let kind = act.kind();
        self.with_activation(stream, wg, &x, t, |x| {
            let mut b = Args::new(self, stream, l.kernel);
            b.ptr(&wg.data.slice)
                .ptr(&wu.data.slice)
                .scalar(&row_bytes)
                .scalar(&rows)
                .scalar(&k)
                .view(x)
                .scalar(&t32)
                .view(&p);
            match gate.bucket.as_ref() {
                Some(bk) => b.ptr(&bk.slice),
                None => b.null(),
            };
            b.scalar(&theta).scalar(&n32).scalar(&kind);
            match count.as_mut() {
                Some(c) => b.view_mut(c),
                None => b.null(),
            };
            b.view_mut(&mut dst);
            // SAFETY: the parameters match matmul_gated_*_t1 in kernels/matmul.cu; the two
            // slices have the same rows, width and row size (checked above), so every row the
            // kernel reads of either exists; the bucket (validated when the slice was made) keeps
            // the writes inside dst's t × N; x, p and dst lengths are checked above.
            unsafe { b.launch(l) }
        })
    }

    /// Queues `launch` with what the product kernels for `w` read: `x` itself for F32
    /// weights; for F16 weights `x` rounded to f16 by `round_f16`, for Q8_0/Q4_0 weights `x`
    /// (t × cols) quantized by `quantize_q8` (t·cols int8 values, then t·cols/32 f32 scales,
    /// viewed as floats), both into the stream's cached scratch buffer
    /// ([`Gpu::activation_scratch`]). The scratch lock is held until `launch` has queued its
    /// kernel, so concurrent calls on one stream cannot overwrite each other's activation; after
    /// the first call of a size on a stream (or [`Gpu::reserve_activation`]) nothing is
    /// allocated.
    fn with_activation(
        &self,
        stream: &Stream,
        w: &DeviceTensor,
        x: &In<'_>,
        t: usize,
        launch: impl FnOnce(&In<'_>) -> Result<()>,
    ) -> Result<()> {
        let quantized = geometry::quantized_activation(w.ty());
        let f16 = w.ty() == powerinfer_gguf::GgmlType::F16;
        if !(quantized || f16) || t == 0 || w.cols() == 0 {
            return launch(x);
        }
        let n = t * w.cols();
        if f16 {
            let (mut cache, i) = self.activation_scratch(stream, n)?;
            let xr = &mut cache[i].buf;
            let n64 = n as i64;
            let mut b = Args::new(self, stream, "round_f16");
            b.view(x).ptr_mut(&mut xr.slice).scalar(&n64);
            // SAFETY: parameters match round_f16 in kernels/matmul.cu; x holds n floats (checked
            // by the caller), the scratch at least n; it writes the n floats the product reads.
            unsafe { b.launch(geometry::per_element("round_f16", n)?) }?;
            let v = cache[i].buf.view(0, n)?;
            return launch(&v);
        }
        // Quantized tensors have cols % 32 == 0 (checked when they are made).
        let blocks = n / 32;
        let (mut cache, i) = self.activation_scratch(stream, blocks * 8 + blocks)?;
        let xq = &mut cache[i].buf;
        let nb = blocks as i64;
        let mut b = Args::new(self, stream, "quantize_q8");
        b.view(x).scalar(&nb).ptr_mut(&mut xq.slice);
        // SAFETY: parameters match quantize_q8 in kernels/matmul.cu; x holds t·cols = 32·blocks
        // floats (checked by the caller), xq at least 32·blocks bytes plus `blocks` floats. It
        // writes all that the product kernel queued next reads.
        unsafe { b.launch(geometry::quantize_q8(blocks)?) }?;
        let v = DeviceView::from(&cache[i].buf);
        launch(&v)
    }

    /// Sparse axpy over the down rows of a GPU slice: `dst` (t × cols) becomes
    /// `dst[t] = Σ_j a[t, bucket[j]] · W_j` over the rows whose neuron is selected for token t
    /// (`p[t, bucket[j]] >= theta`, or every row when `p` is `None`) and whose activation is
    /// non-zero. `a` and `p`: t × N. Up to [`geometry::AXPY_SPARSE_MAX_TOKENS`] tokens a per-token sparse
    /// kernel runs, above it a kernel tiled over 8 tokens.
    pub fn sparse_axpy<'a, 'p, 'y>(
        &self,
        stream: &Stream,
        slice: &GpuSlice,
        a: impl Into<In<'a>>,
        p: Option<In<'p>>,
        theta: f32,
        t: usize,
        dst: impl Into<Out<'y>>,
    ) -> Result<()> {
        self.axpy_into(stream, slice, a.into(), p, theta, t, dst.into(), true)
    }

    /// [`Gpu::sparse_axpy`] added to `dst` instead of written over it: `dst[t] += Σ_j ...`
    /// (no memset first; the residual add of an FFN in the same launch).
    #[allow(clippy::too_many_arguments)]
    pub fn sparse_axpy_add<'a, 'p, 'y>(
        &self,
        stream: &Stream,
        slice: &GpuSlice,
        a: impl Into<In<'a>>,
        p: Option<In<'p>>,
        theta: f32,
        t: usize,
        dst: impl Into<Out<'y>>,
    ) -> Result<()> {
        self.axpy_into(stream, slice, a.into(), p, theta, t, dst.into(), false)
    }

    #[allow(clippy::too_many_arguments)]
    fn axpy_into(
        &self,
        stream: &Stream,
        slice: &GpuSlice,
        a: In<'_>,
        p: Option<In<'_>>,
        theta: f32,
        t: usize,
        mut dst: Out<'_>,
        clear: bool,
    ) -> Result<()> {
        let w = &slice.weight;
        let n = slice.n_neurons();
        let m = w.cols();
        check_len("activations", t * n, a.len())?;
        if let Some(p) = &p {
            check_len("scores", t * n, p.len())?;
        }
        check_len("dst", t * m, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        if clear {
            stream.inner.memset_zeros(&mut dst.inner)?;
        }
        let l = geometry::axpy(w.ty(), m, w.rows(), t)?;
        if m == 0 {
            return Ok(());
        }
        self.launch_rows(
            stream,
            l,
            w,
            slice.bucket.as_ref(),
            &a,
            t,
            p.as_ref(),
            theta,
            n,
            &mut dst,
        )
    }

    /// RMSNorm of `rows` rows of `n`: `y = x / sqrt(mean(x²) + eps) * w` (`w` of length n, or 1).
    pub fn rms_norm<'x, 'w, 'y>(
        &self,
        stream: &Stream,
        x: impl Into<In<'x>>,
        w: Option<In<'w>>,
        eps: f32,
        rows: usize,
        n: usize,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let shape = NormShape { eps, rows, n };
        let x = NormInput::Plain(x.into());
        self.norm(stream, "rms_norm", x, &[w.as_ref()], shape, y.into())
    }

    /// LayerNorm of `rows` rows of `n`: `y = (x - mean) / sqrt(var + eps) * w + b` (population
    /// variance; `w` and `b` of length n, or 1 and 0).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm<'x, 'w, 'b, 'y>(
        &self,
        stream: &Stream,
        x: impl Into<In<'x>>,
        w: Option<In<'w>>,
        bias: Option<In<'b>>,
        eps: f32,
        rows: usize,
        n: usize,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let shape = NormShape { eps, rows, n };
        let params = [w.as_ref(), bias.as_ref()];
        let x = NormInput::Plain(x.into());
        self.norm(stream, "layer_norm", x, &params, shape, y.into())
    }

    /// The residual add and the RMSNorm after it in one launch: `x += a`, then
    /// `y = x / sqrt(mean(x²) + eps) * w` (`x`, `a`, `y`: rows × n; `w` of length n, or 1).
    /// The same operations as [`Gpu::binary`] `Add` followed by [`Gpu::rms_norm`].
    #[allow(clippy::too_many_arguments)]
    pub fn add_rms_norm<'x, 'a, 'w, 'y>(
        &self,
        stream: &Stream,
        x: impl Into<Out<'x>>,
        a: impl Into<In<'a>>,
        w: Option<In<'w>>,
        eps: f32,
        rows: usize,
        n: usize,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let shape = NormShape { eps, rows, n };
        let (x, a, y) = (x.into(), a.into(), y.into());
        let x = NormInput::Residual(x, a);
        self.norm(stream, "add_rms_norm", x, &[w.as_ref()], shape, y)
    }

    /// The residual add and the LayerNorm after it in one launch: `x += a`, then
    /// [`Gpu::layer_norm`] of `x` into `y`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_layer_norm<'x, 'a, 'w, 'b, 'y>(
        &self,
        stream: &Stream,
        x: impl Into<Out<'x>>,
        a: impl Into<In<'a>>,
        w: Option<In<'w>>,
        bias: Option<In<'b>>,
        eps: f32,
        rows: usize,
        n: usize,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let shape = NormShape { eps, rows, n };
        let (x, a, y) = (x.into(), a.into(), y.into());
        let params = [w.as_ref(), bias.as_ref()];
        self.norm(
            stream,
            "add_layer_norm",
            NormInput::Residual(x, a),
            &params,
            shape,
            y,
        )
    }

    /// A norm kernel over `rows` rows of `n`: its input (`x`, or `x` updated by the residual
    /// `a` for the add-and-norm kernels), its optional per-column parameters (each of length n,
    /// null when absent), `y`, `n` and `eps`.
    fn norm(
        &self,
        stream: &Stream,
        kernel: &'static str,
        mut x: NormInput<'_, '_>,
        params: &[Option<&In<'_>>],
        sh: NormShape,
        mut y: Out<'_>,
    ) -> Result<()> {
        let NormShape { eps, rows, n } = sh;
        match &x {
            NormInput::Plain(v) => check_len("x", rows * n, v.len())?,
            NormInput::Residual(v, a) => {
                check_len("x", rows * n, v.len())?;
                check_len("a", rows * n, a.len())?;
            }
        }
        check_len("y", rows * n, y.len())?;
        for v in params.iter().flatten() {
            check_len("weight/bias", n, v.len())?;
        }
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let n32 = i32_arg("n", n)?;
        let mut b = Args::new(self, stream, kernel);
        match &mut x {
            NormInput::Plain(v) => b.view(v),
            NormInput::Residual(v, a) => b.view_mut(v).view(a),
        };
        for &v in params {
            b.view_or_null(v);
        }
        b.view_mut(&mut y).scalar(&n32).scalar(&eps);
        // SAFETY: parameters match rms_norm, layer_norm, add_rms_norm and add_layer_norm in
        // kernels/ops.cu (the input, the optional parameters, y, n, eps); lengths checked above.
        // A residual's x and y are distinct mutable views, its a is read only.
        unsafe { b.launch(geometry::per_row(kernel, rows)?) }
    }

    /// RoPE in place on `t` tokens of `n_head` heads of `head_dim` (`pos`: t positions), angles
    /// as the CPU kernels compute them (`freq_scale · pos · base^(-2i/n_rot)` by repeated f32
    /// products).
    pub fn rope<'x, 'p>(
        &self,
        stream: &Stream,
        x: impl Into<Out<'x>>,
        pos: impl Into<DeviceView<'p, i32>>,
        t: usize,
        n_head: usize,
        head_dim: usize,
        n_rot: usize,
        base: f32,
        freq_scale: f32,
        mode: RopeMode,
    ) -> Result<()> {
        let (mut x, pos) = (x.into(), pos.into());
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
        let theta_scale = rope_theta_scale(base, n_rot);
        let mut b = Args::new(self, stream, "rope");
        b.view_mut(&mut x)
            .view(&pos)
            .scalar(&h)
            .scalar(&d)
            .scalar(&r)
            .scalar(&theta_scale)
            .scalar(&freq_scale)
            .scalar(&neox);
        // SAFETY: parameters match rope in kernels/ops.cu; lengths checked above.
        unsafe { b.launch(geometry::rope(t, n_head, n_rot)?) }
    }

    /// RoPE of Q (`t` tokens of `n_head` heads) and K (`t` tokens of `n_head_kv` heads) in one
    /// launch, each as [`Gpu::rope`] rotates it.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk<'q, 'k, 'p>(
        &self,
        stream: &Stream,
        q: impl Into<Out<'q>>,
        k: impl Into<Out<'k>>,
        pos: impl Into<DeviceView<'p, i32>>,
        t: usize,
        (n_head, n_head_kv): (usize, usize),
        head_dim: usize,
        n_rot: usize,
        base: f32,
        freq_scale: f32,
        mode: RopeMode,
    ) -> Result<()> {
        let (mut q, mut k, pos) = (q.into(), k.into(), pos.into());
        check_len("q", t * n_head * head_dim, q.len())?;
        check_len("k", t * n_head_kv * head_dim, k.len())?;
        check_len("positions", t, pos.len())?;
        if n_rot > head_dim || n_rot % 2 != 0 {
            return Err(CudaError::Shape(format!(
                "n_rot {n_rot} must be even and at most head_dim {head_dim}"
            )));
        }
        if t == 0 || (n_head + n_head_kv) * n_rot == 0 {
            return Ok(());
        }
        let (h, hk, d, r) = (
            i32_arg("n_head", n_head)?,
            i32_arg("n_head_kv", n_head_kv)?,
            i32_arg("head_dim", head_dim)?,
            i32_arg("n_rot", n_rot)?,
        );
        let neox = i32::from(mode == RopeMode::Neox);
        let theta_scale = rope_theta_scale(base, n_rot);
        let mut b = Args::new(self, stream, "rope_qk");
        b.view_mut(&mut q)
            .view_mut(&mut k)
            .view(&pos)
            .scalar(&h)
            .scalar(&hk)
            .scalar(&d)
            .scalar(&r)
            .scalar(&theta_scale)
            .scalar(&freq_scale)
            .scalar(&neox);
        // SAFETY: parameters match rope_qk in kernels/ops.cu; lengths checked above; q and k
        // are distinct mutable views.
        unsafe { b.launch(geometry::rope_qk(t, n_head, n_head_kv, n_rot)?) }
    }

    /// Softmax of `scale * x` over each of `rows` rows of `n`, in place.
    pub fn softmax<'x>(
        &self,
        stream: &Stream,
        x: impl Into<Out<'x>>,
        rows: usize,
        n: usize,
        scale: f32,
    ) -> Result<()> {
        let mut x = x.into();
        check_len("x", rows * n, x.len())?;
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let n32 = i32_arg("n", n)?;
        let mut b = Args::new(self, stream, "softmax");
        b.view_mut(&mut x).scalar(&n32).scalar(&scale);
        // SAFETY: parameters match softmax in kernels/ops.cu; length checked above.
        unsafe { b.launch(geometry::per_row("softmax", rows)?) }
    }

    /// One thread per element of `a`: kernel `name` with `a` (and `b2`), then `y`, `n` (and
    /// `extra`), every operand of `a`'s length.
    fn elementwise(
        &self,
        stream: &Stream,
        name: &'static str,
        a: &In<'_>,
        b2: Option<&In<'_>>,
        y: &mut Out<'_>,
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
        b.view(a);
        if let Some(b2) = b2 {
            b.view(b2);
        }
        b.view_mut(y).scalar(&n64);
        if let Some(e) = extra.as_ref() {
            b.scalar(e);
        }
        // SAFETY: parameters match the element-wise kernels in kernels/ops.cu and round_f16 in
        // kernels/matmul.cu (inputs, output, n, then `extra`); lengths checked.
        unsafe { b.launch(geometry::per_element(name, n)?) }
    }

    /// `y = op(x)` element-wise (`y` and `x` of one length).
    pub fn unary<'x, 'y>(
        &self,
        stream: &Stream,
        op: Unary,
        x: impl Into<In<'x>>,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let (x, mut y) = (x.into(), y.into());
        self.elementwise(stream, op.kernel(), &x, None, &mut y, None)
    }

    /// `y = op(a, b)` element-wise (`a`, `b` and `y` of one length).
    pub fn binary<'a, 'b, 'y>(
        &self,
        stream: &Stream,
        op: Binary,
        a: impl Into<In<'a>>,
        b: impl Into<In<'b>>,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let (a, b, mut y) = (a.into(), b.into(), y.into());
        let (kernel, extra) = op.kernel();
        self.elementwise(stream, kernel, &a, Some(&b), &mut y, extra)
    }

    /// `y = max(y, 0)` in place.
    pub fn relu_in_place<'y>(&self, stream: &Stream, y: impl Into<Out<'y>>) -> Result<()> {
        let mut y = y.into();
        let n = y.len();
        if n == 0 {
            return Ok(());
        }
        let n64 = n as i64;
        let mut b = Args::new(self, stream, "relu_inplace");
        b.view_mut(&mut y).scalar(&n64);
        // SAFETY: parameters match relu_inplace in kernels/ops.cu; n = y's length.
        unsafe { b.launch(geometry::per_element("relu_inplace", n)?) }
    }

    /// `y = 0` (a memset on the stream).
    pub fn zero<'y>(&self, stream: &Stream, y: impl Into<Out<'y>>) -> Result<()> {
        let mut y = y.into();
        // An empty view's memory is not its own (it may stand at another view's start).
        if y.is_empty() {
            return Ok(());
        }
        Ok(stream.inner.memset_zeros(&mut y.inner)?)
    }

    /// `y[r] += bias` for every row `r` of `y` (rows of `bias.len()` values).
    pub fn add_rows<'y, 'b>(
        &self,
        stream: &Stream,
        y: impl Into<Out<'y>>,
        bias: impl Into<In<'b>>,
    ) -> Result<()> {
        let (mut y, bias) = (y.into(), bias.into());
        let (total, n) = (y.len(), bias.len());
        if n == 0 || total % n != 0 {
            return Err(CudaError::Shape(format!(
                "a bias of {n} values over {total}"
            )));
        }
        let (n32, t64) = (i32_arg("bias length", n)?, total as i64);
        let mut b = Args::new(self, stream, "add_rows");
        b.view_mut(&mut y).view(&bias).scalar(&n32).scalar(&t64);
        // SAFETY: parameters match add_rows in kernels/ops.cu; y holds total floats, bias n,
        // and the kernel reads bias[i % n].
        unsafe { b.launch(geometry::per_element("add_rows", total)?) }
    }

    /// `y = x` (a copy on the stream, equal lengths).
    pub fn copy<'x, 'y>(
        &self,
        stream: &Stream,
        x: impl Into<In<'x>>,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let (x, mut y) = (x.into(), y.into());
        check_len("copy destination", x.len(), y.len())?;
        if x.is_empty() {
            return Ok(());
        }
        stream.inner.memcpy_dtod(&x.inner, &mut y.inner)?;
        Ok(())
    }

    /// Rows `rows[i] + offset` of `w` as floats into `y` (`rows.len() × cols`): token or
    /// position embeddings.
    pub fn get_rows<'r, 'y>(
        &self,
        stream: &Stream,
        w: &DeviceTensor,
        rows: impl Into<DeviceView<'r, i32>>,
        offset: usize,
        y: impl Into<Out<'y>>,
    ) -> Result<()> {
        let (rows, mut y) = (rows.into(), y.into());
        let n = rows.len();
        check_len("rows", n * w.cols(), y.len())?;
        if n == 0 || w.cols() == 0 {
            return Ok(());
        }
        let l = geometry::get_rows(w.ty(), w.cols(), n)?;
        let (rb, cols, off) = (
            w.row_bytes() as i64,
            i32_arg("cols", w.cols())?,
            i32_arg("offset", offset)?,
        );
        let mut b = Args::new(self, stream, l.kernel);
        b.ptr(&w.data.slice)
            .scalar(&rb)
            .scalar(&cols)
            .view(&rows)
            .scalar(&off)
            .view_mut(&mut y);
        // SAFETY: parameters match get_rows_* in kernels/ops.cu; y holds n rows of cols; the
        // row indices plus offset must be below w's rows: the caller's contract (the engine
        // checks token ids and positions against the tables before a step).
        unsafe { b.launch(l) }
    }

    /// `out[t]` = how many of a hot slice's rows token `t` computes (`p[t, bucket[j]] >=
    /// theta`), as floats; `p`: t × N scores.
    pub fn count_active<'p, 'o>(
        &self,
        stream: &Stream,
        slice: &GpuSlice,
        p: impl Into<In<'p>>,
        theta: f32,
        t: usize,
        out: impl Into<Out<'o>>,
    ) -> Result<()> {
        let (p, mut out) = (p.into(), out.into());
        let n = slice.n_neurons();
        check_len("scores", t * n, p.len())?;
        check_len("counts", t, out.len())?;
        let Some(bucket) = slice.bucket.as_ref() else {
            return Err(CudaError::Shape("a slice without a bucket".into()));
        };
        if t == 0 {
            return Ok(());
        }
        let (k, n32) = (i32_arg("rows", slice.len())?, i32_arg("neurons", n)?);
        let mut b = Args::new(self, stream, "count_active");
        b.view(&p)
            .ptr(&bucket.slice)
            .scalar(&k)
            .scalar(&n32)
            .scalar(&theta)
            .view_mut(&mut out);
        // SAFETY: parameters match count_active in kernels/ops.cu; p holds t × N scores, the
        // bucket k entries below N (validated when the slice was made), out t floats.
        unsafe { b.launch(geometry::count_active(t)?) }
    }

    /// Stores K and V of `t` tokens (`t * n_kv_head * head_dim` floats each, token-major) as
    /// f16 at their positions `pos` (`t` values in device memory, so that one program serves
    /// every token; a position outside the cache writes nothing: callers check positions on
    /// the host).
    pub fn kv_store<'k, 'v, 'p>(
        &self,
        stream: &Stream,
        cache: &mut LayerKv,
        k: impl Into<In<'k>>,
        v: impl Into<In<'v>>,
        pos: impl Into<DeviceView<'p, i32>>,
        t: usize,
    ) -> Result<()> {
        let (k, v, pos) = (k.into(), v.into(), pos.into());
        let row = cache.n_kv_head * cache.head_dim;
        check_len("k", t * row, k.len())?;
        check_len("v", t * row, v.len())?;
        check_len("positions", t, pos.len())?;
        let (row32, t32, ctx) = (
            i32_arg("row", row)?,
            i32_arg("tokens", t)?,
            i32_arg("n_ctx", cache.n_ctx)?,
        );
        let mut b = Args::new(self, stream, "kv_store");
        b.view(&k)
            .view(&v)
            .ptr_mut(&mut cache.k.slice)
            .ptr_mut(&mut cache.v.slice)
            .view(&pos)
            .scalar(&row32)
            .scalar(&t32)
            .scalar(&ctx);
        // SAFETY: parameters match kv_store in kernels/ops.cu; k and v hold t * row floats,
        // pos t ints; the kernel writes only rows of positions below n_ctx, which the caches
        // hold.
        unsafe { b.launch(geometry::per_element("kv_store", t * row)?) }
    }

    /// Causal attention of `t` query tokens at positions `pos` (`t` values in device memory)
    /// over the cache: token i sees positions `0 ..= pos[i]` (within the cache), with
    /// grouped-query heads (n_head a multiple of the cache's n_kv_head). `q`, `out`:
    /// t × n_head × head_dim; `scratch`: at least t × n_head × n_ctx floats. Decoding is
    /// `t = 1`.
    pub fn attention<'q, 'p, 'o, 's>(
        &self,
        stream: &Stream,
        q: impl Into<In<'q>>,
        cache: &LayerKv,
        n_head: usize,
        pos: impl Into<DeviceView<'p, i32>>,
        t: usize,
        scale: f32,
        out: impl Into<Out<'o>>,
        scratch: impl Into<Out<'s>>,
    ) -> Result<()> {
        let (q, pos, mut out, mut scratch) = (q.into(), pos.into(), out.into(), scratch.into());
        let hd = cache.head_dim;
        check_len("q", t * n_head * hd, q.len())?;
        check_len("out", t * n_head * hd, out.len())?;
        check_len("positions", t, pos.len())?;
        if cache.n_kv_head == 0 || n_head % cache.n_kv_head != 0 {
            return Err(CudaError::Shape(format!(
                "{n_head} heads over {} KV heads",
                cache.n_kv_head
            )));
        }
        let need = t * n_head * cache.n_ctx;
        if scratch.len() < need {
            return Err(CudaError::Length {
                what: "attention scratch",
                expected: need,
                got: scratch.len(),
            });
        }
        if n_head == 0 || hd == 0 || t == 0 {
            return Ok(());
        }
        let (h, kvh, d, ctx) = (
            i32_arg("n_head", n_head)?,
            i32_arg("n_kv", cache.n_kv_head)?,
            i32_arg("head_dim", hd)?,
            i32_arg("n_ctx", cache.n_ctx)?,
        );
        let mut b = Args::new(self, stream, "attention_f16kv");
        b.view(&q)
            .ptr(&cache.k.slice)
            .ptr(&cache.v.slice)
            .view(&pos)
            .view_mut(&mut out)
            .view_mut(&mut scratch);
        b.scalar(&h)
            .scalar(&kvh)
            .scalar(&d)
            .scalar(&ctx)
            .scalar(&scale);
        // SAFETY: parameters match attention_f16kv in kernels/ops.cu; the kernel reads at most
        // n_ctx positions of the caches, scratch has t * n_head * n_ctx floats, q and out
        // lengths and the t positions checked above.
        unsafe { b.launch(geometry::attention(n_head, t)?) }
    }

    /// `mask[i] = p[i] >= theta` (1 or 0) for every score.
    pub fn threshold_mask<'p>(
        &self,
        stream: &Stream,
        p: impl Into<In<'p>>,
        theta: f32,
        mask: &mut DeviceBuffer<u8>,
    ) -> Result<()> {
        let p = p.into();
        check_len("mask", p.len(), mask.len())?;
        if p.is_empty() {
            return Ok(());
        }
        let n = p.len() as i64;
        let mut b = Args::new(self, stream, "threshold_mask");
        b.view(&p)
            .ptr_mut(&mut mask.slice)
            .scalar(&n)
            .scalar(&theta);
        // SAFETY: parameters match threshold_mask in kernels/ops.cu; lengths checked.
        unsafe { b.launch(geometry::per_element("threshold_mask", p.len())?) }
    }

    /// The ascending indices i with `p[i] >= theta` of one token's scores: writes them to the
    /// front of `idx` (length ≥ p.len()) and their number to `count[0]`.
    pub fn active_list<'p>(
        &self,
        stream: &Stream,
        p: impl Into<In<'p>>,
        theta: f32,
        idx: &mut DeviceBuffer<u32>,
        count: &mut DeviceBuffer<u32>,
    ) -> Result<()> {
        let p = p.into();
        check_len("index buffer", p.len(), idx.len())?;
        check_len("count", 1, count.len())?;
        let n = i32_arg("n", p.len())?;
        let mut b = Args::new(self, stream, "active_list");
        b.view(&p)
            .scalar(&n)
            .scalar(&theta)
            .ptr_mut(&mut idx.slice)
            .ptr_mut(&mut count.slice);
        // SAFETY: parameters match active_list in kernels/ops.cu; idx holds n entries.
        unsafe { b.launch(geometry::active_list()) }
    }

    /// The predictor MLP: `scores = fc2 · ReLU(fc1 · h)` for `t` tokens (`fc1`: hidden × d,
    /// `fc2`: N × hidden, `h`: t × d, `hidden`: t × hidden scratch, `scores`: t × N).
    pub fn predictor<'h, 'm, 's>(
        &self,
        stream: &Stream,
        fc1: &DeviceTensor,
        fc2: &DeviceTensor,
        h: impl Into<In<'h>>,
        t: usize,
        hidden: impl Into<Out<'m>>,
        scores: impl Into<Out<'s>>,
    ) -> Result<()> {
        if fc2.cols() != fc1.rows() {
            return Err(CudaError::Shape(format!(
                "fc2 takes {} inputs, fc1 gives {}",
                fc2.cols(),
                fc1.rows()
            )));
        }
        let mut hidden = hidden.into();
        self.matmul(stream, fc1, h, t, hidden.as_mut())?;
        if fc2.ty() != powerinfer_gguf::GgmlType::F16 {
            self.relu_in_place(stream, hidden.as_mut())?;
            return self.matmul(stream, fc2, hidden.as_view(), t, scores);
        }
        // F16 fc2 rows multiply the hidden layer rounded to f16: rounded with the ReLU, in its
        // launch, and multiplied as it is.
        let n = hidden.len();
        if n > 0 {
            let n64 = n as i64;
            let mut b = Args::new(self, stream, "relu_round_f16_inplace");
            b.view_mut(&mut hidden).scalar(&n64);
            // SAFETY: parameters match relu_round_f16_inplace in kernels/ops.cu; n = its length.
            unsafe { b.launch(geometry::per_element("relu_round_f16_inplace", n)?) }?;
        }
        let mut products = vec![Product::Dense {
            w: fc2,
            dst: scores.into(),
        }];
        let Some(w) = self.prepare_products(stream, t, &mut products)? else {
            return Ok(());
        };
        check_len("hidden", t * w.cols(), n)?;
        self.launch_products(stream, &hidden.as_view(), t, &mut products)
    }
}
