//! Predictor quality: how well predicted active sets (`score ≥ θ`) match the true ones.
//!
//! A neuron is **truly active** for a token when its FFN hidden value after the activation
//! function is not 0 (for ReLU: `> 0`; the sparse kernels skip exact zeros, so a neuron with a
//! zero activation costs nothing to leave out). [`PredictorQuality`] accumulates, per layer, a
//! [`Confusion`] count over every (token, neuron) pair and reports recall (share of truly
//! active neurons that were predicted), precision (share of predicted neurons that were truly
//! active), predicted density and true density.

use crate::predictor::{PredictorError, Result};

/// Counts over (token, neuron) pairs of one layer (or a sum over layers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Confusion {
    /// Predicted active and truly active.
    pub true_pos: u64,
    /// Predicted active, truly inactive (wasted work).
    pub false_pos: u64,
    /// Truly active but not predicted (lost activations: accuracy cost).
    pub false_neg: u64,
    /// Tokens counted (in a sum over layers: token-layer pairs).
    pub tokens: u64,
    /// (token, neuron) pairs counted.
    pub cells: u64,
}

impl Confusion {
    /// `tp / (tp + fn)`; 1 when nothing was truly active.
    pub fn recall(&self) -> f64 {
        ratio(self.true_pos, self.true_pos + self.false_neg)
    }

    /// `tp / (tp + fp)`; 1 when nothing was predicted.
    pub fn precision(&self) -> f64 {
        ratio(self.true_pos, self.true_pos + self.false_pos)
    }

    /// Share of (token, neuron) pairs predicted active (what the sparse kernels compute).
    pub fn predicted_density(&self) -> f64 {
        density(self.true_pos + self.false_pos, self.cells)
    }

    /// Share of (token, neuron) pairs truly active.
    pub fn true_density(&self) -> f64 {
        density(self.true_pos + self.false_neg, self.cells)
    }

    /// Adds another count into this one.
    pub fn merge(&mut self, o: &Confusion) {
        self.true_pos += o.true_pos;
        self.false_pos += o.false_pos;
        self.false_neg += o.false_neg;
        self.tokens += o.tokens;
        self.cells += o.cells;
    }

    /// Counts one token: `act` = true activations, `scores` = predictor scores (same length).
    pub fn add_token(&mut self, act: &[f32], scores: &[f32], theta: f32) {
        debug_assert_eq!(act.len(), scores.len());
        let (mut tp, mut pred, mut truth) = (0u64, 0u64, 0u64);
        for (&a, &p) in act.iter().zip(scores) {
            let t = (a != 0.0) as u64;
            let q = (p >= theta) as u64;
            tp += t & q;
            pred += q;
            truth += t;
        }
        self.add_counts(tp, pred, truth, act.len() as u64);
    }

    /// Counts one token given as masks (`truth[i]` truly active, `predicted[i]` predicted).
    pub fn add_masks(&mut self, truth: &[bool], predicted: &[bool]) {
        debug_assert_eq!(truth.len(), predicted.len());
        let (mut tp, mut pred, mut tr) = (0u64, 0u64, 0u64);
        for (&t, &p) in truth.iter().zip(predicted) {
            tp += (t & p) as u64;
            pred += p as u64;
            tr += t as u64;
        }
        self.add_counts(tp, pred, tr, truth.len() as u64);
    }

    fn add_counts(&mut self, tp: u64, pred: u64, truth: u64, n: u64) {
        self.true_pos += tp;
        self.false_pos += pred - tp;
        self.false_neg += truth - tp;
        self.tokens += 1;
        self.cells += n;
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        1.0
    } else {
        a as f64 / b as f64
    }
}

fn density(a: u64, cells: u64) -> f64 {
    if cells == 0 {
        0.0
    } else {
        a as f64 / cells as f64
    }
}

/// Per-layer predictor quality accumulator. See the [module docs](self).
#[derive(Clone, Debug, PartialEq)]
pub struct PredictorQuality {
    n_ff: usize,
    layers: Vec<Confusion>,
}

impl PredictorQuality {
    /// An empty accumulator for `n_layer` layers of `n_ff` neurons.
    pub fn new(n_layer: usize, n_ff: usize) -> PredictorQuality {
        PredictorQuality {
            n_ff,
            layers: vec![Confusion::default(); n_layer],
        }
    }

    /// Counts `t` tokens of layer `layer`: `act` = true activations `[t][n_ff]`, `scores` =
    /// predictor scores `[t][n_ff]`, predicted active when `score ≥ theta`.
    pub fn add(
        &mut self,
        layer: usize,
        t: usize,
        act: &[f32],
        scores: &[f32],
        theta: f32,
    ) -> Result<()> {
        let c = self.check(layer, t, act.len(), scores.len())?;
        for (a, p) in act
            .chunks_exact(self.n_ff)
            .zip(scores.chunks_exact(self.n_ff))
        {
            self.layers[c].add_token(a, p, theta);
        }
        Ok(())
    }

    /// Counts `t` tokens of layer `layer` given as masks `[t][n_ff]`.
    pub fn add_masks(
        &mut self,
        layer: usize,
        t: usize,
        truth: &[bool],
        predicted: &[bool],
    ) -> Result<()> {
        let c = self.check(layer, t, truth.len(), predicted.len())?;
        for (a, p) in truth
            .chunks_exact(self.n_ff)
            .zip(predicted.chunks_exact(self.n_ff))
        {
            self.layers[c].add_masks(a, p);
        }
        Ok(())
    }

    fn check(&self, layer: usize, t: usize, a: usize, b: usize) -> Result<usize> {
        if layer >= self.layers.len() {
            return Err(PredictorError::Shape(format!(
                "layer {layer} of a {}-layer accumulator",
                self.layers.len()
            )));
        }
        let want = t.checked_mul(self.n_ff);
        if want != Some(a) || want != Some(b) {
            return Err(PredictorError::Shape(format!(
                "{t} tokens × {} neurons, got {a} activations and {b} predictions",
                self.n_ff
            )));
        }
        Ok(layer)
    }

    /// Neurons per layer.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// The per-layer counts.
    pub fn layers(&self) -> &[Confusion] {
        &self.layers
    }

    /// The sum over layers (`tokens` counts token-layer pairs).
    pub fn total(&self) -> Confusion {
        let mut t = Confusion::default();
        self.layers.iter().for_each(|l| t.merge(l));
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_ratios() {
        let mut q = PredictorQuality::new(2, 4);
        // Token 0: truth {0, 1}, predicted {1, 2} (θ = 0.5, inclusive).
        // Token 1: truth {3}, predicted {3}.
        let act = [1.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0];
        let scores = [0.0, 0.5, 0.9, -1.0, 0.0, 0.0, 0.0, 3.0];
        q.add(0, 2, &act, &scores, 0.5).unwrap();
        let l = q.layers()[0];
        assert_eq!((l.true_pos, l.false_pos, l.false_neg), (2, 1, 1));
        assert_eq!((l.tokens, l.cells), (2, 8));
        assert!((l.recall() - 2.0 / 3.0).abs() < 1e-12);
        assert!((l.precision() - 2.0 / 3.0).abs() < 1e-12);
        assert!((l.predicted_density() - 3.0 / 8.0).abs() < 1e-12);
        assert!((l.true_density() - 3.0 / 8.0).abs() < 1e-12);
        let truth = [true, false, false, false];
        let pred = [true, true, false, false];
        q.add_masks(1, 1, &truth, &pred).unwrap();
        let t = q.total();
        assert_eq!(
            (t.true_pos, t.false_pos, t.false_neg, t.tokens),
            (3, 2, 1, 3)
        );
        // Empty layer: recall and precision 1, densities 0.
        let e = PredictorQuality::new(1, 4).layers()[0];
        assert_eq!(
            (e.recall(), e.precision(), e.true_density()),
            (1.0, 1.0, 0.0)
        );
        assert!(q.add(2, 1, &act[..4], &scores[..4], 0.0).is_err());
        assert!(q.add(0, 2, &act[..4], &scores[..4], 0.0).is_err());
    }
}
