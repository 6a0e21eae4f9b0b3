//! The real llama.cpp vocabulary files in shared/testdata/vocab open and list their metadata.

use powerinfer_gguf::{FileKind, GgufFile};
use std::path::PathBuf;

/// `$POWERINFER_TESTDATA/vocab/NAME`, else `shared/testdata/vocab/NAME` beside or inside the
/// repository (the convention of the engine's tokenizer tests). Missing: fail in CI, else skip.
fn vocab(name: &str) -> Option<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(dir) = std::env::var_os("POWERINFER_TESTDATA") {
        candidates.push(PathBuf::from(dir).join("vocab"));
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    candidates.push(root.join("../shared/testdata/vocab"));
    candidates.push(root.join("shared/testdata/vocab"));
    if let Some(p) = candidates
        .iter()
        .map(|d| d.join(name))
        .find(|p| p.is_file())
    {
        return Some(p);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "testdata vocab/{name} not found (set POWERINFER_TESTDATA)"
    );
    println!("skipped: testdata vocab/{name} not found");
    None
}

#[test]
fn llama_cpp_vocab_files_open() {
    for (file, model, n_tokens, has_merges) in [
        ("ggml-vocab-llama-spm.gguf", "llama", 32000, false),
        ("ggml-vocab-falcon.gguf", "gpt2", 65024, true),
        ("ggml-vocab-gpt-2.gguf", "gpt2", 50257, true),
    ] {
        let Some(path) = vocab(file) else { continue };
        let f = GgufFile::open(&path).unwrap();
        assert_eq!(f.kind(), FileKind::Gguf);
        assert_eq!(f.version(), 3);
        let md = f.metadata();
        assert_eq!(md.get_str("tokenizer.ggml.model").unwrap(), model, "{file}");
        let tokens = md.get_string_array("tokenizer.ggml.tokens").unwrap();
        assert_eq!(tokens.len(), n_tokens, "{file}");
        assert_eq!(
            md.get_string_array("tokenizer.ggml.merges").is_ok(),
            has_merges,
            "{file}"
        );
        assert!(md.get_uint("tokenizer.ggml.bos_token_id").is_ok(), "{file}");
        if model == "llama" {
            assert_eq!(tokens[0], "<unk>");
            assert_eq!(tokens[13], "<0x0A>");
            assert_eq!(
                md.get_f32_array("tokenizer.ggml.scores").unwrap().len(),
                n_tokens
            );
            assert_eq!(
                md.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
                n_tokens
            );
        }
    }
}
