//! `convert` of Falcon and OPT checkpoints: tiny Hugging Face checkpoints written here (a
//! Falcon-40B-style one with grouped K/V heads and `ln_attn`/`ln_mlp` in two shards, a
//! Falcon-7B-style one with one K/V head, `input_layernorm`, an old `RWForCausalLM` config and
//! a tied head, and an OPT one with biases and learned positions), each with a byte-level BPE
//! `tokenizer.json`, converted to PWRI / GGUF files. Every output tensor is checked against the
//! source values with the transforms re-derived from the spec (the `jploski` QKV regrouping as
//! a view of `n_kv` groups of `g` query heads, a key and a value head; `ffn_down`
//! transposed), the metadata keys in order, the vocabulary, merges and token types. The
//! converted files load in the engine, which runs their FFN with ReLU, agree with an f64
//! forward pass written in Hugging Face's terms on the source tensors, and generate. Bad
//! input is a clear error that leaves no file.

use std::path::{Path, PathBuf};

use powerinfer_cli::convert::{convert, ConvertOptions, OutType};
use powerinfer_engine::model::FfnAct;
use powerinfer_engine::sampling::SamplingParams;
use powerinfer_engine::{Arch, Engine};
use powerinfer_gguf::{FileKind, GgmlType, GgufFile};
use powerinfer_predictor::pt::{self, PtTensor};
use safetensors::Dtype;

#[path = "support/safetensors_src.rs"]
mod safetensors_src;
use safetensors_src::{exact, no_output_left, np_transpose, write_safetensors, SrcTensor};

// The engine tests' helpers: these tests run the models they write as the engine's do.
#[path = "support/engine.rs"]
mod common;
use common::{opts as engine_opts, rel_diff};

const RANK: usize = 32;
/// config.json's `vocab_size`: ids 261 and 264 are in neither `model.vocab` nor
/// `added_tokens`.
const N_VOCAB: usize = 265;
/// The merges of the test vocabulary, in rank order; their results are ids 256..261.
const MERGES: [(&str, &str); 5] = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "w")];
const EOT: u32 = 262;

// ---------------------------------------------------------------------------------------------
// The vocabulary

/// GPT-2's byte-to-unicode alphabet, by byte: printable bytes stand for themselves, the others
/// for U+0100 upwards in byte order.
fn byte_chars() -> Vec<char> {
    let mut n = 0;
    (0..=255u32)
        .map(|b| {
            if (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b) {
                char::from_u32(b).unwrap()
            } else {
                n += 1;
                char::from_u32(255 + n).unwrap()
            }
        })
        .collect()
}

/// `tokenizer.json` of the test vocabulary: the 256 byte characters (ids 0..256), the merge
/// results (256..261), `<|endoftext|>` (262, in `model.vocab` and a special added token) and
/// `<user>` (263, a non-special added token). Merges as strings or as pairs, or none.
fn tokenizer_json(merges: Option<bool>) -> String {
    let mut vocab = serde_json::Map::new();
    for (i, c) in byte_chars().into_iter().enumerate() {
        vocab.insert(c.to_string(), i.into());
    }
    for (i, (a, b)) in MERGES.iter().enumerate() {
        vocab.insert(format!("{a}{b}"), (256 + i).into());
    }
    vocab.insert("<|endoftext|>".into(), EOT.into());
    let mut model = serde_json::json!({"type": "BPE", "vocab": vocab});
    match merges {
        Some(false) => {
            model["merges"] = MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect();
        }
        Some(true) => {
            model["merges"] = MERGES
                .iter()
                .map(|(a, b)| serde_json::json!([a, b]))
                .collect();
        }
        None => {}
    }
    serde_json::json!({
        "version": "1.0",
        "added_tokens": [
            {"id": EOT, "content": "<|endoftext|>", "special": true},
            {"id": 263, "content": "<user>", "special": false},
        ],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Punctuation"},
            {"type": "ByteLevel", "add_prefix_space": false},
        ]},
        "decoder": {"type": "ByteLevel"},
        "model": model,
    })
    .to_string()
}

/// The tokens and GGUF token types PowerInfer's `_set_vocab_gpt2` writes for it.
fn expected_vocab() -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = byte_chars().iter().map(|c| c.to_string()).collect();
    tokens.extend(MERGES.iter().map(|(a, b)| format!("{a}{b}")));
    tokens.extend(["[PAD261]", "<|endoftext|>", "<user>", "[PAD264]"].map(String::from));
    let mut types = vec![1; 261];
    types.extend([4, 3, 4, 4]);
    (tokens, types)
}

fn expected_merges() -> Vec<String> {
    MERGES.iter().map(|(a, b)| format!("{a} {b}")).collect()
}

// ---------------------------------------------------------------------------------------------
// The checkpoints

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `FalconForCausalLM`, `new_decoder_architecture`, 2 K/V heads, `ln_attn` + `ln_mlp`,
    /// `lm_head`, two shards with an index.
    Falcon40,
    /// `RWForCausalLM` (old key names), one K/V head, `input_layernorm`, no `lm_head`, one file.
    Falcon7,
    /// `OPTForCausalLM`, `model.decoder.*` names, `lm_head.weight` (tied), one file.
    Opt,
}

const N_EMBD: usize = 64;
const N_HEAD: usize = 4;
const N_LAYER: usize = 2;
/// OPT's `max_position_embeddings` (its position table has 2 more rows).
const OPT_POS: usize = 30;

impl Kind {
    fn n_kv(self) -> usize {
        match self {
            Kind::Falcon40 => 2,
            Kind::Falcon7 => 1,
            Kind::Opt => N_HEAD,
        }
    }

    fn n_ff(self) -> usize {
        match self {
            Kind::Falcon40 | Kind::Falcon7 => 4 * N_EMBD,
            Kind::Opt => 128,
        }
    }

    fn arch(self) -> &'static str {
        match self {
            Kind::Opt => "opt",
            _ => "falcon",
        }
    }

    fn config(self) -> serde_json::Value {
        match self {
            Kind::Falcon40 => serde_json::json!({
                "architectures": ["FalconForCausalLM"], "model_type": "falcon",
                "new_decoder_architecture": true, "num_kv_heads": 2, "num_attention_heads": N_HEAD,
                "num_hidden_layers": N_LAYER, "hidden_size": N_EMBD, "layer_norm_epsilon": 1e-5,
                "vocab_size": N_VOCAB, "alibi": false, "bias": false, "parallel_attn": true,
                "bos_token_id": EOT, "eos_token_id": EOT, "torch_dtype": "bfloat16"
            }),
            Kind::Falcon7 => serde_json::json!({
                "architectures": ["RWForCausalLM"], "model_type": "RefinedWebModel",
                "n_layer": N_LAYER, "n_head": N_HEAD, "hidden_size": N_EMBD,
                "layer_norm_epsilon": 1e-5, "multi_query": true, "parallel_attn": true,
                "bias": false, "alibi": false, "vocab_size": N_VOCAB,
                "bos_token_id": EOT, "eos_token_id": EOT
            }),
            Kind::Opt => serde_json::json!({
                "architectures": ["OPTForCausalLM"], "model_type": "opt",
                "hidden_size": N_EMBD, "ffn_dim": 128, "num_hidden_layers": N_LAYER,
                "num_attention_heads": N_HEAD, "vocab_size": N_VOCAB,
                "max_position_embeddings": OPT_POS, "do_layer_norm_before": true,
                "word_embed_proj_dim": N_EMBD, "activation_function": "relu",
                "enable_bias": true, "layer_norm_elementwise_affine": true,
                "bos_token_id": EOT, "eos_token_id": EOT, "pad_token_id": 261
            }),
        }
    }

    /// HF tensor names and torch shapes, in the order written.
    fn specs(self) -> Vec<(String, Vec<usize>)> {
        let (e, ff, v) = (N_EMBD, self.n_ff(), N_VOCAB);
        let hd = e / N_HEAD;
        let mut s: Vec<(String, Vec<usize>)> = Vec::new();
        let mut push = |n: String, shape: Vec<usize>| s.push((n, shape));
        match self {
            Kind::Falcon40 | Kind::Falcon7 => {
                push("transformer.word_embeddings.weight".into(), vec![v, e]);
                for l in 0..N_LAYER {
                    let p = |t: &str| format!("transformer.h.{l}.{t}");
                    let norms: &[&str] = if self == Kind::Falcon40 {
                        &["ln_attn", "ln_mlp"]
                    } else {
                        &["input_layernorm"]
                    };
                    for n in norms {
                        push(p(&format!("{n}.weight")), vec![e]);
                        push(p(&format!("{n}.bias")), vec![e]);
                    }
                    let qkv = (N_HEAD + 2 * self.n_kv()) * hd;
                    push(p("self_attention.query_key_value.weight"), vec![qkv, e]);
                    push(p("self_attention.dense.weight"), vec![e, e]);
                    push(p("mlp.dense_h_to_4h.weight"), vec![ff, e]);
                    push(p("mlp.dense_4h_to_h.weight"), vec![e, ff]);
                }
                push("transformer.ln_f.weight".into(), vec![e]);
                push("transformer.ln_f.bias".into(), vec![e]);
                if self == Kind::Falcon40 {
                    push("lm_head.weight".into(), vec![v, e]);
                }
            }
            Kind::Opt => {
                let p = |t: &str| format!("model.decoder.{t}");
                push(p("embed_tokens.weight"), vec![v, e]);
                push(p("embed_positions.weight"), vec![OPT_POS + 2, e]);
                for l in 0..N_LAYER {
                    let p = |t: &str| format!("model.decoder.layers.{l}.{t}");
                    for n in ["self_attn_layer_norm", "final_layer_norm"] {
                        push(p(&format!("{n}.weight")), vec![e]);
                        push(p(&format!("{n}.bias")), vec![e]);
                    }
                    for n in ["q_proj", "k_proj", "v_proj", "out_proj"] {
                        push(p(&format!("self_attn.{n}.weight")), vec![e, e]);
                        push(p(&format!("self_attn.{n}.bias")), vec![e]);
                    }
                    push(p("fc1.weight"), vec![ff, e]);
                    push(p("fc1.bias"), vec![ff]);
                    push(p("fc2.weight"), vec![e, ff]);
                    push(p("fc2.bias"), vec![e]);
                }
                push(p("final_layer_norm.weight"), vec![e]);
                push(p("final_layer_norm.bias"), vec![e]);
                push("lm_head.weight".into(), vec![v, e]);
            }
        }
        s
    }
}

/// Deterministic uniform values in [-1, 1).
fn uniform(seed: usize, n: usize) -> Vec<f32> {
    let mut x = (seed as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Values for a tensor: norm weights near 1, biases small, embeddings O(1), matrices scaled
/// to keep activations O(1).
fn values_for(seed: usize, name: &str, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let u = uniform(seed, n);
    let norm = name.contains("norm") || name.contains(".ln_");
    if shape.len() == 1 && norm && name.ends_with(".weight") {
        u.iter().map(|x| 1.0 + 0.2 * x).collect()
    } else if shape.len() == 1 {
        u.iter().map(|x| 0.2 * x).collect()
    } else if name.contains("embed") || name.contains("word_embeddings") {
        u
    } else {
        let s = 1.7 / (shape[1] as f32).sqrt();
        u.iter().map(|x| s * x).collect()
    }
}

/// Predictor entries of one layer: (key, torch shape, values), fc1 first.
type PredEntries = Vec<(String, Vec<usize>, Vec<f32>)>;

struct Checkpoint {
    _dir: tempfile::TempDir,
    kind: Kind,
    model: PathBuf,
    pred: PathBuf,
    src: Vec<SrcTensor>,
    pred_src: Vec<PredEntries>,
}

impl Checkpoint {
    fn new(kind: Kind) -> Checkpoint {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join(format!("tiny-{kind:?}"));
        let pred = dir.path().join("predictor");
        std::fs::create_dir_all(&model).unwrap();
        std::fs::create_dir_all(&pred).unwrap();
        std::fs::write(model.join("config.json"), kind.config().to_string()).unwrap();
        std::fs::write(
            model.join("tokenizer.json"),
            tokenizer_json(Some(kind == Kind::Opt)),
        )
        .unwrap();
        if kind == Kind::Falcon40 {
            std::fs::write(
                model.join("tokenizer_config.json"),
                r#"{"add_bos_token":false,"eos_token":"<|endoftext|>","model_max_length":2048}"#,
            )
            .unwrap();
        }
        let mut src = kind
            .specs()
            .into_iter()
            .enumerate()
            .map(|(i, (name, shape))| {
                let dtype = [Dtype::F32, Dtype::F16, Dtype::BF16][i % 3];
                SrcTensor {
                    values: exact(dtype, values_for(i, &name, &shape)),
                    name,
                    shape,
                    dtype,
                }
            })
            .collect::<Vec<SrcTensor>>();
        if kind == Kind::Opt {
            // OPT's head is tied: lm_head.weight holds the token embedding.
            let embd = src[0].clone();
            let head = src.iter_mut().find(|t| t.name == "lm_head.weight").unwrap();
            head.dtype = embd.dtype;
            head.values = embd.values;
        }
        std::fs::write(pred.join("config.json"), r#"{"sparse_threshold": 0.25}"#).unwrap();
        let mut pred_src = Vec::new();
        for l in 0..N_LAYER {
            let fc1 = uniform(100 + l, RANK * N_EMBD);
            let fc2 = uniform(200 + l, kind.n_ff() * RANK);
            let t1 = (
                "fc1.weight".to_string(),
                PtTensor::from_f32(vec![RANK, N_EMBD], &fc1).unwrap(),
            );
            let t2 = (
                "fc2.weight".to_string(),
                PtTensor::from_f32(vec![kind.n_ff(), RANK], &fc2).unwrap(),
            );
            // Layer 1's state dict lists fc2 first: the HF script writes fc1 first anyway.
            let entries = if l == 1 { [t2, t1] } else { [t1, t2] };
            pt::write_state_dict(pred.join(format!("model_{l}.pt")), &entries).unwrap();
            pred_src.push(vec![
                ("fc1.weight".into(), vec![RANK, N_EMBD], fc1),
                ("fc2.weight".into(), vec![kind.n_ff(), RANK], fc2),
            ]);
        }
        let c = Checkpoint {
            _dir: dir,
            kind,
            model,
            pred,
            src,
            pred_src,
        };
        c.write_model();
        c
    }

    /// The shard files, in order.
    fn shards(&self) -> Vec<&'static str> {
        if self.kind == Kind::Falcon40 {
            vec![
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
            ]
        } else {
            vec!["model.safetensors"]
        }
    }

    /// Writes `src` as the checkpoint's safetensors files (and, for two shards, the index:
    /// layer 1 in the second shard).
    fn write_model(&self) {
        for e in std::fs::read_dir(&self.model).unwrap() {
            let p = e.unwrap().path();
            if p.to_string_lossy().contains("safetensors") {
                std::fs::remove_file(p).unwrap();
            }
        }
        let shards = self.shards();
        let shard_of =
            |t: &SrcTensor| usize::from(shards.len() > 1 && t.name.starts_with("transformer.h.1."));
        for (i, s) in shards.iter().enumerate() {
            let part: Vec<&SrcTensor> = self.src.iter().filter(|t| shard_of(t) == i).collect();
            write_safetensors(&self.model.join(s), &part);
        }
        if shards.len() > 1 {
            let weight_map: serde_json::Map<String, serde_json::Value> = self
                .src
                .iter()
                .map(|t| (t.name.clone(), shards[shard_of(t)].into()))
                .collect();
            std::fs::write(
                self.model.join("model.safetensors.index.json"),
                serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
            )
            .unwrap();
        }
    }

    fn set_config(&self, f: impl FnOnce(&mut serde_json::Value)) {
        let mut cfg = self.kind.config();
        f(&mut cfg);
        std::fs::write(self.model.join("config.json"), cfg.to_string()).unwrap();
    }

    fn opts(&self, out: &Path, outtype: OutType, dense: bool) -> ConvertOptions {
        ConvertOptions {
            model_dir: self.model.clone(),
            predictor_dir: (!dense).then(|| self.pred.clone()),
            out: out.to_path_buf(),
            outtype,
            dense,
            predictor_layers: Vec::new(),
        }
    }

    fn src(&self, name: &str) -> &SrcTensor {
        self.src
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no source tensor {name}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Expected output, re-derived from the spec

/// The `jploski` layout of a fused Falcon QKV `[(n_kv·(g+2))·hd, cols]`, seen as `n_kv` groups
/// of `g` query heads, one key head and one value head: all query heads (group by group), then
/// the key heads, then the value heads.
fn jploski(w: &[f32], n_head: usize, n_kv: usize, hd: usize, cols: usize) -> Vec<f32> {
    let g = n_head / n_kv;
    let head = |group: usize, slot: usize| {
        let first = (group * (g + 2) + slot) * hd * cols;
        &w[first..first + hd * cols]
    };
    let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for group in 0..n_kv {
        for j in 0..g {
            q.extend_from_slice(head(group, j));
        }
        k.extend_from_slice(head(group, g));
        v.extend_from_slice(head(group, g + 1));
    }
    q.extend(k);
    q.extend(v);
    q
}

/// The ggml name of an HF tensor (gguf-py's map for the architecture).
fn ggml_name(kind: Kind, name: &str, dense: bool) -> Option<String> {
    let down = if dense { "ffn_down" } else { "ffn_down_t" };
    if kind == Kind::Opt {
        if name == "lm_head.weight" {
            return None;
        }
        let rest = name
            .strip_prefix("model.decoder.")
            .or_else(|| name.strip_prefix("decoder."))
            .unwrap();
        let top = [
            ("embed_tokens.weight", "token_embd.weight"),
            ("embed_positions.weight", "position_embd.weight"),
            ("final_layer_norm.weight", "output_norm.weight"),
            ("final_layer_norm.bias", "output_norm.bias"),
        ];
        if let Some((_, g)) = top.iter().find(|(h, _)| *h == rest) {
            return Some(g.to_string());
        }
        let rest = rest.strip_prefix("layers.").unwrap();
        let (l, part) = rest.split_once('.').unwrap();
        let (base, suffix) = part.rsplit_once('.').unwrap();
        let g = match base {
            "self_attn_layer_norm" => "attn_norm",
            "final_layer_norm" => "ffn_norm",
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.out_proj" => "attn_output",
            "fc1" => "ffn_up",
            "fc2" => down,
            other => panic!("{other}"),
        };
        return Some(format!("blk.{l}.{g}.{suffix}"));
    }
    let top = [
        ("transformer.word_embeddings.weight", "token_embd.weight"),
        ("transformer.ln_f.weight", "output_norm.weight"),
        ("transformer.ln_f.bias", "output_norm.bias"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = top.iter().find(|(h, _)| *h == name) {
        return Some(g.to_string());
    }
    let rest = name.strip_prefix("transformer.h.").unwrap();
    let (l, part) = rest.split_once('.').unwrap();
    let (base, suffix) = part.rsplit_once('.').unwrap();
    let g = match base {
        "input_layernorm" | "ln_mlp" => "attn_norm",
        "ln_attn" => "attn_norm_2",
        "self_attention.query_key_value" => "attn_qkv",
        "self_attention.dense" => "attn_output",
        "mlp.dense_h_to_4h" => "ffn_up",
        "mlp.dense_4h_to_h" => down,
        other => panic!("{other}"),
    };
    Some(format!("blk.{l}.{g}.{suffix}"))
}

/// The names of the safetensors files' tensors in header order, shard by shard.
fn header_order(c: &Checkpoint) -> Vec<String> {
    let mut order = Vec::new();
    for shard in c.shards() {
        let bytes = std::fs::read(c.model.join(shard)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        order.extend(header.keys().filter(|k| *k != "__metadata__").cloned());
    }
    order
}

/// (ggml name, ne, values in output order) of every expected tensor, in file order: the
/// predictors first (fc1, fc2 per layer), then the model tensors in header order, then for a
/// Falcon without `lm_head` the token embedding again as `output.weight`.
fn expected(c: &Checkpoint, dense: bool) -> Vec<(String, Vec<u64>, Vec<f32>)> {
    let mut out = Vec::new();
    if !dense {
        for (l, entries) in c.pred_src.iter().enumerate() {
            for (key, shape, vals) in entries {
                out.push((
                    format!("blk.{l}.{key}"),
                    vec![shape[1] as u64, shape[0] as u64],
                    vals.clone(),
                ));
            }
        }
    }
    for name in header_order(c) {
        let t = c.src(&name);
        let Some(g) = ggml_name(c.kind, &name, dense) else {
            continue;
        };
        let (ne, vals) = match t.shape[..] {
            [n] => (vec![n as u64], t.values.clone()),
            [rows, cols] if g.contains("ffn_down_t") => (
                vec![rows as u64, cols as u64],
                np_transpose(&t.values, rows, cols),
            ),
            [rows, cols] if g.contains("attn_qkv") => (
                vec![cols as u64, rows as u64],
                jploski(&t.values, N_HEAD, c.kind.n_kv(), N_EMBD / N_HEAD, cols),
            ),
            [rows, cols] => (vec![cols as u64, rows as u64], t.values.clone()),
            _ => unreachable!(),
        };
        out.push((g, ne, vals));
    }
    if c.kind == Kind::Falcon7 {
        let t = c.src("transformer.word_embeddings.weight");
        out.push((
            "output.weight".into(),
            vec![N_EMBD as u64, N_VOCAB as u64],
            t.values.clone(),
        ));
    }
    out
}

/// The metadata keys PowerInfer's HF script writes, in order.
fn expected_keys(c: &Checkpoint, dense: bool) -> Vec<String> {
    let a = c.kind.arch();
    let mut keys: Vec<String> = vec!["general.architecture".into(), "general.name".into()];
    let arch_keys: &[&str] = if c.kind == Kind::Opt {
        &[
            "context_length",
            "embedding_length",
            "block_count",
            "feed_forward_length",
            "attention.head_count",
        ]
    } else {
        &[
            "context_length",
            "tensor_data_layout",
            "embedding_length",
            "feed_forward_length",
            "block_count",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.layer_norm_epsilon",
        ]
    };
    keys.extend(arch_keys.iter().map(|k| format!("{a}.{k}")));
    keys.push("general.file_type".into());
    if !dense {
        keys.push("powerinfer.sparse_threshold".into());
    }
    for k in ["model", "tokens", "token_type", "merges"] {
        keys.push(format!("tokenizer.ggml.{k}"));
    }
    let special: &[&str] = match c.kind {
        // tokenizer_config.json's eos first, then config.json's bos; then add_bos_token.
        Kind::Falcon40 => &["eos_token_id", "bos_token_id", "add_bos_token"],
        Kind::Falcon7 => &["bos_token_id", "eos_token_id"],
        Kind::Opt => &["bos_token_id", "eos_token_id", "padding_token_id"],
    };
    keys.extend(special.iter().map(|k| format!("tokenizer.ggml.{k}")));
    keys
}

fn check_file(c: &Checkpoint, path: &Path, outtype: OutType, dense: bool) {
    let f = GgufFile::open(path).unwrap();
    let kind = if dense {
        FileKind::Gguf
    } else {
        FileKind::PowerInfer
    };
    assert_eq!(f.kind(), kind);
    let want = expected(c, dense);
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name()).collect();
    let want_names: Vec<&str> = want.iter().map(|w| w.0.as_str()).collect();
    assert_eq!(names, want_names, "{:?}", c.kind);
    for ((name, ne, vals), info) in want.iter().zip(f.tensors()) {
        assert_eq!(info.shape(), &ne[..], "{name}");
        let ty = if ne.len() == 1 {
            GgmlType::F32
        } else {
            outtype.matrix_type()
        };
        assert_eq!(info.ggml_type(), ty, "{name}");
        let want_bytes: Vec<u8> = match ty {
            GgmlType::F32 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
            GgmlType::F16 => vals
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            _ => unreachable!(),
        };
        assert!(
            f.tensor_data(name).unwrap() == &want_bytes[..],
            "{name}: bytes differ"
        );
    }

    let m = f.metadata();
    let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
    assert_eq!(keys, expected_keys(c, dense), "{:?}", c.kind);
    let a = c.kind.arch();
    let u = |k: &str| m.get_u32(&format!("{a}.{k}")).unwrap();
    assert_eq!(m.get_str("general.architecture").unwrap(), a);
    assert_eq!(u("embedding_length"), N_EMBD as u32);
    assert_eq!(u("block_count"), N_LAYER as u32);
    assert_eq!(u("feed_forward_length"), c.kind.n_ff() as u32);
    assert_eq!(u("attention.head_count"), N_HEAD as u32);
    if c.kind == Kind::Opt {
        assert_eq!(m.get_str("general.name").unwrap(), "opt");
        assert_eq!(u("context_length"), (OPT_POS + 2) as u32);
        assert_eq!(m.get_u32("tokenizer.ggml.padding_token_id").unwrap(), 261);
    } else {
        assert_eq!(m.get_str("general.name").unwrap(), "Falcon");
        assert_eq!(u("context_length"), 2048);
        assert_eq!(m.get_str("falcon.tensor_data_layout").unwrap(), "jploski");
        assert_eq!(u("attention.head_count_kv"), c.kind.n_kv() as u32);
        assert_eq!(
            m.get_f32("falcon.attention.layer_norm_epsilon").unwrap(),
            1e-5
        );
    }
    if c.kind == Kind::Falcon40 {
        assert!(!m.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    }
    assert_eq!(m.get_u32("general.file_type").unwrap(), outtype.file_type());
    if !dense {
        assert_eq!(m.get_f32("powerinfer.sparse_threshold").unwrap(), 0.25);
    }
    assert_eq!(m.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    let (tokens, types) = expected_vocab();
    assert_eq!(
        m.get_string_array("tokenizer.ggml.tokens").unwrap(),
        &tokens[..]
    );
    assert_eq!(
        m.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        &types[..]
    );
    assert_eq!(
        m.get_string_array("tokenizer.ggml.merges").unwrap(),
        &expected_merges()[..]
    );
    assert_eq!(m.get_u32("tokenizer.ggml.bos_token_id").unwrap(), EOT);
    assert_eq!(m.get_u32("tokenizer.ggml.eos_token_id").unwrap(), EOT);
}

// ---------------------------------------------------------------------------------------------
// An f64 forward pass in Hugging Face's terms, on the source tensors

struct HfRef<'a> {
    c: &'a Checkpoint,
}

impl HfRef<'_> {
    fn t(&self, name: &str) -> Vec<f64> {
        let name = if self.c.kind == Kind::Opt && name != "lm_head.weight" {
            format!("model.decoder.{name}")
        } else {
            name.to_string()
        };
        self.c.src(&name).values.iter().map(|&x| x as f64).collect()
    }

    fn has(&self, name: &str) -> bool {
        self.c.src.iter().any(|t| t.name == name)
    }

    fn ln(&self, x: &[f64], base: &str) -> Vec<f64> {
        let (w, b) = (
            self.t(&format!("{base}.weight")),
            self.t(&format!("{base}.bias")),
        );
        let n = x.len() as f64;
        let mean = x.iter().sum::<f64>() / n;
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let s = 1.0 / (var + 1e-5).sqrt();
        (0..x.len())
            .map(|j| (x[j] - mean) * s * w[j] + b[j])
            .collect()
    }

    /// `W x (+ b)` for a torch `[out, in]` weight.
    fn linear(&self, base: &str, x: &[f64], bias: bool) -> Vec<f64> {
        let w = self.t(&format!("{base}.weight"));
        let b = bias.then(|| self.t(&format!("{base}.bias")));
        (0..w.len() / x.len())
            .map(|r| {
                let dot: f64 = (0..x.len()).map(|j| w[r * x.len() + j] * x[j]).sum();
                dot + b.as_ref().map_or(0.0, |b| b[r])
            })
            .collect()
    }

    /// Hugging Face's `rotate_half` rotary embedding of one head at `pos`.
    fn rotary(head: &mut [f64], pos: usize) {
        let d = head.len();
        for i in 0..d / 2 {
            let theta = pos as f64 / 10000f64.powf(2.0 * i as f64 / d as f64);
            let (s, c) = theta.sin_cos();
            let (x1, x2) = (head[i], head[i + d / 2]);
            head[i] = x1 * c - x2 * s;
            head[i + d / 2] = x2 * c + x1 * s;
        }
    }

    /// Causal softmax attention of one head's query over its keys and values.
    fn attend(q: &[f64], ks: &[Vec<f64>], vs: &[Vec<f64>], scale: f64) -> Vec<f64> {
        let s: Vec<f64> = ks
            .iter()
            .map(|k| q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() * scale)
            .collect();
        let m = s.iter().cloned().fold(f64::MIN, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        let mut out = vec![0.0; q.len()];
        for (p, v) in vs.iter().enumerate() {
            for i in 0..q.len() {
                out[i] += e[p] / z * v[i];
            }
        }
        out
    }

    /// Logits of every position.
    fn logits(&self, tokens: &[u32]) -> Vec<f64> {
        let e = N_EMBD;
        let hd = e / N_HEAD;
        let opt = self.c.kind == Kind::Opt;
        let n_kv = self.c.kind.n_kv();
        let g = N_HEAD / n_kv;
        let embd = self.t(if opt {
            "embed_tokens.weight"
        } else {
            "transformer.word_embeddings.weight"
        });
        let head = if !opt && self.has("lm_head.weight") {
            self.t("lm_head.weight")
        } else {
            embd.clone()
        };
        // Per layer, per position: keys and values of every K/V head.
        let mut kc: Vec<Vec<Vec<Vec<f64>>>> = vec![Vec::new(); N_LAYER];
        let mut vc: Vec<Vec<Vec<Vec<f64>>>> = vec![Vec::new(); N_LAYER];
        let mut out = Vec::new();
        for (pos, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            let mut x = embd[tok * e..(tok + 1) * e].to_vec();
            if opt {
                let p = self.t("embed_positions.weight");
                for j in 0..e {
                    x[j] += p[(pos + 2) * e + j];
                }
            }
            for l in 0..N_LAYER {
                if opt {
                    let p = |t: &str| format!("layers.{l}.{t}");
                    let h = self.ln(&x, &p("self_attn_layer_norm"));
                    let q = self.linear(&p("self_attn.q_proj"), &h, true);
                    let k = self.linear(&p("self_attn.k_proj"), &h, true);
                    let v = self.linear(&p("self_attn.v_proj"), &h, true);
                    let split =
                        |t: &[f64]| -> Vec<Vec<f64>> { t.chunks(hd).map(|c| c.to_vec()).collect() };
                    kc[l].push(split(&k));
                    vc[l].push(split(&v));
                    let mut a = Vec::new();
                    for (hh, qh) in split(&q).iter().enumerate() {
                        let ks: Vec<Vec<f64>> = kc[l].iter().map(|k| k[hh].clone()).collect();
                        let vs: Vec<Vec<f64>> = vc[l].iter().map(|v| v[hh].clone()).collect();
                        a.extend(Self::attend(qh, &ks, &vs, 1.0 / (hd as f64).sqrt()));
                    }
                    let o = self.linear(&p("self_attn.out_proj"), &a, true);
                    for j in 0..e {
                        x[j] += o[j];
                    }
                    let h = self.ln(&x, &p("final_layer_norm"));
                    let up: Vec<f64> = self
                        .linear(&p("fc1"), &h, true)
                        .into_iter()
                        .map(|u| u.max(0.0))
                        .collect();
                    let y = self.linear(&p("fc2"), &up, true);
                    for j in 0..e {
                        x[j] += y[j];
                    }
                } else {
                    let p = |t: &str| format!("transformer.h.{l}.{t}");
                    let (attn_in, mlp_in) = if self.has(&p("ln_attn.weight")) {
                        (self.ln(&x, &p("ln_attn")), self.ln(&x, &p("ln_mlp")))
                    } else {
                        let n = self.ln(&x, &p("input_layernorm"));
                        (n.clone(), n)
                    };
                    // Fused QKV viewed as (n_kv, g + 2, hd): g queries, a key, a value.
                    let fused = self.linear(&p("self_attention.query_key_value"), &attn_in, false);
                    let slot = |grp: usize, s: usize| {
                        fused[(grp * (g + 2) + s) * hd..(grp * (g + 2) + s + 1) * hd].to_vec()
                    };
                    let mut keys = Vec::new();
                    let mut vals = Vec::new();
                    for grp in 0..n_kv {
                        let mut k = slot(grp, g);
                        Self::rotary(&mut k, pos);
                        keys.push(k);
                        vals.push(slot(grp, g + 1));
                    }
                    kc[l].push(keys);
                    vc[l].push(vals);
                    let mut a = Vec::new();
                    for grp in 0..n_kv {
                        for j in 0..g {
                            let mut q = slot(grp, j);
                            Self::rotary(&mut q, pos);
                            let ks: Vec<Vec<f64>> = kc[l].iter().map(|k| k[grp].clone()).collect();
                            let vs: Vec<Vec<f64>> = vc[l].iter().map(|v| v[grp].clone()).collect();
                            a.extend(Self::attend(&q, &ks, &vs, 1.0 / (hd as f64).sqrt()));
                        }
                    }
                    let o = self.linear(&p("self_attention.dense"), &a, false);
                    let up: Vec<f64> = self
                        .linear(&p("mlp.dense_h_to_4h"), &mlp_in, false)
                        .into_iter()
                        .map(|u| u.max(0.0))
                        .collect();
                    let y = self.linear(&p("mlp.dense_4h_to_h"), &up, false);
                    for j in 0..e {
                        x[j] += o[j] + y[j];
                    }
                }
            }
            let h = self.ln(
                &x,
                if opt {
                    "final_layer_norm"
                } else {
                    "transformer.ln_f"
                },
            );
            for r in 0..N_VOCAB {
                out.push((0..e).map(|j| head[r * e + j] * h[j]).sum::<f64>());
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

const PROMPT: [u32; 6] = [EOT, 116, 257, 258, 100, 263];

/// Loads `path` in the engine: ReLU FFN, the architecture, the BPE tokenizer with the merges,
/// and a few greedy tokens.
fn check_engine(c: &Checkpoint, path: &Path, dense: bool) {
    let engine = Engine::load(path, engine_opts(dense)).unwrap();
    let model = engine.model();
    assert_eq!(model.ffn_act(), FfnAct::Relu);
    let arch = if c.kind == Kind::Opt {
        Arch::Opt
    } else {
        Arch::Falcon
    };
    assert_eq!(model.hparams().arch, arch);
    // "the" = t + he; " the" = Ġt + he → Ġthe.
    assert_eq!(
        engine.tokenizer().encode("the the", false, false),
        [116, 257, 258]
    );
    let mut s = engine.session();
    let got: Vec<u32> = s
        .generate(
            "the the",
            SamplingParams::greedy(4).with(|p| p.stop_at_eog = false),
        )
        .map(|t| t.unwrap().id)
        .collect();
    assert_eq!(got.len(), 4, "{:?}", c.kind);
}

/// The engine's logits on the converted F32 file (run densely) against the f64 forward pass
/// on the source tensors.
fn check_reference(c: &Checkpoint, path: &Path, dense_file: bool) {
    let engine = Engine::load(path, engine_opts(true)).unwrap();
    let got = engine.session().eval_all(&PROMPT).unwrap();
    let want = HfRef { c }.logits(&PROMPT);
    let r = rel_diff(&got, &want);
    eprintln!(
        "{:?} dense file {dense_file}: max diff / std = {r:.3e}",
        c.kind
    );
    assert!(r <= 1e-3, "{:?}: max diff / std = {r}", c.kind);
}

#[test]
fn converts_falcon_and_opt() {
    let out_dir = tempfile::tempdir().unwrap();
    for kind in [Kind::Falcon40, Kind::Falcon7, Kind::Opt] {
        let c = Checkpoint::new(kind);
        for (outtype, dense) in [
            (OutType::F16, false),
            (OutType::F32, false),
            (OutType::F32, true),
        ] {
            let out = out_dir
                .path()
                .join(format!("{kind:?}-{outtype:?}-{dense}.gguf"));
            let report = convert(&c.opts(&out, outtype, dense), &mut |_, _| {}).unwrap();
            assert_eq!(report.arch, kind.arch());
            assert_eq!(report.n_layer, N_LAYER);
            assert_eq!(report.n_vocab, N_VOCAB);
            assert_eq!(report.n_tensors, expected(&c, dense).len());
            check_file(&c, &out, outtype, dense);
            if outtype == OutType::F32 {
                check_reference(&c, &out, dense);
            } else {
                check_engine(&c, &out, dense);
            }
        }
    }
}

#[test]
fn quantized_outtypes_load_and_generate() {
    let out_dir = tempfile::tempdir().unwrap();
    for kind in [Kind::Falcon40, Kind::Opt] {
        let c = Checkpoint::new(kind);
        for outtype in [OutType::Q8_0, OutType::Q4_0] {
            let out = out_dir.path().join(format!("{kind:?}-{outtype:?}.gguf"));
            convert(&c.opts(&out, outtype, false), &mut |_, _| {}).unwrap();
            let f = GgufFile::open(&out).unwrap();
            for info in f.tensors() {
                let want = if info.shape().len() == 1 {
                    GgmlType::F32
                } else if info.name() == "output.weight" && outtype == OutType::Q4_0 {
                    // PowerInfer's quantize: a falcon head is Q8_0.
                    GgmlType::Q8_0
                } else {
                    outtype.matrix_type()
                };
                assert_eq!(info.ggml_type(), want, "{kind:?} {}", info.name());
            }
            check_engine(&c, &out, false);
        }
    }
}

#[test]
fn vocab_variants() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("m.gguf");
    // OPT names without the `model.` prefix (as OPTModel checkpoints store them), merges from
    // merges.txt when tokenizer.json has none.
    let mut c = Checkpoint::new(Kind::Opt);
    for t in &mut c.src {
        if let Some(rest) = t.name.strip_prefix("model.") {
            t.name = rest.to_string();
        }
    }
    c.write_model();
    std::fs::write(c.model.join("tokenizer.json"), tokenizer_json(None)).unwrap();
    let txt: String = expected_merges().iter().map(|m| format!("{m}\n")).collect();
    std::fs::write(c.model.join("merges.txt"), format!("#version: 0.2\n{txt}")).unwrap();
    convert(&c.opts(&out, OutType::F32, false), &mut |_, _| {}).unwrap();
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(
        f.metadata()
            .get_string_array("tokenizer.ggml.merges")
            .unwrap(),
        &expected_merges()[..]
    );
    assert!(f.tensor_info("blk.1.ffn_down_t.bias").is_some());
    assert!(f.tensor_info("output.weight").is_none());
    // No merges anywhere: an error naming tokenizer.json.
    std::fs::remove_file(c.model.join("merges.txt")).unwrap();
    std::fs::remove_file(&out).unwrap();
    expect_err(
        &c.opts(&out, OutType::F32, false),
        &["tokenizer.json", "merges"],
    );
}

fn expect_err(o: &ConvertOptions, needles: &[&str]) -> String {
    let msg = convert(o, &mut |_, _| {}).unwrap_err().to_string();
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
    assert!(!msg.contains('\n'), "{msg:?} is not one line");
    no_output_left(o.out.parent().unwrap());
    msg
}

#[test]
fn bad_input_is_a_clear_error_and_leaves_nothing() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.powerinfer.gguf");

    // A missing tensor.
    let mut c = Checkpoint::new(Kind::Falcon7);
    c.src
        .retain(|t| t.name != "transformer.h.1.self_attention.dense.weight");
    c.write_model();
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["no tensor for blk.1.attn_output.weight"],
    );

    // No lm_head.weight although config.json says the head is not tied.
    let c = Checkpoint::new(Kind::Falcon7);
    c.set_config(|v| v["tie_word_embeddings"] = false.into());
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["no tensor for output.weight"],
    );

    // A 40B-style layer without ln_attn.
    let mut c = Checkpoint::new(Kind::Falcon40);
    c.src
        .retain(|t| !t.name.starts_with("transformer.h.1.ln_attn"));
    c.write_model();
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["no tensor for blk.1.attn_norm_2.weight"],
    );

    // A QKV of the wrong shape (config.json says 2 K/V heads, the checkpoint has one).
    let c = Checkpoint::new(Kind::Falcon7);
    c.set_config(|v| v["n_head_kv"] = 2.into());
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &[
            "model.safetensors",
            "transformer.h.0.self_attention.query_key_value.weight",
            "disagrees with config.json",
        ],
    );

    // An unexpected tensor.
    let mut c = Checkpoint::new(Kind::Opt);
    let mut extra = c.src[0].clone();
    extra.name = "model.decoder.project_in.weight".into();
    c.src.push(extra);
    c.write_model();
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["model.decoder.project_in.weight", "unexpected"],
    );

    // Tokenizers: not BPE, not byte-level, missing, an id past vocab_size, not JSON.
    let c = Checkpoint::new(Kind::Falcon40);
    let tj = c.model.join("tokenizer.json");
    let good = tokenizer_json(Some(false));
    std::fs::write(&tj, good.replace(r#""type":"BPE""#, r#""type":"Unigram""#)).unwrap();
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["tokenizer.json", "Unigram", "BPE"],
    );
    std::fs::write(&tj, good.replace("ByteLevel", "Metaspace")).unwrap();
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["tokenizer.json", "ByteLevel"],
    );
    std::fs::write(&tj, good.replace(r#""id":263"#, r#""id":265"#)).unwrap();
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["tokenizer.json", "<user>", "265", "vocab_size 265"],
    );
    std::fs::write(&tj, &good[..good.len() / 2]).unwrap();
    expect_err(
        &c.opts(&out, OutType::F16, false),
        &["tokenizer.json", "not JSON"],
    );
    std::fs::remove_file(&tj).unwrap();
    expect_err(&c.opts(&out, OutType::F16, false), &["no tokenizer.json"]);

    // Config values PowerInfer's graphs cannot run, and families that disagree.
    let falcon = Checkpoint::new(Kind::Falcon7);
    let opt = Checkpoint::new(Kind::Opt);
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&Checkpoint, Edit, &[&str]); 12] = [
        (&falcon, |v| v["alibi"] = true.into(), &["alibi"]),
        (&falcon, |v| v["bias"] = true.into(), &["bias"]),
        (
            &falcon,
            |v| v["parallel_attn"] = false.into(),
            &["parallel_attn"],
        ),
        (
            &falcon,
            |v| v["multi_query"] = false.into(),
            &["multi_query"],
        ),
        (&falcon, |v| v["n_head_kv"] = 3.into(), &["num_kv_heads 3"]),
        (
            &falcon,
            |v| v["activation"] = "gelu".into(),
            &["activation \"gelu\""],
        ),
        (
            &falcon,
            |v| {
                v.as_object_mut().unwrap().remove("layer_norm_epsilon");
            },
            &["layer_norm_epsilon"],
        ),
        (
            &opt,
            |v| v["do_layer_norm_before"] = false.into(),
            &["do_layer_norm_before"],
        ),
        (
            &opt,
            |v| v["word_embed_proj_dim"] = 32.into(),
            &["word_embed_proj_dim 32"],
        ),
        (&opt, |v| v["enable_bias"] = false.into(), &["enable_bias"]),
        (
            &opt,
            |v| v["activation_function"] = "gelu".into(),
            &["activation_function \"gelu\""],
        ),
        (
            &opt,
            |v| v["architectures"] = serde_json::json!(["FalconForCausalLM"]),
            &["\"opt\"", "FalconForCausalLM"],
        ),
    ];
    for (c, edit, needles) in cases {
        c.set_config(edit);
        let msg = expect_err(&c.opts(&out, OutType::F16, false), needles);
        assert!(msg.contains("config.json"), "{msg}");
        c.set_config(|_| {});
    }
}

/// Every hyper-parameter of a Falcon and an OPT `config.json` set to hostile values, or
/// dropped, one at a time: a typed error (or a file when the value happens to fit), never a
/// panic, and nothing left behind by a failure.
#[test]
fn hostile_configs_are_errors_not_panics() {
    let values = [
        serde_json::json!(0),
        serde_json::json!(1),
        serde_json::json!(3),
        serde_json::json!(1u64 << 31),
        serde_json::json!(1u64 << 40),
        serde_json::json!(-4),
        serde_json::json!(2.5),
        serde_json::json!("x"),
        serde_json::json!(true),
        serde_json::Value::Null,
    ];
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.powerinfer.gguf");
    for kind in [Kind::Falcon40, Kind::Falcon7, Kind::Opt] {
        let c = Checkpoint::new(kind);
        let good = kind.config();
        let (mut refused, mut converted) = (0, 0);
        for k in good.as_object().unwrap().keys() {
            let mut cases = vec![None];
            cases.extend(values.iter().cloned().map(Some));
            for v in cases {
                c.set_config(|cfg| match &v {
                    Some(v) => cfg[k] = v.clone(),
                    None => {
                        cfg.as_object_mut().unwrap().remove(k);
                    }
                });
                let o = c.opts(&out, OutType::F16, false);
                match std::panic::catch_unwind(|| convert(&o, &mut |_, _| {})) {
                    Ok(Ok(_)) => converted += 1,
                    Ok(Err(_)) => {
                        refused += 1;
                        no_output_left(out_dir.path());
                    }
                    Err(_) => panic!("{kind:?} config {k} = {v:?}: convert panicked"),
                }
                let _ = std::fs::remove_file(&out);
            }
        }
        assert!(
            refused > 0 && converted > 0,
            "{kind:?}: {refused} refused, {converted} converted"
        );
    }
}
