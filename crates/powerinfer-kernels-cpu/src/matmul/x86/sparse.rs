//! Neuron-sparse list kernels for Q4_0 and Q8_0 weights (x86-64, AVX-512 F/VL/BW/VNNI).
//!
//! A sparse product visits a list of scattered rows (or row slices, for axpy), which the
//! hardware prefetchers cannot guess. These kernels take the whole list of one thread and run a
//! software prefetch *stream* over it: the rows of the list, in list order, are treated as one
//! byte stream, and the kernel keeps a fixed number of bytes ([`LEAD_DOT`], [`LEAD_AXPY`])
//! requested ahead of what it consumes, issuing a few line prefetches per step of its inner
//! loop. That keeps a steady number of misses in flight (like a hardware stream prefetcher),
//! instead of bursts of whole-row prefetches between rows.
//!
//! * `dot_list_*`: the row-sparse product. Each row's result is computed with exactly the
//!   operations of the dense GEMV's VNNI kernel ([`super::int`]), so sparse == dense with
//!   zeroed rows, bit for bit.
//! * `dense_q4_0_quad`: the dense Q4_0 product (`RowOps::dot_range`) with AVX-512
//!   VBMI, one row at a time with near prefetches into L1, four blocks per 512-bit step; the
//!   same bits as the row-sparse kernel. One sequential stream per thread reads faster than
//!   eight rows per pass with the far stream.
//! * `axpy_list_*`: `out += Σ a_i · row_i` over a thread's column slice, eight rows per pass
//!   with 512-bit vectors. Each element takes `fma(a_i·d, q, y)` row after row in list order,
//!   the same roundings as the AVX2 and scalar one-row kernels. The scales `a_i·d` of the
//!   eight rows are converted together (eight f16 gathered in general registers, one
//!   `vcvtph2ps`) and read back as broadcast loads, and Q4_0 nibbles become `q − 8` as f32
//!   with one 16-entry `vpermps` lookup per 16 weights: less vector work than the four-row
//!   AVX2 kernel.
//!
//! The measurements behind this file's constants and choices are in `docs/tuning.md`.
//!
//! Installed by [`super::register`] only for [`Backend::Avx512`](crate::Backend), which is
//! what makes calling the `#[target_feature]` functions from the safe wrappers sound. Built
//! only by compilers that have the AVX-512 intrinsics (Rust ≥ 1.89, `cfg(powerinfer_avx512)`);
//! older ones run the four-row kernels of [`super::float`] and [`super::int`].

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::common::{
    dot_float_rows512, f16_scalar, hsum, q4_0_pair_act, q4_0_pair_weights, range_blocks, with_act,
    FloatLoad16,
};
use super::int::vnni;
use crate::matmul::act::Act;
use crate::matmul::rowops::ListedRows;
use std::arch::x86_64::*;

/// Bytes the row-sparse products keep requested beyond the rows of the current pass (less
/// lead was slower, more no faster).
const LEAD_DOT: usize = 32 << 10;
/// Bytes the axpy kernels keep requested beyond the rows of the current pass (as above).
const LEAD_AXPY: usize = 32 << 10;

/// Rows per pass of the row-sparse products (sharing each activation load): eight scattered
/// rows in flight were faster than four.
const DOT_ROWS: usize = 8;
/// Rows per pass of the row-sparse float products (four zmm accumulators per row).
const FLOAT_ROWS: usize = 4;
/// Rows per pass of the axpy kernels (sharing each load and store of the output).
const AXPY_ROWS: usize = 8;

/// Checks what the kernels rely on: every listed row slice lies inside `rows.data`, and the
/// slice is `blocks` whole blocks of `block_bytes`. Panics otherwise (a frame bug).
fn check_rows(rows: &ListedRows<'_>, block_bytes: usize, blocks: usize) {
    let (s, e) = (rows.start, rows.end);
    assert!(s <= e && e <= rows.row_bytes && e - s == blocks * block_bytes);
    // Rows of no bytes (no columns) are never read.
    if let Some(n_rows) = rows.data.len().checked_div(rows.row_bytes) {
        assert!(rows.list.iter().all(|&i| (i as usize) < n_rows));
    }
}

/// Blocks of `block_bytes` per row of a row-sparse product over whole listed rows, after
/// checking what its kernels rely on ([`check_rows`], one result per listed row). Panics
/// otherwise (a frame bug).
fn list_blocks(rows: &ListedRows<'_>, block_bytes: usize, res: &[f32]) -> usize {
    let nb = rows.row_bytes / block_bytes;
    check_rows(rows, block_bytes, nb);
    assert!(rows.start == 0 && res.len() == rows.list.len());
    nb
}

// ---------------------------------------------------------------------------------------------
// The prefetch stream.

/// A software prefetch stream over the listed row slices, in list order (see the module docs).
struct Stream<'a> {
    base: usize,
    row_bytes: usize,
    start: usize,
    len: usize,
    list: &'a [u32],
    /// Rows to continue with once `list` is exhausted (`ListedRows::then`).
    then: &'a [u32],
    /// Next list entry to open.
    k: usize,
    /// Next line address to prefetch, and the end of the open slice.
    cur: usize,
    end: usize,
    /// Bytes that may still be requested before the consumer catches up.
    credit: isize,
}

impl<'a> Stream<'a> {
    /// A stream over `rows`, with `lead` bytes requested at once.
    #[inline(always)]
    fn new(rows: &ListedRows<'a>, lead: usize) -> Self {
        let mut s = Stream {
            base: rows.data.as_ptr() as usize,
            row_bytes: rows.row_bytes,
            start: rows.start,
            len: rows.end - rows.start,
            list: rows.list,
            then: rows.then,
            k: 0,
            cur: 0,
            end: 0,
            credit: 0,
        };
        s.consume(lead);
        s
    }

    /// Records that the consumer read `bytes` more, and requests as many bytes further on.
    #[inline(always)]
    fn consume(&mut self, bytes: usize) {
        self.credit += bytes as isize;
        while self.credit > 0 {
            self.credit -= 64;
            if self.cur >= self.end {
                if self.k == self.list.len() && !self.then.is_empty() {
                    (self.list, self.then, self.k) = (self.then, &[], 0);
                }
                let Some(&i) = self.list.get(self.k) else {
                    self.credit = 0;
                    return;
                };
                self.k += 1;
                let s = self.base + i as usize * self.row_bytes + self.start;
                self.cur = s & !63;
                self.end = s + self.len;
                // A slice that does not start and end on line boundaries takes more lines
                // than its bytes fill: credit the difference back, so that the stream stays
                // `lead` bytes of row data ahead however the slices are aligned (charging a
                // whole line for every partial one lost a line of lead per row, and with rows
                // not on 64-byte boundaries the prefetches fell behind the reads).
                let lines = (self.end - self.cur).div_ceil(64);
                self.credit += (lines * 64 - self.len) as isize;
            }
            // SAFETY: a prefetch never faults and changes no state the program can observe;
            // the address lies in the cache line of a byte of a listed row slice, and SSE is
            // part of the x86-64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.cur as *const i8) };
            self.cur += 64;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Row-sparse products (the same operations as `int::vnni`).

/// One row's pair step at blocks `b`, `b + 1` (`q` points at block `b`) against
/// [`q4_0_pair_act`]'s vectors: the exact integer sums as f32 and the scale products
/// `d_w·d_x`, which the caller adds to its accumulator as `fma(sums, scales, acc)`.
///
/// # Safety
/// 36 readable bytes at `q`; AVX2/FMA/F16C and AVX-512 VL/VNNI available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn q4_0_pair_row(
    q: *const u8,
    (dx, x0, x1, init): (__m256, __m256i, __m256i, __m256i),
) -> (__m256, __m256) {
    // SAFETY: the pair's 36 bytes are readable (caller).
    unsafe {
        let (lo, hi, dw) = q4_0_pair_weights(q);
        let si = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(init, lo, x0), hi, x1);
        (_mm256_cvtepi32_ps(si), _mm256_mul_ps(dw, dx))
    }
}

/// `R` Q4_0 rows (block 0 at `p[r]`, `nb` blocks, `nb` even) · an activation in
/// [`ActFormat::Q8_0Pairs`](crate::matmul::act::ActFormat) order, with the operations of the dense
/// VNNI kernel (`q4_0_pair` then `hsum`), feeding `st` as it reads.
///
/// # Safety
/// `nb` even; `18·nb` readable bytes at every `p[r]`; `a` has values, scales and pair offsets
/// for `nb` blocks; AVX2/FMA/F16C and AVX-512 F/VL/BW/VNNI available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn dot_q4_0_rows<const R: usize>(
    p: [*const u8; R],
    nb: usize,
    a: &Act<'_>,
    st: &mut Stream<'_>,
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut b = 0;
    // SAFETY: blocks `b`, `b + 1` < nb lie in every row and in the activation (caller).
    unsafe {
        while b + 2 <= nb {
            st.consume(R * 36);
            let act = q4_0_pair_act(a, b);
            for r in 0..R {
                let (f, sc) = q4_0_pair_row(p[r].add(b * 18), act);
                acc[r] = _mm256_fmadd_ps(f, sc, acc[r]);
            }
            b += 2;
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        // SAFETY: AVX2 available (caller).
        out[r] = unsafe { hsum(acc[r]) };
    }
    out
}

/// Byte indices for [`dense_q4_0_quad`]'s `vpermt2b`: the 64 nibble bytes of four
/// consecutive Q4_0 blocks (72 bytes from the first block's start: bytes `0..64` in the first
/// source, `64..72` in the low bytes of the second), block `k`'s 16 bytes at `16k`.
const QUAD_NIBBLES: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut j = 0;
    while j < 64 {
        // Block j / 16's byte j % 16 sits 2 + 18·(j / 16) + j % 16 bytes in; past 64 it is in
        // the second source, whose byte i has index 64 + i.
        t[j] = (2 + 18 * (j / 16) + j % 16) as u8;
        j += 1;
    }
    t
};

/// Byte indices for [`dense_q4_0_quad`]'s scale `vpermb`: 16 f16 in the low 256 bits,
/// lanes `4k..4k + 4` holding block `k`'s scale (bytes `18k`, `18k + 1`).
const QUAD_SCALES: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut l = 0;
    while l < 16 {
        t[2 * l] = (18 * (l / 4)) as u8;
        t[2 * l + 1] = (18 * (l / 4) + 1) as u8;
        l += 1;
    }
    t
};

/// Bytes ahead of the block being read that [`dense_q4_0_quad`] asks to have in L1 (T0): without
/// these prefetches the hardware brings the stream no closer than L2; the best of the distances
/// swept, and T1 was slower.
const DENSE_AHEAD: usize = 4096;

/// Bytes ahead that [`dense_q4_0_quad`] also asks to have in L2 (T1 hint), beside the near
/// L1 requests, for rows of at least [`DENSE_FAR_ROW_BYTES`]: they help long rows (7B-shaped)
/// and slowed short ones.
const DENSE_FAR: usize = 16 << 10;

/// Rows of at least this many bytes get the [`DENSE_FAR`] requests.
const DENSE_FAR_ROW_BYTES: usize = 2048;

/// Consecutive Q4_0 rows `first..first + y.len()` of `data` (`nb` blocks each, `nb` even) ·
/// `a`, one row at a time: each thread reads one sequential stream, with line prefetches
/// [`DENSE_AHEAD`] bytes on into L1 and [`DENSE_FAR`] into L2. Four blocks per step with
/// 512-bit vectors (AVX-512 VBMI): one `vpermt2b` gathers the four blocks' nibbles from a 64-byte and an 8-byte load,
/// one `vpermb` their scales; the low and high 256 bits are exactly the pair steps of blocks
/// `(b, b+1)` and `(b+2, b+3)` of [`dot_q4_0_rows`] (the same integer sums and scale products,
/// the two FMAs into the row's accumulator in the same order), so the results are those of
/// the dense VNNI kernel bit for bit. A last pair (`nb` = 2 mod 4) takes the 256-bit step.
///
/// # Safety
/// `data` holds rows `first..first + y.len()` of `18·nb` bytes; `a` has values, scales and
/// pair offsets for `nb` blocks; AVX2/FMA/F16C and AVX-512 F/VL/BW/VNNI/VBMI available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi")]
unsafe fn dense_q4_0_quad(data: &[u8], nb: usize, first: usize, a: &Act<'_>, y: &mut [f32]) {
    let rb = nb * 18;
    let far = rb >= DENSE_FAR_ROW_BYTES;
    let mask = _mm512_set1_epi8(0x0F);
    let spread16 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    // SAFETY: the tables are 64 bytes each.
    let (nib, scl) = unsafe {
        (
            _mm512_loadu_si512(QUAD_NIBBLES.as_ptr() as *const __m512i),
            _mm512_loadu_si512(QUAD_SCALES.as_ptr() as *const __m512i),
        )
    };
    // The activation side of every quad, once per call: x0 and x1 (pairs (b, b+1) and
    // (b+2, b+3) in the low and high halves) and d_x spread to four lanes per block.
    let nq = nb / 4;
    // The thread's buffer, borrowed here rather than in a closure (which would not get this
    // function's target features).
    let cell: *const std::cell::RefCell<Vec<Line>> = QUAD_ACT.with(|c| c as *const _);
    {
        // SAFETY: a thread-local lives as long as its thread, which runs this call.
        let mut buf = unsafe { &*cell }.borrow_mut();
        buf.resize(3 * nq, Line([0; 64]));
        let out = buf.as_mut_ptr() as *mut __m512i;
        for j in 0..nq {
            // SAFETY: quad j's 128 values and 4 scales lie in the activation (caller).
            unsafe {
                let xq = a.q.as_ptr().add(j * 128);
                let l0 = _mm512_loadu_si512(xq as *const __m512i);
                let l1 = _mm512_loadu_si512(xq.add(64) as *const __m512i);
                let o = out.add(3 * j);
                _mm512_store_si512(o, _mm512_shuffle_i64x2::<0b01_00_01_00>(l0, l1));
                _mm512_store_si512(o.add(1), _mm512_shuffle_i64x2::<0b11_10_11_10>(l0, l1));
                _mm512_store_si512(
                    o.add(2),
                    _mm512_castps_si512(_mm512_permutexvar_ps(
                        spread16,
                        _mm512_castps128_ps512(_mm_loadu_ps(a.d.as_ptr().add(4 * j))),
                    )),
                );
            }
        }
        let qa = buf.as_ptr() as *const __m512i;
        for (k, yk) in y.iter_mut().enumerate() {
            // SAFETY: row first + k lies in `data` (caller).
            let p = unsafe { data.as_ptr().add((first + k) * rb) };
            let mut acc = _mm256_setzero_ps();
            let mut b = 0;
            // SAFETY: blocks `b..b + 4` (or `b`, `b + 1` in the tail) < nb lie in the row and in
            // the activation (caller); the loads read bytes `0..64` and `64..72` of the four blocks;
            // `qa` holds 3 vectors per quad.
            unsafe {
                while b + 4 <= nb {
                    let q = p.add(b * 18);
                    dense_prefetch(q, far);
                    let v = qa.add(3 * (b / 4));
                    let (x0, x1) = (_mm512_load_si512(v), _mm512_load_si512(v.add(1)));
                    let dx = _mm512_castsi512_ps(_mm512_load_si512(v.add(2)));
                    let init = _mm512_loadu_si512(a.po.as_ptr().add(b / 2 * 8) as *const __m512i);
                    let head = _mm512_loadu_si512(q as *const __m512i);
                    let tail = _mm512_castsi128_si512(_mm_loadl_epi64(q.add(64) as *const __m128i));
                    let raw = _mm512_permutex2var_epi8(head, nib, tail);
                    let lo = _mm512_and_si512(raw, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                    let dw =
                        _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi8(scl, head)));
                    let sc = _mm512_mul_ps(dw, dx);
                    let si = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, lo, x0), hi, x1);
                    let f = _mm512_cvtepi32_ps(si);
                    acc =
                        _mm256_fmadd_ps(_mm512_castps512_ps256(f), _mm512_castps512_ps256(sc), acc);
                    acc = _mm256_fmadd_ps(
                        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(f))),
                        _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sc))),
                        acc,
                    );
                    b += 4;
                }
                if b + 2 <= nb {
                    // The 256-bit pair step of `dot_q4_0_rows`.
                    let (f, sc) = q4_0_pair_row(p.add(b * 18), q4_0_pair_act(a, b));
                    acc = _mm256_fmadd_ps(f, sc, acc);
                }
                *yk = hsum(acc);
            }
        }
    }
}

thread_local! {
    /// [`dense_q4_0_quad`]'s activation side, per thread (no allocation once warm).
    static QUAD_ACT: std::cell::RefCell<Vec<Line>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// 64 bytes on a 64-byte boundary (one 512-bit vector).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// `R` Q8_0 rows (block 0 at `p[r]`, `nb` blocks) · a Q8_0 activation, with the operations of
/// the dense VNNI kernel (even and odd blocks into two accumulators, exact i32 block dots),
/// calling `ahead(b)` (the caller's prefetches) before block `b`.
///
/// # Safety
/// `34·nb` readable bytes at every `p[r]`; `a` has values and scales for `nb` blocks;
/// AVX2/FMA/F16C and AVX-512 F/VL/BW/VNNI available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn dot_q8_0_rows<const R: usize>(
    p: [*const u8; R],
    nb: usize,
    a: &Act<'_>,
    mut ahead: impl FnMut(usize),
) -> [f32; R] {
    let mut acc = [[_mm256_setzero_ps(); R]; 2];
    // SAFETY: block `b` < nb lies in every row and in the activation (caller).
    unsafe {
        for b in 0..nb {
            ahead(b);
            let x = _mm256_loadu_si256(a.q.as_ptr().add(b * 32) as *const __m256i);
            let dx = _mm256_broadcast_ss(a.d.get_unchecked(b));
            for r in 0..R {
                let blk = p[r].add(b * 34);
                let dw = _mm256_set1_ps(f16_scalar(blk));
                let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
                let aw = _mm256_sign_epi8(w, w);
                let sx = _mm256_sign_epi8(x, w);
                let s = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx));
                acc[b & 1][r] = _mm256_fmadd_ps(s, _mm256_mul_ps(dw, dx), acc[b & 1][r]);
            }
        }
    }
    let mut out = [0f32; R];
    for r in 0..R {
        // SAFETY: AVX2 available (caller).
        out[r] = unsafe { hsum(_mm256_add_ps(acc[0][r], acc[1][r])) };
    }
    out
}

/// One of the row kernels above, with the row count as a parameter.
trait DotRows {
    /// Bytes per block.
    const BYTES: usize;
    /// # Safety
    /// As the kernel's.
    unsafe fn rows<const R: usize>(
        p: [*const u8; R],
        nb: usize,
        a: &Act<'_>,
        st: &mut Stream<'_>,
    ) -> [f32; R];
}
struct DQ4_0;
struct DQ8_0;
impl DotRows for DQ4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn rows<const R: usize>(
        p: [*const u8; R],
        nb: usize,
        a: &Act<'_>,
        st: &mut Stream<'_>,
    ) -> [f32; R] {
        // SAFETY: forwarded contract.
        unsafe { dot_q4_0_rows::<R>(p, nb, a, st) }
    }
}
impl DotRows for DQ8_0 {
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn rows<const R: usize>(
        p: [*const u8; R],
        nb: usize,
        a: &Act<'_>,
        st: &mut Stream<'_>,
    ) -> [f32; R] {
        // SAFETY: forwarded contract.
        unsafe { dot_q8_0_rows::<R>(p, nb, a, |_| st.consume(R * 34)) }
    }
}

/// Every listed row · `a` into `res` (list order), `R` rows per pass, then one at a time.
///
/// # Safety
/// Every listed row is whole blocks of `D` inside `rows.data` (`rows.start == 0`, `rows.end ==
/// row_bytes`); `a` is prepared for that row length (and `nb` is even for Q4_0);
/// `res.len() == rows.list.len()`; the kernels' CPU features available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn dot_list<D: DotRows, const R: usize>(
    rows: &ListedRows<'_>,
    a: &Act<'_>,
    res: &mut [f32],
) {
    let nb = rows.row_bytes / D::BYTES;
    let mut st = Stream::new(rows, LEAD_DOT + R * rows.row_bytes);
    let base = rows.data.as_ptr();
    let row = |i: u32| {
        // SAFETY: listed rows lie inside `rows.data` (caller).
        unsafe { base.add(i as usize * rows.row_bytes) }
    };
    let mut groups = rows.list.chunks_exact(R);
    let mut k = 0;
    for g in &mut groups {
        let p: [*const u8; R] = std::array::from_fn(|r| row(g[r]));
        // SAFETY: whole rows of `nb` blocks; features available (caller).
        let v = unsafe { D::rows::<R>(p, nb, a, &mut st) };
        res[k..k + R].copy_from_slice(&v);
        k += R;
    }
    for &i in groups.remainder() {
        // SAFETY: as above.
        res[k] = unsafe { D::rows::<1>([row(i)], nb, a, &mut st) }[0];
        k += 1;
    }
}

pub(super) fn dot_list_q4_0(rows: &ListedRows<'_>, a: &Act<'_>, res: &mut [f32]) {
    let nb = list_blocks(rows, 18, res);
    assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.po.len() >= nb / 2 * 8);
    if nb % 2 == 1 {
        let list = rows.list.iter().map(|&i| i as usize);
        return odd_rows_q4_0(rows.data, rows.row_bytes, list, a, res);
    }
    // SAFETY: installed only for Backend::Avx512 (features detected); rows checked above,
    // `nb` even, the activation holds `nb` blocks.
    unsafe { dot_list::<DQ4_0, DOT_ROWS>(rows, a, res) }
}

/// The dense Q4_0 GEMV over rows `r` with [`dense_q4_0_quad`]; installed only where AVX-512
/// VBMI was detected.
pub(super) fn dot_range_q4_0(
    data: &[u8],
    row_bytes: usize,
    r: std::ops::Range<usize>,
    a: &Act<'_>,
    y: &mut [f32],
) {
    let nb = range_blocks(data, row_bytes, &r, y, 18);
    assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.po.len() >= nb / 2 * 8);
    if nb % 2 == 1 {
        return odd_rows_q4_0(data, row_bytes, r, a, y);
    }
    // SAFETY: installed only for Backend::Avx512 with VBMI detected; rows `r` checked above,
    // `nb` even, the activation holds `nb` blocks.
    unsafe { dense_q4_0_quad(data, nb, r.start, a, y) }
}

/// Q4_0 rows `rows` of `data` (rows of `row_bytes`) · `a` into `out`, one row at a time with the
/// dense VNNI kernel: the Q4_0 list and range kernels' way with rows of an odd number of blocks
/// (rare: 32·odd values), which their pair steps cannot take.
fn odd_rows_q4_0(
    data: &[u8],
    row_bytes: usize,
    rows: impl IntoIterator<Item = usize>,
    a: &Act<'_>,
    out: &mut [f32],
) {
    for (o, i) in out.iter_mut().zip(rows) {
        *o = vnni::dot_q4_0(&data[i * row_bytes..(i + 1) * row_bytes], a);
    }
}

/// The prefetches of the dense range kernels at `q` (a row's block being read): two lines
/// [`DENSE_AHEAD`] bytes on into L1 and, when `far`, two lines [`DENSE_FAR`] bytes on into L2.
/// Prefetches never fault: past the end they touch the next row or nothing.
#[inline(always)]
fn dense_prefetch(q: *const u8, far: bool) {
    // SAFETY: a prefetch never faults and changes no state the program can observe; SSE is part
    // of the x86-64 baseline.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(DENSE_AHEAD) as *const i8);
        _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(DENSE_AHEAD + 64) as *const i8);
        if far {
            _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(DENSE_FAR) as *const i8);
            _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(DENSE_FAR + 64) as *const i8);
        }
    }
}

/// The dense Q8_0 GEMV over rows `r`, one row at a time with [`dot_q8_0_rows`] (the bits of
/// the list kernel and of the dense VNNI kernel) and the prefetches of [`dense_q4_0_quad`]:
/// lines [`DENSE_AHEAD`] bytes on into L1 and, for rows of at least [`DENSE_FAR_ROW_BYTES`],
/// [`DENSE_FAR`] bytes on into L2, two lines every second block: faster than the list kernel
/// (eight rows per pass behind the far stream).
pub(super) fn dot_range_q8_0(
    data: &[u8],
    row_bytes: usize,
    r: std::ops::Range<usize>,
    a: &Act<'_>,
    y: &mut [f32],
) {
    let nb = range_blocks(data, row_bytes, &r, y, 34);
    assert!(a.q.len() >= nb * 32 && a.d.len() >= nb);
    // SAFETY: installed only for Backend::Avx512 (features detected); rows `r` checked above,
    // the activation holds `nb` blocks.
    unsafe { dense_q8_0_rows(data, nb, r.start, a, y) }
}

/// [`dot_range_q8_0`]'s loop.
///
/// # Safety
/// `data` holds rows `first..first + y.len()` of `34·nb` bytes; `a` has values and scales for
/// `nb` blocks; AVX2/FMA/F16C and AVX-512 F/VL/BW/VNNI available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn dense_q8_0_rows(data: &[u8], nb: usize, first: usize, a: &Act<'_>, y: &mut [f32]) {
    let rb = nb * 34;
    let far = rb >= DENSE_FAR_ROW_BYTES;
    for (k, yk) in y.iter_mut().enumerate() {
        // SAFETY: row first + k lies in `data` (caller).
        let p = unsafe { data.as_ptr().add((first + k) * rb) };
        let ahead = |b: usize| {
            if b % 2 == 0 {
                dense_prefetch(p.wrapping_add(b * 34), far);
            }
        };
        // SAFETY: a whole row of `nb` blocks; the activation holds `nb` blocks (caller).
        *yk = unsafe { dot_q8_0_rows::<1>([p], nb, a, ahead) }[0];
    }
}

pub(super) fn dot_list_q8_0(rows: &ListedRows<'_>, a: &Act<'_>, res: &mut [f32]) {
    let nb = list_blocks(rows, 34, res);
    assert!(a.q.len() >= nb * 32 && a.d.len() >= nb);
    // SAFETY: installed only for Backend::Avx512 (features detected); rows checked above, the
    // activation holds `nb` blocks.
    unsafe { dot_list::<DQ8_0, DOT_ROWS>(rows, a, res) }
}

/// Every listed float row (`L`'s elements) · `a.f` into `res` (list order), with the
/// arithmetic of the dense one-token float dot ([`dot_float_rows512`]: the same bits for any
/// row count per pass) and the prefetch stream instead of its in-row prefetches.
pub(super) fn dot_list_float<L: FloatLoad16>(rows: &ListedRows<'_>, a: &Act<'_>, res: &mut [f32]) {
    let n = list_blocks(rows, L::SIZE, res);
    assert!(a.f.len() == n);
    // SAFETY: installed only for Backend::Avx512 (features detected); rows checked above, the
    // activation has a row's length.
    unsafe { dot_list::<DFloat<L>, FLOAT_ROWS>(rows, a, res) }
}

/// Float rows of `L`'s elements as [`DotRows`] (a "block" is one element): the dense 512-bit
/// float dot's arithmetic, feeding the stream a step of 64 elements at a time.
struct DFloat<L>(std::marker::PhantomData<L>);
impl<L: FloatLoad16> DotRows for DFloat<L> {
    const BYTES: usize = L::SIZE;
    #[inline(always)]
    unsafe fn rows<const R: usize>(
        p: [*const u8; R],
        nb: usize,
        a: &Act<'_>,
        st: &mut Stream<'_>,
    ) -> [f32; R] {
        // SAFETY: forwarded contract (`nb` elements at every `p[r]` and in the activation,
        // `a.f` and, where present, `a.h`).
        with_act!(a, |X, x, _n| unsafe {
            dot_float_rows512::<L, X, R>(p, x.as_ptr(), nb, |_| st.consume(R * 64 * L::SIZE))
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Reading alone.

/// The wrapping sum of the listed row slices' bytes as little-endian u64 words, read in list
/// order through the row-sparse products' prefetch stream: their memory access without their
/// arithmetic (`probe::read_rows`). Each slice's whole 64-byte lines are summed here, the
/// rest of it (fewer than 64 bytes) by `tail_sum`, so that the result can equal the portable
/// reading's.
pub(crate) fn read_list(rows: &ListedRows<'_>, tail_sum: impl Fn(&[u8]) -> u64) -> u64 {
    check_rows(rows, 1, rows.end - rows.start);
    // SAFETY: installed only for Backend::Avx512 (the caller checks); rows checked above.
    unsafe { read_list_avx512(rows, tail_sum) }
}

/// # Safety
/// Every listed slice lies inside `rows.data`; AVX-512 F available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn read_list_avx512(rows: &ListedRows<'_>, tail_sum: impl Fn(&[u8]) -> u64) -> u64 {
    let mut st = Stream::new(rows, LEAD_DOT);
    let len = rows.end - rows.start;
    let mut acc = _mm512_setzero_si512();
    let mut tail = 0u64;
    for &i in rows.list {
        // SAFETY: the slice `len` bytes from `p` lies inside `rows.data` (caller).
        unsafe {
            let p = rows
                .data
                .as_ptr()
                .add(i as usize * rows.row_bytes + rows.start);
            let mut o = 0;
            while o + 64 <= len {
                st.consume(64);
                acc = _mm512_add_epi64(acc, _mm512_loadu_si512(p.add(o) as *const __m512i));
                o += 64;
            }
            let rest = std::slice::from_raw_parts(p.add(o), len - o);
            tail = tail.wrapping_add(tail_sum(rest));
        }
    }
    (_mm512_reduce_add_epi64(acc) as u64).wrapping_add(tail)
}

// ---------------------------------------------------------------------------------------------
// Axpy.

/// How a 32-weight block turns into two 16-lane f32 vectors (elements 0..16 and 16..32), each
/// value exact.
trait Block32 {
    /// Bytes per block (the f16 scale first).
    const BYTES: usize;
    /// # Safety
    /// `BYTES − 2` readable bytes at `qs`; AVX-512 F available.
    unsafe fn decode(qs: *const u8, table: __m512) -> (__m512, __m512);
}
struct BQ4_0;
struct BQ8_0;
impl Block32 for BQ4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn decode(qs: *const u8, table: __m512) -> (__m512, __m512) {
        // SAFETY: 16 readable bytes (caller); AVX-512 F available (caller).
        unsafe {
            // Byte j in dword j: its low nibble is element j, its high one element 16 + j;
            // `vpermps` reads the low 4 bits of each index, and the table holds q − 8.
            let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(qs as *const __m128i));
            (
                _mm512_permutexvar_ps(idx, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(idx), table),
            )
        }
    }
}
impl Block32 for BQ8_0 {
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn decode(qs: *const u8, _table: __m512) -> (__m512, __m512) {
        // SAFETY: 32 readable bytes (caller); AVX-512 F available (caller).
        unsafe {
            let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs as *const __m128i));
            let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(qs.add(16) as *const __m128i));
            (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi))
        }
    }
}

/// The scales `a[k]·d` of block `b` of the `N ≤ 8` rows at `p` as eight f32 lanes (lanes ≥ N
/// zero): the f16 scales gathered in general registers, converted eight at a time.
///
/// # Safety
/// Block `b` exists in every row; AVX2/F16C available.
#[inline(always)]
unsafe fn scales8<B: Block32, const N: usize>(p: &[*const u8; N], b: usize, av: __m256) -> __m256 {
    let h = |k: usize| {
        if k < N {
            // SAFETY: block `b` exists in row k (caller).
            unsafe { std::ptr::read_unaligned(p[k].add(b * B::BYTES) as *const u16) as u64 }
        } else {
            0
        }
    };
    let lo = h(0) | h(1) << 16 | h(2) << 32 | h(3) << 48;
    let hi = h(4) | h(5) << 16 | h(6) << 32 | h(7) << 48;
    // SAFETY: F16C/AVX available (caller).
    unsafe { _mm256_mul_ps(av, _mm256_cvtph_ps(_mm_set_epi64x(hi as i64, lo as i64))) }
}

/// The `N ≤ 8` coefficients of an axpy pass in eight f32 lanes, lanes `N..8` zero.
///
/// # Safety
/// AVX2 available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lanes8<const N: usize>(a: [f32; N]) -> __m256 {
    let at = |k: usize| if k < N { a[k % N] } else { 0.0 };
    _mm256_setr_ps(at(0), at(1), at(2), at(3), at(4), at(5), at(6), at(7))
}

/// `*p` in all 16 lanes, as a broadcast load (`vbroadcastss zmm, m32`: no shuffle µop, unlike
/// the register broadcasts the compiler makes of a value it has just stored).
///
/// # Safety
/// 4 readable bytes at `p`; AVX-512 F available.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn bcast(p: *const f32) -> __m512 {
    let r: __m512;
    // SAFETY: reads 4 bytes at `p` (caller); writes only the output register.
    unsafe {
        std::arch::asm!(
            "vbroadcastss {r}, dword ptr [{p}]",
            r = out(zmm_reg) r,
            p = in(reg) p,
            options(pure, readonly, nostack, preserves_flags)
        );
    }
    r
}

/// `out += Σ_k a[k] · rows[k]` for `N ≤ 8` rows (block 0 at `p[k]`), row after row per
/// element in `k` order, two blocks (64 outputs in four 16-lane registers) per step. The
/// scales of a step are converted for all rows at once ([`scales8`]) and read back as
/// broadcasts.
///
/// For Q4_0 this is arithmetic-bound (FMAs and `vpermps` lookups); the other decodings tried
/// were no faster (`docs/tuning.md`).
///
/// # Safety
/// `nb` whole blocks at every `p[k]`; `out` has `32·nb` values; the CPU features available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn axpy_rows<B: Block32, const N: usize>(
    p: [*const u8; N],
    a: [f32; N],
    nb: usize,
    out: &mut [f32],
    st: &mut Stream<'_>,
) {
    const { assert!(N >= 1 && N <= 8) };
    debug_assert!(out.len() == 32 * nb);
    let o = out.as_mut_ptr();
    // SAFETY: AVX2 available (caller).
    let av = unsafe { lanes8(a) };
    let table = _mm512_setr_ps(
        -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
    );
    let mut sc = [0f32; 16];
    let mut b = 0;
    // SAFETY: blocks `b`, `b + 1` < nb exist in every row, outputs `32b..32b + 64` in `out`
    // (caller).
    unsafe {
        while b + 2 <= nb {
            st.consume(N * 2 * B::BYTES);
            _mm256_storeu_ps(sc.as_mut_ptr(), scales8::<B, N>(&p, b, av));
            _mm256_storeu_ps(sc.as_mut_ptr().add(8), scales8::<B, N>(&p, b + 1, av));
            let ob = o.add(b * 32);
            let mut y = [
                _mm512_loadu_ps(ob),
                _mm512_loadu_ps(ob.add(16)),
                _mm512_loadu_ps(ob.add(32)),
                _mm512_loadu_ps(ob.add(48)),
            ];
            for k in 0..N {
                let q = p[k].add(b * B::BYTES + 2);
                let s0 = bcast(sc.as_ptr().add(k));
                let s1 = bcast(sc.as_ptr().add(8 + k));
                let (l0, h0) = B::decode(q, table);
                let (l1, h1) = B::decode(q.add(B::BYTES), table);
                y[0] = _mm512_fmadd_ps(s0, l0, y[0]);
                y[1] = _mm512_fmadd_ps(s0, h0, y[1]);
                y[2] = _mm512_fmadd_ps(s1, l1, y[2]);
                y[3] = _mm512_fmadd_ps(s1, h1, y[3]);
            }
            for (j, &v) in y.iter().enumerate() {
                _mm512_storeu_ps(ob.add(16 * j), v);
            }
            b += 2;
        }
        if b < nb {
            st.consume(N * B::BYTES);
            _mm256_storeu_ps(sc.as_mut_ptr(), scales8::<B, N>(&p, b, av));
            let ob = o.add(b * 32);
            let mut y = [_mm512_loadu_ps(ob), _mm512_loadu_ps(ob.add(16))];
            for k in 0..N {
                let s0 = bcast(sc.as_ptr().add(k));
                let (l0, h0) = B::decode(p[k].add(b * B::BYTES + 2), table);
                y[0] = _mm512_fmadd_ps(s0, l0, y[0]);
                y[1] = _mm512_fmadd_ps(s0, h0, y[1]);
            }
            _mm512_storeu_ps(ob, y[0]);
            _mm512_storeu_ps(ob.add(16), y[1]);
        }
    }
}

/// `out += Σ_k a[k] · rows[k]` for `N ≤ 8` Q4_0 rows (block 0 at `p[k]`) with integer dot
/// instructions: per block, the coefficients `c_k = a[k]·d_k` (as [`scales8`] computes them)
/// are quantized to int8 against their largest magnitude (`s = max|c| / 127`,
/// `ci_k = round(c_k / s)`), the four rows of each half of the pass are transposed so that one
/// dword holds one element of four rows (`vpermb`), and `vpdpbusd` sums `ci_k · q_k` over the
/// rows in exact integers (the −8 of the nibbles folded into the start value `−8·Σ ci`);
/// then `out += s · sum`, one rounding per element and pass.
///
/// Error against the exact sum: per block and pass at most `s/2 · Σ_k |q_k − 8|` per element
/// (the coefficients' rounding; `s/2 = max|c| / 254`), plus the f32 roundings of `c_k`, of
/// `s · sum` and of the addition.
///
/// # Safety
/// `nb` whole blocks at every `p[k]`; `out` has `32·nb` values; AVX-512 F/VL/BW/VNNI/VBMI, AVX2,
/// FMA and F16C available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,avx512vbmi")]
unsafe fn axpy_rows_int8<const N: usize>(
    p: [*const u8; N],
    a: [f32; N],
    nb: usize,
    out: &mut [f32],
    st: &mut Stream<'_>,
) {
    const { assert!(N >= 1 && N <= 8) };
    debug_assert!(out.len() == 32 * nb);
    let o = out.as_mut_ptr();
    // SAFETY: AVX2 available (caller).
    let av = unsafe { lanes8(a) };
    // Rows past N: row 0 again (read, with coefficient 0).
    let q: [*const u8; 8] = std::array::from_fn(|k| p[if k < N { k } else { 0 }]);
    // Output byte 4j + k of a pass half takes byte j of row k's 16 (row k at bytes 16k..).
    let perm = _mm512_set_epi8(
        63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42, 26,
        10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20,
        4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0,
    );
    let mask = _mm512_set1_epi8(0x0F);
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // SAFETY: block `b` < nb exists in every row, outputs `32b..32b + 32` in `out` (caller).
    unsafe {
        for b in 0..nb {
            st.consume(N * 18);
            let c = scales8::<BQ4_0, N>(&p, b, av);
            // max |c| in every lane.
            let m = _mm256_and_ps(c, abs);
            let m = _mm256_max_ps(m, _mm256_permute2f128_ps::<1>(m, m));
            let m = _mm256_max_ps(m, _mm256_shuffle_ps::<0b0100_1110>(m, m));
            let m = _mm256_max_ps(m, _mm256_shuffle_ps::<0b1011_0001>(m, m));
            let amax = _mm256_cvtss_f32(m);
            if amax == 0.0 {
                // Every coefficient is 0 (or rounds to it): the pass adds nothing.
                continue;
            }
            let ci = _mm256_cvtps_epi32(_mm256_mul_ps(c, _mm256_set1_ps(127.0 / amax)));
            let ci8 = _mm256_cvtepi32_epi8(ci);
            let w0 = _mm512_set1_epi32(_mm_cvtsi128_si32(ci8));
            let w1 = _mm512_set1_epi32(_mm_extract_epi32::<1>(ci8));
            // −8·Σ ci, the nibbles' offset.
            let sum = _mm_dpbusd_epi32(_mm_setzero_si128(), _mm_set1_epi8(1), ci8);
            let sum = _mm_cvtsi128_si32(sum) + _mm_extract_epi32::<1>(sum);
            let init = _mm512_set1_epi32(-8 * sum);
            let half = |k: usize| {
                let ld = |r: usize| _mm_loadu_si128(q[r].add(b * 18 + 2) as *const __m128i);
                let v = _mm512_castsi128_si512(ld(k));
                let v = _mm512_inserti32x4::<1>(v, ld(k + 1));
                let v = _mm512_inserti32x4::<2>(v, ld(k + 2));
                let v = _mm512_inserti32x4::<3>(v, ld(k + 3));
                _mm512_permutexvar_epi8(perm, v)
            };
            let (g0, g1) = (half(0), half(4));
            let lo = _mm512_dpbusd_epi32(
                _mm512_dpbusd_epi32(init, _mm512_and_si512(g0, mask), w0),
                _mm512_and_si512(g1, mask),
                w1,
            );
            let hi = _mm512_dpbusd_epi32(
                _mm512_dpbusd_epi32(init, _mm512_and_si512(_mm512_srli_epi16::<4>(g0), mask), w0),
                _mm512_and_si512(_mm512_srli_epi16::<4>(g1), mask),
                w1,
            );
            let sv = _mm512_set1_ps(amax / 127.0);
            let ob = o.add(b * 32);
            _mm512_storeu_ps(
                ob,
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), sv, _mm512_loadu_ps(ob)),
            );
            let oh = ob.add(16);
            _mm512_storeu_ps(
                oh,
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), sv, _mm512_loadu_ps(oh)),
            );
        }
    }
}

/// Q4_0 rows with int8 coefficients ([`axpy_rows_int8`]).
struct Int8Q4_0;
impl AxpyRows for Int8Q4_0 {
    #[inline(always)]
    unsafe fn rows<const N: usize>(
        p: [*const u8; N],
        a: [f32; N],
        out: &mut [f32],
        st: &mut Stream<'_>,
    ) {
        // SAFETY: forwarded contract (the table installs this kernel only where VBMI and VNNI
        // were detected).
        unsafe { axpy_rows_int8::<N>(p, a, out.len() / 32, out, st) }
    }
}

/// The Q4_0 axpy with each pass's coefficients quantized to int8 per block
/// ([`axpy_rows_int8`]): an approximation of [`axpy_list_q4_0`], with its error bound.
pub(super) fn axpy_list_q4_0_int8(rows: &ListedRows<'_>, a: &[f32], out: &mut [f32]) {
    let nb = out.len() / 32;
    check_rows(rows, 18, nb);
    assert!(out.len() == nb * 32 && rows.list.iter().all(|&i| (i as usize) < a.len()));
    // SAFETY: installed only for Backend::Avx512 with VBMI (features detected); slices checked
    // above.
    unsafe { axpy_list::<Int8Q4_0, AXPY_ROWS>(rows, a, out) }
}

/// One of the axpy row kernels, with the row count as a parameter: `out += Σ_k a[k] · rows[k]`.
trait AxpyRows {
    /// # Safety
    /// `out.len()` values (whole blocks) readable at every `p[k]`; `N ≤ 8`; the kernel's CPU
    /// features available.
    unsafe fn rows<const N: usize>(
        p: [*const u8; N],
        a: [f32; N],
        out: &mut [f32],
        st: &mut Stream<'_>,
    );
}
/// Rows of 32-value blocks ([`axpy_rows`]).
struct Blocks<B>(std::marker::PhantomData<B>);
impl<B: Block32> AxpyRows for Blocks<B> {
    #[inline(always)]
    unsafe fn rows<const N: usize>(
        p: [*const u8; N],
        a: [f32; N],
        out: &mut [f32],
        st: &mut Stream<'_>,
    ) {
        // SAFETY: forwarded contract.
        unsafe { axpy_rows::<B, N>(p, a, out.len() / 32, out, st) }
    }
}
/// Float rows of `L`'s elements ([`axpy_float_rows`]).
struct Floats<L>(std::marker::PhantomData<L>);
impl<L: FloatLoad16> AxpyRows for Floats<L> {
    #[inline(always)]
    unsafe fn rows<const N: usize>(
        p: [*const u8; N],
        a: [f32; N],
        out: &mut [f32],
        st: &mut Stream<'_>,
    ) {
        // SAFETY: forwarded contract.
        unsafe { axpy_float_rows::<L, N>(p, a, out, st) }
    }
}

/// `out += Σ a[i] · row_i[start..end]` over the listed rows, `R` per pass, the rest in one
/// shorter pass.
///
/// # Safety
/// Every listed slice lies in `rows.data` and holds `out.len()` values of `A` (whole blocks);
/// `a` covers every listed index; the CPU features available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
unsafe fn axpy_list<A: AxpyRows, const R: usize>(
    rows: &ListedRows<'_>,
    a: &[f32],
    out: &mut [f32],
) {
    let mut st = Stream::new(rows, LEAD_AXPY + R * (rows.end - rows.start));
    let base = rows.data.as_ptr();
    let slice = |i: u32| {
        // SAFETY: listed slices lie inside `rows.data` (caller).
        unsafe { base.add(i as usize * rows.row_bytes + rows.start) }
    };
    let mut groups = rows.list.chunks_exact(R);
    for g in &mut groups {
        let p: [*const u8; R] = std::array::from_fn(|k| slice(g[k]));
        let av: [f32; R] = std::array::from_fn(|k| a[g[k] as usize]);
        // SAFETY: `out.len()` values at every `p[k]` (caller).
        unsafe { A::rows::<R>(p, av, out, &mut st) };
    }
    let rest = groups.remainder();
    macro_rules! tail {
        ($($n:literal)*) => {
            match rest.len() {
                $($n => {
                    let p: [*const u8; $n] = std::array::from_fn(|k| slice(rest[k]));
                    let av: [f32; $n] = std::array::from_fn(|k| a[rest[k] as usize]);
                    // SAFETY: as above.
                    unsafe { A::rows::<$n>(p, av, out, &mut st) };
                })*
                _ => for &i in rest {
                    // SAFETY: as above.
                    unsafe { A::rows::<1>([slice(i)], [a[i as usize]], out, &mut st) };
                }
            }
        };
    }
    tail!(1 2 3 4 5 6 7);
}

pub(super) fn axpy_list_q4_0(rows: &ListedRows<'_>, a: &[f32], out: &mut [f32]) {
    axpy_list_blocks::<BQ4_0>(rows, a, out)
}

pub(super) fn axpy_list_q8_0(rows: &ListedRows<'_>, a: &[f32], out: &mut [f32]) {
    axpy_list_blocks::<BQ8_0>(rows, a, out)
}

/// [`axpy_list`] over rows of 32-value blocks of `B`, after checking what it relies on.
fn axpy_list_blocks<B: Block32>(rows: &ListedRows<'_>, a: &[f32], out: &mut [f32]) {
    let nb = out.len() / 32;
    check_rows(rows, B::BYTES, nb);
    assert!(out.len() == nb * 32 && rows.list.iter().all(|&i| (i as usize) < a.len()));
    // SAFETY: installed only for Backend::Avx512 (features detected); slices checked above.
    unsafe { axpy_list::<Blocks<B>, AXPY_ROWS>(rows, a, out) }
}

/// `out += Σ a[i] · row_i[start..end]` over the listed float row slices (`L`'s elements),
/// [`AXPY_ROWS`] per pass behind the prefetch stream: each element takes `fma(a_i, w, y)` row
/// after row in list order, the roundings of the AVX2 and scalar one-row kernels.
pub(super) fn axpy_list_float<L: FloatLoad16>(rows: &ListedRows<'_>, a: &[f32], out: &mut [f32]) {
    check_rows(rows, L::SIZE, out.len());
    assert!(rows.list.iter().all(|&i| (i as usize) < a.len()));
    // SAFETY: installed only for Backend::Avx512 (features detected); slices checked above.
    unsafe { axpy_list::<Floats<L>, AXPY_ROWS>(rows, a, out) }
}

/// `out += Σ_k a[k] · rows[k]` for `N` float rows (element 0 at `p[k]`), row after row per
/// element in `k` order, 64 outputs in four registers per step, feeding `st` as it reads.
///
/// # Safety
/// `out.len()` elements of `L` readable at every `p[k]`; AVX2/FMA/F16C and AVX-512F/VL
/// available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
unsafe fn axpy_float_rows<L: FloatLoad16, const N: usize>(
    p: [*const u8; N],
    a: [f32; N],
    out: &mut [f32],
    st: &mut Stream<'_>,
) {
    let (n, o) = (out.len(), out.as_mut_ptr());
    let av = a.map(|v| _mm512_set1_ps(v));
    let mut i = 0;
    // SAFETY: element indices below `n`, in bounds of `out` and of every row (caller).
    unsafe {
        while i + 64 <= n {
            st.consume(N * 64 * L::SIZE);
            let mut y = [0, 16, 32, 48].map(|c| _mm512_loadu_ps(o.add(i + c)));
            for k in 0..N {
                for (c, yc) in y.iter_mut().enumerate() {
                    let w = L::load16(p[k].add((i + 16 * c) * L::SIZE));
                    *yc = _mm512_fmadd_ps(av[k], w, *yc);
                }
            }
            for (c, yc) in y.iter().enumerate() {
                _mm512_storeu_ps(o.add(i + 16 * c), *yc);
            }
            i += 64;
        }
        while i + 16 <= n {
            let mut y = _mm512_loadu_ps(o.add(i));
            for k in 0..N {
                y = _mm512_fmadd_ps(av[k], L::load16(p[k].add(i * L::SIZE)), y);
            }
            _mm512_storeu_ps(o.add(i), y);
            i += 16;
        }
        for j in i..n {
            let mut y = *o.add(j);
            for k in 0..N {
                y = a[k].mul_add(L::load1(p[k].add(j * L::SIZE)), y);
            }
            *o.add(j) = y;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Row selection.

/// Appends to `out` the rows `i` with `scores[i] >= threshold`, `skip[i]` false (when given)
/// and `nonzero[i] != 0` (when given), in increasing order: the same rows as the portable
/// `select_rows` of the frame, sixteen per step with mask compares (much faster than the
/// portable loop, which was a noticeable part of a sparse product at 10%).
///
/// # Safety
/// `skip` and `nonzero`, when given, are at least as long as `scores`; AVX-512 F/BW/VL
/// available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw")]
pub(crate) unsafe fn select_rows_avx512(
    scores: &[f32],
    threshold: f32,
    skip: Option<&[bool]>,
    nonzero: Option<&[f32]>,
    out: &mut Vec<u32>,
) {
    let n = scores.len();
    debug_assert!(skip.is_none_or(|k| k.len() >= n) && nonzero.is_none_or(|a| a.len() >= n));
    let thr = _mm512_set1_ps(threshold);
    let zero = _mm512_setzero_ps();
    let mut base = 0;
    while base + 16 <= n {
        // SAFETY: values `base..base + 16` exist in `scores`, `skip` and `nonzero` (caller).
        let mut m = unsafe {
            // Ordered compares: a NaN score never selects, a NaN activation counts as nonzero.
            let mut m =
                _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_loadu_ps(scores.as_ptr().add(base)), thr);
            if let Some(k) = skip {
                let kb = _mm_loadu_si128(k.as_ptr().add(base) as *const __m128i);
                m &= !_mm_test_epi8_mask(kb, kb);
            }
            if let Some(a) = nonzero {
                let v = _mm512_loadu_ps(a.as_ptr().add(base));
                m &= !_mm512_cmp_ps_mask::<_CMP_EQ_OQ>(v, zero);
            }
            m as u32
        };
        while m != 0 {
            out.push((base + m.trailing_zeros() as usize) as u32);
            m &= m - 1;
        }
        base += 16;
    }
    for i in base..n {
        if scores[i] >= threshold
            && !skip.is_some_and(|k| k[i])
            && !nonzero.is_some_and(|a| a[i] == 0.0)
        {
            out.push(i as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::act::{ActBuf, ActFormat};
    use powerinfer_gguf::GgmlType;

    /// A xorshift generator for test data.
    fn xorshift(mut seed: u64) -> impl FnMut() -> u64 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        }
    }

    /// `n_rows` rows of `nb` random blocks of `block_bytes` (an f16 scale in [−1, 1], then
    /// random bytes), and an activation of `32·nb` values in [−1, 1].
    fn random_rows(
        next: &mut impl FnMut() -> u64,
        n_rows: usize,
        nb: usize,
        block_bytes: usize,
    ) -> (Vec<u8>, Vec<f32>) {
        let mut data = vec![0u8; n_rows * nb * block_bytes];
        for blk in data.chunks_exact_mut(block_bytes) {
            let d = half::f16::from_f32((next() % 2001) as f32 / 1000.0 - 1.0);
            blk[..2].copy_from_slice(&d.to_le_bytes());
            blk[2..].iter_mut().for_each(|q| *q = next() as u8);
        }
        let x = (0..nb * 32)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        (data, x)
    }

    /// The one-row VBMI kernel gives every row the bits of the eight-row pair kernel (and of
    /// the dense VNNI kernel), for rows of quads only, quads and a last pair, and a pair alone.
    #[test]
    fn dense_quad_rows_equal_the_pair_kernel_bit_for_bit() {
        if !(crate::Backend::Avx512.is_available() && is_x86_feature_detected!("avx512vbmi")) {
            eprintln!("skipped: this CPU lacks AVX-512 VBMI");
            return;
        }
        let mut next = xorshift(0x2545_F491_4F6C_DD1D);
        for nb in [2usize, 4, 6, 8, 10, 36, 128, 130, 344] {
            let rb = nb * 18;
            let (data, x) = random_rows(&mut next, 21, nb, 18);
            let buf = ActBuf::new(ActFormat::Q8_0Pairs, &x, nb * 32);
            let a = buf.get(0);
            // Rows 3..20: eight-row passes and a remainder on the pair kernel's side.
            let list: Vec<u32> = (3..20).collect();
            let rows = ListedRows::whole(&data, rb, &list);
            let (mut pair, mut quad, mut via_range) =
                (vec![0f32; 17], vec![0f32; 17], vec![0f32; 17]);
            // SAFETY: AVX-512 and VBMI detected; rows 3..20 are whole rows of `data`, `nb` even,
            // the activation prepared for `nb` blocks.
            unsafe {
                dot_list::<DQ4_0, DOT_ROWS>(&rows, &a, &mut pair);
                dense_q4_0_quad(&data, nb, 3, &a, &mut quad);
            }
            // The range entry point, as the dense GEMV calls it.
            dot_range_q4_0(&data, rb, 3..20, &a, &mut via_range);
            for k in 0..17 {
                let i = 3 + k;
                let one = vnni::dot_q4_0(&data[i * rb..(i + 1) * rb], &a);
                assert_eq!(quad[k].to_bits(), pair[k].to_bits(), "nb {nb}, row {i}");
                assert_eq!(quad[k].to_bits(), one.to_bits(), "nb {nb}, row {i}");
                assert_eq!(via_range[k].to_bits(), one.to_bits(), "nb {nb}, row {i}");
            }
            assert!(
                quad.iter().any(|v| v.abs() > 1e-3),
                "nb {nb}: rows carry weight"
            );
        }
    }

    /// The one-row dense Q8_0 kernel gives every row the bits of the eight-row list kernel and
    /// of the dense VNNI kernel, for even and odd block counts.
    #[test]
    fn dense_q8_0_rows_equal_the_list_kernel_bit_for_bit() {
        if !crate::Backend::Avx512.is_available() {
            eprintln!("skipped: this CPU lacks AVX-512");
            return;
        }
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        for nb in [1usize, 2, 3, 7, 36, 128, 129, 344] {
            let rb = nb * 34;
            let (data, x) = random_rows(&mut next, 21, nb, 34);
            let buf = ActBuf::new(ActFormat::Q8_0, &x, nb * 32);
            let a = buf.get(0);
            let list: Vec<u32> = (3..20).collect();
            let rows = ListedRows::whole(&data, rb, &list);
            let (mut listed, mut dense) = (vec![0f32; 17], vec![0f32; 17]);
            // SAFETY: AVX-512 detected; rows 3..20 are whole rows of `data`, the activation
            // prepared for `nb` blocks.
            unsafe { dot_list::<DQ8_0, DOT_ROWS>(&rows, &a, &mut listed) };
            dot_range_q8_0(&data, rb, 3..20, &a, &mut dense);
            for k in 0..17 {
                let i = 3 + k;
                let one = vnni::dot_q8_0(&data[i * rb..(i + 1) * rb], &a);
                assert_eq!(dense[k].to_bits(), listed[k].to_bits(), "nb {nb}, row {i}");
                assert_eq!(dense[k].to_bits(), one.to_bits(), "nb {nb}, row {i}");
            }
            assert!(
                dense.iter().any(|v| v.abs() > 1e-3),
                "nb {nb}: rows carry weight"
            );
        }
    }

    /// Rows of no columns: the list kernels read nothing and give zeros, never a panic.
    #[test]
    fn rows_without_columns() {
        if !crate::Backend::Avx512.is_available() {
            return;
        }
        let pool = crate::ThreadPool::new(2);
        let mm = crate::MatMul::with_backend(&pool, crate::Backend::Avx512).unwrap();
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q8_0,
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
        ] {
            let w = crate::Weights::new(ty, 3, 0, &[]).unwrap();
            let mut y = vec![5f32; 3];
            mm.sparse_gemv_indexed(&w, &[], &[0, 2], &mut y).unwrap();
            assert_eq!(y, [0.0; 3], "{ty:?}");
            mm.sparse_axpy_indexed(&w, &[1.0; 3], &[0, 2], &mut [])
                .unwrap();
        }
    }

    /// The prefetch stream opens the listed rows in order and then runs on into `then`, with
    /// as many lines requested as the lead asks for, and stops at the end of both.
    #[test]
    fn stream_runs_on_into_then() {
        let data = vec![0u8; 16 * 128];
        let list = [3u32, 7];
        let then = [8u32, 9, 10];
        let rows = ListedRows::whole(&data, 128, &list).then(&then);
        // 4 rows of 128 bytes (2 lines each) ahead: rows 3, 7, 8 and 9 opened.
        let st = Stream::new(&rows, 4 * 128);
        assert_eq!((st.list, st.k), (&then[..], 2));
        assert_eq!(st.end, data.as_ptr() as usize + 10 * 128);
        // Enough lead for everything: every row opened, then the stream is spent.
        let mut st = Stream::new(&rows, 64 * 128);
        assert_eq!((st.list.len(), st.k, st.credit), (3, 3, 0));
        st.consume(1 << 20);
        assert_eq!((st.k, st.credit), (3, 0));
        // Without `then` the stream ends with the list.
        let st = Stream::new(&ListedRows::whole(&data, 128, &list), 64 * 128);
        assert_eq!((st.list, st.k), (&list[..], 2));
    }

    /// The vector selection picks exactly the rows of the plain definition, NaNs included, for
    /// lengths around the 16-row step.
    #[test]
    fn select_rows_matches_definition() {
        if !crate::Backend::Avx512.is_available() {
            return;
        }
        let mut next = xorshift(0x9E37_79B9_7F4A_7C15);
        for n in [0usize, 1, 15, 16, 17, 31, 64, 100, 11008] {
            let pick = |r: u64| match r % 7 {
                0 => f32::NAN,
                1 => 0.0,
                2 => -0.0,
                3 => 0.5,
                _ => (r % 1000) as f32 / 500.0 - 1.0,
            };
            let scores: Vec<f32> = (0..n).map(|_| pick(next())).collect();
            let acts: Vec<f32> = (0..n).map(|_| pick(next())).collect();
            let skip: Vec<bool> = (0..n).map(|_| next() % 3 == 0).collect();
            for (sk, nz) in [(false, false), (true, false), (false, true), (true, true)] {
                let skip = sk.then_some(&skip[..]);
                let nonzero = nz.then_some(&acts[..]);
                let want: Vec<u32> = (0..n)
                    .filter(|&i| {
                        scores[i] >= 0.0
                            && !skip.is_some_and(|k| k[i])
                            && !nonzero.is_some_and(|a| a[i] == 0.0)
                    })
                    .map(|i| i as u32)
                    .collect();
                let mut got = Vec::new();
                // SAFETY: AVX-512 was detected; `skip` and `nonzero` have `n` values.
                unsafe { select_rows_avx512(&scores, 0.0, skip, nonzero, &mut got) };
                assert_eq!(got, want, "n={n} skip={sk} nonzero={nz}");
            }
        }
    }
}
