//! `powerinfer synth --shape NAME|custom [...] --out FILE`: writes a seeded synthetic
//! ReLU-sparse LLaMA-architecture model (PowerInfer `PWRI` file), optionally its dense twin
//! for llama.cpp (`--dense-out`), and the per-neuron activation probabilities
//! (`activation/activation_N.pt` and `activation/activation.safetensors` next to the model,
//! unless `--no-activation`) and, with `--predictor-dir`, the predictor as `model_N.pt` state
//! dicts. See `crate::synth` for the construction.

use std::path::PathBuf;

use crate::synth::{
    synthesize, Family, PredictorRule, Shape, SynthConfig, SynthOutputs, VocabSource, ARCHS,
    PRESETS,
};
use powerinfer_gguf::GgmlType;

use super::progress;

/// Arguments of `powerinfer synth`.
#[derive(clap::Args)]
pub struct Args {
    /// Shape preset (tiny, tinyllama-1.1b, llama-2-7b, llama-2-13b, llama-2-70b) or `custom`
    /// (then --layers, --embd, --ff and --heads are required).
    #[arg(long)]
    pub shape: String,
    /// Layers (overrides the preset).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Residual width (a multiple of 32).
    #[arg(long)]
    pub embd: Option<usize>,
    /// FFN width (a multiple of 256).
    #[arg(long)]
    pub ff: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads (default: --heads for custom shapes).
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Vocabulary size of the built-in vocabulary (at least 259).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Training context length written to the file.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Architecture: `llama` (ReLU(gate)·up), `bamboo` (ReLU(gate)·ReLU(up)), `falcon`
    /// (parallel block, fused QKV, LayerNorm, ReLU(up)) or `opt` (learned positions, biases,
    /// LayerNorm, ReLU(up + b)).
    #[arg(long, default_value = "llama")]
    pub arch: String,
    /// Falcon-40B style: a separate `attn_norm_2` per layer (falcon only).
    #[arg(long)]
    pub attn_norm_2: bool,
    /// Two topics with their own hot neurons (llama/bamboo): tokens with even ids are of one,
    /// odd ids of the other; the activation statistics are their average.
    #[arg(long)]
    pub topics: bool,
    /// Type of the 2-D weights: f32, f16, q8_0, q4_0 (also q4_1, q5_0, q5_1).
    #[arg(long = "type", default_value = "f16")]
    pub ty: String,
    /// Seed of every random choice (same seed, same bytes).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Mean activation probability of a neuron.
    #[arg(long, default_value_t = 0.1)]
    pub density: f64,
    /// Share of all activations carried by the most active 20% of neurons (0.2 = uniform).
    #[arg(long, default_value_t = 0.8)]
    pub skew: f64,
    /// Rank r of the predictor's low-rank signal (a multiple of 16; default n_embd/16); the
    /// stored predictor's rank, its hidden width (fc1's rows, what `inspect` shows), is 2r.
    #[arg(long)]
    pub predictor_rank: Option<usize>,
    /// Share of the gate variance the predictor cannot see, in [0, 1) (0 = exact predictor).
    #[arg(long, default_value_t = 0.0)]
    pub predictor_noise: f64,
    /// How predictor tensors are stored for quantized types: `f16` (default, measured
    /// better), `powerinfer` (Q4_0 for q4_0, else Q5_0) or a type name.
    #[arg(long, default_value = "f16")]
    pub predictor_type: String,
    /// Write `powerinfer.sparse_threshold` with this value.
    #[arg(long)]
    pub sparse_threshold: Option<f32>,
    /// Copy the vocabulary (all tokenizer.* keys) from this GGUF file.
    #[arg(long)]
    pub vocab_from: Option<PathBuf>,
    /// Also write the dense twin (GGUF magic, ffn_down not transposed, no predictor) here.
    #[arg(long)]
    pub dense_out: Option<PathBuf>,
    /// Folder for the activation statistics (default: `activation/` next to --out).
    #[arg(long)]
    pub activation_dir: Option<PathBuf>,
    /// Do not write activation statistics.
    #[arg(long, conflicts_with = "activation_dir")]
    pub no_activation: bool,
    /// Also write the predictor as PowerInfer's converter takes it (`model_N.pt` state dicts,
    /// `config.json` with the sparse threshold) into this folder.
    #[arg(long)]
    pub predictor_dir: Option<PathBuf>,
    /// The PowerInfer file to write.
    #[arg(long)]
    pub out: PathBuf,
}

/// Parses a predictor rule argument.
pub fn parse_predictor_rule(s: &str) -> Result<PredictorRule, String> {
    match s.to_ascii_lowercase().as_str() {
        "f16" => Ok(PredictorRule::F16),
        "powerinfer" => Ok(PredictorRule::PowerInfer),
        other => GgmlType::from_name(other)
            .map(PredictorRule::Fixed)
            .ok_or_else(|| format!("--predictor-type {s:?}: use f16, powerinfer or a type name")),
    }
}

fn shape(args: &Args) -> Result<Shape, String> {
    let mut s = if args.shape == "custom" {
        let need =
            |v: Option<usize>, flag: &str| v.ok_or_else(|| format!("--shape custom needs {flag}"));
        Shape {
            n_layer: need(args.layers, "--layers")?,
            n_embd: need(args.embd, "--embd")?,
            n_ff: need(args.ff, "--ff")?,
            n_head: need(args.heads, "--heads")?,
            n_head_kv: args.kv_heads.or(args.heads).unwrap_or(1),
            n_vocab: None,
            n_ctx: 2048,
        }
    } else {
        Shape::preset(&args.shape).ok_or_else(|| {
            format!(
                "unknown --shape {:?}; use custom or one of {}",
                args.shape,
                PRESETS.join(", ")
            )
        })?
    };
    if let Some(v) = args.layers {
        s.n_layer = v;
    }
    if let Some(v) = args.embd {
        s.n_embd = v;
    }
    if let Some(v) = args.ff {
        s.n_ff = v;
    }
    if let Some(v) = args.heads {
        s.n_head = v;
        if args.kv_heads.is_none() && s.n_head_kv > v {
            s.n_head_kv = v;
        }
    }
    if let Some(v) = args.kv_heads {
        s.n_head_kv = v;
    }
    if let Some(v) = args.ctx {
        s.n_ctx = v;
    }
    if args.vocab_from.is_some() {
        // The file decides; --vocab, if given, must agree with it.
        s.n_vocab = args.vocab;
    } else if let Some(v) = args.vocab {
        s.n_vocab = Some(v);
    }
    Ok(s)
}

/// Runs `powerinfer synth`.
pub fn run(args: Args) -> Result<(), String> {
    let mut cfg = SynthConfig::new(shape(&args)?);
    cfg.set_family(
        Family::from_name(&args.arch)
            .ok_or_else(|| format!("--arch {:?}: use one of {}", args.arch, ARCHS.join(", ")))?,
    );
    cfg.attn_norm_2 = args.attn_norm_2;
    cfg.topics = args.topics;
    if args.attn_norm_2 && cfg.family() != Family::Falcon {
        return Err("--attn-norm-2 applies to --arch falcon only".into());
    }
    cfg.ty =
        GgmlType::from_name(&args.ty).ok_or_else(|| format!("--type {:?}: unknown", args.ty))?;
    cfg.seed = args.seed;
    cfg.density = args.density;
    cfg.skew = args.skew;
    cfg.predictor_rank = args.predictor_rank;
    cfg.predictor_noise = args.predictor_noise;
    cfg.predictor_rule = parse_predictor_rule(&args.predictor_type)?;
    cfg.sparse_threshold = args.sparse_threshold;
    if let Some(v) = &args.vocab_from {
        cfg.vocab = VocabSource::FromGguf(v.clone());
    }
    let activation_dir = if args.no_activation {
        None
    } else {
        Some(args.activation_dir.clone().unwrap_or_else(|| {
            args.out
                .parent()
                .map(|p| p.join("activation"))
                .unwrap_or_else(|| PathBuf::from("activation"))
        }))
    };
    let out = SynthOutputs {
        model: args.out.clone(),
        dense: args.dense_out.clone(),
        activation_dir: activation_dir.clone(),
        predictor_dir: args.predictor_dir.clone(),
    };
    let bar = progress::bytes_bar("synth");
    let report = synthesize(&cfg, &out, &mut progress::callback(&bar));
    bar.finish_and_clear();
    let report = report.map_err(|e| e.to_string())?;
    let s = &cfg.shape;
    println!(
        "wrote {} ({} {} layers, n_embd {}, n_ff {}, vocab {}, {}, predictor rank {} as {}, {:.1} MiB)",
        args.out.display(),
        cfg.family().name(),
        s.n_layer,
        s.n_embd,
        s.n_ff,
        report.n_vocab,
        cfg.ty,
        report.predictor_rank(),
        report.predictor_type,
        report.model_bytes as f64 / (1 << 20) as f64
    );
    if let Some(d) = &args.dense_out {
        println!("wrote {} (dense twin)", d.display());
    }
    if let Some(d) = &activation_dir {
        println!(
            "wrote {}/activation_{{0..{}}}.pt and activation.safetensors (activation probabilities, mean {})",
            d.display(),
            s.n_layer - 1,
            cfg.density
        );
    }
    if let Some(d) = &args.predictor_dir {
        println!(
            "wrote {}/model_{{0..{}}}.pt (predictor state dicts)",
            d.display(),
            s.n_layer - 1
        );
    }
    Ok(())
}
