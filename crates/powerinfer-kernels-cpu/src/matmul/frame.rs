//! What the product frames share: argument checks, the output pointer their threads write
//! through, and the software prefetches of the sparse frames.

pub(crate) use crate::error::check_len;
use crate::error::KernelError;
use std::ops::Range;

/// `a · b`, or a shape error if that overflows.
pub(crate) fn mul(a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b)
        .ok_or_else(|| KernelError::Shape(format!("{a} × {b} overflows usize")))
}

/// A raw view of an output buffer that threads write in disjoint places.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: an `OutPtr` is only used inside one kernel call whose threads write disjoint indices
// (each call site says why) while the `&mut [f32]` it came from is borrowed by that call.
unsafe impl Send for OutPtr {}

// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    pub(crate) fn new(y: &mut [f32]) -> Self {
        OutPtr {
            ptr: y.as_mut_ptr(),
            len: y.len(),
        }
    }
    /// # Safety
    /// `i < len`, and no other thread reads or writes index `i` during the kernel call.
    #[inline(always)]
    pub(crate) unsafe fn write(self, i: usize, v: f32) {
        debug_assert!(i < self.len);
        // SAFETY: guaranteed by the caller.
        unsafe { *self.ptr.add(i) = v }
    }
    /// # Safety
    /// `r` lies within `0..len`, and no other thread touches `r` while the slice lives.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn slice(&self, r: Range<usize>) -> &mut [f32] {
        debug_assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }
}

/// Asks the CPU to start loading a row the kernel will visit soon (a hint: no effect on
/// results). Used for the rows a sparse kernel will visit next, which the hardware prefetchers
/// cannot guess: without it, short quantized rows at random places are read at DRAM latency.
/// Rows of at most `whole` bytes ([`PREFETCH_WHOLE_DOT`] for the products,
/// [`PREFETCH_WHOLE_AXPY`] for axpy) are prefetched whole; of longer rows only the first
/// [`PREFETCH_HEAD`] bytes: the hardware stream prefetcher takes over after the first
/// sequential misses, and a burst of a hundred prefetches per row (8 KiB of F16) stalls the
/// loads. The hint is T1 (into L2, not L1), faster for quantized rows (measurements:
/// `docs/tuning.md`).
#[inline(always)]
pub(crate) fn prefetch(bytes: &[u8], whole: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let len = if bytes.len() <= whole {
            bytes.len()
        } else {
            PREFETCH_HEAD.min(bytes.len())
        };
        let mut off = 0;
        while off < len {
            // SAFETY: a prefetch never faults and changes no state the program can observe; the
            // address is inside `bytes` (`off < len <= bytes.len()`); SSE is part of the x86-64
            // baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(bytes.as_ptr().add(off) as *const i8) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (bytes, whole);
}

/// Products: rows up to this many bytes are prefetched whole (a Q4_0 row of 11008 values: 6192
/// bytes, faster whole than by its head).
pub(crate) const PREFETCH_WHOLE_DOT: usize = 6400;

/// Axpy: column slices up to this many bytes are prefetched whole (half a Q4_0 row of 4096
/// values); longer ones (half an F16 row: 4 KiB) run faster with only their head.
pub(crate) const PREFETCH_WHOLE_AXPY: usize = 2560;

/// Bytes prefetched at the start of a longer row.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PREFETCH_HEAD: usize = 512;

/// How many rows ahead the sparse kernels prefetch: enough rows to cover ~4 KiB, at least 2 and
/// at most 8.
pub(crate) fn prefetch_ahead(row_bytes: usize) -> usize {
    4096usize.div_ceil(row_bytes.max(1)).clamp(2, 8)
}
