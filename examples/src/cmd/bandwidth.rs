//! How fast this machine's threads read memory: the bandwidth the benchmarks and `run`'s
//! summary compare the kernels with.

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::probe;
use powerinfer_kernels_cpu::{MatMul, ThreadPool, Weights};
use std::time::Instant;

use super::bench_shared::median;

/// Read bandwidth (bytes/s) of `pool`'s threads reading a `bytes`-long buffer (at least 1 GiB
/// is advised: this machine's L3 holds hundreds of MiB) front to back, each thread its
/// contiguous part: the better of the kernels' two ways of reading ([`read_rates`]), the
/// buffer in transparent huge pages where the OS grants them, as the engine's weights are.
pub(crate) fn read_bandwidth(pool: &ThreadPool, bytes: usize, passes: usize) -> f64 {
    bandwidth_rates(pool, bytes, passes).best()
}

/// [`read_bandwidth`]'s two rates.
pub(crate) fn bandwidth_rates(pool: &ThreadPool, bytes: usize, passes: usize) -> ReadRates {
    const ROW: usize = 4096;
    let rows = (bytes / ROW).max(1);
    match page_fill(rows * ROW) {
        Ok(buf) => read_rates(pool, &buf[..], passes),
        Err(_) => ReadRates {
            stream: f64::NAN,
            plain: f64::NAN,
        },
    }
}

/// How fast `pool`'s threads read one buffer (bytes/s, medians over the passes), two ways.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReadRates {
    /// Through the row-sparse kernels' reading path ([`probe::read_rows`] over 4 KiB rows: on
    /// AVX-512 their software prefetch stream, elsewhere plain word sums).
    pub(crate) stream: f64,
    /// Plain loads, the hardware prefetchers alone ([`probe::read_sequential`]).
    pub(crate) plain: f64,
}

impl ReadRates {
    /// The faster of the two: what this memory gives. Which one wins depends on the CPU, and a
    /// ratio against the slower one alone would overstate the kernels (`docs/tuning.md`).
    pub(crate) fn best(&self) -> f64 {
        self.stream.max(self.plain)
    }
}

/// Median rate (bytes/s) of `pool`'s threads reading `bytes` front to back, each its contiguous
/// part: [`ReadRates::best`] of [`read_rates`].
pub(crate) fn read_bps(pool: &ThreadPool, bytes: &[u8], passes: usize) -> f64 {
    read_rates(pool, bytes, passes).best()
}

/// Both [`ReadRates`] of `bytes` (a tail of less than 4 KiB is not read by the stream), the two
/// ways alternated pass by pass so that both see the same phases of a noisy machine.
pub(crate) fn read_rates(pool: &ThreadPool, bytes: &[u8], passes: usize) -> ReadRates {
    const ROW: usize = 4096;
    let rows = bytes.len() / ROW;
    let mm = MatMul::new(pool);
    let w = Weights::new(GgmlType::F32, rows, ROW / 4, &bytes[..rows * ROW]).ok();
    let all: Vec<u32> = (0..rows as u32).collect();
    let mut sink = 0u64;
    let (mut stream, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..passes.max(1) {
        if let Some(w) = &w {
            let t = Instant::now();
            sink = sink.wrapping_add(probe::read_rows(&mm, w, &all).unwrap_or(0));
            stream.push(t.elapsed().as_secs_f64());
        }
        let t = Instant::now();
        sink = sink.wrapping_add(probe::read_sequential(pool, bytes));
        plain.push(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(sink);
    ReadRates {
        stream: if stream.is_empty() {
            f64::NAN
        } else {
            (rows * ROW) as f64 / median(&stream)
        },
        plain: bytes.len() as f64 / median(&plain),
    }
}

/// `bytes` of anonymous memory in transparent huge pages (if the OS grants them), every page
/// written (so none is the shared zero page).
pub(crate) fn page_fill(bytes: usize) -> Result<memmap2::MmapMut, String> {
    let mut m = memmap2::MmapMut::map_anon(bytes.max(1)).map_err(|e| e.to_string())?;
    #[cfg(target_os = "linux")]
    {
        // Only a hint, given before the first write so that the pages are born huge.
        let _ = m.advise(memmap2::Advice::HugePage);
    }
    for (i, c) in m.chunks_mut(4096).enumerate() {
        c.fill(i as u8);
    }
    Ok(m)
}

/// Anonymous memory holding a copy of `data` starting `offset` bytes past its (page-aligned)
/// start, in transparent huge pages if `huge` (and the OS grants them), else in the OS's base
/// pages.
pub(crate) fn page_copy(
    data: &[u8],
    offset: usize,
    huge: bool,
) -> Result<memmap2::MmapMut, String> {
    let mut m =
        memmap2::MmapMut::map_anon(offset + data.len().max(1)).map_err(|e| e.to_string())?;
    #[cfg(target_os = "linux")]
    {
        // Only a hint, given before the first write so that the pages are born huge.
        let advice = if huge {
            memmap2::Advice::HugePage
        } else {
            memmap2::Advice::NoHugePage
        };
        let _ = m.advise(advice);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = huge;
    m[offset..offset + data.len()].copy_from_slice(data);
    Ok(m)
}
