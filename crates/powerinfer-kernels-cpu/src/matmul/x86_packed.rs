//! The one-token Q4_0 product over a row-interleaved copy of the weights (x86-64, AVX-512
//! F/VL/BW/VNNI): [`MatMul::pack_q4_0`](super::MatMul::pack_q4_0) /
//! [`MatMul::gemv_packed`](super::MatMul::gemv_packed).
//!
//! Layout ([`pack`]): rows in groups of 8; per group, per pair of blocks `(b, b + 1)`, first the
//! 16 f16 scales (row `r`'s `d_b`, `d_b+1` at positions `2r`, `2r + 1`: 32 bytes), then each
//! row's 32 nibble bytes (`qs` of block `b`, then of `b + 1`: 256 bytes). The same 36 bytes per
//! row and pair as ggml's layout, so the copy has the size of the original. Rows past the last
//! whole group stay in ggml's layout and go through the ordinary dot.
//!
//! The kernel does, for every row, exactly the operations of the file-layout kernel
//! (`x86_int::vnni`'s pair step, then `hsum`), so results are bit-identical to
//! [`MatMul::gemv`](super::MatMul::gemv). What it saves is data movement: one 256-bit load and
//! one conversion give the scales of eight rows (the file layout needs two scalar loads, two
//! inserts, a conversion and a permute per row and pair), and each row's nibbles of a pair are
//! one contiguous load. Measured on Zen 4, one thread, weights in L2 (4096 columns): 90–95 vs
//! 61–67 ns per row, 1.42–1.48× as fast.

// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::act::Act;
use std::arch::x86_64::*;

/// Rows per interleaved group.
pub(crate) const GROUP: usize = 8;
/// Bytes per group and pair of blocks: 16 scales and 8 × 32 nibble bytes.
const PAIR_BYTES: usize = 2 * 2 * GROUP + 32 * GROUP;

/// Bytes of one group of `nb` blocks per row (`nb` even).
pub(crate) fn group_bytes(nb: usize) -> usize {
    nb / 2 * PAIR_BYTES
}

/// Repacks row groups `groups` of `data` (rows of `nb` 18-byte Q4_0 blocks, `nb` even) into
/// the interleaved layout, into `out` (exactly `groups.len() · group_bytes(nb)` bytes).
///
/// Panics if the lengths disagree (a frame bug).
pub(crate) fn pack_into(data: &[u8], nb: usize, groups: std::ops::Range<usize>, out: &mut [u8]) {
    let rb = nb * 18;
    assert_eq!(out.len(), groups.len() * group_bytes(nb));
    let mut o = 0;
    let mut put = |src: &[u8]| {
        out[o..o + src.len()].copy_from_slice(src);
        o += src.len();
    };
    for g in groups {
        for b in (0..nb).step_by(2) {
            for r in 0..GROUP {
                let p = (g * GROUP + r) * rb + b * 18;
                put(&data[p..p + 2]);
                put(&data[p + 18..p + 20]);
            }
            for r in 0..GROUP {
                let p = (g * GROUP + r) * rb + b * 18;
                put(&data[p + 2..p + 18]);
                put(&data[p + 20..p + 36]);
            }
        }
    }
}

/// The eight results of every group in `packed` (whole groups of `nb` blocks per row, `nb`
/// even) into `out` (eight per group).
///
/// Panics if the lengths disagree (a frame bug).
pub(crate) fn gemv_groups(packed: &[u8], nb: usize, a: &Act<'_>, out: &mut [f32]) {
    let gb = group_bytes(nb);
    assert!(nb % 2 == 0 && gb > 0 && packed.len() % gb == 0);
    assert!(out.len() == packed.len() / gb * GROUP);
    assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.po.len() >= nb / 2 * 8);
    for (g, y) in packed.chunks_exact(gb).zip(out.chunks_exact_mut(GROUP)) {
        // SAFETY: the group holds nb / 2 pairs of PAIR_BYTES, the activation nb blocks (checked
        // above); this module is used only when Backend::Avx512 was detected.
        let v = unsafe { group(g.as_ptr(), nb, a) };
        y.copy_from_slice(&v);
    }
}

/// One group's eight dot products.
///
/// # Safety
/// `group_bytes(nb)` readable bytes at `q`; `a` has values, scales and pair offsets for `nb`
/// blocks; AVX2/FMA/F16C and AVX-512 F/VL/BW/VNNI available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn group(q: *const u8, nb: usize, a: &Act<'_>) -> [f32; GROUP] {
    let mask = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); GROUP];
    // Lanes 0..4 take row r's scale of block b, lanes 4..8 that of block b + 1.
    let pick: [__m512i; GROUP] = std::array::from_fn(|r| {
        let r = 2 * r as i32;
        _mm512_setr_epi32(
            r,
            r,
            r,
            r,
            r + 1,
            r + 1,
            r + 1,
            r + 1,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
            0,
        )
    });
    let mut b = 0;
    // SAFETY: pair `b / 2` < nb / 2 lies in the group and in the activation (caller).
    unsafe {
        while b + 2 <= nb {
            let p = q.add(b / 2 * PAIR_BYTES);
            let (dx, x0, x1, init) = super::x86_sparse::q4_0_pair_act(a, b);
            let scales = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
            for r in 0..GROUP {
                let dw = _mm512_castps512_ps256(_mm512_permutexvar_ps(pick[r], scales));
                let raw = _mm256_loadu_si256(p.add(32 + 32 * r) as *const __m256i);
                let lo = _mm256_and_si256(raw, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                // The file-layout kernel's operations: d_w·d_x per lane, exact integer sums,
                // one FMA per pair.
                let sc = _mm256_mul_ps(dw, dx);
                let si = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(init, lo, x0), hi, x1);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), sc, acc[r]);
            }
            b += 2;
        }
    }
    // SAFETY: AVX2 available (caller).
    acc.map(|v| unsafe { super::x86::hsum(v) })
}
