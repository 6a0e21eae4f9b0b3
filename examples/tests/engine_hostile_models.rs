//! Well-formed GGUF containers with hostile contents: hyper-parameters of 0, 1 or 2³²−1, NaN
//! epsilons, keys of the wrong type or missing, truncated tokenizer arrays, special-token ids
//! past the vocabulary, tensors of the wrong shape or type. Loading, tokenizing and generating
//! must give a typed error or work; never panic, hang or read out of bounds.
//!
//! Seeded and deterministic: `HOSTILE_MODEL_CASES` (default 160) mutations of small synthetic
//! files of the four architectures (sparse and dense). A failing case prints its number and
//! mutations. (The vocabularies' half is the engine's `tests/hostile_vocab.rs`.)

#[path = "support/engine.rs"]
mod engine_support;
#[path = "../../crates/powerinfer-engine/tests/common/hostile.rs"]
mod hostile;

use engine_support::{make_family, opts};
use hostile::{mutate, panic_text, write, Rng, Tensor};
use powerinfer_cli::synth::Family;
use powerinfer_engine::sampling::SamplingParams;
use powerinfer_engine::Engine;
use powerinfer_gguf::{GgmlType, GgufFile};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

/// Loads `path` and, if that works, tokenizes, evaluates and generates a little.
fn exercise(path: &Path, dense: bool, ctx: usize) -> Result<(), String> {
    let mut options = opts(dense);
    options.ctx_len = ctx;
    let engine = Engine::load(path, options).map_err(|e| e.to_string())?;
    let tok = engine.tokenizer();
    let ids = tok.encode("Hello world, <s> once upon a time\u{e9}!", true, true);
    let _ = tok.decode(&ids, true, true);
    let mut s = engine.session();
    let _ = s.eval(&[1, 2, 3, 100_000]);
    s.reset();
    if let Err(e) = s.eval(&ids) {
        return Err(e.to_string());
    }
    let mut g = s.generate(" and", SamplingParams::greedy(4));
    for t in &mut g {
        t.map_err(|e| e.to_string())?;
    }
    Ok(())
}
#[test]
fn hostile_model_contents_never_panic() {
    let cases: usize = std::env::var("HOSTILE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(160);
    let dir = tempfile::tempdir().unwrap();
    let sources = [
        make_family(GgmlType::F16, Family::Llama, 31),
        make_family(GgmlType::Q4_0, Family::Bamboo, 32),
        make_family(GgmlType::Q8_0, Family::Falcon, 33),
        make_family(GgmlType::F16, Family::Opt, 34),
    ];
    let out = dir.path().join("hostile.gguf");
    let (mut loaded, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for case in 0..cases {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (case as u64 + 1).wrapping_mul(0x2545_F491));
        let f = &sources[case % sources.len()];
        let (path, dense) = if rng.below(2) == 0 {
            (&f.sparse, false)
        } else {
            (&f.dense, true)
        };
        let src = GgufFile::open(path).unwrap();
        let mut md = src.metadata().clone();
        let mut tensors: Vec<Tensor> = src
            .tensors()
            .iter()
            .map(|t| Tensor {
                name: t.name().to_string(),
                shape: t.shape().to_vec(),
                ty: t.ggml_type(),
                data: src.data_of(t).to_vec(),
            })
            .collect();
        let n_mut = 1 + rng.below(2);
        let what: Vec<String> = (0..n_mut)
            .map(|_| mutate(&mut rng, &mut md, &mut tensors))
            .collect();
        if !write(&src, &md, &tensors, &out) {
            continue;
        }
        let ctx = *rng.pick(&[0usize, 1, 40, 64, 256]);
        match catch_unwind(AssertUnwindSafe(|| exercise(&out, dense, ctx))) {
            Ok(Ok(())) => loaded += 1,
            Ok(Err(e)) => {
                if std::env::var_os("HOSTILE_VERBOSE").is_some() {
                    eprintln!("case {case} {what:?}: {e}");
                }
                refused += 1
            }
            Err(p) => failures.push(format!(
                "case {case} (ctx {ctx}, {what:?}): panic: {}",
                panic_text(&*p)
            )),
        }
    }
    eprintln!("{cases} cases: {loaded} ran, {refused} refused with an error");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Both outcomes occur: the mutations are neither all harmless nor all fatal.
    assert!(loaded > 0 && refused > 0, "{loaded} ran, {refused} refused");
}
