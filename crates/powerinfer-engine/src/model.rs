//! A model bound to a GGUF or PowerInfer file: hyper-parameters from the metadata and weight
//! tensors that are views of the memory map (no tensor byte is copied except the small 1-D norm
//! weights).
//!
//! Supported: `general.architecture` = `llama`, `bamboo`, `falcon` and `opt`, each as a
//! PowerInfer file (sparse FFN with predictor) or a dense GGUF file.
//!
//! - PowerInfer files (`PWRI` magic, spec §1.3): per layer `ffn_up`, `ffn_down_t` (and
//!   `ffn_gate` for llama/bamboo) all `[n_embd, n_ff]` and the predictor `fc1` `[n_embd, r]`,
//!   `fc2` `[r, n_ff]`. FFN = ReLU(gate) ⊙ up (`llama`), ReLU(gate) ⊙ ReLU(up) (`bamboo`) or
//!   ReLU(up (+ bias)) (`falcon`, `opt`), computed sparsely.
//! - Dense GGUF files: `ffn_up` (and `ffn_gate`) `[n_embd, n_ff]`, `ffn_down` `[n_ff, n_embd]`.
//!   FFN = SiLU(gate) ⊙ up for `llama` (as llama.cpp), ReLU(gate) ⊙ ReLU(up) for `bamboo`,
//!   ReLU(up (+ bias)) for `falcon` and `opt`.
//!
//! Per architecture (tensor names without `blk.N.`/`.weight`):
//!
//! - `llama`/`bamboo`: RMSNorm `attn_norm`, `ffn_norm`, `output_norm` (weights only),
//!   `attn_q/k/v/output`, RoPE mode 0, optional `output` (else tied to `token_embd`). Key
//!   `{arch}.attention.layer_norm_rms_epsilon`.
//! - `falcon` (ReluFalcon, spec §1.3): LayerNorm with bias `attn_norm.{weight,bias}` and, 40B
//!   style, `attn_norm_2.{weight,bias}`; fused `attn_qkv` `[n_embd, n_embd + 2·n_embd_kv]` (rows
//!   = all Q heads, then all K heads, then all V heads: the converter's "jploski" order);
//!   `attn_output`; no `ffn_norm`, no gate; `output_norm.{weight,bias}`, `output` (tied to
//!   `token_embd` if absent). NeoX RoPE.
//!   As llama.cpp's graph: the attention reads `attn_norm_2(x)` when the layer has it, else
//!   `attn_norm(x)`; the FFN always reads `attn_norm(x)` (for Falcon-40B the converter maps
//!   HF `ln_mlp` to `attn_norm` and `ln_attn` to `attn_norm_2`). Parallel block:
//!   `x ← x + attn + ffn`. Key `falcon.attention.layer_norm_epsilon` (required).
//! - `opt`: `position_embd` `[n_embd, n_pos]` (learned positions, see
//!   [`Model::position_row`]), LayerNorm with bias `attn_norm`, `ffn_norm`, `output_norm`;
//!   `attn_{q,k,v,output}.{weight,bias}`; `ffn_up.{weight,bias}`; `ffn_down_t.{weight,bias}`
//!   (PowerInfer) or `ffn_down.{weight,bias}` (dense); no RoPE; lm head tied to `token_embd`
//!   (an `output.weight`, if present, is used). Key `opt.attention.layer_norm_epsilon`
//!   (optional, default 1e-5 as Hugging Face's OPT; PowerInfer reads none).
//!
//! A tensor that is missing is [`EngineError::MissingTensor`], one of another shape than the
//! hyper-parameters imply [`EngineError::TensorShape`].

use std::path::Path;

use powerinfer_gguf::{FileKind, GgmlType, GgufFile, Metadata, TensorInfo};
use powerinfer_kernels_cpu::Weights;
use powerinfer_predictor::predictor::Predictor;

use crate::error::{EngineError, Result};

/// The model family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Arch {
    /// LLaMA (ReluLLaMA, ProSparse, or a plain SiLU LLaMA in a dense GGUF file).
    Llama,
    /// Bamboo: ReLU(gate) ⊙ ReLU(up).
    Bamboo,
    /// Falcon (ReluFalcon): parallel attention + FFN, fused QKV, NeoX RoPE, LayerNorm,
    /// FFN ReLU(up).
    Falcon,
    /// OPT: learned positions, LayerNorm, biases everywhere, FFN ReLU(up + b), tied head.
    Opt,
}

impl Arch {
    /// From `general.architecture`.
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "bamboo" => Ok(Arch::Bamboo),
            "falcon" => Ok(Arch::Falcon),
            "opt" => Ok(Arch::Opt),
            other => Err(EngineError::UnsupportedArch(other.to_string())),
        }
    }

    /// The `general.architecture` string.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Bamboo => "bamboo",
            Arch::Falcon => "falcon",
            Arch::Opt => "opt",
        }
    }

    /// Whether the norms are LayerNorms with bias (`falcon`, `opt`) rather than RMSNorms.
    pub fn layer_norm(self) -> bool {
        matches!(self, Arch::Falcon | Arch::Opt)
    }
}

/// The FFN activation (the kernels' [`FfnAct`], re-exported here where the model names it).
pub use powerinfer_kernels_cpu::ffn::FfnAct;

/// Hyper-parameters read from the metadata.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
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
    /// Norm epsilon: RMSNorm's (`llama`, `bamboo`) or LayerNorm's (`falcon`, `opt`).
    pub rms_eps: f32,
    /// Training context length (`opt`: the positions the `position_embd` table covers, i.e.
    /// its rows minus the 2-row offset).
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
        if arch != Arch::Opt && (n_rot < 2 || n_rot % 2 != 0 || n_rot > head_dim) {
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
        let rms_eps = match arch {
            Arch::Llama | Arch::Bamboo => {
                md.get_f32(&format!("{a}.attention.layer_norm_rms_epsilon"))?
            }
            Arch::Falcon => md.get_f32(&format!("{a}.attention.layer_norm_epsilon"))?,
            Arch::Opt => opt_f32("attention.layer_norm_epsilon").unwrap_or(1e-5),
        };
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
pub(crate) struct TensorRef {
    /// Tensor name.
    pub(crate) name: String,
    /// Element type.
    pub(crate) ty: GgmlType,
    /// Rows (ggml `ne1`).
    pub(crate) rows: usize,
    /// Elements per row (ggml `ne0`).
    pub(crate) cols: usize,
    /// Where the bytes are in the file.
    pub(crate) info: TensorInfo,
}

/// A norm's weight and, for LayerNorm, its bias (copied out of the file, f32).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Norm {
    /// Weight (`n_embd` values).
    pub(crate) weight: Vec<f32>,
    /// Bias (`n_embd` values): present for the LayerNorms of `falcon` and `opt`.
    pub(crate) bias: Option<Vec<f32>>,
}

/// The FFN weights of a layer.
// One per layer, built once: the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub(crate) enum Ffn {
    /// Dense GGUF layout: `down` is `[n_ff, n_embd]` (rows = n_embd).
    Dense {
        /// `ffn_gate` (rows = n_ff); `None` for the gate-less `falcon` and `opt`.
        gate: Option<TensorRef>,
        /// `ffn_up` (rows = n_ff).
        up: TensorRef,
        /// `ffn_down` (rows = n_embd, cols = n_ff).
        down: TensorRef,
    },
    /// PowerInfer layout: all three with one row per neuron, plus the predictor.
    Sparse {
        /// `ffn_gate` (rows = n_ff); `None` for the gate-less `falcon` and `opt`.
        gate: Option<TensorRef>,
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

impl Ffn {
    /// The predictor's `fc1` and `fc2` of a sparse FFN.
    pub(crate) fn predictor(&self) -> Option<(&TensorRef, &TensorRef)> {
        match self {
            Ffn::Sparse { fc1, fc2, .. } => Some((fc1, fc2)),
            Ffn::Dense { .. } => None,
        }
    }

    /// Rows of the predictor's hidden layer (0 for a dense FFN).
    pub(crate) fn predictor_rank(&self) -> usize {
        self.predictor().map_or(0, |(fc1, _)| fc1.rows)
    }
}

/// The Q/K/V projections of a layer.
// One per layer, built once: the size difference between the variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub(crate) enum Qkv {
    /// Separate `attn_q` (rows = n_embd), `attn_k`, `attn_v` (rows = n_embd_kv), with
    /// optional biases (`opt`).
    Separate {
        /// `attn_q`.
        wq: TensorRef,
        /// `attn_k`.
        wk: TensorRef,
        /// `attn_v`.
        wv: TensorRef,
        /// `attn_q.bias`.
        bq: Option<Vec<f32>>,
        /// `attn_k.bias`.
        bk: Option<Vec<f32>>,
        /// `attn_v.bias`.
        bv: Option<Vec<f32>>,
    },
    /// Fused `attn_qkv` (`falcon`): rows `n_embd + 2·n_embd_kv` = Q, then K, then V.
    Fused(TensorRef),
}

/// The weights of one transformer layer.
#[derive(Clone, Debug)]
pub(crate) struct Layer {
    /// `attn_norm` (the FFN's input norm too for `falcon`).
    pub(crate) attn_norm: Norm,
    /// `attn_norm_2` (`falcon` 40B style: the attention's input norm).
    pub(crate) attn_norm_2: Option<Norm>,
    /// Q/K/V projections.
    pub(crate) qkv: Qkv,
    /// `attn_output` (rows = n_embd).
    pub(crate) wo: TensorRef,
    /// `attn_output.bias` (`opt`).
    pub(crate) bo: Option<Vec<f32>>,
    /// `ffn_norm` (`None` for `falcon`, whose FFN reads `attn_norm`).
    pub(crate) ffn_norm: Option<Norm>,
    /// FFN weights.
    pub(crate) ffn: Ffn,
    /// `ffn_up.bias` (`opt`, `n_ff` values).
    pub(crate) up_b: Option<Vec<f32>>,
    /// `ffn_down_t.bias` / `ffn_down.bias` (`opt`, `n_embd` values).
    pub(crate) down_b: Option<Vec<f32>>,
}

/// A loaded model: the open file, its hyper-parameters and the tensor bindings.
pub struct Model {
    file: GgufFile,
    /// Hyper-parameters.
    pub(crate) hparams: Hparams,
    /// `token_embd` (rows = n_vocab).
    pub(crate) tok_embd: TensorRef,
    /// `position_embd` (`opt`; rows = `n_ctx_train + 2`).
    pub(crate) pos_embd: Option<TensorRef>,
    /// `output_norm`.
    pub(crate) output_norm: Norm,
    /// `output` (rows = n_vocab); `token_embd` when the file has no `output` (tied head).
    pub(crate) output: TensorRef,
    /// Layers.
    pub(crate) layers: Vec<Layer>,
    /// The FFN activation.
    pub(crate) ffn_act: FfnAct,
    /// Names of the file's tensors that no part of the model reads, in file order.
    unused: Vec<String>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("hparams", &self.hparams)
            .field("ffn_act", &self.ffn_act)
            .finish_non_exhaustive()
    }
}

pub use powerinfer_gguf::conventions::OPT_POSITION_OFFSET;

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
        let arch = hp.arch;
        let ln = arch.layer_norm();
        let n_embd = hp.n_embd;
        let n_ff = hp.n_ff;
        let n_kv = hp.n_embd_kv();
        // Every tensor name looked up, to report the ones the graph never reads.
        let used = std::cell::RefCell::new(std::collections::HashSet::<String>::new());
        let bind = |name: &str, cols: usize, rows: usize| {
            used.borrow_mut().insert(name.to_string());
            tensor(&file, name, cols, rows)
        };
        let vec = |name: &str, n: usize| {
            used.borrow_mut().insert(name.to_string());
            vector(&file, name, n)
        };
        let norm_of = |base: &str| -> Result<Norm> {
            Ok(Norm {
                weight: vec(&format!("{base}.weight"), n_embd)?,
                bias: if ln {
                    Some(vec(&format!("{base}.bias"), n_embd)?)
                } else {
                    None
                },
            })
        };
        let tok_embd = bind("token_embd.weight", n_embd, 0)?;
        hp.n_vocab = tok_embd.rows;
        let n_vocab = hp.n_vocab;
        let pos_embd = if arch == Arch::Opt {
            let t = bind("position_embd.weight", n_embd, 0)?;
            if t.rows <= OPT_POSITION_OFFSET {
                return Err(EngineError::TensorShape {
                    name: t.name,
                    expected: vec![n_embd as u64, (OPT_POSITION_OFFSET + 1) as u64],
                    got: vec![n_embd as u64, t.rows as u64],
                });
            }
            hp.n_ctx_train = t.rows - OPT_POSITION_OFFSET;
            Some(t)
        } else {
            None
        };
        // Optional for every architecture (PowerInfer requires it for falcon and never reads it
        // for opt; upstream llama.cpp later made falcon's optional too): else the tied head.
        let output = if file.tensor_info("output.weight").is_some() {
            bind("output.weight", n_embd, n_vocab)?
        } else {
            tok_embd.clone()
        };
        let output_norm = norm_of("output_norm")?;
        let sparse = kind == FileKind::PowerInfer;
        let gated = !ln;
        // Capacity from the file, not the metadata: a hostile block count must fail at its
        // first missing tensor, not in the allocator.
        let mut layers = Vec::with_capacity(hp.n_layer.min(file.tensors().len()));
        for l in 0..hp.n_layer {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            let b = |t: &str| format!("blk.{l}.{t}.bias");
            // A bias of the attention, up or down projection: `opt` only.
            let bias =
                |t: &str, len: usize| (arch == Arch::Opt).then(|| vec(&b(t), len)).transpose();
            let gate = if gated {
                Some(bind(&n("ffn_gate"), n_embd, n_ff)?)
            } else {
                None
            };
            let (ffn, down_b) = if sparse {
                let fc1 = bind(&n("fc1"), n_embd, 0)?;
                let fc2 = bind(&n("fc2"), fc1.rows, n_ff)?;
                let ffn = Ffn::Sparse {
                    gate,
                    up: bind(&n("ffn_up"), n_embd, n_ff)?,
                    down_t: bind(&n("ffn_down_t"), n_embd, n_ff)?,
                    fc1,
                    fc2,
                };
                (ffn, bias("ffn_down_t", n_embd)?)
            } else {
                let ffn = Ffn::Dense {
                    gate,
                    up: bind(&n("ffn_up"), n_embd, n_ff)?,
                    down: bind(&n("ffn_down"), n_ff, n_embd)?,
                };
                (ffn, bias("ffn_down", n_embd)?)
            };
            let base = |t: &str| format!("blk.{l}.{t}");
            let layer = match arch {
                Arch::Llama | Arch::Bamboo | Arch::Opt => Layer {
                    attn_norm: norm_of(&base("attn_norm"))?,
                    attn_norm_2: None,
                    qkv: Qkv::Separate {
                        wq: bind(&n("attn_q"), n_embd, n_embd)?,
                        wk: bind(&n("attn_k"), n_embd, n_kv)?,
                        wv: bind(&n("attn_v"), n_embd, n_kv)?,
                        bq: bias("attn_q", n_embd)?,
                        bk: bias("attn_k", n_kv)?,
                        bv: bias("attn_v", n_kv)?,
                    },
                    wo: bind(&n("attn_output"), n_embd, n_embd)?,
                    bo: bias("attn_output", n_embd)?,
                    ffn_norm: Some(norm_of(&base("ffn_norm"))?),
                    ffn,
                    up_b: bias("ffn_up", n_ff)?,
                    down_b,
                },
                Arch::Falcon => Layer {
                    attn_norm: norm_of(&base("attn_norm"))?,
                    attn_norm_2: if file.tensor_info(&n("attn_norm_2")).is_some() {
                        Some(norm_of(&base("attn_norm_2"))?)
                    } else {
                        None
                    },
                    qkv: Qkv::Fused(bind(&n("attn_qkv"), n_embd, n_embd + 2 * n_kv)?),
                    wo: bind(&n("attn_output"), n_embd, n_embd)?,
                    bo: None,
                    ffn_norm: None,
                    ffn,
                    up_b: None,
                    down_b,
                },
            };
            layers.push(layer);
        }
        // A dense `llama` file runs SiLU unless our converter marked its checkpoint's ReLU.
        let marked_relu = match file.metadata().get("powerinfer.ffn_activation") {
            None => false,
            Some(v) => match v.as_str() {
                Some("relu") => true,
                Some("silu") => false,
                _ => {
                    return Err(EngineError::Hparams(format!(
                        "powerinfer.ffn_activation {v:?} is not supported (relu, silu are)"
                    )))
                }
            },
        };
        let ffn_act = match (arch, sparse) {
            (Arch::Bamboo, _) => FfnAct::Drelu,
            (Arch::Llama, true) => FfnAct::Reglu,
            (Arch::Llama, false) if marked_relu => FfnAct::Reglu,
            (Arch::Llama, false) => FfnAct::Swiglu,
            (Arch::Falcon | Arch::Opt, _) => FfnAct::Relu,
        };
        let used = used.into_inner();
        let unused = file
            .tensors()
            .iter()
            .filter(|t| !used.contains(t.name()))
            .map(|t| t.name().to_string())
            .collect();
        let model = Model {
            file,
            hparams: hp,
            tok_embd,
            pos_embd,
            output_norm,
            output,
            layers,
            ffn_act,
            unused,
        };
        // Check every matrix once against the kernels' type and size rules.
        for t in model.matrices() {
            Weights::new(t.ty, t.rows, t.cols, model.file.data_of(&t.info))?;
        }
        Ok(model)
    }

    /// Every 2-D weight matrix the forward pass reads (the token embedding is read by rows).
    pub(crate) fn matrices(&self) -> impl Iterator<Item = &TensorRef> + '_ {
        let per_layer = self.layers.iter().flat_map(|layer| {
            let qkv: Vec<&TensorRef> = match &layer.qkv {
                Qkv::Separate { wq, wk, wv, .. } => vec![wq, wk, wv],
                Qkv::Fused(t) => vec![t],
            };
            let ffn: Vec<&TensorRef> = match &layer.ffn {
                Ffn::Dense { gate, up, down } => gate.iter().chain([up, down]).collect(),
                Ffn::Sparse {
                    gate, up, down_t, ..
                } => gate.iter().chain([up, down_t]).collect(),
            };
            let predictor = layer.ffn.predictor().into_iter().flat_map(|(a, b)| [a, b]);
            qkv.into_iter()
                .chain([&layer.wo])
                .chain(ffn)
                .chain(predictor)
        });
        std::iter::once(&self.output).chain(per_layer)
    }

    /// Names of the file's tensors that the model does not read (in file order): empty for a
    /// file that matches its architecture exactly. PowerInfer's and llama.cpp's loaders refuse
    /// such files; this engine loads them and leaves the decision to the caller (the
    /// `powerinfer` command prints a warning).
    pub fn unused_tensors(&self) -> &[String] {
        &self.unused
    }

    /// The open file.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The hyper-parameters.
    pub fn hparams(&self) -> &Hparams {
        &self.hparams
    }

    /// The FFN activation.
    pub fn ffn_act(&self) -> FfnAct {
        self.ffn_act
    }

    /// Whether this is a PowerInfer (sparse) file.
    pub fn is_sparse(&self) -> bool {
        self.file.kind() == FileKind::PowerInfer
    }

    /// Layer `layer`'s activation predictor (`fc1`, `fc2` as stored in the file); `None` for a
    /// dense file or a layer outside the model.
    pub fn predictor(&self, layer: usize) -> Result<Option<Predictor<'_>>> {
        match self.layers.get(layer).and_then(|l| l.ffn.predictor()) {
            Some((fc1, fc2)) => {
                let view =
                    |t: &TensorRef| Weights::new(t.ty, t.rows, t.cols, self.file.data_of(&t.info));
                Ok(Some(Predictor::new(view(fc1)?, view(fc2)?)?))
            }
            None => Ok(None),
        }
    }

    /// The row of OPT's `position_embd` used at (0-based) position `pos`: `pos + 2`.
    ///
    /// Hugging Face's `OPTLearnedPositionalEmbedding` has `max_position_embeddings + 2` rows
    /// and looks up `pos + 2` (its `offset = 2`; rows 0 and 1 are never used without padding).
    /// The converter stores that table unchanged (2050 rows for OPT's 2048 positions) and
    /// PowerInfer's llama.cpp adds 2 to every position before `ggml_get_rows`; so do we.
    /// Positions therefore go up to `rows - 3` (`n_ctx_train = rows - 2`).
    pub fn position_row(pos: usize) -> usize {
        pos + OPT_POSITION_OFFSET
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

/// Reads a 1-D tensor of `n` values (a norm weight or a bias, any float type) into a vector.
fn vector(file: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>> {
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
