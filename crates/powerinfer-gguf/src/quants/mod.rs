//! Quantization formats: block structs, dequantization to f32 and quantization from f32.

pub mod blocks;

pub use blocks::*;
