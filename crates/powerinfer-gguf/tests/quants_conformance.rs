//! Bit-exact conformance of the quantization codecs with the PyPI `gguf` package
//! (`gguf.quants`), run through `tests/py/quants_ref.py` with the Python in `POWERINFER_PYTHON`.
//!
//! - Every type both sides can quantize (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the same f32
//!   data from many distributions must give byte-identical blocks, and dequantizing them must
//!   give bit-identical f32.
//! - Every type both sides can only dequantize (the K-quants), plus the others: random valid
//!   block bytes (f16 scales finite), and the output of our K-quant quantizers, must
//!   dequantize to bit-identical f32.
//!
//! Our side also runs on deliberately misaligned buffers, which must not change anything.

use std::path::{Path, PathBuf};
use std::process::Command;

use powerinfer_gguf::quants::{dequantize_to_vec, quantize, quantize_to_vec};
use powerinfer_gguf::GgmlType;

/// SplitMix64: small, seedable, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn normal(&mut self) -> f32 {
        let u1 = self.unit().max(1e-300);
        let u2 = self.unit();
        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
    }
}

/// Values per case: a whole number of 256-value super-blocks, so every type can take them.
const N: usize = 256 * 8;

fn distributions(rng: &mut Rng) -> Vec<(&'static str, Vec<f32>)> {
    let mut cases: Vec<(&'static str, Vec<f32>)> = Vec::new();
    let normal =
        |rng: &mut Rng, scale: f32| (0..N).map(|_| rng.normal() * scale).collect::<Vec<_>>();
    cases.push(("normal", normal(rng, 1.0)));
    cases.push((
        "uniform",
        (0..N).map(|_| (rng.unit() * 2.0 - 1.0) as f32).collect(),
    ));
    cases.push(("zeros", vec![0.0; N]));
    cases.push(("tiny", normal(rng, 1e-30)));
    // f32 subnormals: the scales' reciprocals overflow, exercising the reference's NaN casts.
    cases.push(("subnormal", normal(rng, 1e-39)));
    cases.push(("large", normal(rng, 1e4)));
    // Scales beyond f16's range become infinite.
    cases.push(("huge", normal(rng, 1e6)));
    cases.push((
        "positive",
        (0..N).map(|_| rng.normal().abs() + 0.25).collect(),
    ));
    cases.push((
        "negative",
        (0..N).map(|_| -rng.normal().abs() - 3.0).collect(),
    ));
    let mut equal = Vec::with_capacity(N);
    for _ in 0..N / 32 {
        let v = if rng.below(4) == 0 {
            0.0
        } else {
            rng.normal() * 10.0
        };
        equal.extend(std::iter::repeat_n(v, 32));
    }
    cases.push(("equal_blocks", equal));
    // Largest magnitude negative in every block.
    let mut negmax = normal(rng, 1.0);
    for block in negmax.chunks_exact_mut(32) {
        let m = block.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
        block[rng.below(32)] = -1.5 * m - 0.1;
    }
    cases.push(("negative_max", negmax));
    // +a and -a both the largest magnitude: the first one must win.
    let mut ties = normal(rng, 1.0);
    for block in ties.chunks_exact_mut(32) {
        let a = 4.0 + rng.unit() as f32;
        let i = rng.below(16);
        let j = 16 + rng.below(16);
        let (first, second) = if rng.below(2) == 0 { (a, -a) } else { (-a, a) };
        block[i] = first;
        block[j] = second;
    }
    cases.push(("ties", ties));
    // Exact halves after scaling: x * id lands on k + 0.5, testing the rounding rules.
    let mut halves = Vec::with_capacity(N);
    for _ in 0..N / 32 {
        let s = [127.0f32, 8.0, 16.0, 15.0, 31.0, 7.5][rng.below(6)];
        let lead = if rng.below(2) == 0 { s } else { -s };
        halves.push(lead);
        for _ in 1..32 {
            let k = rng.below((4.0 * s) as usize + 1) as f32 * 0.5 - s;
            halves.push(k);
        }
    }
    cases.push(("half_grid", halves));
    // Block-wise scales across 16 orders of magnitude.
    let mut mixed = Vec::with_capacity(N);
    for _ in 0..N / 32 {
        let scale = 10f32.powi(rng.below(17) as i32 - 8);
        mixed.extend((0..32).map(|_| rng.normal() * scale));
    }
    cases.push(("mixed_scale", mixed));
    // At most one special value per 32-block, so which NaN wins is never in question.
    let specials = [
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7fc1_2345),
        f32::from_bits(0xffd4_3210),
        -0.0,
        1e-40,
        65504.0,
        65520.0,
        -65519.0,
        6.1e-5,
        5.96e-8,
        3.0e38,
    ];
    let mut special = normal(rng, 1.0);
    for block in special.chunks_exact_mut(32) {
        if rng.below(3) != 0 {
            block[rng.below(32)] = specials[rng.below(specials.len())];
        }
    }
    cases.push(("specials", special));
    // Arbitrary bit patterns, NaNs excepted (their payloads are not part of the contract).
    let bits = (0..N)
        .map(|_| {
            let v = f32::from_bits(rng.next_u64() as u32);
            if v.is_nan() {
                rng.normal()
            } else {
                v
            }
        })
        .collect();
    cases.push(("bits", bits));
    cases
}

/// Random blocks of `ty` with every f16 field (`half_offsets` within the block) finite.
fn random_blocks(rng: &mut Rng, ty: GgmlType, n_blocks: usize, half_offsets: &[usize]) -> Vec<u8> {
    let size = ty.type_size();
    let mut out: Vec<u8> = (0..n_blocks * size).map(|_| rng.next_u64() as u8).collect();
    for block in out.chunks_exact_mut(size) {
        for &off in half_offsets {
            let mut h = u16::from_le_bytes([block[off], block[off + 1]]);
            if h & 0x7c00 == 0x7c00 {
                h &= !0x0400; // exponent 31 -> 30: finite
            }
            block[off..off + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    out
}

/// Byte offsets of the f16 fields of each dequantize-only test type.
fn dequant_cases() -> Vec<(GgmlType, Vec<usize>)> {
    use GgmlType::*;
    vec![
        (Q4_0, vec![0]),
        (Q4_1, vec![0, 2]),
        (Q5_0, vec![0]),
        (Q5_1, vec![0, 2]),
        (Q8_0, vec![0]),
        (Q2_K, vec![80, 82]),
        (Q3_K, vec![108]),
        (Q4_K, vec![0, 2]),
        (Q5_K, vec![0, 2]),
        (Q6_K, vec![208]),
        (F16, vec![0]),
        (BF16, vec![]),
    ]
}

const QUANT_TYPES: [GgmlType; 7] = [
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
];

fn python() -> Option<PathBuf> {
    match std::env::var_os("POWERINFER_PYTHON") {
        Some(p) => Some(PathBuf::from(p)),
        None if std::env::var_os("CI").is_some() => {
            panic!("POWERINFER_PYTHON must be set when CI is set")
        }
        None => {
            println!("skipped: POWERINFER_PYTHON not set");
            None
        }
    }
}

fn f32s(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(bytes.len() % 4, 0, "{}", path.display());
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Our dequantization of `bytes`, from an aligned and from a misaligned copy (which must agree).
fn our_dequant(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let aligned = dequantize_to_vec(ty, bytes).unwrap();
    let mut shifted = vec![0u8; bytes.len() + 1];
    shifted[1..].copy_from_slice(bytes);
    let unaligned = dequantize_to_vec(ty, &shifted[1..]).unwrap();
    assert!(
        aligned
            .iter()
            .zip(&unaligned)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{ty}: misaligned input changed the result"
    );
    aligned
}

/// Our quantization of `values`, into an aligned and a misaligned buffer (which must agree).
fn our_quant(ty: GgmlType, values: &[f32]) -> Vec<u8> {
    let aligned = quantize_to_vec(ty, values).unwrap();
    let mut shifted = vec![0u8; aligned.len() + 1];
    quantize(ty, values, &mut shifted[1..]).unwrap();
    assert_eq!(
        aligned,
        &shifted[1..],
        "{ty}: misaligned output changed the result"
    );
    aligned
}

/// Describes the first few differing f32s, or `None` when all are bit-identical.
fn diff_f32(ours: &[f32], theirs: &[f32]) -> Option<String> {
    if ours.len() != theirs.len() {
        return Some(format!("length {} vs {}", ours.len(), theirs.len()));
    }
    let bad: Vec<String> = ours
        .iter()
        .zip(theirs)
        .enumerate()
        .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
        .take(4)
        .map(|(i, (a, b))| {
            format!(
                "[{i}] ours {a:e} ({:#010x}) ref {b:e} ({:#010x})",
                a.to_bits(),
                b.to_bits()
            )
        })
        .collect();
    (!bad.is_empty()).then(|| bad.join(", "))
}

/// Byte offsets of the f16 scale fields in a block of the quantized types.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 => &[0, 2],
        _ => &[],
    }
}

/// A copy of `block` whose NaN f16 scales are all 0x7e00: a block holding a NaN gets a NaN
/// scale on both sides, but which NaN numpy's reductions return depends on where it sits.
fn canonical_nans(ty: GgmlType, block: &[u8]) -> Vec<u8> {
    let mut b = block.to_vec();
    for &off in scale_offsets(ty) {
        let h = u16::from_le_bytes([b[off], b[off + 1]]);
        if h & 0x7c00 == 0x7c00 && h & 0x03ff != 0 {
            b[off..off + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
        }
    }
    b
}

fn diff_bytes(ty: GgmlType, ours: &[u8], theirs: &[u8]) -> Option<String> {
    if ours.len() != theirs.len() {
        return Some(format!("length {} vs {}", ours.len(), theirs.len()));
    }
    let size = ty.type_size();
    let bad: Vec<String> = ours
        .chunks_exact(size)
        .zip(theirs.chunks_exact(size))
        .enumerate()
        .filter(|(_, (a, b))| canonical_nans(ty, a) != canonical_nans(ty, b))
        .take(2)
        .map(|(i, (a, b))| format!("block {i}: ours {a:02x?} ref {b:02x?}"))
        .collect();
    (!bad.is_empty()).then(|| bad.join("; "))
}

#[test]
fn codecs_match_gguf_quants_bit_for_bit() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x005e_ed0f_9915);
    let mut manifest = String::new();

    // (name, type, input values) for quantization cases.
    let mut quant_cases = Vec::new();
    for (dist, values) in distributions(&mut rng) {
        let input = dir.path().join(format!("{dist}.f32"));
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(&input, bytes).unwrap();
        for ty in QUANT_TYPES {
            let prefix = dir.path().join(format!("q-{dist}-{ty}"));
            manifest.push_str(&format!(
                "quant {ty} {} {}\n",
                input.display(),
                prefix.display()
            ));
            quant_cases.push((dist, ty, values.clone(), prefix));
        }
    }
    let mut dequant_cases_run = Vec::new();
    for (ty, offsets) in dequant_cases() {
        let n_blocks = if ty.block_size() == 1 { 4096 } else { 64 };
        let blocks = random_blocks(&mut rng, ty, n_blocks, &offsets);
        let input = dir.path().join(format!("d-{ty}.bin"));
        std::fs::write(&input, &blocks).unwrap();
        let prefix = dir.path().join(format!("d-{ty}"));
        manifest.push_str(&format!(
            "dequant {ty} {} {}\n",
            input.display(),
            prefix.display()
        ));
        dequant_cases_run.push((ty, blocks, prefix));
    }
    // Blocks from our K-quant quantizers (which gguf.quants lacks) as dequantization input:
    // realistic scale patterns rather than random ones.
    for (dist, values) in distributions(&mut rng).into_iter().filter(|(d, _)| {
        matches!(
            *d,
            "normal" | "mixed_scale" | "specials" | "equal_blocks" | "positive"
        )
    }) {
        for ty in [
            GgmlType::Q2_K,
            GgmlType::Q3_K,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            let blocks = quantize_to_vec(ty, &values).unwrap();
            let input = dir.path().join(format!("k-{dist}-{ty}.bin"));
            std::fs::write(&input, &blocks).unwrap();
            let prefix = dir.path().join(format!("k-{dist}-{ty}"));
            manifest.push_str(&format!(
                "dequant {ty} {} {}\n",
                input.display(),
                prefix.display()
            ));
            dequant_cases_run.push((ty, blocks, prefix));
        }
    }
    let manifest_path = dir.path().join("manifest.txt");
    std::fs::write(&manifest_path, manifest).unwrap();

    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/quants_ref.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(&manifest_path)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", python.display()));
    assert!(
        out.status.success(),
        "quants_ref.py failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );

    let mut failures = Vec::new();
    let mut checked = 0;
    for (dist, ty, values, prefix) in &quant_cases {
        let theirs_q = std::fs::read(prefix.with_extension("q")).unwrap();
        let ours_q = our_quant(*ty, values);
        if let Some(d) = diff_bytes(*ty, &ours_q, &theirs_q) {
            failures.push(format!("quantize {ty} {dist}: {d}"));
        }
        let theirs_dq = f32s(&prefix.with_extension("dq"));
        // Dequantize the reference's bytes, so a quantization difference is reported once.
        if let Some(d) = diff_f32(&our_dequant(*ty, &theirs_q), &theirs_dq) {
            failures.push(format!("dequantize {ty} {dist}: {d}"));
        }
        checked += 1;
    }
    for (ty, blocks, prefix) in &dequant_cases_run {
        let theirs = f32s(&prefix.with_extension("dq"));
        if let Some(d) = diff_f32(&our_dequant(*ty, blocks), &theirs) {
            failures.push(format!("dequantize random {ty}: {d}"));
        }
        checked += 1;
    }
    assert!(checked > 100, "only {checked} cases ran");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
