//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`): start from single chars, merge
//! the adjacent pair whose merged text is the best-scoring token until no pair is a token,
//! then emit each piece's token or its bytes as `<0xXX>` tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::hash::FastMap;

use super::TokenId;

/// A piece of the text: a byte range `start..start + len` in a doubly linked list.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and `right` (adjacent when pushed).
#[derive(Clone, Copy, Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Byte length of the merged text; the candidate is stale once the pair's lengths changed.
    len: usize,
}

comparisons_from_ord!(Bigram);

impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// The SPM tokenizer's tables.
#[derive(Clone, Debug)]
pub(crate) struct Spm {
    /// Token for each byte value (`<0xXX>`, else the one-byte text), for byte fallback.
    byte_tokens: [Option<TokenId>; 256],
    /// Fallback when a byte has no token at all.
    unk: Option<TokenId>,
}

impl Spm {
    pub(crate) fn new(token_to_id: &FastMap<String, TokenId>, unk: Option<TokenId>) -> Spm {
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = token_to_id.get(hex.as_str()).copied().or_else(|| {
                let b = b as u8;
                b.is_ascii()
                    .then(|| token_to_id.get(char::from(b).to_string().as_str()).copied())
                    .flatten()
            });
        }
        Spm { byte_tokens, unk }
    }

    /// Tokenizes `text` (spaces already escaped to U+2581) and appends the ids to `out`.
    pub(crate) fn encode(
        &self,
        text: &str,
        token_to_id: &FastMap<String, TokenId>,
        scores: &[f32],
        out: &mut Vec<TokenId>,
    ) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }
        if symbols.is_empty() {
            return;
        }

        let lookup = |symbols: &[Symbol], left: usize, right: usize| -> Option<Bigram> {
            let (l, r) = (&symbols[left], &symbols[right]);
            let len = l.len + r.len;
            let id = *token_to_id.get(&text[l.start..l.start + len])?;
            // -0.0 and 0.0 compare equal here, as in a float comparison.
            let score = scores.get(id as usize).copied().unwrap_or(0.0) + 0.0;
            Some(Bigram {
                score,
                left,
                right,
                len,
            })
        };

        let mut queue = BinaryHeap::with_capacity(symbols.len());
        for i in 1..symbols.len() {
            if let Some(b) = lookup(&symbols, i - 1, i) {
                queue.push(b);
            }
        }

        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue; // one side was merged into something else since
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = symbols[b.left].prev {
                if let Some(nb) = lookup(&symbols, p, b.left) {
                    queue.push(nb);
                }
            }
            if let Some(n) = symbols[b.left].next {
                if let Some(nb) = lookup(&symbols, b.left, n) {
                    queue.push(nb);
                }
            }
        }

        let mut i = Some(0);
        while let Some(idx) = i {
            let s = symbols[idx];
            let piece = &text[s.start..s.start + s.len];
            match token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &byte in piece.as_bytes() {
                        if let Some(id) = self.byte_tokens[usize::from(byte)].or(self.unk) {
                            out.push(id);
                        }
                    }
                }
            }
            i = s.next;
        }
    }
}
