//! The command's environment: every environment variable the `powerinfer` command reads is
//! read here, and nowhere else in the workspace (`tests/architecture.rs` checks it). The
//! library crates take what they need as options.
//!
//! - the cache folders: `XDG_CACHE_HOME`, else `$HOME/.cache` ([`cache_home`]);
//! - the Hugging Face Hub's variables (`HF_HOME`, `HF_HUB_CACHE`, `HF_ENDPOINT`, `HF_TOKEN`,
//!   `HF_TOKEN_PATH`, `HF_HUB_OFFLINE`), as `huggingface_hub` reads them ([`var`]);
//! - PowerInfer's and llama.cpp's tuning variables: `LLAMA_SPARSE_PRED_THRESHOLD`,
//!   `POWERINFER_NOFUSE`, `POWERINFER_CPU_ISA` ([`Tuning`]).

use std::path::PathBuf;

/// Variable `k`, when it is set and not empty.
pub fn var(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.is_empty())
}

/// The user's cache folder: `$XDG_CACHE_HOME`, else `$HOME/.cache` (`None` when neither is
/// set).
pub fn cache_home() -> Option<PathBuf> {
    let var_os = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
}

/// The engine's tuning as PowerInfer's and llama.cpp's environment variables set it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Tuning {
    /// `LLAMA_SPARSE_PRED_THRESHOLD`: the predictor's threshold.
    pub sparse_threshold: Option<f32>,
    /// `POWERINFER_NOFUSE` set: the sparse FFN's products in separate dispatches.
    pub no_fuse: bool,
    /// `POWERINFER_CPU_ISA=scalar`: the scalar kernels.
    pub scalar_kernels: bool,
}

impl Tuning {
    /// The variables as they are set now.
    pub fn from_env() -> Tuning {
        Tuning {
            sparse_threshold: var("LLAMA_SPARSE_PRED_THRESHOLD")
                .and_then(|s| s.trim().parse::<f32>().ok()),
            no_fuse: std::env::var_os("POWERINFER_NOFUSE").is_some(),
            scalar_kernels: var("POWERINFER_CPU_ISA")
                .is_some_and(|v| v.eq_ignore_ascii_case("scalar")),
        }
    }
}
