//! Timed loops (no criterion) for the per-token costs of this crate on a TinyLlama-1.1B shape
//! (22 layers, n_embd 2048, n_ff 5632):
//!
//! - activation profiling (`ActivationProfile::add`): counting cost per token, all layers;
//! - predictor quality accumulation (`PredictorQuality::add`) per token, all layers;
//! - predictor scoring (`Predictor::scores`) per token and layer, for ranks 256 and 1024 in
//!   F16 and Q4_0, one token and blocks of 64, on 1 thread and on all cores.
//!
//! `cargo bench -p powerinfer-predictor --bench predictor` (`-- --quick` for fewer repeats).

use std::hint::black_box;
use std::time::Instant;

use powerinfer_gguf::quants::quantize;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::{MatMul, ThreadPool};
use powerinfer_predictor::predictor::Predictor;
use powerinfer_predictor::profile::ActivationProfile;
use powerinfer_predictor::quality::PredictorQuality;

const N_LAYER: usize = 22;
const N_EMBD: usize = 2048;
const N_FF: usize = 5632;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Best of `reps` runs of `f` (each run does `work` units); returns ns per unit.
fn best_ns(reps: usize, work: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_nanos() as f64 / work as f64);
    }
    best
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let reps = if quick { 3 } else { 10 };
    let mut rng = Lcg(42);

    // Activations: 10 % non-zero (ReLU-like), 64 tokens per layer.
    const T: usize = 64;
    let acts: Vec<Vec<f32>> = (0..N_LAYER)
        .map(|_| {
            (0..T * N_FF)
                .map(|_| {
                    let x = rng.next();
                    if x > 0.8 {
                        x
                    } else {
                        0.0
                    }
                })
                .collect()
        })
        .collect();
    let scores: Vec<f32> = (0..T * N_FF).map(|_| rng.next()).collect();

    println!("TinyLlama shape: {N_LAYER} layers, n_embd {N_EMBD}, n_ff {N_FF}");
    let mut prof = ActivationProfile::new(N_LAYER, N_FF);
    let ns = best_ns(reps, T, || {
        for t in 0..T {
            for (l, a) in acts.iter().enumerate() {
                prof.add(l, 1, &a[t * N_FF..(t + 1) * N_FF]).unwrap();
            }
        }
    });
    println!(
        "profile counting, token by token: {:.1} µs/token ({:.2} ns/neuron)",
        ns / 1e3,
        ns / (N_LAYER * N_FF) as f64
    );
    let ns = best_ns(reps, T, || {
        for (l, a) in acts.iter().enumerate() {
            prof.add(l, T, a).unwrap();
        }
    });
    println!("profile counting, blocks of {T}: {:.1} µs/token", ns / 1e3);
    // In the engine the activations were just computed (in cache): one row per layer, reused.
    let ns = best_ns(reps, T, || {
        for t in 0..T {
            for (l, a) in acts.iter().enumerate() {
                prof.add(l, 1, &a[..N_FF]).unwrap();
            }
            black_box(t);
        }
    });
    println!(
        "profile counting, activations in cache: {:.1} µs/token ({:.2} ns/neuron)",
        ns / 1e3,
        ns / (N_LAYER * N_FF) as f64
    );
    black_box(&prof);

    let mut q = PredictorQuality::new(N_LAYER, N_FF);
    let ns = best_ns(reps, T, || {
        for (l, a) in acts.iter().enumerate() {
            q.add(l, T, a, &scores, 0.0).unwrap();
        }
    });
    println!("quality accumulation: {:.1} µs/token", ns / 1e3);
    black_box(&q);

    let n_cpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let h: Vec<f32> = (0..T * N_EMBD).map(|_| rng.next()).collect();
    for rank in [256usize, 1024] {
        let fc1: Vec<f32> = (0..rank * N_EMBD).map(|_| rng.next() * 0.02).collect();
        let fc2: Vec<f32> = (0..N_FF * rank).map(|_| rng.next() * 0.05).collect();
        for ty in [GgmlType::F16, GgmlType::Q4_0] {
            let enc = |v: &[f32]| {
                let n = ty.bytes_for(v.len() as u64).unwrap() as usize;
                let mut b = vec![0u8; n];
                quantize(ty, v, &mut b).unwrap();
                b
            };
            let (b1, b2) = (enc(&fc1), enc(&fc2));
            let p = Predictor::from_bytes(ty, &b1, ty, &b2, N_EMBD, rank, N_FF).unwrap();
            for threads in [1, n_cpu] {
                let pool = ThreadPool::new(threads);
                let mm = MatMul::new(&pool);
                let mut hidden = Vec::new();
                let mut out = vec![0f32; T * N_FF];
                let ns1 = best_ns(reps * 10, 1, || {
                    p.scores_with(&mm, &h[..N_EMBD], 1, &mut hidden, &mut out[..N_FF])
                        .unwrap();
                });
                let ns64 = best_ns(reps, T, || {
                    p.scores_with(&mm, &h, T, &mut hidden, &mut out).unwrap();
                });
                println!(
                    "predictor r={rank:4} {:4} {threads} thr: {:8.1} µs/token/layer (1 token, {:.1} GB/s), {:7.1} µs/token/layer in blocks of {T}; {:.2} MB/layer",
                    ty.name(),
                    ns1 / 1e3,
                    p.bytes_per_token() as f64 / ns1,
                    ns64 / 1e3,
                    p.bytes_per_token() as f64 / 1e6
                );
                black_box(&out);
            }
        }
    }
}
