//! The device handle: detection, kernel loading, streams, budgeted buffers and pinned host memory.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr,
    PinnedHostSlice, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;

use crate::budget::{MemoryBudget, Reservation};
use crate::error::{CudaError, NoGpu, Result};
use crate::kernels::{cubin_arch_for, KernelModule};

/// Whether the CUDA driver library can be loaded (never panics).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda by its candidate names; no driver call is made.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Which embedded image the kernels were loaded from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelImage {
    /// The CUBIN for this architecture (`sm_80`, `sm_90`).
    Cubin(&'static str),
    /// The compute_80 PTX, JIT-compiled by the driver.
    Ptx,
}

/// What the device is.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// Device name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Total device memory in bytes.
    pub total_memory: u64,
    /// Image the kernels were loaded from.
    pub image: KernelImage,
}

/// A CUDA stream of a [`Gpu`]. Work on one stream runs in order; different streams may overlap
/// each other and the host.
#[derive(Clone, Debug)]
pub struct Stream {
    pub(crate) inner: Arc<CudaStream>,
}

impl Stream {
    /// Blocks the host until the stream's work is done.
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.inner.synchronize()?)
    }

    /// Makes later work on `self` wait for the work queued on `other` so far (no host wait).
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        Ok(self.inner.join(&other.inner)?)
    }

    /// The cudarc stream, for callers that need more.
    pub fn cuda(&self) -> &Arc<CudaStream> {
        &self.inner
    }
}

/// A point of a stream's work that can be timed: [`Stream::record`] places it,
/// [`TimedEvent::elapsed`] measures the device time between two.
#[derive(Debug)]
pub struct TimedEvent {
    inner: cudarc::driver::CudaEvent,
}

impl TimedEvent {
    /// The device time from this event to `end`, once both were reached (it waits for them).
    pub fn elapsed(&self, end: &TimedEvent) -> Result<std::time::Duration> {
        let ms = self.inner.elapsed_ms(&end.inner)?;
        Ok(std::time::Duration::from_secs_f64(
            f64::from(ms.max(0.0)) * 1e-3,
        ))
    }
}

impl Stream {
    /// Places `event` after the work queued so far.
    pub fn record(&self, event: &TimedEvent) -> Result<()> {
        Ok(event.inner.record(&self.inner)?)
    }

    /// Captures the work `queue` puts on this stream into a [`Graph`] instead of running it:
    /// the kernels and copies with the arguments they had, replayed by [`Graph::launch`] with
    /// one launch. `queue` must not wait on the stream, allocate or record timed events. The
    /// capture ends whether `queue` succeeds or not.
    pub fn capture<E: From<CudaError>>(
        &self,
        queue: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<Graph, E> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.inner
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| E::from(CudaError::from(e)))?;
        let queued = queue();
        let graph = self
            .inner
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(|e| E::from(CudaError::from(e)));
        queued?;
        match graph? {
            Some(inner) => Ok(Graph { inner }),
            None => Err(E::from(CudaError::Shape("a capture of no work".into()))),
        }
    }
}

/// Work captured from a stream ([`Stream::capture`]), replayed with one launch.
pub struct Graph {
    inner: cudarc::driver::CudaGraph,
}

// SAFETY: the graph's driver handles may be used from any thread; the driver only asks that
// calls on one graph be serialized, which holds because `Graph` is not `Sync` (a thread that
// launches it owns it or holds the lock it lives under).
unsafe impl Send for Graph {}

impl Graph {
    /// Queues the captured work on the stream it was captured from.
    pub fn launch(&self) -> Result<()> {
        Ok(self.inner.launch()?)
    }
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Graph")
    }
}

/// A device buffer of `T` whose bytes are held against the [`Gpu`]'s budget until dropped.
#[derive(Debug)]
pub struct DeviceBuffer<T> {
    /// max(len, 1) elements: the driver is never asked for 0 bytes.
    pub(crate) slice: CudaSlice<T>,
    len: usize,
    _reservation: Reservation,
}

impl<T: DeviceRepr + ValidAsZeroBits> DeviceBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The cudarc slice (one element long when the buffer is empty).
    pub fn cuda(&self) -> &CudaSlice<T> {
        &self.slice
    }

    /// The cudarc slice, for writing (one element long when the buffer is empty).
    pub fn cuda_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }

    /// Copies the buffer to the host (waits for `stream`).
    pub fn to_host(&self, stream: &Stream) -> Result<Vec<T>> {
        if self.len == 0 {
            return Ok(Vec::new());
        }
        let v = stream.inner.clone_dtoh(&self.slice)?;
        stream.inner.synchronize()?;
        Ok(v)
    }

    /// Copies `src` into the buffer on `stream` (`src.len()` must equal the buffer's length).
    pub fn copy_from(&mut self, stream: &Stream, src: &[T]) -> Result<()> {
        check_len("copy source", self.len(), src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        Ok(stream.inner.memcpy_htod(src, &mut self.slice)?)
    }

    /// Copies a pinned host buffer into the device buffer asynchronously on `stream`.
    pub fn copy_from_pinned(&mut self, stream: &Stream, src: &PinnedBuffer<T>) -> Result<()> {
        check_len("copy source", self.len(), src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        stream.inner.memcpy_htod(&src.inner, &mut self.slice)?;
        src.copied(stream)
    }

    /// Copies the device buffer into a pinned host buffer asynchronously on `stream`.
    pub fn copy_to_pinned(&self, stream: &Stream, dst: &mut PinnedBuffer<T>) -> Result<()> {
        check_len("copy destination", self.len(), dst.len())?;
        if self.len == 0 {
            return Ok(());
        }
        stream.inner.memcpy_dtoh(&self.slice, &mut dst.inner)?;
        dst.copied(stream)
    }
}

/// Elements `start .. start + len` of a device buffer, as an operator reads them.
#[derive(Debug)]
pub struct DeviceView<'a, T> {
    pub(crate) inner: CudaView<'a, T>,
    len: usize,
}

/// Elements `start .. start + len` of a device buffer, as an operator writes them.
#[derive(Debug)]
pub struct DeviceViewMut<'a, T> {
    pub(crate) inner: CudaViewMut<'a, T>,
    len: usize,
}

impl<T> DeviceView<'_, T> {
    /// The same elements again (a view can be passed to several operators).
    pub fn reborrow(&self) -> DeviceView<'_, T> {
        DeviceView {
            inner: self.inner.slice(..),
            len: self.len,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T> DeviceViewMut<'_, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The same elements, read.
    pub fn as_view(&self) -> DeviceView<'_, T> {
        DeviceView {
            inner: self.inner.slice(..),
            len: self.len,
        }
    }

    /// The same elements, written (a shorter borrow, for passing on).
    pub fn as_mut(&mut self) -> DeviceViewMut<'_, T> {
        let len = self.len;
        DeviceViewMut {
            inner: self.inner.slice_mut(..),
            len,
        }
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> DeviceView<'_, T> {
    /// Copies the view into the first `len` elements of a pinned host buffer at least as long,
    /// asynchronously on `stream` (the buffer's contents wait for the copy when read). A
    /// staging buffer made once for the longest copy serves every shorter one.
    pub fn copy_to_pinned(&self, stream: &Stream, dst: &mut PinnedBuffer<T>) -> Result<()> {
        check_room("copy destination", self.len, dst.len())?;
        if self.len == 0 {
            return Ok(());
        }
        // The prefix as a plain slice: cudarc copies exactly its length and adds no wait of its
        // own; the buffer's event, recorded below, is what its readers wait for.
        let host = &mut dst.inner.as_mut_slice()?[..self.len];
        stream.inner.memcpy_dtoh(&self.inner, host)?;
        dst.copied(stream)
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> DeviceViewMut<'_, T> {
    /// Copies the first `len` elements of a pinned host buffer at least as long into it,
    /// asynchronously on `stream` (the buffer waits for the copy before it is written again).
    pub fn copy_from_pinned(&mut self, stream: &Stream, src: &PinnedBuffer<T>) -> Result<()> {
        check_room("copy source", self.len, src.len())?;
        if self.len == 0 {
            return Ok(());
        }
        let host = &src.inner.as_slice()?[..self.len];
        stream.inner.memcpy_htod(host, &mut self.inner)?;
        src.copied(stream)
    }
}

/// The range of a view: `start .. start + len` inside `total` elements, or an index error.
fn view_range(start: usize, len: usize, total: usize) -> Result<std::ops::Range<usize>> {
    match start.checked_add(len) {
        Some(end) if end <= total => Ok(start..end),
        _ => Err(CudaError::Index {
            what: "buffer view",
            index: start.saturating_add(len),
            len: total,
        }),
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> DeviceBuffer<T> {
    /// Elements `start .. start + len`, read.
    pub fn view(&self, start: usize, len: usize) -> Result<DeviceView<'_, T>> {
        let r = view_range(start, len, self.len)?;
        // An empty view still points into the (at least one element long) allocation.
        let r = if r.is_empty() { 0..1 } else { r };
        Ok(DeviceView {
            inner: self.slice.slice(r),
            len,
        })
    }

    /// Elements `start .. start + len`, written.
    pub fn view_mut(&mut self, start: usize, len: usize) -> Result<DeviceViewMut<'_, T>> {
        let r = view_range(start, len, self.len)?;
        let r = if r.is_empty() { 0..1 } else { r };
        Ok(DeviceViewMut {
            inner: self.slice.slice_mut(r),
            len,
        })
    }
}

impl<'a, T> From<&'a DeviceBuffer<T>> for DeviceView<'a, T> {
    fn from(b: &'a DeviceBuffer<T>) -> Self {
        DeviceView {
            inner: b.slice.slice(..),
            len: b.len,
        }
    }
}

impl<'a, T> From<&'a mut DeviceBuffer<T>> for DeviceViewMut<'a, T> {
    fn from(b: &'a mut DeviceBuffer<T>) -> Self {
        let len = b.len;
        DeviceViewMut {
            inner: b.slice.slice_mut(..),
            len,
        }
    }
}

/// Page-locked host memory: copies from and to it are asynchronous, so the host can work while a
/// stream copies. Its own event, recorded after every copy queued through this crate, is what
/// reading, writing and dropping it wait for (cudarc records the buffer's event only while it
/// tracks events across streams, which a GPU opened by [`Gpu::open_one_stream`] does not).
#[derive(Debug)]
pub struct PinnedBuffer<T> {
    inner: PinnedHostSlice<T>,
    done: cudarc::driver::CudaEvent,
}

impl<T> PinnedBuffer<T> {
    /// Marks the end of a copy just queued on `stream`.
    fn copied(&self, stream: &Stream) -> Result<()> {
        Ok(self.done.record(&stream.inner)?)
    }
}

impl<T> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        // The page-locked memory is freed next: no copy may still be using it. (An error
        // here is the driver's; it reports it again at the next call.)
        let _ = self.done.synchronize();
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> PinnedBuffer<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.inner.len() == 0
    }

    /// The contents, after waiting for the copies that use it.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.done.synchronize()?;
        Ok(self.inner.as_slice()?)
    }

    /// The contents for writing, after waiting for the copies that use it.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.done.synchronize()?;
        Ok(self.inner.as_mut_slice()?)
    }
}

/// A pinned buffer of `got` elements holds a copy of `needed`.
fn check_room(what: &'static str, needed: usize, got: usize) -> Result<()> {
    if needed <= got {
        Ok(())
    } else {
        Err(CudaError::Length {
            what,
            expected: needed,
            got,
        })
    }
}

pub(crate) fn check_len(what: &'static str, expected: usize, got: usize) -> Result<()> {
    if expected == got {
        Ok(())
    } else {
        Err(CudaError::Length {
            what,
            expected,
            got,
        })
    }
}

/// A GPU with the kernels loaded, a default stream and a byte budget for device buffers.
#[derive(Debug)]
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Stream,
    budget: MemoryBudget,
    info: DeviceInfo,
    functions: HashMap<&'static str, CudaFunction>,
    /// Per stream, the scratch buffer of the quantized activation (see [`Gpu::activation_scratch`]).
    scratch: Mutex<Vec<ScratchEntry>>,
    /// Opened by [`Gpu::open_one_stream`].
    one_stream: bool,
}

/// A stream's cached scratch buffer. The stream's `Arc` is kept so that its handle cannot be
/// reused by a new stream while the buffer may still be read by queued work.
#[derive(Debug)]
pub(crate) struct ScratchEntry {
    stream: Arc<CudaStream>,
    pub(crate) buf: DeviceBuffer<f32>,
}

/// Streams whose scratch buffers are kept; a further stream evicts the oldest entry (its buffer
/// is freed in the order of its own stream, after the work queued there).
const SCRATCH_STREAMS: usize = 8;

impl Gpu {
    /// Opens device 0 with a budget of 90% of its memory, or says why there is no usable GPU.
    /// Never panics, also when libcuda is missing.
    pub fn detect() -> std::result::Result<Gpu, NoGpu> {
        Gpu::open(0, None)
    }

    /// Opens device `ordinal` with a budget of `budget` bytes (default: 90% of its memory).
    pub fn open(ordinal: usize, budget: Option<u64>) -> std::result::Result<Gpu, NoGpu> {
        Gpu::open_with(ordinal, budget, false)
    }

    /// Opens device `ordinal` as [`Gpu::open`] does, for a caller that queues all its work on
    /// the one stream [`Gpu::stream`]: [`Gpu::new_stream`] refuses, and the buffers it makes
    /// carry none of the events cudarc records and waits on around every launch for every
    /// buffer argument to order uses across streams (on one stream, stream order already
    /// orders every use and every free). A launch is then one driver call, and a capture
    /// ([`Stream::capture`]) holds kernels only. Work queued on other streams through
    /// [`Gpu::context`] must order itself.
    pub fn open_one_stream(ordinal: usize, budget: Option<u64>) -> std::result::Result<Gpu, NoGpu> {
        Gpu::open_with(ordinal, budget, true)
    }

    fn open_with(
        ordinal: usize,
        budget: Option<u64>,
        one_stream: bool,
    ) -> std::result::Result<Gpu, NoGpu> {
        if !driver_present() {
            return Err(NoGpu::NoDriver);
        }
        // cudarc panics if a driver entry point it needs is missing (a driver older than the
        // crate's CUDA 12.4 API): report that as "no GPU" too.
        std::panic::catch_unwind(|| Gpu::open_inner(ordinal, budget, one_stream)).unwrap_or_else(
            |p| {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic in the CUDA driver bindings".to_string());
                Err(NoGpu::Driver(msg))
            },
        )
    }

    fn open_inner(
        ordinal: usize,
        budget: Option<u64>,
        one_stream: bool,
    ) -> std::result::Result<Gpu, NoGpu> {
        if !driver_present() {
            return Err(NoGpu::NoDriver);
        }
        let count = match CudaContext::device_count() {
            Ok(n) => n.max(0) as usize,
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
            Err(e) => return Err(NoGpu::Driver(format!("{e:?}"))),
        };
        if ordinal >= count {
            return Err(NoGpu::NoDevice { ordinal, count });
        }
        let drv = |e: cudarc::driver::DriverError| NoGpu::Driver(format!("{e:?}"));
        let ctx = CudaContext::new(ordinal).map_err(drv)?;
        if one_stream {
            // SAFETY: nothing has been allocated on this context object yet, and every buffer
            // this Gpu makes is used on its one stream (`new_stream` refuses), where stream
            // order orders each use after the previous one and each free (cudarc frees on the
            // buffer's stream) after the last use. cudarc's pinned-buffer event is no longer
            // recorded either: host access to pinned memory waits on PinnedBuffer's own event
            // (recorded after each of its copies) or on the stream.
            unsafe { ctx.disable_event_tracking() };
        }
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        if major < 8 {
            return Err(NoGpu::TooOld { major, minor });
        }
        let total = ctx.total_mem().map_err(drv)? as u64;
        let name = ctx.name().map_err(drv)?;
        let arch = cubin_arch_for(major, minor);
        let mut functions = HashMap::new();
        for m in KernelModule::ALL {
            let image = match arch.and_then(|a| m.cubin(a)) {
                Some(bytes) if !bytes.is_empty() => Ptx::from_binary(bytes.to_vec()),
                _ => Ptx::from_src(m.ptx()),
            };
            let module = ctx
                .load_module(image)
                .map_err(|e| NoGpu::Driver(format!("loading kernel module {}: {e:?}", m.name())))?;
            for f in m.functions() {
                let func = module
                    .load_function(f)
                    .map_err(|e| NoGpu::Driver(format!("kernel {f}: {e:?}")))?;
                functions.insert(*f, func);
            }
        }
        let stream = Stream {
            inner: ctx.new_stream().map_err(drv)?,
        };
        let budget = MemoryBudget::new(budget.unwrap_or(total / 10 * 9));
        let info = DeviceInfo {
            ordinal,
            name,
            compute_capability: (major, minor),
            total_memory: total,
            image: arch.map_or(KernelImage::Ptx, KernelImage::Cubin),
        };
        Ok(Gpu {
            ctx,
            stream,
            budget,
            info,
            functions,
            scratch: Mutex::new(Vec::new()),
            one_stream,
        })
    }

    /// What the device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The default stream.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// A new stream (e.g. one for uploads next to one for compute). Refused on a GPU opened by
    /// [`Gpu::open_one_stream`].
    pub fn new_stream(&self) -> Result<Stream> {
        if self.one_stream {
            return Err(CudaError::Shape(
                "this GPU was opened for one stream (Gpu::open_one_stream)".into(),
            ));
        }
        Ok(Stream {
            inner: self.ctx.new_stream()?,
        })
    }

    /// A new timed event.
    pub fn timed_event(&self) -> Result<TimedEvent> {
        let inner = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        Ok(TimedEvent { inner })
    }

    /// The byte budget of device buffers.
    pub fn budget(&self) -> &MemoryBudget {
        &self.budget
    }

    /// The cudarc context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn function(&self, name: &'static str) -> &CudaFunction {
        // Every name used by the ops is in KernelModule::functions, all loaded by `open`
        // (checked by the kernels tests).
        &self.functions[name]
    }

    /// Budget for a buffer of `len` elements of `T`. An empty buffer still takes one element on
    /// the device, and is counted.
    fn reserve_elements<T>(&self, len: usize) -> Result<Reservation> {
        let bytes = (len.max(1) as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        Ok(self.budget.try_reserve(bytes)?)
    }

    /// A zeroed device buffer of `len` elements, or a budget error (nothing allocated).
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        stream: &Stream,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        let reservation = self.reserve_elements::<T>(len)?;
        // A driver failure drops the reservation: nothing stays accounted.
        let slice = stream.inner.alloc_zeros::<T>(len.max(1))?;
        Ok(DeviceBuffer {
            slice,
            len,
            _reservation: reservation,
        })
    }

    /// An uninitialised device buffer of `len` elements (at least one), budgeted like
    /// [`Gpu::alloc_zeros`] but without the memset: for scratch space that a kernel queued next
    /// on `stream` writes completely before anything reads it.
    pub(crate) fn alloc_scratch<T: DeviceRepr>(
        &self,
        stream: &Stream,
        len: usize,
    ) -> Result<DeviceBuffer<T>> {
        let reservation = self.reserve_elements::<T>(len)?;
        // SAFETY: the callers' kernels write every element before any is read (see above); the
        // memory is stream-ordered on `stream`.
        let slice = unsafe { stream.inner.alloc::<T>(len.max(1)) }?;
        Ok(DeviceBuffer {
            slice,
            len,
            _reservation: reservation,
        })
    }

    /// Allocates now (budgeted) the activation scratch of `stream` for products whose input
    /// holds up to `len` floats, so that no later product allocates.
    pub fn reserve_activation(&self, stream: &Stream, len: usize) -> Result<()> {
        let mut cache = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = cache
            .iter()
            .position(|e| Arc::ptr_eq(&e.stream, &stream.inner))
        {
            if cache[i].buf.len() >= len {
                return Ok(());
            }
            cache.remove(i);
        }
        if cache.len() >= SCRATCH_STREAMS {
            cache.remove(0);
        }
        let buf = self.alloc_scratch::<f32>(stream, len)?;
        cache.push(ScratchEntry {
            stream: stream.inner.clone(),
            buf,
        });
        Ok(())
    }

    /// The scratch buffer of at least `len` floats cached for `stream`, grown (reallocated,
    /// budgeted) when too small, with the lock that guards it: the caller queues every kernel
    /// that writes or reads the buffer on `stream` while it holds the guard, so that calls from
    /// several host threads on one stream cannot interleave their uses (stream order does the
    /// rest: a later call's writes run after the earlier call's reads). Index into the guard
    /// with the returned position. Buffers stay allocated (and counted against the budget) until
    /// the `Gpu` is dropped or their stream's entry is evicted by a ninth stream.
    pub(crate) fn activation_scratch(
        &self,
        stream: &Stream,
        len: usize,
    ) -> Result<(MutexGuard<'_, Vec<ScratchEntry>>, usize)> {
        let mut cache = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = cache
            .iter()
            .position(|e| Arc::ptr_eq(&e.stream, &stream.inner))
        {
            if cache[i].buf.len() >= len {
                return Ok((cache, i));
            }
            // Too small: freed now (stream-ordered, after the work that uses it), which also
            // returns its bytes to the budget before the larger one is reserved.
            cache.remove(i);
        }
        if cache.len() >= SCRATCH_STREAMS {
            cache.remove(0);
        }
        // Grow geometrically in 64 KiB steps so that alternating sizes do not reallocate.
        let grown = len.max(16384).next_power_of_two();
        let buf = match self.alloc_scratch::<f32>(stream, grown) {
            Ok(b) => b,
            Err(_) => self.alloc_scratch::<f32>(stream, len)?,
        };
        cache.push(ScratchEntry {
            stream: stream.inner.clone(),
            buf,
        });
        let i = cache.len() - 1;
        Ok((cache, i))
    }

    /// A device copy of `src`, or a budget error (nothing allocated).
    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        stream: &Stream,
        src: &[T],
    ) -> Result<DeviceBuffer<T>> {
        let bytes = (src.len().max(1) as u64).saturating_mul(std::mem::size_of::<T>() as u64);
        let reservation = self.budget.try_reserve(bytes)?;
        if src.is_empty() {
            let slice = stream.inner.alloc_zeros::<T>(1)?;
            return Ok(DeviceBuffer {
                slice,
                len: 0,
                _reservation: reservation,
            });
        }
        let slice = stream.inner.clone_htod(src)?;
        Ok(DeviceBuffer {
            slice,
            len: src.len(),
            _reservation: reservation,
        })
    }

    /// Page-locked host memory of `len` zeroed elements (not counted against the device budget).
    pub fn alloc_pinned<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<PinnedBuffer<T>> {
        if len == 0 {
            return Err(CudaError::Shape(
                "a pinned buffer needs at least one element".into(),
            ));
        }
        // SAFETY: the memory is zeroed right below before anyone reads it.
        let mut inner = unsafe { self.ctx.alloc_pinned_with_flags::<T>(len, 0) }?;
        let s = inner.as_mut_slice()?;
        // SAFETY: T is ValidAsZeroBits, so all-zero bytes are a valid T.
        unsafe { std::ptr::write_bytes(s.as_mut_ptr(), 0, s.len()) };
        // No timing (a cheaper record); a waiting host spins, as for a stream synchronize.
        let done = self.ctx.new_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        ))?;
        Ok(PinnedBuffer { inner, done })
    }
}
