//! The placement solver at a 70B shape: 80 layers × 28672 neurons with random power-law
//! activation statistics in memory, Q4_0 FFN rows (n_embd 8192: 3 rows of 4608 bytes per
//! neuron), a budget holding about 40% of the FFN, groups of 256.
//!
//! Benches: `solve/greedy` (equal costs, the exact greedy), `solve/balanced` (Q-Infer's mode,
//! r = 1), `solve/dp_min` (a per-layer minimum of 1024 neurons forces the exact DP), and
//! `gpuidx/write` (build the GPU index from a split and write it to a temp file).
//! Targets: solve under 50 ms, write under 100 ms.
//!
//! Run: `cargo bench -p powerinfer-benches --bench placement`.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use powerinfer_placement::{solve, solve_balanced, Problem, Provenance};

const N_LAYER: usize = 80;
const N_FF: usize = 28672;
const NEURON_BYTES: u64 = 3 * 4608;

/// Power-law statistics: a uniform u mapped to u^6 (most neurons cold, a few hot), from a
/// fixed-seed xorshift so every run sees the same numbers.
fn stats() -> Vec<Vec<f32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..N_LAYER)
        .map(|_| {
            (0..N_FF)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let u = (x >> 40) as f32 / (1u64 << 24) as f32;
                    u.powi(6)
                })
                .collect()
        })
        .collect()
}

/// CPU time (user + system, all threads) this process has used so far, in seconds, from
/// `/proc/self/stat` (Linux; `None` elsewhere). Printed next to criterion's wall times because
/// a loaded machine inflates wall time.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Prints the mean CPU time of `f` over `n` runs.
fn cpu_per_run(name: &str, n: usize, mut f: impl FnMut()) {
    let t0 = std::time::Instant::now();
    let c0 = cpu_seconds();
    for _ in 0..n {
        f();
    }
    let wall = t0.elapsed().as_secs_f64() / n as f64;
    if let (Some(a), Some(b)) = (c0, cpu_seconds()) {
        println!(
            "{name}: {:.1} ms CPU (all threads), {:.1} ms wall per run over {n} runs",
            (b - a) / n as f64 * 1e3,
            wall * 1e3
        );
    }
}

fn bench(c: &mut Criterion) {
    let stats = stats();
    let nb = vec![NEURON_BYTES; N_LAYER];
    let budget = (N_LAYER * N_FF) as u64 * NEURON_BYTES * 2 / 5;
    let p = Problem {
        stats: &stats,
        neuron_bytes: &nb,
        budget_bytes: budget,
        group: 256,
        min_neurons: 0,
        cap_neurons: None,
    };
    let sol = solve(&p).unwrap();
    println!(
        "greedy: {:?}, {} of {} neurons on GPU, {} bytes of {budget}",
        sol.method,
        sol.split.layers.iter().map(|l| l.k()).sum::<usize>(),
        N_LAYER * N_FF,
        sol.split.ffn_bytes
    );
    cpu_per_run("solve/greedy", 30, || {
        black_box(solve(&p).unwrap());
    });
    let mut g = c.benchmark_group("solve");
    g.sample_size(20);
    g.bench_function("greedy", |b| b.iter(|| solve(black_box(&p)).unwrap()));
    g.bench_function("balanced", |b| {
        b.iter(|| solve_balanced(black_box(&p), 1.0).unwrap())
    });
    let with_min = Problem {
        min_neurons: 1024,
        ..p
    };
    let dp = solve(&with_min).unwrap();
    println!("dp_min: {:?}, exact {}", dp.method, dp.exact);
    g.bench_function("dp_min", |b| {
        b.iter(|| solve(black_box(&with_min)).unwrap())
    });
    g.finish();

    let prov = Provenance {
        budget_bytes: budget,
        n_ctx: 4096,
        scratch_bytes: 0,
        group_size: 256,
        mode: "max".into(),
        stats_digest: powerinfer_placement::stats_digest(&stats),
        model_size: 0,
        model_mtime: 0,
        kv_types: "F16/F16".into(),
    };
    let path = std::env::temp_dir().join(format!(
        "powerinfer-bench-placement-{}.gpuidx",
        std::process::id()
    ));
    let mut g = c.benchmark_group("gpuidx");
    g.sample_size(20);
    g.bench_function("write", |b| {
        b.iter(|| {
            sol.split
                .to_gpu_index(budget, &prov)
                .unwrap()
                .write_to_path(black_box(&path))
                .unwrap()
        })
    });
    g.finish();
    let _ = std::fs::remove_file(&path);
}

criterion_group!(benches, bench);
criterion_main!(benches);
