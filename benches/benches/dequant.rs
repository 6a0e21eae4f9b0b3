//! Throughput of the quantization codecs in `powerinfer_gguf::quants`.
//!
//! - `dequant/<TYPE>`: dequantization of about 4 MiB of tensor bytes to f32; throughput is in
//!   bytes of *input* (the quantized data), so the figures compare directly with memory
//!   bandwidth.
//! - `quant/<TYPE>`: quantization of activation-sized rows (16384 f32 values, 64 KiB); throughput
//!   in bytes of f32 input. Q8_0/Q8_1/Q8_K run per token in the kernels; Q4_K/Q6_K (weight
//!   formats with a scale search) are there for scale.
//!
//! Run: `cargo bench -p powerinfer-benches --bench dequant -- --warm-up-time 1 --measurement-time 3`

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use powerinfer_gguf::quants::{dequantize, quantize};
use powerinfer_gguf::GgmlType;
use std::hint::black_box;

/// Input size of the dequantization benchmarks.
const DEQUANT_BYTES: usize = 4 << 20;

/// Deterministic pseudo-random bytes (SplitMix64).
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    powerinfer_benches::splitmix64(seed)
        .take(n)
        .map(|z| z as u8)
        .collect()
}

/// Byte offsets of the f16/f32 scale fields in a block, which are made finite.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q8_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        F16 => &[0],
        _ => &[],
    }
}

/// About `DEQUANT_BYTES` of valid `ty` data: random, with scales made finite.
fn tensor(ty: GgmlType) -> Vec<u8> {
    let size = ty.type_size();
    let mut bytes = random_bytes(DEQUANT_BYTES / size * size, u64::from(ty.id()));
    for block in bytes.chunks_exact_mut(size) {
        for &o in scale_offsets(ty) {
            block[o + 1] &= 0xbb;
        }
        if ty == GgmlType::Q8_K {
            block[3] &= 0xbf;
        }
    }
    bytes
}

fn bench_dequant(c: &mut Criterion) {
    use GgmlType::*;
    let mut group = c.benchmark_group("dequant");
    for ty in [
        F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
    ] {
        let src = tensor(ty);
        let n = src.len() / ty.type_size() * ty.block_size();
        let mut dst = vec![0.0f32; n];
        group.throughput(Throughput::Bytes(src.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(ty), &src, |b, src| {
            b.iter(|| dequantize(ty, black_box(src), black_box(&mut dst)).unwrap())
        });
    }
    group.finish();
}

fn bench_quant(c: &mut Criterion) {
    use GgmlType::*;
    const N: usize = 16384;
    let raw = random_bytes(N * 2, 7);
    // Roughly normal activations from sums of uniforms.
    let x: Vec<f32> = raw
        .chunks_exact(2)
        .map(|p| (f32::from(p[0]) + f32::from(p[1]) - 255.0) / 64.0)
        .collect();
    let mut group = c.benchmark_group("quant");
    group.throughput(Throughput::Bytes((N * 4) as u64));
    for ty in [
        F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q8_K, Q4_K, Q6_K,
    ] {
        let mut dst = vec![0u8; N / ty.block_size() * ty.type_size()];
        group.bench_with_input(BenchmarkId::from_parameter(ty), &x, |b, x| {
            b.iter(|| quantize(ty, black_box(x), black_box(&mut dst)).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench_dequant, bench_quant);
criterion_main!(benches);
