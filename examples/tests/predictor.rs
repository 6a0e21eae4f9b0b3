//! `powerinfer profile` and `powerinfer train-predictor` end to end on a synthetic model
//! (`powerinfer synth`, exact predictor: noise 0), run as processes.

use std::path::Path;
use std::process::{Command, Output};

use powerinfer_predictor::predictor::F32Predictor;
use powerinfer_predictor::stats::ActivationStats;
use serde_json::Value;

#[path = "support/cli.rs"]
mod cli;

fn powerinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .output()
        .expect("run powerinfer")
}

fn json(o: Output) -> Value {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "{err}");
    serde_json::from_slice(&o.stdout).expect("JSON on stdout")
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}

/// A deterministic text of common words (any text tokenizes under the synthetic vocabulary).
fn write_text(path: &Path) {
    let words = [
        "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at",
        "from", "his", "her", "an", "be", "were", "are", "which", "this", "also", "had",
    ];
    let mut s = String::new();
    let mut x = 12345u64;
    for _ in 0..2500 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(words[(x >> 33) as usize % words.len()]);
        s.push(' ');
    }
    std::fs::write(path, s).unwrap();
}

#[test]
fn profile_eval_and_train_on_a_synthetic_model() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model = d.join("m.gguf");
    let m = model.to_str().unwrap();
    let twin = d.join("dense.gguf");
    cli::synth(
        &model,
        &[
            "--shape",
            "tiny",
            "--layers",
            "2",
            "--dense-out",
            twin.to_str().unwrap(),
        ],
    );
    let text = d.join("text.txt");
    write_text(&text);
    let t = text.to_str().unwrap();

    // Profile: files readable by both readers, frequencies near the designed density 0.1.
    let out = d.join("prof");
    let v = json(powerinfer(&[
        "profile",
        "-m",
        m,
        "-f",
        t,
        "--out",
        out.to_str().unwrap(),
        "--max-tokens",
        "800",
        "--ctx",
        "256",
        "--json",
    ]));
    assert_eq!(v["tokens"].as_u64(), Some(800));
    let mean = f(&v, "mean_true_density");
    assert!((0.05..0.2).contains(&mean), "mean density {mean}");
    let pt = ActivationStats::read_pt_dir(out.join("activation")).unwrap();
    let st =
        ActivationStats::read_safetensors(out.join("activation/activation.safetensors")).unwrap();
    assert_eq!(pt.layers, st.layers);
    assert_eq!(st.kind, "frequency");
    assert_eq!(pt.n_layer(), 2);
    for (l, layer) in st.layers.iter().enumerate() {
        assert_eq!(layer.len(), 1024);
        assert!(layer.iter().all(|&x| (0.0..=1.0).contains(&x)));
        let d = layer.iter().map(|&x| x as f64).sum::<f64>() / 1024.0;
        let want = f(&v["layers"][l], "true_density");
        assert!((d - want).abs() < 1e-6, "{d} vs {want}");
    }
    // The synthetic model's exact statistics and the measured ones rank neurons alike: the
    // neurons designed hottest fire more often than the coldest.
    let exact =
        ActivationStats::read_safetensors(d.join("activation/activation.safetensors")).unwrap();
    let mut idx: Vec<usize> = (0..1024).collect();
    idx.sort_by(|&a, &b| exact.layers[0][b].total_cmp(&exact.layers[0][a]));
    let hot: f32 = idx[..100].iter().map(|&i| st.layers[0][i]).sum();
    let cold: f32 = idx[924..].iter().map(|&i| st.layers[0][i]).sum();
    assert!(hot > 5.0 * cold, "hot {hot} cold {cold}");

    // The dense twin is a llama.cpp file: SwiGLU, whose activations are (almost) never exactly
    // 0, so every neuron counts as fired.
    let out2 = d.join("prof-dense");
    let v2 = json(powerinfer(&[
        "profile",
        "-m",
        twin.to_str().unwrap(),
        "-f",
        t,
        "--out",
        out2.to_str().unwrap(),
        "--max-tokens",
        "200",
        "--json",
    ]));
    assert!(f(&v2, "mean_true_density") > 0.99, "{v2}");
    assert!(out2.join("activation/activation_1.pt").is_file());
    let o = powerinfer(&[
        "profile",
        "-m",
        twin.to_str().unwrap(),
        "-f",
        t,
        "--eval-predictor",
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no predictor"));

    // The file's exact predictor (F16): recall and precision near 1.
    let v = json(powerinfer(&[
        "profile",
        "-m",
        m,
        "-f",
        t,
        "--eval-predictor",
        "--max-tokens",
        "500",
        "--json",
    ]));
    let tot = &v["predictor_total"];
    assert!(
        f(tot, "recall") > 0.99 && f(tot, "precision") > 0.99,
        "{tot}"
    );
    assert!((f(tot, "predicted_density") - f(tot, "true_density")).abs() < 0.01);
    assert_eq!(v["threshold"].as_f64(), Some(0.0));

    // Train rank-64 predictors on 1500 tokens, 150 held out.
    let pdir = d.join("pred");
    let v = json(powerinfer(&[
        "train-predictor",
        "-m",
        m,
        "-f",
        t,
        "--rank",
        "64",
        "--out",
        pdir.to_str().unwrap(),
        "--max-tokens",
        "1500",
        "--epochs",
        "8",
        "--holdout",
        "0.1",
        "--seed",
        "1",
        "--json",
    ]));
    let h = &v["holdout_total"];
    eprintln!(
        "trained: {h}\nfile's: {}",
        v["file_predictor_holdout_total"]
    );
    // A model denser than --max-density is refused before training, nothing written.
    let dense_dir = d.join("refused");
    let o = Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args([
            "train-predictor",
            "-m",
            m,
            "-f",
            t,
            "--rank",
            "8",
            "--max-tokens",
            "64",
        ])
        .args([
            "--max-density",
            "0.01",
            "--out",
            dense_dir.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("measured FFN density"), "{err}");
    assert!(!dense_dir.join("model_0.safetensors").exists());
    assert_eq!(h["tokens"].as_u64(), Some(2 * 150));
    assert!(f(h, "recall") >= 0.97, "{h}");
    assert!(f(h, "precision") >= 0.9, "{h}");
    assert!(
        f(h, "predicted_density") < 1.2 * f(h, "true_density"),
        "{h}"
    );
    let file = &v["file_predictor_holdout_total"];
    assert!(f(file, "recall") > 0.99, "{file}");
    for l in v["layers"].as_array().unwrap() {
        assert!(f(&l["train"], "recall") >= 0.99, "{l}");
    }
    for l in 0..2 {
        let p = F32Predictor::read(pdir.join(format!("model_{l}.safetensors"))).unwrap();
        assert_eq!((p.rank(), p.n_embd(), p.n_ff()), (64, 256, 1024));
    }
    assert!(!pdir.join("model_2.safetensors").exists());
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(pdir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["sparse_threshold"].as_f64(), Some(-1.0));

    // Errors are one line, exit 1.
    let o = powerinfer(&["profile", "-m", m, "-f", t]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to do"));
}
