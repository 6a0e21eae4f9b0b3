//! The non-matrix operators of `powerinfer_kernels_cpu::ops`, scalar vs AVX2 where both exist.
//!
//! - `rms_norm/<isa>/4096`: one token of a 7B model (throughput in input bytes).
//! - `softmax/<isa>/<n>`: one attention row of `n` scores.
//! - `rope/<mode>`: 32 heads × 128 at one position.
//! - `attention/<isa>/<shape>/t<threads>/<n_pos>`: one new token over an F16 KV cache of `n_pos`
//!   positions; shapes `mha32` (32 heads, 32 kv heads, 128, LLaMA-2-7B) and `gqa32x8`
//!   (32 heads, 8 kv heads, 128). Throughput in bytes of K and V read.
//! - `attention_block/<isa>/t<threads>/<T>`: a causal block of `T` new tokens after 256 cached
//!   positions (mha32).
//! - `attention_kv/<isa>/<K>-<V>/t<threads>/<n_pos>`: one new token over caches of the types `K`
//!   and `V` (f16, q8_0, q4_0), TinyLlama's shape (32 heads, 4 kv heads, 64). Throughput in
//!   bytes of K and V read.
//!
//! Run: `cargo bench -p powerinfer-benches --bench ops -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use powerinfer_kernels_cpu::ops::attention::{
    attention_block_with, attention_with, AttentionParams,
};
use powerinfer_kernels_cpu::ops::attention_kv::{attention_kv_with, kv_bytes_read};
use powerinfer_kernels_cpu::ops::kv::{KvBuf, KvType};
use powerinfer_kernels_cpu::ops::norm::rms_norm_with;
use powerinfer_kernels_cpu::ops::rope::{rope, RopeMode, RopeParams};
use powerinfer_kernels_cpu::ops::softmax::softmax_with;
use powerinfer_kernels_cpu::Backend;
use powerinfer_kernels_cpu::ThreadPool;
use std::hint::black_box;

/// Deterministic pseudo-random values in [-1, 1) (SplitMix64).
fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    powerinfer_benches::splitmix64(seed)
        .take(n)
        .map(|z| (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        .collect()
}

fn random_f16(n: usize, seed: u64) -> Vec<f16> {
    random_f32(n, seed).into_iter().map(f16::from_f32).collect()
}

fn bench_elementwise(c: &mut Criterion) {
    let mut g = c.benchmark_group("rms_norm");
    let n = 4096;
    let x = random_f32(n, 1);
    let w = random_f32(n, 2);
    let mut out = vec![0f32; n];
    g.throughput(Throughput::Bytes((n * 4) as u64));
    for isa in Backend::available() {
        g.bench_with_input(BenchmarkId::new(isa.name(), n), &n, |b, _| {
            b.iter(|| rms_norm_with(isa, black_box(&x), &w, 1e-6, &mut out).unwrap())
        });
    }
    g.finish();

    let mut g = c.benchmark_group("softmax");
    for n in [256usize, 2048] {
        let x = random_f32(n, 3);
        let mut y = x.clone();
        g.throughput(Throughput::Elements(n as u64));
        for isa in Backend::available() {
            g.bench_with_input(BenchmarkId::new(isa.name(), n), &n, |b, _| {
                b.iter(|| {
                    y.copy_from_slice(&x);
                    softmax_with(isa, black_box(&mut y), 0.088).unwrap();
                })
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("rope");
    let x = random_f32(32 * 128, 4);
    let mut y = x.clone();
    for mode in [RopeMode::Normal, RopeMode::NeoX] {
        let p = RopeParams::new(128, mode);
        g.bench_function(format!("{mode:?}"), |b| {
            b.iter(|| {
                y.copy_from_slice(&x);
                rope(black_box(&mut y), 32, 128, 1000, &p).unwrap();
            })
        });
    }
    g.finish();
}

fn bench_attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    let n_threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut thread_counts = vec![1usize];
    if n_threads > 1 {
        thread_counts.push(n_threads);
    }
    for (name, n_kv) in [("mha32", 32usize), ("gqa32x8", 8)] {
        let p = AttentionParams::new(32, n_kv, 128);
        for n_pos in [256usize, 2048] {
            let q = random_f32(p.q_len(), 5);
            let k = random_f16(n_pos * p.kv_row_len(), 6);
            let v = random_f16(n_pos * p.kv_row_len(), 7);
            let mut out = vec![0f32; p.q_len()];
            g.throughput(Throughput::Bytes((2 * k.len() * 2) as u64));
            for isa in Backend::available() {
                for &t in &thread_counts {
                    let pool = ThreadPool::new(t);
                    let id = BenchmarkId::new(format!("{}/{name}/t{t}", isa.name()), n_pos);
                    g.bench_with_input(id, &n_pos, |b, _| {
                        b.iter(|| {
                            attention_with(isa, &pool, black_box(&q), &k, &v, &p, &mut out).unwrap()
                        })
                    });
                }
            }
        }
    }
    g.finish();

    let mut g = c.benchmark_group("attention_block");
    let p = AttentionParams::new(32, 32, 128);
    let n_tokens = 64;
    let n_pos = 256 + n_tokens;
    let q = random_f32(n_tokens * p.q_len(), 8);
    let k = random_f16(n_pos * p.kv_row_len(), 9);
    let v = random_f16(n_pos * p.kv_row_len(), 10);
    let mut out = vec![0f32; n_tokens * p.q_len()];
    g.throughput(Throughput::Elements(n_tokens as u64));
    for isa in Backend::available() {
        for &t in &thread_counts {
            let pool = ThreadPool::new(t);
            let id = BenchmarkId::new(format!("{}/t{t}", isa.name()), n_tokens);
            g.bench_with_input(id, &n_tokens, |b, _| {
                b.iter(|| {
                    attention_block_with(isa, &pool, black_box(&q), &k, &v, n_tokens, &p, &mut out)
                        .unwrap()
                })
            });
        }
    }
    g.finish();
}

fn bench_attention_kv(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention_kv");
    let p = AttentionParams::new(32, 4, 64);
    let n_threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut thread_counts = vec![1usize];
    if n_threads > 1 {
        thread_counts.push(n_threads);
    }
    let types = [
        (KvType::F16, KvType::F16),
        (KvType::Q8_0, KvType::Q8_0),
        (KvType::Q4_0, KvType::Q4_0),
        (KvType::Q8_0, KvType::F16),
    ];
    for n_pos in [512usize, 4096] {
        let q = random_f32(p.q_len(), 11);
        let rows = random_f32(n_pos * p.kv_row_len(), 12);
        let mut out = vec![0f32; p.q_len()];
        for (tk, tv) in types {
            let mut k = KvBuf::new(tk, p.n_kv_head, p.head_dim).unwrap();
            let mut v = KvBuf::new(tv, p.n_kv_head, p.head_dim).unwrap();
            k.push_f32(&rows).unwrap();
            v.push_f32(&rows).unwrap();
            let bytes = kv_bytes_read(tk, tv, n_pos, p.kv_row_len());
            g.throughput(Throughput::Bytes(bytes as u64));
            for isa in Backend::available() {
                for &t in &thread_counts {
                    let pool = ThreadPool::new(t);
                    let id = BenchmarkId::new(format!("{}/{tk}-{tv}/t{t}", isa.name()), n_pos);
                    g.bench_with_input(id, &n_pos, |b, _| {
                        b.iter(|| {
                            let (kv, vv) = (k.view(), v.view());
                            attention_kv_with(isa, &pool, black_box(&q), kv, vv, 1, &p, &mut out)
                                .unwrap()
                        })
                    });
                }
            }
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_elementwise,
    bench_attention,
    bench_attention_kv
);
criterion_main!(benches);
