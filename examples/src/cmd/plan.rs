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
//!
//! `--predict` writes nothing: it solves the placement for the budget and prints the decode
//! speed the cost model (`powerinfer_placement::cost`) predicts for PowerInfer's static split
//! and for the balanced one, on this machine's CPU (its measured read bandwidth, or
//! `--cpu-bw`) and a GPU of `--gpu-bw`, `--gpu-launch-us` and `--link-bw`.

use std::io::{self, Write};
use std::path::PathBuf;

use powerinfer_engine::KvType;
use powerinfer_placement::cost::{self, Hardware, Policy, StepCost, Workload};
use powerinfer_placement::lifecycle::read_stats;
use powerinfer_placement::{
    activation_probabilities, plan_model, solve, IndexSource, KvTypes, ModelPlan, PlanOptions,
    Problem, VramBudget,
};
use serde_json::json;

/// Arguments of `powerinfer plan`.
#[derive(clap::Args)]
pub struct Args {
    /// The model.
    #[command(flatten)]
    pub model: super::model::ModelArgs,
    /// VRAM budget in GiB (fractions allowed).
    #[arg(long, value_parser = super::device::gib)]
    pub vram_budget: f64,
    /// Activation statistics folder (default: `activation/` next to the model).
    #[arg(long)]
    pub activation: Option<PathBuf>,
    /// Context length the KV cache is sized for.
    #[arg(long, default_value_t = 512)]
    pub ctx: u64,
    /// The KV cache's types (a smaller cache leaves more of the budget to neuron rows).
    #[command(flatten)]
    pub cache: super::CacheTypes,
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
    /// Predict decode tokens/s for this budget instead of writing the GPU index (see the
    /// module docs).
    #[arg(long)]
    pub predict: bool,
    /// `--predict`: the CPU's read bandwidth in GB/s (default: measured now).
    #[arg(long = "cpu-bw")]
    pub cpu_bw: Option<f64>,
    /// `--predict`: the CPU's microseconds per active neuron and token on its FFN part
    /// (default: the neuron's bytes over the CPU bandwidth).
    #[arg(long = "cpu-row-us")]
    pub cpu_row_us: Option<f64>,
    /// `--predict`: fixed CPU microseconds per layer (dispatches, norms, RoPE).
    #[arg(long = "cpu-layer-us", default_value_t = 20.0)]
    pub cpu_layer_us: f64,
    /// `--predict`: the GPU's memory bandwidth in GB/s.
    #[arg(long = "gpu-bw", default_value_t = 900.0)]
    pub gpu_bw: f64,
    /// `--predict`: microseconds per GPU kernel launch.
    #[arg(long = "gpu-launch-us", default_value_t = 5.0)]
    pub gpu_launch_us: f64,
    /// `--predict`: host link bandwidth in GB/s.
    #[arg(long = "link-bw", default_value_t = 25.0)]
    pub link_bw: f64,
    /// `--predict`: sequences decoded together.
    #[arg(long = "batch", default_value_t = 1)]
    pub batch: usize,
    /// `--predict`: KV positions each token attends to.
    #[arg(long = "attended", default_value_t = 128)]
    pub attended: usize,
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
    if args.predict {
        let p = predict(&args)?;
        if args.json {
            println!("{}", p.to_json());
        } else {
            p.print_table();
        }
        return Ok(());
    }
    let plan = plan(&args)?;
    if let Some(note) = note(&plan) {
        eprintln!("{note}");
    }
    super::write_stdout(|out| {
        if args.json {
            super::json_line(out, &to_json(&plan))
        } else {
            write_table(out, &plan)
        }
    })
}

/// The placement `args` ask for: the GPU index reused, (re)built and written next to the
/// model, or none (disabled, or no statistics).
pub fn plan(args: &Args) -> Result<ModelPlan, String> {
    let opts = PlanOptions {
        budget_bytes: bytes_of(args.vram_budget, (1u64 << 30) as f64, "--vram-budget")?,
        n_ctx: args.ctx,
        kv: kv_types(&args.cache),
        scratch_bytes: bytes_of(args.scratch_mib, (1u64 << 20) as f64, "--scratch-mib")?,
        group: args.group,
        balanced: args.balanced,
        min_neurons: args.min_neurons,
        cap_neurons: args.cap_neurons,
        activation: args.activation.clone(),
        reset: args.reset_gpu_index,
        disable: args.disable_gpu_index,
    };
    let model = args.model.path()?;
    plan_model(&model, &opts).map_err(|e| super::file_error(&model, e))
}

/// What `powerinfer plan` says on stderr about where `plan`'s GPU index came from, if anything.
pub fn note(plan: &ModelPlan) -> Option<String> {
    match &plan.source {
        IndexSource::NoStatistics { looked_in } => Some(format!(
            "note: no activation statistics in {}; all FFN neurons stay on the CPU \
             (give them with --activation DIR)",
            looked_in.display()
        )),
        IndexSource::Disabled => {
            Some("note: GPU index disabled; all FFN neurons on the CPU".into())
        }
        IndexSource::Built { reason, .. } => plan
            .gpuidx
            .as_ref()
            .map(|p| format!("wrote {} ({reason})", p.display())),
        IndexSource::Reused => None,
    }
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

/// The JSON object `powerinfer plan --json` prints (see the module's documentation).
pub fn to_json(p: &ModelPlan) -> serde_json::Value {
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

fn write_table(out: &mut dyn Write, p: &ModelPlan) -> io::Result<()> {
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

/// The machine and workload `--predict` was asked about.
fn hardware(args: &Args, threads: usize) -> Result<Hardware, String> {
    let positive = |v: f64, what: &str| {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(format!("{what} {v}: expected a positive number"))
        }
    };
    let cpu_bandwidth = match args.cpu_bw {
        Some(v) => positive(v, "--cpu-bw")? * 1e9,
        None => {
            let pool = powerinfer_kernels_cpu::ThreadPool::new(threads);
            super::bandwidth::read_bandwidth(&pool, 1 << 30, 3)
        }
    };
    Ok(Hardware {
        cpu_bandwidth,
        cpu_row_us: args
            .cpu_row_us
            .map(|v| positive(v, "--cpu-row-us"))
            .transpose()?,
        cpu_layer_us: args.cpu_layer_us.max(0.0),
        gpu_bandwidth: positive(args.gpu_bw, "--gpu-bw")? * 1e9,
        gpu_launch_us: args.gpu_launch_us.max(0.0),
        link_bandwidth: positive(args.link_bw, "--link-bw")? * 1e9,
    })
}

/// The predicted step of `policy` for the placement of `budget_bytes` (nothing written).
pub(crate) struct Prediction {
    pub(crate) fixed: StepCost,
    pub(crate) balanced: StepCost,
    pub(crate) held: usize,
    pub(crate) total: usize,
    pub(crate) dense_on_gpu: usize,
}

/// Solves the placement of `model` for `budget_bytes` (PowerInfer's accounting, greedy over
/// the statistics) and predicts both policies.
pub(crate) fn prediction(
    model: &std::path::Path,
    activation: Option<&std::path::Path>,
    budget_bytes: u64,
    ctx: u64,
    hw: &Hardware,
    work: Workload,
) -> Result<Prediction, String> {
    let err = |e: powerinfer_placement::PlacementError| super::file_error(model, e);
    let file = powerinfer_gguf::GgufFile::open(model).map_err(|e| super::file_error(model, e))?;
    let budget = VramBudget::from_gguf(&file).map_err(err)?;
    drop(file);
    let dir = match activation {
        Some(d) => d.to_path_buf(),
        None => model
            .parent()
            .map_or_else(|| PathBuf::from("activation"), |p| p.join("activation")),
    };
    let stats = read_stats(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let vram = budget.plan_with(budget_bytes, ctx, 0, work.kv);
    let sol = solve(&Problem {
        stats: &stats.layers,
        neuron_bytes: &budget.shape.neuron_bytes,
        budget_bytes: vram.ffn_budget_bytes,
        group: 256,
        min_neurons: 0,
        cap_neurons: None,
    })
    .map_err(err)?;
    let p: Vec<Vec<f32>> = stats
        .layers
        .iter()
        .map(|l| activation_probabilities(l))
        .collect();
    let n = vram.dense_gpu_count;
    Ok(Prediction {
        fixed: cost::predict(&budget, n, &sol.split, &p, hw, work, Policy::Static),
        balanced: cost::predict(&budget, n, &sol.split, &p, hw, work, Policy::Balanced),
        held: sol.split.layers.iter().map(|l| l.k()).sum(),
        total: sol.split.layers.iter().map(|l| l.n_ff).sum(),
        dense_on_gpu: n,
    })
}

/// What `plan --predict` found: the cost model's decode step for both policies, and per KV
/// cache type (F16, Q8_0, Q4_0).
pub struct Predicted {
    model: PathBuf,
    budget: u64,
    hw: Hardware,
    work: Workload,
    p: Prediction,
    by_type: Vec<(KvType, Prediction)>,
}

/// The cost model's types of `c`.
fn kv_types(c: &super::CacheTypes) -> KvTypes {
    KvTypes {
        k: c.k.ggml(),
        v: c.v.ggml(),
    }
}

/// The cost model's prediction for the placement `args` ask for (`--predict`; nothing
/// written).
pub fn predict(args: &Args) -> Result<Predicted, String> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let hw = hardware(args, threads)?;
    let work = Workload {
        batch: args.batch.max(1),
        context: args.attended,
        kv: kv_types(&args.cache),
    };
    let budget = bytes_of(args.vram_budget, (1u64 << 30) as f64, "--vram-budget")?;
    let model = args.model.path()?;
    let p = prediction(
        &model,
        args.activation.as_deref(),
        budget,
        args.ctx,
        &hw,
        work,
    )?;
    let mut by_type = Vec::new();
    for ty in [KvType::F16, KvType::Q8_0, KvType::Q4_0] {
        let kv = KvTypes {
            k: ty.ggml(),
            v: ty.ggml(),
        };
        let w = Workload { kv, ..work };
        let pt = prediction(&model, args.activation.as_deref(), budget, args.ctx, &hw, w)?;
        by_type.push((ty, pt));
    }
    Ok(Predicted {
        model,
        budget,
        hw,
        work,
        p,
        by_type,
    })
}

impl Predicted {
    /// The JSON object `plan --predict --json` prints.
    pub fn to_json(&self) -> serde_json::Value {
        let row = |name: &str, c: &StepCost| {
            json!({
                "policy": name, "tokens_per_s": c.tokens_per_s(), "step_ms": c.step_us() / 1e3,
                "gpu_share": c.gpu_share(),
                "computed_on_gpu": c.layers.iter().map(|l| l.computed).sum::<usize>(),
            })
        };
        let (p, hw, work) = (&self.p, &self.hw, &self.work);
        json!({
            "budget_bytes": self.budget, "held_neurons": p.held, "neurons": p.total,
            "dense_on_gpu": p.dense_on_gpu, "batch": work.batch, "attended": work.context,
            "cpu_gbps": hw.cpu_bandwidth / 1e9, "gpu_gbps": hw.gpu_bandwidth / 1e9,
            "link_gbps": hw.link_bandwidth / 1e9,
            "static": row("static", &p.fixed), "balanced": row("balanced", &p.balanced),
            "kv_types": self.by_type.iter().map(|(ty, pt)| json!({
                "type": ty.name(), "held_neurons": pt.held,
                "static_tokens_per_s": pt.fixed.tokens_per_s(),
                "balanced_tokens_per_s": pt.balanced.tokens_per_s(),
            })).collect::<Vec<_>>(),
        })
    }

    /// Prints the prediction as a table.
    fn print_table(&self) {
        let (p, hw, work) = (&self.p, &self.hw, &self.work);
        println!(
            "{}: {} of VRAM holds {} dense tensors and {} of {} FFN neurons ({:.1}%)",
            self.model.display(),
            super::human_bytes(self.budget),
            p.dense_on_gpu,
            p.held,
            p.total,
            100.0 * p.held as f64 / p.total.max(1) as f64
        );
        println!(
            "CPU {:.1} GB/s, GPU {:.0} GB/s (launch {} us), link {:.0} GB/s; batch {}, {} positions attended",
            hw.cpu_bandwidth / 1e9,
            hw.gpu_bandwidth / 1e9,
            hw.gpu_launch_us,
            hw.link_bandwidth / 1e9,
            work.batch,
            work.context
        );
        println!(
            "{:<10} {:>10} {:>10} {:>10} {:>12}",
            "policy", "tok/s", "ms/step", "gpu share", "on GPU"
        );
        for (name, c) in [("static", &p.fixed), ("balanced", &p.balanced)] {
            println!(
                "{name:<10} {:>10.2} {:>10.3} {:>9.1}% {:>12}",
                c.tokens_per_s(),
                c.step_us() / 1e3,
                100.0 * c.gpu_share(),
                c.layers.iter().map(|l| l.computed).sum::<usize>()
            );
        }
        println!(
            "balanced / static: {:.2}x",
            p.balanced.tokens_per_s() / p.fixed.tokens_per_s()
        );
        println!(
            "{:<10} {:>12} {:>14} {:>14}",
            "KV cache", "GPU neurons", "static tok/s", "balanced tok/s"
        );
        for (ty, pt) in &self.by_type {
            println!(
                "{:<10} {:>12} {:>14.2} {:>14.2}",
                ty.name(),
                pt.held,
                pt.fixed.tokens_per_s(),
                pt.balanced.tokens_per_s()
            );
        }
    }
}
