//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use powerinfer_gguf::{Array, FileKind, GgmlType, GgufFile, GgufWriter, Value};
use serde_json::{json, Value as Json};

/// The Python interpreter of the conformance venv, or `None` (after printing why) when
/// POWERINFER_PYTHON is unset outside CI. In CI a missing interpreter fails the test.
pub fn python() -> Option<PathBuf> {
    match std::env::var_os("POWERINFER_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None => {
            assert!(
                std::env::var_os("CI").is_none(),
                "POWERINFER_PYTHON must be set in CI (scripts/test sets it)"
            );
            println!("skipped: POWERINFER_PYTHON not set");
            None
        }
    }
}

/// Runs tests/py/gguf_conformance.py with `args` and parses its JSON output.
pub fn run_py(python: &PathBuf, args: &[&str]) -> Json {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/gguf_conformance.py");
    let out = Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("python prints JSON")
}

fn f32_json(x: f32) -> Json {
    json!(f64::from(x))
}

/// A value in the manifest format of tests/py/gguf_conformance.py.
pub fn canon(v: &Value) -> Json {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::F32(x) => f32_json(*x),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::Array(a) => canon_array(a),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F64(x) => json!(x),
    }
}

/// An array in the manifest format.
pub fn canon_array(a: &Array) -> Json {
    let values: Vec<Json> = match a {
        Array::U8(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I8(v) => v.iter().map(|x| json!(x)).collect(),
        Array::U16(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I16(v) => v.iter().map(|x| json!(x)).collect(),
        Array::U32(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I32(v) => v.iter().map(|x| json!(x)).collect(),
        Array::F32(v) => v.iter().map(|x| f32_json(*x)).collect(),
        Array::Bool(v) => v.iter().map(|x| json!(x)).collect(),
        Array::String(v) => v.iter().map(|x| json!(x)).collect(),
        Array::Array(v) => v.iter().map(canon_array).collect(),
        Array::U64(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I64(v) => v.iter().map(|x| json!(x)).collect(),
        Array::F64(v) => v.iter().map(|x| json!(x)).collect(),
    };
    json!({"elem": a.elem_type().name(), "values": values})
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Our reader's view of a file, in the manifest format.
pub fn describe<B: AsRef<[u8]>>(f: &GgufFile<B>) -> Json {
    let metadata: Vec<Json> = f
        .metadata()
        .iter()
        .map(|(k, v)| json!([k, v.value_type().name(), canon(v)]))
        .collect();
    let tensors: Vec<Json> = f
        .tensors()
        .iter()
        .map(|t| {
            json!({
                "name": t.name(),
                "type": t.type_id(),
                "shape": t.shape(),
                "abs_offset": f.header().data_offset() + t.offset(),
                "data": hex(f.data_of(t)),
            })
        })
        .collect();
    json!({"magic": f.kind().magic_str(), "alignment": f.alignment(), "metadata": metadata, "tensors": tensors})
}

/// Writes everything `f` holds (metadata and tensors, in order) with our writer.
pub fn rewrite<B: AsRef<[u8]>>(f: &GgufFile<B>) -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new(), f.kind());
    w.add_metadata(f.metadata()).unwrap();
    for t in f.tensors() {
        w.add_tensor(t.name(), t.shape(), t.ggml_type()).unwrap();
    }
    for t in f.tensors() {
        w.write_tensor_data(t.name(), f.data_of(t)).unwrap();
    }
    w.finish().unwrap()
}

/// Every value type, nested arrays and empty arrays.
pub fn sample_metadata() -> Vec<(&'static str, Value)> {
    vec![
        ("general.architecture", Value::String("llama".into())),
        ("u8", Value::U8(255)),
        ("i8", Value::I8(-128)),
        ("u16", Value::U16(65535)),
        ("i16", Value::I16(-32768)),
        ("u32", Value::U32(u32::MAX)),
        ("i32", Value::I32(i32::MIN)),
        ("f32", Value::F32(0.1)),
        ("bool", Value::Bool(true)),
        ("string", Value::String("ünïcödé ✓".into())),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f64", Value::F64(-1e300)),
        ("arr.u8", Value::Array(Array::U8(vec![1, 2, 3]))),
        ("arr.i8", Value::Array(Array::I8(vec![-1]))),
        ("arr.u16", Value::Array(Array::U16(vec![7, 8]))),
        ("arr.i16", Value::Array(Array::I16(vec![-7]))),
        ("arr.u32", Value::Array(Array::U32(vec![9]))),
        ("arr.i32", Value::Array(Array::I32(vec![-9, 9]))),
        ("arr.f32", Value::Array(Array::F32(vec![1.5, -0.0]))),
        ("arr.bool", Value::Array(Array::Bool(vec![false, true]))),
        (
            "arr.string",
            Value::Array(Array::String(vec!["a".into(), "".into()])),
        ),
        ("arr.u64", Value::Array(Array::U64(vec![u64::MAX]))),
        ("arr.i64", Value::Array(Array::I64(vec![i64::MIN]))),
        ("arr.f64", Value::Array(Array::F64(vec![0.25]))),
        ("arr.empty", Value::Array(Array::F32(vec![]))),
        (
            "arr.nested",
            Value::Array(Array::Array(vec![
                Array::I32(vec![1, 2]),
                Array::String(vec!["x".into()]),
                Array::Array(vec![Array::U8(vec![5])]),
                Array::Bool(vec![]),
            ])),
        ),
    ]
}

/// Tensors of several types: (name, shape, type, bytes).
pub fn sample_tensors() -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let mut out = Vec::new();
    let specs: &[(&str, &[u64], GgmlType)] = &[
        ("token_embd.weight", &[8, 3], GgmlType::F32),
        ("blk.0.ffn_up.weight", &[64, 2], GgmlType::Q4_0),
        ("blk.0.ffn_down_t.weight", &[32, 2], GgmlType::Q8_0),
        ("blk.0.attn_q.weight", &[5, 3], GgmlType::F16),
        ("blk.0.empty", &[0], GgmlType::I32),
        ("output.weight", &[256], GgmlType::Q6_K),
        ("x.bf16", &[3], GgmlType::BF16),
        ("x.i64", &[2, 1, 1, 2], GgmlType::I64),
        ("x.scalar", &[], GgmlType::F64),
    ];
    for (i, (name, shape, ty)) in specs.iter().enumerate() {
        let n: u64 = shape.iter().product();
        let bytes = ty.bytes_for(n).unwrap() as usize;
        let data = (0..bytes).map(|j| (j * 7 + i * 13) as u8).collect();
        out.push((name.to_string(), shape.to_vec(), *ty, data));
    }
    out
}

/// A file with [`sample_metadata`] and [`sample_tensors`].
pub fn sample_file(kind: FileKind, alignment: Option<u32>) -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new(), kind);
    for (k, v) in sample_metadata() {
        w.add_kv(k, v).unwrap();
    }
    if let Some(a) = alignment {
        w.set_alignment(a).unwrap();
    }
    let tensors = sample_tensors();
    for (name, shape, ty, _) in &tensors {
        w.add_tensor(name, shape, *ty).unwrap();
    }
    for (name, _, _, data) in &tensors {
        w.write_tensor_data(name, data).unwrap();
    }
    w.finish().unwrap()
}

/// A small valid file (for truncation and mutation tests): a few keys and tensors.
pub fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new(), FileKind::PowerInfer);
    w.add_kv("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add_kv("n", Value::U32(3)).unwrap();
    w.add_kv(
        "s",
        Value::Array(Array::String(vec!["ab".into(), "c".into()])),
    )
    .unwrap();
    w.add_kv(
        "nest",
        Value::Array(Array::Array(vec![Array::F32(vec![1.0]), Array::U8(vec![])])),
    )
    .unwrap();
    w.add_kv("b", Value::Bool(true)).unwrap();
    w.add_tensor("a", &[4], GgmlType::F32).unwrap();
    w.add_tensor("q", &[32], GgmlType::Q4_0).unwrap();
    w.add_tensor("e", &[0, 3], GgmlType::F16).unwrap();
    w.write_tensor_data("a", &[1; 16]).unwrap();
    w.write_tensor_data("q", &[2; 18]).unwrap();
    w.write_tensor_data("e", &[]).unwrap();
    w.finish().unwrap()
}
