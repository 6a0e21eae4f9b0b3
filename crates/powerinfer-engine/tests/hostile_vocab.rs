//! llama.cpp's vocabulary files with hostile contents (keys of the wrong type or missing,
//! truncated arrays, special-token ids past the vocabulary): building the tokenizer, encoding
//! and decoding give a typed error or work; never panic. Seeded: `HOSTILE_VOCAB_CASES`
//! (default 300) mutations of the SentencePiece, GPT-2 and Falcon BPE vocabularies.

mod common;

use common::hostile::{mutate, panic_text, Rng};
use powerinfer_engine::tokenizer::Tokenizer;
use powerinfer_gguf::{GgufFile, GgufWriter};
use std::panic::{catch_unwind, AssertUnwindSafe};

#[test]
fn hostile_vocabularies_never_panic() {
    let cases: usize = std::env::var("HOSTILE_VOCAB_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let Some(vocab_dir) = common::vocab_dir() else {
        return;
    };
    let names = [
        "ggml-vocab-llama-spm",
        "ggml-vocab-gpt-2",
        "ggml-vocab-falcon",
    ];
    let mut sources = Vec::new();
    for n in names {
        let path = vocab_dir.join(format!("{n}.gguf"));
        let file = GgufFile::open(&path).unwrap();
        let text =
            std::fs::read_to_string(vocab_dir.join(format!("{n}.gguf.inp"))).unwrap_or_default();
        // The .inp file's test texts, separated by lines of `__ggml_vocab_test__`.
        let texts: Vec<String> = text
            .split("__ggml_vocab_test__")
            .map(|t| {
                t.trim_start_matches('\n')
                    .trim_end_matches('\n')
                    .to_string()
            })
            .take(40)
            .collect();
        sources.push((file.metadata().clone(), texts));
    }
    let (mut built, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for case in 0..cases {
        let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ (case as u64 + 1).wrapping_mul(0x9E37_79B9));
        let (md0, texts) = &sources[case % sources.len()];
        let mut md = md0.clone();
        let mut no_tensors = Vec::new();
        let what: Vec<String> = (0..1 + rng.below(2))
            .map(|_| mutate(&mut rng, &mut md, &mut no_tensors))
            .collect();
        // Through a real container: written and parsed back, as a file would be.
        let mut w = GgufWriter::new(Vec::new(), powerinfer_gguf::FileKind::Gguf);
        if w.add_metadata(&md).is_err() || w.write_header().is_err() {
            continue;
        }
        let Ok(bytes) = w.finish() else { continue };
        let file = GgufFile::from_bytes(bytes).unwrap();
        let run = || -> Result<(), String> {
            let tok = Tokenizer::from_gguf(&file).map_err(|e| e.to_string())?;
            for t in texts {
                let ids = tok.encode(t, true, rng.0 % 2 == 0);
                let _ = tok.decode(&ids, true, true);
                let _ = tok.decode_lossy(&ids, false, false);
                let mut dec = tok.stream_decoder(true);
                for &id in ids.iter().chain([u32::MAX, 7].iter()) {
                    let _ = dec.push(id);
                }
                let _ = dec.finish();
            }
            Ok(())
        };
        match catch_unwind(AssertUnwindSafe(run)) {
            Ok(Ok(())) => built += 1,
            Ok(Err(_)) => refused += 1,
            Err(p) => failures.push(format!(
                "case {case} ({what:?}): panic: {}",
                panic_text(&*p)
            )),
        }
    }
    eprintln!("{cases} cases: {built} tokenizers built, {refused} refused with an error");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(built > 0 && refused > 0, "{built} built, {refused} refused");
}
