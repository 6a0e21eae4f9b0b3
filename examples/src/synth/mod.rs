//! Model-file tools: a seeded generator of synthetic ReLU-sparse models (`llama`, `bamboo`,
//! `falcon`, `opt`; [`synthesize`]) and a quantizer of GGUF / PowerInfer files
//! ([`quantize()`]).
//!
//! # The synthetic model
//!
//! [`synthesize`] writes a PowerInfer file (`PWRI` magic; per layer `ffn_gate`, `ffn_up`,
//! `ffn_down_t` all `[n_embd, n_ff]` and the predictor `fc1` `[n_embd, 2r]`, `fc2` `[2r, n_ff]`),
//! optionally a dense twin for llama.cpp (`GGUF` magic, `ffn_down` `[n_ff, n_embd]`, no
//! predictor), and the per-neuron activation probabilities as `activation/activation_N.pt` and
//! `activation/activation.safetensors` (see [`powerinfer_predictor::stats`]), and the predictor
//! as PowerInfer's converter takes it (`model_N.pt`, [`SynthOutputs::predictor_dir`]). Every weight is a
//! pure function of the seed and its position, so files are byte-identical for a seed and
//! tensors are generated row block by row block (a 7B model needs well under 2 GB of memory).
//!
//! The FFN is sparse like a real ReLU model, by construction:
//!
//! - **Bias channel.** Residual channel [`BIAS_CHANNEL`] holds the constant [`BIAS_VALUE`] for
//!   every token (the embedding sets it; no `attn_output` or `ffn_down_t` row writes to it), so
//!   each gate row's weight on it is a per-neuron bias.
//! - **Exact probabilities.** Each gate row `g_i` is scaled so that `Σ_{j≠c} (g_ij w_j)^2 = 1`
//!   (`w` = `ffn_norm` weight). For a residual `x` with i.i.d. channels of standard deviation
//!   `s_l`, the gate pre-activation numerator `Σ_j g_ij w_j x_j` is then
//!   `N(b_i, s_l^2)`, and the bias `b_i = s_l Φ⁻¹(p_i)` gives neuron `i` activation probability
//!   exactly `p_i` (the RMS factor is positive and does not change the sign). The `p_i` follow
//!   a power law with mean `density` whose top 20 % of neurons carry a share `skew` of all
//!   activations ([`math::power_law_probabilities`]), assigned to neurons in a seeded random
//!   order.
//! - **Predictor.** The gate is low rank plus noise: `g_i ⊙ w = α_i (u_i M + e_i)` with `M`
//!   (`r-1` orthonormal rows, zero at the bias channel) and noise `e_i`. With
//!   `fc1 = [M; e_c/K; -M; -e_c/K]` and `fc2_i = [α_i u_i, b_i, -α_i u_i, 0]`, the predictor
//!   score on the pre-norm residual is `fc2 · ReLU(fc1 · x) = α_i u_i M x + b_i`, i.e. the gate
//!   numerator minus the noise term (`ReLU(z) - ReLU(-z) = z`). With noise 0 it predicts every
//!   activation exactly; `predictor_noise` is the share of the gate variance the predictor
//!   cannot see, which sets its recall and precision.
//! - **Stable residual.** Embedding channels have variance 1; `attn_output` and `ffn_down_t`
//!   are scaled so each sub-layer adds a small, known variance ([`ATTN_STEP`], [`FFN_STEP`]);
//!   the bias of layer `l` uses the expected `s_l`, so the density holds in every layer.
//!
//! The `bamboo` variant (`ReLU(gate) ⊙ ReLU(up)`) also gives every `up` row a bias of
//! [`BAMBOO_UP_BIAS`] standard deviations, so `up > 0` with probability Φ(4) ≈ 0.99997 and the
//! activation pattern is the gate's.
//!
//! # `falcon` and `opt` (LayerNorm, FFN `ReLU(up)`)
//!
//! Same construction with `up` in the gate's role, adapted to LayerNorm with bias, whose mean
//! subtraction and bias would otherwise break the exact predictor:
//!
//! - **Two bias channels**: [`BIAS_CHANNEL`] holds `+BIAS_VALUE` and [`BIAS_CHANNEL_NEG`]
//!   `-BIAS_VALUE` in every token (so they add nothing to the mean); nothing writes to either
//!   (`attn_output`/`ffn_down(_t)` rows, OPT's output/down biases and position embeddings are
//!   0 there). An `up` row's weights `±b_i / (2·BIAS_VALUE)` on them add exactly `b_i / σ`.
//! - The signal rows `M` and each row's noise are orthogonal to the all-ones vector (on the
//!   other channels), so subtracting the mean changes nothing, and to a fixed direction `v`;
//!   the FFN-input LayerNorm's bias is `γ · w ⊙ v` (`w` its weight, entries ≈ 0.1), which the
//!   `up` rows therefore do not see. So `up_i · LN(x) = (α_i (u_i M + e_i)·x + b_i) / σ(x)`
//!   and the predictor `α_i u_i M x + b_i` on the pre-norm input is exact with noise 0.
//! - `opt`'s `ffn_up.bias` is uniform in `[-OPT_UP_BIAS_MAX, 0]`: never positive, so a neuron
//!   that fires is always predicted (recall stays 1; a few predicted neurons output 0).
//!   `opt`'s other biases are small random values; `position_embd` has
//!   `n_ctx + 2` rows (the Hugging Face table with its 2-row offset, `context_length` =
//!   `n_ctx + 2` as PowerInfer's converter writes 2050) of standard deviation [`POS_EMBD_STD`].
//! - `falcon` writes the fused `attn_qkv` and, with [`SynthConfig::attn_norm_2`], a 40B-style
//!   `attn_norm_2` for the attention (the FFN then reads `attn_norm`); `opt` ties its head to
//!   `token_embd` (no `output.weight`).

mod generate;
pub mod math;
mod quantize;
mod rows;
pub mod vocab;

use std::path::PathBuf;

pub use generate::{synthesize, LayerPlan, SynthReport};
pub use quantize::{
    default_output, ftype_of, predictor_type, quantize, KQuantMix, PredictorRule, QuantizeOptions,
    QuantizeReport, QuantizeTarget, QUANTIZE_TYPES,
};

use powerinfer_gguf::GgmlType;

/// Residual channel that carries the constant bias input.
pub const BIAS_CHANNEL: usize = 0;
/// Residual channel that carries `-BIAS_VALUE` in the LayerNorm architectures (`falcon`,
/// `opt`).
pub const BIAS_CHANNEL_NEG: usize = 1;
/// Residual channel that carries the token's topic (`±BIAS_VALUE`) with
/// [`SynthConfig::topics`].
pub const TOPIC_CHANNEL: usize = 1;
/// LayerNorm epsilon written to `falcon`/`opt` files.
pub const LN_EPS: f32 = 1e-5;
/// Standard deviation of OPT's position embeddings.
pub const POS_EMBD_STD: f64 = 0.5;
/// OPT's `ffn_up.bias` lies in `[-OPT_UP_BIAS_MAX, 0]`.
pub const OPT_UP_BIAS_MAX: f32 = 0.05;
/// Value of the bias channel in every token's embedding.
pub const BIAS_VALUE: f32 = 4.0;
/// Standard deviation of the other embedding channels.
pub const EMBD_STD: f64 = 1.0;
/// Standard deviation each attention block adds to a residual channel (at most; averaging over
/// positions lowers it).
pub const ATTN_STEP: f64 = 0.05;
/// Standard deviation each FFN block adds to a residual channel.
pub const FFN_STEP: f64 = 0.1;
/// Share of [`ATTN_STEP`]'s variance assumed when predicting the residual's spread.
pub const ATTN_VARIANCE_SHARE: f64 = 0.5;
/// Bias of every `up` row in the `bamboo` variant, in standard deviations.
pub const BAMBOO_UP_BIAS: f64 = 4.0;
/// RMSNorm epsilon written to the file.
pub const RMS_EPS: f32 = 1e-5;

/// Errors of the generator and the quantizer.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// An invalid option or combination of options.
    #[error("{0}")]
    Config(String),
    /// A GGUF read or write error.
    #[error(transparent)]
    Gguf(#[from] powerinfer_gguf::GgufError),
    /// A quantization error.
    #[error(transparent)]
    Quant(#[from] powerinfer_gguf::quants::QuantError),
    /// Writing the activation statistics failed.
    #[error(transparent)]
    Stats(#[from] powerinfer_predictor::stats::StatsError),
    /// A file-system error.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// The FFN variant of the LLaMA family (see [`SynthConfig::ln_arch`] for `falcon` and `opt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `llama`: ReLU(gate) ⊙ up (ReluLLaMA, ProSparse).
    Llama,
    /// `bamboo`: ReLU(gate) ⊙ ReLU(up).
    Bamboo,
}

impl Arch {
    /// `general.architecture`.
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Bamboo => "bamboo",
        }
    }
}

/// A LayerNorm family with a gate-less ReLU FFN; set in [`SynthConfig::ln_arch`], it replaces
/// [`SynthConfig::arch`]. (Its own type, so that exhaustive matches on [`Arch`] stay valid.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LnArch {
    /// `falcon` (ReluFalcon): ReLU(up), fused QKV, parallel attention and FFN.
    Falcon,
    /// `opt`: ReLU(up + b), biases, learned positions, tied head.
    Opt,
}

/// Every model family the generator writes (`general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// `llama`.
    Llama,
    /// `bamboo`.
    Bamboo,
    /// `falcon`.
    Falcon,
    /// `opt`.
    Opt,
}

/// Names [`Family::from_name`] accepts.
pub const ARCHS: [&str; 4] = ["llama", "bamboo", "falcon", "opt"];

impl Family {
    /// `general.architecture`.
    pub fn name(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Bamboo => "bamboo",
            Family::Falcon => "falcon",
            Family::Opt => "opt",
        }
    }

    /// By `general.architecture` name (see [`ARCHS`]).
    pub fn from_name(name: &str) -> Option<Family> {
        Some(match name {
            "llama" => Family::Llama,
            "bamboo" => Family::Bamboo,
            "falcon" => Family::Falcon,
            "opt" => Family::Opt,
            _ => return None,
        })
    }

    /// LayerNorm with bias and a gate-less FFN (`falcon`, `opt`).
    pub fn layer_norm(self) -> bool {
        matches!(self, Family::Falcon | Family::Opt)
    }
}

/// Model dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// Layers.
    pub n_layer: usize,
    /// Residual width.
    pub n_embd: usize,
    /// FFN width (neurons per layer); a multiple of 256.
    pub n_ff: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Key/value heads (GQA); divides `n_head`.
    pub n_head_kv: usize,
    /// Vocabulary size; `None` = that of the vocabulary source (512 for the built-in one).
    pub n_vocab: Option<usize>,
    /// Training context length written to the file.
    pub n_ctx: usize,
}

/// Names of the shape presets.
pub const PRESETS: [&str; 5] = [
    "tiny",
    "tinyllama-1.1b",
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
];

impl Shape {
    /// A preset by name (see [`PRESETS`]).
    pub fn preset(name: &str) -> Option<Shape> {
        let s = |n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab, n_ctx| Shape {
            n_layer,
            n_embd,
            n_ff,
            n_head,
            n_head_kv,
            n_vocab,
            n_ctx,
        };
        Some(match name {
            "tiny" => s(2, 256, 1024, 4, 2, None, 512),
            "tinyllama-1.1b" => s(22, 2048, 5632, 32, 4, Some(32000), 2048),
            "llama-2-7b" => s(32, 4096, 11008, 32, 32, Some(32000), 4096),
            "llama-2-13b" => s(40, 5120, 13824, 40, 40, Some(32000), 4096),
            "llama-2-70b" => s(80, 8192, 28672, 64, 8, Some(32000), 4096),
            _ => return None,
        })
    }

    /// Head size.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head.max(1)
    }

    /// Key/value width (`head_dim · n_head_kv`).
    pub fn n_embd_kv(&self) -> usize {
        self.head_dim() * self.n_head_kv
    }
}

/// Where the vocabulary comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VocabSource {
    /// The built-in SentencePiece byte vocabulary ([`vocab::builtin`]).
    BuiltIn,
    /// All `tokenizer.*` keys of this GGUF file.
    FromGguf(PathBuf),
}

/// Everything that defines a synthetic model (the files written are a pure function of it).
#[derive(Clone, Debug, PartialEq)]
pub struct SynthConfig {
    /// FFN variant of the LLaMA family (ignored when `ln_arch` is set).
    pub arch: Arch,
    /// `falcon` or `opt` instead of the LLaMA family (see [`SynthConfig::set_family`]).
    pub ln_arch: Option<LnArch>,
    /// Dimensions.
    pub shape: Shape,
    /// Type of the 2-D weights: F32, F16, Q8_0 or Q4_0 (1-D tensors are F32; the predictor
    /// follows [`predictor_type`]).
    pub ty: GgmlType,
    /// Seed of every random choice.
    pub seed: u64,
    /// Mean activation probability of a neuron (0, 1).
    pub density: f64,
    /// Share of all activations carried by the most active 20 % of the neurons [0.2, 1).
    pub skew: f64,
    /// Predictor rank `r` (hidden width `2r`); `None` = `n_embd / 16` rounded to a multiple
    /// of 16, at least 16.
    pub predictor_rank: Option<usize>,
    /// Share of the gate variance the predictor cannot see, in [0, 1).
    pub predictor_noise: f64,
    /// `powerinfer.sparse_threshold` to write, if any.
    pub sparse_threshold: Option<f32>,
    /// Vocabulary.
    pub vocab: VocabSource,
    /// How predictor tensors are stored for quantized types.
    pub predictor_rule: PredictorRule,
    /// `falcon` only: write `attn_norm_2` (Falcon-40B style: the attention reads
    /// `attn_norm_2`, the FFN `attn_norm`).
    pub attn_norm_2: bool,
    /// `llama`/`bamboo` only: two "topics" with different hot neurons. Tokens with an even id
    /// are of topic A, odd ids of topic B ([`TOPIC_CHANNEL`] tells the layers which); each
    /// topic's probabilities follow the same power law in its own random order, and the
    /// activation statistics written are their average (a corpus of both). Text that stays on
    /// one topic then has a hot set the statistics do not predict.
    pub topics: bool,
}

impl SynthConfig {
    /// A configuration with the defaults: `llama`, F16, seed 0, density 0.1, skew 0.8,
    /// predictor noise 0, built-in vocabulary.
    pub fn new(shape: Shape) -> SynthConfig {
        SynthConfig {
            arch: Arch::Llama,
            ln_arch: None,
            shape,
            ty: GgmlType::F16,
            seed: 0,
            density: 0.1,
            skew: 0.8,
            predictor_rank: None,
            predictor_noise: 0.0,
            sparse_threshold: None,
            vocab: VocabSource::BuiltIn,
            predictor_rule: PredictorRule::default(),
            attn_norm_2: false,
            topics: false,
        }
    }

    /// The model family written.
    pub fn family(&self) -> Family {
        match (self.ln_arch, self.arch) {
            (Some(LnArch::Falcon), _) => Family::Falcon,
            (Some(LnArch::Opt), _) => Family::Opt,
            (None, Arch::Llama) => Family::Llama,
            (None, Arch::Bamboo) => Family::Bamboo,
        }
    }

    /// Sets [`arch`](Self::arch) and [`ln_arch`](Self::ln_arch) for `family`.
    pub fn set_family(&mut self, family: Family) {
        match family {
            Family::Llama => (self.arch, self.ln_arch) = (Arch::Llama, None),
            Family::Bamboo => (self.arch, self.ln_arch) = (Arch::Bamboo, None),
            Family::Falcon => self.ln_arch = Some(LnArch::Falcon),
            Family::Opt => self.ln_arch = Some(LnArch::Opt),
        }
    }

    /// The predictor rank in effect.
    pub fn rank(&self) -> usize {
        self.predictor_rank
            .unwrap_or_else(|| ((self.shape.n_embd / 16) / 16 * 16).max(16))
    }
}

/// Where [`synthesize`] writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SynthOutputs {
    /// The PowerInfer (`PWRI`) file.
    pub model: PathBuf,
    /// The dense twin (`GGUF`), if wanted.
    pub dense: Option<PathBuf>,
    /// Folder for `activation_N.pt` and `activation.safetensors`, if wanted (PowerInfer's
    /// layout: `activation/` next to the model).
    pub activation_dir: Option<PathBuf>,
    /// Folder for the predictor as PowerInfer's converter takes it, if wanted: `model_N.pt`
    /// (state dict: `fc1.weight` torch shape `[2r, n_embd]`, `fc2.weight` `[n_ff, 2r]`, f32)
    /// and, with a sparse threshold, `config.json` with `sparse_threshold`.
    pub predictor_dir: Option<PathBuf>,
}

/// The llama.cpp `general.file_type` of a model whose 2-D weights are `ty`.
pub fn file_type_for(ty: GgmlType) -> Option<u32> {
    ftype_of(ty)
}
