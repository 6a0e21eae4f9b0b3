//! `convert`: a tiny Hugging Face checkpoint written here (two safetensors shards with an
//! index, F32/F16/BF16 tensors, a SentencePiece `tokenizer.model` built with a small protobuf
//! writer, a predictor folder with `model_N.pt`) converted to PWRI / GGUF files; every output
//! tensor checked against the source values with the transforms re-derived from the spec
//! (convert.py's `permute` as reshape/swapaxes, `ffn_down` transposed), the metadata, the
//! vocabulary, and bad input. With POWERINFER_PYTHON: one predictor `.pt` made by Python
//! without torch, and the output read back with the PyPI gguf package's GGUFReader.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use powerinfer_cli::convert::{convert, ConvertError, ConvertOptions, OutType};
use powerinfer_gguf::quants::dequantize_to_vec;
use powerinfer_gguf::{FileKind, GgmlType, GgufFile};
use powerinfer_predictor::pt::{self, PtTensor};
use safetensors::Dtype;

#[path = "support/safetensors_src.rs"]
mod safetensors_src;
use safetensors_src::{exact, no_output_left, np_transpose, write_safetensors, SrcTensor};

#[path = "support/hf_checkpoint.rs"]
mod hf_checkpoint;
use hf_checkpoint::{llama_tensor_specs, LlamaDims};

const N_EMBD: usize = 64;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const N_FF: usize = 96;
const N_LAYER: usize = 2;
const RANK: usize = 32;

fn python() -> Option<PathBuf> {
    match std::env::var_os("POWERINFER_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var_os("CI").is_some() => {
            panic!("POWERINFER_PYTHON must be set when CI is set")
        }
        None => {
            println!("skipped: POWERINFER_PYTHON not set");
            None
        }
    }
}

fn py_tool(py: &Path, args: &[&str]) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/convert_fixture.py");
    let o = Command::new(py).arg(script).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Writing the checkpoint

/// (piece, score, sentencepiece type) of the test vocabulary.
fn pieces() -> Vec<(String, f32, u64)> {
    let mut v = vec![
        ("<unk>".to_string(), 0.0, 2),
        ("<s>".to_string(), 0.0, 3),
        ("</s>".to_string(), 0.0, 3),
        ("<0x41>".to_string(), 0.0, 6),
        ("▁the".to_string(), -1.25, 1),
        ("é".to_string(), -2.5, 1),
        ("<user>".to_string(), 0.0, 4),
        ("<unused>".to_string(), 0.0, 5),
    ];
    for i in 0..4 {
        v.push((format!("▁w{i}"), -3.0 - i as f32, 1));
    }
    v
}

fn tokenizer_model() -> Vec<u8> {
    hf_checkpoint::tokenizer_model(&pieces())
}

fn n_vocab() -> usize {
    pieces().len()
}

/// Deterministic values for a tensor.
fn values(seed: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = (i * 31 + seed * 17) % 101;
            (x as f32 - 50.0) / 13.0 + seed as f32 * 0.01
        })
        .collect()
}

fn model_tensors() -> Vec<SrcTensor> {
    let dims = LlamaDims {
        n_vocab: n_vocab(),
        n_embd: N_EMBD,
        n_head: N_HEAD,
        n_head_kv: N_HEAD_KV,
        n_ff: N_FF,
        n_layer: N_LAYER,
    };
    let specs = llama_tensor_specs(&dims, true);
    specs
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let dtype = [Dtype::F32, Dtype::F16, Dtype::BF16][i % 3];
            let n = shape.iter().product();
            SrcTensor {
                values: exact(dtype, values(i, n)),
                name,
                shape,
                dtype,
            }
        })
        .collect()
}

fn config_json(n_embd: usize) -> String {
    format!(
        r#"{{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":{},
        "hidden_size":{n_embd},"intermediate_size":{N_FF},"num_hidden_layers":{N_LAYER},
        "num_attention_heads":{N_HEAD},"num_key_value_heads":{N_HEAD_KV},"rms_norm_eps":1e-6,
        "rope_theta":10000.0,"max_position_embeddings":2048,"rope_scaling":{{"type":"linear","factor":2.0}},
        "tie_word_embeddings":false,"bos_token_id":1,"eos_token_id":2,"pad_token_id":null,"torch_dtype":"float16"}}"#,
        n_vocab()
    )
}

/// Predictor entries of one layer in file order: (key, torch shape, values).
type PredEntries = Vec<(String, Vec<usize>, Vec<f32>)>;

struct Checkpoint {
    _dir: tempfile::TempDir,
    model: PathBuf,
    pred: PathBuf,
    src: Vec<SrcTensor>,
    /// Per layer, the predictor entries in file order: (key, torch shape, values).
    pred_src: Vec<PredEntries>,
}

fn checkpoint(py: Option<&Path>) -> Checkpoint {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-relu-llama");
    let pred = dir.path().join("predictor");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::create_dir_all(&pred).unwrap();
    std::fs::write(model.join("config.json"), config_json(N_EMBD)).unwrap();
    std::fs::write(model.join("tokenizer.model"), tokenizer_model()).unwrap();
    let src = model_tensors();
    let (a, b): (Vec<&SrcTensor>, Vec<&SrcTensor>) = src
        .iter()
        .partition(|t| !t.name.starts_with("model.layers.1."));
    let shards = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write_safetensors(&model.join(shards[0]), &a);
    write_safetensors(&model.join(shards[1]), &b);
    let weight_map: serde_json::Map<String, serde_json::Value> = src
        .iter()
        .map(|t| {
            let s = if t.name.starts_with("model.layers.1.") {
                1
            } else {
                0
            };
            (t.name.clone(), serde_json::Value::from(shards[s]))
        })
        .collect();
    std::fs::write(
        model.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    std::fs::write(pred.join("config.json"), r#"{"sparse_threshold": 0.25}"#).unwrap();

    let mut pred_src = Vec::new();
    for l in 0..N_LAYER {
        let file = pred.join(format!("model_{l}.pt"));
        if l == 1 {
            if let Some(py) = py {
                let j = py_tool(
                    py,
                    &[
                        "pt",
                        file.to_str().unwrap(),
                        &RANK.to_string(),
                        &N_EMBD.to_string(),
                        &N_FF.to_string(),
                    ],
                );
                let get = |k: &str| -> Vec<f32> {
                    j[k].as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_f64().unwrap() as f32)
                        .collect()
                };
                pred_src.push(vec![
                    ("fc2.weight".into(), vec![N_FF, RANK], get("fc2.weight")),
                    ("fc1.weight".into(), vec![RANK, N_EMBD], get("fc1.weight")),
                ]);
                continue;
            }
        }
        let fc1 = values(100 + l, RANK * N_EMBD);
        let fc2 = values(200 + l, N_FF * RANK);
        pt::write_state_dict(
            &file,
            &[
                (
                    "fc1.weight".into(),
                    PtTensor::from_f32(vec![RANK, N_EMBD], &fc1).unwrap(),
                ),
                (
                    "fc2.weight".into(),
                    PtTensor::from_f32(vec![N_FF, RANK], &fc2).unwrap(),
                ),
            ],
        )
        .unwrap();
        pred_src.push(vec![
            ("fc1.weight".into(), vec![RANK, N_EMBD], fc1),
            ("fc2.weight".into(), vec![N_FF, RANK], fc2),
        ]);
    }
    Checkpoint {
        _dir: dir,
        model,
        pred,
        src,
        pred_src,
    }
}

fn opts(c: &Checkpoint, out: &Path, outtype: OutType, dense: bool) -> ConvertOptions {
    ConvertOptions {
        model_dir: c.model.clone(),
        predictor_dir: (!dense).then(|| c.pred.clone()),
        out: out.to_path_buf(),
        outtype,
        dense,
        predictor_layers: Vec::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// Expected output, re-derived from the spec

/// numpy `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)`:
/// output element (h, i, j, c) of the swapped view is input element (h, j, i, c).
fn np_permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let src_row = (h * 2 + j) * half + i;
                out.extend_from_slice(&w[src_row * cols..(src_row + 1) * cols]);
            }
        }
    }
    out
}

/// convert.py's numpy Q8_0: d = max|x|/127 (f32), q = round-half-even(x / d), d as f16.
fn np_q8_0(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in v.chunks(32) {
        let d = b.iter().map(|x| x.abs()).fold(0.0f32, f32::max) / 127.0;
        out.extend(half::f16::from_f32(d).to_le_bytes());
        for &x in b {
            let q = if d == 0.0 {
                0.0
            } else {
                (x / d).round_ties_even()
            };
            out.push(q as i8 as u8);
        }
    }
    out
}

/// (ggml name, ne, values in output order) of every expected tensor, in file order.
fn expected(c: &Checkpoint, dense: bool) -> Vec<(String, Vec<u64>, Vec<f32>)> {
    // Model tensors in the order of the shards' headers.
    let mut order = Vec::new();
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        let bytes = std::fs::read(c.model.join(shard)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        order.extend(header.keys().filter(|k| *k != "__metadata__").cloned());
    }
    let by_name: HashMap<&str, &SrcTensor> = c.src.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut out = Vec::new();
    for name in order {
        let t = by_name[name.as_str()];
        if name.ends_with("rotary_emb.inv_freq") {
            continue;
        }
        let rows = t.shape[0];
        let cols = t.shape.get(1).copied().unwrap_or(1);
        let ne2 = |a: usize, b: usize| vec![a as u64, b as u64];
        let (gname, ne, vals) = match name.as_str() {
            "model.embed_tokens.weight" => (
                "token_embd.weight".to_string(),
                ne2(cols, rows),
                t.values.clone(),
            ),
            "model.norm.weight" => (
                "output_norm.weight".to_string(),
                vec![rows as u64],
                t.values.clone(),
            ),
            "lm_head.weight" => (
                "output.weight".to_string(),
                ne2(cols, rows),
                t.values.clone(),
            ),
            _ => {
                let rest = name.strip_prefix("model.layers.").unwrap();
                let (l, part) = rest.split_once('.').unwrap();
                let g = |s: &str| format!("blk.{l}.{s}.weight");
                match part {
                    "input_layernorm.weight" => {
                        (g("attn_norm"), vec![rows as u64], t.values.clone())
                    }
                    "post_attention_layernorm.weight" => {
                        (g("ffn_norm"), vec![rows as u64], t.values.clone())
                    }
                    "self_attn.q_proj.weight" => (
                        g("attn_q"),
                        ne2(cols, rows),
                        np_permute(&t.values, rows, cols, N_HEAD),
                    ),
                    "self_attn.k_proj.weight" => (
                        g("attn_k"),
                        ne2(cols, rows),
                        np_permute(&t.values, rows, cols, N_HEAD_KV),
                    ),
                    "self_attn.v_proj.weight" => (g("attn_v"), ne2(cols, rows), t.values.clone()),
                    "self_attn.o_proj.weight" => {
                        (g("attn_output"), ne2(cols, rows), t.values.clone())
                    }
                    "mlp.gate_proj.weight" => (g("ffn_gate"), ne2(cols, rows), t.values.clone()),
                    "mlp.up_proj.weight" => (g("ffn_up"), ne2(cols, rows), t.values.clone()),
                    "mlp.down_proj.weight" if dense => {
                        (g("ffn_down"), ne2(cols, rows), t.values.clone())
                    }
                    // torch [n_embd, n_ff] -> numpy .T [n_ff, n_embd] -> ne [n_embd, n_ff]
                    "mlp.down_proj.weight" => (
                        g("ffn_down_t"),
                        ne2(rows, cols),
                        np_transpose(&t.values, rows, cols),
                    ),
                    other => panic!("unexpected {other}"),
                }
            }
        };
        out.push((gname, ne, vals));
    }
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
    out
}

fn check_file(c: &Checkpoint, path: &Path, outtype: OutType, dense: bool) {
    let f = GgufFile::open(path).unwrap();
    assert_eq!(
        f.kind(),
        if dense {
            FileKind::Gguf
        } else {
            FileKind::PowerInfer
        }
    );
    let want = expected(c, dense);
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name()).collect();
    let want_names: Vec<&str> = want.iter().map(|w| w.0.as_str()).collect();
    assert_eq!(names, want_names);
    for ((name, ne, vals), info) in want.iter().zip(f.tensors()) {
        assert_eq!(info.shape(), &ne[..], "{name}");
        let ty = if ne.len() == 1 {
            GgmlType::F32
        } else {
            outtype.matrix_type()
        };
        assert_eq!(info.ggml_type(), ty, "{name}");
        let data = f.tensor_data(name).unwrap();
        let want_bytes: Vec<u8> = match ty {
            GgmlType::F32 => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
            GgmlType::F16 => vals
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
            GgmlType::Q8_0 => np_q8_0(vals),
            _ => unreachable!(),
        };
        assert!(data == &want_bytes[..], "{name}: bytes differ");
        if ty == GgmlType::Q8_0 {
            // And the ggml decoder reads the values back within half a quantization step.
            let back = dequantize_to_vec(ty, data).unwrap();
            for (blk, (b, v)) in back.chunks(32).zip(vals.chunks(32)).enumerate() {
                let d = v.iter().map(|x| x.abs()).fold(0.0f32, f32::max) / 127.0;
                for (x, y) in b.iter().zip(v) {
                    assert!(
                        (x - y).abs() <= d * 0.51 + 1e-3,
                        "{name} block {blk}: {x} vs {y}"
                    );
                }
            }
        }
    }

    let m = f.metadata();
    assert_eq!(m.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(m.get_str("general.name").unwrap(), "tiny-relu-llama");
    assert_eq!(m.get_u32("llama.context_length").unwrap(), 2048);
    assert_eq!(m.get_u32("llama.embedding_length").unwrap(), N_EMBD as u32);
    assert_eq!(m.get_u32("llama.block_count").unwrap(), N_LAYER as u32);
    assert_eq!(m.get_u32("llama.feed_forward_length").unwrap(), N_FF as u32);
    assert_eq!(
        m.get_u32("llama.rope.dimension_count").unwrap(),
        (N_EMBD / N_HEAD) as u32
    );
    assert_eq!(
        m.get_u32("llama.attention.head_count").unwrap(),
        N_HEAD as u32
    );
    assert_eq!(
        m.get_u32("llama.attention.head_count_kv").unwrap(),
        N_HEAD_KV as u32
    );
    assert_eq!(
        m.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        1e-6
    );
    assert_eq!(m.get_f32("llama.rope.freq_base").unwrap(), 10000.0);
    assert_eq!(m.get_str("llama.rope.scaling.type").unwrap(), "linear");
    assert_eq!(m.get_f32("llama.rope.scaling.factor").unwrap(), 2.0);
    assert_eq!(m.get_u32("general.file_type").unwrap(), outtype.file_type());
    if dense {
        assert!(!m.contains_key("powerinfer.sparse_threshold"));
    } else {
        assert_eq!(m.get_f32("powerinfer.sparse_threshold").unwrap(), 0.25);
    }
    assert_eq!(m.get_str("tokenizer.ggml.model").unwrap(), "llama");
    let p = pieces();
    let tokens: Vec<String> = p.iter().map(|x| x.0.clone()).collect();
    let scores: Vec<f32> = p.iter().map(|x| x.1).collect();
    // convert.py: unknown 2, control 3, byte 6, unused 5, user-defined written as normal 1.
    let types: Vec<i32> = p
        .iter()
        .map(|x| match x.2 {
            4 => 1,
            t => t as i32,
        })
        .collect();
    assert_eq!(
        m.get_string_array("tokenizer.ggml.tokens").unwrap(),
        &tokens[..]
    );
    assert_eq!(
        m.get_f32_array("tokenizer.ggml.scores").unwrap(),
        &scores[..]
    );
    assert_eq!(
        m.get_i32_array("tokenizer.ggml.token_type").unwrap(),
        &types[..]
    );
    assert_eq!(m.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert_eq!(m.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 2);
    assert!(!m.contains_key("tokenizer.ggml.padding_token_id"));
    let keys: Vec<&str> = m.iter().map(|(k, _)| k).collect();
    let mut want_keys = vec![
        "general.architecture",
        "general.name",
        "llama.context_length",
        "llama.embedding_length",
        "llama.block_count",
        "llama.feed_forward_length",
        "llama.rope.dimension_count",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.rope.freq_base",
        "llama.rope.scaling.type",
        "llama.rope.scaling.factor",
        "general.file_type",
        "powerinfer.sparse_threshold",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
    ];
    if dense {
        want_keys.retain(|k| *k != "powerinfer.sparse_threshold");
    }
    assert_eq!(keys, want_keys);
}

#[test]
fn converts_every_outtype_and_dense() {
    let py = python();
    let c = checkpoint(py.as_deref());
    let out_dir = tempfile::tempdir().unwrap();
    for (outtype, dense) in [
        (OutType::F16, false),
        (OutType::F32, false),
        (OutType::Q8_0, false),
        (OutType::F16, true),
    ] {
        let out = out_dir.path().join(format!("m-{outtype:?}-{dense}.gguf"));
        let mut calls = 0;
        let report = convert(&opts(&c, &out, outtype, dense), &mut |_, _| calls += 1).unwrap();
        let n = expected(&c, dense).len();
        assert_eq!(report.n_tensors, n);
        assert_eq!(calls, n);
        assert_eq!(report.file_bytes, std::fs::metadata(&out).unwrap().len());
        check_file(&c, &out, outtype, dense);

        if let Some(py) = &py {
            // The PyPI gguf reader sees the same tensors, bytes and keys.
            let j = py_tool(py, &["read", out.to_str().unwrap()]);
            let f = GgufFile::open(&out).unwrap();
            assert_eq!(j["magic"], if dense { "GGUF" } else { "PWRI" });
            let keys: Vec<&str> = j["keys"]
                .as_array()
                .unwrap()
                .iter()
                .map(|k| k.as_str().unwrap())
                .collect();
            let ours: Vec<&str> = f.metadata().iter().map(|(k, _)| k).collect();
            assert_eq!(keys, ours);
            let tensors = j["tensors"].as_array().unwrap();
            assert_eq!(tensors.len(), f.tensors().len());
            for (t, info) in tensors.iter().zip(f.tensors()) {
                assert_eq!(t["name"], info.name());
                let shape: Vec<u64> = t["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| d.as_u64().unwrap())
                    .collect();
                assert_eq!(shape, info.shape(), "{}", info.name());
                assert_eq!(t["type"].as_u64().unwrap() as u32, info.type_id());
                let hex: String = f
                    .tensor_data(info.name())
                    .unwrap()
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                assert_eq!(t["hex"].as_str().unwrap(), hex, "{}", info.name());
            }
        }
    }
}

fn expect_err(c: &Checkpoint, o: &ConvertOptions, needles: &[&str]) -> String {
    let e: ConvertError = convert(o, &mut |_, _| {}).unwrap_err();
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
    let _ = c;
    no_output_left(o.out.parent().unwrap());
    msg
}

#[test]
fn bad_input_is_a_clear_error_and_leaves_nothing() {
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.powerinfer.gguf");

    // Predictors for the wrong number of layers.
    let c = checkpoint(None);
    std::fs::remove_file(c.pred.join("model_1.pt")).unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["predictor", "1 predictor layers", "2 layers"],
    );

    // A predictor with the wrong shape, and one with an unexpected entry.
    let c = checkpoint(None);
    let bad = c.pred.join("model_1.pt");
    pt::write_state_dict(
        &bad,
        &[
            (
                "fc1.weight".into(),
                PtTensor::from_f32(vec![RANK, N_EMBD + 1], &vec![0.0; RANK * (N_EMBD + 1)])
                    .unwrap(),
            ),
            (
                "fc2.weight".into(),
                PtTensor::from_f32(vec![N_FF, RANK], &vec![0.0; N_FF * RANK]).unwrap(),
            ),
        ],
    )
    .unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["model_1.pt", "fc1.weight", "shape"],
    );
    pt::write_state_dict(
        &bad,
        &[
            (
                "fc1.weight".into(),
                PtTensor::from_f32(vec![RANK, N_EMBD], &vec![0.0; RANK * N_EMBD]).unwrap(),
            ),
            (
                "fc2.weight".into(),
                PtTensor::from_f32(vec![N_FF, RANK], &vec![0.0; N_FF * RANK]).unwrap(),
            ),
            (
                "fc1.bias".into(),
                PtTensor::from_f32(vec![RANK], &[0.0; RANK]).unwrap(),
            ),
        ],
    )
    .unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["model_1.pt", "fc1.bias", "unexpected"],
    );
    // A .pt whose pickle holds a bare tensor instead of a state dict.
    pt::write_tensor(&bad, &PtTensor::from_f32(vec![2], &[1.0, 2.0]).unwrap()).unwrap();
    expect_err(&c, &opts(&c, &out, OutType::F16, false), &["model_1.pt"]);
    // Garbage instead of a zip.
    std::fs::write(&bad, b"not a torch file").unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["model_1.pt", "zip"],
    );

    // A missing shard.
    let c = checkpoint(None);
    std::fs::remove_file(c.model.join("model-00002-of-00002.safetensors")).unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["model-00002-of-00002.safetensors", "missing"],
    );

    // Shapes that disagree with config.json.
    let c = checkpoint(None);
    std::fs::write(c.model.join("config.json"), config_json(128)).unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &[
            "model-00001-of-00002.safetensors",
            "disagrees with config.json",
        ],
    );

    // Unsupported architecture.
    let c = checkpoint(None);
    std::fs::write(
        c.model.join("config.json"),
        config_json(N_EMBD).replace("\"llama\"", "\"falcon\""),
    )
    .unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["config.json", "falcon"],
    );

    // Unsupported dtype: an I32 tensor in a single-file checkpoint.
    let c = checkpoint(None);
    for s in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ] {
        std::fs::remove_file(c.model.join(s)).unwrap();
    }
    let mut all: Vec<&SrcTensor> = c.src.iter().collect();
    let odd = SrcTensor {
        name: "model.norm.weight".into(),
        shape: vec![N_EMBD],
        dtype: Dtype::I32,
        values: vec![1.0; N_EMBD],
    };
    all.retain(|t| t.name != "model.norm.weight");
    all.push(&odd);
    write_safetensors(&c.model.join("model.safetensors"), &all);
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["model.safetensors", "model.norm.weight", "I32"],
    );

    // No predictor folder for a sparse file; no tokenizer.model.
    let c = checkpoint(None);
    let mut o = opts(&c, &out, OutType::F16, false);
    o.predictor_dir = None;
    expect_err(&c, &o, &["predictor"]);
    std::fs::remove_file(c.model.join("tokenizer.model")).unwrap();
    std::fs::write(c.model.join("tokenizer.json"), "{}").unwrap();
    expect_err(
        &c,
        &opts(&c, &out, OutType::F16, false),
        &["tokenizer.json", "not"],
    );
}

#[test]
fn special_ids_follow_gguf_py_special_vocab() {
    // tokenizer_config.json names unk (found in tokenizer.json's added_tokens) and a bos that
    // is not an added token; config.json then fills bos and eos. add_bos/add_eos are copied.
    let c = checkpoint(None);
    std::fs::write(
        c.model.join("tokenizer.json"),
        r#"{"added_tokens":[{"id":0,"content":"<unk>"},{"id":2,"content":"</s>"}],"model":{"type":"BPE"}}"#,
    )
    .unwrap();
    std::fs::write(
        c.model.join("tokenizer_config.json"),
        r#"{"add_bos_token":true,"add_eos_token":false,"unk_token":{"content":"<unk>"},"bos_token":"<nope>","pad_token":null}"#,
    )
    .unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("m.gguf");
    convert(&opts(&c, &out, OutType::F16, false), &mut |_, _| {}).unwrap();
    let f = GgufFile::open(&out).unwrap();
    let m = f.metadata();
    let tail: Vec<&str> = m
        .iter()
        .map(|(k, _)| k)
        .skip_while(|k| *k != "tokenizer.ggml.token_type")
        .skip(1)
        .collect();
    assert_eq!(
        tail,
        [
            "tokenizer.ggml.unknown_token_id",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token"
        ]
    );
    assert_eq!(m.get_u32("tokenizer.ggml.unknown_token_id").unwrap(), 0);
    assert_eq!(m.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 1);
    assert!(m.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert!(!m.get_bool("tokenizer.ggml.add_eos_token").unwrap());
}

#[test]
fn bamboo_with_safetensors_predictor() {
    let c = checkpoint(None);
    std::fs::write(
        c.model.join("config.json"),
        config_json(N_EMBD).replace("\"llama\"", "\"bamboo\""),
    )
    .unwrap();
    // Layer 0's predictor as model_0.safetensors (F32, so the values are the same).
    std::fs::remove_file(c.pred.join("model_0.pt")).unwrap();
    let t: Vec<SrcTensor> = c.pred_src[0]
        .iter()
        .map(|(k, shape, v)| SrcTensor {
            name: k.clone(),
            shape: shape.clone(),
            dtype: Dtype::F32,
            values: v.clone(),
        })
        .collect();
    write_safetensors(
        &c.pred.join("model_0.safetensors"),
        &t.iter().collect::<Vec<_>>(),
    );
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("bamboo.powerinfer.gguf");
    convert(&opts(&c, &out, OutType::F32, false), &mut |_, _| {}).unwrap();
    let f = GgufFile::open(&out).unwrap();
    let m = f.metadata();
    assert_eq!(m.get_str("general.architecture").unwrap(), "bamboo");
    assert_eq!(
        m.get_u32("bamboo.feed_forward_length").unwrap(),
        N_FF as u32
    );
    assert!(!m.contains_key("llama.block_count"));
    for (key, shape, v) in &c.pred_src[0] {
        let name = format!("blk.0.{key}");
        let info = f.tensors().iter().find(|t| t.name() == name).unwrap();
        assert_eq!(info.shape(), &[shape[1] as u64, shape[0] as u64]);
        let got = dequantize_to_vec(GgmlType::F32, f.tensor_data(&name).unwrap()).unwrap();
        assert_eq!(&got, v, "{name}");
    }
}

/// Every hyper-parameter of `config.json` set to hostile values (0, 1, 3, 2³¹, 2⁴⁰, negative,
/// fractional, a string, null) and a few keys dropped, one at a time: converting gives a typed
/// error (or a file when the value happens to fit), never a panic, and a failed conversion
/// leaves no output behind.
#[test]
fn hostile_configs_are_errors_not_panics() {
    let c = checkpoint(None);
    let good: serde_json::Value = serde_json::from_str(&config_json(N_EMBD)).unwrap();
    let keys = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
        "bos_token_id",
        "model_type",
    ];
    let values = [
        serde_json::json!(0),
        serde_json::json!(1),
        serde_json::json!(3),
        serde_json::json!(1u64 << 31),
        serde_json::json!(1u64 << 40),
        serde_json::json!(-4),
        serde_json::json!(2.5),
        serde_json::json!("x"),
        serde_json::Value::Null,
        serde_json::json!({"type": "yarn", "factor": 0}),
    ];
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("out.powerinfer.gguf");
    let (mut refused, mut converted) = (0, 0);
    let mut cases: Vec<(String, Option<serde_json::Value>)> = Vec::new();
    for k in keys {
        cases.push((k.to_string(), None));
        for v in &values {
            cases.push((k.to_string(), Some(v.clone())));
        }
    }
    for (k, v) in cases {
        let mut cfg = good.clone();
        match &v {
            Some(v) => cfg[&k] = v.clone(),
            None => {
                cfg.as_object_mut().unwrap().remove(&k);
            }
        }
        std::fs::write(c.model.join("config.json"), cfg.to_string()).unwrap();
        let o = opts(&c, &out, OutType::F16, false);
        let r = std::panic::catch_unwind(|| convert(&o, &mut |_, _| {}));
        match r {
            Ok(Ok(_)) => converted += 1,
            Ok(Err(_)) => {
                refused += 1;
                no_output_left(out_dir.path());
            }
            Err(_) => panic!("config {k} = {v:?}: convert panicked"),
        }
        let _ = std::fs::remove_file(&out);
    }
    std::fs::write(c.model.join("config.json"), config_json(N_EMBD)).unwrap();
    assert!(
        refused > 0 && converted > 0,
        "{refused} refused, {converted} converted"
    );
}

#[test]
fn q4_0_outtype_and_per_layer_predictor_types() {
    // `--outtype q4_0`: PowerInfer's quantize applied to convert.py's F16 file; layer 0's
    // predictor kept in F32 by a per-layer override.
    let c = checkpoint(None);
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("m.q4_0.powerinfer.gguf");
    let mut o = opts(&c, &out, OutType::Q4_0, false);
    o.predictor_layers = vec![Some(GgmlType::F32)];
    convert(&o, &mut |_, _| {}).unwrap();
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(f.metadata().get_u32("general.file_type").unwrap(), 2);
    let round_f16 =
        |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
    for (name, ne, vals) in expected(&c, false) {
        let info = f.tensor_info(&name).unwrap();
        let want_ty = if ne.len() == 1 || name.starts_with("blk.0.fc") {
            GgmlType::F32
        } else if name == "output.weight" {
            // Rows of 64 values are not whole 256-value blocks: Q8_0 instead of Q6_K.
            GgmlType::Q8_0
        } else {
            GgmlType::Q4_0
        };
        assert_eq!(info.ggml_type(), want_ty, "{name}");
        let want: Vec<u8> = if want_ty == GgmlType::F32 {
            vals.iter().flat_map(|x| x.to_le_bytes()).collect()
        } else {
            powerinfer_gguf::quants::quantize_to_vec(want_ty, &round_f16(&vals)).unwrap()
        };
        assert!(f.tensor_data(&name).unwrap() == want.as_slice(), "{name}");
    }
}

#[test]
fn hidden_act_relu_marks_a_dense_llama_file() {
    let c = checkpoint(None);
    let out_dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(c.model.join("config.json")).unwrap();
    let with_act = |act: &str| text.replacen('{', &format!("{{\"hidden_act\":\"{act}\","), 1);
    let run = |act: Option<&str>, dense: bool| -> Result<GgufFile, String> {
        let cfg = act.map_or(text.clone(), with_act);
        std::fs::write(c.model.join("config.json"), cfg).unwrap();
        let out = out_dir
            .path()
            .join(format!("m-{}-{dense}.gguf", act.unwrap_or("none")));
        convert(&opts(&c, &out, OutType::F32, dense), &mut |_, _| {}).map_err(|e| e.to_string())?;
        Ok(GgufFile::open(&out).unwrap())
    };
    let key = powerinfer_cli::convert::FFN_ACTIVATION_KEY;
    let relu = run(Some("relu"), true).unwrap();
    assert_eq!(relu.metadata().get(key).unwrap().as_str(), Some("relu"));
    let silu = run(Some("silu"), true).unwrap();
    assert!(silu.metadata().get(key).is_none());
    // PowerInfer files always run ReLU and carry no mark.
    let sparse = run(Some("relu"), false).unwrap();
    assert!(sparse.metadata().get(key).is_none());
    let err = run(Some("silu"), false).err().unwrap();
    assert!(
        err.contains("hidden_act \"silu\"") && err.contains("--dense"),
        "{err}"
    );
    let err = run(Some("gelu"), true).err().unwrap();
    assert!(err.contains("hidden_act \"gelu\""), "{err}");
    std::fs::write(c.model.join("config.json"), &text).unwrap();

    // The engine runs the marked file with ReLU(gate) ⊙ up, the unmarked one with SiLU.
    use powerinfer_engine::model::FfnAct;
    let act_of = |name: &str| {
        let e = powerinfer_engine::Engine::load(
            out_dir.path().join(name),
            powerinfer_engine::EngineOptions::default(),
        )
        .unwrap();
        e.model().ffn_act()
    };
    assert_eq!(act_of("m-relu-true.gguf"), FfnAct::Reglu);
    assert_eq!(act_of("m-silu-true.gguf"), FfnAct::Swiglu);
}
