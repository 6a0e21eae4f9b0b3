//! `powerinfer plan -m MODEL --vram-budget GIB`: which FFN neurons go to the GPU.
//!
//! Splits the VRAM budget (dense tensors in PowerInfer's order, f16 KV cache for `--ctx`, a
//! scratch reserve, then FFN neuron rows), reuses or (re)builds `<model>.generated.gpuidx`, and
//! prints a per-layer table (GPU neurons, share of the layer's activation mass) with totals.
//! `--json` prints one object: `{"budget_bytes", "dense_bytes", "kv_bytes", "ffn_bytes",
//! "layers": [{"layer", "gpu_neurons", "mass_share"}], "gpuidx" (path or null), "scratch_bytes",
//! "left_bytes", "source"}` (dense, KV and scratch bytes are those placed on the GPU).
//!
//! Without an `activation/` folder next to the model (or `--activation DIR`), the FFN stays on
//! the CPU and a note says so on stderr.

use std::io::{self, BufWriter, Write};
use std::path::PathBuf;

use powerinfer_placement::{plan_model, IndexSource, ModelPlan, PlanOptions};
use serde_json::json;

/// Arguments of `powerinfer plan`.
#[derive(clap::Args)]
pub struct Args {
    /// The PowerInfer model file.
    #[arg(short, long)]
    pub model: PathBuf,
    /// VRAM budget in GiB (fractions allowed).
    #[arg(long)]
    pub vram_budget: f64,
    /// Activation statistics folder (default: `activation/` next to the model).
    #[arg(long)]
    pub activation: Option<PathBuf>,
    /// Context length the KV cache is sized for.
    #[arg(long, default_value_t = 512)]
    pub ctx: u64,
    /// Neurons per group (a multiple of 32).
    #[arg(long, default_value_t = 256)]
    pub group: usize,
    /// Q-Infer's balanced mode: GPU/CPU throughput ratio r (GPU share r/(1+r) per layer).
    #[arg(long)]
    pub balanced: Option<f64>,
    /// Scratch reserve in MiB.
    #[arg(long, default_value_t = 0.0)]
    pub scratch_mib: f64,
    /// A layer holds 0 or at least this many GPU neurons.
    #[arg(long, default_value_t = 0)]
    pub min_neurons: usize,
    /// At most this many GPU neurons per layer.
    #[arg(long)]
    pub cap_neurons: Option<usize>,
    /// Ignore a cached GPU index and rebuild it.
    #[arg(long)]
    pub reset_gpu_index: bool,
    /// All FFN neurons on the CPU (no GPU index read or written).
    #[arg(long)]
    pub disable_gpu_index: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn bytes_of(amount: f64, unit: f64, what: &str) -> Result<u64, String> {
    let b = amount * unit;
    if !(b.is_finite() && b >= 0.0 && b < u64::MAX as f64) {
        return Err(format!("{what} {amount} is not a usable size"));
    }
    Ok(b as u64)
}

/// Runs `powerinfer plan`.
pub fn run(args: Args) -> Result<(), String> {
    let opts = PlanOptions {
        budget_bytes: bytes_of(args.vram_budget, (1u64 << 30) as f64, "--vram-budget")?,
        n_ctx: args.ctx,
        scratch_bytes: bytes_of(args.scratch_mib, (1u64 << 20) as f64, "--scratch-mib")?,
        group: args.group,
        balanced: args.balanced,
        min_neurons: args.min_neurons,
        cap_neurons: args.cap_neurons,
        activation: args.activation.clone(),
        reset: args.reset_gpu_index,
        disable: args.disable_gpu_index,
    };
    let plan =
        plan_model(&args.model, &opts).map_err(|e| format!("{}: {e}", args.model.display()))?;
    match &plan.source {
        IndexSource::NoStatistics { looked_in } => eprintln!(
            "note: no activation statistics in {}; all FFN neurons stay on the CPU \
             (give them with --activation DIR)",
            looked_in.display()
        ),
        IndexSource::Disabled => eprintln!("note: GPU index disabled; all FFN neurons on the CPU"),
        IndexSource::Built { reason, .. } => {
            if let Some(p) = &plan.gpuidx {
                eprintln!("wrote {} ({reason})", p.display());
            }
        }
        IndexSource::Reused => {}
    }
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let written = if args.json {
        serde_json::to_writer(&mut out, &to_json(&plan))
            .map_err(io::Error::from)
            .and_then(|()| writeln!(out))
    } else {
        write_table(&mut out, &plan)
    };
    written
        .and_then(|()| out.flush())
        .or_else(|e| match e.kind() {
            io::ErrorKind::BrokenPipe => Ok(()),
            _ => Err(format!("writing output: {e}")),
        })
}

fn source_text(s: &IndexSource) -> String {
    match s {
        IndexSource::Reused => "reused".into(),
        IndexSource::Built { method, exact, .. } => {
            format!(
                "built ({method:?}{})",
                if *exact { ", optimal" } else { "" }
            )
        }
        IndexSource::Disabled => "disabled".into(),
        IndexSource::NoStatistics { .. } => "no statistics".into(),
    }
}

fn to_json(p: &ModelPlan) -> serde_json::Value {
    let layers: Vec<_> = p
        .split
        .layers
        .iter()
        .enumerate()
        .map(|(i, l)| json!({"layer": i, "gpu_neurons": l.k(), "mass_share": l.mass_share()}))
        .collect();
    json!({
        "budget_bytes": p.vram.budget_bytes,
        "dense_bytes": p.vram.dense_gpu_bytes,
        "kv_bytes": p.vram.kv_gpu_bytes,
        "ffn_bytes": p.split.ffn_bytes,
        "layers": layers,
        "gpuidx": p.gpuidx.as_ref().map(|g| g.display().to_string()),
        "scratch_bytes": p.vram.scratch_bytes,
        "left_bytes": p.vram.left_after(p.split.ffn_bytes),
        "source": source_text(&p.source),
    })
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn write_table(out: &mut impl Write, p: &ModelPlan) -> io::Result<()> {
    writeln!(
        out,
        "{:>5} {:>8} {:>11} {:>10} {:>12}",
        "layer", "n_ff", "gpu_neurons", "mass", "ffn_MiB"
    )?;
    for (i, l) in p.split.layers.iter().enumerate() {
        let bytes = l.k() as u64 * p.budget.shape.neuron_bytes[i];
        writeln!(
            out,
            "{i:>5} {:>8} {:>11} {:>9.2}% {:>12.2}",
            l.n_ff,
            l.k(),
            100.0 * l.mass_share(),
            mib(bytes)
        )?;
    }
    let v = &p.vram;
    let gpu: usize = p.split.layers.iter().map(|l| l.k()).sum();
    let all: usize = p.split.layers.iter().map(|l| l.n_ff).sum();
    writeln!(out, "budget   {:>12.2} MiB", mib(v.budget_bytes))?;
    writeln!(
        out,
        "dense    {:>12.2} MiB on GPU of {:.2} MiB ({} of {} tensors{})",
        mib(v.dense_gpu_bytes),
        mib(v.dense_total_bytes),
        v.dense_gpu_count,
        p.budget.dense.len(),
        if v.dense_complete {
            ""
        } else {
            "; incomplete, no FFN split"
        }
    )?;
    writeln!(
        out,
        "kv       {:>12.2} MiB on GPU of {:.2} MiB",
        mib(v.kv_gpu_bytes),
        mib(v.kv_total_bytes)
    )?;
    writeln!(out, "scratch  {:>12.2} MiB", mib(v.scratch_bytes))?;
    writeln!(
        out,
        "ffn      {:>12.2} MiB ({gpu} of {all} neurons)",
        mib(p.split.ffn_bytes)
    )?;
    writeln!(
        out,
        "left     {:>12.2} MiB",
        mib(v.left_after(p.split.ffn_bytes))
    )?;
    match &p.gpuidx {
        Some(g) => writeln!(out, "gpuidx   {} ({})", g.display(), source_text(&p.source)),
        None => writeln!(out, "gpuidx   none ({})", source_text(&p.source)),
    }
}
