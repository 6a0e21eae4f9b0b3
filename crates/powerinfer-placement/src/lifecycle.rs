//! The whole `plan` step for a model file: budget split, statistics, cached or rebuilt GPU
//! index (PowerInfer's lifecycle, reference §2).
//!
//! 1. [`VramBudget::from_gguf`] and [`VramBudget::plan`] give the FFN budget.
//! 2. `--disable-gpu-index`: every neuron on the CPU; no file is read or written.
//! 3. Statistics: the given folder, else `activation/` next to the model; inside it
//!    `activation.safetensors` if present, else `activation_N.pt`. With no statistics (and no
//!    folder given) the FFN stays on the CPU and the result says so ([`IndexSource::NoStatistics`]);
//!    a folder that was given explicitly but cannot be read is an error.
//! 4. `<model>.generated.gpuidx` is reused if [`check_cached`] accepts it and no reset was
//!    asked for; otherwise the solver runs and the file is (over)written. When the dense
//!    offload did not complete the FFN budget is 0 and the written index holds no GPU neuron
//!    (PowerInfer skips the split in that case; the result is the same all-CPU FFN).

use std::path::{Path, PathBuf};

use powerinfer_gguf::{GgufFile, GpuIndex};
use powerinfer_predictor::stats::{ActivationStats, SAFETENSORS_FILE_NAME};

use crate::budget::KvTypes;
use crate::budget::{VramBudget, VramPlan};
use crate::error::{PlacementError, Result};
use crate::solver::{solve, solve_balanced, Method, Problem};
use crate::split::{check_cached, gpuidx_path, stats_digest, GpuSplit, Provenance};

/// Options of [`plan_model`].
#[derive(Clone, Debug)]
pub struct PlanOptions {
    /// The whole VRAM budget in bytes.
    pub budget_bytes: u64,
    /// Context length the KV cache is sized for.
    pub n_ctx: u64,
    /// The KV cache's types (what it weighs in the budget).
    pub kv: KvTypes,
    /// Scratch reserve in bytes.
    pub scratch_bytes: u64,
    /// Neuron group size (a positive multiple of 32).
    pub group: usize,
    /// Q-Infer's balanced mode with this GPU/CPU throughput ratio.
    pub balanced: Option<f64>,
    /// Per-layer minimum (0 or at least this many GPU neurons).
    pub min_neurons: usize,
    /// Per-layer cap.
    pub cap_neurons: Option<usize>,
    /// Statistics folder (default: `activation/` next to the model).
    pub activation: Option<PathBuf>,
    /// Ignore a cached GPU index and rebuild it.
    pub reset: bool,
    /// Put every FFN neuron on the CPU.
    pub disable: bool,
}

/// Where the split came from.
#[derive(Clone, Debug, PartialEq)]
pub enum IndexSource {
    /// The cached GPU index was reused.
    Reused,
    /// The solver ran and the GPU index was written; `reason` says why it was (re)built.
    Built {
        /// Why (no cache, stale cache, reset, ...).
        reason: String,
        /// The solver method.
        method: Method,
        /// Whether the solution is proven optimal.
        exact: bool,
    },
    /// `--disable-gpu-index`: all FFN neurons on the CPU.
    Disabled,
    /// No statistics found in `looked_in`: all FFN neurons on the CPU.
    NoStatistics {
        /// The folder that was searched.
        looked_in: PathBuf,
    },
}

/// The result of [`plan_model`].
#[derive(Clone, Debug)]
pub struct ModelPlan {
    /// The byte accounting.
    pub budget: VramBudget,
    /// How the budget was split.
    pub vram: VramPlan,
    /// GPU neurons per layer.
    pub split: GpuSplit,
    /// The GPU-index file used or written (`None` when disabled or without statistics).
    pub gpuidx: Option<PathBuf>,
    /// Where the split came from.
    pub source: IndexSource,
    /// The activation statistics the split was made from (`None` when disabled or without
    /// statistics): a run-time scheduler starts from them.
    pub stats: Option<ActivationStats>,
}

/// Reads the statistics in `dir` (`activation.safetensors`, else `activation_N.pt`).
pub fn read_stats(dir: &Path) -> Result<ActivationStats> {
    let st = dir.join(SAFETENSORS_FILE_NAME);
    Ok(if st.is_file() {
        ActivationStats::read_safetensors(st)?
    } else {
        ActivationStats::read_pt_dir(dir)?
    })
}

fn mode_string(o: &PlanOptions) -> String {
    let mut m = match o.balanced {
        Some(r) => format!("balanced:{r}"),
        None => "max".to_string(),
    };
    if o.min_neurons > 0 {
        m.push_str(&format!(",min:{}", o.min_neurons));
    }
    if let Some(c) = o.cap_neurons {
        m.push_str(&format!(",cap:{c}"));
    }
    m
}

/// Plans the model at `model` (see the module documentation).
pub fn plan_model(model: &Path, o: &PlanOptions) -> Result<ModelPlan> {
    let file = GgufFile::open(model)?;
    let budget = VramBudget::from_gguf(&file)?;
    drop(file);
    plan_model_with(model, budget, o)
}

/// [`plan_model`] with the caller's accounting of what the device holds (an engine that keeps
/// some dense tensors in host memory leaves them out of `budget.dense`).
pub fn plan_model_with(model: &Path, budget: VramBudget, o: &PlanOptions) -> Result<ModelPlan> {
    if o.group == 0 || o.group % 32 != 0 {
        return Err(PlacementError::Invalid(format!(
            "group size {} is not a positive multiple of 32",
            o.group
        )));
    }
    if let Some(r) = o.balanced {
        if !(r.is_finite() && r > 0.0) {
            return Err(PlacementError::Invalid(format!(
                "balanced ratio {r} is not a positive number"
            )));
        }
    }
    let vram = budget.plan_with(o.budget_bytes, o.n_ctx, o.scratch_bytes, o.kv);
    let all_cpu = |source| ModelPlan {
        split: GpuSplit::all_cpu(&budget.shape.n_ff),
        budget: budget.clone(),
        vram: vram.clone(),
        gpuidx: None,
        source,
        stats: None,
    };
    if o.disable {
        return Ok(all_cpu(IndexSource::Disabled));
    }
    let dir = match &o.activation {
        Some(d) => d.clone(),
        None => model
            .parent()
            .map_or_else(|| PathBuf::from("activation"), |p| p.join("activation")),
    };
    let has_stats = dir.join(SAFETENSORS_FILE_NAME).is_file()
        || dir
            .join(powerinfer_predictor::stats::pt_file_name(0))
            .is_file();
    if !has_stats && o.activation.is_none() {
        return Ok(all_cpu(IndexSource::NoStatistics { looked_in: dir }));
    }
    let stats = read_stats(&dir)?;
    let widths: Vec<usize> = stats.layers.iter().map(Vec::len).collect();
    if widths != budget.shape.n_ff {
        return Err(PlacementError::Invalid(format!(
            "statistics in {} have layer widths {:?}, the model {:?}",
            dir.display(),
            widths,
            budget.shape.n_ff
        )));
    }
    let (model_size, model_mtime) = Provenance::model_identity(model)?;
    let provenance = Provenance {
        budget_bytes: o.budget_bytes,
        n_ctx: o.n_ctx,
        scratch_bytes: o.scratch_bytes,
        group_size: u32::try_from(o.group)
            .map_err(|_| PlacementError::Invalid(format!("group size {} too large", o.group)))?,
        mode: mode_string(o),
        stats_digest: stats_digest(&stats.layers),
        model_size,
        model_mtime,
        kv_types: format!("{}/{}", o.kv.k.name(), o.kv.v.name()),
    };
    let path = gpuidx_path(model);
    let reason = if o.reset {
        "--reset-gpu-index".to_string()
    } else {
        match check_cached(
            &path,
            &provenance,
            vram.ffn_budget_bytes,
            &budget.shape.n_ff,
        ) {
            Ok(index) => {
                let split =
                    GpuSplit::from_gpu_index(&index, &stats.layers, &budget.shape.neuron_bytes)?;
                return Ok(ModelPlan {
                    budget,
                    vram,
                    split,
                    gpuidx: Some(path),
                    source: IndexSource::Reused,
                    stats: Some(stats),
                });
            }
            Err(reason) => reason,
        }
    };
    let problem = Problem {
        stats: &stats.layers,
        neuron_bytes: &budget.shape.neuron_bytes,
        budget_bytes: vram.ffn_budget_bytes,
        group: o.group,
        min_neurons: o.min_neurons,
        cap_neurons: o.cap_neurons,
    };
    let sol = match o.balanced {
        Some(r) => solve_balanced(&problem, r)?,
        None => solve(&problem)?,
    };
    let index: GpuIndex = sol.split.to_gpu_index(vram.ffn_budget_bytes, &provenance)?;
    index.write_to_path(&path)?;
    Ok(ModelPlan {
        budget,
        vram,
        split: sol.split,
        gpuidx: Some(path),
        source: IndexSource::Built {
            reason,
            method: sol.method,
            exact: sol.exact,
        },
        stats: Some(stats),
    })
}
