//! Any bytes: parsing returns Ok or Err without panicking or reading out of bounds. Files that
//! parse are walked completely, read as GPU indexes, and rewritten with our writer; the rewrite
//! must parse back to the same metadata and tensors.
#![no_main]

use libfuzzer_sys::fuzz_target;
use powerinfer_gguf::{GgufFile, GgufWriter, GpuIndex};

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(data) else {
        return;
    };
    let mut total = 0u64;
    for t in f.tensors() {
        let d = f.data_of(t);
        assert_eq!(d.len() as u64, t.n_bytes());
        total += t.n_bytes();
    }
    assert!(total <= data.len() as u64);
    if let Ok(idx) = GpuIndex::from_gguf(&f) {
        let again =
            GpuIndex::from_gguf(&GgufFile::from_bytes(idx.write(Vec::new()).unwrap()).unwrap())
                .unwrap();
        assert_eq!(again, idx);
    }

    // Round trip through the writer (names longer than ggml allows are refused by the writer).
    let mut w = GgufWriter::new(Vec::new(), f.kind());
    if w.add_metadata(f.metadata()).is_err() {
        return;
    }
    for t in f.tensors() {
        if w.add_tensor(t.name(), t.shape(), t.ggml_type()).is_err() {
            return;
        }
    }
    for t in f.tensors() {
        w.write_tensor_data(t.name(), f.data_of(t)).unwrap();
    }
    let bytes = w.finish().unwrap();
    let g = GgufFile::from_bytes(bytes.as_slice()).unwrap();
    assert_eq!(g.metadata().len(), f.metadata().len());
    for ((k1, v1), (k2, v2)) in f.metadata().iter().zip(g.metadata().iter()) {
        assert_eq!(k1, k2);
        // NaN != NaN: compare the encodings instead of the values.
        assert_eq!(format!("{v1:?}"), format!("{v2:?}"));
    }
    assert_eq!(g.tensors().len(), f.tensors().len());
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        assert_eq!(
            (a.name(), a.shape(), a.ggml_type()),
            (b.name(), b.shape(), b.ggml_type())
        );
        assert_eq!(f.data_of(a), g.data_of(b));
    }
});
