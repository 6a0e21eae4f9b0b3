//! The error type of model loading and inference.

use powerinfer_gguf::GgufError;
use powerinfer_kernels_cpu::KernelError;

use crate::tokenizer::TokenizerError;

/// Errors of loading a model and of evaluating, sampling and generating with it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The file could not be read or parsed, or a metadata key is missing or mistyped.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A kernel refused its arguments (a bug or an unsupported weight type).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The tokenizer metadata is invalid.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A predictor could not be built or run.
    #[error(transparent)]
    Predictor(#[from] powerinfer_predictor::predictor::PredictorError),
    /// A tensor could not be dequantized.
    #[error(transparent)]
    Quant(#[from] powerinfer_gguf::quants::QuantError),
    /// `general.architecture` names a model family this engine cannot run (yet).
    #[error("unsupported architecture `{0}` (supported: llama, bamboo, falcon, opt)")]
    UnsupportedArch(String),
    /// A tensor the architecture needs is not in the file.
    #[error("missing tensor `{0}`")]
    MissingTensor(String),
    /// A tensor has another shape than the hyper-parameters imply.
    #[error("tensor `{name}` has shape {got:?}, expected {}", expected_dims(.expected))]
    TensorShape {
        /// Tensor name.
        name: String,
        /// Expected ggml shape (`[ne0, ne1]`; `0` = any value).
        expected: Vec<u64>,
        /// Shape in the file.
        got: Vec<u64>,
    },
    /// Inconsistent or invalid hyper-parameters.
    #[error("invalid hyper-parameters: {0}")]
    Hparams(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    InvalidToken {
        /// The id.
        id: u32,
        /// Vocabulary size.
        n_vocab: usize,
    },
    /// The sequence would exceed the KV cache's context length.
    #[error("context full: {needed} positions needed, the KV cache holds {ctx_len}")]
    ContextFull {
        /// Positions needed.
        needed: usize,
        /// Capacity.
        ctx_len: usize,
    },
    /// A sequence id that the KV cache does not know.
    #[error("unknown sequence {0}")]
    UnknownSequence(usize),
    /// An invalid argument (empty prompt, bad option).
    #[error("{0}")]
    Invalid(String),
    /// The device that was asked for cannot be used (no driver, no device, too old).
    #[error("no GPU: {0}")]
    NoGpu(String),
    /// The device's memory budget refused an allocation; nothing was allocated.
    #[error(
        "device memory budget exceeded: {requested} bytes requested, {used} of {limit} in use"
    )]
    DeviceMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes in use.
        used: u64,
        /// The budget.
        limit: u64,
    },
    /// The device failed.
    #[error("device: {0}")]
    Device(String),
    /// The neuron placement could not be planned (statistics, GPU index, budget).
    #[error("placement: {0}")]
    Placement(#[from] powerinfer_placement::PlacementError),
}

/// `Result` with [`EngineError`].
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// An expected shape as `[2048, *]`: a `0` dimension accepts any length.
fn expected_dims(d: &[u64]) -> String {
    let parts: Vec<String> = d
        .iter()
        .map(|&n| {
            if n == 0 {
                "*".to_string()
            } else {
                n.to_string()
            }
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::EngineError;

    #[test]
    fn shape_errors_show_free_dimensions_as_stars() {
        let e = EngineError::TensorShape {
            name: "token_embd.weight".into(),
            expected: vec![256, 0],
            got: vec![256],
        };
        assert_eq!(
            e.to_string(),
            "tensor `token_embd.weight` has shape [256], expected [256, *]"
        );
    }
}
