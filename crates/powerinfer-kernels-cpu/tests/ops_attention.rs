//! Attention over an F16 KV cache against `reference::ops::attention`, on every instruction set
//! of this CPU: GQA ratios 1, 2, 4, 8, odd head sizes, 1 to a few hundred cached positions,
//! prompt blocks, thread counts.

use half::f16;
use powerinfer_kernels_cpu::ops::attention::{
    attention, attention_block, attention_block_with, attention_part, attention_with, merge_parts,
    AttentionParams, AttentionPart,
};
use powerinfer_kernels_cpu::reference::ops as r;
use powerinfer_kernels_cpu::Backend;
use powerinfer_kernels_cpu::{KernelError, ThreadPool};
use proptest::prelude::*;

const U: f64 = 1.0 / (1u64 << 24) as f64;

/// A deterministic pseudo-random f32 in [-1, 1) (SplitMix64).
fn rnd(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

struct Case {
    p: AttentionParams,
    q: Vec<f32>,
    k: Vec<f16>,
    v: Vec<f16>,
}

/// `n_tokens` query rows over `n_pos` cache rows; `q_amp` scales the queries (sharper softmax).
fn make_case(
    n_kv: usize,
    group: usize,
    d: usize,
    n_pos: usize,
    n_tokens: usize,
    q_amp: f32,
    seed: u64,
) -> Case {
    let p = AttentionParams::new(n_kv * group, n_kv, d);
    let mut s = seed;
    let q = (0..n_tokens * p.q_len())
        .map(|_| q_amp * rnd(&mut s))
        .collect();
    let k = (0..n_pos * p.kv_row_len())
        .map(|_| f16::from_f32(rnd(&mut s)))
        .collect();
    let v = (0..n_pos * p.kv_row_len())
        .map(|_| f16::from_f32(rnd(&mut s)))
        .collect();
    Case { p, q, k, v }
}

/// Error bound for one output head: the f32 dot products err by at most (d + 2)·u·scale·Σ|q||k|,
/// which moves each softmax weight by at most twice that (relative); exp, the max subtraction and
/// the normalisation add a few roundings relative to the size of the scores; the f32 weighted sum
/// adds (n + 2) roundings of max|v|.
fn head_tol(c: &Case, t: usize, h: usize, n_ctx: usize) -> f64 {
    let d = c.p.head_dim;
    let kv_row = c.p.kv_row_len();
    let off = (h / (c.p.n_head / c.p.n_kv_head)) * d;
    let qh = &c.q[t * c.p.q_len() + h * d..][..d];
    let mut ds = 0f64;
    let mut smax = 0f64;
    let mut vmax = 0f64;
    for pos in 0..n_ctx {
        let kh = &c.k[pos * kv_row + off..][..d];
        let abs: f64 = qh
            .iter()
            .zip(kh)
            .map(|(&a, &b)| (f64::from(a) * f64::from(b.to_f32())).abs())
            .sum();
        ds = ds.max((d as f64 + 2.0) * U * f64::from(c.p.scale) * abs);
        smax = smax.max(f64::from(c.p.scale) * abs);
        let vh = &c.v[pos * kv_row + off..][..d];
        vmax = vmax.max(
            vh.iter()
                .fold(0f64, |a, &b| a.max(f64::from(b.to_f32()).abs())),
        );
    }
    vmax * (4.0 * ds + U * (8.0 * smax + 16.0) + (n_ctx as f64 + 2.0) * U) + 1e-30
}

fn check_against_reference(c: &Case, n_tokens: usize, isa: Backend, pool: &ThreadPool) {
    let mut out = vec![f32::NAN; n_tokens * c.p.q_len()];
    attention_block_with(isa, pool, &c.q, &c.k, &c.v, n_tokens, &c.p, &mut out).unwrap();
    let want = r::attention_block(
        &c.q,
        &c.k,
        &c.v,
        n_tokens,
        c.p.n_head,
        c.p.n_kv_head,
        c.p.head_dim,
        f64::from(c.p.scale),
    );
    let n_pos = c.k.len() / c.p.kv_row_len();
    let d = c.p.head_dim;
    for t in 0..n_tokens {
        let n_ctx = n_pos - n_tokens + t + 1;
        for h in 0..c.p.n_head {
            let tol = head_tol(c, t, h, n_ctx);
            for i in 0..d {
                let j = t * c.p.q_len() + h * d + i;
                let err = (f64::from(out[j]) - want[j]).abs();
                assert!(
                    err <= tol,
                    "{} {:?} tok {t} head {h} elem {i}: got {} want {} err {err:e} > {tol:e}",
                    isa.name(),
                    c.p,
                    out[j],
                    want[j]
                );
            }
        }
    }
}

#[test]
fn gqa_ratios_and_lengths_match_reference() {
    let pool = ThreadPool::single();
    for group in [1usize, 2, 4, 8] {
        for (n_kv, d) in [(1usize, 128usize), (2, 64), (1, 72)] {
            for n_pos in [1usize, 2, 7, 33, 130, 300] {
                let c = make_case(
                    n_kv,
                    group,
                    d,
                    n_pos,
                    1,
                    1.0,
                    (group * 1000 + n_pos * 7 + d) as u64,
                );
                for isa in Backend::available() {
                    check_against_reference(&c, 1, isa, &pool);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_shapes_match_reference(
        n_kv in 1usize..4,
        group in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
        d in 1usize..100,
        n_pos in 1usize..260,
        n_tokens in 1usize..5,
        q_amp in prop::sample::select(vec![0.1f32, 1.0, 4.0]),
        seed in any::<u64>(),
    ) {
        let n_tokens = n_tokens.min(n_pos);
        let c = make_case(n_kv, group, d, n_pos, n_tokens, q_amp, seed);
        for isa in Backend::available() {
            check_against_reference(&c, n_tokens, isa, &ThreadPool::single());
        }
        // Threads (and the split of query-head groups they cause) change nothing, bit for bit.
        let len = n_tokens * c.p.q_len();
        let (mut one, mut four) = (vec![0f32; len], vec![0f32; len]);
        attention_block(&ThreadPool::single(), &c.q, &c.k, &c.v, n_tokens, &c.p, &mut one).unwrap();
        attention_block(&ThreadPool::new(4), &c.q, &c.k, &c.v, n_tokens, &c.p, &mut four).unwrap();
        prop_assert_eq!(one, four);
    }
}

#[test]
fn very_large_groups_match_reference() {
    // 80 query heads per kv head (Falcon-40B has 16), and group splitting across 16 threads.
    let c = make_case(1, 80, 8, 20, 2, 1.0, 3);
    for isa in Backend::available() {
        check_against_reference(&c, 2, isa, &ThreadPool::single());
        check_against_reference(&c, 2, isa, &ThreadPool::new(16));
    }
    // Heads of 16 (the AVX-512 lane path): five items of rows per token, fewer rows per item
    // for 16 threads.
    let c = make_case(1, 80, 16, 20, 2, 1.0, 4);
    for isa in Backend::available() {
        check_against_reference(&c, 2, isa, &ThreadPool::single());
        check_against_reference(&c, 2, isa, &ThreadPool::new(16));
    }
}

#[test]
fn block_equals_single_token_attentions_bit_for_bit() {
    let pool = ThreadPool::new(3);
    for (group, d, n_pos, n_tokens) in [
        (4usize, 64usize, 40usize, 40usize),
        (1, 17, 50, 9),
        (8, 128, 200, 16),
        // AVX-512 lane path: items of 16 (token, head) rows that cut tokens unevenly.
        (3, 48, 70, 23),
        (16, 16, 30, 7),
        (2, 80, 33, 33),
    ] {
        let c = make_case(2, group, d, n_pos, n_tokens, 1.0, 42 + d as u64);
        let kv_row = c.p.kv_row_len();
        let q_len = c.p.q_len();
        for isa in Backend::available() {
            let mut block = vec![0f32; n_tokens * q_len];
            attention_block_with(isa, &pool, &c.q, &c.k, &c.v, n_tokens, &c.p, &mut block).unwrap();
            for t in 0..n_tokens {
                let end = (n_pos - n_tokens + t + 1) * kv_row;
                let mut one = vec![0f32; q_len];
                attention_with(
                    isa,
                    &ThreadPool::single(),
                    &c.q[t * q_len..][..q_len],
                    &c.k[..end],
                    &c.v[..end],
                    &c.p,
                    &mut one,
                )
                .unwrap();
                assert_eq!(
                    &block[t * q_len..][..q_len],
                    &one[..],
                    "{} token {t}",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let c = make_case(2, 4, 64, 150, 5, 1.0, 7);
    let len = 5 * c.p.q_len();
    let mut base = vec![0f32; len];
    attention_block(&ThreadPool::single(), &c.q, &c.k, &c.v, 5, &c.p, &mut base).unwrap();
    for n in [2usize, 3, 16] {
        let pool = ThreadPool::new(n);
        let mut out = vec![0f32; len];
        attention_block(&pool, &c.q, &c.k, &c.v, 5, &c.p, &mut out).unwrap();
        assert_eq!(base, out, "{n} threads");
        let mut one = vec![0f32; c.p.q_len()];
        attention(
            &pool,
            &c.q[..c.p.q_len()],
            &c.k[..146 * c.p.kv_row_len()],
            &c.v[..146 * c.p.kv_row_len()],
            &c.p,
            &mut one,
        )
        .unwrap();
        assert_eq!(&base[..c.p.q_len()], &one[..], "{n} threads, one token");
    }
}

#[test]
fn one_position_returns_its_value_row() {
    let c = make_case(2, 2, 24, 1, 1, 3.0, 9);
    let mut out = vec![0f32; c.p.q_len()];
    for isa in Backend::available() {
        attention_with(isa, &ThreadPool::single(), &c.q, &c.k, &c.v, &c.p, &mut out).unwrap();
        for h in 0..c.p.n_head {
            let kv = h / 2;
            for i in 0..24 {
                assert_eq!(out[h * 24 + i], c.v[kv * 24 + i].to_f32());
            }
        }
    }
}

#[test]
fn rejects_bad_arguments() {
    let c = make_case(2, 2, 8, 3, 1, 1.0, 1);
    let pool = ThreadPool::single();
    let mut out = vec![0f32; c.p.q_len()];
    let bad = |p: AttentionParams, q: &[f32], k: &[f16], v: &[f16], out: &mut [f32]| {
        attention(&pool, q, k, v, &p, out)
    };
    assert!(matches!(
        bad(AttentionParams::new(4, 3, 8), &c.q, &c.k, &c.v, &mut out),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        bad(AttentionParams::new(0, 1, 8), &c.q, &c.k, &c.v, &mut out),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        bad(c.p, &c.q[1..], &c.k, &c.v, &mut out),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        bad(c.p, &c.q, &c.k, &c.v, &mut out[1..]),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        bad(c.p, &c.q, &c.k[1..], &c.v[1..], &mut out),
        Err(KernelError::Shape(_))
    ));
    assert!(matches!(
        bad(c.p, &c.q, &c.k, &c.v[16..], &mut out),
        Err(KernelError::Length { .. })
    ));
    assert!(matches!(
        bad(c.p, &c.q, &[], &[], &mut out),
        Err(KernelError::Shape(_))
    ));
    let mut out4 = vec![0f32; 4 * c.p.q_len()];
    let q4 = vec![0f32; 4 * c.p.q_len()];
    assert!(matches!(
        attention_block(&pool, &q4, &c.k, &c.v, 4, &c.p, &mut out4),
        Err(KernelError::Shape(_))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Two parts over `[0, s)` and `[s, n)` (either may be empty), merged, are the attention
    /// over `[0, n)`: against the f64 reference with twice the whole kernel's bound (the sums
    /// are split in two and rescaled once).
    #[test]
    fn split_parts_merge_into_the_whole_attention(
        n_kv in 1usize..3,
        group_log in 0u32..3,
        d in 1usize..80,
        n_pos in 1usize..200,
        split in 0.0f64..=1.0,
        q_amp in prop_oneof![Just(1.0f32), Just(8.0f32)],
        seed in any::<u64>(),
    ) {
        let c = make_case(n_kv, 1 << group_log, d, n_pos, 1, q_amp, seed);
        let row = c.p.kv_row_len();
        let s = ((split * n_pos as f64) as usize).min(n_pos);
        let (mut a, mut b) = (AttentionPart::default(), AttentionPart::default());
        attention_part(&c.q, &c.k[..s * row], &c.v[..s * row], &c.p, &mut a).unwrap();
        attention_part(&c.q, &c.k[s * row..], &c.v[s * row..], &c.p, &mut b).unwrap();
        let mut out = vec![f32::NAN; c.p.q_len()];
        merge_parts(&a, &b, &c.p, &mut out).unwrap();
        // The merge is symmetric.
        let mut back = vec![f32::NAN; c.p.q_len()];
        merge_parts(&b, &a, &c.p, &mut back).unwrap();
        prop_assert_eq!(&out, &back);
        let want = r::attention(&c.q, &c.k, &c.v, c.p.n_head, c.p.n_kv_head, d, f64::from(c.p.scale));
        for h in 0..c.p.n_head {
            let tol = 2.0 * head_tol(&c, 0, h, n_pos);
            for i in 0..d {
                let err = (f64::from(out[h * d + i]) - want[h * d + i]).abs();
                prop_assert!(err <= tol, "s {s} of {n_pos}, head {h} elem {i}: err {err:e} > {tol:e}");
            }
        }
    }
}

#[test]
fn attention_parts_refuse_bad_shapes() {
    let p = AttentionParams::new(4, 2, 8);
    let q = vec![0.5f32; p.q_len()];
    let row = vec![f16::from_f32(0.25); p.kv_row_len()];
    let mut part = AttentionPart::default();
    assert!(attention_part(&q[1..], &row, &row, &p, &mut part).is_err());
    assert!(attention_part(&q, &row[1..], &row[1..], &p, &mut part).is_err());
    assert!(attention_part(&q, &row, &row[..8], &p, &mut part).is_err());
    attention_part(&q, &[], &[], &p, &mut part).unwrap();
    assert_eq!(part, AttentionPart::empty(&p));
    let mut out = vec![0f32; p.q_len()];
    assert!(
        merge_parts(&part, &part, &p, &mut out).is_err(),
        "both empty"
    );
    let mut one = AttentionPart::default();
    attention_part(&q, &row, &row, &p, &mut one).unwrap();
    merge_parts(&one, &part, &p, &mut out).unwrap();
    // One position: the output is its V row, whatever the score.
    assert!(out.iter().all(|&x| (x - 0.25).abs() < 1e-6), "{out:?}");
    assert!(merge_parts(&one, &part, &p, &mut out[1..]).is_err());
}
