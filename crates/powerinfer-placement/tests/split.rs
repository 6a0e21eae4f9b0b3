//! GPU-index files with provenance, and the cache lifecycle.

use powerinfer_gguf::GpuIndex;
use powerinfer_placement::split::{check_cached, FNV_OFFSET};
use powerinfer_placement::{
    fnv1a64, gpuidx_path, solve, stats_digest, GpuSplit, Method, Problem, Provenance,
};

fn provenance() -> Provenance {
    Provenance {
        budget_bytes: 1 << 30,
        n_ctx: 512,
        scratch_bytes: 0,
        group_size: 32,
        mode: "max".into(),
        stats_digest: 7,
        model_size: 1234,
        model_mtime: 99,
        kv_types: "Q8_0/Q8_0".into(),
    }
}

#[test]
fn fnv_known_values() {
    assert_eq!(fnv1a64(FNV_OFFSET, b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(FNV_OFFSET, b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(FNV_OFFSET, b"foobar"), 0x8594_4171_f739_67e8);
    let a = vec![vec![0.5f32, 0.25], vec![1.0]];
    let b = vec![vec![0.5f32], vec![0.25, 1.0]];
    assert_ne!(stats_digest(&a), stats_digest(&b), "layer boundaries count");
    assert_eq!(stats_digest(&a), stats_digest(&a.clone()));
}

#[test]
fn path_is_next_to_the_model() {
    let p = gpuidx_path(std::path::Path::new("/m/llama.q4.powerinfer.gguf"));
    assert_eq!(
        p,
        std::path::Path::new("/m/llama.q4.powerinfer.gguf.generated.gpuidx")
    );
}

#[test]
fn write_read_and_staleness() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.generated.gpuidx");
    let stats: Vec<Vec<f32>> = (0..3)
        .map(|l| (0..64).map(|i| ((i * 7 + l * 13) % 64) as f32).collect())
        .collect();
    let nb = [10u64; 3];
    let sol = solve(&Problem {
        stats: &stats,
        neuron_bytes: &nb,
        budget_bytes: 10 * 96,
        group: 32,
        min_neurons: 0,
        cap_neurons: None,
    })
    .unwrap();
    assert_eq!(sol.split.layers.iter().map(|l| l.k()).sum::<usize>(), 96);
    let prov = provenance();
    let idx = sol.split.to_gpu_index(960, &prov).unwrap();
    idx.write_to_path(&path).unwrap();

    let back = GpuIndex::open(&path).unwrap();
    assert_eq!(back.vram_capacity, 960);
    assert_eq!(Provenance::from_metadata(&back.extra).unwrap(), prov);
    let split = GpuSplit::from_gpu_index(&back, &stats, &nb).unwrap();
    assert_eq!(split, sol.split);

    let widths = [64, 64, 64];
    assert!(check_cached(&path, &prov, 960, &widths).is_ok());
    assert!(check_cached(&path, &prov, 2000, &widths).is_ok());
    let e = check_cached(&path, &prov, 959, &widths).unwrap_err();
    assert!(e.contains("FFN budget"), "{e}");
    let changed = Provenance {
        stats_digest: 8,
        model_mtime: 100,
        kv_types: "F16/F16".into(),
        ..prov.clone()
    };
    let e = check_cached(&path, &changed, 960, &widths).unwrap_err();
    assert!(
        e.contains("stale")
            && e.contains("statistics")
            && e.contains("model time")
            && e.contains("KV cache types"),
        "{e}"
    );
    let e = check_cached(&path, &prov, 960, &[64, 64]).unwrap_err();
    assert!(e.contains("layer shapes"), "{e}");
    let e = check_cached(&dir.path().join("none"), &prov, 960, &widths).unwrap_err();
    assert!(e.contains("no cached"), "{e}");
    std::fs::write(&path, b"junk").unwrap();
    let e = check_cached(&path, &prov, 960, &widths).unwrap_err();
    assert!(e.contains("unreadable"), "{e}");

    // A file without provenance (PowerInfer's own) is rebuilt.
    let mut plain = sol.split.to_gpu_index(960, &prov).unwrap();
    plain.extra = Default::default();
    plain.write_to_path(&path).unwrap();
    let e = check_cached(&path, &prov, 960, &widths).unwrap_err();
    assert!(e.contains("no provenance"), "{e}");
}

#[test]
fn all_cpu_split() {
    let s = GpuSplit::all_cpu(&[64, 32]);
    assert_eq!(s.ffn_bytes, 0);
    assert!(s.layers.iter().all(|l| l.k() == 0 && l.mass_share() == 0.0));
    let idx = s.to_gpu_index(0, &provenance()).unwrap();
    assert_eq!(idx.layers[1].n_ff(), 32);
}

#[test]
fn huge_dp_falls_back_to_density_within_budget() {
    // Costs 32p, 33p, 32q, 33q with primes p, q: unit 1, so ~66e6 budget units is too big a
    // table; the density fallback must still respect the budget and say it is not exact.
    let (p, q) = (1_000_003u64, 999_983u64);
    let stats = vec![
        (0..33).map(|i| i as f32).collect::<Vec<_>>(),
        (0..33).map(|i| (33 - i) as f32 * 0.5).collect(),
    ];
    let nb = [p, q];
    let budget = 33 * p + 32 * q;
    let sol = solve(&Problem {
        stats: &stats,
        neuron_bytes: &nb,
        budget_bytes: budget,
        group: 32,
        min_neurons: 0,
        cap_neurons: None,
    })
    .unwrap();
    assert_eq!(sol.method, Method::Density);
    assert!(!sol.exact);
    assert!(sol.split.ffn_bytes <= budget);
    // Layer 1's last neuron (0.5) is worth more than layer 0's (0.0); only one fits.
    assert_eq!(sol.split.layers[0].k(), 32);
    assert_eq!(sol.split.layers[1].k(), 33);
}
