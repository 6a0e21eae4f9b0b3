//! Portable row kernels: one dot product of a weight row with a prepared activation, and one
//! `out += a · row` update, for every supported weight type. Always compiled; the reference the
//! SIMD kernels are tested against (besides the f64 references).
//!
//! Rows arrive as raw little-endian bytes (whole blocks), so no alignment is assumed.

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]

use super::act::Act;
use half::{bf16, f16};

#[inline(always)]
fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline(always)]
fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Sums `f(i)` for i in 0..n with 8 interleaved accumulators (a summation tree of depth
/// n/8 + 3, the same shape as the 8-lane SIMD kernels).
#[inline(always)]
fn sum8(n: usize, f: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let main = n / 8 * 8;
    let mut i = 0;
    while i < main {
        for (k, a) in acc.iter_mut().enumerate() {
            *a += f(i + k);
        }
        i += 8;
    }
    for (k, j) in (main..n).enumerate() {
        acc[k] += f(j);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// F32 row · f32 activation.
pub(crate) fn dot_f32(row: &[u8], a: &Act<'_>) -> f32 {
    let x = a.f;
    sum8(x.len(), |i| f32_at(row, 4 * i) * x[i])
}

/// F16 row · f32 activation (already rounded to f16: `ActFormat::F16`).
pub(crate) fn dot_f16(row: &[u8], a: &Act<'_>) -> f32 {
    let x = a.f;
    sum8(x.len(), |i| f16_at(row, 2 * i) * x[i])
}

/// BF16 row · f32 activation.
pub(crate) fn dot_bf16(row: &[u8], a: &Act<'_>) -> f32 {
    let x = a.f;
    sum8(x.len(), |i| {
        bf16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32() * x[i]
    })
}

/// Q8_0 row · Q8_0 activation (34-byte blocks: f16 d, 32 × i8).
pub(crate) fn dot_q8_0(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(34).enumerate() {
        let qa = &a.q[b * 32..b * 32 + 32];
        let mut s = 0i32;
        for j in 0..32 {
            s += (blk[2 + j] as i8 as i32) * qa[j] as i32;
        }
        acc += f16_at(blk, 0) * a.d[b] * s as f32;
    }
    acc
}

/// Q4_0 row · Q8_0 activation (18-byte blocks: f16 d, 16 bytes of nibbles).
pub(crate) fn dot_q4_0(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(18).enumerate() {
        let qa = &a.q[b * 32..b * 32 + 32];
        let mut s = 0i32;
        for j in 0..16 {
            let v = blk[2 + j];
            s += ((v & 0xF) as i32 - 8) * qa[j] as i32;
            s += ((v >> 4) as i32 - 8) * qa[j + 16] as i32;
        }
        acc += f16_at(blk, 0) * a.d[b] * s as f32;
    }
    acc
}

/// Q4_1 row · Q8_1 activation (20-byte blocks: f16 d, f16 m, 16 bytes of nibbles).
pub(crate) fn dot_q4_1(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(20).enumerate() {
        let qa = &a.q[b * 32..b * 32 + 32];
        let mut s = 0i32;
        for j in 0..16 {
            let v = blk[4 + j];
            s += (v & 0xF) as i32 * qa[j] as i32;
            s += (v >> 4) as i32 * qa[j + 16] as i32;
        }
        acc += f16_at(blk, 0) * a.d[b] * s as f32 + f16_at(blk, 2) * a.s[b];
    }
    acc
}

#[inline(always)]
fn q5_values(qh: u32, qs: &[u8], j: usize) -> (i32, i32) {
    let lo = (qs[j] & 0xF) as i32 | ((((qh >> j) & 1) as i32) << 4);
    let hi = (qs[j] >> 4) as i32 | ((((qh >> (j + 16)) & 1) as i32) << 4);
    (lo, hi)
}

/// Q5_0 row · Q8_0 activation (22-byte blocks: f16 d, u32 qh, 16 bytes of nibbles).
pub(crate) fn dot_q5_0(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(22).enumerate() {
        let qa = &a.q[b * 32..b * 32 + 32];
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let mut s = 0i32;
        for j in 0..16 {
            let (lo, hi) = q5_values(qh, &blk[6..22], j);
            s += (lo - 16) * qa[j] as i32 + (hi - 16) * qa[j + 16] as i32;
        }
        acc += f16_at(blk, 0) * a.d[b] * s as f32;
    }
    acc
}

/// Q5_1 row · Q8_1 activation (24-byte blocks: f16 d, f16 m, u32 qh, 16 bytes of nibbles).
pub(crate) fn dot_q5_1(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(24).enumerate() {
        let qa = &a.q[b * 32..b * 32 + 32];
        let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
        let mut s = 0i32;
        for j in 0..16 {
            let (lo, hi) = q5_values(qh, &blk[8..24], j);
            s += lo * qa[j] as i32 + hi * qa[j + 16] as i32;
        }
        acc += f16_at(blk, 0) * a.d[b] * s as f32 + f16_at(blk, 2) * a.s[b];
    }
    acc
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K/Q5_K super-block.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The unsigned values of elements `64c + l` and `64c + 32 + l` (`l < 32`) of a Q4_K
/// (`FIVE = false`: low nibbles, then high ones, of the 128 `qs` bytes) or Q5_K (`FIVE`: the
/// fifth bits from the 32 `qh` bytes) super-block.
#[inline(always)]
fn k45_values<const FIVE: bool>(qs: &[u8], qh: &[u8], c: usize, l: usize) -> (i32, i32) {
    let v = qs[c * 32 + l];
    let (mut lo, mut hi) = ((v & 0xF) as i32, (v >> 4) as i32);
    if FIVE {
        lo |= (((qh[l] >> (2 * c)) & 1) as i32) << 4;
        hi |= (((qh[l] >> (2 * c + 1)) & 1) as i32) << 4;
    }
    (lo, hi)
}

/// The `qh` (empty for Q4_K) and `qs` bytes of a Q4_K or Q5_K super-block.
#[inline(always)]
fn k45_bits<const FIVE: bool>(blk: &[u8]) -> (&[u8], &[u8]) {
    if FIVE {
        (&blk[16..48], &blk[48..176])
    } else {
        (&blk[0..0], &blk[16..144])
    }
}

/// Q4_K (`FIVE = false`; 144-byte super-blocks: f16 d, f16 dmin, 12 scale bytes, 128 qs) or Q5_K
/// (`FIVE`; 176 bytes: d, dmin, 12 scale bytes, 32 qh, 128 qs) row · Q8_K activation.
fn dot_q45k<const FIVE: bool>(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(if FIVE { 176 } else { 144 }).enumerate() {
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        let scales = &blk[4..16];
        let (qh, qs) = k45_bits::<FIVE>(blk);
        let qa = &a.q[b * 256..b * 256 + 256];
        let bs = &a.bs[b * 16..b * 16 + 16];
        let (mut sum_q, mut sum_m) = (0i32, 0i32);
        for c in 0..4 {
            let (sc_lo, m_lo) = scale_min_k4(2 * c, scales);
            let (sc_hi, m_hi) = scale_min_k4(2 * c + 1, scales);
            let (mut s_lo, mut s_hi) = (0i32, 0i32);
            for l in 0..32 {
                let (lo, hi) = k45_values::<FIVE>(qs, qh, c, l);
                s_lo += lo * qa[c * 64 + l] as i32;
                s_hi += hi * qa[c * 64 + 32 + l] as i32;
            }
            sum_q += sc_lo as i32 * s_lo + sc_hi as i32 * s_hi;
            sum_m += m_lo as i32 * (bs[4 * c] as i32 + bs[4 * c + 1] as i32)
                + m_hi as i32 * (bs[4 * c + 2] as i32 + bs[4 * c + 3] as i32);
        }
        acc += a.d[b] * (d * sum_q as f32 - dmin * sum_m as f32);
    }
    acc
}

/// Q4_K row · Q8_K activation.
pub(crate) fn dot_q4_k(row: &[u8], a: &Act<'_>) -> f32 {
    dot_q45k::<false>(row, a)
}

/// Q5_K row · Q8_K activation.
pub(crate) fn dot_q5_k(row: &[u8], a: &Act<'_>) -> f32 {
    dot_q45k::<true>(row, a)
}

/// The 6-bit value of element `e` (0..256) of a Q6_K super-block, offset by -32, and the index
/// of its 16-element scale.
#[inline(always)]
pub(crate) fn q6k_value(ql: &[u8], qh: &[u8], e: usize) -> (i32, usize) {
    let n = e / 128;
    let r = e % 128;
    let quarter = r / 32;
    let l = r % 32;
    let low = match quarter {
        0 => ql[n * 64 + l] & 0xF,
        1 => ql[n * 64 + 32 + l] & 0xF,
        2 => ql[n * 64 + l] >> 4,
        _ => ql[n * 64 + 32 + l] >> 4,
    };
    let high = (qh[n * 32 + l] >> (2 * quarter)) & 3;
    (
        ((low | (high << 4)) as i32) - 32,
        n * 8 + quarter * 2 + l / 16,
    )
}

/// Q6_K row · Q8_K activation (210-byte super-blocks: 128 ql, 64 qh, 16 i8 scales, f16 d).
pub(crate) fn dot_q6_k(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(210).enumerate() {
        let ql = &blk[0..128];
        let qh = &blk[128..192];
        let sc = &blk[192..208];
        let d = f16_at(blk, 208);
        let qa = &a.q[b * 256..b * 256 + 256];
        let mut sums = [0i32; 16];
        for e in 0..256 {
            let (v, g) = q6k_value(ql, qh, e);
            sums[g] += v * qa[e] as i32;
        }
        let total: i32 = sums
            .iter()
            .zip(sc)
            .map(|(&s, &scale)| s * scale as i8 as i32)
            .sum();
        acc += a.d[b] * d * total as f32;
    }
    acc
}

/// The 2-bit value (0..4) of element `e` (0..256) of a Q2_K or Q3_K super-block from its 64
/// `qs` bytes: bits `2s..2s + 2` of `qs[32n + l]` for `e = 128n + 32s + l`.
#[inline(always)]
fn k23_low(qs: &[u8], e: usize) -> i32 {
    let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
    ((qs[32 * n + l] >> (2 * s)) & 3) as i32
}

/// Q2_K row · Q8_K activation (84-byte super-blocks: 16 scale bytes (low nibble scale, high
/// nibble minimum of each sub-block of 16), 64 qs, f16 d, f16 dmin).
pub(crate) fn dot_q2_k(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(84).enumerate() {
        let (sc, qs) = (&blk[0..16], &blk[16..80]);
        let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
        let qa = &a.q[b * 256..b * 256 + 256];
        let bs = &a.bs[b * 16..b * 16 + 16];
        let mut sums = [0i32; 16];
        for e in 0..256 {
            sums[e / 16] += k23_low(qs, e) * qa[e] as i32;
        }
        let (mut sum_q, mut sum_m) = (0i32, 0i32);
        for g in 0..16 {
            sum_q += (sc[g] & 0xF) as i32 * sums[g];
            sum_m += (sc[g] >> 4) as i32 * bs[g] as i32;
        }
        acc += a.d[b] * (d * sum_q as f32 - dmin * sum_m as f32);
    }
    acc
}

/// The 16 signed 6-bit sub-block scales of a Q3_K super-block from its 12 scale bytes: low 4
/// bits of sub-block `g` in the low (g < 8) or high (g ≥ 8) nibble of byte `g % 8`, high 2 bits
/// in bits `2(g / 4)..` of byte `8 + g % 4`; offset by -32.
#[inline(always)]
fn q3k_scales(s: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (g, o) in out.iter_mut().enumerate() {
        let low = if g < 8 { s[g] & 0xF } else { s[g - 8] >> 4 };
        let high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        *o = (low | (high << 4)) as i32 - 32;
    }
    out
}

/// The signed 3-bit value (-4..4) of element `e` of a Q3_K super-block: the 2 low bits from
/// `qs`, minus 4 where bit `4n + s` of `hmask[l]` is clear (`e = 128n + 32s + l`).
#[inline(always)]
fn q3k_value(hmask: &[u8], qs: &[u8], e: usize) -> i32 {
    let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
    let high = ((hmask[l] >> (4 * n + s)) & 1) as i32;
    k23_low(qs, e) - 4 + 4 * high
}

/// Q3_K row · Q8_K activation (110-byte super-blocks: 32 hmask, 64 qs, 12 scale bytes, f16 d).
pub(crate) fn dot_q3_k(row: &[u8], a: &Act<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, blk) in row.chunks_exact(110).enumerate() {
        let (hmask, qs) = (&blk[0..32], &blk[32..96]);
        let sc = q3k_scales(&blk[96..108]);
        let d = f16_at(blk, 108);
        let qa = &a.q[b * 256..b * 256 + 256];
        let mut sums = [0i32; 16];
        for e in 0..256 {
            sums[e / 16] += q3k_value(hmask, qs, e) * qa[e] as i32;
        }
        let total: i32 = sums.iter().zip(&sc).map(|(&s, &scale)| s * scale).sum();
        acc += a.d[b] * d * total as f32;
    }
    acc
}

/// Decodes one block (or super-block) of a quantized type into `out` (32 or 256 values).
pub(crate) fn dequant_block(ty: powerinfer_gguf::GgmlType, blk: &[u8], out: &mut [f32]) {
    use powerinfer_gguf::GgmlType as T;
    match ty {
        T::Q8_0 => {
            let d = f16_at(blk, 0);
            for j in 0..32 {
                out[j] = d * (blk[2 + j] as i8) as f32;
            }
        }
        T::Q4_0 => {
            let d = f16_at(blk, 0);
            for j in 0..16 {
                out[j] = d * ((blk[2 + j] & 0xF) as i32 - 8) as f32;
                out[j + 16] = d * ((blk[2 + j] >> 4) as i32 - 8) as f32;
            }
        }
        T::Q4_1 => {
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            for j in 0..16 {
                out[j] = d * (blk[4 + j] & 0xF) as f32 + m;
                out[j + 16] = d * (blk[4 + j] >> 4) as f32 + m;
            }
        }
        T::Q5_0 => {
            let d = f16_at(blk, 0);
            let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
            for j in 0..16 {
                let (lo, hi) = q5_values(qh, &blk[6..22], j);
                out[j] = d * (lo - 16) as f32;
                out[j + 16] = d * (hi - 16) as f32;
            }
        }
        T::Q5_1 => {
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
            for j in 0..16 {
                let (lo, hi) = q5_values(qh, &blk[8..24], j);
                out[j] = d * lo as f32 + m;
                out[j + 16] = d * hi as f32 + m;
            }
        }
        T::Q2_K => {
            let (sc, qs) = (&blk[0..16], &blk[16..80]);
            let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
            for (e, o) in out.iter_mut().enumerate().take(256) {
                let g = sc[e / 16];
                *o = d * (g & 0xF) as f32 * k23_low(qs, e) as f32 - dmin * (g >> 4) as f32;
            }
        }
        T::Q3_K => {
            let (hmask, qs) = (&blk[0..32], &blk[32..96]);
            let sc = q3k_scales(&blk[96..108]);
            let d = f16_at(blk, 108);
            for (e, o) in out.iter_mut().enumerate().take(256) {
                *o = d * sc[e / 16] as f32 * q3k_value(hmask, qs, e) as f32;
            }
        }
        T::Q4_K => dequant_k45::<false>(blk, out),
        T::Q5_K => dequant_k45::<true>(blk, out),
        T::Q6_K => {
            let (ql, qh, sc) = (&blk[0..128], &blk[128..192], &blk[192..208]);
            let d = f16_at(blk, 208);
            for (e, o) in out.iter_mut().enumerate().take(256) {
                let (v, g) = q6k_value(ql, qh, e);
                *o = d * (sc[g] as i8) as f32 * v as f32;
            }
        }
        _ => out.fill(0.0),
    }
}

/// Decodes one Q4_K (`FIVE = false`) or Q5_K super-block into `out` (256 values).
fn dequant_k45<const FIVE: bool>(blk: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let scales = &blk[4..16];
    let (qh, qs) = k45_bits::<FIVE>(blk);
    for c in 0..4 {
        let (sc_lo, m_lo) = scale_min_k4(2 * c, scales);
        let (sc_hi, m_hi) = scale_min_k4(2 * c + 1, scales);
        for l in 0..32 {
            let (lo, hi) = k45_values::<FIVE>(qs, qh, c, l);
            out[c * 64 + l] = d * sc_lo as f32 * lo as f32 - dmin * m_lo as f32;
            out[c * 64 + 32 + l] = d * sc_hi as f32 * hi as f32 - dmin * m_hi as f32;
        }
    }
}

/// `out += a · row` for an F32 row.
pub(crate) fn axpy_f32(row: &[u8], a: f32, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o += a * f32_at(row, 4 * i);
    }
}

/// `out += a · row` for an F16 row.
pub(crate) fn axpy_f16(row: &[u8], a: f32, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o += a * f16_at(row, 2 * i);
    }
}

/// `out += a · row` for a BF16 row.
pub(crate) fn axpy_bf16(row: &[u8], a: f32, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o += a * bf16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32();
    }
}

/// `out += a · row` for a Q8_0 row (scale folded into `a` per block).
pub(crate) fn axpy_q8_0(row: &[u8], a: f32, out: &mut [f32]) {
    for (blk, o) in row.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
        let s = a * f16_at(blk, 0);
        for j in 0..32 {
            o[j] += s * (blk[2 + j] as i8) as f32;
        }
    }
}

/// `out += a · row` for a Q4_0 row (scale folded into `a` per block).
pub(crate) fn axpy_q4_0(row: &[u8], a: f32, out: &mut [f32]) {
    for (blk, o) in row.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
        let s = a * f16_at(blk, 0);
        for j in 0..16 {
            o[j] += s * ((blk[2 + j] & 0xF) as i32 - 8) as f32;
            o[j + 16] += s * ((blk[2 + j] >> 4) as i32 - 8) as f32;
        }
    }
}

macro_rules! generic_axpy {
    ($name:ident, $ty:ident, $bytes:expr, $qk:expr) => {
        /// `out += a · row`, decoding block by block.
        pub(crate) fn $name(row: &[u8], a: f32, out: &mut [f32]) {
            let mut tmp = [0f32; $qk];
            for (blk, o) in row.chunks_exact($bytes).zip(out.chunks_exact_mut($qk)) {
                dequant_block(powerinfer_gguf::GgmlType::$ty, blk, &mut tmp);
                for (o, t) in o.iter_mut().zip(&tmp) {
                    *o += a * t;
                }
            }
        }
    };
}
generic_axpy!(axpy_q4_1, Q4_1, 20, 32);
generic_axpy!(axpy_q5_0, Q5_0, 22, 32);
generic_axpy!(axpy_q5_1, Q5_1, 24, 32);
generic_axpy!(axpy_q2_k, Q2_K, 84, 256);
generic_axpy!(axpy_q3_k, Q3_K, 110, 256);
generic_axpy!(axpy_q4_k, Q4_K, 144, 256);
generic_axpy!(axpy_q5_k, Q5_K, 176, 256);
generic_axpy!(axpy_q6_k, Q6_K, 210, 256);

macro_rules! dot4_from_dot {
    ($($name:ident => $dot:ident),* $(,)?) => {$(
        /// Four dot products of one row (the row stays in L1 between them).
        pub(crate) fn $name(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
            for (o, a) in out.iter_mut().zip(acts) {
                *o = $dot(row, a);
            }
        }
    )*};
}
dot4_from_dot!(
    dot4_f32 => dot_f32,
    dot4_f16 => dot_f16,
    dot4_bf16 => dot_bf16,
    dot4_q8_0 => dot_q8_0,
    dot4_q4_0 => dot_q4_0,
    dot4_q4_1 => dot_q4_1,
    dot4_q5_0 => dot_q5_0,
    dot4_q5_1 => dot_q5_1,
    dot4_q2_k => dot_q2_k,
    dot4_q3_k => dot_q3_k,
    dot4_q4_k => dot_q4_k,
    dot4_q5_k => dot_q5_k,
    dot4_q6_k => dot_q6_k,
);
