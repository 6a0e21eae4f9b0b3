//! Training of per-layer predictors from (FFN input, true active set) pairs.
//!
//! Model: PowerInfer's `p = fc2 · ReLU(fc1 · h)` (no biases, logits out), fitted with binary
//! cross-entropy on the logits (`y = 1` when the neuron's activation is not 0), Adam, shuffled
//! minibatches. Every matrix product runs on the CPU kernels ([`MatMul::gemm`] over F32
//! weights, transposing operands where needed), so results are bit-identical for every thread
//! count; with the same [`TrainConfig::seed`] a run is reproducible.
//!
//! Details:
//!
//! - **Input scaling.** Each input channel is divided by its RMS over the training tokens while
//!   training (real residual streams have channels hundreds of times larger than others);
//!   the scale is folded back into `fc1`'s columns at the end, so the written predictor takes
//!   the raw `h`.
//! - **Hold-out.** The last [`TrainConfig::holdout`] share of the tokens (in the order given,
//!   i.e. the end of the profiled text) is never trained on; quality is reported on it.
//! - **Threshold calibration.** The file format has one threshold θ per model
//!   (`powerinfer.sparse_threshold`) and no bias, so a per-layer threshold is folded into the
//!   weights: per layer, `θ_l` is the largest value whose recall on the *training* tokens
//!   reaches [`TrainConfig::target_recall`], capped at `-ε` (ε = 1e-3 × the RMS of the scores:
//!   lowering a threshold only raises recall), and `fc2` is scaled by `θ / θ_l > 0`, so that
//!   `score ≥ θ_l` becomes `score' ≥ θ` with the common [`TrainConfig::threshold`] (default
//!   −1). [`write_predictor_dir`] writes `config.json` with `sparse_threshold = θ`, which
//!   `powerinfer convert` stores in the model file.

use std::path::Path;

use powerinfer_kernels_cpu::MatMul;

use crate::predictor::{F32Predictor, FileDtype, Predictor, PredictorError, Result};
use crate::quality::Confusion;

/// Training options.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    /// Hidden width `r` of the predictor.
    pub rank: usize,
    /// Passes over the training tokens.
    pub epochs: usize,
    /// Tokens per minibatch.
    pub batch_size: usize,
    /// Adam step size relative to the initial weight scale (`1/√n_embd` for `fc1`, `√(2/r)`
    /// for `fc2`), decayed linearly to a tenth over the run.
    pub learning_rate: f32,
    /// Weight of a truly active neuron's loss term (1 = plain BCE).
    pub pos_weight: f32,
    /// Recall the per-layer threshold is calibrated to reach on the training tokens.
    pub target_recall: f64,
    /// Share of the tokens held out (the last ones).
    pub holdout: f64,
    /// The common threshold θ the calibrated per-layer thresholds are folded onto (< 0).
    pub threshold: f32,
    /// Seed of the initialisation and the minibatch order.
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            rank: 128,
            epochs: 20,
            batch_size: 128,
            learning_rate: 0.2,
            pos_weight: 1.0,
            target_recall: 0.99,
            holdout: 0.1,
            threshold: -1.0,
            seed: 0,
        }
    }
}

/// Training tokens of one layer: the predictor input `h` (`n_embd` floats) and the true active
/// set (activation `!= 0`, one bit per neuron) of each token.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSamples {
    n_embd: usize,
    n_ff: usize,
    words: usize,
    h: Vec<f32>,
    bits: Vec<u64>,
}

impl LayerSamples {
    /// No tokens yet.
    pub fn new(n_embd: usize, n_ff: usize) -> LayerSamples {
        LayerSamples {
            n_embd,
            n_ff,
            words: n_ff.div_ceil(64),
            h: Vec::new(),
            bits: Vec::new(),
        }
    }

    /// Appends `t` tokens: `h` is `[t][n_embd]`, `act` is `[t][n_ff]` (hidden values after the
    /// activation function; active = `!= 0`).
    pub fn push(&mut self, t: usize, h: &[f32], act: &[f32]) -> Result<()> {
        self.check(t, h.len(), act.len())?;
        self.h.extend_from_slice(h);
        for row in act.chunks_exact(self.n_ff) {
            self.push_bits(row.iter().map(|&a| a != 0.0));
        }
        Ok(())
    }

    /// Appends `t` tokens with the truth given as a mask `[t][n_ff]`.
    pub fn push_mask(&mut self, t: usize, h: &[f32], mask: &[bool]) -> Result<()> {
        self.check(t, h.len(), mask.len())?;
        self.h.extend_from_slice(h);
        for row in mask.chunks_exact(self.n_ff) {
            self.push_bits(row.iter().copied());
        }
        Ok(())
    }

    fn check(&self, t: usize, h: usize, a: usize) -> Result<()> {
        if Some(h) != t.checked_mul(self.n_embd) || Some(a) != t.checked_mul(self.n_ff) {
            return Err(PredictorError::Shape(format!(
                "{t} tokens of {} inputs and {} neurons, got {h} inputs and {a} activations",
                self.n_embd, self.n_ff
            )));
        }
        Ok(())
    }

    fn push_bits(&mut self, it: impl Iterator<Item = bool>) {
        let start = self.bits.len();
        self.bits.resize(start + self.words, 0);
        for (i, b) in it.enumerate() {
            self.bits[start + i / 64] |= (b as u64) << (i % 64);
        }
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.bits.len() / self.words.max(1)
    }

    /// True when there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Share of (token, neuron) pairs that are active (0 without tokens).
    pub fn density(&self) -> f64 {
        let active: u64 = self.bits.iter().map(|w| u64::from(w.count_ones())).sum();
        let all = self.len() * self.n_ff;
        if all == 0 {
            0.0
        } else {
            active as f64 / all as f64
        }
    }

    /// Input width.
    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// Neurons.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Token `k`'s input.
    pub fn h(&self, k: usize) -> &[f32] {
        &self.h[k * self.n_embd..(k + 1) * self.n_embd]
    }

    /// The inputs of tokens `range`, `range.len() × n_embd` values (e.g. the held-out part of
    /// [`split`](Self::split)).
    pub fn h_range(&self, range: std::ops::Range<usize>) -> &[f32] {
        &self.h[range.start * self.n_embd..range.end * self.n_embd]
    }

    /// Whether neuron `i` is truly active for token `k`.
    pub fn is_active(&self, k: usize, i: usize) -> bool {
        self.bits[k * self.words + i / 64] >> (i % 64) & 1 == 1
    }

    /// Token `k`'s truth as 0/1 floats into `out` (`n_ff` values).
    fn truth_into(&self, k: usize, out: &mut [f32]) {
        let w = &self.bits[k * self.words..(k + 1) * self.words];
        for (i, o) in out.iter_mut().enumerate() {
            *o = (w[i / 64] >> (i % 64) & 1) as f32;
        }
    }

    /// Tokens `0..n_train` train, the rest is held out (`holdout` share, at least one token
    /// trains when there is one).
    pub fn split(&self, holdout: f64) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let n = self.len();
        let hold = ((n as f64 * holdout.clamp(0.0, 1.0)).round() as usize).min(n.saturating_sub(1));
        (0..n - hold, n - hold..n)
    }
}

/// One trained layer.
#[derive(Clone, Debug)]
pub struct TrainedLayer {
    /// The predictor, thresholds folded in: use it with [`TrainConfig::threshold`].
    pub predictor: F32Predictor,
    /// The common threshold θ (= [`TrainConfig::threshold`]).
    pub threshold: f32,
    /// The calibrated per-layer threshold before folding (on the unscaled scores).
    pub layer_threshold: f32,
    /// Quality on the training tokens at θ.
    pub train: Confusion,
    /// Quality on the held-out tokens at θ.
    pub holdout: Confusion,
    /// Mean loss per (token, neuron) over the first and the last epoch.
    pub loss: (f64, f64),
}

/// A small deterministic generator (splitmix64).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn transpose(src: &[f32], rows: usize, cols: usize, dst: &mut Vec<f32>) {
    dst.clear();
    dst.resize(rows * cols, 0.0);
    const B: usize = 32;
    for r0 in (0..rows).step_by(B) {
        for c0 in (0..cols).step_by(B) {
            for r in r0..(r0 + B).min(rows) {
                for c in c0..(c0 + B).min(cols) {
                    dst[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
}

struct Adam {
    m: Vec<f32>,
    v: Vec<f32>,
}

impl Adam {
    fn new(n: usize) -> Adam {
        Adam {
            m: vec![0.0; n],
            v: vec![0.0; n],
        }
    }

    fn step(&mut self, w: &mut [f32], g: &[f32], lr: f32, t: i32) {
        const B1: f32 = 0.9;
        const B2: f32 = 0.999;
        let c1 = 1.0 - B1.powi(t);
        let c2 = 1.0 - B2.powi(t);
        let a = lr * c2.sqrt() / c1;
        for (((w, &g), m), v) in w.iter_mut().zip(g).zip(&mut self.m).zip(&mut self.v) {
            *m = B1 * *m + (1.0 - B1) * g;
            *v = B2 * *v + (1.0 - B2) * g * g;
            *w -= a * *m / (v.sqrt() + 1e-8);
        }
    }
}

/// Scores of tokens `range` in chunks; calls `f(token, scores)`.
fn for_scores(
    p: &Predictor<'_>,
    mm: &MatMul<'_>,
    s: &LayerSamples,
    range: std::ops::Range<usize>,
    mut f: impl FnMut(usize, &[f32]),
) -> Result<()> {
    const CHUNK: usize = 64;
    let (ne, nf) = (s.n_embd, s.n_ff);
    let mut out = Vec::new();
    let mut hidden = Vec::new();
    let mut k = range.start;
    while k < range.end {
        let t = CHUNK.min(range.end - k);
        out.clear();
        out.resize(t * nf, 0.0);
        p.scores_with(mm, &s.h[k * ne..(k + t) * ne], t, &mut hidden, &mut out)?;
        for j in 0..t {
            f(k + j, &out[j * nf..(j + 1) * nf]);
        }
        k += t;
    }
    Ok(())
}

/// Quality of `p` at `theta` on tokens `range` of `s`.
pub fn evaluate(
    p: &Predictor<'_>,
    mm: &MatMul<'_>,
    s: &LayerSamples,
    range: std::ops::Range<usize>,
    theta: f32,
) -> Result<Confusion> {
    if p.n_embd() != s.n_embd || p.n_ff() != s.n_ff {
        return Err(PredictorError::Shape(format!(
            "predictor {}→{} on samples {}→{}",
            p.n_embd(),
            p.n_ff(),
            s.n_embd,
            s.n_ff
        )));
    }
    let mut c = Confusion::default();
    let mut truth = vec![0f32; s.n_ff];
    for_scores(p, mm, s, range, |k, sc| {
        s.truth_into(k, &mut truth);
        c.add_token(&truth, sc, theta);
    })?;
    Ok(c)
}

/// The largest θ with `#{positives with score ≥ θ} ≥ ceil(target · #positives)`; `None`
/// without positives.
pub fn calibrate_threshold(mut positive_scores: Vec<f32>, target_recall: f64) -> Option<f32> {
    positive_scores.retain(|x| !x.is_nan());
    let n = positive_scores.len();
    if n == 0 {
        return None;
    }
    let need = ((target_recall.clamp(0.0, 1.0) * n as f64).ceil() as usize).clamp(1, n);
    // The need-th largest = the (n - need)-th smallest.
    let (_, v, _) = positive_scores.select_nth_unstable_by(n - need, |a, b| a.total_cmp(b));
    Some(*v)
}

/// Trains one layer's predictor. See the [module docs](self).
pub fn train_layer(s: &LayerSamples, cfg: &TrainConfig, mm: &MatMul<'_>) -> Result<TrainedLayer> {
    let (ne, nf, r) = (s.n_embd, s.n_ff, cfg.rank);
    if r == 0 || ne == 0 || nf == 0 {
        return Err(PredictorError::Shape(format!(
            "rank {r}, n_embd {ne}, n_ff {nf}"
        )));
    }
    if cfg.threshold.is_nan() || cfg.threshold >= 0.0 {
        return Err(PredictorError::Shape(format!(
            "the common threshold must be negative (got {})",
            cfg.threshold
        )));
    }
    let (train, hold) = s.split(cfg.holdout);
    if train.is_empty() {
        return Err(PredictorError::Shape("no training tokens".into()));
    }
    let n = train.len();
    let mut rng = Rng::new(cfg.seed);

    // Input scale per channel.
    let mut scale = vec![0f64; ne];
    for k in train.clone() {
        for (a, &x) in scale.iter_mut().zip(s.h(k)) {
            *a += x as f64 * x as f64;
        }
    }
    let inv: Vec<f32> = scale
        .iter()
        .map(|&a| {
            let rms = (a / n as f64).sqrt();
            if rms > 1e-12 {
                (1.0 / rms) as f32
            } else {
                1.0
            }
        })
        .collect();

    // Initialisation: pre-activations and logits of unit scale. Step sizes are relative to
    // these scales.
    let (std1, std2) = ((1.0 / ne as f64).sqrt(), (2.0 / r as f64).sqrt());
    let mut fc1: Vec<f32> = (0..r * ne).map(|_| (rng.normal() * std1) as f32).collect();
    let mut fc2: Vec<f32> = (0..nf * r).map(|_| (rng.normal() * std2) as f32).collect();
    let mut adam1 = Adam::new(fc1.len());
    let mut adam2 = Adam::new(fc2.len());

    let bs = cfg.batch_size.clamp(1, n);
    let mut order: Vec<usize> = train.clone().collect();
    let (mut x, mut xt, mut z1, mut a, mut at, mut z2, mut g, mut gt, mut fc2t, mut da, mut dzt) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut grad1 = vec![0f32; r * ne];
    let mut grad2 = vec![0f32; nf * r];
    let mut truth = vec![0f32; nf];
    let mut step = 0i32;
    let total_steps = (cfg.epochs * n.div_ceil(bs)).max(1);
    let mut losses = Vec::with_capacity(cfg.epochs);
    for _epoch in 0..cfg.epochs {
        for i in (1..order.len()).rev() {
            let j = rng.below(i + 1);
            order.swap(i, j);
        }
        let mut loss = 0f64;
        for batch in order.chunks(bs) {
            let b = batch.len();
            // x = scaled inputs [b][ne].
            x.clear();
            for &k in batch {
                x.extend(s.h(k).iter().zip(&inv).map(|(&h, &c)| h * c));
            }
            resize(&mut z1, b * r);
            mm.gemm(&weights(&fc1, r, ne), &x, b, &mut z1)?;
            a.clear();
            a.extend(z1.iter().map(|&z| z.max(0.0)));
            resize(&mut z2, b * nf);
            mm.gemm(&weights(&fc2, nf, r), &a, b, &mut z2)?;
            // g = dL/dz2 / b.
            resize(&mut g, b * nf);
            let inv_b = 1.0 / b as f32;
            for (j, &k) in batch.iter().enumerate() {
                s.truth_into(k, &mut truth);
                let zr = &z2[j * nf..(j + 1) * nf];
                let gr = &mut g[j * nf..(j + 1) * nf];
                for ((gv, &z), &y) in gr.iter_mut().zip(zr).zip(&truth) {
                    let w = if y > 0.0 { cfg.pos_weight } else { 1.0 };
                    let sig = 1.0 / (1.0 + (-z).exp());
                    *gv = w * (sig - y) * inv_b;
                    // BCE with logits: softplus(z) - y z, stable form.
                    let l = z.max(0.0) - y * z + (-z.abs()).exp().ln_1p();
                    loss += (w * l) as f64;
                }
            }
            // grad2 [nf][r] = g^T a: gemm(W = a^T [r][b], x = g^T [nf][b]).
            transpose(&a, b, r, &mut at);
            transpose(&g, b, nf, &mut gt);
            mm.gemm(&weights(&at, r, b), &gt, nf, &mut grad2)?;
            // da [b][r] = g fc2: gemm(W = fc2^T [r][nf], x = g [b][nf]).
            transpose(&fc2, nf, r, &mut fc2t);
            resize(&mut da, b * r);
            mm.gemm(&weights(&fc2t, r, nf), &g, b, &mut da)?;
            // dz1 = da ⊙ (z1 > 0); grad1 [r][ne] = dz1^T x: gemm(W = x^T [ne][b], dz1^T [r][b]).
            for (d, &z) in da.iter_mut().zip(&z1) {
                if z <= 0.0 {
                    *d = 0.0;
                }
            }
            transpose(&da, b, r, &mut dzt);
            transpose(&x, b, ne, &mut xt);
            mm.gemm(&weights(&xt, ne, b), &dzt, r, &mut grad1)?;
            step += 1;
            let progress = (step - 1) as f32 / total_steps as f32;
            let lr = cfg.learning_rate * (1.0 - 0.9 * progress);
            adam1.step(&mut fc1, &grad1, lr * std1 as f32, step);
            adam2.step(&mut fc2, &grad2, lr * std2 as f32, step);
        }
        losses.push(loss / (n as f64 * nf as f64));
    }

    // Fold the input scale into fc1's columns.
    for row in fc1.chunks_exact_mut(ne) {
        row.iter_mut().zip(&inv).for_each(|(w, &c)| *w *= c);
    }
    let mut pred = F32Predictor::new(ne, r, nf, fc1, fc2)?;

    // Calibrate on the training tokens.
    let mut pos = Vec::new();
    let mut sum_sq = 0f64;
    let mut cells = 0u64;
    for_scores(&pred.view(), mm, s, train.clone(), |k, sc| {
        for (i, &p) in sc.iter().enumerate() {
            if s.is_active(k, i) {
                pos.push(p);
            }
            sum_sq += p as f64 * p as f64;
        }
        cells += sc.len() as u64;
    })?;
    let rms = (sum_sq / cells.max(1) as f64).sqrt().max(1e-30) as f32;
    let eps = 1e-3 * rms;
    let theta_l = calibrate_threshold(pos, cfg.target_recall)
        .unwrap_or(-eps)
        .min(-eps);
    // A relative margin of 1e-4 keeps scores at exactly θ_l selected despite the rounding of
    // the rescaled products.
    let fold = cfg.threshold / (theta_l * (1.0 + 1e-4));
    pred.fc2_mut().iter_mut().for_each(|w| *w *= fold);

    let view = pred.view();
    let train_q = evaluate(&view, mm, s, train, cfg.threshold)?;
    let hold_q = evaluate(&view, mm, s, hold, cfg.threshold)?;
    Ok(TrainedLayer {
        threshold: cfg.threshold,
        layer_threshold: theta_l,
        train: train_q,
        holdout: hold_q,
        loss: (
            losses.first().copied().unwrap_or(f64::NAN),
            losses.last().copied().unwrap_or(f64::NAN),
        ),
        predictor: pred,
    })
}

fn resize(v: &mut Vec<f32>, n: usize) {
    v.clear();
    v.resize(n, 0.0);
}

fn weights(w: &[f32], rows: usize, cols: usize) -> powerinfer_kernels_cpu::Weights<'_> {
    powerinfer_kernels_cpu::Weights::new(
        powerinfer_gguf::GgmlType::F32,
        rows,
        cols,
        bytemuck::cast_slice(w),
    )
    .expect("F32 weights of matching length")
}

/// Name of the predictor folder's config file.
pub const CONFIG_FILE_NAME: &str = "config.json";

/// Writes `dir/model_N.safetensors` for every layer and `dir/config.json` with
/// `{"sparse_threshold": θ}` (creates `dir`).
pub fn write_predictor_dir(
    dir: impl AsRef<Path>,
    layers: &[F32Predictor],
    threshold: f32,
    dtype: FileDtype,
) -> Result<()> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|source| PredictorError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for (l, p) in layers.iter().enumerate() {
        p.write_safetensors(dir.join(crate::predictor::safetensors_file_name(l)), dtype)?;
    }
    let path = dir.join(CONFIG_FILE_NAME);
    let text = format!(
        "{{\n  \"sparse_threshold\": {},\n  \"n_layer\": {}\n}}\n",
        json_f32(threshold),
        layers.len()
    );
    crate::pt::write_atomic(&path, text.as_bytes())
        .map_err(|source| PredictorError::Io { path, source })
}

fn json_f32(x: f32) -> String {
    if x.is_finite() {
        format!("{x:?}")
    } else {
        "null".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_reaches_the_target() {
        let s: Vec<f32> = (0..100).map(|i| i as f32).collect();
        assert_eq!(calibrate_threshold(s.clone(), 0.99), Some(1.0));
        assert_eq!(calibrate_threshold(s.clone(), 1.0), Some(0.0));
        assert_eq!(calibrate_threshold(s.clone(), 0.5), Some(50.0));
        assert_eq!(calibrate_threshold(vec![], 0.9), None);
    }

    #[test]
    fn samples_store_bits_and_split() {
        let mut s = LayerSamples::new(2, 70);
        let mut act = vec![0f32; 140];
        act[3] = 1.0;
        act[70 + 69] = 0.5;
        s.push(2, &[1.0, 2.0, 3.0, 4.0], &act).unwrap();
        assert_eq!(s.len(), 2);
        assert!(s.is_active(0, 3) && !s.is_active(0, 4) && s.is_active(1, 69));
        assert_eq!(s.h(1), [3.0, 4.0]);
        assert!(s.push(1, &[1.0], &act[..70]).is_err());
        assert_eq!(s.split(0.5), (0..1, 1..2));
        assert_eq!(s.split(1.0), (0..1, 1..2));
    }

    #[test]
    fn transpose_is_a_transpose() {
        let src: Vec<f32> = (0..35 * 40).map(|i| i as f32).collect();
        let mut t = Vec::new();
        transpose(&src, 35, 40, &mut t);
        for r in 0..35 {
            for c in 0..40 {
                assert_eq!(t[c * 35 + r], src[r * 40 + c]);
            }
        }
    }
}
