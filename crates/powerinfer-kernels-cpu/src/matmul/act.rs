//! Activations prepared for the row kernels: kept as f32 for F32 and BF16 weights, rounded to
//! f16 for F16 weights (as ggml converts them to its F16 weights' `vec_dot_type`), or quantized
//! on the fly to 8-bit blocks for quantized weights so that the dot products run on integers.
//!
//! The quantized formats are this crate's own structure-of-arrays layout (values, then scales),
//! not ggml's block structs; their numbers follow ggml's formats of the same name:
//! * `Q8_0`: blocks of 32, `d = max|x| / 127`, `q = round(x / d)`.
//! * `Q8_1`: `Q8_0` plus `s = d · Σq` per block (for the minimum term of Q4_1/Q5_1).
//! * `Q8_K`: blocks of 256 with the sums of each 16 values (for the minimum and offset terms of the
//!   K-quants).
//!
//! The scale is kept in f32 (ggml rounds it to f16 for Q8_0/Q8_1); that is slightly more exact and
//! saves a conversion in the kernels. [`crate::reference::matmul::quantize_activation`] defines
//! the same numbers in plain code.

use super::scratch::ScratchVec;
use powerinfer_gguf::quants::{f16_bits_to_f32, f32_to_f16_bits};

/// Activation format a weight type's dot product consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ActFormat {
    /// Plain f32 (F32, BF16 weights).
    F32,
    /// Every value rounded to the nearest f16 (ties to even; beyond ±65504 it becomes ±∞, as in
    /// ggml), kept both as f32 (exactly the f16 values: what the scalar, AVX2 and multi-token
    /// kernels read) and as f16 bits (half the bytes: what the AVX-512 one-token kernels read
    /// and widen back to the same f32 values). For F16 weights.
    F16,
    /// 32-blocks, f32 scale.
    Q8_0,
    /// 32-blocks, f32 scale and `d·Σq`.
    Q8_1,
    /// [`ActFormat::Q8_0`] with the values of each pair of blocks `(2p, 2p+1)` interleaved by
    /// halves — `x[2p][0..16], x[2p+1][0..16], x[2p][16..32], x[2p+1][16..32]` — and, per pair,
    /// eight i32 `[−8·Σq[2p], 0, 0, 0, −8·Σq[2p+1], 0, 0, 0]` (the AVX2 Q4_0 kernel reads two
    /// Q4_0 blocks as one vector of low nibbles and one of high nibbles). An odd last block
    /// keeps the plain order.
    Q8_0Pairs,
    /// 256-blocks, f32 scale and sums of 16.
    Q8K,
}

/// One token's prepared activation. Unused fields are empty.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Act<'a> {
    /// f32 values (format F32).
    pub f: &'a [f32],
    /// Quantized values, one per column.
    pub q: &'a [i8],
    /// Scale per block.
    pub d: &'a [f32],
    /// Q8_1: `d · Σq` per block.
    pub s: &'a [f32],
    /// Q8_K: Σq per 16 values.
    pub bs: &'a [i16],
    /// Q8_0Pairs: the offset vectors, 8 per block pair (read by the x86 kernels only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub po: &'a [i32],
    /// F16: the f16 bits of `f`, one per column (read by the x86 kernels only).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub h: &'a [u16],
}

impl ActFormat {
    /// Whether the values stay floats (F32 or F16), i.e. the weights are float rows.
    pub(crate) fn is_float(self) -> bool {
        matches!(self, ActFormat::F32 | ActFormat::F16)
    }
}

/// The prepared activations of `t` tokens of `cols` values each.
pub(crate) struct ActBuf<'a> {
    fmt: ActFormat,
    /// The activations this buffer was prepared from.
    src: &'a [f32],
    cols: usize,
    f: &'a [f32],
    /// F16: the rounded values (as f32) and their f16 bits.
    fr: ScratchVec<f32>,
    h: ScratchVec<u16>,
    q: ScratchVec<i8>,
    d: ScratchVec<f32>,
    s: ScratchVec<f32>,
    bs: ScratchVec<i16>,
    po: ScratchVec<i32>,
}

impl<'a> ActBuf<'a> {
    /// Whether this buffer prepared exactly `x` (the same slice) in format `fmt`.
    pub(crate) fn is_of(&self, fmt: ActFormat, x: &[f32]) -> bool {
        self.fmt == fmt && std::ptr::eq(self.src, x)
    }

    /// Prepares `x` (`t` rows of `cols`, `cols` a multiple of the format's block).
    pub(crate) fn new(fmt: ActFormat, x: &'a [f32], cols: usize) -> Self {
        let t = x.len().checked_div(cols).unwrap_or(0);
        let mut buf = ActBuf {
            fmt,
            src: x,
            cols,
            f: &[],
            fr: ScratchVec::empty(),
            h: ScratchVec::empty(),
            q: ScratchVec::empty(),
            d: ScratchVec::empty(),
            s: ScratchVec::empty(),
            bs: ScratchVec::empty(),
            po: ScratchVec::empty(),
        };
        let qk = match fmt {
            ActFormat::F32 => {
                buf.f = x;
                return buf;
            }
            ActFormat::F16 => {
                let n = t * cols;
                buf.fr = ScratchVec::zeroed(n);
                buf.h = ScratchVec::zeroed(n);
                round_f16(&x[..n], &mut buf.fr, &mut buf.h);
                return buf;
            }
            ActFormat::Q8_0 | ActFormat::Q8_1 | ActFormat::Q8_0Pairs => 32,
            ActFormat::Q8K => 256,
        };
        let nb = cols / qk;
        buf.q = ScratchVec::zeroed(t * cols);
        buf.d = ScratchVec::zeroed(t * nb);
        if fmt == ActFormat::Q8_1 {
            buf.s = ScratchVec::zeroed(t * nb);
        }
        if fmt == ActFormat::Q8_0Pairs {
            buf.po = ScratchVec::zeroed(t * (nb / 2) * 8);
        }
        if fmt == ActFormat::Q8K {
            buf.bs = ScratchVec::zeroed(t * cols / 16);
        }
        // Token by token on the calling thread: cheap next to the GEMM that reads them.
        for tok in 0..t {
            let xs = &x[tok * cols..(tok + 1) * cols];
            let q = &mut buf.q[tok * cols..(tok + 1) * cols];
            let d = &mut buf.d[tok * nb..(tok + 1) * nb];
            match fmt {
                ActFormat::Q8_0 => quantize_q8(xs, q, d, None),
                ActFormat::Q8_0Pairs => {
                    quantize_q8(xs, q, d, None);
                    let po = &mut buf.po[tok * (nb / 2) * 8..(tok + 1) * (nb / 2) * 8];
                    interleave_pairs(q, po);
                }
                ActFormat::Q8_1 => {
                    quantize_q8(xs, q, d, Some(&mut buf.s[tok * nb..(tok + 1) * nb]))
                }
                ActFormat::Q8K => quantize_q8k(
                    xs,
                    q,
                    d,
                    &mut buf.bs[tok * cols / 16..(tok + 1) * cols / 16],
                ),
                ActFormat::F32 | ActFormat::F16 => {}
            }
        }
        buf
    }

    /// Token `t`'s activation.
    #[inline]
    pub(crate) fn get(&self, t: usize) -> Act<'_> {
        let c = self.cols;
        match self.fmt {
            ActFormat::F32 => Act {
                f: &self.f[t * c..(t + 1) * c],
                ..Act::default()
            },
            ActFormat::F16 => Act {
                f: &self.fr[t * c..(t + 1) * c],
                h: &self.h[t * c..(t + 1) * c],
                ..Act::default()
            },
            ActFormat::Q8_0 | ActFormat::Q8_1 | ActFormat::Q8_0Pairs => {
                let nb = c / 32;
                let np = nb / 2 * 8;
                Act {
                    po: if self.po.is_empty() {
                        &[]
                    } else {
                        &self.po[t * np..(t + 1) * np]
                    },
                    q: &self.q[t * c..(t + 1) * c],
                    d: &self.d[t * nb..(t + 1) * nb],
                    s: if self.s.is_empty() {
                        &[]
                    } else {
                        &self.s[t * nb..(t + 1) * nb]
                    },
                    ..Act::default()
                }
            }
            ActFormat::Q8K => {
                let nb = c / 256;
                Act {
                    q: &self.q[t * c..(t + 1) * c],
                    d: &self.d[t * nb..(t + 1) * nb],
                    bs: &self.bs[t * c / 16..(t + 1) * c / 16],
                    ..Act::default()
                }
            }
        }
    }

    /// Bytes of one token's prepared activation (for cache blocking).
    pub(crate) fn bytes_per_token(&self) -> usize {
        match self.fmt {
            ActFormat::F32 | ActFormat::F16 => self.cols * 4,
            _ => self.cols + self.cols / 8,
        }
    }
}

/// Rounds every value of `x` to the nearest f16 (ties to even): `h` gets the bits, `f` the same
/// values widened back to f32 (exact). Equal to [`f32_to_f16_bits`] and [`f16_bits_to_f32`] per
/// value (F16C's conversions are IEEE ones; NaNs stay NaNs).
pub(crate) fn round_f16(x: &[f32], f: &mut [f32], h: &mut [u16]) {
    assert!(f.len() == x.len() && h.len() == x.len());
    #[cfg(target_arch = "x86_64")]
    let done = if crate::Backend::Avx2.is_available() {
        let done = x.len() / 8 * 8;
        // SAFETY: AVX2/FMA/F16C were detected on this CPU; the three slices have equal lengths.
        unsafe { round_f16_avx2(&x[..done], &mut f[..done], &mut h[..done]) };
        done
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for ((&v, fv), hv) in x[done..].iter().zip(&mut f[done..]).zip(&mut h[done..]) {
        *hv = f32_to_f16_bits(v);
        *fv = f16_bits_to_f32(*hv);
    }
}

/// [`round_f16`] on whole groups of 8 with F16C.
///
/// # Safety
/// AVX2, FMA and F16C available; the slices have the same length, a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn round_f16_avx2(x: &[f32], f: &mut [f32], h: &mut [u16]) {
    use std::arch::x86_64::*;
    for i in (0..x.len()).step_by(8) {
        // SAFETY: elements i..i+8 lie in all three slices (equal lengths, multiples of 8).
        unsafe {
            let b =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(x.as_ptr().add(i)));
            _mm_storeu_si128(h.as_mut_ptr().add(i) as *mut __m128i, b);
            _mm256_storeu_ps(f.as_mut_ptr().add(i), _mm256_cvtph_ps(b));
        }
    }
}

/// Quantizes `x` to 32-blocks: `q` (len `x.len()`), `d` (one per block) and optionally `s = d·Σq`.
pub(crate) fn quantize_q8(x: &[f32], q: &mut [i8], d: &mut [f32], s: Option<&mut [f32]>) {
    #[cfg(target_arch = "x86_64")]
    if crate::Backend::Avx2.is_available() {
        // SAFETY: AVX2/FMA/F16C were detected on this CPU.
        unsafe { quantize_q8_avx2(x, q, d, s) };
        return;
    }
    quantize_q8_body(x, q, d, s)
}

/// [`quantize_q8_body`] with AVX2 intrinsics: the same IEEE operations in the same order per
/// value (`|x|` maximum, `d = amax/127`, `id = 1/d`, `x·id`, round half away from zero as
/// `trunc(v + copysign(0.5⁻, v))` — exact for |v| < 2²³ — clamp, convert), so the results are
/// identical for finite inputs.
///
/// # Safety
/// AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], mut s: Option<&mut [f32]>) {
    use std::arch::x86_64::*;
    let sign = _mm256_set1_ps(-0.0);
    let half = _mm256_set1_ps(0.499_999_97);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    for (b, (xb, qb)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        // SAFETY: `xb` has 32 values and `qb` 32 bytes (chunks_exact).
        unsafe {
            let p = xb.as_ptr();
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let a = v.map(|v| _mm256_andnot_ps(sign, v));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let db = amax / 127.0;
            let id = _mm256_set1_ps(if db > 0.0 { 1.0 / db } else { 0.0 });
            let i = v.map(|v| {
                let t = _mm256_mul_ps(v, id);
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(
                    _mm256_add_ps(t, _mm256_or_ps(_mm256_and_ps(t, sign), half)),
                );
                _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            // i32 → i16 → i8 (packs interleave 128-bit lanes; the permute restores order).
            let w01 = _mm256_packs_epi32(i[0], i[1]);
            let w23 = _mm256_packs_epi32(i[2], i[3]);
            let bytes = _mm256_packs_epi16(w01, w23);
            let bytes =
                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(qb.as_mut_ptr() as *mut __m256i, bytes);
            d[b] = db;
            if let Some(s) = s.as_deref_mut() {
                let sum32 =
                    _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
                let t = _mm_add_epi32(
                    _mm256_castsi256_si128(sum32),
                    _mm256_extracti128_si256::<1>(sum32),
                );
                let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
                let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t));
                s[b] = db * _mm_cvtsi128_si32(t) as f32;
            }
        }
    }
}

#[inline(always)]
fn quantize_q8_body(x: &[f32], q: &mut [i8], d: &mut [f32], mut s: Option<&mut [f32]>) {
    for (b, (xb, qb)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        let mut sum = 0i32;
        for (qv, &xv) in qb.iter_mut().zip(xb) {
            let v = (xv * id).round().clamp(-127.0, 127.0) as i8;
            *qv = v;
            sum += v as i32;
        }
        d[b] = db;
        if let Some(s) = s.as_deref_mut() {
            s[b] = db * sum as f32;
        }
    }
}

/// Quantizes `x` to 256-blocks: `q`, `d` (one per 256) and `bs` (Σq per 16).
pub(crate) fn quantize_q8k(x: &[f32], q: &mut [i8], d: &mut [f32], bs: &mut [i16]) {
    #[cfg(target_arch = "x86_64")]
    if crate::Backend::Avx2.is_available() {
        // SAFETY: AVX2/FMA/F16C were detected on this CPU.
        unsafe { quantize_q8k_avx2(x, q, d, bs) };
        return;
    }
    quantize_q8k_body(x, q, d, bs)
}

/// [`quantize_q8k_body`] compiled for AVX2 (see [`quantize_q8_avx2`]).
///
/// # Safety
/// AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_q8k_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], bs: &mut [i16]) {
    quantize_q8k_body(x, q, d, bs)
}

#[inline(always)]
fn quantize_q8k_body(x: &[f32], q: &mut [i8], d: &mut [f32], bs: &mut [i16]) {
    for (b, (xb, qb)) in x.chunks_exact(256).zip(q.chunks_exact_mut(256)).enumerate() {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let db = amax / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        for (qv, &xv) in qb.iter_mut().zip(xb) {
            *qv = (xv * id).round().clamp(-127.0, 127.0) as i8;
        }
        d[b] = db;
        for (g, qg) in qb.chunks_exact(16).enumerate() {
            bs[b * 16 + g] = qg.iter().map(|&v| v as i16).sum();
        }
    }
}

/// Reorders quantized 32-blocks into [`ActFormat::Q8_0Pairs`] order and fills the pair offsets.
fn interleave_pairs(q: &mut [i8], po: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::Backend::Avx2.is_available() {
        // SAFETY: AVX2/FMA/F16C were detected on this CPU.
        unsafe { interleave_pairs_avx2(q, po) };
        return;
    }
    for (pair, off) in q.chunks_exact_mut(64).zip(po.chunks_exact_mut(8)) {
        let sum = |s: &[i8]| s.iter().map(|&v| v as i32).sum::<i32>();
        off.fill(0);
        off[0] = -8 * sum(&pair[..32]);
        off[4] = -8 * sum(&pair[32..]);
        let mut tmp = [0i8; 64];
        tmp[..16].copy_from_slice(&pair[..16]);
        tmp[16..32].copy_from_slice(&pair[32..48]);
        tmp[32..48].copy_from_slice(&pair[16..32]);
        tmp[48..].copy_from_slice(&pair[48..]);
        pair.copy_from_slice(&tmp);
    }
}

/// [`interleave_pairs`] with AVX2 (the same bytes and sums, exact integers): the scalar loop
/// was a noticeable part of a sparse GEMV (measurements: `docs/tuning.md`).
///
/// # Safety
/// AVX2, FMA and F16C available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn interleave_pairs_avx2(q: &mut [i8], po: &mut [i32]) {
    use std::arch::x86_64::*;
    let ones8 = _mm256_set1_epi8(1);
    let ones16 = _mm256_set1_epi16(1);
    let sum = |v: __m256i| {
        // Σ of 32 signed bytes: byte pairs to i16, i16 pairs to i32, then the eight i32.
        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16);
        let t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b01_00_11_10>(t));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t));
        _mm_cvtsi128_si32(t)
    };
    for (pair, off) in q.chunks_exact_mut(64).zip(po.chunks_exact_mut(8)) {
        let p = pair.as_mut_ptr() as *mut __m256i;
        // SAFETY: `pair` holds 64 bytes (chunks_exact).
        let (v0, v1) = unsafe { (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1))) };
        off.copy_from_slice(&[-8 * sum(v0), 0, 0, 0, -8 * sum(v1), 0, 0, 0]);
        // SAFETY: as above.
        unsafe {
            _mm256_storeu_si256(p, _mm256_permute2x128_si256::<0x20>(v0, v1));
            _mm256_storeu_si256(p.add(1), _mm256_permute2x128_si256::<0x31>(v0, v1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::matmul::quantize_activation;
    use powerinfer_gguf::GgmlType;

    fn xs(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * if i % 64 < 32 { 1.0 } else { 0.01 }
            })
            .collect()
    }

    /// The kernels' activations are exactly the values the reference defines, in every layout.
    #[test]
    fn quantized_values_match_reference_exactly() {
        let cols = 512 + 32; // an odd number of 32-blocks, for the pair layout's tail
        let x = xs(cols);
        for (fmt, ty) in [
            (ActFormat::Q8_0, GgmlType::Q8_0),
            (ActFormat::Q8_1, GgmlType::Q4_1),
            (ActFormat::Q8_0Pairs, GgmlType::Q4_0),
        ] {
            let want = quantize_activation(ty, &x);
            let buf = ActBuf::new(fmt, &x, cols);
            let a = buf.get(0);
            for (i, &w) in want.iter().enumerate() {
                let (b, j) = (i / 32, i % 32);
                // Position of element i in the stored order.
                let pos = if fmt == ActFormat::Q8_0Pairs && b / 2 * 2 + 1 < cols / 32 {
                    let pair = b / 2 * 64;
                    pair + (j / 16) * 32 + (b % 2) * 16 + j % 16
                } else {
                    i
                };
                assert_eq!(a.d[b] as f64 * a.q[pos] as f64, w, "{fmt:?} [{i}]");
            }
            if fmt == ActFormat::Q8_1 {
                for b in 0..cols / 32 {
                    let sum: i32 = a.q[b * 32..b * 32 + 32].iter().map(|&v| v as i32).sum();
                    assert_eq!(a.s[b], a.d[b] * sum as f32);
                }
            }
            if fmt == ActFormat::Q8_0Pairs {
                let plain = ActBuf::new(ActFormat::Q8_0, &x, cols);
                let p = plain.get(0);
                for pair in 0..cols / 64 {
                    let s0: i32 = p.q[pair * 64..pair * 64 + 32]
                        .iter()
                        .map(|&v| v as i32)
                        .sum();
                    let s1: i32 = p.q[pair * 64 + 32..pair * 64 + 64]
                        .iter()
                        .map(|&v| v as i32)
                        .sum();
                    assert_eq!(
                        &a.po[pair * 8..pair * 8 + 8],
                        &[-8 * s0, 0, 0, 0, -8 * s1, 0, 0, 0]
                    );
                }
            }
        }
        let cols = 512;
        let x = xs(cols);
        let want = quantize_activation(GgmlType::Q4_K, &x);
        let buf = ActBuf::new(ActFormat::Q8K, &x, cols);
        let a = buf.get(0);
        for (i, &w) in want.iter().enumerate() {
            assert_eq!(a.d[i / 256] as f64 * a.q[i] as f64, w, "Q8K [{i}]");
        }
        for g in 0..cols / 16 {
            let sum: i16 = a.q[g * 16..g * 16 + 16].iter().map(|&v| v as i16).sum();
            assert_eq!(a.bs[g], sum);
        }
    }

    /// `ActFormat::F16` holds exactly the reference's rounded values and their f16 bits, on the
    /// F16C path (groups of 8) and the scalar tail alike: ties, the largest finite f16, overflow
    /// to infinity, subnormals, signed zeros, NaN.
    #[test]
    fn f16_values_match_reference_exactly() {
        let mut x = xs(64 + 5);
        let special = [
            1.0 + 2f32.powi(-11),       // a tie: to even (1.0)
            1.0 + 3.0 * 2f32.powi(-11), // a tie: to even (1 + 2^-9)
            65504.0,
            65519.0,
            65520.0, // rounds to infinity
            -1e9,
            2f32.powi(-24), // the smallest subnormal
            3e-8,
            -0.0,
            f32::INFINITY,
        ];
        x[..special.len()].copy_from_slice(&special);
        x[64..64 + 3].copy_from_slice(&special[2..5]); // in the scalar tail too
        x[40] = f32::NAN;
        let buf = ActBuf::new(ActFormat::F16, &x, x.len());
        let a = buf.get(0);
        let want = quantize_activation(GgmlType::F16, &x);
        for i in 0..x.len() {
            assert_eq!(a.h[i], f32_to_f16_bits(x[i]), "[{i}] {}", x[i]);
            if x[i].is_nan() {
                assert!(a.f[i].is_nan() && want[i].is_nan());
            } else {
                assert_eq!(a.f[i] as f64, want[i], "[{i}] {}", x[i]);
            }
        }
        assert_eq!(a.f[4], f32::INFINITY);
        assert_eq!(a.f[0], 1.0);
        assert_eq!(a.f[6], 2f32.powi(-24));
    }
}
