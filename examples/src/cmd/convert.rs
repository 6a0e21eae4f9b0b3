//! `powerinfer convert HF_MODEL_DIR [PREDICTOR_DIR] --out FILE [--outtype f32|f16|q8_0|q4_0]
//! [--dense]`:
//! a Hugging Face checkpoint (safetensors) plus a predictor folder (`model_N.pt` /
//! `model_N.safetensors`) into the PowerInfer file PowerInfer's converters write: LLaMA or
//! Bamboo with `tokenizer.model` (as `convert.py`), ReluFalcon (Falcon-7B or -40B layout) or OPT
//! with a byte-level BPE `tokenizer.json` (as `convert-hf-to-powerinfer-gguf.py`); `--dense`
//! writes a plain GGUF file (`ffn_down` kept, no predictor) instead. See
//! `crate::convert` for exactly what is written. A PowerInfer file's predictors are
//! then checked in their stored type on held-out tokens (`predictor_check`); a layer outside the
//! margin is rewritten in F32 with a warning, and `--predictor-type auto` stores each layer in
//! the cheapest type within it.

use std::path::PathBuf;

use crate::convert::{convert, find_predictors, ConvertOptions, OutType};
use powerinfer_gguf::{GgmlType, GgufFile};
use powerinfer_predictor::predictor::F32Predictor;

use super::predictor_check::{auto_candidates, check, CheckArgs};
use super::progress;

/// Arguments of `powerinfer convert`.
#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model folder (config.json, model*.safetensors, and tokenizer.model for
    /// LLaMA/Bamboo or tokenizer.json for Falcon/OPT).
    pub model_dir: PathBuf,
    /// Predictor folder (model_N.pt or model_N.safetensors, optional config.json with
    /// sparse_threshold); required unless --dense.
    pub predictor_dir: Option<PathBuf>,
    /// Output file (written under a temporary name, renamed when complete).
    #[arg(long, short)]
    pub out: PathBuf,
    /// Type of the 2-D weights: f32, f16, q8_0 or q4_0 (1-D tensors are always f32).
    #[arg(long, default_value = "f16")]
    pub outtype: String,
    /// Write a dense GGUF file (ffn_down kept, no predictor), as convert-dense.py does.
    #[arg(long)]
    pub dense: bool,
    /// Predictor tensors: the outtype's type (default), `auto` (per layer, the cheapest of
    /// q4_0, q8_0, f16 within the margin, else f32) or a type.
    #[arg(long)]
    pub predictor_type: Option<String>,
    #[command(flatten)]
    pub check: CheckArgs,
}

/// Runs `powerinfer convert`.
pub fn run(args: Args) -> Result<(), String> {
    let outtype = OutType::from_name(&args.outtype).ok_or_else(|| {
        format!(
            "unknown --outtype {:?} (f32, f16, q8_0, q4_0)",
            args.outtype
        )
    })?;
    let fixed = match args.predictor_type.as_deref() {
        None | Some("auto") => None,
        Some(name) => Some(GgmlType::from_name(name).ok_or_else(|| {
            format!("--predictor-type {name:?}: use auto or a type name (f32, f16, q8_0, q4_0)")
        })?),
    };
    if args.dense && args.predictor_type.is_some() {
        return Err("--predictor-type: a dense file has no predictor".into());
    }
    let mut opts = ConvertOptions {
        model_dir: args.model_dir,
        predictor_dir: args.predictor_dir,
        out: args.out,
        outtype,
        dense: args.dense,
        predictor_layers: Vec::new(),
    };
    if let (Some(ty), Some(dir)) = (fixed, &opts.predictor_dir) {
        let n = find_predictors(dir).map_err(|e| e.to_string())?.len();
        opts.predictor_layers = vec![Some(ty); n];
    }
    let mut report = write(&opts)?;
    if let Some(dir) = opts.predictor_dir.clone().filter(|_| !opts.dense) {
        let written = predictor_types(&opts.out)?;
        let candidates = match (args.predictor_type.as_deref(), written.first()) {
            (Some("auto"), _) => auto_candidates(),
            (_, Some(&ty)) => vec![ty],
            (_, None) => Vec::new(),
        };
        let references = find_predictors(&dir)
            .map_err(|e| e.to_string())?
            .iter()
            .map(|f| F32Predictor::read(f).map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let chosen = check(&opts.out, &candidates, Some(&references), &args.check)?;
        if let Some(chosen) = chosen {
            let want: Vec<GgmlType> = chosen.iter().map(|c| c.unwrap_or(GgmlType::F32)).collect();
            if want != written {
                println!("rewriting with the predictor types above");
                opts.predictor_layers = want.into_iter().map(Some).collect();
                report = write(&opts)?;
            }
        }
    }
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

fn write(opts: &ConvertOptions) -> Result<crate::convert::ConvertReport, String> {
    let bar = progress::bytes_bar("convert");
    let report = convert(opts, &mut progress::callback(&bar));
    bar.finish_and_clear();
    report.map_err(|e| e.to_string())
}

/// The type of each layer's `fc1` in a written file.
fn predictor_types(path: &std::path::Path) -> Result<Vec<GgmlType>, String> {
    let f = GgufFile::open(path).map_err(|e| super::file_error(path, e))?;
    Ok((0..)
        .map_while(|l| f.tensor_info(&format!("blk.{l}.fc1.weight")))
        .map(|t| t.ggml_type())
        .collect())
}
