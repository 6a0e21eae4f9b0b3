//! Tokenizer throughput on the llama.cpp test vocabularies (`shared/testdata/vocab`): SPM
//! (LLaMA), byte-level BPE with the Falcon and GPT-2 pre-tokenizers. The text is the test
//! strings of `.inp` (many scripts, emoji, whitespace runs) repeated to 4 KiB, 64 KiB and
//! 1 MiB: bytes per second staying flat across sizes shows encoding is not quadratic.
//! Also times decoding the 64 KiB text's ids.
//!
//! Run: `cargo bench -p powerinfer-benches --bench tokenizer`. The data directory is
//! `$POWERINFER_TESTDATA/vocab` if set, else `shared/testdata/vocab` beside the repository.

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use powerinfer_engine::tokenizer::Tokenizer;
use powerinfer_gguf::GgufFile;

fn vocab_dir() -> Option<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut candidates: Vec<PathBuf> = std::env::var_os("POWERINFER_TESTDATA")
        .map(|d| PathBuf::from(d).join("vocab"))
        .into_iter()
        .collect();
    candidates.push(root.join("../shared/testdata/vocab"));
    candidates.push(root.join("shared/testdata/vocab"));
    candidates.into_iter().find(|d| d.is_dir())
}

fn bench(c: &mut Criterion) {
    let Some(dir) = vocab_dir() else {
        eprintln!("skipped: shared/testdata/vocab not found");
        return;
    };
    let inp =
        std::fs::read_to_string(dir.join("ggml-vocab-llama-spm.gguf.inp")).expect("read .inp");
    let sample = inp.replace("\n__ggml_vocab_test__\n", "\n");
    let text_of = |len: usize| {
        let mut t = String::with_capacity(len + sample.len());
        while t.len() < len {
            t.push_str(&sample);
        }
        t
    };
    for name in ["llama-spm", "falcon", "gpt-2"] {
        let file = GgufFile::open(dir.join(format!("ggml-vocab-{name}.gguf"))).expect("open vocab");
        let tok = Tokenizer::from_gguf(&file).expect("vocab");
        let mut g = c.benchmark_group(format!("encode/{name}"));
        g.sample_size(10);
        for len in [4 << 10, 64 << 10, 1 << 20] {
            let text = text_of(len);
            g.throughput(Throughput::Bytes(text.len() as u64));
            g.bench_with_input(BenchmarkId::from_parameter(len), &text, |b, t| {
                b.iter(|| tok.encode(black_box(t), true, false))
            });
        }
        g.finish();
        let text = text_of(64 << 10);
        let ids = tok.encode(&text, true, false);
        let mut g = c.benchmark_group(format!("decode/{name}"));
        g.throughput(Throughput::Bytes(text.len() as u64));
        g.bench_function("65536", |b| {
            b.iter(|| tok.decode(black_box(&ids), true, false))
        });
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
