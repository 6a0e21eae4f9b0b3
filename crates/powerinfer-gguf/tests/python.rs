//! Conformance with the PyPI `gguf` package (tests/py/gguf_conformance.py): its files read
//! identically by us, and ours by its GGUFReader.

mod common;

use common::{describe, python, rewrite, run_py, sample_file};
use powerinfer_gguf::split::SplitModel;
use powerinfer_gguf::{FileKind, GgufFile, GpuIndex};

#[test]
fn files_written_by_pypi_gguf_read_identically() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    for align in [32, 128] {
        let path = dir.path().join(format!("py-{align}.gguf"));
        let manifest = run_py(&py, &["write", path.to_str().unwrap(), &align.to_string()]);
        let f = GgufFile::open(&path).unwrap();
        let ours = describe(&f);
        assert_eq!(ours["alignment"], manifest["alignment"]);
        assert_eq!(ours["magic"], "GGUF");
        // Metadata: what the script meant to write, key by key.
        let (a, b) = (
            ours["metadata"].as_array().unwrap(),
            manifest["metadata"].as_array().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x, y);
        }
        // Tensors: name, type, shape, position and bytes as GGUFReader sees them.
        let (a, b) = (
            ours["tensors"].as_array().unwrap(),
            manifest["tensors"].as_array().unwrap(),
        );
        assert_eq!(a.len(), 13);
        assert_eq!(a, b);
        // Our writer, given the same content, produces the same bytes as gguf.GGUFWriter.
        assert_eq!(
            rewrite(&f),
            std::fs::read(&path).unwrap(),
            "alignment {align}"
        );
    }
}

#[test]
fn files_we_write_are_read_identically_by_gguf_reader() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    for (kind, align) in [(FileKind::Gguf, None), (FileKind::PowerInfer, Some(64))] {
        let bytes = sample_file(kind, align);
        let path = dir.path().join("ours.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let theirs = run_py(&py, &["describe", path.to_str().unwrap()]);
        let ours = describe(&GgufFile::from_bytes(bytes.as_slice()).unwrap());
        assert_eq!(ours["magic"], theirs["magic"]);
        assert_eq!(ours["alignment"], theirs["alignment"]);
        let (a, b) = (
            ours["metadata"].as_array().unwrap(),
            theirs["metadata"].as_array().unwrap(),
        );
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x, y);
        }
        assert_eq!(ours["tensors"], theirs["tensors"]);
    }
}

#[test]
fn split_files_written_by_pypi_gguf_open_as_one_model() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.gguf");
    run_py(&py, &["write-split", out.to_str().unwrap()]);
    let m = SplitModel::open(dir.path().join("m-00003-of-00003.gguf")).unwrap();
    assert_eq!(m.parts().len(), 3);
    assert_eq!(
        m.metadata().get_str("general.architecture").unwrap(),
        "llama"
    );
    let names: Vec<&str> = m.tensors().map(|t| t.name()).collect();
    assert_eq!(names, ["t0", "t1", "t2", "t3", "t4"]);
    for i in 0..5 {
        let v = i as f32;
        assert_eq!(
            m.tensor_data(&format!("t{i}")).unwrap(),
            bytemuck::cast_slice::<f32, u8>(&[v, v, v])
        );
    }
}

#[test]
fn gpu_index_matches_powerinfer_exporter_layout() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf.generated.gpuidx");
    let manifest = run_py(&py, &["write-gpuidx", path.to_str().unwrap()]);
    // Read: the exporter's layout with today's I32 id (26).
    let idx = GpuIndex::open(&path).unwrap();
    assert_eq!(
        idx.vram_capacity,
        manifest["vram_capacity"].as_u64().unwrap()
    );
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(idx.layers.len(), layers.len());
    for (ours, theirs) in idx.layers.iter().zip(layers) {
        assert_eq!(ours.n_ff() as u64, theirs["n_ff"].as_u64().unwrap());
        let bucket: Vec<u32> = theirs["bucket"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(ours.bucket(), bucket.as_slice());
    }
    assert!(idx.layers.iter().any(|l| l.k() == 0) && idx.layers.iter().any(|l| l.k() == 8));
    // Write: byte for byte the exporter's file, except that each tensor's type id is
    // PowerInfer's 18 instead of 26.
    let ours = idx.write(Vec::new()).unwrap();
    let theirs = std::fs::read(&path).unwrap();
    assert_eq!(ours.len(), theirs.len());
    let diffs: Vec<usize> = (0..ours.len()).filter(|&i| ours[i] != theirs[i]).collect();
    assert_eq!(diffs.len(), 2 * layers.len());
    for i in diffs {
        assert_eq!((ours[i], theirs[i]), (18, 26), "byte {i}");
        assert_eq!(ours[i + 1..i + 4], [0, 0, 0]);
    }
}
