//! The decode profile ([`Session::set_profiling`]): per-operation calls and bytes agree with the
//! model's tensors, the times add up within the decode time, and profiling changes no result;
//! the prompt's profile is kept apart.

use std::path::Path;

use powerinfer_cli::synth::{Arch, Shape};
use powerinfer_engine::profile::OpKind;
use powerinfer_engine::sampling::SamplingParams;
use powerinfer_engine::Engine;
use powerinfer_gguf::{GgmlType, GgufFile};

#[path = "support/engine.rs"]
mod common;
use common::{make, opts};

/// Sum of the sizes of the tensors named one of `suffixes` or ending with `.` and one of them.
fn bytes(path: &Path, suffixes: &[&str]) -> u64 {
    let f = GgufFile::open(path).unwrap();
    f.tensors()
        .iter()
        .filter(|t| {
            suffixes
                .iter()
                .any(|s| t.name() == *s || t.name().ends_with(&format!(".{s}")))
        })
        .map(|t| t.n_bytes())
        .sum()
}

/// Greedy generation of `n` tokens with or without profiling: the tokens, the session's
/// statistics and its profile.
fn generate(
    engine: &Engine,
    n: usize,
    profile: bool,
) -> (
    Vec<u32>,
    powerinfer_engine::Stats,
    Option<powerinfer_engine::profile::OpProfile>,
) {
    let mut s = engine.session();
    s.set_profiling(profile);
    let params = SamplingParams::default().with(|p| {
        p.temperature = 0.0;
        p.max_tokens = n;
    });
    let toks: Vec<u32> = s
        .generate("once upon a time", params)
        .map(|t| t.unwrap().id)
        .collect();
    if profile {
        // The prompt's blocks, apart: every token of the prompt, the attention's operations
        // once per layer and block, the FFN's at least (a sparse block times them per token).
        let pp = s.prompt_profile().unwrap();
        let n_layer = engine.model().hparams().n_layer as u64;
        assert_eq!(pp.tokens as usize, s.stats().prompt_tokens);
        assert!(pp.evals >= 1 && pp.total_time() <= s.stats().prompt_time);
        for op in [OpKind::Qkv, OpKind::Attention, OpKind::AttnOutput] {
            assert_eq!(pp.get(op).calls, n_layer * pp.evals, "{op:?}");
        }
        for op in [OpKind::FfnUpGate, OpKind::FfnDown] {
            assert!(pp.get(op).calls >= n_layer * pp.evals, "{op:?}");
        }
    } else {
        assert!(s.prompt_profile().is_none());
    }
    (toks, s.stats().clone(), s.profile().cloned())
}

#[test]
fn profile_counts_match_the_model() {
    let f = make(GgmlType::Q4_0, Arch::Llama, 11);
    let (sparse, dense) = (f.sparse.clone(), f.dense.clone());
    let n_layer = Shape::preset("tiny").unwrap().n_layer as u64;
    let n = 6;

    for (path, dense_mode) in [(&dense, false), (&sparse, false), (&sparse, true)] {
        let engine = Engine::load(path, opts(dense_mode)).unwrap();
        let (plain, _, none) = generate(&engine, n, false);
        assert!(none.is_none());
        let (toks, stats, p) = generate(&engine, n, true);
        let p = p.unwrap();
        let what = format!("{} dense={dense_mode}", path.display());
        assert_eq!(toks, plain, "profiling changed the tokens: {what}");

        // Decode steps only (the prompt is not recorded).
        let steps = stats.decode_tokens as u64;
        assert!(steps >= 1, "{what}");
        assert_eq!((p.evals, p.tokens), (steps, steps), "{what}");
        assert!(p.total_time() <= stats.decode_time, "{what}");
        for op in [
            OpKind::Qkv,
            OpKind::Attention,
            OpKind::AttnOutput,
            OpKind::FfnUpGate,
            OpKind::FfnDown,
        ] {
            assert_eq!(p.get(op).calls, n_layer * steps, "{op:?} {what}");
        }
        assert_eq!(p.get(OpKind::OutputHead).calls, steps, "{what}");

        // Dense products read whole tensors once per step.
        let per_step = |suffixes: &[&str]| bytes(path, suffixes) * steps;
        assert_eq!(
            p.get(OpKind::Qkv).bytes,
            per_step(&["attn_q.weight", "attn_k.weight", "attn_v.weight"]),
            "{what}"
        );
        assert_eq!(
            p.get(OpKind::AttnOutput).bytes,
            per_step(&["attn_output.weight"]),
            "{what}"
        );
        assert_eq!(
            p.get(OpKind::OutputHead).bytes,
            per_step(&["output.weight"]),
            "{what}"
        );
        let gate_up = per_step(&["ffn_gate.weight", "ffn_up.weight"]);
        let down = per_step(&["ffn_down.weight", "ffn_down_t.weight"]);
        let sparse_run = path == &sparse && !dense_mode;
        if sparse_run {
            // fc1 alone; fc2 with the active gate/up rows; only active rows of down.
            let fc2 = per_step(&["fc2.weight"]);
            assert_eq!(p.get(OpKind::Predictor).bytes, per_step(&["fc1.weight"]));
            let ug = p.get(OpKind::FfnUpGate).bytes;
            assert!(ug > fc2 && ug < fc2 + gate_up, "{ug} vs {fc2} + {gate_up}");
            let d = p.get(OpKind::FfnDown).bytes;
            assert!(d > 0 && d < down, "{d} vs {down}");
            // Whole rows: a gate row per active neuron, an up row per active neuron whose
            // gate fired (ReGLU: the others' up rows are not read), a down row per neuron
            // with a non-zero activation (its gate fired).
            let n_ff = Shape::preset("tiny").unwrap().n_ff as u64;
            let neurons = n_layer * n_ff * steps;
            let (row, down_row) = (gate_up / 2 / neurons, down / neurons);
            assert_eq!((ug - fc2) % row, 0, "{what}");
            assert_eq!(d % down_row, 0, "{what}");
            let (rows, nonzero) = ((ug - fc2) / row, d / down_row);
            // active + fired = rows, nonzero ≤ fired ≤ active.
            let (least, most) = (rows.div_ceil(2), rows - nonzero);
            assert!(
                nonzero > 0 && least <= most,
                "{what}: {rows} rows, {nonzero} non-zero"
            );
            // The active share is about the FFN density (which also counts the prompt).
            let density = stats.ffn_density();
            let share = |n: u64| n as f64 / neurons as f64;
            assert!(
                share(least) - 0.05 < density && density < share(most) + 0.05,
                "{} to {} vs {density}",
                share(least),
                share(most)
            );
        } else {
            assert_eq!(p.get(OpKind::Predictor), &Default::default(), "{what}");
            assert_eq!(p.get(OpKind::FfnUpGate).bytes, gate_up, "{what}");
            assert_eq!(p.get(OpKind::FfnDown).bytes, down, "{what}");
        }
        // Attention reads the cache: K and V, f16, of every position so far, per layer.
        let att = p.get(OpKind::Attention).bytes;
        assert!(att > 0 && att % (n_layer * 2 * 2) == 0, "{att}");
    }
}

/// Blocks of several sequences record, per layer, each token's active neurons and the union of
/// the block's: the union is at least the largest token's list and at most all of them
/// together, the token density matches the profile's one-token figures' order of size, and a
/// block of one token (or a dense run) records none.
#[test]
fn batch_density_counts_the_union_of_a_block() {
    use powerinfer_engine::{Batch, EvalOptions, OpProfile};
    let f = make(GgmlType::Q4_0, Arch::Llama, 12);
    let shape = Shape::preset("tiny").unwrap();
    for (path, dense_mode) in [(&f.sparse, false), (&f.sparse, true), (&f.dense, false)] {
        let engine = Engine::load(path, opts(dense_mode)).unwrap();
        let mut cache = engine.new_cache();
        let tok = engine.tokenizer();
        let prompts = ["once upon a time", "the cat sat", "a b c d e", "hello"];
        let seqs: Vec<_> = prompts.iter().map(|_| cache.add_sequence()).collect();
        for (s, p) in seqs.iter().zip(prompts) {
            let ids = tok.encode(p, true, false);
            engine
                .eval(&mut cache, &Batch::one(*s, &ids), EvalOptions::new())
                .unwrap();
        }
        let mut prof = OpProfile::new();
        let steps = 3;
        for k in 0..steps {
            let step: Vec<_> = seqs.iter().map(|&s| (s, 5 + k as u32)).collect();
            engine
                .eval(
                    &mut cache,
                    &Batch::decode(&step),
                    EvalOptions::new().profile(&mut prof),
                )
                .unwrap();
        }
        // One token: nothing recorded.
        let mut one = OpProfile::new();
        engine
            .eval(
                &mut cache,
                &Batch::one(seqs[0], &[9]),
                EvalOptions::new().profile(&mut one),
            )
            .unwrap();
        assert!(one.batch_density().is_empty());
        let layers = prof.batch_density();
        if path != &f.sparse || dense_mode {
            assert!(layers.is_empty(), "{} dense={dense_mode}", path.display());
            continue;
        }
        assert_eq!(layers.len(), shape.n_layer);
        for (l, b) in layers.iter().enumerate() {
            assert_eq!((b.blocks, b.tokens), (steps, steps * 4), "layer {l}");
            assert_eq!(b.neurons, shape.n_ff as u64, "layer {l}");
            // Per block: max_t |A_t| ≤ |∪ A_t| ≤ Σ_t |A_t|; summed over blocks, the
            // lower bound is at least the mean list.
            assert!(b.union <= b.active, "layer {l}: {b:?}");
            assert!(b.union * 4 >= b.active, "layer {l}: {b:?}");
            let (t, u) = (b.token_density(), b.union_density());
            assert!(
                t > 0.0 && t < 0.5 && u >= t && u <= 4.0 * t,
                "layer {l}: {t} {u}"
            );
            assert_eq!(b.tokens_per_block(), 4.0);
        }
    }
}
