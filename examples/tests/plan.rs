//! `powerinfer plan` end to end on a synthetic model: plans and predictions from the library
//! (`cmd::plan`), the table and refused input from the process.

use std::path::Path;
use std::process::{Command, Output};

use powerinfer_cli::cmd::plan;
use powerinfer_cli::parse_args;
use powerinfer_gguf::GpuIndex;
use serde_json::Value;

#[path = "support/cli.rs"]
mod cli;

fn powerinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .output()
        .expect("run powerinfer")
}

/// `plan -m MODEL EXTRA` in-process: what `--json` prints and the note it prints on stderr.
fn plan(model: &str, extra: &[&str]) -> (Value, String) {
    let mut words = vec!["-m", model];
    words.extend_from_slice(extra);
    let args: plan::Args = parse_args(words).unwrap();
    let p = plan::plan(&args).unwrap();
    (plan::to_json(&p), plan::note(&p).unwrap_or_default())
}

/// `plan -m MODEL --predict EXTRA` in-process: what `--json` prints.
fn predict(model: &str, extra: &[&str]) -> Value {
    let mut words = vec!["-m", model, "--predict"];
    words.extend_from_slice(extra);
    let args: plan::Args = parse_args(words).unwrap();
    plan::predict(&args).unwrap().to_json()
}

fn gpu_neurons(v: &Value) -> Vec<u64> {
    v["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["gpu_neurons"].as_u64().unwrap())
        .collect()
}

#[test]
fn plan_lifecycle_on_a_synthetic_model() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let m = model.to_str().unwrap();
    cli::synth(&model, &["--shape", "tiny", "--layers", "3"]);

    // 5 MiB: dense (1.6 MiB) and KV (0.75 MiB at ctx 512) fit, the FFN gets the rest.
    let (v, err) = plan(m, &["--vram-budget", "0.005"]);
    assert!(err.contains("no cached GPU index"), "{err}");
    let budget = v["budget_bytes"].as_u64().unwrap();
    assert_eq!(budget, (0.005f64 * (1u64 << 30) as f64) as u64);
    let (dense, kv, ffn) = (
        v["dense_bytes"].as_u64().unwrap(),
        v["kv_bytes"].as_u64().unwrap(),
        v["ffn_bytes"].as_u64().unwrap(),
    );
    // tiny: 3 layers, n_embd_gqa = 128, f16 KV for 512 tokens.
    assert_eq!(kv, 2 * 3 * 512 * 128 * 2);
    assert!(dense > 0 && ffn > 0);
    assert_eq!(dense + kv + ffn + v["left_bytes"].as_u64().unwrap(), budget);
    let ks = gpu_neurons(&v);
    assert_eq!(ks.len(), 3);
    assert!(ks.iter().all(|k| k % 256 == 0));
    // f16, n_embd 256: one neuron = 3 rows of 512 bytes.
    assert_eq!(ffn, ks.iter().sum::<u64>() * 3 * 512);
    for l in v["layers"].as_array().unwrap() {
        let s = l["mass_share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&s));
    }
    let path = format!("{m}.generated.gpuidx");
    assert_eq!(v["gpuidx"].as_str().unwrap(), path);
    let idx = GpuIndex::open(&path).unwrap();
    assert_eq!(
        idx.layers.iter().map(|l| l.k() as u64).collect::<Vec<_>>(),
        ks
    );
    assert!(idx.extra.contains_key("powerinfer_rs.stats_digest"));
    assert!(idx.vram_capacity <= budget - dense - kv);

    // Same inputs: reused. Reset: rebuilt, same result.
    let (v2, err) = plan(m, &["--vram-budget", "0.005"]);
    assert_eq!(v2["source"], "reused", "{err}");
    assert_eq!(gpu_neurons(&v2), ks);
    let (v3, err) = plan(m, &["--vram-budget", "0.005", "--reset-gpu-index"]);
    assert!(err.contains("--reset-gpu-index"), "{err}");
    assert_eq!(gpu_neurons(&v3), ks);

    // A smaller budget makes the cache stale; fewer neurons.
    let (v4, err) = plan(m, &["--vram-budget", "0.004"]);
    assert!(err.contains("stale"), "{err}");
    assert!(gpu_neurons(&v4).iter().sum::<u64>() < ks.iter().sum::<u64>());

    // A model file with a new modification time makes the cache stale.
    let f = std::fs::File::options().write(true).open(&model).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(60))
        .unwrap();
    drop(f);
    let (_, err) = plan(m, &["--vram-budget", "0.004"]);
    assert!(err.contains("stale") && err.contains("model time"), "{err}");
    let (v4b, _) = plan(m, &["--vram-budget", "0.004"]);
    assert_eq!(v4b["source"], "reused");

    // Balanced mode with ratio 1: every layer holds at least half its mass when it fits.
    let (v5, _) = plan(m, &["--vram-budget", "0.01", "--balanced", "1"]);
    for l in v5["layers"].as_array().unwrap() {
        assert!(l["mass_share"].as_f64().unwrap() >= 0.5);
    }

    // Disabled: all CPU, no index.
    let (v6, err) = plan(m, &["--vram-budget", "0.005", "--disable-gpu-index"]);
    assert!(err.contains("disabled"), "{err}");
    assert_eq!(gpu_neurons(&v6), [0, 0, 0]);
    assert!(v6["gpuidx"].is_null());

    // No statistics next to the model: said so, all CPU. With --activation: found again.
    let moved = dir.path().join("stats");
    std::fs::rename(dir.path().join("activation"), &moved).unwrap();
    let (v7, err) = plan(m, &["--vram-budget", "0.005"]);
    assert!(err.contains("no activation statistics"), "{err}");
    assert_eq!(gpu_neurons(&v7), [0, 0, 0]);
    assert!(v7["gpuidx"].is_null());
    let (v8, _) = plan(
        m,
        &[
            "--vram-budget",
            "0.005",
            "--activation",
            moved.to_str().unwrap(),
        ],
    );
    assert_eq!(gpu_neurons(&v8), ks);

    // The table form prints one row per layer and the totals.
    let o = powerinfer(&[
        "plan",
        "-m",
        m,
        "--vram-budget",
        "0.005",
        "--activation",
        moved.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("gpu_neurons") && text.contains("left") && text.contains("reused"),
        "{text}"
    );

    // Bad input: a typed error, not a panic.
    let o = powerinfer(&["plan", "-m", m, "--vram-budget", "-1"]);
    assert!(!o.status.success());
    let o = powerinfer(&["plan", "-m", m, "--vram-budget", "1", "--group", "48"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("multiple of 32"));
    let missing = dir.path().join("nope.gguf");
    assert!(!Path::new(&missing).exists());
    let o = powerinfer(&[
        "plan",
        "-m",
        missing.to_str().unwrap(),
        "--vram-budget",
        "1",
    ]);
    assert!(!o.status.success());
}

/// `plan --predict`: nothing written; both policies predicted for the given hardware, the
/// balanced one never slower; a GPU as slow as the CPU gains from balancing, a much faster one
/// computes everything it holds (the two policies agree); bad figures are refused.
#[test]
fn plan_predict_compares_static_and_balanced() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let m = model.to_str().unwrap();
    cli::synth(&model, &["--shape", "tiny", "--layers", "3"]);
    let predict = |gpu_bw: &str| {
        predict(
            m,
            &[
                "--vram-budget",
                "0.005",
                "--cpu-bw",
                "20",
                "--gpu-bw",
                gpu_bw,
                "--gpu-launch-us",
                "0",
                "--link-bw",
                "1000",
            ],
        )
    };
    let slow = predict("20");
    assert!(!dir.path().join("m.gguf.generated.gpuidx").exists());
    let (s, b) = (&slow["static"], &slow["balanced"]);
    assert!(slow["held_neurons"].as_u64().unwrap() > 0);
    assert!(s["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(b["tokens_per_s"].as_f64().unwrap() > s["tokens_per_s"].as_f64().unwrap());
    assert!(b["computed_on_gpu"].as_u64() < s["computed_on_gpu"].as_u64());
    let fast = predict("2000");
    let (s, b) = (&fast["static"], &fast["balanced"]);
    assert_eq!(b["computed_on_gpu"], s["computed_on_gpu"]);
    let o = powerinfer(&[
        "plan",
        "-m",
        m,
        "--vram-budget",
        "0.005",
        "--predict",
        "--gpu-bw",
        "0",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--gpu-bw"));
}

/// The KV cache's type in the budget: at the same budget a Q8_0 or Q4_0 cache weighs less than
/// F16's (the plan's `kv_bytes`), so more neurons fit; `--predict` prints each type's neurons
/// and speeds.
#[test]
fn a_smaller_kv_cache_buys_more_neurons() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    let m = model.to_str().unwrap();
    cli::synth(&model, &["--shape", "tiny", "--layers", "3"]);
    let at = |ty: &str| {
        let (v, _) = plan(
            m,
            &[
                "--vram-budget",
                "0.005",
                "--ctx",
                "2048",
                "-ctk",
                ty,
                "-ctv",
                ty,
            ],
        );
        let n: u64 = gpu_neurons(&v).iter().sum();
        (v["kv_bytes"].as_u64().unwrap(), n)
    };
    let (f16, q8, q4) = (at("f16"), at("q8_0"), at("q4_0"));
    // 3 layers of 128 values per position, K and V.
    assert_eq!(f16.0, 2 * 3 * 2048 * 128 * 2);
    assert_eq!(q8.0, 2 * 3 * 2048 * 128 / 32 * 34);
    assert_eq!(q4.0, 2 * 3 * 2048 * 128 / 32 * 18);
    assert!(f16.1 < q8.1 && q8.1 <= q4.1, "{f16:?} {q8:?} {q4:?}");
    let p = predict(
        m,
        &[
            "--vram-budget",
            "0.005",
            "--ctx",
            "2048",
            "--attended",
            "2048",
            "--cpu-bw",
            "20",
        ],
    );
    let rows = p["kv_types"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["type"].as_str().unwrap()).collect();
    assert_eq!(names, ["f16", "q8_0", "q4_0"]);
    let held: Vec<u64> = rows
        .iter()
        .map(|r| r["held_neurons"].as_u64().unwrap())
        .collect();
    assert!(held[0] < held[1] && held[1] <= held[2], "{held:?}");
    let tps = |i: usize| rows[i]["static_tokens_per_s"].as_f64().unwrap();
    // Fewer bytes read per attended position and more neurons on the GPU.
    assert!(tps(0) < tps(1) && tps(1) <= tps(2), "{rows:?}");
}
