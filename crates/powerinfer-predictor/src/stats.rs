//! Per-neuron activation statistics: for each layer, one value per FFN neuron saying how often
//! it fires (a probability, or a count over a profiling corpus; the placement solver only
//! ranks and sums them, so either works).
//!
//! Two file forms:
//!
//! - PowerInfer's folder `activation/` with `activation_0.pt`, `activation_1.pt`, ... (one 1-D
//!   torch tensor of length `n_ff` per layer). Layers are found in **numeric** order, starting
//!   at 0 and stopping at the first missing index (PowerInfer's exporter sorts file names as
//!   text, which mixes up layers 10+ with 2..9; this reader does not).
//! - One safetensors file (by default `activation/activation.safetensors`) with an F32 tensor
//!   `layer.N` of shape `[n_ff]` per layer and the header metadata `"format":
//!   "powerinfer-activation"`, `"n_layer"` and `"kind"` (e.g. `"probability"` or `"count"`).

use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};

use crate::pt::{self, PtError, PtTensor};

/// Why statistics could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    /// A `.pt` file problem.
    #[error("{path}: {source}")]
    Pt {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: PtError,
    },
    /// A safetensors problem.
    #[error("{path}: {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The statistics are inconsistent (no layers, a tensor that is not 1-D, ...).
    #[error("{0}")]
    Invalid(String),
}

/// Result type of this module.
pub type Result<T> = std::result::Result<T, StatsError>;

/// Name of layer `i`'s file in an activation folder.
pub fn pt_file_name(layer: usize) -> String {
    format!("activation_{layer}.pt")
}

/// Default name of the safetensors form inside the activation folder.
pub const SAFETENSORS_FILE_NAME: &str = "activation.safetensors";

/// The `format` value in the safetensors header metadata.
pub const SAFETENSORS_FORMAT: &str = "powerinfer-activation";

/// Name of layer `i`'s tensor in the safetensors form.
pub fn safetensors_tensor_name(layer: usize) -> String {
    format!("layer.{layer}")
}

/// Per-layer, per-neuron activation statistics.
#[derive(Clone, Debug, PartialEq)]
pub struct ActivationStats {
    /// `layers[l][i]`: the statistic of neuron `i` of layer `l`.
    pub layers: Vec<Vec<f32>>,
    /// What the values are (`"probability"`, `"count"`, ...; free text, stored in the
    /// safetensors metadata, not in `.pt` files).
    pub kind: String,
}

impl ActivationStats {
    /// Statistics with the given per-layer values.
    pub fn new(layers: Vec<Vec<f32>>, kind: impl Into<String>) -> ActivationStats {
        ActivationStats {
            layers,
            kind: kind.into(),
        }
    }

    /// Number of layers.
    pub fn n_layer(&self) -> usize {
        self.layers.len()
    }

    /// Reads `dir/activation_0.pt`, `dir/activation_1.pt`, ... until the first missing index.
    /// `kind` is set to `"unknown"` (`.pt` files do not say).
    pub fn read_pt_dir(dir: impl AsRef<Path>) -> Result<ActivationStats> {
        let dir = dir.as_ref();
        let mut layers = Vec::new();
        loop {
            let path = dir.join(pt_file_name(layers.len()));
            if !path.is_file() {
                break;
            }
            let t = pt::read_tensor(&path).map_err(|source| StatsError::Pt {
                path: path.clone(),
                source,
            })?;
            if t.shape().len() != 1 {
                return Err(StatsError::Invalid(format!(
                    "{}: shape {:?} is not 1-D",
                    path.display(),
                    t.shape()
                )));
            }
            layers.push(t.to_f32_vec());
        }
        if layers.is_empty() {
            return Err(StatsError::Invalid(format!(
                "{}: no {}",
                dir.display(),
                pt_file_name(0)
            )));
        }
        Ok(ActivationStats::new(layers, "unknown"))
    }

    /// Writes one `activation_N.pt` (1-D f32 tensor) per layer into `dir` (created if
    /// missing).
    pub fn write_pt_dir(&self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).map_err(|source| StatsError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        for (l, values) in self.layers.iter().enumerate() {
            let path = dir.join(pt_file_name(l));
            let t = PtTensor::from_f32(vec![values.len()], values).map_err(|source| {
                StatsError::Pt {
                    path: path.clone(),
                    source,
                }
            })?;
            pt::write_tensor(&path, &t).map_err(|source| StatsError::Pt { path, source })?;
        }
        Ok(())
    }

    /// The safetensors form as bytes. The header is written here (not by the `safetensors`
    /// crate, whose metadata map has no fixed order) so the bytes are deterministic: metadata
    /// keys sorted, tensors in layer order.
    pub fn to_safetensors_bytes(&self) -> Result<Vec<u8>> {
        let mut header = String::from("{\"__metadata__\":{");
        let meta = [
            ("format", SAFETENSORS_FORMAT.to_string()),
            ("kind", self.kind.clone()),
            ("n_layer", self.layers.len().to_string()),
        ];
        for (i, (k, v)) in meta.iter().enumerate() {
            if i > 0 {
                header.push(',');
            }
            header.push_str(&format!("{}:{}", json_string(k), json_string(v)));
        }
        header.push('}');
        let mut offset = 0usize;
        for (l, v) in self.layers.iter().enumerate() {
            let end = offset + 4 * v.len();
            header.push_str(&format!(
                ",{}:{{\"dtype\":\"F32\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
                json_string(&safetensors_tensor_name(l)),
                v.len()
            ));
            offset = end;
        }
        header.push('}');
        // Pad the header with spaces so the data starts 8-byte aligned.
        while header.len() % 8 != 0 {
            header.push(' ');
        }
        let mut out = Vec::with_capacity(8 + header.len() + offset);
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        for v in &self.layers {
            out.extend(v.iter().flat_map(|x| x.to_le_bytes()));
        }
        Ok(out)
    }

    /// Writes the safetensors form to `path` (atomically).
    pub fn write_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = self.to_safetensors_bytes()?;
        pt::write_atomic(path, &bytes).map_err(|source| StatsError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Reads the safetensors form from bytes (F32, F16, BF16, F64 or integer tensors
    /// `layer.0`, `layer.1`, ... until the first missing index).
    pub fn from_safetensors_bytes(bytes: &[u8]) -> std::result::Result<ActivationStats, String> {
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| e.to_string())?;
        let st = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let kind = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("kind").cloned())
            .unwrap_or_else(|| "unknown".into());
        let mut layers = Vec::new();
        while let Ok(t) = st.tensor(&safetensors_tensor_name(layers.len())) {
            if t.shape().len() != 1 {
                return Err(format!(
                    "{} has shape {:?}, not 1-D",
                    safetensors_tensor_name(layers.len()),
                    t.shape()
                ));
            }
            let d = t.data();
            let values: Vec<f32> = match t.dtype() {
                dt @ (Dtype::F32 | Dtype::F16 | Dtype::BF16) => {
                    safetensors_floats(dt, d).expect("a float dtype")
                }
                Dtype::F64 => d
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8")) as f32)
                    .collect(),
                Dtype::I64 => d
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8")) as f32)
                    .collect(),
                Dtype::I32 => d
                    .chunks_exact(4)
                    .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f32)
                    .collect(),
                other => return Err(format!("unsupported dtype {other:?}")),
            };
            layers.push(values);
        }
        if layers.is_empty() {
            return Err("no tensor layer.0".into());
        }
        Ok(ActivationStats::new(layers, kind))
    }

    /// Reads the safetensors form from `path`.
    pub fn read_safetensors(path: impl AsRef<Path>) -> Result<ActivationStats> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| StatsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        ActivationStats::from_safetensors_bytes(&bytes).map_err(|msg| StatsError::Safetensors {
            path: path.to_path_buf(),
            msg,
        })
    }
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The values of a safetensors tensor stored as F32, F16 or BF16 (little-endian), as f32;
/// `None` for any other dtype.
pub(crate) fn safetensors_floats(dtype: Dtype, data: &[u8]) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ActivationStats {
        ActivationStats::new(
            (0..12)
                .map(|l| (0..256).map(|i| (i * (l + 1)) as f32 / 4096.0).collect())
                .collect(),
            "probability",
        )
    }

    #[test]
    fn pt_dir_round_trip_in_numeric_order() {
        let dir = tempfile::tempdir().unwrap();
        let s = sample();
        s.write_pt_dir(dir.path()).unwrap();
        let back = ActivationStats::read_pt_dir(dir.path()).unwrap();
        // 12 layers: activation_10 and _11 must come after _9, not after _1.
        assert_eq!(back.layers, s.layers);
        assert!(ActivationStats::read_pt_dir(dir.path().join("nope")).is_err());
    }

    #[test]
    fn safetensors_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(SAFETENSORS_FILE_NAME);
        let s = sample();
        s.write_safetensors(&path).unwrap();
        assert_eq!(ActivationStats::read_safetensors(&path).unwrap(), s);
        // Deterministic bytes; odd characters in `kind` survive.
        assert_eq!(
            s.to_safetensors_bytes().unwrap(),
            s.to_safetensors_bytes().unwrap()
        );
        let odd = ActivationStats::new(s.layers.clone(), "count \"x\"\n\\");
        let back = ActivationStats::from_safetensors_bytes(&odd.to_safetensors_bytes().unwrap());
        assert_eq!(back.unwrap(), odd);
        std::fs::write(&path, b"garbage").unwrap();
        assert!(ActivationStats::read_safetensors(&path).is_err());
    }
}
