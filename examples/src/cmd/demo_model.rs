//! The built-in demo model: a synthetic ReLU-sparse model (and its dense twin) written once to
//! the cache folder, what `run` and the benchmarks use when no model is given.

use std::path::PathBuf;
use std::time::Instant;

use powerinfer_gguf::GgmlType;
use powerinfer_predictor::stats::ActivationStats;

use crate::reorder::reorder_neurons;
use crate::synth::{self, PredictorRule, Shape, SynthConfig, SynthOutputs};

/// Shape of the demo model: 12 layers of width 1024 and 4096 neurons (~180 M weights, ~100 MB
/// in Q4_0), small enough to write in seconds and to decode quickly on two cores.
pub(crate) fn demo_shape() -> Shape {
    Shape {
        n_layer: 12,
        n_embd: 1024,
        n_ff: 4096,
        n_head: 16,
        n_head_kv: 4,
        n_vocab: None,
        n_ctx: 1024,
    }
}

/// The folder of the demo model and the benchmarks' synthetic models.
pub(crate) fn cache_dir() -> PathBuf {
    let base = crate::env::cache_home().unwrap_or_else(std::env::temp_dir);
    base.join("powerinfer-rs").join("demo")
}

/// The demo model and its dense twin in the cache directory, written on first use:
/// `(PowerInfer file, dense GGUF twin)`. The PowerInfer file has its FFN neurons sorted by
/// activation frequency (`powerinfer reorder`), as its statistics give them.
pub fn demo_files() -> Result<(PathBuf, PathBuf), String> {
    let dir = cache_dir();
    let path = dir.join("demo-v3-l12-e1024-f4096-q4_0.powerinfer.gguf");
    let twin = dir.join("demo-v3-l12-e1024-f4096-q4_0.dense.gguf");
    if !path.exists() || !twin.exists() {
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        eprintln!("writing the demo model once to {} ...", path.display());
        let t = Instant::now();
        let mut cfg = SynthConfig::new(demo_shape());
        cfg.ty = GgmlType::Q4_0;
        cfg.seed = 2024;
        // PowerInfer's own rule (Q4_0 predictor for a Q4_0 model): an F16 predictor would cost
        // more memory traffic per token than the 10% of the FFN it selects.
        cfg.predictor_rule = PredictorRule::PowerInfer;
        // The converter's neuron order first, with its statistics, then sorted.
        let work = dir.join(format!(".demo-work-{}", std::process::id()));
        std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
        let unsorted = work.join("unsorted.powerinfer.gguf");
        let act = work.join("activation");
        let out = SynthOutputs {
            model: unsorted.clone(),
            dense: Some(twin.clone()),
            activation_dir: Some(act.clone()),
            predictor_dir: None,
        };
        synth::synthesize(&cfg, &out, &mut |_, _| {}).map_err(|e| e.to_string())?;
        let stats = ActivationStats::read_pt_dir(&act).map_err(|e| e.to_string())?;
        reorder_neurons(&unsorted, &path, &stats).map_err(|e| e.to_string())?;
        // Only the sorted file is kept.
        let _ = std::fs::remove_dir_all(&work);
        eprintln!("done in {:.1} s", t.elapsed().as_secs_f64());
    }
    Ok((path, twin))
}
