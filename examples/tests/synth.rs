//! The synthetic model generator and the quantizer: files read back with our reader, the
//! promised sparsity measured by running the FFN in plain f32 on random inputs, predictor
//! recall / precision, determinism, bad input, and (with POWERINFER_PYTHON) the quantized file
//! read back by the PyPI `gguf` package.

use std::path::{Path, PathBuf};
use std::process::Command;

use powerinfer_cli::synth::math::{gaussian, stream_key};
use powerinfer_cli::synth::{
    quantize, synthesize, Arch, KQuantMix, PredictorRule, QuantizeOptions, Shape, SynthConfig,
    SynthOutputs, SynthReport, VocabSource, BIAS_CHANNEL, BIAS_VALUE, RMS_EPS, TOPIC_CHANNEL,
};
use powerinfer_gguf::quants::{dequantize_to_vec, quantize_to_vec};
use powerinfer_gguf::{FileKind, GgmlType, GgufFile};
use powerinfer_predictor::pt;
use powerinfer_predictor::stats::ActivationStats;

fn tiny(n_layer: usize) -> Shape {
    Shape {
        n_layer,
        ..Shape::preset("tiny").unwrap()
    }
}

fn run_synth(dir: &Path, cfg: &SynthConfig, dense: bool, act: bool) -> (SynthOutputs, SynthReport) {
    let out = SynthOutputs {
        model: dir.join("m.powerinfer.gguf"),
        dense: dense.then(|| dir.join("m.dense.gguf")),
        activation_dir: act.then(|| dir.join("activation")),
        predictor_dir: act.then(|| dir.join("predictor")),
    };
    let report = synthesize(cfg, &out, &mut |_, _| {}).unwrap();
    (out, report)
}

/// A tensor as f32 rows: (values, ne0, rows).
fn tensor(f: &GgufFile, name: &str) -> (Vec<f32>, usize, usize) {
    let info = f
        .tensor_info(name)
        .unwrap_or_else(|| panic!("no tensor {name}"));
    let ne0 = info.shape()[0] as usize;
    let v = dequantize_to_vec(info.ggml_type(), f.data_of(info)).unwrap();
    let rows = v.len() / ne0;
    (v, ne0, rows)
}

fn matvec(m: &[f32], ne0: usize, x: &[f32]) -> Vec<f32> {
    m.chunks_exact(ne0)
        .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
        .collect()
}

/// Random pre-norm residuals for a layer: the bias channel at its constant, the others
/// N(0, s^2).
fn inputs(seed: u64, n: usize, s: f64, count: usize) -> Vec<Vec<f32>> {
    let key = stream_key(seed, "test inputs");
    (0..count)
        .map(|t| {
            let mut x: Vec<f32> = (0..n)
                .map(|j| (s * gaussian(key, (t * n + j) as u64)) as f32)
                .collect();
            x[BIAS_CHANNEL] = BIAS_VALUE;
            x
        })
        .collect()
}

fn rms_norm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let k = 1.0 / (ms + RMS_EPS).sqrt();
    x.iter().zip(w).map(|(a, b)| a * k * b).collect()
}

struct Layer {
    gate: Vec<f32>,
    up: Vec<f32>,
    norm: Vec<f32>,
    fc1: Vec<f32>,
    fc2: Vec<f32>,
    hidden: usize,
    n: usize,
}

impl Layer {
    fn load(f: &GgufFile, l: usize) -> Layer {
        let b = |t: &str| format!("blk.{l}.{t}.weight");
        let (gate, n, _) = tensor(f, &b("ffn_gate"));
        let (fc2, hidden, _) = tensor(f, &b("fc2"));
        Layer {
            gate,
            up: tensor(f, &b("ffn_up")).0,
            norm: tensor(f, &b("ffn_norm")).0,
            fc1: tensor(f, &b("fc1")).0,
            fc2,
            hidden,
            n,
        }
    }

    /// The FFN activation `act` of every neuron for pre-norm residual `x`.
    fn activations(&self, x: &[f32], arch: Arch) -> Vec<f32> {
        let h = rms_norm(x, &self.norm);
        let g = matvec(&self.gate, self.n, &h);
        let u = matvec(&self.up, self.n, &h);
        g.iter()
            .zip(&u)
            .map(|(&g, &u)| match arch {
                Arch::Llama => g.max(0.0) * u,
                Arch::Bamboo => g.max(0.0) * u.max(0.0),
            })
            .collect()
    }

    fn gate_pre(&self, x: &[f32]) -> Vec<f32> {
        matvec(&self.gate, self.n, &rms_norm(x, &self.norm))
    }

    fn predictor_with(fc1: &[f32], fc2: &[f32], n: usize, hidden: usize, x: &[f32]) -> Vec<f32> {
        let hid: Vec<f32> = matvec(fc1, n, x).iter().map(|v| v.max(0.0)).collect();
        matvec(fc2, hidden, &hid)
    }

    fn predictor(&self, x: &[f32]) -> Vec<f32> {
        Layer::predictor_with(&self.fc1, &self.fc2, self.n, self.hidden, x)
    }
}

#[test]
fn files_read_back_with_names_shapes_types_and_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = SynthConfig::new(tiny(2));
    cfg.ty = GgmlType::Q4_0;
    cfg.sparse_threshold = Some(0.25);
    let (out, report) = run_synth(dir.path(), &cfg, true, true);
    let f = GgufFile::open(&out.model).unwrap();
    assert_eq!(f.kind(), FileKind::PowerInfer);
    assert_eq!(f.version(), 3);
    let md = f.metadata();
    assert_eq!(md.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(md.get_u32("llama.embedding_length").unwrap(), 256);
    assert_eq!(md.get_u32("llama.feed_forward_length").unwrap(), 1024);
    assert_eq!(md.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(md.get_u32("llama.attention.head_count").unwrap(), 4);
    assert_eq!(md.get_u32("llama.attention.head_count_kv").unwrap(), 2);
    assert_eq!(md.get_u32("llama.rope.dimension_count").unwrap(), 64);
    assert_eq!(md.get_u32("llama.context_length").unwrap(), 512);
    assert_eq!(md.get_u32("general.file_type").unwrap(), 2);
    assert_eq!(md.get_f32("powerinfer.sparse_threshold").unwrap(), 0.25);
    assert!(md.get_f32("llama.attention.layer_norm_rms_epsilon").is_ok());
    assert!(md.get_f32("llama.rope.freq_base").is_ok());
    // The built-in vocabulary is one our tokenizer reads.
    let tok = powerinfer_engine::tokenizer::Tokenizer::from_gguf(&f).unwrap();
    assert_eq!(tok.n_tokens(), 512);
    assert_eq!(report.n_vocab, 512);
    let ids = tok.encode("hello world", true, false);
    assert_eq!(ids[0], 1, "BOS first");
    assert_eq!(tok.decode(&ids[1..], false, false).unwrap(), b"hello world");
    // Byte fallback: any text round-trips.
    let ids = tok.encode("Grüße, 世界!", false, false);
    assert_eq!(
        tok.decode(&ids, false, false).unwrap(),
        "Grüße, 世界!".as_bytes()
    );

    let r = report.rank as u64;
    let mut expect: Vec<(String, Vec<u64>, GgmlType)> = vec![
        ("token_embd.weight".into(), vec![256, 512], GgmlType::Q4_0),
        ("output_norm.weight".into(), vec![256], GgmlType::F32),
        ("output.weight".into(), vec![256, 512], GgmlType::Q4_0),
    ];
    for l in 0..2 {
        let b = |t: &str| format!("blk.{l}.{t}.weight");
        expect.push((b("attn_norm"), vec![256], GgmlType::F32));
        expect.push((b("attn_q"), vec![256, 256], GgmlType::Q4_0));
        expect.push((b("attn_k"), vec![256, 128], GgmlType::Q4_0));
        expect.push((b("attn_v"), vec![256, 128], GgmlType::Q4_0));
        expect.push((b("attn_output"), vec![256, 256], GgmlType::Q4_0));
        expect.push((b("ffn_norm"), vec![256], GgmlType::F32));
        expect.push((b("ffn_gate"), vec![256, 1024], GgmlType::Q4_0));
        expect.push((b("ffn_up"), vec![256, 1024], GgmlType::Q4_0));
        expect.push((b("ffn_down_t"), vec![256, 1024], GgmlType::Q4_0));
        expect.push((b("fc1"), vec![256, 2 * r], report.predictor_type));
        expect.push((b("fc2"), vec![2 * r, 1024], report.predictor_type));
    }
    let got: Vec<(String, Vec<u64>, GgmlType)> = f
        .tensors()
        .iter()
        .map(|t| (t.name().to_string(), t.shape().to_vec(), t.ggml_type()))
        .collect();
    assert_eq!(got, expect);

    // Dense twin: GGUF magic, ffn_down [n_ff, n_embd], no predictor, no threshold.
    let d = GgufFile::open(out.dense.as_ref().unwrap()).unwrap();
    assert_eq!(d.kind(), FileKind::Gguf);
    assert!(d.metadata().get("powerinfer.sparse_threshold").is_none());
    assert!(d.tensor_info("blk.0.fc1.weight").is_none());
    assert!(d.tensor_info("blk.0.ffn_down_t.weight").is_none());
    assert_eq!(
        d.tensor_info("blk.1.ffn_down.weight").unwrap().shape(),
        [1024, 256]
    );
    assert_eq!(
        d.tensor_data("blk.0.ffn_gate.weight").unwrap(),
        f.tensor_data("blk.0.ffn_gate.weight").unwrap()
    );

    // Activation statistics: .pt and safetensors, equal to the plan.
    let dir_a = out.activation_dir.as_ref().unwrap();
    let from_pt = ActivationStats::read_pt_dir(dir_a).unwrap();
    let from_st = ActivationStats::read_safetensors(dir_a.join("activation.safetensors")).unwrap();
    for l in 0..2 {
        assert_eq!(from_pt.layers[l], report.layers[l].probabilities);
        assert_eq!(from_st.layers[l], report.layers[l].probabilities);
        let t = pt::read_tensor(dir_a.join(format!("activation_{l}.pt"))).unwrap();
        assert_eq!(t.shape(), [1024]);
    }
    assert_eq!(from_pt.n_layer(), 2);
    let pdir = out.predictor_dir.as_ref().unwrap();
    assert_eq!(
        std::fs::read_to_string(pdir.join("config.json")).unwrap(),
        "{\"sparse_threshold\": 0.25}\n"
    );
    assert_eq!(
        pt::read_state_dict(pdir.join("model_1.pt")).unwrap().len(),
        2
    );
    assert_eq!(
        dir_names(dir.path()),
        [
            "activation",
            "m.dense.gguf",
            "m.powerinfer.gguf",
            "predictor"
        ]
    );
}

#[test]
fn dense_down_is_the_transpose_and_predictor_is_exact_without_noise() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = SynthConfig::new(tiny(1));
    cfg.ty = GgmlType::F32;
    let (out, report) = run_synth(dir.path(), &cfg, true, true);
    let f = GgufFile::open(&out.model).unwrap();
    let d = GgufFile::open(out.dense.as_ref().unwrap()).unwrap();
    // The predictor folder as PowerInfer's converter takes it: same values, torch shapes.
    let pdir = out.predictor_dir.as_ref().unwrap();
    assert!(!pdir.join("config.json").exists());
    let sd = pt::read_state_dict(pdir.join("model_0.pt")).unwrap();
    assert_eq!(sd[0].0, "fc1.weight");
    assert_eq!(sd[1].0, "fc2.weight");
    let (fc1, fc1_ne0, fc1_rows) = tensor(&f, "blk.0.fc1.weight");
    let (fc2, fc2_ne0, fc2_rows) = tensor(&f, "blk.0.fc2.weight");
    assert_eq!(sd[0].1.shape(), [fc1_rows, fc1_ne0]);
    assert_eq!(sd[1].1.shape(), [fc2_rows, fc2_ne0]);
    assert_eq!(sd[0].1.to_f32_vec(), fc1);
    assert_eq!(sd[1].1.to_f32_vec(), fc2);
    let (dt, n, n_ff) = tensor(&f, "blk.0.ffn_down_t.weight");
    let (dd, ne0, rows) = tensor(&d, "blk.0.ffn_down.weight");
    assert_eq!((ne0, rows), (n_ff, n));
    for i in 0..n_ff {
        for j in 0..n {
            assert_eq!(dt[i * n + j], dd[j * n_ff + i]);
        }
        assert_eq!(
            dt[i * n + BIAS_CHANNEL],
            0.0,
            "down_t writes the bias channel"
        );
    }
    let (ao, _, _) = tensor(&f, "blk.0.attn_output.weight");
    assert!(ao[BIAS_CHANNEL * n..(BIAS_CHANNEL + 1) * n]
        .iter()
        .all(|&v| v == 0.0));
    let (emb, _, _) = tensor(&f, "token_embd.weight");
    assert!(emb
        .chunks_exact(n)
        .all(|row| row[BIAS_CHANNEL] == BIAS_VALUE));

    // Noise 0: predictor score = gate pre-activation times the input's RMS.
    let layer = Layer::load(&f, 0);
    for x in inputs(1, n, report.layers[0].residual_std, 20) {
        let score = layer.predictor(&x);
        let gate = layer.gate_pre(&x);
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / n as f32 + RMS_EPS).sqrt();
        for (s, g) in score.iter().zip(&gate) {
            assert!(
                (s - g * rms).abs() < 1e-4 * (1.0 + s.abs()),
                "{s} vs {}",
                g * rms
            );
        }
    }
}

/// Measures, per layer: mean density, the share of activations on the neurons the generator
/// made the top 20 %, and the largest per-neuron deviation in standard errors.
fn measure(f: &GgufFile, report: &SynthReport, arch: Arch, count: usize) -> Vec<(f64, f64, f64)> {
    report
        .layers
        .iter()
        .enumerate()
        .map(|(l, plan)| {
            let layer = Layer::load(f, l);
            let n_ff = plan.probabilities.len();
            let mut counts = vec![0u32; n_ff];
            for x in inputs(100 + l as u64, layer.n, plan.residual_std, count) {
                for (c, a) in counts.iter_mut().zip(layer.activations(&x, arch)) {
                    *c += u32::from(a != 0.0);
                }
            }
            let total: u64 = counts.iter().map(|&c| u64::from(c)).sum();
            let density = total as f64 / (count * n_ff) as f64;
            let mut order: Vec<usize> = (0..n_ff).collect();
            order.sort_by(|&a, &b| plan.probabilities[b].total_cmp(&plan.probabilities[a]));
            let top: u64 = order[..n_ff / 5]
                .iter()
                .map(|&i| u64::from(counts[i]))
                .sum();
            let share = top as f64 / total as f64;
            let worst = counts
                .iter()
                .zip(&plan.probabilities)
                .map(|(&c, &p)| {
                    let p = f64::from(p);
                    let se = (p * (1.0 - p) / count as f64)
                        .sqrt()
                        .max(1.0 / count as f64);
                    ((c as f64 / count as f64) - p).abs() / se
                })
                .fold(0.0, f64::max);
            (density, share, worst)
        })
        .collect()
}

#[test]
fn density_and_skew_are_met_when_running_the_ffn() {
    for arch in [Arch::Llama, Arch::Bamboo] {
        for (density, skew) in [(0.1, 0.8), (0.25, 0.5)] {
            let dir = tempfile::tempdir().unwrap();
            let mut cfg = SynthConfig::new(tiny(2));
            cfg.ty = GgmlType::F16;
            cfg.arch = arch;
            cfg.density = density;
            cfg.skew = skew;
            cfg.seed = 7;
            let (out, report) = run_synth(dir.path(), &cfg, false, false);
            let f = GgufFile::open(&out.model).unwrap();
            assert_eq!(
                f.metadata().get_str("general.architecture").unwrap(),
                arch.name()
            );
            for (l, (d, share, worst)) in measure(&f, &report, arch, 1500).into_iter().enumerate() {
                println!(
                    "{arch:?} target density {density} skew {skew}, layer {l}: \
                     density {d:.4}, top-20% share {share:.4}, worst neuron {worst:.1} s.e."
                );
                assert!((d - density).abs() < 0.05 * density, "density {d}");
                assert!((share - skew).abs() < 0.02, "share {share}");
                // 1024 neurons: a 5.5 s.e. outlier has probability ~4e-5 under the model.
                assert!(worst < 5.5, "a neuron is {worst} standard errors off");
            }
        }
    }
}

/// With topics, inputs of each topic fire each neuron with that topic's probability (every
/// neuron within 5.5 standard errors), the two topics' hot sets differ, the statistics are
/// their average, and the predictor stays exact.
#[test]
fn topics_have_their_own_hot_neurons() {
    for arch in [Arch::Llama, Arch::Bamboo] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = SynthConfig::new(tiny(1));
        cfg.ty = GgmlType::F32;
        cfg.arch = arch;
        cfg.seed = 5;
        cfg.topics = true;
        let (out, report) = run_synth(dir.path(), &cfg, false, true);
        let f = GgufFile::open(&out.model).unwrap();
        let plan = &report.layers[0];
        let [pa, pb] = plan.topics.clone().expect("per-topic probabilities");
        for ((m, a), b) in plan.probabilities.iter().zip(&pa).zip(&pb) {
            assert!((m - 0.5 * (a + b)).abs() < 1e-6);
        }
        // (bamboo's statistics count non-zero outputs: the gate's probability times Φ(4))
        let stats = ActivationStats::read_pt_dir(out.activation_dir.as_ref().unwrap()).unwrap();
        for (s, p) in stats.layers[0].iter().zip(&plan.probabilities) {
            assert!((s - p).abs() <= 1e-4 * p, "{s} vs {p}");
        }
        // The two hot sets (top 20%) overlap about as much as random sets do.
        let n_ff = pa.len();
        let top = |p: &[f32]| {
            let mut o: Vec<usize> = (0..n_ff).collect();
            o.sort_by(|&x, &y| p[y].total_cmp(&p[x]));
            o.truncate(n_ff / 5);
            o
        };
        let (ta, tb) = (top(&pa), top(&pb));
        let common = ta.iter().filter(|j| tb.contains(j)).count();
        assert!(
            common < n_ff / 5 / 2,
            "{common} of {} hot neurons shared",
            n_ff / 5
        );
        let emb = tensor(&f, "token_embd.weight").0;
        let n = cfg.shape.n_embd;
        assert!(emb.chunks_exact(n).enumerate().all(
            |(t, row)| row[TOPIC_CHANNEL] == if t % 2 == 0 { BIAS_VALUE } else { -BIAS_VALUE }
        ));
        let layer = Layer::load(&f, 0);
        let count = 1500;
        for (topic, p) in [(BIAS_VALUE, &pa), (-BIAS_VALUE, &pb)] {
            let mut counts = vec![0u32; n_ff];
            for mut x in inputs(200, layer.n, plan.residual_std, count) {
                x[TOPIC_CHANNEL] = topic;
                for (c, a) in counts.iter_mut().zip(layer.activations(&x, arch)) {
                    *c += u32::from(a != 0.0);
                }
                // Noise 0: the predictor's score is the gate's pre-activation times the RMS.
                let rms = (x.iter().map(|v| v * v).sum::<f32>() / n as f32 + RMS_EPS).sqrt();
                for (s, g) in layer.predictor(&x).iter().zip(layer.gate_pre(&x)) {
                    assert!(
                        (s - g * rms).abs() < 1e-4 * (1.0 + s.abs()),
                        "{s} vs {}",
                        g * rms
                    );
                }
            }
            let worst = counts
                .iter()
                .zip(p.iter())
                .map(|(&c, &p)| {
                    let p = f64::from(p);
                    let se = (p * (1.0 - p) / count as f64)
                        .sqrt()
                        .max(1.0 / count as f64);
                    ((c as f64 / count as f64) - p).abs() / se
                })
                .fold(0.0, f64::max);
            println!("{arch:?} topic {topic}: worst neuron {worst:.1} s.e.");
            assert!(
                worst < 5.5,
                "{arch:?}: a neuron is {worst} standard errors off"
            );
        }
    }
}

/// (recall, precision) of `pred` (scores, active iff >= 0) against `truth` (active iff true).
fn recall_precision(pairs: &[(bool, bool)]) -> (f64, f64) {
    let tp = pairs.iter().filter(|&&(t, p)| t && p).count() as f64;
    let t = pairs.iter().filter(|&&(t, _)| t).count() as f64;
    let p = pairs.iter().filter(|&&(_, p)| p).count() as f64;
    (tp / t.max(1.0), tp / p.max(1.0))
}

#[test]
fn predictor_recall_and_precision_follow_the_noise() {
    let mut table = Vec::new();
    for noise in [0.0, 0.05, 0.2, 0.5] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = SynthConfig::new(tiny(1));
        cfg.ty = GgmlType::F32;
        cfg.predictor_noise = noise;
        let (out, report) = run_synth(dir.path(), &cfg, false, false);
        let f = GgufFile::open(&out.model).unwrap();
        let layer = Layer::load(&f, 0);
        let mut pairs = Vec::new();
        for x in inputs(5, layer.n, report.layers[0].residual_std, 500) {
            let truth = layer.gate_pre(&x);
            let score = layer.predictor(&x);
            pairs.extend(truth.iter().zip(&score).map(|(&g, &s)| (g > 0.0, s >= 0.0)));
        }
        let (recall, precision) = recall_precision(&pairs);
        table.push((noise, recall, precision));
    }
    println!("noise  recall  precision");
    for (noise, r, p) in &table {
        println!("{noise:<6} {r:.4}  {p:.4}");
    }
    assert!(
        table[0].1 >= 0.9995 && table[0].2 >= 0.9995,
        "{:?}",
        table[0]
    );
    for w in table.windows(2) {
        assert!(
            w[1].1 < w[0].1 + 1e-3,
            "recall must fall with noise: {table:?}"
        );
        assert!(
            w[1].2 < w[0].2 + 1e-3,
            "precision must fall with noise: {table:?}"
        );
    }
    assert!(table[3].1 < 0.95, "noise 0.5 should cost recall: {table:?}");
}

#[test]
fn predictor_quantization_recall_precision() {
    // The predictor stored as F16 vs PowerInfer's Q5_0 / Q4_0, against the F32 predictor and
    // against the true activations, on random inputs.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = SynthConfig::new(tiny(1));
    cfg.ty = GgmlType::F32;
    cfg.predictor_noise = 0.05;
    cfg.predictor_rank = Some(64);
    let (out, report) = run_synth(dir.path(), &cfg, false, false);
    let f = GgufFile::open(&out.model).unwrap();
    let layer = Layer::load(&f, 0);
    let xs = inputs(9, layer.n, report.layers[0].residual_std, 400);
    let reference: Vec<Vec<f32>> = xs.iter().map(|x| layer.predictor(x)).collect();
    let truth: Vec<Vec<f32>> = xs.iter().map(|x| layer.gate_pre(x)).collect();
    println!("predictor type  recall/F32  precision/F32  recall/true  precision/true");
    let mut rows = Vec::new();
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4_0,
    ] {
        let rt = |v: &[f32]| dequantize_to_vec(ty, &quantize_to_vec(ty, v).unwrap()).unwrap();
        let (fc1, fc2) = (rt(&layer.fc1), rt(&layer.fc2));
        let mut vs_ref = Vec::new();
        let mut vs_true = Vec::new();
        for ((x, r), t) in xs.iter().zip(&reference).zip(&truth) {
            let s = Layer::predictor_with(&fc1, &fc2, layer.n, layer.hidden, x);
            vs_ref.extend(r.iter().zip(&s).map(|(&a, &b)| (a >= 0.0, b >= 0.0)));
            vs_true.extend(t.iter().zip(&s).map(|(&a, &b)| (a > 0.0, b >= 0.0)));
        }
        let (rr, pr) = recall_precision(&vs_ref);
        let (rt_, pt_) = recall_precision(&vs_true);
        println!(
            "{:<15} {rr:.4}      {pr:.4}         {rt_:.4}       {pt_:.4}",
            ty.name()
        );
        rows.push((ty, rr, pr));
    }
    let get = |ty| rows.iter().find(|r| r.0 == ty).unwrap();
    let (f16, q5, q4) = (get(GgmlType::F16), get(GgmlType::Q5_0), get(GgmlType::Q4_0));
    assert!(f16.1 >= 0.995 && f16.2 >= 0.995, "{f16:?}");
    assert!(f16.1 + f16.2 >= q5.1 + q5.2, "F16 {f16:?} vs Q5_0 {q5:?}");
    assert!(
        q5.1 + q5.2 >= q4.1 + q4.2 - 1e-3,
        "Q5_0 {q5:?} vs Q4_0 {q4:?}"
    );
}

#[test]
fn same_seed_same_bytes_other_seed_other_bytes() {
    let mut cfg = SynthConfig::new(tiny(2));
    cfg.ty = GgmlType::Q8_0;
    cfg.arch = Arch::Bamboo;
    cfg.predictor_noise = 0.1;
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let (oa, _) = run_synth(a.path(), &cfg, true, true);
    let (ob, _) = run_synth(b.path(), &cfg, true, true);
    let read = |p: &Path| std::fs::read(p).unwrap();
    assert_eq!(read(&oa.model), read(&ob.model));
    assert_eq!(
        read(oa.dense.as_ref().unwrap()),
        read(ob.dense.as_ref().unwrap())
    );
    for name in [
        "activation_0.pt",
        "activation_1.pt",
        "activation.safetensors",
    ] {
        let p = |o: &SynthOutputs| o.activation_dir.as_ref().unwrap().join(name);
        assert_eq!(read(&p(&oa)), read(&p(&ob)), "{name}");
    }
    // Thread count does not matter.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let d = tempfile::tempdir().unwrap();
    let (od, _) = pool.install(|| run_synth(d.path(), &cfg, false, false));
    assert_eq!(read(&oa.model), read(&od.model));
    cfg.seed = 1;
    let c = tempfile::tempdir().unwrap();
    let (oc, _) = run_synth(c.path(), &cfg, false, false);
    assert_ne!(read(&oa.model), read(&oc.model));
}

#[test]
fn vocabulary_copied_from_a_gguf() {
    // `$POWERINFER_TESTDATA`, else `shared/testdata` beside the repository (as CI lays it out).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let vocab = std::env::var_os("POWERINFER_TESTDATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("../shared/testdata"))
        .join("vocab/ggml-vocab-llama-spm.gguf");
    if !vocab.is_file() {
        assert!(
            std::env::var_os("CI").is_none(),
            "{} not found (set POWERINFER_TESTDATA)",
            vocab.display()
        );
        println!("skipped: {} not found", vocab.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = SynthConfig::new(tiny(1));
    cfg.vocab = VocabSource::FromGguf(vocab.clone());
    let (out, report) = run_synth(dir.path(), &cfg, false, false);
    let src = GgufFile::open(&vocab).unwrap();
    let f = GgufFile::open(&out.model).unwrap();
    assert_eq!(report.n_vocab, 32000);
    for (k, v) in src
        .metadata()
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
    {
        assert_eq!(f.metadata().get(k), Some(v), "{k}");
    }
    assert_eq!(
        f.tensor_info("token_embd.weight").unwrap().shape(),
        [256, 32000]
    );
    // A size that disagrees with the file is refused.
    cfg.shape.n_vocab = Some(1000);
    let err = synthesize(
        &cfg,
        &SynthOutputs {
            model: dir.path().join("x.gguf"),
            dense: None,
            activation_dir: None,
            predictor_dir: None,
        },
        &mut |_, _| {},
    )
    .unwrap_err();
    assert!(err.to_string().contains("32000"), "{err}");
}

fn dir_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn bad_input_is_a_clear_error_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let out = SynthOutputs {
        model: dir.path().join("m.gguf"),
        dense: Some(dir.path().join("d.gguf")),
        activation_dir: Some(dir.path().join("activation")),
        predictor_dir: Some(dir.path().join("predictor")),
    };
    type Edit = Box<dyn Fn(&mut SynthConfig)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|c| c.shape.n_ff = 1000), "multiple of 256"),
        (Box::new(|c| c.shape.n_head = 3), "--heads"),
        (Box::new(|c| c.shape.n_head_kv = 3), "--kv-heads"),
        (Box::new(|c| c.density = 1.5), "--density"),
        (Box::new(|c| c.skew = 0.1), "--skew"),
        (Box::new(|c| c.predictor_noise = 1.0), "--predictor-noise"),
        (
            Box::new(|c| c.predictor_rank = Some(20)),
            "--predictor-rank",
        ),
        (Box::new(|c| c.ty = GgmlType::Q4_K), "not supported"),
        (Box::new(|c| c.shape.n_vocab = Some(100)), "at least"),
        (
            Box::new(|c| {
                c.density = 0.5;
                c.skew = 0.95
            }),
            "power law",
        ),
        (
            Box::new(|c| c.vocab = VocabSource::FromGguf("/nonexistent.gguf".into())),
            "--vocab-from",
        ),
    ];
    for (edit, needle) in cases {
        let mut cfg = SynthConfig::new(tiny(1));
        edit(&mut cfg);
        let err = synthesize(&cfg, &out, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        assert!(
            dir_names(dir.path()).is_empty(),
            "{:?}",
            dir_names(dir.path())
        );
    }
    // Unwritable destination: error, no file.
    let bad = SynthOutputs {
        model: dir.path().join("no/such/dir/m.gguf"),
        dense: None,
        activation_dir: Some(dir.path().join("activation")),
        predictor_dir: Some(dir.path().join("predictor")),
    };
    assert!(synthesize(&SynthConfig::new(tiny(1)), &bad, &mut |_, _| {}).is_err());
    assert!(dir_names(dir.path()).is_empty());
    // No folder is made that the caller did not ask for: statistics in a missing folder are
    // refused before anything is written.
    for missing in ["activation", "predictor"] {
        let folder = dir.path().join("no/such").join(missing);
        let bad = SynthOutputs {
            model: dir.path().join("m.gguf"),
            dense: None,
            activation_dir: Some(if missing == "activation" {
                folder.clone()
            } else {
                dir.path().join("activation")
            }),
            predictor_dir: (missing == "predictor").then(|| folder.clone()),
        };
        let err = synthesize(&SynthConfig::new(tiny(1)), &bad, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist"), "{err}");
        assert!(
            dir_names(dir.path()).is_empty(),
            "{:?}",
            dir_names(dir.path())
        );
    }

    // quantize: missing input, unsupported type, same file.
    let q = |i: &Path, o: &Path, t| quantize(i, o, t, QuantizeOptions::default(), &mut |_, _| {});
    let missing = dir.path().join("missing.gguf");
    let o = dir.path().join("o.gguf");
    assert!(q(&missing, &o, GgmlType::Q4_0).is_err());
    let (src, _) = run_synth(dir.path(), &SynthConfig::new(tiny(1)), false, false);
    let err = q(&src.model, &o, GgmlType::IQ2_XXS)
        .unwrap_err()
        .to_string();
    assert!(err.contains("IQ2_XXS") && err.contains("Q4_K_M"), "{err}");
    assert!(q(&src.model, &src.model, GgmlType::Q4_0).is_err());
    // Garbage input.
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\0\0\0garbage").unwrap();
    assert!(q(&junk, &o, GgmlType::Q4_0).is_err());
    assert_eq!(dir_names(dir.path()), ["junk.gguf", "m.powerinfer.gguf"]);
}

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

#[test]
fn quantize_keeps_the_layout_and_matches_the_reference_codecs() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = SynthConfig::new(tiny(1));
    cfg.ty = GgmlType::F32;
    cfg.sparse_threshold = Some(0.5);
    let (src, _) = run_synth(dir.path(), &cfg, true, false);
    let input = GgufFile::open(&src.model).unwrap();
    for (target, rule, pred) in [
        (GgmlType::Q4_0, PredictorRule::F16, GgmlType::F16),
        (GgmlType::Q4_0, PredictorRule::PowerInfer, GgmlType::Q4_0),
        (GgmlType::Q8_0, PredictorRule::PowerInfer, GgmlType::Q5_0),
        (GgmlType::Q5_1, PredictorRule::F16, GgmlType::F16),
        (GgmlType::Q4_K, PredictorRule::F16, GgmlType::F16),
        (GgmlType::Q2_K, PredictorRule::F16, GgmlType::F16),
        (GgmlType::Q3_K, PredictorRule::PowerInfer, GgmlType::Q5_0),
        (GgmlType::Q5_K, PredictorRule::F16, GgmlType::F16),
        (GgmlType::F16, PredictorRule::PowerInfer, GgmlType::F16),
    ] {
        let out = dir
            .path()
            .join(format!("q-{}-{rule:?}.gguf", target.name()));
        let opts = QuantizeOptions {
            predictor_rule: rule,
            ..QuantizeOptions::default()
        };
        let mut calls = 0u64;
        let report = quantize(&src.model, &out, target, opts, &mut |_, _| calls += 1).unwrap();
        assert!(calls > 0);
        let q = GgufFile::open(&out).unwrap();
        assert_eq!(q.kind(), FileKind::PowerInfer);
        assert_eq!(
            q.metadata().get_f32("powerinfer.sparse_threshold").unwrap(),
            0.5
        );
        assert_eq!(
            q.metadata().get_u32("general.file_type").unwrap(),
            powerinfer_cli::synth::ftype_of(target).unwrap()
        );
        assert_eq!(q.tensors().len(), input.tensors().len());
        for (a, b) in input.tensors().iter().zip(q.tensors()) {
            assert_eq!((a.name(), a.shape()), (b.name(), b.shape()));
            let want = if a.shape().len() == 1 {
                GgmlType::F32
            } else if a.name().ends_with("fc1.weight") || a.name().ends_with("fc2.weight") {
                pred
            } else {
                target
            };
            assert_eq!(b.ggml_type(), want, "{}", a.name());
            // Byte-identical to quantizing the f32 tensor directly.
            let expect = quantize_to_vec(want, input.tensor_f32(a.name()).unwrap()).unwrap();
            assert!(q.data_of(b) == expect.as_slice(), "{}", a.name());
        }
        assert_eq!(report.tensors.len(), q.tensors().len());
    }
    // A llama.cpp mix: Q4_K_M gives output Q6_K and, of the two layers, Q6_K attn_v and
    // ffn_down_t in both (llama.cpp's use_more_bits takes every layer of so small a model), the
    // rest Q4_K; every tensor byte-identical to quantizing its f32 to the type it got.
    let out = dir.path().join("q-Q4_K_M.gguf");
    let opts = QuantizeOptions::default();
    quantize(&src.model, &out, KQuantMix::Q4_K_M, opts, &mut |_, _| {}).unwrap();
    let q = GgufFile::open(&out).unwrap();
    assert_eq!(q.metadata().get_u32("general.file_type").unwrap(), 15);
    for (a, b) in input.tensors().iter().zip(q.tensors()) {
        let name = a.name();
        let want = if a.shape().len() == 1 {
            GgmlType::F32
        } else if name.ends_with("fc1.weight") || name.ends_with("fc2.weight") {
            GgmlType::F16
        } else if name == "output.weight"
            || name.ends_with("attn_v.weight")
            || name.ends_with("ffn_down_t.weight")
        {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        };
        assert_eq!(b.ggml_type(), want, "{name}");
        let expect = quantize_to_vec(want, input.tensor_f32(name).unwrap()).unwrap();
        assert!(q.data_of(b) == expect.as_slice(), "{name}");
    }
    assert!(q.tensor_info("output.weight").is_some());
    // Quantized input: refused without allow_requantize, fine with it.
    let q4 = dir.path().join("q-Q4_0-F16.gguf");
    let q8 = dir.path().join("requant.gguf");
    let opts = QuantizeOptions::default();
    let err = quantize(&q4, &q8, GgmlType::Q8_0, opts.clone(), &mut |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("--allow-requantize"), "{err}");
    let opts = QuantizeOptions {
        allow_requantize: true,
        ..opts
    };
    quantize(&q4, &q8, GgmlType::Q8_0, opts, &mut |_, _| {}).unwrap();
    // Dense file: GGUF magic kept.
    let dq = dir.path().join("dense.q4.gguf");
    quantize(
        src.dense.as_ref().unwrap(),
        &dq,
        GgmlType::Q4_0,
        QuantizeOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(GgufFile::open(&dq).unwrap().kind(), FileKind::Gguf);

    // The PyPI gguf package reads the same tensors at the same places, and its quantizers
    // give the same bytes.
    let Some(py) = python() else { return };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/check_quantized.py");
    for name in [
        "q-Q4_0-PowerInfer.gguf",
        "q-Q8_0-PowerInfer.gguf",
        "q-Q5_1-F16.gguf",
        "dense.q4.gguf",
    ] {
        let out = dir.path().join(name);
        let q = GgufFile::open(&out).unwrap();
        let manifest: String = q
            .tensors()
            .iter()
            .map(|t| {
                let shape: Vec<String> = t.shape().iter().map(|d| d.to_string()).collect();
                format!(
                    "{}\t{}\t{}\t{}\t{}\n",
                    t.name(),
                    t.type_id(),
                    shape.join(","),
                    q.header().data_offset() + t.offset(),
                    t.n_bytes()
                )
            })
            .collect();
        let mpath = dir.path().join(format!("{name}.manifest"));
        std::fs::write(&mpath, manifest).unwrap();
        let original = if name.starts_with("dense") {
            src.dense.clone().unwrap()
        } else {
            src.model.clone()
        };
        let o = Command::new(&py)
            .arg(&script)
            .arg(&original)
            .arg(&out)
            .arg(&mpath)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{name}: {}\n{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        println!("{name}: {}", String::from_utf8_lossy(&o.stdout).trim());
    }
}

/// RoPE (ggml mode 0: adjacent pairs) of one head vector at position `pos`.
fn rope(v: &mut [f32], pos: usize) {
    let d = v.len();
    for i in (0..d).step_by(2) {
        let theta = pos as f32 * 10000f32.powf(-(i as f32) / d as f32);
        let (s, c) = theta.sin_cos();
        let (a, b) = (v[i], v[i + 1]);
        v[i] = a * c - b * s;
        v[i + 1] = a * s + b * c;
    }
}

#[test]
fn density_holds_in_every_layer_of_a_full_forward_pass() {
    // A plain f32 forward pass (RMSNorm, RoPE, causal GQA attention, ReGLU FFN) over random
    // tokens: the residual spread at each FFN input stays near the generator's plan and the
    // measured density stays near the target in every layer.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = SynthConfig::new(tiny(8));
    cfg.ty = GgmlType::F32;
    cfg.seed = 3;
    let (out, report) = run_synth(dir.path(), &cfg, false, false);
    let f = GgufFile::open(&out.model).unwrap();
    let s = cfg.shape;
    let (n, hd) = (s.n_embd, s.head_dim());
    let group = s.n_head / s.n_head_kv;
    let (emb, _, _) = tensor(&f, "token_embd.weight");
    let n_tok = 96;
    let key = stream_key(11, "tokens");
    let mut xs: Vec<Vec<f32>> = (0..n_tok)
        .map(|t| {
            let id = (powerinfer_cli::synth::math::mix64(key ^ t as u64) % 512) as usize;
            emb[id * n..(id + 1) * n].to_vec()
        })
        .collect();
    for (l, plan) in report.layers.iter().enumerate() {
        let b = |t: &str| format!("blk.{l}.{t}.weight");
        let (an, _, _) = tensor(&f, &b("attn_norm"));
        let (wq, _, _) = tensor(&f, &b("attn_q"));
        let (wk, _, _) = tensor(&f, &b("attn_k"));
        let (wv, _, _) = tensor(&f, &b("attn_v"));
        let (wo, _, _) = tensor(&f, &b("attn_output"));
        let (down, _, _) = tensor(&f, &b("ffn_down_t"));
        let layer = Layer::load(&f, l);
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        let mut qs = Vec::new();
        for (t, x) in xs.iter().enumerate() {
            let h = rms_norm(x, &an);
            let mut q = matvec(&wq, n, &h);
            let mut k = matvec(&wk, n, &h);
            q.chunks_exact_mut(hd).for_each(|v| rope(v, t));
            k.chunks_exact_mut(hd).for_each(|v| rope(v, t));
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&wv, n, &h));
        }
        let mut var_sum = 0.0f64;
        let mut active = 0usize;
        for t in 0..n_tok {
            let mut att = vec![0.0f32; n];
            for head in 0..s.n_head {
                let kvh = head / group;
                let q = &qs[t][head * hd..(head + 1) * hd];
                let scores: Vec<f32> = (0..=t)
                    .map(|u| {
                        let k = &ks[u][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f32::MIN, f32::max);
                let w: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f32 = w.iter().sum();
                for (u, wu) in w.iter().enumerate() {
                    let v = &vs[u][kvh * hd..(kvh + 1) * hd];
                    for (o, vv) in att[head * hd..(head + 1) * hd].iter_mut().zip(v) {
                        *o += wu / z * vv;
                    }
                }
            }
            let o = matvec(&wo, n, &att);
            let x = &mut xs[t];
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            assert_eq!(
                x[BIAS_CHANNEL], BIAS_VALUE,
                "the bias channel must not change"
            );
            var_sum += x
                .iter()
                .enumerate()
                .filter(|&(j, _)| j != BIAS_CHANNEL)
                .map(|(_, v)| f64::from(*v).powi(2))
                .sum::<f64>()
                / (n - 1) as f64;
            let act = layer.activations(x, Arch::Llama);
            active += act.iter().filter(|&&a| a != 0.0).count();
            let mut y = vec![0.0f32; n];
            for (i, a) in act.iter().enumerate() {
                if *a != 0.0 {
                    y.iter_mut()
                        .zip(&down[i * n..(i + 1) * n])
                        .for_each(|(o, d)| *o += a * d);
                }
            }
            x.iter_mut().zip(&y).for_each(|(a, b)| *a += b);
        }
        let std = (var_sum / n_tok as f64).sqrt();
        let density = active as f64 / (n_tok * s.n_ff) as f64;
        println!(
            "layer {l}: residual std {std:.4} (plan {:.4}), density {density:.4}",
            plan.residual_std
        );
        assert!(
            (std / plan.residual_std - 1.0).abs() < 0.1,
            "layer {l}: std {std}"
        );
        assert!(
            (density - cfg.density).abs() < 0.15 * cfg.density,
            "layer {l}: {density}"
        );
    }
}
