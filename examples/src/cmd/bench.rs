//! `powerinfer bench kernels [--threads N] [--json] [--quick]`: CPU kernel throughput on
//! LLaMA-7B shapes, compared with this machine's measured memory read bandwidth.
//!
//! Weights are random data generated in memory. Each matrix is copied enough times that the
//! copies together exceed the last-level cache by far, and the timed calls rotate through the
//! copies, so every call reads its weights from DRAM as in real inference. Figures are the
//! median of the timed calls (as is the bandwidth: the median of several passes over a 1 GiB
//! buffer), and the table's `best` column (JSON `best_gbps`, `best_ms`) gives the fastest call.
//! On a shared VM the best call can be much faster than the median, so the best figures
//! overstate what decoding, which runs every call, gets. The measurements behind this
//! benchmark's choices are in `docs/tuning.md`.

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::matmul::supported_types;
use powerinfer_kernels_cpu::probe::{self, random_weights, SplitMix64};
use powerinfer_kernels_cpu::{
    AxpyCoefficients, Backend, MatMul, PoolKind, RowSelect, ThreadPool, Weights,
};
use serde_json::json;

use super::bandwidth::{bandwidth_rates, page_copy};
use super::bench_shared::median;
use std::time::{Duration, Instant};

/// Arguments of `powerinfer bench`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(clap::Subcommand)]
enum What {
    /// Dense and sparse matrix kernels on LLaMA-7B shapes, against measured memory bandwidth.
    Kernels(KernelArgs),
    /// Decode speed of the engine (dense and sparse), bytes read per token against memory
    /// bandwidth, optionally side by side with llama.cpp's `llama-bench`.
    Decode(super::bench_decode::DecodeArgs),
    /// A bounded load test of `powerinfer serve`: concurrent streaming clients on the loopback
    /// address; throughput, time to first token and between tokens.
    Serve(super::bench_serve::ServeArgs),
    /// The run-time scheduling on the simulated GPU: static, balanced and calibrated splits,
    /// the cost model's prediction, and the hot-neuron cache under a change of topic.
    Schedule(super::bench_schedule::ScheduleArgs),
}

/// Arguments of `powerinfer bench kernels`.
#[derive(clap::Args)]
struct KernelArgs {
    /// Threads (0: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Print a JSON array of result objects instead of a table.
    #[arg(long)]
    json: bool,
    /// Fewer types, shapes and repetitions (about a minute).
    #[arg(long)]
    quick: bool,
    /// Thread pool: spin, rayon, or both (each measurement once per pool).
    #[arg(long, default_value = "spin")]
    pool: String,
    /// Instruction set: scalar, avx2, avx512, neon (default: the best this CPU has).
    #[arg(long)]
    backend: Option<String>,
    /// Only these weight types (comma-separated ggml names, e.g. F16,Q4_0).
    #[arg(long, value_delimiter = ',')]
    types: Option<Vec<String>>,
    /// Only these kernels (comma-separated: dense_gemv, dense_gemv_packed (Q4_0 repacked by
    /// `MatMul::pack_q4_0`), dense_gemm, sparse_gemv, sparse_axpy, sparse_axpy_int8 (int8
    /// coefficients, `AxpyCoefficients::Int8`, where the backend has it), sparse_read: the
    /// sparse kernels' rows read without arithmetic, their memory ceiling).
    #[arg(long, value_delimiter = ',')]
    kernels: Option<Vec<String>>,
    /// Tokens of the GEMM (prompt) measurement.
    #[arg(long, default_value_t = 128)]
    tokens: usize,
    /// Matrix shapes ROWSxCOLS (comma-separated) instead of the LLaMA-7B ones.
    #[arg(long, value_delimiter = ',')]
    shapes: Option<Vec<String>>,
    /// MiB of weight copies to rotate through (0: one copy, cache-resident when small).
    #[arg(long)]
    cold_mib: Option<usize>,
    /// Pages the weight copies live in: `huge` (transparent huge pages requested, as the
    /// engine requests them for its weights, mapped or `--no-mmap`) or `small` (base pages,
    /// as in a file mapping that was cached in small pages).
    #[arg(long, default_value = "huge", value_parser = ["huge", "small"])]
    pages: String,
    /// Start each weight copy this many bytes past a page boundary (GGUF aligns tensor data
    /// to 32 bytes only, so a model's matrices may start at 32 mod 64).
    #[arg(long, default_value_t = 0)]
    offset: usize,
}

/// Runs `powerinfer bench`.
pub fn run(args: Args) -> Result<(), String> {
    match args.what {
        What::Kernels(a) => kernels(a),
        What::Decode(a) => super::bench_decode::run(a),
        What::Serve(a) => super::bench_serve::run(a),
        What::Schedule(a) => super::bench_schedule::run(a),
    }
}

/// Seconds per call of `f`, called with an increasing counter, within `budget` (at least
/// `min_iters` calls, after one warm-up call): the median and the best call.
fn time_calls(budget: Duration, min_iters: usize, mut f: impl FnMut(usize)) -> Timing {
    f(0);
    let start = Instant::now();
    let mut secs = Vec::new();
    let mut i = 1;
    while i <= min_iters || start.elapsed() < budget {
        let t = Instant::now();
        f(i);
        secs.push(t.elapsed().as_secs_f64());
        i += 1;
        if i > 100_000 {
            break;
        }
    }
    Timing::of(&mut secs)
}

/// Seconds per call of a timed kernel: the median, which the figures report, and the best.
#[derive(Clone, Copy, Debug)]
struct Timing {
    median: f64,
    best: f64,
}

impl Timing {
    /// The median and the minimum of `secs` (not empty; reordered).
    fn of(secs: &mut [f64]) -> Timing {
        secs.sort_by(f64::total_cmp);
        Timing {
            median: median(secs),
            best: secs[0],
        }
    }
}

/// Greatest common divisor.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Copies of one matrix that together exceed the caches, visited in turn.
struct Rotation {
    copies: Vec<memmap2::MmapMut>,
    offset: usize,
    len: usize,
}
impl Rotation {
    fn new(one: &[u8], total_bytes: usize, offset: usize, huge: bool) -> Result<Self, String> {
        let k = total_bytes.div_ceil(one.len().max(1)).max(1);
        let copies = (0..k)
            .map(|_| page_copy(one, offset, huge))
            .collect::<Result<_, _>>()?;
        Ok(Rotation {
            copies,
            offset,
            len: one.len(),
        })
    }
    fn get(&self, i: usize) -> &[u8] {
        &self.copies[i % self.copies.len()][self.offset..self.offset + self.len]
    }
}

fn kernels(a: KernelArgs) -> Result<(), String> {
    let threads = if a.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        a.threads
    };
    let backend = match a.backend.as_deref() {
        None => Backend::detect(),
        Some(name) => Backend::ALL
            .into_iter()
            .find(|b| b.name().eq_ignore_ascii_case(name))
            .ok_or_else(|| format!("unknown backend {name:?}"))?,
    };
    let kinds: Vec<PoolKind> = match a.pool.as_str() {
        "spin" => vec![PoolKind::Spin],
        "rayon" => vec![PoolKind::Rayon],
        "both" => vec![PoolKind::Spin, PoolKind::Rayon],
        other => {
            return Err(format!(
                "--pool: expected spin, rayon or both, got {other:?}"
            ))
        }
    };
    let types: Vec<GgmlType> = match &a.types {
        Some(names) => names
            .iter()
            .map(|n| {
                GgmlType::from_name(n)
                    .or_else(|| GgmlType::from_name(&n.to_ascii_lowercase()))
                    .or_else(|| GgmlType::from_name(&n.to_ascii_uppercase()))
                    .ok_or_else(|| format!("unknown type {n:?}"))
            })
            .collect::<Result<_, _>>()?,
        None if a.quick => vec![GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0],
        None => supported_types().to_vec(),
    };
    let want = |k: &str| {
        a.kernels
            .as_ref()
            .is_none_or(|ks| ks.iter().any(|x| x == k))
    };
    let (budget, rotate, bw_bytes) = if a.quick {
        (Duration::from_millis(150), 160usize << 20, 256usize << 20)
    } else {
        (Duration::from_millis(600), 320usize << 20, 1usize << 30)
    };
    let rotate = a.cold_mib.map_or(rotate, |m| m << 20);
    let huge = a.pages == "huge";
    let shapes: Vec<(usize, usize)> = match &a.shapes {
        Some(list) => list
            .iter()
            .map(|s| {
                let (r, c) = s
                    .split_once(['x', 'X'])
                    .ok_or_else(|| format!("shape {s:?}: want ROWSxCOLS"))?;
                Ok((
                    r.parse().map_err(|_| format!("shape {s:?}: bad rows"))?,
                    c.parse().map_err(|_| format!("shape {s:?}: bad cols"))?,
                ))
            })
            .collect::<Result<_, String>>()?,
        None if a.quick => vec![(11008, 4096)],
        None => vec![(4096, 4096), (4096, 11008), (11008, 4096)],
    };
    let densities = [0.01, 0.05, 0.10, 0.20, 0.50, 1.00];
    let mut results = Vec::new();
    let mut rng = SplitMix64(42);
    for &kind in &kinds {
        let pool = ThreadPool::with_kind(threads, kind);
        let mm = MatMul::with_backend(&pool, backend).map_err(|e| e.to_string())?;
        let rates = bandwidth_rates(&pool, bw_bytes, if a.quick { 3 } else { 5 });
        let bw = rates.best() / 1e9;
        let pool_name = match kind {
            PoolKind::Spin => "spin",
            PoolKind::Rayon => "rayon",
        };
        // Cost of starting one (empty) job on every thread: what a small kernel pays per call.
        let dispatch = time_calls(budget, 1000, |_| {
            pool.run(|i| {
                std::hint::black_box(i);
            })
        });
        if !a.json {
            println!(
                "threads {} ({pool_name} pool), backend {}, memory read bandwidth {bw:.1} GB/s \
                 (plain loads {:.1}, prefetch stream {:.1}), empty job {:.2} µs, weights in {} \
                 pages at offset {}",
                pool.n_threads(),
                mm.backend(),
                rates.plain / 1e9,
                rates.stream / 1e9,
                dispatch.median * 1e6,
                a.pages,
                a.offset,
            );
            println!(
                "{:<12} {:<5} {:>6} {:>6} {:>7} {:>9} {:>8} {:>6} {:>8} {:>8}",
                "kernel",
                "type",
                "rows",
                "cols",
                "density",
                "ms",
                "GB/s",
                "ratio",
                "best",
                "GFLOP/s"
            );
        }
        results.push(json!({
            "kernel": "pool_dispatch", "type": "none", "rows": 0, "cols": 0, "density": 0.0,
            "tokens": 0, "threads": pool.n_threads(), "pool": pool_name,
            "backend": mm.backend().name(), "ms": dispatch.median * 1e3,
            "best_ms": dispatch.best * 1e3, "gbps": 0.0, "best_gbps": 0.0, "gflops": 0.0,
            "bandwidth_gbps": bw, "ratio": 0.0,
            "bandwidth_plain_gbps": rates.plain / 1e9, "bandwidth_stream_gbps": rates.stream / 1e9,
        }));
        let mut emit = |kernel: &str,
                        ty: GgmlType,
                        rows: usize,
                        cols: usize,
                        density: f64,
                        tokens: usize,
                        time: Timing,
                        bytes: f64| {
            let secs = time.median;
            let gbps = bytes / secs / 1e9;
            let best_gbps = bytes / time.best / 1e9;
            let gflops = 2.0 * rows as f64 * cols as f64 * density * tokens as f64 / secs / 1e9;
            if !a.json {
                println!(
                    "{kernel:<12} {:<5} {rows:>6} {cols:>6} {:>6.0}% {:>9.3} {gbps:>8.1} {:>6.2} \
                     {best_gbps:>8.1} {gflops:>8.1}",
                    ty.name(),
                    density * 100.0,
                    secs * 1e3,
                    gbps / bw
                );
            }
            results.push(json!({
                "kernel": kernel, "type": ty.name(), "rows": rows, "cols": cols,
                "density": density, "tokens": tokens, "threads": pool.n_threads(),
                "pool": pool_name, "backend": mm.backend().name(), "pages": a.pages,
                "offset": a.offset,
                "ms": secs * 1e3, "gbps": gbps, "best_ms": time.best * 1e3,
                "best_gbps": best_gbps, "gflops": gflops,
                "bandwidth_gbps": bw, "ratio": gbps / bw,
            }));
        };
        for &ty in &types {
            for &(rows, cols) in &shapes {
                if cols % ty.block_size() != 0 {
                    continue;
                }
                let one = random_weights(ty, rows, cols, &mut rng);
                let bytes = one.len() as f64;
                let rot = Rotation::new(&one, rotate, a.offset, huge)?;
                let w =
                    |i: usize| Weights::new(ty, rows, cols, rot.get(i)).map_err(|e| e.to_string());
                let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
                let mut y = vec![0f32; rows];
                let mut err = None;
                if want("dense_gemv") {
                    let s = time_calls(budget, 5, |i| {
                        if let Err(e) =
                            w(i).and_then(|w| mm.gemv(&w, &x, &mut y).map_err(|e| e.to_string()))
                        {
                            err = Some(e);
                        }
                    });
                    emit("dense_gemv", ty, rows, cols, 1.0, 1, s, bytes);
                }
                if want("dense_gemv_packed") && ty == GgmlType::Q4_0 {
                    // Packed copies of every rotated copy (ordinary heap memory, not
                    // necessarily in huge pages).
                    let mut packs = Vec::new();
                    for i in 0..rot.copies.len() {
                        if let Some(p) = mm.pack_q4_0(&w(i)?) {
                            packs.push(p);
                        }
                    }
                    if !packs.is_empty() {
                        let s = time_calls(budget, 5, |i| {
                            if let Err(e) = mm.gemv_packed(&packs[i % packs.len()], &x, &mut y) {
                                err = Some(e.to_string());
                            }
                        });
                        emit("dense_gemv_packed", ty, rows, cols, 1.0, 1, s, bytes);
                    }
                }
                if want("dense_gemm") {
                    let t = a.tokens;
                    let xt: Vec<f32> = (0..cols * t).map(|_| rng.f32()).collect();
                    let mut yt = vec![0f32; rows * t];
                    let s = time_calls(budget, 2, |i| {
                        if let Err(e) = w(i)
                            .and_then(|w| mm.gemm(&w, &xt, t, &mut yt).map_err(|e| e.to_string()))
                        {
                            err = Some(e);
                        }
                    });
                    emit("dense_gemm", ty, rows, cols, 1.0, t, s, bytes);
                }
                let sparse_types = [
                    GgmlType::F32,
                    GgmlType::F16,
                    GgmlType::BF16,
                    GgmlType::Q8_0,
                    GgmlType::Q4_0,
                ];
                if (want("sparse_gemv")
                    || want("sparse_axpy")
                    || want("sparse_axpy_int8")
                    || want("sparse_read"))
                    && (sparse_types.contains(&ty) || a.types.is_some())
                    && (rows == 11008 || a.shapes.is_some())
                {
                    for &dens in &densities {
                        // Random sets of exactly `dens · rows` neurons, as predictor scores. A
                        // new set per call, as consecutive tokens activate different neurons.
                        // Call `i` reads set `i mod n_sets` of copy `i mod n_copies`; with the
                        // two counts coprime, a cycle reads n_sets · n_copies different row
                        // sets, at least 1 GiB where 256 sets allow it, so that the rows come
                        // from memory and not from a large L3 (fewer sets had let a large L3
                        // serve the sparse products).
                        let n_active = ((dens * rows as f64).round() as usize).clamp(1, rows);
                        let active_bytes = bytes * n_active as f64 / rows as f64;
                        let n_copies = rot.copies.len();
                        let mut n_sets = (((1u64 << 30) as f64 / (active_bytes * n_copies as f64))
                            .ceil() as usize)
                            .clamp(1, 256);
                        while gcd(n_sets, n_copies) != 1 {
                            n_sets += 1;
                        }
                        let mut sets: Vec<(Vec<f32>, Vec<f32>, Vec<u32>)> =
                            Vec::with_capacity(n_sets);
                        for _ in 0..n_sets {
                            let mut idx: Vec<usize> = (0..rows).collect();
                            for k in 0..n_active {
                                let j = k + (rng.next_u64() % (rows - k) as u64) as usize;
                                idx.swap(k, j);
                            }
                            let mut scores = vec![-1f32; rows];
                            let mut act = vec![0f32; rows];
                            for &i in &idx[..n_active] {
                                scores[i] = 1.0;
                                act[i] = 0.5 + 0.5 * rng.f32().abs();
                            }
                            let mut list: Vec<u32> =
                                idx[..n_active].iter().map(|&i| i as u32).collect();
                            list.sort_unstable();
                            sets.push((scores, act, list));
                        }
                        let sel = |i: usize| RowSelect {
                            scores: &sets[i % n_sets].0,
                            threshold: 0.0,
                            skip: None,
                        };
                        let density = n_active as f64 / rows as f64;
                        if want("sparse_gemv") {
                            let s = time_calls(budget, 5, |i| {
                                if let Err(e) = w(i).and_then(|w| {
                                    mm.sparse_gemv(&w, &x, &sel(i), &mut y)
                                        .map_err(|e| e.to_string())
                                }) {
                                    err = Some(e);
                                }
                            });
                            emit("sparse_gemv", ty, rows, cols, density, 1, s, active_bytes);
                        }
                        if want("sparse_axpy") {
                            // down_t: rows = neurons, cols = output.
                            let mut out = vec![0f32; cols];
                            let s = time_calls(budget, 5, |i| {
                                if let Err(e) = w(i).and_then(|w| {
                                    mm.sparse_axpy(&w, &sets[i % n_sets].1, &sel(i), &mut out)
                                        .map_err(|e| e.to_string())
                                }) {
                                    err = Some(e);
                                }
                            });
                            emit("sparse_axpy", ty, rows, cols, density, 1, s, active_bytes);
                        }
                        // The same axpy with int8 coefficients, where the backend has that
                        // kernel for this type (else it would time the float one again).
                        let int8 = mm.with_axpy(AxpyCoefficients::Int8);
                        if want("sparse_axpy_int8") && int8.has_int8_axpy(ty) {
                            let mut out = vec![0f32; cols];
                            let s = time_calls(budget, 5, |i| {
                                if let Err(e) = w(i).and_then(|w| {
                                    int8.sparse_axpy(&w, &sets[i % n_sets].1, &sel(i), &mut out)
                                        .map_err(|e| e.to_string())
                                }) {
                                    err = Some(e);
                                }
                            });
                            emit(
                                "sparse_axpy_int8",
                                ty,
                                rows,
                                cols,
                                density,
                                1,
                                s,
                                active_bytes,
                            );
                        }
                        if want("sparse_read") {
                            // The same rows read without arithmetic: the memory ceiling of
                            // this access pattern (at 100%, of a dense pass); a plain C
                            // reader gets no more (`docs/tuning.md`).
                            let s = time_calls(budget, 5, |i| {
                                match w(i).and_then(|w| {
                                    probe::read_rows(&mm, &w, &sets[i % n_sets].2)
                                        .map_err(|e| e.to_string())
                                }) {
                                    Ok(sum) => {
                                        std::hint::black_box(sum);
                                    }
                                    Err(e) => err = Some(e),
                                }
                            });
                            emit("sparse_read", ty, rows, cols, density, 1, s, active_bytes);
                        }
                    }
                }
                if let Some(e) = err {
                    return Err(e);
                }
            }
        }
    }
    if a.json {
        println!("{}", serde_json::Value::Array(results));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Timing;

    #[test]
    fn timing_reports_the_median_and_the_best_call() {
        let t = Timing::of(&mut [3.0, 1.0, 9.0]);
        assert_eq!((t.median, t.best), (3.0, 1.0));
        // An even count: the mean of the two middle calls; one slow outlier moves nothing.
        let t = Timing::of(&mut [4.0, 2.0, 100.0, 3.0]);
        assert_eq!((t.median, t.best), (3.5, 2.0));
        let t = Timing::of(&mut [0.5]);
        assert_eq!((t.median, t.best), (0.5, 0.5));
    }
}
