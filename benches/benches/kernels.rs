//! Matrix kernels of `powerinfer-kernels-cpu` on LLaMA-7B shapes: dense GEMV per weight type,
//! GEMM (T = 32), and the sparse product / sparse axpy at 10% density, on 1 and 2 threads,
//! for the best backend and for scalar. Throughput is reported in weight bytes read (for the
//! sparse kernels, only the selected rows). `powerinfer bench kernels` gives the full table with
//! the ratio to measured memory bandwidth.
//!
//! Run: `cargo bench -p powerinfer-benches --bench kernels`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::matmul::supported_types;
use powerinfer_kernels_cpu::probe::{random_weights, SplitMix64};
use powerinfer_kernels_cpu::{Backend, MatMul, RowSelect, ThreadPool, Weights};
use std::hint::black_box;
use std::time::Duration;

fn bench_kernels(c: &mut Criterion) {
    let mut rng = SplitMix64(1);
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
        let data = random_weights(ty, rows, cols, &mut rng);
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
        let data = random_weights(ty, rows, cols, &mut rng);
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
        .map(|_| if rng.next_u64() % 10 == 0 { 1.0 } else { -1.0 })
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
        let data = random_weights(ty, rows, cols, &mut rng);
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
