//! `reorder_neurons`: a PowerInfer file with each layer's FFN neurons sorted by activation
//! frequency is the same model (logits equal up to the order of the down projection's sum),
//! its neuron tensors are the input's rows in the new order, the statistics are permuted
//! alike, and bad inputs give typed errors.

use std::path::{Path, PathBuf};

use powerinfer_cli::reorder::{neuron_order, reorder_neurons};
use powerinfer_cli::synth::{self, LnArch, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::Engine;
use powerinfer_engine::EngineError;
use powerinfer_gguf::{GgmlType, GgufFile};
use powerinfer_predictor::stats::ActivationStats;

// The engine tests' helpers: these tests run the models they write as the engine's do.
#[path = "support/engine.rs"]
mod common;
use common::{argmax, opts, rel_diff, PROMPT};

/// A tiny F32 PowerInfer file (`llama`, or the LayerNorm family `ln`), its dense twin and its
/// activation statistics.
fn make_with_stats(dir: &Path, ln: Option<LnArch>) -> (PathBuf, PathBuf, ActivationStats) {
    let sparse = dir.join("model.powerinfer.gguf");
    let dense = dir.join("model.gguf");
    let act = dir.join("activation");
    let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
    cfg.ty = GgmlType::F32;
    cfg.ln_arch = ln;
    cfg.seed = 17;
    let out = SynthOutputs {
        model: sparse.clone(),
        dense: Some(dense.clone()),
        activation_dir: Some(act.clone()),
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    (sparse, dense, ActivationStats::read_pt_dir(&act).unwrap())
}

fn rows<'a>(f: &'a GgufFile, name: &str) -> Vec<&'a [u8]> {
    let t = f.tensor_info(name).unwrap();
    let data = f.data_of(t);
    let n = t.shape().last().copied().unwrap() as usize;
    let n = if t.shape().len() == 1 {
        data.len() / 4
    } else {
        n
    };
    data.chunks_exact(data.len() / n).collect()
}

#[test]
fn neuron_order_is_descending_and_stable() {
    assert_eq!(neuron_order(&[0.1, 0.5, 0.1, 0.9]), vec![3, 1, 0, 2]);
    assert_eq!(neuron_order(&[f32::NAN, 0.2, 0.0]), vec![1, 2, 0]);
    assert!(neuron_order(&[]).is_empty());
}

#[test]
fn reordered_file_is_the_same_model() {
    for arch in [None, Some(LnArch::Opt)] {
        let dir = tempfile::tempdir().unwrap();
        let (sparse, _, stats) = make_with_stats(dir.path(), arch);
        let out = dir.path().join("sorted.powerinfer.gguf");
        let report = reorder_neurons(&sparse, &out, &stats).unwrap();
        let n_layer = stats.n_layer();
        // gate/up/down_t/fc2 per layer; OPT: no gate, an up bias.
        assert_eq!(report.permuted.len(), 4 * n_layer, "{arch:?}");
        for (l, (old, new)) in stats.layers.iter().zip(&report.stats.layers).enumerate() {
            let order = neuron_order(old);
            assert!(new.windows(2).all(|w| w[0] >= w[1]), "layer {l} not sorted");
            let want: Vec<f32> = order.iter().map(|&i| old[i as usize]).collect();
            assert_eq!(new, &want);
            assert!(report.top20_share[l] >= 0.2, "{:?}", report.top20_share);
        }
        let (a, b) = (
            GgufFile::open(&sparse).unwrap(),
            GgufFile::open(&out).unwrap(),
        );
        assert_eq!(a.metadata(), b.metadata());
        let order = neuron_order(&stats.layers[1]);
        let gate_or_bias = match arch {
            Some(LnArch::Opt) => "blk.1.ffn_up.bias",
            _ => "blk.1.ffn_gate.weight",
        };
        for name in [
            "blk.1.ffn_up.weight",
            "blk.1.ffn_down_t.weight",
            "blk.1.fc2.weight",
            gate_or_bias,
        ] {
            let (ra, rb) = (rows(&a, name), rows(&b, name));
            assert_eq!(ra.len(), order.len(), "{name}");
            for (k, &i) in order.iter().enumerate() {
                assert_eq!(rb[k], ra[i as usize], "{name} row {k}");
            }
        }
        // Tensors without neurons are copied.
        assert_eq!(
            a.data_of(a.tensor_info("blk.1.attn_output.weight").unwrap()),
            b.data_of(b.tensor_info("blk.1.attn_output.weight").unwrap())
        );
        // The same model: prompt logits and greedy decode steps (sparse FFN, and dense mode).
        for dense in [false, true] {
            let run = |path: &Path| {
                let engine = Engine::load(path, opts(dense)).unwrap();
                let mut s = engine.session();
                let mut logits = s.eval(&PROMPT).unwrap();
                let mut all = logits.clone();
                for _ in 0..6 {
                    let tok = argmax(&logits);
                    logits = s.eval(&[tok]).unwrap();
                    all.extend(&logits);
                }
                all
            };
            let (x, y) = (run(&sparse), run(&out));
            let y64: Vec<f64> = y.iter().map(|&v| v as f64).collect();
            let r = rel_diff(&x, &y64);
            eprintln!("{arch:?} dense={dense}: reordered vs original, max diff / std = {r:.2e}");
            assert!(r <= 1e-5, "{arch:?} dense={dense}: {r}");
        }
    }
}

#[test]
fn bad_inputs_give_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let (sparse, dense, stats) = make_with_stats(dir.path(), None);
    let out = dir.path().join("out.gguf");
    // A dense GGUF file keeps neurons in ffn_down's columns.
    assert!(matches!(
        reorder_neurons(&dense, &out, &stats),
        Err(EngineError::Invalid(_))
    ));
    // Statistics of another layer count, or of another width.
    let mut fewer = stats.clone();
    fewer.layers.pop();
    assert!(matches!(
        reorder_neurons(&sparse, &out, &fewer),
        Err(EngineError::Invalid(_))
    ));
    let mut narrow = stats.clone();
    narrow.layers[0].pop();
    assert!(matches!(
        reorder_neurons(&sparse, &out, &narrow),
        Err(EngineError::TensorShape { .. })
    ));
    // Writing over the input.
    assert!(matches!(
        reorder_neurons(&sparse, &sparse, &stats),
        Err(EngineError::Invalid(_))
    ));
    assert!(!out.exists(), "no output after an error");
    // A file that is not GGUF at all.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"PWRI\x03\0\0\0garbage").unwrap();
    assert!(matches!(
        reorder_neurons(&junk, &out, &stats),
        Err(EngineError::Gguf(_))
    ));
}
