//! The simulated device playing a card (`SimSpeed`, the default `H200`): its timing marks, and
//! so the calibration and the balancer, read the card's modelled clock, not the time this
//! machine takes to emulate it, while the CPU keeps its real time. With the default flags
//! (balancer on) the schedule is then the one a card would get:
//!
//! - the whole model resident: the device keeps every neuron, a decode token costs at most two
//!   host waits and its id and logits over the link;
//! - part of the FFN resident: at most the per-layer share over the link;
//! - a card slower than the CPU: the balancer hands neurons to the CPU;
//!
//! and the card's clock times what the card charges: the calibration measures the card's own
//! launch and bandwidth figures, and a resident model's decode speed on it agrees with
//! `plan --predict`'s cost model for the same card.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::time::Duration;

use powerinfer_cli::synth::{self, Family, Shape, SynthConfig, SynthOutputs};
use powerinfer_cli::{cmd, parse_args};
use powerinfer_engine::device::SimSpeed;
use powerinfer_engine::{DeviceChoice, DeviceReport, Engine, EngineOptions, GpuIndexMode, KvType};
use powerinfer_gguf::GgmlType;

#[path = "support/engine.rs"]
mod common;
use common::{argmax, PROMPT};

struct Model {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

/// The `tiny` shape with its activation statistics (the placement needs them).
fn model(ty: GgmlType, family: Family, seed: u64) -> Model {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.powerinfer.gguf");
    let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
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

/// The engine's defaults on the simulated device (balancer, calibration and hot-neuron cache
/// on; the card: the H200), but for the tests' threads and context and a fresh GPU index.
fn defaults(budget: Option<u64>, card: Option<SimSpeed>) -> EngineOptions {
    let mut o = common::opts(false);
    o.ctx_len = 96;
    o.device.choice = DeviceChoice::Sim;
    o.device.vram_budget = budget;
    o.device.gpu_index = GpuIndexMode::Reset;
    if let Some(c) = card {
        o.device.sim.speed = Some(c);
    }
    o
}

/// Greedy decoding of `n` tokens after the prompt: the tokens, and the device's report before
/// and after the decode steps.
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

/// Per decode token: host waits and link bytes between two reports.
fn per_token(a: &DeviceReport, b: &DeviceReport) -> (f64, f64) {
    let t = (b.tokens - a.tokens) as f64;
    (
        (b.host_waits - a.host_waits) as f64 / t,
        (b.link_bytes - a.link_bytes) as f64 / t,
    )
}

/// The FFN's bytes of the file at `path`.
fn ffn_bytes(e: &Engine) -> u64 {
    (e.model().file().tensors().iter())
        .filter(|t| {
            let n = t.name();
            n.contains("ffn_up") || n.contains("ffn_gate") || n.contains("ffn_down_t")
        })
        .map(|t| t.n_bytes())
        .sum()
}

#[test]
fn with_default_flags_the_schedule_is_a_cards() {
    for (i, family) in [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt]
        .into_iter()
        .enumerate()
    {
        let m = model(GgmlType::Q4_0, family, 200 + i as u64);
        let mut cpu_opts = common::opts(false);
        cpu_opts.ctx_len = 96;
        let (want, _, _) = decode(&Engine::load(&m.path, cpu_opts).unwrap(), 16);
        // Everything resident: the balancer keeps every neuron on the card.
        let e = Engine::load(&m.path, defaults(None, None)).unwrap();
        let r = e.device_report();
        assert_eq!(
            (r.layers, r.ffn_rows),
            (r.layers_total, r.ffn_total),
            "{r:?}"
        );
        let (got, a, b) = decode(&e, 16);
        assert_eq!(got, want, "{family:?}: greedy tokens");
        let hp = e.model().hparams();
        let (waits, bytes) = per_token(&a, &b);
        eprintln!("{family:?} all resident, balancer on: {waits:.2} waits, {bytes:.0} B/token");
        let bound = (8 + 4 * hp.n_vocab + 4 * hp.n_layer) as f64;
        assert!(
            bytes <= bound,
            "{family:?}: {bytes} link bytes per token > {bound}"
        );
        assert!(waits <= 2.0, "{family:?}: {waits} host waits per token");
        assert_eq!(
            b.active_cpu, 0,
            "{family:?}: the CPU computed neurons: {b:?}"
        );
        // Half the FFN resident: each layer's share over the link, no more, besides what the
        // balancer itself sends (an enabled mask of the layer's neurons per move, the rows of
        // the neurons the hot-neuron cache migrates).
        let half = r.peak_bytes - ffn_bytes(&e) / 2;
        let e = Engine::load(&m.path, defaults(Some(half), None)).unwrap();
        let moves = |e: &Engine| {
            let t = e.balance_report().unwrap().total();
            (t.rebalances, t.migrated_rows)
        };
        let (moves_a, rows_a) = moves(&e);
        let (got, a, b) = decode(&e, 16);
        assert_eq!(got, want, "{family:?}: greedy tokens, half the FFN");
        let (moves_b, rows_b) = moves(&e);
        let (waits, bytes) = per_token(&a, &b);
        eprintln!("{family:?} half the FFN, balancer on: {waits:.2} waits, {bytes:.0} B/token");
        let matrices = if matches!(family, Family::Llama | Family::Bamboo) {
            3
        } else {
            2
        };
        let neuron = 4 + matrices * hp.n_embd / 32 * 18;
        let balancer = 4 * hp.n_ff as u64 * (moves_b - moves_a) + neuron as u64 * (rows_b - rows_a);
        eprintln!(
            "{family:?} half the FFN: {} moves, {} rows migrated",
            moves_b - moves_a,
            rows_b - rows_a
        );
        let per_layer = 4 * (2 * hp.n_embd + hp.n_ff);
        let bound = (8 + 4 * hp.n_vocab + 4 * hp.n_layer + hp.n_layer * per_layer) as f64
            + balancer as f64 / (b.tokens - a.tokens) as f64;
        assert!(
            bytes <= bound,
            "{family:?}: {bytes} link bytes per token > {bound}"
        );
        assert!(
            waits <= (hp.n_layer + 2) as f64,
            "{family:?}: {waits} waits per token"
        );
        assert!(b.active_device > a.active_device, "{family:?}: {b:?}");
    }
}

#[test]
fn a_card_slower_than_the_cpu_hands_it_neurons() {
    let m = model(GgmlType::Q8_0, Family::Llama, 210);
    // 20 MB/s: a layer's hot neurons take the card milliseconds.
    let slow = SimSpeed::new(20e6, Duration::from_micros(5), 25e9);
    let e = Engine::load(&m.path, defaults(None, Some(slow))).unwrap();
    let r = e.device_report();
    assert_eq!(r.ffn_rows, r.ffn_total, "{r:?}");
    let (_, a, b) = decode(&e, 24);
    let moved = e.balance_report().unwrap().total();
    eprintln!(
        "slow card: CPU computed {} of {} active neurons; {moved:?}",
        b.active_cpu - a.active_cpu,
        (b.active_cpu + b.active_device) - (a.active_cpu + a.active_device)
    );
    assert!(
        b.active_cpu > a.active_cpu,
        "the CPU computed nothing: {b:?}"
    );
    // The same model on the H200: the card keeps everything.
    let e = Engine::load(&m.path, defaults(None, None)).unwrap();
    let (_, _, b) = decode(&e, 24);
    assert_eq!(b.active_cpu, 0, "{b:?}");
}

#[test]
fn the_calibration_reads_the_cards_clock() {
    let m = model(GgmlType::Q4_0, Family::Llama, 220);
    for card in [
        SimSpeed::h200(),
        SimSpeed::rtx4090(),
        SimSpeed::new(20e9, Duration::from_micros(9), 25e9),
    ] {
        let mut o = defaults(None, Some(card));
        o.device.balance.calibration_cache = None;
        let e = Engine::load(&m.path, o).unwrap();
        let c = e
            .balance_report()
            .unwrap()
            .calibration
            .expect("calibrated at load");
        // An active neuron reads its gate and down rows, and its up row where the gate fired:
        // two or three Q4_0 rows of n_embd, at the card's bandwidth.
        let n_embd = e.model().hparams().n_embd;
        let row_us = (n_embd / 32 * 18) as f64 / card.bandwidth * 1e6;
        eprintln!("{}: device {:?}, a row {row_us:.6} us", card.name, c.device);
        assert!(
            (2.0 * row_us..=3.0 * row_us).contains(&c.device.per_row_us),
            "{}: {} us per neuron, the card reads a row in {row_us}",
            card.name,
            c.device.per_row_us
        );
        // The fixed part is whole launches of the card.
        let launches = c.device.fixed_us / (card.launch.as_secs_f64() * 1e6);
        assert!(
            launches >= 1.0 && (launches - launches.round()).abs() < 0.01,
            "{}: {} us fixed is not whole launches",
            card.name,
            c.device.fixed_us
        );
    }
}

#[test]
fn a_resident_models_speed_on_the_card_is_what_plan_predicts() {
    let m = model(GgmlType::Q4_0, Family::Llama, 230);
    let e = Engine::load(&m.path, defaults(None, None)).unwrap();
    let (_, a, b) = decode(&e, 32);
    let (tokens, secs) = (
        b.decode_tokens - a.decode_tokens,
        b.decode_secs - a.decode_secs,
    );
    let measured = tokens as f64 / secs;
    let r = e.device_report();
    assert!(
        r.ffn_rows == r.ffn_total && r.layers == r.layers_total,
        "{r:?}"
    );
    // The launches alone bound the card's time from below.
    let launches = (b.launches - a.launches) as f64 / tokens as f64;
    assert!(
        secs / tokens as f64 >= launches * 5e-6,
        "{secs} s for {tokens} tokens"
    );
    let budget = format!("{}", 2.0 * r.budget_bytes as f64 / (1u64 << 30) as f64);
    let h200 = SimSpeed::h200();
    let words = [
        "-m",
        m.path.to_str().unwrap(),
        "--vram-budget",
        &budget,
        "--predict",
        "--ctx",
        "96",
        "--gpu-bw",
        &format!("{}", h200.bandwidth / 1e9),
        "--gpu-launch-us",
        &format!("{}", h200.launch.as_secs_f64() * 1e6),
        "--link-bw",
        &format!("{}", h200.link_bandwidth / 1e9),
        "--cpu-bw",
        "20",
    ];
    let args = parse_args::<cmd::plan::Args>(words.iter().map(OsStr::new)).unwrap();
    let p = cmd::plan::predict(&args).unwrap().to_json();
    let predicted = p["static"]["tokens_per_s"].as_f64().unwrap();
    let ratio = measured / predicted;
    eprintln!(
        "resident tiny model on the H200: {measured:.0} tokens/s on the card's clock, \
         {predicted:.0} predicted ({ratio:.2}x), {launches:.1} launches per token"
    );
    assert!(
        (0.5..=2.0).contains(&ratio),
        "the card's clock gives {measured} tokens/s, plan --predict {predicted}"
    );
}

/// A quantized KV cache on the device: the device stores the rows it computes in the cache's
/// type as the host does, so the greedy text is the CPU's, resident and with half the FFN; the
/// placement counts the stores at their type, so a smaller cache leaves more of the budget to
/// neuron rows.
#[test]
fn quantized_kv_stores_give_the_cpus_text_and_more_rows() {
    let m = model(GgmlType::Q4_0, Family::Llama, 240);
    // One budget for the three: everything at F16 but two thirds of the FFN.
    let f16 = Engine::load(&m.path, defaults(None, None)).unwrap();
    let budget = f16.device_report().peak_bytes - ffn_bytes(&f16) * 2 / 3;
    drop(f16);
    let mut rows = Vec::new();
    for ty in [KvType::F16, KvType::Q8_0, KvType::Q4_0] {
        let with = |mut o: EngineOptions| {
            o.cache_type_k = ty;
            o.cache_type_v = ty;
            o
        };
        let mut cpu = common::opts(false);
        cpu.ctx_len = 96;
        let (want, _, _) = decode(&Engine::load(&m.path, with(cpu)).unwrap(), 16);
        let e = Engine::load(&m.path, with(defaults(None, None))).unwrap();
        let (got, _, _) = decode(&e, 16);
        assert_eq!(got, want, "{ty}: greedy tokens, all resident");
        let e = Engine::load(&m.path, with(defaults(Some(budget), None))).unwrap();
        let (got, _, _) = decode(&e, 16);
        assert_eq!(got, want, "{ty}: greedy tokens, part of the FFN");
        let r = e.device_report();
        eprintln!(
            "{ty}: KV stores {} bytes, {} FFN rows at {budget} bytes",
            r.kv_bytes, r.ffn_rows
        );
        rows.push((r.kv_bytes, r.ffn_rows));
    }
    assert!(rows[0].0 > rows[1].0 && rows[1].0 > rows[2].0, "{rows:?}");
    assert!(rows[0].1 < rows[1].1 && rows[1].1 <= rows[2].1, "{rows:?}");
}
