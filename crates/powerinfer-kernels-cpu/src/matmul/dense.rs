//! The dense products of [`MatMul`]: the one-token GEMV (alone, several in one dispatch, or
//! over a repacked Q4_0 copy) and the multi-token GEMM, with the GEMM frame the sparse GEMM
//! shares.

use super::act::{self, Act, ActBuf};
use super::frame::{check_len, mul, OutPtr};
use super::handle::MatMul;
use super::rowops::{ListedRows, RowOps};
use super::select::RowSelect;
use super::table;
use super::weights::{PackedQ4_0, Weights};
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
use super::{weights::PageBuf, x86};
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
use crate::backend::Backend;
use crate::error::KernelError;
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
use crate::pool::split_range;
use powerinfer_gguf::GgmlType;
use std::ops::Range;

/// Quantized rows up to this many bytes are computed four per pass by the dense GEMV (see
/// [`MatMul::gemv`]): for short rows the per-row reduction dominates, longer ones read faster
/// one at a time (measurements: `docs/tuning.md`).
const SHORT_ROW_BYTES: usize = 384;

/// Quantized rows of at least this many bytes go through the sparse list kernel over every row
/// in the one-token product, where the backend has one (AVX-512 Q4_0/Q8_0), eight rows per pass
/// behind its software prefetch stream: the one-row loop left long rows waiting on memory
/// (Q4_0 from 2048 columns, Q8_0 from 1024). Not float rows (AVX-512: F32, F16, BF16), although
/// they have list kernels: one row at a time with in-row prefetches reads them faster
/// (measurements: `docs/tuning.md`).
const LIST_GEMV_ROW_BYTES: usize = 1024;

/// Weight bytes per grain of the one-token dense product ([`MatMul::gemv`], rounded to a
/// multiple of 8 rows, at least 8): a thread walks its part of the rows in grains and takes
/// the others' untouched grains from the back once done, so a thread the host delays no longer
/// holds up the others; grains this large seldom restart the list kernel's prefetch stream (see
/// `LIST_GEMV_ROW_BYTES`; measurements: `docs/tuning.md`).
pub const GEMV_GRAIN_BYTES: usize = 128 << 10;

/// Float rows whose activation, as the kernels read it, takes up to this many bytes go through
/// the dense GEMV one per pass, longer ones four per pass (so that the activation stays in L1
/// beside the weight stream, or else each of its loads serves four rows): f32 activations of
/// up to 4096 elements, and, since F16 weights read theirs as f16 bits (`ActFormat::F16`), F16
/// rows of up to 8192 elements go one per pass (measurements: `docs/tuning.md`).
const FLOAT_ONE_ROW_MAX_ACT_BYTES: usize = 16 << 10;

/// Activation bytes per GEMM token block (see `gemm_core`).
const GEMM_BLOCK_BYTES: usize = 8 << 20;

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

/// One product of [`MatMul::gemm_multi`]: `y_t = w x_t` for every token.
#[derive(Debug)]
pub struct GemmJob<'a> {
    /// The matrix.
    pub w: Weights<'a>,
    /// The activations, `[n_tokens][w.cols()]`.
    pub x: &'a [f32],
    /// The outputs, `[n_tokens][w.rows()]`.
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
    // (≤ SHORT_ROW_BYTES: the per-row reduction dominates there). Other rows go one at a
    // time: one sequential stream per thread, the activation in L1. The sparse GEMV, whose
    // scattered rows are software-prefetched and partly compute-bound, always uses four rows
    // per pass.
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
/// without a list kernel, whose slow loops the hardware prefetchers had left waiting on memory.
/// Not the K-quants: their 256-bit kernels are bound by their arithmetic, and on AVX-512 their
/// long rows take a range kernel with its own prefetch stream (`x86::kquant`; measurements:
/// `docs/tuning.md`).
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

impl MatMul<'_> {
    /// `y = W x` for one token: `x` has `cols` values, `y` has `rows`.
    ///
    /// Work split ([`ThreadPool::for_grains`](crate::ThreadPool::for_grains)): each thread walks its own contiguous part of
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
    /// one-token Q4_0 product is compute-bound on cores that read memory fast; measurements:
    /// `docs/tuning.md`). `None` where this backend has no packed kernel (it needs
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

    /// [`gemm`](Self::gemm) of every job over `n_tokens` tokens, in one dispatch of the pool
    /// where the kernels allow it (float weights on AVX-512): the row blocks of all jobs are
    /// shared out together, so small products (a layer's K and V) do not leave threads idle,
    /// and jobs with the same input (a layer's Q, K and V; an FFN's gate and up) prepare it
    /// once. Otherwise one `gemm` after another. Each output equals `gemm` on that job alone,
    /// bit for bit. All jobs are checked before any is computed.
    pub fn gemm_multi(&self, jobs: &mut [GemmJob<'_>], n_tokens: usize) -> Result<(), KernelError> {
        for j in jobs.iter() {
            check_len("x", mul(j.w.cols, n_tokens)?, j.x.len())?;
            check_len("y", mul(j.w.rows, n_tokens)?, j.y.len())?;
            self.ops(&j.w)?;
        }
        if n_tokens == 1 {
            let mut one: Vec<GemvJob<'_>> = jobs
                .iter_mut()
                .map(|j| GemvJob {
                    w: j.w,
                    x: j.x,
                    y: &mut *j.y,
                })
                .collect();
            return self.gemv_multi(&mut one);
        }
        #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
        if x86::gemm::dense_gemm_multi(self.pool, self.backend, jobs, n_tokens) {
            return Ok(());
        }
        for j in jobs.iter_mut() {
            self.gemm(&j.w, j.x, n_tokens, j.y)?;
        }
        Ok(())
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
        // Quantized weights, fewer tokens than the frame's micro-kernel takes at once (2 rows ×
        // 4 tokens): the frame would run its one-row remainder loop on every row, slower than
        // one streaming GEMV per token (`docs/tuning.md`). Their integer sums make both the same
        // bits; float weights keep the frame, whose summation order multi-token products share.
        if n_tokens < 4 && w.ty.is_quantized() {
            for (xt, yt) in x.chunks_exact(w.cols).zip(y.chunks_exact_mut(w.rows)) {
                self.gemv(w, xt, yt)?;
            }
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

    /// The GEMM frame: each thread takes a contiguous part of the row list; tokens go in blocks
    /// whose activations stay in the last-level cache ([`GEMM_BLOCK_BYTES`]); dense products
    /// run two rows × four tokens per micro-kernel call, sparse ones four tokens per pass over
    /// a row.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_core(
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
        // thread's weight rows from DRAM again, which L2-sized blocks made the main cost of a
        // long float GEMM (`docs/tuning.md`). The activations of a block are re-read from L3
        // per row pair instead, which the 2 × 4 micro-kernel keeps cheap.
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
}

#[derive(Clone, Copy)]
pub(super) enum RowList {
    All(usize),
    Listed,
}
