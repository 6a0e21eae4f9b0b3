//! `powerinfer synth` and `powerinfer quantize`: models made in-process, `quantize` and
//! `reorder` run as processes (their printed tables and warnings), bad arguments' exit codes.

use std::path::Path;
use std::process::{Command, Output};

use powerinfer_gguf::{FileKind, GgmlType, GgufFile, GgufWriter};

#[path = "support/cli.rs"]
mod cli;

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
    cli::synth(
        Path::new(&p("m.gguf")),
        &[
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
            "--dense-out",
            &p("d.gguf"),
        ],
    );
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

    // Default for a quantized target: each layer's predictor in the cheapest type within the
    // margin, as the printed table says.
    let o = powerinfer(&["quantize", &p("m.gguf"), &p("q.gguf"), "q4_0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("converted"), "{out}");
    assert!(
        out.contains("predictor storage on 128 held-out tokens"),
        "{out}"
    );
    let row = out
        .lines()
        .find(|l| l.starts_with("0 "))
        .unwrap_or_else(|| panic!("no layer 0 row in {out}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    let recall: f64 = cols[2].parse().unwrap();
    assert!(recall >= 0.99, "{row}");
    let q = GgufFile::open(p("q.gguf")).unwrap();
    assert_eq!(q.kind(), FileKind::PowerInfer);
    let ty = |n: &str| q.tensor_info(n).unwrap().ggml_type();
    assert_eq!(ty("blk.0.ffn_gate.weight"), GgmlType::Q4_0);
    assert_eq!(ty("blk.0.ffn_norm.weight"), GgmlType::F32);
    assert_eq!(ty("blk.0.fc2.weight").name(), cols[1]);
    assert_eq!(ty("blk.0.fc1.weight").name(), cols[1]);

    let o = powerinfer(&[
        "quantize",
        &p("m.gguf"),
        &p("q16.gguf"),
        "q4_0",
        "--predictor-type",
        "f16",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let q = GgufFile::open(p("q16.gguf")).unwrap();
    assert_eq!(
        q.tensor_info("blk.0.fc2.weight").unwrap().ggml_type(),
        GgmlType::F16
    );

    // A llama.cpp K-quant mix by name: output Q6_K, the rest of this one-layer model's
    // ffn_gate Q4_K.
    let o = powerinfer(&["quantize", &p("m.gguf"), &p("qm.gguf"), "q4_k_m"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let q = GgufFile::open(p("qm.gguf")).unwrap();
    let ty = |n: &str| q.tensor_info(n).unwrap().ggml_type();
    assert_eq!(ty("blk.0.ffn_gate.weight"), GgmlType::Q4_K);
    assert_eq!(ty("output.weight"), GgmlType::Q6_K);
    assert_eq!(q.metadata().get_u32("general.file_type").unwrap(), 15);

    let o = powerinfer(&[
        "quantize",
        &p("m.gguf"),
        &p("q5.gguf"),
        "q8_0",
        "--predictor-type",
        "powerinfer",
        "--calib-tokens",
        "0",
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
    cli::synth(
        Path::new(&p("m.gguf")),
        &["--shape", "tiny", "--layers", "2", "--type", "q4_0"],
    );
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

#[test]
fn a_predictor_that_does_not_survive_f16_is_kept_in_f32() {
    // The same products as a well-scaled predictor, but fc2's values overflow F16 and fc1's
    // underflow it: stored in F16, layer 1 would select no neuron at all.
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    cli::synth(
        Path::new(&p("m.gguf")),
        &["--shape", "tiny", "--layers", "2", "--type", "f32"],
    );
    let src = GgufFile::open(p("m.gguf")).unwrap();
    let mut w = GgufWriter::create(Path::new(&p("x.gguf")), src.kind()).unwrap();
    w.add_metadata(src.metadata()).unwrap();
    for t in src.tensors() {
        w.add_tensor(t.name(), t.shape(), t.ggml_type()).unwrap();
    }
    for t in src.tensors() {
        let scale = match t.name() {
            "blk.1.fc1.weight" => 1e-6f32,
            "blk.1.fc2.weight" => 1e6,
            _ => 1.0,
        };
        if scale == 1.0 {
            w.write_tensor_data(t.name(), src.data_of(t)).unwrap();
        } else {
            let v: Vec<u8> = src
                .tensor_f32(t.name())
                .unwrap()
                .iter()
                .flat_map(|x| (x * scale).to_le_bytes())
                .collect();
            w.write_tensor_data(t.name(), &v).unwrap();
        }
    }
    w.finish().unwrap().commit().unwrap();

    let o = powerinfer(&[
        "quantize",
        &p("x.gguf"),
        &p("q.gguf"),
        "q8_0",
        "--predictor-type",
        "f16",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("warning: layer 1:") && err.contains("kept in F32"),
        "{err}"
    );
    assert!(!err.contains("layer 0:"), "{err}");
    let q = GgufFile::open(p("q.gguf")).unwrap();
    let ty = |n: &str| q.tensor_info(n).unwrap().ggml_type();
    assert_eq!(ty("blk.0.fc1.weight"), GgmlType::F16);
    assert_eq!(ty("blk.1.fc1.weight"), GgmlType::F32);
    assert_eq!(ty("blk.1.fc2.weight"), GgmlType::F32);
    // Without the check (--calib-tokens 0) the layer would be written in F16.
    let o = powerinfer(&[
        "quantize",
        &p("x.gguf"),
        &p("q0.gguf"),
        "q8_0",
        "--predictor-type",
        "f16",
        "--calib-tokens",
        "0",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let q = GgufFile::open(p("q0.gguf")).unwrap();
    assert_eq!(
        q.tensor_info("blk.1.fc1.weight").unwrap().ggml_type(),
        GgmlType::F16
    );
}
