//! Whatever the run-time scheduling does (which held neurons the device computes, which
//! neurons it holds), the results are the static schedule's up to the reordering of float
//! sums: a property test over random schedules and migrations on the simulated device.
//!
//! The model has one layer, so that every FFN input is the same bits in both engines: with
//! more layers, a reordered sum changes the next layer's input in its last bits, and a
//! predictor score that close to the threshold flips a neuron (a different computation, not a
//! reordering; `engine_hybrid.rs` compares whole models).

use proptest::prelude::*;

use powerinfer_cli::synth::{self, Family, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::test_hooks::shuffle_schedule;
use powerinfer_engine::{DeviceChoice, Engine, EngineOptions, GpuIndexMode};
use powerinfer_gguf::GgmlType;

/// A tiny model with activation statistics (the placement needs them).
fn model(dir: &std::path::Path, ty: GgmlType, family: Family, seed: u64) -> std::path::PathBuf {
    let path = dir.join("model.powerinfer.gguf");
    let mut shape = Shape::preset("tiny").unwrap();
    shape.n_layer = 1;
    let mut cfg = SynthConfig::new(shape);
    cfg.ty = ty;
    cfg.set_family(family);
    cfg.seed = seed;
    let out = SynthOutputs {
        model: path.clone(),
        dense: None,
        activation_dir: Some(dir.join("activation")),
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    path
}

fn options(device: DeviceChoice, budget: Option<u64>) -> EngineOptions {
    let mut o = EngineOptions::default();
    o.threads = 1;
    o.ctx_len = 64;
    o.device.choice = device;
    o.device.vram_budget = budget;
    o.device.gpu_index = GpuIndexMode::Reset;
    // The test moves the split itself; the engine's own scheduling stays still.
    o.device.balance.balance = false;
    o.device.balance.hot_cache = false;
    o.device.balance.calibrate = false;
    o
}

/// max |a − b| over the standard deviation of `b`.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let n = b.len() as f64;
    let mean = b.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = b.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let d = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .fold(0.0, f64::max);
    d / var.sqrt().max(1e-12)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    #[test]
    fn any_schedule_gives_the_static_results(
        seed in any::<u64>(),
        family in 0usize..4,
        ty in 0usize..3,
        share in 0.35f64..0.8,
    ) {
        let family = [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt][family];
        let ty = [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0][ty];
        let dir = tempfile::tempdir().unwrap();
        let path = model(dir.path(), ty, family, seed % 1000);
        let cpu = Engine::load(&path, options(DeviceChoice::None, None)).unwrap();
        // A budget holding the dense parts and part of the FFN (at least one 256-neuron group).
        let all = Engine::load(&path, options(DeviceChoice::Sim, None)).unwrap();
        let r = all.device_report();
        let ffn_share = r.ffn_rows as f64 / r.ffn_total.max(1) as f64;
        prop_assert!(ffn_share > 0.99);
        let ffn: u64 = cpu
            .model()
            .file()
            .tensors()
            .iter()
            .filter(|t| ["ffn_up", "ffn_gate", "ffn_down_t"].iter().any(|n| t.name().contains(n)))
            .map(|t| t.n_bytes())
            .sum();
        let budget = r.peak_bytes - (ffn as f64 * (1.0 - share)) as u64;
        drop(all);
        let sim = Engine::load(&path, options(DeviceChoice::Sim, Some(budget))).unwrap();
        let held = sim.device_report().ffn_rows;
        prop_assert!(held > 0 && held < sim.device_report().ffn_total);

        let prompt = [1u32, 5, 9, 13, 2, 7];
        let (mut a, mut b) = (cpu.session(), sim.session());
        let mut rng = seed | 1;
        shuffle_schedule(&sim, &mut rng, true).unwrap();
        let mut want = a.eval(&prompt).unwrap();
        let mut got = b.eval(&prompt).unwrap();
        // Float sums of a few hundred terms in another order. The output head rounds its input
        // to f16 (F16) or to 8-bit blocks (Q8_0, Q4_0): one such rounding moved by a step
        // moves the logits by about (max|x| / 127) / (√n_embd · rms x), ~2e-3 of their std at
        // width 256 for an 8-bit block. A lost or doubled neuron (one of ~100 active) moves
        // them by several percent.
        let bound = if ty == GgmlType::F16 { 1e-3 } else { 1e-2 };
        for step in 0..8 {
            let d = rel(&got, &want);
            prop_assert!(d <= bound, "{family:?} {ty:?} step {step}: logits differ by {d:e}");
            // The CPU engine's greedy token, fed to both.
            let next = want
                .iter()
                .enumerate()
                .max_by(|x, y| x.1.total_cmp(y.1))
                .map(|(i, _)| i as u32)
                .unwrap();
            shuffle_schedule(&sim, &mut rng, false).unwrap();
            want = a.eval(&[next]).unwrap();
            got = b.eval(&[next]).unwrap();
        }
        let rep = sim.balance_report().unwrap();
        let t = rep.total();
        prop_assert!(t.migrations > 0, "no migration ran: {t:?}");
        prop_assert!(t.active_cpu > 0 && t.active_device > 0, "{t:?}");
    }
}
