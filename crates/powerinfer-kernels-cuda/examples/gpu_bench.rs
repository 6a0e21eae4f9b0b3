//! GPU benchmark of the matrix kernels: effective GB/s (weight bytes of the rows a kernel must read,
//! divided by its time) against the device's measured device-to-device copy bandwidth, for sparse
//! densities from 1% to 100%. Run by `scripts/gpu-check`; prints a table. Exits 0 with
//! "skipped: no GPU (reason)" when there is no GPU.
//!
//! Usage: gpu_bench [ROWS [COLS [REPS]]]   (defaults 11008 4096 20: a LLaMA-7B FFN matrix)

use std::time::Instant;

use powerinfer_gguf::quants::quantize_to_vec;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cuda::{DeviceTensor, Gpu, GpuSlice, Stream};

fn time_ms(stream: &Stream, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    stream.synchronize().expect("sync");
    let t0 = Instant::now();
    for _ in 0..reps {
        f();
    }
    stream.synchronize().expect("sync");
    t0.elapsed().as_secs_f64() * 1e3 / reps as f64
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rows = args.first().copied().unwrap_or(11008);
    let cols = args.get(1).copied().unwrap_or(4096);
    let reps = args.get(2).copied().unwrap_or(20).max(1);
    let gpu = match Gpu::detect() {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no GPU ({e})");
            return;
        }
    };
    let info = gpu.info();
    println!(
        "device: {} (cc {}.{}, {:.1} GiB, kernels from {:?})",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.total_memory as f64 / (1u64 << 30) as f64,
        info.image
    );
    let s = gpu.stream();

    // Copy bandwidth: read + write bytes of a device-to-device copy of 256 MiB.
    let n = 64 << 20;
    let src = gpu.alloc_zeros::<f32>(s, n).expect("alloc");
    let mut dst = gpu.alloc_zeros::<f32>(s, n).expect("alloc");
    let ms = time_ms(s, reps, || {
        s.cuda()
            .memcpy_dtod(src.cuda(), dst.cuda_mut())
            .expect("copy");
    });
    let copy_gbs = 2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9;
    println!("copy bandwidth (dtod, read+write): {copy_gbs:.0} GB/s");
    drop((src, dst));

    let mut state = 0x1234_5678_9abc_def0u64;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let vals: Vec<f32> = (0..rows * cols).map(|_| rnd() as f32 * 2.0 - 1.0).collect();
    let x: Vec<f32> = (0..cols).map(|_| rnd() as f32).collect();
    let a: Vec<f32> = (0..rows).map(|_| rnd() as f32).collect();
    let scores: Vec<f32> = (0..rows).map(|_| rnd() as f32).collect();
    let bucket: Vec<u32> = (0..rows as u32).collect();
    let xd = gpu.upload(s, &x).expect("upload");
    let ad = gpu.upload(s, &a).expect("upload");
    let pd = gpu.upload(s, &scores).expect("upload");
    let mut y_rows = gpu.alloc_zeros::<f32>(s, rows).expect("alloc");
    let mut y_cols = gpu.alloc_zeros::<f32>(s, cols).expect("alloc");

    println!(
        "{:<6} {:<14} {:>8} {:>10} {:>9} {:>7}",
        "type", "kernel", "density", "time(us)", "GB/s", "%copy"
    );
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        let bytes = quantize_to_vec(ty, &vals).expect("quantize");
        let row_bytes = bytes.len() / rows;
        let slice = GpuSlice::upload(&gpu, s, ty, cols, &bytes, rows, &bucket).expect("upload");
        let dense = DeviceTensor::upload(&gpu, s, ty, rows, cols, &bytes).expect("upload");
        let ms = time_ms(s, reps, || {
            gpu.matmul(s, &dense, &xd, 1, &mut y_rows).expect("matmul")
        });
        let gbs = bytes.len() as f64 / (ms * 1e-3) / 1e9;
        println!(
            "{:<6} {:<14} {:>7}% {:>10.1} {:>9.0} {:>6.0}%",
            ty.name(),
            "matmul dense",
            100,
            ms * 1e3,
            gbs,
            100.0 * gbs / copy_gbs
        );
        for density in [1u32, 5, 10, 25, 50, 100] {
            // Scores are uniform in [0, 1): theta = 1 - density selects that fraction.
            let theta = 1.0 - density as f32 / 100.0;
            let active = scores.iter().filter(|&&p| p >= theta).count();
            let moved = (active * row_bytes) as f64;
            let ms = time_ms(s, reps, || {
                gpu.sparse_matmul(s, &slice, &xd, &pd, theta, 1, &mut y_rows)
                    .expect("sparse_matmul")
            });
            let gbs = moved / (ms * 1e-3) / 1e9;
            println!(
                "{:<6} {:<14} {:>7}% {:>10.1} {:>9.0} {:>6.0}%",
                ty.name(),
                "sparse_matmul",
                density,
                ms * 1e3,
                gbs,
                100.0 * gbs / copy_gbs
            );
            let ms = time_ms(s, reps, || {
                gpu.sparse_axpy(s, &slice, &ad, Some(&pd), theta, 1, &mut y_cols)
                    .expect("sparse_axpy")
            });
            let gbs = moved / (ms * 1e-3) / 1e9;
            println!(
                "{:<6} {:<14} {:>7}% {:>10.1} {:>9.0} {:>6.0}%",
                ty.name(),
                "sparse_axpy",
                density,
                ms * 1e3,
                gbs,
                100.0 * gbs / copy_gbs
            );
        }
    }
}
