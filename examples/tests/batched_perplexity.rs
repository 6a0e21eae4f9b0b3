//! `powerinfer perplexity` against llama.cpp's `llama-perplexity` on the same files and text
//! (reference numbers in crates/powerinfer-engine/tests/data/perplexity, with the script that
//! made them), and `powerinfer batched`.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

#[path = "support/cli.rs"]
mod cli;

fn powerinfer(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .output()
        .unwrap()
}

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../crates/powerinfer-engine/tests/data/perplexity")
}

fn dense_twin(dir: &Path, ty: &str) -> PathBuf {
    let sparse = dir.join(format!("tiny-{ty}.powerinfer.gguf"));
    let dense = dir.join(format!("tiny-{ty}.dense.gguf"));
    cli::synth(
        &sparse,
        &[
            "--shape",
            "tiny",
            "--type",
            ty,
            "--seed",
            "0",
            "--no-activation",
            "--dense-out",
            dense.to_str().unwrap(),
        ],
    );
    dense
}

/// Within 0.5% of llama.cpp's final estimate and of every running estimate (measured when the
/// references were made: F16 0.0002%, Q8_0 0.0001%, Q4_0 0.012%).
#[test]
fn perplexity_agrees_with_llama_cpp() {
    let reference: Value =
        serde_json::from_slice(&std::fs::read(data().join("reference.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = data().join("text.txt");
    for ty in ["f16", "q8_0", "q4_0"] {
        let model = dense_twin(dir.path(), ty);
        let out = powerinfer(&[
            "perplexity",
            "-m",
            model.to_str().unwrap(),
            "-f",
            text.to_str().unwrap(),
            "-c",
            "256",
            "-b",
            "256",
            "-t",
            "2",
            "--gpu",
            "none",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ours: Value = serde_json::from_slice(&out.stdout).unwrap();
        let want = &reference[ty];
        let rel = |a: f64, b: f64| (a - b).abs() / b;
        let r = rel(ours["ppl"].as_f64().unwrap(), want["ppl"].as_f64().unwrap());
        println!(
            "{ty}: ppl {} vs llama.cpp {} ({:.4}%)",
            ours["ppl"],
            want["ppl"],
            100.0 * r
        );
        assert!(r < 0.005, "{ty}: {ours} vs {want}");
        let (a, b) = (
            ours["chunks"].as_array().unwrap(),
            want["chunks"].as_array().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!(
                rel(x.as_f64().unwrap(), y.as_f64().unwrap()) < 0.005,
                "{ty}: {x} vs {y}"
            );
        }
        let e = rel(
            ours["ppl_err"].as_f64().unwrap(),
            want["ppl_err"].as_f64().unwrap(),
        );
        assert!(
            e < 0.01,
            "{ty}: error {} vs {}",
            ours["ppl_err"],
            want["ppl_err"]
        );
    }
}

/// A text too short for two chunks is refused with the numbers; nothing is printed as if done.
#[test]
fn perplexity_refuses_short_texts() {
    let dir = tempfile::tempdir().unwrap();
    let model = dense_twin(dir.path(), "q8_0");
    let short = dir.path().join("short.txt");
    std::fs::write(&short, "a few words only").unwrap();
    let out = powerinfer(&[
        "perplexity",
        "-m",
        model.to_str().unwrap(),
        "-f",
        short.to_str().unwrap(),
        "-c",
        "256",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("needs at least 512"), "{err}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// N continuations of one prompt decoded together give the tokens of decoding them one after
/// another (quantized weights: the same bits; the same seeds), and `--parallel 0` is refused.
#[test]
fn batched_equals_sequential() {
    let dir = tempfile::tempdir().unwrap();
    let model = dense_twin(dir.path(), "q4_0");
    let out = powerinfer(&[
        "batched",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "Once upon a time",
        "--parallel",
        "4",
        "-n",
        "12",
        "-t",
        "2",
        "--gpu",
        "none",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["texts"], v["sequential_texts"], "{v}");
    assert_eq!(v["texts"].as_array().unwrap().len(), 4);
    assert!(v["batched_tps"].as_f64().unwrap() > 0.0);
    let out = powerinfer(&["batched", "-m", model.to_str().unwrap(), "--parallel", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--parallel 0"));
}

/// `batched --profile` on a PowerInfer file: the batched steps' per-operation profile, with
/// the sparse FFN's two halves timed apart (each with its time and bytes), beside the
/// per-layer union densities.
#[test]
fn batched_profile_times_each_operation() {
    let dir = tempfile::tempdir().unwrap();
    dense_twin(dir.path(), "q4_0");
    let sparse = dir.path().join("tiny-q4_0.powerinfer.gguf");
    let out = powerinfer(&[
        "batched",
        "-m",
        sparse.to_str().unwrap(),
        "--parallel",
        "3",
        "-n",
        "6",
        "-t",
        "2",
        "--gpu",
        "none",
        "--no-sequential",
        "--profile",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["profile"].as_array().unwrap();
    let op = |name: &str| rows.iter().find(|r| r["op"] == name).unwrap().clone();
    for name in ["ffn_up_gate", "ffn_down", "predictor", "qkv"] {
        let r = op(name);
        assert!(r["ms_per_token"].as_f64().unwrap() > 0.0, "{name}: {r}");
        assert!(r["mb_per_token"].as_f64().unwrap() > 0.0, "{name}: {r}");
    }
    let total = op("total")["ms_per_token"].as_f64().unwrap();
    let sum: f64 = rows
        .iter()
        .filter(|r| r["op"] != "total")
        .map(|r| r["ms_per_token"].as_f64().unwrap())
        .sum();
    assert!(
        (sum - total).abs() <= 1e-6 * total.max(1.0),
        "{sum} vs {total}"
    );
    assert!(!v["batch_density"].as_array().unwrap().is_empty(), "{v}");
}
