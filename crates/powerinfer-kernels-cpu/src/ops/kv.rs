//! A KV cache's rows in the type it stores them in (llama.cpp's `-ctk`/`-ctv`): [`KvType`],
//! one layer's rows of one sequence ([`KvBuf`]) and the view the attention reads ([`KvView`]).
//!
//! # Layouts
//! - `F16`: row-major `[n_pos][n_kv_head][head_dim]` f16, as [`super::attention`] documents
//!   (its fast paths read it).
//! - every other type (`F32`, `BF16`, `Q8_0`, `Q4_0`): head-major, each kv head's rows
//!   contiguous, `head_dim` values in the type's blocks (a quantized type's block never spans
//!   two heads, so `head_dim` must be a multiple of its block). A head's rows are then a matrix
//!   of `n_pos` rows the row kernels of the matrix products read as they read weights: the
//!   scores are one dot product of each K row with the query quantized once (Q8_0 for the
//!   quantized types, as the quantized products), the output one axpy of each V row.
//!
//! Rows cross between a cache and a device's store in one canonical form, row-major bytes of
//! the type (`[n_pos][n_kv_head][head_dim]`, whole blocks), copied bit for bit: a row is
//! quantized once, when it is stored.

use half::f16;
use half::slice::HalfFloatSliceExt;
use powerinfer_gguf::quants::{dequantize, quantize};
use powerinfer_gguf::GgmlType;

use crate::KernelError;

/// The type a KV cache stores its rows in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvType {
    /// Half precision (the default).
    #[default]
    F16,
    /// Single precision.
    F32,
    /// bfloat16.
    BF16,
    /// 8-bit blocks of 32 with an f16 scale (half the bytes of F16).
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale (a quarter of F16's bytes and a bit).
    Q4_0,
}

impl KvType {
    /// Every type, by the names [`KvType::name`] gives.
    pub const ALL: [KvType; 5] = [
        KvType::F16,
        KvType::F32,
        KvType::BF16,
        KvType::Q8_0,
        KvType::Q4_0,
    ];

    /// llama.cpp's name (`f16`, `q8_0`, ...).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
            KvType::BF16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }

    /// The ggml type of its rows.
    pub fn ggml(self) -> GgmlType {
        match self {
            KvType::F16 => GgmlType::F16,
            KvType::F32 => GgmlType::F32,
            KvType::BF16 => GgmlType::BF16,
            KvType::Q8_0 => GgmlType::Q8_0,
            KvType::Q4_0 => GgmlType::Q4_0,
        }
    }

    /// Values per block (1 for the float types).
    pub fn block(self) -> usize {
        self.ggml().block_size()
    }

    /// Bytes of `n` values (`n` a multiple of the block).
    pub fn bytes_of(self, n: usize) -> usize {
        n / self.block() * self.ggml().type_size()
    }

    /// Whether a head of `head_dim` values is whole blocks of this type; else the error that
    /// says so.
    pub fn check_head(self, head_dim: usize) -> Result<(), KernelError> {
        if head_dim > 0 && head_dim % self.block() == 0 {
            Ok(())
        } else {
            Err(KernelError::Shape(format!(
                "a KV cache of {} holds heads of a multiple of {} values; this model's have {}",
                self.name(),
                self.block(),
                head_dim
            )))
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvType {
    type Err = String;

    /// A name of [`KvType::ALL`] (case does not matter).
    fn from_str(s: &str) -> Result<KvType, String> {
        let l = s.to_ascii_lowercase();
        KvType::ALL
            .into_iter()
            .find(|t| t.name() == l)
            .ok_or_else(|| {
                let names: Vec<&str> = KvType::ALL.iter().map(|t| t.name()).collect();
                format!("`{s}`: expected a KV cache type: {}", names.join(", "))
            })
    }
}

/// One layer's cached K or V rows, as the attention reads them (see the [module docs](self)).
#[derive(Clone, Copy, Debug)]
pub enum KvView<'a> {
    /// Row-major f16 rows.
    F16(&'a [f16]),
    /// Head-major rows of another type.
    Heads {
        /// Their type.
        ty: KvType,
        /// Head `h`'s rows start at byte `h · head_stride`.
        data: &'a [u8],
        /// Bytes between two heads' first rows.
        head_stride: usize,
        /// Rows (positions).
        n_pos: usize,
    },
}

impl<'a> KvView<'a> {
    /// Its type.
    pub fn ty(&self) -> KvType {
        match self {
            KvView::F16(_) => KvType::F16,
            KvView::Heads { ty, .. } => *ty,
        }
    }

    /// Rows (positions), for rows of `kv_row` values.
    pub fn n_pos(&self, kv_row: usize) -> usize {
        match self {
            KvView::F16(k) => k.len().checked_div(kv_row).unwrap_or(0),
            KvView::Heads { n_pos, .. } => *n_pos,
        }
    }
}

/// One layer's K or V rows of one sequence in their type, growing with its positions.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBuf {
    ty: KvType,
    n_head: usize,
    head_dim: usize,
    n_pos: usize,
    /// F16: the rows, row-major.
    f16: Vec<f16>,
    /// Other types: `n_head` regions of `cap` rows each (head-major).
    bytes: Vec<u8>,
    cap: usize,
}

impl KvBuf {
    /// An empty buffer of rows of `n_head` heads of `head_dim` values of `ty`.
    ///
    /// Errors: `head_dim` is not whole blocks of `ty`.
    pub fn new(ty: KvType, n_head: usize, head_dim: usize) -> Result<KvBuf, KernelError> {
        ty.check_head(head_dim)?;
        Ok(KvBuf {
            ty,
            n_head,
            head_dim,
            n_pos: 0,
            f16: Vec::new(),
            bytes: Vec::new(),
            cap: 0,
        })
    }

    /// Its type.
    pub fn ty(&self) -> KvType {
        self.ty
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.n_pos
    }

    /// Whether it holds no row.
    pub fn is_empty(&self) -> bool {
        self.n_pos == 0
    }

    /// Values of a row (all heads).
    pub fn row_values(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Bytes of a row in the type.
    pub fn row_bytes(&self) -> usize {
        self.ty.bytes_of(self.row_values())
    }

    fn head_bytes(&self) -> usize {
        self.ty.bytes_of(self.head_dim)
    }

    /// Bytes of the rows held.
    pub fn bytes(&self) -> usize {
        self.n_pos * self.row_bytes()
    }

    /// Room for `n` rows in every head's region (moving the regions apart).
    fn grow(&mut self, n: usize) {
        if n <= self.cap {
            return;
        }
        let cap = n.max(2 * self.cap).max(16);
        let hb = self.head_bytes();
        let mut bytes = vec![0u8; self.n_head * cap * hb];
        for h in 0..self.n_head {
            let used = self.n_pos * hb;
            bytes[h * cap * hb..][..used].copy_from_slice(&self.bytes[h * self.cap * hb..][..used]);
        }
        self.bytes = bytes;
        self.cap = cap;
    }

    /// Appends rows given in f32 (`n · row_values` values), converted to the type (quantized
    /// once, here).
    pub fn push_f32(&mut self, rows: &[f32]) -> Result<(), KernelError> {
        let rv = self.row_values();
        if rows.len() % rv != 0 {
            return Err(KernelError::Shape(format!(
                "KV rows of {} values for rows of {rv}",
                rows.len()
            )));
        }
        let n = rows.len() / rv;
        if self.ty == KvType::F16 {
            let old = self.f16.len();
            self.f16.resize(old + rows.len(), f16::ZERO);
            self.f16[old..].convert_from_f32_slice(rows);
        } else {
            self.grow(self.n_pos + n);
            let (hb, d, cap) = (self.head_bytes(), self.head_dim, self.cap);
            for (i, row) in rows.chunks_exact(rv).enumerate() {
                for (h, head) in row.chunks_exact(d).enumerate() {
                    let at = (h * cap + self.n_pos + i) * hb;
                    quantize(self.ty.ggml(), head, &mut self.bytes[at..][..hb])
                        .map_err(|e| KernelError::Shape(format!("KV rows: {e}")))?;
                }
            }
        }
        self.n_pos += n;
        Ok(())
    }

    /// Appends rows in the canonical form (row-major bytes of the type, whole rows), bit for
    /// bit.
    pub fn push_bytes(&mut self, rows: &[u8]) -> Result<(), KernelError> {
        let rb = self.row_bytes();
        if rows.len() % rb != 0 {
            return Err(KernelError::Shape(format!(
                "KV rows of {} bytes for rows of {rb}",
                rows.len()
            )));
        }
        let n = rows.len() / rb;
        if self.ty == KvType::F16 {
            self.f16.extend(
                rows.chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]])),
            );
        } else {
            self.grow(self.n_pos + n);
            let (hb, cap) = (self.head_bytes(), self.cap);
            for (i, row) in rows.chunks_exact(rb).enumerate() {
                for (h, head) in row.chunks_exact(hb).enumerate() {
                    self.bytes[(h * cap + self.n_pos + i) * hb..][..hb].copy_from_slice(head);
                }
            }
        }
        self.n_pos += n;
        Ok(())
    }

    /// Rows `from .. from + n` in the canonical form.
    pub fn rows_bytes(&self, from: usize, n: usize) -> Result<Vec<u8>, KernelError> {
        self.check_range(from, n)?;
        let rb = self.row_bytes();
        let mut out = Vec::with_capacity(n * rb);
        if self.ty == KvType::F16 {
            let rv = self.row_values();
            for x in &self.f16[from * rv..(from + n) * rv] {
                out.extend_from_slice(&x.to_le_bytes());
            }
        } else {
            let (hb, cap) = (self.head_bytes(), self.cap);
            for p in from..from + n {
                for h in 0..self.n_head {
                    out.extend_from_slice(&self.bytes[(h * cap + p) * hb..][..hb]);
                }
            }
        }
        Ok(out)
    }

    /// Rows `from .. from + n` in f32 (row-major, dequantized).
    pub fn rows_f32(&self, from: usize, n: usize) -> Result<Vec<f32>, KernelError> {
        let bytes = self.rows_bytes(from, n)?;
        let mut out = vec![0f32; n * self.row_values()];
        dequantize(self.ty.ggml(), &bytes, &mut out)
            .map_err(|e| KernelError::Shape(format!("KV rows: {e}")))?;
        Ok(out)
    }

    fn check_range(&self, from: usize, n: usize) -> Result<(), KernelError> {
        match from.checked_add(n) {
            Some(end) if end <= self.n_pos => Ok(()),
            _ => Err(KernelError::Shape(format!(
                "KV rows {from}..{} of {}",
                from.saturating_add(n),
                self.n_pos
            ))),
        }
    }

    /// Keeps the first `n` rows (no-op when it holds fewer).
    pub fn truncate(&mut self, n: usize) {
        if n >= self.n_pos {
            return;
        }
        self.n_pos = n;
        if self.ty == KvType::F16 {
            self.f16.truncate(n * self.row_values());
        }
    }

    /// Removes rows `from .. from + n`, moving the later ones down.
    pub fn remove(&mut self, from: usize, n: usize) -> Result<(), KernelError> {
        self.check_range(from, n)?;
        if self.ty == KvType::F16 {
            let rv = self.row_values();
            self.f16.drain(from * rv..(from + n) * rv);
        } else {
            let (hb, cap) = (self.head_bytes(), self.cap);
            for h in 0..self.n_head {
                let region = &mut self.bytes[h * cap * hb..][..self.n_pos * hb];
                region.copy_within((from + n) * hb.., from * hb);
            }
        }
        self.n_pos -= n;
        Ok(())
    }

    /// Replaces rows `from ..` (as many as `rows` holds, f32) with `rows` converted to the
    /// type: a context shift's re-rotated keys.
    pub fn overwrite_f32(&mut self, from: usize, rows: &[f32]) -> Result<(), KernelError> {
        let rv = self.row_values();
        let n = rows.len() / rv.max(1);
        self.check_range(from, n)?;
        let tail = self.n_pos - from - n;
        let keep = self.rows_bytes(from + n, tail)?;
        self.truncate(from);
        self.push_f32(rows)?;
        self.push_bytes(&keep)
    }

    /// The rows as the attention reads them.
    pub fn view(&self) -> KvView<'_> {
        match self.ty {
            KvType::F16 => KvView::F16(&self.f16),
            ty => KvView::Heads {
                ty,
                data: &self.bytes,
                head_stride: self.cap * self.head_bytes(),
                n_pos: self.n_pos,
            },
        }
    }

    /// The rows of an F16 buffer as f16 values (`None` for the other types).
    pub fn as_f16(&self) -> Option<&[f16]> {
        (self.ty == KvType::F16).then_some(&self.f16[..])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_cross_bit_for_bit_and_move_as_whole_rows() {
        for ty in KvType::ALL {
            let mut a = KvBuf::new(ty, 2, 64).unwrap();
            let rows: Vec<f32> = (0..5 * 128)
                .map(|i| ((i * 37) % 101) as f32 * 0.01 - 0.5)
                .collect();
            a.push_f32(&rows).unwrap();
            assert_eq!((a.len(), a.bytes()), (5, 5 * ty.bytes_of(128)), "{ty}");
            let canon = a.rows_bytes(0, 5).unwrap();
            let mut b = KvBuf::new(ty, 2, 64).unwrap();
            b.push_bytes(&canon).unwrap();
            assert_eq!(b.rows_bytes(0, 5).unwrap(), canon, "{ty}");
            // Dropping rows 1 and 2 keeps rows 0, 3, 4.
            let want: Vec<u8> = [a.rows_bytes(0, 1).unwrap(), a.rows_bytes(3, 2).unwrap()].concat();
            b.remove(1, 2).unwrap();
            assert_eq!(b.rows_bytes(0, 3).unwrap(), want, "{ty}");
            b.truncate(1);
            assert_eq!(b.len(), 1);
            assert!(b.rows_bytes(0, 2).is_err());
            // Growing past the first regions keeps every head's rows.
            let many: Vec<f32> = (0..40 * 128).map(|i| (i % 7) as f32).collect();
            b.push_f32(&many).unwrap();
            assert_eq!(
                b.rows_bytes(0, 1).unwrap(),
                a.rows_bytes(0, 1).unwrap(),
                "{ty}"
            );
            let back = b.rows_f32(1, 40).unwrap();
            for (x, y) in back.iter().zip(&many) {
                assert!((x - y).abs() <= 0.5, "{ty}: {x} for {y}");
            }
        }
    }

    #[test]
    fn heads_must_be_whole_blocks() {
        assert!(KvBuf::new(KvType::Q8_0, 4, 80).is_err());
        assert!(KvBuf::new(KvType::Q4_0, 4, 96).is_ok());
        assert!(KvBuf::new(KvType::F16, 4, 80).is_ok());
        assert_eq!("Q8_0".parse::<KvType>(), Ok(KvType::Q8_0));
        let e = "q5_0".parse::<KvType>().unwrap_err();
        assert!(e.contains("f16, f32, bf16, q8_0, q4_0"), "{e}");
    }
}
