//! Character classes used by the pre-tokenizers, and GPT-2's byte <-> unicode alphabet.
//!
//! The classes follow llama.cpp's tables: a char is a letter if its General Category is L*,
//! a number if N*, punctuation if P*; whitespace is the Unicode `White_Space` property (what
//! Python's `regex` module calls `\s`, from which llama.cpp's table was generated).

use unicode_general_category::{get_general_category, GeneralCategory as G};

/// The coarse General Category of a char (the first letter of its category name).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    /// L*.
    Letter,
    /// N*.
    Number,
    /// P*.
    Punctuation,
    /// Anything else (M*, S*, Z*, C*).
    Other,
}

/// The coarse category of `c`.
pub(crate) fn class(c: char) -> Class {
    if c.is_ascii() {
        return if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Number
        } else if c.is_ascii_punctuation()
            && !matches!(c, '$' | '+' | '<' | '=' | '>' | '^' | '`' | '|' | '~')
        {
            Class::Punctuation
        } else {
            Class::Other
        };
    }
    match get_general_category(c) {
        G::UppercaseLetter
        | G::LowercaseLetter
        | G::TitlecaseLetter
        | G::ModifierLetter
        | G::OtherLetter => Class::Letter,
        G::DecimalNumber | G::LetterNumber | G::OtherNumber => Class::Number,
        G::ConnectorPunctuation
        | G::DashPunctuation
        | G::OpenPunctuation
        | G::ClosePunctuation
        | G::InitialPunctuation
        | G::FinalPunctuation
        | G::OtherPunctuation => Class::Punctuation,
        _ => Class::Other,
    }
}

/// Flags of one char as the GPT-2 splitter needs them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags {
    /// `\p{L}`.
    pub letter: bool,
    /// `\p{N}`.
    pub number: bool,
    /// `\s`.
    pub whitespace: bool,
}

impl Flags {
    /// The flags of `c`.
    pub fn of(c: char) -> Flags {
        let cl = class(c);
        Flags {
            letter: cl == Class::Letter,
            number: cl == Class::Number,
            whitespace: c.is_whitespace(),
        }
    }
}

/// The char that stands for byte `b` in GPT-2's byte-level alphabet: printable Latin-1 bytes
/// stand for themselves, the other 68 bytes map in order to U+0100..=U+0143.
pub(crate) fn byte_to_char(b: u8) -> char {
    let cp = match b {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => u32::from(b),
        0x00..=0x20 => 0x100 + u32::from(b),
        0x7F..=0xA0 => 0x100 + 33 + u32::from(b - 0x7F),
        0xAD => 0x100 + 33 + 34,
    };
    // Every value above is below U+0144, so always a valid char.
    char::from_u32(cp).unwrap_or('\u{FFFD}')
}

/// The byte that `c` stands for in GPT-2's alphabet, or `None` for chars outside it.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let cp = u32::from(c);
    match cp {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => Some(cp as u8),
        0x100..=0x120 => Some((cp - 0x100) as u8),
        0x121..=0x142 => Some((cp - 0x121 + 0x7F) as u8),
        0x143 => Some(0xAD),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_a_bijection() {
        let mut seen = std::collections::HashSet::new();
        for b in 0..=255u8 {
            let c = byte_to_char(b);
            assert!(seen.insert(c), "byte {b:#x} maps to a char already used");
            assert_eq!(char_to_byte(c), Some(b));
        }
        assert_eq!(byte_to_char(b' '), '\u{120}'); // 'Ġ'
        assert_eq!(byte_to_char(b'\n'), '\u{10A}'); // 'Ċ'
        assert_eq!(byte_to_char(0xAD), '\u{143}');
        assert_eq!(char_to_byte('\u{144}'), None);
        assert_eq!(char_to_byte(' '), None);
    }

    #[test]
    fn classes_match_general_category() {
        assert_eq!(class('a'), Class::Letter);
        assert_eq!(class('Ж'), Class::Letter);
        assert_eq!(class('我'), Class::Letter);
        assert_eq!(class('7'), Class::Number);
        assert_eq!(class('½'), Class::Number);
        assert_eq!(class('Ⅳ'), Class::Number);
        assert_eq!(class('!'), Class::Punctuation);
        assert_eq!(class('_'), Class::Punctuation);
        assert_eq!(class('$'), Class::Other); // Sc
        assert_eq!(class('+'), Class::Other); // Sm
        assert_eq!(class('`'), Class::Other); // Sk
        assert_eq!(class('…'), Class::Punctuation);
        assert_eq!(class('\u{0301}'), Class::Other); // combining accent: Mn
        assert_eq!(class('😀'), Class::Other); // So
                                               // ASCII fast path agrees with the table.
        for c in (0u8..128).map(char::from) {
            let table = match get_general_category(c) {
                G::UppercaseLetter | G::LowercaseLetter => Class::Letter,
                G::DecimalNumber => Class::Number,
                G::ConnectorPunctuation
                | G::DashPunctuation
                | G::OpenPunctuation
                | G::ClosePunctuation
                | G::OtherPunctuation => Class::Punctuation,
                _ => Class::Other,
            };
            assert_eq!(class(c), table, "{c:?}");
        }
    }

    #[test]
    fn whitespace_is_the_white_space_property() {
        for c in [
            '\t', '\n', '\u{0B}', '\u{0C}', '\r', ' ', '\u{85}', '\u{A0}', '\u{3000}',
        ] {
            assert!(Flags::of(c).whitespace, "{c:?}");
        }
        // Python's str.isspace() says yes to these, the White_Space property (and llama.cpp) no.
        for c in ['\u{1C}', '\u{1F}', '\u{200B}'] {
            assert!(!Flags::of(c).whitespace, "{c:?}");
        }
    }
}
