//! The x86-64 row kernels, one file per family, and [`register`], which installs them in the
//! kernel table ([`RowOps`]) in place of the scalar ones.
//!
//! | file | kernels |
//! |---|---|
//! | [`common`] | helpers shared by the others (horizontal sums, float loaders, activation dispatch) |
//! | [`float`] | F32/F16/BF16 dots and axpy (AVX2; one-token dots on 512-bit vectors for AVX-512) |
//! | [`quant_axpy`] | Q8_0/Q4_0 axpy (AVX2) |
//! | [`int`] | integer dots of the quantized types (AVX2, and AVX-512 VNNI on 256-bit vectors) |
//! | `kquant` | Q4_K/Q5_K/Q6_K dots on 512-bit vectors (AVX-512) |
//! | `sparse` | list kernels of the sparse products and dense range kernels (AVX-512) |
//! | `gemm` | cache-blocked dense GEMMs (AVX-512) |
//! | `few` | the Q4_0 product of a few tokens from the file layout (AVX-512) |
//! | `packed` | the one-token product over repacked Q4_0 (AVX-512) |
//!
//! The AVX-512 files are built only by compilers that have the AVX-512 intrinsics (Rust ≥ 1.89,
//! `cfg(powerinfer_avx512)`, set by the crate's build.rs).
//!
//! Every kernel is an `unsafe fn` with `#[target_feature]`; the safe wrappers that [`register`]
//! installs in the kernel table are installed only after [`Backend::Avx2`] (or
//! [`Backend::Avx512`], which implies it) was detected on this CPU, which is what makes calling
//! them sound. Loads are unaligned (`loadu`), so rows need no alignment.
//!
//! Float weights have two dot orders (one-token and multi-token, see [`float`]); the quantized
//! kernels have one (exact integer) order for both.

pub(crate) mod common;
#[cfg(powerinfer_avx512)]
pub(crate) mod few;
pub(crate) mod float;
#[cfg(powerinfer_avx512)]
pub(crate) mod gemm;
pub(crate) mod int;
#[cfg(powerinfer_avx512)]
pub(crate) mod kquant;
#[cfg(powerinfer_avx512)]
pub(crate) mod packed;
pub(crate) mod quant_axpy;
#[cfg(powerinfer_avx512)]
pub(crate) mod sparse;

use super::act::ActFormat;
use super::rowops::RowOps;
use crate::backend::Backend;
use powerinfer_gguf::GgmlType;

/// Replaces the scalar kernels of `ty` in `ops` by the x86 kernels of `backend` where they
/// exist; does nothing unless `backend` is [`Backend::Avx2`] or [`Backend::Avx512`] and this
/// CPU has it. On `Avx512` the quantized dots use the AVX-512 VNNI instantiation of [`int`],
/// and the AVX-512 files add their kernels.
pub(crate) fn register(ty: GgmlType, backend: Backend, ops: &mut RowOps) {
    if !matches!(backend, Backend::Avx2 | Backend::Avx512) || !backend.is_available() {
        return;
    }
    let avx512 = backend == Backend::Avx512;
    register_int(ty, ops, avx512);
    #[cfg(powerinfer_avx512)]
    if avx512 {
        register_sparse(ty, ops);
        register_kquant(ty, ops);
    }
    register_avx2(ty, ops);
    #[cfg(powerinfer_avx512)]
    if avx512 {
        register_float512(ty, ops);
    }
}

/// The integer dots of the quantized type `ty`; `avx512` selects the AVX-512 VNNI
/// instantiation (`vpdpbusd`).
fn register_int(ty: GgmlType, ops: &mut RowOps, avx512: bool) {
    use int::{avx2, vnni};
    use GgmlType as T;
    macro_rules! set {
        ($m:ident) => {
            match ty {
                T::Q8_0 => {
                    (ops.dot, ops.dot4) = ($m::dot_q8_0, $m::dot4_q8_0);
                    ops.rows4 = Some($m::rows4_q8_0);
                }
                T::Q4_0 => {
                    (ops.dot, ops.dot4) = ($m::dot_q4_0, $m::dot4_q4_0);
                    ops.rows4 = Some($m::rows4_q4_0);
                    ops.tile = Some($m::tile_q4_0);
                    ops.act = ActFormat::Q8_0Pairs;
                }
                T::Q4_1 => (ops.dot, ops.dot4) = ($m::dot_q4_1, $m::dot4_q4_1),
                T::Q5_0 => (ops.dot, ops.dot4) = ($m::dot_q5_0, $m::dot4_q5_0),
                T::Q5_1 => (ops.dot, ops.dot4) = ($m::dot_q5_1, $m::dot4_q5_1),
                T::Q4_K => (ops.dot, ops.dot4) = ($m::dot_q4_k, $m::dot4_q4_k),
                T::Q5_K => (ops.dot, ops.dot4) = ($m::dot_q5_k, $m::dot4_q5_k),
                T::Q6_K => (ops.dot, ops.dot4) = ($m::dot_q6_k, $m::dot4_q6_k),
                _ => {}
            }
        };
    }
    if avx512 {
        set!(vnni)
    } else {
        set!(avx2)
    }
    // Integer sums are exact: multi-token products use the one-token dot as it is.
    if !matches!(ty, T::F32 | T::F16 | T::BF16) {
        ops.dot_batch = ops.dot;
    }
}

/// The AVX2 float kernels and the Q8_0/Q4_0 axpy.
fn register_avx2(ty: GgmlType, ops: &mut RowOps) {
    use float as f;
    use quant_axpy as q;
    use GgmlType as T;
    match ty {
        T::F32 => {
            ops.dot = f::dot_f32;
            ops.dot_batch = f::dot_batch_f32;
            ops.dot4 = f::dot4_f32;
            ops.rows4 = Some(f::rows4_f32);
            ops.tile = Some(f::tile_f32);
            ops.axpy = f::axpy_f32;
            ops.axpy4 = Some(f::axpy4_f32);
        }
        T::F16 => {
            ops.dot = f::dot_f16;
            ops.dot_batch = f::dot_batch_f16;
            ops.dot4 = f::dot4_f16;
            ops.rows4 = Some(f::rows4_f16);
            ops.tile = Some(f::tile_f16);
            ops.axpy = f::axpy_f16;
            ops.axpy4 = Some(f::axpy4_f16);
        }
        T::BF16 => {
            ops.dot = f::dot_bf16;
            ops.dot_batch = f::dot_batch_bf16;
            ops.dot4 = f::dot4_bf16;
            ops.rows4 = Some(f::rows4_bf16);
            ops.tile = Some(f::tile_bf16);
            ops.axpy = f::axpy_bf16;
            ops.axpy4 = Some(f::axpy4_bf16);
        }
        T::Q8_0 => {
            ops.axpy = q::axpy_q8_0;
            ops.axpy4 = Some(q::axpy4_q8_0);
        }
        T::Q4_0 => {
            ops.axpy = q::axpy_q4_0;
            ops.axpy4 = Some(q::axpy4_q4_0);
        }
        _ => {}
    }
}

/// The one-token float dots with 512-bit registers (bit-identical to the AVX2 ones).
#[cfg(powerinfer_avx512)]
fn register_float512(ty: GgmlType, ops: &mut RowOps) {
    use super::rowops::Rows4Fn;
    use float as f;
    use GgmlType as T;
    match ty {
        T::F32 => (ops.dot, ops.rows4) = (f::dot512_f32, Some(f::rows4_512_f32 as Rows4Fn)),
        T::F16 => (ops.dot, ops.rows4) = (f::dot512_f16, Some(f::rows4_512_f16 as Rows4Fn)),
        T::BF16 => (ops.dot, ops.rows4) = (f::dot512_bf16, Some(f::rows4_512_bf16 as Rows4Fn)),
        _ => {}
    }
}

/// The list kernels of the sparse products and the dense range kernels of [`sparse`].
#[cfg(powerinfer_avx512)]
fn register_sparse(ty: GgmlType, ops: &mut RowOps) {
    use common::{LBF16, LF16, LF32};
    use sparse as s;
    match ty {
        GgmlType::Q4_0 => {
            ops.dot_list = Some(s::dot_list_q4_0);
            ops.axpy_list = Some(s::axpy_list_q4_0);
            if std::arch::is_x86_feature_detected!("avx512vbmi") {
                ops.dot_range = Some(s::dot_range_q4_0);
                ops.axpy_list_int8 = Some(s::axpy_list_q4_0_int8);
            }
        }
        GgmlType::Q8_0 => {
            ops.dot_list = Some(s::dot_list_q8_0);
            ops.axpy_list = Some(s::axpy_list_q8_0);
            ops.dot_range = Some(s::dot_range_q8_0);
        }
        GgmlType::F32 => {
            ops.dot_list = Some(s::dot_list_float::<LF32>);
            ops.axpy_list = Some(s::axpy_list_float::<LF32>);
        }
        GgmlType::F16 => {
            ops.dot_list = Some(s::dot_list_float::<LF16>);
            ops.axpy_list = Some(s::axpy_list_float::<LF16>);
        }
        GgmlType::BF16 => {
            ops.dot_list = Some(s::dot_list_float::<LBF16>);
            ops.axpy_list = Some(s::axpy_list_float::<LBF16>);
        }
        _ => {}
    }
}

/// The 512-bit K-quant dots of [`kquant`] (other types are left alone).
#[cfg(powerinfer_avx512)]
fn register_kquant(ty: GgmlType, ops: &mut RowOps) {
    use kquant as k;
    match ty {
        GgmlType::Q4_K => {
            (ops.dot, ops.dot4) = (k::dot_q4_k, k::dot4_q4_k);
            ops.dot_range = Some(k::dot_range_k::<144>);
        }
        GgmlType::Q5_K => {
            (ops.dot, ops.dot4) = (k::dot_q5_k, k::dot4_q5_k);
            ops.dot_range = Some(k::dot_range_k::<176>);
        }
        GgmlType::Q6_K => {
            (ops.dot, ops.dot4) = (k::dot_q6_k, k::dot4_q6_k);
            ops.dot_range = Some(k::dot_range_k::<210>);
        }
        _ => return,
    }
    // Integer sums are exact: multi-token products use the one-token dot as it is.
    ops.dot_batch = ops.dot;
}
