//! The error type of the tokenizers.

use super::TokenId;

/// What went wrong building a tokenizer from GGUF metadata or decoding token ids.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenizerError {
    /// A metadata key is missing or has the wrong type (the reader's error names the key).
    #[error("tokenizer metadata: {0}")]
    Metadata(#[from] powerinfer_gguf::GgufError),
    /// `tokenizer.ggml.model` names a tokenizer this crate does not implement.
    #[error("unsupported tokenizer model {0:?} (supported: \"llama\" = SentencePiece, \"gpt2\" = byte-level BPE)")]
    UnsupportedModel(String),
    /// `tokenizer.ggml.pre` names a BPE pre-tokenizer this crate does not implement.
    #[error("unsupported BPE pre-tokenizer {0:?} (supported: {supported})", supported = super::PreTokenizer::SUPPORTED_NAMES.join(", "))]
    UnsupportedPreTokenizer(String),
    /// A per-token array (scores, token types) is shorter than the token list.
    #[error("{key} has {found} entries but the vocabulary has {expected} tokens")]
    LengthMismatch {
        /// The metadata key (or `Vocab` field) of the short array.
        key: &'static str,
        /// The number of tokens.
        expected: usize,
        /// The array's length.
        found: usize,
    },
    /// The vocabulary is empty or has more tokens than a `u32` id can address.
    #[error("vocabulary has {0} tokens; expected between 1 and 2^31")]
    BadVocabSize(usize),
    /// Two tokens have the same text, so text-to-token lookups would be ambiguous.
    #[error("duplicate token {text:?}: ids {first} and {second}")]
    DuplicateToken {
        /// The token text.
        text: String,
        /// The first id with that text.
        first: TokenId,
        /// The second id with that text.
        second: TokenId,
    },
    /// `add_bos`/`add_eos` is set but the vocabulary has no such token.
    #[error("{flag} is set but the vocabulary has no {token} token")]
    MissingSpecialToken {
        /// The flag, e.g. `tokenizer.ggml.add_bos_token`.
        flag: &'static str,
        /// The token kind, e.g. `BOS`.
        token: &'static str,
    },
    /// A BPE vocabulary without `tokenizer.ggml.merges`.
    #[error("BPE vocabulary without merges (tokenizer.ggml.merges)")]
    MissingMerges,
    /// A token id outside the vocabulary was given to a decoder.
    #[error("token id {id} is outside the vocabulary of {n_tokens} tokens")]
    TokenOutOfRange {
        /// The id.
        id: TokenId,
        /// The vocabulary size.
        n_tokens: usize,
    },
}

/// Shorthand for results whose error is [`TokenizerError`].
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;
