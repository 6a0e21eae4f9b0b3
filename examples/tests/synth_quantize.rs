//! `powerinfer synth` and `powerinfer quantize`, run as processes.

use std::path::Path;
use std::process::{Command, Output};

use powerinfer_gguf::{FileKind, GgmlType, GgufFile};

fn powerinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .output()
        .expect("run powerinfer")
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn synth_then_quantize() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let o = powerinfer(&[
        "synth",
        "--shape",
        "tiny",
        "--layers",
        "1",
        "--type",
        "f32",
        "--arch",
        "bamboo",
        "--sparse-threshold",
        "0.1",
        "--out",
        &p("m.gguf"),
        "--dense-out",
        &p("d.gguf"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(names(dir.path()), ["activation", "d.gguf", "m.gguf"]);
    assert_eq!(
        names(&dir.path().join("activation")),
        ["activation.safetensors", "activation_0.pt"]
    );
    let m = GgufFile::open(p("m.gguf")).unwrap();
    assert_eq!(m.kind(), FileKind::PowerInfer);
    assert_eq!(
        m.metadata().get_str("general.architecture").unwrap(),
        "bamboo"
    );
    assert_eq!(GgufFile::open(p("d.gguf")).unwrap().kind(), FileKind::Gguf);

    let o = powerinfer(&["quantize", &p("m.gguf"), &p("q.gguf"), "q4_0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("converted"));
    let q = GgufFile::open(p("q.gguf")).unwrap();
    assert_eq!(q.kind(), FileKind::PowerInfer);
    let ty = |n: &str| q.tensor_info(n).unwrap().ggml_type();
    assert_eq!(ty("blk.0.ffn_gate.weight"), GgmlType::Q4_0);
    assert_eq!(ty("blk.0.ffn_norm.weight"), GgmlType::F32);
    assert_eq!(ty("blk.0.fc2.weight"), GgmlType::F16);

    let o = powerinfer(&[
        "quantize",
        &p("m.gguf"),
        &p("q5.gguf"),
        "q8_0",
        "--predictor-type",
        "powerinfer",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let q = GgufFile::open(p("q5.gguf")).unwrap();
    assert_eq!(
        q.tensor_info("blk.0.fc1.weight").unwrap().ggml_type(),
        GgmlType::Q5_0
    );
}

#[test]
fn bad_arguments_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    for (args, needle) in [
        (
            vec!["synth", "--shape", "huge", "--out", "x"],
            "unknown --shape",
        ),
        (
            vec!["synth", "--shape", "custom", "--layers", "1", "--out", "x"],
            "--embd",
        ),
        (
            vec!["synth", "--shape", "tiny", "--ff", "1000", "--out", "x"],
            "256",
        ),
        (
            vec!["synth", "--shape", "tiny", "--type", "q9", "--out", "x"],
            "--type",
        ),
        (
            vec!["synth", "--shape", "tiny", "--arch", "gpt", "--out", "x"],
            "--arch",
        ),
        (
            vec!["quantize", "missing.gguf", "o.gguf", "q4_0"],
            "missing.gguf",
        ),
        (
            vec!["quantize", "missing.gguf", "o.gguf", "q9_9"],
            "unknown type",
        ),
    ] {
        let args: Vec<String> = args
            .iter()
            .map(|a| match *a {
                "x" | "missing.gguf" | "o.gguf" => p(a),
                other => other.to_string(),
            })
            .collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = powerinfer(&args);
        assert!(!o.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(
            names(dir.path()).is_empty(),
            "{args:?} left {:?}",
            names(dir.path())
        );
    }
}

/// `powerinfer reorder`: reads `activation/` next to the input, writes the sorted file and the
/// permuted statistics next to the output (sorted, most active first), refuses to overwrite the
/// input's statistics, and the output generates the same greedy text.
#[test]
fn synth_then_reorder() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let o = powerinfer(&[
        "synth",
        "--shape",
        "tiny",
        "--layers",
        "2",
        "--type",
        "q4_0",
        "--out",
        &p("m.gguf"),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::create_dir(dir.path().join("out")).unwrap();
    let o = powerinfer(&["reorder", &p("m.gguf"), &p("out/s.gguf")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(said.contains("2 layers, 8 tensors permuted"), "{said}");
    assert_eq!(
        names(&dir.path().join("out/activation")),
        [
            "activation.safetensors",
            "activation_0.pt",
            "activation_1.pt"
        ]
    );
    let stats = powerinfer_predictor::stats::ActivationStats::read_pt_dir(
        dir.path().join("out/activation"),
    )
    .unwrap();
    assert!(stats
        .layers
        .iter()
        .all(|l| l.windows(2).all(|w| w[0] >= w[1])));
    // Next to the input, the statistics would be overwritten.
    let o = powerinfer(&["reorder", &p("m.gguf"), &p("s2.gguf")]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--activation-out"));
    let text = |m: &str| {
        let o = powerinfer(&[
            "run", "-m", m, "-p", "hello", "-n", "8", "-t", "2", "--temp", "0",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        o.stdout
    };
    assert_eq!(text(&p("m.gguf")), text(&p("out/s.gguf")));
}
