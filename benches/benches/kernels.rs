//! Matrix kernels of `powerinfer-kernels-cpu` on LLaMA-7B shapes: dense GEMV per weight type,
//! GEMM (T = 32), and the sparse product / sparse axpy at 10% density, on 1 and 2 threads,
//! for the best backend and for scalar. Throughput is reported in weight bytes read (for the
//! sparse kernels, only the selected rows). `powerinfer bench kernels` gives the full table with
//! the ratio to measured memory bandwidth.
//!
//! Run: `cargo bench -p powerinfer-benches --bench kernels`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use half::f16;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::matmul::supported_types;
use powerinfer_kernels_cpu::{Backend, MatMul, RowSelect, ThreadPool, Weights};
use std::hint::black_box;
use std::time::Duration;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Random weights with finite f16/f32 values and small scales.
fn weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let ts = ty.type_size();
    let mut data = vec![0u8; rows * cols / ty.block_size() * ts];
    match ty {
        GgmlType::F32 => data
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&rng.f32().to_le_bytes())),
        GgmlType::F16 | GgmlType::BF16 => data
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&f16::from_f32(rng.f32()).to_le_bytes())),
        _ => {
            data.iter_mut().for_each(|b| *b = rng.next() as u8);
            let d = f16::from_f32(0.01).to_le_bytes();
            let off = if ty == GgmlType::Q6_K { 208 } else { 0 };
            for blk in data.chunks_exact_mut(ts) {
                blk[off..off + 2].copy_from_slice(&d);
                if matches!(
                    ty,
                    GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K
                ) {
                    blk[2..4].copy_from_slice(&d);
                }
            }
        }
    }
    data
}

fn bench_kernels(c: &mut Criterion) {
    let mut rng = Rng(1);
    let (rows, cols) = (11008usize, 4096usize);
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let mut backends = vec![Backend::detect()];
    if Backend::detect() != Backend::Scalar {
        backends.push(Backend::Scalar);
    }
    // Dense GEMV, every type.
    let mut g = c.benchmark_group("dense_gemv_11008x4096");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for &ty in supported_types() {
        let data = weights(ty, rows, cols, &mut rng);
        let w = Weights::new(ty, rows, cols, &data).expect("shape");
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let mut y = vec![0f32; rows];
        g.throughput(Throughput::Bytes(data.len() as u64));
        for &backend in &backends {
            for pool in &pools {
                let mm = MatMul::with_backend(pool, backend).expect("available");
                let id = BenchmarkId::new(format!("{}/{backend}", ty.name()), pool.n_threads());
                g.bench_function(id, |b| {
                    b.iter(|| mm.gemv(&w, black_box(&x), &mut y).expect("ok"))
                });
            }
        }
    }
    g.finish();

    // GEMM, T = 32, the fast-path types, best backend, 2 threads.
    let mut g = c.benchmark_group("dense_gemm_11008x4096_t32");
    g.sample_size(10)
        .measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(300));
    let t = 32;
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        let data = weights(ty, rows, cols, &mut rng);
        let w = Weights::new(ty, rows, cols, &data).expect("shape");
        let x: Vec<f32> = (0..cols * t).map(|_| rng.f32()).collect();
        let mut y = vec![0f32; rows * t];
        g.throughput(Throughput::Elements((2 * rows * cols * t) as u64));
        let mm = MatMul::new(&pools[1]);
        g.bench_function(ty.name(), |b| {
            b.iter(|| mm.gemm(&w, black_box(&x), t, &mut y).expect("ok"))
        });
    }
    g.finish();

    // Sparse kernels at 10% density, best backend.
    let mut g = c.benchmark_group("sparse_11008x4096_10pct");
    g.sample_size(20)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    let scores: Vec<f32> = (0..rows)
        .map(|_| if rng.next() % 10 == 0 { 1.0 } else { -1.0 })
        .collect();
    let n_active = scores.iter().filter(|&&s| s > 0.0).count();
    let sel = RowSelect {
        scores: &scores,
        threshold: 0.0,
        skip: None,
    };
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
    ] {
        let data = weights(ty, rows, cols, &mut rng);
        let w = Weights::new(ty, rows, cols, &data).expect("shape");
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let a: Vec<f32> = scores
            .iter()
            .map(|&s| if s > 0.0 { rng.f32() } else { 0.0 })
            .collect();
        let mut y = vec![0f32; rows];
        let mut out = vec![0f32; cols];
        g.throughput(Throughput::Bytes((w.row_bytes() * n_active) as u64));
        for pool in &pools {
            let mm = MatMul::new(pool);
            g.bench_function(
                BenchmarkId::new(format!("sparse_gemv/{}", ty.name()), pool.n_threads()),
                |b| b.iter(|| mm.sparse_gemv(&w, black_box(&x), &sel, &mut y).expect("ok")),
            );
            g.bench_function(
                BenchmarkId::new(format!("sparse_axpy/{}", ty.name()), pool.n_threads()),
                |b| {
                    b.iter(|| {
                        mm.sparse_axpy(&w, black_box(&a), &sel, &mut out)
                            .expect("ok")
                    })
                },
            );
        }
    }
    g.finish();
}

criterion_group!(benches, bench_kernels);
criterion_main!(benches);
