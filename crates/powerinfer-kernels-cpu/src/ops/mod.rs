//! The non-matrix operators of a transformer layer.
//!
//! Every operator works on plain `f32` slices (the KV cache is `f16`), checks its argument
//! lengths once per call and returns [`KernelError`](crate::KernelError) on a mismatch; it never
//! panics on bad input. The maths each operator computes is defined by the f64 functions of
//! [`crate::reference::ops`], which the tests compare against.
//!
//! | module | operators |
//! |---|---|
//! | [`norm`] | RMSNorm, LayerNorm with bias, over one or many rows |
//! | [`rope`] | rotary position embedding, normal (mode 0) and NeoX (mode 2) pairing, partial rotary, linear scaling |
//! | [`softmax`] | stable in-place softmax with scale, causal mask helper |
//! | [`activation`] | SiLU, ReLU, GELU (tanh approximation), element-wise add/mul, ReGLU, dReLU, SwiGLU |
//! | [`attention`] | one new token, or a causal block of tokens, over an F16 KV cache with grouped-query heads |
//!
//! SIMD: each hot kernel has a scalar path, always compiled and tested, and on x86-64 an
//! AVX2+FMA+F16C path. The plain functions use [`Backend::detect`](crate::Backend::detect)
//! (cached); the `*_with` variants take an explicit [`Backend`](crate::Backend) so tests and
//! benchmarks can run every path on one machine, and refuse one this CPU cannot run with
//! [`KernelError::BackendUnavailable`](crate::KernelError::BackendUnavailable).
//! [`Backend::Avx512`](crate::Backend::Avx512) runs the AVX2 code and
//! [`Backend::Neon`](crate::Backend::Neon) the scalar code (no NEON operators yet).

pub mod activation;
pub mod attention;
pub mod attention_kv;
mod exp;
mod isa;
pub mod kv;
pub mod norm;
pub mod rope;
pub mod softmax;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
mod x86_512;
#[cfg(target_arch = "x86_64")]
mod x86_kv;

pub(crate) use crate::error::check_len;
