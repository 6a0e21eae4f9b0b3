//! A model of one decode step's time on a CPU beside a GPU: what a placement is worth before
//! anything runs ("what would a 24 GB card do for this 70B model").
//!
//! Decode is memory-bound, so each piece of work costs the bytes it reads over the bandwidth
//! of the side that runs it, plus a launch per GPU kernel and the activations copied over the
//! link. Per layer, in order (as the engine runs it):
//!
//! 1. attention: the Q/K/V/output products on the GPU when it holds them (each a launch and a
//!    copy of its input and output), else on the CPU; attention over the KV cache (in host
//!    memory, as PowerInfer keeps it) on the CPU;
//! 2. the predictor (`fc1`, `fc2`): three launches on the GPU when it holds it, else the CPU;
//! 3. the sparse FFN, both sides at once: the GPU reads the rows of its computed active
//!    neurons, the CPU those of the others ([`Hardware::cpu_row_us`], measured, or the rows'
//!    bytes over its bandwidth); the step waits for the slower side. A neuron is active for a
//!    step of `B` sequences with probability `1 − (1 − p)^B` (the union is computed once).
//!
//! Then the output head. Tokens per second = `B` over the step's time.
//!
//! Two policies over the same held neurons ([`Policy`]): PowerInfer's static split (every
//! neuron the GPU holds is computed there) and the balanced one (each layer computes on the
//! GPU only its hottest held neurons, as many as make the two sides finish together: the
//! run-time balancer's fixed point).

use crate::budget::{DenseClass, KvTypes, VramBudget};
use crate::split::GpuSplit;

/// Figures of the machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Hardware {
    /// Bytes per second the CPU reads weights at.
    pub cpu_bandwidth: f64,
    /// Microseconds the CPU spends per active neuron (its FFN rows) and token, when measured;
    /// `None`: the rows' bytes over `cpu_bandwidth`.
    pub cpu_row_us: Option<f64>,
    /// Microseconds of fixed CPU work per layer (dispatches, norms, RoPE, additions).
    pub cpu_layer_us: f64,
    /// Bytes per second the GPU reads its memory at.
    pub gpu_bandwidth: f64,
    /// Microseconds per GPU kernel launch.
    pub gpu_launch_us: f64,
    /// Bytes per second of the host link (copies of activations).
    pub link_bandwidth: f64,
}

/// What runs: sequences decoded together and KV positions attended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Workload {
    /// Sequences per step (one token each).
    pub batch: usize,
    /// KV cache positions each token attends to.
    pub context: usize,
    /// The KV cache's types (what a position's K and V rows weigh).
    pub kv: KvTypes,
}

/// Which of the held neurons the GPU computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// PowerInfer: all of them.
    Static,
    /// The balanced split: per layer the hottest held neurons that even the two sides.
    Balanced,
}

/// One layer's predicted times (microseconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LayerCost {
    /// Attention products, attention over the cache and the predictor, copies included.
    pub attention_us: f64,
    /// The FFN's CPU part.
    pub ffn_cpu_us: f64,
    /// The FFN's GPU part (launches and copies included).
    pub ffn_gpu_us: f64,
    /// Expected active neurons computed on the GPU per step.
    pub rows_gpu: f64,
    /// Expected active neurons computed on the CPU per step.
    pub rows_cpu: f64,
    /// Held neurons the GPU computes.
    pub computed: usize,
    /// Neurons the GPU holds.
    pub held: usize,
}

impl LayerCost {
    /// The layer's time: attention, then the slower FFN side.
    pub fn time_us(&self) -> f64 {
        self.attention_us + self.ffn_cpu_us.max(self.ffn_gpu_us)
    }
}

/// A predicted decode step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepCost {
    /// Per layer.
    pub layers: Vec<LayerCost>,
    /// The output head (and final norm).
    pub output_us: f64,
    /// Sequences per step.
    pub batch: usize,
}

impl StepCost {
    /// The step's time in microseconds.
    pub fn step_us(&self) -> f64 {
        self.layers.iter().map(LayerCost::time_us).sum::<f64>() + self.output_us
    }

    /// Tokens per second over all sequences.
    pub fn tokens_per_s(&self) -> f64 {
        self.batch as f64 * 1e6 / self.step_us().max(1e-9)
    }

    /// Share of the active neurons computed on the GPU.
    pub fn gpu_share(&self) -> f64 {
        let (g, c) = self
            .layers
            .iter()
            .fold((0.0, 0.0), |a, l| (a.0 + l.rows_gpu, a.1 + l.rows_cpu));
        if g + c > 0.0 {
            g / (g + c)
        } else {
            0.0
        }
    }
}

/// Activation probabilities from statistics: as they are when they are probabilities (all at
/// most 1), counts scaled so that the most active neuron has 1 (a ReLU model's hottest neurons
/// fire for nearly every token).
pub fn activation_probabilities(stats: &[f32]) -> Vec<f32> {
    let max = stats.iter().copied().fold(0f32, f32::max);
    if max > 1.0 {
        stats.iter().map(|&c| (c / max).max(0.0)).collect()
    } else {
        stats.iter().map(|&p| p.max(0.0)).collect()
    }
}

/// The model of one decode step (see the [module docs](self)): `budget` gives the shape and
/// the dense tensors, `dense_on_gpu` how many of them (a prefix of `budget.dense`, as
/// [`VramBudget::plan`] places them) the GPU holds, `split` its neurons, `probabilities` each
/// neuron's activation probability.
pub fn predict(
    budget: &VramBudget,
    dense_on_gpu: usize,
    split: &GpuSplit,
    probabilities: &[Vec<f32>],
    hw: &Hardware,
    work: Workload,
    policy: Policy,
) -> StepCost {
    let shape = &budget.shape;
    let b = work.batch.max(1);
    let f32b = 4.0;
    let ne = shape.n_embd as f64;
    let secs_us = |bytes: f64, bw: f64| if bw > 0.0 { bytes / bw * 1e6 } else { 0.0 };
    // Dense bytes per layer and class, on each side.
    let mut attn = vec![(0.0f64, 0.0f64, 0usize); shape.n_layer];
    let mut pred = vec![(0.0f64, 0.0f64); shape.n_layer];
    let mut output = (0.0f64, 0.0f64, 0usize);
    for (i, t) in budget.dense.iter().enumerate() {
        let on_gpu = i < dense_on_gpu;
        // Norms are vectors: the engine keeps them in host memory.
        let matrix = !t.name.contains("norm");
        let bytes = t.bytes as f64;
        let slot = match (t.class, t.layer) {
            (DenseClass::Attention, Some(l)) if l < shape.n_layer => &mut attn[l],
            (DenseClass::Predictor, Some(l)) if l < shape.n_layer => {
                let p = &mut pred[l];
                if on_gpu {
                    p.0 += bytes;
                } else {
                    p.1 += bytes;
                }
                continue;
            }
            (DenseClass::Output, _) => &mut output,
            _ => continue,
        };
        if on_gpu && matrix {
            slot.0 += bytes;
            slot.2 += 1;
        } else {
            slot.1 += bytes;
        }
    }
    let kv_bytes = work.kv.pair_bytes(work.context as u64 * shape.n_embd_gqa) as f64;
    let layers = (0..shape.n_layer)
        .map(|l| {
            let (g_bytes, c_bytes, g_mats) = attn[l];
            // Each GPU product: a launch, its input in, its output out (about n_embd each).
            let attention_us = secs_us(g_bytes, hw.gpu_bandwidth)
                + g_mats as f64
                    * (hw.gpu_launch_us + secs_us(2.0 * ne * f32b * b as f64, hw.link_bandwidth))
                + secs_us(c_bytes, hw.cpu_bandwidth)
                + b as f64 * secs_us(kv_bytes, hw.cpu_bandwidth)
                + hw.cpu_layer_us;
            let n_ff = shape.n_ff[l];
            let (pg, pc) = pred[l];
            let pred_us = if pg > 0.0 {
                secs_us(pg, hw.gpu_bandwidth)
                    + 3.0 * hw.gpu_launch_us
                    + secs_us((ne + n_ff as f64) * f32b * b as f64, hw.link_bandwidth)
            } else {
                secs_us(pc, hw.cpu_bandwidth)
            };
            let nb = shape.neuron_bytes[l] as f64;
            let cpu_row = hw
                .cpu_row_us
                .unwrap_or_else(|| secs_us(nb, hw.cpu_bandwidth));
            let p = probabilities.get(l).map(Vec::as_slice).unwrap_or(&[]);
            let union = |j: usize| {
                let q = p.get(j).copied().unwrap_or(0.0).clamp(0.0, 1.0) as f64;
                1.0 - (1.0 - q).powi(b as i32)
            };
            let held: Vec<u32> = split
                .layers
                .get(l)
                .map(|s| s.bucket.clone())
                .unwrap_or_default();
            let mut rows_held: Vec<f64> = held.iter().map(|&j| union(j as usize)).collect();
            rows_held.sort_by(|a, b| b.total_cmp(a));
            let all: f64 = (0..n_ff).map(union).sum();
            let gpu_fixed = if held.is_empty() {
                0.0
            } else {
                4.0 * hw.gpu_launch_us
                    + secs_us(
                        (2.0 * ne + n_ff as f64) * f32b * b as f64,
                        hw.link_bandwidth,
                    )
            };
            let gpu = |rows: f64| {
                if rows > 0.0 {
                    gpu_fixed + secs_us(rows * nb, hw.gpu_bandwidth)
                } else {
                    0.0
                }
            };
            let cpu = |rows: f64| rows * cpu_row;
            // The GPU computes its `k` hottest held neurons.
            let cost_of = |k: usize| {
                let g: f64 = rows_held[..k].iter().sum();
                (g, gpu(g), cpu(all - g))
            };
            let k = match policy {
                Policy::Static => held.len(),
                Policy::Balanced => {
                    // The time max(cpu, gpu) falls then rises in k: the first k where the GPU
                    // is the slower side, or the one before.
                    let (mut lo, mut hi) = (0usize, held.len());
                    while lo < hi {
                        let mid = (lo + hi) / 2;
                        let (_, g, c) = cost_of(mid);
                        if g >= c {
                            hi = mid;
                        } else {
                            lo = mid + 1;
                        }
                    }
                    let t = |k: usize| {
                        let (_, g, c) = cost_of(k);
                        g.max(c)
                    };
                    if lo > 0 && t(lo - 1) <= t(lo) {
                        lo - 1
                    } else {
                        lo
                    }
                }
            };
            let (g_rows, g_us, c_us) = cost_of(k);
            LayerCost {
                attention_us: attention_us + pred_us,
                ffn_cpu_us: c_us,
                ffn_gpu_us: g_us,
                rows_gpu: g_rows,
                rows_cpu: all - g_rows,
                computed: k,
                held: held.len(),
            }
        })
        .collect();
    let (og, oc, om) = output;
    let output_us = secs_us(og, hw.gpu_bandwidth)
        + om as f64 * (hw.gpu_launch_us + secs_us(2.0 * ne * f32b * b as f64, hw.link_bandwidth))
        + secs_us(oc, hw.cpu_bandwidth);
    StepCost {
        layers,
        output_us,
        batch: b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{DenseTensor, ModelShape};
    use crate::split::LayerSplit;

    fn budget(n_layer: usize, n_ff: usize) -> VramBudget {
        let shape = ModelShape {
            n_layer,
            n_embd: 1024,
            n_embd_gqa: 1024,
            n_ff: vec![n_ff; n_layer],
            neuron_bytes: vec![3000; n_layer],
        };
        let mut dense = Vec::new();
        for l in 0..n_layer {
            for n in ["attn_q", "attn_k", "attn_v", "attn_output"] {
                dense.push(DenseTensor {
                    name: format!("blk.{l}.{n}.weight"),
                    class: DenseClass::Attention,
                    layer: Some(l),
                    bytes: 1_000_000,
                });
            }
        }
        dense.push(DenseTensor {
            name: "output.weight".into(),
            class: DenseClass::Output,
            layer: None,
            bytes: 10_000_000,
        });
        VramBudget::new(shape, dense).unwrap()
    }

    fn hw() -> Hardware {
        Hardware {
            cpu_bandwidth: 10e9,
            cpu_row_us: None,
            cpu_layer_us: 0.0,
            gpu_bandwidth: 10e9,
            gpu_launch_us: 0.0,
            link_bandwidth: f64::INFINITY,
        }
    }

    #[test]
    fn everything_on_the_cpu_is_bytes_over_bandwidth() {
        let b = budget(2, 100);
        let split = GpuSplit::all_cpu(&[100, 100]);
        let p = vec![vec![0.5f32; 100]; 2];
        let c = predict(
            &b,
            0,
            &split,
            &p,
            &hw(),
            Workload {
                batch: 1,
                context: 0,
                kv: KvTypes::F16,
            },
            Policy::Static,
        );
        // Per layer: 4 MB of attention + 50 active neurons of 3000 bytes; output 10 MB.
        let want = 2.0 * (4e6 + 50.0 * 3000.0) / 10e9 * 1e6 + 10e6 / 10e9 * 1e6;
        assert!(
            (c.step_us() - want).abs() < 1e-6,
            "{} vs {want}",
            c.step_us()
        );
        assert_eq!(c.gpu_share(), 0.0);
        // A batch of 2 reads the dense weights once and the union of the active rows.
        let c2 = predict(
            &b,
            0,
            &split,
            &p,
            &hw(),
            Workload {
                batch: 2,
                context: 0,
                kv: KvTypes::F16,
            },
            Policy::Static,
        );
        let want2 = 2.0 * (4e6 + 75.0 * 3000.0) / 10e9 * 1e6 + 10e6 / 10e9 * 1e6;
        assert!((c2.step_us() - want2).abs() < 1e-6);
        assert!((c2.tokens_per_s() - 2e6 / want2).abs() < 1e-6);
    }

    #[test]
    fn balancing_evens_an_unequal_split_and_never_loses() {
        let b = budget(1, 1000);
        // The GPU holds 600 neurons, equally active: with equal speeds the static split leaves
        // the GPU 1.5× the CPU's rows; balanced computes 500 there.
        let bucket: Vec<u32> = (0..600).collect();
        let split = GpuSplit {
            layers: vec![LayerSplit::new(1000, bucket, 600.0, 1000.0).unwrap()],
            ffn_bytes: 600 * 3000,
        };
        let p = vec![vec![0.2f32; 1000]];
        let w = Workload {
            batch: 1,
            context: 0,
            kv: KvTypes::F16,
        };
        let s = predict(&b, 0, &split, &p, &hw(), w, Policy::Static);
        let d = predict(&b, 0, &split, &p, &hw(), w, Policy::Balanced);
        assert_eq!(s.layers[0].computed, 600);
        assert_eq!(d.layers[0].computed, 500);
        assert!((s.layers[0].ffn_gpu_us / s.layers[0].ffn_cpu_us - 1.5).abs() < 1e-9);
        assert!((d.layers[0].ffn_gpu_us - d.layers[0].ffn_cpu_us).abs() < 1e-9);
        assert!(d.step_us() < s.step_us());
        // A faster GPU: balanced computes everything it holds, as static does.
        let fast = Hardware {
            gpu_bandwidth: 100e9,
            ..hw()
        };
        let s = predict(&b, 0, &split, &p, &fast, w, Policy::Static);
        let d = predict(&b, 0, &split, &p, &fast, w, Policy::Balanced);
        assert_eq!(d.layers[0].computed, 600);
        assert!((d.step_us() - s.step_us()).abs() < 1e-9);
    }

    #[test]
    fn counts_scale_to_probabilities() {
        assert_eq!(activation_probabilities(&[0.5, 0.25]), vec![0.5, 0.25]);
        assert_eq!(
            activation_probabilities(&[10.0, 5.0, 0.0]),
            vec![1.0, 0.5, 0.0]
        );
    }
}
