//! The predictor storage check `quantize` and `convert` run: a calibration text through the
//! model, each layer's predictor measured in its stored type against its F32 form on those
//! held-out inputs, a table printed, and layers outside the margin kept in F32 with a warning
//! (see `crate::predictor_storage`).

use std::path::{Path, PathBuf};

use crate::predictor_storage::{
    choose_predictor_types, collect_predictor_inputs, CALIBRATION_TEXT,
};
use powerinfer_engine::Engine;
use powerinfer_gguf::GgmlType;
use powerinfer_predictor::predictor::F32Predictor;
use powerinfer_predictor::storage::{StorageChoice, StorageMargin, STORAGE_CANDIDATES};

/// Flags of the predictor storage check.
#[derive(clap::Args, Clone, Debug)]
pub struct CheckArgs {
    /// Text whose tokens are the held-out inputs of the predictor check (default: a built-in
    /// paragraph).
    #[arg(long = "calib-file")]
    pub calib_file: Option<PathBuf>,
    /// Tokens of it to run (0 skips the predictor check).
    #[arg(long = "calib-tokens", default_value_t = 128)]
    pub calib_tokens: usize,
    /// Largest loss of recall against the F32 predictor's selection a stored predictor may
    /// have.
    #[arg(long = "predictor-recall-margin", default_value_t = 0.01)]
    pub recall_margin: f64,
    /// Largest relative rise of the predicted density a stored predictor may have.
    #[arg(long = "predictor-density-margin", default_value_t = 0.10)]
    pub density_margin: f64,
}

impl CheckArgs {
    fn margin(&self) -> Result<StorageMargin, String> {
        let ok = |x: f64| x.is_finite() && (0.0..=1.0).contains(&x);
        if !ok(self.recall_margin) {
            return Err(format!(
                "--predictor-recall-margin {} must be in [0, 1]",
                self.recall_margin
            ));
        }
        if !(self.density_margin.is_finite() && self.density_margin >= 0.0) {
            return Err(format!(
                "--predictor-density-margin {} must be ≥ 0",
                self.density_margin
            ));
        }
        Ok(StorageMargin::new(self.recall_margin, self.density_margin))
    }
}

/// The candidate types of `--predictor-type auto`, cheapest first.
pub fn auto_candidates() -> Vec<GgmlType> {
    STORAGE_CANDIDATES.to_vec()
}

/// Runs the check on `model` (a loadable model file whose predictors, or `references`, are
/// the F32 forms to compare with), trying `candidates` cheapest first, and prints the table.
/// Returns each layer's type (`None`: no predictor), or `None` when skipped.
pub fn check(
    model: &Path,
    candidates: &[GgmlType],
    references: Option<&[F32Predictor]>,
    args: &CheckArgs,
) -> Result<Option<Vec<Option<GgmlType>>>, String> {
    let margin = args.margin()?;
    if args.calib_tokens == 0 {
        return Ok(None);
    }
    let text = match &args.calib_file {
        Some(p) => std::fs::read_to_string(p).map_err(|e| super::file_error(p, e))?,
        None => CALIBRATION_TEXT.to_string(),
    };
    let engine = Engine::load(model, super::engine_options(0, None))
        .map_err(|e| super::file_error(model, e))?;
    if !engine.model().is_sparse() {
        return Ok(None);
    }
    let mut tokens = engine.tokenizer().encode(&text, true, false);
    tokens.truncate(args.calib_tokens);
    if tokens.is_empty() {
        return Err("the calibration text has no tokens".into());
    }
    let ctx = engine.model().hparams().n_ctx_train.clamp(1, 512);
    let inputs = collect_predictor_inputs(&engine, &tokens, ctx).map_err(|e| e.to_string())?;
    let choices = choose_predictor_types(&engine, &inputs, candidates, &margin, references)
        .map_err(|e| e.to_string())?;
    print_table(&choices, tokens.len(), &margin);
    Ok(Some(
        choices.iter().map(|c| c.as_ref().map(|c| c.ty)).collect(),
    ))
}

fn print_table(choices: &[Option<StorageChoice>], tokens: usize, margin: &StorageMargin) {
    println!(
        "predictor storage on {tokens} held-out tokens (within {:.1}% recall and +{:.0}% density \
         of the F32 predictor):",
        margin.recall_drop * 100.0,
        margin.density_rise * 100.0
    );
    println!("layer  type  recall  density  F32 density  KiB    tried");
    let mut bytes = 0u64;
    for (layer, c) in choices.iter().enumerate() {
        let Some(c) = c else { continue };
        let tried: Vec<String> = c
            .measured
            .iter()
            .filter(|q| q.ty != c.ty)
            .map(|q| format!("{} {:.4}/{:.4}", q.ty, q.recall, q.density))
            .collect();
        if let Some(q) = c.measured.iter().find(|q| q.ty == c.ty) {
            bytes += q.bytes;
            println!(
                "{layer:<6} {:<5} {:.4}  {:.4}   {:.4}       {:<6.1} {}",
                q.ty.name(),
                q.recall,
                q.density,
                q.reference_density,
                q.bytes as f64 / 1024.0,
                tried.join(", ")
            );
        }
        if c.fell_back {
            eprintln!(
                "warning: layer {layer}: no predictor type within the margin (recall/density: \
                 {}); kept in F32",
                tried.join(", ")
            );
        }
    }
    println!(
        "predictor bytes per token: {:.1} KiB",
        bytes as f64 / 1024.0
    );
}
