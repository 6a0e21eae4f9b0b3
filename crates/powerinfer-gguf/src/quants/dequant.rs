//! Dequantization of every block type to f32.
//!
//! Each function performs exactly the float32 operations of the reference (`gguf.quants`), in
//! the same order: e.g. Q4_1 is `d * q + m` with two roundings, Q4_K first rounds the
//! sub-block scale `d * sc` to f32 and then computes `(d * sc) * q - dmin * m`.

use super::blocks::*;
use super::{dequantize_blocks, f16_bits_to_f32, QuantBlock, QuantError};
use half::f16;

/// The 32 values of a 32-wide block from their quants: value j from the low nibble of `qs[j]`,
/// value j + 16 from its high nibble, each with bit j (j + 16) of `qh` as fifth bit (Q5_0,
/// Q5_1; 0 for Q4_0, Q4_1), through `value`.
#[inline(always)]
fn nibble_block(qs: &[u8; QK / 2], qh: u32, value: impl Fn(u8) -> f32, out: &mut [f32]) {
    let (lo, hi) = out[..QK].split_at_mut(QK / 2);
    for (j, ((l, h), &b)) in lo.iter_mut().zip(hi.iter_mut()).zip(qs).enumerate() {
        *l = value((b & 0x0f) | ((((qh >> j) & 1) as u8) << 4));
        *h = value((b >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4));
    }
}

impl QuantBlock for BlockQ4_0 {
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        nibble_block(&self.qs, 0, |q| d * (i32::from(q) - 8) as f32, out);
    }
}

impl QuantBlock for BlockQ4_1 {
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        let m = f16_bits_to_f32(self.m.to_bits());
        nibble_block(&self.qs, 0, |q| d * f32::from(q) + m, out);
    }
}

impl QuantBlock for BlockQ5_0 {
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        let qh = u32::from_le_bytes(self.qh);
        nibble_block(&self.qs, qh, |q| d * (i32::from(q) - 16) as f32, out);
    }
}

impl QuantBlock for BlockQ5_1 {
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        let m = f16_bits_to_f32(self.m.to_bits());
        let qh = u32::from_le_bytes(self.qh);
        nibble_block(&self.qs, qh, |q| d * f32::from(q) + m, out);
    }
}

/// `d * q` for the values of a Q8_0 or Q8_1 block.
#[inline(always)]
fn scaled_i8(d: f16, qs: &[i8; QK], out: &mut [f32]) {
    let d = f16_bits_to_f32(d.to_bits());
    for (o, &q) in out[..QK].iter_mut().zip(qs) {
        *o = f32::from(q) * d;
    }
}

impl QuantBlock for BlockQ8_0 {
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        scaled_i8(self.d, &self.qs, out);
    }
}

impl QuantBlock for BlockQ8_1 {
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        scaled_i8(self.d, &self.qs, out);
    }
}

impl QuantBlock for BlockQ2K {
    #[inline]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        let dmin = f16_bits_to_f32(self.dmin.to_bits());
        // Value 128 * h + 32 * s + j is bits 2s..2s+2 of qs[32 * h + j]; sub-block of 16 values.
        let out = &mut out[..QK_K];
        for h in 0..2 {
            let qs = &self.qs[32 * h..32 * h + 32];
            let sc = &self.scales[8 * h..8 * h + 8];
            let out = &mut out[128 * h..128 * h + 128];
            for half in 0..2 {
                let q = &qs[16 * half..16 * half + 16];
                let o = 16 * half;
                q2k_group::<0>(q, d, dmin, sc[half], &mut out[o..o + 16]);
                q2k_group::<2>(q, d, dmin, sc[2 + half], &mut out[32 + o..48 + o]);
                q2k_group::<4>(q, d, dmin, sc[4 + half], &mut out[64 + o..80 + o]);
                q2k_group::<6>(q, d, dmin, sc[6 + half], &mut out[96 + o..112 + o]);
            }
        }
    }
}

/// 16 values of a Q2_K block: bits `SHIFT..SHIFT + 2` of `q`, sub-block scale byte `sc`.
/// The shift is a constant so that the loop vectorizes well.
#[inline(always)]
fn q2k_group<const SHIFT: u32>(q: &[u8], d: f32, dmin: f32, sc: u8, out: &mut [f32]) {
    let dl = d * f32::from(sc & 0x0f);
    let ml = dmin * f32::from(sc >> 4);
    for (o, &b) in out[..16].iter_mut().zip(&q[..16]) {
        *o = dl * f32::from((b >> SHIFT) & 3) - ml;
    }
}

/// The 16 signed 6-bit scales of a Q3_K block, still offset by 32.
#[inline]
pub(crate) fn q3k_scales(s: &[u8; 12]) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = low | (high << 4);
    }
    out
}

impl QuantBlock for BlockQ3K {
    #[inline]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        let scales = q3k_scales(&self.scales);
        // Value 128 * h + 32 * s + j: low bits 2s..2s+2 of qs[32 * h + j], high bit 4h + s of
        // hmask[j]; a clear high bit subtracts 4. Constant shifts vectorize best, hence the
        // spelled-out calls.
        let out = &mut out[..QK_K];
        let (lo, hi) = out.split_at_mut(128);
        let (q0, q1) = self.qs.split_at(32);
        let m = &self.hmask;
        let sc = |i: usize| d * (i32::from(scales[i]) - 32) as f32;
        q3k_group::<0, 0>(q0, m, [sc(0), sc(1)], &mut lo[..32]);
        q3k_group::<2, 1>(q0, m, [sc(2), sc(3)], &mut lo[32..64]);
        q3k_group::<4, 2>(q0, m, [sc(4), sc(5)], &mut lo[64..96]);
        q3k_group::<6, 3>(q0, m, [sc(6), sc(7)], &mut lo[96..]);
        q3k_group::<0, 4>(q1, m, [sc(8), sc(9)], &mut hi[..32]);
        q3k_group::<2, 5>(q1, m, [sc(10), sc(11)], &mut hi[32..64]);
        q3k_group::<4, 6>(q1, m, [sc(12), sc(13)], &mut hi[64..96]);
        q3k_group::<6, 7>(q1, m, [sc(14), sc(15)], &mut hi[96..]);
    }
}

/// 32 values of a Q3_K block: low bits `SHIFT..SHIFT + 2` of `qs`, high bit `HBIT` of `hmask`;
/// `dl` holds the scales of the two sub-blocks of 16.
#[inline(always)]
fn q3k_group<const SHIFT: u32, const HBIT: u32>(
    qs: &[u8],
    hmask: &[u8],
    dl: [f32; 2],
    out: &mut [f32],
) {
    for (((out, qs), hm), dl) in out[..32]
        .chunks_exact_mut(16)
        .zip(qs[..32].chunks_exact(16))
        .zip(hmask[..32].chunks_exact(16))
        .zip(dl)
    {
        for ((o, &q), &m) in out.iter_mut().zip(qs).zip(hm) {
            let low = i32::from((q >> SHIFT) & 3);
            let high = i32::from((m >> HBIT) & 1);
            *o = dl * (low - 4 + 4 * high) as f32;
        }
    }
}

/// The 8 6-bit scales and 8 6-bit minimums packed in the 12 `scales` bytes of Q4_K and Q5_K.
#[inline]
pub(crate) fn k4_scales_mins(s: &[u8; K_SCALE_SIZE]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for i in 0..4 {
        sc[i] = s[i] & 0x3f;
        mn[i] = s[4 + i] & 0x3f;
        sc[4 + i] = (s[8 + i] & 0x0f) | ((s[i] >> 2) & 0x30);
        mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
    (sc, mn)
}

impl QuantBlock for BlockQ4K {
    #[inline]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        let dmin = f16_bits_to_f32(self.dmin.to_bits());
        let (sc, mn) = k4_scales_mins(&self.scales);
        // Sub-block 2c is the low nibbles of qs[32c..32c + 32], sub-block 2c + 1 the high ones.
        for (c, (out, qs)) in out[..QK_K]
            .chunks_exact_mut(64)
            .zip(self.qs.chunks_exact(32))
            .enumerate()
        {
            let (lo, hi) = out.split_at_mut(32);
            let d1 = d * f32::from(sc[2 * c]);
            let m1 = dmin * f32::from(mn[2 * c]);
            let d2 = d * f32::from(sc[2 * c + 1]);
            let m2 = dmin * f32::from(mn[2 * c + 1]);
            for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
                *l = d1 * f32::from(q & 0x0f) - m1;
                *h = d2 * f32::from(q >> 4) - m2;
            }
        }
    }
}

impl QuantBlock for BlockQ5K {
    #[inline]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        let dmin = f16_bits_to_f32(self.dmin.to_bits());
        let (sc, mn) = k4_scales_mins(&self.scales);
        // As Q4_K, plus bit k of qh[j] as the fifth bit of value 32k + j.
        let out = &mut out[..QK_K];
        let sub = |k: usize| (d * f32::from(sc[k]), dmin * f32::from(mn[k]));
        let qs = &self.qs;
        let qh = &self.qh;
        q5k_pair::<0>(&qs[..32], qh, [sub(0), sub(1)], &mut out[..64]);
        q5k_pair::<2>(&qs[32..64], qh, [sub(2), sub(3)], &mut out[64..128]);
        q5k_pair::<4>(&qs[64..96], qh, [sub(4), sub(5)], &mut out[128..192]);
        q5k_pair::<6>(&qs[96..], qh, [sub(6), sub(7)], &mut out[192..]);
    }
}

/// 64 values of a Q5_K block: the low then the high nibbles of `qs`, with fifth bits `BIT` and
/// `BIT + 1` of `qh`; `sub` holds (scale, minimum) of the two sub-blocks.
#[inline(always)]
fn q5k_pair<const BIT: u32>(qs: &[u8], qh: &[u8], sub: [(f32, f32); 2], out: &mut [f32]) {
    let (lo, hi) = out[..64].split_at_mut(32);
    let [(d1, m1), (d2, m2)] = sub;
    for (((l, h), &q), &b) in lo
        .iter_mut()
        .zip(hi.iter_mut())
        .zip(&qs[..32])
        .zip(&qh[..32])
    {
        let q1 = (q & 0x0f) | (((b >> BIT) & 1) << 4);
        let q2 = (q >> 4) | (((b >> (BIT + 1)) & 1) << 4);
        *l = d1 * f32::from(q1) - m1;
        *h = d2 * f32::from(q2) - m2;
    }
}

impl QuantBlock for BlockQ6K {
    #[inline]
    fn dequantize(&self, out: &mut [f32]) {
        let d = f16_bits_to_f32(self.d.to_bits());
        // Value 128 * h + 32 * s + j: low nibble (shift 4 * (s / 2)) of
        // ql[64 * h + 32 * (s % 2) + j], high bits 2s..2s+2 of qh[32 * h + j].
        let out = &mut out[..QK_K];
        let dl = |i: usize| d * f32::from(self.scales[i]);
        for h in 0..2 {
            let ql = &self.ql[64 * h..64 * h + 64];
            let qh = &self.qh[32 * h..32 * h + 32];
            let out = &mut out[128 * h..128 * h + 128];
            let i = 8 * h;
            q6k_group::<0>(ql, qh, [dl(i), dl(i + 1)], &mut out[..32]);
            q6k_group::<1>(ql, qh, [dl(i + 2), dl(i + 3)], &mut out[32..64]);
            q6k_group::<2>(ql, qh, [dl(i + 4), dl(i + 5)], &mut out[64..96]);
            q6k_group::<3>(ql, qh, [dl(i + 6), dl(i + 7)], &mut out[96..]);
        }
    }
}

/// 32 values `32 * S + j` of one half of a Q6_K block (`ql`: its 64 bytes, `qh`: its 32);
/// `dl` holds the scales of the two sub-blocks of 16.
#[inline(always)]
fn q6k_group<const S: usize>(ql: &[u8], qh: &[u8], dl: [f32; 2], out: &mut [f32]) {
    let ql = &ql[32 * (S % 2)..32 * (S % 2) + 32];
    for (((out, ql), qh), dl) in out[..32]
        .chunks_exact_mut(16)
        .zip(ql.chunks_exact(16))
        .zip(qh[..32].chunks_exact(16))
        .zip(dl)
    {
        for ((o, &l), &hb) in out.iter_mut().zip(ql).zip(qh) {
            let q = i32::from((l >> (4 * (S / 2))) & 0x0f) | (i32::from((hb >> (2 * S)) & 3) << 4);
            *o = dl * (q - 32) as f32;
        }
    }
}

impl QuantBlock for BlockQ8K {
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d;
        for (o, &q) in out[..QK_K].iter_mut().zip(&self.qs) {
            *o = d * f32::from(q);
        }
    }
}

macro_rules! row_fns {
    ($($name:ident: $block:ty),* $(,)?) => {
        $(
            #[doc = concat!(
                "Dequantizes `", stringify!($block), "` blocks into `dst`, which must hold exactly ",
                "`src.len() * ", stringify!($block), "::BLOCK` values."
            )]
            pub fn $name(src: &[$block], dst: &mut [f32]) -> Result<(), QuantError> {
                dequantize_blocks(src, dst)
            }
        )*
    };
}

row_fns!(
    dequantize_row_q4_0: BlockQ4_0,
    dequantize_row_q4_1: BlockQ4_1,
    dequantize_row_q5_0: BlockQ5_0,
    dequantize_row_q5_1: BlockQ5_1,
    dequantize_row_q8_0: BlockQ8_0,
    dequantize_row_q8_1: BlockQ8_1,
    dequantize_row_q2_k: BlockQ2K,
    dequantize_row_q3_k: BlockQ3K,
    dequantize_row_q4_k: BlockQ4K,
    dequantize_row_q5_k: BlockQ5K,
    dequantize_row_q6_k: BlockQ6K,
    dequantize_row_q8_k: BlockQ8K,
);
