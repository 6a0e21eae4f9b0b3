//! BPE pre-tokenizers: split text into words before byte-level BPE runs on each word.
//!
//! Each pre-tokenizer is a list of steps, as in llama.cpp. A step splits every current piece
//! into its matches and the text between them (which is kept as pieces too), so later steps
//! only refine earlier cuts. The steps are written by hand (no regex engine); each one's
//! doc comment gives the regex it stands for.

use std::ops::Range;

use super::unicode::{class, Class, Flags};

/// A BPE pre-tokenizer, chosen by `tokenizer.ggml.pre`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PreTokenizer {
    /// `"default"` or absent: punctuation runs, the GPT-2 split, digit runs, digit triples.
    Default,
    /// `"gpt-2"` (also `"phi-2"`, `"mpt"`, `"olmo"`, `"jais"`): the GPT-2 split.
    Gpt2,
    /// `"falcon"`: punctuation runs, the GPT-2 split, digit triples.
    Falcon,
    /// `"starcoder"` (also `"refact"`, `"codeshell"`): single digits, then the GPT-2 split.
    StarCoder,
    /// `"command-r"`: as `StarCoder`, without space clean-up when decoding.
    CommandR,
    /// `"llama3"` (also `"llama-v3"`, `"llama-bpe"`, `"falcon3"`): the LLaMA-3 split (digits
    /// in threes); a word that is a token is not merged; BOS is added by default.
    Llama3,
    /// `"qwen2"`: the LLaMA-3 split with single digits, without space clean-up.
    Qwen2,
}

impl PreTokenizer {
    /// The `tokenizer.ggml.pre` names this crate understands.
    pub const SUPPORTED_NAMES: &'static [&'static str] = &[
        "default",
        "gpt-2",
        "phi-2",
        "mpt",
        "olmo",
        "jais",
        "falcon",
        "starcoder",
        "refact",
        "codeshell",
        "command-r",
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "qwen2",
    ];

    /// The pre-tokenizer for `tokenizer.ggml.pre` = `name` (`None`: the key is absent, which
    /// llama.cpp treats as `"default"`). `None` for names this crate does not implement.
    pub fn from_gguf_name(name: Option<&str>) -> Option<PreTokenizer> {
        Some(match name {
            None | Some("default") => PreTokenizer::Default,
            Some("gpt-2" | "phi-2" | "mpt" | "olmo" | "jais") => PreTokenizer::Gpt2,
            Some("falcon") => PreTokenizer::Falcon,
            Some("starcoder" | "refact" | "codeshell") => PreTokenizer::StarCoder,
            Some("command-r") => PreTokenizer::CommandR,
            Some("llama3" | "llama-v3" | "llama-bpe" | "falcon3") => PreTokenizer::Llama3,
            Some("qwen2") => PreTokenizer::Qwen2,
            Some(_) => return None,
        })
    }

    fn steps(self) -> &'static [Step] {
        use Step::*;
        match self {
            PreTokenizer::Default => &[
                PunctRun { backtick: false },
                Gpt2,
                NumberRun,
                AsciiDigitTriple,
            ],
            PreTokenizer::Gpt2 => &[Gpt2],
            PreTokenizer::Falcon => &[PunctRun { backtick: true }, Gpt2, AsciiDigitTriple],
            PreTokenizer::StarCoder | PreTokenizer::CommandR => &[SingleNumber, Gpt2],
            PreTokenizer::Llama3 => &[Llama3 { max_digits: 3 }],
            PreTokenizer::Qwen2 => &[Llama3 { max_digits: 1 }],
        }
    }

    /// Whether a word that is itself a token is emitted as is, without merges (LLaMA-3).
    pub fn ignores_merges(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Whether decoding removes spaces before punctuation and around apostrophes
    /// (llama.cpp's `clean_spaces`).
    pub fn cleans_spaces(self) -> bool {
        !matches!(self, PreTokenizer::CommandR | PreTokenizer::Qwen2)
    }

    /// Whether BOS is added when the file does not say (`tokenizer.ggml.add_bos_token`).
    pub fn adds_bos_by_default(self) -> bool {
        self == PreTokenizer::Llama3
    }

    /// Splits `text` into words, returned as byte ranges of `text` that cover it in order.
    pub fn split(self, text: &str) -> Vec<Range<usize>> {
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::with_capacity(chars.len() / 3 + 1);
        if !chars.is_empty() {
            pieces.push(0..chars.len());
        }
        let mut next = Vec::with_capacity(chars.len() / 3 + 1);
        for step in self.steps() {
            next.clear();
            for piece in &pieces {
                step.split(&chars, piece.clone(), &mut next);
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        // Char ranges -> byte ranges.
        let mut out = Vec::with_capacity(pieces.len());
        let mut byte = 0;
        let mut ci = 0;
        for piece in pieces {
            debug_assert_eq!(piece.start, ci);
            let start = byte;
            for &c in &chars[piece.clone()] {
                byte += c.len_utf8();
            }
            ci = piece.end;
            out.push(start..byte);
        }
        out
    }
}

#[derive(Clone, Copy, Debug)]
enum Step {
    /// `[\p{P}\$\+<=>\^~\|]+`, plus `` ` `` in the class when `backtick`. The class is taken
    /// as llama.cpp evaluates it: ASCII chars by the literal class, other chars by category
    /// P (and never whitespace).
    PunctRun { backtick: bool },
    /// `\p{N}+`.
    NumberRun,
    /// `\p{N}`.
    SingleNumber,
    /// `[0-9][0-9][0-9]`.
    AsciiDigitTriple,
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
    /// ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
    Llama3 { max_digits: usize },
}

fn is_punct_class(c: char, backtick: bool) -> bool {
    if c.is_ascii() {
        c.is_ascii_punctuation() && (backtick || c != '`')
    } else {
        !c.is_whitespace() && class(c) == Class::Punctuation
    }
}

fn is_number_class(c: char) -> bool {
    if c.is_ascii() {
        c.is_ascii_digit()
    } else {
        !c.is_whitespace() && class(c) == Class::Number
    }
}

/// Pushes the gaps and matches of `piece` in order, given the matches (sorted, disjoint).
struct Emitter<'a> {
    out: &'a mut Vec<Range<usize>>,
    prev_end: usize,
}

impl Emitter<'_> {
    fn matched(&mut self, m: Range<usize>) {
        if m.start > self.prev_end {
            self.out.push(self.prev_end..m.start);
        }
        if m.end > m.start {
            self.out.push(m.start..m.end);
        }
        self.prev_end = m.end;
    }

    fn finish(self, end: usize) {
        if end > self.prev_end {
            self.out.push(self.prev_end..end);
        }
    }
}

impl Step {
    fn split(self, chars: &[char], piece: Range<usize>, out: &mut Vec<Range<usize>>) {
        match self {
            Step::PunctRun { backtick } => {
                run_split(chars, piece, out, |c| is_punct_class(c, backtick))
            }
            Step::NumberRun => run_split(chars, piece, out, is_number_class),
            Step::SingleNumber => {
                let end = piece.end;
                let mut em = Emitter {
                    out,
                    prev_end: piece.start,
                };
                for i in piece {
                    if is_number_class(chars[i]) {
                        em.matched(i..i + 1);
                    }
                }
                em.finish(end);
            }
            Step::AsciiDigitTriple => {
                let (start, end) = (piece.start, piece.end);
                let mut em = Emitter {
                    out,
                    prev_end: start,
                };
                let mut i = start;
                while i + 3 <= end {
                    if chars[i..i + 3].iter().all(char::is_ascii_digit) {
                        em.matched(i..i + 3);
                        i += 3;
                    } else {
                        i += 1;
                    }
                }
                em.finish(end);
            }
            Step::Gpt2 => gpt2_split(chars, piece, out),
            Step::Llama3 { max_digits } => llama3_split(chars, piece, out, max_digits),
        }
    }
}

/// Splits `piece` into maximal runs of chars satisfying `pred` and the gaps between them.
fn run_split(
    chars: &[char],
    piece: Range<usize>,
    out: &mut Vec<Range<usize>>,
    pred: impl Fn(char) -> bool,
) {
    let end = piece.end;
    let mut em = Emitter {
        out,
        prev_end: piece.start,
    };
    let mut i = piece.start;
    while i < end {
        if pred(chars[i]) {
            let s = i;
            while i < end && pred(chars[i]) {
                i += 1;
            }
            em.matched(s..i);
        } else {
            i += 1;
        }
    }
    em.finish(end);
}

/// The GPT-2 split of `piece`. Alternatives are tried in regex order at each position; the
/// lookahead of `\s+(?!\S)` sees only this piece (the next piece counts as end of text).
fn gpt2_split(chars: &[char], piece: Range<usize>, out: &mut Vec<Range<usize>>) {
    let (start, end) = (piece.start, piece.end);
    // Flags of the char at `p`, or all-false (and "absent") past the piece.
    let flags = |p: usize| -> Option<Flags> { (p < end).then(|| Flags::of(chars[p])) };
    let is = |p: usize, f: fn(&Flags) -> bool| flags(p).as_ref().is_some_and(f);
    let other = |f: &Flags| !(f.letter || f.number || f.whitespace);

    let mut pos = start;
    while pos < end {
        let c = chars[pos];
        let tok_start = pos;
        // 's|'t|'re|'ve|'m|'ll|'d
        if let Some(n) = contraction(&chars[pos..end], |c| c) {
            pos += n;
            out.push(tok_start..pos);
            continue;
        }
        // The optional leading space: the class is decided by the char after it.
        let lead = usize::from(c == ' ');
        let f2 = flags(pos + lead);
        if let Some(f2) = f2 {
            let class_pred: Option<fn(&Flags) -> bool> = if f2.letter {
                Some(|f| f.letter)
            } else if f2.number {
                Some(|f| f.number)
            } else if other(&f2) {
                Some(|f| !(f.letter || f.number || f.whitespace))
            } else {
                None
            };
            if let Some(pred) = class_pred {
                pos += lead;
                while is(pos, pred) {
                    pos += 1;
                }
                out.push(tok_start..pos);
                continue;
            }
        }
        // \s+(?!\S) | \s+
        let mut n_ws = 0;
        while is(pos + n_ws, |f| f.whitespace) {
            n_ws += 1;
        }
        pos = whitespace_end(pos, n_ws, end);
        out.push(tok_start..pos);
    }
}

/// The length of the contraction `'s|'t|'re|'ve|'m|'ll|'d` at the start of `rest` (the piece
/// from the current position on), its letters compared after `fold`; `None` if there is none.
fn contraction(rest: &[char], fold: impl Fn(char) -> char) -> Option<usize> {
    if rest.len() < 2 || rest[0] != '\'' {
        return None;
    }
    let n1 = fold(rest[1]);
    if matches!(n1, 's' | 't' | 'm' | 'd') {
        return Some(2);
    }
    let n2 = fold(*rest.get(2)?);
    matches!((n1, n2), ('r', 'e') | ('v', 'e') | ('l', 'l')).then_some(3)
}

/// Where `\s+(?!\S) | \s+` ends at `pos`, with `n_ws` whitespace chars there and the piece
/// ending at `end` (the lookahead sees only the piece): before the last of several whitespace
/// chars followed by more of the piece, else after the run; a position without whitespace
/// advances by one char.
fn whitespace_end(pos: usize, n_ws: usize, end: usize) -> usize {
    if n_ws > 1 && pos + n_ws < end {
        pos + n_ws - 1
    } else if n_ws > 0 {
        pos + n_ws
    } else {
        pos + 1
    }
}

/// The LLaMA-3 split of `piece`, alternatives tried in regex order at each position.
fn llama3_split(
    chars: &[char],
    piece: Range<usize>,
    out: &mut Vec<Range<usize>>,
    max_digits: usize,
) {
    let end = piece.end;
    let flags = |p: usize| -> Option<Flags> { (p < end).then(|| Flags::of(chars[p])) };
    let is = |p: usize, f: fn(&Flags) -> bool| flags(p).as_ref().is_some_and(f);
    let lower = |c: char| c.to_lowercase().next().unwrap_or(c);
    let is_newline = |p: usize| p < end && matches!(chars[p], '\r' | '\n');

    let mut pos = piece.start;
    while pos < end {
        let c = chars[pos];
        let f = Flags::of(c);
        let tok_start = pos;
        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if let Some(n) = contraction(&chars[pos..end], lower) {
            pos += n;
            out.push(tok_start..pos);
            continue;
        }
        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(c == '\r' || c == '\n' || f.number) && (f.letter || is(pos + 1, |g| g.letter)) {
            pos += 1;
            while is(pos, |g| g.letter) {
                pos += 1;
            }
            out.push(tok_start..pos);
            continue;
        }
        // \p{N}{1,max_digits}
        if f.number {
            let mut run = 0;
            while is(pos, |g| g.number) {
                pos += 1;
                run += 1;
                if run == max_digits {
                    out.push(pos - run..pos);
                    run = 0;
                }
            }
            if run > 0 {
                out.push(pos - run..pos);
            }
            continue;
        }
        // ' ?[^\s\p{L}\p{N}]+[\r\n]*'. A lone space at the end of the piece is taken here as
        // well (as llama.cpp does); `\s+` would give the same word.
        let f2 = if c == ' ' { flags(pos + 1) } else { Some(f) };
        let other = |g: &Flags| !(g.letter || g.number || g.whitespace);
        if f2.as_ref().is_none_or(other) {
            pos += usize::from(c == ' ');
            while is(pos, |g| !(g.letter || g.number || g.whitespace)) {
                pos += 1;
            }
            while is_newline(pos) {
                pos += 1;
            }
            out.push(tok_start..pos);
            continue;
        }
        // \s*[\r\n]+ | \s+(?!\S) | \s+
        let mut n_ws = 0;
        let mut last_newline_end = None;
        while is(pos + n_ws, |g| g.whitespace) {
            if is_newline(pos + n_ws) {
                last_newline_end = Some(pos + n_ws + 1);
            }
            n_ws += 1;
        }
        pos = last_newline_end.unwrap_or_else(|| whitespace_end(pos, n_ws, end));
        out.push(tok_start..pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: PreTokenizer, text: &str) -> Vec<&str> {
        pre.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_split_follows_the_regex() {
        let p = PreTokenizer::Gpt2;
        assert_eq!(words(p, "Hello world"), ["Hello", " world"]);
        assert_eq!(
            words(p, "I've been 'told"),
            ["I", "'ve", " been", " '", "told"]
        );
        assert_eq!(words(p, "   Hello"), ["  ", " Hello"]);
        assert_eq!(words(p, "a  \n\n b"), ["a", "  \n\n", " b"]);
        assert_eq!(words(p, "x   "), ["x", "   "]);
        assert_eq!(words(p, "3.14!!"), ["3", ".", "14", "!!"]);
        assert_eq!(words(p, " 😀😀 ok"), [" 😀😀", " ok"]);
        assert_eq!(words(p, ""), Vec::<&str>::new());
        assert_eq!(words(p, "\t\n"), ["\t\n"]);
    }

    #[test]
    fn falcon_splits_punctuation_first_and_digits_in_threes() {
        let p = PreTokenizer::Falcon;
        // The punctuation step isolates "'" so the contraction rule never fires.
        assert_eq!(words(p, "I've"), ["I", "'", "ve"]);
        assert_eq!(words(p, "1234567"), ["123", "456", "7"]);
        assert_eq!(words(p, " 3333"), [" ", "333", "3"]);
        assert_eq!(words(p, "a+=`b"), ["a", "+=`", "b"]);
    }

    #[test]
    fn default_and_starcoder_split_numbers() {
        assert_eq!(
            words(PreTokenizer::Default, "x`1234"),
            ["x", "`", "123", "4"]
        );
        assert_eq!(
            words(PreTokenizer::StarCoder, " 123a"),
            [" ", "1", "2", "3", "a"]
        );
    }

    #[test]
    fn llama3_split_follows_the_regex() {
        let p = PreTokenizer::Llama3;
        assert_eq!(
            words(p, "I'VE 1234567"),
            ["I", "'VE", " ", "123", "456", "7"]
        );
        assert_eq!(words(p, "a  \n\n b"), ["a", "  \n\n", " b"]);
        assert_eq!(words(p, "(hello)\r\nx"), ["(hello", ")\r\n", "x"]);
        assert_eq!(words(p, "x   y"), ["x", "  ", " y"]);
        assert_eq!(words(p, "x "), ["x", " "]);
        assert_eq!(words(PreTokenizer::Qwen2, "x123"), ["x", "1", "2", "3"]);
        assert!(p.ignores_merges() && p.adds_bos_by_default() && p.cleans_spaces());
        assert!(!PreTokenizer::Qwen2.cleans_spaces() && !PreTokenizer::Qwen2.ignores_merges());
    }

    #[test]
    fn names() {
        assert_eq!(
            PreTokenizer::from_gguf_name(None),
            Some(PreTokenizer::Default)
        );
        assert_eq!(
            PreTokenizer::from_gguf_name(Some("falcon")),
            Some(PreTokenizer::Falcon)
        );
        assert_eq!(
            PreTokenizer::from_gguf_name(Some("gpt-2")),
            Some(PreTokenizer::Gpt2)
        );
        assert_eq!(
            PreTokenizer::from_gguf_name(Some("llama-bpe")),
            Some(PreTokenizer::Llama3)
        );
        assert_eq!(PreTokenizer::from_gguf_name(Some("deepseek-llm")), None);
        for name in PreTokenizer::SUPPORTED_NAMES {
            assert!(PreTokenizer::from_gguf_name(Some(name)).is_some(), "{name}");
        }
    }
}
