//! `powerinfer convert HF_MODEL_DIR [PREDICTOR_DIR] --out FILE [--outtype f32|f16|q8_0] [--dense]`:
//! a Hugging Face LLaMA or Bamboo checkpoint (safetensors, `tokenizer.model`) plus a predictor
//! folder (`model_N.pt` / `model_N.safetensors`) into the PowerInfer file PowerInfer's
//! `convert.py` writes; `--dense` writes the plain GGUF file of `convert-dense.py` instead. See
//! `powerinfer_engine::convert` for exactly what is written.

use std::path::PathBuf;

use powerinfer_engine::convert::{convert, ConvertOptions, OutType};

use super::progress;

/// Arguments of `powerinfer convert`.
#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model folder (config.json, model*.safetensors, tokenizer.model).
    pub model_dir: PathBuf,
    /// Predictor folder (model_N.pt or model_N.safetensors, optional config.json with
    /// sparse_threshold); required unless --dense.
    pub predictor_dir: Option<PathBuf>,
    /// Output file (written under a temporary name, renamed when complete).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Type of the 2-D weights: f32, f16 or q8_0 (1-D tensors are always f32).
    #[arg(long, default_value = "f16")]
    pub outtype: String,
    /// Write a dense GGUF file (ffn_down kept, no predictor), as convert-dense.py does.
    #[arg(long)]
    pub dense: bool,
}

/// Runs `powerinfer convert`.
pub fn run(args: Args) -> Result<(), String> {
    let outtype = OutType::from_name(&args.outtype)
        .ok_or_else(|| format!("unknown --outtype {:?} (f32, f16, q8_0)", args.outtype))?;
    let opts = ConvertOptions {
        model_dir: args.model_dir,
        predictor_dir: args.predictor_dir,
        out: args.out,
        outtype,
        dense: args.dense,
    };
    let bar = progress::bytes_bar("convert");
    let report = convert(&opts, &mut progress::callback(&bar));
    bar.finish_and_clear();
    let report = report.map_err(|e| e.to_string())?;
    println!(
        "wrote {} ({} magic, {}): {} layers, {} tensors, {} tokens, {:.1} MiB",
        opts.out.display(),
        String::from_utf8_lossy(&report.kind.magic()),
        report.arch,
        report.n_layer,
        report.n_tensors,
        report.n_vocab,
        report.file_bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}
