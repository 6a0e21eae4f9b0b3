//! ggml tensor element types (ids as stored in GGUF files, block sizes, bytes per block) and
//! GGUF metadata value types.

use std::fmt;

/// A ggml tensor type, numbered as llama.cpp's `enum ggml_type` numbers it today.
///
/// Ids that ggml retired (4, 5, 31-33, 36-38) are not types: reading one is an error, as in
/// llama.cpp. PowerInfer's older ggml numbered the integer types differently (I32 was 18); the
/// GPU-index reader in [`crate::gpuidx`] handles that file's numbering itself.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    /// 32-bit IEEE float.
    F32 = 0,
    /// 16-bit IEEE float.
    F16 = 1,
    /// 32 weights: f16 scale, 4-bit values offset by 8.
    Q4_0 = 2,
    /// 32 weights: f16 scale and minimum, 4-bit values.
    Q4_1 = 3,
    /// 32 weights: f16 scale, 5-bit values offset by 16.
    Q5_0 = 6,
    /// 32 weights: f16 scale and minimum, 5-bit values.
    Q5_1 = 7,
    /// 32 weights: f16 scale, 8-bit signed values.
    Q8_0 = 8,
    /// 32 weights: f16 scale and f16 sum, 8-bit signed values (activations only).
    Q8_1 = 9,
    /// K-quant, 256 weights, 2 bits.
    Q2_K = 10,
    /// K-quant, 256 weights, 3 bits.
    Q3_K = 11,
    /// K-quant, 256 weights, 4 bits.
    Q4_K = 12,
    /// K-quant, 256 weights, 5 bits.
    Q5_K = 13,
    /// K-quant, 256 weights, 6 bits.
    Q6_K = 14,
    /// K-quant, 256 weights, 8 bits, f32 scale and block sums (activations only).
    Q8_K = 15,
    /// i-quant, 2.06 bits per weight.
    IQ2_XXS = 16,
    /// i-quant, 2.31 bits per weight.
    IQ2_XS = 17,
    /// i-quant, 3.06 bits per weight.
    IQ3_XXS = 18,
    /// i-quant, 1.56 bits per weight.
    IQ1_S = 19,
    /// Non-linear 4-bit, 32 weights.
    IQ4_NL = 20,
    /// i-quant, 3.44 bits per weight.
    IQ3_S = 21,
    /// i-quant, 2.5 bits per weight.
    IQ2_S = 22,
    /// Non-linear 4-bit, 256 weights.
    IQ4_XS = 23,
    /// 8-bit signed integer.
    I8 = 24,
    /// 16-bit signed integer.
    I16 = 25,
    /// 32-bit signed integer.
    I32 = 26,
    /// 64-bit signed integer.
    I64 = 27,
    /// 64-bit IEEE float.
    F64 = 28,
    /// i-quant, 1.75 bits per weight.
    IQ1_M = 29,
    /// bfloat16.
    BF16 = 30,
    /// Ternary, 1.69 bits per weight.
    TQ1_0 = 34,
    /// Ternary, 2.06 bits per weight.
    TQ2_0 = 35,
    /// Microscaling FP4: 32 e2m1 values sharing an e8m0 scale.
    MXFP4 = 39,
}

impl GgmlType {
    /// Every type, in id order.
    pub const ALL: [GgmlType; 32] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ1_S,
        GgmlType::IQ4_NL,
        GgmlType::IQ3_S,
        GgmlType::IQ2_S,
        GgmlType::IQ4_XS,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::IQ1_M,
        GgmlType::BF16,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::MXFP4,
    ];

    /// The type with ggml id `id`, or `None` for an id llama.cpp does not define.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// The ggml id stored in GGUF tensor infos.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Elements per block (1 for plain types).
    pub const fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 => 256,
        }
    }

    /// Bytes per block (ggml's `type_size`).
    pub fn type_size(self) -> usize {
        self.type_size_const()
    }

    /// [`type_size`](Self::type_size) usable in constants.
    pub const fn type_size_const(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 => 2,
            BF16 => 2,
            F64 => 8,
            I8 => 1,
            I16 => 2,
            I32 => 4,
            I64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
        }
    }

    /// Whether values are stored in blocks with shared scales (anything but plain numbers).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Bytes taken by `n_elements` values, or `None` when `n_elements` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if n_elements % bs != 0 {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }

    /// The name llama.cpp and the PyPI `gguf` package print (`"Q4_0"`, `"F16"`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            IQ1_M => "IQ1_M",
            BF16 => "BF16",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
        }
    }

    /// The type whose [`name`](Self::name) is `name`, ignoring ASCII case.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .iter()
            .copied()
            .find(|t| t.name().eq_ignore_ascii_case(name))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_retired_ids_are_unknown() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        for retired in [4, 5, 31, 32, 33, 36, 37, 38, 40, 1000] {
            assert_eq!(GgmlType::from_id(retired), None);
        }
    }

    #[test]
    fn bytes_for_requires_whole_blocks() {
        assert_eq!(GgmlType::Q4_0.bytes_for(64), Some(36));
        assert_eq!(GgmlType::Q4_0.bytes_for(33), None);
        assert_eq!(GgmlType::F16.bytes_for(3), Some(6));
        assert_eq!(GgmlType::Q6_K.bytes_for(512), Some(420));
        assert_eq!(GgmlType::F64.bytes_for(u64::MAX), None);
    }
}

/// A GGUF metadata value type, with its id as stored in files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    /// `u8`.
    U8 = 0,
    /// `i8`.
    I8 = 1,
    /// `u16`.
    U16 = 2,
    /// `i16`.
    I16 = 3,
    /// `u32`.
    U32 = 4,
    /// `i32`.
    I32 = 5,
    /// `f32`.
    F32 = 6,
    /// One byte, 0 or 1.
    Bool = 7,
    /// u64 length, then UTF-8 bytes.
    String = 8,
    /// u32 element type, u64 count, elements.
    Array = 9,
    /// `u64`.
    U64 = 10,
    /// `i64`.
    I64 = 11,
    /// `f64`.
    F64 = 12,
}

impl ValueType {
    /// The type with file id `id`, or `None` outside 0..=12.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The id stored in files.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The fewest bytes one value of this type takes in a file (a string's length field,
    /// an array's type and count).
    pub fn min_size(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }

    /// Lower-case name as used in error messages and `inspect` (`"u32"`, `"string"`, ...).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
