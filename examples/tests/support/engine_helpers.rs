//! Engine helpers of the tool tests that run the models they write (`tests/reorder.rs`,
//! `tests/convert_falcon_opt.rs`; each includes this file with `#[path]`).
#![allow(dead_code)]

use powerinfer_engine::EngineOptions;

/// Engine options of the tests: 2 threads, θ = 0, a 256-position context.
pub fn opts(dense: bool) -> EngineOptions {
    let mut o = EngineOptions::default();
    o.threads = 2;
    o.sparse_threshold = Some(0.0);
    o.dense = dense;
    o.ctx_len = 256;
    o.mmap = false;
    o
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

/// The index of the largest value (the first of equal ones): a greedy token.
pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as u32
}
