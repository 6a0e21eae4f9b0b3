//! GPU benchmark of the matrix kernels: effective GB/s (weight bytes of the rows a kernel must read,
//! divided by its device time) against the device's measured device-to-device copy bandwidth.
//! Run by `scripts/gpu-check`. Exits 0 with "skipped: no GPU (reason)" when there is no GPU.
//!
//! Usage: gpu_bench [REPS]              the shape table (default; REPS default 20)
//!        gpu_bench ROWS COLS [REPS]    a density sweep (1% to 100%) of one matrix
//!
//! The shape table: LLaMA-7B's matrices (4096x4096 attention, 11008x4096 up/gate and the FFN's
//! rows, 4096x11008 down) and TinyLlama's (2048x2048, 5632x2048, 2048x5632), in Q4_0, Q8_0 and
//! F16: the dense one-token product (target: >= 75% of the copy bandwidth), on the FFN's
//! row-shaped matrices the sparse product and sparse axpy at 10% density (target: within 1.5x
//! the time to read their rows at the copy bandwidth), and the dense product of 512 tokens (the
//! prompt GEMM: TOPS, and its time against 512 one-token products). Each line says whether its
//! target is met; the exit status is 1 when one is missed.
//!
//! Three times per operator call, each the mean over REPS back-to-back calls:
//! - `dev(us)`: GPU time, from CUDA events around the REPS calls, queued behind a long copy so
//!   that the GPU runs them back to back (host submission is hidden): what the kernels cost.
//! - `host(us)`: host wall time of the REPS calls up to a stream synchronize (what a caller sees
//!   when it waits: max of submission and GPU time, plus one launch latency).
//! - `enq(us)`: host time to queue one call (cudarc + driver submission cost).
//!
//! When host ≈ enq > dev, the operator is bound by host submission, not by the GPU.
//! Weights are not served from L2: REPS copies of each matrix (up to 8 GiB) are rotated, one per
//! call, and a 256 MiB copy flushes L2 before each timed loop.
//! The sweep's last section repeats some rows with cudarc's multi-stream event tracking off
//! (buffers made after `disable_event_tracking`), which removes the cuStreamWaitEvent /
//! cuEventRecord that cudarc adds around every launch for every buffer argument.

use std::time::Instant;

use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use powerinfer_gguf::quants::quantize_to_vec;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cuda::{DeviceBuffer, Gpu, GpuSlice, Stream};

/// Per-call times in microseconds.
struct Times {
    dev: f64,
    host: f64,
    enq: f64,
}

/// A 256 MiB device-to-device copy: flushes L2 and keeps the GPU busy while the host queues.
struct Blocker {
    src: DeviceBuffer<f32>,
    dst: DeviceBuffer<f32>,
    /// Microseconds one copy takes on the GPU.
    copy_us: f64,
}

impl Blocker {
    fn copy(&mut self, s: &Stream) {
        s.cuda()
            .memcpy_dtod(self.src.cuda(), self.dst.cuda_mut())
            .expect("copy");
    }
}

fn measure(s: &Stream, reps: usize, blocker: &mut Blocker, mut f: impl FnMut()) -> Times {
    f();
    s.synchronize().expect("sync");
    // Host: flush L2, wait, then queue REPS calls and wait for them.
    blocker.copy(s);
    s.synchronize().expect("sync");
    let t0 = Instant::now();
    for _ in 0..reps {
        f();
    }
    let enq = t0.elapsed().as_secs_f64();
    s.synchronize().expect("sync");
    let host = t0.elapsed().as_secs_f64();
    // Device: enough copies ahead of the start event that the host has queued all REPS calls
    // before the GPU reaches it (the last copy also flushes L2).
    let n_block = ((2.0 * enq * 1e6 / blocker.copy_us).ceil() as usize + 1).min(1000);
    for _ in 0..n_block {
        blocker.copy(s);
    }
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = s.cuda().record_event(timing).expect("event");
    for _ in 0..reps {
        f();
    }
    let e1 = s.cuda().record_event(timing).expect("event");
    let ms = e0.elapsed_ms(&e1).expect("elapsed") as f64;
    s.synchronize().expect("sync");
    let r = reps as f64;
    Times {
        dev: ms * 1e3 / r,
        host: host * 1e6 / r,
        enq: enq * 1e6 / r,
    }
}

struct Ctx<'a> {
    gpu: &'a Gpu,
    rows: usize,
    cols: usize,
    reps: usize,
    copy_gbs: f64,
    blocker: Blocker,
    l2: usize,
    vals: Vec<f32>,
    x: Vec<f32>,
    a: Vec<f32>,
    scores: Vec<f32>,
}

fn row(ty: GgmlType, kernel: &str, density: u32, t: &Times, moved: f64, copy_gbs: f64) {
    let gbs = moved / (t.dev * 1e-6) / 1e9;
    println!(
        "{:<6} {:<14} {:>7}% {:>9.1} {:>9.1} {:>8.1} {:>8.0} {:>6.0}%",
        ty.name(),
        kernel,
        density,
        t.dev,
        t.host,
        t.enq,
        gbs,
        100.0 * gbs / copy_gbs
    );
}

fn bench_type(c: &mut Ctx, ty: GgmlType, densities: &[u32], dense: bool) {
    let (gpu, rows, cols, reps) = (c.gpu, c.rows, c.cols, c.reps);
    let s = gpu.stream();
    let bytes = quantize_to_vec(ty, &c.vals).expect("quantize");
    let row_bytes = bytes.len() / rows;
    let bucket: Vec<u32> = (0..rows as u32).collect();
    let n_copies = reps.min(((8usize << 30) / bytes.len().max(1)).max(1));
    let slices: Vec<GpuSlice> = (0..n_copies)
        .map(|_| GpuSlice::upload(gpu, s, ty, cols, &bytes, rows, &bucket).expect("upload"))
        .collect();
    let xd = gpu.upload(s, &c.x).expect("upload");
    let ad = gpu.upload(s, &c.a).expect("upload");
    let pd = gpu.upload(s, &c.scores).expect("upload");
    let mut y_rows = gpu.alloc_zeros::<f32>(s, rows).expect("alloc");
    let mut y_cols = gpu.alloc_zeros::<f32>(s, cols).expect("alloc");
    let note = if n_copies >= reps {
        "each call reads its own copy".to_string()
    } else if n_copies * bytes.len() > 2 * c.l2 {
        format!("a copy is reused after {n_copies} calls; copies exceed L2")
    } else {
        format!("a copy is reused after {n_copies} calls; WEIGHTS FIT IN L2")
    };
    println!(
        "-- {}: {} copies of {:.1} MB rotated ({note})",
        ty.name(),
        n_copies,
        bytes.len() as f64 / 1e6
    );
    let mut k = 0usize;
    if dense {
        let t = measure(s, reps, &mut c.blocker, || {
            k += 1;
            gpu.matmul(s, slices[k % n_copies].weight(), &xd, 1, &mut y_rows)
                .expect("matmul")
        });
        row(ty, "matmul dense", 100, &t, bytes.len() as f64, c.copy_gbs);
    }
    for &density in densities {
        // Scores are uniform in [0, 1): theta = 1 - density selects that fraction.
        let theta = 1.0 - density as f32 / 100.0;
        let active = c.scores.iter().filter(|&&p| p >= theta).count();
        let moved = (active * row_bytes) as f64;
        let t = measure(s, reps, &mut c.blocker, || {
            k += 1;
            gpu.sparse_matmul(s, &slices[k % n_copies], &xd, &pd, theta, 1, &mut y_rows)
                .expect("sparse_matmul")
        });
        row(ty, "sparse_matmul", density, &t, moved, c.copy_gbs);
        let t = measure(s, reps, &mut c.blocker, || {
            k += 1;
            gpu.sparse_axpy(
                s,
                &slices[k % n_copies],
                &ad,
                Some((&pd).into()),
                theta,
                1,
                &mut y_cols,
            )
            .expect("sparse_axpy")
        });
        row(ty, "sparse_axpy", density, &t, moved, c.copy_gbs);
    }
}

/// The shape table's matrices: (name, rows, cols, whether its rows are FFN neurons, so that
/// the sparse operators apply).
const SHAPES: [(&str, usize, usize, bool); 6] = [
    ("7b attn", 4096, 4096, false),
    ("7b up", 11008, 4096, true),
    ("7b down", 4096, 11008, false),
    ("tl attn", 2048, 2048, false),
    ("tl up", 5632, 2048, true),
    ("tl down", 2048, 5632, false),
];

/// Tokens of the prompt GEMM.
const GEMM_TOKENS: usize = 512;

/// One line of the shape table; returns whether its target (if any) is met.
#[allow(clippy::too_many_arguments)]
fn shape_line(
    shape: &str,
    ty: GgmlType,
    op: &str,
    t: &Times,
    moved: f64,
    copy_gbs: f64,
    figure: String,
    target: Option<(&str, bool)>,
) -> bool {
    let gbs = moved / (t.dev * 1e-6) / 1e9;
    let (target, ok) = match target {
        Some((text, ok)) => (format!("{text} {}", if ok { "met" } else { "MISSED" }), ok),
        None => (String::new(), true),
    };
    println!(
        "{:<8} {:<5} {:<16} {:>9.1} {:>9.1} {:>7.0} {:>6.0}% {:>16}  {target}",
        shape,
        ty.name(),
        op,
        t.dev,
        t.host,
        gbs,
        100.0 * gbs / copy_gbs,
        figure
    );
    ok
}

/// The shape table (see the file's documentation). Returns the number of missed targets.
fn shape_table(gpu: &Gpu, reps: usize, copy_gbs: f64, blocker: &mut Blocker) -> usize {
    let s = gpu.stream();
    println!(
        "{:<8} {:<5} {:<16} {:>9} {:>9} {:>7} {:>7} {:>16}  target",
        "shape", "type", "operator", "dev(us)", "host(us)", "GB/s", "%copy", "figure"
    );
    let mut missed = 0;
    let mut state = 0x0bad_cafe_1234_5678u64;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    for (shape, rows, cols, neurons) in SHAPES {
        let vals: Vec<f32> = (0..rows * cols).map(|_| rnd() as f32 * 2.0 - 1.0).collect();
        let x: Vec<f32> = (0..GEMM_TOKENS * cols).map(|_| rnd() as f32).collect();
        let a: Vec<f32> = (0..rows).map(|_| rnd() as f32).collect();
        let scores: Vec<f32> = (0..rows).map(|_| rnd() as f32).collect();
        let xd = gpu.upload(s, &x).expect("upload");
        let ad = gpu.upload(s, &a).expect("upload");
        let pd = gpu.upload(s, &scores).expect("upload");
        let mut y = gpu
            .alloc_zeros::<f32>(s, GEMM_TOKENS * rows)
            .expect("alloc");
        let mut y_cols = gpu.alloc_zeros::<f32>(s, cols).expect("alloc");
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16] {
            let bytes = quantize_to_vec(ty, &vals).expect("quantize");
            let row_bytes = bytes.len() / rows;
            let bucket: Vec<u32> = (0..rows as u32).collect();
            let n_copies = reps.min(((8usize << 30) / bytes.len().max(1)).max(1));
            let slices: Vec<GpuSlice> = (0..n_copies)
                .map(|_| GpuSlice::upload(gpu, s, ty, cols, &bytes, rows, &bucket).expect("upload"))
                .collect();
            let mut k = 0usize;
            let moved = bytes.len() as f64;
            let gemv = measure(s, reps, blocker, || {
                k += 1;
                let y1 = y.view_mut(0, rows).expect("view");
                gpu.matmul(
                    s,
                    slices[k % n_copies].weight(),
                    xd.view(0, cols).expect("view"),
                    1,
                    y1,
                )
                .expect("matmul")
            });
            let pct = 100.0 * moved / (gemv.dev * 1e-6) / 1e9 / copy_gbs;
            let ok = shape_line(
                shape,
                ty,
                "matmul t=1",
                &gemv,
                moved,
                copy_gbs,
                String::new(),
                Some((">= 75% of copy", pct >= 75.0)),
            );
            missed += usize::from(!ok);
            if neurons {
                let theta = 0.9f32;
                let active = scores.iter().filter(|&&p| p >= theta).count();
                let moved = (active * row_bytes) as f64;
                let read_us = moved / (copy_gbs * 1e9) * 1e6;
                // A sparse operator against the time to read its rows at the copy bandwidth.
                let sparse_line = |op: &str, t: &Times| {
                    let r = t.dev / read_us;
                    let target = Some(("<= 1.5x read", r <= 1.5));
                    let figure = format!("{r:.2}x read");
                    shape_line(shape, ty, op, t, moved, copy_gbs, figure, target)
                };
                let t = measure(s, reps, blocker, || {
                    k += 1;
                    let y1 = y.view_mut(0, rows).expect("view");
                    gpu.sparse_matmul(
                        s,
                        &slices[k % n_copies],
                        xd.view(0, cols).expect("view"),
                        &pd,
                        theta,
                        1,
                        y1,
                    )
                    .expect("sparse_matmul")
                });
                missed += usize::from(!sparse_line("sparse_matmul 10%", &t));
                let t = measure(s, reps, blocker, || {
                    k += 1;
                    gpu.sparse_axpy(
                        s,
                        &slices[k % n_copies],
                        &ad,
                        Some((&pd).into()),
                        theta,
                        1,
                        &mut y_cols,
                    )
                    .expect("sparse_axpy")
                });
                missed += usize::from(!sparse_line("sparse_axpy 10%", &t));
            }
            let t = measure(s, reps.min(5), blocker, || {
                k += 1;
                gpu.matmul(s, slices[k % n_copies].weight(), &xd, GEMM_TOKENS, &mut y)
                    .expect("matmul")
            });
            let tops = 2.0 * (rows * cols * GEMM_TOKENS) as f64 / (t.dev * 1e-6) / 1e12;
            let vs = GEMM_TOKENS as f64 * gemv.dev / t.dev;
            shape_line(
                shape,
                ty,
                "matmul t=512",
                &t,
                moved,
                copy_gbs,
                format!("{tops:.1} TOPS {vs:.0}x t=1"),
                None,
            );
        }
    }
    missed
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let sweep = args.len() >= 2;
    let (rows, cols, reps) = if sweep {
        (args[0], args[1], args.get(2).copied().unwrap_or(20).max(1))
    } else {
        (11008, 4096, args.first().copied().unwrap_or(20).max(1))
    };
    let gpu = match Gpu::detect() {
        Ok(g) => g,
        Err(e) => {
            println!("skipped: no GPU ({e})");
            return;
        }
    };
    let info = gpu.info();
    let l2 = gpu
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        .unwrap_or(0)
        .max(0) as usize;
    println!(
        "device: {} (cc {}.{}, {:.1} GiB, L2 {:.0} MB, kernels from {:?}); {reps} reps",
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.total_memory as f64 / (1u64 << 30) as f64,
        l2 as f64 / 1e6,
        info.image
    );
    let s = gpu.stream();

    // Copy bandwidth: read + write bytes of a device-to-device copy of 256 MiB.
    let n = 64 << 20;
    let mut blocker = Blocker {
        src: gpu.alloc_zeros::<f32>(s, n).expect("alloc"),
        dst: gpu.alloc_zeros::<f32>(s, n).expect("alloc"),
        copy_us: 100.0,
    };
    blocker.copy(s);
    s.synchronize().expect("sync");
    let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let e0 = s.cuda().record_event(timing).expect("event");
    for _ in 0..reps {
        blocker.copy(s);
    }
    let e1 = s.cuda().record_event(timing).expect("event");
    let ms = e0.elapsed_ms(&e1).expect("elapsed") as f64 / reps as f64;
    blocker.copy_us = ms * 1e3;
    let copy_gbs = 2.0 * (n * 4) as f64 / (ms * 1e-3) / 1e9;
    println!("copy bandwidth (dtod, read+write, CUDA events): {copy_gbs:.0} GB/s");
    if !sweep {
        let missed = shape_table(&gpu, reps, copy_gbs, &mut blocker);
        println!("shape table: {missed} target(s) missed");
        std::process::exit(i32::from(missed > 0));
    }
    println!("density sweep of {rows}x{cols}");

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
    let mut c = Ctx {
        gpu: &gpu,
        rows,
        cols,
        reps,
        copy_gbs,
        blocker,
        l2,
        vals,
        x,
        a,
        scores,
    };

    let header = || {
        println!(
            "{:<6} {:<14} {:>8} {:>9} {:>9} {:>8} {:>8} {:>7}",
            "type", "kernel", "density", "dev(us)", "host(us)", "enq(us)", "GB/s", "%copy"
        )
    };
    header();
    for ty in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        bench_type(&mut c, ty, &[1, 5, 10, 25, 50, 100], true);
    }

    // SAFETY: the buffers made from here on are used on the one stream `s` only, in order, and
    // the stream is synchronized before any of them is dropped (measure ends with a synchronize).
    unsafe { gpu.context().disable_event_tracking() };
    println!("cudarc event tracking off (buffers made after disable_event_tracking):");
    header();
    bench_type(&mut c, GgmlType::Q4_0, &[1, 10], true);
}
