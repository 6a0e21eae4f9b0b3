//! End-to-end tests of the CPU engine on tiny synthetic models written into a temp dir.

use std::path::Path;

use powerinfer_engine::{Batch, Engine, EngineError, EvalOptions, KvType};

use powerinfer_cli::synth::Arch;
use powerinfer_engine::kv_cache::KvCache;
use powerinfer_engine::model::Model;
use powerinfer_engine::sampling::SamplingParams;
use powerinfer_gguf::{GgmlType, GgufFile, GgufWriter};

#[path = "support/engine.rs"]
mod common;
use common::{argmax, make, opts, rel_diff, PROMPT};

#[test]
fn sparse_with_perfect_predictor_equals_dense_relu() {
    let f = make(GgmlType::F16, Arch::Llama, 1);
    let sparse = Engine::load(&f.sparse, opts(false)).unwrap();
    let dense = Engine::load(&f.sparse, opts(true)).unwrap();
    assert!(sparse.is_sparse() && !dense.is_sparse());
    let mut s = sparse.session();
    let mut d = dense.session();
    let ls = s.eval_all(&PROMPT).unwrap();
    let ld = d.eval_all(&PROMPT).unwrap();
    let ld64: Vec<f64> = ld.iter().map(|&x| x as f64).collect();
    let r = rel_diff(&ls, &ld64);
    eprintln!("sparse vs dense: max diff / std = {r:.3e}");
    // The two sum in other orders, and the F16 products round their activations to f16 (as
    // ggml does), which turns such differences into an f16 step here and there: 4.0e-4
    // measured (below 1e-4 with f32 activations).
    assert!(r <= 1e-3, "sparse vs dense: max diff / std = {r}");
    // Decode steps too.
    let ls = s.eval(&[42]).unwrap();
    let ld: Vec<f64> = d.eval(&[42]).unwrap().iter().map(|&x| x as f64).collect();
    assert!(rel_diff(&ls, &ld) <= 1e-3);
    let density = s.stats().ffn_density();
    eprintln!("sparse FFN density {density:.4}");
    assert!(
        (0.05..0.2).contains(&density),
        "sparse density {density} should be about 0.1"
    );
    assert_eq!(d.stats().ffn_density(), 1.0);
}

/// Plain f64 forward pass over dequantized weights; logits of every position.
fn reference(path: &Path, tokens: &[u32]) -> Vec<f64> {
    let model = Model::load(path).unwrap();
    let hp = model.hparams().clone();
    let file = GgufFile::open(path).unwrap();
    let sparse = file.kind() == powerinfer_gguf::FileKind::PowerInfer;
    let mat = |name: &str| -> Vec<f64> {
        let info = file.tensor_info(name).unwrap();
        powerinfer_gguf::quants::dequantize_to_vec(info.ggml_type(), file.data_of(info))
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    };
    // y = W x with W of `rows` rows of x.len() values.
    let matvec = |w: &[f64], x: &[f64]| -> Vec<f64> {
        w.chunks_exact(x.len())
            .map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + hp.rms_eps as f64).sqrt();
        x.iter().zip(w).map(|(a, b)| a * s * b).collect()
    };
    let (ne, hd, nh, nkv) = (hp.n_embd, hp.head_dim(), hp.n_head, hp.n_head_kv);
    let rope = |x: &mut [f64], n_heads: usize, pos: usize| {
        for h in 0..n_heads {
            for i in 0..hp.n_rot / 2 {
                let theta = pos as f64
                    * (hp.rope_freq_base as f64).powf(-2.0 * i as f64 / hp.n_rot as f64)
                    * hp.rope_freq_scale as f64;
                let (s, c) = theta.sin_cos();
                let j = h * hd + 2 * i;
                let (a, b) = (x[j], x[j + 1]);
                x[j] = a * c - b * s;
                x[j + 1] = a * s + b * c;
            }
        }
    };
    let embd = mat("token_embd.weight");
    let out_norm = mat("output_norm.weight");
    let output = mat("output.weight");
    struct L {
        an: Vec<f64>,
        q: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
        o: Vec<f64>,
        fnorm: Vec<f64>,
        g: Vec<f64>,
        u: Vec<f64>,
        d: Vec<f64>,
    }
    let layers: Vec<L> = (0..hp.n_layer)
        .map(|l| {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            L {
                an: mat(&n("attn_norm")),
                q: mat(&n("attn_q")),
                k: mat(&n("attn_k")),
                v: mat(&n("attn_v")),
                o: mat(&n("attn_output")),
                fnorm: mat(&n("ffn_norm")),
                g: mat(&n("ffn_gate")),
                u: mat(&n("ffn_up")),
                d: mat(&n(if sparse { "ffn_down_t" } else { "ffn_down" })),
            }
        })
        .collect();
    let mut kc: Vec<Vec<Vec<f64>>> = vec![Vec::new(); hp.n_layer];
    let mut vc: Vec<Vec<Vec<f64>>> = vec![Vec::new(); hp.n_layer];
    let mut logits = Vec::new();
    for (pos, &tok) in tokens.iter().enumerate() {
        let mut x: Vec<f64> = embd[tok as usize * ne..(tok as usize + 1) * ne].to_vec();
        for (l, w) in layers.iter().enumerate() {
            let cur = rms(&x, &w.an);
            let mut q = matvec(&w.q, &cur);
            let mut k = matvec(&w.k, &cur);
            let v = matvec(&w.v, &cur);
            rope(&mut q, nh, pos);
            rope(&mut k, nkv, pos);
            kc[l].push(k);
            vc[l].push(v);
            let mut attn = vec![0.0; ne];
            for h in 0..nh {
                let kh = h / (nh / nkv);
                let qh = &q[h * hd..(h + 1) * hd];
                let scores: Vec<f64> = kc[l]
                    .iter()
                    .map(|k| {
                        qh.iter()
                            .zip(&k[kh * hd..(kh + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (p, v) in vc[l].iter().enumerate() {
                    for i in 0..hd {
                        attn[h * hd + i] += e[p] / z * v[kh * hd + i];
                    }
                }
            }
            let o = matvec(&w.o, &attn);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let cur = rms(&x, &w.fnorm);
            let g = matvec(&w.g, &cur);
            let u = matvec(&w.u, &cur);
            let a: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(&g, &u)| {
                    if sparse {
                        g.max(0.0) * u
                    } else {
                        g / (1.0 + (-g).exp()) * u
                    }
                })
                .collect();
            if sparse {
                for (&ai, row) in a.iter().zip(w.d.chunks_exact(ne)) {
                    x.iter_mut().zip(row).for_each(|(x, d)| *x += ai * d);
                }
            } else {
                let y = matvec(&w.d, &a);
                x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
            }
        }
        logits.extend(matvec(&output, &rms(&x, &out_norm)));
    }
    logits
}

#[test]
fn forward_matches_f64_reference() {
    let f = make(GgmlType::F32, Arch::Llama, 2);
    // Bound: the engine keeps K/V in f16 (relative rounding 2^-11) and sums in f32; logits
    // agree with the f64 forward to within 1e-3 of their standard deviation (measured: ~5e-5).
    for (path, dense) in [(&f.sparse, false), (&f.sparse, true), (&f.dense, false)] {
        let engine = Engine::load(path, opts(dense)).unwrap();
        let got = engine.session().eval_all(&PROMPT).unwrap();
        let want = reference(path, &PROMPT);
        let r = rel_diff(&got, &want);
        eprintln!("{} dense={dense}: max diff / std = {r:.3e}", path.display());
        assert!(
            r <= 1e-3,
            "{} dense={dense}: max diff / std = {r}",
            path.display()
        );
    }
}

/// Each KV cache type against the exact f64 forward (which keeps K and V exact): the cache's
/// rounding is what moves the logits. Measured on the tiny F32 model (max diff / std): F32
/// 6.2e-7, F16 4.8e-5, BF16 3.9e-4, Q8_0 1.2e-3, Q4_0 2.1e-2; bounded at a few times that.
#[test]
fn kv_cache_types_stay_near_the_f64_forward() {
    let f = make(GgmlType::F32, Arch::Llama, 2);
    let want = reference(&f.sparse, &PROMPT);
    for (ty, bound) in [
        (KvType::F32, 1e-5),
        (KvType::F16, 2e-4),
        (KvType::BF16, 2e-3),
        (KvType::Q8_0, 5e-3),
        (KvType::Q4_0, 6e-2),
    ] {
        let mut o = opts(false);
        o.cache_type_k = ty;
        o.cache_type_v = ty;
        let engine = Engine::load(&f.sparse, o).unwrap();
        assert_eq!(engine.kv_types(), (ty, ty));
        let got = engine.session().eval_all(&PROMPT).unwrap();
        let r = rel_diff(&got, &want);
        eprintln!("KV cache {ty}: max diff / std = {r:.3e}");
        assert!(r <= bound, "KV cache {ty}: max diff / std = {r}");
    }
}

#[test]
fn block_equals_token_by_token() {
    let f = make(GgmlType::Q8_0, Arch::Bamboo, 3);
    let engine = Engine::load(&f.sparse, opts(false)).unwrap();
    let mut a = engine.session();
    let block = a.eval(&PROMPT).unwrap();
    let mut b = engine.session();
    let mut last = Vec::new();
    for &t in &PROMPT {
        last = b.eval(&[t]).unwrap();
    }
    assert_eq!(b.n_past(), PROMPT.len());
    let last64: Vec<f64> = last.iter().map(|&x| x as f64).collect();
    let r = rel_diff(&block, &last64);
    eprintln!("block vs token by token: max diff / std = {r:.3e}");
    assert!(r <= 1e-3, "block vs token by token: {r}");
}

/// A generation that ends spends no forward pass on its last token: `max_tokens` tokens cost
/// `max_tokens - 1` decode steps, the token stays in the session's sequence (`n_past`), and the
/// session's next evaluation puts it in the cache first: its logits then match evaluating the
/// whole sequence in one block. Also when the caller stops iterating early.
#[test]
fn generation_leaves_its_last_token_to_the_session() {
    let f = make(GgmlType::F32, Arch::Llama, 5);
    let engine = Engine::load(&f.dense, opts(false)).unwrap();
    let params = SamplingParams::greedy(4).with(|p| {
        p.stop_at_eog = false;
    });
    let mut s = engine.session();
    let prompt = engine.tokenizer().encode("hello world", true, true);
    let toks: Vec<u32> = s
        .generate("hello world", params.clone())
        .map(|t| t.unwrap().id)
        .collect();
    assert_eq!(toks.len(), 4);
    assert_eq!(
        s.stats().decode_tokens,
        3,
        "one forward pass per token after the first"
    );
    assert_eq!(s.n_past(), prompt.len() + 4);
    let next = s.eval(&[9]).unwrap();
    assert_eq!(s.n_past(), prompt.len() + 5);
    let mut whole = prompt.clone();
    whole.extend(&toks);
    whole.push(9);
    let mut b = engine.session();
    let want = b.eval(&whole).unwrap();
    let want64: Vec<f64> = want.iter().map(|&x| x as f64).collect();
    let r = rel_diff(&next, &want64);
    assert!(r <= 1e-4, "continued session vs one block: {r}");
    // `eval_all` after a generation returns the rows of the caller's tokens only.
    let mut c = engine.session();
    let first = c
        .generate("hello world", params.clone())
        .next()
        .unwrap()
        .unwrap();
    assert_eq!(first.id, toks[0]);
    assert_eq!(c.n_past(), prompt.len() + 1);
    let rows = c.eval_all(&[9, 10]).unwrap();
    assert_eq!(rows.len(), 2 * engine.model().hparams().n_vocab);
    assert_eq!(c.n_past(), prompt.len() + 3);
}

/// The one-token sparse FFN's thread split is learned from each token's timing (`FusedSplit`):
/// it changes which thread computes which neuron, never a result. A second session on the same
/// engine (starting from the cuts the first one learned) gives the first one's logits bit for
/// bit, and so does a fresh engine.
#[test]
fn learned_thread_split_keeps_results() {
    let f = make(GgmlType::Q4_0, Arch::Llama, 6);
    let run = |engine: &Engine| {
        let mut s = engine.session();
        let mut logits = s.eval(&PROMPT).unwrap();
        let mut bits = Vec::new();
        for _ in 0..16 {
            let tok = argmax(&logits);
            logits = s.eval(&[tok]).unwrap();
            bits.extend(logits.iter().map(|v| v.to_bits()));
        }
        bits
    };
    let engine = Engine::load(&f.sparse, opts(false)).unwrap();
    let first = run(&engine);
    assert_eq!(run(&engine), first, "second session");
    let fresh = Engine::load(&f.sparse, opts(false)).unwrap();
    assert_eq!(run(&fresh), first, "fresh engine");
}

#[test]
fn sampling_is_reproducible() {
    let f = make(GgmlType::Q4_0, Arch::Llama, 4);
    let engine = Engine::load(&f.sparse, opts(false)).unwrap();
    let run = |params: SamplingParams| -> (Vec<u32>, String) {
        let mut s = engine.session();
        let toks: Vec<_> = s
            .generate("hello world", params)
            .map(|t| t.unwrap())
            .collect();
        (
            toks.iter().map(|t| t.id).collect(),
            toks.iter().map(|t| t.text.as_str()).collect(),
        )
    };
    let params = |seed| {
        SamplingParams::default().with(|p| {
            p.seed = seed;
            p.max_tokens = 12;
            p.stop_at_eog = false;
            p.temperature = 1.5;
        })
    };
    let a = run(params(5));
    assert_eq!(a.0.len(), 12);
    assert_eq!(a, run(params(5)));
    let g = run(SamplingParams::greedy(8).with(|p| {
        p.stop_at_eog = false;
    }));
    assert_eq!(g.0.len(), 8);
    assert_eq!(
        g,
        run(SamplingParams::greedy(8).with(|p| {
            p.stop_at_eog = false;
        }))
    );
    // Stop strings end the generation at the token that completes them.
    if let Some(piece) = g.1.chars().next().map(String::from) {
        let stopped = run(SamplingParams::greedy(8).with(|p| {
            p.stop = vec![piece];
            p.stop_at_eog = false;
        }));
        assert!(stopped.0.len() < 8 || g.1.chars().count() == 1);
    }
}

#[test]
fn bad_files_give_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a model file at all").unwrap();
    assert!(matches!(
        Engine::load(&junk, opts(false)),
        Err(EngineError::Gguf(_))
    ));

    // A copy of a model without one tensor, and one claiming another architecture.
    let f = make(GgmlType::F16, Arch::Llama, 6);
    let src = GgufFile::open(&f.sparse).unwrap();
    let write = |skip: &str, arch: &str, out: &Path| {
        let mut w = GgufWriter::new(Vec::new(), src.kind());
        let mut md = src.metadata().clone();
        md.insert(
            "general.architecture",
            powerinfer_gguf::Value::String(arch.into()),
        );
        w.add_metadata(&md).unwrap();
        let keep: Vec<_> = src.tensors().iter().filter(|t| t.name() != skip).collect();
        for t in &keep {
            w.add_tensor(t.name(), t.shape(), t.ggml_type()).unwrap();
        }
        w.write_header().unwrap();
        for t in &keep {
            w.write_tensor_data(t.name(), src.data_of(t)).unwrap();
        }
        std::fs::write(out, w.finish().unwrap()).unwrap();
    };
    let missing = dir.path().join("missing.gguf");
    write("blk.1.fc2.weight", "llama", &missing);
    match Engine::load(&missing, opts(false)) {
        Err(EngineError::MissingTensor(name)) => assert_eq!(name, "blk.1.fc2.weight"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    let gptneox = dir.path().join("gptneox.gguf");
    write("", "gptneox", &gptneox);
    assert!(matches!(
        Engine::load(&gptneox, opts(false)),
        Err(EngineError::UnsupportedArch(a)) if a == "gptneox"
    ));
}

#[test]
fn threshold_option_and_decode_batch() {
    let f = make(GgmlType::F16, Arch::Llama, 7);
    // θ above every score: no neuron is computed, the FFN adds nothing, and it still runs.
    let none = Engine::load(&f.sparse, {
        let mut o = opts(false);
        o.sparse_threshold = Some(1e30);
        o
    })
    .unwrap();
    assert_eq!(none.threshold(), 1e30);
    let mut s = none.session();
    s.eval(&PROMPT).unwrap();
    assert_eq!(s.stats().ffn_density(), 0.0);
}

/// Logits of `tokens` continuing `prefix` in a session of its own (the unbatched reference).
fn alone(engine: &Engine, prefix: &[u32], tokens: &[u32]) -> Vec<f32> {
    let mut s = engine.session();
    if !prefix.is_empty() {
        s.eval(prefix).unwrap();
    }
    s.eval(tokens).unwrap()
}

#[test]
fn batched_sequences_match_separate_sessions() {
    // Sequences at different positions, decoded together (`decode`) and mixed with a prompt
    // block of a third sequence (`eval_batch`), against each evaluated alone. Quantized weights:
    // bit-identical (the products of several tokens are those of one token). F16: the
    // several-token products sum in another order, and since F16 products round their
    // activations to f16 (as ggml does) such a difference can move a later activation by one
    // f16 step (2^-10 relative): up to 1.5e-4 of the logits' std measured, 1e-6 before the
    // rounding; bound 1e-3.
    for (ty, seed) in [
        (GgmlType::Q4_0, 21),
        (GgmlType::Q8_0, 22),
        (GgmlType::F16, 23),
    ] {
        let f = make(ty, Arch::Llama, seed);
        for (path, dense) in [(&f.sparse, false), (&f.sparse, true), (&f.dense, true)] {
            let engine = Engine::load(path, opts(dense)).unwrap();
            let mut cache = engine.new_cache();
            let a = cache.add_sequence();
            let b = cache.add_sequence();
            let c = cache.add_sequence();
            let last = EvalOptions::new;
            engine
                .eval(&mut cache, &Batch::one(a, &PROMPT[..4]), last())
                .unwrap();
            engine
                .eval(&mut cache, &Batch::one(b, &PROMPT[4..9]), last())
                .unwrap();
            let step = engine
                .eval(&mut cache, &Batch::decode(&[(a, 50), (b, 60)]), last())
                .unwrap();
            let mut batch = Batch::new();
            batch.push(b, &[61]).push(c, &PROMPT[9..]).push(a, &[]);
            let mixed = engine
                .eval(&mut cache, &batch, EvalOptions::new().all_logits())
                .unwrap();
            let nv = engine.model().hparams().n_vocab;
            assert_eq!(step.len(), 2);
            assert_eq!(step[0].density.len(), 1);
            assert_eq!(mixed[1].logits.len(), 3 * nv);
            assert_eq!(mixed[1].density.len(), 3);
            assert!(mixed[2].logits.is_empty() && mixed[2].density.is_empty());
            let b_prefix: Vec<u32> = PROMPT[4..9].iter().copied().chain([60]).collect();
            let mut c_alone = engine.session();
            let c_all = c_alone.eval_all(&PROMPT[9..]).unwrap();
            let pairs: [(&[f32], Vec<f32>); 4] = [
                (&step[0].logits, alone(&engine, &PROMPT[..4], &[50])),
                (&step[1].logits, alone(&engine, &PROMPT[4..9], &[60])),
                (&mixed[0].logits, alone(&engine, &b_prefix, &[61])),
                (&mixed[1].logits, c_all),
            ];
            for (i, (got, want)) in pairs.iter().enumerate() {
                if ty == GgmlType::F16 {
                    let want64: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                    let r = rel_diff(got, &want64);
                    eprintln!("{ty:?} dense={dense} entry {i}: {r:e}");
                    assert!(r <= 1e-3, "{ty:?} dense={dense} entry {i}: {r:e}");
                } else {
                    assert_eq!(*got, &want[..], "{ty:?} dense={dense} entry {i}");
                }
            }
            let pos = |cache: &KvCache, s| cache.pos(s).unwrap();
            assert_eq!((pos(&cache, a), pos(&cache, b), pos(&cache, c)), (5, 7, 3));
            // A sequence twice in one batch is refused before anything is evaluated.
            assert!(matches!(
                engine.eval(&mut cache, &Batch::decode(&[(a, 1), (a, 2)]), last()),
                Err(EngineError::Invalid(_))
            ));
            assert_eq!(pos(&cache, a), 5);
        }
    }
}

/// `EngineOptions::repack`: the repacked dense Q4_0 matrices give the same logits bit for bit,
/// for a prompt block and for decode steps, on a dense file and on a PowerInfer file (sparse
/// and `dense`); copies are made exactly where the CPU has the packed kernel, none at load or
/// for a prompt block, at the first decode step, or all at once by `repack_now`.
#[test]
fn repacked_q4_0_matches_file_layout_bitwise() {
    let f = make(GgmlType::Q4_0, Arch::Llama, 31);
    let has_kernel =
        powerinfer_kernels_cpu::Backend::detect() == powerinfer_kernels_cpu::Backend::Avx512;
    for (path, dense) in [(&f.dense, true), (&f.sparse, false), (&f.sparse, true)] {
        let plain = Engine::load(path, opts(dense)).unwrap();
        let packed = Engine::load(path, {
            let mut o = opts(dense);
            o.repack = true;
            o
        })
        .unwrap();
        let eager = Engine::load(path, {
            let mut o = opts(dense);
            o.repack = true;
            o
        })
        .unwrap();
        assert_eq!(plain.packed_bytes(), 0);
        assert_eq!(packed.packed_bytes(), 0, "copies made at load");
        eager.repack_now().unwrap();
        let all = eager.packed_bytes();
        assert_eq!(all > 0, has_kernel, "{path:?}");
        let run = |e: &Engine| {
            let mut cache = e.new_cache();
            let s = cache.add_sequence();
            let every = EvalOptions::new().all_logits();
            let mut logits = e.eval(&mut cache, &Batch::one(s, &PROMPT), every).unwrap()[0]
                .logits
                .clone();
            assert_eq!(
                e.packed_bytes(),
                if std::ptr::eq(e, &eager) { all } else { 0 },
                "copies made by a prompt block"
            );
            let mut tok = 7u32;
            for _ in 0..4 {
                let out = e.eval(&mut cache, &Batch::one(s, &[tok]), EvalOptions::new());
                let out = out.unwrap().remove(0);
                tok = argmax(&out.logits);
                logits.extend(out.logits);
            }
            logits.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
        };
        let want = run(&plain);
        assert_eq!(run(&packed), want, "{path:?} dense={dense}");
        assert_eq!(
            packed.packed_bytes(),
            all,
            "{path:?}: copies after decoding"
        );
        assert_eq!(run(&eager), want, "{path:?} dense={dense}, repack_now");
        assert_eq!(plain.packed_bytes(), 0);
    }
}

/// `EngineOptions::fuse`: one dispatch for a token's row-parallel products (Q/K/V, gate/up,
/// the sparse FFN's predictor and gate/up) gives the logits of one dispatch per product bit
/// for bit, for every family, weight type, thread count, sparse and dense.
#[test]
fn fused_decode_is_bit_identical() {
    use powerinfer_cli::synth::Family;
    let decode = |path: &Path, dense: bool, threads: usize, fuse: bool| -> Vec<Vec<u32>> {
        let mut o = opts(dense);
        o.threads = threads;
        o.ctx_len = 64;
        o.fuse = fuse;
        let engine = Engine::load(path, o).unwrap();
        let mut s = engine.session();
        let mut out = vec![s.eval(&[1, 300, 301, 77]).unwrap()];
        for t in [5u32, 260, 400, 33, 90, 270] {
            out.push(s.eval(&[t]).unwrap());
        }
        out.iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    for (ty, family) in [
        (GgmlType::Q4_0, Family::Llama),
        (GgmlType::F16, Family::Bamboo),
        (GgmlType::Q8_0, Family::Opt),
        (GgmlType::Q4_0, Family::Falcon),
    ] {
        let f = common::make_family(ty, family, 5);
        for threads in [1, 2, 3] {
            for (path, dense) in [(&f.sparse, false), (&f.sparse, true), (&f.dense, false)] {
                assert_eq!(
                    decode(path, dense, threads, true),
                    decode(path, dense, threads, false),
                    "{ty:?} {family:?} threads {threads} {path:?} dense {dense}"
                );
            }
        }
    }
}

/// Files quantized to K-quants by `synth::quantize` (pure Q2_K, Q3_K, Q5_K and the Q3_K_M mix)
/// run on the CPU kernels close to the f64 forward over their own dequantized weights: what
/// separates them is the kernels' Q8_K activations (8 bits against each block's largest
/// value) and f32 sums, the same for every K-quant (Q4_K files land at the same level). Sparse
/// runs get twice the bound: the F16 predictor, made from the unquantized gate, no longer picks
/// exactly the neurons the quantized gate activates, which the reference's ReLU does.
#[test]
fn k_quant_files_match_f64_reference() {
    use powerinfer_cli::synth::{quantize, KQuantMix, QuantizeOptions, QuantizeTarget};
    let f = make(GgmlType::F32, Arch::Llama, 2);
    let dir = tempfile::tempdir().unwrap();
    let targets: [QuantizeTarget; 4] = [
        GgmlType::Q2_K.into(),
        GgmlType::Q3_K.into(),
        GgmlType::Q5_K.into(),
        KQuantMix::Q3_K_M.into(),
    ];
    for target in targets {
        for (src, dense) in [(&f.sparse, false), (&f.sparse, true), (&f.dense, true)] {
            let out = dir.path().join(format!("{target}-{dense}.gguf"));
            let opts_q = QuantizeOptions::default();
            quantize(src, &out, target, opts_q, &mut |_, _| {}).unwrap();
            let engine = Engine::load(&out, opts(dense)).unwrap();
            let got = engine.session().eval_all(&PROMPT).unwrap();
            let r = rel_diff(&got, &reference(&out, &PROMPT));
            eprintln!(
                "{target} {} dense={dense}: max diff / std = {r:.3e}",
                src.display()
            );
            let bound = if dense { 0.05 } else { 0.1 };
            assert!(r <= bound, "{target} dense={dense}: max diff / std = {r}");
        }
    }
}
