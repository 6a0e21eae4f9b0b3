//! Split models: parts opened as one tensor directory.

mod common;

use powerinfer_gguf::split::{parse_split_name, split_path, SplitModel};
use powerinfer_gguf::{FileKind, GgmlType, GgufError, GgufWriter, Value};
use std::path::Path;

fn write_part(path: &Path, no: u16, count: u16, total: i32, tensors: &[(&str, f32)]) {
    let mut w = GgufWriter::create(path, FileKind::Gguf).unwrap();
    if no == 0 {
        w.add_kv("general.architecture", Value::String("llama".into()))
            .unwrap();
    }
    w.add_kv("split.no", Value::U16(no)).unwrap();
    w.add_kv("split.count", Value::U16(count)).unwrap();
    w.add_kv("split.tensors.count", Value::I32(total)).unwrap();
    for (name, _) in tensors {
        w.add_tensor(name, &[2], GgmlType::F32).unwrap();
    }
    for (name, v) in tensors {
        w.write_tensor_data(name, bytemuck::cast_slice(&[*v, *v]))
            .unwrap();
    }
    w.finish().unwrap().commit().unwrap();
}

#[test]
fn parts_form_one_directory() {
    assert_eq!(
        parse_split_name(Path::new("/x/model-q4-00002-of-00003.gguf")),
        Some(("model-q4".to_string(), 2, 3))
    );
    assert_eq!(parse_split_name(Path::new("model.gguf")), None);
    assert_eq!(parse_split_name(Path::new("m-00004-of-00003.gguf")), None);
    let dir = tempfile::tempdir().unwrap();
    let p = |i| split_path(dir.path(), "m", i, 3);
    write_part(&p(1), 0, 3, 4, &[("a", 1.0)]);
    write_part(&p(2), 1, 3, 4, &[("b", 2.0), ("c", 3.0)]);
    write_part(&p(3), 2, 3, 4, &[("d", 4.0)]);
    // Any part's name opens the whole model.
    let m = SplitModel::open(p(2)).unwrap();
    assert_eq!(m.parts().len(), 3);
    assert_eq!(m.n_tensors(), 4);
    assert_eq!(
        m.metadata().get_str("general.architecture").unwrap(),
        "llama"
    );
    let names: Vec<&str> = m.tensors().map(|t| t.name()).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    assert_eq!(
        m.tensor_data("c").unwrap(),
        bytemuck::cast_slice::<f32, u8>(&[3.0, 3.0])
    );
    assert_eq!(m.tensor_info("d").unwrap().shape(), [2]);
    assert!(matches!(
        m.tensor_data("zz"),
        Err(GgufError::TensorNotFound { .. })
    ));

    // A wrong tensor total, a missing part, a duplicated tensor: errors.
    write_part(&p(3), 2, 3, 4, &[("d", 4.0), ("e", 5.0)]);
    assert!(matches!(SplitModel::open(p(1)), Err(GgufError::Split(_))));
    write_part(&p(3), 2, 3, 4, &[("a", 4.0)]);
    assert!(matches!(SplitModel::open(p(1)), Err(GgufError::Split(_))));
    std::fs::remove_file(p(3)).unwrap();
    assert!(matches!(SplitModel::open(p(1)), Err(GgufError::Io { .. })));

    // A plain file is a one-part model.
    let single = dir.path().join("plain.gguf");
    std::fs::write(&single, common::small_file()).unwrap();
    assert_eq!(SplitModel::open(&single).unwrap().n_tensors(), 3);
}
