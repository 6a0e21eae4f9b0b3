//! The generator: plans (activation probabilities, residual spread), tensor row functions and
//! the streaming writer.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use powerinfer_gguf::{FileKind, GgmlType, GgufFile, GgufWriter, Metadata, Value};
use powerinfer_predictor::pt::{self, PtTensor};
use powerinfer_predictor::stats::{ActivationStats, SAFETENSORS_FILE_NAME};

use super::math::{
    mix64, normal_cdf, normal_ppf, power_law_probabilities, relu_second_moment, stream_key,
    uniform, unit, P_MAX, P_MIN,
};
use super::rows::{RowFn, RowReader};
use super::{
    predictor_type, vocab, Family, SynthConfig, SynthError, SynthOutputs, VocabSource, ATTN_STEP,
    ATTN_VARIANCE_SHARE, BAMBOO_UP_BIAS, BIAS_CHANNEL, BIAS_CHANNEL_NEG, BIAS_VALUE, EMBD_STD,
    FFN_STEP, LN_EPS, OPT_UP_BIAS_MAX, POS_EMBD_STD, RMS_EPS, TOPIC_CHANNEL,
};

/// A folder whose files are written under a temporary sibling folder and moved into place by
/// [`commit`](Staging::commit); dropped uncommitted, the temporary folder is removed.
struct Staging {
    temp: PathBuf,
    dest: PathBuf,
    committed: bool,
}

impl Staging {
    fn new(dest: &Path) -> Result<Staging, SynthError> {
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "out".into());
        let temp = dest.with_file_name(format!(".{name}.partial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&temp);
        std::fs::create_dir_all(&temp).map_err(|source| SynthError::Io {
            path: temp.clone(),
            source,
        })?;
        Ok(Staging {
            temp,
            dest: dest.to_path_buf(),
            committed: false,
        })
    }

    fn commit(mut self) -> Result<(), SynthError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| SynthError::Io { path, source }
        };
        std::fs::create_dir_all(&self.dest).map_err(io(&self.dest))?;
        let entries = std::fs::read_dir(&self.temp).map_err(io(&self.temp))?;
        for e in entries {
            let e = e.map_err(io(&self.temp))?;
            let to = self.dest.join(e.file_name());
            std::fs::rename(e.path(), &to).map_err(io(&to))?;
        }
        self.committed = true;
        std::fs::remove_dir(&self.temp).map_err(io(&self.temp))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.temp);
        }
    }
}

/// What the generator decided for one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    /// Activation probability of each neuron (of the gate; for `bamboo` the neuron's output is
    /// non-zero with probability `p · Φ(4)`).
    pub probabilities: Vec<f32>,
    /// Expected standard deviation of a residual channel (other than the bias channel) at the
    /// FFN input of this layer; the probabilities hold for residuals with this spread.
    pub residual_std: f64,
    /// With [`SynthConfig::topics`]: each topic's probabilities (`probabilities` is their
    /// average).
    pub topics: Option<[Vec<f32>; 2]>,
}

/// Refuses an output whose parent folder does not exist: the tool writes its files and its
/// own statistics folders there, and creates no folder elsewhere.
fn folder_exists(path: &Path) -> Result<(), SynthError> {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() && !parent.is_dir() => {
            Err(SynthError::Config(format!(
                "{}: the folder {} does not exist (synth creates no folders there; make it \
                 first)",
                path.display(),
                parent.display()
            )))
        }
        _ => Ok(()),
    }
}

/// What [`synthesize`] produced.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthReport {
    /// Vocabulary size.
    pub n_vocab: usize,
    /// Rank of the predictor's low-rank signal ([`SynthConfig::predictor_rank`]); the stored
    /// predictor's rank is [`predictor_rank`](SynthReport::predictor_rank).
    pub rank: usize,
    /// Type of the predictor tensors.
    pub predictor_type: GgmlType,
    /// Per-layer plans.
    pub layers: Vec<LayerPlan>,
    /// Bytes of the PowerInfer file.
    pub model_bytes: u64,
}

impl SynthReport {
    /// The stored predictor's rank: its hidden width, the rows of `fc1` (twice [`rank`](SynthReport::rank)),
    /// as `inspect` and the predictor crate count it.
    pub fn predictor_rank(&self) -> usize {
        2 * self.rank
    }
}

/// Types the generator writes 2-D weights in.
const SYNTH_TYPES: [GgmlType; 7] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
];

fn validate(cfg: &SynthConfig) -> Result<(), SynthError> {
    let s = &cfg.shape;
    let bad = |m: String| Err(SynthError::Config(m));
    if !SYNTH_TYPES.contains(&cfg.ty) {
        return bad(format!(
            "type {} is not supported by synth (use F32, F16, Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1; \
             `powerinfer quantize` converts to others)",
            cfg.ty
        ));
    }
    if s.n_layer == 0 || s.n_embd == 0 || s.n_ff == 0 || s.n_head == 0 || s.n_head_kv == 0 {
        return bad("every dimension must be positive".into());
    }
    if s.n_embd % 32 != 0 || s.n_embd < 64 {
        return bad(format!(
            "--embd {} must be a multiple of 32 and at least 64",
            s.n_embd
        ));
    }
    if s.n_ff % 256 != 0 {
        return bad(format!(
            "--ff {} must be a multiple of 256 (PowerInfer's placement solver groups neurons by 256)",
            s.n_ff
        ));
    }
    if s.n_embd % s.n_head != 0 || s.head_dim() % 2 != 0 {
        return bad(format!(
            "--heads {} must divide --embd {} into heads of even size",
            s.n_head, s.n_embd
        ));
    }
    if s.n_head % s.n_head_kv != 0 {
        return bad(format!(
            "--kv-heads {} must divide --heads {}",
            s.n_head_kv, s.n_head
        ));
    }
    if !(P_MIN * 10.0..=P_MAX / 1.1).contains(&cfg.density) {
        return bad(format!(
            "--density {} must lie in [{}, {}]",
            cfg.density,
            P_MIN * 10.0,
            P_MAX / 1.1
        ));
    }
    if !(0.2..1.0).contains(&cfg.skew) {
        return bad(format!("--skew {} must lie in [0.2, 1)", cfg.skew));
    }
    if !(0.0..1.0).contains(&cfg.predictor_noise) {
        return bad(format!(
            "--predictor-noise {} must lie in [0, 1)",
            cfg.predictor_noise
        ));
    }
    let r = cfg.rank();
    if r % 16 != 0 || r < 16 || r > s.n_embd {
        return bad(format!(
            "--predictor-rank {r} must be a multiple of 16 between 16 and --embd {}",
            s.n_embd
        ));
    }
    if cfg.attn_norm_2 && cfg.family() != Family::Falcon {
        return bad("attn_norm_2 is a falcon option".into());
    }
    if cfg.topics && cfg.family().layer_norm() {
        return bad("topics are a llama/bamboo option".into());
    }
    if cfg.topics && cfg.rank() < 16 {
        return bad("topics need a predictor rank of at least 16".into());
    }
    if let Some(t) = cfg.sparse_threshold {
        if !t.is_finite() {
            return bad("the sparse threshold must be finite".into());
        }
    }
    Ok(())
}

/// Expected residual standard deviation at the FFN input of layer `l` (for `falcon`, the
/// layer input, which the parallel FFN's norm and the predictor read).
fn residual_std(arch: Family, l: usize) -> f64 {
    let attn = ATTN_STEP * ATTN_STEP * ATTN_VARIANCE_SHARE;
    let ffn = FFN_STEP * FFN_STEP;
    match arch {
        Family::Llama | Family::Bamboo => {
            (EMBD_STD * EMBD_STD + l as f64 * (attn + ffn) + attn).sqrt()
        }
        Family::Falcon => (EMBD_STD * EMBD_STD + l as f64 * (attn + ffn)).sqrt(),
        Family::Opt => {
            (EMBD_STD * EMBD_STD + POS_EMBD_STD * POS_EMBD_STD + l as f64 * (attn + ffn) + attn)
                .sqrt()
        }
    }
}

/// Bias channels: 1 (`llama`, `bamboo`) or 2 (the LayerNorm architectures).
fn n_bias_channels(arch: Family) -> usize {
    if arch.layer_norm() {
        2
    } else {
        1
    }
}

/// Name of the norm whose output the FFN of layer `l` reads.
fn ffn_norm_name(arch: Family, l: usize) -> String {
    match arch {
        Family::Falcon => format!("blk.{l}.attn_norm.weight"),
        _ => format!("blk.{l}.ffn_norm.weight"),
    }
}

/// Scale γ of the FFN-input LayerNorm's bias `γ · w ⊙ v` (`v` unit): entries of about 0.1.
fn ln_bias_scale(n: usize) -> f32 {
    0.1 * ((n - 2) as f32).sqrt()
}

fn plan_layers(cfg: &SynthConfig) -> Result<Vec<LayerPlan>, SynthError> {
    let n_ff = cfg.shape.n_ff;
    let sorted = power_law_probabilities(n_ff, cfg.density, cfg.skew).ok_or_else(|| {
        SynthError::Config(format!(
            "no power law has mean {} with the top 20% carrying {} of the activations \
             (probabilities are capped at {P_MAX}); lower --skew or --density",
            cfg.density, cfg.skew
        ))
    })?;
    // Seeded Fisher-Yates shuffle: hot neurons are scattered, as in real models.
    let shuffled = |name: String| {
        let key = stream_key(cfg.seed, &name);
        let mut order: Vec<usize> = (0..n_ff).collect();
        for i in (1..n_ff).rev() {
            let j = (mix64(key ^ i as u64) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let mut probabilities = vec![0.0f32; n_ff];
        for (rank, &neuron) in order.iter().enumerate() {
            probabilities[neuron] = sorted[rank] as f32;
        }
        probabilities
    };
    Ok((0..cfg.shape.n_layer)
        .map(|l| {
            let probabilities = shuffled(format!("perm.{l}"));
            let residual_std = residual_std(cfg.family(), l);
            if cfg.topics {
                let b = shuffled(format!("perm.{l}.topic_b"));
                let mean = probabilities
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| 0.5 * (x + y))
                    .collect();
                LayerPlan {
                    probabilities: mean,
                    residual_std,
                    topics: Some([probabilities, b]),
                }
            } else {
                LayerPlan {
                    probabilities,
                    residual_std,
                    topics: None,
                }
            }
        })
        .collect())
}

/// Per-layer matrices the gate and predictor rows are built from.
struct LayerState {
    layer: usize,
    /// `ffn_norm` weight.
    w: Vec<f32>,
    /// `r-1` orthonormal rows of length n_embd, zero at the bias channel.
    m: Vec<f32>,
    /// `n_ff` rows of `r-1` mixing weights.
    u: Vec<f32>,
    /// Gate bias numerator per neuron, `s_l Φ⁻¹(p_i)` (with topics, the mean of the two
    /// topics' values).
    bias: Vec<f32>,
    /// With topics: half the difference of the two topics' bias numerators (the weight of
    /// the topic channel); empty otherwise.
    topic: Vec<f32>,
    /// Row scale α_i of each gate row, set when the gate is written (f32 bits).
    alpha: Vec<AtomicU32>,
    /// Residual std `s_l`.
    s: f64,
    /// Standard deviation of the `ffn_down` weights.
    down_std: f32,
    /// Standard deviation of a noise element relative to a unit-norm signal row.
    noise_std: f32,
    /// LayerNorm architectures: the unit direction `v` (zero on the bias channels, orthogonal
    /// to the ones) the FFN-input norm's bias follows and no `up` row sees; empty otherwise.
    v: Vec<f32>,
}

struct Gen<'a> {
    cfg: &'a SynthConfig,
    /// Channels no signal row uses: the bias channels (see [`n_bias_channels`]) and, with
    /// topics, [`TOPIC_CHANNEL`].
    nbc: usize,
    /// [`SynthConfig::topics`].
    topics: bool,
    n: usize,
    n_ff: usize,
    rank: usize,
    plans: &'a [LayerPlan],
}

impl Gen<'_> {
    fn key(&self, name: &str) -> u64 {
        stream_key(self.cfg.seed, name)
    }

    fn norm_weight(&self, name: &str, lo: f32, hi: f32, j: usize) -> f32 {
        lo + (hi - lo) * uniform(self.key(name), j as u64)
    }

    /// Predictor rows carrying the low-rank signal (`M`): the rank less the bias row and, with
    /// topics, the topic row.
    fn signal_rows(&self) -> usize {
        self.rank - 1 - self.topics as usize
    }

    fn layer_state(&self, l: usize) -> LayerState {
        let n = self.n;
        let rs = self.signal_rows();
        let nbc = self.nbc;
        let ln = self.cfg.family().layer_norm();
        let ffn_norm = ffn_norm_name(self.cfg.family(), l);
        let w: Vec<f32> = (0..n)
            .map(|j| {
                if j < nbc {
                    1.0
                } else {
                    self.norm_weight(&ffn_norm, 0.8, 1.2, j)
                }
            })
            .collect();
        // LayerNorm: the unit vectors every signal row is orthogonal to (the ones, and `v`).
        let mut constraints: Vec<Vec<f64>> = Vec::new();
        if ln {
            let ones: Vec<f64> = (0..n).map(|j| if j < nbc { 0.0 } else { 1.0 }).collect();
            let vkey = self.key(&format!("blk.{l}.ln.v"));
            let mut v: Vec<f64> = (0..n)
                .map(|j| {
                    if j < nbc {
                        0.0
                    } else {
                        f64::from(unit(vkey, j as u64))
                    }
                })
                .collect();
            let mean = v.iter().sum::<f64>() / (n - nbc) as f64;
            v.iter_mut().skip(nbc).for_each(|x| *x -= mean);
            for c in [ones, v] {
                let norm = c.iter().map(|x| x * x).sum::<f64>().sqrt();
                constraints.push(c.iter().map(|x| x / norm).collect());
            }
        }
        // M: Gram-Schmidt (modified, f64) of random rows, zero at the bias channel(s).
        let mkey = self.key(&format!("blk.{l}.pred.m"));
        let mut m64: Vec<f64> = Vec::with_capacity(rs * n);
        for k in 0..rs {
            let mut row: Vec<f64> = (0..n)
                .map(|j| {
                    if j < nbc {
                        0.0
                    } else {
                        f64::from(unit(mkey, (k * n + j) as u64))
                    }
                })
                .collect();
            for _pass in 0..2 {
                for prev in constraints
                    .iter()
                    .map(Vec::as_slice)
                    .chain(m64.chunks_exact(n))
                {
                    let d: f64 = prev.iter().zip(&row).map(|(a, b)| a * b).sum();
                    row.iter_mut().zip(prev).for_each(|(r, p)| *r -= d * p);
                }
            }
            let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
            m64.extend(row.iter().map(|x| x / norm));
        }
        let m: Vec<f32> = m64.iter().map(|&x| x as f32).collect();
        let ukey = self.key(&format!("blk.{l}.pred.u"));
        let uscale = 1.0 / (rs as f32).sqrt();
        let u: Vec<f32> = (0..self.n_ff * rs)
            .map(|i| unit(ukey, i as u64) * uscale)
            .collect();
        let plan = &self.plans[l];
        let s = plan.residual_std;
        let numerator =
            |p: &[f32]| -> Vec<f64> { p.iter().map(|&p| s * normal_ppf(f64::from(p))).collect() };
        let (bias, topic): (Vec<f32>, Vec<f32>) = match &plan.topics {
            None => (
                numerator(&plan.probabilities)
                    .into_iter()
                    .map(|b| b as f32)
                    .collect(),
                Vec::new(),
            ),
            Some([a, b]) => numerator(a)
                .into_iter()
                .zip(numerator(b))
                .map(|(a, b)| ((0.5 * (a + b)) as f32, (0.5 * (a - b)) as f32))
                .unzip(),
        };
        // Down scale: each FFN adds variance FFN_STEP^2 to a residual channel. (For LayerNorm
        // `rms` is the spread σ: the bias channels ±BIAS_VALUE add nothing to the mean.)
        let rms = ((nbc as f64 * f64::from(BIAS_VALUE).powi(2) + (n - nbc) as f64 * s * s)
            / n as f64)
            .sqrt();
        let t2 = (s / rms).powi(2);
        let up_moment = match self.cfg.family() {
            Family::Llama => t2,
            Family::Bamboo => t2 * relu_second_moment(BAMBOO_UP_BIAS),
            // No gate: the activation is ReLU(up) itself.
            Family::Falcon | Family::Opt => 1.0,
        };
        let sum_a2: f64 = plan
            .probabilities
            .iter()
            .map(|&p| t2 * relu_second_moment(normal_ppf(f64::from(p))) * up_moment)
            .sum();
        let down_std = (FFN_STEP / sum_a2.max(1e-30).sqrt()) as f32;
        let rho = self.cfg.predictor_noise;
        let noise_std = ((rho / (1.0 - rho)) / (n - nbc) as f64).sqrt() as f32;
        LayerState {
            layer: l,
            w,
            m,
            u,
            bias,
            topic,
            alpha: (0..self.n_ff).map(|_| AtomicU32::new(0)).collect(),
            s,
            down_std,
            noise_std,
            v: constraints
                .get(1)
                .map(|v| v.iter().map(|&x| x as f32).collect())
                .unwrap_or_default(),
        }
    }

    /// `falcon`/`opt`: `ffn_up` row `i` in the gate's role (see the module docs): the signal
    /// `α_i (u_i M + e_i)` (noise orthogonal to the ones and to `v`) divided by the norm
    /// weight, and `±b_i / (2·BIAS_VALUE)` on the two bias channels.
    fn relu_up_row(&self, st: &LayerState, i: usize, out: &mut [f32]) {
        let n = self.n;
        let nbc = self.nbc;
        self.signal(st, i, self.rank - 1, out);
        if st.noise_std > 0.0 {
            let ekey = self.key(&format!("blk.{}.up.noise", st.layer));
            let mut e: Vec<f64> = (0..n)
                .map(|j| {
                    if j < nbc {
                        0.0
                    } else {
                        f64::from(st.noise_std * unit(ekey, (i * n + j) as u64))
                    }
                })
                .collect();
            let mean = e.iter().sum::<f64>() / (n - nbc) as f64;
            e.iter_mut().skip(nbc).for_each(|x| *x -= mean);
            let d: f64 = e.iter().zip(&st.v).map(|(a, &b)| a * f64::from(b)).sum();
            e.iter_mut()
                .zip(&st.v)
                .for_each(|(x, &b)| *x -= d * f64::from(b));
            out.iter_mut().zip(&e).for_each(|(o, &x)| *o += x as f32);
        }
        self.normalize(st, i, out);
        let c = st.bias[i] / (2.0 * BIAS_VALUE);
        out[BIAS_CHANNEL] = c / st.w[BIAS_CHANNEL];
        out[BIAS_CHANNEL_NEG] = -c / st.w[BIAS_CHANNEL_NEG];
    }

    /// `out = Σ_k u_ik m_k` over the first `rs` signal directions `m_k` of the layer.
    fn signal(&self, st: &LayerState, i: usize, rs: usize, out: &mut [f32]) {
        let n = self.n;
        out.fill(0.0);
        let ui = &st.u[i * rs..(i + 1) * rs];
        for (k, &c) in ui.iter().enumerate() {
            let mk = &st.m[k * n..(k + 1) * n];
            out.iter_mut().zip(mk).for_each(|(o, &x)| *o += c * x);
        }
    }

    /// Zeroes the bias channels of neuron `i`'s row `out`, scales it to unit norm (the factor
    /// `α_i` is kept in the layer state) and divides it by the norm weight.
    fn normalize(&self, st: &LayerState, i: usize, out: &mut [f32]) {
        out[..self.nbc].fill(0.0);
        let norm = out
            .iter()
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        let alpha = (1.0 / norm.max(1e-30)) as f32;
        st.alpha[i].store(alpha.to_bits(), Ordering::Relaxed);
        for (o, &w) in out.iter_mut().zip(&st.w) {
            *o = *o * alpha / w;
        }
    }

    fn gate_row(&self, st: &LayerState, i: usize, out: &mut [f32]) {
        let n = self.n;
        self.signal(st, i, self.signal_rows(), out);
        if st.noise_std > 0.0 {
            let ekey = self.key(&format!("blk.{}.gate.noise", st.layer));
            for (j, o) in out.iter_mut().enumerate() {
                if j >= self.nbc {
                    *o += st.noise_std * unit(ekey, (i * n + j) as u64);
                }
            }
        }
        self.normalize(st, i, out);
        out[BIAS_CHANNEL] = st.bias[i] / (st.w[BIAS_CHANNEL] * BIAS_VALUE);
        if let Some(&d) = st.topic.get(i) {
            out[TOPIC_CHANNEL] = d / (st.w[TOPIC_CHANNEL] * BIAS_VALUE);
        }
    }

    fn up_row(&self, st: &LayerState, i: usize, out: &mut [f32]) {
        let n = self.n;
        let key = self.key(&format!("blk.{}.ffn_up.weight", st.layer));
        for (j, o) in out.iter_mut().enumerate() {
            *o = if j < self.nbc {
                0.0
            } else {
                unit(key, (i * n + j) as u64)
            };
        }
        let norm = out
            .iter()
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        let scale = (1.0 / norm) as f32;
        for (o, &w) in out.iter_mut().zip(&st.w) {
            *o = *o * scale / w;
        }
        out[BIAS_CHANNEL] = match self.cfg.family() {
            Family::Llama | Family::Falcon | Family::Opt => 0.0,
            Family::Bamboo => (st.s * BAMBOO_UP_BIAS) as f32 / (st.w[BIAS_CHANNEL] * BIAS_VALUE),
        };
    }

    fn down_value(&self, st: &LayerState, key: u64, neuron: usize, j: usize) -> f32 {
        if j < self.nbc {
            0.0
        } else {
            st.down_std * unit(key, (neuron * self.n + j) as u64)
        }
    }

    fn fc1_row(&self, st: &LayerState, k: usize, out: &mut [f32]) {
        let n = self.n;
        let r = self.rank;
        let rs = self.signal_rows();
        out.fill(0.0);
        let (idx, sign) = if k < r { (k, 1.0) } else { (k - r, -1.0) };
        if idx < rs {
            out.iter_mut()
                .zip(&st.m[idx * n..(idx + 1) * n])
                .for_each(|(o, &m)| *o = sign * m);
        } else if idx == rs {
            out[BIAS_CHANNEL] = sign / BIAS_VALUE;
        } else {
            out[TOPIC_CHANNEL] = sign / BIAS_VALUE;
        }
    }

    /// Writes layer `st`'s predictor as `dir/model_N.pt` (f32 state dict, torch shapes).
    fn write_predictor_pt(&self, st: &LayerState, dir: &Path) -> Result<(), SynthError> {
        let (n, h) = (self.n, 2 * self.rank);
        let mut fc1 = vec![0.0f32; h * n];
        for (k, row) in fc1.chunks_exact_mut(n).enumerate() {
            self.fc1_row(st, k, row);
        }
        let mut fc2 = vec![0.0f32; self.n_ff * h];
        for (i, row) in fc2.chunks_exact_mut(h).enumerate() {
            self.fc2_row(st, i, row);
        }
        let path = dir.join(format!("model_{}.pt", st.layer));
        let pt_err = |source| {
            SynthError::Stats(powerinfer_predictor::stats::StatsError::Pt {
                path: path.clone(),
                source,
            })
        };
        let entries = vec![
            (
                "fc1.weight".to_string(),
                PtTensor::from_f32(vec![h, n], &fc1).map_err(pt_err)?,
            ),
            (
                "fc2.weight".to_string(),
                PtTensor::from_f32(vec![self.n_ff, h], &fc2).map_err(pt_err)?,
            ),
        ];
        pt::write_state_dict(&path, &entries).map_err(pt_err)
    }

    fn fc2_row(&self, st: &LayerState, i: usize, out: &mut [f32]) {
        let r = self.rank;
        let rs = self.signal_rows();
        let alpha = f32::from_bits(st.alpha[i].load(Ordering::Relaxed));
        let ui = &st.u[i * rs..(i + 1) * rs];
        for k in 0..rs {
            out[k] = alpha * ui[k];
            out[r + k] = -alpha * ui[k];
        }
        out[rs] = st.bias[i];
        out[r + rs] = 0.0;
        // The topic channel is ±BIAS_VALUE: its row and the negated row give ±d together.
        if let Some(&d) = st.topic.get(i) {
            out[rs + 1] = d;
            out[r + rs + 1] = -d;
        }
    }
}

/// One tensor to write: name, ggml shape `[ne0, ne1]` (or `[ne0]`), type and what its rows are.
struct Spec {
    name: String,
    ne0: usize,
    ne1: Option<usize>,
    ty: GgmlType,
    rows: Rows,
}

#[derive(Clone, Copy)]
enum Rows {
    Norm {
        lo: f32,
        hi: f32,
        bias_one: bool,
    },
    Embd,
    Output,
    Attn {
        scale: f32,
        zero_bias_row: bool,
    },
    Gate(usize),
    Up(usize),
    DownT(usize),
    Down(usize),
    Fc1(usize),
    Fc2(usize),
    /// `falcon`/`opt` `ffn_up` row (the gate's construction).
    ReluUp(usize),
    /// Bias of the norm the FFN of this layer reads (`γ · w ⊙ v`).
    FfnNormBias(usize),
    /// A random 1-D bias, standard deviation `std`, zero on the bias channels if `zero_c`.
    Bias {
        std: f32,
        zero_c: bool,
    },
    /// A bias uniform in `[-max, 0]` (OPT's `ffn_up.bias`).
    NegBias {
        max: f32,
    },
    /// OPT's position embeddings.
    PosEmbd,
}

impl Rows {
    fn layer(self) -> Option<usize> {
        match self {
            Rows::Gate(l)
            | Rows::ReluUp(l)
            | Rows::FfnNormBias(l)
            | Rows::Up(l)
            | Rows::DownT(l)
            | Rows::Down(l)
            | Rows::Fc1(l)
            | Rows::Fc2(l) => Some(l),
            _ => None,
        }
    }
}

/// The tensors of a file of `cfg`'s family, in file order (see the module docs): the dense
/// GGUF twin's with `dense`, else the PowerInfer file's.
fn specs(
    cfg: &SynthConfig,
    n_vocab: usize,
    rank: usize,
    dense: bool,
    pred_ty: GgmlType,
) -> Vec<Spec> {
    let s = &cfg.shape;
    let (n, f, kv) = (s.n_embd, s.n_ff, s.n_embd_kv());
    let ty = cfg.ty;
    let ln = cfg.family().layer_norm();
    let opt = cfg.family() == Family::Opt;
    let mut v = Vec::new();
    let mut push = |name: String, ne0: usize, ne1: Option<usize>, ty: GgmlType, rows: Rows| {
        v.push(Spec {
            name,
            ne0,
            ne1,
            ty,
            rows,
        })
    };
    let f32t = GgmlType::F32;
    let inv_sqrt_n = 1.0 / (n as f32).sqrt();
    let norm = |lo, hi, bias_one| Rows::Norm { lo, hi, bias_one };
    let bias = |std, zero_c| Rows::Bias { std, zero_c };
    push("token_embd.weight".into(), n, Some(n_vocab), ty, Rows::Embd);
    if opt {
        push(
            "position_embd.weight".into(),
            n,
            Some(s.n_ctx + powerinfer_gguf::conventions::OPT_POSITION_OFFSET),
            ty,
            Rows::PosEmbd,
        );
    }
    push(
        "output_norm.weight".into(),
        n,
        None,
        f32t,
        norm(0.9, 1.1, false),
    );
    if ln {
        push("output_norm.bias".into(), n, None, f32t, bias(0.1, false));
    }
    if !opt {
        push("output.weight".into(), n, Some(n_vocab), ty, Rows::Output);
    }
    let attn = Rows::Attn {
        scale: inv_sqrt_n,
        zero_bias_row: false,
    };
    let attn_out = Rows::Attn {
        scale: ATTN_STEP as f32 * inv_sqrt_n,
        zero_bias_row: true,
    };
    for l in 0..s.n_layer {
        let w = |t: &str| format!("blk.{l}.{t}.weight");
        let b = |t: &str| format!("blk.{l}.{t}.bias");
        if !ln {
            push(w("attn_norm"), n, None, f32t, norm(0.8, 1.2, false));
            push(w("attn_q"), n, Some(n), ty, attn);
            push(w("attn_k"), n, Some(kv), ty, attn);
            push(w("attn_v"), n, Some(kv), ty, attn);
            push(w("attn_output"), n, Some(n), ty, attn_out);
            push(w("ffn_norm"), n, None, f32t, norm(0.8, 1.2, true));
            push(w("ffn_gate"), n, Some(f), ty, Rows::Gate(l));
            push(w("ffn_up"), n, Some(f), ty, Rows::Up(l));
        } else if opt {
            push(w("attn_norm"), n, None, f32t, norm(0.8, 1.2, false));
            push(b("attn_norm"), n, None, f32t, bias(0.1, false));
            push(w("attn_q"), n, Some(n), ty, attn);
            push(b("attn_q"), n, None, f32t, bias(0.1, false));
            push(w("attn_k"), n, Some(kv), ty, attn);
            push(b("attn_k"), kv, None, f32t, bias(0.1, false));
            push(w("attn_v"), n, Some(kv), ty, attn);
            push(b("attn_v"), kv, None, f32t, bias(0.1, false));
            push(w("attn_output"), n, Some(n), ty, attn_out);
            push(b("attn_output"), n, None, f32t, bias(0.01, true));
            push(w("ffn_norm"), n, None, f32t, norm(0.8, 1.2, true));
            push(b("ffn_norm"), n, None, f32t, Rows::FfnNormBias(l));
        } else {
            // attn_norm feeds the FFN (and the attention unless attn_norm_2 is written).
            push(w("attn_norm"), n, None, f32t, norm(0.8, 1.2, true));
            push(b("attn_norm"), n, None, f32t, Rows::FfnNormBias(l));
            if cfg.attn_norm_2 {
                push(w("attn_norm_2"), n, None, f32t, norm(0.8, 1.2, false));
                push(b("attn_norm_2"), n, None, f32t, bias(0.1, false));
            }
            push(w("attn_qkv"), n, Some(n + 2 * kv), ty, attn);
            push(w("attn_output"), n, Some(n), ty, attn_out);
        }
        if ln {
            push(w("ffn_up"), n, Some(f), ty, Rows::ReluUp(l));
        }
        if opt {
            push(
                b("ffn_up"),
                f,
                None,
                f32t,
                Rows::NegBias {
                    max: OPT_UP_BIAS_MAX,
                },
            );
        }
        let down = if dense { "ffn_down" } else { "ffn_down_t" };
        if dense {
            push(w(down), f, Some(n), ty, Rows::Down(l));
        } else {
            push(w(down), n, Some(f), ty, Rows::DownT(l));
        }
        if opt {
            push(b(down), n, None, f32t, bias(0.01, true));
        }
        if !dense {
            push(w("fc1"), n, Some(2 * rank), pred_ty, Rows::Fc1(l));
            push(w("fc2"), 2 * rank, Some(f), pred_ty, Rows::Fc2(l));
        }
    }
    v
}

fn base_metadata(cfg: &SynthConfig, n_vocab: usize, tokenizer: &Metadata) -> Metadata {
    let s = &cfg.shape;
    let a = cfg.family().name();
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String(a.into()));
    md.insert(
        "general.name",
        Value::String(format!("powerinfer-rs synth {}", cfg.seed)),
    );
    let u = |x: usize| Value::U32(x as u32);
    md.insert(format!("{a}.context_length"), u(s.n_ctx));
    md.insert(format!("{a}.embedding_length"), u(s.n_embd));
    md.insert(format!("{a}.block_count"), u(s.n_layer));
    md.insert(format!("{a}.feed_forward_length"), u(s.n_ff));
    if cfg.family().layer_norm() {
        if cfg.family() == Family::Opt {
            // The rows of position_embd, as PowerInfer's converter writes 2050 for OPT.
            md.insert(
                format!("{a}.context_length"),
                u(s.n_ctx + powerinfer_gguf::conventions::OPT_POSITION_OFFSET),
            );
        }
        md.insert(format!("{a}.attention.head_count"), u(s.n_head));
        md.insert(format!("{a}.attention.head_count_kv"), u(s.n_head_kv));
        md.insert(
            format!("{a}.attention.layer_norm_epsilon"),
            Value::F32(LN_EPS),
        );
        if cfg.family() == Family::Falcon {
            md.insert(
                format!("{a}.tensor_data_layout"),
                Value::String("jploski".into()),
            );
        }
    } else {
        md.insert(format!("{a}.rope.dimension_count"), u(s.head_dim()));
        md.insert(format!("{a}.attention.head_count"), u(s.n_head));
        md.insert(format!("{a}.attention.head_count_kv"), u(s.n_head_kv));
        md.insert(
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(RMS_EPS),
        );
        md.insert(format!("{a}.rope.freq_base"), Value::F32(10000.0));
    }
    md.insert(
        "general.file_type",
        Value::U32(super::ftype_of(cfg.ty).unwrap_or(1)),
    );
    debug_assert_eq!(
        tokenizer
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map(|a| a.len()),
        Some(n_vocab)
    );
    for (k, v) in tokenizer.iter() {
        md.insert(k, v.clone());
    }
    // Provenance (llama.cpp ignores unknown keys).
    md.insert("powerinfer_rs.synth.seed", Value::U64(cfg.seed));
    md.insert(
        "powerinfer_rs.synth.density",
        Value::F32(cfg.density as f32),
    );
    md.insert("powerinfer_rs.synth.skew", Value::F32(cfg.skew as f32));
    if cfg.topics {
        md.insert("powerinfer_rs.synth.topics", Value::Bool(true));
    }
    md.insert(
        "powerinfer_rs.synth.predictor_noise",
        Value::F32(cfg.predictor_noise as f32),
    );
    md.insert(
        "powerinfer_rs.synth.bias_channel",
        Value::U32(BIAS_CHANNEL as u32),
    );
    md.insert("powerinfer_rs.synth.bias_value", Value::F32(BIAS_VALUE));
    md
}

/// Writes the synthetic model described by `cfg` to `out`. `progress` is called with the
/// number of tensor bytes just written and the total of all files.
///
/// Nothing is left behind on error: files are written under temporary names and renamed when
/// everything is complete.
pub fn synthesize(
    cfg: &SynthConfig,
    out: &SynthOutputs,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<SynthReport, SynthError> {
    validate(cfg)?;
    let outputs = [Some(&out.model), out.dense.as_ref()]
        .into_iter()
        .chain([out.activation_dir.as_ref(), out.predictor_dir.as_ref()]);
    for path in outputs.flatten() {
        folder_exists(path)?;
    }
    if out.dense.as_ref() == Some(&out.model) {
        return Err(SynthError::Config(
            "the dense twin and the PowerInfer file must be different files".into(),
        ));
    }
    let (tokenizer, n_vocab_src) = match &cfg.vocab {
        VocabSource::BuiltIn => {
            let n = cfg.shape.n_vocab.unwrap_or(512);
            (vocab::builtin(n)?, n)
        }
        VocabSource::FromGguf(path) => {
            let f = GgufFile::open(path)
                .map_err(|e| SynthError::Config(format!("--vocab-from {}: {e}", path.display())))?;
            vocab::copy_from(&f)?
        }
    };
    if let (VocabSource::FromGguf(_), Some(n)) = (&cfg.vocab, cfg.shape.n_vocab) {
        if n != n_vocab_src {
            return Err(SynthError::Config(format!(
                "--vocab {n} but the vocabulary file has {n_vocab_src} tokens"
            )));
        }
    }
    let n_vocab = n_vocab_src;
    let rank = cfg.rank();
    let pred_ty = predictor_type(cfg.ty, cfg.predictor_rule);
    let plans = plan_layers(cfg)?;
    let gen = Gen {
        cfg,
        nbc: n_bias_channels(cfg.family()) + cfg.topics as usize,
        topics: cfg.topics,
        n: cfg.shape.n_embd,
        n_ff: cfg.shape.n_ff,
        rank,
        plans: &plans,
    };
    let md = base_metadata(cfg, n_vocab, &tokenizer);

    let mut jobs: Vec<(FileKind, &std::path::Path, Vec<Spec>)> = Vec::new();
    let mut sparse_md = md.clone();
    if let Some(t) = cfg.sparse_threshold {
        sparse_md.insert("powerinfer.sparse_threshold", Value::F32(t));
    }
    jobs.push((
        FileKind::PowerInfer,
        out.model.as_path(),
        specs(cfg, n_vocab, rank, false, pred_ty),
    ));
    if let Some(d) = &out.dense {
        jobs.push((
            FileKind::Gguf,
            d.as_path(),
            specs(cfg, n_vocab, rank, true, pred_ty),
        ));
    }
    let total: u64 = jobs
        .iter()
        .flat_map(|(_, _, s)| s.iter())
        .map(|s| {
            s.ty.bytes_for((s.ne0 * s.ne1.unwrap_or(1)) as u64)
                .unwrap_or(0)
        })
        .sum();
    let activation_stage = out
        .activation_dir
        .as_deref()
        .map(Staging::new)
        .transpose()?;
    let predictor_stage = out.predictor_dir.as_deref().map(Staging::new).transpose()?;
    let mut files = Vec::new();
    let mut model_bytes = 0;
    for (kind, path, specs) in &jobs {
        let mut w = GgufWriter::create(path, *kind)?;
        let file_md = if *kind == FileKind::PowerInfer {
            &sparse_md
        } else {
            &md
        };
        w.add_metadata(file_md)?;
        for s in specs {
            let shape: Vec<u64> = std::iter::once(s.ne0 as u64)
                .chain(s.ne1.map(|x| x as u64))
                .collect();
            w.add_tensor(&s.name, &shape, s.ty)?;
        }
        let mut state: Option<LayerState> = None;
        let mut bytes = 0u64;
        for s in specs {
            if let Some(l) = s.rows.layer() {
                if state.as_ref().map(|st| st.layer) != Some(l) {
                    if let (Some(stage), Some(prev), FileKind::PowerInfer) =
                        (&predictor_stage, &state, kind)
                    {
                        gen.write_predictor_pt(prev, &stage.temp)?;
                    }
                    state = Some(gen.layer_state(l));
                }
            }
            let st = state.as_ref();
            // A bias of the down projection has the same values in both layouts.
            let key = match s.rows {
                Rows::Bias { .. } => gen.key(&s.name.replace("ffn_down_t.", "ffn_down.")),
                _ => gen.key(&s.name),
            };
            let n = gen.n;
            let nbc = gen.nbc;
            let topics = gen.topics;
            let rows = s.rows;
            let g = &gen;
            let f: Box<RowFn> = match rows {
                Rows::Norm { lo, hi, bias_one } => Box::new(move |_, out: &mut [f32]| {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = if bias_one && j < nbc {
                            1.0
                        } else {
                            lo + (hi - lo) * uniform(key, j as u64)
                        };
                    }
                }),
                Rows::Embd => Box::new(move |t, out: &mut [f32]| {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = EMBD_STD as f32 * unit(key, (t * n + j) as u64);
                    }
                    out[BIAS_CHANNEL] = BIAS_VALUE;
                    if topics {
                        out[TOPIC_CHANNEL] = if t % 2 == 0 { BIAS_VALUE } else { -BIAS_VALUE };
                    } else if nbc > 1 {
                        out[BIAS_CHANNEL_NEG] = -BIAS_VALUE;
                    }
                }),
                Rows::Output => Box::new(move |t, out: &mut [f32]| {
                    let sc = 1.0 / (n as f32).sqrt();
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = sc * unit(key, (t * n + j) as u64);
                    }
                }),
                Rows::Attn {
                    scale,
                    zero_bias_row,
                } => Box::new(move |r, out: &mut [f32]| {
                    if zero_bias_row && r < nbc {
                        out.fill(0.0);
                        return;
                    }
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = scale * unit(key, (r * n + j) as u64);
                    }
                }),
                Rows::Gate(_) | Rows::Up(_) | Rows::ReluUp(_) | Rows::Fc1(_) | Rows::Fc2(_) => {
                    let st = st.expect("layer state");
                    let row = match rows {
                        Rows::Gate(_) => Gen::gate_row,
                        Rows::Up(_) => Gen::up_row,
                        Rows::ReluUp(_) => Gen::relu_up_row,
                        Rows::Fc1(_) => Gen::fc1_row,
                        _ => Gen::fc2_row,
                    };
                    Box::new(move |i, out: &mut [f32]| row(g, st, i, out))
                }
                Rows::FfnNormBias(_) => {
                    let st = st.expect("layer state");
                    let gamma = ln_bias_scale(n);
                    Box::new(move |_, out: &mut [f32]| {
                        for ((o, &w), &v) in out.iter_mut().zip(&st.w).zip(&st.v) {
                            *o = gamma * w * v;
                        }
                    })
                }
                Rows::Bias { std, zero_c } => Box::new(move |_, out: &mut [f32]| {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = if zero_c && j < nbc {
                            0.0
                        } else {
                            std * unit(key, j as u64)
                        };
                    }
                }),
                Rows::NegBias { max } => Box::new(move |_, out: &mut [f32]| {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = -max * uniform(key, j as u64);
                    }
                }),
                Rows::PosEmbd => Box::new(move |r, out: &mut [f32]| {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = if j < nbc {
                            0.0
                        } else {
                            POS_EMBD_STD as f32 * unit(key, (r * n + j) as u64)
                        };
                    }
                }),
                Rows::DownT(l) | Rows::Down(l) => {
                    let st = st.expect("layer state");
                    // Same stream for both layouts: the dense twin is the exact transpose.
                    let dkey = g.key(&format!("blk.{l}.ffn_down"));
                    if matches!(rows, Rows::DownT(_)) {
                        Box::new(move |i, out: &mut [f32]| {
                            for (j, o) in out.iter_mut().enumerate() {
                                *o = g.down_value(st, dkey, i, j);
                            }
                        })
                    } else {
                        Box::new(move |j, out: &mut [f32]| {
                            for (i, o) in out.iter_mut().enumerate() {
                                *o = g.down_value(st, dkey, i, j);
                            }
                        })
                    }
                }
            };
            let mut report = |b: u64| progress(b, total);
            let mut reader = RowReader {
                ty: s.ty,
                ne0: s.ne0,
                n_rows: s.ne1.unwrap_or(1),
                next_row: 0,
                gen: &*f,
                buf: Vec::new(),
                pos: 0,
                progress: &mut report,
            };
            w.write_tensor_from(&s.name, &mut reader)?;
            bytes +=
                s.ty.bytes_for((s.ne0 * s.ne1.unwrap_or(1)) as u64)
                    .unwrap_or(0);
        }
        if *kind == FileKind::PowerInfer {
            model_bytes = bytes;
            if let (Some(stage), Some(last)) = (&predictor_stage, &state) {
                gen.write_predictor_pt(last, &stage.temp)?;
            }
        }
        files.push(w.finish()?);
    }

    if let (Some(stage), Some(t)) = (&predictor_stage, cfg.sparse_threshold) {
        let path = stage.temp.join("config.json");
        let json = format!("{{\"sparse_threshold\": {t:?}}}\n");
        std::fs::write(&path, json).map_err(|source| SynthError::Io { path, source })?;
    }
    if let Some(stage) = &activation_stage {
        let dir = &stage.temp;
        let bamboo_factor = match cfg.family() {
            Family::Llama | Family::Falcon | Family::Opt => 1.0,
            Family::Bamboo => normal_cdf(BAMBOO_UP_BIAS) as f32,
        };
        let stats = ActivationStats::new(
            plans
                .iter()
                .map(|p| p.probabilities.iter().map(|&x| x * bamboo_factor).collect())
                .collect(),
            "probability",
        );
        stats.write_pt_dir(dir)?;
        stats.write_safetensors(dir.join(SAFETENSORS_FILE_NAME))?;
    }
    for f in files {
        f.commit()?;
    }
    if let Some(stage) = activation_stage {
        stage.commit()?;
    }
    if let Some(stage) = predictor_stage {
        stage.commit()?;
    }
    Ok(SynthReport {
        n_vocab,
        rank,
        predictor_type: pred_ty,
        layers: plans,
        model_bytes,
    })
}
