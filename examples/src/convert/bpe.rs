//! A Hugging Face `tokenizer.json` reader for byte-level BPE vocabularies (Falcon, OPT), giving
//! the `tokenizer.ggml.*` arrays PowerInfer's `convert-hf-to-powerinfer-gguf.py` writes with
//! `tokenizer.ggml.model = "gpt2"` (its `_set_vocab_gpt2`, which reads the vocabulary through
//! `transformers`' fast tokenizer; here the JSON is read directly).
//!
//! - **Tokens**: ids `0..vocab_size` (config.json's `vocab_size`). An id that `model.vocab`
//!   and `added_tokens` both lack is written `[PAD{id}]` (user-defined); an id of
//!   `added_tokens` takes that entry's content (control when `special` is true, else
//!   user-defined); every other id is `model.vocab`'s token (normal). An id at or above
//!   `vocab_size` is an error, as the script's assertion makes it.
//! - **Merges**: `model.merges`, each `"left right"`. Newer `tokenizer.json` files store each
//!   merge as a two-element array, which is joined with a space here (gguf-py's `SpecialVocab`
//!   of PowerInfer's snapshot only takes the string form, and would write no merges for
//!   these); when `tokenizer.json` has no merges, `merges.txt` in the same folder is read (as
//!   `SpecialVocab` falls back to it).
//! - Refused: a `model.type` other than `BPE`, and a BPE without a `ByteLevel` pre-tokenizer
//!   or decoder (a SentencePiece-style BPE, which the `gpt2` tokenizer would split wrongly).

use std::collections::HashMap;

use serde_json::Value;

use super::spm::{TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED};

/// A byte-level BPE vocabulary as PowerInfer's HF script writes it (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpeVocab {
    /// Token texts by id (GPT-2's byte-to-unicode alphabet), `vocab_size` of them.
    pub tokens: Vec<String>,
    /// GGUF token types by id: normal 1, control 3, user-defined 4.
    pub token_types: Vec<i32>,
    /// Merges in rank order, each `"left right"`; empty when `tokenizer.json` has none (then
    /// [`BpeVocab::set_merges_txt`] may supply them).
    pub merges: Vec<String>,
}

fn id_of(v: &Value, what: &str) -> Result<usize, String> {
    v.as_u64()
        .and_then(|i| usize::try_from(i).ok())
        .ok_or_else(|| format!("{what}: id {v} is not a non-negative integer"))
}

/// Whether a pre-tokenizer or decoder description is (or contains) `ByteLevel`.
fn has_byte_level(v: Option<&Value>) -> bool {
    let Some(v) = v else { return false };
    if v.get("type").and_then(Value::as_str) == Some("ByteLevel") {
        return true;
    }
    ["pretokenizers", "decoders"].iter().any(|k| {
        v.get(*k)
            .and_then(Value::as_array)
            .is_some_and(|a| a.iter().any(|x| has_byte_level(Some(x))))
    })
}

impl BpeVocab {
    /// Reads `tokenizer.json` text for a model of `n_vocab` tokens. The error names the
    /// offending field.
    pub fn from_tokenizer_json(text: &str, n_vocab: usize) -> Result<BpeVocab, String> {
        let json: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        let model = json
            .get("model")
            .filter(|m| m.is_object())
            .ok_or("no model object")?;
        match model.get("type").and_then(Value::as_str) {
            Some("BPE") => {}
            Some(t) => {
                return Err(format!(
                    "model.type is {t:?}: only byte-level BPE tokenizers are supported"
                ))
            }
            None => {
                return Err(
                    "model.type is missing: only byte-level BPE tokenizers are supported".into(),
                )
            }
        }
        if !has_byte_level(json.get("pre_tokenizer")) && !has_byte_level(json.get("decoder")) {
            return Err(
                "a BPE without a ByteLevel pre-tokenizer or decoder (SentencePiece-style) is \
                 not supported: only byte-level BPE vocabularies are"
                    .into(),
            );
        }
        let vocab = model
            .get("vocab")
            .and_then(Value::as_object)
            .ok_or("model.vocab is not an object")?;
        // id -> (text, added, special)
        let mut by_id: HashMap<usize, (&str, bool, bool)> = HashMap::new();
        for (text, id) in vocab {
            let id = id_of(id, &format!("model.vocab {text:?}"))?;
            by_id.insert(id, (text.as_str(), false, false));
        }
        match json.get("added_tokens") {
            None | Some(Value::Null) => {}
            Some(Value::Array(added)) => {
                for (i, t) in added.iter().enumerate() {
                    let what = format!("added_tokens[{i}]");
                    let id = id_of(t.get("id").unwrap_or(&Value::Null), &what)?;
                    let content = t
                        .get("content")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("{what}: content is not a string"))?;
                    let special = match t.get("special") {
                        None | Some(Value::Null) => false,
                        Some(s) => s
                            .as_bool()
                            .ok_or_else(|| format!("{what}: special is not true or false"))?,
                    };
                    by_id.insert(id, (content, true, special));
                }
            }
            Some(_) => return Err("added_tokens is not a list".into()),
        }
        if let Some((&id, (text, ..))) = by_id.iter().max_by_key(|(id, _)| **id) {
            if id >= n_vocab {
                return Err(format!(
                    "token {text:?} has id {id}, not below config.json's vocab_size {n_vocab}"
                ));
            }
        }
        let mut tokens = Vec::with_capacity(n_vocab);
        let mut token_types = Vec::with_capacity(n_vocab);
        for i in 0..n_vocab {
            let (text, ty) = match by_id.get(&i) {
                None => (format!("[PAD{i}]"), TOKEN_USER_DEFINED),
                Some(&(t, true, true)) => (t.to_string(), TOKEN_CONTROL),
                Some(&(t, true, false)) => (t.to_string(), TOKEN_USER_DEFINED),
                Some(&(t, false, _)) => (t.to_string(), TOKEN_NORMAL),
            };
            tokens.push(text);
            token_types.push(ty);
        }
        let merges = match model.get("merges") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(m)) => m
                .iter()
                .enumerate()
                .map(|(i, m)| merge_of(i, m))
                .collect::<Result<_, _>>()?,
            Some(_) => return Err("model.merges is not a list".into()),
        };
        Ok(BpeVocab {
            tokens,
            token_types,
            merges,
        })
    }

    /// Takes the merges from `merges.txt` text as gguf-py's `SpecialVocab` reads it: an
    /// optional first line starting with `#` skipped, blank lines skipped, every other line
    /// two whitespace-separated parts (a line of another shape is an error here, where
    /// `SpecialVocab` warns and skips it).
    pub fn set_merges_txt(&mut self, text: &str) -> Result<(), String> {
        let mut merges = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || (i == 0 && line.starts_with('#')) {
                continue;
            }
            let parts: Vec<&str> = line.split_whitespace().collect();
            if parts.len() != 2 {
                return Err(format!("line {}: {line:?} is not two parts", i + 1));
            }
            merges.push(format!("{} {}", parts[0], parts[1]));
        }
        self.merges = merges;
        Ok(())
    }
}

/// One `model.merges` entry as `"left right"`.
fn merge_of(i: usize, m: &Value) -> Result<String, String> {
    match m {
        Value::String(s) => Ok(s.clone()),
        Value::Array(pair) => match pair.as_slice() {
            [Value::String(a), Value::String(b)] => {
                if a.contains(' ') || b.contains(' ') {
                    Err(format!(
                        "model.merges[{i}]: [{a:?}, {b:?}] holds a space, which the \
                         \"left right\" form of GGUF merges cannot"
                    ))
                } else {
                    Ok(format!("{a} {b}"))
                }
            }
            _ => Err(format!("model.merges[{i}] is not a pair of strings")),
        },
        _ => Err(format!(
            "model.merges[{i}] is neither a string nor a pair of strings"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BYTE_LEVEL: &str = r#""pre_tokenizer":{"type":"ByteLevel"}"#;

    #[test]
    fn tokens_types_and_merges() {
        let text = format!(
            r#"{{{BYTE_LEVEL},"added_tokens":[{{"id":0,"content":"<s>","special":true}},
            {{"id":5,"content":"<user>","special":false}}],
            "model":{{"type":"BPE","vocab":{{"<s>":0,"a":1,"b":2,"ab":3}},"merges":["a b"]}}}}"#
        );
        let v = BpeVocab::from_tokenizer_json(&text, 7).unwrap();
        assert_eq!(
            v.tokens,
            ["<s>", "a", "b", "ab", "[PAD4]", "<user>", "[PAD6]"]
        );
        assert_eq!(v.token_types, [3, 1, 1, 1, 4, 4, 4]);
        assert_eq!(v.merges, ["a b"]);
        // Pairs, as newer tokenizer.json files write them.
        let pairs = text.replace(r#"["a b"]"#, r#"[["a","b"],["ab","b"]]"#);
        let v = BpeVocab::from_tokenizer_json(&pairs, 7).unwrap();
        assert_eq!(v.merges, ["a b", "ab b"]);
        let spaced = text.replace(r#"["a b"]"#, r#"[["a c","b"]]"#);
        assert!(BpeVocab::from_tokenizer_json(&spaced, 7)
            .unwrap_err()
            .contains("model.merges[0]"));
        // An id past vocab_size.
        assert!(BpeVocab::from_tokenizer_json(&text, 5)
            .unwrap_err()
            .contains("<user>"));
        // merges.txt.
        let mut v =
            BpeVocab::from_tokenizer_json(&text.replace(r#","merges":["a b"]"#, ""), 7).unwrap();
        assert!(v.merges.is_empty());
        v.set_merges_txt("#version: 0.2\na b\n\nab b\n").unwrap();
        assert_eq!(v.merges, ["a b", "ab b"]);
        assert!(v.set_merges_txt("a b c\n").unwrap_err().contains("line 1"));
    }

    #[test]
    fn refuses_other_models() {
        let uni = format!(r#"{{{BYTE_LEVEL},"model":{{"type":"Unigram","vocab":[]}}}}"#);
        assert!(BpeVocab::from_tokenizer_json(&uni, 3)
            .unwrap_err()
            .contains("\"Unigram\""));
        let spm = r#"{"model":{"type":"BPE","vocab":{},"merges":[],"byte_fallback":true},
            "decoder":{"type":"Sequence","decoders":[{"type":"ByteFallback"}]}}"#;
        assert!(BpeVocab::from_tokenizer_json(spm, 3)
            .unwrap_err()
            .contains("ByteLevel"));
        let nested = r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[]},
            "pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Digits"},{"type":"ByteLevel"}]}}"#;
        assert!(BpeVocab::from_tokenizer_json(nested, 1).is_ok());
        assert!(BpeVocab::from_tokenizer_json("[1", 1)
            .unwrap_err()
            .contains("not JSON"));
    }
}
