//! The kernels' logic without a GPU: the real `kernels/*.cu` sources are compiled as C++ with a
//! small CUDA emulation (`tests/emu/cuda_emu.h`: one fiber per CUDA thread, a scheduler that
//! releases `__syncthreads` and warp-shuffle barriers), launched with the operators' own launch
//! geometry (`powerinfer_kernels_cuda::geometry`) and checked against the f64 references of
//! `powerinfer-kernels-cpu` on random shapes with tails, empty buckets, all neurons and none.
//!
//! This tests indexing, block layouts, bucket indirection (writes go to `dst[bucket[j]]`),
//! predicates, reductions and that partial sums of different blocks are all added (a plain
//! store instead of `atomicAdd` fails here because blocks overwrite each other). It does not
//! test what only hardware shows: concurrent atomics, the memory model, alignment faults, the
//! PTX `cvt` conversions, performance. Needs g++ with C++20 (`CXX` overrides); without one the
//! tests print "skipped: no C++ compiler (reason)". A compiler that fails on the sources is a
//! test failure.

mod common;

use std::process::Command;
use std::sync::{Mutex, OnceLock};

use common::{random_bucket, random_weight, Rng};
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::reference::{matmul as rm, ops as ro};
use powerinfer_kernels_cuda::geometry::{self, Launch};
use powerinfer_kernels_cuda::kernels::KernelModule;
use powerinfer_kernels_cuda::tensor::row_bytes;
use proptest::prelude::*;

struct Emu {
    lib: libloading::Library,
    _dir: tempfile::TempDir,
}

/// Serialises emulated launches: the emulation keeps its state in globals.
static LOCK: Mutex<()> = Mutex::new(());

fn build() -> Result<Emu, String> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    // The headers are embedded so the test binary also runs where the sources are absent
    // (scripts/gpu-check copies binaries to another machine).
    let headers = [
        ("cuda_emu.h", include_str!("emu/cuda_emu.h")),
        ("exports.h", include_str!("emu/exports.h")),
    ];
    for (name, text) in headers {
        std::fs::write(dir.path().join(name), text).map_err(|e| e.to_string())?;
    }
    let mut sources = Vec::new();
    for m in KernelModule::ALL {
        let defines = match m {
            KernelModule::Matmul => "#define EMU_MODULE_ROWS\n#define EMU_MODULE_MATMUL\n",
            KernelModule::Axpy => "#define EMU_MODULE_ROWS\n",
            KernelModule::Ops => "#define EMU_MODULE_OPS\n",
        };
        let src = format!(
            "#include \"cuda_emu.h\"\n{}\n{defines}#include \"exports.h\"\n",
            m.expanded_source()
        );
        let path = dir.path().join(format!("{}.cpp", m.name()));
        std::fs::write(&path, src).map_err(|e| e.to_string())?;
        sources.push(path);
    }
    let lib = dir.path().join("libemu.so");
    let out = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O1",
            "-fPIC",
            "-shared",
            "-pthread",
            "-fno-strict-aliasing",
            "-w",
        ])
        .arg("-I")
        .arg(dir.path())
        .args(&sources)
        .arg("-o")
        .arg(&lib)
        .output()
        .map_err(|e| format!("no C++ compiler ({cxx}: {e})"))?;
    if !out.status.success() {
        panic!(
            "the emulated kernels do not compile:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // SAFETY: the library was just built from our sources; loading runs no initialiser of note.
    let lib = unsafe { libloading::Library::new(&lib) }.map_err(|e| e.to_string())?;
    Ok(Emu { lib, _dir: dir })
}

fn emu() -> Option<&'static Emu> {
    static EMU: OnceLock<Result<Emu, String>> = OnceLock::new();
    match EMU.get_or_init(build) {
        Ok(e) => Some(e),
        Err(reason) => {
            println!("skipped: no C++ compiler ({reason})");
            None
        }
    }
}

type RowsFn = unsafe extern "C" fn(
    u32,
    u32,
    u32,
    u32,
    *const u8,
    i64,
    i32,
    i32,
    *const f32,
    i32,
    *const f32,
    *const u32,
    f32,
    i32,
    *mut f32,
);

impl Emu {
    fn sym<T: Copy>(&self, name: &str) -> T {
        // SAFETY: every emu_<kernel> symbol has the signature the caller names (tests/emu/exports.h).
        unsafe {
            *self
                .lib
                .get::<T>(format!("emu_{name}\0").as_bytes())
                .expect("symbol")
        }
    }

    /// Runs a matmul/axpy kernel as the operators launch it.
    #[allow(clippy::too_many_arguments)]
    fn rows(
        &self,
        l: Launch,
        w: &[u8],
        rb: usize,
        n_rows: usize,
        k: usize,
        x: &[f32],
        t: usize,
        p: Option<&[f32]>,
        bucket: Option<&[u32]>,
        theta: f32,
        n: usize,
        dst: &mut [f32],
    ) {
        if n_rows == 0 || t == 0 {
            return;
        }
        let f: RowsFn = self.sym(l.kernel);
        let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: buffers have the lengths the kernel reads and writes for these shapes (checked by
        // the callers as the operators check them).
        unsafe {
            f(
                l.grid.0,
                l.grid.1,
                l.grid.2,
                l.block,
                w.as_ptr(),
                rb as i64,
                n_rows as i32,
                k as i32,
                x.as_ptr(),
                t as i32,
                p.map_or(std::ptr::null(), |p| p.as_ptr()),
                bucket.map_or(std::ptr::null(), |b| b.as_ptr()),
                theta,
                n as i32,
                dst.as_mut_ptr(),
            )
        }
    }
}

/// What the product kernels read for weights of type `ty`, as the operators prepare it: `x`
/// itself (F32), `x` rounded to f16 values by the emulated `round_f16` (F16), or `x` quantized
/// by the emulated `quantize_q8` (Q8_0/Q4_0), whose values are checked bit for bit against
/// `reference::matmul::quantize_activation`. Also returns the activation values the reference
/// multiplies.
fn prepare_x(emu: &Emu, ty: GgmlType, x: &[f32]) -> Result<(Vec<f32>, Vec<f64>), TestCaseError> {
    if ty == GgmlType::F16 {
        let mut y = vec![f32::NAN; x.len()];
        let l = geometry::per_element("round_f16", x.len()).unwrap();
        type Round = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *mut f32, i64);
        let f: Round = emu.sym("round_f16");
        if !x.is_empty() {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: x and y hold x.len() floats.
            unsafe {
                f(
                    l.grid.0,
                    l.grid.1,
                    l.grid.2,
                    l.block,
                    x.as_ptr(),
                    y.as_mut_ptr(),
                    x.len() as i64,
                )
            };
        }
        let y64 = y.iter().map(|&v| v as f64).collect();
        return Ok((y, y64));
    }
    if !geometry::quantized_activation(ty) {
        return Ok((x.to_vec(), x.iter().map(|&v| v as f64).collect()));
    }
    let blocks = x.len() / 32;
    let mut xq = vec![f32::NAN; blocks * 9];
    let l = geometry::quantize_q8(blocks).unwrap();
    type Quant = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, i64, *mut u8);
    let f: Quant = emu.sym("quantize_q8");
    if blocks > 0 {
        let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: x holds 32·blocks floats, xq 32·blocks bytes plus `blocks` floats.
        unsafe {
            f(
                l.grid.0,
                l.grid.1,
                l.grid.2,
                l.block,
                x.as_ptr(),
                blocks as i64,
                xq.as_mut_ptr() as *mut u8,
            )
        };
    }
    let q: Vec<i8> = xq[..blocks * 8]
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .map(|b| b as i8)
        .collect();
    let d = &xq[blocks * 8..];
    let got: Vec<f64> = q
        .iter()
        .enumerate()
        .map(|(i, &v)| d[i / 32] as f64 * v as f64)
        .collect();
    let want = rm::quantize_activation(ty, x);
    prop_assert_eq!(
        &got,
        &want,
        "quantize_q8 differs from the reference quantizer"
    );
    Ok((xq, want))
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const TYPES: [GgmlType; 4] = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0];

fn cols_for(ty: GgmlType, raw: usize) -> usize {
    if ty.block_size() > 1 {
        32 * (1 + raw % 6)
    } else {
        1 + raw % 150
    }
}

fn abs_gemm(w: &[f64], rows: usize, cols: usize, x: &[f64], t: usize) -> Vec<f64> {
    let wa: Vec<f64> = w.iter().map(|v| v.abs()).collect();
    let xa: Vec<f64> = x.iter().map(|v| v.abs()).collect();
    rm::gemm(&wa, rows, cols, &xa, t)
}

fn close(what: &str, got: &[f32], want: &[f64], scale: &[f64]) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for i in 0..got.len() {
        let tol = 1e-4 * scale[i] + 1e-5;
        prop_assert!(
            (got[i] as f64 - want[i]).abs() <= tol,
            "{}[{}]: got {}, want {} (tol {})",
            what,
            i,
            got[i],
            want[i],
            tol
        );
    }
    Ok(())
}

/// Gathers the rows `bucket` of a quantized matrix (what GpuSlice::upload puts on the device).
fn gather(bytes: &[u8], rb: usize, bucket: &[u32]) -> Vec<u8> {
    powerinfer_kernels_cuda::tensor::gather_rows(bytes, rb, bucket).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn emulated_sparse_matmul_matches_reference(ti in 0usize..4, n in 1usize..80, raw in 0usize..200, t in prop_oneof![1usize..11, 60usize..72], mode in 0u8..4, theta_mode in 0u8..3, dense in any::<bool>(), seed in any::<u64>()) {
        let Some(emu) = emu() else { return Ok(()); };
        let ty = TYPES[ti];
        let cols = cols_for(ty, raw);
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, cols);
        let rb = row_bytes(ty, cols).unwrap();
        let x = rng.vec(t * cols);
        let (x, x64) = prepare_x(emu, ty, &x)?;
        let l = geometry::matmul(ty, n, t).unwrap();
        if dense {
            let mut y = vec![9.0f32; t * n];
            emu.rows(l, &bytes, rb, n, cols, &x, t, None, None, 0.0, n, &mut y);
            close("dense matmul", &y, &rm::gemm(&w, n, cols, &x64, t), &abs_gemm(&w, n, cols, &x64, t))?;
        } else {
            let bucket = random_bucket(&mut rng, n, mode);
            let slice = gather(&bytes, rb, &bucket);
            let scores = rng.vec(t * n);
            let theta = [-2.0f32, 2.0, 0.0][theta_mode as usize];
            let mut y = vec![0.0f32; t * n]; // the operator zeroes dst first
            let l = geometry::matmul(ty, bucket.len(), t).unwrap();
            emu.rows(l, &slice, rb, bucket.len(), cols, &x, t, Some(&scores), Some(&bucket), theta, n, &mut y);
            let mut skip = vec![true; n];
            for &b in &bucket { skip[b as usize] = false; }
            let want = rm::sparse_gemm(&w, n, cols, &x64, t, &scores, theta, Some(&skip));
            close("sparse matmul", &y, &want, &abs_gemm(&w, n, cols, &x64, t))?;
        }
    }

    #[test]
    fn emulated_matmul_long_rows_match_reference(ti in 0usize..4, n in 1usize..12, raw in 0usize..12800, vec8 in any::<bool>(), tm in 0usize..4, seed in any::<u64>()) {
        // Rows long enough for the unrolled main loops of every kernel (the test above only
        // reaches their tails), up to K = 12800, for one token (matmul_*_t1) and for several
        // (9 tokens: the tensor-core kernels' partial token tile; their K up to 3200).
        let Some(emu) = emu() else { return Ok(()); };
        let ty = TYPES[ti];
        let t = [1, 1, 2, 9][tm];
        let raw = if t > 8 { raw / 4 } else { raw };
        let cols = if ty.block_size() > 1 { 32 * (1 + raw % 400) } else if vec8 { 8 * (1 + raw % 1600) } else { 1 + raw };
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, cols);
        let rb = row_bytes(ty, cols).unwrap();
        let x = rng.vec(t * cols);
        let (x, x64) = prepare_x(emu, ty, &x)?;
        let l = geometry::matmul(ty, n, t).unwrap();
        let mut y = vec![9.0f32; t * n];
        emu.rows(l, &bytes, rb, n, cols, &x, t, None, None, 0.0, n, &mut y);
        close(&format!("{} K={cols} T={t}", l.kernel), &y, &rm::gemm(&w, n, cols, &x64, t), &abs_gemm(&w, n, cols, &x64, t))?;
    }

    #[test]
    fn emulated_sparse_matmul_long_rows_few_active(ti in 0usize..4, n in 1usize..40, raw in 0usize..12800, active in 0usize..12, t in 1usize..3, seed in any::<u64>()) {
        // Long rows of a sparse product with only a few active rows (the decode case for which
        // matmul_*_t1 spreads a block's active rows over all its warps: 1, 2, 4 or 8 warps per
        // row): the active outputs are the dot products, every other bucket row is 0.
        let Some(emu) = emu() else { return Ok(()); };
        let ty = TYPES[ti];
        let cols = if ty.block_size() > 1 { 32 * (1 + raw % 400) } else { 1 + raw };
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, cols);
        let rb = row_bytes(ty, cols).unwrap();
        let x = rng.vec(t * cols);
        let (x, x64) = prepare_x(emu, ty, &x)?;
        let bucket = random_bucket(&mut rng, n, 1);
        let slice = gather(&bytes, rb, &bucket);
        let mut scores = vec![-1.0f32; t * n];
        for _ in 0..active {
            scores[rng.below(t * n)] = 1.0;
        }
        let mut y = vec![0.0f32; t * n];
        let l = geometry::matmul(ty, bucket.len(), t).unwrap();
        emu.rows(l, &slice, rb, bucket.len(), cols, &x, t, Some(&scores), Some(&bucket), 0.0, n, &mut y);
        let mut skip = vec![true; n];
        for &b in &bucket { skip[b as usize] = false; }
        let want = rm::sparse_gemm(&w, n, cols, &x64, t, &scores, 0.0, Some(&skip));
        close(&format!("{} K={cols} T={t}", l.kernel), &y, &want, &abs_gemm(&w, n, cols, &x64, t))?;
    }

    #[test]
    fn emulated_gated_products_match_reference(ti in 0usize..4, n in 1usize..40, raw in 0usize..3000, active in 0usize..40, t in 1usize..4, kind in 0u8..3, seed in any::<u64>()) {
        // The fused gate/up products and activation of a gated FFN's hot neurons: 1 to 8 active
        // rows a block (the halves spread over the warps) and more, every type, 1-3 tokens.
        let Some(emu) = emu() else { return Ok(()); };
        let ty = TYPES[ti];
        let cols = if ty.block_size() > 1 { 32 * (1 + raw % 100) } else { 1 + raw };
        let mut rng = Rng::new(seed);
        let (bytes_g, wg) = random_weight(&mut rng, ty, n, cols);
        let (bytes_u, wu) = random_weight(&mut rng, ty, n, cols);
        let rb = row_bytes(ty, cols).unwrap();
        let x = rng.vec(t * cols);
        let (x, x64) = prepare_x(emu, ty, &x)?;
        let bucket = random_bucket(&mut rng, n, 2);
        let (sg, su) = (gather(&bytes_g, rb, &bucket), gather(&bytes_u, rb, &bucket));
        let mut scores = vec![-1.0f32; t * n];
        for _ in 0..active {
            scores[rng.below(t * n)] = 1.0;
        }
        let mut y = vec![7.0f32; t * n];
        let mut count = vec![0.0f32; t];
        if !bucket.is_empty() {
            let l = geometry::gated(ty, bucket.len(), t).unwrap();
            type Gated = unsafe extern "C" fn(u32, u32, u32, u32, *const u8, *const u8, i64, i32, i32, *const f32, i32, *const f32, *const u32, f32, i32, i32, *mut f32, *mut f32);
            let f: Gated = emu.sym(l.kernel);
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: sg and su hold bucket.len() rows of rb bytes; x the t tokens' activation as
            // the kernel reads it; scores and y hold t × n floats; the bucket is unique and < n.
            unsafe {
                f(l.grid.0, l.grid.1, l.grid.2, l.block, sg.as_ptr(), su.as_ptr(), rb as i64, bucket.len() as i32, cols as i32, x.as_ptr(), t as i32, scores.as_ptr(), bucket.as_ptr(), 0.0, n as i32, i32::from(kind), count.as_mut_ptr(), y.as_mut_ptr())
            };
        }
        let want_count: Vec<f32> = (0..t)
            .map(|tok| bucket.iter().filter(|&&r| scores[tok * n + r as usize] >= 0.0).count() as f32)
            .collect();
        prop_assert_eq!(&count, &want_count, "neurons counted per token");
        let (g, u) = (rm::gemm(&wg, n, cols, &x64, t), rm::gemm(&wu, n, cols, &x64, t));
        let (ag, au) = (abs_gemm(&wg, n, cols, &x64, t), abs_gemm(&wu, n, cols, &x64, t));
        let mut want = vec![7.0f64; t * n];
        let mut scale = vec![0.0f64; t * n];
        for tok in 0..t {
            for &row in &bucket {
                let i = tok * n + row as usize;
                want[i] = if scores[i] >= 0.0 {
                    match kind {
                        0 => g[i].max(0.0) * u[i],
                        1 => g[i].max(0.0) * u[i].max(0.0),
                        _ => g[i] / (1.0 + (-g[i]).exp()) * u[i],
                    }
                } else {
                    0.0
                };
                scale[i] = 2.0 * (u[i].abs() + au[i]) * ag[i] + 2.0 * (g[i].abs() + ag[i]) * au[i];
            }
        }
        close(&format!("gated {ty} kind {kind} K={cols} T={t} k={}", bucket.len()), &y, &want, &scale)?;
    }

    #[test]
    fn emulated_sparse_axpy_matches_reference(ti in 0usize..4, n in 1usize..300, raw in 0usize..400, wide in any::<bool>(), t in 1usize..11, mode in 0u8..4, theta_mode in 0u8..4, seed in any::<u64>()) {
        let Some(emu) = emu() else { return Ok(()); };
        let ty = TYPES[ti];
        // Up to 2 column blocks of 256 threads (t8) with a tail; `wide`: up to 2 column blocks of
        // 2048 (t1: 8 columns per thread), F32 / F16 rows a multiple of 8 (16-byte loads).
        let m = match (ty.block_size() > 1, wide) {
            (true, false) => 32 * (1 + raw % 12),
            (true, true) => 32 * (1 + raw % 100),
            (false, false) => 1 + raw,
            (false, true) => 8 * (1 + raw),
        };
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, m);
        let rb = row_bytes(ty, m).unwrap();
        let bucket = random_bucket(&mut rng, n, mode);
        let slice = gather(&bytes, rb, &bucket);
        let a: Vec<f32> = (0..t * n).map(|_| rng.uniform(-0.5, 1.0).max(0.0)).collect();
        let scores = rng.vec(t * n);
        let (theta, p, ref_scores) = match theta_mode {
            3 => (0.0f32, None, vec![1.0f32; t * n]),
            k => ([-2.0f32, 2.0, 0.0][k as usize], Some(&scores[..]), scores.clone()),
        };
        let mut y = vec![0.0f32; t * m];
        let l = geometry::axpy(ty, m, bucket.len(), t).unwrap();
        emu.rows(l, &slice, rb, bucket.len(), m, &a, t, p, Some(&bucket), theta, n, &mut y);
        let mut skip = vec![true; n];
        for &b in &bucket { skip[b as usize] = false; }
        let a64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let want = rm::sparse_axpy(&w, n, m, &a64, t, &ref_scores, theta, Some(&skip), &vec![0.0; t * m]);
        let wa: Vec<f64> = w.iter().map(|v| v.abs()).collect();
        let scale = rm::sparse_axpy(&wa, n, m, &a64, t, &vec![1.0; t * n], 0.0, None, &vec![0.0; t * m]);
        close(&format!("axpy {} T={t} k={}", l.kernel, bucket.len()), &y, &want, &scale)?;
    }

    #[test]
    fn emulated_sparse_axpy_t1_low_density(ti in 0usize..4, n in 1usize..400, blocks in 1usize..200, density in 0usize..5, t in 1usize..5, all_rows in any::<bool>(), scored in any::<bool>(), seed in any::<u64>()) {
        // The one-token kernels (axpy_*_t1, T <= 4) at the densities of decoding, from a few
        // selected rows per block of 64 rows to all of them, on rows of 32 k columns, k not a
        // multiple of 64: the last column block of 2048 is partial.
        let Some(emu) = emu() else { return Ok(()); };
        let ty = TYPES[ti];
        let m = 32 * if blocks % 64 == 0 { blocks + 1 } else { blocks };
        let frac = [0.02f32, 0.1, 0.3, 0.7, 1.0][density];
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, m);
        let rb = row_bytes(ty, m).unwrap();
        let bucket = random_bucket(&mut rng, n, if all_rows { 1 } else { 2 });
        let slice = gather(&bytes, rb, &bucket);
        // Selected with probability `frac`: by the score (p[k] >= 0) or by a nonzero activation.
        let mut a = vec![0.0f32; t * n];
        let mut scores = vec![-1.0f32; t * n];
        for k in 0..t * n {
            let on = rng.uniform(0.0, 1.0) < frac;
            if scored {
                a[k] = rng.uniform(0.0, 1.0);
                if on { scores[k] = 1.0; }
            } else if on {
                a[k] = rng.uniform(0.0, 1.0);
            }
        }
        let (p, ref_scores) = if scored { (Some(&scores[..]), scores.clone()) } else { (None, vec![1.0f32; t * n]) };
        let mut y = vec![0.0f32; t * m];
        let l = geometry::axpy(ty, m, bucket.len(), t).unwrap();
        prop_assert!(l.kernel.ends_with("_t1"), "{} is not a one-token kernel", l.kernel);
        emu.rows(l, &slice, rb, bucket.len(), m, &a, t, p, Some(&bucket), 0.0, n, &mut y);
        let mut skip = vec![true; n];
        for &b in &bucket { skip[b as usize] = false; }
        let a64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let want = rm::sparse_axpy(&w, n, m, &a64, t, &ref_scores, 0.0, Some(&skip), &vec![0.0; t * m]);
        let wa: Vec<f64> = w.iter().map(|v| v.abs()).collect();
        let scale = rm::sparse_axpy(&wa, n, m, &a64, t, &vec![1.0; t * n], 0.0, None, &vec![0.0; t * m]);
        close(&format!("axpy {} m={m} T={t} k={} density={frac}", l.kernel, bucket.len()), &y, &want, &scale)?;
    }

    /// The hybrid FFN's device chain, as the engine queues it, kernel after kernel on the
    /// emulation: predictor (`fc1` product, `relu`, `fc2` product), the gate and up rows of the
    /// layer's hot neurons (`sparse_matmul` over their slices), `relu_gate`, and the `sparse_axpy`
    /// over their down rows. Added to the reference FFN of the other (cold) neurons it gives the
    /// reference FFN of every active neuron.
    #[test]
    fn emulated_hybrid_ffn_chain_matches_reference(ti in 0usize..4, n in 1usize..96, cb in 1usize..5, rank in 1usize..40, t in 1usize..4, mode in 0u8..3, bamboo in any::<bool>(), seed in any::<u64>()) {
        let Some(emu) = emu() else { return Ok(()); };
        let ty = TYPES[ti];
        let d = 32 * cb;
        let mut rng = Rng::new(seed);
        // Predictor in F32 (d -> rank -> n), FFN rows in `ty` (n rows of d).
        let (fc1_b, fc1) = random_weight(&mut rng, GgmlType::F32, rank, d);
        let (fc2_b, fc2) = random_weight(&mut rng, GgmlType::F32, n, rank);
        let (gate_b, gate) = random_weight(&mut rng, ty, n, d);
        let (up_b, up) = random_weight(&mut rng, ty, n, d);
        let (down_b, down) = random_weight(&mut rng, ty, n, d);
        let h = rng.vec(t * d);
        let x = rng.vec(t * d);
        // The predictor on the device.
        let mut hid = vec![0.0f32; t * rank];
        emu.rows(geometry::matmul(GgmlType::F32, rank, t).unwrap(), &fc1_b, 4 * d, rank, d, &h, t, None, None, 0.0, rank, &mut hid);
        let mut hid_r = vec![0.0f32; t * rank];
        type Relu = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *mut f32, i64);
        let f: Relu = emu.sym("relu");
        let l = geometry::per_element("relu", hid.len()).unwrap();
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: hid and hid_r hold t × rank floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, hid.as_ptr(), hid_r.as_mut_ptr(), hid.len() as i64) };
        }
        let mut p = vec![0.0f32; t * n];
        emu.rows(geometry::matmul(GgmlType::F32, n, t).unwrap(), &fc2_b, 4 * rank, n, rank, &hid_r, t, None, None, 0.0, n, &mut p);
        let h64: Vec<f64> = h.iter().map(|&v| v as f64).collect();
        let relu64: Vec<f64> = rm::gemm(&fc1, rank, d, &h64, t).into_iter().map(ro::relu).collect();
        let p_ref = rm::gemm(&fc2, n, rank, &relu64, t);
        let p_scale = rm::gemm(&fc2.iter().map(|v| v.abs()).collect::<Vec<_>>(), n, rank, &relu64.iter().map(|v| v.abs()).collect::<Vec<_>>(), t);
        close("predictor", &p, &p_ref, &p_scale)?;
        // The hot neurons' gate and up, the activation, the down rows.
        let bucket = random_bucket(&mut rng, n, [0u8, 1, 2][mode as usize]);
        let rb = row_bytes(ty, d).unwrap();
        let (xq, x64) = prepare_x(emu, ty, &x)?;
        let l = geometry::matmul(ty, bucket.len(), t).unwrap();
        let mut g = vec![0.0f32; t * n];
        let mut u = vec![0.0f32; t * n];
        emu.rows(l, &gather(&gate_b, rb, &bucket), rb, bucket.len(), d, &xq, t, Some(&p), Some(&bucket), 0.0, n, &mut g);
        emu.rows(l, &gather(&up_b, rb, &bucket), rb, bucket.len(), d, &xq, t, Some(&p), Some(&bucket), 0.0, n, &mut u);
        let mut a = vec![0.0f32; t * n];
        let f: unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *mut f32, i64, i32) = emu.sym("relu_gate");
        let l = geometry::per_element("relu_gate", a.len()).unwrap();
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: g, u and a hold t × n floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, g.as_ptr(), u.as_ptr(), a.as_mut_ptr(), a.len() as i64, i32::from(bamboo)) };
        }
        let mut y = vec![0.0f32; t * d];
        let l = geometry::axpy(ty, d, bucket.len(), t).unwrap();
        emu.rows(l, &gather(&down_b, rb, &bucket), rb, bucket.len(), d, &a, t, Some(&p), Some(&bucket), 0.0, n, &mut y);
        // Reference: every neuron active by the device's scores, its FFN in f64; the device's
        // part (hot neurons) plus the CPU's part (the rest) must give it.
        let hot: Vec<bool> = { let mut v = vec![false; n]; for &b in &bucket { v[b as usize] = true; } v };
        let gr = rm::gemm(&gate, n, d, &x64, t);
        let ur = rm::gemm(&up, n, d, &x64, t);
        let mut a_hot = vec![0.0f64; t * n];
        let mut a_cold = vec![0.0f64; t * n];
        for k in 0..t * n {
            if p[k] < 0.0 { continue; }
            let uv = if bamboo { ro::relu(ur[k]) } else { ur[k] };
            let v = ro::relu(gr[k]) * uv;
            if hot[k % n] { a_hot[k] = v } else { a_cold[k] = v }
        }
        let ones = vec![1.0f32; t * n];
        let zero = vec![0.0f64; t * d];
        let y_hot = rm::sparse_axpy(&down, n, d, &a_hot, t, &ones, 0.0, None, &zero);
        let y_cold = rm::sparse_axpy(&down, n, d, &a_cold, t, &ones, 0.0, None, &zero);
        let a_abs: Vec<f64> = gr.iter().zip(&ur).map(|(g, u)| g.abs() * u.abs() + 1.0).collect();
        let wa: Vec<f64> = down.iter().map(|v| v.abs()).collect();
        let scale = rm::sparse_axpy(&wa, n, d, &a_abs, t, &ones, 0.0, None, &zero);
        close("device part", &y, &y_hot, &scale)?;
        let total: Vec<f32> = y.iter().zip(&y_cold).map(|(a, b)| (*a as f64 + b) as f32).collect();
        let want: Vec<f64> = y_hot.iter().zip(&y_cold).map(|(a, b)| a + b).collect();
        close("device + CPU", &total, &want, &scale)?;
    }

    #[test]
    fn emulated_norm_softmax_rope_gate_match_reference(rows in 1usize..4, n in 1usize..600, n_head in 1usize..4, half in 1usize..20, neox in any::<bool>(), seed in any::<u64>()) {
        let Some(emu) = emu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let x = rng.vec(rows * n);
        let w = rng.vec(n);
        let mut y = vec![0.0f32; rows * n];
        let l = geometry::per_row("rms_norm", rows).unwrap();
        type Norm = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *mut f32, i32, f32);
        let f: Norm = emu.sym("rms_norm");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: x and y hold rows × n floats, w holds n.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, x.as_ptr(), w.as_ptr(), y.as_mut_ptr(), n as i32, 1e-5) };
        }
        let want = ro::rms_norm(&x, &w, 1e-5);
        let scale: Vec<f64> = want.iter().map(|v| 10.0 * v.abs()).collect();
        close("rms_norm", &y, &want, &scale)?;

        let bias = rng.vec(n);
        let l = geometry::per_row("layer_norm", rows).unwrap();
        type Layer = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *const f32, *mut f32, i32, f32);
        let f: Layer = emu.sym("layer_norm");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: x and y hold rows × n floats, w and bias hold n.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, x.as_ptr(), w.as_ptr(), bias.as_ptr(), y.as_mut_ptr(), n as i32, 1e-5) };
        }
        let want = ro::layer_norm(&x, &w, &bias, 1e-5);
        let scale: Vec<f64> = want.iter().map(|v| 10.0 * v.abs() + 10.0).collect();
        close("layer_norm", &y, &want, &scale)?;

        // The norm and the conversion its products read in one launch: bit for bit the norm,
        // then quantize_q8 (rows of whole blocks) or round_f16 of its output.
        let nq = 32 * (1 + n % 18);
        let xq = rng.vec(rows * nq);
        let wq = rng.vec(nq);
        let bq = rng.vec(nq);
        for (layer, conv) in [(false, 1), (false, 2), (true, 1), (true, 2)] {
            let mut sep = vec![0.0f32; rows * nq];
            let mut fused = vec![0.0f32; rows * nq];
            let total = rows * nq;
            let mut out = vec![0.0f32; if conv == 1 { total / 32 * 9 } else { total }];
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: the inputs and outputs hold rows × nq floats, w and b nq, out the
            // conversion (total int8 values and total / 32 scales, or total floats).
            unsafe {
                let name = if layer { "layer_norm_conv" } else { "rms_norm_conv" };
                let l = geometry::per_row(name, rows).unwrap();
                if layer {
                    let f: Layer = emu.sym("layer_norm");
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, xq.as_ptr(), wq.as_ptr(), bq.as_ptr(), sep.as_mut_ptr(), nq as i32, 1e-5);
                    type LayerConv = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *const f32, *mut f32, i32, f32, i32, i32, *mut u8);
                    let f: LayerConv = emu.sym(name);
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, xq.as_ptr(), wq.as_ptr(), bq.as_ptr(), fused.as_mut_ptr(), nq as i32, 1e-5, rows as i32, conv, out.as_mut_ptr() as *mut u8);
                } else {
                    let f: Norm = emu.sym("rms_norm");
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, xq.as_ptr(), wq.as_ptr(), sep.as_mut_ptr(), nq as i32, 1e-5);
                    type NormConv = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *mut f32, i32, f32, i32, i32, *mut u8);
                    let f: NormConv = emu.sym(name);
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, xq.as_ptr(), wq.as_ptr(), fused.as_mut_ptr(), nq as i32, 1e-5, rows as i32, conv, out.as_mut_ptr() as *mut u8);
                }
            }
            drop(_g);
            prop_assert_eq!(bits(&fused), bits(&sep), "norm output (layer {}, conv {})", layer, conv);
            let want = if conv == 1 {
                let ty = GgmlType::Q8_0;
                prepare_x(emu, ty, &sep)?.0
            } else {
                prepare_x(emu, GgmlType::F16, &sep)?.0
            };
            prop_assert_eq!(bits(&out), bits(&want), "conversion (layer {}, conv {})", layer, conv);
        }

        // The residual add and the norm in one launch: bit for bit the add (add_inplace) and
        // then the norm.
        let a = rng.vec(rows * n);
        let mut sum = x.clone();
        type Residual = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *mut f32, i64);
        let add: Residual = emu.sym("add_inplace");
        let la = geometry::per_element("add_inplace", rows * n).unwrap();
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: a and sum hold rows × n floats.
            unsafe { add(la.grid.0, la.grid.1, la.grid.2, la.block, a.as_ptr(), sum.as_mut_ptr(), (rows * n) as i64) };
        }
        for layer in [false, true] {
            let mut sep = vec![0.0f32; rows * n];
            let mut xf = x.clone();
            let mut yf = vec![0.0f32; rows * n];
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: x, a, sum and the outputs hold rows × n floats, w and bias hold n.
            unsafe {
                if layer {
                    let l = geometry::per_row("layer_norm", rows).unwrap();
                    let f: Layer = emu.sym("layer_norm");
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, sum.as_ptr(), w.as_ptr(), bias.as_ptr(), sep.as_mut_ptr(), n as i32, 1e-5);
                    type AddLayer = unsafe extern "C" fn(u32, u32, u32, u32, *mut f32, *const f32, *const f32, *const f32, *mut f32, i32, f32);
                    let l = geometry::per_row("add_layer_norm", rows).unwrap();
                    let f: AddLayer = emu.sym("add_layer_norm");
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, xf.as_mut_ptr(), a.as_ptr(), w.as_ptr(), bias.as_ptr(), yf.as_mut_ptr(), n as i32, 1e-5);
                } else {
                    let l = geometry::per_row("rms_norm", rows).unwrap();
                    let f: Norm = emu.sym("rms_norm");
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, sum.as_ptr(), w.as_ptr(), sep.as_mut_ptr(), n as i32, 1e-5);
                    type AddNorm = unsafe extern "C" fn(u32, u32, u32, u32, *mut f32, *const f32, *const f32, *mut f32, i32, f32);
                    let l = geometry::per_row("add_rms_norm", rows).unwrap();
                    let f: AddNorm = emu.sym("add_rms_norm");
                    f(l.grid.0, l.grid.1, l.grid.2, l.block, xf.as_mut_ptr(), a.as_ptr(), w.as_ptr(), yf.as_mut_ptr(), n as i32, 1e-5);
                }
            }
            prop_assert_eq!(bits(&xf), bits(&sum), "residual of the fused norm (layer {})", layer);
            prop_assert_eq!(bits(&yf), bits(&sep), "fused norm (layer {})", layer);
        }

        let mut sx = x.clone();
        if rows > 1 { for v in &mut sx[..n] { *v = f32::NEG_INFINITY; } }
        let l = geometry::per_row("softmax", rows).unwrap();
        type Soft = unsafe extern "C" fn(u32, u32, u32, u32, *mut f32, i32, f32);
        let f: Soft = emu.sym("softmax");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: sx holds rows × n floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, sx.as_mut_ptr(), n as i32, 0.7) };
        }
        let src: Vec<f32> = { let mut s = x.clone(); if rows > 1 { for v in &mut s[..n] { *v = f32::NEG_INFINITY; } } s };
        let want: Vec<f64> = src.chunks(n).flat_map(|r| ro::softmax(r, 0.7)).collect();
        close("softmax", &sx, &want, &vec![10.0; want.len()])?;

        let g: Vec<f32> = x.clone();
        let u: Vec<f32> = x.iter().rev().copied().collect();
        let l = geometry::per_element("relu_gate", g.len()).unwrap();
        type Gate = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *mut f32, i64, i32);
        let f: Gate = emu.sym("relu_gate");
        for relu_u in [0, 1] {
            {
                let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
                // SAFETY: g, u, y hold the same number of floats.
                unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, g.as_ptr(), u.as_ptr(), y.as_mut_ptr(), g.len() as i64, relu_u) };
            }
            let want: Vec<f64> = g.iter().zip(&u).map(|(&a, &b)| ro::relu(a as f64) * if relu_u == 1 { ro::relu(b as f64) } else { b as f64 }).collect();
            close("relu_gate", &y, &want, &vec![0.0; want.len()])?;
        }

        // RoPE on `rows` tokens.
        let head_dim = 2 * half + 2;
        let n_rot = 2 * half;
        let mut xr = rng.vec(rows * n_head * head_dim);
        let orig = xr.clone();
        let pos: Vec<i32> = (0..rows).map(|_| rng.below(4096) as i32).collect();
        let l = geometry::rope(rows, n_head, n_rot).unwrap();
        type Rope = unsafe extern "C" fn(u32, u32, u32, u32, *mut f32, *const i32, i32, i32, i32, f32, f32, i32);
        let f: Rope = emu.sym("rope");
        let freq_scale = if seed % 3 == 0 { 0.25 } else { 1.0 };
        let theta_scale = powerinfer_kernels_cuda::ops::rope_theta_scale(10000.0, n_rot);
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: xr holds rows × n_head × head_dim floats, pos holds rows positions.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, xr.as_mut_ptr(), pos.as_ptr(), n_head as i32, head_dim as i32, n_rot as i32, theta_scale, freq_scale, i32::from(neox)) };
        }
        let mode = if neox { powerinfer_kernels_cpu::ops::rope::RopeMode::NeoX } else { powerinfer_kernels_cpu::ops::rope::RopeMode::Normal };
        let per = n_head * head_dim;
        // The CPU kernel's angles (ggml's repeated products): the same f32 operations, so the
        // two agree to the rounding of cos and sin, tighter than either to the exact angles.
        let params = powerinfer_kernels_cpu::ops::rope::RopeParams { n_dims: n_rot, mode, freq_base: 10000.0, freq_scale };
        let mut cpu = orig.clone();
        for (i, tok) in cpu.chunks_exact_mut(per).enumerate() {
            powerinfer_kernels_cpu::ops::rope::rope(tok, n_head, head_dim, pos[i] as usize, &params).unwrap();
        }
        let want: Vec<f64> = cpu.iter().map(|&v| v as f64).collect();
        close("rope", &xr, &want, &vec![0.02; want.len()])?;

        // Q and K in one launch: bit for bit rope on each (K: one head fewer, at least one).
        let n_kv = n_head.saturating_sub(1).max(1);
        let (mut q2, mut k2) = (orig.clone(), rng.vec(rows * n_kv * head_dim));
        let k_orig = k2.clone();
        let l = geometry::rope_qk(rows, n_head, n_kv, n_rot).unwrap();
        type RopeQk = unsafe extern "C" fn(u32, u32, u32, u32, *mut f32, *mut f32, *const i32, i32, i32, i32, i32, f32, f32, i32);
        let fqk: RopeQk = emu.sym("rope_qk");
        let mut k1 = k_orig.clone();
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: q2 and k2 hold rows × heads × head_dim floats, pos holds rows positions.
            unsafe {
                fqk(l.grid.0, l.grid.1, l.grid.2, l.block, q2.as_mut_ptr(), k2.as_mut_ptr(), pos.as_ptr(), n_head as i32, n_kv as i32, head_dim as i32, n_rot as i32, theta_scale, freq_scale, i32::from(neox));
                let l = geometry::rope(rows, n_kv, n_rot).unwrap();
                f(l.grid.0, l.grid.1, l.grid.2, l.block, k1.as_mut_ptr(), pos.as_ptr(), n_kv as i32, head_dim as i32, n_rot as i32, theta_scale, freq_scale, i32::from(neox));
            }
        }
        prop_assert_eq!(bits(&q2), bits(&xr), "rope_qk: q");
        prop_assert_eq!(bits(&k2), bits(&k1), "rope_qk: k");

        // SwiGLU as the CPU kernel computes it.
        let l = geometry::per_element("silu_gate", g.len()).unwrap();
        type Silu = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *mut f32, i64);
        let f: Silu = emu.sym("silu_gate");
        let gs: Vec<f32> = g.iter().map(|v| 8.0 * v).collect();
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: gs, u, y hold the same number of floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, gs.as_ptr(), u.as_ptr(), y.as_mut_ptr(), gs.len() as i64) };
        }
        let mut cpu = gs.clone();
        powerinfer_kernels_cpu::ops::activation::swiglu(&mut cpu, &u).unwrap();
        let scale: Vec<f64> = cpu.iter().map(|v| 0.1 * v.abs() as f64).collect();
        close("silu_gate", &y, &cpu.iter().map(|&v| v as f64).collect::<Vec<_>>(), &scale)?;

        // A bias over rows, in place; an in-place add and ReLU.
        let mut yb = x.clone();
        let l = geometry::per_element("add_rows", yb.len()).unwrap();
        type AddRows = unsafe extern "C" fn(u32, u32, u32, u32, *mut f32, *const f32, i32, i64);
        let f: AddRows = emu.sym("add_rows");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: yb holds rows × n floats, w holds n.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, yb.as_mut_ptr(), w.as_ptr(), n as i32, yb.len() as i64) };
        }
        let want: Vec<f64> = x.iter().enumerate().map(|(i, &v)| (v + w[i % n]) as f64).collect();
        close("add_rows", &yb, &want, &vec![0.0; want.len()])?;
        type AddIn = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *mut f32, i64);
        let f: AddIn = emu.sym("add_inplace");
        let l = geometry::per_element("add_inplace", yb.len()).unwrap();
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: yb and x hold the same number of floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, x.as_ptr(), yb.as_mut_ptr(), yb.len() as i64) };
        }
        let want: Vec<f64> = x.iter().enumerate().map(|(i, &v)| ((v + w[i % n]) + v) as f64).collect();
        close("add_inplace", &yb, &want, &vec![0.0; want.len()])?;
        type ReluIn = unsafe extern "C" fn(u32, u32, u32, u32, *mut f32, i64);
        let f: ReluIn = emu.sym("relu_inplace");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: yb holds its length of floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, yb.as_mut_ptr(), yb.len() as i64) };
        }
        let want: Vec<f64> = want.iter().map(|&v| ro::relu(v)).collect();
        close("relu_inplace", &yb, &want, &vec![0.0; want.len()])?;

        // ReLU and the f16 rounding in one launch: bit for bit relu_inplace, then round_f16.
        let (mut fused, mut sep) = (x.clone(), x.clone());
        let f2: ReluIn = emu.sym("relu_round_f16_inplace");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: fused and sep hold their lengths of floats.
            unsafe {
                f2(l.grid.0, l.grid.1, l.grid.2, l.block, fused.as_mut_ptr(), fused.len() as i64);
                f(l.grid.0, l.grid.1, l.grid.2, l.block, sep.as_mut_ptr(), sep.len() as i64);
            }
        }
        let (sep, _) = prepare_x(emu, GgmlType::F16, &sep)?;
        prop_assert_eq!(bits(&fused), bits(&sep), "relu_round_f16_inplace");
    }

    #[test]
    fn emulated_kv_store_and_causal_attention_match_reference(n_kv in 1usize..3, group in 1usize..4, head_dim in 1usize..70, len in 1usize..100, tq in 1usize..4, batch in 1usize..6, seed in any::<u64>()) {
        let Some(emu) = emu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let n_head = n_kv * group;
        let row = n_kv * head_dim;
        let tq = tq.min(len);
        let n_ctx = len + 2;
        let (mut kc, mut vc) = (vec![0u16; n_ctx * row], vec![0u16; n_ctx * row]);
        let (k, v) = (rng.vec(len * row), rng.vec(len * row));
        type Store = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const f32, *mut u16, *mut u16, *const i32, i32, i32, i32);
        let store: Store = emu.sym("kv_store");
        let mut pos = 0;
        while pos < len {
            let t = batch.min(len - pos);
            let at: Vec<i32> = (pos..pos + t).map(|p| p as i32).collect();
            let l = geometry::per_element("kv_store", t * row).unwrap();
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: caches hold n_ctx × row halves, the k and v slices t × row floats, at t positions.
            unsafe { store(l.grid.0, l.grid.1, l.grid.2, l.block, k[pos * row..].as_ptr(), v[pos * row..].as_ptr(), kc.as_mut_ptr(), vc.as_mut_ptr(), at.as_ptr(), row as i32, t as i32, n_ctx as i32) };
            pos += t;
        }
        // Positions outside the cache write nothing.
        {
            let at = [-1i32, n_ctx as i32, i32::MAX];
            let l = geometry::per_element("kv_store", 3 * row).unwrap();
            let (k3, v3) = (k.repeat(3), v.repeat(3));
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: as above; k3 and v3 hold at least 3 × row floats.
            unsafe { store(l.grid.0, l.grid.1, l.grid.2, l.block, k3.as_ptr(), v3.as_ptr(), kc.as_mut_ptr(), vc.as_mut_ptr(), at.as_ptr(), row as i32, 3, n_ctx as i32) };
        }
        let ks: Vec<half::f16> = k.iter().map(|&x| half::f16::from_f32(x)).collect();
        let vs: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
        prop_assert_eq!(&kc[..len * row], &ks.iter().map(|h| h.to_bits()).collect::<Vec<_>>()[..]);
        prop_assert_eq!(&vc[..len * row], &vs.iter().map(|h| h.to_bits()).collect::<Vec<_>>()[..]);
        prop_assert!(kc[len * row..].iter().all(|&b| b == 0));
        let q = rng.vec(tq * n_head * head_dim);
        let mut out = vec![0.0f32; tq * n_head * head_dim];
        let mut scratch = vec![0.0f32; tq * n_head * n_ctx];
        let scale = 1.0 / (head_dim as f32).sqrt();
        let l = geometry::attention(n_head, tq).unwrap();
        // The queries are the last tq of the len stored positions.
        let at: Vec<i32> = (len - tq..len).map(|p| p as i32).collect();
        type Att = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const u16, *const u16, *const i32, *mut f32, *mut f32, i32, i32, i32, i32, f32);
        let f: Att = emu.sym("attention_f16kv");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: shapes as documented on attention_f16kv; scratch holds tq × n_head × n_ctx floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, q.as_ptr(), kc.as_ptr(), vc.as_ptr(), at.as_ptr(), out.as_mut_ptr(), scratch.as_mut_ptr(), n_head as i32, n_kv as i32, head_dim as i32, n_ctx as i32, scale) };
        }
        let want = ro::attention_block(&q, &ks, &vs, tq, n_head, n_kv, head_dim, scale as f64);
        close("attention", &out, &want, &vec![10.0; want.len()])?;
    }

    #[test]
    fn emulated_threshold_and_active_list_are_exact(n in 0usize..3000, theta_mode in 0u8..3, seed in any::<u64>()) {
        let Some(emu) = emu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let p = rng.vec(n);
        let theta = [-2.0f32, 2.0, 0.3][theta_mode as usize];
        let mut idx = vec![u32::MAX; n.max(1)];
        let mut count = [u32::MAX];
        let l = geometry::active_list();
        type List = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, i32, f32, *mut u32, *mut u32);
        let f: List = emu.sym("active_list");
        let mut mask = vec![7u8; n.max(1)];
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: idx holds at least n entries.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, p.as_ptr(), n as i32, theta, idx.as_mut_ptr(), count.as_mut_ptr()) };
            if n > 0 {
                let lm = geometry::per_element("threshold_mask", n).unwrap();
                type Mask = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *mut u8, i64, f32);
                let g: Mask = emu.sym("threshold_mask");
                // SAFETY: mask holds n bytes.
                unsafe { g(lm.grid.0, lm.grid.1, lm.grid.2, lm.block, p.as_ptr(), mask.as_mut_ptr(), n as i64, theta) };
            }
        }
        let want: Vec<u32> = (0..n as u32).filter(|&i| p[i as usize] >= theta).collect();
        prop_assert_eq!(count[0] as usize, want.len());
        prop_assert_eq!(&idx[..want.len()], &want[..]);
        for i in 0..n {
            prop_assert_eq!(mask[i] == 1, p[i] >= theta);
        }
    }

    /// Embedding rows of every type as the CPU dequantizes them; the per-token count of a hot
    /// slice's computed rows; the f16 rounding of F16 products' activations.
    #[test]
    fn emulated_rows_counts_and_f16_rounding_are_exact(ti in 0usize..4, rows in 1usize..40, blocks in 1usize..6, n_ids in 1usize..9, offset in 0usize..3, k in 0usize..60, t in 1usize..4, seed in any::<u64>()) {
        let Some(emu) = emu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let ty = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0][ti];
        let cols = 32 * blocks;
        let (w, exact) = random_weight(&mut rng, ty, rows + offset, cols);
        let rb = row_bytes(ty, cols).unwrap();
        let ids: Vec<i32> = (0..n_ids).map(|_| rng.below(rows) as i32).collect();
        let mut y = vec![f32::NAN; n_ids * cols];
        let l = geometry::get_rows(ty, cols, n_ids).unwrap();
        type Rows = unsafe extern "C" fn(u32, u32, u32, u32, *const u8, i64, i32, *const i32, i32, *mut f32);
        let f: Rows = emu.sym(l.kernel);
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: w holds rows + offset rows of rb bytes, every id + offset is below that,
            // y holds n_ids rows of cols floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, w.as_ptr(), rb as i64, cols as i32, ids.as_ptr(), offset as i32, y.as_mut_ptr()) };
        }
        for (i, &id) in ids.iter().enumerate() {
            let r = id as usize + offset;
            for c in 0..cols {
                prop_assert_eq!(y[i * cols + c] as f64, exact[r * cols + c], "row {} col {}", r, c);
            }
        }

        let n = k + rng.below(20) + 1;
        let bucket = random_bucket(&mut rng, n, 2);
        let p = rng.vec(t * n);
        let theta = 0.25;
        let mut counts = vec![f32::NAN; t];
        let l = geometry::count_active(t).unwrap();
        type Count = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *const u32, i32, i32, f32, *mut f32);
        let f: Count = emu.sym("count_active");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: p holds t × n scores, bucket entries are below n, counts holds t floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, p.as_ptr(), bucket.as_ptr(), bucket.len() as i32, n as i32, theta, counts.as_mut_ptr()) };
        }
        for i in 0..t {
            let want = bucket.iter().filter(|&&j| p[i * n + j as usize] >= theta).count();
            prop_assert_eq!(counts[i], want as f32, "token {}", i);
        }

        let x: Vec<f32> = rng.vec(t * cols).iter().map(|v| v * 300.0).collect();
        let mut r = vec![0.0f32; x.len()];
        let l = geometry::per_element("round_f16", x.len()).unwrap();
        type Round = unsafe extern "C" fn(u32, u32, u32, u32, *const f32, *mut f32, i64);
        let f: Round = emu.sym("round_f16");
        {
            let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: x and r hold the same number of floats.
            unsafe { f(l.grid.0, l.grid.1, l.grid.2, l.block, x.as_ptr(), r.as_mut_ptr(), x.len() as i64) };
        }
        for (i, (&a, &b)) in x.iter().zip(&r).enumerate() {
            prop_assert_eq!(b.to_bits(), half::f16::from_f32(a).to_f32().to_bits(), "value {}", i);
        }
    }
}
