//! `powerinfer bench schedule`: the run-time scheduling on the simulated GPU (`--gpu sim`),
//! measured side by side in one run.
//!
//! 1. **Balance.** The simulated device reads its memory at `--sim-bandwidth` (paced: slower
//!    than its thread computes, so its times are the speed model's) and holds the dense parts
//!    and a share of the FFN's bytes chosen so that PowerInfer's static split (every held
//!    neuron computed on the device) leaves the device `--imbalance` times as long per layer
//!    as the CPU: the share is searched by short static runs (or given, `--resident`). Then,
//!    alternating the order over `--rounds`, four schedules decode the same tokens: `static`,
//!    `balanced` (the feedback loop alone, starting from the static split), `calibrated`
//!    (the split started from speeds measured at load, then the loop) and `+attention`
//!    (calibrated, with the attention split; its KV mirror comes out of the same budget,
//!    before the FFN's rows). Reported: tokens/s (all
//!    decode tokens, and the second half), the FFN's time per token (per layer the slower
//!    side), the evaluation at which every layer's two times had come within the dead band
//!    (convergence), the mean imbalance at the end and the device's share of active neurons.
//! 2. **Prediction.** The cost model (`powerinfer_placement::cost`, as `plan --predict` runs
//!    it) for the same budget, with the simulated device's figures, this machine's measured
//!    read bandwidth and the calibrated CPU row cost, against the measured static and balanced
//!    tokens/s.
//! 3. **Topic shift.** A synthetic model whose hot neurons depend on a topic (`synth
//!    --topics`; the statistics are the two topics' average) decodes tokens of topic A, then
//!    of topic B, with `--topic-resident` of its FFN on the device, with and without the
//!    hot-neuron cache: the device set's recall and tokens/s per topic (recall after the
//!    cache's window has turned over, and over the whole topic).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::bench_shared::{budget_for, median};
use crate::synth::{self, SynthConfig, SynthOutputs};
use powerinfer_engine::device::SimSpeed;
use powerinfer_engine::schedule::LayerBalance;
use powerinfer_engine::{BalanceReport, DeviceChoice, Engine, EngineOptions, GpuIndexMode};
use powerinfer_gguf::GgmlType;
use powerinfer_placement::cost::{Hardware, Workload};
use serde_json::json;

/// Arguments of `powerinfer bench schedule`.
#[derive(clap::Args)]
pub struct ScheduleArgs {
    /// A PowerInfer model with `activation/` beside it (default: the demo model).
    #[command(flatten)]
    model: super::model::ModelArgs<false>,
    /// CPU threads (the simulated device has one more of its own).
    #[arg(short = 't', long, default_value_t = 1, value_parser = crate::cmd::whole_number)]
    threads: usize,
    /// Tokens decoded per run.
    #[arg(short = 'n', long, default_value_t = 128)]
    tokens: usize,
    /// Share of the FFN's bytes the device holds in the balance part (default: searched for
    /// `--imbalance`).
    #[arg(long)]
    resident: Option<f64>,
    /// Device time over CPU time per layer that the static split should have.
    #[arg(long, default_value_t = 2.0)]
    imbalance: f64,
    /// Simulated device bandwidth in GB/s.
    #[arg(long = "sim-bandwidth", default_value_t = 4.0)]
    sim_bandwidth: f64,
    /// Measure the schedules this many times, alternating the order; medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Tokens of each topic in the topic-shift part (0: skip it).
    #[arg(long = "topic-tokens", default_value_t = 192)]
    topic_tokens: usize,
    /// Share of the topic model's FFN bytes the device holds.
    #[arg(long = "topic-resident", default_value_t = 0.125)]
    topic_resident: f64,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

const LAUNCH_US: f64 = 5.0;
const LINK_GBPS: f64 = 25.0;
const PROMPT: usize = 8;

/// One decode run's figures.
#[derive(Clone, Debug)]
struct Run {
    tps: f64,
    tps_late: f64,
    report: BalanceReport,
}

impl Run {
    /// The evaluation by which every layer's two times had come within the dead band (`None`:
    /// some layer never did).
    fn converged_at(&self) -> Option<u64> {
        let l = &self.report.layers;
        (!l.is_empty() && l.iter().all(|l| l.settled_at > 0))
            .then(|| l.iter().map(|l| l.settled_at).max().unwrap_or(0))
    }

    /// Mean |imbalance| over the layers at the end.
    fn imbalance(&self) -> f64 {
        let n = self.report.layers.len().max(1) as f64;
        self.report
            .layers
            .iter()
            .map(|l| l.imbalance.abs())
            .sum::<f64>()
            / n
    }

    /// The FFN's milliseconds per evaluation: per layer the slower side's mean time.
    fn ffn_ms(&self) -> f64 {
        self.report
            .layers
            .iter()
            .map(|l| l.cpu.max(l.device).as_secs_f64() * 1e3 / l.evals.max(1) as f64)
            .sum()
    }

    /// Device over CPU FFN time, over all layers and evaluations.
    fn time_ratio(&self) -> f64 {
        let t = self.report.total();
        t.device.as_secs_f64() / t.cpu.as_secs_f64().max(1e-12)
    }
}

fn base_options(a: &ScheduleArgs, bandwidth: Option<f64>) -> EngineOptions {
    let mut o = super::engine_options(a.threads.max(1), None);
    o.ctx_len = (PROMPT + a.tokens).max(2 * a.topic_tokens + 1) + 16;
    o.device.choice = DeviceChoice::Sim;
    o.device.gpu_index = GpuIndexMode::Reset;
    o.device.sim.threads = 1;
    o.device.sim.speed = bandwidth.map(|bw| {
        SimSpeed::new(
            bw,
            Duration::from_secs_f64(LAUNCH_US * 1e-6),
            LINK_GBPS * 1e9,
        )
    });
    // The schedules are timed by the wall clock: the card's time must pass there too.
    o.device.sim.paced = true;
    let b = &mut o.device.balance;
    b.balance = false;
    b.hot_cache = false;
    b.calibrate = false;
    b.calibration_cache = None;
    o
}

/// Loads `path` with `o`, evaluates a prompt, decodes `n` tokens greedily.
fn decode(path: &Path, o: EngineOptions, n: usize) -> Result<Run, String> {
    let e = Engine::load(path, o).map_err(|e| super::file_error(path, e))?;
    let vocab = e.model().hparams().n_vocab as u32;
    let mut s = e.session();
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|i| (100 + 37 * i) % vocab).collect();
    let mut logits = s.eval(&prompt).map_err(|e| e.to_string())?;
    let t = Instant::now();
    let mut half = t;
    for i in 0..n {
        if i == n / 2 {
            half = Instant::now();
        }
        let tok = super::bench_shared::argmax(&logits);
        logits = s.eval(&[tok]).map_err(|e| e.to_string())?;
    }
    let end = t.elapsed().as_secs_f64();
    let late = half.elapsed().as_secs_f64();
    Ok(Run {
        tps: n as f64 / end.max(1e-9),
        tps_late: (n - n / 2) as f64 / late.max(1e-9),
        report: e.balance_report().unwrap_or_default(),
    })
}

/// The share of the FFN's bytes on the device that makes the static split's device `target`
/// times as slow as the CPU per layer, found by bisection over short static runs (the ratio
/// grows with the share): `(share, budget, measured ratio)`.
fn search_share(
    path: &Path,
    o: &EngineOptions,
    target: f64,
    quiet: bool,
) -> Result<(f64, u64, f64), String> {
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    let mut best = (f64::NAN, 0u64, f64::NAN);
    for step in 0..7 {
        let share = 0.5 * (lo + hi);
        let budget = budget_for(path, o, share)?;
        let mut oo = o.clone();
        oo.device.vram_budget = Some(budget);
        let ratio = decode(path, oo, 24)?.time_ratio();
        if !quiet {
            eprintln!(
                "  search {step}: {:.1}% of the FFN on the device -> device/CPU time {ratio:.2}",
                100.0 * share
            );
        }
        if best.2.is_nan() || (ratio / target).ln().abs() < (best.2 / target).ln().abs() {
            best = (share, budget, ratio);
        }
        if (ratio / target - 1.0).abs() < 0.1 {
            break;
        }
        if ratio > target || !ratio.is_finite() {
            hi = share;
        } else {
            lo = share;
        }
    }
    Ok(best)
}

/// Runs `powerinfer bench schedule`.
pub fn run(a: ScheduleArgs) -> Result<(), String> {
    let quiet = a.json;
    let path = match a.model.path_if_given()? {
        Some(p) => p,
        None => cached_synth(super::demo_model::demo_shape(), false, quiet)?,
    };
    if !(a.sim_bandwidth.is_finite() && a.sim_bandwidth > 0.0) {
        return Err(format!(
            "--sim-bandwidth {}: expected GB/s",
            a.sim_bandwidth
        ));
    }
    let bw = a.sim_bandwidth * 1e9;
    let mut o = base_options(&a, Some(bw));
    if !quiet {
        eprintln!(
            "{}: simulated device at {:.2} GB/s, 1 device thread, {} CPU thread(s)",
            path.display(),
            a.sim_bandwidth,
            a.threads
        );
    }
    let (resident, budget, found) = match a.resident {
        Some(r) => (r, budget_for(&path, &o, r)?, f64::NAN),
        None => search_share(&path, &o, a.imbalance, quiet)?,
    };
    o.device.vram_budget = Some(budget);
    let schedules: [(&str, bool, bool, bool); 4] = [
        ("static", false, false, false),
        ("balanced", true, false, false),
        ("calibrated", true, true, false),
        ("+attention", true, true, true),
    ];
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); schedules.len()];
    for round in 0..a.rounds.max(1) {
        let mut order: Vec<usize> = (0..schedules.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let (_, balance, calibrate, attention) = schedules[i];
            let mut oo = o.clone();
            oo.device.balance.balance = balance;
            oo.device.balance.calibrate = calibrate;
            oo.device.balance.attention_split = attention;
            runs[i].push(decode(&path, oo, a.tokens)?);
        }
    }
    let summary: Vec<serde_json::Value> = schedules
        .iter()
        .zip(&runs)
        .map(|((name, ..), rs)| {
            let last = rs.last().expect("a run");
            let t = last.report.total();
            json!({
                "schedule": name,
                "tps": median(&rs.iter().map(|r| r.tps).collect::<Vec<_>>()),
                "tps_second_half": median(&rs.iter().map(|r| r.tps_late).collect::<Vec<_>>()),
                "converged_at_eval": last.converged_at(),
                "ffn_ms_per_token": median(&rs.iter().map(Run::ffn_ms).collect::<Vec<_>>()),
                "mean_abs_imbalance": median(&rs.iter().map(Run::imbalance).collect::<Vec<_>>()),
                "device_over_cpu_time": median(&rs.iter().map(Run::time_ratio).collect::<Vec<_>>()),
                "device_share": t.device_share(),
                "rebalances": t.rebalances,
                "enabled": t.enabled, "held": t.held,
                "calibration_ratio": last.report.calibration.as_ref().map(|c| c.ratio()),
                "attention_device_share": attention_share(&last.report),
            })
        })
        .collect();
    let ratio_of = |i: usize, key: &str| {
        let per_round: Vec<f64> = runs[i]
            .iter()
            .zip(&runs[0])
            .map(|(r, s)| match key {
                "tps" => r.tps / s.tps,
                _ => r.tps_late / s.tps_late,
            })
            .collect();
        median(&per_round)
    };

    // The cost model's prediction for the same placement.
    let cpu_row_us = runs[2]
        .last()
        .and_then(|r| r.report.calibration.as_ref())
        .map(|c| c.cpu.per_row_us);
    let pool = powerinfer_kernels_cpu::ThreadPool::new(a.threads.max(1));
    let cpu_bw = super::bandwidth::read_bandwidth(&pool, 1 << 30, 3);
    let hw = Hardware {
        cpu_bandwidth: cpu_bw,
        cpu_row_us,
        cpu_layer_us: 20.0,
        gpu_bandwidth: bw,
        gpu_launch_us: LAUNCH_US,
        link_bandwidth: LINK_GBPS * 1e9,
    };
    // The engine keeps the KV cache in host memory (without the attention split): no KV in
    // the budget.
    let pred = super::plan::prediction(
        &path,
        None,
        budget,
        0,
        &hw,
        Workload {
            batch: 1,
            context: PROMPT + a.tokens / 2,
            kv: powerinfer_placement::KvTypes::F16,
        },
    )?;
    let ffn_gain = median(
        &runs[1]
            .iter()
            .zip(&runs[0])
            .map(|(b, s)| s.ffn_ms() / b.ffn_ms().max(1e-12))
            .collect::<Vec<_>>(),
    );
    let measured_static = summary[0]["tps"].as_f64().unwrap_or(f64::NAN);
    let measured_bal = summary[1]["tps_second_half"].as_f64().unwrap_or(f64::NAN);
    let prediction = json!({
        "cpu_gbps": cpu_bw / 1e9, "cpu_row_us": cpu_row_us,
        "static_tps": pred.fixed.tokens_per_s(), "balanced_tps": pred.balanced.tokens_per_s(),
        "static_error": pred.fixed.tokens_per_s() / measured_static - 1.0,
        "balanced_error": pred.balanced.tokens_per_s() / measured_bal - 1.0,
        "held_neurons": pred.held, "neurons": pred.total,
        "static_ffn_ms": ffn_ms(&pred.fixed), "balanced_ffn_ms": ffn_ms(&pred.balanced),
    });

    let topics = if a.topic_tokens > 0 {
        Some(topic_shift(&a, &path, quiet)?)
    } else {
        None
    };

    if a.json {
        let v = json!({
            "model": path.display().to_string(), "threads": a.threads, "tokens": a.tokens,
            "rounds": a.rounds, "resident": resident, "budget_bytes": budget,
            "sim_gbps": bw / 1e9, "static_device_over_cpu_at_search": found,
            "ffn_balanced_over_static": ffn_gain,
            "schedules": summary,
            "balanced_over_static": ratio_of(1, "tps"),
            "balanced_over_static_second_half": ratio_of(1, "late"),
            "calibrated_over_static": ratio_of(2, "tps"),
            "attention_split_over_static": ratio_of(3, "tps"),
            "prediction": prediction,
            "topic_shift": topics,
        });
        println!("{v}");
        return Ok(());
    }
    println!(
        "balance: simulated device at {:.2} GB/s (launch {LAUNCH_US} us, link {LINK_GBPS} GB/s) \
         holding {:.1}% of the FFN; {} tokens, median of {} rounds",
        bw / 1e9,
        100.0 * resident,
        a.tokens,
        a.rounds
    );
    println!(
        "{:<11} {:>8} {:>9} {:>8} {:>9} {:>8} {:>9} {:>8} {:>11}",
        "schedule",
        "tok/s",
        "2nd half",
        "ffn ms",
        "settled",
        "|imbal|",
        "dev/cpu t",
        "dev.act",
        "on.dev"
    );
    for s in &summary {
        println!(
            "{:<11} {:>8.2} {:>9.2} {:>8.3} {:>9} {:>8.3} {:>9.2} {:>7.1}% {:>11}",
            s["schedule"].as_str().unwrap_or(""),
            s["tps"].as_f64().unwrap_or(0.0),
            s["tps_second_half"].as_f64().unwrap_or(0.0),
            s["ffn_ms_per_token"].as_f64().unwrap_or(0.0),
            s["converged_at_eval"]
                .as_u64()
                .map_or("never".to_string(), |v| v.to_string()),
            s["mean_abs_imbalance"].as_f64().unwrap_or(0.0),
            s["device_over_cpu_time"].as_f64().unwrap_or(0.0),
            100.0 * s["device_share"].as_f64().unwrap_or(0.0),
            format!(
                "{}/{}",
                s["enabled"].as_u64().unwrap_or(0),
                s["held"].as_u64().unwrap_or(0)
            ),
        );
    }
    println!(
        "balanced / static: {:.2}x tok/s (second half {:.2}x), FFN time {:.2}x; calibrated / \
         static: {:.2}x tok/s; with the attention split: {:.2}x ({:.1}% of the positions on the \
         device at the end)",
        ratio_of(1, "tps"),
        ratio_of(1, "late"),
        ffn_gain,
        ratio_of(2, "tps"),
        ratio_of(3, "tps"),
        100.0 * summary[3]["attention_device_share"].as_f64().unwrap_or(0.0)
    );
    println!(
        "cost model (CPU {:.1} GB/s, {} us/row): static {:.2} tok/s ({:+.1}% vs measured), \
         balanced {:.2} tok/s ({:+.1}% vs measured second half)",
        cpu_bw / 1e9,
        cpu_row_us.map_or("bytes/bandwidth".to_string(), |v| format!("{v:.4}")),
        pred.fixed.tokens_per_s(),
        100.0 * (pred.fixed.tokens_per_s() / measured_static - 1.0),
        pred.balanced.tokens_per_s(),
        100.0 * (pred.balanced.tokens_per_s() / measured_bal - 1.0),
    );
    println!(
        "cost model's FFN time per token: static {:.3} ms, balanced {:.3} ms ({:.2}x)",
        ffn_ms(&pred.fixed),
        ffn_ms(&pred.balanced),
        ffn_ms(&pred.fixed) / ffn_ms(&pred.balanced).max(1e-12)
    );
    if let Some(t) = topics {
        println!(
            "topic shift: {} tokens per topic, {:.1}% of the FFN on the device, median of {} rounds",
            a.topic_tokens,
            100.0 * a.topic_resident,
            a.rounds
        );
        println!(
            "{:<10} {:>7} {:>12} {:>12} {:>10} {:>10} {:>10}",
            "hot cache", "topic", "recall", "recall(all)", "tok/s", "migr", "rows"
        );
        for row in t["rows"].as_array().into_iter().flatten() {
            println!(
                "{:<10} {:>7} {:>11.1}% {:>11.1}% {:>10.2} {:>10} {:>10}",
                row["hot_cache"].as_str().unwrap_or(""),
                row["topic"].as_str().unwrap_or(""),
                100.0 * row["recall_steady"].as_f64().unwrap_or(0.0),
                100.0 * row["recall"].as_f64().unwrap_or(0.0),
                row["tps"].as_f64().unwrap_or(0.0),
                row["migrations"].as_u64().unwrap_or(0),
                row["migrated_rows"].as_u64().unwrap_or(0),
            );
        }
    }
    Ok(())
}

/// Positions attended on the device over all positions of split evaluations (0 when off).
fn attention_share(r: &BalanceReport) -> f64 {
    let (d, c) = r.attention.iter().fold((0u64, 0u64), |a, l| {
        (a.0 + l.device_positions, a.1 + l.cpu_positions)
    });
    d as f64 / (d + c).max(1) as f64
}

/// A predicted step's FFN milliseconds: per layer the slower side.
fn ffn_ms(c: &powerinfer_placement::cost::StepCost) -> f64 {
    c.layers
        .iter()
        .map(|l| l.ffn_cpu_us.max(l.ffn_gpu_us))
        .sum::<f64>()
        / 1e3
}

fn recall_between(before: &LayerBalance, after: &LayerBalance) -> f64 {
    (after.held_active - before.held_active) as f64 / (after.active - before.active).max(1) as f64
}

/// Part 3 (see the module docs).
fn topic_shift(a: &ScheduleArgs, like: &Path, quiet: bool) -> Result<serde_json::Value, String> {
    // The layers and widths of the balance part's model (the built-in vocabulary), two topics.
    let h = Engine::load(like, base_options(a, None))
        .map_err(|e| format!("{}: {e}", like.display()))?
        .model()
        .hparams()
        .clone();
    let shape = synth::Shape {
        n_layer: h.n_layer,
        n_embd: h.n_embd,
        n_ff: h.n_ff,
        n_head: h.n_head,
        n_head_kv: h.n_head_kv,
        n_vocab: None,
        n_ctx: 1024,
    };
    let path = cached_synth(shape, true, quiet)?;
    let probe = base_options(a, None);
    let budget = budget_for(&path, &probe, a.topic_resident)?;
    let settle = 32.min(a.topic_tokens / 2);
    // Per (cache, topic): recall after `settle` tokens, recall over all, tok/s.
    let mut figures: Vec<Vec<[f64; 3]>> = vec![Vec::new(); 4];
    let mut last: [(u64, u64); 2] = [(0, 0); 2];
    for round in 0..a.rounds.max(1) {
        let mut order = [false, true];
        if round % 2 == 1 {
            order.reverse();
        }
        for cache in order {
            let mut o = probe.clone();
            o.device.vram_budget = Some(budget);
            o.device.balance.hot_cache = cache;
            let e = Engine::load(&path, o).map_err(|e| e.to_string())?;
            let vocab = e.model().hparams().n_vocab as u32;
            let half = (vocab / 2).max(2);
            let mut s = e.session();
            s.eval(&[1]).map_err(|e| e.to_string())?;
            for parity in 0..2u32 {
                let report = || e.balance_report().unwrap_or_default().total();
                let start = report();
                let mut settled = start.clone();
                let t = Instant::now();
                for i in 0..a.topic_tokens as u32 {
                    if i as usize == settle {
                        settled = report();
                    }
                    let tok = (2 * ((i * 37 + 11) % (half - 1)) + parity) % vocab;
                    s.eval(&[tok]).map_err(|e| e.to_string())?;
                }
                let tps = a.topic_tokens as f64 / t.elapsed().as_secs_f64().max(1e-9);
                let end = report();
                figures[2 * cache as usize + parity as usize].push([
                    recall_between(&settled, &end),
                    recall_between(&start, &end),
                    tps,
                ]);
            }
            let t = e.balance_report().unwrap_or_default().total();
            last[cache as usize] = (t.migrations, t.migrated_rows);
        }
    }
    let mut rows = Vec::new();
    for cache in [false, true] {
        for parity in 0..2usize {
            let f = &figures[2 * cache as usize + parity];
            let col = |k: usize| median(&f.iter().map(|x| x[k]).collect::<Vec<_>>());
            rows.push(json!({
                "hot_cache": if cache { "on" } else { "off" },
                "topic": if parity == 0 { "A" } else { "B" },
                "recall_steady": col(0), "recall": col(1), "tps": col(2),
                "migrations": last[cache as usize].0, "migrated_rows": last[cache as usize].1,
            }));
        }
    }
    Ok(json!({ "budget_bytes": budget, "settle_tokens": settle, "rows": rows }))
}

/// A synthetic Q4_0 PowerInfer model of `shape` with its `activation/` statistics (two topics
/// with `topics`), written once to a folder of the demo's cache.
fn cached_synth(shape: synth::Shape, topics: bool, quiet: bool) -> Result<PathBuf, String> {
    let dir = super::demo_model::cache_dir().join(format!(
        "{}-v1-l{}-e{}-f{}-q4_0",
        if topics { "topics" } else { "schedule" },
        shape.n_layer,
        shape.n_embd,
        shape.n_ff
    ));
    let path = dir.join("model.powerinfer.gguf");
    if path.exists() && dir.join("activation").exists() {
        return Ok(path);
    }
    let mut cfg = SynthConfig::new(shape);
    cfg.ty = GgmlType::Q4_0;
    cfg.seed = if topics { 77 } else { 2024 };
    cfg.topics = topics;
    let work = dir.join(format!(".work-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let out = SynthOutputs {
        model: work.join("model.powerinfer.gguf"),
        dense: None,
        activation_dir: Some(work.join("activation")),
        predictor_dir: None,
    };
    if !quiet {
        eprintln!("writing a synthetic model once to {} ...", path.display());
    }
    synth::synthesize(&cfg, &out, &mut |_, _| {}).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(dir.join("activation"));
    std::fs::rename(work.join("activation"), dir.join("activation"))
        .and_then(|_| std::fs::rename(work.join("model.powerinfer.gguf"), &path))
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let _ = std::fs::remove_dir_all(&work);
    Ok(path)
}
