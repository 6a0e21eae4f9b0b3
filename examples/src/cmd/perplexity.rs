//! `powerinfer perplexity -m MODEL -f TEXT [-c N] [--chunks K] [-b N]`: the perplexity of a
//! model on a text, computed as llama.cpp's `llama-perplexity` computes it.
//!
//! The text is tokenized with a BOS first and cut into chunks of `-c` tokens (at least two
//! chunks' worth is needed). Each chunk is evaluated from an empty cache with its first token
//! replaced by BOS, in batches of `-b` tokens with every position's logits; the second half of
//! the chunk is scored: for positions `c/2 .. c-2` the negative log-probability of the next
//! token (log-softmax in f64). After each chunk `[i]ppl` is printed with the running estimate
//! `exp(mean NLL)`; the final estimate is `exp(mean NLL)` with its error
//! `sqrt((mean NLL² − mean NLL²) / (count − 1)) · ppl`.

use std::path::PathBuf;

use powerinfer_engine::{Batch, Engine, EvalOptions};
use serde_json::json;

/// Arguments of `powerinfer perplexity`.
#[derive(clap::Args)]
pub struct Args {
    /// The model.
    #[command(flatten)]
    model: super::model::ModelArgs,
    /// The text (UTF-8).
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    /// Tokens per chunk.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512, value_parser = crate::cmd::whole_number)]
    ctx: usize,
    /// Chunks to evaluate at most (default: all).
    #[arg(long = "chunks")]
    chunks: Option<usize>,
    /// Tokens per evaluated batch (at most the chunk).
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    batch: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0, value_parser = crate::cmd::whole_number)]
    threads: usize,
    /// Predictor threshold (default: as `powerinfer run`).
    #[arg(long)]
    sparse_threshold: Option<f32>,
    /// Compute every FFN neuron of a PowerInfer file.
    #[arg(long)]
    dense: bool,
    /// Print one JSON object instead of the running estimates.
    #[arg(long)]
    json: bool,
    /// The device beside the CPU.
    #[command(flatten)]
    device: super::device::DeviceArgs,
    /// The KV cache's types.
    #[command(flatten)]
    cache: super::CacheTypes,
}

/// The result of scoring a text.
#[derive(Clone, Debug, PartialEq)]
pub struct Perplexity {
    /// The running estimate after each chunk.
    pub chunks: Vec<f64>,
    /// The final estimate.
    pub ppl: f64,
    /// Its error (`None` when the variance came out negative).
    pub err: Option<f64>,
    /// Tokens scored.
    pub count: usize,
    /// Tokens in the text.
    pub tokens: usize,
}

/// `−log softmax(logits)[token]`, in f64 as llama.cpp's `log_softmax`.
fn nll(logits: &[f32], token: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
    -(f64::from(logits[token as usize] - max) - sum.ln())
}

/// Scores `tokens` (BOS first) in chunks of `ctx` (see the module documentation).
pub fn perplexity(
    engine: &Engine,
    mut tokens: Vec<u32>,
    ctx: usize,
    max_chunks: Option<usize>,
    batch: usize,
    mut progress: impl FnMut(usize, f64),
) -> Result<Perplexity, String> {
    if ctx < 2 {
        return Err(format!("-c {ctx}: a chunk needs at least 2 tokens"));
    }
    if tokens.len() < 2 * ctx {
        return Err(format!(
            "the text has {} tokens; perplexity with a context of {ctx} needs at least {} \
             (two chunks, as llama.cpp asks)",
            tokens.len(),
            2 * ctx
        ));
    }
    let n_chunk = (tokens.len() / ctx).min(max_chunks.unwrap_or(usize::MAX));
    let n_batch = batch.clamp(1, ctx);
    let bos = engine.tokenizer().bos();
    let nv = engine.model().hparams().n_vocab;
    let first = ctx / 2;
    let (mut sum, mut sum2, mut count) = (0f64, 0f64, 0usize);
    let mut chunks = Vec::with_capacity(n_chunk);
    for i in 0..n_chunk {
        let start = i * ctx;
        let mut cache = engine.new_cache();
        let seq = cache.add_sequence();
        let mut logits = Vec::with_capacity(ctx * nv);
        for b0 in (start..start + ctx).step_by(n_batch) {
            let b1 = (b0 + n_batch).min(start + ctx);
            let original = tokens[b0];
            if b0 == start {
                if let Some(bos) = bos {
                    tokens[b0] = bos;
                }
            }
            let out = engine
                .eval(
                    &mut cache,
                    &Batch::one(seq, &tokens[b0..b1]),
                    EvalOptions::new().all_logits(),
                )
                .map_err(|e| e.to_string())?;
            tokens[b0] = original;
            logits.extend_from_slice(&out[0].logits);
        }
        for p in first..ctx - 1 {
            let v = nll(&logits[p * nv..(p + 1) * nv], tokens[start + p + 1]);
            sum += v;
            sum2 += v * v;
        }
        count += ctx - 1 - first;
        let running = (sum / count as f64).exp();
        chunks.push(running);
        progress(i + 1, running);
    }
    let mean = sum / count as f64;
    let var = sum2 / count as f64 - mean * mean;
    let ppl = mean.exp();
    let err = (var > 0.0).then(|| (var / (count as f64 - 1.0)).sqrt() * ppl);
    Ok(Perplexity {
        chunks,
        ppl,
        err,
        count,
        tokens: tokens.len(),
    })
}

/// Runs `powerinfer perplexity`.
pub fn run(args: Args) -> Result<(), String> {
    let text = std::fs::read_to_string(&args.file).map_err(|e| super::file_error(&args.file, e))?;
    let mut o = super::engine_options(args.threads, args.sparse_threshold);
    args.device.apply(&mut o)?;
    args.cache.apply(&mut o)?;
    o.dense = args.dense;
    o.ctx_len = args.ctx.max(2);
    o.batch = args.batch.clamp(1, args.ctx.max(1));
    let model = args.model.path()?;
    let engine = super::load_engine(&model, o)?;
    for line in super::device::describe(&engine) {
        eprintln!("{line}");
    }
    let tokens = engine.tokenizer().encode(&text, true, false);
    let t0 = std::time::Instant::now();
    let json = args.json;
    let r = perplexity(
        &engine,
        tokens,
        args.ctx,
        args.chunks,
        args.batch,
        |i, p| {
            if !json {
                print!("[{i}]{p:.4},");
                let _ = std::io::Write::flush(&mut std::io::stdout());
            }
        },
    )
    .map_err(|e| format!("{}: {e}", args.file.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    if json {
        println!(
            "{}",
            json!({
                "model": model.display().to_string(),
                "mode": if engine.is_sparse() { "sparse" } else { "dense" },
                "n_ctx": args.ctx,
                "tokens": r.tokens,
                "scored": r.count,
                "chunks": r.chunks,
                "ppl": r.ppl,
                "ppl_err": r.err,
                "seconds": secs,
            })
        );
    } else {
        println!();
        match r.err {
            Some(e) => println!("Final estimate: PPL = {:.4} +/- {e:.5}", r.ppl),
            None => println!("Final estimate: PPL = {:.4} (negative variance)", r.ppl),
        }
        eprintln!(
            "{} chunks of {} tokens, {} scored, {:.1} s ({:.1} tokens/s)",
            r.chunks.len(),
            args.ctx,
            r.count,
            secs,
            (r.chunks.len() * args.ctx) as f64 / secs
        );
    }
    Ok(())
}
