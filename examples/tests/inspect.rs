//! `powerinfer inspect` on real files: the JSON description from the library
//! (`inspect::describe`), the table, exit codes and error lines from the process.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use powerinfer_cli::cmd::inspect::describe;
use serde_json::Value as Json;

#[path = "support/cli.rs"]
mod cli;

fn inspect(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .arg("inspect")
        .args(args)
        .output()
        .expect("run powerinfer")
}

fn python() -> Option<PathBuf> {
    match std::env::var_os("POWERINFER_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            assert!(
                std::env::var_os("CI").is_none(),
                "POWERINFER_PYTHON must be set in CI"
            );
            println!("skipped: POWERINFER_PYTHON not set");
            None
        }
    }
}

/// Writes the PyPI-gguf sample file (alignment 64) into `dir`; returns its path and the
/// script's manifest.
fn pypi_file(py: &Path, dir: &Path) -> (PathBuf, Json) {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/powerinfer-gguf/tests/py/gguf_conformance.py"
    );
    let path = dir.join("py.gguf");
    let out = Command::new(py)
        .args([script, "write", path.to_str().unwrap(), "64"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (path, serde_json::from_slice(&out.stdout).unwrap())
}

/// The manifest's array values ({"elem", "values"}) as plain (nested) JSON arrays.
fn plain(v: &Json) -> Json {
    match v {
        Json::Object(o) if o.contains_key("elem") => {
            Json::Array(o["values"].as_array().unwrap().iter().map(plain).collect())
        }
        other => other.clone(),
    }
}

/// Equal JSON, except that floats only need to agree as f32 (inspect prints an f32 in its
/// shortest form, the script its exact double).
fn same(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| same(p, q))
        }
        (Json::Number(x), Json::Number(y)) if x.is_f64() || y.is_f64() => {
            x.as_f64().map(|v| v as f32) == y.as_f64().map(|v| v as f32)
        }
        _ => a == b,
    }
}

#[test]
fn json_describes_a_pypi_gguf_file() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (path, manifest) = pypi_file(&py, dir.path());
    let j = describe(&path).unwrap();
    assert_eq!(j["magic"], "GGUF");
    assert_eq!(j["version"], 3);
    assert_eq!(j["alignment"], 64);
    // Metadata keys in file order with their values.
    let md = j["metadata"].as_object().unwrap();
    let expected = manifest["metadata"].as_array().unwrap();
    assert_eq!(md.len(), expected.len());
    for ((k, v), e) in md.iter().zip(expected) {
        assert_eq!(k, e[0].as_str().unwrap());
        assert!(same(v, &plain(&e[2])), "{k}: {v} vs {}", e[2]);
    }
    assert_eq!(md["t.u64"], 18000000000000000000u64);
    assert_eq!(md["a.f32"], serde_json::json!([0.5, -0.25, 0.001]));
    // Tensors: name, type name, shape ne0 first, offset relative to the data section.
    let tensors = j["tensors"].as_array().unwrap();
    let expected = manifest["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), expected.len());
    let base = expected[0]["abs_offset"].as_u64().unwrap();
    for (t, e) in tensors.iter().zip(expected) {
        assert_eq!(t["name"], e["name"]);
        assert_eq!(t["shape"], e["shape"]);
        assert_eq!(
            t["offset"].as_u64().unwrap(),
            e["abs_offset"].as_u64().unwrap() - base
        );
    }
    assert_eq!(tensors[0]["type"], "F32");
    assert_eq!(tensors[0]["shape"], serde_json::json!([5, 3]));
    assert_eq!(tensors[9]["type"], "Q4_0");
}

#[test]
fn table_lists_keys_and_tensors() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = pypi_file(&py, dir.path());
    let out = inspect(&[path.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("magic:     GGUF"), "{text}");
    assert!(text.contains("alignment: 64"));
    assert!(text.contains("general.architecture") && text.contains("\"conformance\""));
    assert!(
        text.lines()
            .any(|l| l.contains("q4_0") && l.contains("Q4_0") && l.contains("[32, 3]")),
        "{text}"
    );
}

#[test]
fn long_arrays_full_in_json_abbreviated_in_table() {
    let name = "vocab/ggml-vocab-llama-spm.gguf";
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut candidates: Vec<PathBuf> = std::env::var_os("POWERINFER_TESTDATA")
        .map(|d| PathBuf::from(d).join(name))
        .into_iter()
        .collect();
    candidates.push(root.join("../shared/testdata").join(name));
    candidates.push(root.join("shared/testdata").join(name));
    let Some(vocab) = candidates.into_iter().find(|p| p.is_file()) else {
        assert!(
            std::env::var_os("CI").is_none(),
            "testdata {name} not found"
        );
        println!("skipped: testdata {name} not found");
        return;
    };
    let j = describe(&vocab).unwrap();
    assert_eq!(
        j["metadata"]["tokenizer.ggml.tokens"]
            .as_array()
            .unwrap()
            .len(),
        32000
    );
    assert_eq!(j["metadata"]["tokenizer.ggml.model"], "llama");
    let out = inspect(&[vocab.to_str().unwrap()]);
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("array<string>[32000]"), "{text}");
    assert!(text.contains("31992 more"), "{text}");
    assert!(
        text.len() < 20_000,
        "table not abbreviated: {} bytes",
        text.len()
    );
}

#[test]
fn bad_files_exit_1_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = {
        let mut w =
            powerinfer_gguf::GgufWriter::new(Vec::new(), powerinfer_gguf::FileKind::PowerInfer);
        w.add_kv(
            "general.architecture",
            powerinfer_gguf::Value::String("llama".into()),
        )
        .unwrap();
        w.add_kv("nan", powerinfer_gguf::Value::F32(f32::NAN))
            .unwrap();
        w.add_kv("inf", powerinfer_gguf::Value::F64(f64::NEG_INFINITY))
            .unwrap();
        w.add_kv("tenth", powerinfer_gguf::Value::F32(0.1)).unwrap();
        w.add_tensor("t", &[8], powerinfer_gguf::GgmlType::F32)
            .unwrap();
        w.write_tensor_data("t", &[0; 32]).unwrap();
        w.finish().unwrap()
    };
    let ok = dir.path().join("ok.gguf");
    std::fs::write(&ok, &good).unwrap();
    let out = inspect(&[ok.to_str().unwrap(), "--json"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "one JSON object on one line");
    let j: Json = serde_json::from_str(&text).unwrap();
    assert_eq!(j, describe(&ok).unwrap());
    assert_eq!(j["magic"], "PWRI");
    // Non-finite floats have no JSON number: null. Finite f32 print in shortest form.
    assert_eq!(j["metadata"]["nan"], Json::Null);
    assert_eq!(j["metadata"]["inf"], Json::Null);
    assert_eq!(j["metadata"]["tenth"].to_string(), "0.1");
    assert_eq!(j["tensors"][0]["offset"], 0);

    let truncated = dir.path().join("truncated.gguf");
    std::fs::write(&truncated, &good[..good.len() - 40]).unwrap();
    let mut bad_magic = good.clone();
    bad_magic[0] = b'X';
    let magic = dir.path().join("magic.gguf");
    std::fs::write(&magic, &bad_magic).unwrap();
    let missing = dir.path().join("missing.gguf");
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    for (path, needle) in [
        (&truncated, "past the end"),
        (&magic, "magic"),
        (&missing, "No such file"),
        (&empty, "truncated"),
    ] {
        for json in [false, true] {
            let mut args = vec![path.to_str().unwrap()];
            if json {
                args.push("--json");
            }
            let out = inspect(&args);
            assert_eq!(out.status.code(), Some(1));
            assert!(out.stdout.is_empty());
            let err = String::from_utf8(out.stderr).unwrap();
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(err.starts_with("error: ") && err.contains(needle), "{err}");
            assert!(!err.contains("panicked"));
        }
    }
}

#[test]
fn gpu_index_files_show_i32_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.generated.gpuidx");
    let idx = powerinfer_gguf::GpuIndex {
        layers: vec![powerinfer_gguf::LayerGpuIndex::new(4, vec![1, 2]).unwrap()],
        vram_capacity: 77,
        extra: Default::default(),
    };
    idx.write_to_path(&path).unwrap();
    let j = describe(&path).unwrap();
    assert_eq!(j["magic"], "PWRI");
    assert_eq!(j["metadata"]["general.architecture"], "generic.gpu_index");
    assert_eq!(j["metadata"]["split.vram_capacity"], 77);
    assert_eq!(j["tensors"][0]["name"], "blk.0.gpu_idx");
    assert_eq!(j["tensors"][0]["type"], "I32");
    assert_eq!(j["tensors"][1]["shape"], serde_json::json!([2]));
}

/// A PowerInfer file's predictor types per layer: in the table (runs of equal layers) and in
/// the JSON.
#[test]
fn predictors_are_listed_per_layer() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m.powerinfer.gguf");
    cli::synth(
        &m,
        &[
            "--shape",
            "tiny",
            "--layers",
            "3",
            "--predictor-type",
            "q8_0",
        ],
    );
    let j = describe(&m).unwrap();
    let p = j["predictors"].as_array().unwrap();
    assert_eq!(p.len(), 3, "{j}");
    for (l, e) in p.iter().enumerate() {
        assert_eq!(e["layer"], l);
        assert_eq!(
            (e["fc1"].as_str(), e["fc2"].as_str()),
            (Some("Q8_0"), Some("Q8_0"))
        );
        assert!(e["rank"].as_u64().unwrap() > 0);
    }
    let table = String::from_utf8(inspect(&[m.to_str().unwrap()]).stdout).unwrap();
    assert!(
        table.contains("predictors (3 layers):\n  layers 0-2: fc1 Q8_0, fc2 Q8_0, rank "),
        "{table}"
    );
}
