//! `powerinfer quantize IN OUT TYPE`: converts the 2-D weights of a GGUF or PowerInfer file to
//! TYPE (f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k: every tensor of
//! that type; or one of llama.cpp's K-quant mixes q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m,
//! q5_k_s, q5_k_m), keeping the magic, 1-D tensors and metadata. Each layer's predictor is
//! stored in the cheapest of Q4_0, Q8_0, F16 whose selection on held-out tokens stays within a
//! margin of the F32 predictor's (`auto`, the default for quantized targets; F32 when none is);
//! a fixed `--predictor-type` (`f16`, `powerinfer` for PowerInfer's Q4_0 / Q5_0, or a type) is
//! checked the same way and a layer outside the margin kept in F32 with a warning. See
//! `crate::synth::quantize` for the rules and `predictor_check` for the check.

use std::path::PathBuf;

use crate::synth::{predictor_type, quantize, PredictorRule, QuantizeOptions, QuantizeTarget};

use super::predictor_check::{auto_candidates, check, CheckArgs};
use super::progress;

/// Arguments of `powerinfer quantize`.
#[derive(clap::Args)]
pub struct Args {
    /// Input GGUF or PowerInfer file.
    pub input: PathBuf,
    /// Output file (written under a temporary name, renamed when complete).
    pub output: PathBuf,
    /// Target type of the 2-D weights (`q4_k`), or a llama.cpp K-quant mix (`q4_k_m`).
    #[arg(value_name = "TYPE")]
    pub ty: String,
    /// Predictor tensors: `auto` (default for quantized targets: the cheapest type within the
    /// margin, per layer), `f16` (default otherwise), `powerinfer` (Q4_0 for q4_0, else Q5_0)
    /// or a type.
    #[arg(long)]
    pub predictor_type: Option<String>,
    #[command(flatten)]
    pub check: CheckArgs,
    /// Convert tensors that are already quantized (loses precision twice).
    #[arg(long)]
    pub allow_requantize: bool,
}

/// Runs `powerinfer quantize`.
pub fn run(args: Args) -> Result<(), String> {
    let ty = QuantizeTarget::from_name(&args.ty).ok_or_else(|| {
        format!(
            "unknown type {:?} (one of {})",
            args.ty,
            QuantizeTarget::accepted_names().join(", ").to_lowercase()
        )
    })?;
    let base = ty.base();
    let (rule, candidates) = match args.predictor_type.as_deref() {
        Some("auto") => (PredictorRule::F16, auto_candidates()),
        None if base.is_quantized() => (PredictorRule::F16, auto_candidates()),
        None => (
            PredictorRule::F16,
            vec![predictor_type(base, PredictorRule::F16)],
        ),
        Some(s) => {
            let rule = super::synth::parse_predictor_rule(s)?;
            (rule, vec![predictor_type(base, rule)])
        }
    };
    let layers = check(&args.input, &candidates, None, &args.check)?;
    let opts = QuantizeOptions {
        predictor_rule: rule,
        predictor_layers: layers.unwrap_or_default(),
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
    let report = report.map_err(|e| super::file_error(&args.input, e))?;
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
