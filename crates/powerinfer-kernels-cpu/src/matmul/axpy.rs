//! The sparse axpy of [`MatMul`] (`y += Σ a_i · row_i` over a transposed matrix's selected
//! rows), for one token or several.

use super::act;
use super::frame::{check_len, mul, prefetch, prefetch_ahead, OutPtr, PREFETCH_WHOLE_AXPY};
use super::handle::MatMul;
use super::rowops::{self, ListedRows};
use super::scratch::ScratchVec;
use super::select::{check_active, select_rows, RowSelect};
use super::sparse::sparse_list_fits;
use super::weights::Weights;
use crate::error::KernelError;
use crate::pool::split_range;

/// One-token sparse axpy over rows of at least this many bytes splits the active rows between
/// threads (with a list kernel; [`MatMul::axpy_rows_split`]), shorter rows split the columns
/// (no gain there). Float rows always split the columns, whose result does not depend on the
/// thread count and which read them no slower (measurements: `docs/tuning.md`).
const ROW_SPLIT_AXPY_BYTES: usize = 2048;

impl MatMul<'_> {
    /// Sparse axpy for one token over the transposed matrix `w_t` (`rows` = neurons, `cols` =
    /// output length): `y += Σ a[i] · row_i` over rows `i` selected by `select` (`scores` has
    /// `rows` values) with `a[i] != 0`. `a` has `rows` values, `y` has `cols`; `y` is added to,
    /// not overwritten. For F16 rows every `a[i]` is first rounded to f16 (a value that rounds
    /// to 0 is skipped), in all three axpy forms (see the [module docs](super)). With
    /// [`AxpyCoefficients::Int8`](crate::AxpyCoefficients::Int8) (also for
    /// [`sparse_axpy_indexed`](Self::sparse_axpy_indexed)) Q4_0 rows may take int8
    /// coefficients, within that mode's stated error.
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
    /// whole rows (2304 bytes for a 4096-wide Q4_0 row) instead of a part of every row, which
    /// reads faster (`docs/tuning.md`).
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
