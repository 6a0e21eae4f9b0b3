//! Attention over KV caches of every type (`ops::attention_kv`) against
//! `reference::ops::attention_kv` on the caches' exact values: F16, F32, BF16, Q8_0 and Q4_0
//! for K and V independently, head sizes 64, 80 (the float types: 80 is not whole 32-blocks),
//! 96 and 128, GQA ratios 1 to 8, prompt blocks and single tokens over up to 90 positions, every
//! instruction set of this CPU, 1 and 2 threads (bit for bit).

use powerinfer_kernels_cpu::ops::attention::AttentionParams;
use powerinfer_kernels_cpu::ops::attention_kv::{attention_kv, attention_kv_with};
use powerinfer_kernels_cpu::ops::kv::{KvBuf, KvType};
use powerinfer_kernels_cpu::reference::{matmul as rm, ops as r};
use powerinfer_kernels_cpu::{Backend, ThreadPool};
use proptest::prelude::*;

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
    k: KvBuf,
    v: KvBuf,
}

#[allow(clippy::too_many_arguments)]
fn case(
    (tk, tv): (KvType, KvType),
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
    let mut k = KvBuf::new(tk, n_kv, d).unwrap();
    let mut v = KvBuf::new(tv, n_kv, d).unwrap();
    // Appended in two pieces, as a prompt then decode tokens would be.
    let rows =
        |s: &mut u64, n: usize| -> Vec<f32> { (0..n * p.kv_row_len()).map(|_| rnd(s)).collect() };
    let first = n_pos / 2;
    for buf in [&mut k, &mut v] {
        buf.push_f32(&rows(&mut s, first)).unwrap();
        buf.push_f32(&rows(&mut s, n_pos - first)).unwrap();
    }
    Case { p, q, k, v }
}

/// The caches' exact values, row-major.
fn exact(b: &KvBuf) -> Vec<f64> {
    let bytes = b.rows_bytes(0, b.len()).unwrap();
    rm::dequantize(b.ty().ggml(), &bytes).unwrap()
}

fn check(c: &Case, n_tokens: usize, backend: Backend, pool: &ThreadPool) -> Vec<f32> {
    let mut out = vec![0f32; n_tokens * c.p.q_len()];
    attention_kv_with(
        backend,
        pool,
        &c.q,
        c.k.view(),
        c.v.view(),
        n_tokens,
        &c.p,
        &mut out,
    )
    .unwrap();
    let want = r::attention_kv(
        &c.q,
        c.k.ty().ggml(),
        &exact(&c.k),
        &exact(&c.v),
        n_tokens,
        c.p.n_head,
        c.p.n_kv_head,
        c.p.head_dim,
        f64::from(c.p.scale),
    );
    // The kernel multiplies the same values as the reference; what differs is f32 rounding
    // (the products, the exponentials, the sums over up to 90 positions).
    for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= 2e-5 * (1.0 + w.abs()),
            "{backend:?} {:?}/{:?}: value {i}: {g} vs {w}",
            c.k.ty(),
            c.v.ty()
        );
    }
    out
}

fn types_for(d: usize) -> Vec<KvType> {
    KvType::ALL
        .into_iter()
        .filter(|t| d % t.block() == 0)
        .collect()
}

#[test]
fn every_pair_of_types_matches_the_reference() {
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    for d in [64, 80, 96, 128] {
        for tk in types_for(d) {
            for tv in types_for(d) {
                if (tk, tv) == (KvType::F16, KvType::F16) {
                    continue; // ops_attention.rs
                }
                let c = case(
                    (tk, tv),
                    2,
                    4,
                    d,
                    37,
                    3,
                    2.0,
                    (d * 7 + tk as usize * 3 + tv as usize) as u64,
                );
                for backend in Backend::available() {
                    let one = check(&c, 3, backend, &pools[0]);
                    let two = check(&c, 3, backend, &pools[1]);
                    assert_eq!(one, two, "{backend:?} {tk}/{tv}: threads change the result");
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_shapes_match_the_reference(
        tk in 0usize..5,
        tv in 0usize..5,
        d in prop::sample::select(vec![64usize, 80, 96, 128]),
        n_kv in 1usize..4,
        group in prop::sample::select(vec![1usize, 2, 4, 8]),
        n_pos in 1usize..90,
        block in 1usize..5,
        amp in 0.5f32..4.0,
        seed in any::<u64>(),
    ) {
        let (tk, tv) = (KvType::ALL[tk], KvType::ALL[tv]);
        prop_assume!(d % tk.block() == 0 && d % tv.block() == 0);
        let n_tokens = block.min(n_pos);
        let c = case((tk, tv), n_kv, group, d, n_pos, n_tokens, amp, seed);
        let pool = ThreadPool::new(2);
        check(&c, n_tokens, Backend::detect(), &pool);
    }
}

/// A block of tokens gives each token what it gets alone over the cache cut after its row.
#[test]
fn a_block_equals_its_tokens_one_by_one() {
    let pool = ThreadPool::new(2);
    for (tk, tv) in [
        (KvType::Q8_0, KvType::Q8_0),
        (KvType::Q4_0, KvType::Q8_0),
        (KvType::F16, KvType::Q4_0),
    ] {
        let c = case((tk, tv), 2, 4, 64, 40, 5, 2.0, 9);
        let mut block = vec![0f32; 5 * c.p.q_len()];
        attention_kv(&pool, &c.q, c.k.view(), c.v.view(), 5, &c.p, &mut block).unwrap();
        for t in 0..5 {
            let (mut k, mut v) = (c.k.clone(), c.v.clone());
            k.truncate(40 - 4 + t);
            v.truncate(40 - 4 + t);
            let q = &c.q[t * c.p.q_len()..][..c.p.q_len()];
            let mut one = vec![0f32; c.p.q_len()];
            attention_kv(&pool, q, k.view(), v.view(), 1, &c.p, &mut one).unwrap();
            assert_eq!(
                &block[t * c.p.q_len()..][..c.p.q_len()],
                &one[..],
                "{tk}/{tv} token {t}"
            );
        }
    }
}

#[test]
fn quantized_caches_stay_near_the_exact_attention() {
    // How far a quantized cache moves the output from the f16 one (what the types cost):
    // printed, and bounded loosely (a mix-up of blocks or heads moves it by ~1).
    let pool = ThreadPool::new(2);
    let base = case((KvType::F32, KvType::F32), 4, 8, 64, 512, 1, 3.0, 77);
    let mut want = vec![0f32; base.p.q_len()];
    attention_kv(
        &pool,
        &base.q,
        base.k.view(),
        base.v.view(),
        1,
        &base.p,
        &mut want,
    )
    .unwrap();
    for (ty, bound) in [
        (KvType::F16, 2e-3),
        (KvType::BF16, 2e-2),
        (KvType::Q8_0, 2e-2),
        (KvType::Q4_0, 2e-1),
    ] {
        let mut k = KvBuf::new(ty, 4, 64).unwrap();
        let mut v = KvBuf::new(ty, 4, 64).unwrap();
        k.push_f32(&base.k.rows_f32(0, 512).unwrap()).unwrap();
        v.push_f32(&base.v.rows_f32(0, 512).unwrap()).unwrap();
        let mut got = vec![0f32; base.p.q_len()];
        attention_kv(&pool, &base.q, k.view(), v.view(), 1, &base.p, &mut got).unwrap();
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let size = want.iter().map(|x| x.abs()).fold(0f32, f32::max);
        eprintln!("{ty}: max deviation {err:.2e} of outputs up to {size:.3}");
        assert!(
            f64::from(err) <= bound * f64::from(size),
            "{ty}: {err} of {size}"
        );
    }
}

#[test]
fn bad_caches_are_refused() {
    let pool = ThreadPool::new(1);
    let c = case((KvType::Q8_0, KvType::Q8_0), 2, 2, 64, 10, 1, 1.0, 3);
    let mut out = vec![0f32; c.p.q_len()];
    // V shorter than K.
    let mut v = c.v.clone();
    v.truncate(9);
    assert!(attention_kv(&pool, &c.q, c.k.view(), v.view(), 1, &c.p, &mut out).is_err());
    // More new tokens than rows; queries of the wrong length.
    let mut out2 = vec![0f32; 11 * c.p.q_len()];
    let q2 = vec![0f32; 11 * c.p.q_len()];
    assert!(attention_kv(&pool, &q2, c.k.view(), c.v.view(), 11, &c.p, &mut out2).is_err());
    assert!(attention_kv(&pool, &c.q[1..], c.k.view(), c.v.view(), 1, &c.p, &mut out).is_err());
    // A view claiming more rows than its bytes hold.
    if let powerinfer_kernels_cpu::ops::kv::KvView::Heads {
        ty,
        data,
        head_stride,
        ..
    } = c.k.view()
    {
        let lying = powerinfer_kernels_cpu::ops::kv::KvView::Heads {
            ty,
            data,
            head_stride,
            n_pos: 1000,
        };
        assert!(attention_kv(&pool, &c.q, lying, c.v.view(), 1, &c.p, &mut out).is_err());
    }
}
