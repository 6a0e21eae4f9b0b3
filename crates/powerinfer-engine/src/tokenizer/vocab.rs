//! [`Vocab`]: the tokenizer description stored in a GGUF file's `tokenizer.ggml.*` metadata.

use powerinfer_gguf::{Array, GgufFile, Metadata};

use super::error::{Result, TokenizerError};
use super::{PreTokenizer, TokenId};

/// Which algorithm turns text into tokens (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TokenizerModel {
    /// SentencePiece BPE with scores and byte fallback (`"llama"`): LLaMA-2, ReluLLaMA,
    /// ProSparse, Bamboo.
    Spm,
    /// Byte-level BPE with merges and a regex-style pre-tokenizer (`"gpt2"`): Falcon, OPT.
    Bpe,
}

impl TokenizerModel {
    /// The model with GGUF name `name`, or `None` for tokenizers this crate does not have.
    pub fn from_gguf_name(name: &str) -> Option<TokenizerModel> {
        match name {
            "llama" => Some(TokenizerModel::Spm),
            "gpt2" => Some(TokenizerModel::Bpe),
            _ => None,
        }
    }

    /// The GGUF name (`"llama"` or `"gpt2"`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            TokenizerModel::Spm => "llama",
            TokenizerModel::Bpe => "gpt2",
        }
    }
}

/// The kind of a token (`tokenizer.ggml.token_type`, values as stored in files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TokenType {
    /// 0, or any value outside 1..=6: never produced by the text splitters' special-token
    /// pass, decodes to nothing.
    Undefined,
    /// 1: an ordinary piece of text.
    Normal,
    /// 2: the unknown token (`<unk>`).
    Unknown,
    /// 3: a control token (`<s>`, `</s>`, `<|endoftext|>`); decoded only on request.
    Control,
    /// 4: a user-defined token, matched in text before anything else.
    UserDefined,
    /// 5: reserved, never produced and decoded to nothing.
    Unused,
    /// 6: a byte-fallback token `<0xXX>`.
    Byte,
}

impl TokenType {
    /// The type with file value `v`.
    pub fn from_i32(v: i32) -> TokenType {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// The value stored in files.
    pub fn to_i32(self) -> i32 {
        match self {
            TokenType::Undefined => 0,
            TokenType::Normal => 1,
            TokenType::Unknown => 2,
            TokenType::Control => 3,
            TokenType::UserDefined => 4,
            TokenType::Unused => 5,
            TokenType::Byte => 6,
        }
    }
}

/// Ids of the special tokens; `None` where the vocabulary has none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<TokenId>,
    /// End of sequence.
    pub eos: Option<TokenId>,
    /// End of turn (chat models).
    pub eot: Option<TokenId>,
    /// End of message (chat models with tool calls).
    pub eom: Option<TokenId>,
    /// Unknown piece.
    pub unk: Option<TokenId>,
    /// Separator.
    pub sep: Option<TokenId>,
    /// Padding.
    pub pad: Option<TokenId>,
}

/// A tokenizer's data, as stored in a GGUF file: the token list with scores and types, the BPE
/// merges, the special token ids and the BOS/EOS/space-prefix rules. Build a
/// [`Tokenizer`](super::Tokenizer) from it with [`Tokenizer::new`](super::Tokenizer::new).
///
/// The fields are resolved: defaults are applied (as llama.cpp applies them), `scores` and
/// `token_types` have one entry per token.
#[derive(Clone, Debug, PartialEq)]
pub struct Vocab {
    /// The algorithm.
    pub model: TokenizerModel,
    /// The BPE pre-tokenizer name (`tokenizer.ggml.pre`), if the file has one. SPM ignores it.
    pub pre: Option<String>,
    /// Token texts, indexed by id. SPM texts use U+2581 for spaces; BPE texts are in GPT-2's
    /// byte-to-unicode alphabet.
    pub tokens: Vec<String>,
    /// SPM merge scores (higher merges first), one per token; 0 where the file has none.
    pub scores: Vec<f32>,
    /// Token types, one per token; `Normal` where the file has none.
    pub token_types: Vec<TokenType>,
    /// BPE merges in rank order, each `"left right"`; empty for SPM.
    pub merges: Vec<String>,
    /// Special token ids.
    pub special: SpecialTokens,
    /// Whether encoding with `add_special` starts with BOS.
    pub add_bos: bool,
    /// Whether encoding with `add_special` ends with EOS.
    pub add_eos: bool,
    /// SPM: whether a space is put before the text (and before text after a special token),
    /// and removed again when decoding.
    pub add_space_prefix: bool,
}

/// Metadata keys read by [`Vocab::from_metadata`].
pub mod keys {
    /// Tokenizer algorithm (string).
    pub const MODEL: &str = "tokenizer.ggml.model";
    /// BPE pre-tokenizer name (string).
    pub const PRE: &str = "tokenizer.ggml.pre";
    /// Token texts (array of string).
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    /// Token scores (array of f32 or i32).
    pub const SCORES: &str = "tokenizer.ggml.scores";
    /// Token types (array of i32).
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    /// BPE merges (array of string).
    pub const MERGES: &str = "tokenizer.ggml.merges";
    /// BOS id.
    pub const BOS_ID: &str = "tokenizer.ggml.bos_token_id";
    /// EOS id.
    pub const EOS_ID: &str = "tokenizer.ggml.eos_token_id";
    /// EOT id.
    pub const EOT_ID: &str = "tokenizer.ggml.eot_token_id";
    /// EOM id.
    pub const EOM_ID: &str = "tokenizer.ggml.eom_token_id";
    /// Unknown-token id.
    pub const UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
    /// Separator id (the misspelling is the GGUF key).
    pub const SEP_ID: &str = "tokenizer.ggml.seperator_token_id";
    /// Padding id.
    pub const PAD_ID: &str = "tokenizer.ggml.padding_token_id";
    /// Whether to add BOS (bool).
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    /// Whether to add EOS (bool).
    pub const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
    /// SPM: whether to add a space prefix (bool).
    pub const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
}

impl Vocab {
    /// Reads the vocabulary of an open GGUF file.
    pub fn from_gguf<B: AsRef<[u8]>>(file: &GgufFile<B>) -> Result<Vocab> {
        Vocab::from_metadata(file.metadata())
    }

    /// Reads the vocabulary from GGUF metadata, applying llama.cpp's defaults for absent keys:
    /// SPM has BOS 1, EOS 2, UNK 0, adds BOS and a space prefix; BPE has BOS = EOS = 11, adds
    /// nothing (LLaMA-3 BPE adds BOS). Default ids outside the vocabulary are dropped; ids from
    /// keys outside it are ignored (the default stays), as llama.cpp does.
    pub fn from_metadata(md: &Metadata) -> Result<Vocab> {
        let model_name = md.get_str(keys::MODEL)?;
        let model = TokenizerModel::from_gguf_name(model_name)
            .ok_or_else(|| TokenizerError::UnsupportedModel(model_name.to_string()))?;
        let pre = match md.get(keys::PRE) {
            Some(_) => Some(md.get_str(keys::PRE)?.to_string()),
            None => None,
        };
        let tokens = md.get_string_array(keys::TOKENS)?.to_vec();
        let n = tokens.len();
        if n == 0 || n > (1usize << 31) {
            return Err(TokenizerError::BadVocabSize(n));
        }

        let scores = match md.get(keys::SCORES) {
            None => vec![0.0; n],
            Some(_) => match md.get_array(keys::SCORES)? {
                Array::F32(v) => take_n(v, n, keys::SCORES)?.to_vec(),
                Array::I32(v) => take_n(v, n, keys::SCORES)?
                    .iter()
                    .map(|&s| s as f32)
                    .collect(),
                other => {
                    return Err(powerinfer_gguf::GgufError::WrongType {
                        key: keys::SCORES.to_string(),
                        expected: "array of f32 or i32",
                        found: format!("array of {}", other.elem_type()),
                    }
                    .into())
                }
            },
        };
        let token_types = match md.get(keys::TOKEN_TYPE) {
            None => vec![TokenType::Normal; n],
            Some(_) => take_n(md.get_i32_array(keys::TOKEN_TYPE)?, n, keys::TOKEN_TYPE)?
                .iter()
                .map(|&t| TokenType::from_i32(t))
                .collect(),
        };
        let merges = match model {
            TokenizerModel::Bpe => match md.get(keys::MERGES) {
                Some(_) => md.get_string_array(keys::MERGES)?.to_vec(),
                None => return Err(TokenizerError::MissingMerges),
            },
            TokenizerModel::Spm => Vec::new(),
        };

        let (bos, eos, unk) = match model {
            TokenizerModel::Spm => (Some(1), Some(2), Some(0)),
            TokenizerModel::Bpe => (Some(11), Some(11), None),
        };
        let in_range = |id: Option<TokenId>| id.filter(|&i| (i as usize) < n);
        let read_id = |key: &str, default: Option<TokenId>| -> Result<Option<TokenId>> {
            let default = in_range(default);
            if md.get(key).is_none() {
                return Ok(default);
            }
            let v = md.get_uint(key)?;
            Ok(if v < n as u64 {
                Some(v as TokenId)
            } else {
                default
            })
        };
        let special = SpecialTokens {
            bos: read_id(keys::BOS_ID, bos)?,
            eos: read_id(keys::EOS_ID, eos)?,
            eot: read_id(keys::EOT_ID, None)?,
            eom: read_id(keys::EOM_ID, None)?,
            unk: read_id(keys::UNK_ID, unk)?,
            sep: read_id(keys::SEP_ID, None)?,
            pad: read_id(keys::PAD_ID, None)?,
        };
        let read_bool = |key: &str, default: bool| -> Result<bool> {
            Ok(match md.get(key) {
                Some(_) => md.get_bool(key)?,
                None => default,
            })
        };
        let spm = model == TokenizerModel::Spm;
        // LLaMA-3-style BPE vocabularies add BOS unless the file says otherwise.
        let bpe_bos = model == TokenizerModel::Bpe
            && PreTokenizer::from_gguf_name(pre.as_deref())
                .is_some_and(PreTokenizer::adds_bos_by_default);
        Ok(Vocab {
            model,
            pre,
            tokens,
            scores,
            token_types,
            merges,
            special,
            add_bos: read_bool(keys::ADD_BOS, spm || bpe_bos)?,
            add_eos: read_bool(keys::ADD_EOS, false)?,
            add_space_prefix: read_bool(keys::ADD_SPACE_PREFIX, spm)?,
        })
    }

    /// Number of tokens.
    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }
}

fn take_n<'a, T>(v: &'a [T], n: usize, key: &'static str) -> Result<&'a [T]> {
    if v.len() < n {
        return Err(TokenizerError::LengthMismatch {
            key,
            expected: n,
            found: v.len(),
        });
    }
    Ok(&v[..n])
}
