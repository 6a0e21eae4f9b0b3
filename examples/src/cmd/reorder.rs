//! `powerinfer reorder IN OUT`: writes a PowerInfer file with each layer's FFN neurons sorted by
//! their activation frequency (most active first), from the activation statistics next to the
//! input (`activation/*.pt`, as PowerInfer ships them, or `activation.safetensors`), and the
//! statistics permuted alike next to the output. Same model, faster sparse decode: see
//! `crate::reorder`.

use std::path::{Path, PathBuf};

use crate::reorder::reorder_neurons;
use powerinfer_predictor::stats::ActivationStats;

/// Arguments of `powerinfer reorder`.
#[derive(clap::Args)]
pub struct Args {
    /// Input PowerInfer file.
    pub input: PathBuf,
    /// Output PowerInfer file (written under a temporary name, renamed when complete).
    pub output: PathBuf,
    /// Folder of the input's activation statistics (default: `activation/` next to the input).
    #[arg(long)]
    pub activation: Option<PathBuf>,
    /// Folder for the permuted statistics (default: `activation/` next to the output).
    #[arg(long)]
    pub activation_out: Option<PathBuf>,
}

/// `dir/activation_*.pt` if there are any, else `dir/activation.safetensors`.
fn read_stats(dir: &Path) -> Result<ActivationStats, String> {
    if dir.join("activation_0.pt").exists() {
        return ActivationStats::read_pt_dir(dir).map_err(|e| format!("{}: {e}", dir.display()));
    }
    let st = dir.join("activation.safetensors");
    ActivationStats::read_safetensors(&st).map_err(|e| format!("{}: {e}", st.display()))
}

fn activation_next_to(file: &Path) -> PathBuf {
    file.parent()
        .map(|p| p.join("activation"))
        .unwrap_or_else(|| PathBuf::from("activation"))
}

/// Runs `powerinfer reorder`.
pub fn run(args: Args) -> Result<(), String> {
    let in_dir = args
        .activation
        .clone()
        .unwrap_or_else(|| activation_next_to(&args.input));
    let out_dir = args
        .activation_out
        .clone()
        .unwrap_or_else(|| activation_next_to(&args.output));
    let same = matches!(
        (out_dir.canonicalize(), in_dir.canonicalize()),
        (Ok(a), Ok(b)) if a == b
    );
    if same {
        return Err(format!(
            "the permuted statistics would overwrite the input's in {}: pass --activation-out",
            out_dir.display()
        ));
    }
    let stats = read_stats(&in_dir)?;
    let report = reorder_neurons(&args.input, &args.output, &stats)
        .map_err(|e| super::file_error(&args.input, e))?;
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    report
        .stats
        .write_pt_dir(&out_dir)
        .map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let st = out_dir.join("activation.safetensors");
    report
        .stats
        .write_safetensors(&st)
        .map_err(|e| format!("{}: {e}", st.display()))?;
    let n = report.top20_share.len().max(1) as f32;
    let mean = report.top20_share.iter().sum::<f32>() / n;
    println!(
        "wrote {}: {} layers, {} tensors permuted; the first 20% of each layer's neurons now carry \
         {:.1}% of its activations (mean); statistics in {}",
        args.output.display(),
        report.top20_share.len(),
        report.permuted.len(),
        100.0 * mean,
        out_dir.display()
    );
    Ok(())
}
