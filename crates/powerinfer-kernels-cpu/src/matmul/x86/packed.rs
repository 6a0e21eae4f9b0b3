//! The one-token Q4_0 product over a row-interleaved copy of the weights (x86-64, AVX-512
//! F/VL/BW/VNNI): [`MatMul::pack_q4_0`](crate::MatMul::pack_q4_0) /
//! [`MatMul::gemv_packed`](crate::MatMul::gemv_packed).
//!
//! Layout ([`pack_into`]): rows in groups of 8; per group, per pair of blocks `(b, b + 1)`, first the
//! 16 f16 scales (row `r`'s `d_b`, `d_b+1` at positions `2r`, `2r + 1`: 32 bytes), then each
//! row's 32 nibble bytes (`qs` of block `b`, then of `b + 1`: 256 bytes). The same 36 bytes per
//! row and pair as ggml's layout, so the copy has the size of the original. Rows past the last
//! whole group stay in ggml's layout and go through the ordinary dot.
//!
//! The kernel does, for every row, exactly the operations of the file-layout kernel
//! (`int::vnni`'s pair step, then `hsum`), so results are bit-identical to
//! [`MatMul::gemv`](crate::MatMul::gemv). What it saves is data movement: one 256-bit load and
//! one conversion give the scales of eight rows (the file layout needs two scalar loads, two
//! inserts, a conversion and a permute per row and pair), and each row's nibbles of a pair are
//! one contiguous load; two rows' nibbles of a pair are 64 contiguous bytes, so 512-bit vectors
//! do two rows per instruction, each 256-bit half with one row's lanes (a 256-bit version was
//! not faster than the file-layout kernel on every CPU; measurements: `docs/tuning.md`).

// The AVX-512 intrinsics are stable since Rust 1.89, above the workspace MSRV: this module is
// compiled only with such compilers (`cfg(powerinfer_avx512)`, set by the crate's build.rs).
#![allow(clippy::incompatible_msrv)]
#![deny(unsafe_op_in_unsafe_fn)]

use super::common::{hsum, q4_0_pair_act};
use crate::matmul::act::Act;
use std::arch::x86_64::*;

/// Bytes ahead of the pair being computed that the kernel asks to have in L1 (T0): the
/// hardware prefetchers bring the stream to L2 but not far enough into L1; the best of the
/// distances swept.
const PREFETCH_AHEAD: usize = 1024;
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

/// One group's eight dot products, two rows per 512-bit vector: rows `2k` and `2k + 1` of a
/// pair's nibbles are 64 contiguous bytes, so one load, one decode and one `vpdpbusd` pair
/// serve both, the low 256 bits doing row `2k`'s lanes and the high 256 bits row `2k + 1`'s.
/// Every lane does the file-layout kernel's operations in its order (lanes never mix until
/// the final `hsum` of each half), so the results equal `int::vnni`'s bit for bit.
///
/// # Safety
/// `group_bytes(nb)` readable bytes at `q`; `a` has values, scales and pair offsets for `nb`
/// blocks; AVX2/FMA/F16C and AVX-512 F/VL/BW/VNNI available.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")]
unsafe fn group(q: *const u8, nb: usize, a: &Act<'_>) -> [f32; GROUP] {
    const PAIRS: usize = GROUP / 2;
    let mask = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); PAIRS];
    // Rows 2k, 2k + 1: lanes 0..4 take row 2k's scale of block b, lanes 4..8 that of b + 1,
    // lanes 8..16 the same for row 2k + 1 (scales at 2r, 2r + 1 of the pair's 16).
    let pick: [__m512i; PAIRS] = std::array::from_fn(|k| {
        let r = 4 * k as i32;
        _mm512_setr_epi32(
            r,
            r,
            r,
            r,
            r + 1,
            r + 1,
            r + 1,
            r + 1,
            r + 2,
            r + 2,
            r + 2,
            r + 2,
            r + 3,
            r + 3,
            r + 3,
            r + 3,
        )
    });
    let mut b = 0;
    // SAFETY: pair `b / 2` < nb / 2 lies in the group and in the activation (caller).
    unsafe {
        while b + 2 <= nb {
            let p = q.add(b / 2 * PAIR_BYTES);
            let (dx, x0, x1, init) = q4_0_pair_act(a, b);
            let dx = _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                _mm512_castpd256_pd512(_mm256_castps_pd(dx)),
                _mm256_castps_pd(dx),
            ));
            let x0 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x0), x0);
            let x1 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x1), x1);
            let init = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(init), init);
            let scales = _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i));
            // The lines PREFETCH_AHEAD bytes on into L1 (a hint; past the group's end it
            // touches the next group or nothing: prefetches never fault).
            let mut o = 0;
            while o < PAIR_BYTES {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_AHEAD + o) as *const i8);
                o += 64;
            }
            for k in 0..PAIRS {
                let dw = _mm512_permutexvar_ps(pick[k], scales);
                let raw = _mm512_loadu_si512(p.add(32 + 64 * k) as *const __m512i);
                let lo = _mm512_and_si512(raw, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                // The file-layout kernel's operations per lane: d_w·d_x, exact integer sums,
                // one FMA per pair.
                let sc = _mm512_mul_ps(dw, dx);
                let si = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init, lo, x0), hi, x1);
                acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), sc, acc[k]);
            }
            b += 2;
        }
    }
    let mut out = [0f32; GROUP];
    for k in 0..PAIRS {
        // SAFETY: AVX2 and AVX-512 F available (caller).
        unsafe {
            out[2 * k] = hsum(_mm512_castps512_ps256(acc[k]));
            let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc[k]));
            out[2 * k + 1] = hsum(_mm256_castpd_ps(hi));
        }
    }
    out
}
