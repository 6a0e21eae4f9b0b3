//! Well-formed GGUF containers with hostile contents: hyper-parameters of 0, 1 or 2³²−1, NaN
//! epsilons, keys of the wrong type or missing, truncated tokenizer arrays, special-token ids
//! past the vocabulary, tensors of the wrong shape or type. Loading, tokenizing and generating
//! must give a typed error or work; never panic, hang or read out of bounds.
//!
//! Seeded and deterministic: `HOSTILE_MODEL_CASES` (default 160) mutations of small synthetic
//! files of the four architectures (sparse and dense), and `HOSTILE_VOCAB_CASES` (default 300)
//! of llama.cpp's vocabulary files (SentencePiece, GPT-2 and Falcon BPE) through the tokenizer
//! alone. A failing case prints its number and mutations.

mod common;

use common::{make_family, opts};
use powerinfer_cli::synth::Family;
use powerinfer_engine::sampling::SamplingParams;
use powerinfer_engine::tokenizer::Tokenizer;
use powerinfer_engine::Engine;
use powerinfer_gguf::{Array, GgmlType, GgufFile, GgufWriter, Metadata, Value};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

/// A small xorshift generator (the cases must not depend on another crate's stream).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// One tensor of the copy: name, shape, type and bytes.
struct Tensor {
    name: String,
    shape: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Bytes a tensor of `shape` and `ty` takes, if its first dimension is whole blocks.
fn bytes_of(shape: &[u64], ty: GgmlType) -> Option<usize> {
    let ne0 = *shape.first()? as usize;
    if ne0 % ty.block_size() != 0 {
        return None;
    }
    let rest: u64 = shape[1..].iter().product();
    Some(ne0 / ty.block_size() * ty.type_size() * rest as usize)
}

const HOSTILE_U32: [u32; 9] = [0, 1, 2, 3, 7, 63, 4096, 1 << 20, u32::MAX];
const HOSTILE_F32: [f32; 7] = [0.0, -1.0, 1e-30, 1e30, f32::NAN, f32::INFINITY, -0.0];

/// Applies one random mutation to `md` / `tensors`; returns its description.
fn mutate(rng: &mut Rng, md: &mut Metadata, tensors: &mut Vec<Tensor>) -> String {
    let keys: Vec<String> = md.iter().map(|(k, _)| k.to_string()).collect();
    // Kinds 7 and 8 change tensors: only where there are some.
    match rng.below(if tensors.is_empty() { 7 } else { 9 }) {
        // A numeric key gets a hostile value of its own type.
        0 | 1 => {
            let numeric: Vec<&String> = keys
                .iter()
                .filter(|k| {
                    matches!(
                        md.get(k),
                        Some(Value::U32(_) | Value::F32(_) | Value::U64(_))
                    )
                })
                .collect();
            let k = (*rng.pick(&numeric)).clone();
            let v = match md.get(&k) {
                Some(Value::F32(_)) => Value::F32(*rng.pick(&HOSTILE_F32)),
                Some(Value::U64(_)) => Value::U64(*rng.pick(&HOSTILE_U32) as u64),
                _ => Value::U32(*rng.pick(&HOSTILE_U32)),
            };
            let d = format!("{k} = {v:?}");
            md.insert(k, v);
            d
        }
        // A key of another type.
        2 => {
            let k = rng.pick(&keys).clone();
            let v = match rng.below(4) {
                0 => Value::String("x".into()),
                1 => Value::F32(2.5),
                2 => Value::I64(-5),
                _ => Value::Array(Array::U8(vec![1, 2, 3])),
            };
            let d = format!("{k} retyped as {v:?}");
            md.insert(k, v);
            d
        }
        // A key dropped.
        3 => {
            let k = rng.pick(&keys).clone();
            let mut kept = Metadata::new();
            for (key, v) in md.iter() {
                if *key != k {
                    kept.insert(key, v.clone());
                }
            }
            *md = kept;
            format!("{k} removed")
        }
        // Tokenizer arrays truncated or with hostile entries.
        4 => {
            let arrays = [
                "tokenizer.ggml.tokens",
                "tokenizer.ggml.scores",
                "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges",
            ];
            let k = *rng.pick(&arrays);
            let Some(Value::Array(a)) = md.get(k).cloned() else {
                return format!("{k} absent");
            };
            let cut = rng.below(a.len() + 1);
            let v = match (a, rng.below(3)) {
                (Array::String(mut s), 0) => {
                    s.truncate(cut);
                    Array::String(s)
                }
                (Array::String(mut s), 1) if !s.is_empty() => {
                    let i = rng.below(s.len());
                    s[i] = ["", " ", "\u{0}", "<0xZZ>", "a b c", "<0x"][rng.below(6)].into();
                    Array::String(s)
                }
                (Array::String(mut s), _) if !s.is_empty() => {
                    let (i, j) = (rng.below(s.len()), rng.below(s.len()));
                    s[i] = s[j].clone();
                    Array::String(s)
                }
                (Array::F32(mut f), 0) => {
                    f.truncate(cut);
                    Array::F32(f)
                }
                (Array::F32(mut f), _) if !f.is_empty() => {
                    let i = rng.below(f.len());
                    f[i] = *rng.pick(&HOSTILE_F32);
                    Array::F32(f)
                }
                (Array::I32(mut t), 0) => {
                    t.truncate(cut);
                    Array::I32(t)
                }
                (Array::I32(mut t), _) if !t.is_empty() => {
                    let i = rng.below(t.len());
                    t[i] = [-1, 0, 7, 99, i32::MIN][rng.below(5)];
                    Array::I32(t)
                }
                (a, _) => a,
            };
            md.insert(k, Value::Array(v));
            format!("{k} mutated (cut {cut})")
        }
        // Special-token ids past the vocabulary.
        5 => {
            let k = *rng.pick(&[
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.eot_token_id",
            ]);
            let v = *rng.pick(&[512u32, 513, 100_000, u32::MAX]);
            md.insert(k, Value::U32(v));
            format!("{k} = {v}")
        }
        // An optional key set (or overwritten) with a hostile value.
        6 => {
            let arch = match md.get("general.architecture") {
                Some(Value::String(a)) => a.clone(),
                _ => "llama".into(),
            };
            let f = *rng.pick(&HOSTILE_F32);
            let (k, v) = match rng.below(9) {
                0 => (
                    format!("{arch}.rope.scaling.type"),
                    Value::String(["linear", "yarn", "none", "x"][rng.below(4)].into()),
                ),
                1 => (format!("{arch}.rope.scaling.factor"), Value::F32(f)),
                2 => (format!("{arch}.rope.freq_base"), Value::F32(f)),
                3 => ("powerinfer.sparse_threshold".into(), Value::F32(f)),
                4 => (
                    format!("{arch}.attention.layer_norm_epsilon"),
                    Value::F32(f),
                ),
                5 => (
                    "tokenizer.ggml.model".into(),
                    Value::String(["llama", "gpt2", "bert", "x"][rng.below(4)].into()),
                ),
                6 => (
                    "tokenizer.ggml.pre".into(),
                    Value::String(
                        ["default", "gpt-2", "falcon", "llama-bpe", "x"][rng.below(5)].into(),
                    ),
                ),
                7 => (
                    "tokenizer.ggml.merges".into(),
                    Value::Array(Array::String(
                        ["a b", "ab", "", " ", "a  b", "\u{0120} \u{0120}"]
                            .iter()
                            .take(1 + rng.below(6))
                            .map(|s| s.to_string())
                            .collect(),
                    )),
                ),
                _ => (
                    format!("{arch}.context_length"),
                    Value::U32(*rng.pick(&HOSTILE_U32)),
                ),
            };
            let d = format!("{k} set to {v:?}");
            md.insert(k, v);
            d
        }
        // A tensor of another shape (its data resized to match).
        7 => {
            let i = rng.below(tensors.len());
            let t = &mut tensors[i];
            let old = t.shape.clone();
            let mut shape = old.clone();
            match rng.below(4) {
                0 => shape.reverse(),
                1 => {
                    let d = rng.below(shape.len());
                    shape[d] = [0, 1, 32, shape[d] * 2, shape[d].saturating_sub(32)][rng.below(5)];
                }
                2 => shape.push(2),
                _ => {
                    shape.pop();
                }
            }
            match bytes_of(&shape, t.ty) {
                Some(n) if !shape.is_empty() => {
                    t.data.resize(n, 0x3c);
                    t.shape = shape;
                    format!("{} shape {old:?} -> {:?}", t.name, t.shape)
                }
                _ => "no-op (shape not whole blocks)".into(),
            }
        }
        // A tensor of another type (its data resized to match), or dropped.
        _ => {
            let i = rng.below(tensors.len());
            if rng.below(4) == 0 {
                let t = tensors.remove(i);
                return format!("{} removed", t.name);
            }
            let t = &mut tensors[i];
            let ty = *rng.pick(&[
                GgmlType::F32,
                GgmlType::F16,
                GgmlType::BF16,
                GgmlType::Q8_0,
                GgmlType::Q4_0,
                GgmlType::Q4_K,
                GgmlType::Q6_K,
            ]);
            match bytes_of(&t.shape, ty) {
                Some(n) => {
                    t.data.resize(n, 0x3c);
                    let d = format!("{} type {:?} -> {ty:?}", t.name, t.ty);
                    t.ty = ty;
                    d
                }
                None => "no-op (type does not fit)".into(),
            }
        }
    }
}

/// Writes `md` and `tensors` as a file of `kind` at `out`.
fn write<B: AsRef<[u8]>>(src: &GgufFile<B>, md: &Metadata, tensors: &[Tensor], out: &Path) -> bool {
    let mut w = GgufWriter::new(Vec::new(), src.kind());
    if w.add_metadata(md).is_err() {
        return false;
    }
    for t in tensors {
        if w.add_tensor(&t.name, &t.shape, t.ty).is_err() {
            return false;
        }
    }
    if w.write_header().is_err() {
        return false;
    }
    for t in tensors {
        if w.write_tensor_data(&t.name, &t.data).is_err() {
            return false;
        }
    }
    match w.finish() {
        Ok(bytes) => {
            std::fs::write(out, bytes).unwrap();
            true
        }
        Err(_) => false,
    }
}

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

/// The message of a caught panic.
fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn hostile_vocabularies_never_panic() {
    let cases: usize = std::env::var("HOSTILE_VOCAB_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let Some(vocab_dir) = common::vocab_dir() else {
        return;
    };
    let names = [
        "ggml-vocab-llama-spm",
        "ggml-vocab-gpt-2",
        "ggml-vocab-falcon",
    ];
    let mut sources = Vec::new();
    for n in names {
        let path = vocab_dir.join(format!("{n}.gguf"));
        let file = GgufFile::open(&path).unwrap();
        let text =
            std::fs::read_to_string(vocab_dir.join(format!("{n}.gguf.inp"))).unwrap_or_default();
        // The .inp file's test texts, separated by lines of `__ggml_vocab_test__`.
        let texts: Vec<String> = text
            .split("__ggml_vocab_test__")
            .map(|t| {
                t.trim_start_matches('\n')
                    .trim_end_matches('\n')
                    .to_string()
            })
            .take(40)
            .collect();
        sources.push((file.metadata().clone(), texts));
    }
    let (mut built, mut refused) = (0, 0);
    let mut failures = Vec::new();
    for case in 0..cases {
        let mut rng = Rng(0xD1B5_4A32_D192_ED03 ^ (case as u64 + 1).wrapping_mul(0x9E37_79B9));
        let (md0, texts) = &sources[case % sources.len()];
        let mut md = md0.clone();
        let mut no_tensors = Vec::new();
        let what: Vec<String> = (0..1 + rng.below(2))
            .map(|_| mutate(&mut rng, &mut md, &mut no_tensors))
            .collect();
        // Through a real container: written and parsed back, as a file would be.
        let mut w = GgufWriter::new(Vec::new(), powerinfer_gguf::FileKind::Gguf);
        if w.add_metadata(&md).is_err() || w.write_header().is_err() {
            continue;
        }
        let Ok(bytes) = w.finish() else { continue };
        let file = GgufFile::from_bytes(bytes).unwrap();
        let run = || -> Result<(), String> {
            let tok = Tokenizer::from_gguf(&file).map_err(|e| e.to_string())?;
            for t in texts {
                let ids = tok.encode(t, true, rng.0 % 2 == 0);
                let _ = tok.decode(&ids, true, true);
                let _ = tok.decode_lossy(&ids, false, false);
                let mut dec = tok.stream_decoder(true);
                for &id in ids.iter().chain([u32::MAX, 7].iter()) {
                    let _ = dec.push(id);
                }
                let _ = dec.finish();
            }
            Ok(())
        };
        match catch_unwind(AssertUnwindSafe(run)) {
            Ok(Ok(())) => built += 1,
            Ok(Err(_)) => refused += 1,
            Err(p) => failures.push(format!(
                "case {case} ({what:?}): panic: {}",
                panic_text(&*p)
            )),
        }
    }
    eprintln!("{cases} cases: {built} tokenizers built, {refused} refused with an error");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(built > 0 && refused > 0, "{built} built, {refused} refused");
}
