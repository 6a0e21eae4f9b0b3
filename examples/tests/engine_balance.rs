//! The run-time scheduling on the simulated GPU: a slow device hands neurons to the CPU (and
//! PowerInfer's static split never does), the load-time calibration starts the split there,
//! and the hot-neuron cache follows a change of topic that the activation statistics do not
//! predict. (`engine_schedule.rs` checks that no schedule changes the results beyond
//! float reordering; speeds are measured by `powerinfer bench schedule`, not here.)

use std::path::PathBuf;
use std::time::Duration;

use powerinfer_cli::synth::{self, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::device::SimSpeed;
use powerinfer_engine::schedule::LayerBalance;
use powerinfer_engine::{DeviceChoice, Engine, EngineOptions, GpuIndexMode, SamplingParams};
use powerinfer_gguf::GgmlType;

#[path = "support/engine.rs"]
mod common;
use common::PROMPT;

struct Model {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

fn model(topics: bool, n_ff: usize, seed: u64) -> Model {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.powerinfer.gguf");
    let mut shape = Shape::preset("tiny").unwrap();
    shape.n_ff = n_ff;
    let mut cfg = SynthConfig::new(shape);
    cfg.ty = GgmlType::Q8_0;
    cfg.seed = seed;
    cfg.topics = topics;
    let out = SynthOutputs {
        model: path.clone(),
        dense: None,
        activation_dir: Some(dir.path().join("activation")),
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    Model { _dir: dir, path }
}

fn options(budget: Option<u64>) -> EngineOptions {
    let mut o = common::opts(false);
    o.ctx_len = 512;
    o.device.choice = DeviceChoice::Sim;
    o.device.vram_budget = budget;
    o.device.gpu_index = GpuIndexMode::Reset;
    o.device.balance.calibrate = false;
    o
}

/// A device reading its memory at 0.1 GB/s: each layer's device part takes milliseconds
/// where the CPU's takes tens of microseconds.
fn slow_device(o: &mut EngineOptions) {
    o.device.sim.speed = Some(SimSpeed::new(0.1e9, Duration::from_micros(5), 1e9));
}

fn decode(engine: &Engine, n: usize) {
    let mut s = engine.session();
    s.eval(&PROMPT).unwrap();
    for i in 0..n {
        s.eval(&[(7 + 3 * i as u32) % 500]).unwrap();
    }
}

#[test]
fn a_slow_device_hands_neurons_to_the_cpu_and_the_static_split_does_not() {
    let m = model(false, 1024, 3);
    for balance in [true, false] {
        let mut o = options(None);
        slow_device(&mut o);
        o.device.balance.balance = balance;
        let e = Engine::load(&m.path, o).unwrap();
        decode(&e, 24);
        let r = e.balance_report().unwrap();
        let t = r.total();
        eprintln!("balance {balance}: {t:?}");
        assert_eq!(t.held, e.device_report().ffn_total, "everything held");
        if balance {
            assert!(t.rebalances > 0, "{t:?}");
            assert!(t.enabled < t.held, "{t:?}");
            assert!(t.active_cpu > 0, "{t:?}");
            for l in &r.layers {
                assert!(l.enabled < l.held, "layer {}: {l:?}", l.layer);
            }
        } else {
            assert_eq!((t.rebalances, t.active_cpu), (0, 0), "{t:?}");
            assert_eq!(t.enabled, t.held);
        }
    }
}

#[test]
fn calibration_starts_the_split_from_measured_speeds() {
    let m = model(false, 1024, 4);
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("calibration.tsv");
    let mut o = options(None);
    slow_device(&mut o);
    o.device.balance.calibrate = true;
    o.device.balance.calibration_cache = Some(cache.clone());
    let e = Engine::load(&m.path, o.clone()).unwrap();
    let r = e.balance_report().unwrap();
    let c = r.calibration.clone().expect("calibrated");
    eprintln!("{c:?}");
    assert!(!c.cached);
    // The slow device's rows cost more than the CPU's: it starts with part of its neurons.
    assert!(c.ratio() < 1.0, "{c:?}");
    assert!(c.device.per_row_us > 0.0 && c.cpu.per_row_us > 0.0);
    let t = r.total();
    // The split follows the measured costs: with the CPU's fixed cost per call below a few
    // device rows (what an idle machine measures), the CPU takes part of the held neurons. A
    // machine busy with other work can measure a CPU call at hundreds of µs (the pool's
    // threads descheduled), and then the device rightly keeps everything.
    if c.cpu.fixed_us < c.device.fixed_us + 8.0 * c.device.per_row_us {
        assert!(t.enabled < t.held, "{t:?}");
    } else {
        eprintln!(
            "CPU fixed cost {:.0} µs: the machine was busy; split check skipped",
            c.cpu.fixed_us
        );
        assert!(t.enabled <= t.held, "{t:?}");
    }
    assert_eq!(t.evals, 0);
    // The second load reads the cache.
    let again = Engine::load(&m.path, o).unwrap();
    let c2 = again.balance_report().unwrap().calibration.unwrap();
    assert!(c2.cached);
    assert_eq!((c2.cpu, c2.device), (c.cpu, c.device));
    assert_eq!(std::fs::read_to_string(&cache).unwrap().lines().count(), 1);
}

/// Recall of the device's neurons between two reports.
fn recall_between(before: &LayerBalance, after: &LayerBalance) -> f64 {
    (after.held_active - before.held_active) as f64 / (after.active - before.active).max(1) as f64
}

#[test]
fn the_hot_cache_follows_a_change_of_topic() {
    // Two topics with their own hot neurons; the statistics (and so the static placement) are
    // their average. An eighth of the FFN fits the budget.
    let m = model(true, 2048, 5);
    let probe = Engine::load(&m.path, options(None)).unwrap();
    let all = probe.device_report();
    drop(probe);
    let ffn_bytes: u64 = powerinfer_gguf::GgufFile::open(&m.path)
        .unwrap()
        .tensors()
        .iter()
        .filter(|t| {
            ["ffn_up", "ffn_gate", "ffn_down_t"]
                .iter()
                .any(|n| t.name().contains(n))
        })
        .map(|t| t.n_bytes())
        .sum();
    let budget = all.peak_bytes - ffn_bytes * 7 / 8;
    let mut results = Vec::new();
    for cache in [false, true] {
        let mut o = options(Some(budget));
        o.device.balance.hot_cache = cache;
        o.device.balance.balance = false;
        let e = Engine::load(&m.path, o).unwrap();
        let held = e.device_report().ffn_rows;
        assert!(held > 0 && held < e.device_report().ffn_total);
        let mut s = e.session();
        // Topic A (even token ids), then topic B (odd ids): recall over each topic's tokens
        // after the first 32 (the cache's window turning over), and over all of them.
        let mut steady = Vec::new();
        let mut whole = Vec::new();
        for parity in [0u32, 1] {
            let start = e.balance_report().unwrap().total();
            let mut settled = start.clone();
            for i in 0..160u32 {
                if i == 32 {
                    settled = e.balance_report().unwrap().total();
                }
                s.eval(&[(2 * (i * 37 % 250) + parity) % 500]).unwrap();
            }
            let end = e.balance_report().unwrap().total();
            steady.push(recall_between(&settled, &end));
            whole.push(recall_between(&start, &end));
        }
        let t = e.balance_report().unwrap().total();
        eprintln!(
            "hot cache {cache}: recall topic A {:.3} ({:.3} after 32 tokens), topic B {:.3} \
             ({:.3}); {} migrations, {} rows",
            whole[0], steady[0], whole[1], steady[1], t.migrations, t.migrated_rows
        );
        if !cache {
            assert_eq!(t.migrations, 0);
        }
        results.push((steady, whole, t));
    }
    let (fixed, dynamic) = (&results[0], &results[1]);
    assert!(dynamic.2.migrations > 0);
    for topic in 0..2 {
        assert!(
            dynamic.0[topic] > fixed.0[topic] + 0.05,
            "topic {topic}: recall {:.3} with the cache, {:.3} without",
            dynamic.0[topic],
            fixed.0[topic]
        );
        assert!(dynamic.1[topic] > fixed.1[topic], "topic {topic}");
    }
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams::default().with(|p| {
        p.temperature = 0.0;
        p.max_tokens = n;
        p.stop_at_eog = false;
    })
}

fn generated(e: &Engine, n: usize) -> Vec<u32> {
    let mut s = e.session();
    s.generate("Hello", greedy(n))
        .map(|t| t.unwrap().id)
        .collect()
}

/// A budget holding the work buffers and the attention split's mirror of `ctx` positions but
/// no layer: the layers attend on the host, where the split works.
fn mirror_budget(m: &Model, ctx: usize) -> u64 {
    let mut o = options(None);
    o.ctx_len = ctx;
    let e = Engine::load(&m.path, o).unwrap();
    let hp = e.model().hparams();
    let mirror = 4 * (hp.n_layer * ctx * hp.n_embd_kv()) as u64;
    e.device_report().work_bytes + mirror + 1024
}

/// The attention split: each layer's first positions attended on the device over its mirror,
/// the rest on the CPU, merged, where the layers attend on the host. Through context shifts
/// (which change the stored rows, so the mirror is filled again) the greedy tokens are the CPU
/// engine's.
#[test]
fn the_attention_split_gives_the_cpu_tokens_through_context_shifts() {
    let m = model(false, 1024, 6);
    let mut c = common::opts(false);
    c.ctx_len = 96;
    let cpu = Engine::load(&m.path, c).unwrap();
    let mut o = options(Some(mirror_budget(&m, 96)));
    o.ctx_len = 96;
    o.device.balance.attention_split = true;
    o.device.balance.balance = false;
    o.device.balance.hot_cache = false;
    // The share stays at half (no imbalance is outside a dead band of 1), so that the split
    // points, and with them the float sums, do not depend on measured times.
    o.device.balance.dead_band = 1.0;
    let e = Engine::load(&m.path, o).unwrap();
    assert_eq!(e.device_report().layers, 0, "{:?}", e.device_report());
    assert_eq!(generated(&e, 200), generated(&cpu, 200));
    let r = e.balance_report().unwrap();
    assert_eq!(r.attention.len(), e.model().hparams().n_layer);
    for a in &r.attention {
        assert!(a.evals > 100, "{a:?}");
        assert!(a.device_positions > 0 && a.cpu_positions > 0, "{a:?}");
        // More rows copied than the context holds: the mirror was refilled after shifts.
        assert!(a.copied_rows > 96, "{a:?}");
    }
    // Off: no mirror, no split.
    let mut o = options(None);
    o.ctx_len = 96;
    let e = Engine::load(&m.path, o).unwrap();
    assert!(e.balance_report().unwrap().attention.is_empty());
}

/// A device much slower than the CPU on attention gets a smaller share of the positions, by
/// bounded steps.
#[test]
fn a_slow_device_attends_to_fewer_positions() {
    let m = model(false, 1024, 7);
    let mut o = options(Some(mirror_budget(&m, 512)));
    slow_device(&mut o);
    o.device.balance.attention_split = true;
    o.device.balance.balance = false;
    o.device.balance.hot_cache = false;
    let e = Engine::load(&m.path, o).unwrap();
    generated(&e, 120);
    for a in &e.balance_report().unwrap().attention {
        assert!(a.moves > 0 && a.share < 0.5, "{a:?}");
        // At most `attention_step` (0.05) per move from the starting half.
        assert!(a.share >= 0.5 - 0.05 * a.moves as f64 - 1e-9, "{a:?}");
    }
}
