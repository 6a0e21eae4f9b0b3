//! The vocabulary of a synthetic model: copied from a GGUF file, or built in.
//!
//! The built-in one is a SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`, the
//! tokenizer LLaMA-2 models use and `powerinfer_engine::tokenizer` reads): `<unk>`, `<s>`, `</s>`, the
//! 256 byte tokens `<0x00>`..`<0xFF>` (byte fallback, so every text encodes), then text
//! pieces (`▁`, printable ASCII characters, `▁` + letter, letter pairs, `▁` + letter pair) with
//! descending scores, padded with unused `<extra_N>` tokens up to the requested size.

use powerinfer_gguf::{Array, GgufFile, Metadata, Value};

use super::SynthError;

/// Fewest tokens of the built-in vocabulary (the three specials and the 256 bytes).
pub const BUILTIN_MIN_TOKENS: usize = 3 + 256;

/// Token types as stored in `tokenizer.ggml.token_type`.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// The `tokenizer.ggml.*` metadata of the built-in vocabulary with `n` tokens.
pub fn builtin(n: usize) -> Result<Metadata, SynthError> {
    if n < BUILTIN_MIN_TOKENS {
        return Err(SynthError::Config(format!(
            "vocabulary of {n} tokens: the built-in one needs at least {BUILTIN_MIN_TOKENS}"
        )));
    }
    let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    let mut types = vec![UNKNOWN, CONTROL, CONTROL];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(BYTE);
    }
    let sp = '\u{2581}';
    let letters: Vec<char> = ('a'..='z').chain('A'..='Z').collect();
    let lower: Vec<char> = ('a'..='z').collect();
    let mut pieces: Vec<String> = vec![sp.to_string()];
    pieces.extend((0x21u8..0x7f).map(|b| char::from(b).to_string()));
    pieces.extend(letters.iter().map(|c| format!("{sp}{c}")));
    for &a in &lower {
        for &b in &lower {
            pieces.push(format!("{a}{b}"));
        }
    }
    for &a in &lower {
        for &b in &lower {
            pieces.push(format!("{sp}{a}{b}"));
        }
    }
    let mut scores = vec![0.0f32; tokens.len()];
    for (rank, p) in pieces.into_iter().enumerate() {
        if tokens.len() == n {
            break;
        }
        tokens.push(p);
        types.push(NORMAL);
        scores.push(-(rank as f32));
    }
    let mut extra = 0;
    while tokens.len() < n {
        tokens.push(format!("<extra_{extra}>"));
        types.push(UNUSED);
        scores.push(-1e9);
        extra += 1;
    }
    let mut md = Metadata::new();
    md.insert("tokenizer.ggml.model", Value::String("llama".into()));
    md.insert("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    md.insert("tokenizer.ggml.scores", Value::Array(Array::F32(scores)));
    md.insert("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    md.insert("tokenizer.ggml.bos_token_id", Value::U32(1));
    md.insert("tokenizer.ggml.eos_token_id", Value::U32(2));
    md.insert("tokenizer.ggml.unknown_token_id", Value::U32(0));
    md.insert("tokenizer.ggml.add_bos_token", Value::Bool(true));
    md.insert("tokenizer.ggml.add_eos_token", Value::Bool(false));
    Ok(md)
}

/// Every `tokenizer.*` key of `file`, in file order, and the number of tokens.
pub fn copy_from<B: AsRef<[u8]>>(file: &GgufFile<B>) -> Result<(Metadata, usize), SynthError> {
    let mut md = Metadata::new();
    for (k, v) in file.metadata().iter() {
        if k.starts_with("tokenizer.") {
            md.insert(k, v.clone());
        }
    }
    let n = match md.get("tokenizer.ggml.tokens") {
        Some(Value::Array(a)) if !a.is_empty() => a.len(),
        _ => {
            return Err(SynthError::Config(
                "the vocabulary file has no tokenizer.ggml.tokens array".into(),
            ))
        }
    };
    Ok((md, n))
}
