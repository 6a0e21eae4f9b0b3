//! The hybrid engine on a real GPU (`--gpu cuda`) against the CPU engine. Without a usable GPU
//! it prints why and passes, unless `POWERINFER_REQUIRE_GPU` is set (`scripts/gpu-check run`).

use powerinfer_cli::synth::{self, Family, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::{DeviceChoice, Engine, GpuIndexMode};
use powerinfer_gguf::GgmlType;

mod common;
use common::{argmax, PROMPT};

fn gpu_or_skip() -> bool {
    match powerinfer_kernels_cuda::Gpu::detect() {
        Ok(_) => true,
        Err(e) if std::env::var_os("POWERINFER_REQUIRE_GPU").is_some() => {
            panic!("POWERINFER_REQUIRE_GPU is set but there is no GPU: {e}")
        }
        Err(e) => {
            println!("skipped: no GPU ({e})");
            false
        }
    }
}

/// Greedy tokens and logits of the CUDA hybrid (nothing, part and everything of the FFN on
/// the GPU) against the CPU engine, every family, F16 and Q4_0. The GPU multiplies F16 rows
/// with f32 activations where the CPU rounds them to f16, so F16 logits differ by that rounding
/// (bound 2e-2 of their std); Q4_0 products are the same integer sums (bound 1e-3).
#[test]
fn cuda_hybrid_matches_cpu() {
    if !gpu_or_skip() {
        return;
    }
    for (i, family) in [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt]
        .into_iter()
        .enumerate()
    {
        for ty in [GgmlType::F16, GgmlType::Q4_0] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("m.powerinfer.gguf");
            let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
            cfg.ty = ty;
            cfg.set_family(family);
            cfg.seed = 70 + i as u64;
            let out = SynthOutputs {
                model: path.clone(),
                dense: None,
                activation_dir: Some(dir.path().join("activation")),
                predictor_dir: None,
            };
            synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
            let run = |choice, budget| {
                let mut o = common::opts(false);
                o.ctx_len = 64;
                o.device.choice = choice;
                o.device.vram_budget = budget;
                o.device.gpu_index = GpuIndexMode::Reset;
                let e = Engine::load(&path, o).unwrap();
                let mut s = e.session();
                let mut logits = vec![s.eval(&PROMPT).unwrap()];
                for _ in 0..6 {
                    let t = argmax(logits.last().unwrap());
                    logits.push(s.eval(&[t]).unwrap());
                }
                (logits, e.device_report())
            };
            let (want, _) = run(DeviceChoice::None, None);
            let (_, all) = run(DeviceChoice::Cuda(0), None);
            let ffn = all.dense_bytes / 2;
            for budget in [Some(0), Some(all.peak_bytes.saturating_sub(ffn)), None] {
                let (got, r) = run(DeviceChoice::Cuda(0), budget);
                assert!(r.peak_bytes <= r.budget_bytes, "{r:?}");
                let bound = if ty == GgmlType::F16 { 2e-2 } else { 1e-3 };
                for (g, w) in got.iter().zip(&want) {
                    let w64: Vec<f64> = w.iter().map(|&v| v as f64).collect();
                    let d = common::rel_diff(g, &w64);
                    println!("{family:?} {ty:?} budget {budget:?}: {d:e}");
                    assert!(
                        d <= bound,
                        "{family:?} {ty:?} budget {budget:?}: {d:e} {r:?}"
                    );
                }
            }
        }
    }
}
