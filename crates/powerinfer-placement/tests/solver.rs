//! The solver against brute force on random small instances, and its invariants.

use powerinfer_placement::{solve, solve_balanced, Method, Problem};
use proptest::prelude::*;

/// Mass of the `j` first groups of each layer, computed independently of the crate.
fn prefixes(stats: &[Vec<f32>], group: usize) -> Vec<Vec<f64>> {
    stats
        .iter()
        .map(|l| {
            let mut v: Vec<f64> = l.iter().map(|&x| f64::from(x)).collect();
            v.sort_by(|a, b| b.total_cmp(a));
            let mut p = vec![0.0];
            for c in v.chunks(group) {
                p.push(p.last().unwrap() + c.iter().sum::<f64>());
            }
            p
        })
        .collect()
}

/// Best objective by enumerating every per-layer group count.
fn brute(p: &Problem) -> f64 {
    let pre = prefixes(p.stats, p.group);
    let n = p.stats.len();
    let mut js = vec![0usize; n];
    let mut best = 0.0f64;
    loop {
        let mut ok = true;
        let mut cost = 0u64;
        let mut val = 0.0;
        for l in 0..n {
            let n_ff = p.stats[l].len();
            let k = (js[l] * p.group).min(n_ff);
            if k > 0 {
                if k < p.min_neurons.min(n_ff) {
                    ok = false;
                }
                if let Some(cap) = p.cap_neurons {
                    if k > cap && cap < n_ff {
                        ok = false;
                    }
                }
            }
            cost += k as u64 * p.neuron_bytes[l];
            val += pre[l][js[l]];
        }
        if ok && cost <= p.budget_bytes && val > best {
            best = val;
        }
        // Next combination.
        let mut l = 0;
        loop {
            if l == n {
                return best;
            }
            js[l] += 1;
            if js[l] < pre[l].len() {
                break;
            }
            js[l] = 0;
            l += 1;
        }
    }
}

/// Checks feasibility and returns the objective.
fn check_feasible(p: &Problem, sol: &powerinfer_placement::Solution) -> f64 {
    let mut bytes = 0u64;
    let mut val = 0.0;
    for (l, layer) in sol.split.layers.iter().enumerate() {
        let n_ff = p.stats[l].len();
        assert_eq!(layer.n_ff, n_ff);
        let k = layer.k();
        assert!(k == n_ff || k % p.group == 0, "k {k} not whole groups");
        if k > 0 {
            assert!(
                k >= p.min_neurons.min(n_ff),
                "layer {l}: k {k} below minimum"
            );
        }
        if let Some(cap) = p.cap_neurons {
            assert!(k <= cap.max(if cap >= n_ff { n_ff } else { 0 }), "cap");
        }
        assert!(layer.bucket.windows(2).all(|w| w[0] < w[1]));
        // The bucket holds a hottest prefix: no CPU neuron is hotter than a GPU neuron.
        let on: std::collections::HashSet<u32> = layer.bucket.iter().copied().collect();
        let min_gpu = layer
            .bucket
            .iter()
            .map(|&i| p.stats[l][i as usize])
            .fold(f32::INFINITY, f32::min);
        for (i, &v) in p.stats[l].iter().enumerate() {
            if !on.contains(&(i as u32)) {
                assert!(
                    v <= min_gpu,
                    "layer {l}: CPU neuron {i} hotter than a GPU one"
                );
            }
        }
        let m: f64 = layer
            .bucket
            .iter()
            .map(|&i| f64::from(p.stats[l][i as usize]))
            .sum();
        assert!((m - layer.gpu_mass).abs() <= 1e-9 * (1.0 + m));
        bytes += k as u64 * p.neuron_bytes[l];
        val += layer.gpu_mass;
    }
    assert_eq!(bytes, sol.split.ffn_bytes);
    assert!(
        bytes <= p.budget_bytes,
        "bytes {bytes} over budget {}",
        p.budget_bytes
    );
    val
}

fn stats_strategy(
    layers: std::ops::Range<usize>,
    widths: Vec<usize>,
) -> impl Strategy<Value = Vec<Vec<f32>>> {
    prop::collection::vec(
        prop::sample::select(widths).prop_flat_map(|n| {
            prop::collection::vec(prop_oneof![Just(0.0f32), 0.0f32..1.0, 0.0f32..0.01], n)
        }),
        layers,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Equal group costs, no minimum: greedy, and optimal.
    #[test]
    fn greedy_is_optimal(
        stats in stats_strategy(1..5, vec![32, 64, 96, 128]),
        nb in 1u64..50,
        budget_frac in 0.0f64..1.1,
        cap in prop::option::of(0usize..160),
    ) {
        let total: u64 = stats.iter().map(|l| l.len() as u64 * nb).sum();
        let neuron_bytes = vec![nb; stats.len()];
        let p = Problem {
            stats: &stats,
            neuron_bytes: &neuron_bytes,
            budget_bytes: (total as f64 * budget_frac) as u64,
            group: 32,
            min_neurons: 0,
            cap_neurons: cap,
        };
        let sol = solve(&p).unwrap();
        prop_assert_eq!(sol.method, Method::Greedy);
        prop_assert!(sol.exact);
        let v = check_feasible(&p, &sol);
        let b = brute(&p);
        prop_assert!((v - b).abs() <= 1e-9 * (1.0 + b), "greedy {} brute {}", v, b);
    }

    /// Different per-layer costs, tails and minimums: the DP, and optimal.
    #[test]
    fn dp_is_optimal(
        stats in stats_strategy(1..5, vec![32, 40, 64, 100, 128]),
        nbs in prop::collection::vec(1u64..40, 4),
        budget_frac in 0.0f64..1.1,
        min in prop_oneof![Just(0usize), 0usize..130],
        cap in prop::option::of(0usize..160),
    ) {
        let neuron_bytes: Vec<u64> = nbs[..stats.len()].to_vec();
        let total: u64 = stats.iter().zip(&neuron_bytes).map(|(l, b)| l.len() as u64 * b).sum();
        let p = Problem {
            stats: &stats,
            neuron_bytes: &neuron_bytes,
            budget_bytes: (total as f64 * budget_frac) as u64,
            group: 32,
            min_neurons: min,
            cap_neurons: cap,
        };
        let sol = solve(&p).unwrap();
        let v = check_feasible(&p, &sol);
        let b = brute(&p);
        prop_assert!(sol.exact);
        prop_assert!((v - b).abs() <= 1e-9 * (1.0 + b), "{:?} {} brute {}", sol.method, v, b);
    }

    /// Balanced mode: within budget, and with a large budget each layer's share reaches
    /// r/(1+r) with the fewest groups.
    #[test]
    fn balanced_shares(
        stats in stats_strategy(1..5, vec![64, 128, 256]),
        ratio in 0.1f64..10.0,
        budget_frac in 0.0f64..1.2,
    ) {
        let nb = 10u64;
        let neuron_bytes = vec![nb; stats.len()];
        let total: u64 = stats.iter().map(|l| l.len() as u64 * nb).sum();
        let p = Problem {
            stats: &stats,
            neuron_bytes: &neuron_bytes,
            budget_bytes: (total as f64 * budget_frac) as u64,
            group: 32,
            min_neurons: 0,
            cap_neurons: None,
        };
        let sol = solve_balanced(&p, ratio).unwrap();
        check_feasible(&p, &sol);
        let s = ratio / (1.0 + ratio);
        let pre = prefixes(&stats, 32);
        let need: u64 = pre.iter().zip(&stats).map(|(pr, l)| {
            let t = s * pr.last().unwrap();
            let j = if t <= 0.0 { 0 } else { pr.iter().position(|&m| m >= t).unwrap() };
            (j * 32).min(l.len()) as u64 * nb
        }).sum();
        if need <= p.budget_bytes {
            prop_assert_eq!(sol.split.ffn_bytes, need);
            for layer in &sol.split.layers {
                prop_assert!(layer.total_mass <= 0.0 || layer.mass_share() >= s - 1e-9);
            }
        }
    }
}

#[test]
fn rejects_bad_input() {
    let stats = vec![vec![0.5f32; 64]];
    let nb = [4u64];
    let mut p = Problem {
        stats: &stats,
        neuron_bytes: &nb,
        budget_bytes: 1000,
        group: 48,
        min_neurons: 0,
        cap_neurons: None,
    };
    assert!(solve(&p).is_err(), "group not a multiple of 32");
    p.group = 32;
    let nan = vec![vec![f32::NAN; 64]];
    assert!(solve(&Problem { stats: &nan, ..p }).is_err());
    let neg = vec![vec![-1.0f32; 64]];
    assert!(solve(&Problem { stats: &neg, ..p }).is_err());
    assert!(solve(&Problem {
        neuron_bytes: &[],
        ..p
    })
    .is_err());
    assert!(solve_balanced(&p, 0.0).is_err());
    assert!(solve_balanced(&p, f64::NAN).is_err());
}

#[test]
fn hottest_neurons_go_first() {
    // Layer 0 is hot, layer 1 cold: the first 64 neurons bought are layer 0's hottest.
    let l0: Vec<f32> = (0..128)
        .map(|i| if i % 2 == 0 { 0.9 } else { 0.5 })
        .collect();
    let l1: Vec<f32> = (0..128).map(|_| 0.1).collect();
    let stats = vec![l0, l1];
    let nb = [2u64, 2];
    let p = Problem {
        stats: &stats,
        neuron_bytes: &nb,
        budget_bytes: 64 * 2,
        group: 32,
        min_neurons: 0,
        cap_neurons: None,
    };
    let sol = solve(&p).unwrap();
    let even: Vec<u32> = (0..64).map(|i| 2 * i).collect();
    assert_eq!(sol.split.layers[0].bucket, even);
    assert!(sol.split.layers[1].bucket.is_empty());
    assert_eq!(sol.split.ffn_bytes, 128);
}

/// Large layers (the multi-threaded path): the chosen neurons are exactly the reference
/// top-k (value descending, ties by ascending index), including many ties.
#[test]
fn large_layers_match_a_reference_sort() {
    let mut x = 12345u64;
    let stats: Vec<Vec<f32>> = (0..4)
        .map(|_| {
            (0..30_000)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    // Few distinct values: many ties; some tiny subnormal-free values.
                    ((x >> 59) as f32) * 0.125 + if x & 1 == 0 { 0.0 } else { 1e-30 }
                })
                .collect()
        })
        .collect();
    let nb = [3u64; 4];
    let p = Problem {
        stats: &stats,
        neuron_bytes: &nb,
        budget_bytes: 3 * 50_000,
        group: 32,
        min_neurons: 0,
        cap_neurons: None,
    };
    let sol = solve(&p).unwrap();
    let v = check_feasible(&p, &sol);
    for (l, layer) in sol.split.layers.iter().enumerate() {
        let mut idx: Vec<u32> = (0..30_000).collect();
        idx.sort_by(|&a, &b| {
            stats[l][b as usize]
                .total_cmp(&stats[l][a as usize])
                .then(a.cmp(&b))
        });
        let mut want = idx[..layer.k()].to_vec();
        want.sort_unstable();
        assert_eq!(layer.bucket, want, "layer {l}");
    }
    assert!(v > 0.0);
    assert!(sol.split.ffn_bytes > 3 * 49_900);
}
