//! Unit and property tests of the quantization codecs that need no Python: error bounds of
//! quantize -> dequantize round trips, an element-by-element reference for every block layout,
//! typed length errors, and alignment independence. Bit-exactness against `gguf.quants` is in
//! `quants_conformance.rs`.

use half::f16;
use powerinfer_gguf::quants::*;
use powerinfer_gguf::GgmlType;
use proptest::prelude::*;

fn h(x: f16) -> f32 {
    x.to_f32()
}

/// Values of one 32-block with a random overall scale (small enough that f16 scales and
/// minimums stay finite).
fn block32() -> impl Strategy<Value = Vec<f32>> {
    (prop::collection::vec(-1.0f32..1.0, 32), -6i32..5).prop_map(|(v, e)| {
        let s = 10f32.powi(e);
        v.into_iter().map(|x| x * s).collect()
    })
}

fn block256() -> impl Strategy<Value = Vec<f32>> {
    (prop::collection::vec(-1.0f32..1.0, 256), -6i32..6).prop_map(|(v, e)| {
        let s = 10f32.powi(e);
        v.into_iter().map(|x| x * s).collect()
    })
}

/// Relative error of f32 -> f16 rounding for normal numbers.
const F16_EPS: f64 = 1.0 / 2048.0;

proptest! {
    #[test]
    fn q8_0_error_is_at_most_half_a_step(x in block32()) {
        let b = BlockQ8_0::quantize(&x);
        let mut y = [0.0f32; 32];
        b.dequantize(&mut y);
        let d = x.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs()))) / 127.0;
        let d16 = f64::from(h(b.d));
        for (a, r) in x.iter().zip(y) {
            let bound = d / 2.0 + 127.0 * (d - d16).abs() + 1e-6 * d;
            prop_assert!((f64::from(*a) - f64::from(r)).abs() <= bound, "{a} -> {r}, d {d}");
        }
    }

    #[test]
    fn q8_1_sum_field_is_scaled_sum(x in block32()) {
        let b = BlockQ8_1::quantize(&x);
        let q0 = BlockQ8_0::quantize(&x);
        prop_assert_eq!(b.qs, q0.qs);
        prop_assert_eq!(b.d, q0.d);
        let sum: i32 = b.qs.iter().map(|&q| i32::from(q)).sum();
        let d = x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        prop_assert_eq!(b.s, f16::from_f32(sum as f32 * d));
    }

    #[test]
    fn q4_0_and_q5_0_errors_are_bounded(x in block32()) {
        let amax = x.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        for (levels, ty) in [(8.0, GgmlType::Q4_0), (16.0, GgmlType::Q5_0)] {
            let bytes = quantize_to_vec(ty, &x).unwrap();
            let y = dequantize_to_vec(ty, &bytes).unwrap();
            let d = amax / levels;
            let d16 = f64::from(h(f16::from_le_bytes([bytes[0], bytes[1]]))).abs();
            // Half a step, but a whole step where +max is clipped to the top level.
            let bound = d + levels * (d - d16).abs() + 1e-6 * d;
            for (a, r) in x.iter().zip(&y) {
                prop_assert!((f64::from(*a) - f64::from(*r)).abs() <= bound, "{ty}: {a} -> {r}");
            }
        }
    }

    #[test]
    fn q4_1_and_q5_1_errors_are_bounded(x in block32()) {
        let min = x.iter().fold(f64::INFINITY, |m, v| m.min(f64::from(*v)));
        let max = x.iter().fold(f64::NEG_INFINITY, |m, v| m.max(f64::from(*v)));
        for (levels, ty) in [(15.0, GgmlType::Q4_1), (31.0, GgmlType::Q5_1)] {
            let bytes = quantize_to_vec(ty, &x).unwrap();
            let y = dequantize_to_vec(ty, &bytes).unwrap();
            let d = (max - min) / levels;
            let d16 = f64::from(h(f16::from_le_bytes([bytes[0], bytes[1]])));
            // f16 rounding of the minimum: relative, or 2^-25 absolute among subnormals.
            let bound = d / 2.0 + levels * (d - d16).abs() + min.abs() * F16_EPS + 3e-8
                + 1e-6 * (d + min.abs());
            for (a, r) in x.iter().zip(&y) {
                prop_assert!((f64::from(*a) - f64::from(*r)).abs() <= bound, "{ty}: {a} -> {r}");
            }
        }
    }

    #[test]
    fn q8_k_error_and_block_sums(x in block256()) {
        let b = BlockQ8K::quantize(&x);
        let mut y = vec![0.0f32; 256];
        b.dequantize(&mut y);
        let amax = x.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        let d = amax / 127.0;
        prop_assert!((f64::from(b.d.abs()) - d).abs() <= 1e-6 * d);
        for (a, r) in x.iter().zip(&y) {
            prop_assert!((f64::from(*a) - f64::from(*r)).abs() <= d * (0.5 + 1e-5), "{a} -> {r}");
        }
        for (s, qs) in b.bsums.iter().zip(b.qs.chunks_exact(16)) {
            prop_assert_eq!(i32::from(*s), qs.iter().map(|&q| i32::from(q)).sum::<i32>());
        }
    }

    #[test]
    fn k_quant_round_trips_are_close(x in block256()) {
        let amax = x.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
        let energy: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        // Worst cases seen on Gaussian and uniform data (Q2_K / Q3_K / Q4_K / Q5_K / Q6_K): max
        // error 0.42 / 0.26 / 0.18 / 0.07 / 0.02 of the largest magnitude, relative RMS error
        // 0.36 / 0.18 / 0.07 / 0.04 / 0.017; the bounds leave some room. Small blocks
        // have f16-subnormal super-block scales, whose 2^-25 rounding error times the largest
        // sub-block scale and level (Q6_K: 128 * 32) adds an absolute term.
        let slack = 128.0 * 32.0 * 2f64.powi(-25);
        for (ty, max_rel, rms_rel) in [
            (GgmlType::Q2_K, 0.6, 0.45),
            (GgmlType::Q3_K, 0.35, 0.25),
            (GgmlType::Q4_K, 0.25, 0.1),
            (GgmlType::Q5_K, 0.12, 0.06),
            (GgmlType::Q6_K, 0.03, 0.025),
        ] {
            let y = dequantize_to_vec(ty, &quantize_to_vec(ty, &x).unwrap()).unwrap();
            let mut err2 = 0.0f64;
            for (a, r) in x.iter().zip(&y) {
                let e = (f64::from(*a) - f64::from(*r)).abs();
                prop_assert!(e <= max_rel * amax + slack, "{ty}: {a} -> {r} (max |x| {amax})");
                err2 += e * e;
            }
            let rms_bound = rms_rel * energy.sqrt() + slack * 16.0;
            prop_assert!(err2.sqrt() <= rms_bound, "{ty}: rms error {}", (err2 / energy).sqrt());
        }
    }

    #[test]
    fn f16_and_bf16_round_trips(v in prop::collection::vec(-60000.0f32..60000.0, 1..300)) {
        let f = dequantize_to_vec(GgmlType::F16, &quantize_to_vec(GgmlType::F16, &v).unwrap()).unwrap();
        let b = dequantize_to_vec(GgmlType::BF16, &quantize_to_vec(GgmlType::BF16, &v).unwrap()).unwrap();
        for ((x, f), b) in v.iter().zip(&f).zip(&b) {
            let x = f64::from(*x);
            // Absolute slack for f16 subnormals (spacing 2^-24).
            prop_assert!((x - f64::from(*f)).abs() <= x.abs() * F16_EPS + 6e-8);
            prop_assert!((x - f64::from(*b)).abs() <= x.abs() / 256.0);
        }
    }

    #[test]
    fn every_dequantizer_matches_elementwise_reference(seed in any::<u64>(), n_blocks in 1usize..4) {
        for ty in [
            GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
            GgmlType::Q8_1, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K,
            GgmlType::Q6_K, GgmlType::Q8_K, GgmlType::F16, GgmlType::BF16,
        ] {
            let bytes = random_blocks(seed ^ u64::from(ty.id()), ty, n_blocks);
            let ours = dequantize_to_vec(ty, &bytes).unwrap();
            let want = reference_dequantize(ty, &bytes);
            prop_assert_eq!(ours.len(), want.len());
            for (i, (a, b)) in ours.iter().zip(&want).enumerate() {
                prop_assert_eq!(a.to_bits(), b.to_bits(), "{} value {}: {} vs {}", ty, i, a, b);
            }
        }
    }

    #[test]
    fn alignment_does_not_matter(seed in any::<u64>(), shift in 1usize..8) {
        for ty in [GgmlType::Q4_0, GgmlType::Q6_K, GgmlType::Q8_K, GgmlType::F16, GgmlType::Q5_K] {
            let bytes = random_blocks(seed, ty, 3);
            let mut buf = vec![0u8; bytes.len() + shift];
            buf[shift..].copy_from_slice(&bytes);
            let a = dequantize_to_vec(ty, &bytes).unwrap();
            let b = dequantize_to_vec(ty, &buf[shift..]).unwrap();
            prop_assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
        let x: Vec<f32> = (0..512).map(|i| ((i as f32) * 0.37 + seed as f32).sin()).collect();
        for ty in [GgmlType::Q4_0, GgmlType::Q5_1, GgmlType::Q8_0, GgmlType::Q8_K, GgmlType::F16, GgmlType::BF16] {
            let want = quantize_to_vec(ty, &x).unwrap();
            let mut buf = vec![0u8; want.len() + shift];
            quantize(ty, &x, &mut buf[shift..]).unwrap();
            prop_assert_eq!(&buf[shift..], &want[..]);
        }
    }
}

/// Deterministic random blocks of `ty` whose f16 and f32 scale fields are finite.
fn random_blocks(seed: u64, ty: GgmlType, n_blocks: usize) -> Vec<u8> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as u8
    };
    let size = ty.type_size();
    let mut out: Vec<u8> = (0..n_blocks * size).map(|_| next()).collect();
    let halves: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q8_1 | GgmlType::Q4_K | GgmlType::Q5_K => {
            &[0, 2]
        }
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        GgmlType::F16 => &[0],
        _ => &[],
    };
    for block in out.chunks_exact_mut(size) {
        for &o in halves {
            block[o + 1] &= 0xbb; // clears an exponent bit: never inf/NaN
        }
        if ty == GgmlType::Q8_K {
            block[3] &= 0xbf; // f32 exponent below all-ones
        }
    }
    out
}

fn rd16(b: &[u8], o: usize) -> f32 {
    f16::from_le_bytes([b[o], b[o + 1]]).to_f32()
}

/// Value `i` of one block, straight from the ggml block layouts, in the reference's order of
/// float operations.
fn reference_value(ty: GgmlType, b: &[u8], i: usize) -> f32 {
    use GgmlType::*;
    match ty {
        Q4_0 | Q4_1 | Q5_0 | Q5_1 => {
            let (qs_at, has_m, has_h) = match ty {
                Q4_0 => (2, false, false),
                Q4_1 => (4, true, false),
                Q5_0 => (6, false, true),
                _ => (8, true, true),
            };
            let byte = b[qs_at + i % 16];
            let mut q = if i < 16 { byte & 15 } else { byte >> 4 } as i32;
            if has_h {
                let qh =
                    u32::from_le_bytes([b[qs_at - 4], b[qs_at - 3], b[qs_at - 2], b[qs_at - 1]]);
                q |= (((qh >> i) & 1) as i32) << 4;
            }
            let d = rd16(b, 0);
            if has_m {
                d * q as f32 + rd16(b, 2)
            } else {
                let offset = if has_h { 16 } else { 8 };
                d * (q - offset) as f32
            }
        }
        Q8_0 => f32::from(b[2 + i] as i8) * rd16(b, 0),
        Q8_1 => f32::from(b[4 + i] as i8) * rd16(b, 0),
        Q8_K => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * f32::from(b[4 + i] as i8),
        Q2_K => {
            let (h, r) = (i / 128, i % 128);
            let q = (b[16 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
            let sc = b[i / 16];
            let dl = rd16(b, 80) * f32::from(sc & 15);
            let ml = rd16(b, 82) * f32::from(sc >> 4);
            dl * f32::from(q) - ml
        }
        Q3_K => {
            let (h, r) = (i / 128, i % 128);
            let low = (b[32 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
            let high = (b[r % 32] >> (4 * h + r / 32)) & 1;
            let q = i32::from(low) - if high == 0 { 4 } else { 0 };
            let s = i / 16;
            let sb = &b[96..108];
            let low_s = if s < 8 { sb[s] & 15 } else { sb[s - 8] >> 4 };
            let high_s = (sb[8 + s % 4] >> (2 * (s / 4))) & 3;
            let sc = i32::from(low_s | (high_s << 4)) - 32;
            (rd16(b, 108) * sc as f32) * q as f32
        }
        Q4_K | Q5_K => {
            let sb = &b[4..16];
            let j = i / 32;
            let (sc, m) = if j < 4 {
                (sb[j] & 63, sb[j + 4] & 63)
            } else {
                (
                    (sb[j + 4] & 15) | ((sb[j - 4] >> 6) << 4),
                    (sb[j + 4] >> 4) | ((sb[j] >> 6) << 4),
                )
            };
            let qs_at = if ty == Q4_K { 16 } else { 48 };
            let byte = b[qs_at + 32 * (i / 64) + i % 32];
            let mut q = if (i / 32) % 2 == 0 {
                byte & 15
            } else {
                byte >> 4
            };
            if ty == Q5_K {
                q |= ((b[16 + i % 32] >> j) & 1) << 4;
            }
            (rd16(b, 0) * f32::from(sc)) * f32::from(q) - rd16(b, 2) * f32::from(m)
        }
        Q6_K => {
            let (h, r) = (i / 128, i % 128);
            let l = b[64 * h + r % 64];
            let low = if r < 64 { l & 15 } else { l >> 4 };
            let high = (b[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
            let q = i32::from(low | (high << 4)) - 32;
            (rd16(b, 208) * f32::from(b[192 + i / 16] as i8)) * q as f32
        }
        F16 => rd16(b, 0),
        BF16 => f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
        _ => unreachable!("not a test type"),
    }
}

fn reference_dequantize(ty: GgmlType, bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(ty.type_size())
        .flat_map(|b| (0..ty.block_size()).map(move |i| reference_value(ty, b, i)))
        .collect()
}

#[test]
fn length_errors_are_typed_and_leave_dst_alone() {
    let mut dst = vec![7.0f32; 64];
    assert_eq!(
        dequantize(GgmlType::Q4_0, &[0u8; 17], &mut dst),
        Err(QuantError::PartialBlockBytes {
            ty: GgmlType::Q4_0,
            len: 17,
            type_size: 18
        })
    );
    assert_eq!(
        dequantize(GgmlType::Q4_0, &[0u8; 36], &mut dst[..63]),
        Err(QuantError::Length {
            ty: GgmlType::Q4_0,
            expected: 64,
            got: 63,
            unit: "values"
        })
    );
    assert!(dst.iter().all(|&v| v == 7.0));
    assert_eq!(
        dequantize(GgmlType::IQ2_XXS, &[0u8; 66], &mut dst),
        Err(QuantError::UnsupportedDequantize(GgmlType::IQ2_XXS))
    );
    let mut bytes = vec![9u8; 40];
    assert_eq!(
        quantize(GgmlType::Q8_0, &[1.0; 33], &mut bytes),
        Err(QuantError::PartialBlockValues {
            ty: GgmlType::Q8_0,
            len: 33,
            block_size: 32
        })
    );
    assert_eq!(
        quantize(GgmlType::Q8_0, &[1.0; 32], &mut bytes),
        Err(QuantError::Length {
            ty: GgmlType::Q8_0,
            expected: 34,
            got: 40,
            unit: "bytes"
        })
    );
    assert!(bytes.iter().all(|&b| b == 9));
    assert_eq!(
        quantize(GgmlType::IQ2_XXS, &[1.0; 256], &mut bytes),
        Err(QuantError::UnsupportedQuantize(GgmlType::IQ2_XXS))
    );
    assert_eq!(
        quantize_to_vec(GgmlType::MXFP4, &[0.0; 32]),
        Err(QuantError::UnsupportedQuantize(GgmlType::MXFP4))
    );
    let mut k_blocks = [BlockQ6K::quantize(&[0.0; 256])];
    assert_eq!(
        quantize_row_q6_k(&[0.0; 300], &mut k_blocks),
        Err(QuantError::PartialBlockValues {
            ty: GgmlType::Q6_K,
            len: 300,
            block_size: 256
        })
    );
    let mut blocks = [BlockQ8_0::quantize(&[0.0; 32]); 2];
    assert_eq!(
        quantize_row_q8_0(&[0.0; 32], &mut blocks),
        Err(QuantError::Length {
            ty: GgmlType::Q8_0,
            expected: 1,
            got: 2,
            unit: "blocks"
        })
    );
    assert_eq!(
        dequantize_row_q6_k(&[], &mut dst[..1]),
        Err(QuantError::Length {
            ty: GgmlType::Q6_K,
            expected: 0,
            got: 1,
            unit: "values"
        })
    );
    assert_eq!(values_in_bytes(GgmlType::Q6_K, 420), Ok(512));
    assert_eq!(bytes_for_values(GgmlType::Q5_1, 64), Ok(48));
    // The error message names the type and the numbers.
    let msg = dequantize(GgmlType::Q4_0, &[0u8; 17], &mut dst)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("Q4_0") && msg.contains("17") && msg.contains("18"),
        "{msg}"
    );
}

#[test]
fn support_lists_agree_with_dispatch() {
    for ty in GgmlType::ALL {
        let n = ty.block_size();
        let bytes = vec![0u8; ty.type_size()];
        let mut out = vec![0.0f32; n];
        assert_eq!(
            dequantize(ty, &bytes, &mut out).is_ok(),
            can_dequantize(ty),
            "{ty}"
        );
        assert_eq!(
            quantize_to_vec(ty, &vec![0.0; n]).is_ok(),
            can_quantize(ty),
            "{ty}"
        );
    }
}

#[test]
fn q8_k_zero_block_and_sign_convention() {
    let b = BlockQ8K::quantize(&[0.0; 256]);
    assert_eq!(b.d, 0.0);
    assert!(b.qs.iter().all(|&q| q == 0) && b.bsums.iter().all(|&s| s == 0));
    let mut x = [0.5f32; 256];
    x[10] = 2.0;
    let b = BlockQ8K::quantize(&x);
    // The largest value maps to -127 with a negative scale, as in llama.cpp.
    assert_eq!(b.qs[10], -127);
    assert_eq!(b.d, 1.0 / (-127.0 / 2.0));
    assert_eq!(b.qs[0], -32); // 0.5 * 63.5 = 31.75 -> 32
}

#[test]
fn k_quant_zero_and_constant_blocks() {
    // All-zero input: an all-zero block, dequantizing to zeros.
    assert_eq!(
        bytemuck::bytes_of(&BlockQ6K::quantize(&[0.0; 256])),
        &[0u8; 210][..]
    );
    let q4 = BlockQ4K::quantize(&[0.0; 256]);
    let mut y = [1.0f32; 256];
    q4.dequantize(&mut y);
    assert!(y.iter().all(|&v| v == 0.0));
    // A constant positive block is all minimum-free scale in Q4_K and reproduced closely.
    for ty in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let y = dequantize_to_vec(ty, &quantize_to_vec(ty, &[0.75; 256]).unwrap()).unwrap();
        assert!(
            y.iter().all(|&v| (v - 0.75).abs() < 0.75 / 30.0),
            "{ty}: {:?}",
            &y[..4]
        );
    }
}

#[test]
fn q4_0_known_block() {
    // max |x| is -8 -> d = 1, id = 1: q = trunc(x + 8.5).
    let mut x = [0.0f32; 32];
    x[0] = -8.0;
    x[1] = 7.0;
    x[2] = 0.5; // 9.0 -> 9
    x[3] = 0.49; // 8.99 -> 8
    x[16] = 7.6; // 16.1 -> clipped to 15
    let b = BlockQ4_0::quantize(&x);
    assert_eq!(b.d, f16::from_f32(1.0));
    assert_eq!(b.qs[0], 15 << 4); // x[0] -> 0, x[16] -> 15
    assert_eq!(b.qs[0] & 15, 0);
    assert_eq!(b.qs[1] & 15, 15);
    assert_eq!(b.qs[2] & 15, 9);
    assert_eq!(b.qs[3] & 15, 8);
    let mut y = [0.0f32; 32];
    b.dequantize(&mut y);
    assert_eq!(&y[..4], &[-8.0, 7.0, 1.0, 0.0]);
    assert_eq!(y[16], 7.0);
}

#[test]
fn bf16_rounding_and_nan() {
    assert_eq!(f32_to_bf16(1.0).to_bits(), 0x3f80);
    // Ties to even: 0x3f808000 is halfway between 0x3f80 and 0x3f81.
    assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)).to_bits(), 0x3f80);
    assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)).to_bits(), 0x3f82);
    assert_eq!(f32_to_bf16(f32::MAX).to_bits(), 0x7f80);
    // Signalling NaN becomes quiet, keeping sign and top payload.
    assert_eq!(f32_to_bf16(f32::from_bits(0xff80_0001)).to_bits(), 0xffc0);
    assert_eq!(bf16_to_f32(f32_to_bf16(-2.5)), -2.5);
    assert_eq!(f32_to_f16(65520.0), f16::INFINITY);
    assert_eq!(f32_to_f16(65519.0).to_f32(), 65504.0);
}

#[test]
fn typed_slice_helpers_check_lengths() {
    let src = [1.0f32, 2.0, 3.0];
    let mut h = [f16::ZERO; 3];
    f32_to_f16_slice(&src, &mut h).unwrap();
    let mut back = [0.0f32; 3];
    f16_to_f32_slice(&h, &mut back).unwrap();
    assert_eq!(back, src);
    let mut short = [0.0f32; 2];
    assert!(matches!(
        f16_to_f32_slice(&h, &mut short),
        Err(QuantError::Length { .. })
    ));
    let mut b = [half::bf16::ZERO; 3];
    f32_to_bf16_slice(&src, &mut b).unwrap();
    bf16_to_f32_slice(&b, &mut back).unwrap();
    assert_eq!(back, src);
}

#[test]
fn f16_bits_to_f32_is_exact_for_every_pattern() {
    for bits in 0..=u16::MAX {
        let ours = f16_bits_to_f32(bits);
        let want = f16::from_bits(bits).to_f32();
        if want.is_nan() {
            assert!(ours.is_nan(), "{bits:#06x}");
            assert_eq!(
                ours.is_sign_negative(),
                want.is_sign_negative(),
                "{bits:#06x}"
            );
            // The payload is kept, not quieted.
            assert_eq!(
                ours.to_bits() & 0x003f_ffff,
                u32::from(bits & 0x01ff) << 13,
                "{bits:#06x}"
            );
        } else {
            assert_eq!(ours.to_bits(), want.to_bits(), "{bits:#06x}");
        }
    }
}

#[test]
fn f32_to_f16_bits_matches_half() {
    // Every 65521st pattern (both signs, all exponents), plus the neighbourhoods of each
    // rounding boundary: the subnormal, normal and overflow thresholds and the ties between
    // them. (All 2^32 patterns were checked once in a release build.)
    let mut patterns: Vec<u32> = (0..=u32::MAX).step_by(65521).collect();
    for edge in [
        0x3300_0000u32,
        0x3380_0000,
        0x3880_0000,
        0x4780_0000,
        0x477f_f000,
        0x7f80_0000,
    ] {
        for d in 0..4096 {
            patterns.push(edge.wrapping_sub(2048).wrapping_add(d));
            patterns.push((edge.wrapping_sub(2048).wrapping_add(d)) | 0x8000_0000);
        }
    }
    for bits in patterns {
        let x = f32::from_bits(bits);
        assert_eq!(
            f32_to_f16_bits(x),
            f16::from_f32(x).to_bits(),
            "{bits:#010x}"
        );
    }
}
