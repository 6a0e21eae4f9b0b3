//! `powerinfer convert`: a Hugging Face checkpoint plus a predictor folder into the PowerInfer
//! file PowerInfer's converters write (or, with `dense`, a plain GGUF file with `ffn_down`
//! kept and no predictor, as `convert-dense.py` writes for LLaMA). Families ([`HfArch`]):
//! LLaMA and Bamboo (`model_type` `llama` / `bamboo`) as PowerInfer's `convert.py` converts
//! them; ReluFalcon (`FalconForCausalLM`, `RWForCausalLM`; Falcon-7B and Falcon-40B layouts)
//! and OPT (`OPTForCausalLM`) as its `convert-hf-to-powerinfer-gguf.py` does.
//!
//! # LLaMA and Bamboo (as convert.py does it)
//!
//! - **Metadata**, in this order: `general.architecture` (`llama`, or `bamboo` when
//!   `model_type` is `bamboo`), `general.name` (`LLaMA v2` when the context is 4096, else the
//!   model folder's name), `{arch}.context_length`, `.embedding_length`, `.block_count`,
//!   `.feed_forward_length`, `.rope.dimension_count`, `.attention.head_count`,
//!   `.attention.head_count_kv`, `.attention.layer_norm_rms_epsilon`, then if present
//!   `.rope.freq_base`, `.rope.scaling.type` + `.rope.scaling.factor` (linear only),
//!   `general.file_type` (0 f32, 1 f16, 7 q8_0, 2 q4_0), `powerinfer.sparse_threshold` (from the
//!   predictor folder's `config.json`, sparse files only), the SentencePiece vocabulary
//!   (`tokenizer.ggml.model` = `llama`, `.tokens`, `.scores`, `.token_type`), the special
//!   ids gguf-py's `SpecialVocab` takes from `tokenizer_config.json` + `tokenizer.json`, then
//!   `config.json` (`bos`, `eos`, `unk`, `sep`, `pad`), and `add_bos_token` / `add_eos_token`.
//! - **Tensors**, in the order of the safetensors headers (shard by shard), then the predictor
//!   tensors layer by layer: HF names mapped to ggml names; `q_proj` / `k_proj` rows permuted
//!   for ggml's RoPE ([`permute_rows`]); `self_attn.rotary_emb.inv_freq` skipped; in sparse
//!   files `mlp.down_proj` becomes `blk.N.ffn_down_t.weight`, transposed, and `model_N.pt`'s
//!   `fc1.weight` / `fc2.weight` become `blk.N.fc1.weight` / `blk.N.fc2.weight`.
//!
//! # Falcon and OPT (as convert-hf-to-powerinfer-gguf.py does it)
//!
//! - **Metadata**, in this order: `general.architecture`, `general.name` (`Falcon` / `opt`),
//!   `{arch}.context_length` (falcon 2048; opt `max_position_embeddings + 2`, the rows of its
//!   position table, which is the 2050 the script hard-codes for every released OPT), then for
//!   falcon `.tensor_data_layout` = `jploski`, `.embedding_length`, `.feed_forward_length`
//!   (4 · hidden), `.block_count`, `.attention.head_count`, `.attention.head_count_kv`,
//!   `.attention.layer_norm_epsilon`; for opt `.embedding_length`, `.block_count`,
//!   `.feed_forward_length` (`ffn_dim`), `.attention.head_count`. Then `general.file_type`,
//!   `powerinfer.sparse_threshold` and the byte-level BPE vocabulary of `tokenizer.json`
//!   ([`BpeVocab`]: `tokenizer.ggml.model` = `gpt2`, `.tokens`, `.token_type`, `.merges`), then
//!   the special ids and `add_*_token` flags as above.
//! - **Tensors**: first the predictor tensors layer by layer (`fc1`, then `fc2`), then the
//!   model tensors in the order of the safetensors headers, named by gguf-py's tensor map:
//!   Falcon `word_embeddings` → `token_embd`, `input_layernorm` (7B) or `ln_mlp` (40B) →
//!   `attn_norm`, `ln_attn` (40B) → `attn_norm_2`, `self_attention.query_key_value` →
//!   `attn_qkv` regrouped into the `jploski` layout ([`regroup_qkv`]), `self_attention.dense` →
//!   `attn_output`, `mlp.dense_h_to_4h` → `ffn_up`, `mlp.dense_4h_to_h` → `ffn_down_t`
//!   (transposed; `ffn_down` as is in dense files), `ln_f` → `output_norm`, `lm_head` →
//!   `output`; OPT (`model.decoder.` or `decoder.` names) `embed_tokens`, `embed_positions` →
//!   `position_embd`, per layer `self_attn_layer_norm` → `attn_norm`, `q/k/v/out_proj` →
//!   `attn_q/k/v/output`, `final_layer_norm` → `ffn_norm`, `fc1` → `ffn_up`, `fc2` →
//!   `ffn_down_t` (weight transposed, bias renamed as is), all with their biases, the final
//!   `final_layer_norm` → `output_norm`.
//! - Where this converter differs from the script on purpose: `RWForCausalLM` is written as
//!   `falcon` (the script names it `llama`, and a falcon tensor set under that name does not
//!   load); a Falcon checkpoint without `lm_head.weight` (tied head) gets the token embedding
//!   again as `output.weight` (PowerInfer's falcon loader requires one; the script writes
//!   none); OPT's `lm_head.weight` is not written (the head is the token embedding; PowerInfer's
//!   loader would refuse the extra tensor); `model.decoder.` names are accepted besides the
//!   `decoder.` ones the script's map knows; merges stored as `[left, right]` pairs are joined
//!   (the script's gguf-py only reads string merges); special ids at or above `vocab_size` are
//!   dropped (the script passes no vocabulary size and keeps them). Configurations PowerInfer's
//!   graphs cannot run (ALiBi or sequential Falcon, Falcon or OPT without ReLU, post-norm or
//!   projected-embedding OPT, ...) are refused rather than converted.
//!
//! # Common to all
//!
//! - **Types**: 1-D tensors F32; 2-D tensors F32, F16, Q8_0 or Q4_0 (`outtype`; the HF script
//!   itself knows only f32 and f16); Q4_0 is what PowerInfer's `quantize` makes of the F16
//!   file (values rounded to F16, ggml's reference quantizer, the output head Q6_K — Q8_0 for
//!   falcon or rows that are not whole 256-value blocks —, rows that are not whole blocks F16);
//!   a layer's predictor may get its own type ([`ConvertOptions::predictor_layers`]). Q8_0 is
//!   convert.py's own numpy quantizer ([`quantize_q8_0_convert_py`]), which divides by the
//!   scale and rounds half to even (ggml's reference multiplies by the inverse and rounds half
//!   away from zero).
//! - **Magic** `PWRI` (sparse) or `GGUF` (dense).
//!
//! Input is read one tensor at a time (positioned reads of the safetensors shards), so memory
//! stays at about one tensor in f32. The output goes to a temporary file renamed into place on
//! success: a failed conversion leaves nothing behind.

pub mod bpe;
pub mod config;
pub mod spm;

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use powerinfer_gguf::quants::{bf16_to_f32, f16_bits_to_f32, f32_to_f16_bits, quantize_to_vec};
use powerinfer_gguf::{FileKind, GgmlType, GgufError, GgufWriter, Value};
use powerinfer_predictor::pt::{self, PtDtype};
use rayon::prelude::*;
use serde_json::Value as Json;

use powerinfer_predictor::predictor::predictor_layer;

pub use bpe::BpeVocab;
pub use config::{HfArch, HfConfig};
pub use spm::SpmModel;

/// Why a conversion failed. Every variant names the file (and the tensor, where one is at
/// fault).
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file or folder holds something the converter cannot use.
    #[error("{path}: {message}")]
    Input {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// One tensor is missing, misshapen or of an unsupported type.
    #[error("{path}: tensor {tensor}: {message}")]
    Tensor {
        /// The file that holds (or should hold) it.
        path: PathBuf,
        /// The tensor's name in that file.
        tensor: String,
        /// What is wrong.
        message: String,
    },
    /// Writing the output failed.
    #[error("writing the output: {0}")]
    Gguf(#[from] GgufError),
}

type Result<T> = std::result::Result<T, ConvertError>;

fn input_err(path: &Path, message: impl Into<String>) -> ConvertError {
    ConvertError::Input {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn tensor_err(path: &Path, tensor: &str, message: impl Into<String>) -> ConvertError {
    ConvertError::Tensor {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        message: message.into(),
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ConvertError + '_ {
    move |source| ConvertError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The type of the 2-D weights (convert.py's `--outtype`); 1-D tensors are always F32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutType {
    /// Everything F32 (`general.file_type` 0).
    F32,
    /// 2-D weights F16 (`general.file_type` 1, the default).
    F16,
    /// 2-D weights Q8_0 with convert.py's quantizer (`general.file_type` 7).
    Q8_0,
    /// 2-D weights Q4_0 with ggml's reference quantizer, as PowerInfer's `quantize` makes them
    /// from an F16 file (`general.file_type` 2; predictors Q4_0 as PowerInfer stores them;
    /// rows that are not whole blocks F16).
    Q4_0,
}

impl OutType {
    /// Parses `f32`, `f16`, `q8_0` or `q4_0`.
    pub fn from_name(name: &str) -> Option<OutType> {
        match name {
            "f32" => Some(OutType::F32),
            "f16" => Some(OutType::F16),
            "q8_0" => Some(OutType::Q8_0),
            "q4_0" => Some(OutType::Q4_0),
            _ => None,
        }
    }

    /// The llama.cpp `general.file_type` convert.py writes.
    pub fn file_type(self) -> u32 {
        match self {
            OutType::F32 => 0,
            OutType::F16 => 1,
            OutType::Q8_0 => 7,
            OutType::Q4_0 => 2,
        }
    }

    /// The ggml type of 2-D tensors.
    pub fn matrix_type(self) -> GgmlType {
        match self {
            OutType::F32 => GgmlType::F32,
            OutType::F16 => GgmlType::F16,
            OutType::Q8_0 => GgmlType::Q8_0,
            OutType::Q4_0 => GgmlType::Q4_0,
        }
    }
}

/// What to convert and where to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvertOptions {
    /// The Hugging Face model folder (`config.json`, safetensors shards, `tokenizer.model` for
    /// llama/bamboo or `tokenizer.json` for falcon/opt).
    pub model_dir: PathBuf,
    /// The predictor folder (`model_N.pt` or `model_N.safetensors`, optional `config.json`);
    /// required unless `dense`.
    pub predictor_dir: Option<PathBuf>,
    /// The output file.
    pub out: PathBuf,
    /// Type of the 2-D weights.
    pub outtype: OutType,
    /// Write a dense GGUF file (`ffn_down` kept, no predictor) as convert-dense.py does.
    pub dense: bool,
    /// Per layer, the type of that layer's predictor tensors instead of `outtype`'s (layers
    /// past the end, and `None` entries, keep `outtype`'s); e.g. the F32 fallback of a layer
    /// whose predictor did not survive storage
    /// ([`predictor_storage`](crate::predictor_storage)).
    pub predictor_layers: Vec<Option<GgmlType>>,
}

/// What [`convert`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConvertReport {
    /// `general.architecture`.
    pub arch: String,
    /// Layers.
    pub n_layer: usize,
    /// Tensors written.
    pub n_tensors: usize,
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Size of the output file in bytes.
    pub file_bytes: u64,
    /// Its magic.
    pub kind: FileKind,
}

// ------------------------------------------------------------------------------------------
// Sources

/// Element type of a source tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SrcDtype {
    F32,
    F16,
    Bf16,
}

impl SrcDtype {
    fn size(self) -> usize {
        match self {
            SrcDtype::F32 => 4,
            SrcDtype::F16 | SrcDtype::Bf16 => 2,
        }
    }

    fn decode(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            SrcDtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            SrcDtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
            SrcDtype::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| bf16_to_f32(half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))))
                .collect(),
        }
    }
}

/// Where a tensor's data lives.
#[derive(Clone, Debug)]
enum Src {
    /// A safetensors file: absolute byte offset of the data.
    Safetensors {
        file: PathBuf,
        name: String,
        offset: u64,
        dtype: SrcDtype,
    },
    /// A `.pt` state dict entry (read again when written).
    Pt { file: PathBuf, key: String },
}

impl Src {
    fn file(&self) -> &Path {
        match self {
            Src::Safetensors { file, .. } | Src::Pt { file, .. } => file,
        }
    }

    fn key(&self) -> &str {
        match self {
            Src::Safetensors { name, .. } => name,
            Src::Pt { key, .. } => key,
        }
    }
}

/// One tensor listed in a source file: name, torch shape (row-major, outermost first), data.
#[derive(Clone, Debug)]
struct Listed {
    name: String,
    shape: Vec<usize>,
    src: Src,
}

/// Lists the tensors of a safetensors file in header order, checking the header.
fn list_safetensors(path: &Path) -> Result<Vec<Listed>> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let file_len = f.metadata().map_err(io_err(path))?.len();
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| input_err(path, "too short for a safetensors file"))?;
    let n = u64::from_le_bytes(len);
    if n > 100 << 20 || n.saturating_add(8) > file_len {
        return Err(input_err(
            path,
            format!("safetensors header length {n} does not fit the file ({file_len} bytes)"),
        ));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io_err(path))?;
    let json: Json = serde_json::from_slice(&header)
        .map_err(|e| input_err(path, format!("safetensors header is not JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| input_err(path, "safetensors header is not a JSON object"))?;
    let data_start = 8 + n;
    let data_len = file_len - data_start;
    let mut out = Vec::new();
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let bad = |m: String| tensor_err(path, name, m);
        let dtype = match info.get("dtype").and_then(Json::as_str) {
            Some("F32") => SrcDtype::F32,
            Some("F16") => SrcDtype::F16,
            Some("BF16") => SrcDtype::Bf16,
            Some(d) => {
                return Err(bad(format!(
                    "dtype {d} is not supported (F32, F16 and BF16 are)"
                )))
            }
            None => return Err(bad("no dtype".into())),
        };
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(Json::as_array)
            .and_then(|a| {
                a.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            })
            .ok_or_else(|| bad("no valid shape".into()))?;
        let offs: Vec<u64> = info
            .get("data_offsets")
            .and_then(Json::as_array)
            .and_then(|a| a.iter().map(Json::as_u64).collect())
            .filter(|v: &Vec<u64>| v.len() == 2)
            .ok_or_else(|| bad("no valid data_offsets".into()))?;
        let numel = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad("shape overflows".into()))?;
        let want = numel.saturating_mul(dtype.size() as u64);
        if offs[0] > offs[1] || offs[1] > data_len || offs[1] - offs[0] != want {
            return Err(bad(format!(
                "data_offsets {offs:?} do not hold {want} bytes inside the {data_len} data bytes"
            )));
        }
        out.push(Listed {
            name: name.clone(),
            shape,
            src: Src::Safetensors {
                file: path.to_path_buf(),
                name: name.clone(),
                offset: data_start + offs[0],
                dtype,
            },
        });
    }
    Ok(out)
}

fn pt_dtype_ok(d: PtDtype) -> bool {
    matches!(d, PtDtype::F32 | PtDtype::F16 | PtDtype::BF16)
}

/// Lists a `.pt` state dict (shapes only; the data is read again when written).
fn list_pt(path: &Path) -> Result<Vec<Listed>> {
    let sd = pt::read_state_dict(path).map_err(|e| input_err(path, e.to_string()))?;
    sd.into_iter()
        .map(|(key, t)| {
            if !pt_dtype_ok(t.dtype()) {
                return Err(tensor_err(
                    path,
                    &key,
                    format!(
                        "dtype {:?} is not supported (float, half, bfloat16 are)",
                        t.dtype()
                    ),
                ));
            }
            Ok(Listed {
                name: key.clone(),
                shape: t.shape().to_vec(),
                src: Src::Pt {
                    file: path.to_path_buf(),
                    key,
                },
            })
        })
        .collect()
}

/// Reads a listed tensor as f32 values (row-major).
fn read_values(
    src: &Src,
    numel: usize,
    pt_cache: &mut Option<(PathBuf, pt::PtObject)>,
) -> Result<Vec<f32>> {
    match src {
        Src::Safetensors {
            file,
            offset,
            dtype,
            ..
        } => {
            let bytes = read_raw(file, *offset, numel * dtype.size())?;
            Ok(dtype.decode(&bytes))
        }
        Src::Pt { file, key } => {
            if pt_cache.as_ref().is_none_or(|(p, _)| p != file) {
                let obj = pt::read(file).map_err(|e| input_err(file, e.to_string()))?;
                *pt_cache = Some((file.clone(), obj));
            }
            let Some((_, pt::PtObject::Dict(entries))) = pt_cache.as_ref() else {
                return Err(input_err(file, "not a state dict"));
            };
            let t = entries
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, t)| t)
                .ok_or_else(|| tensor_err(file, key, "vanished from the file"))?;
            if t.numel() != numel {
                return Err(tensor_err(file, key, "changed size while converting"));
            }
            Ok(t.to_f32_vec())
        }
    }
}

// ------------------------------------------------------------------------------------------
// Transformations

/// convert.py's `permute` for RoPE: the rows of a `[n_head·head_dim, cols]` matrix viewed as
/// `(n_head, 2, head_dim/2, cols)`, axes 1 and 2 swapped, flattened back. Output row
/// `h·head_dim + 2i + j` is input row `h·head_dim + j·head_dim/2 + i`.
pub fn permute_rows<T: Copy + Default>(
    values: &[T],
    rows: usize,
    row_len: usize,
    n_head: usize,
) -> Vec<T> {
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![T::default(); values.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let dst = h * hd + 2 * i + j;
                let src = h * hd + j * half + i;
                out[dst * row_len..(dst + 1) * row_len]
                    .copy_from_slice(&values[src * row_len..(src + 1) * row_len]);
            }
        }
    }
    out
}

fn read_raw(file: &Path, offset: u64, n: usize) -> Result<Vec<u8>> {
    let mut f = File::open(file).map_err(io_err(file))?;
    f.seek(SeekFrom::Start(offset)).map_err(io_err(file))?;
    let mut bytes = vec![0u8; n];
    f.read_exact(&mut bytes).map_err(io_err(file))?;
    Ok(bytes)
}

/// [`transpose`] on raw elements of `es` bytes.
fn transpose_raw(bytes: &[u8], rows: usize, cols: usize, es: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let d = (c * rows + r) * es;
            let s = (r * cols + c) * es;
            out[d..d + es].copy_from_slice(&bytes[s..s + es]);
        }
    }
    out
}

/// Transposes a row-major `[rows, cols]` matrix.
pub fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// PowerInfer's Falcon QKV regrouping (the `jploski` tensor data layout): the rows of a fused
/// `query_key_value` weight come as `n_head_kv` groups of `n_head / n_head_kv` query heads, one
/// key head and one value head (`head_dim` rows each); they leave as all query heads, then all
/// key heads, then all value heads, each in group order. `values` holds the rows, `row_len`
/// elements each (any element type, so raw bytes work too).
pub fn regroup_qkv<T: Copy>(
    values: &[T],
    row_len: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
) -> Vec<T> {
    let group = n_head / n_head_kv;
    let head = head_dim * row_len;
    let mut out = Vec::with_capacity(values.len());
    for dst in 0..n_head + 2 * n_head_kv {
        let src = if dst < n_head {
            (dst / group) * (group + 2) + dst % group
        } else if dst < n_head + n_head_kv {
            (dst - n_head) * (group + 2) + group
        } else {
            (dst - n_head - n_head_kv) * (group + 2) + group + 1
        };
        out.extend_from_slice(&values[src * head..(src + 1) * head]);
    }
    out
}

/// convert.py's Q8_0 quantizer (numpy): per block of 32, `d = max|x| / 127` (f32),
/// `q = round_half_even(x / d)` (0 where `d` is 0), `d` stored as F16. `values.len()` must be
/// a multiple of 32.
pub fn quantize_q8_0_convert_py(values: &[f32]) -> Vec<u8> {
    const BLOCKS: usize = 4096;
    let mut out = vec![0u8; values.len() / 32 * 34];
    out.par_chunks_mut(34 * BLOCKS)
        .zip(values.par_chunks(32 * BLOCKS))
        .for_each(|(out, values)| {
            for (o, block) in out.chunks_exact_mut(34).zip(values.chunks_exact(32)) {
                let amax = block.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
                let d = amax / 127.0f32;
                o[..2].copy_from_slice(&f32_to_f16_bits(d).to_le_bytes());
                for (q, &x) in o[2..].iter_mut().zip(block) {
                    let v = if d == 0.0 {
                        0.0
                    } else {
                        (x / d).round_ties_even()
                    };
                    *q = v as i8 as u8;
                }
            }
        });
    out
}

fn encode(values: &[f32], ty: GgmlType) -> Vec<u8> {
    match ty {
        GgmlType::F16 => {
            let mut out = vec![0u8; values.len() * 2];
            out.par_chunks_mut(1 << 16)
                .zip(values.par_chunks(1 << 15))
                .for_each(|(o, v)| {
                    for (o, &x) in o.chunks_exact_mut(2).zip(v) {
                        o.copy_from_slice(&f32_to_f16_bits(x).to_le_bytes());
                    }
                });
            out
        }
        GgmlType::Q8_0 => quantize_q8_0_convert_py(values),
        GgmlType::F32 => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
        // Other types are planned only for rows of whole blocks.
        ty => quantize_to_vec(ty, values).expect("rows planned as whole blocks"),
    }
}

// ------------------------------------------------------------------------------------------
// Planning

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    None,
    /// convert.py's RoPE permutation with this many heads ([`permute_rows`]).
    Permute(usize),
    /// Transposed (`ffn_down` in sparse files).
    Transpose,
    /// Falcon's fused QKV regrouped ([`regroup_qkv`]): (n_head, n_head_kv, head_dim).
    Regroup(usize, usize, usize),
}

struct Planned {
    name: String,
    listed: Listed,
    op: Op,
    ne: Vec<u64>,
    ty: GgmlType,
}

/// Finds the safetensors shards of a model folder, in order.
fn find_shards(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    let mut firsts = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(io_err(dir))?;
    for e in entries {
        let e = e.map_err(io_err(dir))?;
        let name = e.file_name().to_string_lossy().into_owned();
        if let Some(rest) = name.strip_prefix("model-00001-of-") {
            if let Some(total) = rest.strip_suffix(".safetensors") {
                firsts.push(total.to_string());
            }
        }
    }
    firsts.sort();
    let have_single = single.is_file();
    match (have_single, firsts.len()) {
        (true, 0) => Ok(vec![single]),
        (false, 1) => {
            let total = &firsts[0];
            let n: usize = total.parse().map_err(|_| {
                input_err(dir, format!("cannot read the shard count of model-00001-of-{total}.safetensors"))
            })?;
            let mut shards = Vec::with_capacity(n);
            for i in 1..=n {
                let p = dir.join(format!("model-{i:05}-of-{total}.safetensors"));
                if !p.is_file() {
                    return Err(input_err(&p, format!("missing shard {i} of {n}")));
                }
                shards.push(p);
            }
            Ok(shards)
        }
        (false, 0) => Err(input_err(
            dir,
            "no model.safetensors or model-00001-of-N.safetensors (PyTorch .bin checkpoints are not supported)",
        )),
        _ => Err(input_err(
            dir,
            "found more than one model (model.safetensors and/or several model-00001-of-N.safetensors)",
        )),
    }
}

/// Checks `model.safetensors.index.json`, if present, against the shards found.
fn check_index(dir: &Path, listed: &[Listed]) -> Result<()> {
    let path = dir.join("model.safetensors.index.json");
    if !path.is_file() {
        return Ok(());
    }
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let json: Json =
        serde_json::from_str(&text).map_err(|e| input_err(&path, format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(Json::as_object)
        .ok_or_else(|| input_err(&path, "no weight_map object"))?;
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| tensor_err(&path, tensor, "weight_map entry is not a file name"))?;
        let shard = dir.join(file);
        if !shard.is_file() {
            return Err(tensor_err(
                &path,
                tensor,
                format!("its shard {file} is missing"),
            ));
        }
        if !listed
            .iter()
            .any(|l| &l.name == tensor && l.src.file() == shard.as_path())
        {
            return Err(tensor_err(
                &shard,
                tensor,
                "listed in the index but not in this shard",
            ));
        }
    }
    Ok(())
}

/// A mapped tensor: ggml name, expected torch shape, transformation; `None` = skipped.
type Mapped = Option<(String, Vec<usize>, Op)>;

/// The ggml name of an HF tensor and its expected torch shape; `Ok(None)` = skipped.
fn map_name(name: &str, c: &HfConfig, dense: bool) -> std::result::Result<Mapped, String> {
    match c.arch {
        HfArch::Llama | HfArch::Bamboo => map_llama(name, c, dense),
        HfArch::Falcon => map_falcon(name, c, dense),
        HfArch::Opt => map_opt(name, c, dense),
    }
}

/// `{prefix}{layer}.{part}` split into the layer (checked against `num_hidden_layers`) and
/// the part.
fn layer_part<'a>(
    name: &'a str,
    prefix: &str,
    c: &HfConfig,
) -> std::result::Result<(usize, &'a str), String> {
    let unexpected = || unexpected_name(c);
    let rest = name.strip_prefix(prefix).ok_or_else(unexpected)?;
    let (idx, part) = rest.split_once('.').ok_or_else(unexpected)?;
    let l: usize = idx.parse().map_err(|_| unexpected())?;
    if l >= c.n_layer {
        return Err(format!(
            "layer {l} is beyond num_hidden_layers {}",
            c.n_layer
        ));
    }
    Ok((l, part))
}

fn unexpected_name(c: &HfConfig) -> String {
    format!(
        "unexpected tensor name (not in PowerInfer's {} tensor map)",
        c.arch.name()
    )
}

/// gguf-py's tensor map for `falcon` (7B style `input_layernorm`, 40B style `ln_mlp` →
/// `attn_norm` and `ln_attn` → `attn_norm_2`), the fused QKV regrouped, `dense_4h_to_h`
/// transposed into `ffn_down_t` in sparse files.
fn map_falcon(name: &str, c: &HfConfig, dense: bool) -> std::result::Result<Mapped, String> {
    let (e, ff, v, kv) = (c.n_embd, c.n_ff, c.n_vocab, c.n_embd_kv());
    let top = match name {
        "transformer.word_embeddings.weight" => Some(("token_embd.weight", vec![v, e])),
        "transformer.ln_f.weight" => Some(("output_norm.weight", vec![e])),
        "transformer.ln_f.bias" => Some(("output_norm.bias", vec![e])),
        "lm_head.weight" => Some(("output.weight", vec![v, e])),
        _ => None,
    };
    if let Some((n, s)) = top {
        return Ok(Some((n.to_string(), s, Op::None)));
    }
    let (l, part) = layer_part(name, "transformer.h.", c)?;
    let (short, suffix) = part.rsplit_once('.').unwrap_or((part, ""));
    let (short, shape, op) = match (short, suffix) {
        ("input_layernorm" | "ln_mlp", "weight" | "bias") => ("attn_norm", vec![e], Op::None),
        ("ln_attn", "weight" | "bias") => ("attn_norm_2", vec![e], Op::None),
        ("self_attention.query_key_value", "weight") => (
            "attn_qkv",
            vec![e.saturating_add(kv.saturating_mul(2)), e],
            Op::Regroup(c.n_head, c.n_head_kv, c.head_dim()),
        ),
        ("self_attention.dense", "weight") => ("attn_output", vec![e, e], Op::None),
        ("mlp.dense_h_to_4h", "weight") => ("ffn_up", vec![ff, e], Op::None),
        ("mlp.dense_4h_to_h", "weight") if dense => ("ffn_down", vec![e, ff], Op::None),
        ("mlp.dense_4h_to_h", "weight") => ("ffn_down_t", vec![e, ff], Op::Transpose),
        // A rotary buffer some checkpoints store; derived from the head size.
        (_, "inv_freq") => return Ok(None),
        _ => return Err(unexpected_name(c)),
    };
    Ok(Some((format!("blk.{l}.{short}.{suffix}"), shape, op)))
}

/// gguf-py's tensor map for `opt` (names with or without the `model.` prefix), biases
/// included; `fc2` → `ffn_down_t` transposed in sparse files, its bias renamed
/// `ffn_down_t.bias` too (PowerInfer renames by substring); `lm_head.weight` skipped (OPT's
/// head is the token embedding, which PowerInfer's `opt` graph reads; its loader would refuse
/// the extra `output.weight` PowerInfer's script writes from it).
fn map_opt(name: &str, c: &HfConfig, dense: bool) -> std::result::Result<Mapped, String> {
    let (e, ff, v) = (c.n_embd, c.n_ff, c.n_vocab);
    if name == "lm_head.weight" {
        return Ok(None);
    }
    let unexpected = || unexpected_name(c);
    let rest = name
        .strip_prefix("model.decoder.")
        .or_else(|| name.strip_prefix("decoder."))
        .ok_or_else(unexpected)?;
    let top = match rest {
        "embed_tokens.weight" => Some(("token_embd.weight", vec![v, e])),
        "embed_positions.weight" => Some(("position_embd.weight", vec![c.n_ctx, e])),
        "final_layer_norm.weight" => Some(("output_norm.weight", vec![e])),
        "final_layer_norm.bias" => Some(("output_norm.bias", vec![e])),
        _ => None,
    };
    if let Some((n, s)) = top {
        return Ok(Some((n.to_string(), s, Op::None)));
    }
    let (l, part) = layer_part(rest, "layers.", c)?;
    let (short, suffix) = part.rsplit_once('.').ok_or_else(unexpected)?;
    let down = if dense { "ffn_down" } else { "ffn_down_t" };
    let (short, shape, op) = match (short, suffix) {
        ("self_attn_layer_norm", _) => ("attn_norm", vec![e], Op::None),
        ("self_attn.q_proj", "weight") => ("attn_q", vec![e, e], Op::None),
        ("self_attn.k_proj", "weight") => ("attn_k", vec![e, e], Op::None),
        ("self_attn.v_proj", "weight") => ("attn_v", vec![e, e], Op::None),
        ("self_attn.out_proj", "weight") => ("attn_output", vec![e, e], Op::None),
        ("self_attn.q_proj", _) => ("attn_q", vec![e], Op::None),
        ("self_attn.k_proj", _) => ("attn_k", vec![e], Op::None),
        ("self_attn.v_proj", _) => ("attn_v", vec![e], Op::None),
        ("self_attn.out_proj", _) => ("attn_output", vec![e], Op::None),
        ("final_layer_norm", _) => ("ffn_norm", vec![e], Op::None),
        ("fc1", "weight") => ("ffn_up", vec![ff, e], Op::None),
        ("fc1", _) => ("ffn_up", vec![ff], Op::None),
        ("fc2", "weight") if dense => (down, vec![e, ff], Op::None),
        ("fc2", "weight") => (down, vec![e, ff], Op::Transpose),
        ("fc2", _) => (down, vec![e], Op::None),
        _ => return Err(unexpected()),
    };
    if suffix != "weight" && suffix != "bias" {
        return Err(unexpected());
    }
    Ok(Some((format!("blk.{l}.{short}.{suffix}"), shape, op)))
}

/// convert.py's tensor map for `llama` / `bamboo`.
fn map_llama(name: &str, c: &HfConfig, dense: bool) -> std::result::Result<Mapped, String> {
    let (e, ff, v, kv) = (c.n_embd, c.n_ff, c.n_vocab, c.n_embd_kv());
    let top = match name {
        "model.embed_tokens.weight" => Some(("token_embd.weight".to_string(), vec![v, e])),
        "model.norm.weight" => Some(("output_norm.weight".to_string(), vec![e])),
        "lm_head.weight" => Some(("output.weight".to_string(), vec![v, e])),
        _ => None,
    };
    if let Some((n, s)) = top {
        return Ok(Some((n, s, Op::None)));
    }
    let rest = name
        .strip_prefix("model.layers.")
        .ok_or_else(|| "unexpected tensor name".to_string())?;
    let (idx, part) = rest
        .split_once('.')
        .ok_or_else(|| "unexpected tensor name".to_string())?;
    let l: usize = idx
        .parse()
        .map_err(|_| "unexpected tensor name".to_string())?;
    if l >= c.n_layer {
        return Err(format!(
            "layer {l} is beyond num_hidden_layers {}",
            c.n_layer
        ));
    }
    let (short, shape, op) = match part {
        "input_layernorm.weight" => ("attn_norm", vec![e], Op::None),
        "self_attn.q_proj.weight" => ("attn_q", vec![e, e], Op::Permute(c.n_head)),
        "self_attn.k_proj.weight" => ("attn_k", vec![kv, e], Op::Permute(c.n_head_kv)),
        "self_attn.v_proj.weight" => ("attn_v", vec![kv, e], Op::None),
        "self_attn.o_proj.weight" => ("attn_output", vec![e, e], Op::None),
        "post_attention_layernorm.weight" => ("ffn_norm", vec![e], Op::None),
        "mlp.gate_proj.weight" => ("ffn_gate", vec![ff, e], Op::None),
        "mlp.up_proj.weight" => ("ffn_up", vec![ff, e], Op::None),
        "mlp.down_proj.weight" if dense => ("ffn_down", vec![e, ff], Op::None),
        "mlp.down_proj.weight" => ("ffn_down_t", vec![e, ff], Op::Transpose),
        "self_attn.rotary_emb.inv_freq" => return Ok(None),
        _ => return Err("unexpected tensor name".to_string()),
    };
    Ok(Some((format!("blk.{l}.{short}.weight"), shape, op)))
}

/// The metadata key that marks a dense `llama` file whose FFN is ReLU(gate) ⊙ up (value
/// `relu`). PowerInfer has none: its dense `llama` graph always uses SiLU, and only the
/// architecture name `bamboo` selects ReLU, so a dense ReLU-LLaMA file is ambiguous without it.
pub const FFN_ACTIVATION_KEY: &str = "powerinfer.ffn_activation";

/// Refuses a `hidden_act` this converter cannot write faithfully: a dense file runs SiLU or
/// ReLU, a PowerInfer file always ReLU.
fn check_activation(dir: &Path, cfg: &HfConfig, dense: bool) -> Result<()> {
    let act = cfg.hidden_act.as_deref();
    let ok = match act {
        None | Some("relu" | "fatrelu") => true,
        Some("silu" | "swish") => dense,
        Some(_) => false,
    };
    if ok {
        return Ok(());
    }
    let act = act.unwrap_or_default();
    Err(input_err(
        &dir.join("config.json"),
        if dense {
            format!("hidden_act {act:?} is not supported (silu, relu, fatrelu are)")
        } else {
            format!(
                "hidden_act {act:?}: a PowerInfer file runs its FFN with ReLU, so only a ReLU \
                 checkpoint (relu, fatrelu) converts to one; use --dense for this model"
            )
        },
    ))
}

/// The predictor files `model_0`, `model_1`, … (`.pt` or `.safetensors`) of a predictor folder,
/// until the first gap.
pub fn find_predictors(dir: &Path) -> Result<Vec<PathBuf>> {
    if !dir.is_dir() {
        return Err(input_err(dir, "the predictor folder does not exist"));
    }
    let mut out = Vec::new();
    loop {
        let i = out.len();
        let pt = dir.join(format!("model_{i}.pt"));
        let st = dir.join(format!("model_{i}.safetensors"));
        match (pt.is_file(), st.is_file()) {
            (true, false) => out.push(pt),
            (false, true) => out.push(st),
            (true, true) => {
                return Err(input_err(
                    dir,
                    format!("both model_{i}.pt and model_{i}.safetensors exist"),
                ))
            }
            (false, false) => return Ok(out),
        }
    }
}

fn read_sparse_threshold(dir: &Path) -> Result<Option<f32>> {
    let path = dir.join("config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let json: Json =
        serde_json::from_str(&text).map_err(|e| input_err(&path, format!("not JSON: {e}")))?;
    match json.get("sparse_threshold") {
        None | Some(Json::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| input_err(&path, "sparse_threshold is not a number")),
    }
}

/// The vocabulary a checkpoint converts with.
enum Vocab {
    /// SentencePiece (`tokenizer.model`): llama, bamboo.
    Spm(SpmModel),
    /// Byte-level BPE (`tokenizer.json`): falcon, opt.
    Bpe(BpeVocab),
}

impl Vocab {
    fn len(&self) -> usize {
        match self {
            Vocab::Spm(m) => m.tokens.len(),
            Vocab::Bpe(b) => b.tokens.len(),
        }
    }
}

fn find_vocab(dir: &Path, cfg: &HfConfig) -> Result<(PathBuf, Vocab)> {
    if cfg.arch.hf_script() {
        return find_bpe(dir, cfg.n_vocab).map(|(p, v)| (p, Vocab::Bpe(v)));
    }
    let mut candidates = vec![dir.join("tokenizer.model")];
    if let Some(parent) = dir.parent() {
        candidates.push(parent.join("tokenizer.model"));
    }
    for p in &candidates {
        if p.is_file() {
            let bytes = std::fs::read(p).map_err(io_err(p))?;
            let m = SpmModel::parse(&bytes)
                .map_err(|e| input_err(p, format!("not a SentencePiece model: {e}")))?;
            return Ok((p.clone(), Vocab::Spm(m)));
        }
    }
    if dir.join("tokenizer.json").is_file() {
        return Err(input_err(
            &dir.join("tokenizer.json"),
            "a llama/bamboo model needs a SentencePiece vocabulary (tokenizer.model); tokenizer.json is not read for these",
        ));
    }
    Err(input_err(
        dir,
        "no tokenizer.model here or in the parent folder",
    ))
}

/// The byte-level BPE vocabulary of a falcon/opt model: `tokenizer.json`, with `merges.txt`
/// when `tokenizer.json` has no merges ([`BpeVocab`]).
fn find_bpe(dir: &Path, n_vocab: usize) -> Result<(PathBuf, BpeVocab)> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Err(input_err(
            dir,
            "no tokenizer.json (falcon and opt models convert with their Hugging Face byte-level BPE tokenizer.json)",
        ));
    }
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    let mut vocab =
        BpeVocab::from_tokenizer_json(&text, n_vocab).map_err(|m| input_err(&path, m))?;
    if vocab.merges.is_empty() {
        let txt = dir.join("merges.txt");
        if txt.is_file() {
            let text = std::fs::read_to_string(&txt).map_err(io_err(&txt))?;
            vocab
                .set_merges_txt(&text)
                .map_err(|m| input_err(&txt, m))?;
        }
    }
    if vocab.merges.is_empty() {
        return Err(input_err(
            &path,
            "model.merges is empty and there is no merges.txt: a BPE vocabulary needs its merges",
        ));
    }
    Ok((path, vocab))
}

/// GGUF special-token keys as gguf-py's `SpecialVocab` fills them: ids first from
/// `tokenizer_config.json` (`{kind}_token`, a string or `{"content": ...}`, looked up in
/// `tokenizer.json`'s `added_tokens`), then from `config.json` (`{kind}_token_id`), the first
/// source winning, ids at or above `n_vocab` dropped; `add_bos_token` / `add_eos_token` from
/// `tokenizer_config.json` (only when `tokenizer.json` has `added_tokens`).
type SpecialKeys = (Vec<(&'static str, u32)>, Vec<(&'static str, bool)>);

fn special_vocab(dir: &Path, cfg: &HfConfig, n_vocab: usize) -> Result<SpecialKeys> {
    let mut ids: Vec<(&'static str, &'static str, u32)> = Vec::new();
    let mut adds = Vec::new();
    let set =
        |ids: &mut Vec<(&'static str, &'static str, u32)>, kind: &'static str, key, id: u32| {
            if (id as usize) < n_vocab && !ids.iter().any(|(k, _, _)| *k == kind) {
                ids.push((kind, key, id));
            }
        };
    let tj = dir.join("tokenizer.json");
    let tc = dir.join("tokenizer_config.json");
    if tj.is_file() && tc.is_file() {
        let read = |p: &Path| -> Result<Json> {
            let text = std::fs::read_to_string(p).map_err(io_err(p))?;
            serde_json::from_str(&text).map_err(|e| input_err(p, format!("not JSON: {e}")))
        };
        let tok = read(&tj)?;
        if let Some(added) = tok.get("added_tokens").filter(|a| !a.is_null()) {
            let conf = read(&tc)?;
            for (kind, key) in config::SPECIAL_KINDS {
                if let Some(b) = conf
                    .get(format!("add_{kind}_token"))
                    .and_then(Json::as_bool)
                {
                    match kind {
                        "bos" => adds.push(("tokenizer.ggml.add_bos_token", b)),
                        "eos" => adds.push(("tokenizer.ggml.add_eos_token", b)),
                        _ => {}
                    }
                }
                let content = match conf.get(format!("{kind}_token")) {
                    Some(Json::String(s)) => s.as_str(),
                    Some(Json::Object(o)) => match o.get("content").and_then(Json::as_str) {
                        Some(c) => c,
                        None => continue,
                    },
                    _ => continue,
                };
                let id = added.as_array().and_then(|a| {
                    a.iter()
                        .find(|t| t.get("content").and_then(Json::as_str) == Some(content))
                        .and_then(|t| t.get("id"))
                        .and_then(Json::as_u64)
                        .and_then(|i| u32::try_from(i).ok())
                });
                if let Some(id) = id {
                    set(&mut ids, kind, key, id);
                }
            }
        }
    }
    for (kind, id) in &cfg.special_ids {
        if let Some((k, key)) = config::SPECIAL_KINDS.iter().find(|(k, _)| k == kind) {
            set(&mut ids, k, key, *id);
        }
    }
    Ok((
        ids.into_iter().map(|(_, key, id)| (key, id)).collect(),
        adds,
    ))
}

/// The metadata, in the order of the PowerInfer converter of `cfg.arch` (see the module
/// documentation).
fn write_metadata(
    w: &mut GgufWriter<impl std::io::Write>,
    dir: &Path,
    cfg: &HfConfig,
    opts: &ConvertOptions,
    threshold: Option<f32>,
    vocab: &Vocab,
) -> Result<()> {
    let a = cfg.arch.name();
    let u = |x: usize| Value::U32(x as u32);
    w.add_kv("general.architecture", Value::String(a.to_string()))?;
    w.add_kv("general.name", Value::String(model_name(dir, cfg)))?;
    w.add_kv(format!("{a}.context_length"), u(cfg.n_ctx))?;
    match cfg.arch {
        HfArch::Llama | HfArch::Bamboo => {
            w.add_kv(format!("{a}.embedding_length"), u(cfg.n_embd))?;
            w.add_kv(format!("{a}.block_count"), u(cfg.n_layer))?;
            w.add_kv(format!("{a}.feed_forward_length"), u(cfg.n_ff))?;
            w.add_kv(format!("{a}.rope.dimension_count"), u(cfg.head_dim()))?;
            w.add_kv(format!("{a}.attention.head_count"), u(cfg.n_head))?;
            w.add_kv(format!("{a}.attention.head_count_kv"), u(cfg.n_head_kv))?;
            w.add_kv(
                format!("{a}.attention.layer_norm_rms_epsilon"),
                Value::F32(cfg.rms_eps as f32),
            )?;
            if let Some(t) = cfg.rope_theta {
                w.add_kv(format!("{a}.rope.freq_base"), Value::F32(t as f32))?;
            }
            if let Some(f) = cfg.rope_linear_factor {
                w.add_kv(
                    format!("{a}.rope.scaling.type"),
                    Value::String("linear".into()),
                )?;
                w.add_kv(format!("{a}.rope.scaling.factor"), Value::F32(f as f32))?;
            }
        }
        HfArch::Falcon => {
            w.add_kv(
                format!("{a}.tensor_data_layout"),
                Value::String("jploski".into()),
            )?;
            w.add_kv(format!("{a}.embedding_length"), u(cfg.n_embd))?;
            w.add_kv(format!("{a}.feed_forward_length"), u(cfg.n_ff))?;
            w.add_kv(format!("{a}.block_count"), u(cfg.n_layer))?;
            w.add_kv(format!("{a}.attention.head_count"), u(cfg.n_head))?;
            w.add_kv(format!("{a}.attention.head_count_kv"), u(cfg.n_head_kv))?;
            w.add_kv(
                format!("{a}.attention.layer_norm_epsilon"),
                Value::F32(cfg.rms_eps as f32),
            )?;
        }
        HfArch::Opt => {
            w.add_kv(format!("{a}.embedding_length"), u(cfg.n_embd))?;
            w.add_kv(format!("{a}.block_count"), u(cfg.n_layer))?;
            w.add_kv(format!("{a}.feed_forward_length"), u(cfg.n_ff))?;
            w.add_kv(format!("{a}.attention.head_count"), u(cfg.n_head))?;
        }
    }
    w.add_kv("general.file_type", Value::U32(opts.outtype.file_type()))?;
    if let Some(t) = threshold {
        w.add_kv("powerinfer.sparse_threshold", Value::F32(t))?;
    }
    if opts.dense && cfg.arch == HfArch::Llama && cfg.is_relu() {
        w.add_kv(FFN_ACTIVATION_KEY, Value::String("relu".into()))?;
    }
    let strings = |v: &[String]| Value::Array(powerinfer_gguf::Array::String(v.to_vec()));
    let ints = |v: &[i32]| Value::Array(powerinfer_gguf::Array::I32(v.to_vec()));
    match vocab {
        Vocab::Spm(m) => {
            w.add_kv("tokenizer.ggml.model", Value::String("llama".into()))?;
            w.add_kv("tokenizer.ggml.tokens", strings(&m.tokens))?;
            w.add_kv(
                "tokenizer.ggml.scores",
                Value::Array(powerinfer_gguf::Array::F32(m.scores.clone())),
            )?;
            w.add_kv("tokenizer.ggml.token_type", ints(&m.token_types))?;
        }
        Vocab::Bpe(b) => {
            w.add_kv("tokenizer.ggml.model", Value::String("gpt2".into()))?;
            w.add_kv("tokenizer.ggml.tokens", strings(&b.tokens))?;
            w.add_kv("tokenizer.ggml.token_type", ints(&b.token_types))?;
            w.add_kv("tokenizer.ggml.merges", strings(&b.merges))?;
        }
    }
    let (ids, adds) = special_vocab(dir, cfg, vocab.len())?;
    for (key, id) in ids {
        w.add_kv(key, Value::U32(id))?;
    }
    for (key, add) in adds {
        w.add_kv(key, Value::Bool(add))?;
    }
    Ok(())
}

fn model_name(dir: &Path, c: &HfConfig) -> String {
    match c.arch {
        HfArch::Falcon => return "Falcon".to_string(),
        HfArch::Opt => return "opt".to_string(),
        HfArch::Llama | HfArch::Bamboo => {}
    }
    if c.n_ctx == 4096 {
        return "LLaMA v2".to_string();
    }
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.to_string_lossy().into_owned())
}

/// Converts a checkpoint (see the module documentation). `progress(bytes, total)` is called
/// after each tensor with the bytes just written and the total tensor bytes.
pub fn convert(opts: &ConvertOptions, progress: &mut dyn FnMut(u64, u64)) -> Result<ConvertReport> {
    let dir = &opts.model_dir;
    let cfg_path = dir.join("config.json");
    let cfg_text = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
    let cfg = HfConfig::parse(&cfg_text).map_err(|m| input_err(&cfg_path, m))?;
    if !cfg.arch.hf_script() {
        check_activation(dir, &cfg, opts.dense)?;
    }

    // Model tensors, in file order.
    let shards = find_shards(dir)?;
    let mut listed = Vec::new();
    for s in &shards {
        listed.extend(list_safetensors(s)?);
    }
    check_index(dir, &listed)?;
    let mut plan: Vec<Planned> = Vec::new();
    for l in listed {
        let Some((name, expect, op)) = map_name(&l.name, &cfg, opts.dense)
            .map_err(|m| tensor_err(l.src.file(), &l.name, m))?
        else {
            continue;
        };
        if l.shape != expect {
            return Err(tensor_err(
                l.src.file(),
                &l.name,
                format!(
                    "shape {:?} disagrees with config.json (expected {expect:?})",
                    l.shape
                ),
            ));
        }
        if plan.iter().any(|p| p.name == name) {
            return Err(tensor_err(l.src.file(), &l.name, "appears twice"));
        }
        plan.push(Planned {
            name,
            listed: l,
            op,
            ne: Vec::new(),
            ty: GgmlType::F32,
        });
    }
    // Every tensor the model needs, checked name by name (the first missing one is the error;
    // nothing is built per configured layer first, so a hostile num_hidden_layers fails at the
    // first layer the checkpoint lacks instead of exhausting memory).
    let has = |plan: &[Planned], r: &str| plan.iter().any(|p| p.name == r);
    let require = |plan: &[Planned], r: &str| -> Result<()> {
        if has(plan, r) {
            Ok(())
        } else {
            Err(input_err(
                dir,
                format!("the checkpoint has no tensor for {r} (missing shard or tensor?)"),
            ))
        }
    };
    let down = if opts.dense { "ffn_down" } else { "ffn_down_t" };
    match cfg.arch {
        HfArch::Llama | HfArch::Bamboo | HfArch::Opt => {
            // OPT: learned positions, LayerNorms and biases everywhere, no gate.
            let opt = cfg.arch == HfArch::Opt;
            let globals: &[&str] = if opt {
                &[
                    "token_embd.weight",
                    "position_embd.weight",
                    "output_norm.weight",
                    "output_norm.bias",
                ]
            } else {
                &["token_embd.weight", "output_norm.weight"]
            };
            for t in globals {
                require(&plan, t)?;
            }
            if !opt && !cfg.tie_word_embeddings {
                require(&plan, "output.weight")?;
            }
            let gate = (!opt).then_some("ffn_gate");
            let kinds: &[&str] = if opt {
                &["weight", "bias"]
            } else {
                &["weight"]
            };
            for b in 0..cfg.n_layer {
                let attn = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"];
                let ffn = ["ffn_norm"].into_iter().chain(gate).chain(["ffn_up", down]);
                for t in attn.into_iter().chain(ffn) {
                    for k in kinds {
                        require(&plan, &format!("blk.{b}.{t}.{k}"))?;
                    }
                }
            }
        }
        HfArch::Falcon => {
            for t in [
                "token_embd.weight",
                "output_norm.weight",
                "output_norm.bias",
            ] {
                require(&plan, t)?;
            }
            // 40B style (ln_attn) in one layer means in every layer.
            let norm_2 = plan.iter().any(|p| p.name.ends_with(".attn_norm_2.weight"));
            for b in 0..cfg.n_layer {
                let mut names = vec![
                    format!("blk.{b}.attn_norm.weight"),
                    format!("blk.{b}.attn_norm.bias"),
                ];
                if norm_2 {
                    names.push(format!("blk.{b}.attn_norm_2.weight"));
                    names.push(format!("blk.{b}.attn_norm_2.bias"));
                }
                for t in ["attn_qkv", "attn_output", "ffn_up", down] {
                    names.push(format!("blk.{b}.{t}.weight"));
                }
                for n in names {
                    require(&plan, &n)?;
                }
            }
            if !cfg.tie_word_embeddings {
                require(&plan, "output.weight")?;
            }
            if !has(&plan, "output.weight") {
                // A tied head (no lm_head.weight): PowerInfer's falcon loader requires
                // output.weight, so the token embedding is written again under that name.
                let embd = plan
                    .iter()
                    .find(|p| p.name == "token_embd.weight")
                    .map(|p| p.listed.clone())
                    .expect("required above");
                plan.push(Planned {
                    name: "output.weight".into(),
                    listed: embd,
                    op: Op::None,
                    ne: Vec::new(),
                    ty: GgmlType::F32,
                });
            }
        }
    }

    // The vocabulary, once the token embedding has shown that vocab_size is real.
    let (vocab_path, vocab) = find_vocab(dir, &cfg)?;
    if vocab.len() != cfg.n_vocab {
        return Err(input_err(
            &vocab_path,
            format!(
                "vocabulary has {} pieces, config.json vocab_size is {}",
                vocab.len(),
                cfg.n_vocab
            ),
        ));
    }

    // Predictors.
    let mut threshold = None;
    let mut preds: Vec<Planned> = Vec::new();
    match (&opts.predictor_dir, opts.dense) {
        (Some(pdir), false) => {
            threshold = read_sparse_threshold(pdir)?;
            let files = find_predictors(pdir)?;
            if files.len() != cfg.n_layer {
                return Err(input_err(
                    pdir,
                    format!(
                        "{} predictor layers (model_0 … model_{}), but the model has {} layers",
                        files.len(),
                        files.len().saturating_sub(1),
                        cfg.n_layer
                    ),
                ));
            }
            for (layer, f) in files.iter().enumerate() {
                let entries = if f.extension().is_some_and(|e| e == "pt") {
                    list_pt(f)?
                } else {
                    list_safetensors(f)?
                };
                let mut rank = None;
                for want in ["fc1.weight", "fc2.weight"] {
                    if !entries.iter().any(|e| e.name == want) {
                        return Err(tensor_err(f, want, "missing"));
                    }
                }
                for e in entries {
                    let expect = match e.name.as_str() {
                        "fc1.weight" => {
                            let r = e.shape.first().copied().unwrap_or(0);
                            rank.get_or_insert(r);
                            vec![r, cfg.n_embd]
                        }
                        "fc2.weight" => {
                            let r = e.shape.get(1).copied().unwrap_or(0);
                            rank.get_or_insert(r);
                            vec![cfg.n_ff, r]
                        }
                        _ => {
                            return Err(tensor_err(
                                f,
                                &e.name,
                                "unexpected entry (a predictor state dict holds fc1.weight and fc2.weight)",
                            ))
                        }
                    };
                    if e.shape != expect || Some(expect[0].min(expect[1])) == Some(0) {
                        return Err(tensor_err(
                            f,
                            &e.name,
                            format!("shape {:?}, expected {expect:?}", e.shape),
                        ));
                    }
                    if rank
                        != Some(if e.name == "fc1.weight" {
                            expect[0]
                        } else {
                            expect[1]
                        })
                    {
                        return Err(tensor_err(
                            f,
                            &e.name,
                            "fc1 and fc2 disagree on the predictor rank",
                        ));
                    }
                    preds.push(Planned {
                        name: format!("blk.{layer}.{}", e.name),
                        listed: e,
                        op: Op::None,
                        ne: Vec::new(),
                        ty: GgmlType::F32,
                    });
                }
            }
        }
        (None, false) => {
            return Err(input_err(
                dir,
                "a PowerInfer file needs a predictor folder (or pass --dense)",
            ))
        }
        (Some(pdir), true) => {
            return Err(input_err(
                pdir,
                "a dense file has no predictor; leave out the predictor folder with --dense",
            ))
        }
        (None, true) => {}
    }
    if cfg.arch.hf_script() {
        // PowerInfer's HF script: every predictor first, each as its rebuilt module's state
        // dict (fc1, then fc2), then the model.
        preds.sort_by_key(|p| (predictor_layer(&p.name), p.name.ends_with("fc2.weight")));
        preds.append(&mut plan);
        plan = preds;
    } else {
        plan.append(&mut preds);
    }

    // Output shapes and types.
    for p in &mut plan {
        let mut ne: Vec<u64> = p.listed.shape.iter().rev().map(|&d| d as u64).collect();
        if p.op == Op::Transpose {
            ne.reverse();
        }
        let layer_ty =
            predictor_layer(&p.name).and_then(|l| opts.predictor_layers.get(l).copied().flatten());
        p.ty = match (ne.len() > 1, layer_ty) {
            (false, _) => GgmlType::F32,
            (true, Some(ty)) => ty,
            (true, None) => opts.outtype.matrix_type(),
        };
        if opts.outtype == OutType::Q4_0 && layer_ty.is_none() && ne.len() > 1 {
            if p.name == "output.weight" {
                // PowerInfer's quantize: the output head Q6_K (Q8_0 for Falcon or rows that
                // are not whole 256-value blocks).
                p.ty = if cfg.arch == HfArch::Falcon || ne[0] % 256 != 0 {
                    GgmlType::Q8_0
                } else {
                    GgmlType::Q6_K
                };
            }
            if ne[0] % p.ty.block_size() as u64 != 0 {
                p.ty = GgmlType::F16;
            }
        }
        if p.ty.block_size() > 1 && ne[0] % p.ty.block_size() as u64 != 0 {
            return Err(tensor_err(
                p.listed.src.file(),
                p.listed.src.key(),
                format!(
                    "row length {} is not a multiple of {}, needed for {}",
                    ne[0],
                    p.ty.block_size(),
                    p.ty
                ),
            ));
        }
        p.ne = ne;
    }

    // Write.
    let arch = cfg.arch.name().to_string();
    let kind = if opts.dense {
        FileKind::Gguf
    } else {
        FileKind::PowerInfer
    };
    let mut w = GgufWriter::create(&opts.out, kind)?;
    write_metadata(&mut w, dir, &cfg, opts, threshold, &vocab)?;
    let mut total = 0u64;
    for p in &plan {
        w.add_tensor(&p.name, &p.ne, p.ty)?;
        let n: u64 = p.ne.iter().product();
        total += p.ty.bytes_for(n).unwrap_or(0);
    }
    let mut pt_cache = None;
    for p in &plan {
        let numel: usize = p.listed.shape.iter().product();
        let rows = p.listed.shape.first().copied().unwrap_or(1);
        let cols = p.listed.shape.get(1).copied().unwrap_or(1);
        let bytes = match (&p.listed.src, p.ty) {
            // Same type in and out: move the raw elements (numpy's astype to the same dtype
            // is a copy, so even NaN payloads stay as they are).
            (
                Src::Safetensors {
                    file,
                    offset,
                    dtype: SrcDtype::F16,
                    ..
                },
                GgmlType::F16,
            )
            | (
                Src::Safetensors {
                    file,
                    offset,
                    dtype: SrcDtype::F32,
                    ..
                },
                GgmlType::F32,
            ) => {
                let es = if p.ty == GgmlType::F16 { 2 } else { 4 };
                let raw = read_raw(file, *offset, numel * es)?;
                match p.op {
                    Op::None => raw,
                    Op::Permute(h) => permute_rows(&raw, rows, cols * es, h),
                    Op::Transpose => transpose_raw(&raw, rows, cols, es),
                    Op::Regroup(h, kv, hd) => regroup_qkv(&raw, cols * es, h, kv, hd),
                }
            }
            _ => {
                let mut values = read_values(&p.listed.src, numel, &mut pt_cache)?;
                if opts.outtype == OutType::Q4_0 && p.ty.is_quantized() {
                    // As PowerInfer's quantize sees them: through the F16 file convert.py writes.
                    for v in &mut values {
                        *v = f16_bits_to_f32(f32_to_f16_bits(*v));
                    }
                }
                let values = match p.op {
                    Op::None => values,
                    Op::Permute(h) => permute_rows(&values, rows, cols, h),
                    Op::Transpose => transpose(&values, rows, cols),
                    Op::Regroup(h, kv, hd) => regroup_qkv(&values, cols, h, kv, hd),
                };
                encode(&values, p.ty)
            }
        };
        w.write_tensor_data(&p.name, &bytes)?;
        progress(bytes.len() as u64, total);
    }
    w.finish()?.commit()?;
    let file_bytes = std::fs::metadata(&opts.out)
        .map_err(io_err(&opts.out))?
        .len();
    Ok(ConvertReport {
        arch,
        n_layer: cfg.n_layer,
        n_tensors: plan.len(),
        n_vocab: vocab.len(),
        file_bytes,
        kind,
    })
}
