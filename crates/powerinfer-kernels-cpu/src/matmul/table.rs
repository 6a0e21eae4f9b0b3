//! Which row kernels serve a (weight type, backend) pair: the scalar kernels, replaced by the
//! backend's own where it has them.

use super::act::ActFormat;
use super::rowops::{AxpyFn, Dot4Fn, DotFn, RowOps};
use super::scalar as s;
use crate::backend::Backend;
use powerinfer_gguf::GgmlType;

fn scalar_ops(ty: GgmlType) -> Option<RowOps> {
    use ActFormat as A;
    use GgmlType as T;
    let ops = |dot: DotFn, dot4: Dot4Fn, axpy: AxpyFn, act| RowOps {
        dot,
        dot_batch: dot,
        dot4,
        rows4: None,
        tile: None,
        axpy,
        axpy4: None,
        dot_list: None,
        dot_range: None,
        axpy_list: None,
        axpy_list_int8: None,
        act,
    };
    Some(match ty {
        T::F32 => ops(s::dot_f32, s::dot4_f32, s::axpy_f32, A::F32),
        T::F16 => ops(s::dot_f16, s::dot4_f16, s::axpy_f16, A::F16),
        T::BF16 => ops(s::dot_bf16, s::dot4_bf16, s::axpy_bf16, A::F32),
        T::Q8_0 => ops(s::dot_q8_0, s::dot4_q8_0, s::axpy_q8_0, A::Q8_0),
        T::Q4_0 => ops(s::dot_q4_0, s::dot4_q4_0, s::axpy_q4_0, A::Q8_0),
        T::Q4_1 => ops(s::dot_q4_1, s::dot4_q4_1, s::axpy_q4_1, A::Q8_1),
        T::Q5_0 => ops(s::dot_q5_0, s::dot4_q5_0, s::axpy_q5_0, A::Q8_0),
        T::Q5_1 => ops(s::dot_q5_1, s::dot4_q5_1, s::axpy_q5_1, A::Q8_1),
        T::Q2_K => ops(s::dot_q2_k, s::dot4_q2_k, s::axpy_q2_k, A::Q8K),
        T::Q3_K => ops(s::dot_q3_k, s::dot4_q3_k, s::axpy_q3_k, A::Q8K),
        T::Q4_K => ops(s::dot_q4_k, s::dot4_q4_k, s::axpy_q4_k, A::Q8K),
        T::Q5_K => ops(s::dot_q5_k, s::dot4_q5_k, s::axpy_q5_k, A::Q8K),
        T::Q6_K => ops(s::dot_q6_k, s::dot4_q6_k, s::axpy_q6_k, A::Q8K),
        _ => return None,
    })
}

/// The kernels for `ty` on `backend` (which the caller has checked is available), or `None`
/// if the type is not supported. Kernels a backend lacks fall back to the scalar ones.
pub(crate) fn row_ops(ty: GgmlType, backend: Backend) -> Option<RowOps> {
    #[allow(unused_mut)]
    let mut ops = scalar_ops(ty)?;
    #[cfg(target_arch = "x86_64")]
    super::x86::register(ty, backend, &mut ops);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = backend;
    Some(ops)
}
