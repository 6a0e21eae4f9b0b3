//! `powerinfer profile -m MODEL -f TEXT --out DIR`: runs a text through the model (every FFN
//! neuron computed) and writes how often each neuron fired as `DIR/activation/activation_N.pt`
//! (PowerInfer's form) and `DIR/activation/activation.safetensors` (ours, what `powerinfer
//! plan` prefers), values = activation frequencies. With `--eval-predictor` it also measures the
//! model's own predictor against the true activations (per-layer recall, precision, predicted
//! and true density at θ).
//!
//! The text is tokenized once (with BOS) and evaluated in chunks of `--ctx` tokens, each chunk
//! as a fresh sequence.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use powerinfer_engine::Engine;
use powerinfer_engine::FfnObserver;
use powerinfer_predictor::profile::{ActivationProfile, StatsKind};
use powerinfer_predictor::quality::{Confusion, PredictorQuality};
use powerinfer_predictor::stats::SAFETENSORS_FILE_NAME;
use serde_json::{json, Value};

/// The model and the text of `profile` and `train-predictor` (each command words their help
/// for itself).
#[derive(clap::Args)]
pub struct Input {
    /// The model.
    #[command(flatten)]
    pub model: super::model::ModelArgs,
    /// Text file.
    #[arg(short = 'f', long = "file")]
    pub file: PathBuf,
}

/// Sets a command's help of the [`Input`] arguments (through `mut_args`, which keeps the
/// arguments' order).
pub fn input_help(model: &'static str, file: &'static str) -> impl FnMut(clap::Arg) -> clap::Arg {
    move |a| match a.get_id().as_str() {
        "model" => a.help(model),
        "file" => a.help(file),
        _ => a,
    }
}

/// How `profile` and `train-predictor` run the text through the model.
#[derive(clap::Args)]
pub struct Chunks {
    /// Threads (0 = all cores).
    #[arg(short = 't', long = "threads", default_value_t = 0, value_parser = crate::cmd::whole_number)]
    pub threads: usize,
    /// Tokens per chunk (each chunk is a fresh sequence).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Use at most this many tokens of the text (0 = all).
    #[arg(long, default_value_t = 0)]
    pub max_tokens: usize,
}

/// Arguments of `powerinfer profile`.
#[derive(clap::Args)]
#[command(mut_args(input_help(
    "Model file (PowerInfer or dense GGUF; `--eval-predictor` needs a PowerInfer file)",
    "Text file to profile on",
)))]
pub struct Args {
    /// The model and the text.
    #[command(flatten)]
    pub input: Input,
    /// Output folder: writes `DIR/activation/activation_N.pt` and
    /// `DIR/activation/activation.safetensors`.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Measure the model's predictor against the true activations.
    #[arg(long)]
    pub eval_predictor: bool,
    /// Predictor threshold θ for `--eval-predictor` (default: env, then the file's, then 0).
    #[arg(long = "sparse-threshold")]
    pub sparse_threshold: Option<f32>,
    /// Threads and chunks.
    #[command(flatten)]
    pub chunks: Chunks,
    /// Print a JSON report on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Loads the model for observation and tokenizes the text (BOS first, at most `max_tokens`);
/// the model file's path beside them.
pub fn load(
    input: &Input,
    chunks: &Chunks,
    sparse_threshold: Option<f32>,
) -> Result<(Engine, Vec<u32>, PathBuf), String> {
    let (model, file) = (input.model.path()?, &input.file);
    let Chunks {
        threads,
        ctx,
        max_tokens,
    } = *chunks;
    if ctx == 0 {
        return Err("--ctx must be positive".into());
    }
    let text = std::fs::read_to_string(file).map_err(|e| super::file_error(file, e))?;
    let mut options = super::engine_options(threads, sparse_threshold);
    options.ctx_len = ctx;
    let engine = super::load_engine(&model, options)?;
    let mut tokens = engine.tokenizer().encode(&text, true, false);
    if max_tokens > 0 {
        tokens.truncate(max_tokens);
    }
    if tokens.is_empty() {
        return Err(format!("{}: no tokens", file.display()));
    }
    Ok((engine, tokens, model))
}

/// Runs `tokens` through the engine in chunks of `ctx` (fresh sequence each) with `observer`.
pub fn observe_text(
    engine: &Engine,
    tokens: &[u32],
    ctx: usize,
    observer: &mut dyn FfnObserver,
) -> Result<Duration, String> {
    let start = Instant::now();
    let mut session = engine.session();
    for chunk in tokens.chunks(ctx) {
        session.reset();
        session
            .eval_observed(chunk, observer)
            .map_err(|e| e.to_string())?;
    }
    Ok(start.elapsed())
}

struct ProfileObserver {
    profile: ActivationProfile,
    quality: Option<(PredictorQuality, f32)>,
    missing_scores: bool,
    count_time: Duration,
    error: Option<String>,
}

impl FfnObserver for ProfileObserver {
    fn observe(&mut self, layer: usize, t: usize, _h: &[f32], act: &[f32], scores: Option<&[f32]>) {
        let start = Instant::now();
        if let Err(e) = self.profile.add(layer, t, act) {
            self.error.get_or_insert(e.to_string());
        }
        self.count_time += start.elapsed();
        if let Some((q, theta)) = &mut self.quality {
            match scores {
                Some(s) => {
                    if let Err(e) = q.add(layer, t, act, s, *theta) {
                        self.error.get_or_insert(e.to_string());
                    }
                }
                None => self.missing_scores = true,
            }
        }
    }
}

/// A confusion count as JSON.
pub fn confusion_json(c: &Confusion) -> Value {
    json!({
        "recall": c.recall(),
        "precision": c.precision(),
        "predicted_density": c.predicted_density(),
        "true_density": c.true_density(),
        "true_pos": c.true_pos,
        "false_pos": c.false_pos,
        "false_neg": c.false_neg,
        "tokens": c.tokens,
    })
}

/// Runs `powerinfer profile`.
pub fn run(args: Args) -> Result<(), String> {
    if args.out.is_none() && !args.eval_predictor {
        return Err("nothing to do: pass --out DIR and/or --eval-predictor".into());
    }
    let (engine, tokens, model) = load(&args.input, &args.chunks, args.sparse_threshold)?;
    let hp = &engine.model().hparams();
    let (n_layer, n_ff) = (hp.n_layer, hp.n_ff);
    let theta = engine.threshold();
    if args.eval_predictor && !engine.is_sparse() {
        return Err(format!(
            "{}: --eval-predictor needs a PowerInfer file (this one has no predictor)",
            model.display()
        ));
    }
    let mut obs = ProfileObserver {
        profile: ActivationProfile::new(n_layer, n_ff),
        quality: args
            .eval_predictor
            .then(|| (PredictorQuality::new(n_layer, n_ff), theta)),
        missing_scores: false,
        count_time: Duration::ZERO,
        error: None,
    };
    let elapsed = observe_text(&engine, &tokens, args.chunks.ctx, &mut obs)?;
    if let Some(e) = obs.error {
        return Err(e);
    }
    if obs.missing_scores {
        return Err("a layer has no predictor scores".into());
    }
    let n_tok = tokens.len();
    let count_us = obs.count_time.as_secs_f64() * 1e6 / n_tok as f64;
    let eval_ms = elapsed.as_secs_f64() * 1e3 / n_tok as f64;

    let mut written = None;
    if let Some(out) = &args.out {
        let dir = out.join("activation");
        let stats = obs.profile.to_stats(StatsKind::Frequency);
        stats.write_pt_dir(&dir).map_err(|e| e.to_string())?;
        stats
            .write_safetensors(dir.join(SAFETENSORS_FILE_NAME))
            .map_err(|e| e.to_string())?;
        written = Some(dir);
    }

    let p = &obs.profile;
    let quality = obs.quality.as_ref().map(|(q, _)| q);
    if args.json {
        let layers: Vec<Value> = (0..n_layer)
            .map(|l| {
                let mut v = json!({ "layer": l, "true_density": p.density(l) });
                if let Some(q) = quality {
                    v["predictor"] = confusion_json(&q.layers()[l]);
                }
                v
            })
            .collect();
        let mut v = json!({
            "model": model.display().to_string(),
            "tokens": n_tok,
            "n_layer": n_layer,
            "n_ff": n_ff,
            "mean_true_density": p.mean_density(),
            "eval_ms_per_token": eval_ms,
            "count_us_per_token": count_us,
            "layers": layers,
        });
        if let Some(q) = quality {
            v["threshold"] = json!(theta);
            v["predictor_total"] = confusion_json(&q.total());
        }
        if let Some(d) = &written {
            v["activation_dir"] = json!(d.display().to_string());
        }
        println!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
    } else {
        println!(
            "{n_tok} tokens, {n_layer} layers × {n_ff} neurons; dense observed eval {eval_ms:.2} ms/token, counting {count_us:.2} µs/token"
        );
        if quality.is_some() {
            println!("predictor threshold θ = {theta}");
            println!("layer  true_density  pred_density  recall   precision");
        } else {
            println!("layer  true_density");
        }
        for l in 0..n_layer {
            match quality {
                Some(q) => {
                    let c = &q.layers()[l];
                    println!(
                        "{l:5}  {:12.4}  {:12.4}  {:7.4}  {:9.4}",
                        c.true_density(),
                        c.predicted_density(),
                        c.recall(),
                        c.precision()
                    );
                }
                None => println!("{l:5}  {:12.4}", p.density(l)),
            }
        }
        match quality {
            Some(q) => {
                let c = q.total();
                println!(
                    "total  {:12.4}  {:12.4}  {:7.4}  {:9.4}",
                    c.true_density(),
                    c.predicted_density(),
                    c.recall(),
                    c.precision()
                );
            }
            None => println!("mean   {:12.4}", p.mean_density()),
        }
    }
    if let Some(d) = written {
        eprintln!(
            "wrote {} activation_N.pt and {} to {}",
            n_layer,
            SAFETENSORS_FILE_NAME,
            d.display()
        );
    }
    Ok(())
}
