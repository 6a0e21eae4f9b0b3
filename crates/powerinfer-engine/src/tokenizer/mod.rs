//! Tokenizers built from GGUF metadata, matching llama.cpp token for token.
//!
//! - [`Vocab`] is the data of `tokenizer.ggml.*`: tokens, scores, types, merges, special ids
//!   and the BOS/EOS/space-prefix rules ([`Vocab::from_gguf`]).
//! - [`Tokenizer`] encodes text ([`Tokenizer::encode`]) with SentencePiece BPE
//!   (`tokenizer.ggml.model = "llama"`) or byte-level BPE (`"gpt2"`, with the pre-tokenizer
//!   named by `tokenizer.ggml.pre`, see [`PreTokenizer`]), and decodes ids back to bytes
//!   ([`Tokenizer::token_to_piece`], [`Tokenizer::decode`]).
//! - [`StreamDecoder`] turns a stream of ids into text as it is generated, holding back the
//!   bytes of a char split across tokens.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use powerinfer_engine::tokenizer::Tokenizer;
//! let file = powerinfer_gguf::GgufFile::open("model.gguf")?;
//! let tok = Tokenizer::from_gguf(&file)?;
//! let ids = tok.encode("Hello world", true, false);
//! let text = tok.decode(&ids, true, false)?;
//! assert_eq!(String::from_utf8_lossy(&text), "Hello world");
//! # Ok(()) }
//! ```

/// Implements `PartialEq`, `Eq` and `PartialOrd` of `$t` from its `Ord` (the merge candidates
/// of the BPE and SPM tokenizers, which order themselves for a max-heap).
macro_rules! comparisons_from_ord {
    ($t:ty) => {
        impl PartialEq for $t {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other) == std::cmp::Ordering::Equal
            }
        }

        impl Eq for $t {}

        impl PartialOrd for $t {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }
    };
}

mod bpe;
mod error;
mod hash;
mod pretokenize;
mod spm;
mod stream;
mod unicode;
mod vocab;

use hash::FastMap;

use powerinfer_gguf::GgufFile;

pub use error::{Result, TokenizerError};
pub use pretokenize::PreTokenizer;
pub use stream::StreamDecoder;
pub use vocab::{keys, SpecialTokens, TokenType, TokenizerModel, Vocab};

/// A token id: an index into the vocabulary.
pub type TokenId = u32;

/// The SentencePiece space marker U+2581 (`▁`).
const SPM_SPACE: &str = "\u{2581}";

/// Token texts that end generation besides the EOS/EOT/EOM ids (chat models mark turn ends
/// with these; llama.cpp recognises them by text as well).
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
];

#[derive(Clone, Debug)]
enum Algorithm {
    Spm(Box<spm::Spm>),
    Bpe(Box<bpe::Bpe>),
}

/// A piece of the input: text still to tokenize, or a special token found in it.
#[derive(Clone, Copy, Debug)]
enum Fragment {
    Text(usize, usize),
    Token(TokenId),
}

/// A ready-to-use tokenizer: a [`Vocab`] plus lookup tables.
///
/// Encoding never fails (text that no token covers falls back to byte tokens); decoding fails
/// only on ids outside the vocabulary.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    vocab: Vocab,
    token_to_id: FastMap<String, TokenId>,
    algorithm: Algorithm,
    /// Control, user-defined and unknown tokens, longest text first: matched in the input
    /// before tokenizing the rest.
    special_tokens: Vec<TokenId>,
    /// Each token's bytes when decoded with `special = true`.
    pieces: Vec<Vec<u8>>,
    /// BPE: remove spaces before `?!.,` and around `'` when decoding, as llama.cpp does.
    clean_spaces: bool,
    /// Ids that end generation.
    eog: Vec<TokenId>,
}

impl Tokenizer {
    /// Reads the vocabulary of a GGUF file and builds its tokenizer.
    pub fn from_gguf<B: AsRef<[u8]>>(file: &GgufFile<B>) -> Result<Tokenizer> {
        Tokenizer::new(Vocab::from_gguf(file)?)
    }

    /// Builds the lookup tables of `vocab`. Fails on an inconsistent vocabulary: per-token
    /// arrays of the wrong length, duplicate token texts, special ids outside the vocabulary,
    /// an unsupported pre-tokenizer, or an `add_bos`/`add_eos` flag without the token.
    pub fn new(vocab: Vocab) -> Result<Tokenizer> {
        let n = vocab.tokens.len();
        if n == 0 || n > (1usize << 31) {
            return Err(TokenizerError::BadVocabSize(n));
        }
        for (key, len) in [
            ("scores", vocab.scores.len()),
            ("token_types", vocab.token_types.len()),
        ] {
            if len != n {
                return Err(TokenizerError::LengthMismatch {
                    key,
                    expected: n,
                    found: len,
                });
            }
        }
        let s = vocab.special;
        for id in [s.bos, s.eos, s.eot, s.eom, s.unk, s.sep, s.pad]
            .into_iter()
            .flatten()
        {
            if id as usize >= n {
                return Err(TokenizerError::TokenOutOfRange { id, n_tokens: n });
            }
        }
        if vocab.add_bos && vocab.special.bos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: keys::ADD_BOS,
                token: "BOS",
            });
        }
        if vocab.add_eos && vocab.special.eos.is_none() {
            return Err(TokenizerError::MissingSpecialToken {
                flag: keys::ADD_EOS,
                token: "EOS",
            });
        }

        let mut token_to_id = FastMap::with_capacity_and_hasher(n, Default::default());
        for (i, text) in vocab.tokens.iter().enumerate() {
            let id = i as TokenId;
            // llama.cpp renames empty tokens so that they can never match.
            let key = if text.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                text.clone()
            };
            if let Some(first) = token_to_id.insert(key.clone(), id) {
                return Err(TokenizerError::DuplicateToken {
                    text: key,
                    first,
                    second: id,
                });
            }
        }

        let (algorithm, clean_spaces) = match vocab.model {
            TokenizerModel::Spm => (
                Algorithm::Spm(Box::new(spm::Spm::new(&token_to_id, vocab.special.unk))),
                false,
            ),
            TokenizerModel::Bpe => {
                let pre = PreTokenizer::from_gguf_name(vocab.pre.as_deref()).ok_or_else(|| {
                    TokenizerError::UnsupportedPreTokenizer(vocab.pre.clone().unwrap_or_default())
                })?;
                let bpe = bpe::Bpe::new(pre, &token_to_id, n, &vocab.merges);
                (Algorithm::Bpe(Box::new(bpe)), pre.cleans_spaces())
            }
        };

        let mut special_tokens: Vec<TokenId> = (0..n as TokenId)
            .filter(|&id| {
                matches!(
                    vocab.token_types[id as usize],
                    TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                ) && !vocab.tokens[id as usize].is_empty()
            })
            .collect();
        // Longest first; ties by id so that the order does not depend on the sort.
        special_tokens.sort_by(|&a, &b| {
            vocab.tokens[b as usize]
                .len()
                .cmp(&vocab.tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        let pieces = (0..n).map(|i| piece_of(&vocab, i)).collect();

        let mut eog: Vec<TokenId> = [s.eos, s.eot, s.eom].into_iter().flatten().collect();
        for text in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                eog.push(id);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        Ok(Tokenizer {
            vocab,
            token_to_id,
            algorithm,
            special_tokens,
            pieces,
            clean_spaces,
            eog,
        })
    }

    /// The vocabulary.
    pub fn vocab(&self) -> &Vocab {
        &self.vocab
    }

    /// Number of tokens.
    pub fn n_tokens(&self) -> usize {
        self.vocab.tokens.len()
    }

    /// The special token ids.
    pub fn special(&self) -> &SpecialTokens {
        &self.vocab.special
    }

    /// The BOS id, if any.
    pub fn bos(&self) -> Option<TokenId> {
        self.vocab.special.bos
    }

    /// The EOS id, if any.
    pub fn eos(&self) -> Option<TokenId> {
        self.vocab.special.eos
    }

    /// Whether `id` ends generation (EOS, EOT, EOM, or a token such as `<|im_end|>`).
    pub fn is_eog(&self, id: TokenId) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The ids that end generation, sorted.
    pub fn eog_tokens(&self) -> &[TokenId] {
        &self.eog
    }

    /// The id of the token whose text is exactly `text` (in the vocabulary's own spelling:
    /// `▁` for spaces in SPM, GPT-2's byte alphabet in BPE).
    pub fn token_id(&self, text: &str) -> Option<TokenId> {
        self.token_to_id.get(text).copied()
    }

    /// The stored text of token `id`.
    pub fn token_text(&self, id: TokenId) -> Option<&str> {
        self.vocab.tokens.get(id as usize).map(String::as_str)
    }

    /// The type of token `id`.
    pub fn token_type(&self, id: TokenId) -> Option<TokenType> {
        self.vocab.token_types.get(id as usize).copied()
    }

    /// The BPE pre-tokenizer (`None` for SPM).
    pub fn pre_tokenizer(&self) -> Option<PreTokenizer> {
        match &self.algorithm {
            Algorithm::Bpe(b) => Some(b.pre),
            Algorithm::Spm(_) => None,
        }
    }

    /// Tokenizes `text` as llama.cpp's `llama_tokenize` does.
    ///
    /// `add_special`: add BOS/EOS where the vocabulary asks for them (`add_bos`, `add_eos`).
    /// `parse_special`: turn the text of control tokens (`<s>`, `<|endoftext|>`) found in
    /// `text` into those tokens; without it only user-defined tokens are matched and control
    /// token texts are tokenized as ordinary text.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<TokenId> {
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        let v = &self.vocab;
        match &self.algorithm {
            Algorithm::Spm(spm) => {
                if add_special && v.add_bos {
                    out.extend(v.special.bos);
                }
                // A space goes before the text and before text that follows a special token.
                let mut prev_special = true;
                let mut buf = String::new();
                for f in fragments {
                    match f {
                        Fragment::Text(s, e) => {
                            buf.clear();
                            if v.add_space_prefix && prev_special {
                                buf.push_str(SPM_SPACE);
                            }
                            for (i, part) in text[s..e].split(' ').enumerate() {
                                if i > 0 {
                                    buf.push_str(SPM_SPACE);
                                }
                                buf.push_str(part);
                            }
                            spm.encode(&buf, &self.token_to_id, &v.scores, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Algorithm::Bpe(bpe) => {
                if add_special && v.add_bos {
                    out.extend(v.special.bos);
                }
                for f in fragments {
                    match f {
                        Fragment::Text(s, e) => {
                            bpe.encode(&text[s..e], &self.token_to_id, &mut out)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && v.add_eos {
            out.extend(v.special.eos);
        }
        out
    }

    /// Splits `text` at occurrences of special-token texts (longest tokens first, each
    /// occurrence leftmost first). Control and unknown tokens count only with
    /// `parse_special`; user-defined tokens always.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut fragments = Vec::new();
        if text.is_empty() {
            return fragments;
        }
        fragments.push(Fragment::Text(0, text.len()));
        let mut next = Vec::new();
        for &id in &self.special_tokens {
            let ty = self.vocab.token_types[id as usize];
            if !parse_special && ty != TokenType::UserDefined {
                continue;
            }
            let needle = self.vocab.tokens[id as usize].as_str();
            if !text.contains(needle) {
                continue;
            }
            next.clear();
            for &f in &fragments {
                let Fragment::Text(mut s, e) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = text[s..e].find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(s, s + at));
                    }
                    next.push(Fragment::Token(id));
                    s += at + needle.len();
                }
                if s < e {
                    next.push(Fragment::Text(s, e));
                }
            }
            std::mem::swap(&mut fragments, &mut next);
        }
        fragments
    }

    /// The bytes token `id` stands for. Control and unknown tokens give their text only with
    /// `special`, nothing otherwise; unused and undefined tokens give nothing. A piece can be
    /// part of a UTF-8 sequence (byte tokens, byte-level BPE): join pieces before decoding
    /// them as UTF-8, or use a [`StreamDecoder`].
    pub fn token_to_piece(&self, id: TokenId, special: bool) -> Result<&[u8]> {
        let i = id as usize;
        let piece = self.pieces.get(i).ok_or(TokenizerError::TokenOutOfRange {
            id,
            n_tokens: self.n_tokens(),
        })?;
        if !special
            && matches!(
                self.vocab.token_types[i],
                TokenType::Control | TokenType::Unknown
            )
        {
            return Ok(&[]);
        }
        Ok(piece)
    }

    /// Decodes `tokens` to bytes as llama.cpp's `llama_detokenize` does.
    ///
    /// `remove_special`: drop a leading BOS and a trailing EOS where the vocabulary adds
    /// them. `unparse_special`: write control tokens as their text (else they vanish).
    /// SPM removes the space prefix of the first token unless a BOS was dropped; BPE
    /// vocabularies clean up spaces before punctuation and apostrophes.
    pub fn decode(
        &self,
        tokens: &[TokenId],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<Vec<u8>> {
        let v = &self.vocab;
        let mut tokens = tokens;
        let mut remove_space = v.add_space_prefix;
        if remove_special && v.add_bos {
            if let (Some(&first), Some(bos)) = (tokens.first(), v.special.bos) {
                if first == bos {
                    remove_space = false;
                    tokens = &tokens[1..];
                }
            }
        }
        if remove_special && v.add_eos {
            if let (Some(&last), Some(eos)) = (tokens.last(), v.special.eos) {
                if last == eos {
                    tokens = &tokens[..tokens.len() - 1];
                }
            }
        }
        let mut out = Vec::with_capacity(tokens.len() * 4);
        for &id in tokens {
            let mut piece = self.token_to_piece(id, unparse_special)?;
            if remove_space {
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
            }
            remove_space = false;
            out.extend_from_slice(piece);
        }
        if self.clean_spaces {
            out = clean_up_spaces(out);
        }
        Ok(out)
    }

    /// Like [`decode`](Tokenizer::decode), with invalid UTF-8 replaced by U+FFFD.
    pub fn decode_lossy(
        &self,
        tokens: &[TokenId],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<String> {
        let bytes = self.decode(tokens, remove_special, unparse_special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// A decoder for a stream of generated tokens; see [`StreamDecoder`].
    pub fn stream_decoder(&self, special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, special)
    }
}

/// The decoded bytes of token `i`, as with `special = true`.
fn piece_of(v: &Vocab, i: usize) -> Vec<u8> {
    let text = &v.tokens[i];
    match v.token_types[i] {
        TokenType::Control | TokenType::Unknown | TokenType::UserDefined => {
            text.as_bytes().to_vec()
        }
        TokenType::Normal => match v.model {
            TokenizerModel::Spm => text.replace(SPM_SPACE, " ").into_bytes(),
            TokenizerModel::Bpe => {
                let mut out = Vec::with_capacity(text.len());
                for c in text.chars() {
                    match unicode::char_to_byte(c) {
                        Some(b) => out.push(b),
                        // Not in the byte alphabet (a broken vocabulary): keep the char.
                        None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                out
            }
        },
        TokenType::Byte => parse_byte_token(text).map(|b| vec![b]).unwrap_or_default(),
        TokenType::Unused | TokenType::Undefined => Vec::new(),
    }
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// llama.cpp's `clean_up_tokenization_spaces`: removes the space before `?`, `!`, `.`, `,`;
/// the spaces around a lone `'`; and the space before `'s`, `'m`, `'re`, `'ve`.
fn clean_up_spaces(text: Vec<u8>) -> Vec<u8> {
    // " ?", " !", " .", " ,"
    let mut a = Vec::with_capacity(text.len());
    for (i, &x) in text.iter().enumerate() {
        if i > 0 && text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            a.pop();
        }
        a.push(x);
    }
    // " ' " -> "'"
    let mut b = Vec::with_capacity(a.len());
    let mut i = 0;
    while i < a.len() {
        let x = a[i];
        if i > 0 && x == b'\'' && i + 1 < a.len() && a[i - 1] == b' ' && a[i + 1] == b' ' {
            b.pop();
            a[i + 1] = 0; // the next space is dropped and no longer counts as a space
            i += 1;
        }
        b.push(x);
        i += 1;
    }
    // " 's", " 'm", " 're", " 've"
    let mut c = Vec::with_capacity(b.len());
    for (i, &x) in b.iter().enumerate() {
        if i > 0 && b[i - 1] == b' ' && x == b'\'' && i + 1 < b.len() {
            let x1 = b[i + 1];
            let x2 = b.get(i + 2).copied();
            let remove =
                matches!(x1, b's' | b'm') || (matches!(x1, b'r' | b'v') && x2 == Some(b'e'));
            if remove {
                c.pop();
            }
        }
        c.push(x);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xFF>"), Some(255));
        assert_eq!(parse_byte_token("<0xG0>"), None);
        assert_eq!(parse_byte_token("0x41"), None);
    }

    #[test]
    fn clean_up_spaces_matches_llama_cpp() {
        let c = |s: &str| String::from_utf8(clean_up_spaces(s.as_bytes().to_vec())).unwrap();
        assert_eq!(c("Hello , world !"), "Hello, world!");
        assert_eq!(c("it ' s"), "it's");
        assert_eq!(c("I 've been"), "I've been");
        assert_eq!(c("don 't"), "don 't");
        assert_eq!(c("you 'll"), "you 'll");
        assert_eq!(c(""), "");
        assert_eq!(c(" ."), ".");
    }
}
