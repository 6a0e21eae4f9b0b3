//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): each pre-tokenized word is written in
//! GPT-2's byte alphabet (one char per byte), then the adjacent pair with the lowest merge
//! rank is merged until no pair has a rank.
//!
//! Strings are interned once at load: every token text, merge side and merge result gets an
//! id, so the merge loop compares integers and never builds strings.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::hash::FastMap;

use super::pretokenize::PreTokenizer;
use super::unicode::byte_to_char;
use super::TokenId;

/// Interned string id: token ids first (`0..n_tokens`), then other strings.
type Sym = u32;

#[derive(Clone, Copy, Debug)]
struct Symbol {
    /// Byte range of the word.
    start: usize,
    len: usize,
    /// Interned id of the symbol's text, `None` if no merge or token has that text.
    sym: Option<Sym>,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(Clone, Copy, Debug)]
struct Bigram {
    rank: u32,
    left: usize,
    right: usize,
    left_len: usize,
    right_len: usize,
    merged: Sym,
}

comparisons_from_ord!(Bigram);

impl Ord for Bigram {
    /// Max-heap order: lowest rank first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .rank
            .cmp(&self.rank)
            .then_with(|| other.left.cmp(&self.left))
            .then_with(|| other.right.cmp(&self.right))
    }
}

/// The BPE tokenizer's tables.
#[derive(Clone, Debug)]
pub(crate) struct Bpe {
    pub(crate) pre: PreTokenizer,
    n_tokens: u32,
    /// `(left, right) -> (rank, merged)`.
    ranks: FastMap<(Sym, Sym), (u32, Sym)>,
    /// Interned id of the one-char string standing for each byte.
    byte_syms: [Option<Sym>; 256],
    /// Token of each printable ASCII byte's one-char text, the last-resort fallback.
    ascii_tokens: [Option<TokenId>; 128],
}

impl Bpe {
    pub(crate) fn new(
        pre: PreTokenizer,
        token_to_id: &FastMap<String, TokenId>,
        n_tokens: usize,
        merges: &[String],
    ) -> Bpe {
        let n_tokens = n_tokens as u32;
        let mut extra: FastMap<String, Sym> = FastMap::default();
        let intern = |s: &str, extra: &mut FastMap<String, Sym>| -> Sym {
            if let Some(&id) = token_to_id.get(s) {
                return id;
            }
            let next = n_tokens + extra.len() as u32;
            *extra.entry(s.to_string()).or_insert(next)
        };
        let mut ranks = FastMap::with_capacity_and_hasher(merges.len(), Default::default());
        for (rank, merge) in merges.iter().enumerate() {
            // Split at the first space after the first byte (a merge side may be a space in
            // vocabularies that have one); a merge without a space is the pair ("", "").
            let space = merge.as_bytes().iter().skip(1).position(|&b| b == b' ');
            let (left, right) = match space {
                Some(i) => (&merge[..i + 1], &merge[i + 2..]),
                None => ("", ""),
            };
            let l = intern(left, &mut extra);
            let r = intern(right, &mut extra);
            let merged = intern(&format!("{left}{right}"), &mut extra);
            ranks.entry((l, r)).or_insert((rank as u32, merged));
        }
        let mut byte_syms = [None; 256];
        for (b, slot) in byte_syms.iter_mut().enumerate() {
            let s = byte_to_char(b as u8).to_string();
            *slot = token_to_id
                .get(s.as_str())
                .or_else(|| extra.get(s.as_str()))
                .copied();
        }
        let mut ascii_tokens = [None; 128];
        for (b, slot) in ascii_tokens.iter_mut().enumerate() {
            *slot = token_to_id
                .get(char::from(b as u8).to_string().as_str())
                .copied();
        }
        Bpe {
            pre,
            n_tokens,
            ranks,
            byte_syms,
            ascii_tokens,
        }
    }

    /// Tokenizes `text` (one special-token-free fragment) and appends the ids to `out`.
    pub(crate) fn encode(
        &self,
        text: &str,
        token_to_id: &FastMap<String, TokenId>,
        out: &mut Vec<TokenId>,
    ) {
        let mut symbols = Vec::new();
        let mut queue = BinaryHeap::new();
        // Words repeat a lot in text: reuse the tokens of a word seen before in this call
        // (they are a range of `out`, which only grows).
        let mut seen: FastMap<&[u8], (usize, usize)> = FastMap::default();
        for word in self.pre.split(text) {
            let word = &text.as_bytes()[word];
            if let Some(&(start, end)) = seen.get(word) {
                out.extend_from_within(start..end);
                continue;
            }
            let start = out.len();
            let whole = self.pre.ignores_merges().then(|| {
                let encoded: String = word.iter().map(|&b| byte_to_char(b)).collect();
                token_to_id.get(&encoded).copied()
            });
            match whole.flatten() {
                Some(id) => out.push(id),
                None => self.encode_word(word, &mut symbols, &mut queue, out),
            }
            seen.insert(word, (start, out.len()));
        }
    }

    fn bigram(&self, symbols: &[Symbol], left: usize, right: usize) -> Option<Bigram> {
        let (l, r) = (&symbols[left], &symbols[right]);
        let &(rank, merged) = self.ranks.get(&(l.sym?, r.sym?))?;
        Some(Bigram {
            rank,
            left,
            right,
            left_len: l.len,
            right_len: r.len,
            merged,
        })
    }

    fn encode_word(
        &self,
        word: &[u8],
        symbols: &mut Vec<Symbol>,
        queue: &mut BinaryHeap<Bigram>,
        out: &mut Vec<TokenId>,
    ) {
        symbols.clear();
        queue.clear();
        for (i, &b) in word.iter().enumerate() {
            symbols.push(Symbol {
                start: i,
                len: 1,
                sym: self.byte_syms[usize::from(b)],
                prev: i.checked_sub(1),
                next: (i + 1 < word.len()).then_some(i + 1),
            });
        }
        for i in 1..symbols.len() {
            if let Some(b) = self.bigram(symbols, i - 1, i) {
                queue.push(b);
            }
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // Stale if either side was merged since: lengths only ever grow, or drop to 0.
            if l.len != b.left_len || r.len != b.right_len {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.left].sym = Some(b.merged);
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            if let Some(p) = l.prev {
                if let Some(nb) = self.bigram(symbols, p, b.left) {
                    queue.push(nb);
                }
            }
            if let Some(n) = r.next {
                if let Some(nb) = self.bigram(symbols, b.left, n) {
                    queue.push(nb);
                }
            }
        }
        let mut i = (!symbols.is_empty()).then_some(0);
        while let Some(idx) = i {
            let s = symbols[idx];
            match s.sym {
                Some(id) if id < self.n_tokens => out.push(id),
                _ => {
                    // Not a token: emit the tokens of its chars that are one byte long (only
                    // printable ASCII stands for itself in the byte alphabet).
                    for &b in &word[s.start..s.start + s.len] {
                        if (0x21..0x7F).contains(&b) {
                            if let Some(id) = self.ascii_tokens[usize::from(b)] {
                                out.push(id);
                            }
                        }
                    }
                }
            }
            i = s.next;
        }
    }
}
