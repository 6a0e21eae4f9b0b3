//! The one-token sparse FFN's thread split ([`FusedSplit`]) and the helper that runs several
//! row-parallel products in one thread-pool dispatch ([`run_threads`]): each thread runs the
//! ordinary kernels on a one-thread pool over its own range of rows, so every output row is
//! computed by the same kernel code as the separate multi-threaded calls (bit-identical);
//! only the number of dispatches changes.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use powerinfer_kernels_cpu::pool::split_range;
use powerinfer_kernels_cpu::{KernelError, MatMul, ThreadPool};

use crate::error::Result;

/// Most threads whose split [`FusedSplit`] learns (more: equal parts).
const SPLIT_MAX_THREADS: usize = 64;

/// Where the one-token sparse FFN's fused dispatch (`ffn::sparse_hidden_fused`) cuts one
/// layer's neurons among the threads. Each thread computes the predictor scores (`fc2`) of its
/// neurons and then gate/up for those of them that are active, so equal ranges are equal
/// work only where active neurons are spread evenly over the layer. In a file whose neurons
/// are ordered by how often they fire (`powerinfer reorder`) the active ones crowd into the
/// first rows, and equal ranges leave one thread with most of the gathering (measurements:
/// `docs/tuning.md`, "Learned split of the sparse FFN"). So the cuts are learned: after each
/// token they are moved to where the work of that token (every neuron's `fc2` row, plus the
/// gate and up rows of the active ones) would have been shared equally, and the next token
/// uses them. Results do not depend on the cuts (every neuron is computed by the same kernel
/// operations whichever thread does it), only the speed does. Shared by every session of an
/// engine through atomics; a stale or torn set of cuts is still a valid split.
#[derive(Debug)]
pub(crate) struct FusedSplit {
    /// Thread count the cuts are for (0: none learned yet).
    n: AtomicUsize,
    /// `cuts[t]`: the first neuron of thread `t + 1`.
    cuts: Box<[AtomicUsize]>,
}

impl Default for FusedSplit {
    fn default() -> Self {
        FusedSplit {
            n: AtomicUsize::new(0),
            cuts: (1..SPLIT_MAX_THREADS)
                .map(|_| AtomicUsize::new(0))
                .collect(),
        }
    }
}

impl FusedSplit {
    /// The neuron ranges of `n` threads over `nff` neurons: the learned cuts when there are
    /// some for `n` threads, else equal parts.
    pub(crate) fn ranges(&self, nff: usize, n: usize) -> Vec<Range<usize>> {
        let equal = || (0..n).map(|t| split_range(nff, n, t)).collect();
        if !(2..=SPLIT_MAX_THREADS).contains(&n) || self.n.load(Ordering::Relaxed) != n {
            return equal();
        }
        let mut out = Vec::with_capacity(n);
        let mut start = 0;
        for t in 0..n {
            let end = if t + 1 == n {
                nff
            } else {
                self.cuts[t].load(Ordering::Relaxed)
            };
            if end < start || end > nff {
                return equal();
            }
            out.push(start..end);
            start = end;
        }
        out
    }

    /// Learns the cuts from one token's dispatch: thread `t` did `ranges[t]` in `times[t]`
    /// ns. Taking each thread's time as spread evenly over its neurons, each cut moves half-way
    /// (and at most `nff / 16`) towards where the threads would have taken equal times.
    pub(crate) fn learn(&self, nff: usize, ranges: &[Range<usize>], times: &[u64]) {
        let n = ranges.len();
        if !(2..=SPLIT_MAX_THREADS).contains(&n) || nff == 0 || times.len() != n {
            return;
        }
        let total: u64 = times.iter().sum();
        if total == 0 {
            return;
        }
        let step = (nff / 16).max(1);
        let (mut k, mut before) = (0usize, 0u64);
        let mut last = 0usize;
        for t in 1..n {
            // Where the cumulative time reaches t/n of the total.
            let target = total as f64 * t as f64 / n as f64;
            while k + 1 < n && (before + times[k]) as f64 <= target {
                before += times[k];
                k += 1;
            }
            let r = &ranges[k];
            let frac = if times[k] > 0 {
                ((target - before as f64) / times[k] as f64).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let ideal = r.start + (frac * r.len() as f64) as usize;
            let old = ranges[t - 1].end;
            let moved = if ideal >= old {
                old + ((ideal - old) / 2).min(step)
            } else {
                old - ((old - ideal) / 2).min(step)
            };
            let cut = moved.clamp(last, nff);
            self.cuts[t - 1].store(cut, Ordering::Relaxed);
            last = cut;
        }
        self.n.store(n, Ordering::Relaxed);
    }
}

/// Runs `f(tid, &single_thread_matmul)` on every thread of `mm`'s pool in one dispatch and
/// returns the first error any call returned.
pub(crate) fn run_threads<F>(mm: &MatMul<'_>, f: F) -> Result<()>
where
    F: Fn(usize, &MatMul<'_>) -> std::result::Result<(), KernelError> + Sync,
{
    let backend = mm.backend();
    let err: Mutex<Option<KernelError>> = Mutex::new(None);
    mm.pool().run(|tid| {
        let single = ThreadPool::single();
        let r = MatMul::with_backend(&single, backend).and_then(|m| f(tid, &m));
        if let Err(e) = r {
            let mut g = err.lock().unwrap_or_else(|e| e.into_inner());
            g.get_or_insert(e);
        }
    });
    match err.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cuts move half-way (at most `nff / 16`) towards equal times, stay increasing and inside
    /// the layer, and are used only for the thread count they were learned for.
    #[test]
    fn fused_split_moves_towards_equal_times() {
        let split = FusedSplit::default();
        assert_eq!(split.ranges(100, 2), vec![0..50, 50..100]);
        // Thread 0 took 3× as long: equal times at neuron 33 (200 of its 300 ns).
        split.learn(100, &[0..50, 50..100], &[300, 100]);
        assert_eq!(
            split.ranges(100, 2),
            vec![0..44, 44..100],
            "half-way, at most 6"
        );
        assert_eq!(
            split.ranges(100, 3),
            vec![0..34, 34..67, 67..100],
            "other count"
        );
        let r = split.ranges(1000, 2);
        split.learn(1000, &r, &[100, 100]);
        assert_eq!(split.ranges(1000, 2), r, "balanced: no move");
        // Three threads, the last one slow: the cuts move right, in order.
        let r3 = vec![0..300, 300..600, 600..900];
        split.learn(900, &r3, &[100, 100, 400]);
        let got = split.ranges(900, 3);
        assert!(got[0].end > 300 && got[1].end > 600, "{got:?}");
        assert!(got[0].end <= got[1].end && got[1].end <= 900, "{got:?}");
        // Zero times and one thread learn nothing.
        split.learn(900, &got, &[0, 0, 0]);
        assert_eq!(split.ranges(900, 3), got);
        split.learn(900, std::slice::from_ref(&(0..900)), &[5]);
        assert_eq!(split.ranges(900, 1), vec![0..900]);
    }
}
