//! Opening a GGUF file costs the same whatever its size: the header, metadata and tensor
//! directory are parsed, no tensor byte is read.
//!
//! Two PWRI files with the same directory (LLaMA-7B-like: 32 layers, 291 Q4_0/F32 tensors, a
//! 32000-token vocabulary) are written to the temp dir, one with 7B dimensions (~3.8 GB) and
//! one scaled down (~9 MB: the vocabulary-sized embedding and output keep it above 4 MB).
//! Their tensor data are holes (`set_len`), so writing them costs no disk I/O. The bench
//! times `GgufFile::open` + listing every tensor for each, and prints the process's resident
//! memory before and after opening the big one.
//!
//! Run: `cargo bench -p powerinfer-benches --bench gguf_open`.

use std::fs::File;
use std::hint::black_box;
use std::io::Write;
use std::path::{Path, PathBuf};

use criterion::{criterion_group, Criterion};
use powerinfer_gguf::{Array, FileKind, GgmlType, GgufFile, GgufWriter, Value};

/// Writes a sparse model file with the given dimensions; returns its size in bytes.
fn write_sparse_model(path: &Path, n_embd: u64, n_ff: u64, n_vocab: u64) -> u64 {
    let mut tensors: Vec<(String, Vec<u64>, GgmlType)> = vec![
        (
            "token_embd.weight".into(),
            vec![n_embd, n_vocab],
            GgmlType::Q4_0,
        ),
        ("output_norm.weight".into(), vec![n_embd], GgmlType::F32),
        (
            "output.weight".into(),
            vec![n_embd, n_vocab],
            GgmlType::Q4_0,
        ),
    ];
    for i in 0..32 {
        for (name, shape, ty) in [
            ("attn_norm.weight", vec![n_embd], GgmlType::F32),
            ("attn_q.weight", vec![n_embd, n_embd], GgmlType::Q4_0),
            ("attn_k.weight", vec![n_embd, n_embd], GgmlType::Q4_0),
            ("attn_v.weight", vec![n_embd, n_embd], GgmlType::Q4_0),
            ("attn_output.weight", vec![n_embd, n_embd], GgmlType::Q4_0),
            ("ffn_norm.weight", vec![n_embd], GgmlType::F32),
            ("ffn_gate.weight", vec![n_embd, n_ff], GgmlType::Q4_0),
            ("ffn_up.weight", vec![n_embd, n_ff], GgmlType::Q4_0),
            ("ffn_down_t.weight", vec![n_embd, n_ff], GgmlType::Q4_0),
        ] {
            tensors.push((format!("blk.{i}.{name}"), shape, ty));
        }
    }
    let mut header = Vec::new();
    let mut w = GgufWriter::new(&mut header, FileKind::PowerInfer);
    w.add_kv("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add_kv("llama.embedding_length", Value::U32(n_embd as u32))
        .unwrap();
    w.add_kv("llama.feed_forward_length", Value::U32(n_ff as u32))
        .unwrap();
    w.add_kv("llama.block_count", Value::U32(32)).unwrap();
    w.add_kv("tokenizer.ggml.model", Value::String("llama".into()))
        .unwrap();
    let tokens = (0..n_vocab).map(|i| format!("tok{i}")).collect();
    w.add_kv("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
        .unwrap();
    let scores = (0..n_vocab).map(|i| -(i as f32)).collect();
    w.add_kv("tokenizer.ggml.scores", Value::Array(Array::F32(scores)))
        .unwrap();
    let mut data_len = 0;
    for (name, shape, ty) in &tensors {
        w.add_tensor(name, shape, *ty).unwrap();
        let n: u64 = shape.iter().product();
        data_len += ty.bytes_for(n).unwrap().next_multiple_of(32);
    }
    w.write_header().unwrap();
    drop(w);
    let mut f = File::create(path).unwrap();
    f.write_all(&header).unwrap();
    let len = header.len() as u64 + data_len;
    f.set_len(len).unwrap();
    len
}

fn vm_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

fn open_and_list(path: &Path) -> u64 {
    let f = GgufFile::open(path).unwrap();
    f.tensors().iter().map(|t| t.n_bytes() ^ t.shape()[0]).sum()
}

struct Files {
    big: PathBuf,
    small: PathBuf,
}

fn files() -> Files {
    let dir = std::env::temp_dir().join("powerinfer-bench-gguf-open");
    std::fs::create_dir_all(&dir).unwrap();
    let big = dir.join("big.powerinfer.gguf");
    let small = dir.join("small.powerinfer.gguf");
    let big_len = write_sparse_model(&big, 4096, 11008, 32000);
    let small_len = write_sparse_model(&small, 128, 352, 32000);
    eprintln!("big file: {big_len} bytes, small file: {small_len} bytes (tensor data are holes)");
    Files { big, small }
}

fn bench(c: &mut Criterion) {
    let files = files();
    let before = vm_rss_kib();
    let f = GgufFile::open(&files.big).unwrap();
    let n = f.tensors().len();
    let after = vm_rss_kib();
    eprintln!(
        "VmRSS before opening the big file: {before} KiB, after opening and listing its {n} tensors: {after} KiB (+{} KiB)",
        after.saturating_sub(before)
    );
    drop(f);
    let mut g = c.benchmark_group("gguf_open_and_list");
    g.bench_function("4GB", |b| b.iter(|| black_box(open_and_list(&files.big))));
    g.bench_function("4MB", |b| b.iter(|| black_box(open_and_list(&files.small))));
    g.finish();
    let _ = std::fs::remove_file(&files.big);
    let _ = std::fs::remove_file(&files.small);
}

criterion_group!(benches, bench);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
}
