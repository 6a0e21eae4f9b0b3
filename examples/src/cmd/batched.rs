//! `powerinfer batched -m MODEL -p PROMPT --parallel N -n LEN`: N sequences continued from one
//! prompt, decoded together (as llama.cpp's and PowerInfer's `batched` example): the prompt is
//! evaluated once and its KV cache copied to every sequence; each decode step evaluates one
//! token of every unfinished sequence in one batch. The same N continuations are then decoded
//! one sequence after another, and the two speeds are printed side by side.

use std::time::{Duration, Instant};

use powerinfer_engine::{
    Batch, Engine, EvalOptions, KvCache, OpProfile, Sampler, SamplingParams, SeqId,
};
use serde_json::json;

/// Arguments of `powerinfer batched`.
#[derive(clap::Args)]
pub struct Args {
    /// The model.
    #[command(flatten)]
    model: super::model::ModelArgs,
    /// The prompt every sequence continues.
    #[arg(short = 'p', long = "prompt", default_value = "Hello my name is")]
    prompt: String,
    /// Sequences.
    #[arg(long = "parallel", alias = "np", default_value_t = 4)]
    parallel: usize,
    /// Tokens generated per sequence at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 32)]
    n_predict: usize,
    /// Threads (0: all cores).
    #[arg(short = 't', long, default_value_t = 0, value_parser = crate::cmd::whole_number)]
    threads: usize,
    /// Temperature (llama.cpp's example samples with 0.4, top-k 40, top-p 0.9).
    #[arg(long = "temp", default_value_t = 0.4)]
    temp: f32,
    /// Seed of the first sequence (sequence i uses seed + i).
    #[arg(long = "seed", default_value_t = 0)]
    seed: u64,
    /// Only the batched run (no one-after-another comparison).
    #[arg(long = "no-sequential")]
    no_sequential: bool,
    /// Predictor threshold (default: as `powerinfer run`).
    #[arg(long)]
    sparse_threshold: Option<f32>,
    /// Print one JSON object instead of the texts and speeds.
    #[arg(long)]
    json: bool,
    /// Over the batched steps: each operation's time and bytes per token (as `run --profile`;
    /// `profile` in the JSON) and, per layer of a PowerInfer file's sparse FFN, the share of
    /// neurons one token activates and the share some sequence of the step activates (the
    /// union, the rows a step would read once for every sequence; `batch_density` in the
    /// JSON). Tables on stderr.
    #[arg(long)]
    profile: bool,
    /// The device beside the CPU.
    #[command(flatten)]
    device: super::device::DeviceArgs,
    /// The KV cache's types.
    #[command(flatten)]
    cache: super::CacheTypes,
}

/// What decoding N continuations produced.
struct Decoded {
    tokens: Vec<Vec<u32>>,
    time: Duration,
    /// With `--profile`: the batched steps' profile.
    profile: Option<OpProfile>,
}

fn samplers(a: &Args) -> Vec<Sampler> {
    (0..a.parallel)
        .map(|i| {
            Sampler::new(SamplingParams::default().with(|p| {
                p.temperature = a.temp;
                p.top_k = 40;
                p.top_p = 0.9;
                p.min_p = 0.0;
                p.seed = a.seed + i as u64;
                p.max_tokens = a.n_predict;
            }))
        })
        .collect()
}

/// Decodes every continuation: `together` in one batch per step, else one sequence after
/// another (each from its own copy of the prompt's cache).
fn decode(
    engine: &Engine,
    cache: &mut KvCache,
    prompt_seq: SeqId,
    prompt_logits: &[f32],
    a: &Args,
    together: bool,
) -> Result<Decoded, String> {
    let n = a.parallel;
    let tok = engine.tokenizer();
    let mut samplers = samplers(a);
    let seqs: Vec<SeqId> = (0..n)
        .map(|_| engine.fork_sequence(cache, prompt_seq))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut next: Vec<u32> = samplers
        .iter_mut()
        .map(|s| s.sample(&mut prompt_logits.to_vec()))
        .collect();
    let done =
        |i: usize, t: &[Vec<u32>], next: &[u32]| tok.is_eog(next[i]) || t[i].len() >= a.n_predict;
    let mut profile = (a.profile && together).then(OpProfile::new);
    let start = Instant::now();
    if together {
        loop {
            let live: Vec<usize> = (0..n).filter(|&i| !done(i, &tokens, &next)).collect();
            if live.is_empty() {
                break;
            }
            let step: Vec<(SeqId, u32)> = live.iter().map(|&i| (seqs[i], next[i])).collect();
            let opts = match profile.as_mut() {
                Some(p) => EvalOptions::new().profile(p),
                None => EvalOptions::new(),
            };
            let outs = engine
                .eval(cache, &Batch::decode(&step), opts)
                .map_err(|e| e.to_string())?;
            for (&i, mut o) in live.iter().zip(outs) {
                tokens[i].push(next[i]);
                samplers[i].accept(next[i]);
                next[i] = samplers[i].sample(&mut o.logits);
            }
        }
    } else {
        for i in 0..n {
            while !done(i, &tokens, &next) {
                let mut o = engine
                    .eval(cache, &Batch::one(seqs[i], &[next[i]]), EvalOptions::new())
                    .map_err(|e| e.to_string())?;
                tokens[i].push(next[i]);
                samplers[i].accept(next[i]);
                next[i] = samplers[i].sample(&mut o[0].logits);
            }
        }
    }
    let time = start.elapsed();
    for s in seqs {
        let _ = cache.remove_sequence(s);
    }
    Ok(Decoded {
        tokens,
        time,
        profile,
    })
}

/// Runs `powerinfer batched`.
pub fn run(a: Args) -> Result<(), String> {
    if a.parallel == 0 {
        return Err("--parallel 0: at least one sequence".into());
    }
    let model = a.model.path()?;
    let probe = Engine::load(&model, {
        let mut o = super::engine_options(a.threads, a.sparse_threshold);
        o.ctx_len = 1;
        o
    })
    .map_err(|e| super::file_error(&model, e))?;
    let prompt = probe.tokenizer().encode(&a.prompt, true, false);
    drop(probe);
    if prompt.is_empty() {
        return Err("the prompt has no tokens".into());
    }
    let mut o = super::engine_options(a.threads, a.sparse_threshold);
    a.device.apply(&mut o)?;
    a.cache.apply(&mut o)?;
    // The prompt's sequence and its continuations keep their KV rows on a device together.
    o.device.kv_sequences = a.parallel + 1;
    o.ctx_len = prompt.len() + a.n_predict + 1;
    let engine = super::load_engine(&model, o)?;
    for line in super::device::describe(&engine) {
        eprintln!("{line}");
    }
    let mut cache = engine.new_cache();
    let seq = cache.add_sequence();
    let t0 = Instant::now();
    let mut out = engine
        .eval(&mut cache, &Batch::one(seq, &prompt), EvalOptions::new())
        .map_err(|e| e.to_string())?;
    let prompt_time = t0.elapsed();
    let logits = out.remove(0).logits;
    let batched = decode(&engine, &mut cache, seq, &logits, &a, true)?;
    let sequential = if a.no_sequential {
        None
    } else {
        Some(decode(&engine, &mut cache, seq, &logits, &a, false)?)
    };
    let tps = |d: &Decoded| {
        d.tokens.iter().map(Vec::len).sum::<usize>() as f64 / d.time.as_secs_f64().max(1e-9)
    };
    let b_tps = tps(&batched);
    let s_tps = sequential.as_ref().map(tps);
    if a.json {
        let texts = |d: &Decoded| -> Vec<String> {
            d.tokens
                .iter()
                .map(|t| {
                    engine
                        .tokenizer()
                        .decode_lossy(t, false, false)
                        .unwrap_or_default()
                })
                .collect()
        };
        println!(
            "{}",
            json!({
                "model": model.display().to_string(),
                "parallel": a.parallel,
                "prompt_tokens": prompt.len(),
                "prompt_ms": prompt_time.as_secs_f64() * 1e3,
                "generated": batched.tokens.iter().map(Vec::len).collect::<Vec<_>>(),
                "batched_tps": b_tps,
                "sequential_tps": s_tps,
                "speedup": s_tps.map(|s| b_tps / s),
                "texts": texts(&batched),
                "sequential_texts": sequential.as_ref().map(texts),
                "device": super::device::json(&engine.device_report()),
                "batch_density": batched.profile.as_ref().map(density_json),
                "profile": batched
                    .profile
                    .as_ref()
                    .map(|p| super::run::profile_json(p, super::run::bandwidth(&engine))),
            })
        );
        return Ok(());
    }
    for (i, t) in batched.tokens.iter().enumerate() {
        let mut bytes = Vec::new();
        for &id in t {
            bytes.extend_from_slice(engine.tokenizer().token_to_piece(id, false).unwrap_or(b""));
        }
        println!(
            "sequence {i}:\n{}{}\n",
            a.prompt,
            String::from_utf8_lossy(&bytes)
        );
    }
    let total: usize = batched.tokens.iter().map(Vec::len).sum();
    eprintln!(
        "prompt: {} tokens in {:.2} ms, evaluated once for {} sequences",
        prompt.len(),
        prompt_time.as_secs_f64() * 1e3,
        a.parallel
    );
    eprintln!(
        "batched: {total} tokens in {:.3} s: {b_tps:.2} tokens/s",
        batched.time.as_secs_f64()
    );
    if let Some(s) = s_tps {
        eprintln!(
            "one after another: {s:.2} tokens/s; batched/sequential = {:.2}x",
            b_tps / s
        );
    }
    if let Some(p) = &batched.profile {
        let timeline = super::device::timeline(&engine.device_report());
        super::run::print_profile(p, super::run::bandwidth(&engine), &timeline);
        print_density(p);
    }
    Ok(())
}

/// The per-layer densities of `--profile` on stderr.
fn print_density(p: &OpProfile) {
    let layers = p.batch_density();
    if layers.is_empty() {
        eprintln!("profile: no step ran a sparse FFN over several sequences on the CPU");
        return;
    }
    eprintln!("sparse FFN over the batched steps, per layer (CPU neurons):");
    eprintln!("layer  seqs/step  token density  union density  union / token");
    for (l, b) in layers.iter().enumerate() {
        let (t, u) = (b.token_density(), b.union_density());
        eprintln!(
            "{l:>5}  {:>9.2}  {t:>13.4}  {u:>13.4}  {:>13.2}",
            b.tokens_per_block(),
            if t > 0.0 { u / t } else { 0.0 }
        );
    }
}

/// The per-layer densities of `--profile` as JSON.
fn density_json(p: &OpProfile) -> serde_json::Value {
    p.batch_density()
        .iter()
        .enumerate()
        .map(|(l, b)| {
            json!({
                "layer": l,
                "sequences_per_step": b.tokens_per_block(),
                "token_density": b.token_density(),
                "union_density": b.union_density(),
            })
        })
        .collect()
}
