//! ggml quantization blocks as plain `#[repr(C)]` data.
//!
//! Each struct has exactly the byte layout of the ggml block of the same name, so a tensor's
//! bytes can be viewed as a slice of blocks with `bytemuck::try_cast_slice` (they need the
//! alignment of their widest field: 2 bytes, or 4 for [`BlockQ8K`]). Each implements
//! [`GgmlBlock`], whose type's [`GgmlType::type_size`] its size is checked against at compile time.

use crate::{GgmlBlock, GgmlType};
use bytemuck::{Pod, Zeroable};
use half::f16;

/// Elements in a block of the 32-wide formats (Q4_0 ... Q8_1).
pub const QK: usize = 32;
/// Elements in a K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes of packed 6-bit scales and minimums in Q4_K and Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// Q4_0: `x = d * (q - 8)`, q in 0..16; element j in the low nibble of `qs[j]`, element j + 16
/// in its high nibble.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// Packed 4-bit values.
    pub qs: [u8; QK / 2],
}

/// Q4_1: `x = d * q + m`, q in 0..16; nibble order as Q4_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Minimum.
    pub m: f16,
    /// Packed 4-bit values.
    pub qs: [u8; QK / 2],
}

/// Q5_0: `x = d * (q - 16)`, q in 0..32; low 4 bits as Q4_0, bit 4 of element j in bit j of
/// the little-endian u32 `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: f16,
    /// Fifth bits, little-endian u32.
    pub qh: [u8; 4],
    /// Packed low 4 bits.
    pub qs: [u8; QK / 2],
}

/// Q5_1: `x = d * q + m`, q in 0..32; bit layout as Q5_0.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: f16,
    /// Minimum.
    pub m: f16,
    /// Fifth bits, little-endian u32.
    pub qh: [u8; 4],
    /// Packed low 4 bits.
    pub qs: [u8; QK / 2],
}

/// Q8_0: `x = d * q`, q in -127..=127.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Values.
    pub qs: [i8; QK],
}

/// Q8_1: Q8_0 plus `s = d * sum(q)`, used for activations against Q4_1/Q5_1 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8_1 {
    /// Scale.
    pub d: f16,
    /// `d * sum(qs)`.
    pub s: f16,
    /// Values.
    pub qs: [i8; QK],
}

/// Q2_K: 16 sub-blocks of 16; 4-bit scale and 4-bit minimum per sub-block, 2-bit values.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Low nibble: scale, high nibble: minimum, per sub-block.
    pub scales: [u8; QK_K / 16],
    /// Packed 2-bit values.
    pub qs: [u8; QK_K / 4],
    /// Super-block scale of the scales.
    pub d: f16,
    /// Super-block scale of the minimums.
    pub dmin: f16,
}

/// Q3_K: 16 sub-blocks of 16; 6-bit scales, values from 2 low bits plus a high-bit mask.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High bits of the values.
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits of the values.
    pub qs: [u8; QK_K / 4],
    /// Packed 6-bit scales.
    pub scales: [u8; 12],
    /// Super-block scale.
    pub d: f16,
}

/// Q4_K: 8 sub-blocks of 32; 6-bit scales and minimums, 4-bit values.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ4K {
    /// Super-block scale of the scales.
    pub d: f16,
    /// Super-block scale of the minimums.
    pub dmin: f16,
    /// Packed 6-bit scales and minimums.
    pub scales: [u8; K_SCALE_SIZE],
    /// Packed 4-bit values.
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: 8 sub-blocks of 32; 6-bit scales and minimums, 5-bit values.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ5K {
    /// Super-block scale of the scales.
    pub d: f16,
    /// Super-block scale of the minimums.
    pub dmin: f16,
    /// Packed 6-bit scales and minimums.
    pub scales: [u8; K_SCALE_SIZE],
    /// Fifth bits of the values.
    pub qh: [u8; QK_K / 8],
    /// Low 4 bits of the values.
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: 16 sub-blocks of 16; 8-bit scales, 6-bit values offset by 32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits of the values.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the values.
    pub qh: [u8; QK_K / 4],
    /// Signed sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: f16,
}

/// Q8_K: 256 signed 8-bit values, f32 scale and sums of each group of 16 (activations only).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8K {
    /// Scale.
    pub d: f32,
    /// Values.
    pub qs: [i8; QK_K],
    /// Sum of each group of 16 values.
    pub bsums: [i16; QK_K / 16],
}

/// Binds each block struct to its type ([`GgmlBlock`]), checks its size against
/// [`GgmlType::type_size`] at compile time and lists the types in [`TYPES`].
macro_rules! block_types {
    ($($block:ty => $ty:ident),* $(,)?) => {
        $(
            impl GgmlBlock for $block {
                const TYPE: GgmlType = GgmlType::$ty;
            }
            const _: () = assert!(std::mem::size_of::<$block>() == GgmlType::$ty.type_size_const());
        )*

        /// The types with a block struct here, in this module's order.
        pub const TYPES: &[GgmlType] = &[$(GgmlType::$ty),*];
    };
}

block_types!(
    BlockQ4_0 => Q4_0,
    BlockQ4_1 => Q4_1,
    BlockQ5_0 => Q5_0,
    BlockQ5_1 => Q5_1,
    BlockQ8_0 => Q8_0,
    BlockQ8_1 => Q8_1,
    BlockQ2K => Q2_K,
    BlockQ3K => Q3_K,
    BlockQ4K => Q4_K,
    BlockQ5K => Q5_K,
    BlockQ6K => Q6_K,
    BlockQ8K => Q8_K,
);
