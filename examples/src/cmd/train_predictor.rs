//! `powerinfer train-predictor -m MODEL -f TEXT --rank R --out DIR`: runs a text through the
//! model (every FFN neuron computed), collects per layer the predictor input `h` (the pre-norm
//! residual) and the true active set (activation `!= 0`) of every token, trains one predictor
//! per layer (`powerinfer_predictor::train`), calibrates each layer's threshold to the target
//! recall on the training tokens and writes `DIR/model_N.safetensors` + `DIR/config.json`
//! (`sparse_threshold`), the predictor folder `powerinfer convert` takes.
//!
//! The last `--holdout` share of the tokens is held out; the report gives recall, precision and
//! predicted density there per layer, next to the model file's own predictor (when it has one)
//! at its threshold on the same tokens.

use std::path::PathBuf;
use std::time::Instant;

use powerinfer_engine::FfnObserver;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::{MatMul, ThreadPool};
use powerinfer_predictor::predictor::{safetensors_file_name, FileDtype};
use powerinfer_predictor::quality::Confusion;
use powerinfer_predictor::storage::{stored_quality, StorageMargin};
use powerinfer_predictor::train::{
    evaluate, train_layer, write_predictor_dir, LayerSamples, TrainConfig,
};
use serde_json::json;

use super::profile::{confusion_json, input_help, load, observe_text, Chunks, Input};

/// Arguments of `powerinfer train-predictor`.
#[derive(clap::Args)]
#[command(mut_args(input_help(
    "Model file (PowerInfer or dense GGUF of a ReLU-family model)",
    "Text file to train on",
)))]
pub struct Args {
    /// The model and the text.
    #[command(flatten)]
    pub input: Input,
    /// Hidden width of each predictor.
    #[arg(long)]
    pub rank: usize,
    /// Output predictor folder (`model_N.safetensors`, `config.json`).
    #[arg(long)]
    pub out: PathBuf,
    /// Recall each layer's threshold is calibrated to on the training tokens.
    #[arg(long, default_value_t = 0.99)]
    pub target_recall: f64,
    /// Training epochs.
    #[arg(long, default_value_t = 20)]
    pub epochs: usize,
    /// Tokens per minibatch.
    #[arg(long, default_value_t = 128)]
    pub batch_size: usize,
    /// Adam step size relative to the initial weight scale.
    #[arg(long, default_value_t = 0.2)]
    pub lr: f32,
    /// Share of the tokens held out (the last ones).
    #[arg(long, default_value_t = 0.1)]
    pub holdout: f64,
    /// Seed of the initialisation and batch order.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The model-wide threshold θ the per-layer thresholds are folded onto (negative).
    #[arg(long, default_value_t = -1.0, allow_hyphen_values = true)]
    pub threshold: f32,
    /// Tensor type of the written files: f32 or f16 (each layer's F16 form is checked on the
    /// held-out tokens; one that loses more than 1% recall or adds more than 10% density
    /// against the F32 form is written as F32, with a warning).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Threads and chunks.
    #[command(flatten)]
    pub chunks: Chunks,
    /// Refuse a model whose measured FFN density (share of neurons active per token, over
    /// all layers) is above this: a predictor for it would select nearly every neuron (a ReLU
    /// checkpoint run with SiLU reads as dense).
    #[arg(long = "max-density", default_value_t = 0.5)]
    pub max_density: f64,
    /// Print a JSON report on stdout.
    #[arg(long)]
    pub json: bool,
}

struct Collector {
    layers: Vec<LayerSamples>,
    error: Option<String>,
}

impl FfnObserver for Collector {
    fn observe(&mut self, layer: usize, t: usize, h: &[f32], act: &[f32], _: Option<&[f32]>) {
        let r = match self.layers.get_mut(layer) {
            Some(s) => s.push(t, h, act).map_err(|e| e.to_string()),
            None => Err(format!("layer {layer} out of range")),
        };
        if let Err(e) = r {
            self.error.get_or_insert(e);
        }
    }
}

/// Runs `powerinfer train-predictor`.
pub fn run(args: Args) -> Result<(), String> {
    let dtype = match args.dtype.as_str() {
        "f32" => FileDtype::F32,
        "f16" => FileDtype::F16,
        d => return Err(format!("--dtype {d}: expected f32 or f16")),
    };
    if args.rank == 0 {
        return Err("--rank must be positive".into());
    }
    if args.threshold.is_nan() || args.threshold >= 0.0 {
        return Err("--threshold must be negative".into());
    }
    if !(0.0..1.0).contains(&args.holdout) {
        return Err("--holdout must be in [0, 1)".into());
    }
    let (engine, tokens, model) = load(&args.input, &args.chunks, None)?;
    let hp = &engine.model().hparams();
    let (n_layer, n_embd, n_ff) = (hp.n_layer, hp.n_embd, hp.n_ff);
    let mut c = Collector {
        layers: (0..n_layer)
            .map(|_| LayerSamples::new(n_embd, n_ff))
            .collect(),
        error: None,
    };
    let collect_time = observe_text(&engine, &tokens, args.chunks.ctx, &mut c)?;
    if let Some(e) = c.error {
        return Err(e);
    }
    eprintln!(
        "collected {} tokens × {n_layer} layers in {:.1} s",
        tokens.len(),
        collect_time.as_secs_f64()
    );
    let density = c.layers.iter().map(LayerSamples::density).sum::<f64>() / n_layer.max(1) as f64;
    if density > args.max_density {
        let worst = c
            .layers
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.density().total_cmp(&b.1.density()))
            .map_or(0, |(l, _)| l);
        return Err(format!(
            "{}: measured FFN density {density:.3} (layer {worst}: {:.3}) is above --max-density \
             {}: the FFN is not sparse, so a predictor would select nearly every neuron. Is it a \
             ReLU model run with its activation (a ReLU checkpoint converted as SiLU reads as \
             dense)?",
            model.display(),
            c.layers[worst].density(),
            args.max_density
        ));
    }

    let cfg = TrainConfig {
        rank: args.rank,
        epochs: args.epochs,
        batch_size: args.batch_size,
        learning_rate: args.lr,
        target_recall: args.target_recall,
        holdout: args.holdout,
        threshold: args.threshold,
        seed: args.seed,
        ..TrainConfig::default()
    };
    let pool = ThreadPool::new(engine.threads());
    let mm = MatMul::new(&pool);
    let file_theta = engine.threshold();
    let mut trained = Vec::with_capacity(n_layer);
    let mut report = Vec::with_capacity(n_layer);
    let (mut tot_new, mut tot_file) = (Confusion::default(), Confusion::default());
    let mut has_file = true;
    if !args.json {
        println!(
            "{} tokens ({} held out), rank {}, target recall {} (training tokens)",
            tokens.len(),
            c.layers[0].split(args.holdout).1.len(),
            args.rank,
            args.target_recall
        );
        println!("layer  true_dens  | trained: recall  precision  density | file's: recall  precision  density");
    }
    for (l, samples) in c.layers.iter().enumerate() {
        let start = Instant::now();
        let t = train_layer(samples, &cfg, &mm).map_err(|e| format!("layer {l}: {e}"))?;
        let secs = start.elapsed().as_secs_f64();
        let (_, hold) = samples.split(args.holdout);
        let file_q = match engine.model().predictor(l).map_err(|e| e.to_string())? {
            Some(p) => {
                Some(evaluate(&p, &mm, samples, hold, file_theta).map_err(|e| e.to_string())?)
            }
            None => None,
        };
        tot_new.merge(&t.holdout);
        match &file_q {
            Some(q) => tot_file.merge(q),
            None => has_file = false,
        }
        let h = &t.holdout;
        if !args.json {
            let file_cols = file_q.map_or("      -          -         -".to_string(), |q| {
                format!(
                    "{:7.4}  {:9.4}  {:7.4}",
                    q.recall(),
                    q.precision(),
                    q.predicted_density()
                )
            });
            println!(
                "{l:5}  {:9.4}  |          {:7.4}  {:9.4}  {:7.4} |         {file_cols}   ({secs:.1} s, loss {:.4} -> {:.4})",
                h.true_density(),
                h.recall(),
                h.precision(),
                h.predicted_density(),
                t.loss.0,
                t.loss.1
            );
        }
        let mut v = json!({
            "layer": l,
            "layer_threshold": t.layer_threshold,
            "loss_first_epoch": t.loss.0,
            "loss_last_epoch": t.loss.1,
            "train": confusion_json(&t.train),
            "holdout": confusion_json(&t.holdout),
            "seconds": secs,
        });
        if let Some(q) = &file_q {
            v["file_predictor_holdout"] = confusion_json(q);
        }
        report.push(v);
        trained.push(t.predictor);
    }
    write_predictor_dir(&args.out, &trained, args.threshold, dtype).map_err(|e| e.to_string())?;
    if dtype == FileDtype::F16 {
        // The files hold F16 weights: check each layer's F16 form against the trained F32 one
        // on the held-out tokens, and keep a layer outside the margin in F32.
        let margin = StorageMargin::default();
        for (l, (p, samples)) in trained.iter().zip(&c.layers).enumerate() {
            let (_, hold) = samples.split(args.holdout);
            let (h, t) = (samples.h_range(hold.clone()), hold.len());
            let q = stored_quality(p, GgmlType::F16, &mm, h, t, args.threshold)
                .map_err(|e| format!("layer {l}: {e}"))?;
            if let Some(v) = report.get_mut(l) {
                v["stored_f16"] = json!({"recall": q.recall, "density": q.density,
                    "f32_density": q.reference_density, "within_margin": q.within(&margin)});
            }
            if !q.within(&margin) {
                eprintln!(
                    "warning: layer {l}: stored as F16 its predictor keeps recall {:.4} and density \
                     {:.4} of the F32 one's {:.4} (margin: {:.1}% recall, +{:.0}% density); \
                     written as F32",
                    q.recall,
                    q.density,
                    q.reference_density,
                    margin.recall_drop * 100.0,
                    margin.density_rise * 100.0
                );
                p.write_safetensors(args.out.join(safetensors_file_name(l)), FileDtype::F32)
                    .map_err(|e| e.to_string())?;
            }
        }
    }
    if args.json {
        let mut v = json!({
            "model": model.display().to_string(),
            "tokens": tokens.len(),
            "rank": args.rank,
            "threshold": args.threshold,
            "target_recall": args.target_recall,
            "out": args.out.display().to_string(),
            "layers": report,
            "holdout_total": confusion_json(&tot_new),
        });
        if has_file {
            v["file_threshold"] = json!(file_theta);
            v["file_predictor_holdout_total"] = confusion_json(&tot_file);
        }
        println!("{}", serde_json::to_string_pretty(&v).expect("JSON"));
    } else {
        println!(
            "total  {:9.4}  |          {:7.4}  {:9.4}  {:7.4} |",
            tot_new.true_density(),
            tot_new.recall(),
            tot_new.precision(),
            tot_new.predicted_density()
        );
        if has_file {
            println!(
                "file's predictor at θ = {file_theta}: recall {:.4}, precision {:.4}, density {:.4}",
                tot_file.recall(),
                tot_file.precision(),
                tot_file.predicted_density()
            );
        }
    }
    eprintln!(
        "wrote {n_layer} model_N.safetensors and config.json (sparse_threshold {}) to {}",
        args.threshold,
        args.out.display()
    );
    Ok(())
}
