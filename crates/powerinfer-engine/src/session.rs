//! [`Session`]: one sequence over an [`Engine`] with its own KV cache, text generation
//! ([`Session::generate`]) and statistics ([`Stats`]).

use std::time::{Duration, Instant};

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::exec::{Batch, EvalOptions, Logits};
use crate::kv_cache::{KvCache, SeqId};
use crate::observer::FfnObserver;
use crate::profile::OpProfile;
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::StreamDecoder;

/// Timings and sparsity of a session.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Stats {
    /// Model load time.
    pub load_time: Duration,
    /// Prompt tokens evaluated.
    pub prompt_tokens: usize,
    /// Time spent on prompt blocks.
    pub prompt_time: Duration,
    /// Single-token decode steps.
    pub decode_tokens: usize,
    /// Time spent on decode steps.
    pub decode_time: Duration,
    /// Context shifts made to keep generating past a full context.
    pub context_shifts: usize,
    /// Sum over evaluated tokens of the mean FFN density (active / n_ff, averaged over layers).
    pub density_sum: f64,
    /// Tokens in `density_sum`.
    pub density_tokens: usize,
}

impl Stats {
    /// Prompt tokens per second.
    pub fn prompt_tps(&self) -> f64 {
        rate(self.prompt_tokens, self.prompt_time)
    }

    /// Decode tokens per second.
    pub fn decode_tps(&self) -> f64 {
        rate(self.decode_tokens, self.decode_time)
    }

    /// Mean FFN density over every evaluated token (1 for a dense FFN).
    pub fn ffn_density(&self) -> f64 {
        if self.density_tokens == 0 {
            0.0
        } else {
            self.density_sum / self.density_tokens as f64
        }
    }

    fn record(&mut self, density: &[f32]) {
        self.density_sum += density.iter().map(|&d| d as f64).sum::<f64>();
        self.density_tokens += density.len();
    }
}

fn rate(n: usize, t: Duration) -> f64 {
    let s = t.as_secs_f64();
    if s > 0.0 {
        n as f64 / s
    } else {
        0.0
    }
}

/// One generated token.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Token {
    /// Token id.
    pub id: u32,
    /// The text this token completes (may be empty while a multi-byte character is pending).
    pub text: String,
}

/// One sequence of generation over an [`Engine`].
#[derive(Debug)]
pub struct Session<'e> {
    engine: &'e Engine,
    cache: KvCache,
    seq: SeqId,
    stats: Stats,
    profile: Option<OpProfile>,
    prompt_profile: Option<OpProfile>,
    /// The last token [`Session::generate`] sampled and gave out, which no logits were needed
    /// for yet: evaluated first by the session's next evaluation (so a generation that ends
    /// spends no forward pass on its last token, and the sequence still holds it after).
    unevaluated: Option<u32>,
    /// Context shift: `Some(keep)` drops half of the tokens after the first `keep` (and a BOS)
    /// when the context is full; `None` makes a full context an error.
    context_shift: Option<usize>,
}

impl Engine {
    /// A new session (its own KV cache with one sequence).
    pub fn session(&self) -> Session<'_> {
        Session::new(self)
    }
}

impl<'e> Session<'e> {
    /// A session over `engine` with its own KV cache holding one empty sequence.
    pub fn new(engine: &'e Engine) -> Session<'e> {
        let mut cache = engine.new_cache();
        let seq = cache.add_sequence();
        Session {
            engine,
            cache,
            seq,
            stats: Stats {
                load_time: engine.load_time(),
                ..Stats::default()
            },
            profile: None,
            prompt_profile: None,
            unevaluated: None,
            context_shift: Some(0),
        }
    }

    /// What [`Session::generate`] does when the context is full: `Some(keep)` (the default,
    /// `Some(0)`) shifts it as llama.cpp does (the first `keep` tokens, and a BOS, stay; half of
    /// the rest is dropped; generation goes on), `None` ends the generation with
    /// [`EngineError::ContextFull`].
    pub fn set_context_shift(&mut self, keep: Option<usize>) {
        self.context_shift = keep;
    }

    /// Makes room for one more token when the context is full (see
    /// [`set_context_shift`](Self::set_context_shift)).
    fn room_for_one(&mut self) -> Result<()> {
        let ctx = self.engine.ctx_len();
        let pos = self.cache.pos(self.seq)?;
        if pos < ctx {
            return Ok(());
        }
        let Some(keep) = self.context_shift else {
            return Err(EngineError::ContextFull {
                needed: pos + 1,
                ctx_len: ctx,
            });
        };
        let keep = keep
            .max(usize::from(self.engine.tokenizer().bos().is_some()))
            .min(pos);
        let discard = (pos - keep) / 2;
        if discard == 0 {
            return Err(EngineError::ContextFull {
                needed: pos + 1,
                ctx_len: ctx,
            });
        }
        self.engine
            .shift_context(&mut self.cache, self.seq, keep, discard)?;
        self.stats.context_shifts += 1;
        Ok(())
    }

    /// The engine.
    pub fn engine(&self) -> &'e Engine {
        self.engine
    }

    /// Statistics so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Starts (`true`, from empty profiles) or stops recording where the time goes: of the
    /// decode steps (single tokens, those of [`Session::generate`] after the prompt:
    /// [`Session::profile`]) and of the prompt blocks ([`Session::prompt_profile`]), apart.
    /// The clock is read between operations, which costs well under a microsecond per layer.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(OpProfile::new);
        self.prompt_profile = on.then(OpProfile::new);
    }

    /// Time, calls and bytes read per operation over the decode steps since
    /// [`set_profiling(true)`](Session::set_profiling); `None` when not recording.
    pub fn profile(&self) -> Option<&OpProfile> {
        self.profile.as_ref()
    }

    /// As [`profile`](Self::profile), over the prompt blocks evaluated since
    /// [`set_profiling(true)`](Session::set_profiling).
    pub fn prompt_profile(&self) -> Option<&OpProfile> {
        self.prompt_profile.as_ref()
    }

    /// Tokens of the session's sequence: those in the KV cache, and a last generated token
    /// that the next evaluation will put there.
    pub fn n_past(&self) -> usize {
        self.cache.pos(self.seq).unwrap_or(0) + usize::from(self.unevaluated.is_some())
    }

    /// Forgets every token (the statistics stay).
    pub fn reset(&mut self) {
        self.unevaluated = None;
        // The sequence was created by `Engine::session` and is never removed.
        let _ = self.cache.clear(self.seq);
    }

    /// Evaluates `tokens` (in blocks of [`EngineOptions::batch`](crate::EngineOptions::batch)) and returns the logits of the
    /// last one (`n_vocab` values). Counted as prompt time. On an error the session is reset
    /// (its KV cache could hold part of a block).
    pub fn eval(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut last = Vec::new();
        let blocks = prompt_blocks(tokens, self.engine.batch_size());
        let n = blocks.len();
        for (i, block) in blocks.into_iter().enumerate() {
            last = self.eval_block(block, last_block(i, n), true)?;
        }
        Ok(last)
    }

    /// Evaluates `tokens` and returns the logits of every position (`tokens.len() · n_vocab`
    /// values, position after position). Counted as prompt time.
    pub fn eval_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut all = Vec::with_capacity(tokens.len() * self.engine.model().hparams().n_vocab);
        for block in prompt_blocks(tokens, self.engine.batch_size()) {
            all.extend(self.eval_block(block, Logits::All, true)?);
        }
        Ok(all)
    }

    /// Evaluates `tokens` (in blocks of [`EngineOptions::batch`](crate::EngineOptions::batch)) with an observer of every
    /// layer's FFN: the FFN is computed densely and the observer sees its input, true
    /// activations and predictor scores (profiling, predictor training and evaluation).
    /// Returns the logits of the last token. Counted as prompt time.
    pub fn eval_observed(
        &mut self,
        tokens: &[u32],
        observer: &mut dyn FfnObserver,
    ) -> Result<Vec<f32>> {
        let mut last = Vec::new();
        let blocks = prompt_blocks(tokens, self.engine.batch_size());
        let n = blocks.len();
        for (i, block) in blocks.into_iter().enumerate() {
            last = self.eval_block_with(block, last_block(i, n), true, Some(&mut *observer))?;
        }
        Ok(last)
    }

    fn eval_block(&mut self, tokens: &[u32], which: Logits, prompt: bool) -> Result<Vec<f32>> {
        self.eval_block_with(tokens, which, prompt, None)
    }

    fn eval_block_with(
        &mut self,
        tokens: &[u32],
        which: Logits,
        prompt: bool,
        observer: Option<&mut dyn FfnObserver>,
    ) -> Result<Vec<f32>> {
        let start = Instant::now();
        let e = self.engine;
        let joined: Vec<u32>;
        let first = self.unevaluated.take();
        let tokens = match first {
            Some(t) => {
                joined = std::iter::once(t).chain(tokens.iter().copied()).collect();
                &joined[..]
            }
            None => tokens,
        };
        let batch = Batch::one(self.seq, tokens);
        let mut opts = EvalOptions::new();
        opts.logits = which;
        let all = which == Logits::All;
        if let Some(o) = observer {
            opts = opts.observe(o);
        } else if let Some(p) = match prompt {
            true => self.prompt_profile.as_mut(),
            false => self.profile.as_mut(),
        } {
            opts = opts.profile(p);
        }
        let out = e
            .eval(&mut self.cache, &batch, opts)
            .inspect_err(|_| self.reset())?
            .pop()
            .expect("one output per segment");
        let dt = start.elapsed();
        if prompt {
            self.stats.prompt_tokens += tokens.len();
            self.stats.prompt_time += dt;
        } else {
            self.stats.decode_tokens += tokens.len();
            self.stats.decode_time += dt;
        }
        self.stats.record(&out.density);
        let mut logits = out.logits;
        if all && first.is_some() {
            // The caller asked for the rows of its own tokens.
            logits.drain(..e.model().hparams().n_vocab);
        }
        Ok(logits)
    }

    /// Generates text after `prompt` (tokenized with BOS and special tokens parsed), continuing
    /// the session's sequence. The iterator evaluates the prompt on its first call and then
    /// one token per call; it ends after `max_tokens` tokens, at an end-of-generation token
    /// (not returned) if `stop_at_eog`, or after the token whose text completes a stop string.
    pub fn generate<'s>(&'s mut self, prompt: &str, params: SamplingParams) -> Generate<'s, 'e> {
        let add_bos = self.n_past() == 0;
        let tokens = self.engine.tokenizer().encode(prompt, add_bos, true);
        self.generate_tokens(tokens, params)
    }

    /// [`generate`](Self::generate) after the given prompt tokens (a chat turn rendered by a
    /// template, say) instead of a text.
    pub fn generate_tokens<'s>(
        &'s mut self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Generate<'s, 'e> {
        Generate {
            decoder: self.engine.tokenizer().stream_decoder(false),
            session: self,
            sampler: Sampler::new(params),
            prompt: Some(prompt),
            logits: Vec::new(),
            pending: None,
            text: String::new(),
            n_generated: 0,
            done: false,
        }
    }

    /// Forgets every token after the first `n` (a conversation rewound to where it still
    /// agrees with a new rendering); a last generated token not yet in the cache is dropped too.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        let pos = self.cache.pos(self.seq)?;
        if n > pos && self.unevaluated.is_some() {
            // The pending token is position `pos`: it stays when `n` reaches past it.
            return Ok(());
        }
        self.unevaluated = None;
        self.cache.truncate(self.seq, n)
    }
}

/// The iterator of [`Session::generate`].
pub struct Generate<'s, 'e> {
    session: &'s mut Session<'e>,
    decoder: StreamDecoder<'e>,
    sampler: Sampler,
    prompt: Option<Vec<u32>>,
    logits: Vec<f32>,
    pending: Option<u32>,
    text: String,
    n_generated: usize,
    done: bool,
}

impl Generate<'_, '_> {
    /// The text generated so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The statistics of the session.
    pub fn stats(&self) -> &Stats {
        &self.session.stats
    }

    fn step(&mut self) -> Result<Option<Token>> {
        if let Some(prompt) = self.prompt.take() {
            if prompt.is_empty() {
                return Err(EngineError::Invalid("the prompt has no tokens".into()));
            }
            let ctx = self.session.engine.ctx_len();
            let past = self.session.n_past();
            if past + prompt.len() > ctx {
                return Err(EngineError::Invalid(format!(
                    "the prompt has {} tokens{}, more than the context of {ctx} (-c) holds",
                    prompt.len(),
                    if past > 0 {
                        format!(" after {past} earlier ones")
                    } else {
                        String::new()
                    }
                )));
            }
            prompt.iter().for_each(|&t| self.sampler.accept(t));
            self.logits = self.session.eval(&prompt)?;
        }
        if self.n_generated >= self.sampler.params().max_tokens {
            // The last token given out stays pending: `Drop` hands it to the session.
            return Ok(None);
        }
        if let Some(tok) = self.pending.take() {
            if let Err(e) = self.session.room_for_one() {
                // Not evaluated: it stays the session's last token.
                self.pending = Some(tok);
                return Err(e);
            }
            self.logits = self.session.eval_block(&[tok], Logits::Last, false)?;
        }
        let id = self.sampler.sample(&mut self.logits);
        self.sampler.accept(id);
        let tokenizer = self.session.engine.tokenizer();
        if self.sampler.params().stop_at_eog && tokenizer.is_eog(id) {
            return Ok(None);
        }
        let text = self.decoder.push(id)?;
        self.text.push_str(&text);
        self.n_generated += 1;
        if self
            .sampler
            .params()
            .stop
            .iter()
            .any(|s| !s.is_empty() && self.text.contains(s.as_str()))
        {
            self.done = true;
        }
        self.pending = Some(id);
        Ok(Some(Token { id, text }))
    }
}

impl Drop for Generate<'_, '_> {
    /// A sampled token that was given out but not evaluated (the generation ended, or the
    /// caller stopped early) stays in the session's sequence: its next evaluation starts with
    /// it.
    fn drop(&mut self) {
        if let Some(t) = self.pending.take() {
            self.session.unevaluated = Some(t);
        }
    }
}

impl Iterator for Generate<'_, '_> {
    type Item = Result<Token>;

    fn next(&mut self) -> Option<Result<Token>> {
        if self.done {
            return None;
        }
        match self.step() {
            Ok(Some(t)) => Some(Ok(t)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                self.done = true;
                Some(Err(e))
            }
        }
    }
}

/// `tokens` cut into as few blocks of at most `batch` (≥ 1) tokens as possible, whose sizes
/// differ by at most one (the longer ones first): a prompt one token over the batch becomes two
/// half blocks, not a full block and a one-token block whose products read every weight for a
/// single token.
fn prompt_blocks(tokens: &[u32], batch: usize) -> Vec<&[u32]> {
    let n = tokens.len().div_ceil(batch.max(1));
    let mut out = Vec::with_capacity(n);
    let mut rest = tokens;
    for i in 0..n {
        let len = tokens.len() / n + usize::from(i < tokens.len() % n);
        let (block, tail) = rest.split_at(len);
        out.push(block);
        rest = tail;
    }
    out
}

/// The logits block `i` of `n` returns: the last block's last token's; none before it.
fn last_block(i: usize, n: usize) -> Logits {
    if i + 1 == n {
        Logits::Last
    } else {
        Logits::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As few blocks as the batch allows, none longer than it, sizes within one token of each
    /// other, every token once and in order.
    #[test]
    fn prompt_blocks_are_balanced() {
        for (n, batch, want) in [
            (515usize, 256usize, vec![172usize, 172, 171]),
            (257, 256, vec![129, 128]),
            (256, 256, vec![256]),
            (5, 2, vec![2, 2, 1]),
            (1, 64, vec![1]),
            (0, 64, vec![]),
            (3, 0, vec![1, 1, 1]),
            (10, 3, vec![3, 3, 2, 2]),
        ] {
            let toks: Vec<u32> = (0..n as u32).collect();
            let blocks = prompt_blocks(&toks, batch);
            assert_eq!(
                blocks.iter().map(|b| b.len()).collect::<Vec<_>>(),
                want,
                "{n} / {batch}"
            );
            assert_eq!(blocks.concat(), toks);
        }
        let sizes: Vec<usize> = prompt_blocks(&vec![0; 1001], 16)
            .iter()
            .map(|b| b.len())
            .collect();
        assert_eq!(sizes.len(), 63);
        assert!(sizes.iter().all(|&l| l == 16 || l == 15), "{sizes:?}");
        assert_eq!(last_block(2, 3), Logits::Last);
        assert_eq!(last_block(0, 3), Logits::None);
    }
}
