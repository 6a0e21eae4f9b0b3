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
//! - K-quant targets fall back for tensors whose rows are not a multiple of 256 values: Q4_K to
//!   Q5_0, Q6_K to Q8_0 (F16 when rows are not a multiple of 32 either), as llama.cpp does.
//! - Re-quantizing already quantized tensors to another quantized type loses precision twice
//!   and is refused unless [`QuantizeOptions::allow_requantize`] is set.

use std::path::{Path, PathBuf};

use powerinfer_gguf::quants::{can_dequantize, dequantize};
use powerinfer_gguf::{GgmlType, GgufFile, GgufWriter, Value};

use super::generate::RowReader;
use super::SynthError;

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
        Q4_K => 14, // Q4_K_S
        Q6_K => 18,
        BF16 => 32,
        _ => return None,
    })
}

/// Target types `quantize` accepts.
pub const QUANTIZE_TYPES: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

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

/// The layer of a predictor tensor `blk.N.fc1.weight` / `blk.N.fc2.weight`.
fn predictor_layer(name: &str) -> Option<usize> {
    let rest = name.strip_prefix("blk.")?;
    let (n, tail) = rest.split_once('.')?;
    matches!(tail, "fc1.weight" | "fc2.weight")
        .then(|| n.parse().ok())
        .flatten()
}

fn fits(ty: GgmlType, ne0: u64) -> bool {
    ne0 % ty.block_size() as u64 == 0
}

/// The type `name` (ggml shape `shape`, type `from`) gets in a `target` file.
pub(crate) fn tensor_target(
    name: &str,
    shape: &[u64],
    from: GgmlType,
    target: GgmlType,
    rule: PredictorRule,
) -> GgmlType {
    let n_rows: u64 = shape.iter().skip(1).product();
    if shape.len() < 2 || n_rows <= 1 || shape.contains(&0) || !can_dequantize(from) {
        return from;
    }
    let want = if is_predictor(name) {
        predictor_type(target, rule)
    } else {
        target
    };
    let ne0 = shape[0];
    if fits(want, ne0) {
        return want;
    }
    let fallback = match want {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q6_K => GgmlType::Q8_0,
        t => t,
    };
    if fits(fallback, ne0) {
        fallback
    } else {
        GgmlType::F16
    }
}

/// Converts `input` to `output` with 2-D weights of type `target`. `progress` gets the bytes
/// just written and the total. The output appears only when complete.
pub fn quantize(
    input: &Path,
    output: &Path,
    target: GgmlType,
    opts: QuantizeOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<QuantizeReport, SynthError> {
    if !QUANTIZE_TYPES.contains(&target) {
        let names: Vec<&str> = QUANTIZE_TYPES.iter().map(|t| t.name()).collect();
        return Err(SynthError::Config(format!(
            "cannot quantize to {target}; supported: {}",
            names.join(", ")
        )));
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
    for t in file.tensors() {
        let from = t.ggml_type();
        let layer_ty = predictor_layer(t.name())
            .and_then(|l| opts.predictor_layers.get(l).copied().flatten())
            .filter(|ty| t.shape().len() == 2 && fits(*ty, t.shape()[0]) && can_dequantize(from));
        let to = layer_ty.unwrap_or_else(|| {
            tensor_target(t.name(), t.shape(), from, target, opts.predictor_rule)
        });
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
    if let Some(ft) = ftype_of(target) {
        w.add_kv("general.file_type", Value::U32(ft))?;
    }
    if target.is_quantized() {
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
pub fn default_output(input: &Path, target: GgmlType) -> PathBuf {
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
        let t = |name, shape: &[u64], from, to, rule| tensor_target(name, shape, from, to, rule);
        let pi = PredictorRule::PowerInfer;
        let f16 = PredictorRule::F16;
        assert_eq!(t("blk.0.ffn_norm.weight", &[256], F32, Q4_0, pi), F32);
        assert_eq!(t("blk.0.ffn_up.weight", &[256, 1024], F16, Q4_0, pi), Q4_0);
        assert_eq!(t("blk.0.fc1.weight", &[256, 64], F16, Q4_0, pi), Q4_0);
        assert_eq!(t("blk.0.fc2.weight", &[64, 1024], F16, Q8_0, pi), Q5_0);
        assert_eq!(t("blk.0.fc2.weight", &[64, 1024], F16, Q8_0, f16), F16);
        assert_eq!(t("blk.0.fc2.weight", &[64, 1024], F32, F32, pi), F32);
        // K-quant fallbacks, then F16.
        assert_eq!(t("x.weight", &[96, 8], F32, Q4_K, pi), Q5_0);
        assert_eq!(t("x.weight", &[96, 8], F32, Q6_K, pi), Q8_0);
        assert_eq!(t("x.weight", &[48, 8], F32, Q4_K, pi), F16);
        assert_eq!(t("x.weight", &[512, 8], F32, Q4_K, pi), Q4_K);
        // Single rows, empty tensors and integer tensors are copied.
        assert_eq!(t("x.weight", &[256, 1], F32, Q4_0, pi), F32);
        assert_eq!(t("x.weight", &[0, 8], F32, Q4_0, pi), F32);
        assert_eq!(t("x.weight", &[256, 8], I32, Q4_0, pi), I32);
        assert_eq!(ftype_of(Q4_0), Some(2));
        assert_eq!(
            default_output(Path::new("/m/model.powerinfer.gguf"), Q4_0),
            Path::new("/m/model.q4_0.powerinfer.gguf")
        );
    }
}
