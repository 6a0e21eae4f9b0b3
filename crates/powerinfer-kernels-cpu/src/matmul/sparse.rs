//! The row-sparse products of [`MatMul`]: one token over the rows a predicate selects or an
//! explicit list names, and several tokens over per-token selections.

use super::act::ActBuf;
use super::dense::RowList;
use super::frame::{check_len, mul, prefetch, prefetch_ahead, OutPtr, PREFETCH_WHOLE_DOT};
use super::handle::MatMul;
use super::rowops::{ListedRows, RowOps};
use super::select::{check_active, select_rows, RowSelect};
use super::weights::Weights;
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
use super::x86;
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
use crate::backend::Backend;
use crate::error::KernelError;

/// Float rows up to this many bytes go through the backend's sparse list kernels (AVX-512:
/// four rows per pass behind the prefetch stream), longer ones through the four-row kernels
/// with in-row prefetches, which read long rows faster (measurements: `docs/tuning.md`).
const FLOAT_LIST_MAX_ROW_BYTES: usize = 4096;

/// Whether the sparse products of `w` take the backend's list kernels (where it has them).
pub(super) fn sparse_list_fits(ops: &RowOps, w: &Weights<'_>) -> bool {
    !ops.act.is_float() || w.row_bytes <= FLOAT_LIST_MAX_ROW_BYTES
}

impl MatMul<'_> {
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
        self.gemv_listed(self.ops(w)?, w, x, &active, y);
        Ok(())
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
        self.gemv_listed(self.ops(w)?, w, x, active, y);
        Ok(())
    }

    /// The row-sparse GEMV of [`sparse_gemv_indexed`](Self::sparse_gemv_indexed) with its
    /// checks made and `w`'s row kernels `ops` found.
    fn gemv_listed(&self, ops: RowOps, w: &Weights<'_>, x: &[f32], active: &[u32], y: &mut [f32]) {
        y.fill(0.0);
        if active.is_empty() {
            return;
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
            return;
        }
        // With four rows per pass, rows `k + 1..k + 4` are computed together with row `k`: the
        // look-ahead counts from the end of the current group, plus one more group
        // (`docs/tuning.md`).
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
    }

    /// Row-sparse product for `n_tokens` tokens over one list of rows shared by every token
    /// (a batch's union of active rows, read once for all of them): `y[t][i] = row_i · x_t` for
    /// `i` in `rows`, 0 elsewhere. `rows` must be strictly increasing and below `w.rows`. Each
    /// result has the bits of the dense [`gemm`](Self::gemm) there; for quantized weights
    /// those are the one-token products' ([`sparse_gemv_indexed`](Self::sparse_gemv_indexed)
    /// of that token), so a token's results do not depend on the others in the batch.
    pub fn sparse_gemm_indexed(
        &self,
        w: &Weights<'_>,
        x: &[f32],
        n_tokens: usize,
        rows: &[u32],
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        check_len("x", mul(w.cols, n_tokens)?, x.len())?;
        check_len("y", mul(w.rows, n_tokens)?, y.len())?;
        check_active(rows, w.rows)?;
        let ops = self.ops(w)?;
        if n_tokens == 1 {
            self.gemv_listed(ops, w, x, rows, y);
            return Ok(());
        }
        y.fill(0.0);
        if rows.is_empty() {
            return Ok(());
        }
        // Q4_0 and Q8_0 on AVX-512: the few-token kernel over the listed rows (its tiles take
        // four tokens at a time; it is made for decode batches, the blocked GEMMs that serve
        // prompts take no row list).
        #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
        if self.few_kernel(w) {
            x86::few::gemm(self.pool, w, x, n_tokens, Some(rows), y);
            return Ok(());
        }
        // Quantized weights below the frame's four-token micro-kernel: one listed GEMV per token
        // (the frame would run its one-row remainder loop; the same integer sums either way).
        if n_tokens < 4 && w.ty.is_quantized() {
            for (xt, yt) in x.chunks_exact(w.cols).zip(y.chunks_exact_mut(w.rows)) {
                self.gemv_listed(ops, w, xt, rows, yt);
            }
            return Ok(());
        }
        let acts = ActBuf::new(ops.act, x, w.cols);
        self.gemm_core(w, ops, &acts, n_tokens, RowList::Listed, rows, None, y);
        Ok(())
    }

    /// Whether the few-token kernel (`x86::few`, Q4_0 and Q8_0) serves `w` on this backend.
    #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
    fn few_kernel(&self, w: &Weights<'_>) -> bool {
        self.backend == Backend::Avx512
            && self.backend.is_available()
            && x86::few::fits(w.ty, w.cols)
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
}
