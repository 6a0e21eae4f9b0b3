//! Helpers of the engine's integration tests: where llama.cpp's vocabularies are, and the
//! hostile mutations of a file's contents (`hostile.rs`, which the command's hostile-model
//! test includes too). Tests that need a model file are the command's package's
//! (`examples/tests/engine*.rs`): the synthetic generator is the command's.
#![allow(dead_code)]

pub mod hostile;

use std::path::PathBuf;

/// llama.cpp's vocabulary files and test vectors (`shared/testdata/vocab`): the directory
/// `$POWERINFER_TESTDATA/vocab` if set, else `shared/testdata/vocab` beside or inside the
/// repository. Without it, tests fail under CI (`CI` set) and skip otherwise (`None`).
pub fn vocab_dir() -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("POWERINFER_TESTDATA") {
        candidates.push(PathBuf::from(dir).join("vocab"));
    }
    // `shared/` inside or beside the repository.
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    candidates.extend(here.ancestors().map(|d| d.join("shared/testdata/vocab")));
    if let Some(dir) = candidates
        .into_iter()
        .find(|d| d.join("ggml-vocab-gpt-2.gguf").is_file())
    {
        return Some(dir);
    }
    if std::env::var_os("CI").is_some() {
        panic!("shared/testdata/vocab not found (set POWERINFER_TESTDATA)");
    }
    println!("skipped: shared/testdata/vocab not found");
    None
}
