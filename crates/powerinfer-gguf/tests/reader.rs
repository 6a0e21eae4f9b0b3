//! Reader and writer: round trips, typed views, and every kind of malformed input.

mod common;

use common::{sample_file, sample_metadata, sample_tensors, small_file};
use powerinfer_gguf::quants::blocks::{BlockQ4_0, BlockQ8_0};
use powerinfer_gguf::{
    Array, FileKind, GgmlType, GgufError, GgufFile, GgufHeader, GgufWriter, Value, ValueType,
};
use proptest::prelude::*;

/// Hand-assembled files, for inputs our writer refuses to produce.
#[derive(Default)]
struct Raw(Vec<u8>);

impl Raw {
    fn header(magic: &[u8; 4], version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw::default();
        r.bytes(magic).u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Raw {
        self.0.extend_from_slice(b);
        self
    }
    fn u32(&mut self, v: u32) -> &mut Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> &mut Raw {
        self.bytes(&v.to_le_bytes())
    }
    fn string(&mut self, s: &[u8]) -> &mut Raw {
        self.u64(s.len() as u64).bytes(s)
    }
    fn kv_u32(&mut self, key: &str, v: u32) -> &mut Raw {
        self.string(key.as_bytes()).u32(4).u32(v)
    }
    fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Raw {
        self.string(name.as_bytes()).u32(dims.len() as u32);
        for d in dims {
            self.u64(*d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends `n` data bytes.
    fn data(&mut self, n: usize) -> &mut Raw {
        while self.0.len() % 32 != 0 {
            self.0.push(0);
        }
        self.0.extend(std::iter::repeat_n(0x55, n));
        self
    }
    fn parse(&self) -> Result<GgufHeader, GgufError> {
        GgufHeader::parse(&self.0)
    }
}

/// Copies bytes into 8-byte-aligned storage so typed views work on in-memory files.
struct Aligned(Vec<u64>, usize);

impl AsRef<[u8]> for Aligned {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.0)[..self.1]
    }
}

fn aligned(bytes: &[u8]) -> Aligned {
    let mut v = vec![0u64; bytes.len().div_ceil(8)];
    bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..bytes.len()].copy_from_slice(bytes);
    Aligned(v, bytes.len())
}

#[test]
fn round_trip_every_value_and_tensor_type() {
    for (kind, align) in [(FileKind::Gguf, None), (FileKind::PowerInfer, Some(128))] {
        let bytes = sample_file(kind, align);
        let f = GgufFile::from_bytes(bytes.as_slice()).unwrap();
        assert_eq!(f.kind(), kind);
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), u64::from(align.unwrap_or(32)));
        let mut expected = sample_metadata();
        if let Some(a) = align {
            expected.push(("general.alignment", Value::U32(a)));
        }
        let got: Vec<(&str, &Value)> = f.metadata().iter().collect();
        assert_eq!(got.len(), expected.len());
        for ((k, v), (ek, ev)) in got.iter().zip(&expected) {
            assert_eq!(k, ek);
            assert_eq!(*v, ev);
        }
        assert_eq!(f.header().data_offset() % f.alignment(), 0);
        let tensors = sample_tensors();
        assert_eq!(f.tensors().len(), tensors.len());
        for (info, (name, shape, ty, data)) in f.tensors().iter().zip(&tensors) {
            assert_eq!(info.name(), name);
            assert_eq!(info.shape(), shape.as_slice());
            assert_eq!(info.ggml_type(), *ty);
            assert_eq!(info.offset() % f.alignment(), 0);
            assert_eq!(f.tensor_data(name).unwrap(), data.as_slice());
            assert_eq!(f.tensor_info(name), Some(info));
        }
        // Padding bytes are zeros, and the file ends padded, as gguf-py writes it.
        assert_eq!(bytes.len() as u64 % f.alignment(), 0);
        // Rewriting what we read reproduces the file byte for byte.
        assert_eq!(common::rewrite(&f), bytes);
    }
}

#[test]
fn typed_accessors_and_wrong_type_errors() {
    let bytes = sample_file(FileKind::Gguf, None);
    let f = GgufFile::from_bytes(bytes).unwrap();
    let md = f.metadata();
    assert_eq!(md.get_u32("u32").unwrap(), u32::MAX);
    assert_eq!(md.get_u64("u64").unwrap(), u64::MAX);
    assert_eq!(md.get_f32("f32").unwrap(), 0.1);
    assert!(md.get_bool("bool").unwrap());
    assert_eq!(md.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(md.get_string_array("arr.string").unwrap(), ["a", ""]);
    assert_eq!(md.get_f32_array("arr.f32").unwrap(), [1.5, -0.0]);
    assert_eq!(md.get_i32_array("arr.i32").unwrap(), [-9, 9]);
    assert_eq!(md.get_u32_array("arr.u32").unwrap(), [9]);
    assert_eq!(md.get_uint("u8").unwrap(), 255);
    assert_eq!(md.get_array("arr.nested").unwrap().len(), 4);
    assert_eq!(
        md.get_array("arr.nested").unwrap().get(2),
        Some(Value::Array(Array::Array(vec![Array::U8(vec![5])])))
    );
    match md.get_u32("f32") {
        Err(GgufError::WrongType {
            key,
            expected,
            found,
        }) => {
            assert_eq!(
                (key.as_str(), expected, found.as_str()),
                ("f32", "u32", "f32")
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        md.get_string_array("arr.f32"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        md.get_uint("i8"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        md.get_str("nope"),
        Err(GgufError::MissingKey { .. })
    ));
}

#[test]
fn typed_tensor_views() {
    let bytes = sample_file(FileKind::Gguf, None);
    let f = GgufFile::from_bytes(aligned(&bytes)).unwrap();
    let x = f.tensor_f32("token_embd.weight").unwrap();
    assert_eq!(x.len(), 24);
    assert_eq!(
        x[0].to_bits().to_le_bytes(),
        f.tensor_data("token_embd.weight").unwrap()[..4]
    );
    let q: &[BlockQ4_0] = f.tensor_blocks("blk.0.ffn_up.weight").unwrap();
    assert_eq!(q.len(), 4);
    assert_eq!(
        bytemuck::cast_slice::<BlockQ4_0, u8>(q),
        f.tensor_data("blk.0.ffn_up.weight").unwrap()
    );
    let q8: &[BlockQ8_0] = f.tensor_blocks("blk.0.ffn_down_t.weight").unwrap();
    assert_eq!(q8.len(), 2);
    assert_eq!(f.tensor_f16("blk.0.attn_q.weight").unwrap().len(), 15);
    assert_eq!(f.tensor_i32("blk.0.empty").unwrap().len(), 0);
    assert!(matches!(
        f.tensor_blocks::<BlockQ4_0>("blk.0.ffn_down_t.weight"),
        Err(GgufError::TensorTypeMismatch {
            found: GgmlType::Q8_0,
            ..
        })
    ));
    assert!(matches!(
        f.tensor_f32("output.weight"),
        Err(GgufError::TensorTypeMismatch { .. })
    ));
    assert!(matches!(
        f.tensor_f32("missing"),
        Err(GgufError::TensorNotFound { .. })
    ));
    // A misaligned buffer gives an error, not a panic.
    let mut shifted = vec![0u8];
    shifted.extend_from_slice(&bytes);
    let storage = aligned(&shifted);
    let f = GgufFile::from_bytes(&storage.as_ref()[1..]).unwrap();
    assert!(matches!(
        f.tensor_f32("token_embd.weight"),
        Err(GgufError::MisalignedView { .. })
    ));
}

#[test]
fn open_maps_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let mut w = GgufWriter::create(&path, FileKind::PowerInfer).unwrap();
    w.add_kv("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add_tensor("w", &[2, 2], GgmlType::F32).unwrap();
    // Nothing is visible under the final name until commit.
    w.write_tensor_data("w", bytemuck::cast_slice(&[1.0f32, 2.0, 3.0, 4.0]))
        .unwrap();
    assert!(!path.exists());
    w.finish().unwrap().commit().unwrap();
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "temporary file left behind"
    );
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.kind(), FileKind::PowerInfer);
    assert_eq!(f.tensor_f32("w").unwrap(), [1.0, 2.0, 3.0, 4.0]);
    // Read into anonymous memory instead: the same header and bytes.
    let m = GgufFile::open_in_memory(&path).unwrap();
    assert_eq!(m.tensors(), f.tensors());
    assert_eq!(m.version(), f.version());
    assert_eq!(m.tensor_f32("w").unwrap(), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(m.bytes(), std::fs::read(&path).unwrap());

    // An abandoned writer leaves nothing behind.
    let other = dir.path().join("n.gguf");
    let w = GgufWriter::create(&other, FileKind::Gguf).unwrap();
    drop(w);
    assert!(!other.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    assert!(matches!(
        GgufFile::open(dir.path().join("absent")),
        Err(GgufError::Io { .. })
    ));
    assert!(matches!(
        GgufFile::open_in_memory(dir.path().join("absent")),
        Err(GgufError::Io { .. })
    ));
}

/// A file of several read pieces per thread, ending mid-piece, read into memory: the same bytes
/// as the file.
#[test]
fn open_in_memory_reads_big_files_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.gguf");
    let n = (5 << 20) + 777; // f32 values: ~20 MiB of data
    let mut w = GgufWriter::create(&path, FileKind::Gguf).unwrap();
    w.add_tensor("w", &[n as u64], GgmlType::F32).unwrap();
    let values: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
    w.write_tensor_data("w", bytemuck::cast_slice(&values))
        .unwrap();
    w.finish().unwrap().commit().unwrap();
    let m = GgufFile::open_in_memory(&path).unwrap();
    assert_eq!(m.bytes(), std::fs::read(&path).unwrap());
    assert_eq!(m.tensor_f32("w").unwrap(), values);
}

#[test]
fn writer_streams_from_a_reader_and_checks_usage() {
    let mut w = GgufWriter::new(Vec::new(), FileKind::Gguf);
    w.add_tensor("a", &[3], GgmlType::F32).unwrap();
    w.add_tensor("b", &[1], GgmlType::I8).unwrap();
    assert!(matches!(
        w.add_tensor("a", &[1], GgmlType::F32),
        Err(GgufError::Writer(_))
    ));
    assert!(matches!(
        w.add_tensor("q", &[33], GgmlType::Q4_0),
        Err(GgufError::Writer(_))
    ));
    assert!(matches!(
        w.add_tensor("d", &[1, 1, 1, 1, 1], GgmlType::F32),
        Err(GgufError::Writer(_))
    ));
    assert!(matches!(
        w.add_tensor(&"n".repeat(64), &[1], GgmlType::F32),
        Err(GgufError::Writer(_))
    ));
    assert!(matches!(
        w.add_tensor("o", &[u64::MAX, 2], GgmlType::F32),
        Err(GgufError::Writer(_))
    ));
    assert!(matches!(
        w.set_alignment(24),
        Err(GgufError::BadAlignment { .. })
    ));
    assert!(matches!(
        w.add_kv("general.alignment", Value::U64(32)),
        Err(GgufError::BadAlignment { .. })
    ));
    assert!(
        matches!(w.write_tensor_data("b", &[1]), Err(GgufError::Writer(_))),
        "out of order"
    );
    assert!(
        matches!(
            w.write_tensor_data("a", &[1; 11]),
            Err(GgufError::Writer(_))
        ),
        "wrong size"
    );
    let mut short: &[u8] = &[0; 5];
    assert!(matches!(
        w.write_tensor_from("a", &mut short),
        Err(GgufError::Writer(_))
    ));

    let mut w = GgufWriter::new(Vec::new(), FileKind::Gguf);
    w.add_tensor("a", &[3], GgmlType::F32).unwrap();
    w.add_tensor("b", &[1], GgmlType::I8).unwrap();
    let mut src: &[u8] = &[9; 12];
    w.write_tensor_from("a", &mut src).unwrap();
    assert!(matches!(
        w.add_kv("late", Value::U8(1)),
        Err(GgufError::Writer(_))
    ));
    let mut w2 = w;
    let err = match w2.write_tensor_data("b", &[7]) {
        Ok(()) => w2.finish().map(|_| ()),
        Err(e) => Err(e),
    };
    assert!(err.is_ok());

    let mut w = GgufWriter::new(Vec::new(), FileKind::Gguf);
    w.add_tensor("a", &[3], GgmlType::F32).unwrap();
    assert!(
        matches!(w.finish(), Err(GgufError::Writer(_))),
        "missing tensor data"
    );

    // Replacing a key keeps its position, as gguf-py does.
    let mut w = GgufWriter::new(Vec::new(), FileKind::Gguf);
    w.add_kv("x", Value::U8(1)).unwrap();
    w.add_kv("y", Value::U8(2)).unwrap();
    w.add_kv("x", Value::U8(3)).unwrap();
    let f = GgufFile::from_bytes(w.finish().unwrap()).unwrap();
    let got: Vec<_> = f
        .metadata()
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    assert_eq!(
        got,
        [
            ("x".to_string(), Value::U8(3)),
            ("y".to_string(), Value::U8(2))
        ]
    );
    assert_eq!(
        f.header().data_offset(),
        64,
        "header padded to the alignment even without tensors"
    );
}

#[test]
fn version_two_is_read() {
    let mut bytes = small_file();
    bytes[4] = 2;
    let f = GgufFile::from_bytes(bytes).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.tensors().len(), 3);
}

fn err_of(r: &Raw) -> GgufError {
    match r.parse() {
        Ok(_) => panic!("parse succeeded"),
        Err(e) => e,
    }
}

#[test]
fn header_errors() {
    assert!(
        matches!(err_of(&Raw::header(b"GGUG", 3, 0, 0)), GgufError::BadMagic { found } if &found == b"GGUG")
    );
    let e = err_of(&Raw::header(b"GGUF", 1, 0, 0));
    assert!(matches!(e, GgufError::VersionOne));
    assert!(e.to_string().contains("version 1"));
    assert!(matches!(
        err_of(&Raw::header(b"GGUF", 4, 0, 0)),
        GgufError::UnsupportedVersion { version: 4 }
    ));
    let be = err_of(&Raw::header(b"GGUF", 3u32.swap_bytes(), 0, 0));
    assert!(be.to_string().contains("big-endian"), "{be}");
    match err_of(&Raw::header(b"GGUF", 3, 1 << 63, 0)) {
        GgufError::CountTooLarge { offset, count, .. } => assert_eq!((offset, count), (8, 1 << 63)),
        e => panic!("{e}"),
    }
    match err_of(&Raw::header(b"PWRI", 3, 0, u64::MAX)) {
        GgufError::CountTooLarge { offset, .. } => assert_eq!(offset, 16),
        e => panic!("{e}"),
    }
    assert!(matches!(
        err_of(&Raw(b"GGU".to_vec())),
        GgufError::Truncated { offset: 0, .. }
    ));
    // Empty input.
    assert!(matches!(
        GgufHeader::parse(&[]),
        Err(GgufError::Truncated { .. })
    ));
}

#[test]
fn metadata_errors() {
    // String length past EOF.
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.u64(1 << 40).bytes(b"abcdefghijklmnop");
    match err_of(&r) {
        GgufError::Truncated { offset, .. } => assert_eq!(offset, 24),
        e => panic!("{e}"),
    }
    // Invalid UTF-8 key.
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"k\xff").u32(4).u32(0);
    assert!(matches!(err_of(&r), GgufError::InvalidUtf8 { offset: 32 }));
    // Unknown value type: the error names the id and its offset.
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"k").u32(13).u32(0);
    assert!(matches!(
        err_of(&r),
        GgufError::UnknownValueType { offset: 33, id: 13 }
    ));
    // Unknown array element type.
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"k").u32(9).u32(99).u64(0);
    assert!(matches!(
        err_of(&r),
        GgufError::UnknownValueType { id: 99, .. }
    ));
    // Array count far beyond the bytes present.
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"k").u32(9).u32(8).u64(1 << 62).bytes(&[0; 64]);
    assert!(matches!(
        err_of(&r),
        GgufError::CountTooLarge {
            what: "array",
            min_size: 8,
            ..
        }
    ));
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"k").u32(9).u32(9).u64(u64::MAX);
    assert!(matches!(err_of(&r), GgufError::CountTooLarge { .. }));
    // Duplicate keys.
    let mut r = Raw::header(b"GGUF", 3, 0, 2);
    r.kv_u32("k", 1).kv_u32("k", 2);
    assert!(matches!(err_of(&r), GgufError::DuplicateKey { offset: 41, ref key } if key == "k"));
    // Bool other than 0/1.
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"k").u32(7).bytes(&[2]);
    assert!(matches!(
        err_of(&r),
        GgufError::InvalidBool { value: 2, .. }
    ));
    // Alignment: zero, not a power of two, wrong type.
    for a in [0, 24] {
        let mut r = Raw::header(b"GGUF", 3, 0, 1);
        r.kv_u32("general.alignment", a);
        assert!(matches!(err_of(&r), GgufError::BadAlignment { .. }));
    }
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"general.alignment").u32(10).u64(32);
    assert!(matches!(err_of(&r), GgufError::BadAlignment { .. }));
    // Arrays nested deeper than any real file: an error, not a stack overflow.
    let mut r = Raw::header(b"GGUF", 3, 0, 1);
    r.string(b"k").u32(9);
    for _ in 0..100_000 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    assert!(matches!(err_of(&r), GgufError::TooDeep { max: 64, .. }));
}

#[test]
fn tensor_info_errors() {
    let one = |name: &str, dims: &[u64], ty: u32, off: u64, data: usize| {
        let mut r = Raw::header(b"GGUF", 3, 1, 0);
        r.tensor(name, dims, ty, off).data(data);
        r
    };
    assert!(one("t", &[4], 0, 0, 16).parse().is_ok());
    assert!(matches!(
        err_of(&one("t", &[1; 5], 0, 0, 16)),
        GgufError::TooManyDims {
            n_dims: 5,
            offset: 33,
            ..
        }
    ));
    assert!(matches!(
        err_of(&one("t", &[1 << 32, 1 << 32], 0, 0, 0)),
        GgufError::ShapeOverflow { .. }
    ));
    assert!(matches!(
        err_of(&one("t", &[1 << 63], 24, 0, 0)),
        GgufError::ShapeOverflow { .. }
    ));
    assert!(
        matches!(
            err_of(&one("t", &[1 << 62], 0, 0, 0)),
            GgufError::ShapeOverflow { .. }
        ),
        "bytes overflow"
    );
    let e = err_of(&one("t", &[4], 4, 0, 16));
    assert!(matches!(
        e,
        GgufError::UnknownGgmlType {
            id: 4,
            offset: 45,
            ..
        }
    ));
    assert!(e.to_string().contains("type id 4"), "{e}");
    assert!(matches!(
        err_of(&one("t", &[4], 1000, 0, 16)),
        GgufError::UnknownGgmlType { id: 1000, .. }
    ));
    // 18 is IQ3_XXS outside GPU-index files: 4 elements are not a whole block.
    assert!(matches!(
        err_of(&one("t", &[4], 18, 0, 16)),
        GgufError::NotWholeBlocks {
            ggml_type: GgmlType::IQ3_XXS,
            ..
        }
    ));
    assert!(matches!(
        err_of(&one("t", &[33], 2, 0, 64)),
        GgufError::NotWholeBlocks { block_size: 32, .. }
    ));
    assert!(matches!(
        err_of(&one("t", &[4], 0, 8, 64)),
        GgufError::MisalignedOffset {
            offset: 8,
            alignment: 32,
            ..
        }
    ));
    assert!(matches!(
        err_of(&one("t", &[4], 0, 0, 15)),
        GgufError::TensorOutOfBounds { .. }
    ));
    assert!(matches!(
        err_of(&one("t", &[4], 0, 1 << 63, 16)),
        GgufError::TensorOutOfBounds { .. }
    ));
    assert!(matches!(
        err_of(&one("t", &[4], 0, u64::MAX - 31, 16)),
        GgufError::TensorOutOfBounds { .. }
    ));
    // Zero-element tensors need no bytes, even at the end of the file.
    assert!(one("t", &[0, 7], 2, 0, 0).parse().is_ok());

    let two = |a: (u64, u64), b: (u64, u64), data: usize, name_b: &str| {
        let mut r = Raw::header(b"GGUF", 3, 2, 0);
        r.tensor("a", &[a.0], 0, a.1)
            .tensor(name_b, &[b.0], 0, b.1)
            .data(data);
        r
    };
    assert!(two((8, 0), (8, 32), 64, "b").parse().is_ok());
    assert!(
        two((8, 32), (8, 0), 64, "b").parse().is_ok(),
        "order of offsets is free"
    );
    assert!(matches!(
        err_of(&two((16, 0), (8, 32), 96, "b")),
        GgufError::OverlappingTensors { offset: 32, .. }
    ));
    assert!(matches!(
        err_of(&two((8, 0), (8, 0), 64, "b")),
        GgufError::OverlappingTensors { .. }
    ));
    assert!(
        two((0, 0), (8, 0), 32, "b").parse().is_ok(),
        "an empty tensor overlaps nothing"
    );
    assert!(
        matches!(err_of(&two((8, 0), (8, 32), 64, "a")), GgufError::DuplicateTensor { ref name, .. } if name == "a")
    );
    // A tensor info count the bytes cannot hold.
    let mut r = Raw::header(b"GGUF", 3, 1000, 0);
    r.tensor("t", &[4], 0, 0);
    assert!(matches!(
        err_of(&r),
        GgufError::CountTooLarge {
            what: "tensor infos",
            ..
        }
    ));
}

#[test]
fn gpu_index_files_read_type_18_as_i32() {
    let mut r = Raw::header(b"PWRI", 3, 1, 1);
    r.string(b"general.architecture")
        .u32(8)
        .string(b"generic.gpu_index");
    r.tensor("blk.0.gpu_idx", &[3], 18, 0).data(12);
    let h = r.parse().unwrap();
    assert_eq!(h.tensors()[0].ggml_type(), GgmlType::I32);
    assert_eq!(h.tensors()[0].type_id(), 18);
    assert_eq!(h.tensors()[0].n_bytes(), 12);
}

#[test]
fn truncation_at_every_byte_is_an_error() {
    for bytes in [small_file(), sample_file(FileKind::Gguf, Some(64))] {
        assert!(GgufHeader::parse(&bytes).is_ok());
        // The last tensor's padding may be cut without harm; everything before its data may not.
        let f = GgufFile::from_bytes(bytes.as_slice()).unwrap();
        let needed = f
            .tensors()
            .iter()
            .filter(|t| t.n_bytes() > 0)
            .map(|t| f.header().data_offset() + t.offset() + t.n_bytes())
            .max()
            .unwrap();
        for len in 0..bytes.len() {
            let r = GgufHeader::parse(&bytes[..len]);
            if (len as u64) < needed {
                let e = r.expect_err("truncated file parsed");
                assert!(!e.to_string().is_empty());
            } else {
                assert!(r.is_ok(), "cut at {len} inside the final padding");
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(usize, u8),
    Overwrite(usize, Vec<u8>),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    /// Writes a u64 (for counts and lengths) at a position.
    BigNumber(usize, u64),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting = prop_oneof![
        Just(0u64),
        Just(u64::MAX),
        Just(1 << 63),
        Just(u32::MAX as u64),
        Just(1 << 32),
        0u64..300
    ];
    prop_oneof![
        (any::<usize>(), 1u8..).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..9))
            .prop_map(|(i, v)| Mutation::Overwrite(i, v)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..9))
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Remove(i, n)),
        (any::<usize>(), interesting).prop_map(|(i, v)| Mutation::BigNumber(i, v)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let len = bytes.len();
    match m {
        Mutation::Flip(i, b) => bytes[i % len] ^= b,
        Mutation::Overwrite(i, v) => {
            for (k, b) in v.iter().enumerate() {
                let j = (i % len + k) % len;
                bytes[j] = *b;
            }
        }
        Mutation::Insert(i, v) => {
            let at = i % (len + 1);
            bytes.splice(at..at, v.iter().copied());
        }
        Mutation::Remove(i, n) => {
            let at = i % len;
            let end = (at + n).min(len);
            bytes.drain(at..end);
        }
        Mutation::BigNumber(i, v) => {
            let at = i % len.saturating_sub(8).max(1);
            let end = (at + 8).min(len);
            bytes[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    /// Random damage to a valid file gives Ok or Err, never a panic; an Ok file's tensor data
    /// and metadata can be walked completely.
    #[test]
    fn mutated_files_never_panic(muts in prop::collection::vec(mutation(), 1..5), big in any::<bool>()) {
        let mut bytes = if big { sample_file(FileKind::Gguf, None) } else { small_file() };
        for m in &muts {
            if bytes.is_empty() { break; }
            apply(&mut bytes, m);
        }
        if let Ok(f) = GgufFile::from_bytes(bytes.as_slice()) {
            let mut total = 0u64;
            for t in f.tensors() {
                total += f.data_of(t).len() as u64;
                prop_assert_eq!(f.data_of(t).len() as u64, t.n_bytes());
            }
            prop_assert!(total <= bytes.len() as u64);
            for (k, v) in f.metadata().iter() {
                prop_assert!(f.metadata().get(k).is_some());
                let _ = v.value_type();
            }
        }
    }
}

#[test]
fn value_type_ids_round_trip() {
    for id in 0..13 {
        assert_eq!(ValueType::from_id(id).unwrap().id(), id);
    }
    assert_eq!(ValueType::from_id(13), None);
}

/// Writes seed files for the fuzzer into $GGUF_FUZZ_SEEDS (see /fuzz/README.md at the repository root).
#[test]
#[ignore]
fn write_fuzz_seeds() {
    let dir =
        std::path::PathBuf::from(std::env::var_os("GGUF_FUZZ_SEEDS").expect("GGUF_FUZZ_SEEDS"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("small.gguf"), small_file()).unwrap();
    std::fs::write(dir.join("sample.gguf"), sample_file(FileKind::Gguf, None)).unwrap();
    std::fs::write(
        dir.join("sample128.gguf"),
        sample_file(FileKind::PowerInfer, Some(128)),
    )
    .unwrap();
    let idx = powerinfer_gguf::GpuIndex {
        layers: vec![
            powerinfer_gguf::LayerGpuIndex::new(8, vec![0, 5]).unwrap(),
            powerinfer_gguf::LayerGpuIndex::new(4, vec![]).unwrap(),
        ],
        vram_capacity: 1000,
        extra: Default::default(),
    };
    std::fs::write(dir.join("index.gpuidx"), idx.write(Vec::new()).unwrap()).unwrap();
}
