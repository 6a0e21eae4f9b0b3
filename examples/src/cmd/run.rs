//! `powerinfer run`: generate text with the engine (the CPU, and a device beside it: `--gpu`).
//!
//! With `-m MODEL` it streams the generated text to stdout and prints a timing summary to
//! stderr (or, with `--json`, one JSON object to stdout). Without `-m` it runs a built-in demo:
//! a synthetic ReLU-sparse model (generated once into a cache directory, with its dense twin)
//! decoded densely (the twin: full GEMVs over every neuron) and with the predictor-driven sparse
//! FFN, and the two decode speeds side by side.

use std::path::PathBuf;

use powerinfer_engine::sampling::SamplingParams;
use powerinfer_engine::OpProfile;
use powerinfer_engine::{AxpyCoefficients, Engine, EngineOptions, Stats};
use powerinfer_kernels_cpu::ThreadPool;

/// Arguments of `powerinfer run`.
#[derive(clap::Args)]
pub struct Args {
    /// The model (PowerInfer `PWRI` or dense GGUF, `llama`, `bamboo`, `falcon` or `opt`).
    /// Without one: the demo.
    #[command(flatten)]
    pub model: super::model::ModelArgs<false>,
    /// Prompt.
    #[arg(short = 'p', long = "prompt", default_value = "Once upon a time")]
    pub prompt: String,
    /// Read the prompt from this file instead (UTF-8, used as is).
    #[arg(short = 'f', long = "file", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,
    /// Tokens to generate; -1: until an end-of-generation token or a stop string (the context
    /// is shifted when it fills); -2: until the context is full.
    #[arg(
        short = 'n',
        long = "n-predict",
        default_value_t = 64,
        allow_negative_numbers = true,
        value_parser = tokens_to_generate
    )]
    pub n_predict: i64,
    /// Context shift: tokens kept at the start (besides a BOS) when a full context is halved.
    #[arg(long = "keep", default_value_t = 0)]
    pub keep: usize,
    /// Stop with an error when the context is full instead of shifting it.
    #[arg(long = "no-context-shift")]
    pub no_context_shift: bool,
    /// Chat in the terminal (llama.cpp's `-cnv`): each line you type is a user message, the
    /// answer streams back; the conversation stays in the KV cache; Ctrl-C stops the answer,
    /// Ctrl-D (end of input) ends the chat.
    #[arg(short = 'i', long = "conversation", visible_alias = "interactive")]
    pub conversation: bool,
    /// The system message of a conversation (`-sys`).
    #[arg(long = "system-prompt")]
    pub system_prompt: Option<String>,
    /// Chat template: a file of Jinja text or a name (chatml, llama2, mistral, zephyr, vicuna,
    /// gemma, llama3); default: the model's, else ChatML.
    #[arg(long = "chat-template")]
    pub chat_template: Option<String>,
    /// Threads (0 = all cores).
    #[arg(short = 't', long = "threads", default_value_t = 0, value_parser = crate::cmd::whole_number)]
    pub threads: usize,
    /// Temperature (≤ 0: greedy, as llama.cpp).
    #[arg(long = "temp", default_value_t = 0.8, allow_negative_numbers = true, value_parser = finite)]
    pub temp: f32,
    /// Top-k (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Top-p, in (0, 1] (1 = off).
    #[arg(long = "top-p", default_value_t = 0.95, allow_negative_numbers = true, value_parser = share_above_zero)]
    pub top_p: f32,
    /// Min-p, in [0, 1] (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05, allow_negative_numbers = true, value_parser = share)]
    pub min_p: f32,
    /// Locally typical sampling, in (0, 1] (1 = off).
    #[arg(long = "typical", default_value_t = 1.0, allow_negative_numbers = true, value_parser = share_above_zero)]
    pub typical: f32,
    /// XTC: the chance per token of dropping the top choices, in [0, 1] (0 = off).
    #[arg(long = "xtc-probability", default_value_t = 0.0, allow_negative_numbers = true, value_parser = share)]
    pub xtc_probability: f32,
    /// XTC: tokens at or above this probability are the top choices (above 0.5: off).
    #[arg(long = "xtc-threshold", default_value_t = 0.1, allow_negative_numbers = true, value_parser = share)]
    pub xtc_threshold: f32,
    /// Mirostat: 0 off, 1 (v1), 2 (v2); replaces top-k, typical, top-p, min-p and XTC.
    #[arg(long = "mirostat", default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub mirostat: u8,
    /// Mirostat's learning rate (η).
    #[arg(long = "mirostat-lr", default_value_t = 0.1, allow_negative_numbers = true, value_parser = positive)]
    pub mirostat_lr: f32,
    /// Mirostat's target entropy (τ).
    #[arg(long = "mirostat-ent", default_value_t = 5.0, allow_negative_numbers = true, value_parser = positive)]
    pub mirostat_ent: f32,
    /// Add BIAS to token ID's logit: `ID+BIAS` or `ID-BIAS` (`-inf` forbids it), e.g.
    /// `15043+1` or `15043-inf`; may be given several times (llama.cpp's `--logit-bias`).
    #[arg(short = 'l', long = "logit-bias", value_parser = logit_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// DRY: penalty scale for tokens that extend a repeat of the recent text (0 = off).
    #[arg(long = "dry-multiplier", default_value_t = 0.0, allow_negative_numbers = true, value_parser = non_negative)]
    pub dry_multiplier: f32,
    /// DRY: growth of the penalty per token of repeat (at least 1).
    #[arg(long = "dry-base", default_value_t = 1.75, allow_negative_numbers = true, value_parser = at_least_one)]
    pub dry_base: f32,
    /// DRY: repeats up to this many tokens are free.
    #[arg(long = "dry-allowed-length", default_value_t = 2)]
    pub dry_allowed_length: usize,
    /// DRY: how many of the last tokens it looks at (-1: all, 0: off).
    #[arg(long = "dry-penalty-last-n", default_value_t = -1, allow_negative_numbers = true, value_parser = clap::value_parser!(i64).range(-1..))]
    pub dry_penalty_last_n: i64,
    /// DRY: text a repeat does not reach across (may be given several times; default `\n`,
    /// `:`, `"` and `*`, as llama.cpp).
    #[arg(long = "dry-sequence-breaker")]
    pub dry_sequence_breaker: Vec<String>,
    /// Repetition penalty over the last `--repeat-last-n` tokens, positive (1 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0, allow_negative_numbers = true, value_parser = positive)]
    pub repeat_penalty: f32,
    /// Presence penalty: subtracted from the logit of every recent token (0 = off).
    #[arg(long = "presence-penalty", default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty: subtracted once per occurrence of a recent token (0 = off).
    #[arg(long = "frequency-penalty", default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// How many of the last tokens (prompt included) the penalties look at (0 = none).
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Stop once the generated text contains this string (may be given several times).
    #[arg(short = 'r', long = "stop", alias = "reverse-prompt")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens (EOS, EOT).
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Random seed.
    #[arg(short = 's', long = "seed", default_value_t = 0)]
    pub seed: u64,
    /// Context size (0 = the model's).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0, value_parser = crate::cmd::whole_number)]
    pub ctx_size: usize,
    /// Most prompt tokens evaluated per block (the prompt is cut into equal blocks).
    #[arg(short = 'b', long = "batch-size", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: u32,
    /// Predictor threshold θ (default: env LLAMA_SPARSE_PRED_THRESHOLD, the file's key, 0).
    #[arg(long = "sparse-threshold")]
    pub sparse_threshold: Option<f32>,
    /// Compute every FFN neuron (ignore the predictor), for comparison.
    #[arg(long)]
    pub dense: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Read the model into memory (huge pages requested) instead of mapping it: slower load;
    /// faster decode only where the page cache holds the file in small pages (see
    /// `EngineOptions::mmap`).
    #[arg(long = "no-mmap")]
    pub no_mmap: bool,
    /// Repack dense Q4_0 matrices for a faster one-token product (llama.cpp's `--repack`; each
    /// matrix is copied at its first decode step; results unchanged; costs their size in
    /// memory; see `EngineOptions::repack`).
    #[arg(long)]
    pub repack: bool,
    /// Sparse FFN: multiply the hidden values into the down rows as int8 per block with
    /// integer dot instructions instead of f32 FMAs (`EngineOptions::axpy`; Q4_0 rows on
    /// AVX-512 with VBMI; results differ from the default by at most max|c|/254 per weight
    /// and block; the default keeps PowerInfer's arithmetic).
    #[arg(long)]
    pub int8_axpy: bool,
    /// Record where decode time goes: per operation (norms, Q/K/V, attention, predictor, FFN
    /// up/gate, FFN down, output head) its time, bytes read per token and read bandwidth,
    /// against this machine's measured read bandwidth (a table on stderr; with `--json`, a
    /// `profile` array); and the prompt's time per operation (`prompt_profile`).
    #[arg(long)]
    pub profile: bool,
    /// With a device: print what the run-time scheduling did (per layer: CPU and device
    /// times, the device's share of active neurons, recall of the device's neurons,
    /// rebalances, cache migrations, the load-time calibration); with `--json`, a `schedule`
    /// object.
    #[arg(long)]
    pub stats: bool,
    /// The device beside the CPU.
    #[command(flatten)]
    pub device: super::device::DeviceArgs,
    /// The KV cache's types.
    #[command(flatten)]
    pub cache: super::CacheTypes,
}

/// A finite number.
fn finite(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("`{s}`: expected a number")),
    }
}

/// `ID+BIAS` or `ID-BIAS` (llama.cpp's `--logit-bias`).
fn logit_bias(s: &str) -> Result<(u32, f32), String> {
    let at = s
        .find(['+', '-'])
        .ok_or_else(|| format!("`{s}`: expected TOKEN_ID+BIAS or TOKEN_ID-BIAS"))?;
    let id = s[..at]
        .trim()
        .parse::<u32>()
        .map_err(|_| format!("`{s}`: `{}` is not a token id", &s[..at]))?;
    let bias = s[at..]
        .trim()
        .parse::<f32>()
        .ok()
        .filter(|b| !b.is_nan() && *b != f32::INFINITY)
        .ok_or_else(|| format!("`{s}`: `{}` is not a bias", &s[at..]))?;
    Ok((id, bias))
}

/// DRY's breaker tokens: those of `engine`'s vocabulary whose piece contains one of `breakers`
/// (none given: llama.cpp's `\n`, `:`, `"` and `*`), sorted.
pub(crate) fn dry_breaker_tokens(engine: &Engine, breakers: &[String]) -> Vec<u32> {
    let default = ["\n", ":", "\"", "*"].map(String::from);
    let breakers = if breakers.is_empty() {
        &default[..]
    } else {
        breakers
    };
    let tk = engine.tokenizer();
    (0..engine.model().hparams().n_vocab as u32)
        .filter(|&id| {
            tk.token_to_piece(id, false).is_ok_and(|piece| {
                breakers
                    .iter()
                    .any(|b| !b.is_empty() && piece.windows(b.len()).any(|w| w == b.as_bytes()))
            })
        })
        .collect()
}

/// A finite number that `ok` accepts; otherwise the error says it expected `expected`.
fn number_where(s: &str, ok: impl Fn(f32) -> bool, expected: &str) -> Result<f32, String> {
    let v = finite(s)?;
    if ok(v) {
        Ok(v)
    } else {
        Err(format!("{v}: expected {expected}"))
    }
}

/// A number ≥ 0.
fn non_negative(s: &str) -> Result<f32, String> {
    number_where(s, |v| v >= 0.0, "a number ≥ 0")
}

/// A share in [0, 1].
fn share(s: &str) -> Result<f32, String> {
    number_where(s, |v| (0.0..=1.0).contains(&v), "a value in [0, 1]")
}

/// A share in (0, 1].
fn share_above_zero(s: &str) -> Result<f32, String> {
    number_where(s, |v| v > 0.0 && v <= 1.0, "a value in (0, 1]")
}

/// `-n`: a count of tokens, -1 or -2.
fn tokens_to_generate(s: &str) -> Result<i64, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if n >= -2 => Ok(n),
        _ => Err(format!(
            "`{s}`: expected a number of tokens, -1 (until an end-of-generation token) or -2 \
             (until the context is full)"
        )),
    }
}

/// A number ≥ 1 (DRY's base).
fn at_least_one(s: &str) -> Result<f32, String> {
    number_where(s, |v| v >= 1.0, "a number ≥ 1")
}

/// A positive number.
fn positive(s: &str) -> Result<f32, String> {
    number_where(s, |v| v > 0.0, "a positive number")
}

impl Args {
    /// The sampling flags; DRY's breakers are the tokens of `engine`'s vocabulary containing
    /// one of the breaker strings.
    pub(crate) fn sampling(&self, engine: &Engine) -> Result<SamplingParams, String> {
        let n_vocab = engine.model().hparams().n_vocab;
        if let Some((id, _)) = self
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= n_vocab)
        {
            return Err(format!(
                "--logit-bias: token id {id} is outside the vocabulary of {n_vocab} tokens"
            ));
        }
        let dry_breakers = if self.dry_multiplier > 0.0 {
            dry_breaker_tokens(engine, &self.dry_sequence_breaker)
        } else {
            Vec::new()
        };
        Ok(SamplingParams::default().with(|p| {
            p.dry_multiplier = self.dry_multiplier;
            p.dry_base = self.dry_base;
            p.dry_allowed_length = self.dry_allowed_length;
            p.dry_penalty_last_n = usize::try_from(self.dry_penalty_last_n).unwrap_or(usize::MAX);
            p.dry_breakers = dry_breakers;
            p.temperature = self.temp;
            p.top_k = self.top_k;
            p.top_p = self.top_p;
            p.min_p = self.min_p;
            p.repeat_penalty = self.repeat_penalty;
            p.presence_penalty = self.presence_penalty;
            p.frequency_penalty = self.frequency_penalty;
            p.penalty_last_n = self.repeat_last_n;
            p.seed = self.seed;
            p.max_tokens = match self.n_predict {
                n if n >= 0 => n as usize,
                _ => usize::MAX,
            };
            p.stop = self.stop.clone();
            p.stop_at_eog = !self.ignore_eos;
            p.typical_p = self.typical;
            p.xtc_probability = self.xtc_probability;
            p.xtc_threshold = self.xtc_threshold;
            p.mirostat = self.mirostat;
            p.mirostat_eta = self.mirostat_lr;
            p.mirostat_tau = self.mirostat_ent;
            p.logit_bias = self.logit_bias.clone();
        }))
    }

    /// The prompt: `--file`'s contents, else `--prompt`.
    fn prompt_text(&self) -> Result<String, String> {
        match &self.file {
            Some(f) => std::fs::read_to_string(f)
                .map_err(|e| format!("cannot read the prompt file {}: {e}", f.display())),
            None => Ok(self.prompt.clone()),
        }
    }

    fn options(&self, dense: bool) -> Result<EngineOptions, String> {
        let mut o = super::engine_options(self.threads, self.sparse_threshold);
        self.device.apply(&mut o)?;
        self.cache.apply(&mut o)?;
        o.dense = dense;
        o.ctx_len = self.ctx_size;
        o.batch = self.batch_size as usize;
        o.mmap = !self.no_mmap;
        o.repack = self.repack;
        if self.int8_axpy {
            o.axpy = AxpyCoefficients::Int8;
        }
        Ok(o)
    }
}

/// Result of one generation.
struct Run {
    tokens: Vec<u32>,
    text: String,
    stats: Stats,
    prompt_tokens: usize,
    profile: Option<OpProfile>,
    prompt_profile: Option<OpProfile>,
}

fn generate(engine: &Engine, args: &Args, prompt: &str, stream: bool) -> Result<Run, String> {
    let mut session = engine.session();
    session.set_profiling(args.profile);
    // -2: until the context is full (then stop quietly); otherwise shift unless told not to.
    let until_full = args.n_predict == -2;
    session.set_context_shift((!args.no_context_shift && !until_full).then_some(args.keep));
    let mut tokens = Vec::new();
    let mut text = String::new();
    let out = super::terminal::ModelText::stdout();
    for tok in session.generate(prompt, args.sampling(engine)?) {
        let tok = match tok {
            Ok(t) => t,
            Err(powerinfer_engine::EngineError::ContextFull { .. }) if until_full => break,
            Err(e) => {
                if stream {
                    out.write("\n");
                }
                return Err(format!(
                    "{e} after {} generated tokens{}",
                    tokens.len(),
                    if args.no_context_shift {
                        " (--no-context-shift; without it the context is shifted)"
                    } else {
                        ""
                    }
                ));
            }
        };
        if stream {
            out.write(&tok.text);
        }
        tokens.push(tok.id);
        text.push_str(&tok.text);
    }
    if stream {
        out.write("\n");
    }
    let stats = session.stats().clone();
    let profile = session.profile().cloned();
    let prompt_profile = session.prompt_profile().cloned();
    Ok(Run {
        profile,
        prompt_profile,
        tokens,
        text,
        prompt_tokens: stats.prompt_tokens,
        stats,
    })
}

/// The timing summary of a generation of `generated` tokens, on stderr. The first token is
/// sampled from the prompt's evaluation, so `decode eval` counts one run fewer than the
/// tokens generated; both are said.
fn summary(label: &str, engine: &Engine, s: &Stats, generated: usize) {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    eprintln!("{label}load time = {:9.2} ms", ms(s.load_time));
    eprintln!(
        "{label}prompt eval = {:9.2} ms / {:4} tokens ({:8.2} tokens per second)",
        ms(s.prompt_time),
        s.prompt_tokens,
        s.prompt_tps()
    );
    eprintln!(
        "{label}decode eval = {:9.2} ms / {:4} runs   ({:8.2} tokens per second)",
        ms(s.decode_time),
        s.decode_tokens,
        s.decode_tps()
    );
    eprintln!("{label}generated   = {generated:4} tokens (the first from the prompt's evaluation)");
    eprintln!(
        "{label}FFN density = {:.4} ({}, θ = {}, {} threads)",
        s.ffn_density(),
        if engine.is_sparse() {
            "sparse"
        } else {
            "dense"
        },
        engine.threshold(),
        engine.threads()
    );
}

/// One row per operation of a decode profile: `(name, ms/token, MB/token, GB/s)`, then the
/// total.
fn profile_rows(p: &OpProfile) -> Vec<(&'static str, f64, f64, f64)> {
    let per = |x: f64| x / p.tokens.max(1) as f64;
    let row = |name, t: std::time::Duration, bytes: u64| {
        let s = t.as_secs_f64();
        let gbps = if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 };
        (name, per(s * 1e3), per(bytes as f64 / 1e6), gbps)
    };
    let mut rows: Vec<_> = p
        .iter()
        .map(|(op, o)| row(op.name(), o.time, o.bytes))
        .collect();
    rows.push(row("total", p.total_time(), p.total_bytes()));
    rows
}

/// The decode profile as a table on stderr, with each operation's read bandwidth against the
/// machine's (`bandwidth`, bytes/s).
pub(crate) fn print_profile(p: &OpProfile, bandwidth: f64, timeline: &str) {
    eprintln!(
        "decode profile: {} tokens, memory read bandwidth {:.1} GB/s",
        p.tokens,
        bandwidth / 1e9
    );
    eprintln!(
        "{:<12} {:>10} {:>6} {:>9} {:>7} {:>6}",
        "op", "ms/token", "share", "MB/token", "GB/s", "ratio"
    );
    let total_ms = p.total_time().as_secs_f64() * 1e3 / p.tokens.max(1) as f64;
    for (name, ms, mb, gbps) in profile_rows(p) {
        let share = if total_ms > 0.0 { ms / total_ms } else { 0.0 };
        let (gb, ratio) = if mb > 0.0 {
            (
                format!("{gbps:.1}"),
                format!("{:.2}", gbps * 1e9 / bandwidth),
            )
        } else {
            ("-".to_string(), "-".to_string())
        };
        eprintln!(
            "{name:<12} {ms:>10.3} {:>5.1}% {mb:>9.1} {gb:>7} {ratio:>6}",
            share * 100.0
        );
    }
    if let Some((launches, syncs, bytes)) = super::device::traffic_per_token(p) {
        // The host's time in the device's calls (queuing programs and copies) per launch.
        let queue_ms = (p.iter())
            .find(|(op, _)| op.name() == "device")
            .map_or(0.0, |(_, o)| {
                o.time.as_secs_f64() * 1e3 / p.tokens.max(1) as f64
            });
        let per_launch = if launches > 0.0 {
            format!(", {:.1} us of host time each", queue_ms * 1e3 / launches)
        } else {
            String::new()
        };
        eprintln!(
            "device per token: {launches:.1} kernel launches{per_launch}, {syncs:.2} host \
             waits, {:.1} KB over the link",
            bytes / 1e3
        );
        let ms = p.device.time.as_secs_f64() * 1e3 / p.tokens.max(1) as f64;
        if ms > 0.0 {
            eprintln!(
                "device timeline ({}): {ms:.3} ms per token, {:.1} tokens/s",
                timeline,
                1e3 / ms
            );
        }
    }
}

/// The prompt's profile as a table on stderr: each operation's time and share (a prompt is
/// bound by arithmetic, not by reading the weights, so no bandwidth column).
pub(crate) fn print_prompt_profile(p: &OpProfile) {
    eprintln!("prompt profile: {} tokens in {} blocks", p.tokens, p.evals);
    eprintln!("{:<12} {:>10} {:>6}", "op", "ms", "share");
    let total = p.total_time().as_secs_f64() * 1e3;
    let rows = p
        .iter()
        .map(|(op, o)| (op.name(), o.time))
        .chain(std::iter::once(("total", p.total_time())));
    for (name, t) in rows {
        let ms = t.as_secs_f64() * 1e3;
        let share = if total > 0.0 { ms / total } else { 0.0 };
        eprintln!("{name:<12} {ms:>10.1} {:>5.1}%", share * 100.0);
    }
}

/// The prompt's profile as JSON: milliseconds per operation and in total.
pub(crate) fn prompt_profile_json(p: &OpProfile) -> serde_json::Value {
    let ms = |t: std::time::Duration| t.as_secs_f64() * 1e3;
    let mut rows: Vec<serde_json::Value> = p
        .iter()
        .map(|(op, o)| serde_json::json!({ "op": op.name(), "ms": ms(o.time) }))
        .collect();
    rows.push(serde_json::json!({ "op": "total", "ms": ms(p.total_time()), "tokens": p.tokens }));
    serde_json::Value::Array(rows)
}

/// The decode profile as JSON: one object per operation and the total.
pub(crate) fn profile_json(p: &OpProfile, bandwidth: f64) -> serde_json::Value {
    let rows: Vec<serde_json::Value> = profile_rows(p)
        .into_iter()
        .map(|(name, ms, mb, gbps)| {
            serde_json::json!({
                "op": name, "ms_per_token": ms, "mb_per_token": mb, "gbps": gbps,
                "bandwidth_gbps": bandwidth / 1e9,
            })
        })
        .collect();
    serde_json::Value::Array(rows)
}

/// This machine's read bandwidth with the engine's thread count (bytes/s), for `--profile`.
pub(crate) fn bandwidth(engine: &Engine) -> f64 {
    let pool = ThreadPool::new(engine.threads());
    super::bandwidth::read_bandwidth(&pool, 1 << 30, 3)
}

fn json(run: &Run, extra: &[(&str, serde_json::Value)]) -> String {
    let s = &run.stats;
    let mut v = serde_json::json!({
        "tokens": run.tokens,
        "text": run.text,
        "prompt_tokens": run.prompt_tokens,
        "load_ms": s.load_time.as_secs_f64() * 1e3,
        "prompt_tps": s.prompt_tps(),
        "decode_tps": s.decode_tps(),
        "ffn_density": s.ffn_density(),
    });
    for (k, x) in extra {
        v[*k] = x.clone();
    }
    v.to_string()
}

/// Bytes of one sequence's KV cache at the engine's full context.
fn kv_bytes(engine: &Engine) -> u64 {
    (engine.new_cache().bytes_per_position() * engine.ctx_len()) as u64
}

/// Runs `powerinfer run`.
pub fn run(args: Args) -> Result<(), String> {
    // Read before the model loads, so that a wrong path or template name fails at once.
    let prompt = args.prompt_text()?;
    let template = if args.conversation {
        super::chat::template_source(args.chat_template.as_deref())?
    } else {
        None
    };
    let Some(model) = &args.model.path_if_given()? else {
        return demo(&args, &prompt);
    };
    let engine = super::load_engine(model, args.options(args.dense)?)?;
    warn_unused(&engine);
    for line in super::device::describe(&engine) {
        eprintln!("{line}");
    }
    if args.conversation {
        return super::chat::run(
            &engine,
            args.system_prompt.as_deref(),
            args.sampling(&engine)?,
            (!args.no_context_shift).then_some(args.keep),
            template,
        );
    }
    let run = generate(&engine, &args, &prompt, !args.json)?;
    let bw = run.profile.as_ref().map(|_| bandwidth(&engine));
    let memory = run
        .profile
        .as_ref()
        .map(|_| super::bench_decode::WeightsMemory::of(&engine, model, args.no_mmap));
    if args.json {
        let mut extra: Vec<(&str, serde_json::Value)> = match (&run.profile, bw, memory) {
            (Some(p), Some(bw), Some(m)) => vec![
                ("profile", profile_json(p, bw)),
                ("hybrid_profile", super::device::split_json(p)),
                ("device_traffic", super::device::traffic_json(p)),
                ("weights_read_gbps", (m.read_bps / 1e9).into()),
                ("weights_huge_page_share", m.huge_share.into()),
            ],
            _ => Vec::new(),
        };
        if let Some(p) = &run.prompt_profile {
            extra.push(("prompt_profile", prompt_profile_json(p)));
        }
        extra.push(("device", super::device::json(&engine.device_report())));
        let (tk, tv) = engine.kv_types();
        extra.push(("kv_type_k", tk.name().into()));
        extra.push(("kv_type_v", tv.name().into()));
        extra.push(("kv_bytes", kv_bytes(&engine).into()));
        if let (true, Some(b)) = (args.stats, engine.balance_report()) {
            extra.push(("schedule", super::device::balance_json(&b)));
        }
        println!("{}", json(&run, &extra));
    } else {
        summary("", &engine, &run.stats, run.tokens.len());
        if let Some(p) = &run.prompt_profile {
            print_prompt_profile(p);
        }
        if let (Some(p), Some(bw)) = (&run.profile, bw) {
            let timeline = super::device::timeline(&engine.device_report());
            print_profile(p, bw, &timeline);
            let (tk, tv) = engine.kv_types();
            eprintln!(
                "KV cache: K {tk}, V {tv}: {} for {} positions",
                super::human_bytes(kv_bytes(&engine)),
                engine.ctx_len()
            );
            super::device::print_split(p);
            if let Some(m) = memory {
                eprintln!("{}", m.describe(bw));
            }
        }
        if args.stats {
            match engine.balance_report() {
                Some(b) => super::device::print_balance(&b),
                None => eprintln!("scheduling: no device (--gpu)"),
            }
        }
    }
    Ok(())
}

/// Prints a warning naming the file's tensors that the model does not read (PowerInfer and
/// llama.cpp refuse such files; a stray tensor usually means a converter mismatch).
pub(crate) fn warn_unused(engine: &Engine) {
    let unused = engine.model().unused_tensors();
    if unused.is_empty() {
        return;
    }
    let shown: Vec<&str> = unused.iter().take(5).map(String::as_str).collect();
    let more = unused.len().saturating_sub(shown.len());
    eprintln!(
        "warning: {} tensor(s) in the file are not used by the {} model: {}{}",
        unused.len(),
        engine.model().hparams().arch.name(),
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        }
    );
}

fn demo(args: &Args, prompt: &str) -> Result<(), String> {
    let (path, twin) = super::demo_model::demo_files()?;
    eprintln!("================================================================");
    eprintln!(" powerinfer-rs demo: a SYNTHETIC ReLU-sparse model (random weights,");
    eprintln!(" ~10% of FFN neurons fire per token, sorted by how often they fire:");
    eprintln!(" `powerinfer reorder`). Its text is meaningless; the demo shows the");
    eprintln!(" speed of the sparse FFN against the dense one.");
    eprintln!(" model: {}", path.display());
    eprintln!(" Use `powerinfer run -m MODEL -p PROMPT` for a real model.");
    eprintln!("================================================================");
    let sparse = Engine::load(&path, args.options(false)?).map_err(|e| e.to_string())?;
    for line in super::device::describe(&sparse) {
        eprintln!("{line}");
    }
    // The dense baseline is the dense twin (llama.cpp's layout: full GEMVs over every neuron),
    // the fastest way to compute every neuron, on the CPU.
    let mut cpu = args.options(false)?;
    cpu.device = Default::default();
    let dense = Engine::load(&twin, cpu).map_err(|e| e.to_string())?;
    eprintln!("--- dense FFN (dense twin, every neuron) ---");
    let d = generate(&dense, args, prompt, false)?;
    summary("dense  ", &dense, &d.stats, d.tokens.len());
    eprintln!("--- sparse FFN (predictor) ---");
    let s = generate(&sparse, args, prompt, !args.json)?;
    summary("sparse ", &sparse, &s.stats, s.tokens.len());
    let ratio = s.stats.decode_tps() / d.stats.decode_tps().max(1e-9);
    let bw = s.profile.as_ref().map(|_| bandwidth(&sparse));
    if args.json {
        let mut extra = vec![
            ("dense_decode_tps", d.stats.decode_tps().into()),
            ("sparse_speedup", ratio.into()),
        ];
        if let (Some(dp), Some(sp), Some(bw)) = (&d.profile, &s.profile, bw) {
            extra.push(("dense_profile", profile_json(dp, bw)));
            extra.push(("profile", profile_json(sp, bw)));
        }
        println!("{}", json(&s, &extra));
    } else if let (Some(dp), Some(sp), Some(bw)) = (&d.profile, &s.profile, bw) {
        eprintln!("--- dense FFN ---");
        print_profile(dp, bw, "wall clock");
        eprintln!("--- sparse FFN ---");
        print_profile(sp, bw, "wall clock");
    }
    eprintln!(
        "decode: dense {:.2} tokens/s, sparse {:.2} tokens/s, sparse/dense = {:.2}x (FFN density {:.3})",
        d.stats.decode_tps(),
        s.stats.decode_tps(),
        ratio,
        s.stats.ffn_density()
    );
    Ok(())
}
