//! Activation profiling: per layer, per neuron, how many tokens activated it (hidden value after
//! the activation function `!= 0`), turned into [`ActivationStats`] for the placement solver
//! (PowerInfer's `activation/activation_N.pt` and our safetensors form).
//!
//! Counting is one compare and one add per neuron per token into a `u32` counter (the loop
//! vectorizes); for a TinyLlama shape (22 layers × 5632 neurons) that is ~124 k counter updates
//! per token (`cargo bench -p powerinfer-predictor --bench predictor` measures it).

use crate::predictor::{PredictorError, Result};
use crate::stats::ActivationStats;

/// What the values of the produced statistics are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatsKind {
    /// Activation count / tokens profiled (`kind = "frequency"`).
    Frequency,
    /// Raw activation counts (`kind = "count"`).
    Count,
}

/// Per-layer per-neuron activation counts. See the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub struct ActivationProfile {
    n_ff: usize,
    counts: Vec<Vec<u32>>,
    tokens: Vec<u64>,
}

impl ActivationProfile {
    /// An empty profile of `n_layer` layers of `n_ff` neurons.
    pub fn new(n_layer: usize, n_ff: usize) -> ActivationProfile {
        ActivationProfile {
            n_ff,
            counts: vec![vec![0; n_ff]; n_layer],
            tokens: vec![0; n_layer],
        }
    }

    /// Counts `t` tokens of `layer`: `act` is `[t][n_ff]`, the FFN hidden values after the
    /// activation function.
    pub fn add(&mut self, layer: usize, t: usize, act: &[f32]) -> Result<()> {
        if layer >= self.counts.len() || Some(act.len()) != t.checked_mul(self.n_ff) {
            return Err(PredictorError::Shape(format!(
                "layer {layer} of {}, {t} tokens × {} neurons, got {} values",
                self.counts.len(),
                self.n_ff,
                act.len()
            )));
        }
        let counts = &mut self.counts[layer];
        for row in act.chunks_exact(self.n_ff) {
            count_row(counts, row);
        }
        self.tokens[layer] += t as u64;
        Ok(())
    }

    /// Adds another profile's counts (same shape) into this one.
    pub fn merge(&mut self, other: &ActivationProfile) -> Result<()> {
        if other.n_ff != self.n_ff || other.counts.len() != self.counts.len() {
            return Err(PredictorError::Shape(
                "profiles of different shapes".to_string(),
            ));
        }
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            a.iter_mut().zip(b).for_each(|(x, y)| *x += y);
        }
        self.tokens
            .iter_mut()
            .zip(&other.tokens)
            .for_each(|(x, y)| *x += y);
        Ok(())
    }

    /// Number of layers.
    pub fn n_layer(&self) -> usize {
        self.counts.len()
    }

    /// Neurons per layer.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Layer `l`'s counts.
    pub fn counts(&self, layer: usize) -> &[u32] {
        &self.counts[layer]
    }

    /// Tokens counted in layer `l`.
    pub fn tokens(&self, layer: usize) -> u64 {
        self.tokens[layer]
    }

    /// Layer `l`'s true density: activations / (tokens × n_ff); 0 before any token.
    pub fn density(&self, layer: usize) -> f64 {
        let n = self.tokens[layer] as f64 * self.n_ff as f64;
        if n == 0.0 {
            return 0.0;
        }
        self.counts[layer].iter().map(|&c| c as f64).sum::<f64>() / n
    }

    /// Mean density over layers.
    pub fn mean_density(&self) -> f64 {
        if self.counts.is_empty() {
            return 0.0;
        }
        (0..self.n_layer()).map(|l| self.density(l)).sum::<f64>() / self.n_layer() as f64
    }

    /// The statistics: counts (as f32) or frequencies (count / tokens of the layer).
    pub fn to_stats(&self, kind: StatsKind) -> ActivationStats {
        let layers = self
            .counts
            .iter()
            .zip(&self.tokens)
            .map(|(c, &n)| match kind {
                StatsKind::Count => c.iter().map(|&x| x as f32).collect(),
                StatsKind::Frequency => {
                    let d = (n as f64).max(1.0);
                    c.iter().map(|&x| (x as f64 / d) as f32).collect()
                }
            })
            .collect();
        let name = match kind {
            StatsKind::Count => "count",
            StatsKind::Frequency => "frequency",
        };
        ActivationStats::new(layers, name)
    }
}

/// `counts[i] += (row[i] != 0)`, written so LLVM vectorizes it.
#[inline]
pub fn count_row(counts: &mut [u32], row: &[f32]) {
    for (c, &a) in counts.iter_mut().zip(row) {
        *c += (a != 0.0) as u32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_to_stats() {
        let mut p = ActivationProfile::new(2, 3);
        p.add(0, 2, &[1.0, 0.0, 0.5, 0.0, 0.0, 2.0]).unwrap();
        p.add(1, 1, &[0.0, 0.0, 0.0]).unwrap();
        assert_eq!(p.counts(0), [1, 0, 2]);
        assert_eq!(p.tokens(0), 2);
        assert!((p.density(0) - 0.5).abs() < 1e-12);
        assert_eq!(p.density(1), 0.0);
        let f = p.to_stats(StatsKind::Frequency);
        assert_eq!(f.layers[0], [0.5, 0.0, 1.0]);
        assert_eq!(f.kind, "frequency");
        assert_eq!(p.to_stats(StatsKind::Count).layers[0], [1.0, 0.0, 2.0]);
        let q = p.clone();
        p.merge(&q).unwrap();
        assert_eq!(p.counts(0), [2, 0, 4]);
        assert!(p.add(2, 1, &[0.0; 3]).is_err());
        assert!(p.add(0, 2, &[0.0; 3]).is_err());
        assert!(p.merge(&ActivationProfile::new(1, 3)).is_err());
    }
}
