//! Matrix kernels against the f64 references of `reference::matmul`, on random shapes (including
//! row lengths that are not a multiple of the SIMD width) for every weight type, every backend
//! this CPU has, and several thread counts. Bounds are explained in `matmul_common`.

mod matmul_common;

use matmul_common::{
    abs_parts, assert_close, product_bounds, random_vec, random_weights, to_f64, Rng, U,
};
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::matmul::supported_types;
use powerinfer_kernels_cpu::reference::matmul as r;
use powerinfer_kernels_cpu::{
    probe, AxpyCoefficients, Backend, GemmJob, GemvJob, KernelError, MatMul, PackedGemvJob,
    RowSelect, ThreadPool, Weights,
};
use proptest::prelude::*;

const THREADS: [usize; 2] = [1, 3];

fn pools() -> Vec<ThreadPool> {
    THREADS.iter().map(|&n| ThreadPool::new(n)).collect()
}

/// Column count for `units`: any length for the float types, whole blocks otherwise.
fn cols_for(ty: GgmlType, units: usize) -> usize {
    match ty.block_size() {
        1 => units,
        32 => 32 * (1 + units % 6),
        _ => 256 * (1 + units % 2),
    }
}

struct Case {
    data: Vec<u8>,
    w: Vec<f64>,
    abs_w: Vec<f64>,
}

fn make_case(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Case {
    let data = random_weights(ty, rows, cols, rng);
    let w = r::dequantize(ty, &data).expect("kernel type");
    let abs_w = abs_parts(ty, &data);
    Case { data, w, abs_w }
}

fn quantized_acts(ty: GgmlType, x: &[f32], cols: usize) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|xs| r::quantize_activation(ty, xs))
        .collect()
}

fn check_dense(ty_i: usize, rows: usize, units: usize, n_tokens: usize, seed: u64) {
    let ty = supported_types()[ty_i];
    let cols = cols_for(ty, units);
    let mut rng = Rng(seed);
    let c = make_case(ty, rows, cols, &mut rng);
    let x = random_vec(cols * n_tokens, &mut rng);
    let xq = quantized_acts(ty, &x, cols);
    let want_tight = r::gemm(&c.w, rows, cols, &xq, n_tokens);
    let want_exact = r::gemm(&c.w, rows, cols, &to_f64(&x), n_tokens);
    let (tight, loose) = product_bounds(ty, &c.abs_w, rows, cols, &x, &xq, n_tokens);
    let wv = Weights::new(ty, rows, cols, &c.data).unwrap();
    let mut first: Option<Vec<f32>> = None;
    for backend in Backend::available() {
        for pool in pools() {
            let mm = MatMul::with_backend(&pool, backend).unwrap();
            let mut y = vec![f32::NAN; rows * n_tokens];
            mm.gemm(&wv, &x, n_tokens, &mut y).unwrap();
            let what = format!(
                "{ty:?} {backend} {}t {rows}x{cols} T={n_tokens}",
                pool.n_threads()
            );
            assert_close(&format!("{what} tight"), &y, &want_tight, &tight);
            assert_close(&format!("{what} exact"), &y, &want_exact, &loose);
            // Same thread count twice: bit-identical.
            let mut y2 = vec![0f32; y.len()];
            mm.gemm(&wv, &x, n_tokens, &mut y2).unwrap();
            assert_eq!(bits(&y), bits(&y2), "{what}: repeat not bit-identical");
            // Rows never depend on how threads split the work: 1 and 3 threads agree exactly
            // on one backend.
            if pool.n_threads() == 1 {
                first = Some(y);
            } else if let Some(f) = &first {
                assert_eq!(bits(f), bits(&y), "{what}: 1 vs 3 threads differ");
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn scores_for(rows: usize, n_tokens: usize, rng: &mut Rng) -> Vec<f32> {
    // About half of the scores are ≥ 0 (selected at θ = 0); a few NaN never select.
    (0..rows * n_tokens)
        .map(|_| {
            if rng.below(50) == 0 {
                f32::NAN
            } else {
                rng.f32()
            }
        })
        .collect()
}

fn check_sparse(
    ty_i: usize,
    rows: usize,
    units: usize,
    n_tokens: usize,
    seed: u64,
    use_skip: bool,
) {
    let ty = supported_types()[ty_i];
    let cols = cols_for(ty, units);
    let mut rng = Rng(seed);
    let c = make_case(ty, rows, cols, &mut rng);
    let x = random_vec(cols * n_tokens, &mut rng);
    let scores = scores_for(rows, n_tokens, &mut rng);
    let skip: Vec<bool> = (0..rows).map(|_| rng.below(4) == 0).collect();
    let skip = use_skip.then_some(&skip[..]);
    let sel = RowSelect {
        scores: &scores,
        threshold: 0.0,
        skip,
    };
    let xq = quantized_acts(ty, &x, cols);
    let want = r::sparse_gemm(&c.w, rows, cols, &xq, n_tokens, &scores, 0.0, skip);
    let (tight, _) = product_bounds(ty, &c.abs_w, rows, cols, &x, &xq, n_tokens);
    let wv = Weights::new(ty, rows, cols, &c.data).unwrap();
    for backend in Backend::available() {
        for pool in pools() {
            let mm = MatMul::with_backend(&pool, backend).unwrap();
            let what = format!(
                "{ty:?} {backend} {}t {rows}x{cols} T={n_tokens}",
                pool.n_threads()
            );
            let mut y = vec![f32::NAN; rows * n_tokens];
            mm.sparse_gemm(&wv, &x, n_tokens, &sel, &mut y).unwrap();
            assert_close(&format!("{what} sparse_gemm"), &y, &want, &tight);
            // Sparse == dense with the unselected rows zeroed, exactly.
            let mut dense = vec![0f32; rows * n_tokens];
            mm.gemm(&wv, &x, n_tokens, &mut dense).unwrap();
            // Over the union of the tokens' rows, every token: the dense product's bits there
            // (for quantized types the one-token products'), 0 elsewhere.
            let union: Vec<u32> = (0..rows as u32)
                .filter(|&i| {
                    (0..n_tokens).any(|t| r::is_selected(&scores, rows, 0.0, skip, t, i as usize))
                })
                .collect();
            let mut yu = vec![f32::NAN; rows * n_tokens];
            mm.sparse_gemm_indexed(&wv, &x, n_tokens, &union, &mut yu)
                .unwrap();
            let mut want_u = vec![0f32; rows * n_tokens];
            for t in 0..n_tokens {
                for &i in &union {
                    want_u[t * rows + i as usize] = dense[t * rows + i as usize];
                }
            }
            assert_eq!(bits(&yu), bits(&want_u), "{what}: sparse_gemm_indexed");
            for t in 0..n_tokens {
                for i in 0..rows {
                    if !r::is_selected(&scores, rows, 0.0, skip, t, i) {
                        dense[t * rows + i] = 0.0;
                    }
                }
            }
            assert_eq!(bits(&y), bits(&dense), "{what}: sparse != zeroed dense");
            // Per token: sparse_gemv equals the dense GEMV with unselected rows zeroed and the
            // indexed form, bit for bit; for quantized types also the multi-token product's
            // token (float weights sum one-token products in another order, see
            // `gemm_equals_gemv_per_token_bitwise`; `tight` above bounds both).
            for t in 0..n_tokens {
                let xs = &x[t * cols..(t + 1) * cols];
                let sc = &scores[t * rows..(t + 1) * rows];
                let sel1 = RowSelect {
                    scores: sc,
                    threshold: 0.0,
                    skip,
                };
                let mut y1 = vec![f32::NAN; rows];
                mm.sparse_gemv(&wv, xs, &sel1, &mut y1).unwrap();
                assert_close(
                    &format!("{what} sparse_gemv t={t}"),
                    &y1,
                    &want[t * rows..(t + 1) * rows],
                    &tight[t * rows..(t + 1) * rows],
                );
                let mut d1 = vec![f32::NAN; rows];
                mm.gemv(&wv, xs, &mut d1).unwrap();
                for (i, d) in d1.iter_mut().enumerate() {
                    if !r::is_selected(sc, rows, 0.0, skip, 0, i) {
                        *d = 0.0;
                    }
                }
                assert_eq!(
                    bits(&y1),
                    bits(&d1),
                    "{what}: gemv t={t} != zeroed dense gemv"
                );
                if ty.block_size() > 1 {
                    assert_eq!(
                        bits(&y1),
                        bits(&y[t * rows..(t + 1) * rows]),
                        "{what}: gemv t={t}"
                    );
                }
                let active: Vec<u32> = (0..rows as u32)
                    .filter(|&i| r::is_selected(sc, rows, 0.0, skip, 0, i as usize))
                    .collect();
                let mut y2 = vec![f32::NAN; rows];
                mm.sparse_gemv_indexed(&wv, xs, &active, &mut y2).unwrap();
                assert_eq!(bits(&y1), bits(&y2), "{what}: indexed t={t}");
            }
        }
    }
}

fn check_axpy(ty_i: usize, rows: usize, units: usize, n_tokens: usize, seed: u64, use_skip: bool) {
    let ty = supported_types()[ty_i];
    let cols = cols_for(ty, units);
    let mut rng = Rng(seed);
    let c = make_case(ty, rows, cols, &mut rng);
    // Activations after ReLU: about a third exactly zero.
    let a: Vec<f32> = (0..rows * n_tokens)
        .map(|_| if rng.below(3) == 0 { 0.0 } else { rng.f32() })
        .collect();
    let y0 = random_vec(cols * n_tokens, &mut rng);
    let scores = scores_for(rows, n_tokens, &mut rng);
    let skip: Vec<bool> = (0..rows).map(|_| rng.below(4) == 0).collect();
    let skip = use_skip.then_some(&skip[..]);
    let sel = RowSelect {
        scores: &scores,
        threshold: 0.0,
        skip,
    };
    let want = r::sparse_axpy(
        &c.w,
        rows,
        cols,
        &r::axpy_coefficients(ty, &a),
        n_tokens,
        &scores,
        0.0,
        skip,
        &to_f64(&y0),
    );
    // Bound: each output is y0 plus a sequential sum over at most `rows` terms, each term
    // rounded a few times (a·d, ·q, the add): (rows + 4)·u·(|y0| + Σ|a||w|).
    let mut bound = vec![0f64; cols * n_tokens];
    for t in 0..n_tokens {
        for col in 0..cols {
            let s: f64 = (0..rows)
                .map(|i| (a[t * rows + i] as f64).abs() * c.abs_w[i * cols + col])
                .sum();
            bound[t * cols + col] =
                (rows + 4) as f64 * U * (s + (y0[t * cols + col] as f64).abs()) + 1e-30;
        }
    }
    let wv = Weights::new(ty, rows, cols, &c.data).unwrap();
    for backend in Backend::available() {
        let mut first: Option<Vec<f32>> = None;
        for pool in pools() {
            let mm = MatMul::with_backend(&pool, backend).unwrap();
            let what = format!(
                "{ty:?} {backend} {}t {rows}x{cols} T={n_tokens}",
                pool.n_threads()
            );
            let mut y = y0.clone();
            mm.sparse_axpy_batch(&wv, &a, n_tokens, &sel, &mut y)
                .unwrap();
            assert_close(&format!("{what} axpy"), &y, &want, &bound);
            let mut again = y0.clone();
            mm.sparse_axpy_batch(&wv, &a, n_tokens, &sel, &mut again)
                .unwrap();
            assert_eq!(bits(&y), bits(&again), "{what}: repeat not bit-identical");
            if let Some(f) = &first {
                assert_eq!(bits(f), bits(&y), "{what}: 1 vs 3 threads differ");
            } else {
                first = Some(y.clone());
            }
            // Per token: the one-token kernel and the indexed form give the same bits.
            for t in 0..n_tokens {
                let at = &a[t * rows..(t + 1) * rows];
                let sc = &scores[t * rows..(t + 1) * rows];
                let sel1 = RowSelect {
                    scores: sc,
                    threshold: 0.0,
                    skip,
                };
                let mut y1 = y0[t * cols..(t + 1) * cols].to_vec();
                mm.sparse_axpy(&wv, at, &sel1, &mut y1).unwrap();
                assert_eq!(
                    bits(&y1),
                    bits(&y[t * cols..(t + 1) * cols]),
                    "{what}: t={t}"
                );
                let active: Vec<u32> = (0..rows as u32)
                    .filter(|&i| r::is_selected(sc, rows, 0.0, skip, 0, i as usize))
                    .collect();
                let mut y2 = y0[t * cols..(t + 1) * cols].to_vec();
                mm.sparse_axpy_indexed(&wv, at, &active, &mut y2).unwrap();
                assert_eq!(bits(&y1), bits(&y2), "{what}: indexed t={t}");
            }
        }
    }
}

/// How many weight types the property tests below draw from: all of `supported_types()`.
const N_TYPES: usize = 13;

#[test]
fn property_tests_draw_every_supported_type() {
    assert_eq!(N_TYPES, supported_types().len());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn dense_matches_reference(ty_i in 0usize..N_TYPES, rows in 1usize..10, units in 1usize..80,
                               n_tokens in prop_oneof![Just(1usize), 2usize..9, 60usize..=64],
                               seed in any::<u64>()) {
        check_dense(ty_i, rows, units, n_tokens, seed);
    }

    #[test]
    fn sparse_matches_reference_and_zeroed_dense(ty_i in 0usize..N_TYPES, rows in 1usize..24,
                               units in 1usize..80, n_tokens in prop_oneof![Just(1usize), 2usize..6, Just(17usize)],
                               seed in any::<u64>(), use_skip in any::<bool>()) {
        check_sparse(ty_i, rows, units, n_tokens, seed, use_skip);
    }

    #[test]
    fn axpy_matches_reference(ty_i in 0usize..N_TYPES, rows in 1usize..24, units in 1usize..150,
                              n_tokens in prop_oneof![Just(1usize), 2usize..6, Just(13usize)],
                              seed in any::<u64>(), use_skip in any::<bool>()) {
        check_axpy(ty_i, rows, units, n_tokens, seed, use_skip);
    }
}

/// Every type once on a LLaMA-like row length (4096), so the block loops run long.
#[test]
fn long_rows_every_type() {
    for ty_i in 0..supported_types().len() {
        check_dense(ty_i, 5, 4096 + 64, 6, 7 + ty_i as u64);
        check_axpy(ty_i, 9, 4096 + 64, 2, 11 + ty_i as u64, true);
    }
}

/// SIMD and scalar within twice the tight bound of each other (each is within it of the
/// reference), on the same data.
#[test]
fn simd_close_to_scalar() {
    let mut rng = Rng(99);
    for &ty in supported_types() {
        let (rows, cols, n_tokens) = (7, cols_for(ty, 70), 5);
        let c = make_case(ty, rows, cols, &mut rng);
        let x = random_vec(cols * n_tokens, &mut rng);
        let xq = quantized_acts(ty, &x, cols);
        let (tight, _) = product_bounds(ty, &c.abs_w, rows, cols, &x, &xq, n_tokens);
        let wv = Weights::new(ty, rows, cols, &c.data).unwrap();
        let pool = ThreadPool::new(2);
        let mut ys = vec![0f32; rows * n_tokens];
        MatMul::with_backend(&pool, Backend::Scalar)
            .unwrap()
            .gemm(&wv, &x, n_tokens, &mut ys)
            .unwrap();
        for backend in Backend::available() {
            let mut y = vec![0f32; rows * n_tokens];
            MatMul::with_backend(&pool, backend)
                .unwrap()
                .gemm(&wv, &x, n_tokens, &mut y)
                .unwrap();
            let ys64 = to_f64(&ys);
            let b2: Vec<f64> = tight.iter().map(|b| 2.0 * b).collect();
            assert_close(&format!("{ty:?} {backend} vs scalar"), &y, &ys64, &b2);
        }
    }
}

#[test]
fn reference_decoder_matches_gguf_decoder() {
    let mut rng = Rng(5);
    for &ty in supported_types() {
        let cols = cols_for(ty, 3);
        let data = random_weights(ty, 3, cols, &mut rng);
        let ours = r::dequantize(ty, &data).unwrap();
        let theirs = powerinfer_gguf::quants::dequantize_to_vec(ty, &data).unwrap();
        assert_eq!(ours.len(), theirs.len());
        for (i, (&a, &b)) in ours.iter().zip(&theirs).enumerate() {
            // gguf decodes in f32 (one or two roundings of values below ~2).
            assert!(
                (a - b as f64).abs() <= 1e-6 * (1.0 + a.abs()),
                "{ty:?} [{i}]: {a} vs {b}"
            );
        }
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    let pool = ThreadPool::new(2);
    let mm = MatMul::new(&pool);
    let data = vec![0u8; 4 * 64 / 32 * 18];
    assert!(matches!(
        Weights::new(GgmlType::Q4_0, 4, 48, &data[..]),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        Weights::new(GgmlType::Q4_0, 5, 64, &data[..]),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        Weights::new(GgmlType::Q8_K, 1, 256, &[0u8; 292][..]),
        Err(KernelError::UnsupportedType(GgmlType::Q8_K))
    ));
    let w = Weights::new(GgmlType::Q4_0, 4, 64, &data).unwrap();
    let x = vec![1f32; 64];
    let mut y = vec![0f32; 4];
    assert!(matches!(
        mm.gemv(&w, &x[..63], &mut y),
        Err(KernelError::Length { what: "x", .. })
    ));
    assert!(matches!(
        mm.sparse_gemv_indexed(&w, &x, &[0, 4], &mut y),
        Err(KernelError::IndexOutOfRange {
            index: 4,
            len: 4,
            ..
        })
    ));
    assert!(matches!(
        mm.sparse_gemv_indexed(&w, &x, &[2, 1], &mut y),
        Err(KernelError::IndicesNotIncreasing { position: 1, .. })
    ));
    let mut out = vec![0f32; 64];
    let a = vec![1f32; 4];
    assert!(matches!(
        mm.sparse_axpy_indexed(&w, &a, &[1, 9], &mut out),
        Err(KernelError::IndexOutOfRange { index: 9, .. })
    ));
    let scores = vec![0f32; 3];
    let sel = RowSelect {
        scores: &scores,
        threshold: 0.0,
        skip: None,
    };
    assert!(matches!(
        mm.sparse_axpy(&w, &a, &sel, &mut out),
        Err(KernelError::Length { what: "scores", .. })
    ));
    let unavailable = Backend::ALL.into_iter().find(|b| !b.is_available());
    if let Some(b) = unavailable {
        assert!(matches!(
            MatMul::with_backend(&pool, b),
            Err(KernelError::BackendUnavailable(_))
        ));
    }
}

/// The AVX-512 VNNI integer dots compute the same exact integer sums as the AVX2 ones, and the
/// 512-bit one-token float dots the same lane operations as the AVX2 ones, so the two backends
/// agree bit for bit on every type, in GEMV and GEMM, with and without vector tails.
#[test]
fn avx512_matches_avx2_bitwise() {
    if !(Backend::Avx512.is_available() && Backend::Avx2.is_available()) {
        eprintln!("skipped: this CPU lacks AVX-512 VNNI");
        return;
    }
    let mut rng = Rng(123);
    let pool = ThreadPool::new(2);
    for &ty in supported_types() {
        for units in [4096 + 32, 4096 + 48 + 5, 16 * 3 + 9] {
            for n_tokens in [1, 6] {
                let (rows, cols) = (9, cols_for(ty, units));
                let c = make_case(ty, rows, cols, &mut rng);
                let x = random_vec(cols * n_tokens, &mut rng);
                let wv = Weights::new(ty, rows, cols, &c.data).unwrap();
                let run = |b: Backend| {
                    let mut y = vec![0f32; rows * n_tokens];
                    MatMul::with_backend(&pool, b)
                        .unwrap()
                        .gemm(&wv, &x, n_tokens, &mut y)
                        .unwrap();
                    bits(&y)
                };
                assert_eq!(
                    run(Backend::Avx2),
                    run(Backend::Avx512),
                    "{ty:?} {cols} T={n_tokens}"
                );
            }
        }
    }
}

/// F16 weights multiply the activation rounded to f16 (ties to even), as ggml converts it to
/// its F16 weights' `vec_dot_type`, on every path: each product of F16 weights with `x` has
/// exactly the bits of the same product of F32 weights holding the same values with `x`
/// already rounded (the float kernels share their arithmetic across element types), and
/// differs from that F32 product with `x` unrounded. One-row and four-row GEMV lengths (F16
/// rows one per pass up to 8192 elements, F32 rows up to 4096), the
/// blocked GEMM, the row-sparse products (list kernels for rows of at most 4 KiB, four-row
/// kernels beyond), the sparse axpy's coefficients, every backend, 1 and 3 threads.
#[test]
fn f16_products_multiply_activations_rounded_to_f16() {
    let mut rng = Rng(77);
    for cols in [5, 64 + 9, 2048 + 5, 4096 + 16 + 3, 8192 + 37] {
        for n_tokens in [1, 5, 16] {
            let rows = 23;
            let w16: Vec<half::f16> = (0..rows * cols)
                .map(|_| half::f16::from_f32(rng.f32()))
                .collect();
            let d16: Vec<u8> = w16.iter().flat_map(|v| v.to_le_bytes()).collect();
            let d32: Vec<u8> = w16.iter().flat_map(|v| v.to_f32().to_le_bytes()).collect();
            // Values of many magnitudes, most of them not f16 numbers.
            let x: Vec<f32> = (0..cols * n_tokens)
                .map(|i| rng.f32() * [1.0, 3e-3, 40.0, 1e-6][i % 4])
                .collect();
            let xr: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            assert!(x.iter().zip(&xr).filter(|(a, b)| a != b).count() > x.len() / 2);
            // Axpy coefficients (`rows` per token), with some exact zeros.
            let a: Vec<f32> = (0..rows * n_tokens)
                .map(|i| [rng.f32() * 3e-3, 0.0, rng.f32(), rng.f32() * 20.0][i % 4])
                .collect();
            let ar: Vec<f32> = a.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
            let scores: Vec<f32> = (0..rows * n_tokens).map(|_| rng.f32()).collect();
            let sel = RowSelect {
                scores: &scores,
                threshold: 0.2,
                skip: None,
            };
            let ws = [
                Weights::new(GgmlType::F16, rows, cols, &d16).unwrap(),
                Weights::new(GgmlType::F32, rows, cols, &d32).unwrap(),
            ];
            for backend in Backend::available() {
                for pool in pools() {
                    let mm = MatMul::with_backend(&pool, backend).unwrap();
                    let what =
                        format!("{backend} {}t {rows}x{cols} T={n_tokens}", pool.n_threads());
                    let run = |w: &Weights<'_>, x: &[f32], sparse: bool| {
                        let mut y = vec![f32::NAN; rows * n_tokens];
                        match (sparse, n_tokens) {
                            (false, 1) => mm.gemv(w, x, &mut y).unwrap(),
                            (false, _) => mm.gemm(w, x, n_tokens, &mut y).unwrap(),
                            (true, 1) => mm.sparse_gemv(w, x, &sel, &mut y).unwrap(),
                            (true, _) => mm.sparse_gemm(w, x, n_tokens, &sel, &mut y).unwrap(),
                        }
                        bits(&y)
                    };
                    for sparse in [false, true] {
                        let got = run(&ws[0], &x, sparse);
                        assert_eq!(got, run(&ws[1], &xr, sparse), "{what} sparse={sparse}");
                        assert_ne!(
                            got,
                            run(&ws[1], &x, sparse),
                            "{what} sparse={sparse}: unrounded"
                        );
                    }
                    // The axpy over the same matrix taken as transposed (`rows` neurons of
                    // `cols`): its coefficients are rounded too.
                    let (t, a, ar) = (n_tokens, &a[..], &ar[..]);
                    let axpy = |w: &Weights<'_>, a: &[f32]| {
                        let mut y = vec![0.5f32; cols * t];
                        if t == 1 {
                            mm.sparse_axpy(w, a, &sel, &mut y).unwrap();
                        } else {
                            mm.sparse_axpy_batch(w, a, t, &sel, &mut y).unwrap();
                        }
                        bits(&y)
                    };
                    let got = axpy(&ws[0], a);
                    assert_eq!(got, axpy(&ws[1], ar), "{what} axpy");
                    assert_ne!(got, axpy(&ws[1], a), "{what} axpy: unrounded");
                }
            }
        }
    }
}

/// Empty shapes are valid and produce empty (or untouched) outputs, never a panic; absurd token
/// counts are a typed error, not an overflow.
#[test]
fn degenerate_shapes() {
    let pool = ThreadPool::new(2);
    for backend in Backend::available() {
        let mm = MatMul::with_backend(&pool, backend).unwrap();
        for &ty in supported_types() {
            // No rows.
            let w = Weights::new(ty, 0, ty.block_size(), &[]).unwrap();
            let x = vec![1f32; ty.block_size()];
            mm.gemv(&w, &x, &mut []).unwrap();
            mm.sparse_gemv_indexed(&w, &x, &[], &mut []).unwrap();
            // No tokens.
            let data = vec![0u8; ty.type_size()];
            let w = Weights::new(ty, 1, ty.block_size(), &data).unwrap();
            mm.gemm(&w, &[], 0, &mut []).unwrap();
            let mut y = vec![5f32; ty.block_size()];
            mm.sparse_axpy_indexed(&w, &[0.0], &[0], &mut y).unwrap();
            assert!(
                y.iter().all(|&v| v == 5.0),
                "{ty:?}: zero activation must add nothing"
            );
            // Shape error (overflow) or length error (F32: 1 × MAX fits), never a panic.
            assert!(mm.gemm(&w, &[], usize::MAX, &mut []).is_err());
            assert!(mm.gemm(&w, &[], usize::MAX / 2 + 1, &mut []).is_err());
        }
    }
}

/// How every (row, token) of a product is computed does not depend on how the work was grouped:
/// for odd row counts (a row left over after the pairs, parts of odd length per thread), token
/// counts that are not a multiple of 4, row lengths that are not a multiple of the SIMD width
/// (float types) or of two blocks (Q4_0 pairs), on every backend and 1, 2 and 3 threads:
/// - every token of a T-token GEMM equals, bit for bit, the same token in a 2-token GEMM (the
///   blocked kernels' tiles, the 2 × 4 micro-kernel, the four-token and one-row kernels agree);
/// - quantized types: a GEMM equals one GEMV per token bit for bit (exact integer sums, one
///   order). Float weights sum one-token products in another order (four 16-lane accumulators
///   per row, see `matmul::x86`) than multi-token ones: there the two agree within
///   `2 · n · ε · Σ|w·x|`, a bound on the difference of two f32 summation orders.
#[test]
fn gemm_equals_gemv_per_token_bitwise() {
    let mut rng = Rng(4242);
    for &ty in supported_types() {
        for &(rows, units, n_tokens) in &[(7usize, 4096 + 37, 9usize), (5, 133, 6), (2, 61, 4)] {
            let cols = match ty.block_size() {
                1 => units,
                32 => 32 * ((units / 32) | 1),
                _ => 256 * (1 + units / 2048),
            };
            let c = make_case(ty, rows, cols, &mut rng);
            let x = random_vec(cols * n_tokens, &mut rng);
            let wv = Weights::new(ty, rows, cols, &c.data).unwrap();
            let float = ty.block_size() == 1;
            for backend in Backend::available() {
                let mut first: Option<Vec<f32>> = None;
                for threads in [1, 2, 3] {
                    let pool = ThreadPool::new(threads);
                    let mm = MatMul::with_backend(&pool, backend).unwrap();
                    let what = format!("{ty:?} {backend} {threads}t {rows}x{cols} T={n_tokens}");
                    let mut y = vec![f32::NAN; rows * n_tokens];
                    mm.gemm(&wv, &x, n_tokens, &mut y).unwrap();
                    for t in 0..n_tokens {
                        let xt = &x[t * cols..(t + 1) * cols];
                        let got = &y[t * rows..(t + 1) * rows];
                        // The same token next to another one, in a 2-token product.
                        let pair: Vec<f32> = xt.iter().chain(&x[..cols]).copied().collect();
                        let mut y2 = vec![f32::NAN; rows * 2];
                        mm.gemm(&wv, &pair, 2, &mut y2).unwrap();
                        assert_eq!(bits(&y2[..rows]), bits(got), "{what}: grouping at t={t}");
                        let mut yt = vec![f32::NAN; rows];
                        mm.gemv(&wv, xt, &mut yt).unwrap();
                        if !float {
                            assert_eq!(bits(&yt), bits(got), "{what}: gemm != gemv at t={t}");
                            continue;
                        }
                        for i in 0..rows {
                            let w = &c.w[i * cols..(i + 1) * cols];
                            let mass: f64 =
                                w.iter().zip(xt).map(|(w, &x)| (w * x as f64).abs()).sum();
                            let bound = 2.0 * cols as f64 * f32::EPSILON as f64 * mass;
                            let d = (yt[i] as f64 - got[i] as f64).abs();
                            assert!(d <= bound, "{what}: row {i} t={t}: |{d}| > {bound}");
                        }
                    }
                    match &first {
                        None => first = Some(y),
                        Some(f) => assert_eq!(bits(f), bits(&y), "{what}: thread counts differ"),
                    }
                }
            }
        }
    }
}

/// `gemm_multi` gives every job exactly what `gemm` gives it alone: jobs of one type and of
/// mixed types (float and quantized), sharing one input or not, with row lengths that are not a
/// multiple of the SIMD width, matrices of a few rows beside large ones (a layer's K and V
/// beside Q), inputs small and large (prepared by one thread or by all), one token and many, on every backend and 1, 2 and 3 threads; and a job of the
/// wrong size is an error before anything is written.
#[test]
fn gemm_multi_equals_gemm_per_job_bitwise() {
    let mut rng = Rng(777);
    // (type, rows, units of cols, which input: 0 shared, 1 its own)
    let sets: [&[(GgmlType, usize, usize, usize)]; 5] = [
        &[
            (GgmlType::F16, 67, 301, 0),
            (GgmlType::F16, 9, 301, 0),
            (GgmlType::F16, 9, 301, 0),
        ],
        // Inputs large enough to be prepared by every thread.
        &[(GgmlType::F16, 21, 4101, 0), (GgmlType::F16, 6, 4101, 0)],
        &[
            (GgmlType::F32, 33, 77, 0),
            (GgmlType::BF16, 5, 77, 1),
            (GgmlType::F16, 260, 77, 0),
        ],
        &[
            (GgmlType::F16, 40, 256, 0),
            (GgmlType::Q4_0, 40, 256, 0),
            (GgmlType::Q8_0, 7, 256, 1),
        ],
        &[(GgmlType::F16, 3, 8, 0), (GgmlType::F32, 1, 5, 1)],
    ];
    for set in sets {
        for n_tokens in [1usize, 2, 5, 13, 30] {
            let cases: Vec<(GgmlType, usize, usize, Case)> = set
                .iter()
                .map(|&(ty, rows, units, _)| {
                    let cols = cols_for(ty, units);
                    (ty, rows, cols, make_case(ty, rows, cols, &mut rng))
                })
                .collect();
            // Inputs by column count: one shared per length, and one of each job's own.
            let shared: Vec<Vec<f32>> = cases
                .iter()
                .map(|(_, _, cols, _)| random_vec(cols * n_tokens, &mut rng))
                .collect();
            let own: Vec<Vec<f32>> = cases
                .iter()
                .map(|(_, _, cols, _)| random_vec(cols * n_tokens, &mut rng))
                .collect();
            let input = |k: usize| -> &[f32] {
                let first_same = (0..k)
                    .find(|&i| set[i].3 == 0 && cases[i].2 == cases[k].2)
                    .unwrap_or(k);
                if set[k].3 == 0 {
                    &shared[first_same]
                } else {
                    &own[k]
                }
            };
            for backend in Backend::available() {
                for threads in [1, 2, 3] {
                    let pool = ThreadPool::new(threads);
                    let mm = MatMul::with_backend(&pool, backend).unwrap();
                    let what = format!("{set:?} {backend} {threads}t T={n_tokens}");
                    let views: Vec<Weights<'_>> = cases
                        .iter()
                        .map(|(ty, rows, cols, c)| {
                            Weights::new(*ty, *rows, *cols, &c.data).unwrap()
                        })
                        .collect();
                    let mut ys: Vec<Vec<f32>> = cases
                        .iter()
                        .map(|(_, rows, _, _)| vec![f32::NAN; rows * n_tokens])
                        .collect();
                    let mut jobs: Vec<GemmJob<'_>> = ys
                        .iter_mut()
                        .enumerate()
                        .map(|(k, y)| GemmJob {
                            w: views[k],
                            x: input(k),
                            y,
                        })
                        .collect();
                    mm.gemm_multi(&mut jobs, n_tokens).unwrap();
                    for (k, y) in ys.iter().enumerate() {
                        let mut alone = vec![f32::NAN; y.len()];
                        mm.gemm(&views[k], input(k), n_tokens, &mut alone).unwrap();
                        assert_eq!(bits(&alone), bits(y), "{what}: job {k}");
                    }
                    // A job whose output is one value short: an error, nothing written.
                    let mut short = vec![7f32; cases[0].1 * n_tokens - 1];
                    let mut fine = vec![7f32; cases[0].1 * n_tokens];
                    let mut bad = [
                        GemmJob {
                            w: views[0],
                            x: input(0),
                            y: &mut fine,
                        },
                        GemmJob {
                            w: views[0],
                            x: input(0),
                            y: &mut short,
                        },
                    ];
                    assert!(mm.gemm_multi(&mut bad, n_tokens).is_err(), "{what}");
                    assert!(
                        fine.iter().all(|&v| v == 7.0),
                        "{what}: written before the check"
                    );
                }
            }
        }
    }
}

/// The sparse kernels on LLaMA-like lengths at ~10% density (the multi-row GEMV over scattered
/// active rows; the axpy, which splits the active rows between threads on AVX-512 for these
/// 2358-byte Q4_0 rows, the columns otherwise): against the reference; the GEMV 1 vs 2 threads
/// bit-identical, the axpy bit-identical when repeated with the same thread count (across
/// thread counts both results meet the reference bound); the active count is not a multiple of
/// 8 (the AVX-512 list kernels' rows per pass), so the last pass is a shorter one.
#[test]
fn sparse_long_rows_low_density() {
    let mut rng = Rng(777);
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16, GgmlType::F32] {
        let (rows, cols) = (203, 4096 + 96);
        let c = make_case(ty, rows, cols, &mut rng);
        let x = random_vec(cols, &mut rng);
        let xq = quantized_acts(ty, &x, cols);
        let active: Vec<u32> = (0..rows as u32).filter(|_| rng.below(10) == 0).collect();
        // Whole passes of the list kernels (8 rows) and a shorter last one.
        let active = if active.len() % 8 == 0 {
            &active[1..]
        } else {
            &active[..]
        };
        let a: Vec<f32> = (0..rows).map(|_| rng.f32()).collect();
        let y0 = random_vec(cols, &mut rng);
        let scores: Vec<f32> = (0..rows)
            .map(|i| {
                if active.contains(&(i as u32)) {
                    1.0
                } else {
                    -1.0
                }
            })
            .collect();
        let want = r::sparse_gemm(&c.w, rows, cols, &xq, 1, &scores, 0.0, None);
        let (tight, _) = product_bounds(ty, &c.abs_w, rows, cols, &x, &xq, 1);
        let want_axpy = r::sparse_axpy(
            &c.w,
            rows,
            cols,
            &r::axpy_coefficients(ty, &a),
            1,
            &scores,
            0.0,
            None,
            &to_f64(&y0),
        );
        let bound: Vec<f64> = (0..cols)
            .map(|col| {
                let s: f64 = active
                    .iter()
                    .map(|&i| (a[i as usize] as f64).abs() * c.abs_w[i as usize * cols + col])
                    .sum();
                // Two more roundings for the per-thread partial sums and their addition.
                (rows + 6) as f64 * U * (s + (y0[col] as f64).abs()) + 1e-30
            })
            .collect();
        let wv = Weights::new(ty, rows, cols, &c.data).unwrap();
        for backend in Backend::available() {
            let mut prev: Option<Vec<f32>> = None;
            for threads in [1, 2] {
                let pool = ThreadPool::new(threads);
                let mm = MatMul::with_backend(&pool, backend).unwrap();
                let what = format!("{ty:?} {backend} {threads}t");
                let mut y = vec![f32::NAN; rows];
                mm.sparse_gemv_indexed(&wv, &x, active, &mut y).unwrap();
                assert_close(&format!("{what} sparse_gemv"), &y, &want, &tight);
                let mut ya = y0.clone();
                mm.sparse_axpy_indexed(&wv, &a, active, &mut ya).unwrap();
                assert_close(&format!("{what} sparse_axpy"), &ya, &want_axpy, &bound);
                let mut again = y0.clone();
                mm.sparse_axpy_indexed(&wv, &a, active, &mut again).unwrap();
                assert_eq!(bits(&again), bits(&ya), "{what}: axpy repeat");
                if let Some(py) = &prev {
                    assert_eq!(bits(py), bits(&y), "{what}: gemv 1 vs 2 threads");
                }
                prev = Some(y);
            }
        }
    }
}

#[test]
fn row_range_views_give_the_same_rows() {
    let mut rng = Rng(91);
    let pool = ThreadPool::single();
    let mm = MatMul::new(&pool);
    for &ty in &[GgmlType::F16, GgmlType::Q4_0, GgmlType::Q8_0] {
        let (rows, cols) = (37, cols_for(ty, 3));
        let data = random_weights(ty, rows, cols, &mut rng);
        let w = Weights::new(ty, rows, cols, &data).unwrap();
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
            .collect();
        let mut full = vec![0f32; rows];
        mm.gemv(&w, &x, &mut full).unwrap();
        for r in [0..0, 0..5, 5..37, 11..12] {
            let v = w.row_range(r.clone()).unwrap();
            assert_eq!((v.rows(), v.cols(), v.ty()), (r.len(), cols, ty));
            let mut part = vec![0f32; r.len()];
            mm.gemv(&v, &x, &mut part).unwrap();
            assert_eq!(bits(&part), bits(&full[r]), "{ty:?}");
        }
        assert!(matches!(w.row_range(30..38), Err(KernelError::Shape(_))));
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 5..4;
        assert!(matches!(w.row_range(reversed), Err(KernelError::Shape(_))));
    }
}

/// `read_rows` (the memory ceiling probe of `powerinfer bench kernels`) returns the wrapping
/// sum of the listed rows' little-endian u64 words (a tail byte by byte) on every backend and
/// thread count, and refuses bad lists like the indexed kernels.
#[test]
fn read_rows_checksums_the_listed_rows() {
    let mut rng = Rng(11);
    for (ty, cols) in [
        (GgmlType::Q4_0, 4096),
        (GgmlType::Q4_0, 96),
        (GgmlType::F16, 4096 + 3),
        (GgmlType::F32, 5),
    ] {
        let rows = 37;
        let data = random_weights(ty, rows, cols, &mut rng);
        let w = Weights::new(ty, rows, cols, &data).unwrap();
        let row_bytes = data.len() / rows;
        let lists: [Vec<u32>; 3] = [
            vec![],
            (0..rows as u32).collect(),
            (0..rows as u32).filter(|i| i % 3 != 1).collect(),
        ];
        for list in &lists {
            let mut want = 0u64;
            for &i in list {
                let row = &data[i as usize * row_bytes..(i as usize + 1) * row_bytes];
                let words = row.len() / 8 * 8;
                for c in row[..words].chunks(8) {
                    want = want.wrapping_add(u64::from_le_bytes(c.try_into().unwrap()));
                }
                for &b in &row[words..] {
                    want = want.wrapping_add(b as u64);
                }
            }
            for pool in pools() {
                for backend in Backend::available() {
                    let mm = MatMul::with_backend(&pool, backend).unwrap();
                    let got = probe::read_rows(&mm, &w, list).unwrap();
                    assert_eq!(
                        got,
                        want,
                        "{ty:?} {cols} cols, {backend:?}, {} rows",
                        list.len()
                    );
                }
            }
        }
        let pool = ThreadPool::new(2);
        let mm = MatMul::new(&pool);
        assert!(matches!(
            probe::read_rows(&mm, &w, &[3, rows as u32]),
            Err(KernelError::IndexOutOfRange { .. })
        ));
        assert!(matches!(
            probe::read_rows(&mm, &w, &[4, 4]),
            Err(KernelError::IndicesNotIncreasing { position: 1, .. })
        ));
    }
}

/// `read_sequential` (the plain half of `powerinfer bench`'s bandwidth probe) returns the
/// wrapping sum of the buffer's little-endian u64 words (a last partial word byte by byte) for
/// any length and thread count: every byte read once, whichever thread reads it.
#[test]
fn read_sequential_checksums_every_byte() {
    let mut rng = Rng(12);
    let data: Vec<u8> = (0..70_001).map(|_| rng.next_u64() as u8).collect();
    for len in [0, 1, 7, 8, 9, 63, 64, 65, 127, 4096, 4096 + 61, 70_001] {
        let bytes = &data[..len];
        let words = len / 8 * 8;
        let mut want = 0u64;
        for c in bytes[..words].chunks(8) {
            want = want.wrapping_add(u64::from_le_bytes(c.try_into().unwrap()));
        }
        for &b in &bytes[words..] {
            want = want.wrapping_add(b as u64);
        }
        for pool in pools() {
            assert_eq!(
                probe::read_sequential(&pool, bytes),
                want,
                "{len} bytes, {} threads",
                pool.n_threads()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// The repacked one-token Q4_0 product equals the GEMV bit for bit (whole groups of eight
    /// rows and a tail, 1 and 3 threads); where no packed kernel exists, `pack_q4_0` says so.
    #[test]
    fn packed_q4_0_equals_gemv_bitwise(rows in 1usize..40, pairs in 1usize..70, seed in any::<u64>()) {
        let mut rng = Rng(seed);
        let cols = 64 * pairs;
        let data = random_weights(GgmlType::Q4_0, rows, cols, &mut rng);
        let w = Weights::new(GgmlType::Q4_0, rows, cols, &data).unwrap();
        let x = random_vec(cols, &mut rng);
        for pool in pools() {
            for backend in Backend::available() {
                let mm = MatMul::with_backend(&pool, backend).unwrap();
                let Some(p) = mm.pack_q4_0(&w) else {
                    prop_assert!(backend != Backend::Avx512, "no packed kernel on {backend:?}");
                    continue;
                };
                prop_assert_eq!((p.rows(), p.cols(), p.bytes()), (rows, cols, data.len()));
                let mut want = vec![0f32; rows];
                mm.gemv(&w, &x, &mut want).unwrap();
                let mut got = vec![f32::NAN; rows];
                mm.gemv_packed(&p, &x, &mut got).unwrap();
                prop_assert_eq!(bits(&got), bits(&want), "{:?}, {} threads", backend, pool.n_threads());
                // Wrong lengths are refused.
                prop_assert!(mm.gemv_packed(&p, &x[1..], &mut got).is_err());
            }
        }
    }
}

/// The repacked product over enough groups of rows that each thread's part is cut into several
/// grains (`GEMV_GRAIN_BYTES`), plus a tail: bit-identical to the GEMV for 1, 2 and 3 threads.
#[test]
fn packed_q4_0_many_grains_equals_gemv() {
    let mut rng = Rng(11);
    let (rows, cols) = (8 * 61 + 5, 2048);
    let data = random_weights(GgmlType::Q4_0, rows, cols, &mut rng);
    let w = Weights::new(GgmlType::Q4_0, rows, cols, &data).unwrap();
    let x = random_vec(cols, &mut rng);
    for threads in [1usize, 2, 3] {
        let pool = ThreadPool::new(threads);
        let mm = MatMul::new(&pool);
        let Some(p) = mm.pack_q4_0(&w) else {
            assert_ne!(mm.backend(), Backend::Avx512, "no packed kernel on AVX-512");
            eprintln!("skipped: no packed Q4_0 kernel on {:?}", mm.backend());
            return;
        };
        let mut want = vec![0f32; rows];
        mm.gemv(&w, &x, &mut want).unwrap();
        let mut got = vec![f32::NAN; rows];
        mm.gemv_packed(&p, &x, &mut got).unwrap();
        assert_eq!(bits(&got), bits(&want), "{threads} threads");
        // A clone is an independent copy of the packed storage with the same results.
        let copy = p.clone();
        drop(p);
        let mut again = vec![f32::NAN; rows];
        mm.gemv_packed(&copy, &x, &mut again).unwrap();
        assert_eq!(bits(&again), bits(&want), "{threads} threads, clone");
    }
}

/// `gemv_packed_multi`: several repacked products in one dispatch (Q, K and V shapes: rows
/// that are and are not whole groups of eight, two activations, one shared) give each job the
/// bits of `gemv` on its matrix alone, for 1, 2 and 3 threads; `has_packed_q4_0` says whether
/// copies are made; a wrong length in any job is refused before anything is written.
#[test]
fn packed_q4_0_multi_equals_gemv() {
    let mut rng = Rng(12);
    let cols = 1024;
    let shapes = [8 * 40, 8 * 5 + 3, 8 * 5 + 3, 7];
    let data: Vec<Vec<u8>> = shapes
        .iter()
        .map(|&r| random_weights(GgmlType::Q4_0, r, cols, &mut rng))
        .collect();
    let ws: Vec<Weights<'_>> = shapes
        .iter()
        .zip(&data)
        .map(|(&r, d)| Weights::new(GgmlType::Q4_0, r, cols, d).unwrap())
        .collect();
    let (xa, xb) = (random_vec(cols, &mut rng), random_vec(cols, &mut rng));
    let xs = [&xa, &xa, &xa, &xb];
    for threads in [1usize, 2, 3] {
        let pool = ThreadPool::new(threads);
        let mm = MatMul::new(&pool);
        let packed: Vec<_> = ws.iter().map(|w| mm.pack_q4_0(w)).collect();
        assert_eq!(
            packed.iter().all(Option::is_some),
            mm.has_packed_q4_0(),
            "{:?}",
            mm.backend()
        );
        if !mm.has_packed_q4_0() {
            eprintln!("skipped: no packed Q4_0 kernel on {:?}", mm.backend());
            return;
        }
        let want: Vec<Vec<f32>> = ws
            .iter()
            .zip(xs)
            .map(|(w, x)| {
                let mut y = vec![0f32; w.rows()];
                mm.gemv(w, x, &mut y).unwrap();
                y
            })
            .collect();
        let mut got: Vec<Vec<f32>> = shapes.iter().map(|&r| vec![f32::NAN; r]).collect();
        let mut jobs: Vec<PackedGemvJob<'_>> = packed
            .iter()
            .zip(xs)
            .zip(got.iter_mut())
            .map(|((p, x), y)| PackedGemvJob {
                w: p.as_ref().unwrap(),
                x,
                y,
            })
            .collect();
        mm.gemv_packed_multi(&mut jobs).unwrap();
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w), "job {k}, {threads} threads");
        }
        // A short output in the last job: refused, and the first job's output untouched.
        let mut y0 = vec![f32::NAN; shapes[0]];
        let mut y3 = vec![0f32; shapes[3] - 1];
        let mut bad = [
            PackedGemvJob {
                w: packed[0].as_ref().unwrap(),
                x: &xa,
                y: &mut y0,
            },
            PackedGemvJob {
                w: packed[3].as_ref().unwrap(),
                x: &xb,
                y: &mut y3,
            },
        ];
        assert!(mm.gemv_packed_multi(&mut bad).is_err());
        assert!(y0.iter().all(|v| v.is_nan()));
    }
}

/// `pack_q4_0` declines other types and rows of an odd number of blocks.
#[test]
fn pack_q4_0_declines_what_it_cannot_pack() {
    let mut rng = Rng(3);
    let pool = ThreadPool::new(2);
    let mm = MatMul::new(&pool);
    let odd = random_weights(GgmlType::Q4_0, 9, 96, &mut rng);
    assert!(mm
        .pack_q4_0(&Weights::new(GgmlType::Q4_0, 9, 96, &odd).unwrap())
        .is_none());
    let q8 = random_weights(GgmlType::Q8_0, 9, 128, &mut rng);
    assert!(mm
        .pack_q4_0(&Weights::new(GgmlType::Q8_0, 9, 128, &q8).unwrap())
        .is_none());
}

/// One-token products over long quantized rows (which AVX-512 routes through its dense range
/// kernel or the sparse list kernel over every row): bit-identical to the AVX2 GEMV, to the
/// sparse product over every row, and across thread counts; within the bound of the reference.
/// Q4_0 with an even and an odd block count, Q8_0 and the K-quants, rows just below, just
/// above and far above the routing length (1024 bytes), and enough rows for several grains per
/// thread (the prefetch stream running on into the next grain).
#[test]
fn long_quantized_rows_gemv() {
    let mut rng = Rng(4242);
    for (ty, cols, rows) in [
        (GgmlType::Q4_0, 16384 + 64, 19),
        (GgmlType::Q4_0, 11008 + 32, 19),
        (GgmlType::Q4_0, 1792, 19),
        (GgmlType::Q4_0, 1856, 19),
        (GgmlType::Q4_0, 2048, 700),
        (GgmlType::Q8_0, 960, 19),
        (GgmlType::Q8_0, 1024, 19),
        (GgmlType::Q8_0, 4096 + 32, 19),
        (GgmlType::Q8_0, 11008, 19),
        // K-quants: rows just below (840, 704 bytes) and above (1050) the routing length, the
        // 7B shapes' 4096 and 11008 columns, and many grains per thread.
        (GgmlType::Q6_K, 1024, 19),
        (GgmlType::Q6_K, 1280, 19),
        (GgmlType::Q6_K, 11008, 19),
        (GgmlType::Q5_K, 1024, 19),
        (GgmlType::Q5_K, 4096 + 256, 19),
        (GgmlType::Q4_K, 4096, 19),
        (GgmlType::Q4_K, 11008, 19),
        (GgmlType::Q4_K, 2048, 700),
        (GgmlType::Q3_K, 4096, 19),
        (GgmlType::Q2_K, 11008, 19),
    ] {
        let c = make_case(ty, rows, cols, &mut rng);
        let w = Weights::new(ty, rows, cols, &c.data).unwrap();
        let x = random_vec(cols, &mut rng);
        let xq = quantized_acts(ty, &x, cols);
        let want = r::gemm(&c.w, rows, cols, &xq, 1);
        let (tight, _) = product_bounds(ty, &c.abs_w, rows, cols, &x, &xq, 1);
        let mut first: Option<Vec<u32>> = None;
        for backend in Backend::available() {
            for threads in [1usize, 2, 3] {
                let pool = ThreadPool::new(threads);
                let mm = MatMul::with_backend(&pool, backend).unwrap();
                let mut y = vec![0f32; rows];
                mm.gemv(&w, &x, &mut y).unwrap();
                let what = format!("{ty:?} {cols} {backend:?} {threads}");
                assert_close(&what, &y, &want, &tight);
                if backend == Backend::Scalar || backend == Backend::Neon {
                    continue;
                }
                let all: Vec<u32> = (0..rows as u32).collect();
                let mut ys = vec![0f32; rows];
                mm.sparse_gemv_indexed(&w, &x, &all, &mut ys).unwrap();
                assert_eq!(bits(&y), bits(&ys), "{ty:?} {cols} {backend:?} {threads}");
                match &first {
                    None => first = Some(bits(&y)),
                    Some(f) => assert_eq!(f, &bits(&y), "{ty:?} {cols} {backend:?} {threads}"),
                }
            }
        }
    }
}

/// Several products in one dispatch (`gemv_multi`, also what `gemv` runs): bit-identical to
/// one `gemv` per matrix and across thread counts, for jobs of different types, long and short
/// rows, many grains per thread (so threads take each other's grains), and an empty job; a bad
/// job fails the call before any output is written.
#[test]
fn gemv_multi_equals_separate_products() {
    let mut rng = Rng(77);
    let shapes = [
        (GgmlType::F16, 203, 1024),
        (GgmlType::Q4_0, 301, 2048),
        (GgmlType::Q8_0, 0, 64),
        (GgmlType::Q8_0, 45, 4096 + 32),
        (GgmlType::Q4_K, 70, 512),
        (GgmlType::F32, 9, 33),
    ];
    // (type, rows, cols, weight bytes, activation)
    type Job = (GgmlType, usize, usize, Vec<u8>, Vec<f32>);
    let cases: Vec<Job> = shapes
        .iter()
        .map(|&(ty, rows, cols)| {
            let data = random_weights(ty, rows, cols, &mut rng);
            let x = random_vec(cols, &mut rng);
            (ty, rows, cols, data, x)
        })
        .collect();
    let weights: Vec<Weights<'_>> = cases
        .iter()
        .map(|(ty, rows, cols, data, _)| Weights::new(*ty, *rows, *cols, data).unwrap())
        .collect();
    for backend in Backend::available() {
        let mut first: Option<Vec<Vec<u32>>> = None;
        for threads in [1usize, 2, 3] {
            let pool = ThreadPool::new(threads);
            let mm = MatMul::with_backend(&pool, backend).unwrap();
            let mut outs: Vec<Vec<f32>> = cases.iter().map(|c| vec![f32::NAN; c.1]).collect();
            let mut jobs: Vec<GemvJob<'_>> = weights
                .iter()
                .zip(&cases)
                .zip(outs.iter_mut())
                .map(|((w, c), y)| GemvJob { w: *w, x: &c.4, y })
                .collect();
            mm.gemv_multi(&mut jobs).unwrap();
            let got: Vec<Vec<u32>> = outs.iter().map(|y| bits(y)).collect();
            for (k, (w, c)) in weights.iter().zip(&cases).enumerate() {
                let mut y = vec![0f32; c.1];
                mm.gemv(w, &c.4, &mut y).unwrap();
                assert_eq!(
                    got[k],
                    bits(&y),
                    "{backend:?} {threads}t job {k} ({:?})",
                    c.0
                );
            }
            match &first {
                None => first = Some(got.clone()),
                Some(f) => assert_eq!(f, &got, "{backend:?}: {threads} threads vs 1"),
            }
            // Two matrices reading the same activation (prepared once): the same results as
            // separate products.
            let (w1, x1) = (weights[1], &cases[1].4);
            let w1b = Weights::new(GgmlType::Q4_0, 7, cases[1].2, &cases[1].3[..7 * 1152]).unwrap();
            let (mut ya, mut yb) = (vec![0f32; w1.rows()], vec![0f32; 7]);
            mm.gemv_multi(&mut [
                GemvJob {
                    w: w1,
                    x: x1,
                    y: &mut ya,
                },
                GemvJob {
                    w: w1b,
                    x: x1,
                    y: &mut yb,
                },
            ])
            .unwrap();
            assert_eq!(
                bits(&ya),
                got[1],
                "{backend:?} {threads}t shared activation"
            );
            assert_eq!(
                bits(&yb),
                got[1][..7].to_vec(),
                "{backend:?} {threads}t shared"
            );
            // A job whose output has the wrong length: an error, and no job computed.
            let mut y0 = vec![f32::NAN; cases[0].1];
            let mut bad = vec![0f32; cases[1].1 + 1];
            let r = mm.gemv_multi(&mut [
                GemvJob {
                    w: weights[0],
                    x: &cases[0].4,
                    y: &mut y0,
                },
                GemvJob {
                    w: weights[1],
                    x: &cases[1].4,
                    y: &mut bad,
                },
            ]);
            assert!(matches!(r, Err(KernelError::Length { .. })), "{r:?}");
            assert!(y0.iter().all(|v| v.is_nan()));
        }
    }
}

/// GEMMs over rows long enough that each thread's part is several row blocks, which threads
/// may take from one another (`ThreadPool::for_grains`): bit-identical for 1, 2 and 3 threads,
/// and for the quantized types equal to the per-token GEMV bit for bit.
#[test]
fn gemm_with_many_row_blocks_is_thread_count_independent() {
    let mut rng = Rng(99);
    // Enough tokens for the blocked AVX-512 GEMMs of every type here (Q8_0 from 6).
    let n_tokens = 7;
    for (ty, rows, cols) in [
        (GgmlType::F16, 150, 8192),
        (GgmlType::Q8_0, 150, 8192),
        (GgmlType::Q4_0, 150, 8192),
    ] {
        let data = random_weights(ty, rows, cols, &mut rng);
        let w = Weights::new(ty, rows, cols, &data).unwrap();
        let x = random_vec(cols * n_tokens, &mut rng);
        for backend in Backend::available() {
            let mut first: Option<Vec<u32>> = None;
            for threads in [1usize, 2, 3] {
                let pool = ThreadPool::new(threads);
                let mm = MatMul::with_backend(&pool, backend).unwrap();
                let mut y = vec![f32::NAN; rows * n_tokens];
                mm.gemm(&w, &x, n_tokens, &mut y).unwrap();
                let what = format!("{ty:?} {backend:?} {threads}t");
                match &first {
                    None => first = Some(bits(&y)),
                    Some(f) => assert_eq!(f, &bits(&y), "{what}"),
                }
                if ty != GgmlType::F16 {
                    for t in 0..n_tokens {
                        let mut yt = vec![0f32; rows];
                        mm.gemv(&w, &x[t * cols..(t + 1) * cols], &mut yt).unwrap();
                        assert_eq!(bits(&yt), bits(&y[t * rows..(t + 1) * rows]), "{what} t{t}");
                    }
                }
            }
        }
    }
}

/// The sparse axpy with int8 coefficients ([`AxpyCoefficients::Int8`]) against the exact sum:
/// within its stated bound, `max|c| / 254 · Σ_k |q_k − 8|` per element and block (`c_k = a_k·d_k`,
/// the largest over every listed row, which bounds each pass's), plus f32 roundings; on
/// both of the frame's paths (column split and, from 2048-byte rows with several threads,
/// row split) and with rows that fill no whole pass. Backends without the int8 kernel run the
/// float one, which meets the bound too.
#[test]
fn int8_axpy_within_its_bound() {
    let mut rng = Rng(0x1A7);
    for case in 0..60 {
        let rows = 1 + rng.below(40);
        let blocks = if case % 3 == 0 {
            64 + rng.below(80)
        } else {
            1 + rng.below(12)
        };
        let cols = 32 * blocks;
        let data = random_weights(GgmlType::Q4_0, rows, cols, &mut rng);
        let w = r::dequantize(GgmlType::Q4_0, &data).unwrap();
        let a: Vec<f32> = random_vec(rows, &mut rng)
            .into_iter()
            .map(|v| if rng.below(4) == 0 { 0.0 } else { v * 4.0 })
            .collect();
        let active: Vec<u32> = (0..rows as u32).filter(|_| rng.below(3) != 0).collect();
        let y0 = random_vec(cols, &mut rng);
        let wv = Weights::new(GgmlType::Q4_0, rows, cols, &data).unwrap();
        // Scales and nibbles straight from the bytes.
        let d = |i: usize, b: usize| {
            let o = (i * blocks + b) * 18;
            half::f16::from_le_bytes([data[o], data[o + 1]]).to_f64()
        };
        let q = |i: usize, j: usize| {
            let (b, e) = (j / 32, j % 32);
            let byte = data[(i * blocks + b) * 18 + 2 + e % 16];
            (if e < 16 { byte & 15 } else { byte >> 4 }) as f64 - 8.0
        };
        let mut want = vec![0f64; cols];
        let mut bound = vec![0f64; cols];
        for (j, (wj, bj)) in want.iter_mut().zip(&mut bound).enumerate() {
            let b = j / 32;
            let cmax = active
                .iter()
                .map(|&i| (a[i as usize] as f64 * d(i as usize, b)).abs())
                .fold(0.0, f64::max);
            let (mut sum, mut abs_sum, mut qs) = (y0[j] as f64, y0[j].abs() as f64, 0.0);
            for &i in &active {
                let i = i as usize;
                let t = a[i] as f64 * w[i * cols + j];
                sum += t;
                abs_sum += t.abs();
                qs += q(i, j).abs();
            }
            *wj = sum;
            // Coefficient rounding, then f32 roundings (one per pass and per partial sum,
            // at most `rows + 4` of them, each ≤ 2^-24 of the running magnitudes).
            *bj = cmax / 254.0 * qs * (1.0 + 1e-6)
                + abs_sum * (rows + 4) as f64 * 2f64.powi(-23)
                + cmax * qs * 2f64.powi(-22);
        }
        for backend in Backend::available() {
            for pool in pools() {
                let mm = MatMul::with_backend(&pool, backend)
                    .unwrap()
                    .with_axpy(AxpyCoefficients::Int8);
                assert_eq!(mm.axpy_mode(), AxpyCoefficients::Int8);
                let mut y = y0.clone();
                mm.sparse_axpy_indexed(&wv, &a, &active, &mut y).unwrap();
                for j in 0..cols {
                    let err = (y[j] as f64 - want[j]).abs();
                    assert!(
                        err <= bound[j],
                        "case {case} {backend} {}t {rows}x{cols} col {j}: {} vs {} (err {err:e} > {:e})",
                        pool.n_threads(),
                        y[j],
                        want[j],
                        bound[j]
                    );
                }
            }
        }
    }
}
