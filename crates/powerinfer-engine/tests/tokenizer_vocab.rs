//! Conformance with llama.cpp: the vocabulary files and test vectors of `shared/testdata/vocab`
//! (llama.cpp's `models/ggml-vocab-*.gguf{,.inp,.out}`). Each `.inp` holds test strings, each
//! followed by a line `__ggml_vocab_test__`; line `i` of `.out` holds the ids llama.cpp
//! produces for string `i` (no BOS, special tokens not parsed), each preceded by a space.
//!
//! The data directory is `$POWERINFER_TESTDATA/vocab` if set, else `shared/testdata/vocab`
//! beside or inside the repository. Without it the tests fail under CI and skip otherwise.

mod common;

use common::vocab_dir;
use powerinfer_engine::tokenizer::{
    PreTokenizer, TokenType, Tokenizer, TokenizerError, TokenizerModel,
};
use powerinfer_gguf::GgufFile;

const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

struct Case {
    text: String,
    expected: String,
}

fn load(name: &str) -> Option<(Tokenizer, Vec<Case>)> {
    let dir = vocab_dir()?;
    let path = dir.join(name);
    let file = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tok = Tokenizer::from_gguf(&file).unwrap_or_else(|e| panic!("{name}: {e}"));
    let inp = std::fs::read_to_string(dir.join(format!("{name}.inp"))).expect("read .inp");
    let out = std::fs::read_to_string(dir.join(format!("{name}.out"))).expect("read .out");
    // As llama.cpp's test-tokenizer-0 reads them: cut at each separator (whose first
    // newline ends the previous string); the text after the last separator is empty.
    let mut texts: Vec<&str> = inp.split(SEPARATOR).collect();
    assert_eq!(
        texts.pop(),
        Some(""),
        "{name}.inp must end with a separator line"
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        texts.len(),
        lines.len(),
        "{name}: .inp and .out disagree on the number of cases"
    );
    let cases = texts
        .into_iter()
        .zip(lines)
        .map(|(t, l)| Case {
            text: t.to_string(),
            expected: l.to_string(),
        })
        .collect();
    Some((tok, cases))
}

fn format_ids(ids: &[u32]) -> String {
    ids.iter().map(|id| format!(" {id}")).collect()
}

/// Encodes every case and compares with the `.out` line; returns the number of cases.
fn check_vectors(name: &str) -> Option<(Tokenizer, Vec<Case>)> {
    let (tok, cases) = load(name)?;
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let got = format_ids(&tok.encode(&case.text, false, false));
        if got != case.expected {
            failures.push(format!(
                "case {i} {:?}\n  expected:{}\n  got:     {}",
                case.text, case.expected, got
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    println!("{name}: {} of {} cases match", cases.len(), cases.len());
    Some((tok, cases))
}

/// The concatenated pieces of a text's tokens, streamed one token at a time.
fn stream_text(tok: &Tokenizer, ids: &[u32]) -> String {
    let mut dec = tok.stream_decoder(false);
    let mut s = String::new();
    for &id in ids {
        s.push_str(&dec.push(id).expect("id in range"));
    }
    s.push_str(&dec.finish());
    s
}

#[test]
fn llama_spm_vectors() {
    let Some((tok, cases)) = check_vectors("ggml-vocab-llama-spm.gguf") else {
        return;
    };
    assert_eq!(cases.len(), 46);
    assert_eq!(tok.vocab().model, TokenizerModel::Spm);
    assert_eq!(tok.n_tokens(), 32000);
    for case in &cases {
        let ids = tok.encode(&case.text, false, false);
        // The pieces reproduce the text after the space prefix (byte fallback included) ...
        if !case.text.is_empty() {
            assert_eq!(stream_text(&tok, &ids), format!(" {}", case.text));
        }
        // ... and decoding removes the prefix again.
        assert_eq!(
            tok.decode(&ids, false, false).unwrap(),
            case.text.as_bytes()
        );
        // With BOS: the same ids after id 1; decoding drops BOS and keeps the first space, as
        // llama.cpp does.
        let with_bos = tok.encode(&case.text, true, false);
        assert_eq!(with_bos[0], 1);
        assert_eq!(&with_bos[1..], &ids[..]);
        if !case.text.is_empty() {
            assert_eq!(
                tok.decode(&with_bos, true, false).unwrap(),
                format!(" {}", case.text).as_bytes()
            );
        }
    }
}

#[test]
fn falcon_vectors() {
    let Some((tok, cases)) = check_vectors("ggml-vocab-falcon.gguf") else {
        return;
    };
    assert_eq!(cases.len(), 46);
    assert_eq!(tok.pre_tokenizer(), Some(PreTokenizer::Falcon));
    for case in &cases {
        let ids = tok.encode(&case.text, false, false);
        assert_eq!(stream_text(&tok, &ids), case.text);
    }
}

#[test]
fn gpt2_vectors() {
    let Some((tok, cases)) = check_vectors("ggml-vocab-gpt-2.gguf") else {
        return;
    };
    assert_eq!(cases.len(), 46);
    assert_eq!(tok.pre_tokenizer(), Some(PreTokenizer::Gpt2));
    for case in &cases {
        let ids = tok.encode(&case.text, false, false);
        assert_eq!(stream_text(&tok, &ids), case.text);
    }
}

#[test]
fn special_tokens_and_bos_eos_rules() {
    let Some((spm, _)) = load("ggml-vocab-llama-spm.gguf") else {
        return;
    };
    let v = spm.vocab();
    assert!(v.add_bos && !v.add_eos && v.add_space_prefix);
    assert_eq!(
        (spm.bos(), spm.eos(), spm.special().unk),
        (Some(1), Some(2), Some(0))
    );
    assert_eq!(spm.token_type(1), Some(TokenType::Control));
    assert!(spm.is_eog(2) && !spm.is_eog(1));
    // Control tokens are text unless parse_special; after a special token the SPM space
    // prefix is added again.
    let hello = spm.encode("Hello", false, false);
    assert_eq!(hello, [15043]);
    let parsed = spm.encode("<s>Hello</s>", false, true);
    assert_eq!(parsed, [1, 15043, 2]);
    let unparsed = spm.encode("<s>Hello", false, false);
    assert!(!unparsed.contains(&1), "{unparsed:?}");
    // Control tokens decode to nothing unless asked for. The space-prefix removal applies to
    // the first token even when that is a BOS that decodes to nothing (llama.cpp does so).
    assert_eq!(spm.decode(&parsed, false, false).unwrap(), b" Hello");
    assert_eq!(spm.decode(&hello, false, false).unwrap(), b"Hello");
    assert_eq!(spm.decode(&parsed, false, true).unwrap(), b"<s> Hello</s>");
    // Byte fallback: a char missing from the vocabulary becomes its UTF-8 bytes.
    let ids = spm.encode("\u{1F999}", false, false);
    assert_eq!(ids, [29871, 243, 162, 169, 156]);
    assert_eq!(
        spm.decode(&ids, false, false).unwrap(),
        "\u{1F999}".as_bytes()
    );
    // Out-of-range ids are errors, not panics.
    assert!(spm.decode(&[32000], false, false).is_err());
    assert!(spm.token_to_piece(u32::MAX, true).is_err());

    let Some((gpt2, _)) = load("ggml-vocab-gpt-2.gguf") else {
        return;
    };
    let v = gpt2.vocab();
    assert!(!v.add_bos && !v.add_eos && !v.add_space_prefix);
    assert_eq!(gpt2.encode("Hello", true, false), [15496]);
    assert_eq!(
        gpt2.encode("Hello<|endoftext|>", false, true),
        [15496, 50256]
    );
    assert_ne!(gpt2.encode("<|endoftext|>", false, false), [50256]);
    assert!(gpt2.is_eog(50256));
    // BPE decoding cleans up spaces before punctuation, as llama.cpp does.
    let ids = gpt2.encode("Hello , world !", false, false);
    assert_eq!(gpt2.decode(&ids, false, false).unwrap(), b"Hello, world!");
}

#[test]
fn long_inputs_round_trip() {
    let Some((spm, cases)) = load("ggml-vocab-llama-spm.gguf") else {
        return;
    };
    let Some((falcon, _)) = load("ggml-vocab-falcon.gguf") else {
        return;
    };
    // A long text built from all test strings, plus long runs that a quadratic merge loop
    // would choke on.
    let mut text: String = cases
        .iter()
        .map(|c| c.text.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    text.push_str(&"a".repeat(20_000));
    text.push_str(&" ".repeat(5_000));
    text.push_str(&"3".repeat(5_000));
    let ids = spm.encode(&text, false, false);
    assert_eq!(spm.decode(&ids, false, false).unwrap(), text.as_bytes());
    let ids = falcon.encode(&text, false, false);
    assert_eq!(stream_text(&falcon, &ids), text);
}

mod roundtrip {
    use std::sync::OnceLock;

    use proptest::prelude::*;

    use super::*;

    fn tokenizers() -> Option<&'static [Tokenizer; 3]> {
        static TOKS: OnceLock<Option<[Tokenizer; 3]>> = OnceLock::new();
        TOKS.get_or_init(|| {
            Some([
                load("ggml-vocab-llama-spm.gguf")?.0,
                load("ggml-vocab-falcon.gguf")?.0,
                load("ggml-vocab-gpt-2.gguf")?.0,
            ])
        })
        .as_ref()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// Any text survives encoding: SPM decodes back to it (byte fallback covers every
        /// char), byte-level BPE's pieces concatenate to it.
        #[test]
        fn any_text_round_trips(text in "(\\PC|[ \t\n]){0,40}", parse_special in any::<bool>()) {
            let Some([spm, falcon, gpt2]) = tokenizers() else { return Ok(()) };
            // SPM writes spaces as U+2581 and decodes U+2581 as a space.
            prop_assume!(!text.contains('\u{2581}'));
            // Control-token texts would legitimately become control tokens with
            // parse_special; the generator cannot produce them anyway ("<s>" needs '<').
            let ids = spm.encode(&text, false, parse_special);
            prop_assert_eq!(spm.decode(&ids, false, true).unwrap(), text.as_bytes());
            for bpe in [falcon, gpt2] {
                let ids = bpe.encode(&text, false, parse_special);
                prop_assert_eq!(stream_text(bpe, &ids), text.clone());
            }
        }
    }
}

/// Every `X.gguf` with `X.gguf.inp` and `X.gguf.out` in the data directory whose tokenizer
/// this crate implements must match; the others are listed as skipped. (Point
/// `POWERINFER_TESTDATA` at a directory with llama.cpp's full `models/` set to check more.)
#[test]
fn every_supported_vocab_in_the_data_dir() {
    let Some(dir) = vocab_dir() else {
        return;
    };
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("list vocab dir")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n.ends_with(".gguf")
                && dir.join(format!("{n}.inp")).is_file()
                && dir.join(format!("{n}.out")).is_file()
        })
        .collect();
    names.sort();
    let mut checked = 0;
    for name in &names {
        let file = GgufFile::open(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        match Tokenizer::from_gguf(&file) {
            Ok(_) => {
                check_vectors(name);
                checked += 1;
            }
            Err(
                e @ (TokenizerError::UnsupportedModel(_)
                | TokenizerError::UnsupportedPreTokenizer(_)),
            ) => {
                println!("{name}: skipped: {e}");
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    assert!(
        checked >= 3,
        "expected at least the three vocabularies of shared/testdata"
    );
}
