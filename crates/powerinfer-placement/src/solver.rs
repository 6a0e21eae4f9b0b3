//! The hot/cold neuron placement solver.
//!
//! Each layer's neurons are sorted by their activation statistic (largest first, ties by
//! ascending index) and cut into groups of `group` consecutive sorted neurons (the last group of
//! a layer may be shorter when `group` does not divide `n_ff`). A layer holds a prefix of its
//! groups on the GPU; taking `j` groups costs `neurons(j) · neuron_bytes[l]` bytes and gains the
//! statistics of those neurons ("activation mass"). The solver maximises the total mass under
//! the byte budget, subject to an optional per-layer cap and an optional per-layer minimum with
//! PowerInfer's meaning (a layer holds either no GPU neurons or at least the minimum).
//!
//! Methods, chosen automatically ([`Method`]):
//! - [`Method::Greedy`] when every group costs the same bytes (equal per-neuron bytes and every
//!   `n_ff` a multiple of `group`) and the minimum is at most one group. Group values are
//!   non-increasing within a layer, so the globally largest groups form per-layer prefixes, and
//!   with equal costs taking the `floor(budget / cost)` largest is optimal (an exchange
//!   argument; tested against brute force).
//! - [`Method::Dp`] otherwise: a dynamic program over layers × budget in units of the greatest
//!   common divisor of all prefix costs. Exact.
//! - [`Method::Density`] when that table would be too large (more than [`DP_MAX_CELLS`] cells
//!   or [`DP_MAX_OPS`] transitions): greedy by value per byte, then minimums repaired. Not
//!   guaranteed optimal; [`Solution::exact`] is `false`.
//!
//! [`solve_balanced`] is Q-Infer's mode: every layer puts the same share `s` of its own mass on
//! the GPU (`s = r / (1 + r)` for a GPU/CPU throughput ratio `r`, so both sides finish a layer
//! together), with `s` lowered uniformly (bisection) until the bytes fit.

use crate::error::{PlacementError, Result};
use crate::split::{GpuSplit, LayerSplit};

/// Largest DP table (layers × budget units) the exact method builds.
pub const DP_MAX_CELLS: u64 = 40_000_000;
/// Largest number of DP transitions (cells × choices per layer) the exact method runs.
pub const DP_MAX_OPS: u64 = 2_000_000_000;

/// A placement problem.
#[derive(Clone, Copy, Debug)]
pub struct Problem<'a> {
    /// Per layer, per neuron activation statistics (finite, non-negative; larger = hotter).
    pub stats: &'a [Vec<f32>],
    /// Bytes of one neuron of each layer (see [`crate::ModelShape::neuron_bytes`]).
    pub neuron_bytes: &'a [u64],
    /// Bytes available for neuron rows.
    pub budget_bytes: u64,
    /// Neurons per group: a positive multiple of 32 (PowerInfer: 256).
    pub group: usize,
    /// A layer holds 0 or at least this many GPU neurons (rounded up to whole groups; a whole
    /// layer always satisfies it); 0 = no minimum.
    pub min_neurons: usize,
    /// At most this many GPU neurons per layer (rounded down to whole groups); `None` = no cap.
    pub cap_neurons: Option<usize>,
}

/// How a solution was found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Largest groups first (exact for equal group costs without minimums).
    Greedy,
    /// Dynamic program over layers × budget units (exact).
    Dp,
    /// Value-per-byte greedy (fallback for instances too large for the DP; approximate).
    Density,
    /// Q-Infer's balanced mode.
    Balanced,
}

/// The result of a solve.
#[derive(Clone, Debug)]
pub struct Solution {
    /// The GPU neurons of each layer.
    pub split: GpuSplit,
    /// Method used.
    pub method: Method,
    /// Whether the objective is proven optimal (greedy in its exact case, DP).
    pub exact: bool,
}

/// One layer, sorted and grouped.
struct Layer<'a> {
    /// The layer's statistics, in neuron order.
    values: &'a [f32],
    /// The statistics sorted in descending order.
    sorted: Vec<f32>,
    /// `prefix[j]` = mass of the first `j` groups (`prefix[0] = 0`).
    prefix: Vec<f64>,
    n_ff: usize,
    group: usize,
    neuron_bytes: u64,
    /// Largest allowed group count.
    max_j: usize,
    /// Smallest allowed non-zero group count.
    min_j: usize,
}

impl Layer<'_> {
    fn groups(&self) -> usize {
        self.prefix.len() - 1
    }
    fn neurons(&self, j: usize) -> usize {
        (j * self.group).min(self.n_ff)
    }
    fn cost(&self, j: usize) -> u64 {
        self.neurons(j) as u64 * self.neuron_bytes
    }
    fn allowed(&self, j: usize) -> bool {
        j == 0 || (j >= self.min_j && j <= self.max_j)
    }
}

/// A finite non-negative f32 → u32 with the same order (`-0.0` counts as `0.0`).
fn ordered_bits(v: f32) -> u32 {
    (v + 0.0).to_bits()
}

/// `values` in descending order: an LSD radix sort (3 passes of 11 bits) of the
/// inverted value bits. Passes whose digit is the same for every value are skipped.
fn sorted_desc(values: &[f32]) -> Vec<f32> {
    let mut a: Vec<u32> = values.iter().map(|&v| !ordered_bits(v)).collect();
    let mut b = vec![0u32; a.len()];
    for pass in 0..3 {
        let shift = 11 * pass;
        let digit = |x: u32| ((x >> shift) & 0x7ff) as usize;
        let mut count = [0usize; 2048];
        for &x in &a {
            count[digit(x)] += 1;
        }
        if count.contains(&a.len()) {
            continue;
        }
        let mut sum = 0;
        for c in count.iter_mut() {
            let t = *c;
            *c = sum;
            sum += t;
        }
        for &x in &a {
            let d = digit(x);
            b[count[d]] = x;
            count[d] += 1;
        }
        std::mem::swap(&mut a, &mut b);
    }
    a.into_iter().map(|x| f32::from_bits(!x)).collect()
}

/// Ascending indices of the `k` hottest neurons (ties by ascending index), given the values
/// sorted in descending order.
fn hottest(values: &[f32], sorted: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let t = sorted[k - 1];
    let above = sorted.partition_point(|&v| v > t);
    let mut ties = k - above;
    let mut out = Vec::with_capacity(k);
    for (i, &v) in values.iter().enumerate() {
        let v = v + 0.0;
        if v > t {
            out.push(i as u32);
        } else if v == t && ties > 0 {
            ties -= 1;
            out.push(i as u32);
        }
    }
    out
}

fn check_stats(l: usize, values: &[f32]) -> Result<()> {
    if values.len() > u32::MAX as usize {
        return Err(PlacementError::Invalid(format!(
            "layer {l}: too many neurons"
        )));
    }
    if let Some((i, v)) = values
        .iter()
        .enumerate()
        .find(|(_, v)| !(v.is_finite() && **v >= 0.0))
    {
        return Err(PlacementError::Invalid(format!(
            "layer {l}: statistic {v} of neuron {i} is not a finite non-negative number"
        )));
    }
    Ok(())
}

fn prepare_layer<'a>(p: &Problem, values: &'a [f32], neuron_bytes: u64) -> Layer<'a> {
    let n_ff = values.len();
    let sorted = sorted_desc(values);
    let n_groups = n_ff.div_ceil(p.group);
    let mut prefix = Vec::with_capacity(n_groups + 1);
    prefix.push(0.0f64);
    let mut acc = 0.0f64;
    for chunk in sorted.chunks(p.group) {
        let s: f64 = chunk.iter().map(|&v| f64::from(v)).sum();
        acc += s;
        prefix.push(acc);
    }
    let max_j = match p.cap_neurons {
        None => n_groups,
        Some(cap) if cap >= n_ff => n_groups,
        Some(cap) => cap / p.group,
    };
    let min_j = p.min_neurons.div_ceil(p.group).min(n_groups).max(1);
    Layer {
        values,
        sorted,
        prefix,
        n_ff,
        group: p.group,
        neuron_bytes,
        max_j,
        min_j,
    }
}

/// Validates the problem and sorts and groups every layer (layers spread over the available
/// cores with scoped threads).
fn prepare<'a>(p: &Problem<'a>) -> Result<Vec<Layer<'a>>> {
    if p.group == 0 || p.group % 32 != 0 {
        return Err(PlacementError::Invalid(format!(
            "group size {} is not a positive multiple of 32",
            p.group
        )));
    }
    if p.stats.len() != p.neuron_bytes.len() {
        return Err(PlacementError::Invalid(format!(
            "statistics for {} layers, neuron sizes for {}",
            p.stats.len(),
            p.neuron_bytes.len()
        )));
    }
    for (l, values) in p.stats.iter().enumerate() {
        check_stats(l, values)?;
    }
    let n = p.stats.len();
    let work: usize = p.stats.iter().map(Vec::len).sum();
    let threads = if work < 1 << 16 {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, |t| t.get())
            .min(n)
    };
    if threads <= 1 {
        return Ok(p
            .stats
            .iter()
            .zip(p.neuron_bytes)
            .map(|(v, &nb)| prepare_layer(p, v, nb))
            .collect());
    }
    let per = n.div_ceil(threads);
    let mut out: Vec<Layer<'a>> = Vec::with_capacity(n);
    std::thread::scope(|scope| {
        let handles: Vec<_> = p
            .stats
            .chunks(per)
            .zip(p.neuron_bytes.chunks(per))
            .map(|(vs, nbs)| {
                scope.spawn(move || {
                    vs.iter()
                        .zip(nbs)
                        .map(|(v, &nb)| prepare_layer(p, v, nb))
                        .collect::<Vec<Layer<'a>>>()
                })
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(layers) => out.extend(layers),
                Err(e) => std::panic::resume_unwind(e),
            }
        }
    });
    Ok(out)
}

fn finish(layers: &[Layer], js: &[usize], method: Method, exact: bool) -> Result<Solution> {
    let mut out = Vec::with_capacity(layers.len());
    let mut bytes = 0u64;
    for (layer, &j) in layers.iter().zip(js) {
        let k = layer.neurons(j);
        let bucket = hottest(layer.values, &layer.sorted, k);
        bytes += layer.cost(j);
        let total = layer.prefix[layer.groups()];
        out.push(LayerSplit::new(layer.n_ff, bucket, layer.prefix[j], total)?);
    }
    Ok(Solution {
        split: GpuSplit {
            layers: out,
            ffn_bytes: bytes,
        },
        method,
        exact,
    })
}

/// Solves a placement problem (maximum activation mass under the budget).
pub fn solve(p: &Problem) -> Result<Solution> {
    let layers = prepare(p)?;
    let uniform_cost = layers
        .windows(2)
        .all(|w| w[0].neuron_bytes == w[1].neuron_bytes)
        && layers.iter().all(|l| l.n_ff % p.group == 0);
    let no_min = layers.iter().all(|l| l.min_j <= 1);
    if uniform_cost && no_min {
        return finish(
            &layers,
            &greedy(&layers, p.budget_bytes),
            Method::Greedy,
            true,
        );
    }
    match dp(&layers, p.budget_bytes) {
        Some(js) => finish(&layers, &js, Method::Dp, true),
        None => finish(
            &layers,
            &density(&layers, p.budget_bytes),
            Method::Density,
            false,
        ),
    }
}

/// Equal group costs: the `floor(budget / cost)` largest groups (ties: lower layer, then lower
/// group index, which keeps per-layer prefixes).
fn greedy(layers: &[Layer], budget: u64) -> Vec<usize> {
    let mut js = vec![0usize; layers.len()];
    let Some(first) = layers.first() else {
        return js;
    };
    let cost = first.cost(1);
    let mut cands: Vec<(f64, u32, u32)> = Vec::new();
    for (l, layer) in layers.iter().enumerate() {
        for j in 1..=layer.max_j {
            cands.push((layer.prefix[j] - layer.prefix[j - 1], l as u32, j as u32));
        }
    }
    let n = budget
        .checked_div(cost)
        .map_or(cands.len(), |n| n.min(cands.len() as u64) as usize);
    let cmp = |a: &(f64, u32, u32), b: &(f64, u32, u32)| {
        b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2))
    };
    if n < cands.len() && n > 0 {
        cands.select_nth_unstable_by(n - 1, cmp);
    }
    for &(_, l, _) in &cands[..n] {
        js[l as usize] += 1;
    }
    js
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Exact DP; `None` when the table would exceed the limits.
fn dp(layers: &[Layer], budget: u64) -> Option<Vec<usize>> {
    let mut unit = 0u64;
    let mut all_cost = 0u64;
    for layer in layers {
        for j in 1..=layer.groups() {
            unit = gcd(unit, layer.cost(j));
        }
        all_cost = all_cost.saturating_add(layer.cost(layer.max_j));
    }
    if unit == 0 {
        // Every neuron is free: take everything allowed.
        return Some(layers.iter().map(|l| l.max_j).collect());
    }
    let u_max = (budget.min(all_cost) / unit) as usize;
    let width = u_max as u64 + 1;
    let choices: u64 = layers.iter().map(|l| l.max_j as u64 + 1).sum();
    if width.saturating_mul(layers.len() as u64) > DP_MAX_CELLS
        || width.saturating_mul(choices) > DP_MAX_OPS
    {
        return None;
    }
    let mut best = vec![0.0f64; u_max + 1];
    let mut next = vec![0.0f64; u_max + 1];
    let mut pick: Vec<Vec<u32>> = Vec::with_capacity(layers.len());
    for layer in layers {
        let mut choice = vec![0u32; u_max + 1];
        next.copy_from_slice(&best);
        for j in 1..=layer.max_j {
            if !layer.allowed(j) {
                continue;
            }
            let c = (layer.cost(j) / unit) as usize;
            if c > u_max {
                break;
            }
            let v = layer.prefix[j];
            for u in c..=u_max {
                let cand = best[u - c] + v;
                if cand > next[u] {
                    next[u] = cand;
                    choice[u] = j as u32;
                }
            }
        }
        std::mem::swap(&mut best, &mut next);
        pick.push(choice);
    }
    let mut js = vec![0usize; layers.len()];
    let mut u = u_max;
    for l in (0..layers.len()).rev() {
        let j = pick[l][u] as usize;
        js[l] = j;
        u -= (layers[l].cost(j) / unit) as usize;
    }
    Some(js)
}

/// Value-per-byte greedy over groups in per-layer order, then minimums repaired (raised if the
/// bytes allow, else dropped to 0).
fn density(layers: &[Layer], budget: u64) -> Vec<usize> {
    let mut cands: Vec<(f64, u32, u32)> = Vec::new();
    for (l, layer) in layers.iter().enumerate() {
        for j in 1..=layer.max_j {
            let c = (layer.cost(j) - layer.cost(j - 1)).max(1) as f64;
            cands.push((
                (layer.prefix[j] - layer.prefix[j - 1]) / c,
                l as u32,
                j as u32,
            ));
        }
    }
    cands.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut js = vec![0usize; layers.len()];
    let mut left = budget;
    for &(_, l, j) in &cands {
        let (l, j) = (l as usize, j as usize);
        if js[l] + 1 != j {
            continue;
        }
        let c = layers[l].cost(j) - layers[l].cost(j - 1);
        if c <= left {
            left -= c;
            js[l] = j;
        }
    }
    for (l, layer) in layers.iter().enumerate() {
        if js[l] > 0 && js[l] < layer.min_j {
            let extra = layer.cost(layer.min_j) - layer.cost(js[l]);
            if layer.min_j <= layer.max_j && extra <= left {
                left -= extra;
                js[l] = layer.min_j;
            } else {
                left += layer.cost(js[l]);
                js[l] = 0;
            }
        }
    }
    js
}

/// Q-Infer's balanced mode for a GPU/CPU throughput ratio `ratio` (> 0): each layer holds the
/// fewest allowed groups whose mass reaches the share `s` of that layer's mass, with
/// `s = ratio / (1 + ratio)` if that fits in the budget, else the largest `s` that does.
pub fn solve_balanced(p: &Problem, ratio: f64) -> Result<Solution> {
    if !(ratio.is_finite() && ratio > 0.0) {
        return Err(PlacementError::Invalid(format!(
            "balanced ratio {ratio} is not a positive number"
        )));
    }
    let layers = prepare(p)?;
    let pick = |s: f64| -> (Vec<usize>, u64) {
        let mut js = Vec::with_capacity(layers.len());
        let mut bytes = 0u64;
        for layer in &layers {
            let target = s * layer.prefix[layer.groups()];
            // Smallest j with prefix[j] >= target (prefix is non-decreasing: statistics are
            // non-negative).
            let mut j = layer.prefix.partition_point(|&m| m < target);
            j = j.min(layer.max_j);
            if target <= 0.0 {
                j = 0;
            }
            if j > 0 && j < layer.min_j {
                j = if layer.min_j <= layer.max_j {
                    layer.min_j
                } else {
                    0
                };
            }
            bytes = bytes.saturating_add(layer.cost(j));
            js.push(j);
        }
        (js, bytes)
    };
    let s0 = ratio / (1.0 + ratio);
    let (js, bytes) = pick(s0);
    if bytes <= p.budget_bytes {
        return finish(&layers, &js, Method::Balanced, false);
    }
    let (mut lo, mut hi) = (0.0f64, s0);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if pick(mid).1 <= p.budget_bytes {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (js, _) = pick(lo);
    finish(&layers, &js, Method::Balanced, false)
}
