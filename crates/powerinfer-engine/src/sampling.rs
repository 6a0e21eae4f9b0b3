//! Token sampling: logit bias, repetition/presence/frequency penalties, DRY, top-k, typical-p,
//! top-p, min-p, XTC, temperature and a seeded random generator, applied in llama.cpp's order
//! (bias → penalties → DRY → top-k → typical → top-p → min-p → XTC → temperature → draw), or
//! mirostat (v1 or v2) after the temperature instead of the truncations. A temperature ≤ 0 picks the most likely
//! token (greedy).

/// Sampling settings. Start from [`SamplingParams::default`] (llama.cpp's defaults) or
/// [`SamplingParams::greedy`] and set what differs.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SamplingParams {
    /// Temperature; ≤ 0 = greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1 = all).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top one's (0 = off).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recent tokens by this (1 = off).
    pub repeat_penalty: f32,
    /// Subtract from the logit of every recent token (0 = off).
    pub presence_penalty: f32,
    /// Subtract this times its count from the logit of every recent token (0 = off).
    pub frequency_penalty: f32,
    /// How many of the last tokens the penalties look at.
    pub penalty_last_n: usize,
    /// Random seed (same seed, same model, same prompt → same text).
    pub seed: u64,
    /// Tokens to generate at most.
    pub max_tokens: usize,
    /// Stop when the generated text contains one of these.
    pub stop: Vec<String>,
    /// Stop at an end-of-generation token (EOS, EOT).
    pub stop_at_eog: bool,
    /// Locally typical sampling: keep the tokens whose surprise is closest to the
    /// distribution's entropy until their probability reaches `typical_p` (1 = off).
    pub typical_p: f32,
    /// XTC ("exclude top choices"): with this probability per token, drop every token above
    /// `xtc_threshold` but the least likely of them (0 = off).
    pub xtc_probability: f32,
    /// XTC's probability threshold (above 0.5: off).
    pub xtc_threshold: f32,
    /// Mirostat: 0 off, 1 (v1) or 2 (v2); replaces top-k/typical/top-p/min-p/XTC.
    pub mirostat: u8,
    /// Mirostat's target surprise (τ, bits).
    pub mirostat_tau: f32,
    /// Mirostat's learning rate (η).
    pub mirostat_eta: f32,
    /// Added to the logits of these tokens before anything else (`-inf` forbids a token).
    pub logit_bias: Vec<(u32, f32)>,
    /// DRY ("don't repeat yourself"): a token that would extend a repeat of the recent text
    /// loses `dry_multiplier · dry_base^(length − dry_allowed_length)` (0 = off).
    pub dry_multiplier: f32,
    /// DRY's growth per token of repeat.
    pub dry_base: f32,
    /// DRY: repeats up to this long are free.
    pub dry_allowed_length: usize,
    /// DRY: how many of the last tokens it looks at (`usize::MAX`: all).
    pub dry_penalty_last_n: usize,
    /// DRY: tokens a repeat does not reach across (sorted ids; the CLI and the server fill it
    /// with the tokens containing `\n`, `:`, `"` or `*`, as llama.cpp's default breakers).
    pub dry_breakers: Vec<u32>,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults: temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat
    /// penalty 1.0 over the last 64 tokens, seed 0, 128 tokens.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
            max_tokens: 128,
            stop: Vec::new(),
            stop_at_eog: true,
            typical_p: 1.0,
            xtc_probability: 0.0,
            xtc_threshold: 0.1,
            mirostat: 0,
            mirostat_tau: 5.0,
            mirostat_eta: 0.1,
            logit_bias: Vec::new(),
            dry_multiplier: 0.0,
            dry_base: 1.75,
            dry_allowed_length: 2,
            dry_penalty_last_n: usize::MAX,
            dry_breakers: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// These settings changed by `f`: `SamplingParams::greedy(8).with(|p| p.seed = 3)`.
    pub fn with(mut self, f: impl FnOnce(&mut Self)) -> Self {
        f(&mut self);
        self
    }

    /// Greedy decoding of `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }
}

/// A small seeded random generator (xoshiro256** seeded through splitmix64).
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform value in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A sampler: the settings, the random state and the recent tokens.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    recent: Vec<u32>,
    /// Mirostat's running maximum surprise (μ), starting at 2τ.
    mu: f32,
}

impl Sampler {
    /// A sampler seeded with `params.seed`.
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler {
            rng: Rng::new(params.seed),
            mu: 2.0 * params.mirostat_tau,
            params,
            recent: Vec::new(),
        }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token (prompt or generated) for the penalties.
    pub fn accept(&mut self, token: u32) {
        self.recent.push(token);
        let p = &self.params;
        let n = if p.dry_multiplier > 0.0 {
            p.penalty_last_n.max(p.dry_penalty_last_n)
        } else {
            p.penalty_last_n
        };
        if self.recent.len() > n.max(1).saturating_mul(2) {
            self.recent.drain(..self.recent.len() - n);
        }
    }

    /// Picks the next token from `logits` (which are modified by the penalties).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        for &(t, b) in &self.params.logit_bias {
            if let Some(l) = logits.get_mut(t as usize) {
                *l += b;
            }
        }
        self.apply_penalties(logits);
        self.apply_dry(logits);
        let p = &self.params;
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        if p.mirostat != 0 {
            return self.mirostat(logits);
        }
        let mut cand = top_candidates(logits, p.top_k);
        if cand.is_empty() {
            return 0;
        }
        if p.typical_p < 1.0 {
            cand = typical(cand, p.typical_p);
        }
        let probs = softmax(&cand, 1.0);
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            let mut keep = cand.len();
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if p.min_p > 0.0 {
            let top = cand[0].1;
            let min_logit = top + (p.min_p as f64).ln() as f32;
            let keep = cand.iter().take_while(|c| c.1 >= min_logit).count();
            cand.truncate(keep.max(1));
        }
        if p.xtc_probability > 0.0 && p.xtc_threshold <= 0.5 && cand.len() > 1 {
            let (prob, threshold) = (p.xtc_probability, p.xtc_threshold);
            if self.rng.next_f64() < prob as f64 {
                // The last of the leading tokens at or above the threshold stays.
                let probs = softmax(&cand, 1.0);
                let above = probs.iter().take_while(|&&q| q >= threshold as f64).count();
                if above > 1 {
                    cand.drain(..above - 1);
                }
            }
        }
        let probs = softmax(&cand, p.temperature);
        self.draw(&cand, &probs)
    }

    /// A candidate drawn with probabilities `probs`.
    fn draw(&mut self, cand: &[(u32, f32)], probs: &[f64]) -> u32 {
        let r = self.rng.next_f64();
        let mut cum = 0.0;
        let mut last = cand[0].0;
        for (c, &pr) in cand.iter().zip(probs) {
            cum += pr;
            if r < cum {
                return c.0;
            }
            // Rounding can leave the sum just below `r`: the last token that could be drawn.
            if pr > 0.0 {
                last = c.0;
            }
        }
        last
    }

    /// Mirostat (Basu et al. 2021, as llama.cpp implements it) at the temperature: v2 keeps
    /// the tokens whose surprise `−log2 p` is at most μ; v1 estimates the distribution's Zipf
    /// exponent from the top 100 tokens and keeps the top `k` that make the expected surprise
    /// μ. After the draw, μ moves by `η · (τ − surprise)`.
    fn mirostat(&mut self, logits: &[f32]) -> u32 {
        let p = self.params.clone();
        let mut cand = top_candidates(logits, 0);
        if cand.is_empty() {
            return 0;
        }
        for c in &mut cand {
            c.1 /= p.temperature;
        }
        if p.mirostat == 1 {
            let probs = softmax(&cand, 1.0);
            let m = 100.min(probs.len());
            let (mut sum_tb, mut sum_t2) = (0.0f64, 0.0f64);
            for i in 0..m.saturating_sub(1) {
                let t = ((i + 2) as f64 / (i + 1) as f64).ln();
                let b = (probs[i] / probs[i + 1]).ln();
                sum_tb += t * b;
                sum_t2 += t * t;
            }
            let s_hat = if sum_t2 > 0.0 { sum_tb / sum_t2 } else { 1.0 };
            let eps = s_hat - 1.0;
            let n = logits.len() as f64;
            let k = ((eps * 2f64.powf(self.mu as f64)) / (1.0 - n.powf(-eps))).powf(1.0 / s_hat);
            let k = if k.is_finite() {
                k.floor().max(1.0)
            } else {
                1.0
            };
            cand.truncate((k as usize).clamp(1, cand.len()));
        } else {
            let probs = softmax(&cand, 1.0);
            let keep = probs
                .iter()
                .take_while(|&&q| -q.log2() <= self.mu as f64)
                .count();
            cand.truncate(keep.max(1));
        }
        let probs = softmax(&cand, 1.0);
        let id = self.draw(&cand, &probs);
        let q = cand
            .iter()
            .zip(&probs)
            .find(|(c, _)| c.0 == id)
            .map_or(1.0, |(_, &q)| q);
        let surprise = -q.log2() as f32;
        self.mu -= p.mirostat_eta * (surprise - p.mirostat_tau);
        id
    }

    /// Mirostat's μ now.
    pub fn mirostat_mu(&self) -> f32 {
        self.mu
    }

    /// DRY ("don't repeat yourself", p-e-w's sampler as llama.cpp runs it): a token that would
    /// extend a repeat of at least `dry_allowed_length` tokens of the recent text loses
    /// `dry_multiplier · dry_base^(length − allowed)`; a match does not reach across a
    /// sequence breaker token.
    fn apply_dry(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.dry_multiplier <= 0.0 || p.dry_base < 1.0 || p.dry_penalty_last_n == 0 {
            return;
        }
        let start = self.recent.len().saturating_sub(p.dry_penalty_last_n);
        let h = &self.recent[start..];
        let n = h.len();
        if n < 2 {
            return;
        }
        let breaker = |t: u32| p.dry_breakers.binary_search(&t).is_ok();
        // For each earlier position j, the tokens before it that equal the text's end: then
        // h[j] would continue that repeat.
        let mut longest: Vec<(u32, usize)> = Vec::new();
        for j in 1..n {
            let next = h[j];
            let mut len = 0;
            while len < j && h[j - 1 - len] == h[n - 1 - len] && !breaker(h[n - 1 - len]) {
                len += 1;
            }
            if len >= p.dry_allowed_length.max(1) {
                longest.push((next, len));
            }
        }
        longest.sort_unstable();
        for run in longest.chunk_by(|a, b| a.0 == b.0) {
            let (t, len) = run[run.len() - 1];
            if let Some(l) = logits.get_mut(t as usize) {
                let excess = (len - p.dry_allowed_length) as i32;
                *l -= p.dry_multiplier * p.dry_base.powi(excess);
            }
        }
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        let off =
            p.repeat_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0;
        if off || p.penalty_last_n == 0 {
            return;
        }
        let start = self.recent.len().saturating_sub(p.penalty_last_n);
        // Counts of each token in the window, by sorting a copy (a linear search per token is
        // quadratic in the window).
        let mut window = self.recent[start..].to_vec();
        window.sort_unstable();
        let counts = window
            .chunk_by(|a, b| a == b)
            .map(|run| (run[0], run.len() as u32));
        for (t, n) in counts {
            let Some(l) = logits.get_mut(t as usize) else {
                continue;
            };
            if *l > 0.0 {
                *l /= p.repeat_penalty;
            } else {
                *l *= p.repeat_penalty;
            }
            *l -= n as f32 * p.frequency_penalty + p.presence_penalty;
        }
    }
}

/// The `top_k` largest non-NaN logits (all of them for `top_k == 0`) as (id, logit), sorted by
/// logit descending, ties by lower id first.
fn top_candidates(logits: &[f32], top_k: usize) -> Vec<(u32, f32)> {
    let mut cand: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_nan())
        .map(|(i, &l)| (i as u32, l))
        .collect();
    // A strict total order, so the top k are one well-defined set: select them in linear time
    // and sort only those (a full sort of a 32k–150k vocabulary took ~3% of a fast sparse
    // decode step).
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if top_k > 0 && top_k < cand.len() {
        cand.select_nth_unstable_by(top_k - 1, order);
        cand.truncate(top_k);
    }
    cand.sort_unstable_by(order);
    cand
}

/// Locally typical sampling over sorted candidates: by `|−ln p − H|` ascending (H the entropy),
/// the smallest set whose probability reaches `mass`, returned sorted by logit again.
fn typical(cand: Vec<(u32, f32)>, mass: f32) -> Vec<(u32, f32)> {
    let probs = softmax(&cand, 1.0);
    let entropy: f64 = probs
        .iter()
        .filter(|&&q| q > 0.0)
        .map(|&q| -q * q.ln())
        .sum();
    let mut order: Vec<usize> = (0..cand.len()).collect();
    let shifted = |i: usize| (-probs[i].ln() - entropy).abs();
    order.sort_by(|&a, &b| shifted(a).total_cmp(&shifted(b)).then(a.cmp(&b)));
    let mut cum = 0.0;
    let mut keep = order.len();
    for (n, &i) in order.iter().enumerate() {
        cum += probs[i];
        // Strictly past the mass, as llama.cpp.
        if cum > mass as f64 {
            keep = n + 1;
            break;
        }
    }
    order.truncate(keep.max(1));
    order.sort_unstable();
    order.into_iter().map(|i| cand[i]).collect()
}

/// Index of the largest logit (the lowest such index on ties; NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_v {
            best_v = l;
            best = i;
        }
    }
    best as u32
}

/// Probabilities of sorted candidates at temperature `temp` (in f64).
fn softmax(cand: &[(u32, f32)], temp: f32) -> Vec<f64> {
    let max = cand[0].1 as f64;
    let e: Vec<f64> = cand
        .iter()
        .map(|c| ((c.1 as f64 - max) / temp as f64).exp())
        .collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's penalties over the last `penalty_last_n` accepted tokens: a positive logit
    /// divided by the repeat penalty, a negative one multiplied, then `count · frequency +
    /// presence` subtracted; tokens outside the window and ids past the vocabulary untouched.
    #[test]
    fn penalties_follow_llama_cpp() {
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            penalty_last_n: 5,
            ..SamplingParams::greedy(1)
        });
        // The window is the last five: 2, 3, 1, 1, 99 (token 0 fell out of it).
        for t in [0, 2, 3, 1, 1, 99] {
            s.accept(t);
        }
        let mut logits = [1.0f32, 2.0, -1.0, 4.0, 5.0];
        assert_eq!(s.sample(&mut logits), 4);
        assert_eq!(logits, [1.0, 0.0, -2.75, 1.25, 5.0]);
    }

    #[test]
    fn top_candidates_equal_a_full_sort() {
        let mut rng = Rng::new(3);
        for case in 0..200 {
            let n = 1 + (rng.next_u64() % 300) as usize;
            // Few distinct values: many ties, which must break by id.
            let levels = 1 + case % 17;
            let logits: Vec<f32> = (0..n)
                .map(|_| match rng.next_u64() % 50 {
                    0 => f32::NAN,
                    _ => (rng.next_u64() % levels as u64) as f32 - 3.0,
                })
                .collect();
            let mut full: Vec<(u32, f32)> = logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(i, &l)| (i as u32, l))
                .collect();
            full.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
            for k in [0, 1, 2, 5, 40, n - 1, n, n + 3] {
                let mut want = full.clone();
                if k > 0 {
                    want.truncate(k);
                }
                assert_eq!(top_candidates(&logits, k), want, "n {n} k {k}");
            }
        }
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy(1));
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_repeats() {
        let p = SamplingParams {
            top_k: 1,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        for _ in 0..10 {
            assert_eq!(s.sample(&mut [0.0, 1.0, 5.0, 4.9]), 2);
        }
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                seed,
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                ..Default::default()
            });
            (0..50)
                .map(|_| s.sample(&mut [1.0, 1.0, 1.0, 1.0]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // Uniform logits: every token shows up in 50 draws.
        let d = draw(7);
        assert!((0..4).all(|t| d.contains(&t)));
    }

    #[test]
    fn penalties_and_min_p() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            repeat_penalty: 2.0,
            ..Default::default()
        });
        s.accept(0);
        // 3.0 / 2 = 1.5 < 2.0: token 1 wins after the penalty.
        assert_eq!(s.sample(&mut [3.0, 2.0]), 1);
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            ..Default::default()
        });
        // exp(-1) < 0.5: only token 0 survives min-p.
        for _ in 0..20 {
            assert_eq!(s.sample(&mut [1.0, 0.0]), 0);
        }
    }

    /// Logits of probabilities 0.4, 0.3, 0.2, 0.1.
    fn four() -> Vec<f32> {
        [0.4f32, 0.3, 0.2, 0.1].iter().map(|p| p.ln()).collect()
    }

    /// The tokens drawn over 400 seeds.
    fn drawn(p: SamplingParams) -> std::collections::BTreeSet<u32> {
        (0..400)
            .map(|seed| Sampler::new(p.clone().with(|p| p.seed = seed)).sample(&mut four()))
            .collect()
    }

    fn plain() -> SamplingParams {
        SamplingParams::default().with(|p| {
            p.temperature = 1.0;
            p.top_k = 0;
            p.top_p = 1.0;
            p.min_p = 0.0;
        })
    }

    #[test]
    fn logit_bias_forbids_and_promotes() {
        let mut s = Sampler::new(SamplingParams::greedy(1).with(|p| {
            p.logit_bias = vec![(0, f32::NEG_INFINITY), (3, 0.5)];
        }));
        // 0 forbidden; ln 0.1 + 0.5 < ln 0.3: token 1.
        assert_eq!(s.sample(&mut four()), 1);
        let p = plain().with(|p| p.logit_bias = vec![(0, f32::NEG_INFINITY), (9, 1.0)]);
        assert_eq!(drawn(p), [1, 2, 3].into());
    }

    /// Entropy H = 1.2799 nats; |−ln p − H| = 0.364, 0.076, 0.330, 1.023: by closeness tokens
    /// 1, 2, 0, 3; a mass of 0.45 is passed by tokens 1 and 2 (0.5), one of 0.5 only with token
    /// 0 too (llama.cpp keeps until the sum exceeds the mass).
    #[test]
    fn typical_keeps_the_tokens_nearest_the_entropy() {
        assert_eq!(drawn(plain().with(|p| p.typical_p = 0.45)), [1, 2].into());
        assert_eq!(drawn(plain().with(|p| p.typical_p = 0.8)), [0, 1, 2].into());
        assert_eq!(drawn(plain()), [0, 1, 2, 3].into());
    }

    #[test]
    fn xtc_drops_the_top_choices_but_the_last_above_the_threshold() {
        let xtc = |prob: f32, threshold: f32| {
            plain().with(|p| {
                p.xtc_probability = prob;
                p.xtc_threshold = threshold;
            })
        };
        // 0.4, 0.3, 0.2 are at or above 0.15: 0 and 1 go.
        assert_eq!(drawn(xtc(1.0, 0.15)), [2, 3].into());
        // One token above 0.35: nothing goes.
        assert_eq!(drawn(xtc(1.0, 0.35)), [0, 1, 2, 3].into());
        // Off above 0.5, and at probability 0.
        assert_eq!(drawn(xtc(1.0, 0.6)), [0, 1, 2, 3].into());
        assert_eq!(drawn(xtc(0.0, 0.15)), [0, 1, 2, 3].into());
    }

    /// v2 with τ = 1: μ starts at 2 bits, so tokens of probability ≥ 0.25 (0 and 1) stay; the
    /// drawn token's renormalized surprise moves μ by η·(τ − surprise).
    #[test]
    fn mirostat_v2_truncates_by_surprise_and_learns() {
        let p = plain().with(|p| {
            p.mirostat = 2;
            p.mirostat_tau = 1.0;
            p.mirostat_eta = 0.1;
        });
        assert_eq!(drawn(p.clone()), [0, 1].into());
        for seed in 0..20 {
            let mut s = Sampler::new(p.clone().with(|p| p.seed = seed));
            let id = s.sample(&mut four());
            let q: f64 = if id == 0 { 0.4 / 0.7 } else { 0.3 / 0.7 };
            let want = 2.0 - 0.1 * (-q.log2() as f32 - 1.0);
            assert!(
                (s.mirostat_mu() - want).abs() < 1e-6,
                "{id}: {}",
                s.mirostat_mu()
            );
        }
    }

    /// v1 on a Zipf distribution over 1000 tokens: μ stays bounded (it settles where the
    /// draws' surprise averages τ), and the same seed gives the same tokens.
    #[test]
    fn mirostat_v1_tracks_its_target() {
        let logits: Vec<f32> = (1..=1000).map(|r| -1.1 * (r as f32).ln()).collect();
        let p = plain().with(|p| {
            p.mirostat = 1;
            p.mirostat_tau = 3.0;
            p.mirostat_eta = 0.1;
            p.seed = 7;
        });
        let run = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            let ids: Vec<u32> = (0..300).map(|_| s.sample(&mut logits.clone())).collect();
            (ids, s.mirostat_mu())
        };
        let (ids, mu) = run(&p);
        assert_eq!(run(&p).0, ids);
        assert!(mu.is_finite() && mu > 0.0 && mu < 20.0, "{mu}");
        // A lower target truncates harder: fewer distinct tokens.
        let (low, _) = run(&p.clone().with(|p| p.mirostat_tau = 1.0));
        let distinct = |v: &[u32]| v.iter().collect::<std::collections::BTreeSet<_>>().len();
        assert!(
            distinct(&low) < distinct(&ids),
            "{} vs {}",
            distinct(&low),
            distinct(&ids)
        );
        // Tokens outside the few most likely are drawn: it is not greedy.
        assert!(ids.iter().any(|&t| t > 3));
        assert!(ids.iter().all(|&t| t < 1000));
    }

    /// DRY on the history 1 2 3 4 9 1 2 3: continuing with 4 would repeat "1 2 3 4", a match
    /// of 3 tokens, 1 past the allowed 2: token 4 loses 1.5 · 2^1. A breaker inside the match
    /// (token 2) cuts it to 1 token: no penalty. Off at multiplier 0.
    #[test]
    fn dry_penalizes_the_token_that_extends_a_repeat() {
        let run = |multiplier: f32, breakers: Vec<u32>| {
            let mut s = Sampler::new(SamplingParams::greedy(1).with(|p| {
                p.dry_multiplier = multiplier;
                p.dry_base = 2.0;
                p.dry_allowed_length = 2;
                p.dry_breakers = breakers;
            }));
            for t in [1, 2, 3, 4, 9, 1, 2, 3] {
                s.accept(t);
            }
            let mut logits = vec![0.0f32; 10];
            logits[4] = 2.0;
            let id = s.sample(&mut logits);
            (id, logits)
        };
        let (id, logits) = run(1.5, vec![]);
        assert_eq!(logits[4], 2.0 - 1.5 * 2.0);
        assert!(logits.iter().enumerate().all(|(i, &l)| i == 4 || l == 0.0));
        assert_ne!(id, 4);
        assert_eq!(run(1.5, vec![2]).1[4], 2.0);
        assert_eq!(run(0.0, vec![]).0, 4);
    }
}
