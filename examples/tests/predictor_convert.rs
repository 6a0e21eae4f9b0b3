//! The predictor folder `powerinfer train-predictor` writes (`model_N.safetensors` from
//! `write_predictor_dir`, `config.json` with `sparse_threshold`) is accepted by `powerinfer
//! convert`: a tiny Hugging Face checkpoint is written here (F32 safetensors, a SentencePiece
//! `tokenizer.model` from a small protobuf writer), converted with the predictors, and the
//! output checked (fc1/fc2 values and shapes, `powerinfer.sparse_threshold`), then loaded by
//! `powerinfer profile --eval-predictor`, which picks the threshold up.

use std::path::Path;
use std::process::{Command, Output};

use powerinfer_gguf::quants::dequantize_to_vec;
use powerinfer_gguf::GgufFile;
use powerinfer_predictor::predictor::{F32Predictor, FileDtype};
use powerinfer_predictor::train::write_predictor_dir;
use serde_json::{json, Value};

#[path = "support/hf_checkpoint.rs"]
mod hf_checkpoint;
use hf_checkpoint::{llama_tensor_specs, LlamaDims};

const N_EMBD: usize = 64;
const N_HEAD: usize = 4;
const N_HEAD_KV: usize = 2;
const N_FF: usize = 96;
const N_LAYER: usize = 2;
const RANK: usize = 32;

fn powerinfer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_powerinfer"))
        .args(args)
        .output()
        .expect("run powerinfer")
}

/// (piece, score, sentencepiece type).
fn pieces() -> Vec<(String, f32, u64)> {
    let mut v = vec![
        ("<unk>".to_string(), 0.0, 2),
        ("<s>".to_string(), 0.0, 3),
        ("</s>".to_string(), 0.0, 3),
        ("▁the".to_string(), -1.0, 1),
    ];
    for i in 0..8 {
        v.push((format!("▁w{i}"), -2.0 - i as f32, 1));
    }
    v
}

fn tokenizer_model() -> Vec<u8> {
    hf_checkpoint::tokenizer_model(&pieces())
}

fn values(seed: usize, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 31 + seed * 17) % 101) as f32 - 50.0) / 50.0 * scale)
        .collect()
}

/// A single-file F32 safetensors checkpoint.
fn write_model(path: &Path) {
    let dims = LlamaDims {
        n_vocab: pieces().len(),
        n_embd: N_EMBD,
        n_head: N_HEAD,
        n_head_kv: N_HEAD_KV,
        n_ff: N_FF,
        n_layer: N_LAYER,
    };
    let specs = llama_tensor_specs(&dims, false);
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (i, (name, shape)) in specs.iter().enumerate() {
        let n: usize = shape.iter().product();
        let v = if shape.len() == 1 {
            vec![1.0; n]
        } else {
            values(i, n, 0.2)
        };
        let start = data.len();
        data.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = Value::Object(header).to_string();
    while h.len() % 8 != 0 {
        h.push(' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn convert_accepts_trained_predictor_folders() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let model_dir = d.join("hf");
    std::fs::create_dir_all(&model_dir).unwrap();
    std::fs::write(
        model_dir.join("config.json"),
        json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": pieces().len(), "hidden_size": N_EMBD, "intermediate_size": N_FF,
            "num_hidden_layers": N_LAYER, "num_attention_heads": N_HEAD,
            "num_key_value_heads": N_HEAD_KV, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 256, "tie_word_embeddings": false,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"
        })
        .to_string(),
    )
    .unwrap();
    std::fs::write(model_dir.join("tokenizer.model"), tokenizer_model()).unwrap();
    write_model(&model_dir.join("model.safetensors"));

    // Predictors as train-predictor writes them (F16 files, threshold -1).
    let preds: Vec<F32Predictor> = (0..N_LAYER)
        .map(|l| {
            F32Predictor::new(
                N_EMBD,
                RANK,
                N_FF,
                values(100 + l, RANK * N_EMBD, 0.5),
                values(200 + l, N_FF * RANK, 0.5),
            )
            .unwrap()
        })
        .collect();
    let pdir = d.join("pred");
    write_predictor_dir(&pdir, &preds, -1.0, FileDtype::F16).unwrap();

    let out = d.join("m.powerinfer.gguf");
    let o = powerinfer(&[
        "convert",
        model_dir.to_str().unwrap(),
        pdir.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--outtype",
        "f32",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(
        f.metadata().get_f32("powerinfer.sparse_threshold").unwrap(),
        -1.0
    );
    for (l, p) in preds.iter().enumerate() {
        for (key, shape, want) in [
            ("fc1", [N_EMBD as u64, RANK as u64], p.fc1()),
            ("fc2", [RANK as u64, N_FF as u64], p.fc2()),
        ] {
            let name = format!("blk.{l}.{key}.weight");
            let info = f.tensors().iter().find(|t| t.name() == name).unwrap();
            assert_eq!(info.shape(), &shape);
            let got = dequantize_to_vec(info.ggml_type(), f.tensor_data(&name).unwrap()).unwrap();
            let want: Vec<f32> = want
                .iter()
                .map(|&x| half::f16::from_f32(x).to_f32())
                .collect();
            assert_eq!(got, want, "{name}");
        }
    }

    // `--outtype q4_0 --predictor-type auto`: each layer's predictor in the type the printed
    // check chose, measured against the predictor folder's own (F16-exact) values.
    let auto = d.join("m.q4_0.powerinfer.gguf");
    let o = powerinfer(&[
        "convert",
        model_dir.to_str().unwrap(),
        pdir.to_str().unwrap(),
        "-o",
        auto.to_str().unwrap(),
        "--outtype",
        "q4_0",
        "--predictor-type",
        "auto",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let f = GgufFile::open(&auto).unwrap();
    assert_eq!(f.metadata().get_u32("general.file_type").unwrap(), 2);
    for l in 0..N_LAYER {
        let row = stdout
            .lines()
            .find(|r| r.split_whitespace().next() == Some(&l.to_string()))
            .unwrap_or_else(|| panic!("no row for layer {l} in {stdout}"));
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert!(cols[2].parse::<f64>().unwrap() >= 0.99, "{row}");
        for key in ["fc1", "fc2"] {
            let name = format!("blk.{l}.{key}.weight");
            assert_eq!(f.tensor_info(&name).unwrap().ggml_type().name(), cols[1]);
        }
    }

    // The engine takes the file's threshold.
    let text = d.join("t.txt");
    std::fs::write(&text, "the w0 w1 w2 the w3 w4 the w5 w6 w7 ".repeat(20)).unwrap();
    let o = powerinfer(&[
        "profile",
        "-m",
        out.to_str().unwrap(),
        "-f",
        text.to_str().unwrap(),
        "--eval-predictor",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["threshold"].as_f64(), Some(-1.0));
    assert_eq!(v["layers"].as_array().unwrap().len(), N_LAYER);
}
