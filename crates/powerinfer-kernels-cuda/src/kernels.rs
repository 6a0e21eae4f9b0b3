//! The kernel sources and the artifacts compiled from them, embedded in the crate.
//!
//! `kernels/*.cu` are compiled by NVRTC (`scripts/build-cuda-kernels`) into `kernels/gen/`:
//! `<module>.ptx` (compute_80, JIT-compiled by the driver on any GPU of compute capability 8.0 or
//! newer) and `<module>.sm_80.cubin` / `<module>.sm_90.cubin` (loaded as they are on 8.x and 9.0
//! devices). The GPU machine needs only the driver.

/// The header pasted into each module in place of its `#include "common.cuh"` line.
pub const COMMON_HEADER: &str = include_str!("../kernels/common.cuh");

/// A compilation unit of kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelModule {
    /// Dense and row-sparse products (`kernels/matmul.cu`).
    Matmul,
    /// Sparse axpy over down rows (`kernels/axpy.cu`).
    Axpy,
    /// Norms, RoPE, softmax, element-wise ops, KV store, attention, predictor threshold (`kernels/ops.cu`).
    Ops,
}

macro_rules! artifacts {
    ($name:literal) => {
        (
            include_str!(concat!("../kernels/", $name, ".cu")),
            include_str!(concat!("../kernels/gen/", $name, ".ptx")),
            include_bytes!(concat!("../kernels/gen/", $name, ".sm_80.cubin")).as_slice(),
            include_bytes!(concat!("../kernels/gen/", $name, ".sm_90.cubin")).as_slice(),
        )
    };
}

type Artifacts = (&'static str, &'static str, &'static [u8], &'static [u8]);

impl KernelModule {
    /// Every module.
    pub const ALL: [KernelModule; 3] =
        [KernelModule::Matmul, KernelModule::Axpy, KernelModule::Ops];

    /// Short name (the file stem).
    pub fn name(self) -> &'static str {
        match self {
            KernelModule::Matmul => "matmul",
            KernelModule::Axpy => "axpy",
            KernelModule::Ops => "ops",
        }
    }

    /// Source file name.
    pub fn file_name(self) -> String {
        format!("{}.cu", self.name())
    }

    fn artifacts(self) -> Artifacts {
        match self {
            KernelModule::Matmul => artifacts!("matmul"),
            KernelModule::Axpy => artifacts!("axpy"),
            KernelModule::Ops => artifacts!("ops"),
        }
    }

    /// The committed CUDA C source.
    pub fn source(self) -> &'static str {
        self.artifacts().0
    }

    /// The source with `common.cuh` pasted in (what NVRTC compiles).
    pub fn expanded_source(self) -> String {
        expand_includes(self.source())
    }

    /// The embedded PTX (compute_80).
    pub fn ptx(self) -> &'static str {
        self.artifacts().1
    }

    /// The embedded CUBIN for `sm_80` or `sm_90`, if there is one.
    pub fn cubin(self, arch: &str) -> Option<&'static [u8]> {
        match arch {
            "sm_80" => Some(self.artifacts().2),
            "sm_90" => Some(self.artifacts().3),
            _ => None,
        }
    }

    /// The kernels (entry points) of the module.
    pub fn functions(self) -> &'static [&'static str] {
        match self {
            KernelModule::Matmul => &[
                "matmul_f32",
                "matmul_f16",
                "matmul_q8_0",
                "matmul_q4_0",
                "matmul_f32_t1",
                "matmul_f16_t1",
                "matmul_q8_0_t1",
                "matmul_q4_0_t1",
                "matmul_f16_mma",
                "matmul_q8_0_mma",
                "matmul_q4_0_mma",
                "matmul_gated_f32_t1",
                "matmul_gated_f16_t1",
                "matmul_gated_q8_0_t1",
                "matmul_gated_q4_0_t1",
                "quantize_q8",
                "round_f16",
            ],
            KernelModule::Axpy => &[
                "axpy_f32_t1",
                "axpy_f16_t1",
                "axpy_q8_0_t1",
                "axpy_q4_0_t1",
                "axpy_f32_t8",
                "axpy_f16_t8",
                "axpy_q8_0_t8",
                "axpy_q4_0_t8",
            ],
            KernelModule::Ops => &[
                "rms_norm",
                "layer_norm",
                "add_rms_norm",
                "add_layer_norm",
                "rms_norm_conv",
                "layer_norm_conv",
                "rope",
                "rope_qk",
                "softmax",
                "relu",
                "add",
                "relu_gate",
                "add_inplace",
                "relu_inplace",
                "relu_round_f16_inplace",
                "silu_gate",
                "add_rows",
                "get_rows_f32",
                "get_rows_f16",
                "get_rows_q8_0",
                "get_rows_q4_0",
                "count_active",
                "kv_store",
                "attention_f16kv",
                "threshold_mask",
                "active_list",
            ],
        }
    }
}

/// Kind of a kernel parameter, as the launch code pushes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// A device pointer (`.u64` in PTX).
    Ptr,
    /// `int` (`.u32` in PTX).
    I32,
    /// `long` (`.u64` in PTX).
    I64,
    /// `float` (`.f32` in PTX).
    F32,
}

/// The parameters of a kernel, in order, as declared in `kernels/*.cu`.
pub fn params(kernel: &str) -> Option<&'static [Param]> {
    use Param::*;
    const ROWS: &[Param] = &[Ptr, I64, I32, I32, Ptr, I32, Ptr, Ptr, F32, I32, Ptr];
    Some(match kernel {
        k if k.starts_with("matmul_gated_") => &[
            Ptr, Ptr, I64, I32, I32, Ptr, I32, Ptr, Ptr, F32, I32, I32, Ptr, Ptr,
        ],
        k if k.starts_with("matmul_") || k.starts_with("axpy_") => ROWS,
        "quantize_q8" => &[Ptr, I64, Ptr],
        "round_f16" => &[Ptr, Ptr, I64],
        "rms_norm" => &[Ptr, Ptr, Ptr, I32, F32],
        "layer_norm" => &[Ptr, Ptr, Ptr, Ptr, I32, F32],
        "add_rms_norm" => &[Ptr, Ptr, Ptr, Ptr, I32, F32],
        "add_layer_norm" => &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, F32],
        "rms_norm_conv" => &[Ptr, Ptr, Ptr, I32, F32, I32, I32, Ptr],
        "layer_norm_conv" => &[Ptr, Ptr, Ptr, Ptr, I32, F32, I32, I32, Ptr],
        "rope" => &[Ptr, Ptr, I32, I32, I32, F32, F32, I32],
        "rope_qk" => &[Ptr, Ptr, Ptr, I32, I32, I32, I32, F32, F32, I32],
        "softmax" => &[Ptr, I32, F32],
        "relu" => &[Ptr, Ptr, I64],
        "add" => &[Ptr, Ptr, Ptr, I64],
        "relu_gate" => &[Ptr, Ptr, Ptr, I64, I32],
        "silu_gate" => &[Ptr, Ptr, Ptr, I64],
        "add_inplace" => &[Ptr, Ptr, I64],
        "relu_inplace" => &[Ptr, I64],
        "relu_round_f16_inplace" => &[Ptr, I64],
        "add_rows" => &[Ptr, Ptr, I32, I64],
        k if k.starts_with("get_rows_") => &[Ptr, I64, I32, Ptr, I32, Ptr],
        "count_active" => &[Ptr, Ptr, I32, I32, F32, Ptr],
        "kv_store" => &[Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32],
        "attention_f16kv" => &[Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, I32, I32, I32, I32, F32],
        "threshold_mask" => &[Ptr, Ptr, I64, F32],
        "active_list" => &[Ptr, I32, F32, Ptr, Ptr],
        _ => return None,
    })
}

/// The parameter types of entry `kernel` in PTX text (`.u64`, `.u32`, `.f32`, ...), if present.
pub fn ptx_param_types(ptx: &str, kernel: &str) -> Option<Vec<String>> {
    let start = ptx.find(&format!(".entry {kernel}("))?;
    let body = &ptx[start..];
    let end = body.find(')')?;
    Some(
        body[..end]
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                (it.next()? == ".param").then(|| it.next().map(str::to_string))?
            })
            .collect(),
    )
}

/// Replaces each `#include "common.cuh"` line with [`COMMON_HEADER`].
pub fn expand_includes(src: &str) -> String {
    let mut out = String::with_capacity(src.len() + COMMON_HEADER.len());
    for line in src.lines() {
        if line.trim() == "#include \"common.cuh\"" {
            out.push_str(COMMON_HEADER);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// The CUBIN architecture embedded for a device of compute capability (major, minor), if any:
/// `sm_80` runs on every 8.x device, `sm_90` on 9.0 only; other devices JIT the PTX.
pub fn cubin_arch_for(major: i32, minor: i32) -> Option<&'static str> {
    match (major, minor) {
        (8, _) => Some("sm_80"),
        (9, 0) => Some("sm_90"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn includes_are_expanded_and_entry_points_exist() {
        for m in KernelModule::ALL {
            let s = m.expanded_source();
            assert!(
                !s.lines().any(|l| l.trim_start().starts_with("#include")),
                "{}",
                m.name()
            );
            assert!(s.contains("__device__ __forceinline__ float h2f"));
            for f in m.functions() {
                assert!(
                    m.ptx().contains(&format!(".entry {f}(")),
                    "{f} not in {}.ptx",
                    m.name()
                );
            }
        }
    }

    #[test]
    fn declared_parameters_match_the_ptx() {
        for m in KernelModule::ALL {
            for f in m.functions() {
                let declared =
                    params(f).unwrap_or_else(|| panic!("{f} has no declared parameters"));
                let ptx = ptx_param_types(m.ptx(), f).unwrap_or_else(|| panic!("{f} not in PTX"));
                let want: Vec<&str> = declared
                    .iter()
                    .map(|p| match p {
                        Param::Ptr | Param::I64 => ".u64",
                        Param::I32 => ".u32",
                        Param::F32 => ".f32",
                    })
                    .collect();
                assert_eq!(ptx, want, "{f}");
            }
        }
        assert_eq!(params("nope"), None);
    }

    #[test]
    fn cubin_choice_follows_binary_compatibility() {
        assert_eq!(cubin_arch_for(8, 0), Some("sm_80"));
        assert_eq!(cubin_arch_for(8, 9), Some("sm_80"));
        assert_eq!(cubin_arch_for(9, 0), Some("sm_90"));
        assert_eq!(cubin_arch_for(10, 0), None);
        assert_eq!(cubin_arch_for(7, 5), None);
    }
}
