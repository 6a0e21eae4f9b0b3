//! The weight views of the matrix kernels: [`Weights`] (a borrowed matrix in ggml layout) and
//! [`PackedQ4_0`] (an owned, repacked Q4_0 copy for [`MatMul::gemv_packed`](super::MatMul::gemv_packed)).

use super::rowops::SUPPORTED;
use crate::error::KernelError;
use powerinfer_gguf::GgmlType;
use std::ops::Range;

/// A Q4_0 matrix repacked for the one-token product ([`MatMul::pack_q4_0`](super::MatMul::pack_q4_0),
/// [`MatMul::gemv_packed`](super::MatMul::gemv_packed)): rows in interleaved groups of eight (the same bytes per row as
/// ggml's layout), the rows after the last whole group in ggml's layout. An owned copy: the
/// original (e.g. a memory-mapped file) is not needed by `gemv_packed`.
#[derive(Clone, Debug)]
pub struct PackedQ4_0 {
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Whole groups, interleaved, in page-aligned storage (the kernel's 32-byte loads then
    /// never straddle two lines); `groups_len` bytes of it are used.
    pub(super) groups: PageBuf,
    pub(super) groups_len: usize,
    /// The remaining `rows % 8` rows, ggml layout.
    pub(super) tail: Vec<u8>,
}

impl PackedQ4_0 {
    /// Rows of the matrix.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns of the matrix.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes held (the size of the original matrix).
    pub fn bytes(&self) -> usize {
        self.groups_len + self.tail.len()
    }

    #[cfg_attr(not(all(target_arch = "x86_64", powerinfer_avx512)), allow(dead_code))]
    pub(super) fn group_data(&self) -> &[u8] {
        &self.groups.bytes()[..self.groups_len]
    }
}

/// Page-aligned anonymous memory, zero until written, with transparent huge pages requested on
/// Linux: no page is touched before its first writer touches it, so the threads that fill a
/// copy fault its pages in, in parallel, 2 MiB at a time where the OS grants huge pages (much
/// faster to make than `Vec`s zeroed by one thread; measurements: `docs/tuning.md`).
///
/// A buffer of at least 2 MiB starts on a 2 MiB boundary (2 MiB more address space is mapped
/// and never touched), so that every whole 2 MiB of it can be a huge page: mapped where the
/// OS put them, the copies of small matrices got almost none.
pub(super) struct PageBuf {
    map: memmap2::MmapMut,
    /// Where the buffer starts in `map`.
    off: usize,
    len: usize,
}

/// The transparent huge page size of x86-64 and of aarch64 with 4 KiB pages.
const HUGE_PAGE: usize = 2 << 20;

impl PageBuf {
    /// `len` zero bytes (at least one page), or `None` where the OS refuses the memory.
    #[cfg_attr(not(all(target_arch = "x86_64", powerinfer_avx512)), allow(dead_code))]
    pub(super) fn zeroed(len: usize) -> Option<PageBuf> {
        let extra = if len >= HUGE_PAGE { HUGE_PAGE } else { 0 };
        let map = memmap2::MmapMut::map_anon(len.checked_add(extra)?.max(1)).ok()?;
        #[cfg(target_os = "linux")]
        {
            // Only a hint: without transparent huge pages the memory is still correct.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        let p = map.as_ptr() as usize;
        let off = if extra > 0 {
            p.next_multiple_of(HUGE_PAGE) - p
        } else {
            0
        };
        Some(PageBuf { map, off, len })
    }

    /// The buffer.
    fn bytes(&self) -> &[u8] {
        &self.map[self.off..self.off + self.len]
    }

    /// The buffer, writable.
    #[cfg_attr(not(all(target_arch = "x86_64", powerinfer_avx512)), allow(dead_code))]
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.off..self.off + self.len]
    }
}

impl Clone for PageBuf {
    fn clone(&self) -> PageBuf {
        let Some(mut copy) = PageBuf::zeroed(self.len) else {
            panic!("out of memory copying {} bytes", self.len);
        };
        copy.bytes_mut().copy_from_slice(self.bytes());
        copy
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageBuf({} bytes)", self.len)
    }
}

/// A borrowed weight matrix in ggml layout. See the [module docs](super).
#[derive(Clone, Copy, Debug)]
pub struct Weights<'a> {
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) row_bytes: usize,
    pub(super) data: &'a [u8],
}

impl<'a> Weights<'a> {
    /// Views `data` as `rows` rows of `cols` elements of type `ty`. Checks that `cols` is a whole
    /// number of blocks, that `data` has exactly `rows` rows, and that the kernels support `ty`.
    /// No alignment is required.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        data: &'a [u8],
    ) -> Result<Self, KernelError> {
        if !SUPPORTED.contains(&ty) {
            return Err(KernelError::UnsupportedType(ty));
        }
        let bs = ty.block_size();
        if cols % bs != 0 {
            return Err(KernelError::Shape(format!(
                "row length {cols} is not a multiple of the {} block size {bs}",
                ty.name()
            )));
        }
        let row_bytes = cols / bs * ty.type_size();
        let expected = rows.checked_mul(row_bytes).ok_or_else(|| {
            KernelError::Shape(format!("{rows} rows of {row_bytes} bytes overflow usize"))
        })?;
        if data.len() != expected {
            return Err(KernelError::Length {
                what: "weight data",
                expected,
                got: data.len(),
            });
        }
        Ok(Weights {
            ty,
            rows,
            cols,
            row_bytes,
            data,
        })
    }

    /// The element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }
    /// The raw data.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
    /// Rows `r` as a view of the same data (for splitting products across callers' own
    /// threads). An out-of-range `r` is an error; an empty one gives a view of no rows.
    pub fn row_range(&self, r: Range<usize>) -> Result<Weights<'a>, KernelError> {
        if r.start > r.end || r.end > self.rows {
            return Err(KernelError::Shape(format!(
                "rows {}..{} of a {}-row matrix",
                r.start, r.end, self.rows
            )));
        }
        Ok(Weights {
            rows: r.len(),
            data: &self.data[r.start * self.row_bytes..r.end * self.row_bytes],
            ..*self
        })
    }
    #[inline]
    pub(super) fn row(&self, i: usize) -> &'a [u8] {
        &self.data[i * self.row_bytes..(i + 1) * self.row_bytes]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buffers of 2 MiB and more start on a 2 MiB boundary (so their whole 2 MiB parts can be
    /// huge pages); every buffer is zero, as long as asked, writable, and cloned exactly.
    #[test]
    fn page_buf_alignment_and_contents() {
        for len in [1usize, 4096, HUGE_PAGE - 1, HUGE_PAGE, 3 * HUGE_PAGE + 123] {
            let mut b = PageBuf::zeroed(len).unwrap();
            assert_eq!(b.bytes().len(), len);
            assert!(b.bytes().iter().all(|&x| x == 0));
            if len >= HUGE_PAGE {
                assert_eq!(b.bytes().as_ptr() as usize % HUGE_PAGE, 0, "{len}");
            }
            b.bytes_mut()[len - 1] = 7;
            b.bytes_mut()[0] = 9;
            let c = b.clone();
            assert_eq!(c.bytes(), b.bytes());
            assert_eq!(format!("{c:?}"), format!("PageBuf({len} bytes)"));
        }
    }
}
