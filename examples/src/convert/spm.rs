//! A SentencePiece `tokenizer.model` reader (protobuf `ModelProto`), without a protobuf crate.
//!
//! Only what the converter needs is decoded: the pieces (field 1: `piece` = 1, `score` = 2,
//! `type` = 3) and, for information, the trainer's special ids (field 2: `unk_id` = 40,
//! `bos_id` = 41, `eos_id` = 42, `pad_id` = 43). Every other field is skipped by wire type.

/// GGUF token type of a normal piece.
pub const TOKEN_NORMAL: i32 = 1;
/// GGUF token type of the unknown piece.
pub const TOKEN_UNKNOWN: i32 = 2;
/// GGUF token type of a control piece (`<s>`, `</s>`).
pub const TOKEN_CONTROL: i32 = 3;
/// GGUF token type of a user-defined piece (never written by convert.py, see [`SpmModel`]).
pub const TOKEN_USER_DEFINED: i32 = 4;
/// GGUF token type of an unused piece.
pub const TOKEN_UNUSED: i32 = 5;
/// GGUF token type of a byte piece (`<0x41>`).
pub const TOKEN_BYTE: i32 = 6;

/// The vocabulary of a SentencePiece model, as PowerInfer's convert.py writes it.
///
/// Token types follow convert.py's `SentencePieceVocab`: normal 1, unknown 2, control 3,
/// unused 5, byte 6; user-defined pieces are written as normal (1), because convert.py's
/// user-defined check is commented out.
#[derive(Clone, Debug, PartialEq)]
pub struct SpmModel {
    /// Piece strings, by id.
    pub tokens: Vec<String>,
    /// Piece scores, by id.
    pub scores: Vec<f32>,
    /// GGUF token types, by id.
    pub token_types: Vec<i32>,
    /// `trainer_spec.unk_id` (default 0).
    pub unk_id: i32,
    /// `trainer_spec.bos_id` (default 1).
    pub bos_id: i32,
    /// `trainer_spec.eos_id` (default 2).
    pub eos_id: i32,
    /// `trainer_spec.pad_id` (default -1).
    pub pad_id: i32,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn done(&self) -> bool {
        self.pos >= self.bytes.len()
    }

    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = *self
                .bytes
                .get(self.pos)
                .ok_or_else(|| format!("truncated varint at byte {}", self.pos))?;
            self.pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(format!("varint longer than 10 bytes at byte {}", self.pos))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| format!("field of {n} bytes at byte {} runs past the end", self.pos))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next (field number, wire type).
    fn key(&mut self) -> Result<(u64, u8), String> {
        let k = self.varint()?;
        Ok((k >> 3, (k & 7) as u8))
    }

    fn len_delimited(&mut self) -> Result<&'a [u8], String> {
        let n = self.varint()?;
        let n = usize::try_from(n).map_err(|_| format!("length {n} too large"))?;
        self.take(n)
    }

    fn skip(&mut self, wire: u8) -> Result<(), String> {
        match wire {
            0 => self.varint().map(|_| ()),
            1 => self.take(8).map(|_| ()),
            2 => self.len_delimited().map(|_| ()),
            5 => self.take(4).map(|_| ()),
            w => Err(format!("unsupported wire type {w} at byte {}", self.pos)),
        }
    }
}

fn parse_piece(bytes: &[u8]) -> Result<(String, f32, i32), String> {
    let mut r = Reader { bytes, pos: 0 };
    let (mut piece, mut score, mut ty) = (String::new(), 0.0f32, 1u64);
    while !r.done() {
        match r.key()? {
            (1, 2) => {
                piece = String::from_utf8(r.len_delimited()?.to_vec())
                    .map_err(|_| "a piece is not UTF-8".to_string())?
            }
            (2, 5) => {
                let b = r.take(4)?;
                score = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            (3, 0) => ty = r.varint()?,
            (_, w) => r.skip(w)?,
        }
    }
    // SentencePiece Type enum: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, BYTE 6, UNUSED 5.
    let gguf_type = match ty {
        2 => TOKEN_UNKNOWN,
        3 => TOKEN_CONTROL,
        5 => TOKEN_UNUSED,
        6 => TOKEN_BYTE,
        1 | 4 => TOKEN_NORMAL,
        t => return Err(format!("piece {piece:?} has unknown type {t}")),
    };
    Ok((piece, score, gguf_type))
}

impl SpmModel {
    /// Parses the bytes of a `tokenizer.model`. The error says what is wrong and where.
    pub fn parse(bytes: &[u8]) -> Result<SpmModel, String> {
        let mut m = SpmModel {
            tokens: Vec::new(),
            scores: Vec::new(),
            token_types: Vec::new(),
            unk_id: 0,
            bos_id: 1,
            eos_id: 2,
            pad_id: -1,
        };
        let mut r = Reader { bytes, pos: 0 };
        while !r.done() {
            match r.key()? {
                (1, 2) => {
                    let (p, s, t) = parse_piece(r.len_delimited()?)
                        .map_err(|e| format!("piece {}: {e}", m.tokens.len()))?;
                    m.tokens.push(p);
                    m.scores.push(s);
                    m.token_types.push(t);
                }
                (2, 2) => {
                    let mut t = Reader {
                        bytes: r.len_delimited()?,
                        pos: 0,
                    };
                    while !t.done() {
                        match t.key()? {
                            // int32 fields: negative values are 10-byte varints.
                            (40, 0) => m.unk_id = t.varint()? as i32,
                            (41, 0) => m.bos_id = t.varint()? as i32,
                            (42, 0) => m.eos_id = t.varint()? as i32,
                            (43, 0) => m.pad_id = t.varint()? as i32,
                            (_, w) => t.skip(w)?,
                        }
                    }
                }
                (_, w) => r.skip(w)?,
            }
        }
        if m.tokens.is_empty() {
            return Err("no pieces (not a SentencePiece model?)".into());
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(out: &mut Vec<u8>, mut v: u64) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    #[test]
    fn parses_pieces_trainer_ids_and_skips_unknown_fields() {
        let mut piece = Vec::new();
        piece.extend([0x0a, 2, b'a', b'b']);
        piece.push(0x15);
        piece.extend((-1.5f32).to_le_bytes());
        piece.extend([0x18, 6]);
        let mut model = Vec::new();
        // An unknown fixed64 field first.
        model.push((9 << 3) | 1);
        model.extend([0u8; 8]);
        model.push(0x0a);
        varint(&mut model, piece.len() as u64);
        model.extend(&piece);
        let mut trainer = Vec::new();
        varint(&mut trainer, 41 << 3);
        varint(&mut trainer, 5);
        varint(&mut trainer, 43 << 3);
        varint(&mut trainer, (-1i64) as u64);
        model.push(0x12);
        varint(&mut model, trainer.len() as u64);
        model.extend(&trainer);
        let m = SpmModel::parse(&model).unwrap();
        assert_eq!(m.tokens, ["ab"]);
        assert_eq!(m.scores, [-1.5]);
        assert_eq!(m.token_types, [TOKEN_BYTE]);
        assert_eq!((m.unk_id, m.bos_id, m.eos_id, m.pad_id), (0, 5, 2, -1));
        assert!(SpmModel::parse(&model[..model.len() - 1]).is_err());
        assert!(SpmModel::parse(&[]).is_err());
    }
}
