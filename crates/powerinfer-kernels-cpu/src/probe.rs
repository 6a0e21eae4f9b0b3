//! Memory-read probes for benchmarks (not kernels): they read weight bytes the way the matrix
//! kernels do, without the arithmetic, and return a checksum so that the reads cannot be
//! optimised away. `powerinfer bench kernels` times them to get the memory ceilings it compares
//! the kernels with.

use crate::error::KernelError;
use crate::matmul::rowops::ListedRows;
use crate::matmul::{check_active, MatMul, Weights};
use crate::pool::ThreadPool;
use std::sync::atomic::{AtomicU64, Ordering};

/// Reads the bytes of the rows of `w` listed in `active` (strictly increasing, below
/// `rows`) with the row-sparse product's thread split and access order on `mm`'s pool, and on
/// AVX-512 its software prefetch stream, but no arithmetic; returns a checksum of them (the
/// wrapping sum of every row's little-endian u64 words, a row's last partial word byte by
/// byte). Timing it gives the memory ceiling of a sparse product over the same rows (with
/// every row listed: of a dense pass over the matrix): `powerinfer bench kernels` reports it as
/// `sparse_read`. Bad lists fail as in [`MatMul::sparse_gemv_indexed`].
pub fn read_rows(mm: &MatMul<'_>, w: &Weights<'_>, active: &[u32]) -> Result<u64, KernelError> {
    check_active(active, w.rows())?;
    let sum = AtomicU64::new(0);
    mm.pool().for_chunks(active.len(), |r| {
        let rows = ListedRows::whole(w.data(), w.row_bytes(), &active[r]);
        #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
        let s = if mm.backend() == crate::Backend::Avx512 {
            crate::matmul::x86::sparse::read_list(&rows, word_sum)
        } else {
            read_list_portable(&rows)
        };
        #[cfg(not(all(target_arch = "x86_64", powerinfer_avx512)))]
        let s = read_list_portable(&rows);
        sum.fetch_add(s, Ordering::Relaxed);
    });
    Ok(sum.into_inner())
}

/// Reads `bytes` front to back, each of `pool`'s threads its own contiguous part (cut at
/// multiples of 64 bytes), with plain loads and no software prefetch: the hardware
/// prefetchers alone. Returns the wrapping sum of `bytes` as little-endian u64 words (a last
/// partial word byte by byte), the checksum [`read_rows`] gives for the same bytes. Timing it
/// gives the memory's plain sequential read rate. Which of the two reads memory faster depends
/// on the CPU (measurements: `docs/tuning.md`).
pub fn read_sequential(pool: &ThreadPool, bytes: &[u8]) -> u64 {
    const PIECE: usize = 64;
    let pieces = bytes.len().div_ceil(PIECE);
    let sum = AtomicU64::new(0);
    pool.for_chunks(pieces, |r| {
        let end = (r.end * PIECE).min(bytes.len());
        let s = word_sum(&bytes[r.start * PIECE..end]);
        sum.fetch_add(s, Ordering::Relaxed);
    });
    sum.into_inner()
}

/// The wrapping sum of `bytes` as little-endian u64 words, a last partial word byte by byte
/// ([`read_rows`]'s and [`read_sequential`]'s checksum).
fn word_sum(bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    let mut sum = 0u64;
    for w in &mut words {
        sum = sum.wrapping_add(u64::from_le_bytes(w.try_into().unwrap_or_default()));
    }
    words
        .remainder()
        .iter()
        .fold(sum, |s, &b| s.wrapping_add(b as u64))
}

/// [`read_rows`]' per-thread reading without a prefetch stream.
fn read_list_portable(rows: &ListedRows<'_>) -> u64 {
    rows.list.iter().fold(0u64, |sum, &i| {
        let row = &rows.data[i as usize * rows.row_bytes..][rows.start..rows.end];
        sum.wrapping_add(word_sum(row))
    })
}
