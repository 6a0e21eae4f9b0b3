//! The FFN observer: what it reports, and that an observed evaluation is the dense forward pass.

use powerinfer_cli::synth::{self, Arch, Shape, SynthConfig, SynthOutputs};
use powerinfer_engine::FfnObserver;
use powerinfer_engine::{Engine, EngineOptions};
use powerinfer_gguf::GgmlType;

#[derive(Default)]
struct Record {
    calls: Vec<(usize, usize)>,
    /// Per call: (tokens whose scores predicted the activations exactly, tokens).
    agree: Vec<(usize, usize)>,
    fired: usize,
    values: usize,
    h_len_ok: bool,
}

struct Dims {
    n_embd: usize,
    n_ff: usize,
}

struct Observer<'a> {
    dims: &'a Dims,
    rec: &'a mut Record,
}

impl FfnObserver for Observer<'_> {
    fn observe(&mut self, layer: usize, t: usize, h: &[f32], act: &[f32], scores: Option<&[f32]>) {
        let r = &mut *self.rec;
        r.calls.push((layer, t));
        r.h_len_ok &= h.len() == t * self.dims.n_embd && act.len() == t * self.dims.n_ff;
        r.fired += act.iter().filter(|&&a| a != 0.0).count();
        r.values += act.len();
        let scores = scores.expect("a PowerInfer file has predictors");
        assert_eq!(scores.len(), act.len());
        let exact = act
            .chunks_exact(self.dims.n_ff)
            .zip(scores.chunks_exact(self.dims.n_ff))
            .filter(|(a, s)| a.iter().zip(*s).all(|(&a, &s)| (a != 0.0) == (s >= 0.0)))
            .count();
        r.agree.push((exact, t));
    }
}

#[test]
fn observed_eval_reports_every_layer_and_equals_dense() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.powerinfer.gguf");
    let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
    cfg.ty = GgmlType::F32;
    cfg.arch = Arch::Llama;
    cfg.seed = 5;
    cfg.predictor_noise = 0.0;
    let out = SynthOutputs {
        model: path.clone(),
        dense: None,
        activation_dir: None,
        predictor_dir: None,
    };
    synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
    let load = |dense| {
        Engine::load(&path, {
            let mut o = EngineOptions::default();
            o.threads = 2;
            o.sparse_threshold = Some(0.0);
            o.dense = dense;
            o.ctx_len = 128;
            o.batch = 8;
            o.mmap = false;
            o
        })
        .unwrap()
    };
    let sparse = load(false);
    let dense = load(true);
    let hp = sparse.model().hparams().clone();
    let dims = Dims {
        n_embd: hp.n_embd,
        n_ff: hp.n_ff,
    };
    let tokens: Vec<u32> = (0..12).map(|i| 3 + 17 * i).collect();

    let mut rec = Record {
        h_len_ok: true,
        ..Record::default()
    };
    let mut s = sparse.session();
    let observed = s
        .eval_observed(
            &tokens,
            &mut Observer {
                dims: &dims,
                rec: &mut rec,
            },
        )
        .unwrap();
    let want = dense.session().eval(&tokens).unwrap();
    // The observed pass computes every neuron, as the dense pass does (same kernels, same
    // blocks): identical logits.
    assert_eq!(observed, want);

    // 12 tokens in blocks of at most 8: two equal blocks of 6, every layer in order for each.
    let mut expect = Vec::new();
    for t in [6, 6] {
        expect.extend((0..hp.n_layer).map(|l| (l, t)));
    }
    assert_eq!(rec.calls, expect);
    assert!(rec.h_len_ok);
    // A ReLU model: some but far from all neurons fire.
    let density = rec.fired as f64 / rec.values as f64;
    assert!(density > 0.01 && density < 0.6, "density {density}");
    // A perfect predictor (noise 0): its scores give exactly the neurons that fired, for
    // (nearly) every token; a neuron whose gate is ≈ 0 may flip with rounding.
    let (exact, total) = rec
        .agree
        .iter()
        .fold((0, 0), |(e, t), &(a, b)| (e + a, t + b));
    assert!(exact * 10 >= total * 9, "{exact} of {total} tokens exact");
}
