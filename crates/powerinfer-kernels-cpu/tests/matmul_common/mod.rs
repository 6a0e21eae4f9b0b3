//! Shared helpers of the matrix-kernel tests: random weights of every type, error bounds.
#![allow(dead_code)]

use half::{bf16, f16};
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::reference::matmul as r;

/// Unit roundoff of f32.
pub const U: f64 = f32::EPSILON as f64 / 2.0;

/// A small deterministic generator (SplitMix64) so the tests need no extra crate.
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Random weights of `ty`: random bytes for the quantized values, finite random scales
/// (`d` in ±0.05, minimums in ±0.02; the K-quant super-scales smaller so values stay near ±1).
pub fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    use GgmlType as T;
    let n_blocks = rows * cols / ty.block_size();
    let ts = ty.type_size();
    let mut data = vec![0u8; n_blocks * ts];
    match ty {
        T::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.f32().to_le_bytes());
            }
        }
        T::F16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(rng.f32()).to_le_bytes());
            }
        }
        T::BF16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&bf16::from_f32(rng.f32()).to_le_bytes());
            }
        }
        _ => {
            for b in data.iter_mut() {
                *b = rng.next_u64() as u8;
            }
            for blk in data.chunks_exact_mut(ts) {
                match ty {
                    T::Q8_0 | T::Q4_0 | T::Q5_0 => put_f16(blk, 0, 0.05 * rng.f32()),
                    T::Q4_1 | T::Q5_1 => {
                        put_f16(blk, 0, 0.05 * rng.f32());
                        put_f16(blk, 2, 0.02 * rng.f32());
                    }
                    T::Q4_K | T::Q5_K => {
                        put_f16(blk, 0, 0.002 * rng.f32());
                        put_f16(blk, 2, 0.002 * rng.f32());
                    }
                    T::Q6_K => put_f16(blk, 208, 0.0005 * rng.f32()),
                    T::Q2_K => {
                        put_f16(blk, 80, 0.01 * rng.f32());
                        put_f16(blk, 82, 0.01 * rng.f32());
                    }
                    T::Q3_K => put_f16(blk, 108, 0.002 * rng.f32()),
                    _ => unreachable!("not a kernel type"),
                }
            }
        }
    }
    data
}

/// Per element, the sum of the absolute values of the parts that make the weight (scale part and
/// minimum part), which bounds the magnitude of the intermediate terms the kernels round.
pub fn abs_parts(ty: GgmlType, data: &[u8]) -> Vec<f64> {
    use GgmlType as T;
    let full = r::dequantize(ty, data).expect("type");
    let min_off = match ty {
        T::Q4_1 | T::Q5_1 | T::Q4_K | T::Q5_K => Some(2),
        T::Q2_K => Some(82),
        _ => None,
    };
    let Some(off) = min_off else {
        return full.iter().map(|v| v.abs()).collect();
    };
    let mut scaled = data.to_vec();
    for blk in scaled.chunks_exact_mut(ty.type_size()) {
        blk[off] = 0;
        blk[off + 1] = 0;
    }
    let p = r::dequantize(ty, &scaled).expect("type");
    full.iter()
        .zip(&p)
        .map(|(w, p)| p.abs() + (w - p).abs())
        .collect()
}

pub fn random_vec(n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n).map(|_| rng.f32()).collect()
}

pub fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

/// Product bounds for `y[t][r]`: (tight, loose). Tight: against the reference on the decoded
/// weights and the quantized-then-decoded activations, `(cols/4 + 16)·u·Σ|w||x̂|` — a
/// summation tree no deeper than cols/4 + a few levels (8-lane accumulators, one f32 term per
/// block) and a handful of roundings per term (scale products, i32→f32). Loose: against exact
/// f64 on the f32 activations: the tight bound plus the activation-quantization error
/// `Σ|w|·e` with `e` from `activation_error_bound`.
pub fn product_bounds(
    ty: GgmlType,
    abs_w: &[f64],
    rows: usize,
    cols: usize,
    x: &[f32],
    xq: &[f64],
    n_tokens: usize,
) -> (Vec<f64>, Vec<f64>) {
    let k = (cols / 4 + 16) as f64 * U;
    let mut tight = vec![0f64; rows * n_tokens];
    let mut loose = vec![0f64; rows * n_tokens];
    for t in 0..n_tokens {
        let xs = &x[t * cols..(t + 1) * cols];
        let e = r::activation_error_bound(ty, xs);
        for row in 0..rows {
            let w = &abs_w[row * cols..(row + 1) * cols];
            let s: f64 = (0..cols).map(|c| w[c] * xq[t * cols + c].abs()).sum();
            let q: f64 = (0..cols).map(|c| w[c] * e[c]).sum();
            tight[t * rows + row] = k * s + 1e-30;
            loose[t * rows + row] = k * s + q * 1.0001 + 1e-30;
        }
    }
    (tight, loose)
}

/// Asserts `|got − want| ≤ bound` elementwise, with a helpful message.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], bound: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &b)) in got.iter().zip(want).zip(bound).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= b,
            "{what}: element {i}: got {g}, want {w}, error {err:e} > bound {b:e}"
        );
    }
}
