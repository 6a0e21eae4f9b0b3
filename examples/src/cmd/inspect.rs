//! `powerinfer inspect FILE [--json]`: header, metadata and tensor directory of a GGUF,
//! PowerInfer or GPU-index file.
//!
//! The table abbreviates long arrays and strings; `--json` prints everything as one object:
//! `{"magic", "version", "alignment", "metadata": {key: value, ...} (file order), "tensors":
//! [{"name", "type", "shape" (ne0 first), "offset" (relative to the data section)}]}`.
//! Integers are JSON integers, strings JSON strings, arrays JSON arrays (nested as stored);
//! floats are JSON numbers written with the fewest digits that read back as the same value
//! (an f32 0.1 prints as 0.1), and NaN or infinite floats, which JSON cannot express, print
//! as `null`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use powerinfer_gguf::{Array, FileKind, GgufFile, Value};
use serde_json::{json, Map, Value as Json};

/// Arguments of `powerinfer inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// The GGUF or PowerInfer file.
    pub file: PathBuf,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Array elements shown in the table before "... N more".
const TABLE_ARRAY_ITEMS: usize = 8;
/// Characters of a string shown in the table.
const TABLE_STRING_CHARS: usize = 80;

fn open(path: &Path) -> Result<GgufFile, String> {
    GgufFile::open(path).map_err(|e| super::file_error(path, e))
}

/// The JSON object `powerinfer inspect FILE --json` prints (see the module's documentation).
pub fn describe(path: &Path) -> Result<Json, String> {
    Ok(to_json(&open(path)?))
}

/// Runs `powerinfer inspect`.
pub fn run(args: Args) -> Result<(), String> {
    let file = open(&args.file)?;
    super::write_stdout(|out| {
        if args.json {
            super::json_line(out, &to_json(&file))
        } else {
            write_table(out, &args.file, &file)
        }
    })
}

fn float_json(x: f64, as_f32: bool) -> Json {
    if !x.is_finite() {
        return Json::Null;
    }
    // Shortest text that reads back as the stored value, e.g. f32 0.1 -> 0.1, not 0.10000000149.
    let shortest = if as_f32 {
        (x as f32).to_string().parse::<f64>().unwrap_or(x)
    } else {
        x
    };
    serde_json::Number::from_f64(shortest).map_or(Json::Null, Json::Number)
}

/// A metadata value as JSON.
pub fn value_json(v: &Value) -> Json {
    match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F32(x) => float_json(f64::from(*x), true),
        Value::F64(x) => float_json(*x, false),
        Value::Bool(x) => json!(x),
        Value::String(s) => json!(s),
        Value::Array(a) => array_json(a),
    }
}

fn array_json(a: &Array) -> Json {
    Json::Array(match a {
        Array::U8(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I8(v) => v.iter().map(|x| json!(x)).collect(),
        Array::U16(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I16(v) => v.iter().map(|x| json!(x)).collect(),
        Array::U32(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I32(v) => v.iter().map(|x| json!(x)).collect(),
        Array::U64(v) => v.iter().map(|x| json!(x)).collect(),
        Array::I64(v) => v.iter().map(|x| json!(x)).collect(),
        Array::F32(v) => v.iter().map(|x| float_json(f64::from(*x), true)).collect(),
        Array::F64(v) => v.iter().map(|x| float_json(*x, false)).collect(),
        Array::Bool(v) => v.iter().map(|x| json!(x)).collect(),
        Array::String(v) => v.iter().map(|x| json!(x)).collect(),
        Array::Array(v) => v.iter().map(array_json).collect(),
    })
}

/// A layer's predictor as stored: `(layer, fc1 type, fc2 type, rank)`.
type StoredPredictor = (usize, &'static str, &'static str, u64);

/// The predictors of a PowerInfer file, layer by layer (`blk.N.fc1.weight`, `blk.N.fc2.weight`).
fn predictors(file: &GgufFile) -> Vec<StoredPredictor> {
    let find = |name: &str| file.tensors().iter().find(|t| t.name() == name);
    (0..)
        .map_while(|l| {
            let fc1 = find(&format!("blk.{l}.fc1.weight"))?;
            let fc2 = find(&format!("blk.{l}.fc2.weight"))?;
            let rank = fc1.shape().get(1).copied().unwrap_or(0);
            Some((l, fc1.ggml_type().name(), fc2.ggml_type().name(), rank))
        })
        .collect()
}

/// The whole description of an open file as one JSON object (what [`describe`] returns).
pub fn to_json(file: &GgufFile) -> Json {
    let mut metadata = Map::new();
    for (k, v) in file.metadata().iter() {
        metadata.insert(k.to_string(), value_json(v));
    }
    let tensors: Vec<Json> = file
        .tensors()
        .iter()
        .map(|t| {
            json!({
                "name": t.name(),
                "type": t.ggml_type().name(),
                "shape": t.shape(),
                "offset": t.offset(),
            })
        })
        .collect();
    json!({
        "magic": file.kind().magic_str(),
        "version": file.version(),
        "alignment": file.alignment(),
        "metadata": metadata,
        "tensors": tensors,
        "predictors": predictors(file)
            .iter()
            .map(|&(l, a, b, r)| json!({"layer": l, "fc1": a, "fc2": b, "rank": r}))
            .collect::<Vec<_>>(),
    })
}

fn short_string(s: &str) -> String {
    let mut out: String = s.chars().take(TABLE_STRING_CHARS).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    format!("{out:?}")
}

fn short_value(v: &Value) -> String {
    match v {
        Value::String(s) => short_string(s),
        Value::Array(a) => short_array(a),
        Value::F32(x) => x.to_string(),
        Value::F64(x) => x.to_string(),
        other => value_json(other).to_string(),
    }
}

fn short_array(a: &Array) -> String {
    let shown: Vec<String> = (0..a.len().min(TABLE_ARRAY_ITEMS))
        .filter_map(|i| a.get(i))
        .map(|v| short_value(&v))
        .collect();
    let more = a.len().saturating_sub(TABLE_ARRAY_ITEMS);
    if more > 0 {
        format!("[{}, ... {more} more]", shown.join(", "))
    } else {
        format!("[{}]", shown.join(", "))
    }
}

fn type_label(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("{}[{}]", array_type_label(a), a.len()),
        other => other.value_type().name().to_string(),
    }
}

fn array_type_label(a: &Array) -> String {
    match a {
        Array::Array(inner) => match inner.first() {
            Some(first) => format!("array<{}>", array_type_label(first)),
            None => "array<array>".to_string(),
        },
        other => format!("array<{}>", other.elem_type().name()),
    }
}

fn write_table(out: &mut dyn Write, path: &std::path::Path, file: &GgufFile) -> io::Result<()> {
    let kind = match file.kind() {
        FileKind::Gguf => "GGUF (dense)",
        FileKind::PowerInfer => "PWRI (PowerInfer sparse)",
    };
    writeln!(out, "file:      {}", path.display())?;
    writeln!(out, "magic:     {kind}")?;
    writeln!(out, "version:   {}", file.version())?;
    writeln!(out, "alignment: {}", file.alignment())?;
    writeln!(
        out,
        "data:      starts at byte {}",
        file.header().data_offset()
    )?;
    writeln!(out)?;
    let md = file.metadata();
    writeln!(out, "metadata ({} keys):", md.len())?;
    let key_w = md.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let labels: Vec<String> = md.iter().map(|(_, v)| type_label(v)).collect();
    let type_w = labels.iter().map(String::len).max().unwrap_or(0);
    for ((k, v), label) in md.iter().zip(&labels) {
        writeln!(out, "  {k:key_w$}  {label:type_w$}  {}", short_value(v))?;
    }
    writeln!(out)?;
    let tensors = file.tensors();
    let total: u64 = tensors.iter().map(|t| t.n_bytes()).sum();
    writeln!(out, "tensors ({}, {total} bytes):", tensors.len())?;
    let name_w = tensors
        .iter()
        .map(|t| t.name().len())
        .max()
        .unwrap_or(4)
        .max(4);
    let shapes: Vec<String> = tensors
        .iter()
        .map(|t| {
            let dims: Vec<String> = t.shape().iter().map(u64::to_string).collect();
            format!("[{}]", dims.join(", "))
        })
        .collect();
    let shape_w = shapes.iter().map(String::len).max().unwrap_or(5).max(5);
    writeln!(
        out,
        "  {:name_w$}  {:7}  {:shape_w$}  {:>12}  {:>12}",
        "name", "type", "shape", "offset", "bytes"
    )?;
    for (t, shape) in tensors.iter().zip(&shapes) {
        writeln!(
            out,
            "  {:name_w$}  {:7}  {shape:shape_w$}  {:>12}  {:>12}",
            t.name(),
            t.ggml_type().name(),
            t.offset(),
            t.n_bytes()
        )?;
    }
    // Predictor types per layer, runs of equal layers together.
    let preds = predictors(file);
    if !preds.is_empty() {
        writeln!(out)?;
        writeln!(out, "predictors ({} layers):", preds.len())?;
        for run in preds.chunk_by(|a, b| (a.1, a.2, a.3) == (b.1, b.2, b.3)) {
            let (first, last) = (run[0], run[run.len() - 1]);
            let layers = if first.0 == last.0 {
                format!("layer {}", first.0)
            } else {
                format!("layers {}-{}", first.0, last.0)
            };
            writeln!(
                out,
                "  {layers}: fc1 {}, fc2 {}, rank {}",
                first.1, first.2, first.3
            )?;
        }
    }
    Ok(())
}
