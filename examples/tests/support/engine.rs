//! Helpers of the engine's integration tests that run models (`examples/tests/engine*.rs`) and
//! of the command's tool tests that run the models they write (`reorder.rs`,
//! `convert_falcon_opt.rs`): each includes this file with `#[path]`. The models are made by
//! the synthetic generator, which is the command's (so these tests are the command
//! package's, and the engine has no dependency on the command, not even a dev one).
#![allow(dead_code)]

use std::path::PathBuf;

use powerinfer_cli::synth::{self, Arch, Family, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::EngineOptions;
use powerinfer_gguf::GgmlType;

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

/// A tiny synthetic PowerInfer file and its dense twin in a temporary directory.
pub struct Files {
    _dir: tempfile::TempDir,
    pub sparse: PathBuf,
    pub dense: PathBuf,
}

/// Writes the `tiny` shape of type `ty` and architecture `arch` with `seed`.
pub fn make(ty: GgmlType, arch: Arch, seed: u64) -> Files {
    make_family(
        ty,
        match arch {
            Arch::Llama => Family::Llama,
            Arch::Bamboo => Family::Bamboo,
        },
        seed,
    )
}

/// Writes the `tiny` shape of type `ty` and model family `family` (any of the four) with `seed`.
pub fn make_family(ty: GgmlType, family: Family, seed: u64) -> Files {
    let dir = tempfile::tempdir().unwrap();
    let sparse = dir.path().join("model.powerinfer.gguf");
    let dense = dir.path().join("model.gguf");
    let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
    cfg.ty = ty;
    cfg.set_family(family);
    cfg.seed = seed;
    let out = SynthOutputs {
        model: sparse.clone(),
        dense: Some(dense.clone()),
        activation_dir: None,
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    Files {
        _dir: dir,
        sparse,
        dense,
    }
}

/// The index of the largest value (the first of equal ones): a greedy token.
pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as u32
}
