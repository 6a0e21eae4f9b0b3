//! [`StreamDecoder`]: text from a stream of token ids, one token at a time.

use super::{Result, TokenId, Tokenizer};

/// Decodes generated tokens one at a time into text that can be printed at once.
///
/// Pieces are joined as bytes; a char whose UTF-8 bytes are split across tokens (byte-fallback
/// tokens, byte-level BPE) is held back until it is complete. Bytes that can never form a
/// char become U+FFFD. No space cleanup or prefix removal is done: the output is the plain
/// concatenation of the tokens' pieces, as a terminal would show them.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    special: bool,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder writing control tokens as their text if `special`.
    pub fn new(tokenizer: &'a Tokenizer, special: bool) -> StreamDecoder<'a> {
        StreamDecoder {
            tokenizer,
            special,
            pending: Vec::new(),
        }
    }

    /// Adds token `id`; returns the text completed by it (possibly empty).
    pub fn push(&mut self, id: TokenId) -> Result<String> {
        let piece = self.tokenizer.token_to_piece(id, self.special)?;
        self.pending.extend_from_slice(piece);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid` is valid UTF-8 (checked just above).
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An incomplete char at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..valid);
                            break;
                        }
                        // Bytes that can never be valid: replace them and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Whether bytes of an incomplete char are held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: returns U+FFFD for held-back bytes of an incomplete char, if any.
    pub fn finish(mut self) -> String {
        if self.pending.is_empty() {
            String::new()
        } else {
            self.pending.clear();
            char::REPLACEMENT_CHARACTER.to_string()
        }
    }
}
