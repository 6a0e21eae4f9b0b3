//! A tensor's rows as a byte stream: generated and quantized in parallel blocks, what the
//! generator and the quantizer write.

use std::io::{self, Read};

use powerinfer_gguf::quants::{bytes_for_values, quantize as quantize_row};
use powerinfer_gguf::GgmlType;
use rayon::prelude::*;

/// Fills one row (its index, its values).
pub(super) type RowFn<'a> = dyn Fn(usize, &mut [f32]) + Sync + 'a;

/// Streams a tensor's rows, generated and converted in parallel blocks, as bytes.
pub(super) struct RowReader<'a> {
    pub(super) ty: GgmlType,
    pub(super) ne0: usize,
    pub(super) n_rows: usize,
    pub(super) next_row: usize,
    pub(super) gen: &'a RowFn<'a>,
    pub(super) buf: Vec<u8>,
    pub(super) pos: usize,
    pub(super) progress: &'a mut dyn FnMut(u64),
}

impl Read for RowReader<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        if self.pos == self.buf.len() {
            if self.next_row == self.n_rows {
                return Ok(0);
            }
            let row_bytes = bytes_for_values(self.ty, self.ne0).map_err(io::Error::other)?;
            let block = ((4usize << 20) / (self.ne0 * 4)).clamp(1, 4096);
            let end = (self.next_row + block).min(self.n_rows);
            let first = self.next_row;
            self.buf.resize((end - first) * row_bytes, 0);
            let (ty, ne0, gen) = (self.ty, self.ne0, self.gen);
            self.buf
                .par_chunks_mut(row_bytes)
                .enumerate()
                .try_for_each_init(
                    || vec![0.0f32; ne0],
                    |row, (k, dst)| {
                        gen(first + k, row);
                        quantize_row(ty, row, dst)
                    },
                )
                .map_err(io::Error::other)?;
            self.next_row = end;
            self.pos = 0;
            (self.progress)(self.buf.len() as u64);
        }
        let k = out.len().min(self.buf.len() - self.pos);
        out[..k].copy_from_slice(&self.buf[self.pos..self.pos + k]);
        self.pos += k;
        Ok(k)
    }
}
