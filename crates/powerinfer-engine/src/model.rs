//! A model bound to a GGUF or PowerInfer file: hyper-parameters from the metadata and weight
//! tensors that are views of the memory map (no tensor byte is copied except the small 1-D norm
//! weights).
//!
//! Supported: `general.architecture` = `llama` and `bamboo`.
//!
//! - PowerInfer files (`PWRI` magic, spec §1.3): per layer `ffn_gate`, `ffn_up`, `ffn_down_t`
//!   all `[n_embd, n_ff]` and the predictor `fc1` `[n_embd, r]`, `fc2` `[r, n_ff]`. FFN =
//!   ReLU(gate) ⊙ up (`llama`) or ReLU(gate) ⊙ ReLU(up) (`bamboo`), computed sparsely.
//! - Dense GGUF files: `ffn_gate`, `ffn_up` `[n_embd, n_ff]`, `ffn_down` `[n_ff, n_embd]`. FFN =
//!   SiLU(gate) ⊙ up for `llama` (as llama.cpp), ReLU(gate) ⊙ ReLU(up) for `bamboo`.

use std::path::Path;

use powerinfer_gguf::{FileKind, GgmlType, GgufFile, Metadata, TensorInfo};
use powerinfer_kernels_cpu::Weights;

use crate::error::{EngineError, Result};

/// The model family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// LLaMA (ReluLLaMA, ProSparse, or a plain SiLU LLaMA in a dense GGUF file).
    Llama,
    /// Bamboo: ReLU(gate) ⊙ ReLU(up).
    Bamboo,
}

impl Arch {
    /// From `general.architecture`.
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "bamboo" => Ok(Arch::Bamboo),
            other => Err(EngineError::UnsupportedArch(other.to_string())),
        }
    }

    /// The `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Bamboo => "bamboo",
        }
    }
}

/// The FFN activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnAct {
    /// ReLU(gate) ⊙ up.
    Reglu,
    /// ReLU(gate) ⊙ ReLU(up).
    Drelu,
    /// SiLU(gate) ⊙ up.
    Swiglu,
}

/// Hyper-parameters read from the metadata.
#[derive(Clone, Debug, PartialEq)]
pub struct Hparams {
    /// Model family.
    pub arch: Arch,
    /// Vocabulary size (rows of `token_embd`).
    pub n_vocab: usize,
    /// Residual width.
    pub n_embd: usize,
    /// Layers.
    pub n_layer: usize,
    /// FFN width.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (GQA); defaults to `n_head`.
    pub n_head_kv: usize,
    /// Rotated dimensions per head (`rope.dimension_count`, default `head_dim`).
    pub n_rot: usize,
    /// RoPE frequency base (default 10000).
    pub rope_freq_base: f32,
    /// RoPE linear scaling: positions are multiplied by this (`1 / rope.scaling.factor`).
    pub rope_freq_scale: f32,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Training context length.
    pub n_ctx_train: usize,
    /// `powerinfer.sparse_threshold` from the file (PowerInfer files only).
    pub file_sparse_threshold: Option<f32>,
}

impl Hparams {
    /// Head size.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Key/value width per token.
    pub fn n_embd_kv(&self) -> usize {
        self.head_dim() * self.n_head_kv
    }

    /// Reads the hyper-parameters of `md` (`n_vocab` is set by the loader from `token_embd`).
    pub fn from_metadata(md: &Metadata, kind: FileKind) -> Result<Hparams> {
        let arch = Arch::from_name(md.get_str("general.architecture")?)?;
        let a = arch.name();
        let uint = |k: &str| -> Result<usize> { Ok(md.get_uint(&format!("{a}.{k}"))? as usize) };
        let opt_uint = |k: &str| md.get(&format!("{a}.{k}")).and_then(|v| v.to_u64());
        let opt_f32 = |k: &str| md.get(&format!("{a}.{k}")).and_then(|v| v.as_f32());
        let n_embd = uint("embedding_length")?;
        let n_head = uint("attention.head_count")?;
        let n_head_kv = opt_uint("attention.head_count_kv").map_or(n_head, |v| v as usize);
        if n_head == 0 || n_head_kv == 0 || n_embd % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(EngineError::Hparams(format!(
                "n_embd {n_embd}, n_head {n_head}, n_head_kv {n_head_kv}: need n_head | n_embd and n_head_kv | n_head"
            )));
        }
        let head_dim = n_embd / n_head;
        let n_rot = opt_uint("rope.dimension_count").map_or(head_dim, |v| v as usize);
        if n_rot < 2 || n_rot % 2 != 0 || n_rot > head_dim {
            return Err(EngineError::Hparams(format!(
                "rope.dimension_count {n_rot} must be even and within 2..={head_dim}"
            )));
        }
        let scaling_factor = match md
            .get(&format!("{a}.rope.scaling.type"))
            .and_then(|v| v.as_str())
        {
            Some("linear") | None => opt_f32("rope.scaling.factor")
                .or_else(|| opt_f32("rope.scale_linear"))
                .unwrap_or(1.0),
            Some("none") => 1.0,
            Some(other) => {
                return Err(EngineError::Hparams(format!(
                    "rope scaling type `{other}` is not supported (only linear)"
                )))
            }
        };
        let scaling_factor = if scaling_factor > 0.0 {
            scaling_factor
        } else {
            1.0
        };
        let rms_eps = md.get_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?;
        let file_sparse_threshold = match kind {
            FileKind::PowerInfer => md
                .get("powerinfer.sparse_threshold")
                .and_then(|v| v.as_f32()),
            _ => None,
        };
        Ok(Hparams {
            arch,
            n_vocab: 0,
            n_embd,
            n_layer: uint("block_count")?,
            n_ff: uint("feed_forward_length")?,
            n_head,
            n_head_kv,
            n_rot,
            rope_freq_base: opt_f32("rope.freq_base").unwrap_or(10000.0),
            rope_freq_scale: 1.0 / scaling_factor,
            rms_eps,
            n_ctx_train: opt_uint("context_length").map_or(2048, |v| v as usize),
            file_sparse_threshold,
        })
    }
}

/// A weight matrix in the file: `rows` rows of `cols` elements (ggml `[cols, rows]`).
#[derive(Clone, Debug)]
pub struct TensorRef {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub ty: GgmlType,
    /// Rows (ggml `ne1`).
    pub rows: usize,
    /// Elements per row (ggml `ne0`).
    pub cols: usize,
    info: TensorInfo,
}

/// The FFN weights of a layer.
// One per layer, built once: the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum Ffn {
    /// Dense GGUF layout: `down` is `[n_ff, n_embd]` (rows = n_embd).
    Dense {
        /// `ffn_gate` (rows = n_ff).
        gate: TensorRef,
        /// `ffn_up` (rows = n_ff).
        up: TensorRef,
        /// `ffn_down` (rows = n_embd, cols = n_ff).
        down: TensorRef,
    },
    /// PowerInfer layout: all three with one row per neuron, plus the predictor.
    Sparse {
        /// `ffn_gate` (rows = n_ff).
        gate: TensorRef,
        /// `ffn_up` (rows = n_ff).
        up: TensorRef,
        /// `ffn_down_t` (rows = n_ff, cols = n_embd).
        down_t: TensorRef,
        /// `fc1` (rows = r, cols = n_embd).
        fc1: TensorRef,
        /// `fc2` (rows = n_ff, cols = r).
        fc2: TensorRef,
    },
}

/// The weights of one transformer layer.
#[derive(Clone, Debug)]
pub struct Layer {
    /// `attn_norm` weight.
    pub attn_norm: Vec<f32>,
    /// `attn_q` (rows = n_embd).
    pub wq: TensorRef,
    /// `attn_k` (rows = n_embd_kv).
    pub wk: TensorRef,
    /// `attn_v` (rows = n_embd_kv).
    pub wv: TensorRef,
    /// `attn_output` (rows = n_embd).
    pub wo: TensorRef,
    /// `ffn_norm` weight.
    pub ffn_norm: Vec<f32>,
    /// FFN weights.
    pub ffn: Ffn,
}

/// A loaded model: the open file, its hyper-parameters and the tensor bindings.
pub struct Model {
    file: GgufFile,
    /// Hyper-parameters.
    pub hparams: Hparams,
    /// `token_embd` (rows = n_vocab).
    pub tok_embd: TensorRef,
    /// `output_norm` weight.
    pub output_norm: Vec<f32>,
    /// `output` (rows = n_vocab); `token_embd` when the file has no `output` (tied head).
    pub output: TensorRef,
    /// Layers.
    pub layers: Vec<Layer>,
    /// The FFN activation.
    pub ffn_act: FfnAct,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("hparams", &self.hparams)
            .field("ffn_act", &self.ffn_act)
            .finish_non_exhaustive()
    }
}

impl Model {
    /// Maps `path` and binds every tensor (see the [module docs](self)).
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let file = GgufFile::open(path)?;
        Model::from_file(file)
    }

    /// Binds the tensors of an open file.
    pub fn from_file(file: GgufFile) -> Result<Model> {
        let kind = file.kind();
        let mut hp = Hparams::from_metadata(file.metadata(), kind)?;
        let n_embd = hp.n_embd;
        let n_ff = hp.n_ff;
        let n_kv = hp.n_embd_kv();
        let bind = |name: &str, cols: usize, rows: usize| tensor(&file, name, cols, rows);
        let tok_embd = bind("token_embd.weight", n_embd, 0)?;
        hp.n_vocab = tok_embd.rows;
        let n_vocab = hp.n_vocab;
        let output = if file.tensor_info("output.weight").is_some() {
            bind("output.weight", n_embd, n_vocab)?
        } else {
            tok_embd.clone()
        };
        let output_norm = norm(&file, "output_norm.weight", n_embd)?;
        let sparse = kind == FileKind::PowerInfer;
        let mut layers = Vec::with_capacity(hp.n_layer);
        for l in 0..hp.n_layer {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            let ffn = if sparse {
                let fc1 = bind(&n("fc1"), n_embd, 0)?;
                let fc2 = bind(&n("fc2"), fc1.rows, n_ff)?;
                Ffn::Sparse {
                    gate: bind(&n("ffn_gate"), n_embd, n_ff)?,
                    up: bind(&n("ffn_up"), n_embd, n_ff)?,
                    down_t: bind(&n("ffn_down_t"), n_embd, n_ff)?,
                    fc1,
                    fc2,
                }
            } else {
                Ffn::Dense {
                    gate: bind(&n("ffn_gate"), n_embd, n_ff)?,
                    up: bind(&n("ffn_up"), n_embd, n_ff)?,
                    down: bind(&n("ffn_down"), n_ff, n_embd)?,
                }
            };
            layers.push(Layer {
                attn_norm: norm(&file, &n("attn_norm"), n_embd)?,
                wq: bind(&n("attn_q"), n_embd, n_embd)?,
                wk: bind(&n("attn_k"), n_embd, n_kv)?,
                wv: bind(&n("attn_v"), n_embd, n_kv)?,
                wo: bind(&n("attn_output"), n_embd, n_embd)?,
                ffn_norm: norm(&file, &n("ffn_norm"), n_embd)?,
                ffn,
            });
        }
        let ffn_act = match (hp.arch, sparse) {
            (Arch::Bamboo, _) => FfnAct::Drelu,
            (Arch::Llama, true) => FfnAct::Reglu,
            (Arch::Llama, false) => FfnAct::Swiglu,
        };
        let model = Model {
            file,
            hparams: hp,
            tok_embd,
            output_norm,
            output,
            layers,
            ffn_act,
        };
        // Check every matrix once against the kernels' type and size rules.
        model.weights(&model.output)?;
        for layer in &model.layers {
            for t in [&layer.wq, &layer.wk, &layer.wv, &layer.wo] {
                model.weights(t)?;
            }
            match &layer.ffn {
                Ffn::Dense { gate, up, down } => {
                    for t in [gate, up, down] {
                        model.weights(t)?;
                    }
                }
                Ffn::Sparse {
                    gate,
                    up,
                    down_t,
                    fc1,
                    fc2,
                } => {
                    for t in [gate, up, down_t, fc1, fc2] {
                        model.weights(t)?;
                    }
                }
            }
        }
        Ok(model)
    }

    /// The open file.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// Whether this is a PowerInfer (sparse) file.
    pub fn is_sparse(&self) -> bool {
        self.file.kind() == FileKind::PowerInfer
    }

    /// A kernel view of `t`, borrowing the memory map.
    pub fn weights(&self, t: &TensorRef) -> Result<Weights<'_>> {
        Ok(Weights::new(
            t.ty,
            t.rows,
            t.cols,
            self.file.data_of(&t.info),
        )?)
    }

    /// Writes the embedding of `token` (dequantized row of `token_embd`) into `out`.
    pub fn embed(&self, token: u32, out: &mut [f32]) -> Result<()> {
        let t = &self.tok_embd;
        if token as usize >= t.rows {
            return Err(EngineError::InvalidToken {
                id: token,
                n_vocab: t.rows,
            });
        }
        let data = self.file.data_of(&t.info);
        let row_bytes = data.len() / t.rows;
        let start = token as usize * row_bytes;
        powerinfer_gguf::quants::dequantize(t.ty, &data[start..start + row_bytes], out)?;
        Ok(())
    }
}

/// Binds a 2-D tensor of ggml shape `[cols, rows]` (`rows == 0`: any).
fn tensor(file: &GgufFile, name: &str, cols: usize, rows: usize) -> Result<TensorRef> {
    let info = file
        .tensor_info(name)
        .ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
    let shape = info.shape();
    let ok = shape.len() == 2
        && shape[0] == cols as u64
        && (rows == 0 || shape[1] == rows as u64)
        && shape[1] > 0;
    if !ok {
        return Err(EngineError::TensorShape {
            name: name.to_string(),
            expected: vec![cols as u64, rows as u64],
            got: shape.to_vec(),
        });
    }
    Ok(TensorRef {
        name: name.to_string(),
        ty: info.ggml_type(),
        rows: shape[1] as usize,
        cols,
        info: info.clone(),
    })
}

/// Reads a 1-D norm weight of `n` values (any float type) into a vector.
fn norm(file: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
    let info = file
        .tensor_info(name)
        .ok_or_else(|| EngineError::MissingTensor(name.to_string()))?;
    if info.shape() != [n as u64] {
        return Err(EngineError::TensorShape {
            name: name.to_string(),
            expected: vec![n as u64],
            got: info.shape().to_vec(),
        });
    }
    Ok(powerinfer_gguf::quants::dequantize_to_vec(
        info.ggml_type(),
        file.data_of(info),
    )?)
}
