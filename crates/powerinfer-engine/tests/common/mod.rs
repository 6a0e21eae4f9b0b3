//! Helpers shared by the engine's integration tests.

use powerinfer_engine::engine::EngineOptions;

/// Engine options of the tests: 2 threads, θ = 0, a 256-position context.
pub fn opts(dense: bool) -> EngineOptions {
    EngineOptions {
        threads: 2,
        sparse_threshold: Some(0.0),
        dense,
        ctx_len: 256,
        batch: 64,
        mmap: false,
        repack: false,
    }
}

/// A fixed prompt of ordinary token ids (BOS first).
pub const PROMPT: [u32; 12] = [1, 300, 301, 77, 120, 5, 260, 400, 33, 90, 270, 11];

/// max |a - b| / std(b).
pub fn rel_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mean = b.iter().sum::<f64>() / b.len() as f64;
    let var = b.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / b.len() as f64;
    let max = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y).abs())
        .fold(0.0, f64::max);
    max / var.sqrt()
}
