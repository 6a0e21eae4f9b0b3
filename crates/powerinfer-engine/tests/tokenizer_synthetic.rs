//! Tokenizers built from small hand-made vocabularies: metadata defaults and errors, special
//! token matching, SPM merge order, BPE merge ranks, decoding.

use powerinfer_engine::tokenizer::{
    keys, TokenType, Tokenizer, TokenizerError, TokenizerModel, Vocab,
};
use powerinfer_gguf::{Array, Metadata, Value};

fn strings(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().map(|s| s.to_string()).collect()))
}

/// An SPM vocabulary: `<unk> <s> </s>`, the 256 byte tokens, then `pieces` with scores.
fn spm_metadata(pieces: &[(&str, f32)], types: &[(usize, i32)]) -> Metadata {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut scores = vec![0.0f32; 3];
    let mut tt = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        tt.push(6);
    }
    for (p, s) in pieces {
        tokens.push(p.to_string());
        scores.push(*s);
        tt.push(1);
    }
    for &(i, t) in types {
        tt[i] = t;
    }
    let mut md = Metadata::new();
    md.insert(keys::MODEL, Value::String("llama".into()));
    md.insert(keys::TOKENS, Value::Array(Array::String(tokens)));
    md.insert(keys::SCORES, Value::Array(Array::F32(scores)));
    md.insert(keys::TOKEN_TYPE, Value::Array(Array::I32(tt)));
    md
}

const N_BASE: u32 = 3 + 256;

#[test]
fn spm_defaults_and_merge_order() {
    // "▁ab" can form as "▁a"+"b" or "▁"+"ab"; the highest-scoring merge goes first.
    let pieces = [
        ("▁", -1.0),
        ("a", -1.0),
        ("b", -1.0),
        ("▁a", -5.0),
        ("ab", -2.0),
        ("▁ab", -3.0),
    ];
    let md = spm_metadata(&pieces, &[]);
    let tok = Tokenizer::new(Vocab::from_metadata(&md).unwrap()).unwrap();
    let v = tok.vocab();
    assert_eq!(v.model, TokenizerModel::Spm);
    assert_eq!(
        (v.special.bos, v.special.eos, v.special.unk),
        (Some(1), Some(2), Some(0))
    );
    assert!(v.add_bos && !v.add_eos && v.add_space_prefix);
    let id = |t: &str| tok.token_id(t).unwrap();
    // "ab" (-2) merges before "▁a" (-5); then "▁"+"ab" = "▁ab".
    assert_eq!(tok.encode("ab", false, false), [id("▁ab")]);
    assert_eq!(tok.encode("ab", true, false), [1, id("▁ab")]);
    // "ba": no merge; "▁" and the chars as tokens.
    assert_eq!(tok.encode("ba", false, false), [id("▁"), id("b"), id("a")]);
    // "c" is not a token: byte fallback.
    assert_eq!(
        tok.encode("c", false, false),
        [id("▁"), 3 + u32::from(b'c')]
    );
    assert_eq!(
        tok.decode(&tok.encode("c ab", false, false), false, false)
            .unwrap(),
        b"c ab"
    );
    // Ties in score merge the leftmost pair first: "aaa" -> "aa" + "a".
    let md = spm_metadata(&[("a", -1.0), ("aa", -1.0)], &[]);
    let mut md = md;
    md.insert(keys::ADD_SPACE_PREFIX, Value::Bool(false));
    let tok = Tokenizer::new(Vocab::from_metadata(&md).unwrap()).unwrap();
    assert_eq!(tok.encode("aaa", false, false), [N_BASE + 1, N_BASE]);
    assert_eq!(
        tok.decode(&[N_BASE + 1, N_BASE], false, false).unwrap(),
        b"aaa"
    );
}

#[test]
fn user_defined_tokens_are_matched_even_without_parse_special() {
    let pieces = [
        ("▁", -1.0),
        ("x", -1.0),
        ("<tool>", 0.0),
        ("<tool_call>", 0.0),
    ];
    let ud = N_BASE as usize + 2;
    let md = spm_metadata(&pieces, &[(ud, 4), (ud + 1, 4)]);
    let tok = Tokenizer::new(Vocab::from_metadata(&md).unwrap()).unwrap();
    assert_eq!(tok.token_type(ud as u32), Some(TokenType::UserDefined));
    let (x, sp, tool, call) = (N_BASE + 1, N_BASE, ud as u32, ud as u32 + 1);
    // The longest user-defined token wins; text after a special token gets a space prefix.
    assert_eq!(
        tok.encode("x<tool_call>x<tool>", false, false),
        [sp, x, call, sp, x, tool]
    );
    // Control tokens only with parse_special.
    assert_eq!(tok.encode("</s>x", false, true), [2, sp, x]);
    assert_ne!(tok.encode("</s>x", false, false)[0], 2);
    // User-defined tokens decode to their text with or without `special`.
    assert_eq!(tok.decode(&[call], false, false).unwrap(), b"<tool_call>");
}

#[test]
fn metadata_errors_are_typed() {
    let md = spm_metadata(&[("▁", 0.0)], &[]);

    let mut bad = md.clone();
    bad.insert(keys::MODEL, Value::String("t5".into()));
    assert!(
        matches!(Vocab::from_metadata(&bad), Err(TokenizerError::UnsupportedModel(m)) if m == "t5")
    );

    let mut bad = md.clone();
    bad.insert(keys::SCORES, Value::Array(Array::F32(vec![0.0; 3])));
    assert!(matches!(
        Vocab::from_metadata(&bad),
        Err(TokenizerError::LengthMismatch {
            key: keys::SCORES,
            found: 3,
            ..
        })
    ));

    let mut bad = md.clone();
    bad.insert(keys::SCORES, Value::Array(Array::String(vec![])));
    assert!(matches!(
        Vocab::from_metadata(&bad),
        Err(TokenizerError::Metadata(_))
    ));

    let mut bad = Metadata::new();
    bad.insert(keys::MODEL, Value::String("llama".into()));
    assert!(matches!(
        Vocab::from_metadata(&bad),
        Err(TokenizerError::Metadata(_))
    ));

    let mut bad = md.clone();
    bad.insert(keys::ADD_BOS, Value::U32(1));
    assert!(matches!(
        Vocab::from_metadata(&bad),
        Err(TokenizerError::Metadata(_))
    ));

    // Integer scores are accepted; ids beyond the vocabulary keep the default.
    let mut ok = md.clone();
    let n = ok.get_string_array(keys::TOKENS).unwrap().len();
    ok.insert(keys::SCORES, Value::Array(Array::I32(vec![-1; n])));
    ok.insert(keys::BOS_ID, Value::U32(1_000_000));
    ok.insert(keys::EOS_ID, Value::I32(1));
    let v = Vocab::from_metadata(&ok).unwrap();
    assert_eq!(v.scores[0], -1.0);
    assert_eq!((v.special.bos, v.special.eos), (Some(1), Some(1)));

    // Duplicate texts.
    let mut dup = Vocab::from_metadata(&md).unwrap();
    dup.tokens[5] = dup.tokens[4].clone();
    assert!(matches!(
        Tokenizer::new(dup),
        Err(TokenizerError::DuplicateToken {
            first: 4,
            second: 5,
            ..
        })
    ));

    // Special ids outside the vocabulary.
    let mut far = Vocab::from_metadata(&md).unwrap();
    far.special.eot = Some(1 << 20);
    assert!(matches!(
        Tokenizer::new(far),
        Err(TokenizerError::TokenOutOfRange { id: 1048576, .. })
    ));

    // add_bos without a BOS token.
    let mut nobos = Vocab::from_metadata(&md).unwrap();
    nobos.special.bos = None;
    assert!(matches!(
        Tokenizer::new(nobos),
        Err(TokenizerError::MissingSpecialToken { .. })
    ));
}

/// A byte-level BPE vocabulary over "Ġ", "a", "b", "c" with merges `merges`.
fn bpe_metadata(pre: Option<&str>, merges: &[&str]) -> Metadata {
    let mut tokens: Vec<String> = ["<|endoftext|>", "Ġ", "a", "b", "c", "!"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let mut tt = vec![1; tokens.len()];
    tt[0] = 3;
    let mut md = Metadata::new();
    md.insert(keys::MODEL, Value::String("gpt2".into()));
    if let Some(p) = pre {
        md.insert(keys::PRE, Value::String(p.into()));
    }
    md.insert(keys::TOKENS, Value::Array(Array::String(tokens)));
    md.insert(keys::TOKEN_TYPE, Value::Array(Array::I32(tt)));
    md.insert(keys::MERGES, strings(merges));
    md.insert(keys::BOS_ID, Value::U32(0));
    md.insert(keys::EOS_ID, Value::U32(0));
    md
}

#[test]
fn bpe_merges_by_rank() {
    // Ranks: "b c" first, then "a b" (stale once "bc" exists), then "a bc".
    let md = bpe_metadata(Some("gpt-2"), &["b c", "a b", "a bc", "Ġ abc"]);
    let tok = Tokenizer::new(Vocab::from_metadata(&md).unwrap()).unwrap();
    let v = tok.vocab();
    assert!(!v.add_bos && !v.add_eos && !v.add_space_prefix);
    let id = |t: &str| tok.token_id(t).unwrap();
    assert_eq!(tok.encode("abc", true, false), [id("abc")]);
    assert_eq!(tok.encode("ab", false, false), [id("ab")]);
    assert_eq!(
        tok.encode(" abc abc!", false, false),
        [id("Ġabc"), id("Ġabc"), id("!")]
    );
    // "d" has no token at all: dropped, as llama.cpp does.
    assert_eq!(tok.encode("d", false, false), Vec::<u32>::new());
    assert_eq!(
        tok.decode(&[id("Ġabc"), id("!")], false, false).unwrap(),
        b" abc!"
    );
    // Missing merges and unknown pre-tokenizers are errors.
    let mut bad = md.clone();
    bad.insert(keys::PRE, Value::String("deepseek-coder".into()));
    let v = Vocab::from_metadata(&bad).unwrap();
    assert!(
        matches!(Tokenizer::new(v), Err(TokenizerError::UnsupportedPreTokenizer(p)) if p == "deepseek-coder")
    );
    let mut nomerges = bpe_metadata(None, &[]);
    nomerges.insert(keys::MERGES, Value::U32(0));
    assert!(Vocab::from_metadata(&nomerges).is_err());
}

#[test]
fn stream_decoder_holds_back_split_chars() {
    let md = spm_metadata(&[("▁", 0.0)], &[]);
    let mut md = md;
    md.insert(keys::ADD_SPACE_PREFIX, Value::Bool(false));
    let tok = Tokenizer::new(Vocab::from_metadata(&md).unwrap()).unwrap();
    let ids = tok.encode("é!", false, false); // two byte tokens for "é", one for "!"
    assert_eq!(ids, [3 + 0xC3, 3 + 0xA9, 3 + u32::from(b'!')]);
    let mut dec = tok.stream_decoder(false);
    assert_eq!(dec.push(ids[0]).unwrap(), "");
    assert!(dec.has_pending());
    assert_eq!(dec.push(ids[1]).unwrap(), "é");
    assert_eq!(dec.push(ids[2]).unwrap(), "!");
    assert_eq!(dec.finish(), "");
    // A stray continuation byte becomes U+FFFD; an unfinished char at the end too.
    let mut dec = tok.stream_decoder(false);
    assert_eq!(dec.push(3 + 0xA9).unwrap(), "\u{FFFD}");
    assert_eq!(dec.push(3 + 0xC3).unwrap(), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
    // Control tokens only with `special`.
    let mut dec = tok.stream_decoder(true);
    assert_eq!(dec.push(1).unwrap(), "<s>");
    assert!(tok.stream_decoder(false).push(9999).is_err());
}
