//! The attention split (Q-Infer): for one sequence decoding a token at a time, each layer's
//! KV positions `[0, s)` are attended on the device, over its mirror of those rows, and
//! `[s, n)` on the CPU at the same time; the two parts (maximum, sum of exponentials, weighted
//! values) merge exactly ([`merge_parts`](powerinfer_kernels_cpu::ops::attention::merge_parts)).
//!
//! The host cache stays complete; the device mirrors a prefix of one sequence's rows, copied
//! in as `s` grows past what it holds, and dropped when that sequence's existing rows change
//! (a context shift, truncation, rollback or another sequence: [`KvCache::stamp`]). Each
//! layer's share `s / n` moves from the two sides' measured times: outside the dead band, toward
//! the share that evens them (from each side's cost per position), by at most
//! [`BalanceOptions::attention_step`](super::BalanceOptions::attention_step) per move.

use std::time::Duration;

use crate::kv_cache::{KvCache, SeqId};

use crate::device::AttentionDevice;
use crate::error::{EngineError, Result};

/// Fewest positions attended before a layer splits them (below, the device's launch and
/// copies cost more than the positions).
pub(crate) const MIN_SPLIT_POSITIONS: usize = 32;

/// Evaluations averaged before a layer's share moves.
const SETTLE: u32 = 2;

/// What the attention split did in one layer ([`BalanceReport::attention`](super::BalanceReport)).
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct AttentionBalance {
    /// Layer index.
    pub layer: usize,
    /// Share of the positions attended on the device now.
    pub share: f64,
    /// Evaluations split between the two sides.
    pub evals: u64,
    /// The CPU's time on its positions, over those evaluations.
    pub cpu: Duration,
    /// The device's time on its positions (copies of the query and the part included).
    pub device: Duration,
    /// Positions attended on the device, over those evaluations.
    pub device_positions: u64,
    /// Positions attended on the CPU.
    pub cpu_positions: u64,
    /// Times the share moved.
    pub moves: u64,
    /// KV rows copied into the device's mirror.
    pub copied_rows: u64,
    /// Time of those copies.
    pub copy_time: Duration,
}

/// One layer's share and measurements.
#[derive(Debug)]
struct LayerState {
    share: f64,
    /// Mirrored rows valid for the mirrored sequence.
    mirrored: usize,
    sum_cpu: f64,
    sum_dev: f64,
    sum_pos_cpu: f64,
    sum_pos_dev: f64,
    samples: u32,
    report: AttentionBalance,
}

/// The attention split's state for all layers (inside [`super::balance::Balance`]).
#[derive(Debug)]
pub(crate) struct AttentionSplit {
    /// Positions the device's mirror holds.
    capacity: usize,
    /// The sequence mirrored and the stamp of its rows.
    mirror: Option<(SeqId, u64)>,
    layers: Vec<LayerState>,
}

impl AttentionSplit {
    /// A split for `n_layer` layers whose mirror holds `capacity` positions, each layer
    /// starting with half of the positions on the device.
    pub(crate) fn new(n_layer: usize, capacity: usize) -> AttentionSplit {
        AttentionSplit {
            capacity,
            mirror: None,
            layers: (0..n_layer)
                .map(|l| LayerState {
                    share: 0.5,
                    mirrored: 0,
                    sum_cpu: 0.0,
                    sum_dev: 0.0,
                    sum_pos_cpu: 0.0,
                    sum_pos_dev: 0.0,
                    samples: 0,
                    report: AttentionBalance {
                        layer: l,
                        share: 0.5,
                        ..Default::default()
                    },
                })
                .collect(),
        }
    }

    /// Positions of layer `layer` to attend on the device when `n` are attended (0: none).
    pub(crate) fn device_positions(&self, layer: usize, n: usize) -> usize {
        match self.layers.get(layer) {
            Some(s) if n >= MIN_SPLIT_POSITIONS => ((s.share * n as f64) as usize)
                .min(n - 1)
                .min(self.capacity),
            _ => 0,
        }
    }

    /// Makes the device's mirror of `layer` hold the first `s` rows of sequence `seq` of
    /// `cache` (rows copied in as needed; everything again after the sequence's rows changed).
    pub(crate) fn sync(
        &mut self,
        device: &dyn AttentionDevice,
        cache: &KvCache,
        seq: SeqId,
        layer: usize,
        s: usize,
    ) -> Result<()> {
        let stamp = cache.stamp(seq)?;
        if self.mirror != Some((seq, stamp)) {
            self.mirror = Some((seq, stamp));
            for l in &mut self.layers {
                l.mirrored = 0;
            }
        }
        let Some(state) = self.layers.get_mut(layer) else {
            return Ok(());
        };
        if state.mirrored >= s {
            return Ok(());
        }
        let Some((k, v)) = cache.layer_f16(seq, layer)? else {
            return Err(EngineError::Invalid(
                "the attention split mirrors F16 KV caches only".into(),
            ));
        };
        let row = cache.row_len();
        let (a, b) = (state.mirrored * row, s * row);
        let took = device.write_mirror(layer, state.mirrored, &k[a..b], &v[a..b])?;
        state.report.copied_rows += (s - state.mirrored) as u64;
        state.report.copy_time += took;
        state.mirrored = s;
        Ok(())
    }

    /// Records an evaluation of `layer` that attended `s` of `n` positions on the device, and
    /// moves the layer's share, by at most `max_step`, when the two times differ by more than
    /// `dead_band` of their sum.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn measured(
        &mut self,
        layer: usize,
        n: usize,
        s: usize,
        cpu: Duration,
        device: Duration,
        dead_band: f64,
        max_step: f64,
    ) {
        let Some(st) = self.layers.get_mut(layer) else {
            return;
        };
        let r = &mut st.report;
        r.evals += 1;
        r.cpu += cpu;
        r.device += device;
        r.device_positions += s as u64;
        r.cpu_positions += (n - s) as u64;
        st.sum_cpu += cpu.as_secs_f64();
        st.sum_dev += device.as_secs_f64();
        st.sum_pos_cpu += (n - s) as f64;
        st.sum_pos_dev += s as f64;
        st.samples += 1;
        if st.samples < SETTLE {
            return;
        }
        let (c, d) = (st.sum_cpu, st.sum_dev);
        if c + d <= 0.0 || ((d - c) / (c + d)).abs() <= dead_band {
            return;
        }
        // Each side's time per position; the share that makes them equal.
        let per_cpu = c / st.sum_pos_cpu.max(1.0);
        let per_dev = d / st.sum_pos_dev.max(1.0);
        let even = per_cpu / (per_cpu + per_dev);
        let step = (even - st.share).clamp(-max_step, max_step);
        st.share = (st.share + step).clamp(0.0, 1.0);
        st.report.share = st.share;
        st.report.moves += 1;
        st.sum_cpu = 0.0;
        st.sum_dev = 0.0;
        st.sum_pos_cpu = 0.0;
        st.sum_pos_dev = 0.0;
        st.samples = 0;
    }

    /// Per layer, what the split did.
    pub(crate) fn report(&self) -> Vec<AttentionBalance> {
        self.layers.iter().map(|l| l.report.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_moves_toward_even_times_by_bounded_steps() {
        let mut a = AttentionSplit::new(1, 4096);
        assert_eq!(a.device_positions(0, MIN_SPLIT_POSITIONS - 1), 0);
        assert_eq!(a.device_positions(0, 100), 50);
        // The device is 3× slower per position than the CPU: the even share is 0.25.
        for _ in 0..200 {
            let n = 100;
            let s = a.device_positions(0, n);
            let cpu = Duration::from_nanos(100 * (n - s) as u64);
            let dev = Duration::from_nanos(300 * s as u64);
            a.measured(0, n, s, cpu, dev, 0.05, 0.05);
        }
        let r = &a.report()[0];
        assert!((r.share - 0.25).abs() < 0.05, "{r:?}");
        assert!(r.moves >= 5, "{r:?}: at most 0.05 per move from 0.5");
        assert_eq!(r.evals, 200);
    }
}
