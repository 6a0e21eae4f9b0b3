//! Quantization formats: block structs, dequantization to f32 and quantization from f32.
//!
//! Three levels of API, from generic to typed:
//!
//! - [`dequantize`] / [`quantize`](fn@quantize) work on raw little-endian tensor bytes of any [`GgmlType`]
//!   they support ([`can_dequantize`], [`can_quantize`]). The byte slices may have any
//!   alignment. Lengths are checked once, up front; a mismatch is a [`QuantError`].
//! - `dequantize_row_*` / `quantize_row_*` work on typed block slices (`&[BlockQ4_0]`, ...),
//!   for code that already holds blocks (e.g. a `bytemuck` view of a memory map).
//! - The [`QuantBlock`] and [`QuantizeBlock`] traits give one block's codec, for code that is
//!   generic over the block type (the CPU kernels).
//!
//! # Numerics
//!
//! Every codec reproduces the reference implementation in the PyPI `gguf` package
//! (`gguf.quants`, which follows llama.cpp's `ggml-quants.c` reference code) bit for bit:
//! the same float32 operations in the same order, no fused multiply-adds, f16 conversion with
//! round-to-nearest-even. Where the reference relies on a float-to-integer cast of a value that
//! does not fit (NaN or infinite scales from non-finite or denormal-tiny blocks), we reproduce
//! what that cast does on x86-64 (`cvttss2si`: the result is `i32::MIN`, whose low byte is 0),
//! so such blocks are deterministic on every platform. Q8_1, Q8_K and the K-quants, which
//! `gguf.quants` cannot quantize, follow llama.cpp's reference quantizers
//! (`quantize_row_q8_1_ref`, `quantize_row_q8_K_ref`, `quantize_row_q4_K_ref`, ...). The
//! conformance test `tests/quants_conformance.rs` checks everything `gguf.quants` implements
//! (all dequantizers but Q8_1/Q8_K, all quantizers but those); `tests/kquant_golden.rs` checks
//! the K-quant quantizers and dequantizers against golden files from llama.cpp itself.
//!
//! Multi-byte fields are little-endian, as in GGUF files; the typed block structs assume a
//! little-endian host, which is all this crate supports.

pub mod blocks;
mod dequant;
mod float;
mod kquants;
mod quantize;

pub use blocks::*;
pub use dequant::*;
pub use float::*;
pub use kquants::*;
pub use quantize::*;

use crate::{GgmlBlock, GgmlType};

#[cfg(target_endian = "big")]
compile_error!(
    "powerinfer-gguf reads little-endian tensor data in place and needs a little-endian host"
);

/// Why a quantization or dequantization call was refused. Nothing is written to the destination
/// when a call returns an error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The source bytes are not a whole number of blocks.
    #[error("{ty}: {len} bytes are not a whole number of {type_size}-byte blocks")]
    PartialBlockBytes {
        /// Element type of the data.
        ty: GgmlType,
        /// Length of the source in bytes.
        len: usize,
        /// Bytes per block of `ty`.
        type_size: usize,
    },
    /// The source values are not a whole number of blocks.
    #[error("{ty}: {len} values are not a whole number of {block_size}-value blocks")]
    PartialBlockValues {
        /// Element type being produced.
        ty: GgmlType,
        /// Number of source values.
        len: usize,
        /// Values per block of `ty`.
        block_size: usize,
    },
    /// The destination does not have the length that the source implies.
    #[error("{ty}: destination has room for {got} {unit}, the source needs exactly {expected}")]
    Length {
        /// Element type of the data.
        ty: GgmlType,
        /// Length the destination must have.
        expected: usize,
        /// Length it has.
        got: usize,
        /// What the lengths count: `"values"`, `"bytes"` or `"blocks"`.
        unit: &'static str,
    },
    /// Dequantization of this type is not implemented.
    #[error("dequantization of {0} is not supported")]
    UnsupportedDequantize(GgmlType),
    /// Quantization to this type is not implemented.
    #[error("quantization to {0} is not supported")]
    UnsupportedQuantize(GgmlType),
}

/// One ggml quantization block: a fixed number of values stored in a fixed number of bytes.
///
/// Implemented by every block struct in [`blocks`]; its type is [`GgmlBlock::TYPE`], and
/// `size_of::<Self>()` is that type's [`GgmlType::type_size`].
pub trait QuantBlock: GgmlBlock + Send + Sync + 'static {
    /// Values per block: the type's [`GgmlType::block_size`].
    const BLOCK: usize = Self::TYPE.block_size();

    /// Writes this block's [`BLOCK`](Self::BLOCK) values to `out[..BLOCK]`.
    ///
    /// # Panics
    ///
    /// If `out` is shorter than [`BLOCK`](Self::BLOCK). The slice-level functions
    /// ([`dequantize_blocks`], [`dequantize`]) check lengths and return errors instead.
    fn dequantize(&self, out: &mut [f32]);
}

/// A block type that can also be produced from f32 values.
pub trait QuantizeBlock: QuantBlock {
    /// Quantizes `x[..BLOCK]` into one block.
    ///
    /// # Panics
    ///
    /// If `x` is shorter than [`BLOCK`](QuantBlock::BLOCK). The slice-level functions
    /// ([`quantize_blocks`], [`quantize`](fn@quantize)) check lengths and return errors instead.
    fn quantize(x: &[f32]) -> Self;
}

/// Dequantizes `src` into `dst`, which must hold exactly `src.len() * B::BLOCK` values.
pub fn dequantize_blocks<B: QuantBlock>(src: &[B], dst: &mut [f32]) -> Result<(), QuantError> {
    check_len(B::TYPE, src.len() * B::BLOCK, dst.len(), "values")?;
    for (block, out) in src.iter().zip(dst.chunks_exact_mut(B::BLOCK)) {
        block.dequantize(out);
    }
    Ok(())
}

/// Quantizes `src` into `dst`, which must hold exactly `src.len() / B::BLOCK` blocks;
/// `src.len()` must be a multiple of `B::BLOCK`.
pub fn quantize_blocks<B: QuantizeBlock>(src: &[f32], dst: &mut [B]) -> Result<(), QuantError> {
    if src.len() % B::BLOCK != 0 {
        return Err(QuantError::PartialBlockValues {
            ty: B::TYPE,
            len: src.len(),
            block_size: B::BLOCK,
        });
    }
    check_len(B::TYPE, src.len() / B::BLOCK, dst.len(), "blocks")?;
    for (x, block) in src.chunks_exact(B::BLOCK).zip(dst.iter_mut()) {
        *block = B::quantize(x);
    }
    Ok(())
}

fn check_len(
    ty: GgmlType,
    expected: usize,
    got: usize,
    unit: &'static str,
) -> Result<(), QuantError> {
    if expected == got {
        Ok(())
    } else {
        Err(QuantError::Length {
            ty,
            expected,
            got,
            unit,
        })
    }
}

/// Whether [`dequantize`] supports `ty`: the float types F32, F16, BF16 and every type with a
/// block struct in [`blocks`].
pub fn can_dequantize(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) || blocks::TYPES.contains(&ty)
}

/// Whether [`quantize`](fn@quantize) supports `ty`: the same types as [`can_dequantize`].
pub fn can_quantize(ty: GgmlType) -> bool {
    can_dequantize(ty)
}

/// Number of values stored in `len` bytes of `ty`, or an error when `len` is not a whole number
/// of blocks.
pub fn values_in_bytes(ty: GgmlType, len: usize) -> Result<usize, QuantError> {
    let type_size = ty.type_size();
    if len % type_size != 0 {
        return Err(QuantError::PartialBlockBytes { ty, len, type_size });
    }
    Ok(len / type_size * ty.block_size())
}

/// Number of bytes that `n` values of `ty` take, or an error when `n` is not a whole number of
/// blocks.
pub fn bytes_for_values(ty: GgmlType, n: usize) -> Result<usize, QuantError> {
    let block_size = ty.block_size();
    if n % block_size != 0 {
        return Err(QuantError::PartialBlockValues {
            ty,
            len: n,
            block_size,
        });
    }
    Ok(n / block_size * ty.type_size())
}

/// `$f::<B>($args)` for the block struct `B` of the type `$ty`; `$other` for a type without one.
macro_rules! per_block {
    ($ty:expr, $f:ident($($arg:expr),*), $other:expr) => {
        match $ty {
            GgmlType::Q4_0 => $f::<BlockQ4_0>($($arg),*),
            GgmlType::Q4_1 => $f::<BlockQ4_1>($($arg),*),
            GgmlType::Q5_0 => $f::<BlockQ5_0>($($arg),*),
            GgmlType::Q5_1 => $f::<BlockQ5_1>($($arg),*),
            GgmlType::Q8_0 => $f::<BlockQ8_0>($($arg),*),
            GgmlType::Q8_1 => $f::<BlockQ8_1>($($arg),*),
            GgmlType::Q2_K => $f::<BlockQ2K>($($arg),*),
            GgmlType::Q3_K => $f::<BlockQ3K>($($arg),*),
            GgmlType::Q4_K => $f::<BlockQ4K>($($arg),*),
            GgmlType::Q5_K => $f::<BlockQ5K>($($arg),*),
            GgmlType::Q6_K => $f::<BlockQ6K>($($arg),*),
            GgmlType::Q8_K => $f::<BlockQ8K>($($arg),*),
            _ => $other,
        }
    };
}

/// The checks [`dequantize`] and [`quantize`](fn@quantize) make before writing anything: `ty` is
/// supported (else `unsupported`), then the destination's length `got` is `expected` `unit`s.
fn admit(
    ty: GgmlType,
    unsupported: QuantError,
    expected: Result<usize, QuantError>,
    got: usize,
    unit: &'static str,
) -> Result<(), QuantError> {
    if !can_dequantize(ty) {
        return Err(unsupported);
    }
    check_len(ty, expected?, got, unit)
}

/// Dequantizes the tensor bytes `src` of type `ty` into `dst`.
///
/// `src` must be a whole number of blocks and `dst` must hold exactly the values they encode
/// ([`values_in_bytes`]). `src` may have any alignment.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let unsupported = QuantError::UnsupportedDequantize(ty);
    let n = values_in_bytes(ty, src.len());
    admit(ty, unsupported.clone(), n, dst.len(), "values")?;
    match ty {
        // Little-endian host: the f32 bytes are the values.
        GgmlType::F32 => bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(src),
        GgmlType::F16 => f16_bytes_to_f32(src, dst),
        GgmlType::BF16 => bf16_bytes_to_f32(src, dst),
        _ => per_block!(ty, dequantize_bytes(src, dst), return Err(unsupported)),
    }
    Ok(())
}

/// Dequantizes the tensor bytes `src` of type `ty` into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, src: &[u8]) -> Result<Vec<f32>, QuantError> {
    if !can_dequantize(ty) {
        return Err(QuantError::UnsupportedDequantize(ty));
    }
    let mut out = vec![0.0; values_in_bytes(ty, src.len())?];
    dequantize(ty, src, &mut out)?;
    Ok(out)
}

/// Quantizes `src` to type `ty`, writing the tensor bytes to `dst`.
///
/// `src.len()` must be a whole number of blocks and `dst` must have exactly the size of the
/// result ([`bytes_for_values`]). `dst` may have any alignment.
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    let unsupported = QuantError::UnsupportedQuantize(ty);
    let n = bytes_for_values(ty, src.len());
    admit(ty, unsupported.clone(), n, dst.len(), "bytes")?;
    match ty {
        GgmlType::F32 => dst.copy_from_slice(bytemuck::cast_slice::<f32, u8>(src)),
        GgmlType::F16 => f32_to_f16_bytes(src, dst),
        GgmlType::BF16 => f32_to_bf16_bytes(src, dst),
        _ => per_block!(ty, quantize_bytes(src, dst), return Err(unsupported)),
    }
    Ok(())
}

/// Quantizes `src` to type `ty` into a new byte vector.
pub fn quantize_to_vec(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    if !can_quantize(ty) {
        return Err(QuantError::UnsupportedQuantize(ty));
    }
    let mut out = vec![0u8; bytes_for_values(ty, src.len())?];
    quantize(ty, src, &mut out)?;
    Ok(out)
}

/// Dequantizes whole blocks from bytes of any alignment. Lengths were checked by the caller.
fn dequantize_bytes<B: QuantBlock>(src: &[u8], dst: &mut [f32]) {
    match bytemuck::try_cast_slice::<u8, B>(src) {
        Ok(blocks) => {
            for (block, out) in blocks.iter().zip(dst.chunks_exact_mut(B::BLOCK)) {
                block.dequantize(out);
            }
        }
        Err(_) => {
            let size = std::mem::size_of::<B>();
            for (bytes, out) in src.chunks_exact(size).zip(dst.chunks_exact_mut(B::BLOCK)) {
                let block: B = bytemuck::pod_read_unaligned(bytes);
                block.dequantize(out);
            }
        }
    }
}

/// Quantizes whole blocks into bytes of any alignment. Lengths were checked by the caller.
fn quantize_bytes<B: QuantizeBlock>(src: &[f32], dst: &mut [u8]) {
    let size = std::mem::size_of::<B>();
    for (x, bytes) in src.chunks_exact(B::BLOCK).zip(dst.chunks_exact_mut(size)) {
        bytes.copy_from_slice(bytemuck::bytes_of(&B::quantize(x)));
    }
}
