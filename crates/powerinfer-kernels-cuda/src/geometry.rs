//! Which kernel each operator launches and with what grid: pure functions, shared by the
//! operators and by the CPU emulation test (`tests/emu.rs`), which runs the CUDA sources with
//! exactly these launches.

use powerinfer_gguf::GgmlType;

use crate::error::{CudaError, Result};

/// Warps (rows) per block of the matrix-product kernels.
pub const MATMUL_WARPS: usize = 8;
/// Tokens per block of the matrix-product kernels (NT in kernels/matmul.cu).
pub const MATMUL_TOKENS: usize = 8;
/// Weight rows per block of the tensor-core product kernels `matmul_*_mma` (MMA_ROWS).
pub const MMA_ROWS: usize = 64;
/// Tokens per block of `matmul_*_mma` (MMA_TOKENS).
pub const MMA_TOKENS: usize = 64;
/// Threads per block of `matmul_*_mma` (4 warps).
pub const MMA_THREADS: usize = 128;
/// Blocks of 32 values per block of `quantize_q8` (one warp each).
pub const QUANTIZE_BLOCKS: usize = 8;
/// Rows per block of the many-token axpy kernels (ROWS_PER_BLOCK in kernels/axpy.cu).
pub const AXPY_ROWS: usize = 128;
/// Rows per block of the per-token axpy kernels `axpy_*_t1` (T1_ROWS in kernels/axpy.cu).
pub const AXPY_T1_ROWS: usize = 64;
/// Threads per block of `axpy_*_t1` (T1_THREADS), each owning 8 consecutive columns.
pub const AXPY_T1_THREADS: usize = 256;
/// Up to this many tokens the axpy runs its per-token sparse kernel; above, the kernel tiled
/// over 8 tokens (each weight element read once per 8 tokens).
pub const AXPY_SPARSE_MAX_TOKENS: usize = 4;
/// Threads per block of the other kernels.
pub const BLOCK: usize = 256;
/// Threads of the single block of `active_list`.
pub const ACTIVE_LIST_THREADS: usize = 1024;
const MAX_GRID_YZ: usize = 65535;

/// A kernel launch: entry point, grid and threads per block (1-D blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Kernel name.
    pub kernel: &'static str,
    /// Grid (x, y, z).
    pub grid: (u32, u32, u32),
    /// Threads per block.
    pub block: u32,
}

fn launch(kernel: &'static str, x: usize, y: usize, z: usize, block: usize) -> Result<Launch> {
    if x > u32::MAX as usize || y > MAX_GRID_YZ || z > MAX_GRID_YZ {
        return Err(CudaError::Shape(format!(
            "launch grid ({x}, {y}, {z}) too large"
        )));
    }
    Ok(Launch {
        kernel,
        grid: (x as u32, y as u32, z as u32),
        block: block as u32,
    })
}

fn type_index(ty: GgmlType) -> Result<usize> {
    Ok(match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q8_0 => 2,
        GgmlType::Q4_0 => 3,
        other => return Err(CudaError::UnsupportedType(other)),
    })
}

/// Dense or row-sparse product over `rows` weight rows of type `ty` and `t` tokens: the
/// one-token kernel (`matmul_*_t1`: one token per block, the block's active rows share its
/// [`MATMUL_WARPS`] warps) for a single token; up to [`MATMUL_TOKENS`] tokens the kernel tiled
/// over that many tokens (one warp per row); more tokens of F16, Q8_0 or Q4_0 weights take the
/// tensor-core kernel (`matmul_*_mma`: [`MMA_ROWS`] rows by [`MMA_TOKENS`] tokens per block,
/// mma.sync on 16-row by 8-token tiles), F32 weights the tiled kernel. Q8_0/Q4_0 kernels read
/// the activation quantized by [`quantize_q8`].
pub fn matmul(ty: GgmlType, rows: usize, t: usize) -> Result<Launch> {
    const NAMES: [&str; 4] = ["matmul_f32", "matmul_f16", "matmul_q8_0", "matmul_q4_0"];
    const T1: [&str; 4] = [
        "matmul_f32_t1",
        "matmul_f16_t1",
        "matmul_q8_0_t1",
        "matmul_q4_0_t1",
    ];
    const MMA: [Option<&str>; 4] = [
        None,
        Some("matmul_f16_mma"),
        Some("matmul_q8_0_mma"),
        Some("matmul_q4_0_mma"),
    ];
    let i = type_index(ty)?;
    if t > MATMUL_TOKENS {
        if let Some(name) = MMA[i] {
            return launch(
                name,
                rows.div_ceil(MMA_ROWS),
                t.div_ceil(MMA_TOKENS),
                1,
                MMA_THREADS,
            );
        }
    }
    let (name, nt) = if t == 1 {
        (T1[i], 1)
    } else {
        (NAMES[i], MATMUL_TOKENS)
    };
    launch(
        name,
        rows.div_ceil(MATMUL_WARPS),
        t.div_ceil(nt),
        1,
        MATMUL_WARPS * 32,
    )
}

/// The fused gate and up products and activation of a gated FFN's hot neurons
/// (`matmul_gated_*_t1`): one block per [`MATMUL_WARPS`] rows and token, each token as the
/// one-token kernel computes it.
pub fn gated(ty: GgmlType, rows: usize, t: usize) -> Result<Launch> {
    const NAMES: [&str; 4] = [
        "matmul_gated_f32_t1",
        "matmul_gated_f16_t1",
        "matmul_gated_q8_0_t1",
        "matmul_gated_q4_0_t1",
    ];
    let name = NAMES[type_index(ty)?];
    launch(name, rows.div_ceil(MATMUL_WARPS), t, 1, MATMUL_WARPS * 32)
}

/// Whether the product kernels for weights of type `ty` read the activation quantized to Q8_0
/// blocks by [`quantize_q8`] (Q8_0 and Q4_0 weights) rather than f32.
pub fn quantized_activation(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0)
}

/// Quantization of `blocks` blocks of 32 activation values (`quantize_q8`, one warp per block).
pub fn quantize_q8(blocks: usize) -> Result<Launch> {
    launch(
        "quantize_q8",
        blocks.div_ceil(QUANTIZE_BLOCKS),
        1,
        1,
        QUANTIZE_BLOCKS * 32,
    )
}

/// Sparse axpy of `rows` rows of `m` outputs of type `ty` for `t` tokens.
pub fn axpy(ty: GgmlType, m: usize, rows: usize, t: usize) -> Result<Launch> {
    const T1: [&str; 4] = ["axpy_f32_t1", "axpy_f16_t1", "axpy_q8_0_t1", "axpy_q4_0_t1"];
    const T8: [&str; 4] = ["axpy_f32_t8", "axpy_f16_t8", "axpy_q8_0_t8", "axpy_q4_0_t8"];
    let i = type_index(ty)?;
    if t > AXPY_SPARSE_MAX_TOKENS {
        launch(
            T8[i],
            m.div_ceil(BLOCK),
            rows.div_ceil(AXPY_ROWS),
            t.div_ceil(8),
            BLOCK,
        )
    } else {
        launch(
            T1[i],
            m.div_ceil(8 * AXPY_T1_THREADS),
            rows.div_ceil(AXPY_T1_ROWS),
            t,
            AXPY_T1_THREADS,
        )
    }
}

/// One block per row (rms_norm, layer_norm, softmax).
pub fn per_row(kernel: &'static str, rows: usize) -> Result<Launch> {
    launch(kernel, rows, 1, 1, BLOCK)
}

/// One thread per element (the element-wise operators, kv_store, threshold_mask).
pub fn per_element(kernel: &'static str, n: usize) -> Result<Launch> {
    launch(kernel, n.div_ceil(BLOCK), 1, 1, BLOCK)
}

/// RoPE: one thread per rotated pair, grid y = tokens.
pub fn rope(t: usize, n_head: usize, n_rot: usize) -> Result<Launch> {
    launch("rope", (n_head * (n_rot / 2)).div_ceil(BLOCK), t, 1, BLOCK)
}

/// RoPE of Q (`n_head` heads) and K (`n_head_kv`) in one launch: one thread per rotated pair
/// of either, grid y = tokens.
pub fn rope_qk(t: usize, n_head: usize, n_head_kv: usize, n_rot: usize) -> Result<Launch> {
    let pairs = (n_head + n_head_kv) * (n_rot / 2);
    launch("rope_qk", pairs.div_ceil(BLOCK), t, 1, BLOCK)
}

/// Rows of a table as floats: one block column per `BLOCK` elements, one block row per row.
pub fn get_rows(ty: GgmlType, cols: usize, n: usize) -> Result<Launch> {
    const NAMES: [&str; 4] = [
        "get_rows_f32",
        "get_rows_f16",
        "get_rows_q8_0",
        "get_rows_q4_0",
    ];
    launch(NAMES[type_index(ty)?], cols.div_ceil(BLOCK), n, 1, BLOCK)
}

/// One block per token.
pub fn count_active(t: usize) -> Result<Launch> {
    launch("count_active", t, 1, 1, BLOCK)
}

/// Attention: one block per (head, query token).
pub fn attention(n_head: usize, t: usize) -> Result<Launch> {
    launch("attention_f16kv", n_head, t, 1, BLOCK)
}

/// Ordered compaction of active neurons: a single block.
pub fn active_list() -> Launch {
    Launch {
        kernel: "active_list",
        grid: (1, 1, 1),
        block: ACTIVE_LIST_THREADS as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::KernelModule;

    #[test]
    fn launches_name_loaded_kernels_and_cover_the_shape() {
        let all: Vec<&str> = KernelModule::ALL
            .iter()
            .flat_map(|m| m.functions().iter().copied())
            .collect();
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
            let l = matmul(ty, 17, 8).unwrap();
            assert!(all.contains(&l.kernel) && !l.kernel.ends_with("_t1"));
            assert_eq!(l.grid, (3, 1, 1));
            let l = matmul(ty, 130, 65).unwrap();
            assert!(all.contains(&l.kernel));
            if ty == GgmlType::F32 {
                assert_eq!((l.kernel, l.grid), ("matmul_f32", (17, 9, 1)));
            } else {
                assert!(l.kernel.ends_with("_mma"));
                assert_eq!((l.grid, l.block), ((3, 2, 1), 128));
            }
            let l = matmul(ty, 17, 1).unwrap();
            assert!(all.contains(&l.kernel) && l.kernel.ends_with("_t1"));
            assert_eq!((l.grid, l.block), ((3, 1, 1), 256));
            let l = axpy(ty, 300, 129, 4).unwrap();
            assert!(all.contains(&l.kernel) && l.kernel.ends_with("_t1"));
            assert_eq!(l.grid, (1, 3, 4));
            let l = axpy(ty, 2049, 64, 1).unwrap();
            assert_eq!((l.grid, l.block), ((2, 1, 1), 256));
            let l = axpy(ty, 300, 129, 17).unwrap();
            assert!(l.kernel.ends_with("_t8"));
            assert_eq!(l.grid, (2, 2, 3));
        }
        assert!(matches!(
            matmul(GgmlType::Q4_K, 1, 1),
            Err(CudaError::UnsupportedType(_))
        ));
        assert!(matches!(
            matmul(GgmlType::F32, 1, 8 * 65536),
            Err(CudaError::Shape(_))
        ));
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
            let l = gated(ty, 17, 3).unwrap();
            assert!(all.contains(&l.kernel) && l.kernel.starts_with("matmul_gated_"));
            assert_eq!((l.grid, l.block), ((3, 3, 1), 256));
        }
        let l = quantize_q8(17).unwrap();
        assert!(all.contains(&l.kernel));
        assert_eq!((l.grid, l.block), ((3, 1, 1), 256));
        assert!(quantized_activation(GgmlType::Q4_0) && !quantized_activation(GgmlType::F16));
        for l in [
            per_row("rms_norm", 3).unwrap(),
            rope(2, 3, 4).unwrap(),
            rope_qk(2, 3, 1, 4).unwrap(),
            attention(2, 3).unwrap(),
            per_row("layer_norm", 2).unwrap(),
            active_list(),
        ] {
            assert!(all.contains(&l.kernel));
        }
    }
}
