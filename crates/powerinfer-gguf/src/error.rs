//! The error type of everything in this crate that reads or writes files.

use std::path::PathBuf;

use crate::types::{GgmlType, ValueType};

/// Shorthand for results whose error is [`GgufError`].
pub type Result<T, E = GgufError> = std::result::Result<T, E>;

/// What went wrong reading or writing a GGUF, PowerInfer or GPU-index file.
///
/// Errors about the bytes of a file name the byte offset (from the start of the file) where
/// the offending item starts, so a corrupt file can be examined with a hex dump.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// Opening, mapping, reading or writing a file failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Writing to a caller-supplied stream failed.
    #[error("write failed: {0}")]
    Write(#[from] std::io::Error),
    /// The file ends inside an item.
    #[error("truncated file: {what} at byte {offset} needs {needed} bytes, only {available} left")]
    Truncated {
        /// The item being read.
        what: &'static str,
        /// Where it starts.
        offset: u64,
        /// Bytes it needs.
        needed: u64,
        /// Bytes left in the file from `offset`.
        available: u64,
    },
    /// The first four bytes are neither `GGUF` nor `PWRI`.
    #[error("not a GGUF file: magic at byte 0 is {found:02x?}, expected \"GGUF\" or \"PWRI\"")]
    BadMagic {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// GGUF version 1 (32-bit counts), which llama.cpp no longer reads either.
    #[error("GGUF version 1 at byte 4 is not supported (it uses 32-bit counts); convert the file to version 3")]
    VersionOne,
    /// A version other than 1, 2 or 3.
    #[error("unsupported GGUF version {version} at byte 4 (supported: 2 and 3){hint}", hint = if version.swap_bytes() <= 3 { " — the file looks big-endian, which is not supported" } else { "" })]
    UnsupportedVersion {
        /// The version found.
        version: u32,
    },
    /// A count (tensors, key-value pairs, array elements) or string length claims more items
    /// than the remaining bytes can hold.
    #[error("{what} at byte {offset} claims {count} items of at least {min_size} bytes each, but only {available} bytes are left")]
    CountTooLarge {
        /// The counted thing.
        what: &'static str,
        /// Where the count is stored.
        offset: u64,
        /// The claimed count.
        count: u64,
        /// The smallest size one item can have.
        min_size: u64,
        /// Bytes left after the count.
        available: u64,
    },
    /// Arrays nested deeper than [`MAX_ARRAY_DEPTH`](crate::reader::MAX_ARRAY_DEPTH).
    #[error("array at byte {offset} is nested more than {max} levels deep")]
    TooDeep {
        /// Where the innermost array starts.
        offset: u64,
        /// The limit.
        max: u32,
    },
    /// A string is not valid UTF-8.
    #[error("string at byte {offset} is not valid UTF-8")]
    InvalidUtf8 {
        /// Where the string's bytes start.
        offset: u64,
    },
    /// A bool value is neither 0 nor 1.
    #[error("bool at byte {offset} has value {value}, expected 0 or 1")]
    InvalidBool {
        /// Where the byte is.
        offset: u64,
        /// The byte found.
        value: u8,
    },
    /// A metadata value type id outside 0..=12.
    #[error("unknown metadata value type {id} at byte {offset}")]
    UnknownValueType {
        /// Where the type id is.
        offset: u64,
        /// The id found.
        id: u32,
    },
    /// A key appears twice.
    #[error("duplicate metadata key {key:?} at byte {offset}")]
    DuplicateKey {
        /// The key.
        key: String,
        /// Where the second occurrence starts.
        offset: u64,
    },
    /// `general.alignment` is not a u32, zero, or not a power of two.
    #[error("invalid general.alignment: {reason}")]
    BadAlignment {
        /// What is wrong.
        reason: String,
    },
    /// A tensor has more than four dimensions.
    #[error("tensor {name:?} at byte {offset} has {n_dims} dimensions, at most 4 are allowed")]
    TooManyDims {
        /// The tensor.
        name: String,
        /// Where its `n_dims` is stored.
        offset: u64,
        /// The count found.
        n_dims: u32,
    },
    /// A tensor's element count or byte size overflows 63 bits.
    #[error("tensor {name:?} at byte {offset}: shape {shape:?} overflows")]
    ShapeOverflow {
        /// The tensor.
        name: String,
        /// Where its tensor info starts.
        offset: u64,
        /// Its dimensions, ne0 first.
        shape: Vec<u64>,
    },
    /// A ggml type id that llama.cpp does not define.
    #[error("tensor {name:?} at byte {offset} has unknown ggml type id {id}")]
    UnknownGgmlType {
        /// The tensor.
        name: String,
        /// Where the type id is.
        offset: u64,
        /// The id found.
        id: u32,
    },
    /// A quantized tensor whose element count is not a multiple of its block size.
    #[error("tensor {name:?} at byte {offset}: {n_elements} elements is not a whole number of {ggml_type} blocks of {block_size}")]
    NotWholeBlocks {
        /// The tensor.
        name: String,
        /// Where its tensor info starts.
        offset: u64,
        /// Its element count.
        n_elements: u64,
        /// Its type.
        ggml_type: GgmlType,
        /// Elements per block of that type.
        block_size: usize,
    },
    /// Two tensors with the same name.
    #[error("duplicate tensor name {name:?} at byte {offset}")]
    DuplicateTensor {
        /// The name.
        name: String,
        /// Where the second tensor info starts.
        offset: u64,
    },
    /// A tensor's data offset is not a multiple of the alignment.
    #[error(
        "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedOffset {
        /// The tensor.
        name: String,
        /// Its offset relative to the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },
    /// A tensor's data runs past the end of the file.
    #[error("tensor {name:?}: data at bytes {start}..{end} runs past the end of the file ({file_len} bytes)")]
    TensorOutOfBounds {
        /// The tensor.
        name: String,
        /// Absolute start of its data.
        start: u64,
        /// Absolute end of its data (exclusive), saturated at `u64::MAX`.
        end: u64,
        /// File length.
        file_len: u64,
    },
    /// Two tensors' data ranges overlap.
    #[error("tensors {first:?} and {second:?} overlap in the data section at byte {offset}")]
    OverlappingTensors {
        /// The tensor that starts first.
        first: String,
        /// The tensor that starts inside it.
        second: String,
        /// Where `second` starts, relative to the data section.
        offset: u64,
    },
    /// A metadata key that is required is absent.
    #[error("metadata key {key:?} is missing")]
    MissingKey {
        /// The key.
        key: String,
    },
    /// A metadata value has another type than the one asked for.
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type asked for.
        expected: &'static str,
        /// The type found.
        found: String,
    },
    /// No tensor with this name.
    #[error("tensor {name:?} not found")]
    TensorNotFound {
        /// The name.
        name: String,
    },
    /// A typed view asked for another element type than the tensor has.
    #[error("tensor {name:?} has type {found}, expected {expected}")]
    TensorTypeMismatch {
        /// The tensor.
        name: String,
        /// The type asked for.
        expected: String,
        /// The tensor's type.
        found: GgmlType,
    },
    /// The bytes of a tensor are not aligned for a typed view.
    #[error(
        "tensor {name:?}: data is not aligned to {align} bytes for a typed view; copy it instead"
    )]
    MisalignedView {
        /// The tensor.
        name: String,
        /// The alignment the view needs.
        align: usize,
    },
    /// The writer was used wrongly (tensor data of the wrong size or out of order, invalid
    /// names, ...).
    #[error("writer: {0}")]
    Writer(String),
    /// A GPU-index file is malformed.
    #[error("GPU index: {0}")]
    GpuIndex(String),
    /// The parts of a split model do not fit together.
    #[error("split model: {0}")]
    Split(String),
}

impl GgufError {
    /// Wraps an I/O error with the path it happened on.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> GgufError {
        GgufError::Io {
            path: path.into(),
            source,
        }
    }

    /// The error for a metadata value of the wrong type.
    pub(crate) fn wrong_type(key: &str, expected: &'static str, found: ValueType) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: found.name().to_string(),
        }
    }
}
