//! # powerinfer-kernels-cuda
//!
//! PowerInfer's operators on NVIDIA GPUs, driven through `cudarc` with the CUDA driver loaded at
//! run time, so that the crate builds and its tests pass on machines without CUDA.
//!
//! - [`Gpu::detect`] opens device 0 or says why not ([`NoGpu`]); it never panics.
//! - Kernels are CUDA C (`kernels/*.cu`), compiled by NVRTC on a CPU machine
//!   (`scripts/build-cuda-kernels`) to PTX for compute_80 and CUBINs for sm_80 / sm_90, embedded
//!   in the crate ([`kernels`]) and loaded with the driver alone.
//! - Device buffers ([`DeviceBuffer`], [`DeviceTensor`], [`GpuSlice`], [`LayerKv`]) are held
//!   against a byte budget ([`MemoryBudget`]) that refuses rather than exceed it.
//! - Operators ([`Gpu::matmul`], [`Gpu::sparse_matmul`], [`Gpu::sparse_axpy`], [`Gpu::rms_norm`],
//!   [`Gpu::layer_norm`], [`Gpu::rope`], [`Gpu::softmax`], [`Gpu::kv_store`],
//!   [`Gpu::attention`], [`Gpu::predictor`], [`Gpu::active_list`], ...) queue work on a
//!   [`Stream`]; their semantics are those of `powerinfer-kernels-cpu`'s f64 references
//!   (activations stay f32: no Q8 quantization of the input vector).
//!
//! Tests without a GPU: `tests/nvrtc_ci.rs` (every kernel assembles for sm_80/sm_90 without
//! spills; embedded images current), `tests/emu.rs` (the CUDA sources run on a CPU emulation
//! against the references). `tests/gpu_ops.rs` needs a GPU (`scripts/gpu-check`).

#![warn(missing_docs)]

pub mod budget;
pub mod device;
pub mod error;
pub mod geometry;
pub mod kernels;
pub mod nvrtc;
pub mod ops;
pub mod tensor;

pub use budget::{MemoryBudget, Reservation};
pub use device::{
    driver_present, DeviceBuffer, DeviceInfo, DeviceView, DeviceViewMut, Gpu, Graph, KernelImage,
    PinnedBuffer, Stream, TimedEvent,
};
pub use error::{BudgetError, CudaError, NoGpu, Result};
pub use ops::{Binary, Gate, LayerKv, Product, RopeMode, Unary};
pub use tensor::{DeviceTensor, GpuSlice};
