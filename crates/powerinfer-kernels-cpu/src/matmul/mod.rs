//! Dense and neuron-sparse matrix products over ggml weight matrices.
//!
//! A weight matrix ([`Weights`]) is ggml's layout: `rows` rows of `cols` elements, row-major,
//! each row a whole number of blocks of its [`GgmlType`]. Activations are f32, one token per
//! `cols`-long row (`x[t * cols + c]`); outputs are f32, one token per row (`y[t * rows + r]`
//! for products, `y[t * cols + c]` for the axpy kernels, which read the matrix transposed).
//!
//! | method of [`MatMul`] | computes |
//! |---|---|
//! | [`gemv`](MatMul::gemv), [`gemm`](MatMul::gemm) | `y_t = W x_t` for one or `T` tokens |
//! | [`sparse_gemv`](MatMul::sparse_gemv), [`sparse_gemm`](MatMul::sparse_gemm) | rows of `W x_t` where the row is selected ([`RowSelect`]), 0 elsewhere |
//! | [`sparse_gemv_indexed`](MatMul::sparse_gemv_indexed) | rows listed in `active`, 0 elsewhere |
//! | [`sparse_axpy`](MatMul::sparse_axpy), [`sparse_axpy_batch`](MatMul::sparse_axpy_batch) | `y_t += Σ a_t[i] · row_i` over selected `i` with `a_t[i] != 0` |
//! | [`sparse_axpy_indexed`](MatMul::sparse_axpy_indexed) | the same over the rows listed in `active` |
//!
//! Weight types: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, for every kernel.
//! F32 and BF16 weights take f32 activations; F16 weights take them rounded to f16 (ties to
//! even, as ggml converts them for its F16 dot products; beyond ±65504 a value becomes ±∞), and
//! so do the F16 axpy's coefficients `a_i`; quantized weights take activations quantized on the
//! fly (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for the K-quants) and use integer dot
//! products. The other axpy kernels use the f32 `a_i` directly.
//!
//! Work split: products split the rows (or the list of active rows) into contiguous parts,
//! one per thread, so every row's result is the same for every thread count (the one-token
//! dense product cuts the parts into grains that an idle thread may take over:
//! [`MatMul::gemv`]). The axpy kernels split the *output* columns (block-aligned),
//! each thread walking every active row over its columns, so no reduction between threads is
//! needed and the summation order never changes; except the one-token axpy over rows of
//! ≥ 2048 bytes on backends with a list kernel (AVX-512 Q4_0/Q8_0), which splits the active
//! rows into per-thread partial sums added in thread order: bit-identical for a given thread
//! count, equal within rounding across thread counts. GEMM walks tokens in blocks sized to the
//! last-level cache; dense products run a two-row × four-token micro-kernel, sparse ones four
//! tokens per pass over a weight row. On AVX-512, dense GEMMs of F32/F16/BF16/Q8_0 weights run
//! cache-blocked 4 × 6 / 4 × 4 tiles instead (`x86::gemm`). Every multi-token kernel variant
//! (four tokens, the 2 × 4 tile, the blocked tiles, `dot_batch`) computes each (row, token) with
//! the same operations in the same order, so a token's result does not depend on the other
//! tokens, and sparse == dense with zeroed rows bit for bit. One-token float products sum in
//! another order (`x86::float`'s wide dot) than multi-token ones, so for float weights GEMM and
//! per-token GEMV agree within rounding; for quantized weights (exact integer sums) bit for bit.
//!
//! The f64 definitions of every kernel are in [`crate::reference::matmul`].

pub(crate) mod act;
pub(crate) mod rowops;
pub(crate) mod scalar;
pub(crate) mod scratch;
pub(crate) mod table;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use crate::backend::Backend;
use crate::error::KernelError;
use crate::pool::{split_range, ThreadPool};
use act::{Act, ActBuf};
use powerinfer_gguf::GgmlType;
use rowops::{ListedRows, RowOps};
use scratch::ScratchVec;
use std::ops::Range;

/// Quantized rows up to this many bytes are computed four per pass by the dense GEMV (see
/// [`MatMul::gemv`]). Measured on Zen 4, 2 threads, 11008 rows, four per pass vs one (GB/s):
/// Q4_0 144 B 35.7 vs 28.0, 216 B 39.0 vs 32.8, 288 B 36.1 vs 32.8, 360 B 28.5 vs 27.0, but
/// 432 B 27.5 vs 34.5 and 576 B 10.8 vs 36.0; Q8_0 272 B 38.3 vs 37.9, 408 B 31.1 vs 37.3.
const SHORT_ROW_BYTES: usize = 384;

/// Quantized rows of at least this many bytes go through the sparse list kernel over every row
/// in the one-token product, where the backend has one (AVX-512 Q4_0/Q8_0), eight rows per pass
/// behind its software prefetch stream. Zen 4, one thread, Q4_0: 1024×16384 8.9 → 26 GB/s,
/// 4096×11008 (LLaMA-7B's `ffn_down`) 23 → 26 GB/s, from a 7B file's 32 `ffn_down` matrices
/// 9–13 GB/s one row at a time; rows of 2304 bytes (4096 columns) ran at the same speed either
/// way there. On a 2-vCPU Xeon (AVX-512 + AMX, 480 MiB L3), 2 threads, weights not in cache,
/// the one-row loop reads Q4_0 at 15–16 GB/s where the list kernel reads 22–23 (4096×4096,
/// 2048×2048, 5632×2048); TinyLlama-shaped Q4_0 decode went from 17.7 to 37 tok/s, hence the
/// lower bound (Q4_0 from 2048 columns, Q8_0 from 1024). Not float rows (AVX-512: F32, F16,
/// BF16), although they have list kernels: one row at a time with in-row prefetches reads them
/// faster. Same Xeon, F16, `bench kernels` medians: 2048×2048 30.6 against 25.1 GB/s through
/// the list kernel, 5632×2048 31.7 against 25.0, 32000×2048 31.3 against 24.7 (27.3–28.2
/// against 24.2–24.5 in 4 KiB pages); TinyLlama-shaped F16 decode, alternated runs: dense
/// 14.42–14.62 against 12.46–12.51 tok/s (14.61–14.77 against 12.66–12.70 with `--no-mmap`),
/// sparse 34.3–34.9 against 30.2–30.7. (An earlier measurement, in another phase of that VM,
/// had favoured the list kernel by 3–5%.)
const LIST_GEMV_ROW_BYTES: usize = 1024;

/// Float rows up to this many bytes go through the backend's sparse list kernels (AVX-512:
/// four rows per pass behind the prefetch stream), longer ones through the four-row kernels
/// with in-row prefetches. F16 at 10%, 2 threads, Xeon, weights not in cache, against the
/// four-row kernels: 5632×2048 (4 KiB rows) GEMV 0.101–0.102 vs 0.124–0.125 ms, axpy
/// 0.096–0.117 vs 0.119–0.122; 11008×4096 (8 KiB rows, LLaMA-7B's sparse FFN) 0.373–0.380 vs
/// 0.361–0.371 and 0.360–0.376 vs 0.338–0.356 (slower in every pair); 4096×11008 (22 KiB)
/// 0.357–0.364 vs 0.282–0.288.
const FLOAT_LIST_MAX_ROW_BYTES: usize = 4096;

/// Whether the sparse products of `w` take the backend's list kernels (where it has them).
fn sparse_list_fits(ops: &RowOps, w: &Weights<'_>) -> bool {
    !ops.act.is_float() || w.row_bytes <= FLOAT_LIST_MAX_ROW_BYTES
}

/// One-token sparse axpy over rows of at least this many bytes splits the active rows between
/// threads (with a list kernel; [`MatMul::axpy_rows_split`]), shorter rows split the columns
/// (5632×2048 Q4_0, 1152-byte rows: no gain measured). Float rows always split the columns,
/// whose result does not depend on the thread count: with the AVX-512 list kernel, F16 at
/// 10–20% on a Xeon, 2 threads, 5632×2048 24.0–24.8 GB/s against 26.3–28.0 with rows split,
/// 11008×4096 27.4–28.8 against 27.8–29.5.
const ROW_SPLIT_AXPY_BYTES: usize = 2048;

/// Weight bytes per grain of the one-token dense product ([`MatMul::gemv`], rounded to a
/// multiple of 8 rows, at least 8): a thread walks its part of the rows in grains and takes
/// the others' untouched grains from the back once done. TinyLlama-shaped Q4_0 products in
/// decode order (22 layers and the head, 2 threads, Zen 4 VM, alternated runs): 52–55 tok/s
/// with 64 or 128 KiB grains against 49 with fixed halves. On a Xeon, where these products run
/// through the list kernel (see `LIST_GEMV_ROW_BYTES`), whose prefetch stream restarts at each
/// grain: 64 KiB 35.0–35.4, 128 KiB 36.1–36.2, 256 KiB 36.3–37.1 tok/s.
pub const GEMV_GRAIN_BYTES: usize = 128 << 10;

/// Float rows whose activation, as the kernels read it, takes up to this many bytes go through
/// the dense GEMV one per pass, longer ones four per pass (so that the activation stays in L1
/// beside the weight stream, or else each of its loads serves four rows). f32 activations
/// (4096 elements at most one per pass): F16, 2 threads, Zen 4, 5632×2048 35.8 vs 25–29 GB/s
/// one vs four rows, 4096×11008 22.5 vs 29.5–30.5; decode of a 7B-shaped F16 model at
/// 0.86–1.03× llama.cpp with 4096-element rows one per pass, 0.88–0.99× four per pass,
/// 0.77–0.97× with every row one per pass. F16 weights' activations are read as f16 bits
/// (`ActFormat::F16`), so their rows of up to 8192 elements go one per pass: Zen 4, 3
/// alternated `bench kernels` runs (small pages, offset 32), 2048×5632 30.3–31.9 GB/s one per
/// pass vs 25.8–30.6 four per pass, 4096×11008 still 23.1–24.0 vs 27.9–31.2.
const FLOAT_ONE_ROW_MAX_ACT_BYTES: usize = 16 << 10;

/// A Q4_0 matrix repacked for the one-token product ([`MatMul::pack_q4_0`],
/// [`MatMul::gemv_packed`]): rows in interleaved groups of eight (the same bytes per row as
/// ggml's layout), the rows after the last whole group in ggml's layout. An owned copy: the
/// original (e.g. a memory-mapped file) is not needed by `gemv_packed`.
#[derive(Clone, Debug)]
pub struct PackedQ4_0 {
    rows: usize,
    cols: usize,
    /// Whole groups, interleaved, in page-aligned storage (the kernel's 32-byte loads then
    /// never straddle two lines); `groups_len` bytes of it are used.
    groups: PageBuf,
    groups_len: usize,
    /// The remaining `rows % 8` rows, ggml layout.
    tail: Vec<u8>,
}

impl PackedQ4_0 {
    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes held (the size of the original matrix).
    pub fn bytes(&self) -> usize {
        self.groups_len + self.tail.len()
    }

    #[cfg_attr(not(all(target_arch = "x86_64", powerinfer_avx512)), allow(dead_code))]
    fn group_data(&self) -> &[u8] {
        &self.groups.bytes()[..self.groups_len]
    }
}

/// Page-aligned anonymous memory, zero until written, with transparent huge pages requested on
/// Linux: no page is touched before its first writer touches it, so the threads that fill a
/// copy fault its pages in, in parallel, 2 MiB at a time where the OS grants huge pages.
/// Measured on a Xeon VM, a 7B-shaped Q4_0 file repacked at load (`powerinfer run --repack`):
/// 3.5–6.2 s with `Vec`s zeroed by the loading thread, 0.66–0.68 s with this (a first run
/// after another process freed its memory: 2.5–4.7 s); decode from the copies 6.7–6.9 tok/s
/// against 5.1–5.2 from the file.
///
/// A buffer of at least 2 MiB starts on a 2 MiB boundary (2 MiB more address space is mapped
/// and never touched), so that every whole 2 MiB of it can be a huge page: mapped where the
/// OS put them, the copies of TinyLlama's small matrices (2.4 MB and less) got almost none
/// (55 of 169 MB in huge pages); TinyLlama Q4_0 dense decode with `--repack`, alternated
/// runs: 43.1–44.6 tok/s aligned, 39.3–40.4 not.
struct PageBuf {
    map: memmap2::MmapMut,
    /// Where the buffer starts in `map`.
    off: usize,
    len: usize,
}

/// The transparent huge page size of x86-64 and of aarch64 with 4 KiB pages.
const HUGE_PAGE: usize = 2 << 20;

impl PageBuf {
    /// `len` zero bytes (at least one page), or `None` where the OS refuses the memory.
    #[cfg_attr(not(all(target_arch = "x86_64", powerinfer_avx512)), allow(dead_code))]
    fn zeroed(len: usize) -> Option<PageBuf> {
        let extra = if len >= HUGE_PAGE { HUGE_PAGE } else { 0 };
        let map = memmap2::MmapMut::map_anon(len.checked_add(extra)?.max(1)).ok()?;
        #[cfg(target_os = "linux")]
        {
            // Only a hint: without transparent huge pages the memory is still correct.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        let p = map.as_ptr() as usize;
        let off = if extra > 0 {
            p.next_multiple_of(HUGE_PAGE) - p
        } else {
            0
        };
        Some(PageBuf { map, off, len })
    }

    /// The buffer.
    fn bytes(&self) -> &[u8] {
        &self.map[self.off..self.off + self.len]
    }

    /// The buffer, writable.
    #[cfg_attr(not(all(target_arch = "x86_64", powerinfer_avx512)), allow(dead_code))]
    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.off..self.off + self.len]
    }
}

impl Clone for PageBuf {
    fn clone(&self) -> PageBuf {
        let Some(mut copy) = PageBuf::zeroed(self.len) else {
            panic!("out of memory copying {} bytes", self.len);
        };
        copy.bytes_mut().copy_from_slice(self.bytes());
        copy
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageBuf({} bytes)", self.len)
    }
}

/// A borrowed weight matrix in ggml layout. See the [module docs](self).
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: &'a [u8],
}

impl<'a> Weights<'a> {
    /// Views `data` as `rows` rows of `cols` elements of type `ty`. Checks that `cols` is a whole
    /// number of blocks, that `data` has exactly `rows` rows, and that the kernels support `ty`.
    /// No alignment is required.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        if !rowops::SUPPORTED.contains(&ty) {
            return Err(KernelError::UnsupportedType(ty));
        }
        let bs = ty.block_size();
        if cols % bs != 0 {
            return Err(KernelError::Shape(format!(
                "row length {cols} is not a multiple of the {} block size {bs}",
                ty.name()
            )));
        }
        let row_bytes = cols / bs * ty.type_size();
        let expected = rows.checked_mul(row_bytes).ok_or_else(|| {
            KernelError::Shape(format!("{rows} rows of {row_bytes} bytes overflow usize"))
        })?;
        if data.len() != expected {
            return Err(KernelError::Length {
                what: "weight data",
                expected,
                got: data.len(),
            });
        }
        Ok(Weights {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    /// The raw data.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
    /// Rows `r` as a view of the same data (for splitting products across callers' own
    /// threads). An out-of-range `r` is an error; an empty one gives a view of no rows.
    pub fn row_range(&self, r: Range<usize>) -> Result<Weights<'a>, KernelError> {
        if r.start > r.end || r.end > self.rows {
            return Err(KernelError::Shape(format!(
                "rows {}..{} of a {}-row matrix",
                r.start, r.end, self.rows
            )));
        }
        Ok(Weights {
            rows: r.len(),
            data: &self.data[r.start * self.row_bytes..r.end * self.row_bytes],
            ..*self
        })
    }
    #[inline]
    fn row(&self, i: usize) -> &'a [u8] {
        &self.data[i * self.row_bytes..(i + 1) * self.row_bytes]
    }
}

/// Which rows (neurons) a sparse product computes for a token: row `i` is selected when
/// `scores[t * rows + i] >= threshold` and `skip` is `None` or `skip[i]` is false. A NaN score
/// never selects.
///
/// `skip` is the other side's neurons: on the CPU side, the GPU index (`true` = the neuron lives
/// on the GPU, so the CPU skips it).
#[derive(Clone, Copy, Debug)]
pub struct RowSelect<'a> {
    /// Predictor scores, `[T][rows]`.
    pub scores: &'a [f32],
    /// Threshold θ; a row is active when its score is ≥ θ.
    pub threshold: f32,
    /// Rows to skip for every token (`[rows]`), or `None`.
    pub skip: Option<&'a [bool]>,
}

impl RowSelect<'_> {
    #[inline]
    fn selected(&self, rows: usize, t: usize, i: usize) -> bool {
        self.scores[t * rows + i] >= self.threshold && !self.skip.is_some_and(|s| s[i])
    }

    fn check(&self, rows: usize, n_tokens: usize) -> Result<(), KernelError> {
        check_len("scores", mul(rows, n_tokens)?, self.scores.len())?;
        if let Some(s) = self.skip {
            check_len("skip mask", rows, s.len())?;
        }
        Ok(())
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), KernelError> {
    if expected == got {
        Ok(())
    } else {
        Err(KernelError::Length {
            what,
            expected,
            got,
        })
    }
}

/// `a · b`, or a shape error if that overflows.
fn mul(a: usize, b: usize) -> Result<usize, KernelError> {
    a.checked_mul(b)
        .ok_or_else(|| KernelError::Shape(format!("{a} × {b} overflows usize")))
}

/// Checks that `active` is strictly increasing and below `rows`.
pub(crate) fn check_active(active: &[u32], rows: usize) -> Result<(), KernelError> {
    let mut prev: Option<u32> = None;
    for (pos, &i) in active.iter().enumerate() {
        if i as usize >= rows {
            return Err(KernelError::IndexOutOfRange {
                what: "active",
                index: i as usize,
                len: rows,
            });
        }
        if prev.is_some_and(|p| p >= i) {
            return Err(KernelError::IndicesNotIncreasing {
                what: "active",
                position: pos,
            });
        }
        prev = Some(i);
    }
    Ok(())
}

/// The rows `i` with `scores[i] >= threshold`, `skip[i]` false (when given) and `nonzero[i] !=
/// 0` (when given), in increasing order. Branch-free per row (a 64-row mask, then its set bits):
/// at ~10% random density a branch per row mispredicts often enough to cost several µs per call
/// on an 11008-row matrix, a noticeable part of a sparse GEMV. With AVX-512, sixteen rows per
/// step with mask compares (`x86::sparse::select_rows_avx512`, the same rows).
fn select_rows(
    scores: &[f32],
    threshold: f32,
    skip: Option<&[bool]>,
    nonzero: Option<&[f32]>,
) -> Vec<u32> {
    let mut out = Vec::with_capacity(scores.len());
    #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
    if Backend::Avx512.is_available()
        && skip.is_none_or(|k| k.len() >= scores.len())
        && nonzero.is_none_or(|a| a.len() >= scores.len())
    {
        // SAFETY: AVX-512 F/BW/VL were detected; `skip` and `nonzero` are long enough.
        unsafe { x86::sparse::select_rows_avx512(scores, threshold, skip, nonzero, &mut out) };
        return out;
    }
    for (c, chunk) in scores.chunks(64).enumerate() {
        let base = c * 64;
        let mut m = 0u64;
        for (j, &s) in chunk.iter().enumerate() {
            m |= ((s >= threshold) as u64) << j;
        }
        if let Some(skip) = skip {
            for (j, &k) in skip[base..base + chunk.len()].iter().enumerate() {
                m &= !((k as u64) << j);
            }
        }
        if let Some(a) = nonzero {
            for (j, &v) in a[base..base + chunk.len()].iter().enumerate() {
                m &= !(((v == 0.0) as u64) << j);
            }
        }
        while m != 0 {
            out.push((base + m.trailing_zeros() as usize) as u32);
            m &= m - 1;
        }
    }
    out
}

/// Asks the CPU to start loading a row the kernel will visit soon (a hint: no effect on
/// results). Used for the rows a sparse kernel will visit next, which the hardware prefetchers
/// cannot guess: without it, short quantized rows at random places are read at DRAM latency,
/// several times slower. Rows of at most `whole` bytes ([`PREFETCH_WHOLE_DOT`] for the products,
/// [`PREFETCH_WHOLE_AXPY`] for axpy) are prefetched whole; of longer rows only the first
/// [`PREFETCH_HEAD`] bytes: the hardware stream prefetcher takes over after the first
/// sequential misses, and a burst of a hundred prefetches per row (8 KiB of F16) stalls the
/// loads (measured: F16 sparse GEMV/axpy at 10% ~2× slower that way). The hint is T1 (into L2,
/// not L1): measured on Zen 4 with Q4_0 rows, sparse GEMV and axpy at 10% run ~1.7× faster than
/// with T0 (same speed for F16).
#[inline(always)]
fn prefetch(bytes: &[u8], whole: usize) {
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
/// bytes; measured 1.65× faster sparse GEMV than prefetching 512 bytes of it).
const PREFETCH_WHOLE_DOT: usize = 6400;
/// Axpy: column slices up to this many bytes are prefetched whole (half a Q4_0 row of 4096
/// values); longer ones (half an F16 row: 4 KiB) run ~1.4× faster with only their head.
const PREFETCH_WHOLE_AXPY: usize = 2560;
/// Bytes prefetched at the start of a longer row.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const PREFETCH_HEAD: usize = 512;

/// Activation bytes per GEMM token block (see `gemm_core`).
const GEMM_BLOCK_BYTES: usize = 8 << 20;

/// How many rows ahead the sparse kernels prefetch: enough rows to cover ~4 KiB, at least 2 and
/// at most 8.
fn prefetch_ahead(row_bytes: usize) -> usize {
    4096usize.div_ceil(row_bytes.max(1)).clamp(2, 8)
}

/// A raw view of an output buffer that threads write in disjoint places.
#[derive(Clone, Copy)]
struct OutPtr {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: an `OutPtr` is only used inside one kernel call whose threads write disjoint indices
// (each call site says why) while the `&mut [f32]` it came from is borrowed by that call.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn new(y: &mut [f32]) -> Self {
        OutPtr {
            ptr: y.as_mut_ptr(),
            len: y.len(),
        }
    }
    /// # Safety
    /// `i < len`, and no other thread reads or writes index `i` during the kernel call.
    #[inline(always)]
    unsafe fn write(self, i: usize, v: f32) {
        debug_assert!(i < self.len);
        // SAFETY: guaranteed by the caller.
        unsafe { *self.ptr.add(i) = v }
    }
    /// # Safety
    /// `r` lies within `0..len`, and no other thread touches `r` while the slice lives.
    #[inline(always)]
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, r: Range<usize>) -> &mut [f32] {
        debug_assert!(r.start <= r.end && r.end <= self.len);
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(r.start), r.end - r.start) }
    }
}

/// One product of [`MatMul::gemv_multi`]: `y = w x`.
#[derive(Debug)]
pub struct GemvJob<'a> {
    /// The matrix.
    pub w: Weights<'a>,
    /// The activation, `w.cols()` values.
    pub x: &'a [f32],
    /// The output, `w.rows()` values.
    pub y: &'a mut [f32],
}

/// One product of [`MatMul::gemv_packed_multi`]: `y = w x` over a repacked matrix.
#[derive(Debug)]
pub struct PackedGemvJob<'a> {
    /// The matrix, from [`MatMul::pack_q4_0`].
    pub w: &'a PackedQ4_0,
    /// The activation, `w.cols()` values.
    pub x: &'a [f32],
    /// The output, `w.rows()` values.
    pub y: &'a mut [f32],
}

thread_local! {
    /// Each thread's row numbers for [`gemv_rows`]' list kernel: a grain's rows and the ones
    /// after it, rewritten per grain (at most two grains' worth, so no allocation once warm).
    static GRAIN_ROWS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Rows `r` of `y = W x` into `y` (`r.len()` values), one thread: for long quantized rows
/// (`listed`, see [`LIST_GEMV_ROW_BYTES`]) the backend's range kernel, else its list kernel;
/// otherwise four rows per pass or one (see below).
fn gemv_rows(
    w: &Weights<'_>,
    ops: &RowOps,
    act: &Act<'_>,
    listed: bool,
    r: Range<usize>,
    y: &mut [f32],
) {
    if let (Some(dot_range), true) = (ops.dot_range, listed) {
        dot_range(w.data, w.row_bytes, r, act, y);
        return;
    }
    if let (Some(dot_list), true) = (ops.dot_list, listed) {
        GRAIN_ROWS.with(|ids| {
            let mut ids = ids.borrow_mut();
            // The stream runs on into the rows after this grain (usually this thread's next).
            let then_end = w.rows.min(r.end + r.len());
            ids.clear();
            ids.extend(r.start as u32..then_end as u32);
            let (list, then) = ids.split_at(r.len());
            dot_list(
                &ListedRows::whole(w.data, w.row_bytes, list).then(then),
                act,
                y,
            );
        });
        return;
    }
    let mut done = 0;
    // Four rows per pass for float rows whose activation exceeds FLOAT_ONE_ROW_MAX_ACT_BYTES
    // (each load of the long activation then serves four rows) and for short quantized rows
    // (≤ SHORT_ROW_BYTES: the per-row reduction dominates there; a predictor's fc2, 5632×256
    // Q4_0, went from 27.5 to 34 GB/s). Other rows go one at a time: one sequential stream
    // per thread, the activation in L1 (quantized 11008×4096: 33.7 vs 17.5 GB/s, 2048×2048:
    // 33 vs 15; F16 5632×2048: 35.8 vs 25–29). The sparse GEMV, whose scattered rows are
    // software-prefetched and partly compute-bound, always uses four rows per pass.
    let act_bytes = w.cols * if ops.act == act::ActFormat::F16 { 2 } else { 4 };
    let rows4 = match ops.act {
        f if f.is_float() && act_bytes > FLOAT_ONE_ROW_MAX_ACT_BYTES => ops.rows4,
        f if f.is_float() => None,
        _ if w.row_bytes <= SHORT_ROW_BYTES => ops.rows4,
        _ => None,
    };
    if let Some(rows4) = rows4 {
        for (k, yq) in y.chunks_exact_mut(4).enumerate() {
            let i = r.start + 4 * k;
            let v = rows4([w.row(i), w.row(i + 1), w.row(i + 2), w.row(i + 3)], act);
            yq.copy_from_slice(&v);
        }
        done = y.len() / 4 * 4;
    }
    // Rows ahead whose lines are requested into L1 (see `ONE_ROW_PREFETCH_BYTES`); 0: none.
    let ahead = if one_row_prefetch(w.ty) {
        ONE_ROW_PREFETCH_BYTES.div_ceil(w.row_bytes.max(1))
    } else {
        0
    };
    for (yi, i) in y[done..].iter_mut().zip(r.start + done..r.end) {
        if ahead > 0 && i + ahead < w.rows {
            prefetch_l1(w.row(i + ahead));
        }
        *yi = (ops.dot)(w.row(i), act);
    }
}

/// How far ahead (bytes, rounded up to whole rows) the one-row dense GEMV requests the next
/// rows' lines into L1, for the types of [`one_row_prefetch`].
const ONE_ROW_PREFETCH_BYTES: usize = 2048;

/// Whether the one-row dense GEMV prefetches rows ahead for `ty`: the 32-value block types
/// without a list kernel. Xeon, 2 threads, alternated runs of `bench kernels` (weights not in
/// cache): Q4_1 5.0–5.5 → 9.9–10.5 GB/s, Q5_0 4.7–5.0 → 8.5–9.0, Q5_1 4.9–5.3 → 10.4–12.0
/// (1 KiB; 2, 4 and 8 KiB the same). The hardware prefetchers had left these slow loops
/// waiting on memory. Not the K-quants: their 256-bit kernels are bound by their arithmetic
/// (Q4_K and Q6_K unchanged, Q5_K 0.61–0.69 → 0.52–0.58 of the bandwidth), and on AVX-512 their
/// long rows take a range kernel with its own prefetch stream (`x86::kquant`).
fn one_row_prefetch(ty: GgmlType) -> bool {
    cfg!(target_arch = "x86_64") && matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1)
}

/// Requests every line of `bytes` into L1 (T0 hint).
fn prefetch_l1(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..bytes.len()).step_by(64) {
        // SAFETY: a prefetch never faults and changes no state the program can observe; the
        // address is inside `bytes`; SSE is part of the x86-64 baseline.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(off) as *const i8)
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Runs the matrix kernels on a thread pool with one backend. Cheap to make; make one per pool.
#[derive(Clone, Copy, Debug)]
pub struct MatMul<'p> {
    pool: &'p ThreadPool,
    backend: Backend,
}

impl<'p> MatMul<'p> {
    /// Kernels on `pool` with the best backend of this CPU ([`Backend::detect`]).
    pub fn new(pool: &'p ThreadPool) -> Self {
        MatMul {
            pool,
            backend: Backend::detect(),
        }
    }

    /// Kernels on `pool` with a chosen backend; [`KernelError::BackendUnavailable`] if this CPU
    /// cannot run it.
    pub fn with_backend(pool: &'p ThreadPool, backend: Backend) -> Result<Self, KernelError> {
        if !backend.is_available() {
            return Err(KernelError::BackendUnavailable(backend.name()));
        }
        Ok(MatMul { pool, backend })
    }

    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The pool in use.
    pub fn pool(&self) -> &'p ThreadPool {
        self.pool
    }

    fn ops(&self, w: &Weights<'_>) -> Result<RowOps, KernelError> {
        table::row_ops(w.ty, self.backend).ok_or(KernelError::UnsupportedType(w.ty))
    }

    /// `y = W x` for one token: `x` has `cols` values, `y` has `rows`.
    ///
    /// Work split ([`ThreadPool::for_grains`]): each thread walks its own contiguous part of
    /// the rows, front to back, in grains of about [`GEMV_GRAIN_BYTES`] of weights, and a
    /// thread done with its part takes the grains the others have not started, from the back.
    pub fn gemv(&self, w: &Weights<'_>, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
        self.gemv_multi(&mut [GemvJob { w: *w, x, y }])
    }

    /// `y = W x` for every job, in one dispatch of the pool: the rows of all jobs, concatenated,
    /// are split as in [`gemv`](Self::gemv), so small products (a layer's Q, K and V) share one
    /// start and one wait instead of paying one each. Every output row is computed by the same
    /// row kernel as `gemv` on that matrix alone; the grouping of rows into passes depends on
    /// the thread count only, and the kernels give a row the same bits whichever pass it is in.
    /// All jobs are checked before any is computed.
    pub fn gemv_multi(&self, jobs: &mut [GemvJob<'_>]) -> Result<(), KernelError> {
        let mut prepared = Vec::with_capacity(jobs.len());
        // Each distinct activation prepared once (a layer's Q, K and V share theirs).
        let mut acts: Vec<ActBuf<'_>> = Vec::with_capacity(jobs.len());
        let mut total = 0usize;
        let mut max_row_bytes = 1usize;
        for j in jobs.iter_mut() {
            check_len("x", j.w.cols, j.x.len())?;
            check_len("y", j.w.rows, j.y.len())?;
            let ops = self.ops(&j.w)?;
            let same = |a: &ActBuf<'_>| a.is_of(ops.act, j.x);
            let act = match acts.iter().position(same) {
                Some(k) => k,
                None => {
                    acts.push(ActBuf::new(ops.act, j.x, j.w.cols));
                    acts.len() - 1
                }
            };
            // Long quantized rows: the backend's dense range kernel, or the list kernel over
            // every row (8 rows per pass share each activation load; same per-row operations,
            // same bits). Not float rows (see `LIST_GEMV_ROW_BYTES`).
            let listed = (ops.dot_list.is_some() || ops.dot_range.is_some())
                && !ops.act.is_float()
                && j.w.row_bytes >= LIST_GEMV_ROW_BYTES;
            prepared.push((total, j.w, ops, act, listed, OutPtr::new(j.y)));
            total += j.w.rows;
            max_row_bytes = max_row_bytes.max(j.w.row_bytes);
        }
        if total == 0 {
            return Ok(());
        }
        let grain = (GEMV_GRAIN_BYTES / max_row_bytes).max(8) / 8 * 8;
        self.pool.for_grains(total, grain, |_, r| {
            for (offset, w, ops, act, listed, out) in &prepared {
                let s = r.start.max(*offset);
                let e = r.end.min(offset + w.rows);
                if s >= e {
                    continue;
                }
                let rows = s - offset..e - offset;
                // SAFETY: `for_grains` hands out disjoint ranges of the concatenated rows; their
                // parts in this job are disjoint ranges within `0..w.rows == y.len()`.
                let y = unsafe { out.slice(rows.clone()) };
                gemv_rows(w, ops, &acts[*act].get(0), *listed, rows, y);
            }
        });
        Ok(())
    }

    /// Whether this backend has the packed one-token Q4_0 kernel ([`pack_q4_0`](Self::pack_q4_0)
    /// returns copies only then).
    pub fn has_packed_q4_0(&self) -> bool {
        cfg!(all(target_arch = "x86_64", powerinfer_avx512)) && self.backend == Backend::Avx512
    }

    /// A copy of the Q4_0 matrix `w` laid out for [`gemv_packed`](Self::gemv_packed), whose
    /// results equal [`gemv`](Self::gemv)'s bit for bit at less arithmetic per row (the
    /// one-token Q4_0 product is compute-bound on cores that read memory fast: Zen 4, weights
    /// in L2, 1.42–1.48× as fast). `None` where this backend has no packed kernel (it needs
    /// [`Backend::Avx512`]), for other types, and for rows of an odd number of blocks.
    pub fn pack_q4_0(&self, w: &Weights<'_>) -> Option<PackedQ4_0> {
        #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
        {
            let nb = w.cols / 32;
            if self.backend != Backend::Avx512 || w.ty != GgmlType::Q4_0 || nb == 0 || nb % 2 == 1 {
                return None;
            }
            let groups = w.rows / x86::packed::GROUP;
            let split = groups * x86::packed::GROUP * w.row_bytes;
            let gb = x86::packed::group_bytes(nb);
            let len = groups * gb;
            let mut buf = PageBuf::zeroed(len)?;
            // Each thread packs its own range of groups into its own part of the copy (the
            // copy's pages are first touched there too, in parallel).
            let n = self.pool.n_threads();
            let mut parts: Vec<std::sync::Mutex<(Range<usize>, &mut [u8])>> = Vec::with_capacity(n);
            let mut rest = &mut buf.bytes_mut()[..len];
            for t in 0..n {
                let r = split_range(groups, n, t);
                let (part, tail) = rest.split_at_mut(r.len() * gb);
                rest = tail;
                parts.push(std::sync::Mutex::new((r, part)));
            }
            self.pool.run(|t| {
                let mut p = parts[t].lock().unwrap_or_else(|e| e.into_inner());
                let (r, out) = &mut *p;
                x86::packed::pack_into(w.data, nb, r.clone(), out);
            });
            drop(parts);
            Some(PackedQ4_0 {
                rows: w.rows,
                cols: w.cols,
                groups: buf,
                groups_len: len,
                tail: w.data[split..].to_vec(),
            })
        }
        #[cfg(not(all(target_arch = "x86_64", powerinfer_avx512)))]
        {
            let _ = w;
            None
        }
    }

    /// `y = W x` for one token over a matrix from [`pack_q4_0`](Self::pack_q4_0): the same
    /// results as [`gemv`](Self::gemv) on the original, bit for bit. Fails with
    /// [`KernelError::BackendUnavailable`] on a backend without the packed kernel.
    pub fn gemv_packed(&self, p: &PackedQ4_0, x: &[f32], y: &mut [f32]) -> Result<(), KernelError> {
        self.gemv_packed_multi(&mut [PackedGemvJob { w: p, x, y }])
    }

    /// Several [`gemv_packed`](Self::gemv_packed) products in one dispatch, as
    /// [`gemv_multi`](Self::gemv_multi) does for the file layout: the groups of all jobs are
    /// split among the threads together, so a layer's Q, K and V share one start and one wait.
    /// Each row gets the same bits as from `gemv_packed` alone. All jobs are checked first.
    pub fn gemv_packed_multi(&self, jobs: &mut [PackedGemvJob<'_>]) -> Result<(), KernelError> {
        for j in jobs.iter() {
            check_len("x", j.w.cols, j.x.len())?;
            check_len("y", j.w.rows, j.y.len())?;
        }
        #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
        if self.backend == Backend::Avx512 {
            let ops = table::row_ops(GgmlType::Q4_0, self.backend)
                .ok_or(KernelError::UnsupportedType(GgmlType::Q4_0))?;
            // Each distinct activation prepared once.
            let mut acts: Vec<ActBuf<'_>> = Vec::with_capacity(jobs.len());
            let mut prepared = Vec::with_capacity(jobs.len());
            let (mut total, mut max_gb) = (0usize, 1usize);
            for j in jobs.iter_mut() {
                let act = match acts.iter().position(|a| a.is_of(ops.act, j.x)) {
                    Some(k) => k,
                    None => {
                        acts.push(ActBuf::new(ops.act, j.x, j.w.cols));
                        acts.len() - 1
                    }
                };
                let nb = j.w.cols / 32;
                let gb = x86::packed::group_bytes(nb);
                let n_groups = j.w.group_data().len() / gb.max(1);
                let body = n_groups * x86::packed::GROUP;
                let (head, tail) = j.y.split_at_mut(body);
                prepared.push((total, n_groups, nb, gb, j.w, act, OutPtr::new(head), tail));
                total += n_groups;
                max_gb = max_gb.max(gb);
            }
            // Grains of groups, as the rows of `gemv`.
            let grain = (GEMV_GRAIN_BYTES / max_gb).max(1);
            self.pool.for_grains(total, grain, |_, r| {
                for (offset, n_groups, nb, gb, w, act, out, _) in &prepared {
                    let s = r.start.max(*offset);
                    let e = r.end.min(offset + n_groups);
                    if s >= e {
                        continue;
                    }
                    let g = s - offset..e - offset;
                    // SAFETY: `for_grains` hands out disjoint ranges of the concatenated groups;
                    // their rows in this job are disjoint ranges within `0..out.len`.
                    let y = unsafe {
                        out.slice(g.start * x86::packed::GROUP..g.end * x86::packed::GROUP)
                    };
                    let data = &w.group_data()[g.start * gb..g.end * gb];
                    x86::packed::gemv_groups(data, *nb, &acts[*act].get(0), y);
                }
            });
            for (_, _, nb, _, w, act, _, tail) in prepared.iter_mut() {
                let a = acts[*act].get(0);
                for (yi, row) in tail.iter_mut().zip(w.tail.chunks_exact(*nb * 18)) {
                    *yi = (ops.dot)(row, &a);
                }
            }
            return Ok(());
        }
        Err(KernelError::BackendUnavailable(self.backend.name()))
    }

    /// `y_t = W x_t` for `n_tokens` tokens: `x` is `[n_tokens][cols]`, `y` is `[n_tokens][rows]`.
    pub fn gemm(
        &self,
        w: &Weights<'_>,
        x: &[f32],
        n_tokens: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("x", mul(w.cols, n_tokens)?, x.len())?;
        check_len("y", mul(w.rows, n_tokens)?, y.len())?;
        if n_tokens == 1 {
            return self.gemv(w, x, y);
        }
        let ops = self.ops(w)?;
        // Prompt-sized products of some types have their own cache-blocked kernels.
        #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
        if x86::gemm::dense_gemm(self.pool, self.backend, w, x, n_tokens, y) {
            return Ok(());
        }
        let acts = ActBuf::new(ops.act, x, w.cols);
        let rows: Vec<u32> = Vec::new();
        self.gemm_core(
            w,
            ops,
            &acts,
            n_tokens,
            RowList::All(w.rows),
            &rows,
            None,
            y,
        );
        Ok(())
    }

    /// Row-sparse product for one token: `y[i] = row_i · x` where row `i` is selected
    /// ([`RowSelect`], `scores` has `rows` values), `y[i] = 0` elsewhere.
    pub fn sparse_gemv(
        &self,
        w: &Weights<'_>,
        x: &[f32],
        select: &RowSelect<'_>,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("x", w.cols, x.len())?;
        check_len("y", w.rows, y.len())?;
        select.check(w.rows, 1)?;
        let active = select_rows(
            &select.scores[..w.rows],
            select.threshold,
            select.skip,
            None,
        );
        self.gemv_indexed_unchecked(w, x, &active, y)
    }

    /// Row-sparse product for one token over an explicit list of active rows: `y[i] = row_i · x`
    /// for `i` in `active`, 0 elsewhere. `active` must be strictly increasing and below `rows`
    /// ([`KernelError::IndexOutOfRange`], [`KernelError::IndicesNotIncreasing`]).
    pub fn sparse_gemv_indexed(
        &self,
        w: &Weights<'_>,
        x: &[f32],
        active: &[u32],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("x", w.cols, x.len())?;
        check_len("y", w.rows, y.len())?;
        check_active(active, w.rows)?;
        self.gemv_indexed_unchecked(w, x, active, y)
    }

    fn gemv_indexed_unchecked(
        &self,
        w: &Weights<'_>,
        x: &[f32],
        active: &[u32],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let ops = self.ops(w)?;
        y.fill(0.0);
        if active.is_empty() {
            return Ok(());
        }
        let acts = ActBuf::new(ops.act, x, w.cols);
        let act = acts.get(0);
        let out = OutPtr::new(y);
        if let (Some(dot_list), true) = (ops.dot_list, sparse_list_fits(&ops, w)) {
            self.pool.for_chunks(active.len(), |r| {
                let part = &active[r];
                let mut res = vec![0f32; part.len()];
                let rows = ListedRows::whole(w.data, w.row_bytes, part);
                dot_list(&rows, &act, &mut res);
                for (&i, &v) in part.iter().zip(&res) {
                    // SAFETY: `active` is strictly increasing and below `rows == y.len()`, and
                    // `for_chunks` gives each thread a disjoint part of it: one writer per index.
                    unsafe { out.write(i as usize, v) };
                }
            });
            return Ok(());
        }
        // With four rows per pass, rows `k + 1..k + 4` are computed together with row `k`: the
        // look-ahead counts from the end of the current group, plus one more group (measured
        // at 10% density, 2 threads: +3 rows ~1.07× faster than none for Q4_0/Q8_0, +7 about
        // the same for Q4_0 and ~1.08× more for Q8_0).
        let ahead = prefetch_ahead(w.row_bytes) + if ops.rows4.is_some() { 7 } else { 0 };
        self.pool.for_chunks(active.len(), |r| {
            let part = &active[r];
            for &i in part.iter().take(ahead) {
                prefetch(w.row(i as usize), PREFETCH_WHOLE_DOT);
            }
            let mut done = 0;
            if let Some(rows4) = ops.rows4 {
                for (q, quad) in part.chunks_exact(4).enumerate() {
                    for k in 4 * q..4 * q + 4 {
                        if let Some(&next) = part.get(k + ahead) {
                            prefetch(w.row(next as usize), PREFETCH_WHOLE_DOT);
                        }
                    }
                    let i = [quad[0], quad[1], quad[2], quad[3]].map(|i| i as usize);
                    let v = rows4(i.map(|i| w.row(i)), &act);
                    for (&i, v) in i.iter().zip(v) {
                        // SAFETY: `active` is strictly increasing and below `rows == y.len()`
                        // and each thread has a disjoint part of it: one writer per index.
                        unsafe { out.write(i, v) };
                    }
                }
                done = part.len() / 4 * 4;
            }
            for (k, &i) in part.iter().enumerate().skip(done) {
                if let Some(&next) = part.get(k + ahead) {
                    prefetch(w.row(next as usize), PREFETCH_WHOLE_DOT);
                }
                let i = i as usize;
                // SAFETY: `active` is strictly increasing (checked, or built so) and below
                // `rows == y.len()`, and `for_chunks` gives each thread a disjoint part of it,
                // so every index is written by one thread only.
                unsafe { out.write(i, (ops.dot)(w.row(i), &act)) };
            }
        });
        Ok(())
    }

    /// Row-sparse product for `n_tokens` tokens with a per-token predicate: `y[t][i] =
    /// row_i · x_t` where row `i` is selected for token `t` (`scores` is `[n_tokens][rows]`),
    /// 0 elsewhere.
    pub fn sparse_gemm(
        &self,
        w: &Weights<'_>,
        x: &[f32],
        n_tokens: usize,
        select: &RowSelect<'_>,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("x", mul(w.cols, n_tokens)?, x.len())?;
        check_len("y", mul(w.rows, n_tokens)?, y.len())?;
        select.check(w.rows, n_tokens)?;
        if n_tokens == 1 {
            return self.sparse_gemv(w, x, select, y);
        }
        let ops = self.ops(w)?;
        y.fill(0.0);
        let rows: Vec<u32> = (0..w.rows)
            .filter(|&i| (0..n_tokens).any(|t| select.selected(w.rows, t, i)))
            .map(|i| i as u32)
            .collect();
        if rows.is_empty() {
            return Ok(());
        }
        let acts = ActBuf::new(ops.act, x, w.cols);
        self.gemm_core(
            w,
            ops,
            &acts,
            n_tokens,
            RowList::Listed,
            &rows,
            Some(select),
            y,
        );
        Ok(())
    }

    /// The GEMM frame: each thread takes a contiguous part of the row list; tokens go in blocks
    /// whose activations stay in the last-level cache ([`GEMM_BLOCK_BYTES`]); dense products
    /// run two rows × four tokens per micro-kernel call, sparse ones four tokens per pass over
    /// a row.
    #[allow(clippy::too_many_arguments)]
    fn gemm_core(
        &self,
        w: &Weights<'_>,
        ops: RowOps,
        acts: &ActBuf<'_>,
        n_tokens: usize,
        list: RowList,
        rows: &[u32],
        select: Option<&RowSelect<'_>>,
        y: &mut [f32],
    ) {
        let n_rows = match list {
            RowList::All(n) => n,
            RowList::Listed => rows.len(),
        };
        // Token blocks sized to the last-level cache, not L2: every block streams all of the
        // thread's weight rows from DRAM again, and with L2-sized blocks (4–16 tokens of f32
        // activations) a 128-token F16 GEMM re-read its weights 8–32 times, ~2× slower
        // (measured on Zen 4, 2 threads; the quantized types, with 4× smaller activations,
        // gained little). The activations of a block are re-read from L3 per row pair
        // instead, which the 2 × 4 micro-kernel keeps cheap.
        let block = (GEMM_BLOCK_BYTES / acts.bytes_per_token().max(1)).clamp(4, 128) / 4 * 4;
        let out = OutPtr::new(y);
        let wr = w.rows;
        let index = |k: usize| match list {
            RowList::All(_) => k,
            RowList::Listed => rows[k] as usize,
        };
        // The two-row micro-kernel serves dense products (every row takes every token); each
        // result is the same as the one-row kernels give, so sparse == zeroed dense still holds.
        let tile = if select.is_none() { ops.tile } else { None };
        self.pool.for_chunks(n_rows, |part| {
            let mut t0 = 0;
            while t0 < n_tokens {
                let t1 = (t0 + block).min(n_tokens);
                let mut first = part.start;
                if let Some(tile) = tile {
                    while first + 2 <= part.end {
                        let i = [index(first), index(first + 1)];
                        let pair = [w.row(i[0]), w.row(i[1])];
                        let mut t = t0;
                        while t + 4 <= t1 {
                            let a = [
                                acts.get(t),
                                acts.get(t + 1),
                                acts.get(t + 2),
                                acts.get(t + 3),
                            ];
                            let mut r = [[0f32; 4]; 2];
                            tile(pair, &a, &mut r);
                            for (&i, r) in i.iter().zip(&r) {
                                for (j, &v) in r.iter().enumerate() {
                                    // SAFETY: rows `i` belong to this thread only (disjoint
                                    // parts of a strictly increasing row list), so
                                    // `(t + j) * wr + i < n_tokens * rows` is written by this
                                    // thread only.
                                    unsafe { out.write((t + j) * wr + i, v) };
                                }
                            }
                            t += 4;
                        }
                        for t in t..t1 {
                            let a = acts.get(t);
                            for (&i, row) in i.iter().zip(pair) {
                                // SAFETY: as above.
                                unsafe { out.write(t * wr + i, (ops.dot_batch)(row, &a)) };
                            }
                        }
                        first += 2;
                    }
                }
                for k in first..part.end {
                    let i = index(k);
                    let row = w.row(i);
                    let mut pending = [0usize; 4];
                    let mut np = 0;
                    for t in t0..t1 {
                        if select.is_some_and(|s| !s.selected(wr, t, i)) {
                            continue;
                        }
                        pending[np] = t;
                        np += 1;
                        if np == 4 {
                            let a = [
                                acts.get(pending[0]),
                                acts.get(pending[1]),
                                acts.get(pending[2]),
                                acts.get(pending[3]),
                            ];
                            let mut r = [0f32; 4];
                            (ops.dot4)(row, &a, &mut r);
                            for (&t, &v) in pending.iter().zip(&r) {
                                // SAFETY: row `i` belongs to this thread only (disjoint parts
                                // of a strictly increasing row list), so `t * wr + i` is
                                // written by this thread only; it is < n_tokens * rows.
                                unsafe { out.write(t * wr + i, v) };
                            }
                            np = 0;
                        }
                    }
                    for &t in &pending[..np] {
                        let v = (ops.dot_batch)(row, &acts.get(t));
                        // SAFETY: as above.
                        unsafe { out.write(t * wr + i, v) };
                    }
                }
                t0 = t1;
            }
        });
    }

    /// Sparse axpy for one token over the transposed matrix `w_t` (`rows` = neurons, `cols` =
    /// output length): `y += Σ a[i] · row_i` over rows `i` selected by `select` (`scores` has
    /// `rows` values) with `a[i] != 0`. `a` has `rows` values, `y` has `cols`; `y` is added to,
    /// not overwritten. For F16 rows every `a[i]` is first rounded to f16 (a value that rounds
    /// to 0 is skipped), in all three axpy forms (see the [module docs](self)).
    pub fn sparse_axpy(
        &self,
        w_t: &Weights<'_>,
        a: &[f32],
        select: &RowSelect<'_>,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("a", w_t.rows, a.len())?;
        check_len("y", w_t.cols, y.len())?;
        select.check(w_t.rows, 1)?;
        let mut rounded = ScratchVec::empty();
        let a = self.axpy_coefficients(w_t, a, &mut rounded)?;
        let active = select_rows(
            &select.scores[..w_t.rows],
            select.threshold,
            select.skip,
            Some(a),
        );
        self.axpy_core(w_t, a, 1, &active, None, y)
    }

    /// Sparse axpy over an explicit list of active rows: `y += Σ_{i in active, a[i] != 0}
    /// a[i] · row_i`. `active` must be strictly increasing and below `rows`.
    pub fn sparse_axpy_indexed(
        &self,
        w_t: &Weights<'_>,
        a: &[f32],
        active: &[u32],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("a", w_t.rows, a.len())?;
        check_len("y", w_t.cols, y.len())?;
        check_active(active, w_t.rows)?;
        let mut rounded = ScratchVec::empty();
        let a = self.axpy_coefficients(w_t, a, &mut rounded)?;
        let nonzero: Vec<u32> = active
            .iter()
            .copied()
            .filter(|&i| a[i as usize] != 0.0)
            .collect();
        self.axpy_core(w_t, a, 1, &nonzero, None, y)
    }

    /// Sparse axpy for `n_tokens` tokens: `y_t += Σ a_t[i] · row_i` over rows selected for
    /// token `t` with `a_t[i] != 0`. `a` and `scores` are `[n_tokens][rows]`, `y` is
    /// `[n_tokens][cols]`.
    pub fn sparse_axpy_batch(
        &self,
        w_t: &Weights<'_>,
        a: &[f32],
        n_tokens: usize,
        select: &RowSelect<'_>,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("a", mul(w_t.rows, n_tokens)?, a.len())?;
        check_len("y", mul(w_t.cols, n_tokens)?, y.len())?;
        select.check(w_t.rows, n_tokens)?;
        let mut rounded = ScratchVec::empty();
        let a = self.axpy_coefficients(w_t, a, &mut rounded)?;
        let rows = w_t.rows;
        let active: Vec<u32> = (0..rows)
            .filter(|&i| {
                (0..n_tokens).any(|t| a[t * rows + i] != 0.0 && select.selected(rows, t, i))
            })
            .map(|i| i as u32)
            .collect();
        self.axpy_core(w_t, a, n_tokens, &active, Some(select), y)
    }

    /// The coefficients the axpy multiplies: `a` itself, or for F16 weights `a` rounded to f16
    /// into `buf` (as every F16 product rounds its activations, and as PowerInfer's F16 axpy
    /// converts them), before the zero test, so a value that rounds to 0 is skipped.
    fn axpy_coefficients<'b>(
        &self,
        w: &Weights<'_>,
        a: &'b [f32],
        buf: &'b mut ScratchVec<f32>,
    ) -> Result<&'b [f32], KernelError> {
        if self.ops(w)?.act != act::ActFormat::F16 {
            return Ok(a);
        }
        // Pooled buffers: this runs once per layer and token in a sparse F16 decode.
        let mut bits = ScratchVec::<u16>::zeroed(a.len());
        *buf = ScratchVec::zeroed(a.len());
        act::round_f16(a, buf, &mut bits);
        Ok(buf)
    }

    /// The one-token axpy over long rows on backends with a list kernel: thread `k` of `n`
    /// takes the `k`-th contiguous part of the active list, whole rows, into its own zeroed
    /// partial output; then `y[c] += ((p_0[c] + p_1[c]) + …) + p_{n-1}[c]`. Each thread reads
    /// whole rows (2304 bytes for a 4096-wide Q4_0 row) instead of a part of every row:
    /// 11008×4096 Q4_0 at 10%, 2 threads, 19.4–20.0 GB/s against 13.1–16.1 with columns split.
    /// The result depends on the thread count (by rounding: the sum is grouped per thread),
    /// not on timing.
    fn axpy_rows_split(
        &self,
        w: &Weights<'_>,
        a: &[f32],
        active: &[u32],
        axpy_list: rowops::AxpyListFn,
        y: &mut [f32],
    ) {
        let (n, cols) = (self.pool.n_threads(), w.cols);
        let mut parts = vec![0f32; n * cols];
        let out = OutPtr::new(&mut parts);
        self.pool.run(|tid| {
            let list = &active[split_range(active.len(), n, tid)];
            if list.is_empty() {
                return;
            }
            // SAFETY: thread `tid` owns `parts[tid * cols..(tid + 1) * cols]`, within the
            // `n * cols` values (tid < n).
            let part = unsafe { out.slice(tid * cols..(tid + 1) * cols) };
            let rows = ListedRows::whole(w.data, w.row_bytes, list);
            axpy_list(&rows, a, part);
        });
        let (first, rest) = parts.split_at(cols);
        for (c, yc) in y.iter_mut().enumerate() {
            let mut s = first[c];
            for p in rest.chunks_exact(cols) {
                s += p[c];
            }
            *yc += s;
        }
    }

    /// The axpy frame: threads own disjoint block-aligned column ranges of the output and walk
    /// every active row over them, in list order (one-token products of long rows with a list
    /// kernel: [`Self::axpy_rows_split`] instead).
    fn axpy_core(
        &self,
        w: &Weights<'_>,
        a: &[f32],
        n_tokens: usize,
        active: &[u32],
        select: Option<&RowSelect<'_>>,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let ops = self.ops(w)?;
        if active.is_empty() || w.cols == 0 {
            return Ok(());
        }
        // Column granule: a whole block, and at least 64 elements (a cache line of f32 output).
        let bs = w.ty.block_size();
        let granule = bs.max(64);
        let n_gran = w.cols.div_ceil(granule);
        let elem_bytes_num = w.ty.type_size();
        let cols = w.cols;
        let rows = w.rows;
        if n_tokens == 1
            && select.is_none()
            && w.row_bytes >= ROW_SPLIT_AXPY_BYTES
            && !ops.act.is_float()
        {
            if let (Some(axpy_list), true) = (ops.axpy_list, self.pool.n_threads() > 1) {
                self.axpy_rows_split(w, a, active, axpy_list, y);
                return Ok(());
            }
        }
        let out = OutPtr::new(y);
        let n_threads = self.pool.n_threads().min(n_gran);
        self.pool.run(|tid| {
            if tid >= n_threads {
                return;
            }
            let g = split_range(n_gran, n_threads, tid);
            let c0 = g.start * granule;
            let c1 = (g.end * granule).min(cols);
            if c0 >= c1 {
                return;
            }
            let b0 = c0 / bs * elem_bytes_num;
            let b1 = c1 / bs * elem_bytes_num;
            if n_tokens == 1 && select.is_none() {
                // SAFETY: threads own disjoint column ranges `c0..c1 <= cols == y.len()`.
                let yo = unsafe { out.slice(c0..c1) };
                if let (Some(axpy_list), true) = (ops.axpy_list, sparse_list_fits(&ops, w)) {
                    // Every listed row has a nonzero activation (filtered by the callers).
                    let rows = ListedRows {
                        data: w.data,
                        row_bytes: w.row_bytes,
                        start: b0,
                        end: b1,
                        list: active,
                        then: &[],
                    };
                    axpy_list(&rows, a, yo);
                    return;
                }
                // Four rows per pass: count the look-ahead from the end of the current group.
                let ahead = prefetch_ahead(b1 - b0) + if ops.axpy4.is_some() { 4 } else { 0 };
                for &i in active.iter().take(ahead) {
                    prefetch(&w.row(i as usize)[b0..b1], PREFETCH_WHOLE_AXPY);
                }
                let fetch = |k: usize| {
                    if let Some(&next) = active.get(k + ahead) {
                        prefetch(&w.row(next as usize)[b0..b1], PREFETCH_WHOLE_AXPY);
                    }
                };
                let mut rest = active;
                if let Some(axpy4) = ops.axpy4 {
                    let mut quads = active.chunks_exact(4);
                    for (qi, q) in (&mut quads).enumerate() {
                        for k in 4 * qi..4 * qi + 4 {
                            fetch(k);
                        }
                        let i = [q[0] as usize, q[1] as usize, q[2] as usize, q[3] as usize];
                        let rows4 = i.map(|i| &w.row(i)[b0..b1]);
                        // Every listed row has a nonzero activation (filtered by the callers).
                        axpy4(rows4, i.map(|i| a[i]), yo);
                    }
                    rest = quads.remainder();
                }
                let base = active.len() - rest.len();
                for (k, &i) in rest.iter().enumerate() {
                    fetch(base + k);
                    let i = i as usize;
                    if a[i] != 0.0 {
                        (ops.axpy)(&w.row(i)[b0..b1], a[i], yo);
                    }
                }
                return;
            }
            let ahead = prefetch_ahead(b1 - b0);
            for (k, &i) in active.iter().enumerate() {
                if let Some(&next) = active.get(k + ahead) {
                    prefetch(&w.row(next as usize)[b0..b1], PREFETCH_WHOLE_AXPY);
                }
                let i = i as usize;
                let row = &w.row(i)[b0..b1];
                for t in 0..n_tokens {
                    let ai = a[t * rows + i];
                    if ai == 0.0 || select.is_some_and(|s| !s.selected(rows, t, i)) {
                        continue;
                    }
                    // SAFETY: threads own disjoint column ranges `c0..c1` of every token's
                    // output row, and `t * cols + c1 <= n_tokens * cols == y.len()`.
                    let yo = unsafe { out.slice(t * cols + c0..t * cols + c1) };
                    (ops.axpy)(row, ai, yo);
                }
            }
        });
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum RowList {
    All(usize),
    Listed,
}

/// Whether [`MatMul`] supports weight type `ty` (for every kernel).
pub fn is_supported(ty: GgmlType) -> bool {
    rowops::SUPPORTED.contains(&ty)
}

/// The weight types the matrix kernels support.
pub fn supported_types() -> &'static [GgmlType] {
    &rowops::SUPPORTED
}

#[allow(dead_code)]
fn _assert_act_is_copy(a: Act<'_>) -> Act<'_> {
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers of 2 MiB and more start on a 2 MiB boundary (so their whole 2 MiB parts can be
    /// huge pages); every buffer is zero, as long as asked, writable, and cloned exactly.
    #[test]
    fn page_buf_alignment_and_contents() {
        for len in [1usize, 4096, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 123] {
            let mut b = PageBuf::zeroed(len).unwrap();
            assert_eq!(b.bytes().len(), len);
            assert!(b.bytes().iter().all(|&x| x == 0));
            if len >= HUGE_PAGE {
                assert_eq!(b.bytes().as_ptr() as usize % HUGE_PAGE, 0, "{len}");
            }
            b.bytes_mut()[len - 1] = 7;
            b.bytes_mut()[0] = 9;
            let c = b.clone();
            assert_eq!(c.bytes(), b.bytes());
            assert_eq!(format!("{c:?}"), format!("PageBuf({len} bytes)"));
        }
    }
}
