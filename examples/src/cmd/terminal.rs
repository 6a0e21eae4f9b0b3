//! Model text on a terminal. A model's output is untrusted input for the terminal that shows
//! it: an escape sequence in it could move the cursor, rewrite what was printed, change the
//! window's title or worse. [`visible`] shows such characters instead of sending them;
//! [`ModelText`] applies it only when standard output is a terminal, so that files, pipes and
//! JSON keep the exact text.

use std::borrow::Cow;
use std::io::{IsTerminal, Write};

/// `text` with every control character but newline and tab made visible: the C0 controls and
/// DEL in caret notation (`^[` for ESC, `^M` for a carriage return, `^?` for DEL), the C1
/// controls (U+0080 to U+009F) as `<U+009B>`. Text without control characters is borrowed.
pub fn visible(text: &str) -> Cow<'_, str> {
    let shown = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !text.chars().any(shown) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            c if !shown(c) => out.push(c),
            '\u{7f}' => out.push_str("^?"),
            c if (c as u32) < 0x20 => {
                out.push('^');
                out.push(char::from(c as u8 + 0x40));
            }
            c => out.push_str(&format!("<U+{:04X}>", c as u32)),
        }
    }
    Cow::Owned(out)
}

/// Standard output for model text: [`visible`] when it is a terminal, the exact text
/// otherwise; each piece is flushed at once (text streams as it is generated).
pub struct ModelText {
    terminal: bool,
}

impl ModelText {
    /// Looks at whether standard output is a terminal.
    pub fn stdout() -> ModelText {
        ModelText {
            terminal: std::io::stdout().is_terminal(),
        }
    }

    /// Writes `piece` (errors, such as a closed pipe, end nothing here: the caller goes on).
    pub fn write(&self, piece: &str) {
        let mut out = std::io::stdout().lock();
        let text = if self.terminal {
            visible(piece)
        } else {
            Cow::Borrowed(piece)
        };
        let _ = out.write_all(text.as_bytes());
        let _ = out.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::visible;
    use std::borrow::Cow;

    #[test]
    fn control_characters_are_shown_not_sent() {
        assert!(matches!(visible("plain text\n\tand tab"), Cow::Borrowed(_)));
        assert_eq!(visible("\x1b[2J\x1b]0;title\x07"), "^[[2J^[]0;title^G");
        assert_eq!(visible("a\rb\x08c\x00"), "a^Mb^Hc^@");
        assert_eq!(visible("del\x7f"), "del^?");
        assert_eq!(visible("csi\u{9b}31m"), "csi<U+009B>31m");
        assert_eq!(visible("grüße, 世界 ✓\n"), "grüße, 世界 ✓\n");
    }
}
