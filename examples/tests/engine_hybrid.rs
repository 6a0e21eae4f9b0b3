//! The hybrid engine on the simulated GPU against the CPU engine: same greedy tokens, logits
//! within rounding, for every family and weight type, budgets from nothing to everything, one
//! sequence and several; the device's memory budget is never exceeded.

use std::path::{Path, PathBuf};

use powerinfer_cli::synth::{self, Family, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::{
    Batch, DeviceChoice, DeviceReport, Engine, EngineOptions, EvalOptions, GpuIndexMode,
};
use powerinfer_gguf::GgmlType;
use proptest::prelude::*;

#[path = "support/engine.rs"]
mod common;
use common::{argmax, PROMPT};

/// A tiny PowerInfer file with its activation statistics beside it, and its dense twin.
struct Model {
    _dir: tempfile::TempDir,
    sparse: PathBuf,
    dense: PathBuf,
}

fn model(ty: GgmlType, family: Family, seed: u64) -> Model {
    let dir = tempfile::tempdir().unwrap();
    let sparse = dir.path().join("model.powerinfer.gguf");
    let dense = dir.path().join("model.gguf");
    let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
    cfg.ty = ty;
    cfg.set_family(family);
    cfg.seed = seed;
    let out = SynthOutputs {
        model: sparse.clone(),
        dense: Some(dense.clone()),
        activation_dir: Some(dir.path().join("activation")),
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    Model {
        _dir: dir,
        sparse,
        dense,
    }
}

fn options(device: DeviceChoice, budget: Option<u64>) -> EngineOptions {
    let mut o = common::opts(false);
    o.ctx_len = 64;
    o.device.choice = device;
    o.device.vram_budget = budget;
    o.device.gpu_index = GpuIndexMode::Reset;
    // PowerInfer's static split: every held neuron computed on the device (engine_balance.rs
    // covers the run-time scheduling).
    o.device.balance.balance = false;
    o.device.balance.hot_cache = false;
    o.device.balance.calibrate = false;
    o
}

/// A prompt block and `n` greedy decode steps: the tokens and every step's logits.
fn greedy(engine: &Engine, n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut s = engine.session();
    let mut logits = vec![s.eval(&PROMPT).unwrap()];
    let mut tokens = Vec::new();
    for _ in 0..n {
        let t = argmax(logits.last().unwrap());
        tokens.push(t);
        logits.push(s.eval(&[t]).unwrap());
    }
    (tokens, logits)
}

/// max |a − b| over the std of `b`.
fn rel(a: &[f32], b: &[f32]) -> f64 {
    let b64: Vec<f64> = b.iter().map(|&v| v as f64).collect();
    common::rel_diff(a, &b64)
}

/// Bytes the FFN rows of the model take (what "everything" must hold at least).
fn ffn_bytes(path: &Path) -> u64 {
    let file = powerinfer_gguf::GgufFile::open(path).unwrap();
    file.tensors()
        .iter()
        .filter(|t| {
            let n = t.name();
            n.contains("ffn_up") || n.contains("ffn_gate") || n.contains("ffn_down_t")
        })
        .map(|t| t.n_bytes())
        .sum()
}

fn check_report(r: &DeviceReport, budget: Option<u64>) {
    assert!(r.kind.starts_with("sim"), "{r:?}");
    if let Some(b) = budget {
        assert_eq!(r.budget_bytes, b);
    }
    assert!(r.peak_bytes <= r.budget_bytes, "{r:?}");
}

/// Greedy tokens identical and logits within 1e-5 of their std (F16: 1e-3) for every family
/// and weight type, with nothing, a part and everything on the simulated device; nothing on it gives the
/// CPU engine's bits. The only difference the device makes is where the sum over the active
/// neurons is split (CPU part + device part), a reordering of float additions.
#[test]
fn sim_matches_cpu_for_every_family_type_and_budget() {
    for (i, family) in [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt]
        .into_iter()
        .enumerate()
    {
        for (j, ty) in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0]
            .into_iter()
            .enumerate()
        {
            let m = model(ty, family, 40 + (3 * i + j) as u64);
            let cpu = Engine::load(&m.sparse, options(DeviceChoice::None, None)).unwrap();
            let (want_tokens, want) = greedy(&cpu, 8);
            let ffn = ffn_bytes(&m.sparse);
            // The budget covering everything, found from the default placement.
            let all = Engine::load(&m.sparse, options(DeviceChoice::Sim, None)).unwrap();
            let everything = all.device_report();
            assert_eq!(
                everything.ffn_rows, everything.ffn_total,
                "{family:?} {ty:?}"
            );
            assert_eq!(everything.dense_matrices, everything.dense_total);
            let partial = everything.peak_bytes - 2 * ffn / 3;
            for budget in [Some(0), Some(partial), None] {
                let e = Engine::load(&m.sparse, options(DeviceChoice::Sim, budget)).unwrap();
                let (tokens, got) = greedy(&e, 8);
                let r = e.device_report();
                check_report(&r, budget);
                let what = format!("{family:?} {ty:?} budget {budget:?}: {r:?}");
                assert_eq!(tokens, want_tokens, "{what}");
                let d = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| rel(g, w))
                    .fold(0.0, f64::max);
                eprintln!("{family:?} {ty:?} budget {budget:?}: max logit diff {d:e} of std");

                // F16 products round activations to f16 (as ggml does), Q8_0/Q4_0 products
                // quantize them to 8 bits per block: a reordered sum can move one such rounding
                // by a step, which later layers carry.
                let bound = if ty == GgmlType::F16 { 1e-3 } else { 1e-4 };
                assert!(d <= bound, "{what}: logits differ by {d:e} of their std");
                match budget {
                    Some(0) => {
                        assert_eq!((r.ffn_rows, r.dense_matrices), (0, 0), "{what}");
                        assert_eq!(got, want, "{what}: nothing on the device, same bits");
                    }
                    Some(_) => {
                        assert!(r.ffn_rows > 0 && r.ffn_rows < r.ffn_total, "{what}");
                        assert!(r.active_device > 0 && r.active_cpu > 0, "{what}");
                    }
                    None => {
                        assert_eq!(r.active_cpu, 0, "{what}: every neuron on the device");
                        assert!(r.active_device > 0, "{what}");
                    }
                }
            }
        }
    }
}

/// Several sequences in one batch (a prompt block beside decode tokens): each sequence's
/// logits with part of the model on the device equal the CPU engine's within rounding.
#[test]
fn sim_batches_match_cpu() {
    let m = model(GgmlType::Q4_0, Family::Llama, 51);
    let run = |o: EngineOptions| {
        let e = Engine::load(&m.sparse, o).unwrap();
        let mut cache = e.new_cache();
        let (a, b, c) = (
            cache.add_sequence(),
            cache.add_sequence(),
            cache.add_sequence(),
        );
        let mut first = Batch::new();
        first.push(a, &PROMPT[..5]).push(b, &PROMPT[5..]);
        let mut out = e.eval(&mut cache, &first, EvalOptions::new()).unwrap();
        let mut second = Batch::new();
        second.push(a, &[17]).push(b, &[23]).push(c, &PROMPT[2..9]);
        out.extend(
            e.eval(&mut cache, &second, EvalOptions::new().all_logits())
                .unwrap(),
        );
        (out, e.device_report())
    };
    let (want, _) = run(options(DeviceChoice::None, None));
    let probe = Engine::load(&m.sparse, options(DeviceChoice::Sim, None)).unwrap();
    let r = probe.device_report();
    let budget = r.peak_bytes - ffn_bytes(&m.sparse) / 2;
    let (got, r) = run(options(DeviceChoice::Sim, Some(budget)));
    assert!(r.ffn_rows > 0 && r.ffn_rows < r.ffn_total, "{r:?}");
    assert!(r.peak_bytes <= budget);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let d = rel(&g.logits, &w.logits);
        assert!(d <= 1e-5, "segment {i}: {d:e}");
    }
}

/// Dense GGUF files offload whole layers (`n_gpu_layers`, the last ones; more than the layer
/// count takes the output head too): the same bits as the CPU engine (every product is the
/// CPU kernel's on the device's copy), and a PowerInfer file refuses `n_gpu_layers`.
#[test]
fn dense_files_offload_layers() {
    let m = model(GgmlType::Q8_0, Family::Llama, 52);
    let cpu = Engine::load(&m.dense, options(DeviceChoice::None, None)).unwrap();
    let (want_tokens, want) = greedy(&cpu, 6);
    for (n, matrices) in [(1, 7), (2, 14), (3, 15)] {
        let mut o = options(DeviceChoice::Sim, None);
        o.device.n_gpu_layers = Some(n);
        let e = Engine::load(&m.dense, o).unwrap();
        let r = e.device_report();
        assert_eq!(r.dense_matrices, matrices, "-ngl {n}: {r:?}");
        let (tokens, got) = greedy(&e, 6);
        assert_eq!(tokens, want_tokens, "-ngl {n}");
        assert_eq!(got, want, "-ngl {n}: the same kernels, the same bits");
    }
    let mut o = options(DeviceChoice::Sim, None);
    o.device.n_gpu_layers = Some(1);
    let e = Engine::load(&m.sparse, o).unwrap_err().to_string();
    assert!(e.contains("-ngl 1") && e.contains("--vram-budget"), "{e}");
}

/// Without statistics, or with the GPU index disabled, the FFN stays on the CPU (the dense
/// parts still go to the device); a budget smaller than the dense parts places the first
/// layers (with their KV rows) and says so; asking for CUDA on a machine without one is a typed error, and `auto`
/// runs on the CPU and says why.
#[test]
fn placement_edge_cases() {
    let m = model(GgmlType::F16, Family::Bamboo, 53);
    let mut o = options(DeviceChoice::Sim, None);
    o.device.gpu_index = GpuIndexMode::Disable;
    let r = Engine::load(&m.sparse, o).unwrap().device_report();
    assert_eq!(r.ffn_rows, 0);
    assert!(r.dense_matrices > 0);
    assert!(r.placement.contains("disabled"), "{r:?}");

    std::fs::remove_dir_all(m.sparse.parent().unwrap().join("activation")).unwrap();
    let mut o = options(DeviceChoice::Sim, None);
    o.device.gpu_index = GpuIndexMode::Reuse;
    let r = Engine::load(&m.sparse, o).unwrap().device_report();
    assert_eq!(r.ffn_rows, 0);
    assert!(r.placement.contains("no activation statistics"), "{r:?}");

    let full = Engine::load(&m.sparse, options(DeviceChoice::Sim, None))
        .unwrap()
        .device_report();
    // No statistics any more: the device holds only dense matrices.
    let cut = full.peak_bytes - full.dense_bytes / 2;
    let small = Engine::load(&m.sparse, options(DeviceChoice::Sim, Some(cut))).unwrap();
    let r = small.device_report();
    assert!(
        r.dense_matrices > 0 && r.dense_matrices < r.dense_total,
        "{r:?}"
    );
    let note = r.note.as_deref().unwrap_or("");
    assert!(
        note.contains("VRAM budget") && note.contains("holds"),
        "{r:?}"
    );
    assert!(r.peak_bytes <= cut && r.ffn_rows == 0, "{r:?}");
    greedy(&small, 3);
    let tiny = Engine::load(&m.sparse, options(DeviceChoice::Sim, Some(1000))).unwrap();
    let r = tiny.device_report();
    assert!(
        r.note.as_deref().unwrap_or("").contains("work buffers"),
        "{r:?}"
    );
    assert_eq!((r.dense_matrices, r.ffn_rows, r.peak_bytes), (0, 0, 0));
    greedy(&tiny, 3);

    if powerinfer_kernels_cuda::Gpu::detect().is_err() {
        let e = Engine::load(&m.sparse, options(DeviceChoice::Cuda(0), None)).unwrap_err();
        assert!(e.to_string().starts_with("no GPU"), "{e}");
        let auto = Engine::load(&m.sparse, options(DeviceChoice::Auto, None)).unwrap();
        let r = auto.device_report();
        assert_eq!(r.kind, "none");
        assert!(r.note.unwrap().contains("runs on the CPU"));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// Whatever the budget, the device never holds more than it (the allocator refuses
    /// before allocating), loading succeeds and a decode step runs.
    #[test]
    fn budget_is_never_exceeded(frac in 0.0f64..1.2, family in 0usize..4, seed in 0u64..3) {
        let fam = [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt][family];
        let m = model(GgmlType::Q4_0, fam, 60 + seed);
        let all = Engine::load(&m.sparse, options(DeviceChoice::Sim, None)).unwrap();
        let budget = (all.device_report().budget_bytes as f64 * frac) as u64;
        let e = Engine::load(&m.sparse, options(DeviceChoice::Sim, Some(budget))).unwrap();
        greedy(&e, 2);
        let r = e.device_report();
        prop_assert!(r.peak_bytes <= budget, "{:?}", r);
        prop_assert_eq!(r.budget_bytes, budget);
    }
}
