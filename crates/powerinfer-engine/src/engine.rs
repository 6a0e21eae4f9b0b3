//! The generation API: [`Engine`] (a loaded model, its tokenizer and a thread pool) and
//! [`Session`] (one sequence of a KV cache, with text generation and statistics).
//!
//! ```no_run
//! use powerinfer_engine::engine::{Engine, EngineOptions};
//! use powerinfer_engine::sampling::SamplingParams;
//!
//! let engine = Engine::load("model.powerinfer.gguf", EngineOptions::default())?;
//! let mut session = engine.session();
//! for token in session.generate("Once upon a time", SamplingParams::greedy(32)) {
//!     print!("{}", token?.text);
//! }
//! eprintln!("decode: {:.1} tokens/s", session.stats().decode_tps());
//! # Ok::<(), powerinfer_engine::error::EngineError>(())
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use powerinfer_gguf::GgufFile;
use powerinfer_kernels_cpu::{MatMul, ThreadPool};

use crate::error::{EngineError, Result};
/// A block of one sequence's new tokens in a batch (re-exported from [`forward`]).
pub use crate::forward::Segment;
use crate::forward::{self, EvalOutput, FfnObserver, ForwardOptions};
use crate::kv_cache::{KvCache, SeqId};
use crate::model::Model;
use crate::profile::OpProfile;
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// Environment variable that overrides the predictor threshold (as PowerInfer's).
pub const THRESHOLD_ENV: &str = "LLAMA_SPARSE_PRED_THRESHOLD";

/// Options of [`Engine::load`].
#[derive(Clone, Debug, PartialEq)]
pub struct EngineOptions {
    /// Worker threads (the caller counts as one); 0 = all available cores.
    pub threads: usize,
    /// Predictor threshold θ; `None` = env [`THRESHOLD_ENV`], else the file's
    /// `powerinfer.sparse_threshold`, else 0.
    pub sparse_threshold: Option<f32>,
    /// Compute every FFN neuron even for PowerInfer files (for comparison with the sparse path).
    pub dense: bool,
    /// KV cache positions per sequence; 0 = the model's training context length.
    pub ctx_len: usize,
    /// Prompt tokens evaluated per block.
    pub batch: usize,
    /// Map the file (`true`, the default: loading is nearly free and the weights stay in the
    /// OS page cache) or read it into anonymous memory with transparent huge pages requested
    /// (`false`, llama.cpp's `--no-mmap`). Copying helps decode where the page cache holds the
    /// file in 4 KiB pages (measured then: TinyLlama shape, 2 threads, Q4_0 sparse +3-13%, F16
    /// dense up to +33%); where it holds it in 2 MiB folios (ext4/XFS on Linux ≥ 6.16, see
    /// [`GgufFile::open`]) alternated runs showed no difference on a Zen 4 VM; on a Xeon VM the
    /// copy stayed faster (TinyLlama F16 sparse +17%, 7B Q4_0 dense +7%). Loading then costs a
    /// copy (7B Q4_0: 0.52–0.55 s on that Xeon instead of 20 ms).
    pub mmap: bool,
    /// Copy the dense Q4_0 matrices (attention, a dense file's FFN, the output head) into a
    /// layout whose one-token product needs less arithmetic ([`MatMul::pack_q4_0`]; results
    /// unchanged, bit for bit), as llama.cpp repacks Q4_0 by default. Each matrix is copied at
    /// its first one-token product (the first decode step; prompts read the file's layout, so
    /// loading and the first token cost nothing more); [`Engine::repack_now`] copies them all
    /// at once instead. Costs those matrices' size in anonymous memory next to the file's
    /// pages, which prompts still read. Only on CPUs with the packed kernel (AVX-512).
    /// Measured on a Xeon VM (2 threads, alternated runs, copies made before timing):
    /// TinyLlama-shaped Q4_0 dense 43.8–44.6 vs 37.5–37.7 tok/s (llama.cpp ~40), sparse no
    /// difference (83.6–88.0 vs 85.0–87.6); LLaMA-7B-shaped dense 6.67–7.10 vs 5.83–6.12,
    /// sparse 12.3–12.7 vs 11.2–11.9. But the copies are new memory: 0.65 s for a 7B file's
    /// dense matrices in a warm process, 2–8 s in a fresh one while the page cache filled the
    /// RAM (huge-page faults stalled in reclaim and compaction), so 64 tokens of a 7B file took
    /// 10.5–14.5 s end to end against 11.5 s without: off by default. On a Zen 4 VM: +1–12%
    /// while the host gave ~45 GB/s, no difference at ~30 GB/s. Since the file-layout
    /// product reads one row at a time with near prefetches, TinyLlama dense gains
    /// nothing (41.1–42.7 vs 41.3–43.1 tok/s, alternated runs); 7B dense still gained 12–18%
    /// (6.04–6.55 vs 5.37–5.54) in a slow phase of the host, with a seventh of the file's
    /// pages cached in small folios.
    ///
    /// [`MatMul::pack_q4_0`]: powerinfer_kernels_cpu::MatMul::pack_q4_0
    pub repack: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            sparse_threshold: None,
            dense: false,
            ctx_len: 0,
            batch: 64,
            mmap: true,
            repack: false,
        }
    }
}

/// A loaded model ready to evaluate tokens.
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    pool: ThreadPool,
    forward: ForwardOptions,
    ctx_len: usize,
    batch: usize,
    load_time: Duration,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the tokenizer: its vocabulary would fill the screen.
        f.debug_struct("Engine")
            .field("model", &self.model)
            .field("threads", &self.pool.n_threads())
            .field("forward", &self.forward)
            .field("ctx_len", &self.ctx_len)
            .finish_non_exhaustive()
    }
}

/// Resolves θ: the option, else the environment variable, else the file's key, else 0.
fn resolve_threshold(option: Option<f32>, file: Option<f32>) -> f32 {
    let env = std::env::var(THRESHOLD_ENV)
        .ok()
        .and_then(|s| s.trim().parse::<f32>().ok());
    option.or(env).or(file).unwrap_or(0.0)
}

impl Engine {
    /// Reads or maps the model file ([`EngineOptions::mmap`]), binds its tensors, builds its tokenizer and starts the thread pool.
    pub fn load(path: impl AsRef<Path>, options: EngineOptions) -> Result<Engine> {
        let start = Instant::now();
        let path = path.as_ref();
        let file = if options.mmap {
            GgufFile::open(path)?
        } else {
            GgufFile::open_in_memory(path)?
        };
        let mut model = Model::from_file(file)?;
        let tokenizer = Tokenizer::from_gguf(model.file())?;
        let threads = if options.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            options.threads
        };
        let pool = ThreadPool::new(threads);
        if options.repack {
            model.plan_repack(&MatMul::new(&pool));
        }
        let threshold = resolve_threshold(
            options.sparse_threshold,
            model.hparams.file_sparse_threshold,
        );
        let ctx_len = if options.ctx_len == 0 {
            model.hparams.n_ctx_train
        } else {
            options.ctx_len
        };
        Ok(Engine {
            tokenizer,
            pool,
            forward: ForwardOptions {
                threshold,
                dense: options.dense,
            },
            ctx_len,
            batch: options.batch.max(1),
            load_time: start.elapsed(),
            model,
        })
    }

    /// Makes now the repacked copies that [`EngineOptions::repack`] would otherwise make at
    /// each matrix's first one-token product, so that the first decode steps take no longer
    /// than the others (e.g. before timing them, or before serving). Does nothing when
    /// repacking is off or the CPU has no packed kernel.
    pub fn repack_now(&self) -> Result<()> {
        self.model.repack_now(&MatMul::new(&self.pool))
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The predictor threshold in effect.
    pub fn threshold(&self) -> f32 {
        self.forward.threshold
    }

    /// Whether the FFN runs sparsely (a PowerInfer file without [`EngineOptions::dense`]).
    pub fn is_sparse(&self) -> bool {
        self.model.is_sparse() && !self.forward.dense
    }

    /// Threads in use.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// KV cache positions per sequence.
    pub fn ctx_len(&self) -> usize {
        self.ctx_len
    }

    /// Time [`load`](Self::load) took.
    pub fn load_time(&self) -> Duration {
        self.load_time
    }

    /// An empty KV cache sized for this model.
    pub fn new_cache(&self) -> KvCache {
        let hp = &self.model.hparams;
        KvCache::new(hp.n_layer, hp.n_embd_kv(), self.ctx_len)
    }

    /// Evaluates `tokens` as the next positions of sequence `seq` of `cache` (one block);
    /// returns the logits of every token (`all_logits`) or of the last one.
    pub fn eval(
        &self,
        cache: &mut KvCache,
        seq: SeqId,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<EvalOutput> {
        forward::eval(
            &self.model,
            &self.pool,
            self.forward,
            cache,
            seq,
            tokens,
            all_logits,
        )
    }

    /// [`Engine::eval`], adding each operation's time, calls and bytes read to `prof` (see
    /// [`crate::profile`]).
    pub fn eval_profiled(
        &self,
        cache: &mut KvCache,
        seq: SeqId,
        tokens: &[u32],
        all_logits: bool,
        prof: &mut OpProfile,
    ) -> Result<EvalOutput> {
        forward::eval_profiled(
            &self.model,
            &self.pool,
            self.forward,
            cache,
            seq,
            tokens,
            all_logits,
            prof,
        )
    }

    /// [`Engine::eval`] with an observer of every layer's FFN (computed densely, see
    /// [`forward::eval_observed`]).
    pub fn eval_observed(
        &self,
        cache: &mut KvCache,
        seq: SeqId,
        tokens: &[u32],
        all_logits: bool,
        observer: &mut dyn FfnObserver,
    ) -> Result<EvalOutput> {
        forward::eval_observed(
            &self.model,
            &self.pool,
            self.forward,
            cache,
            seq,
            tokens,
            all_logits,
            Some(observer),
        )
    }

    /// Evaluates several sequences' new tokens in one pass: prompt blocks and decode tokens of
    /// different sequences side by side (continuous batching). Every weight is read once for the
    /// whole batch. Returns one [`EvalOutput`] per segment; see [`forward::eval_batch`] for the
    /// rounding and error rules.
    pub fn eval_batch(
        &self,
        cache: &mut KvCache,
        segments: &[Segment<'_>],
        all_logits: bool,
    ) -> Result<Vec<EvalOutput>> {
        forward::eval_batch(
            &self.model,
            &self.pool,
            self.forward,
            cache,
            segments,
            all_logits,
        )
    }

    /// One decode step for a batch of `(sequence, token)` pairs: each token is appended to its
    /// sequence and the logits of each entry are returned in order. The tokens are evaluated
    /// together ([`Engine::eval_batch`]): each weight is read once per step for the whole batch.
    pub fn decode(&self, cache: &mut KvCache, batch: &[(SeqId, u32)]) -> Result<Vec<EvalOutput>> {
        let segments: Vec<Segment<'_>> = batch
            .iter()
            .map(|(seq, tok)| Segment {
                seq: *seq,
                tokens: std::slice::from_ref(tok),
            })
            .collect();
        self.eval_batch(cache, &segments, false)
    }

    /// A new session (its own KV cache with one sequence).
    pub fn session(&self) -> Session<'_> {
        let mut cache = self.new_cache();
        let seq = cache.add_sequence();
        Session {
            engine: self,
            cache,
            seq,
            stats: Stats {
                load_time: self.load_time,
                ..Stats::default()
            },
            profile: None,
            unevaluated: None,
        }
    }
}

/// Timings and sparsity of a session.
#[derive(Clone, Debug, Default, PartialEq)]
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

    fn record(&mut self, out: &EvalOutput) {
        self.density_sum += out.density.iter().map(|&d| d as f64).sum::<f64>();
        self.density_tokens += out.density.len();
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
    /// The last token [`Session::generate`] sampled and gave out, which no logits were needed
    /// for yet: evaluated first by the session's next evaluation (so a generation that ends
    /// spends no forward pass on its last token, and the sequence still holds it after).
    unevaluated: Option<u32>,
}

impl<'e> Session<'e> {
    /// The engine.
    pub fn engine(&self) -> &'e Engine {
        self.engine
    }

    /// Statistics so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Starts (`true`, from an empty profile) or stops recording where the decode steps'
    /// time goes ([`Session::profile`]). Only single-token decode steps (those of
    /// [`Session::generate`] after the prompt) are recorded; the clock is read between
    /// operations, which costs well under a microsecond per layer.
    pub fn set_profiling(&mut self, on: bool) {
        self.profile = on.then(OpProfile::new);
    }

    /// Time, calls and bytes read per operation over the decode steps since
    /// [`set_profiling(true)`](Session::set_profiling); `None` when not recording.
    pub fn profile(&self) -> Option<&OpProfile> {
        self.profile.as_ref()
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

    /// Evaluates `tokens` (in blocks of [`EngineOptions::batch`]) and returns the logits of the
    /// last one (`n_vocab` values). Counted as prompt time. On an error the session is reset
    /// (its KV cache could hold part of a block).
    pub fn eval(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut last = Vec::new();
        for block in tokens.chunks(self.engine.batch) {
            last = self.eval_block(block, false, true)?;
        }
        Ok(last)
    }

    /// Evaluates `tokens` and returns the logits of every position (`tokens.len() · n_vocab`
    /// values, position after position). Counted as prompt time.
    pub fn eval_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut all = Vec::with_capacity(tokens.len() * self.engine.model.hparams.n_vocab);
        for block in tokens.chunks(self.engine.batch) {
            all.extend(self.eval_block(block, true, true)?);
        }
        Ok(all)
    }

    /// Evaluates `tokens` (in blocks of [`EngineOptions::batch`]) with an observer of every
    /// layer's FFN: the FFN is computed densely and the observer sees its input, true
    /// activations and predictor scores (profiling, predictor training and evaluation).
    /// Returns the logits of the last token. Counted as prompt time.
    pub fn eval_observed(
        &mut self,
        tokens: &[u32],
        observer: &mut dyn FfnObserver,
    ) -> Result<Vec<f32>> {
        let mut last = Vec::new();
        for block in tokens.chunks(self.engine.batch) {
            last = self.eval_block_with(block, false, true, Some(&mut *observer))?;
        }
        Ok(last)
    }

    fn eval_block(&mut self, tokens: &[u32], all: bool, prompt: bool) -> Result<Vec<f32>> {
        self.eval_block_with(tokens, all, prompt, None)
    }

    fn eval_block_with(
        &mut self,
        tokens: &[u32],
        all: bool,
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
        let out = match (observer, self.profile.as_mut()) {
            (Some(o), _) => e.eval_observed(&mut self.cache, self.seq, tokens, all, o),
            (None, Some(p)) if !prompt => {
                e.eval_profiled(&mut self.cache, self.seq, tokens, all, p)
            }
            (None, _) => e.eval(&mut self.cache, self.seq, tokens, all),
        }
        .inspect_err(|_| self.reset())?;
        let dt = start.elapsed();
        if prompt {
            self.stats.prompt_tokens += tokens.len();
            self.stats.prompt_time += dt;
        } else {
            self.stats.decode_tokens += tokens.len();
            self.stats.decode_time += dt;
        }
        self.stats.record(&out);
        let mut logits = out.logits;
        if all && first.is_some() {
            // The caller asked for the rows of its own tokens.
            logits.drain(..e.model.hparams.n_vocab);
        }
        Ok(logits)
    }

    /// Generates text after `prompt` (tokenized with BOS and special tokens parsed), continuing
    /// the session's sequence. The iterator evaluates the prompt on its first call and then
    /// one token per call; it ends after `max_tokens` tokens, at an end-of-generation token
    /// (not returned) if `stop_at_eog`, or after the token whose text completes a stop string.
    pub fn generate<'s>(&'s mut self, prompt: &str, params: SamplingParams) -> Generate<'s, 'e> {
        let engine = self.engine;
        let add_bos = self.n_past() == 0;
        let prompt_tokens = engine.tokenizer.encode(prompt, add_bos, true);
        Generate {
            decoder: engine.tokenizer.stream_decoder(false),
            session: self,
            sampler: Sampler::new(params),
            prompt: Some(prompt_tokens),
            logits: Vec::new(),
            pending: None,
            text: String::new(),
            n_generated: 0,
            done: false,
        }
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
            prompt.iter().for_each(|&t| self.sampler.accept(t));
            self.logits = self.session.eval(&prompt)?;
        }
        if self.n_generated >= self.sampler.params().max_tokens {
            // The last token given out stays pending: `Drop` hands it to the session.
            return Ok(None);
        }
        if let Some(tok) = self.pending.take() {
            self.logits = self.session.eval_block(&[tok], false, false)?;
        }
        let id = self.sampler.sample(&mut self.logits);
        self.sampler.accept(id);
        let tokenizer = &self.session.engine.tokenizer;
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
