//! The hybrid engine on a real GPU (`--gpu cuda`) against the CPU engine. Without a usable GPU
//! it prints why and passes, unless `POWERINFER_REQUIRE_GPU` is set (`scripts/gpu-check run`).

use powerinfer_cli::synth::{self, Family, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::{DeviceChoice, DeviceReport, Engine, GpuIndexMode};
use powerinfer_gguf::GgmlType;

#[path = "support/engine.rs"]
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

/// A prompt block and `n` greedy steps on `device` at `budget`: the logits of every step, the
/// tokens, and the device's report before and after the decode steps.
fn run(
    path: &std::path::Path,
    device: DeviceChoice,
    budget: Option<u64>,
    n: usize,
) -> (Vec<Vec<f32>>, Vec<u32>, DeviceReport, DeviceReport) {
    run_with(path, device, budget, n, false)
}

/// [`run`], with CUDA graphs or without.
fn run_with(
    path: &std::path::Path,
    device: DeviceChoice,
    budget: Option<u64>,
    n: usize,
    graphs: bool,
) -> (Vec<Vec<f32>>, Vec<u32>, DeviceReport, DeviceReport) {
    let mut o = common::opts(false);
    o.device.graphs = graphs;
    o.ctx_len = 96;
    o.device.choice = device;
    o.device.vram_budget = budget;
    o.device.gpu_index = GpuIndexMode::Reset;
    o.device.balance.balance = false;
    o.device.balance.hot_cache = false;
    o.device.balance.calibrate = false;
    let e = Engine::load(path, o).unwrap();
    let mut s = e.session();
    let mut logits = vec![s.eval(&PROMPT).unwrap()];
    let before = e.device_report();
    let mut tokens = Vec::new();
    for _ in 0..n {
        let t = argmax(logits.last().unwrap());
        tokens.push(t);
        logits.push(s.eval(&[t]).unwrap());
    }
    (logits, tokens, before, e.device_report())
}

/// Greedy tokens and logits of the CUDA hybrid (nothing, part and everything of the FFN on
/// the GPU) against the CPU engine, every family, F16 and Q4_0, and what the GPU charged per
/// token. Both sides multiply the same operands (F16 products and axpys round activations to
/// f16 on both; Q4_0 products are the same integer sums); sums run in other orders, so logits
/// differ by rounding (bounds 1e-3 of their std, 2e-2 for F16 whose f16 rounding of a
/// reordered sum can move by a step), and a predictor score that close to its threshold can
/// still decide a neuron differently.
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
            let (want, want_tokens, _, _) = run(&path, DeviceChoice::None, None, 6);
            let (_, _, _, all) = run(&path, DeviceChoice::Cuda(0), None, 0);
            let ffn = all.dense_bytes / 2;
            for budget in [Some(0), Some(all.peak_bytes.saturating_sub(ffn)), None] {
                let (got, tokens, a, r) = run(&path, DeviceChoice::Cuda(0), budget, 6);
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
                assert_eq!(tokens, want_tokens, "{family:?} {ty:?} budget {budget:?}");
                let t = (r.tokens - a.tokens).max(1) as f64;
                let (waits, bytes) = (
                    (r.host_waits - a.host_waits) as f64 / t,
                    (r.link_bytes - a.link_bytes) as f64 / t,
                );
                println!("{family:?} {ty:?} budget {budget:?}: {waits:.2} waits, {bytes:.0} link bytes per token");
                if budget.is_none() {
                    assert!(waits <= 2.0, "{r:?}");
                }
            }
        }
    }
}

/// 64 greedy tokens on the GPU, everything resident and half the FFN, with CUDA graphs and
/// without, are the CPU's.
#[test]
fn cuda_greedy_text_is_the_cpus() {
    if !gpu_or_skip() {
        return;
    }
    for ty in [GgmlType::Q4_0, GgmlType::F16] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.powerinfer.gguf");
        let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
        cfg.ty = ty;
        cfg.seed = 77;
        let out = SynthOutputs {
            model: path.clone(),
            dense: None,
            activation_dir: Some(dir.path().join("activation")),
            predictor_dir: None,
        };
        synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
        let (_, want, _, _) = run(&path, DeviceChoice::None, None, 64);
        let (_, _, _, all) = run(&path, DeviceChoice::Cuda(0), None, 0);
        for budget in [None, Some(all.peak_bytes - all.dense_bytes / 4)] {
            let (_, got, _, _) = run(&path, DeviceChoice::Cuda(0), budget, 64);
            assert_eq!(got, want, "{ty:?} budget {budget:?}");
            // Captured programs replayed (one per layer part) give the same tokens.
            let (_, got, a, b) = run_with(&path, DeviceChoice::Cuda(0), budget, 64, true);
            assert_eq!(got, want, "{ty:?} budget {budget:?} with graphs");
            let t = (b.tokens - a.tokens).max(1) as f64;
            println!(
                "{ty:?} budget {budget:?} graphs: {:.1} launches per token",
                (b.launches - a.launches) as f64 / t
            );
        }
    }
}
