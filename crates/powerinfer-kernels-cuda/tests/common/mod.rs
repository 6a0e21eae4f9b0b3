//! Shared helpers of the GPU tests: the device (or a skip), random data, tolerances.
#![allow(dead_code)]

use std::sync::OnceLock;

use powerinfer_gguf::quants::quantize_to_vec;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::reference::matmul::dequantize;
use powerinfer_kernels_cuda::Gpu;

/// The device, opened once per test binary; `None` (after printing "skipped: no GPU (reason)")
/// when there is none. With env POWERINFER_REQUIRE_GPU set (scripts/gpu-check sets it), a missing
/// GPU is a failure instead.
pub fn gpu() -> Option<&'static Gpu> {
    static GPU: OnceLock<Result<Gpu, String>> = OnceLock::new();
    match GPU.get_or_init(|| Gpu::detect().map_err(|e| e.to_string())) {
        Ok(g) => Some(g),
        Err(reason) => {
            if std::env::var_os("POWERINFER_REQUIRE_GPU").is_some() {
                panic!("POWERINFER_REQUIRE_GPU is set but there is no GPU: {reason}");
            }
            println!("skipped: no GPU ({reason})");
            None
        }
    }
}

/// A small deterministic generator (xorshift64*), so failures reproduce from the seed.
pub struct Rng(u64);

impl Rng {
    /// Seeded generator.
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    /// `n` values uniform in [-1, 1).
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.uniform(-1.0, 1.0)).collect()
    }
}

/// A random `rows × cols` matrix of type `ty`: its bytes and its exact values (f64).
pub fn random_weight(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> (Vec<u8>, Vec<f64>) {
    let vals = rng.vec(rows * cols);
    let bytes = quantize_to_vec(ty, &vals).expect("quantize");
    let exact = dequantize(ty, &bytes).expect("dequantize");
    (bytes, exact)
}

/// A random subset of 0..n (in random order) whose size is chosen by `mode`:
/// 0 = empty, 1 = all, else random.
pub fn random_bucket(rng: &mut Rng, n: usize, mode: u8) -> Vec<u32> {
    let mut all: Vec<u32> = (0..n as u32).collect();
    for i in (1..all.len()).rev() {
        let j = rng.below(i + 1);
        all.swap(i, j);
    }
    let k = match mode {
        0 => 0,
        1 => n,
        _ => rng.below(n + 1),
    };
    all.truncate(k);
    all
}

/// Asserts |got - want| <= 1e-4 * scale + 1e-5 elementwise, where `scale` bounds the magnitude
/// of the sum that produced each value (f32 accumulation error grows with it).
pub fn assert_close(what: &str, got: &[f32], want: &[f64], scale: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = 1e-4 * s + 1e-5;
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}[{i}]: got {g}, want {w} (tolerance {tol})"
        );
    }
}
