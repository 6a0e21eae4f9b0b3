//! `powerinfer quantize IN OUT TYPE`: converts the 2-D weights of a GGUF or PowerInfer file to
//! TYPE (f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q6_k), keeping the magic, 1-D tensors
//! and metadata. Predictor tensors are F16 by default (`--predictor-type powerinfer` gives
//! PowerInfer's Q4_0 / Q5_0). See `powerinfer_engine::synth::quantize` for the rules.

use std::path::PathBuf;

use powerinfer_engine::synth::{quantize, QuantizeOptions};
use powerinfer_gguf::GgmlType;

use super::progress;

/// Arguments of `powerinfer quantize`.
#[derive(clap::Args)]
pub struct Args {
    /// Input GGUF or PowerInfer file.
    pub input: PathBuf,
    /// Output file (written under a temporary name, renamed when complete).
    pub output: PathBuf,
    /// Target type of the 2-D weights.
    #[arg(value_name = "TYPE")]
    pub ty: String,
    /// Predictor tensors: `f16` (default), `powerinfer` (Q4_0 for q4_0, else Q5_0) or a type.
    #[arg(long, default_value = "f16")]
    pub predictor_type: String,
    /// Convert tensors that are already quantized (loses precision twice).
    #[arg(long)]
    pub allow_requantize: bool,
}

/// Runs `powerinfer quantize`.
pub fn run(args: Args) -> Result<(), String> {
    let ty = GgmlType::from_name(&args.ty).ok_or_else(|| format!("unknown type {:?}", args.ty))?;
    let opts = QuantizeOptions {
        predictor_rule: super::synth::parse_predictor_rule(&args.predictor_type)?,
        allow_requantize: args.allow_requantize,
    };
    let bar = progress::bytes_bar("quantize");
    let report = quantize(
        &args.input,
        &args.output,
        ty,
        opts,
        &mut progress::callback(&bar),
    );
    bar.finish_and_clear();
    let report = report.map_err(|e| format!("{}: {e}", args.input.display()))?;
    let changed = report.tensors.iter().filter(|(_, a, b)| a != b).count();
    println!(
        "wrote {}: {} tensors ({changed} converted), {:.1} MiB -> {:.1} MiB",
        args.output.display(),
        report.tensors.len(),
        report.bytes_in as f64 / (1 << 20) as f64,
        report.bytes_out as f64 / (1 << 20) as f64
    );
    Ok(())
}
