//! Reordering a PowerInfer file's FFN neurons by how often they fire (`powerinfer reorder`).
//!
//! A sparse FFN reads, per token, the gate/up rows and the `ffn_down_t` row of each active
//! neuron. With the neurons in the converter's order the active rows are scattered over the
//! whole matrix, and scattered rows of 1–2 KiB read from memory at well under the sequential
//! speed (`docs/tuning.md`, "Neurons sorted by activation frequency"). A layer's FFN gives the same result for any order of its
//! neurons, as long as the rows of `ffn_gate`, `ffn_up`, `ffn_down_t`, the predictor's `fc2`
//! and the up bias are permuted alike. [`reorder_neurons`] sorts each layer's neurons by their
//! activation frequency (most frequent first), so that the neurons active for most tokens sit
//! in one block of consecutive rows. The engine cuts a layer's neurons among its threads where
//! their measured times come out equal (the executor's learned thread split), so the crowded first rows do not
//! all fall to one thread. The logits change only by the order of the down projection's sum.
//!
//! The file keeps its magic, metadata and every other tensor; the activation statistics are
//! permuted with the neurons, so that they still describe the new file (a GPU index planned
//! from them, `powerinfer plan`, refers to the new neuron numbers).

use std::path::Path;

use powerinfer_gguf::{FileKind, GgmlType, GgufFile, GgufWriter};
use powerinfer_predictor::stats::ActivationStats;

use powerinfer_engine::{EngineError, Result};

/// What [`reorder_neurons`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct ReorderReport {
    /// Tensors whose rows (or values) were permuted.
    pub permuted: Vec<String>,
    /// Per layer: the share of all activations (the statistics' sum) carried by the first 20%
    /// of the new order.
    pub top20_share: Vec<f32>,
    /// The statistics permuted like the neurons (index `i` describes new neuron `i`).
    pub stats: ActivationStats,
}

/// The order of one layer's neurons by descending activation frequency: `order[k]` is the
/// old index of new neuron `k`. Ties (and NaN, which sorts last) keep their old order.
pub fn neuron_order(freq: &[f32]) -> Vec<u32> {
    let mut order: Vec<u32> = (0..freq.len() as u32).collect();
    let key = |i: u32| {
        let f = freq[i as usize];
        if f.is_nan() {
            f32::NEG_INFINITY
        } else {
            f
        }
    };
    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
    order
}

/// The per-layer tensors whose rows are neurons, and whether they must be present.
fn neuron_tensors(layer: usize) -> [(String, bool); 5] {
    let b = |s: &str| format!("blk.{layer}.{s}");
    [
        (b("ffn_up.weight"), true),
        (b("ffn_down_t.weight"), true),
        (b("fc2.weight"), true),
        (b("ffn_gate.weight"), false),
        (b("ffn_up.bias"), false),
    ]
}

/// Writes `input` (a PowerInfer file) to `output` with each layer's FFN neurons sorted by
/// `stats` (one value per neuron per layer, e.g. PowerInfer's `activation/*.pt`), most active
/// first. Errors: a dense GGUF file (its `ffn_down` keeps neurons in columns), statistics whose
/// layer count or lengths do not match the file, a neuron tensor of another shape, or the
/// output being the input.
pub fn reorder_neurons(
    input: &Path,
    output: &Path,
    stats: &ActivationStats,
) -> Result<ReorderReport> {
    if let (Ok(a), Ok(b)) = (input.canonicalize(), output.canonicalize()) {
        if a == b {
            return Err(EngineError::Invalid(
                "the output must be a different file from the input".into(),
            ));
        }
    }
    let file = GgufFile::open(input)?;
    if file.kind() != FileKind::PowerInfer {
        return Err(EngineError::Invalid(
            "not a PowerInfer file (PWRI): only files with ffn_down_t keep a neuron per row".into(),
        ));
    }
    // The layers are those with an ffn_down_t.
    let n_layer = (0..)
        .take_while(|l| {
            file.tensor_info(&format!("blk.{l}.ffn_down_t.weight"))
                .is_some()
        })
        .count();
    if n_layer == 0 || stats.n_layer() != n_layer {
        return Err(EngineError::Invalid(format!(
            "the statistics have {} layers, the file {n_layer}",
            stats.n_layer()
        )));
    }
    let orders: Vec<Vec<u32>> = stats.layers.iter().map(|l| neuron_order(l)).collect();
    // Every neuron tensor's name -> its layer; checked against the statistics' lengths.
    let mut plan = std::collections::HashMap::new();
    for (l, order) in orders.iter().enumerate() {
        let n_ff = order.len() as u64;
        for (name, required) in neuron_tensors(l) {
            let Some(t) = file.tensor_info(&name) else {
                if required {
                    return Err(EngineError::MissingTensor(name));
                }
                continue;
            };
            let shape = t.shape();
            let rows_ok = match shape {
                [ne0] => *ne0 == n_ff && t.ggml_type() == GgmlType::F32,
                [_, ne1] => *ne1 == n_ff,
                _ => false,
            };
            if !rows_ok {
                return Err(EngineError::TensorShape {
                    name,
                    expected: if shape.len() == 1 {
                        vec![n_ff]
                    } else {
                        vec![0, n_ff]
                    },
                    got: shape.to_vec(),
                });
            }
            plan.insert(name, l);
        }
    }
    let mut w = GgufWriter::create(output, file.kind())?;
    w.add_metadata(file.metadata())?;
    for t in file.tensors() {
        w.add_tensor(t.name(), t.shape(), t.ggml_type())?;
    }
    let mut permuted = Vec::new();
    for t in file.tensors() {
        let data = file.data_of(t);
        match plan.get(t.name()) {
            None => w.write_tensor_data(t.name(), data)?,
            Some(&l) => {
                let order = &orders[l];
                let row = data.len() / order.len();
                let mut out = Vec::with_capacity(data.len());
                for &i in order {
                    out.extend_from_slice(&data[i as usize * row..][..row]);
                }
                w.write_tensor_data(t.name(), &out)?;
                permuted.push(t.name().to_string());
            }
        }
    }
    w.finish()?.commit()?;
    let layers: Vec<Vec<f32>> = stats
        .layers
        .iter()
        .zip(&orders)
        .map(|(v, o)| o.iter().map(|&i| v[i as usize]).collect())
        .collect();
    let top20_share = layers
        .iter()
        .map(|v| {
            let total: f64 = v.iter().filter(|x| x.is_finite()).map(|&x| x as f64).sum();
            let top: f64 = v[..v.len().div_ceil(5)]
                .iter()
                .filter(|x| x.is_finite())
                .map(|&x| x as f64)
                .sum();
            if total > 0.0 {
                (top / total) as f32
            } else {
                0.0
            }
        })
        .collect();
    Ok(ReorderReport {
        permuted,
        top20_share,
        stats: ActivationStats::new(layers, stats.kind.clone()),
    })
}
