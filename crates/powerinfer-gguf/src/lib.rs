//! # powerinfer-gguf
//!
//! The container format of llama.cpp and PowerInfer model files: GGUF v2/v3 with the `GGUF`
//! magic (dense models) or PowerInfer's `PWRI` magic (sparse models), their metadata, tensor
//! directory and tensor data, the ggml element types with their quantization block codecs, and
//! PowerInfer's GPU-index file (`<model>.generated.gpuidx`).
//!
//! Data flows one way: bytes (usually a memory map) -> [`GgmlType`]-typed tensor views ->
//! kernels. Nothing in this crate knows about models or inference.
//!
//! - [`GgufFile::open`] maps a file and parses its header, metadata ([`Metadata`]) and tensor
//!   directory ([`TensorInfo`]); tensor bytes are borrowed from the map on demand.
//!   [`GgufFile::from_bytes`] does the same for bytes in memory.
//! - [`GgufWriter`] writes files with tensor data streamed one tensor at a time.
//! - [`gpuidx::GpuIndex`] reads and writes the GPU-index file.
//! - [`conventions`]: numbers of model families that files agree on (OPT's position offset).
//! - [`split::SplitModel`] opens `NAME-0000i-of-0000n.gguf` parts as one tensor directory.
//!
//! Malformed input never panics: every problem is a [`GgufError`] that names the byte offset.

#![warn(missing_docs)]

pub mod conventions;
pub mod error;
pub mod gpuidx;
pub mod metadata;
pub mod quants;
pub mod reader;
pub mod split;
pub mod types;
pub mod writer;

pub use error::{GgufError, Result};
pub use gpuidx::{GpuIndex, LayerGpuIndex};
pub use metadata::{Array, Metadata, Value, ValueType};
pub use reader::{FileKind, GgmlBlock, GgufFile, GgufHeader, TensorInfo};
pub use types::GgmlType;
pub use writer::{AtomicFile, GgufWriter};
