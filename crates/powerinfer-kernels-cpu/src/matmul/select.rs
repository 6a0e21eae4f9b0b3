//! Which rows a sparse product computes: the public [`RowSelect`] predicate, and the checked or
//! built lists of active rows the frames walk.

use super::frame::{check_len, mul};
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
use crate::backend::Backend;
use crate::error::KernelError;

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
    pub(super) fn selected(&self, rows: usize, t: usize, i: usize) -> bool {
        self.scores[t * rows + i] >= self.threshold && !self.skip.is_some_and(|s| s[i])
    }

    pub(super) fn check(&self, rows: usize, n_tokens: usize) -> Result<(), KernelError> {
        check_len("scores", mul(rows, n_tokens)?, self.scores.len())?;
        if let Some(s) = self.skip {
            check_len("skip mask", rows, s.len())?;
        }
        Ok(())
    }
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
/// at ~10% random density a branch per row mispredicts often, a noticeable cost in a sparse
/// GEMV (`docs/tuning.md`). With AVX-512, sixteen rows per step with mask compares
/// (`x86::sparse::select_rows_avx512`, the same rows).
pub(super) fn select_rows(
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
        unsafe {
            super::x86::sparse::select_rows_avx512(scores, threshold, skip, nonzero, &mut out)
        };
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
