//! Mutations of a GGUF file's contents for the hostile-input tests: a seeded generator and
//! one random change of the metadata or the tensor directory at a time. Shared by
//! `hostile_vocab.rs` here and the command's `engine_hostile_models.rs` (which includes this
//! file with `#[path]`).
#![allow(dead_code)]

use powerinfer_gguf::{Array, GgmlType, GgufFile, GgufWriter, Metadata, Value};
use std::path::Path;

/// A small xorshift generator (the cases must not depend on another crate's stream).
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn pick<'a, T>(&mut self, v: &'a [T]) -> &'a T {
        &v[self.below(v.len())]
    }
}

/// One tensor of the copy: name, shape, type and bytes.
pub struct Tensor {
    pub name: String,
    pub shape: Vec<u64>,
    pub ty: GgmlType,
    pub data: Vec<u8>,
}

/// Bytes a tensor of `shape` and `ty` takes, if its first dimension is whole blocks.
pub fn bytes_of(shape: &[u64], ty: GgmlType) -> Option<usize> {
    let ne0 = *shape.first()? as usize;
    if ne0 % ty.block_size() != 0 {
        return None;
    }
    let rest: u64 = shape[1..].iter().product();
    Some(ne0 / ty.block_size() * ty.type_size() * rest as usize)
}

pub const HOSTILE_U32: [u32; 9] = [0, 1, 2, 3, 7, 63, 4096, 1 << 20, u32::MAX];
pub const HOSTILE_F32: [f32; 7] = [0.0, -1.0, 1e-30, 1e30, f32::NAN, f32::INFINITY, -0.0];

/// Applies one random mutation to `md` / `tensors`; returns its description.
pub fn mutate(rng: &mut Rng, md: &mut Metadata, tensors: &mut Vec<Tensor>) -> String {
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
pub fn write<B: AsRef<[u8]>>(
    src: &GgufFile<B>,
    md: &Metadata,
    tensors: &[Tensor],
    out: &Path,
) -> bool {
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

/// The message of a caught panic.
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}
