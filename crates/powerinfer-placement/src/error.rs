//! Errors of the placement crate.

/// Why a budget, a placement or a GPU-index file could not be made.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// The model or GPU-index file could not be read or written.
    #[error(transparent)]
    Gguf(#[from] powerinfer_gguf::GgufError),
    /// The activation statistics could not be read.
    #[error(transparent)]
    Stats(#[from] powerinfer_predictor::stats::StatsError),
    /// A file system problem outside the GGUF code (model size and time, ...).
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The model does not have what the accounting needs (a metadata key, an FFN tensor, ...).
    #[error("model: {0}")]
    Model(String),
    /// The solver input is inconsistent (group size, NaN statistics, layer count, ...).
    #[error("placement: {0}")]
    Invalid(String),
}

/// Result type of this crate.
pub type Result<T> = std::result::Result<T, PlacementError>;
