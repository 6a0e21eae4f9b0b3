//! Tools for benchmarks (not kernels). Memory-read probes read weight bytes the way the matrix
//! kernels do, without the arithmetic, and return a checksum so that the reads cannot be
//! optimised away: `powerinfer bench kernels` times them to get the memory ceilings it compares
//! the kernels with. [`random_weights`] and [`SplitMix64`] make the benchmarks' data.

use crate::error::KernelError;
use crate::matmul::rowops::ListedRows;
use crate::matmul::{check_active, MatMul, Weights};
use crate::pool::ThreadPool;
use powerinfer_gguf::GgmlType;
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

/// SplitMix64: the benchmarks' random numbers (weights, activations, row sets). Fast and
/// reproducible from its seed; not for anything that needs unpredictable numbers.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `[-1, 1)`.
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random weights of `ty` for `rows × cols` (cols a multiple of the block size): float values
/// in `[-1, 1)`; quantized blocks of random bytes with finite scales (0.01, the minimum too
/// where the type has one), so every kernel does its full work on them.
pub fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut SplitMix64) -> Vec<u8> {
    use half::{bf16, f16};
    use GgmlType as T;
    let ts = ty.type_size();
    let mut data = vec![0u8; rows * cols / ty.block_size() * ts];
    match ty {
        T::F32 => data
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&rng.f32().to_le_bytes())),
        T::F16 => data
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&f16::from_f32(rng.f32()).to_le_bytes())),
        T::BF16 => data
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&bf16::from_f32(rng.f32()).to_le_bytes())),
        _ => {
            for c in data.chunks_mut(8) {
                let v = rng.next_u64().to_le_bytes();
                c.copy_from_slice(&v[..c.len()]);
            }
            let d = f16::from_f32(0.01).to_le_bytes();
            let off = match ty {
                T::Q6_K => 208,
                T::Q2_K => 80,
                T::Q3_K => 108,
                _ => 0,
            };
            for blk in data.chunks_exact_mut(ts) {
                blk[off..off + 2].copy_from_slice(&d);
                if matches!(ty, T::Q4_1 | T::Q5_1 | T::Q4_K | T::Q5_K | T::Q2_K) {
                    blk[off + 2..off + 4].copy_from_slice(&d);
                }
            }
        }
    }
    data
}
