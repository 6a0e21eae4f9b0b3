//! The GPU-index file: PowerInfer's exact layout on write, validation on read.

use powerinfer_gguf::gpuidx::{BLOCK_COUNT_KEY, VRAM_CAPACITY_KEY};
use powerinfer_gguf::{
    FileKind, GgmlType, GgufError, GgufFile, GgufWriter, GpuIndex, LayerGpuIndex, Metadata, Value,
};

fn sample() -> GpuIndex {
    let mut extra = Metadata::new();
    extra.insert("powerinfer.placement.budget", Value::U64(123));
    extra.insert(
        "powerinfer.placement.stats_digest",
        Value::String("abc".into()),
    );
    GpuIndex {
        layers: vec![
            LayerGpuIndex::new(8, vec![1, 3, 7]).unwrap(),
            LayerGpuIndex::new(8, vec![]).unwrap(),
            LayerGpuIndex::from_mask(&[true; 8]).unwrap(),
        ],
        vram_capacity: 1 << 33,
        extra,
    }
}

#[test]
fn writes_powerinfer_layout_and_reads_back() {
    let idx = sample();
    let bytes = idx.write(Vec::new()).unwrap();
    assert_eq!(&bytes[..8], b"PWRI\x03\x00\x00\x00");
    let f = GgufFile::from_bytes(bytes.as_slice()).unwrap();
    assert_eq!(f.kind(), FileKind::PowerInfer);
    let keys: Vec<&str> = f.metadata().iter().map(|(k, _)| k).collect();
    assert_eq!(
        keys,
        [
            "general.architecture",
            BLOCK_COUNT_KEY,
            VRAM_CAPACITY_KEY,
            "powerinfer.placement.budget",
            "powerinfer.placement.stats_digest"
        ]
    );
    assert_eq!(f.metadata().get(BLOCK_COUNT_KEY), Some(&Value::U32(3)));
    assert_eq!(
        f.metadata().get(VRAM_CAPACITY_KEY),
        Some(&Value::U64(1 << 33))
    );
    // Tensor order gpu_idx(0), gpu_bucket(0), ... with PowerInfer's I32 id 18.
    let names: Vec<&str> = f.tensors().iter().map(|t| t.name()).collect();
    assert_eq!(
        names,
        [
            "blk.0.gpu_idx",
            "blk.0.gpu_bucket",
            "blk.1.gpu_idx",
            "blk.1.gpu_bucket",
            "blk.2.gpu_idx",
            "blk.2.gpu_bucket"
        ]
    );
    for t in f.tensors() {
        assert_eq!(t.type_id(), 18);
        assert_eq!(t.ggml_type(), GgmlType::I32);
    }
    assert_eq!(f.tensor_info("blk.1.gpu_bucket").unwrap().shape(), [0]);
    assert_eq!(
        f.tensor_data("blk.0.gpu_idx").unwrap(),
        bytemuck::cast_slice::<i32, u8>(&[0, 1, 0, 1, 0, 0, 0, 1])
    );
    assert_eq!(
        f.tensor_data("blk.0.gpu_bucket").unwrap(),
        bytemuck::cast_slice::<i32, u8>(&[1, 3, 7])
    );
    assert_eq!(GpuIndex::from_gguf(&f).unwrap(), idx);

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.generated.gpuidx");
    idx.write_to_path(&path).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
    assert_eq!(GpuIndex::open(&path).unwrap(), idx);
}

/// Writes a GPU-index file from raw parts (tensors as i32 vectors, any order, any type id).
fn raw_index(n_layers: u32, tensors: &[(&str, Vec<i32>)], ty: GgmlType) -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new(), FileKind::PowerInfer);
    w.add_kv(
        "general.architecture",
        Value::String("generic.gpu_index".into()),
    )
    .unwrap();
    w.add_kv(BLOCK_COUNT_KEY, Value::U32(n_layers)).unwrap();
    w.add_kv(VRAM_CAPACITY_KEY, Value::U64(5)).unwrap();
    for (name, v) in tensors {
        w.add_tensor(name, &[v.len() as u64], ty).unwrap();
    }
    for (name, v) in tensors {
        w.write_tensor_data(name, bytemuck::cast_slice(v)).unwrap();
    }
    w.finish().unwrap()
}

fn read(bytes: &[u8]) -> Result<GpuIndex, GgufError> {
    GpuIndex::from_gguf(&GgufFile::from_bytes(bytes)?)
}

#[test]
fn reads_todays_i32_id_and_any_tensor_order() {
    let bytes = raw_index(
        2,
        &[
            ("blk.1.gpu_bucket", vec![0]),
            ("blk.0.gpu_idx", vec![0, 0, 1]),
            ("blk.1.gpu_idx", vec![1, 0]),
            ("blk.0.gpu_bucket", vec![2]),
        ],
        GgmlType::I32,
    );
    let idx = read(&bytes).unwrap();
    assert_eq!(idx.layers[0].bucket(), [2]);
    assert_eq!(idx.layers[0].n_ff(), 3);
    assert_eq!(idx.layers[1].bucket(), [0]);
    assert_eq!(idx.layers[1].gpu_idx(), [1, 0]);
    assert_eq!(idx.vram_capacity, 5);
    assert!(idx.extra.is_empty());
}

#[test]
fn rejects_inconsistent_indexes() {
    let bad = |tensors: &[(&str, Vec<i32>)]| {
        let e = read(&raw_index(1, tensors, GgmlType::I32)).unwrap_err();
        assert!(
            matches!(e, GgufError::GpuIndex(_) | GgufError::TensorNotFound { .. }),
            "{e}"
        );
        e.to_string()
    };
    assert!(
        bad(&[("blk.0.gpu_idx", vec![0, 2]), ("blk.0.gpu_bucket", vec![1])]).contains("0 or 1")
    );
    assert!(bad(&[
        ("blk.0.gpu_idx", vec![1, 1]),
        ("blk.0.gpu_bucket", vec![1, 0])
    ])
    .contains("ascending"));
    assert!(bad(&[
        ("blk.0.gpu_idx", vec![1, 1]),
        ("blk.0.gpu_bucket", vec![1, 1])
    ])
    .contains("ascending"));
    assert!(bad(&[("blk.0.gpu_idx", vec![0, 1]), ("blk.0.gpu_bucket", vec![2])]).contains("n_ff"));
    assert!(
        bad(&[("blk.0.gpu_idx", vec![0, 1]), ("blk.0.gpu_bucket", vec![0])]).contains("exactly")
    );
    assert!(
        bad(&[("blk.0.gpu_idx", vec![1, 1]), ("blk.0.gpu_bucket", vec![0])]).contains("exactly")
    );
    assert!(bad(&[
        ("blk.0.gpu_idx", vec![1, 0]),
        ("blk.0.gpu_bucket", vec![-1])
    ])
    .contains("negative"));
    bad(&[("blk.0.gpu_idx", vec![1, 0]), ("blk.1.gpu_bucket", vec![0])]);
    assert!(bad(&[("blk.0.gpu_idx", vec![1, 0])]).contains("tensors"));
    // Wrong element type.
    let e = read(&raw_index(
        1,
        &[("blk.0.gpu_idx", vec![0]), ("blk.0.gpu_bucket", vec![])],
        GgmlType::F32,
    ));
    assert!(matches!(e, Err(GgufError::GpuIndex(m)) if m.contains("expected I32")));
    // Not a GPU index at all.
    let mut w = GgufWriter::new(Vec::new(), FileKind::Gguf);
    w.add_kv("general.architecture", Value::String("llama".into()))
        .unwrap();
    assert!(matches!(
        read(&w.finish().unwrap()),
        Err(GgufError::GpuIndex(_))
    ));
    // Extra metadata must not shadow the standard keys.
    let mut idx = sample();
    idx.extra.insert(VRAM_CAPACITY_KEY, Value::U64(1));
    assert!(matches!(idx.write(Vec::new()), Err(GgufError::GpuIndex(_))));
    assert!(LayerGpuIndex::new(4, vec![4]).is_err());
    assert!(LayerGpuIndex::new(4, vec![2, 1]).is_err());
}
