//! VRAM accounting on a small hand-built PowerInfer file, and the never-over-budget invariant.

use powerinfer_gguf::{FileKind, GgmlType, GgufFile, GgufWriter, Value};
use powerinfer_placement::{solve, DenseClass, DenseTensor, ModelShape, Problem, VramBudget};
use proptest::prelude::*;

/// A 2-layer LLaMA-style sparse file: n_embd 64, 4 heads, 2 KV heads, n_ff 128, FFN up/gate
/// Q4_0, down_t F16, everything else F16/F32.
fn tiny_model() -> GgufFile<Vec<u8>> {
    let (e, ff, vocab) = (64u64, 128u64, 100u64);
    let mut tensors: Vec<(String, Vec<u64>, GgmlType)> =
        vec![("token_embd.weight".into(), vec![e, vocab], GgmlType::F16)];
    for l in 0..2 {
        let t = |n: &str, s: Vec<u64>, ty| (format!("blk.{l}.{n}"), s, ty);
        tensors.extend([
            t("attn_norm.weight", vec![e], GgmlType::F32),
            t("attn_q.weight", vec![e, e], GgmlType::F16),
            t("attn_k.weight", vec![e, 32], GgmlType::F16),
            t("attn_v.weight", vec![e, 32], GgmlType::F16),
            t("attn_output.weight", vec![e, e], GgmlType::F16),
            t("ffn_norm.weight", vec![e], GgmlType::F32),
            t("ffn_gate.weight", vec![e, ff], GgmlType::Q4_0),
            t("ffn_up.weight", vec![e, ff], GgmlType::Q4_0),
            t("ffn_down_t.weight", vec![e, ff], GgmlType::F16),
            t("fc1.weight", vec![e, 16], GgmlType::F16),
            t("fc2.weight", vec![16, ff], GgmlType::F16),
        ]);
    }
    tensors.push(("output_norm.weight".into(), vec![e], GgmlType::F32));
    tensors.push(("output.weight".into(), vec![e, vocab], GgmlType::F16));
    let mut w = GgufWriter::new(Vec::new(), FileKind::PowerInfer);
    w.add_kv("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add_kv("llama.block_count", Value::U32(2)).unwrap();
    w.add_kv("llama.embedding_length", Value::U32(e as u32))
        .unwrap();
    w.add_kv("llama.feed_forward_length", Value::U32(ff as u32))
        .unwrap();
    w.add_kv("llama.attention.head_count", Value::U32(4))
        .unwrap();
    w.add_kv("llama.attention.head_count_kv", Value::U32(2))
        .unwrap();
    for (n, s, ty) in &tensors {
        w.add_tensor(n, s, *ty).unwrap();
    }
    for (n, s, ty) in &tensors {
        let bytes = ty.bytes_for(s.iter().product()).unwrap();
        w.write_tensor_data(n, &vec![0u8; bytes as usize]).unwrap();
    }
    GgufFile::from_bytes(w.finish().unwrap()).unwrap()
}

#[test]
fn accounting_of_a_small_file() {
    let b = VramBudget::from_gguf(&tiny_model()).unwrap();
    assert_eq!(b.shape.n_layer, 2);
    assert_eq!(b.shape.n_embd_gqa, 32);
    assert_eq!(b.shape.n_ff, [128, 128]);
    // Q4_0 row of 64: 2 blocks of 18 bytes, twice (up, gate); F16 down_t row: 128 bytes.
    assert_eq!(b.shape.neuron_bytes, [36 + 36 + 128, 200]);
    let names: Vec<&str> = b.dense.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "blk.0.attn_norm.weight",
            "blk.0.attn_q.weight",
            "blk.0.attn_k.weight",
            "blk.0.attn_v.weight",
            "blk.0.attn_output.weight",
            "blk.1.attn_norm.weight",
            "blk.1.attn_q.weight",
            "blk.1.attn_k.weight",
            "blk.1.attn_v.weight",
            "blk.1.attn_output.weight",
            "blk.0.fc1.weight",
            "blk.0.fc2.weight",
            "blk.1.fc1.weight",
            "blk.1.fc2.weight",
            "blk.0.ffn_norm.weight",
            "blk.1.ffn_norm.weight",
            "output_norm.weight",
            "output.weight",
        ]
    );
    // Attention per layer: 256 + 8192 + 4096 + 4096 + 8192; predictor: 2048 + 4096;
    // ffn_norm 256; output 256 + 12800.
    let attn = 256 + 8192 + 4096 + 4096 + 8192;
    let dense_total = 2 * attn + 2 * (2048 + 4096) + 2 * 256 + 256 + 12800;
    assert_eq!(b.dense.iter().map(|t| t.bytes).sum::<u64>(), dense_total);
    // KV: 2 (K, V) · 2 layers · 512 tokens · 32 · 2 bytes.
    assert_eq!(b.kv_bytes(512), 2 * 2 * 512 * 32 * 2);

    // Enough for everything.
    let p = b.plan(1 << 20, 512, 1000);
    assert!(p.dense_complete);
    assert_eq!(p.dense_gpu_bytes, dense_total);
    assert_eq!(p.kv_gpu_bytes, b.kv_bytes(512));
    assert_eq!(p.scratch_bytes, 1000);
    assert_eq!(
        p.ffn_budget_bytes,
        (1 << 20) - dense_total - b.kv_bytes(512) - 1000
    );

    // Stops at the first dense tensor that does not fit: layer 0's attention and layer 1's
    // attn_norm fit, layer 1's attn_q does not; no KV, no FFN.
    let p = b.plan(attn + 256 + 8000, 512, 0);
    assert!(!p.dense_complete);
    assert_eq!(p.dense_gpu_count, 6);
    assert_eq!(p.dense_gpu_bytes, attn + 256);
    assert_eq!((p.kv_gpu_bytes, p.ffn_budget_bytes), (0, 0));

    // Dense complete, one KV chunk (V) fits, scratch too.
    let chunk = b.kv_bytes(512) / 2;
    let p = b.plan(dense_total + chunk + 10 + 5, 512, 10);
    assert_eq!(p.kv_gpu_bytes, chunk);
    assert_eq!(p.ffn_budget_bytes, 5);
}

#[test]
fn rejects_files_without_sparse_ffn() {
    let mut w = GgufWriter::new(Vec::new(), FileKind::Gguf);
    w.add_kv("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add_kv("llama.block_count", Value::U32(1)).unwrap();
    w.add_kv("llama.embedding_length", Value::U32(64)).unwrap();
    w.add_kv("llama.attention.head_count", Value::U32(4))
        .unwrap();
    w.add_tensor("blk.0.ffn_up.weight", &[64, 32], GgmlType::F32)
        .unwrap();
    w.add_tensor("blk.0.ffn_down.weight", &[32, 64], GgmlType::F32)
        .unwrap();
    w.write_tensor_data("blk.0.ffn_up.weight", &[0u8; 64 * 32 * 4])
        .unwrap();
    w.write_tensor_data("blk.0.ffn_down.weight", &[0u8; 64 * 32 * 4])
        .unwrap();
    let f = GgufFile::from_bytes(w.finish().unwrap()).unwrap();
    let e = VramBudget::from_gguf(&f).unwrap_err().to_string();
    assert!(e.contains("ffn_down_t"), "{e}");
    // It has its ffn_up: the message says what the file is instead.
    assert!(e.contains("a dense GGUF file"), "{e}");
    assert!(!e.contains("ffn_up"), "{e}");
}

fn class_strategy() -> impl Strategy<Value = DenseClass> {
    prop_oneof![
        Just(DenseClass::Attention),
        Just(DenseClass::Predictor),
        Just(DenseClass::FfnNorm),
        Just(DenseClass::Output),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Whatever the shapes and budget: dense + KV + scratch + chosen FFN rows <= budget, the
    /// dense tensors on the GPU are a prefix of the priority order, and it stopped only where
    /// the next tensor did not fit.
    #[test]
    fn never_over_budget(
        layers in prop::collection::vec((1usize..6, 1u64..5000), 1..6),
        dense in prop::collection::vec((class_strategy(), 0usize..6, 0u64..100_000), 0..20),
        n_embd_gqa in 1u64..512,
        n_ctx in 0u64..4096,
        scratch in 0u64..100_000,
        budget in 0u64..20_000_000,
        group_mul in 1usize..4,
        seed in any::<u64>(),
    ) {
        let n_ff: Vec<usize> = layers.iter().map(|&(g, _)| g * 32).collect();
        let neuron_bytes: Vec<u64> = layers.iter().map(|&(_, b)| b).collect();
        let shape = ModelShape {
            n_layer: layers.len(),
            n_embd: 64,
            n_embd_gqa,
            n_ff: n_ff.clone(),
            neuron_bytes: neuron_bytes.clone(),
        };
        let dense: Vec<DenseTensor> = dense
            .iter()
            .enumerate()
            .map(|(i, &(class, layer, bytes))| DenseTensor {
                name: format!("t{i}"),
                class,
                layer: (class != DenseClass::Output).then_some(layer),
                bytes,
            })
            .collect();
        let b = VramBudget::new(shape, dense).unwrap();
        prop_assert!(b.dense.windows(2).all(|w| (w[0].class, w[0].layer) <= (w[1].class, w[1].layer)));
        let plan = b.plan(budget, n_ctx, scratch);
        let placed: u64 = b.dense[..plan.dense_gpu_count].iter().map(|t| t.bytes).sum();
        prop_assert_eq!(placed, plan.dense_gpu_bytes);
        if let Some(next) = b.dense.get(plan.dense_gpu_count) {
            prop_assert!(next.bytes > budget - placed);
        }
        let mut x = seed;
        let stats: Vec<Vec<f32>> = n_ff.iter().map(|&n| (0..n).map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 40) as f32) / (1u64 << 24) as f32
        }).collect()).collect();
        let sol = solve(&Problem {
            stats: &stats,
            neuron_bytes: &neuron_bytes,
            budget_bytes: plan.ffn_budget_bytes,
            group: 32 * group_mul,
            min_neurons: 0,
            cap_neurons: None,
        }).unwrap();
        let total = plan.dense_gpu_bytes + plan.kv_gpu_bytes + plan.scratch_bytes + sol.split.ffn_bytes;
        prop_assert!(total <= budget, "{} > {}", total, budget);
        prop_assert_eq!(plan.left_after(sol.split.ffn_bytes), budget - total);
    }
}
