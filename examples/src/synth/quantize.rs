//! `quantize`: converts the 2-D weights of a GGUF or PowerInfer file to another type, tensor by
//! tensor, row block by row block (memory stays at a few MB whatever the model size).
//!
//! Rules (those of PowerInfer's `quantize`, except where noted):
//! - The magic is kept (`PWRI` stays `PWRI`), metadata is copied, `general.file_type` is set to
//!   the llama.cpp file type of the target, `general.quantization_version` = 2 is added for
//!   quantized targets.
//! - 1-D tensors (norms, biases) and tensors of types that cannot be converted (integers)
//!   are copied unchanged.
//! - Predictor tensors (`blk.N.fc1.weight`, `blk.N.fc2.weight`) follow [`predictor_type`].
//! - A type name as target (`q4_k`, `q2_k`, ...) gives every converted tensor that type, as
//!   llama.cpp's `llama-quantize --pure` does. llama.cpp's K-quant mixes (`q3_k_s` ... `q5_k_m`,
//!   [`KQuantMix`]) give most tensors the mix's base type and some more bits, by
//!   `llama_tensor_get_type`'s rules (see [`KQuantMix`]). llama.cpp's `Q2_K` mix is not offered
//!   (its name is the pure type's here), nor `Q2_K_S`, which llama.cpp only makes with an
//!   importance matrix.
//! - K-quant types fall back for tensors whose rows are not a multiple of 256 values as
//!   llama.cpp's `tensor_type_fallback` does: Q2_K and Q3_K to Q4_0, Q4_K to Q5_0, Q5_K to Q5_1,
//!   Q6_K to Q8_0; F16 when rows are not a multiple of 32 either.
//! - Re-quantizing already quantized tensors to another quantized type loses precision twice
//!   and is refused unless [`QuantizeOptions::allow_requantize`] is set.

use std::path::{Path, PathBuf};

use powerinfer_gguf::quants::{can_dequantize, dequantize};
use powerinfer_gguf::{GgmlType, GgufFile, GgufWriter, Value};

use super::rows::RowReader;
use super::SynthError;
use powerinfer_predictor::predictor::predictor_layer;

/// How predictor tensors (`fc1`, `fc2`) are stored when the target type is quantized.
///
/// Measured on synthetic models (`tests/synth.rs`,
/// `predictor_quantization_recall_precision`): against the F32 predictor, an F16 predictor
/// reproduces the active set almost exactly, while PowerInfer's Q5_0 / Q4_0 lose a few percent
/// of recall and precision. F16 costs 2 bytes per weight instead of 0.69 (Q5_0), which for a
/// predictor of rank r is `2·r·(n_embd + n_ff)` bytes per layer — small next to the FFN. So
/// F16 is the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PredictorRule {
    /// F16 (F32 for an F32 target).
    #[default]
    F16,
    /// PowerInfer's rule: Q4_0 for a Q4_0 target, Q5_0 for any other quantized target.
    PowerInfer,
    /// Always this type.
    Fixed(GgmlType),
}

/// The type of predictor tensors for a model whose 2-D weights are `target`: the target itself
/// for F32 / F16 targets, otherwise as `rule` says.
pub fn predictor_type(target: GgmlType, rule: PredictorRule) -> GgmlType {
    match (target, rule) {
        (_, PredictorRule::Fixed(t)) => t,
        (GgmlType::F32, _) => GgmlType::F32,
        (GgmlType::F16, _) => GgmlType::F16,
        (_, PredictorRule::F16) => GgmlType::F16,
        (GgmlType::Q4_0, PredictorRule::PowerInfer) => GgmlType::Q4_0,
        (_, PredictorRule::PowerInfer) => GgmlType::Q5_0,
    }
}

/// llama.cpp's `general.file_type` (`llama_ftype`) for a model whose weights are mostly `ty`.
pub fn ftype_of(ty: GgmlType) -> Option<u32> {
    use GgmlType::*;
    Some(match ty {
        F32 => 0,
        F16 => 1,
        Q4_0 => 2,
        Q4_1 => 3,
        Q8_0 => 7,
        Q5_0 => 8,
        Q5_1 => 9,
        Q2_K => 10,
        Q3_K => 11, // Q3_K_S
        Q4_K => 14, // Q4_K_S
        Q5_K => 16, // Q5_K_S
        Q6_K => 18,
        BF16 => 32,
        _ => return None,
    })
}

/// Target types `quantize` accepts (besides the mixes of [`KQuantMix`]): the weight types the
/// CPU kernels run.
pub const QUANTIZE_TYPES: [GgmlType; 13] = powerinfer_kernels_cpu::matmul::SUPPORTED_TYPES;

/// One of llama.cpp's K-quant mixes (its `llama_ftype`s of the same names): the base type for
/// most 2-D weights, more bits for the tensors `llama_tensor_get_type` singles out.
///
/// The rules, for the model families this crate runs (no experts); layer `i` of `n` counts as
/// "more bits" when `i < n/8`, `i >= 7n/8` or `(i - n/8) % 3 == 2` (llama.cpp's
/// `use_more_bits`), and `i` is the tensor's place among the file's tensors of its kind, as
/// llama.cpp counts:
///
/// | tensor | Q3_K_S | Q3_K_M | Q3_K_L | Q4_K_S | Q4_K_M | Q5_K_S | Q5_K_M |
/// |---|---|---|---|---|---|---|---|
/// | `output` (`token_embd` when the head is tied to it) | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K | Q6_K |
/// | `attn_v`, falcon's `attn_qkv` | | Q5_K for the first 2, else Q4_K | Q5_K | Q5_K for the first 4 | Q6_K on more-bits layers | | Q6_K on more-bits layers |
/// | `ffn_down`, PowerInfer's `ffn_down_t` | | Q5_K below n/16, else Q4_K (falcon: Q4_K on more-bits layers) | Q5_K (falcon: Q4_K) | Q5_K below n/8 (not falcon) | Q6_K on more-bits layers (falcon: Q6_K below n/16, Q5_K on more-bits layers) | | Q6_K on more-bits layers |
/// | `attn_output` | | Q4_K (not falcon) | Q5_K (falcon: Q4_K) | | | | |
///
/// Empty cells keep the base type. `output` becomes Q8_0 instead for falcon or rows that are
/// not whole 256-blocks; in a LLaMA with 80 layers and grouped-query attention (llama.cpp's
/// 70B), Q3_K/Q4_K `attn_v` become Q5_K. Predictors (`fc1`, `fc2`) follow [`PredictorRule`]
/// with the base type as target; the row-length fallbacks apply to every result.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KQuantMix {
    /// Q3_K, `output` Q6_K.
    Q3_K_S,
    /// Q3_K, more bits in `attn_v`, `ffn_down`, `attn_output`.
    Q3_K_M,
    /// Q3_K, Q5_K `attn_v` and `ffn_down`.
    Q3_K_L,
    /// Q4_K, Q5_K in the first `attn_v` and `ffn_down` tensors.
    Q4_K_S,
    /// Q4_K, Q6_K in half of the `attn_v` and `ffn_down` tensors.
    Q4_K_M,
    /// Q5_K, `output` Q6_K.
    Q5_K_S,
    /// Q5_K, Q6_K in half of the `attn_v` and `ffn_down` tensors.
    Q5_K_M,
}

impl KQuantMix {
    /// Every mix.
    pub const ALL: [KQuantMix; 7] = [
        KQuantMix::Q3_K_S,
        KQuantMix::Q3_K_M,
        KQuantMix::Q3_K_L,
        KQuantMix::Q4_K_S,
        KQuantMix::Q4_K_M,
        KQuantMix::Q5_K_S,
        KQuantMix::Q5_K_M,
    ];

    /// llama.cpp's name (`Q4_K_M`).
    pub fn name(self) -> &'static str {
        match self {
            KQuantMix::Q3_K_S => "Q3_K_S",
            KQuantMix::Q3_K_M => "Q3_K_M",
            KQuantMix::Q3_K_L => "Q3_K_L",
            KQuantMix::Q4_K_S => "Q4_K_S",
            KQuantMix::Q4_K_M => "Q4_K_M",
            KQuantMix::Q5_K_S => "Q5_K_S",
            KQuantMix::Q5_K_M => "Q5_K_M",
        }
    }

    /// The mix called `name` (any case).
    pub fn from_name(name: &str) -> Option<KQuantMix> {
        KQuantMix::ALL
            .into_iter()
            .find(|m| m.name().eq_ignore_ascii_case(name))
    }

    /// The type of the tensors no rule singles out.
    pub fn base(self) -> GgmlType {
        match self {
            KQuantMix::Q3_K_S | KQuantMix::Q3_K_M | KQuantMix::Q3_K_L => GgmlType::Q3_K,
            KQuantMix::Q4_K_S | KQuantMix::Q4_K_M => GgmlType::Q4_K,
            KQuantMix::Q5_K_S | KQuantMix::Q5_K_M => GgmlType::Q5_K,
        }
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`) of the mix.
    pub fn file_type(self) -> u32 {
        match self {
            KQuantMix::Q3_K_S => 11,
            KQuantMix::Q3_K_M => 12,
            KQuantMix::Q3_K_L => 13,
            KQuantMix::Q4_K_S => 14,
            KQuantMix::Q4_K_M => 15,
            KQuantMix::Q5_K_S => 16,
            KQuantMix::Q5_K_M => 17,
        }
    }
}

/// What [`quantize`] converts the 2-D weights to: one type, or one of llama.cpp's mixes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantizeTarget {
    /// Every converted tensor of this type (after the row-length fallbacks).
    Type(GgmlType),
    /// A K-quant mix.
    Mix(KQuantMix),
}

impl QuantizeTarget {
    /// The target called `name` (any case): a mix name (`q4_k_m`) or a type name (`q4_k`).
    /// Type names [`quantize`] does not accept still parse; it refuses them.
    pub fn from_name(name: &str) -> Option<QuantizeTarget> {
        KQuantMix::from_name(name)
            .map(QuantizeTarget::Mix)
            .or_else(|| GgmlType::from_name(name).map(QuantizeTarget::Type))
    }

    /// The name, as [`from_name`](Self::from_name) takes it (upper case).
    pub fn name(self) -> &'static str {
        match self {
            QuantizeTarget::Type(t) => t.name(),
            QuantizeTarget::Mix(m) => m.name(),
        }
    }

    /// The type most tensors get.
    pub fn base(self) -> GgmlType {
        match self {
            QuantizeTarget::Type(t) => t,
            QuantizeTarget::Mix(m) => m.base(),
        }
    }

    /// llama.cpp's `general.file_type` for the converted file.
    pub fn file_type(self) -> Option<u32> {
        match self {
            QuantizeTarget::Type(t) => ftype_of(t),
            QuantizeTarget::Mix(m) => Some(m.file_type()),
        }
    }

    /// Every target [`quantize`] accepts, by name.
    pub fn accepted_names() -> Vec<&'static str> {
        QUANTIZE_TYPES
            .iter()
            .map(|t| t.name())
            .chain(KQuantMix::ALL.iter().map(|m| m.name()))
            .collect()
    }
}

impl From<GgmlType> for QuantizeTarget {
    fn from(t: GgmlType) -> QuantizeTarget {
        QuantizeTarget::Type(t)
    }
}

impl From<KQuantMix> for QuantizeTarget {
    fn from(m: KQuantMix) -> QuantizeTarget {
        QuantizeTarget::Mix(m)
    }
}

impl std::fmt::Display for QuantizeTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Options of [`quantize`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QuantizeOptions {
    /// How predictor tensors are stored.
    pub predictor_rule: PredictorRule,
    /// Per layer, the type of that layer's predictor tensors, overriding `predictor_rule`
    /// (layers past the end, and `None` entries, follow the rule); e.g. the choice of
    /// [`choose_predictor_types`](crate::predictor_storage::choose_predictor_types).
    pub predictor_layers: Vec<Option<GgmlType>>,
    /// Allow converting tensors that are already quantized.
    pub allow_requantize: bool,
}

/// What [`quantize`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantizeReport {
    /// Per tensor: name, input type, output type.
    pub tensors: Vec<(String, GgmlType, GgmlType)>,
    /// Tensor data bytes read.
    pub bytes_in: u64,
    /// Tensor data bytes written.
    pub bytes_out: u64,
}

fn is_predictor(name: &str) -> bool {
    name.ends_with(".fc1.weight") || name.ends_with(".fc2.weight")
}

fn fits(ty: GgmlType, ne0: u64) -> bool {
    ne0 % ty.block_size() as u64 == 0
}

/// What llama.cpp's mix rules read of the model being converted: its `quantize_state_impl`
/// totals and the hyper-parameters they test.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct MixModel {
    /// `general.architecture` is `falcon`.
    pub falcon: bool,
    /// A `llama` of 80 layers with fewer KV heads than heads (llama.cpp's `LLM_TYPE_70B`).
    pub llama_70b: bool,
    /// Layers (`{arch}.block_count`; else the `ffn_down` tensors counted).
    pub n_layer: usize,
    /// Tensors named `attn_v`, `attn_qkv` or `attn_kv_b` weights.
    pub n_attn_v: usize,
    /// No `output.weight`: the head is `token_embd`, which then takes the output's type.
    pub tied_output: bool,
}

impl MixModel {
    /// The totals of `file`'s metadata and tensor directory.
    fn of<B: AsRef<[u8]>>(file: &GgufFile<B>) -> MixModel {
        let md = file.metadata();
        let arch = md.get_str("general.architecture").unwrap_or("");
        let uint = |k: &str| md.get(&format!("{arch}.{k}")).and_then(|v| v.to_u64());
        let names = || file.tensors().iter().map(|t| t.name());
        let n_layer = uint("block_count").map_or_else(
            || names().filter(|n| category(n) == Category::FfnDown).count(),
            |v| v as usize,
        );
        let n_head = uint("attention.head_count");
        let n_head_kv = uint("attention.head_count_kv").or(n_head);
        MixModel {
            falcon: arch == "falcon",
            llama_70b: arch == "llama" && n_layer == 80 && n_head != n_head_kv,
            n_layer,
            n_attn_v: names().filter(|n| category(n) == Category::AttnV).count(),
            tied_output: !names().any(|n| n == "output.weight"),
        }
    }
}

/// The tensor kinds llama.cpp's mix rules tell apart (`tensor_get_category`: the same name
/// tests in the same order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    /// `attn_v` and the tensors that hold it (`attn_qkv`, `attn_kv_b`).
    AttnV,
    AttnOutput,
    /// `ffn_down` and PowerInfer's `ffn_down_t`.
    FfnDown,
    /// Anything else, including `attn_q`, `attn_k`, `ffn_up`, `ffn_gate`, which no mix here
    /// changes.
    Other,
}

fn category(name: &str) -> Category {
    if name == "output.weight" {
        return Category::Output;
    }
    if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        return Category::TokenEmbd;
    }
    let has = |s: &str| name.contains(s);
    if has("attn_qkv.weight") || has("attn_kv_b.weight") || has("attn_v.weight") {
        Category::AttnV
    } else if has("attn_k.weight") || has("attn_q.weight") {
        Category::Other
    } else if has("attn_output.weight") {
        Category::AttnOutput
    } else if has("ffn_up") || has("ffn_gate") {
        Category::Other
    } else if has("ffn_down") {
        Category::FfnDown
    } else {
        Category::Other
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and every third one
/// between.
fn more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The per-tensor state of a conversion: the model's totals and the counters llama.cpp
/// advances as it meets `attn_v` and `ffn_down` tensors in file order.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MixState {
    pub model: MixModel,
    i_attn_v: usize,
    i_ffn_down: usize,
}

impl MixState {
    pub(crate) fn new(model: MixModel) -> MixState {
        MixState {
            model,
            i_attn_v: 0,
            i_ffn_down: 0,
        }
    }

    /// llama.cpp's `llama_tensor_get_type_impl` for `mix`, before the row-length fallback.
    fn mix_type(&mut self, mix: KQuantMix, name: &str, ne0: u64) -> GgmlType {
        use GgmlType::*;
        use KQuantMix as M;
        let m = self.model;
        let base = mix.base();
        let output = || {
            if m.falcon || !fits(base, ne0) {
                Q8_0
            } else {
                Q6_K
            }
        };
        match category(name) {
            Category::Output => output(),
            Category::TokenEmbd if m.tied_output => output(),
            Category::AttnV => {
                let i = self.i_attn_v;
                self.i_attn_v += 1;
                let t = match mix {
                    M::Q3_K_M if i < 2 => Q5_K,
                    M::Q3_K_M => Q4_K,
                    M::Q3_K_L => Q5_K,
                    M::Q4_K_M | M::Q5_K_M if more_bits(i, m.n_attn_v) => Q6_K,
                    M::Q4_K_S if i < 4 => Q5_K,
                    _ => base,
                };
                if m.llama_70b && matches!(t, Q3_K | Q4_K) {
                    Q5_K
                } else {
                    t
                }
            }
            Category::FfnDown => {
                let (i, n) = (self.i_ffn_down, m.n_layer);
                self.i_ffn_down += 1;
                match mix {
                    M::Q3_K_M if i < n / 16 => Q5_K,
                    M::Q3_K_M if !m.falcon || more_bits(i, n) => Q4_K,
                    M::Q3_K_L if m.falcon => Q4_K,
                    M::Q3_K_L => Q5_K,
                    M::Q4_K_M if m.falcon && i < n / 16 => Q6_K,
                    M::Q4_K_M if m.falcon && more_bits(i, n) => Q5_K,
                    M::Q4_K_M if !m.falcon && more_bits(i, n) => Q6_K,
                    M::Q5_K_M if more_bits(i, n) => Q6_K,
                    M::Q4_K_S if !m.falcon && i < n / 8 => Q5_K,
                    _ => base,
                }
            }
            Category::AttnOutput => match mix {
                M::Q3_K_M if !m.falcon => Q4_K,
                M::Q3_K_L if m.falcon => Q4_K,
                M::Q3_K_L => Q5_K,
                _ => base,
            },
            _ => base,
        }
    }
}

/// llama.cpp's `tensor_type_fallback`: the type a tensor with rows of `ne0` values gets instead
/// of `want` when its rows are not whole blocks of `want`.
fn fallback(want: GgmlType, ne0: u64) -> GgmlType {
    if fits(want, ne0) {
        return want;
    }
    let fallback = match want {
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        t => t,
    };
    if fits(fallback, ne0) {
        fallback
    } else {
        GgmlType::F16
    }
}

/// The type `name` (ggml shape `shape`, type `from`) gets in a `target` file. `state` carries
/// llama.cpp's per-file counters for a mix: call this for the file's tensors in order.
pub(crate) fn tensor_target(
    name: &str,
    shape: &[u64],
    from: GgmlType,
    target: QuantizeTarget,
    rule: PredictorRule,
    state: &mut MixState,
) -> GgmlType {
    let n_rows: u64 = shape.iter().skip(1).product();
    if shape.len() < 2 || n_rows <= 1 || shape.contains(&0) || !can_dequantize(from) {
        return from;
    }
    let ne0 = shape[0];
    let want = if is_predictor(name) {
        predictor_type(target.base(), rule)
    } else {
        match target {
            QuantizeTarget::Type(t) => t,
            QuantizeTarget::Mix(mix) => state.mix_type(mix, name, ne0),
        }
    };
    fallback(want, ne0)
}

/// Converts `input` to `output` with 2-D weights of type `target`. `progress` gets the bytes
/// just written and the total. The output appears only when complete.
pub fn quantize(
    input: &Path,
    output: &Path,
    target: impl Into<QuantizeTarget>,
    opts: QuantizeOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<QuantizeReport, SynthError> {
    let target = target.into();
    if let QuantizeTarget::Type(ty) = target {
        if !QUANTIZE_TYPES.contains(&ty) {
            return Err(SynthError::Config(format!(
                "cannot quantize to {target}; supported: {}",
                QuantizeTarget::accepted_names().join(", ")
            )));
        }
    }
    let same = match (input.canonicalize(), output.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same {
        return Err(SynthError::Config(
            "the output must be a different file from the input".into(),
        ));
    }
    let file = GgufFile::open(input)?;
    let mut plan = Vec::new();
    let mut state = MixState::new(MixModel::of(&file));
    for t in file.tensors() {
        let from = t.ggml_type();
        let layer_ty = predictor_layer(t.name())
            .and_then(|l| opts.predictor_layers.get(l).copied().flatten())
            .filter(|ty| t.shape().len() == 2 && fits(*ty, t.shape()[0]) && can_dequantize(from));
        let to = match layer_ty {
            Some(ty) => ty,
            None => tensor_target(
                t.name(),
                t.shape(),
                from,
                target,
                opts.predictor_rule,
                &mut state,
            ),
        };
        if to != from && t.shape()[0] % from.block_size() as u64 != 0 {
            return Err(SynthError::Config(format!(
                "tensor {}: rows of {} values are not whole {from} blocks",
                t.name(),
                t.shape()[0]
            )));
        }
        let widened = layer_ty.is_some() && !to.is_quantized();
        if to != from && from.is_quantized() && !widened && !opts.allow_requantize {
            return Err(SynthError::Config(format!(
                "tensor {} is already {from}; converting it to {to} loses precision twice \
                 (pass --allow-requantize to do it anyway)",
                t.name()
            )));
        }
        plan.push((t.clone(), to));
    }
    let mut w = GgufWriter::create(output, file.kind())?;
    w.add_metadata(file.metadata())?;
    if let Some(ft) = target.file_type() {
        w.add_kv("general.file_type", Value::U32(ft))?;
    }
    if target.base().is_quantized() {
        w.add_kv("general.quantization_version", Value::U32(2))?;
    }
    for (t, to) in &plan {
        w.add_tensor(t.name(), t.shape(), *to)?;
    }
    let total: u64 = plan
        .iter()
        .map(|(t, to)| to.bytes_for(t.n_elements()).unwrap_or(0))
        .sum();
    let mut report = QuantizeReport {
        tensors: Vec::new(),
        bytes_in: 0,
        bytes_out: 0,
    };
    for (t, to) in &plan {
        let from = t.ggml_type();
        let data = file.data_of(t);
        report.bytes_in += data.len() as u64;
        let out_bytes = to.bytes_for(t.n_elements()).unwrap_or(0);
        if from == *to {
            w.write_tensor_data(t.name(), data)?;
            progress(out_bytes, total);
        } else {
            let ne0 = t.shape()[0] as usize;
            let n_rows = (t.n_elements() / t.shape()[0]) as usize;
            let in_row = data.len() / n_rows;
            let gen = move |r: usize, out: &mut [f32]| {
                // Cannot fail: rows are whole blocks (checked with the plan) and the reader checked
                // the tensor's byte size.
                let _ = dequantize(from, &data[r * in_row..(r + 1) * in_row], out);
            };
            let mut report_bytes = |b: u64| progress(b, total);
            let mut reader = RowReader {
                ty: *to,
                ne0,
                n_rows,
                next_row: 0,
                gen: &gen,
                buf: Vec::new(),
                pos: 0,
                progress: &mut report_bytes,
            };
            w.write_tensor_from(t.name(), &mut reader)?;
        }
        report.bytes_out += out_bytes;
        report.tensors.push((t.name().to_string(), from, *to));
    }
    w.finish()?.commit()?;
    Ok(report)
}

/// The default output name for `input` quantized to `target`: `<stem>.<type>.<ext>` next to
/// the input, e.g. `model.powerinfer.gguf` -> `model.q4_0.powerinfer.gguf`.
pub fn default_output(input: &Path, target: impl Into<QuantizeTarget>) -> PathBuf {
    let target = target.into();
    let name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ty = target.name().to_lowercase();
    let new = match name.find('.') {
        Some(i) => format!("{}.{ty}{}", &name[..i], &name[i..]),
        None => format!("{name}.{ty}"),
    };
    input.with_file_name(new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType::*;

    #[test]
    fn target_rules() {
        let t = |name, shape: &[u64], from, to: GgmlType, rule| {
            tensor_target(name, shape, from, to.into(), rule, &mut MixState::default())
        };
        let pi = PredictorRule::PowerInfer;
        let f16 = PredictorRule::F16;
        assert_eq!(t("blk.0.ffn_norm.weight", &[256], F32, Q4_0, pi), F32);
        assert_eq!(t("blk.0.ffn_up.weight", &[256, 1024], F16, Q4_0, pi), Q4_0);
        assert_eq!(t("blk.0.fc1.weight", &[256, 64], F16, Q4_0, pi), Q4_0);
        assert_eq!(t("blk.0.fc2.weight", &[64, 1024], F16, Q8_0, pi), Q5_0);
        assert_eq!(t("blk.0.fc2.weight", &[64, 1024], F16, Q8_0, f16), F16);
        assert_eq!(t("blk.0.fc2.weight", &[64, 1024], F32, F32, pi), F32);
        // K-quant fallbacks (llama.cpp's tensor_type_fallback), then F16.
        assert_eq!(t("x.weight", &[96, 8], F32, Q2_K, pi), Q4_0);
        assert_eq!(t("x.weight", &[96, 8], F32, Q3_K, pi), Q4_0);
        assert_eq!(t("x.weight", &[96, 8], F32, Q4_K, pi), Q5_0);
        assert_eq!(t("x.weight", &[96, 8], F32, Q5_K, pi), Q5_1);
        assert_eq!(t("x.weight", &[96, 8], F32, Q6_K, pi), Q8_0);
        assert_eq!(t("x.weight", &[48, 8], F32, Q4_K, pi), F16);
        assert_eq!(t("x.weight", &[48, 8], F32, Q2_K, pi), F16);
        for ty in [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K] {
            assert_eq!(t("x.weight", &[512, 8], F32, ty, pi), ty);
        }
        // Single rows, empty tensors and integer tensors are copied.
        assert_eq!(t("x.weight", &[256, 1], F32, Q4_0, pi), F32);
        assert_eq!(t("x.weight", &[0, 8], F32, Q4_0, pi), F32);
        assert_eq!(t("x.weight", &[256, 8], I32, Q4_0, pi), I32);
        assert_eq!(ftype_of(Q4_0), Some(2));
        assert_eq!(
            [Q2_K, Q3_K, Q4_K, Q5_K, Q6_K].map(ftype_of),
            [Some(10), Some(11), Some(14), Some(16), Some(18)]
        );
        assert_eq!(
            default_output(Path::new("/m/model.powerinfer.gguf"), Q4_0),
            Path::new("/m/model.q4_0.powerinfer.gguf")
        );
        assert_eq!(
            default_output(Path::new("/m/model.gguf"), KQuantMix::Q4_K_M),
            Path::new("/m/model.q4_k_m.gguf")
        );
    }

    #[test]
    fn target_names() {
        let p = QuantizeTarget::from_name;
        assert_eq!(p("q4_k_m"), Some(QuantizeTarget::Mix(KQuantMix::Q4_K_M)));
        assert_eq!(p("Q3_K_L"), Some(QuantizeTarget::Mix(KQuantMix::Q3_K_L)));
        assert_eq!(p("q4_k"), Some(QuantizeTarget::Type(Q4_K)));
        assert_eq!(p("q2_k"), Some(QuantizeTarget::Type(Q2_K)));
        assert_eq!(p("q2_k_s"), None);
        assert_eq!(p("q9"), None);
        for m in KQuantMix::ALL {
            assert_eq!(p(&m.name().to_lowercase()), Some(QuantizeTarget::Mix(m)));
            assert_eq!(QuantizeTarget::Mix(m).file_type(), Some(m.file_type()));
        }
        assert_eq!(
            KQuantMix::ALL.map(|m| m.file_type()),
            [11, 12, 13, 14, 15, 16, 17]
        );
        let names = QuantizeTarget::accepted_names();
        assert!(names.contains(&"Q5_K_M") && names.contains(&"Q2_K"));
    }

    /// A PowerInfer LLaMA's 2-D tensors, in the order the files hold them.
    fn llama_tensors(n_layer: usize, attn_v: &str) -> Vec<(String, Vec<u64>)> {
        let mut v = vec![("token_embd.weight".to_string(), vec![4096, 32000])];
        for i in 0..n_layer {
            for (n, shape) in [
                ("attn_q", [4096, 4096]),
                ("attn_k", [4096, 1024]),
                (attn_v, [4096, 1024]),
                ("attn_output", [4096, 4096]),
                ("ffn_gate", [4096, 11008]),
                ("ffn_up", [4096, 11008]),
                ("ffn_down_t", [4096, 11008]),
                ("fc1", [4096, 1024]),
                ("fc2", [1024, 11008]),
            ] {
                v.push((format!("blk.{i}.{n}.weight"), shape.to_vec()));
            }
        }
        v.push(("output.weight".to_string(), vec![4096, 32000]));
        v
    }

    /// The type of every tensor of `tensors` under `mix`, keyed by name.
    fn plan(
        mix: KQuantMix,
        model: MixModel,
        tensors: &[(String, Vec<u64>)],
    ) -> std::collections::HashMap<String, GgmlType> {
        let mut state = MixState::new(model);
        tensors
            .iter()
            .map(|(name, shape)| {
                let rule = PredictorRule::F16;
                let ty = tensor_target(name, shape, F32, mix.into(), rule, &mut state);
                (name.clone(), ty)
            })
            .collect()
    }

    fn llama(n_layer: usize) -> MixModel {
        MixModel {
            n_layer,
            n_attn_v: n_layer,
            ..MixModel::default()
        }
    }

    /// The layers llama.cpp's `use_more_bits` picks out of 32, written out.
    const MORE_BITS_32: [usize; 16] = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31];

    #[test]
    fn k_quant_mixes_follow_llama_cpp() {
        let tensors = llama_tensors(32, "attn_v");
        let layer = |p: &std::collections::HashMap<String, GgmlType>, i: usize, n: &str| {
            p[&format!("blk.{i}.{n}.weight")]
        };
        for mix in KQuantMix::ALL {
            let p = plan(mix, llama(32), &tensors);
            let base = mix.base();
            assert_eq!(p["output.weight"], Q6_K, "{mix:?}");
            assert_eq!(p["token_embd.weight"], base, "{mix:?}");
            for i in 0..32 {
                let more = MORE_BITS_32.contains(&i);
                let (v, down, out) = match mix {
                    KQuantMix::Q3_K_S | KQuantMix::Q5_K_S => (base, base, base),
                    KQuantMix::Q3_K_M => (
                        if i < 2 { Q5_K } else { Q4_K },
                        if i < 2 { Q5_K } else { Q4_K },
                        Q4_K,
                    ),
                    KQuantMix::Q3_K_L => (Q5_K, Q5_K, Q5_K),
                    KQuantMix::Q4_K_S => {
                        let t = if i < 4 { Q5_K } else { Q4_K };
                        (t, t, Q4_K)
                    }
                    KQuantMix::Q4_K_M | KQuantMix::Q5_K_M => {
                        let t = if more { Q6_K } else { base };
                        (t, t, base)
                    }
                };
                let what = format!("{mix:?} layer {i}");
                assert_eq!(layer(&p, i, "attn_v"), v, "{what}");
                assert_eq!(layer(&p, i, "ffn_down_t"), down, "{what}");
                assert_eq!(layer(&p, i, "attn_output"), out, "{what}");
                for n in ["attn_q", "attn_k", "ffn_gate", "ffn_up"] {
                    assert_eq!(layer(&p, i, n), base, "{what} {n}");
                }
                assert_eq!(layer(&p, i, "fc1"), F16, "{what}");
                assert_eq!(layer(&p, i, "fc2"), F16, "{what}");
            }
        }
    }

    #[test]
    fn k_quant_mix_special_cases() {
        use KQuantMix::*;
        // falcon: fused attn_qkv takes attn_v's rules; output Q8_0; its own ffn_down and
        // attn_output rules.
        let mut falcon = llama_tensors(32, "attn_qkv");
        falcon.retain(|(n, _)| !n.contains("attn_q.") && !n.contains("attn_k."));
        let model = MixModel {
            falcon: true,
            ..llama(32)
        };
        let p = plan(Q4_K_M, model, &falcon);
        assert_eq!(p["output.weight"], Q8_0);
        for i in 0..32 {
            let more = MORE_BITS_32.contains(&i);
            let qkv = p[&format!("blk.{i}.attn_qkv.weight")];
            assert_eq!(qkv, if more { Q6_K } else { Q4_K }, "layer {i}");
            let down = p[&format!("blk.{i}.ffn_down_t.weight")];
            let want = if i < 2 {
                Q6_K
            } else if more {
                Q5_K
            } else {
                Q4_K
            };
            assert_eq!(down, want, "layer {i}");
        }
        let p = plan(Q3_K_M, model, &falcon);
        assert_eq!(p["blk.5.attn_output.weight"], Q3_K);
        assert_eq!(p["blk.5.ffn_down_t.weight"], Q3_K);
        assert_eq!(p["blk.6.ffn_down_t.weight"], Q4_K);
        assert_eq!(p["blk.1.ffn_down_t.weight"], Q5_K);
        let p = plan(Q3_K_L, model, &falcon);
        assert_eq!(p["blk.5.attn_output.weight"], Q4_K);
        assert_eq!(p["blk.5.ffn_down_t.weight"], Q4_K);
        let p = plan(Q4_K_S, model, &falcon);
        assert_eq!(p["blk.0.ffn_down_t.weight"], Q4_K);

        // A head tied to token_embd: token_embd takes the output's type.
        let mut tied = llama_tensors(8, "attn_v");
        tied.retain(|(n, _)| n != "output.weight");
        let model = MixModel {
            tied_output: true,
            ..llama(8)
        };
        assert_eq!(plan(Q3_K_S, model, &tied)["token_embd.weight"], Q6_K);

        // llama.cpp's 70B: Q3_K/Q4_K attn_v become Q5_K.
        let big = llama_tensors(80, "attn_v");
        let model = MixModel {
            llama_70b: true,
            ..llama(80)
        };
        let p = plan(Q4_K_M, model, &big);
        let v = |i: usize| p[&format!("blk.{i}.attn_v.weight")];
        assert_eq!((v(0), v(10), v(11), v(12)), (Q6_K, Q5_K, Q5_K, Q6_K));
        assert_eq!(p["blk.11.attn_q.weight"], Q4_K);

        // Rows that are not whole 256-blocks: output Q8_0, the others fall back.
        let odd = vec![
            ("blk.0.attn_v.weight".to_string(), vec![96, 8]),
            ("blk.0.ffn_down.weight".to_string(), vec![96, 8]),
            ("blk.0.ffn_up.weight".to_string(), vec![96, 8]),
            ("output.weight".to_string(), vec![96, 8]),
        ];
        let p = plan(Q4_K_M, llama(1), &odd);
        assert_eq!(p["blk.0.attn_v.weight"], Q8_0);
        assert_eq!(p["blk.0.ffn_down.weight"], Q8_0);
        assert_eq!(p["blk.0.ffn_up.weight"], Q5_0);
        assert_eq!(p["output.weight"], Q8_0);
        let p = plan(Q3_K_S, llama(1), &odd);
        assert_eq!(p["blk.0.ffn_up.weight"], Q4_0);
    }
}
