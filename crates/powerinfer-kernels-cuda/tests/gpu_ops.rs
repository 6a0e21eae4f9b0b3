//! Every operator against the f64 references of `powerinfer-kernels-cpu` on random data with odd
//! sizes and tails, empty buckets, all neurons and none. Without a GPU each test prints
//! "skipped: no GPU (reason)" and passes.

mod common;

use common::{assert_close, gpu, random_bucket, random_weight, Rng};
use half::f16;
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::reference::{matmul as rm, ops as ro};
use powerinfer_kernels_cuda::{
    Binary, CudaError, DeviceTensor, Gpu, GpuSlice, LayerKv, NoGpu, RopeMode, Stream, Unary,
};
use proptest::prelude::*;

const TYPES: [GgmlType; 4] = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0];

fn cols_for(ty: GgmlType, raw: usize) -> usize {
    if ty.block_size() > 1 {
        32 * (1 + raw % 12)
    } else {
        1 + raw % 300
    }
}

/// Σ_c |w[r, c] · x[t, c]| for each (t, r): the scale of the products' rounding error.
fn abs_gemm(w: &[f64], rows: usize, cols: usize, x: &[f64], t: usize) -> Vec<f64> {
    let wa: Vec<f64> = w.iter().map(|v| v.abs()).collect();
    let xa: Vec<f64> = x.iter().map(|v| v.abs()).collect();
    rm::gemm(&wa, rows, cols, &xa, t)
}

/// A random `rows × cols` weight of type `ty` times `t` random tokens on the device, against
/// the f64 reference of the activation the kernels multiply.
fn check_dense_matmul(gpu: &Gpu, ty: GgmlType, rows: usize, cols: usize, t: usize, seed: u64) {
    check_dense_matmul_on(gpu, gpu.stream(), ty, rows, cols, t, seed, 1);
}

/// [`check_dense_matmul`] on stream `s`, with the product computed `reps` times in a row.
#[allow(clippy::too_many_arguments)]
fn check_dense_matmul_on(
    gpu: &Gpu,
    s: &Stream,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    t: usize,
    seed: u64,
    reps: usize,
) {
    let mut rng = Rng::new(seed);
    let (bytes, w) = random_weight(&mut rng, ty, rows, cols);
    let x = rng.vec(t * cols);
    let wd = DeviceTensor::upload(gpu, s, ty, rows, cols, &bytes).unwrap();
    let xd = gpu.upload(s, &x).unwrap();
    let mut y = gpu.alloc_zeros::<f32>(s, t * rows).unwrap();
    for _ in 0..reps {
        gpu.matmul(s, &wd, &xd, t, &mut y).unwrap();
    }
    let got = y.to_host(s).unwrap();
    // Q8_0/Q4_0 products multiply the activation quantized as the CPU kernels quantize it.
    let x64 = gpu_activation(ty, &x);
    assert_close(
        &format!("matmul {ty} {rows}x{cols} T={t}"),
        &got,
        &rm::gemm(&w, rows, cols, &x64, t),
        &abs_gemm(&w, rows, cols, &x64, t),
    );
}

/// The activation values the GPU products multiply, those the CPU kernels multiply: for
/// Q8_0/Q4_0 weights `x` quantized per block, for F16 weights `x` rounded to f16 (as ggml's CPU
/// backend does), for F32 weights `x` itself.
fn gpu_activation(ty: GgmlType, x: &[f32]) -> Vec<f64> {
    rm::quantize_activation(ty, x)
}

#[test]
fn detect_never_panics_and_explains() {
    match powerinfer_kernels_cuda::Gpu::detect() {
        Ok(g) => assert!(g.info().compute_capability.0 >= 8),
        Err(e) => {
            if !powerinfer_kernels_cuda::driver_present() {
                assert_eq!(e, NoGpu::NoDriver);
            }
            assert!(!e.to_string().is_empty());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn dense_matmul_matches_reference(ti in 0usize..4, rows in 1usize..150, raw_cols in 0usize..400, t in prop_oneof![1usize..20, 60usize..140], seed in any::<u64>()) {
        let Some(gpu) = gpu() else { return Ok(()); };
        let ty = TYPES[ti];
        let cols = cols_for(ty, raw_cols);
        check_dense_matmul(gpu, ty, rows, cols, t, seed);
    }

    #[test]
    fn dense_matmul_long_rows_match_reference(ti in 0usize..4, rows in 1usize..40, raw in 0usize..12000, vec8 in any::<bool>(), tm in 0usize..4, seed in any::<u64>()) {
        // Rows long enough for the unrolled main loops (and their alignment cases), one token
        // (matmul_*_t1) and several.
        let Some(gpu) = gpu() else { return Ok(()); };
        let ty = TYPES[ti];
        let cols = if ty.block_size() > 1 { 32 * (1 + raw % 400) } else if vec8 { 8 * (1 + raw % 1500) } else { 1 + raw };
        let t = [1, 1, 2, 9][tm];
        check_dense_matmul(gpu, ty, rows, cols, t, seed);
    }

    #[test]
    fn sparse_matmul_writes_bucket_rows_only(ti in 0usize..4, n in 1usize..80, raw_cols in 0usize..400, t in prop_oneof![1usize..12, 60usize..80], mode in 0u8..4, theta_mode in 0u8..3, seed in any::<u64>()) {
        let Some(gpu) = gpu() else { return Ok(()); };
        let ty = TYPES[ti];
        let cols = cols_for(ty, raw_cols);
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, cols);
        let bucket = random_bucket(&mut rng, n, mode);
        let x = rng.vec(t * cols);
        let scores = rng.vec(t * n);
        // theta: every neuron predicted active, none, or about half.
        let theta = [-2.0f32, 2.0, 0.0][theta_mode as usize];
        let s = gpu.stream();
        let slice = GpuSlice::upload(gpu, s, ty, cols, &bytes, n, &bucket).unwrap();
        let xd = gpu.upload(s, &x).unwrap();
        let pd = gpu.upload(s, &scores).unwrap();
        // Garbage in dst must be overwritten: the operator zeroes it.
        let mut y = gpu.upload(s, &vec![7.0f32; t * n]).unwrap();
        gpu.sparse_matmul(s, &slice, &xd, &pd, theta, t, &mut y).unwrap();
        let got = y.to_host(s).unwrap();
        let mut skip = vec![true; n];
        for &b in &bucket { skip[b as usize] = false; }
        // Q8_0/Q4_0 products multiply the activation quantized as the CPU kernels quantize it.
        let x64 = gpu_activation(ty, &x);
        let want = rm::sparse_gemm(&w, n, cols, &x64, t, &scores, theta, Some(&skip));
        assert_close(&format!("sparse_matmul {ty} n={n} cols={cols} T={t} k={}", bucket.len()), &got, &want, &abs_gemm(&w, n, cols, &x64, t));
    }

    #[test]
    fn sparse_matmul_long_rows_few_active(ti in 0usize..4, n in 1usize..300, raw in 0usize..12800, active in 0usize..12, t in 1usize..3, seed in any::<u64>()) {
        // The decode case for which matmul_*_t1 spreads a block's few active rows over all its
        // warps: long rows (K up to 12800), all neurons in the bucket, few predicted active.
        let Some(gpu) = gpu() else { return Ok(()); };
        let ty = TYPES[ti];
        let cols = if ty.block_size() > 1 { 32 * (1 + raw % 400) } else { 1 + raw };
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, cols);
        let bucket = random_bucket(&mut rng, n, 1);
        let x = rng.vec(t * cols);
        let mut scores = vec![-1.0f32; t * n];
        for _ in 0..active {
            scores[rng.below(t * n)] = 1.0;
        }
        let s = gpu.stream();
        let slice = GpuSlice::upload(gpu, s, ty, cols, &bytes, n, &bucket).unwrap();
        let xd = gpu.upload(s, &x).unwrap();
        let pd = gpu.upload(s, &scores).unwrap();
        let mut y = gpu.upload(s, &vec![7.0f32; t * n]).unwrap();
        gpu.sparse_matmul(s, &slice, &xd, &pd, 0.0, t, &mut y).unwrap();
        let got = y.to_host(s).unwrap();
        let x64 = gpu_activation(ty, &x);
        let want = rm::sparse_gemm(&w, n, cols, &x64, t, &scores, 0.0, None);
        assert_close(&format!("sparse_matmul {ty} n={n} cols={cols} T={t} active={active}"), &got, &want, &abs_gemm(&w, n, cols, &x64, t));

        // The fused gated products (SwiGLU over this matrix as gate and a second one as up)
        // against the separate products and activation.
        let (bytes_u, wu) = random_weight(&mut rng, ty, n, cols);
        let up = GpuSlice::upload(gpu, s, ty, cols, &bytes_u, n, &bucket).unwrap();
        let mut gsep = gpu.upload(s, &vec![7.0f32; t * n]).unwrap();
        let mut usep = gpu.upload(s, &vec![7.0f32; t * n]).unwrap();
        gpu.sparse_matmul(s, &slice, &xd, &pd, 0.0, t, &mut gsep).unwrap();
        gpu.sparse_matmul(s, &up, &xd, &pd, 0.0, t, &mut usep).unwrap();
        let mut sep = gpu.alloc_zeros::<f32>(s, t * n).unwrap();
        gpu.binary(s, Binary::SiluGate, &gsep, &usep, &mut sep).unwrap();
        let mut fused = gpu.upload(s, &vec![7.0f32; t * n]).unwrap();
        let mut count = gpu.alloc_zeros::<f32>(s, t).unwrap();
        gpu.gated_matmul(s, &slice, &up, &xd, &pd, 0.0, t, powerinfer_kernels_cuda::Gate::Silu, Some((&mut count).into()), &mut fused).unwrap();
        let want_count: Vec<f32> = (0..t).map(|tok| bucket.iter().filter(|&&r| scores[tok * n + r as usize] >= 0.0).count() as f32).collect();
        prop_assert_eq!(count.to_host(s).unwrap(), want_count);
        // The activation's error from its operands': their bounds (abs_gemm) times the other.
        let (gs, us) = (gsep.to_host(s).unwrap(), usep.to_host(s).unwrap());
        let (ag, au) = (abs_gemm(&w, n, cols, &x64, t), abs_gemm(&wu, n, cols, &x64, t));
        let scale: Vec<f64> = (0..t * n)
            .map(|i| 2.0 * (us[i].abs() as f64 + au[i]) * ag[i] + 2.0 * (gs[i].abs() as f64 + ag[i]) * au[i])
            .collect();
        let want: Vec<f64> = sep.to_host(s).unwrap().iter().map(|&v| v as f64).collect();
        assert_close(&format!("gated_matmul {ty} n={n} cols={cols} T={t} active={active}"), &fused.to_host(s).unwrap(), &want, &scale);
    }

    #[test]
    fn sparse_axpy_matches_reference(ti in 0usize..4, n in 1usize..300, raw_m in 0usize..400, t in 1usize..20, mode in 0u8..4, theta_mode in 0u8..4, seed in any::<u64>()) {
        let Some(gpu) = gpu() else { return Ok(()); };
        let ty = TYPES[ti];
        let m = cols_for(ty, raw_m);
        let mut rng = Rng::new(seed);
        let (bytes, w) = random_weight(&mut rng, ty, n, m);
        let bucket = random_bucket(&mut rng, n, mode);
        // ReLU-like activations: about a third exactly zero.
        let a: Vec<f32> = (0..t * n).map(|_| rng.uniform(-0.5, 1.0).max(0.0)).collect();
        let scores = rng.vec(t * n);
        let s = gpu.stream();
        let slice = GpuSlice::upload(gpu, s, ty, m, &bytes, n, &bucket).unwrap();
        let ad = gpu.upload(s, &a).unwrap();
        let pd = gpu.upload(s, &scores).unwrap();
        let mut y = gpu.upload(s, &vec![3.0f32; t * m]).unwrap();
        // theta_mode 3: no predictor (every row of the slice, dense fallback semantics).
        let (theta, p, ref_scores) = match theta_mode {
            3 => (0.0f32, None, vec![1.0f32; t * n]),
            k => ([-2.0f32, 2.0, 0.0][k as usize], Some((&pd).into()), scores.clone()),
        };
        gpu.sparse_axpy(s, &slice, &ad, p, theta, t, &mut y).unwrap();
        let got = y.to_host(s).unwrap();
        let mut skip = vec![true; n];
        for &b in &bucket { skip[b as usize] = false; }
        let a64: Vec<f64> = a.iter().map(|&v| v as f64).collect();
        let want = rm::sparse_axpy(&w, n, m, &a64, t, &ref_scores, theta, Some(&skip), &vec![0.0; t * m]);
        let wa: Vec<f64> = w.iter().map(|v| v.abs()).collect();
        let scale = rm::sparse_axpy(&wa, n, m, &a64, t, &vec![1.0; t * n], 0.0, None, &vec![0.0; t * m]);
        assert_close(&format!("sparse_axpy {ty} n={n} m={m} T={t} k={}", bucket.len()), &got, &want, &scale);

        // Added to what the output holds (the residual) instead of written over it.
        let base = rng.vec(t * m);
        let mut y = gpu.upload(s, &base).unwrap();
        let p = (theta_mode != 3).then(|| (&pd).into());
        gpu.sparse_axpy_add(s, &slice, &ad, p, theta, t, &mut y).unwrap();
        let base64: Vec<f64> = base.iter().map(|&v| v as f64).collect();
        let want = rm::sparse_axpy(&w, n, m, &a64, t, &ref_scores, theta, Some(&skip), &base64);
        let scale: Vec<f64> = scale.iter().zip(&base64).map(|(s, b)| s + b.abs()).collect();
        assert_close(&format!("sparse_axpy_add {ty} n={n} m={m} T={t}"), &y.to_host(s).unwrap(), &want, &scale);
    }

    #[test]
    fn norms_softmax_elementwise_match_reference(rows in 1usize..9, n in 1usize..700, seed in any::<u64>()) {
        let Some(gpu) = gpu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let s = gpu.stream();
        let x = rng.vec(rows * n);
        let w = rng.vec(n);
        let (xd, wd) = (gpu.upload(s, &x).unwrap(), gpu.upload(s, &w).unwrap());
        let mut y = gpu.alloc_zeros::<f32>(s, rows * n).unwrap();
        gpu.rms_norm(s, &xd, Some((&wd).into()), 1e-5, rows, n, &mut y).unwrap();
        let want = ro::rms_norm(&x, &w, 1e-5);
        let scale: Vec<f64> = want.iter().map(|v| 10.0 * v.abs()).collect();
        assert_close("rms_norm", &y.to_host(s).unwrap(), &want, &scale);

        let bias = rng.vec(n);
        let bd = gpu.upload(s, &bias).unwrap();
        gpu.layer_norm(s, &xd, Some((&wd).into()), Some((&bd).into()), 1e-5, rows, n, &mut y).unwrap();
        let want = ro::layer_norm(&x, &w, &bias, 1e-5);
        let scale: Vec<f64> = want.iter().map(|v| 10.0 * v.abs() + 10.0).collect();
        assert_close("layer_norm", &y.to_host(s).unwrap(), &want, &scale);

        // The residual add and the norm in one launch: bit for bit the add and then the norm.
        let ad = gpu.upload(s, &rng.vec(rows * n)).unwrap();
        let mut sum = gpu.alloc_zeros::<f32>(s, rows * n).unwrap();
        gpu.binary(s, Binary::Add, &xd, &ad, &mut sum).unwrap();
        for layer in [false, true] {
            let mut sep = gpu.alloc_zeros::<f32>(s, rows * n).unwrap();
            let mut xf = gpu.upload(s, &x).unwrap();
            if layer {
                gpu.layer_norm(s, &sum, Some((&wd).into()), Some((&bd).into()), 1e-5, rows, n, &mut sep).unwrap();
                gpu.add_layer_norm(s, &mut xf, &ad, Some((&wd).into()), Some((&bd).into()), 1e-5, rows, n, &mut y).unwrap();
            } else {
                gpu.rms_norm(s, &sum, Some((&wd).into()), 1e-5, rows, n, &mut sep).unwrap();
                gpu.add_rms_norm(s, &mut xf, &ad, Some((&wd).into()), 1e-5, rows, n, &mut y).unwrap();
            }
            let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(xf.to_host(s).unwrap()), bits(sum.to_host(s).unwrap()));
            prop_assert_eq!(bits(y.to_host(s).unwrap()), bits(sep.to_host(s).unwrap()));
        }

        let mut sx = x.clone();
        if rows > 1 { for v in &mut sx[..n] { *v = f32::NEG_INFINITY; } }
        let mut sd = gpu.upload(s, &sx).unwrap();
        gpu.softmax(s, &mut sd, rows, n, 3.0).unwrap();
        let want: Vec<f64> = sx.chunks(n).flat_map(|r| ro::softmax(r, 3.0)).collect();
        assert_close("softmax", &sd.to_host(s).unwrap(), &want, &vec![10.0; want.len()]);

        let (gd, ud) = (gpu.upload(s, &x).unwrap(), gpu.upload(s, &x.iter().rev().copied().collect::<Vec<_>>()).unwrap());
        let u: Vec<f32> = x.iter().rev().copied().collect();
        for relu_u in [false, true] {
            let op = if relu_u { Binary::DreluGate } else { Binary::ReluGate };
            gpu.binary(s, op, &gd, &ud, &mut y).unwrap();
            let want: Vec<f64> = x.iter().zip(&u).map(|(&g, &u)| ro::relu(g as f64) * if relu_u { ro::relu(u as f64) } else { u as f64 }).collect();
            assert_close("relu_gate", &y.to_host(s).unwrap(), &want, &vec![0.0; want.len()]);
        }
        gpu.binary(s, Binary::Add, &gd, &ud, &mut y).unwrap();
        let want: Vec<f64> = x.iter().zip(&u).map(|(&a, &b)| (a + b) as f64).collect();
        assert_close("add", &y.to_host(s).unwrap(), &want, &vec![0.0; want.len()]);
        gpu.unary(s, Unary::Relu, &gd, &mut y).unwrap();
        let want: Vec<f64> = x.iter().map(|&a| ro::relu(a as f64)).collect();
        assert_close("relu", &y.to_host(s).unwrap(), &want, &vec![0.0; want.len()]);
    }

    #[test]
    fn rope_matches_reference(t in 1usize..5, n_head in 1usize..6, half_dim in 1usize..40, rot_cut in 0usize..3, neox in any::<bool>(), seed in any::<u64>()) {
        let Some(gpu) = gpu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let head_dim = 2 * half_dim;
        let n_rot = 2 * (half_dim - (rot_cut.min(half_dim - 1)));
        let x = rng.vec(t * n_head * head_dim);
        let pos: Vec<i32> = (0..t).map(|_| rng.below(2048) as i32).collect();
        let s = gpu.stream();
        let mut xd = gpu.upload(s, &x).unwrap();
        let pd = gpu.upload(s, &pos).unwrap();
        let mode = if neox { RopeMode::Neox } else { RopeMode::Normal };
        gpu.rope(s, &mut xd, &pd, t, n_head, head_dim, n_rot, 10000.0, 1.0, mode).unwrap();
        let cpu_mode = if neox { powerinfer_kernels_cpu::ops::rope::RopeMode::NeoX } else { powerinfer_kernels_cpu::ops::rope::RopeMode::Normal };
        let per = n_head * head_dim;
        // The CPU kernel's angles: the same f32 operations, cos and sin within their rounding.
        let params = powerinfer_kernels_cpu::ops::rope::RopeParams { n_dims: n_rot, mode: cpu_mode, freq_base: 10000.0, freq_scale: 1.0 };
        let mut cpu = x.clone();
        for (i, tok) in cpu.chunks_exact_mut(per).enumerate() {
            powerinfer_kernels_cpu::ops::rope::rope(tok, n_head, head_dim, pos[i] as usize, &params).unwrap();
        }
        let want: Vec<f64> = cpu.iter().map(|&v| v as f64).collect();
        assert_close("rope", &xd.to_host(s).unwrap(), &want, &vec![0.05; want.len()]);

        // Q and K in one launch: bit for bit rope on each.
        let n_kv = n_head.saturating_sub(1).max(1);
        let k = rng.vec(t * n_kv * head_dim);
        let (mut qd, mut kd) = (gpu.upload(s, &x).unwrap(), gpu.upload(s, &k).unwrap());
        gpu.rope_qk(s, &mut qd, &mut kd, &pd, t, (n_head, n_kv), head_dim, n_rot, 10000.0, 1.0, mode).unwrap();
        let mut k1 = gpu.upload(s, &k).unwrap();
        gpu.rope(s, &mut k1, &pd, t, n_kv, head_dim, n_rot, 10000.0, 1.0, mode).unwrap();
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(qd.to_host(s).unwrap()), bits(xd.to_host(s).unwrap()));
        prop_assert_eq!(bits(kd.to_host(s).unwrap()), bits(k1.to_host(s).unwrap()));
    }

    #[test]
    fn kv_store_and_causal_attention_match_reference(n_kv in 1usize..4, group in 1usize..4, head_dim in 1usize..130, len in 1usize..300, tq in 1usize..5, batch in 1usize..9, seed in any::<u64>()) {
        let Some(gpu) = gpu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let n_head = n_kv * group;
        let row = n_kv * head_dim;
        let tq = tq.min(len);
        let s = gpu.stream();
        let mut cache = LayerKv::new(gpu, s, len + 3, n_kv, head_dim).unwrap();
        let (k, v) = (rng.vec(len * row), rng.vec(len * row));
        // Store in batches of `batch` tokens (the last one shorter).
        let mut pos = 0;
        while pos < len {
            let t = batch.min(len - pos);
            let kd = gpu.upload(s, &k[pos * row..(pos + t) * row]).unwrap();
            let vd = gpu.upload(s, &v[pos * row..(pos + t) * row]).unwrap();
            let at: Vec<i32> = (pos..pos + t).map(|p| p as i32).collect();
            let pd = gpu.upload(s, &at).unwrap();
            gpu.kv_store(s, &mut cache, &kd, &vd, &pd, t).unwrap();
            pos += t;
        }
        let ks: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
        let vs: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let (kh, vh) = cache.to_host(s).unwrap();
        prop_assert_eq!(&kh[..len * row], &ks.iter().map(|h| h.to_bits()).collect::<Vec<_>>()[..]);
        prop_assert_eq!(&vh[..len * row], &vs.iter().map(|h| h.to_bits()).collect::<Vec<_>>()[..]);
        prop_assert!(kh[len * row..].iter().all(|&b| b == 0));
        let q = rng.vec(tq * n_head * head_dim);
        let qd = gpu.upload(s, &q).unwrap();
        let mut out = gpu.alloc_zeros::<f32>(s, tq * n_head * head_dim).unwrap();
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut scratch = gpu.alloc_zeros::<f32>(s, tq * n_head * (len + 3)).unwrap();
        // The queries are the last tq of the len stored positions.
        let at: Vec<i32> = (len - tq..len).map(|p| p as i32).collect();
        let pd = gpu.upload(s, &at).unwrap();
        gpu.attention(s, &qd, &cache, n_head, &pd, tq, scale, &mut out, &mut scratch).unwrap();
        let want = ro::attention_block(&q, &ks, &vs, tq, n_head, n_kv, head_dim, scale as f64);
        assert_close("attention", &out.to_host(s).unwrap(), &want, &vec![10.0; want.len()]);
    }

    #[test]
    fn predictor_mask_and_active_list_match_reference(d in 1usize..200, hidden in 1usize..64, n in 1usize..3000, t in 1usize..4, theta_mode in 0u8..3, seed in any::<u64>()) {
        let Some(gpu) = gpu() else { return Ok(()); };
        let mut rng = Rng::new(seed);
        let ty = if seed % 2 == 0 { GgmlType::F32 } else { GgmlType::F16 };
        let (b1, w1) = random_weight(&mut rng, ty, hidden, d);
        let (b2, w2) = random_weight(&mut rng, ty, n, hidden);
        let h = rng.vec(t * d);
        let s = gpu.stream();
        let fc1 = DeviceTensor::upload(gpu, s, ty, hidden, d, &b1).unwrap();
        let fc2 = DeviceTensor::upload(gpu, s, ty, n, hidden, &b2).unwrap();
        let hd = gpu.upload(s, &h).unwrap();
        let mut scores = gpu.alloc_zeros::<f32>(s, t * n).unwrap();
        let mut mask = gpu.alloc_zeros::<u8>(s, t * n).unwrap();
        let theta = [-1e30f32, 1e30, 0.0][theta_mode as usize];
        let mut hid = gpu.alloc_zeros::<f32>(s, t * hidden).unwrap();
        gpu.predictor(s, &fc1, &fc2, &hd, t, &mut hid, &mut scores).unwrap();
        gpu.threshold_mask(s, &scores, theta, &mut mask).unwrap();
        // Both products multiply their activation as the CPU kernels do (f16-rounded for F16).
        let h64 = gpu_activation(ty, &h);
        let mid32: Vec<f32> = rm::gemm(&w1, hidden, d, &h64, t).into_iter().map(|v| ro::relu(v) as f32).collect();
        let mid = gpu_activation(ty, &mid32);
        let want = rm::gemm(&w2, n, hidden, &mid, t);
        let mid_abs: Vec<f64> = abs_gemm(&w1, hidden, d, &h64, t);
        let scale = abs_gemm(&w2, n, hidden, &mid_abs, t);
        let got = scores.to_host(s).unwrap();
        assert_close("predictor scores", &got, &want, &scale);
        let m = mask.to_host(s).unwrap();
        for i in 0..t * n {
            prop_assert_eq!(m[i] == 1, got[i] >= theta, "mask[{}]", i);
        }
        let first = gpu.upload(s, &got[..n]).unwrap();
        let mut idx = gpu.alloc_zeros::<u32>(s, n).unwrap();
        let mut count = gpu.alloc_zeros::<u32>(s, 1).unwrap();
        gpu.active_list(s, &first, theta, &mut idx, &mut count).unwrap();
        let c = count.to_host(s).unwrap()[0] as usize;
        let want_idx: Vec<u32> = (0..n as u32).filter(|&i| got[i as usize] >= theta).collect();
        prop_assert_eq!(&idx.to_host(s).unwrap()[..c], &want_idx[..]);
    }
}

#[test]
fn a_one_stream_gpu_refuses_streams_and_computes_the_same() {
    // Buffers without cudarc's cross-stream events: the products (the tensor-core kernel for
    // 70 tokens, the one-token kernel) as on a GPU opened for several streams.
    let Some(_) = gpu() else { return };
    let one = powerinfer_kernels_cuda::Gpu::open_one_stream(0, None).unwrap();
    assert!(one.new_stream().is_err());
    for (ty, t) in [
        (GgmlType::Q4_0, 70),
        (GgmlType::F16, 70),
        (GgmlType::Q8_0, 1),
    ] {
        check_dense_matmul(&one, ty, 150, 4096, t, 7);
    }
    // Copies to and from pinned memory are waited for by the buffer's own event: a read right
    // after queuing the copy behind long work sees the result, and a write waits for the copy
    // that reads the buffer.
    let s = one.stream();
    let n = 32 << 20;
    let ones = one.upload(s, &vec![1.0f32; n]).unwrap();
    let mut acc = one.alloc_zeros::<f32>(s, n).unwrap();
    for _ in 0..8 {
        one.unary(s, Unary::Accumulate, &ones, &mut acc).unwrap();
    }
    let mut pinned = one.alloc_pinned::<f32>(n).unwrap();
    acc.copy_to_pinned(s, &mut pinned).unwrap();
    let got = pinned.as_slice().unwrap();
    assert!(
        got.iter().all(|&v| v == 8.0),
        "read before the copy ended: {}",
        got[n - 1]
    );
    let mut back = one.alloc_zeros::<f32>(s, n).unwrap();
    back.copy_from_pinned(s, &pinned).unwrap();
    pinned.as_mut_slice().unwrap().fill(3.0);
    assert!(
        back.to_host(s).unwrap().iter().all(|&v| v == 8.0),
        "written during the copy"
    );
}

#[test]
fn a_norm_that_converts_for_its_products_matches_the_separate_launches() {
    // norm_matmuls: the norm writes the products' converted activation in its own launch; the
    // norm's output and every product bit for bit as a norm followed by matmuls.
    let Some(gpu) = gpu() else { return };
    let s = gpu.stream();
    let mut rng = Rng::new(5);
    for (ty, layer, rows) in [
        (GgmlType::Q4_0, false, 1),
        (GgmlType::Q8_0, true, 3),
        (GgmlType::F16, false, 70),
        (GgmlType::F32, true, 2),
    ] {
        let n = 256;
        let x = gpu.upload(s, &rng.vec(rows * n)).unwrap();
        let w = gpu.upload(s, &rng.vec(n)).unwrap();
        let b = gpu.upload(s, &rng.vec(n)).unwrap();
        let mats: Vec<DeviceTensor> = [96usize, 32]
            .iter()
            .map(|&r| {
                let (bytes, _) = random_weight(&mut rng, ty, r, n);
                DeviceTensor::upload(gpu, s, ty, r, n, &bytes).unwrap()
            })
            .collect();
        let bias = layer.then(|| (&b).into());
        let mut y_sep = gpu.alloc_zeros::<f32>(s, rows * n).unwrap();
        if layer {
            gpu.layer_norm(
                s,
                &x,
                Some((&w).into()),
                Some((&b).into()),
                1e-5,
                rows,
                n,
                &mut y_sep,
            )
            .unwrap();
        } else {
            gpu.rms_norm(s, &x, Some((&w).into()), 1e-5, rows, n, &mut y_sep)
                .unwrap();
        }
        let mut sep: Vec<_> = mats
            .iter()
            .map(|m| gpu.alloc_zeros::<f32>(s, rows * m.rows()).unwrap())
            .collect();
        for (m, o) in mats.iter().zip(&mut sep) {
            gpu.matmul(s, m, &y_sep, rows, o).unwrap();
        }
        let mut y = gpu.alloc_zeros::<f32>(s, rows * n).unwrap();
        let mut outs: Vec<_> = mats
            .iter()
            .map(|m| gpu.alloc_zeros::<f32>(s, rows * m.rows()).unwrap())
            .collect();
        let products = mats
            .iter()
            .zip(&mut outs)
            .map(|(w, o)| powerinfer_kernels_cuda::Product::Dense { w, dst: o.into() })
            .collect();
        gpu.norm_matmuls(
            s,
            &x,
            Some((&w).into()),
            bias,
            1e-5,
            rows,
            n,
            &mut y,
            products,
        )
        .unwrap();
        let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(y.to_host(s).unwrap()),
            bits(y_sep.to_host(s).unwrap()),
            "{ty} norm"
        );
        for (a, b) in outs.iter().zip(&sep) {
            assert_eq!(
                bits(a.to_host(s).unwrap()),
                bits(b.to_host(s).unwrap()),
                "{ty} product"
            );
        }
    }
}

#[test]
fn budget_refuses_and_leaks_nothing_on_the_device() {
    let Some(_) = gpu() else { return };
    let gpu = powerinfer_kernels_cuda::Gpu::open(0, Some(4096)).unwrap();
    let s = gpu.stream();
    let a = gpu.alloc_zeros::<f32>(s, 512).unwrap();
    assert_eq!(gpu.budget().used(), 2048);
    let err = gpu.alloc_zeros::<f32>(s, 513).unwrap_err();
    assert!(matches!(err, CudaError::Budget(_)), "{err:?}");
    assert_eq!(gpu.budget().used(), 2048);
    let bytes = vec![0u8; 4096];
    assert!(matches!(
        DeviceTensor::upload(&gpu, s, GgmlType::F32, 32, 32, &bytes),
        Err(CudaError::Budget(_))
    ));
    assert_eq!(gpu.budget().used(), 2048);
    drop(a);
    assert_eq!(gpu.budget().used(), 0);
    let _b = gpu.alloc_zeros::<f32>(s, 1024).unwrap();
    assert_eq!(gpu.budget().used(), 4096);
}

#[test]
fn quantized_activation_matches_the_cpu_quantizer() {
    // A Q8_0 identity matrix (scale 1, one quantum of 1 per row): output (t, c) is exactly the
    // quantized activation d · q of column c, up to the f32 rounding of the product, so one
    // quantum of difference from the CPU's quantizer (d) fails.
    let Some(gpu) = gpu() else { return };
    let s = gpu.stream();
    let mut rng = Rng::new(11);
    for cols in [32usize, 1056, 4096] {
        let rb = cols / 32 * 34;
        let mut bytes = vec![0u8; cols * rb];
        for r in 0..cols {
            let row = &mut bytes[r * rb..(r + 1) * rb];
            for b in 0..cols / 32 {
                row[b * 34..b * 34 + 2]
                    .copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
            }
            row[r / 32 * 34 + 2 + r % 32] = 1;
        }
        let wd = DeviceTensor::upload(gpu, s, GgmlType::Q8_0, cols, cols, &bytes).unwrap();
        for t in [1usize, 3] {
            let mut x = rng.vec(t * cols);
            x[0] = 0.0;
            if cols > 32 {
                // A zero block and a block whose values sit half-way between quanta.
                x[32..64].iter_mut().for_each(|v| *v = 0.0);
                x[64] = 127.0;
                x[65] = 0.5;
                x[66] = -2.5;
            }
            let xd = gpu.upload(s, &x).unwrap();
            let mut y = gpu.alloc_zeros::<f32>(s, t * cols).unwrap();
            gpu.matmul(s, &wd, &xd, t, &mut y).unwrap();
            let got = y.to_host(s).unwrap();
            let want = rm::quantize_activation(GgmlType::Q8_0, &x);
            for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g as f64 - w).abs() <= w.abs() * 2f64.powi(-23),
                    "K={cols} T={t} [{i}]: got {g}, want {w}"
                );
            }
        }
    }
}

#[test]
fn operators_reject_bad_shapes_without_launching() {
    let Some(gpu) = gpu() else { return };
    let s = gpu.stream();
    let w = DeviceTensor::upload(gpu, s, GgmlType::F32, 2, 3, &[0u8; 24]).unwrap();
    let x = gpu.alloc_zeros::<f32>(s, 5).unwrap();
    let mut y = gpu.alloc_zeros::<f32>(s, 2).unwrap();
    assert!(matches!(
        gpu.matmul(s, &w, &x, 1, &mut y),
        Err(CudaError::Length { what: "x", .. })
    ));
    assert!(matches!(
        GpuSlice::upload(gpu, s, GgmlType::F32, 3, &[0u8; 24], 2, &[1, 1]),
        Err(CudaError::Index { .. })
    ));
    assert!(matches!(
        DeviceTensor::upload(gpu, s, GgmlType::Q4_0, 1, 48, &[0u8; 27]),
        Err(CudaError::Shape(_))
    ));
}

#[test]
fn pinned_buffers_round_trip_on_a_second_stream() {
    let Some(gpu) = gpu() else { return };
    let copy = gpu.new_stream().unwrap();
    let mut pin = gpu.alloc_pinned::<f32>(1000).unwrap();
    for (i, v) in pin.as_mut_slice().unwrap().iter_mut().enumerate() {
        *v = i as f32;
    }
    let mut d = gpu.alloc_zeros::<f32>(&copy, 1000).unwrap();
    d.copy_from_pinned(&copy, &pin).unwrap();
    let compute = gpu.stream();
    compute.wait_for(&copy).unwrap();
    let mut y = gpu.alloc_zeros::<f32>(compute, 1000).unwrap();
    gpu.unary(compute, Unary::Relu, &d, &mut y).unwrap();
    let mut back = gpu.alloc_pinned::<f32>(1000).unwrap();
    y.copy_to_pinned(compute, &mut back).unwrap();
    compute.synchronize().unwrap();
    let got = back.as_slice().unwrap();
    assert!(got.iter().enumerate().all(|(i, &v)| v == i as f32));
}

/// A captured program replays what it captured on the buffers' current contents: relu then
/// an add, captured once (nothing runs while capturing), launched for two inputs.
#[test]
fn a_captured_graph_replays_on_new_contents() {
    let Some(gpu) = gpu() else { return };
    let s = gpu.stream();
    let n = 3000;
    let mut x = gpu.alloc_zeros::<f32>(s, n).unwrap();
    let b = gpu.upload(s, &vec![0.5f32; n]).unwrap();
    let mut r = gpu.alloc_zeros::<f32>(s, n).unwrap();
    let mut y = gpu.alloc_zeros::<f32>(s, n).unwrap();
    s.synchronize().unwrap();
    let graph = s
        .capture(|| -> Result<(), CudaError> {
            gpu.unary(s, Unary::Relu, &x, &mut r)?;
            gpu.binary(s, Binary::Add, &r, &b, &mut y)
        })
        .unwrap();
    // Captured, not run.
    assert!(y.to_host(s).unwrap().iter().all(|&v| v == 0.0));
    for k in [1.0f32, -3.0] {
        let xs: Vec<f32> = (0..n).map(|i| k * (i as f32 - 1000.0)).collect();
        x.copy_from(s, &xs).unwrap();
        graph.launch().unwrap();
        let got = y.to_host(s).unwrap();
        for (i, (&g, &xv)) in got.iter().zip(&xs).enumerate() {
            assert_eq!(g, xv.max(0.0) + 0.5, "value {i} for k {k}");
        }
    }
}

#[test]
fn quantized_products_reuse_the_scratch_across_sizes_streams_and_threads() {
    // The quantized activation lives in a scratch buffer cached per stream: products of
    // growing and shrinking sizes, on two streams and from two host threads sharing a stream,
    // must each read their own activation.
    let Some(gpu) = gpu() else { return };
    let s2 = gpu.new_stream().unwrap();
    let run = |s: &Stream, ty: GgmlType, rows: usize, cols: usize, t: usize, seed: u64| {
        check_dense_matmul_on(gpu, s, ty, rows, cols, t, seed, 3)
    };
    for (i, (cols, t)) in [(64usize, 1usize), (12800, 1), (96, 3), (4096, 5), (32, 1)]
        .into_iter()
        .enumerate()
    {
        run(gpu.stream(), GgmlType::Q4_0, 37, cols, t, i as u64);
        run(&s2, GgmlType::Q8_0, 19, cols, t, 100 + i as u64);
    }
    std::thread::scope(|sc| {
        for k in 0..2u64 {
            let run = &run;
            sc.spawn(move || {
                for i in 0..4 {
                    let (ty, cols) = if k == 0 {
                        (GgmlType::Q4_0, 4096)
                    } else {
                        (GgmlType::Q8_0, 2048 + 32 * i)
                    };
                    run(gpu.stream(), ty, 24, cols, 1 + (i & 1), 1000 * k + i as u64);
                }
            });
        }
    });
}
