//! The K-quant codecs against llama.cpp's reference code, through the golden files in
//! `tests/data/kquant-golden/` (written by `scripts/kquant-golden`, which runs llama.cpp's
//! `quantize_row_q*_K_ref` and `dequantize_row_q*_K` compiled with `-O2 -ffp-contract=off` on
//! seeded test blocks: normal, uniform, one-signed, constant, tiny, f16-subnormal-scale,
//! f32-subnormal, large, overflowing, mixed-magnitude, sparse, outlier, rounding-tie and
//! infinite/NaN data; `manifest.txt` lists the cases).
//!
//! - Quantizing the stored input must give byte-identical blocks, for every type we quantize.
//! - Dequantizing llama.cpp's blocks must give bit-identical f32 (compared through an FNV-1a
//!   hash of each case's values, which the manifest stores instead of the values).
//!
//! The reference is only deterministic across builds without fused multiply-adds: a build that
//! contracts `a * b + c` (e.g. `-march=native` on FMA hardware) picks different scales in some
//! blocks, so the golden files fix that choice of flags.

use std::collections::HashMap;
use std::path::PathBuf;

use powerinfer_gguf::quants::{dequantize_to_vec, quantize_to_vec};
use powerinfer_gguf::GgmlType;

/// The types the golden files hold, with their file names.
const TYPES: [(GgmlType, &str); 5] = [
    (GgmlType::Q2_K, "q2_k"),
    (GgmlType::Q3_K, "q3_k"),
    (GgmlType::Q4_K, "q4_k"),
    (GgmlType::Q5_K, "q5_k"),
    (GgmlType::Q6_K, "q6_k"),
];

const BLOCK: usize = 256;

struct Case {
    name: String,
    first: usize,
    count: usize,
}

struct Golden {
    input: Vec<f32>,
    cases: Vec<Case>,
    /// (type file name, case name) -> FNV-1a 64 of llama.cpp's dequantized values.
    dequant: HashMap<(String, String), u64>,
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/kquant-golden")
}

fn read(name: &str) -> Vec<u8> {
    let path = dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn golden() -> Golden {
    let input: Vec<f32> = read("input.f32")
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let manifest = String::from_utf8(read("manifest.txt")).unwrap();
    let mut cases = Vec::new();
    let mut dequant = HashMap::new();
    for line in manifest.lines().filter(|l| !l.starts_with('#')) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        match fields[..] {
            ["case", name, first, count] => cases.push(Case {
                name: name.to_string(),
                first: first.parse().unwrap(),
                count: count.parse().unwrap(),
            }),
            ["dequant", ty, case, hash] => {
                let hash = u64::from_str_radix(hash, 16).unwrap();
                dequant.insert((ty.to_string(), case.to_string()), hash);
            }
            _ => panic!("manifest line not understood: {line:?}"),
        }
    }
    let blocks: usize = cases.iter().map(|c| c.count).sum();
    assert_eq!(
        input.len(),
        blocks * BLOCK,
        "input.f32 against the manifest"
    );
    assert!(
        cases.iter().all(|c| c.first + c.count <= blocks),
        "a case reaches past the input"
    );
    Golden {
        input,
        cases,
        dequant,
    }
}

fn fnv1a(values: &[f32]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for v in values {
        for b in v.to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

#[test]
fn quantizers_are_byte_identical_to_llama_cpp() {
    let g = golden();
    let mut failures = Vec::new();
    for (ty, file) in TYPES {
        let want = read(&format!("{file}.bin"));
        let size = ty.type_size();
        assert_eq!(want.len(), g.input.len() / BLOCK * size, "{file}.bin");
        let got = quantize_to_vec(ty, &g.input).unwrap();
        for case in &g.cases {
            for b in case.first..case.first + case.count {
                let (w, o) = (&want[b * size..][..size], &got[b * size..][..size]);
                if let Some(at) = w.iter().zip(o).position(|(w, o)| w != o) {
                    failures.push(format!(
                        "{ty} {} block {b}: first difference at byte {at} ({:#04x}, llama.cpp {:#04x})",
                        case.name, o[at], w[at]
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} blocks differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn dequantizers_are_bit_identical_to_llama_cpp() {
    let g = golden();
    let mut failures = Vec::new();
    for (ty, file) in TYPES {
        let blocks = read(&format!("{file}.bin"));
        let size = ty.type_size();
        for case in &g.cases {
            let bytes = &blocks[case.first * size..(case.first + case.count) * size];
            let values = dequantize_to_vec(ty, bytes).unwrap();
            let want = g.dequant[&(file.to_string(), case.name.clone())];
            if fnv1a(&values) != want {
                failures.push(format!("{ty} {}", case.name));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "dequantization differs from llama.cpp's in: {}",
        failures.join(", ")
    );
}

#[test]
fn the_golden_files_cover_every_type_and_case() {
    let g = golden();
    assert!(g.cases.len() >= 10);
    for (_, file) in TYPES {
        for case in &g.cases {
            assert!(
                g.dequant
                    .contains_key(&(file.to_string(), case.name.clone())),
                "{file} {}",
                case.name
            );
        }
    }
}
