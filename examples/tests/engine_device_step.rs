//! The device-resident step on the simulated GPU, held to what a GPU must not be charged more
//! than (what the simulated device counts as every device does: kernel launches, host waits,
//! bytes over the host link):
//!
//! - everything on the device: a decode token costs its id and position in, its logits (and
//!   one count per layer) out, and one host wait;
//! - part of the FFN on the device: per layer at most the FFN's input and the CPU's partial sum
//!   (`n_embd` values each) and the scores (`n_ff` values), and at most `n_layer + 2` host waits;
//! - part of the layers on the device: per layer at most two hidden states;
//!
//! and, at every budget, the CPU engine's greedy text. A return to per-operation round trips
//! (every product's input and output over the link, a wait each) breaks these bounds.

use std::path::PathBuf;

use powerinfer_cli::synth::{self, Family, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::{
    Batch, DeviceChoice, DeviceReport, Engine, EngineOptions, EvalOptions, GpuIndexMode,
    SamplingParams,
};
use powerinfer_gguf::GgmlType;
use proptest::prelude::*;

#[path = "support/engine.rs"]
mod common;
use common::{argmax, PROMPT};

struct Model {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn model(ty: GgmlType, family: Family, seed: u64, shape: Shape) -> Model {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.powerinfer.gguf");
    let mut cfg = SynthConfig::new(shape);
    cfg.ty = ty;
    cfg.set_family(family);
    cfg.seed = seed;
    let out = SynthOutputs {
        model: path.clone(),
        dense: None,
        activation_dir: Some(dir.path().join("activation")),
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    Model { _dir: dir, path }
}

fn tiny() -> Shape {
    Shape::preset("tiny").unwrap()
}

/// PowerInfer's static split (every held neuron on the device): the bounds are the step's,
/// not the balancer's choices.
fn options(device: DeviceChoice, budget: Option<u64>) -> EngineOptions {
    let mut o = common::opts(false);
    o.ctx_len = 96;
    o.device.choice = device;
    o.device.vram_budget = budget;
    o.device.gpu_index = GpuIndexMode::Reset;
    o.device.balance.balance = false;
    o.device.balance.hot_cache = false;
    o.device.balance.calibrate = false;
    o
}

/// Greedy decoding of `n` tokens after the prompt; the tokens, and the device's report
/// before and after the decode steps (the prompt's block excluded).
fn decode(e: &Engine, n: usize) -> (Vec<u32>, DeviceReport, DeviceReport) {
    let mut s = e.session();
    let mut logits = s.eval(&PROMPT).unwrap();
    let before = e.device_report();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        logits = s.eval(&[t]).unwrap();
    }
    (out, before, e.device_report())
}

/// Per decode token: launches, host waits and link bytes between two reports.
fn per_token(a: &DeviceReport, b: &DeviceReport) -> (f64, f64, f64) {
    let t = (b.tokens - a.tokens) as f64;
    (
        (b.launches - a.launches) as f64 / t,
        (b.host_waits - a.host_waits) as f64 / t,
        (b.link_bytes - a.link_bytes) as f64 / t,
    )
}

/// The budget that holds everything, and the FFN's bytes.
fn everything(path: &std::path::Path) -> (u64, u64) {
    let all = Engine::load(path, options(DeviceChoice::Sim, None)).unwrap();
    let ffn: u64 = all
        .model()
        .file()
        .tensors()
        .iter()
        .filter(|t| {
            let n = t.name();
            n.contains("ffn_up") || n.contains("ffn_gate") || n.contains("ffn_down_t")
        })
        .map(|t| t.n_bytes())
        .sum();
    (all.device_report().peak_bytes, ffn)
}

#[test]
fn the_whole_model_on_the_device_costs_a_token_its_id_and_its_logits() {
    for (i, family) in [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt]
        .into_iter()
        .enumerate()
    {
        let m = model(GgmlType::Q4_0, family, 80 + i as u64, tiny());
        let cpu = Engine::load(&m.path, options(DeviceChoice::None, None)).unwrap();
        let (want, _, _) = decode(&cpu, 12);
        let e = Engine::load(&m.path, options(DeviceChoice::Sim, None)).unwrap();
        let r = e.device_report();
        assert_eq!(
            (r.layers, r.ffn_rows),
            (r.layers_total, r.ffn_total),
            "{r:?}"
        );
        let (got, a, b) = decode(&e, 12);
        assert_eq!(got, want, "{family:?}: greedy tokens");
        let hp = e.model().hparams();
        let (launches, waits, bytes) = per_token(&a, &b);
        eprintln!(
            "{family:?} all resident: {launches:.0} launches, {waits:.2} waits, {bytes:.0} link \
             bytes per token"
        );
        // Id and position in; logits and a count per layer out.
        let bound = (8 + 4 * hp.n_vocab + 4 * hp.n_layer) as f64;
        assert!(
            bytes <= bound,
            "{family:?}: {bytes} link bytes per token > {bound}"
        );
        assert!(waits <= 2.0, "{family:?}: {waits} host waits per token");
        assert!(launches > 0.0, "{family:?}");
        assert_eq!(
            b.active_cpu, a.active_cpu,
            "{family:?}: the CPU computed neurons"
        );
        // The device's neuron counts (added up by the fused products for one token of a gated
        // FFN, into counts zeroed once a step) are the neurons the CPU computes when it holds
        // the FFN: the same predictor, the same tokens.
        let (all, ffn) = everything(&m.path);
        let host_ffn = Engine::load(&m.path, options(DeviceChoice::Sim, Some(all - ffn))).unwrap();
        let (got, c, d) = decode(&host_ffn, 12);
        assert_eq!(got, want, "{family:?}: greedy tokens, FFN on the host");
        let active = |a: &DeviceReport, b: &DeviceReport| {
            (b.active_device + b.active_cpu) - (a.active_device + a.active_cpu)
        };
        assert!(d.active_cpu > c.active_cpu, "{family:?}: {d:?}");
        assert_eq!(
            active(&a, &b),
            active(&c, &d),
            "{family:?}: neurons computed"
        );
    }
}

#[test]
fn part_of_the_ffn_on_the_device_sends_a_layer_its_share_only() {
    for (i, family) in [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt]
        .into_iter()
        .enumerate()
    {
        let m = model(GgmlType::Q8_0, family, 90 + i as u64, tiny());
        let cpu = Engine::load(&m.path, options(DeviceChoice::None, None)).unwrap();
        let (want, _, _) = decode(&cpu, 12);
        let (all, ffn) = everything(&m.path);
        let e = Engine::load(&m.path, options(DeviceChoice::Sim, Some(all - ffn / 2))).unwrap();
        let r = e.device_report();
        assert_eq!(r.layers, r.layers_total, "{r:?}");
        assert!(r.ffn_rows > 0 && r.ffn_rows < r.ffn_total, "{r:?}");
        let (got, a, b) = decode(&e, 12);
        assert_eq!(got, want, "{family:?}: greedy tokens");
        let hp = e.model().hparams();
        let (launches, waits, bytes) = per_token(&a, &b);
        eprintln!(
            "{family:?} half the FFN: {launches:.0} launches, {waits:.2} waits, {bytes:.0} link \
             bytes per token"
        );
        let per_layer = 4 * (2 * hp.n_embd + hp.n_ff);
        let bound = (8 + 4 * hp.n_vocab + 4 * hp.n_layer + hp.n_layer * per_layer) as f64;
        assert!(
            bytes <= bound,
            "{family:?}: {bytes} link bytes per token > {bound}"
        );
        assert!(
            waits <= (hp.n_layer + 2) as f64,
            "{family:?}: {waits} host waits per token"
        );
        assert!(b.active_cpu > a.active_cpu && b.active_device > a.active_device);
    }
}

/// With graphs a device replays each program (the runs between timing marks) with one launch
/// once it has seen it twice: the same tokens, and per token one launch (up to three a layer
/// when the balancer times the hot FFN between two marks) instead of one per kernel, the link
/// and the waits as without graphs (with the static split; the balancer's moves follow
/// measured times).
#[test]
fn graphs_replay_a_layer_with_a_launch_or_three() {
    for (i, family) in [Family::Llama, Family::Opt].into_iter().enumerate() {
        let m = model(GgmlType::Q4_0, family, 110 + i as u64, tiny());
        let cpu = Engine::load(&m.path, options(DeviceChoice::None, None)).unwrap();
        let (want, _, _) = decode(&cpu, 12);
        let (all, ffn) = everything(&m.path);
        for (budget, balance) in [(None, false), (Some(all - ffn / 2), true)] {
            let run = |graphs: bool| {
                let mut o = options(DeviceChoice::Sim, budget);
                o.device.graphs = graphs;
                o.device.balance.balance = balance;
                let e = Engine::load(&m.path, o).unwrap();
                let (got, a, b) = decode(&e, 12);
                assert_eq!(got, want, "{family:?} graphs {graphs}: greedy tokens");
                (per_token(&a, &b), e.model().hparams().n_layer)
            };
            let ((plain, plain_waits, plain_bytes), n_layer) = run(false);
            let ((launches, waits, bytes), _) = run(true);
            eprintln!(
                "{family:?} budget {budget:?}: {plain:.0} launches per token, {launches:.0} with \
                 graphs"
            );
            // One program a token when the device holds everything and nothing times the hot
            // FFN (the static split); up to three a layer when the balancer does. A program
            // runs as it is the first time it is seen (the first decode token), is captured the
            // second time and replayed after.
            let bound = if balance { 3 * n_layer + 2 } else { 1 } as f64;
            let n = 12.0;
            assert!(
                launches <= (plain + (n - 1.0) * bound) / n + 1e-9,
                "{family:?}: {launches} launches per token with graphs"
            );
            assert!(launches < plain, "{family:?}: {launches} vs {plain}");
            // With the balancer on, what it moves (enabled masks, migrated rows: link bytes)
            // follows measured times, which differ from run to run.
            if !balance {
                assert_eq!((waits, bytes), (plain_waits, plain_bytes), "{family:?}");
            }
        }
    }
}

/// A batch of more sequences than the device has KV stores for runs on the CPU without
/// copying any sequence's rows to the device first (and back): no link traffic at all, and the
/// CPU's logits.
#[test]
fn a_batch_beyond_the_stores_stays_on_the_host() {
    let m = model(GgmlType::Q4_0, Family::Llama, 130, tiny());
    let run = |device: DeviceChoice| {
        let e = Engine::load(&m.path, options(device, None)).unwrap();
        let mut cache = e.new_cache();
        let seqs: Vec<_> = (0..2).map(|_| cache.add_sequence()).collect();
        let mut first = Batch::new();
        for &s in &seqs {
            first.push(s, &PROMPT);
        }
        let before = e.device_report();
        let mut out = e.eval(&mut cache, &first, EvalOptions::new()).unwrap();
        let step: Vec<_> = seqs.iter().map(|&s| (s, 7)).collect();
        out.extend(
            e.eval(&mut cache, &Batch::decode(&step), EvalOptions::new())
                .unwrap(),
        );
        let after = e.device_report();
        let logits: Vec<Vec<f32>> = out.into_iter().map(|o| o.logits).collect();
        (logits, after.link_bytes - before.link_bytes)
    };
    let (want, _) = run(DeviceChoice::None);
    // One store (the default), two sequences.
    let (got, bytes) = run(DeviceChoice::Sim);
    assert_eq!(got, want);
    assert_eq!(bytes, 0, "link bytes of a batch the device does not run");
}

#[test]
fn part_of_the_layers_on_the_device_sends_a_layer_its_hidden_state() {
    let mut shape = tiny();
    shape.n_layer = 4;
    let m = model(GgmlType::Q4_0, Family::Llama, 99, shape);
    let cpu = Engine::load(&m.path, options(DeviceChoice::None, None)).unwrap();
    let (want, _, _) = decode(&cpu, 10);
    // A budget between the first layer and all of them.
    let r = Engine::load(&m.path, options(DeviceChoice::Sim, None))
        .unwrap()
        .device_report();
    let e = (1..20)
        .map(|k| r.work_bytes + (r.kv_bytes + r.dense_bytes) * k / 20)
        .map(|b| Engine::load(&m.path, options(DeviceChoice::Sim, Some(b))).unwrap())
        .find(|e| {
            let r = e.device_report();
            r.layers > 0 && r.layers < r.layers_total
        })
        .expect("a budget holding some of the layers");
    let (got, a, b) = decode(&e, 10);
    assert_eq!(got, want, "greedy tokens");
    let hp = e.model().hparams();
    let (_, waits, bytes) = per_token(&a, &b);
    let bound = (8 + 4 * hp.n_layer + hp.n_layer * 4 * 2 * hp.n_embd + 4 * 2 * hp.n_embd) as f64;
    assert!(bytes <= bound, "{bytes} link bytes per token > {bound}");
    assert!(
        waits <= (hp.n_layer + 2) as f64,
        "{waits} host waits per token"
    );
}

/// Greedy text equal to the CPU engine's at every share of the budget, F16 included (whose
/// activations both sides round to f16 alike), with the run-time scheduling on.
#[test]
fn every_budget_gives_the_cpu_text() {
    let m = model(GgmlType::F16, Family::Bamboo, 100, tiny());
    let params = || {
        SamplingParams::default().with(|p| {
            p.temperature = 0.0;
            p.max_tokens = 24;
            p.stop_at_eog = false;
        })
    };
    let text = |o: EngineOptions| -> Vec<u32> {
        let e = Engine::load(&m.path, o).unwrap();
        let mut s = e.session();
        s.generate("The river", params())
            .map(|t| t.unwrap().id)
            .collect()
    };
    let want = text(options(DeviceChoice::None, None));
    let (all, _) = everything(&m.path);
    for share in [0.0, 0.2, 0.4, 0.55, 0.7, 0.85, 1.0] {
        let mut o = options(DeviceChoice::Sim, Some((all as f64 * share) as u64));
        o.device.balance.balance = true;
        o.device.balance.hot_cache = true;
        assert_eq!(text(o), want, "budget {share} of everything");
    }
}

/// Context shifts, forks and prompts longer than the device's chunk on the device: the CPU
/// engine's results.
#[test]
fn shifts_forks_and_long_prompts_match_the_cpu() {
    let m = model(GgmlType::Q4_0, Family::Llama, 101, tiny());
    let run = |device| {
        let mut o = options(device, None);
        o.ctx_len = 40;
        o.batch = 200;
        o.device.kv_sequences = 3;
        let e = Engine::load(&m.path, o).unwrap();
        // 120 tokens in a context of 40: two shifts at least.
        let mut s = e.session();
        let gen: Vec<u32> = s
            .generate(
                "Once",
                SamplingParams::default().with(|p| {
                    p.temperature = 0.0;
                    p.max_tokens = 120;
                    p.stop_at_eog = false;
                }),
            )
            .map(|t| t.unwrap().id)
            .collect();
        assert!(s.stats().context_shifts >= 2);
        // A prompt of 150 tokens (more than a device chunk), then two forks decoded together.
        let mut cache = e.new_cache();
        let a = cache.add_sequence();
        let long: Vec<u32> = (0..30).map(|i| 3 + (i * 7) % 400).collect();
        let mut out = e
            .eval(&mut cache, &Batch::one(a, &long), EvalOptions::new())
            .unwrap();
        let b = e.fork_sequence(&mut cache, a).unwrap();
        let c = e.fork_sequence(&mut cache, a).unwrap();
        let step = [(a, 11u32), (b, 12), (c, 13)];
        out.extend(
            e.eval(&mut cache, &Batch::decode(&step), EvalOptions::new())
                .unwrap(),
        );
        let logits: Vec<Vec<f32>> = out.into_iter().map(|o| o.logits).collect();
        (gen, logits, e.device_report())
    };
    let (want_gen, want, _) = run(DeviceChoice::None);
    let (gen, got, r) = run(DeviceChoice::Sim);
    assert_eq!(r.layers, r.layers_total, "{r:?}");
    assert_eq!(gen, want_gen, "through context shifts");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "output {i}: quantized weights give the same bits");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, .. ProptestConfig::default() })]

    /// Random shapes, budgets, sequences and block sizes: the device never holds more than
    /// its budget while decoding (the placement counted every buffer it takes), and nothing is
    /// allocated after loading.
    #[test]
    fn no_budget_is_exceeded_while_decoding(
        frac in 0.0f64..1.1,
        family in 0usize..4,
        n_layer in 1usize..4,
        wide in any::<bool>(),
        kv in 1usize..3,
        batch in 1usize..40,
        seed in 0u64..1000,
    ) {
        let mut shape = tiny();
        shape.n_layer = n_layer;
        if wide {
            shape.n_ff *= 2;
        }
        let fam = [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt][family];
        let m = model(GgmlType::Q8_0, fam, seed, shape);
        let mut o = options(DeviceChoice::Sim, None);
        o.device.kv_sequences = kv;
        o.batch = batch;
        let all = Engine::load(&m.path, o.clone()).unwrap().device_report().budget_bytes;
        let budget = (all as f64 * frac) as u64;
        o.device.vram_budget = Some(budget);
        o.device.balance.balance = true;
        o.device.balance.hot_cache = true;
        let e = Engine::load(&m.path, o).unwrap();
        let loaded = e.device_report().peak_bytes;
        let mut cache = e.new_cache();
        let seqs: Vec<_> = (0..kv + 1).map(|_| cache.add_sequence()).collect();
        let mut first = Batch::new();
        for &s in &seqs {
            first.push(s, &PROMPT);
        }
        e.eval(&mut cache, &first, EvalOptions::new()).unwrap();
        for i in 0..4u32 {
            let step: Vec<_> = seqs.iter().map(|&s| (s, 5 + i)).collect();
            e.eval(&mut cache, &Batch::decode(&step), EvalOptions::new()).unwrap();
        }
        let r = e.device_report();
        prop_assert!(r.peak_bytes <= budget, "{:?}", r);
        prop_assert_eq!(r.peak_bytes, loaded, "allocated after loading: {:?}", r);
    }
}
