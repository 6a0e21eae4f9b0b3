//! The activation predictor of one layer: scores `p = fc2 · ReLU(fc1 · h)` (spec §4), one per
//! FFN neuron per token; neuron `i` is predicted active for a token when `p_i ≥ θ` (strict `≥`,
//! as every PowerInfer kernel tests it; a NaN score is never active).
//!
//! - [`Predictor`] borrows `fc1` (`rank` rows of `n_embd`, torch shape `[r, n_embd]`) and `fc2`
//!   (`n_ff` rows of `rank`) as kernel [`Weights`] views of any type the CPU kernels support
//!   (F32, F16, BF16, Q8_0, Q4_0, ...; quantized `fc2` needs a rank that is a multiple of the
//!   block size), e.g. straight from a memory-mapped model file, and computes the scores of a
//!   block of tokens with two [`MatMul::gemm`] calls, exactly as the engine's forward pass does.
//! - [`F32Predictor`] owns f32 weights (what the trainer produces); [`F32Predictor::view`] gives
//!   a [`Predictor`] over them. It reads and writes `model_N.safetensors` (`fc1.weight`,
//!   `fc2.weight`, F32 or F16, the form `powerinfer convert` takes) and reads `model_N.pt`.
//! - [`active_set`] / [`active_mask`]: the neurons a score row selects.

use std::path::{Path, PathBuf};

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ops::activation::relu;
use powerinfer_kernels_cpu::{KernelError, MatMul, Weights};
use safetensors::tensor::SafeTensors;

use crate::pt::{self, PtError};

/// Why a predictor could not be built, run, read or written.
#[derive(Debug, thiserror::Error)]
pub enum PredictorError {
    /// Shapes that do not fit together (fc1 vs fc2, input or output lengths).
    #[error("predictor shape mismatch: {0}")]
    Shape(String),
    /// A kernel refused its arguments (unsupported type, row length not a whole block, ...).
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A predictor file is malformed (missing tensor, unsupported dtype, bad safetensors).
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// A `.pt` file problem.
    #[error("{path}: {source}")]
    Pt {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: PtError,
    },
}

/// Result type of this module.
pub type Result<T> = std::result::Result<T, PredictorError>;

/// Name of layer `i`'s predictor file in a predictor folder (safetensors form).
pub fn safetensors_file_name(layer: usize) -> String {
    format!("model_{layer}.safetensors")
}

/// Name of layer `i`'s predictor file in a predictor folder (PowerInfer's `.pt` form).
pub fn pt_file_name(layer: usize) -> String {
    format!("model_{layer}.pt")
}

/// A borrowed predictor: `fc1` is `rank × n_embd`, `fc2` is `n_ff × rank` (ggml row layout,
/// i.e. torch's `[out, in]` weight shape). See the [module docs](self).
#[derive(Clone, Copy, Debug)]
pub struct Predictor<'a> {
    fc1: Weights<'a>,
    fc2: Weights<'a>,
}

impl<'a> Predictor<'a> {
    /// A predictor over two weight views; [`PredictorError::Shape`] unless `fc2.cols() ==
    /// fc1.rows()` and both are non-empty.
    pub fn new(fc1: Weights<'a>, fc2: Weights<'a>) -> Result<Predictor<'a>> {
        if fc1.rows() == 0 || fc1.cols() == 0 || fc2.rows() == 0 {
            return Err(PredictorError::Shape(format!(
                "empty predictor: fc1 {}×{}, fc2 {}×{}",
                fc1.rows(),
                fc1.cols(),
                fc2.rows(),
                fc2.cols()
            )));
        }
        if fc2.cols() != fc1.rows() {
            return Err(PredictorError::Shape(format!(
                "fc1 has rank {} rows but fc2 rows have {} elements",
                fc1.rows(),
                fc2.cols()
            )));
        }
        Ok(Predictor { fc1, fc2 })
    }

    /// A predictor over raw tensor bytes: `fc1` is `rank` rows of `n_embd` elements of
    /// `fc1_ty`, `fc2` is `n_ff` rows of `rank` elements of `fc2_ty` (no alignment needed).
    #[allow(clippy::too_many_arguments)]
    pub fn from_bytes(
        fc1_ty: GgmlType,
        fc1: &'a [u8],
        fc2_ty: GgmlType,
        fc2: &'a [u8],
        n_embd: usize,
        rank: usize,
        n_ff: usize,
    ) -> Result<Predictor<'a>> {
        let w1 = Weights::new(fc1_ty, rank, n_embd, fc1)?;
        let w2 = Weights::new(fc2_ty, n_ff, rank, fc2)?;
        Predictor::new(w1, w2)
    }

    /// The `fc1` view (`rank × n_embd`).
    pub fn fc1(&self) -> &Weights<'a> {
        &self.fc1
    }

    /// The `fc2` view (`n_ff × rank`).
    pub fn fc2(&self) -> &Weights<'a> {
        &self.fc2
    }

    /// The hidden width `r`.
    pub fn rank(&self) -> usize {
        self.fc1.rows()
    }

    /// Input width (the model's `n_embd`).
    pub fn n_embd(&self) -> usize {
        self.fc1.cols()
    }

    /// Number of scores per token (the model's `n_ff`).
    pub fn n_ff(&self) -> usize {
        self.fc2.rows()
    }

    /// Bytes of `fc1` and `fc2` read to score one token (both matrices are read in full).
    pub fn bytes_per_token(&self) -> usize {
        self.fc1.data().len() + self.fc2.data().len()
    }

    /// Scores of `t` tokens: `h` is `[t][n_embd]` (the pre-norm residual `ffn_inp`), `out`
    /// receives `[t][n_ff]`. Allocates the `t × rank` hidden buffer; see
    /// [`scores_with`](Self::scores_with) to reuse one.
    pub fn scores(&self, mm: &MatMul<'_>, h: &[f32], t: usize, out: &mut [f32]) -> Result<()> {
        let mut hidden = Vec::new();
        self.scores_with(mm, h, t, &mut hidden, out)
    }

    /// [`scores`](Self::scores) with a caller-owned hidden buffer (resized as needed).
    pub fn scores_with(
        &self,
        mm: &MatMul<'_>,
        h: &[f32],
        t: usize,
        hidden: &mut Vec<f32>,
        out: &mut [f32],
    ) -> Result<()> {
        self.check_io(h.len(), t, out.len())?;
        if t == 0 {
            return Ok(());
        }
        self.hidden(mm, h, t, hidden)?;
        mm.gemm(&self.fc2, hidden, t, out)?;
        Ok(())
    }

    /// The first layer alone: `hidden = ReLU(fc1 · h)` for `t` tokens (`t × rank` values,
    /// resized), for callers that compute the scores of parts of the neurons separately
    /// ([`scores_of_rows`](Self::scores_of_rows)).
    pub fn hidden(
        &self,
        mm: &MatMul<'_>,
        h: &[f32],
        t: usize,
        hidden: &mut Vec<f32>,
    ) -> Result<()> {
        if t.checked_mul(self.n_embd()) != Some(h.len()) {
            return Err(PredictorError::Shape(format!(
                "input has {} values, expected {t} tokens × {}",
                h.len(),
                self.n_embd()
            )));
        }
        hidden.clear();
        hidden.resize(t * self.rank(), 0.0);
        mm.gemm(&self.fc1, h, t, hidden)?;
        relu(hidden);
        Ok(())
    }

    /// The scores of the neurons `rows` for one token from its [`hidden`](Self::hidden)
    /// values: `out[i] = fc2[rows.start + i] · hidden`, the same bits as those entries of
    /// [`scores`](Self::scores) computed with the same backend.
    pub fn scores_of_rows(
        &self,
        mm: &MatMul<'_>,
        hidden: &[f32],
        rows: std::ops::Range<usize>,
        out: &mut [f32],
    ) -> Result<()> {
        mm.gemv(&self.fc2.row_range(rows)?, hidden, out)?;
        Ok(())
    }

    fn check_io(&self, h_len: usize, t: usize, out_len: usize) -> Result<()> {
        let want_h = t.checked_mul(self.n_embd());
        if want_h != Some(h_len) {
            return Err(PredictorError::Shape(format!(
                "input has {h_len} values, expected {t} tokens × {} = {want_h:?}",
                self.n_embd()
            )));
        }
        let want_out = t.checked_mul(self.n_ff());
        if want_out != Some(out_len) {
            return Err(PredictorError::Shape(format!(
                "output has {out_len} values, expected {t} tokens × {} = {want_out:?}",
                self.n_ff()
            )));
        }
        Ok(())
    }
}

/// Appends to `out` (cleared first) the indices `i` with `scores[i] >= theta`, increasing.
pub fn active_set(scores: &[f32], theta: f32, out: &mut Vec<u32>) {
    out.clear();
    out.extend(
        scores
            .iter()
            .enumerate()
            .filter(|(_, &p)| p >= theta)
            .map(|(i, _)| i as u32),
    );
}

/// `out[i] = scores[i] >= theta` (lengths must match; `out` is resized).
pub fn active_mask(scores: &[f32], theta: f32, out: &mut Vec<bool>) {
    out.clear();
    out.extend(scores.iter().map(|&p| p >= theta));
}

/// Tensor element type of a written predictor file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileDtype {
    /// 32-bit floats.
    F32,
    /// IEEE half floats (round to nearest even).
    F16,
}

/// A predictor owning f32 weights (row-major, torch layout): `fc1` `[rank][n_embd]`, `fc2`
/// `[n_ff][rank]`.
#[derive(Clone, Debug, PartialEq)]
pub struct F32Predictor {
    n_embd: usize,
    rank: usize,
    n_ff: usize,
    fc1: Vec<f32>,
    fc2: Vec<f32>,
}

impl F32Predictor {
    /// A predictor from its weights; [`PredictorError::Shape`] if the lengths do not match the
    /// dimensions or a dimension is 0.
    pub fn new(
        n_embd: usize,
        rank: usize,
        n_ff: usize,
        fc1: Vec<f32>,
        fc2: Vec<f32>,
    ) -> Result<F32Predictor> {
        if n_embd == 0 || rank == 0 || n_ff == 0 {
            return Err(PredictorError::Shape(format!(
                "empty predictor: n_embd {n_embd}, rank {rank}, n_ff {n_ff}"
            )));
        }
        if Some(fc1.len()) != rank.checked_mul(n_embd) {
            return Err(PredictorError::Shape(format!(
                "fc1 has {} values, expected {rank} × {n_embd}",
                fc1.len()
            )));
        }
        if Some(fc2.len()) != n_ff.checked_mul(rank) {
            return Err(PredictorError::Shape(format!(
                "fc2 has {} values, expected {n_ff} × {rank}",
                fc2.len()
            )));
        }
        Ok(F32Predictor {
            n_embd,
            rank,
            n_ff,
            fc1,
            fc2,
        })
    }

    /// Decodes a borrowed predictor of any type to f32 (`powerinfer_gguf::quants::dequantize`).
    pub fn from_view(p: &Predictor<'_>) -> Result<F32Predictor> {
        let decode = |w: &Weights<'_>| -> Result<Vec<f32>> {
            let mut out = vec![0f32; w.rows() * w.cols()];
            powerinfer_gguf::quants::dequantize(w.ty(), w.data(), &mut out)
                .map_err(|e| PredictorError::Shape(format!("cannot decode {}: {e}", w.ty())))?;
            Ok(out)
        };
        F32Predictor::new(
            p.n_embd(),
            p.rank(),
            p.n_ff(),
            decode(p.fc1())?,
            decode(p.fc2())?,
        )
    }

    /// Input width.
    pub fn n_embd(&self) -> usize {
        self.n_embd
    }
    /// Hidden width.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of neurons scored.
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }
    /// `fc1`, `[rank][n_embd]`.
    pub fn fc1(&self) -> &[f32] {
        &self.fc1
    }
    /// `fc2`, `[n_ff][rank]`.
    pub fn fc2(&self) -> &[f32] {
        &self.fc2
    }
    /// Mutable `fc1`.
    pub fn fc1_mut(&mut self) -> &mut [f32] {
        &mut self.fc1
    }
    /// Mutable `fc2`.
    pub fn fc2_mut(&mut self) -> &mut [f32] {
        &mut self.fc2
    }

    /// A kernel view of these weights (F32).
    pub fn view(&self) -> Predictor<'_> {
        let w1 = Weights::new(
            GgmlType::F32,
            self.rank,
            self.n_embd,
            bytemuck::cast_slice(&self.fc1),
        )
        .expect("F32 view of checked shapes");
        let w2 = Weights::new(
            GgmlType::F32,
            self.n_ff,
            self.rank,
            bytemuck::cast_slice(&self.fc2),
        )
        .expect("F32 view of checked shapes");
        Predictor { fc1: w1, fc2: w2 }
    }

    /// The safetensors form: `fc1.weight` `[rank, n_embd]` and `fc2.weight` `[n_ff, rank]` in
    /// `dtype`, metadata `{"format": "pt"}` (as `safetensors.torch.save_file` writes it).
    /// Deterministic bytes.
    pub fn to_safetensors_bytes(&self, dtype: FileDtype) -> Vec<u8> {
        let (name, size) = match dtype {
            FileDtype::F32 => ("F32", 4),
            FileDtype::F16 => ("F16", 2),
        };
        let n1 = self.fc1.len() * size;
        let n2 = self.fc2.len() * size;
        let mut header = format!(
            "{{\"__metadata__\":{{\"format\":\"pt\"}},\
             \"fc1.weight\":{{\"dtype\":\"{name}\",\"shape\":[{},{}],\"data_offsets\":[0,{n1}]}},\
             \"fc2.weight\":{{\"dtype\":\"{name}\",\"shape\":[{},{}],\"data_offsets\":[{n1},{}]}}}}",
            self.rank,
            self.n_embd,
            self.n_ff,
            self.rank,
            n1 + n2
        );
        while header.len() % 8 != 0 {
            header.push(' ');
        }
        let mut out = Vec::with_capacity(8 + header.len() + n1 + n2);
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        for v in [&self.fc1, &self.fc2] {
            match dtype {
                FileDtype::F32 => out.extend(v.iter().flat_map(|x| x.to_le_bytes())),
                FileDtype::F16 => out.extend(
                    v.iter()
                        .flat_map(|&x| powerinfer_gguf::quants::f32_to_f16_bits(x).to_le_bytes()),
                ),
            }
        }
        out
    }

    /// Writes the safetensors form to `path` (atomically).
    pub fn write_safetensors(&self, path: impl AsRef<Path>, dtype: FileDtype) -> Result<()> {
        let path = path.as_ref();
        pt::write_atomic(path, &self.to_safetensors_bytes(dtype)).map_err(|source| {
            PredictorError::Io {
                path: path.to_path_buf(),
                source,
            }
        })
    }

    /// Reads `fc1.weight` / `fc2.weight` from safetensors bytes (F32, F16 or BF16).
    pub fn from_safetensors_bytes(bytes: &[u8]) -> std::result::Result<F32Predictor, String> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| e.to_string())?;
        let get = |name: &str| -> std::result::Result<(Vec<usize>, Vec<f32>), String> {
            let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
            let v = crate::stats::safetensors_floats(t.dtype(), t.data())
                .ok_or_else(|| format!("{name}: unsupported dtype {:?}", t.dtype()))?;
            Ok((t.shape().to_vec(), v))
        };
        let (s1, fc1) = get("fc1.weight")?;
        let (s2, fc2) = get("fc2.weight")?;
        F32Predictor::from_shaped(&s1, fc1, &s2, fc2)
    }

    fn from_shaped(
        s1: &[usize],
        fc1: Vec<f32>,
        s2: &[usize],
        fc2: Vec<f32>,
    ) -> std::result::Result<F32Predictor, String> {
        if s1.len() != 2 || s2.len() != 2 || s1[0] != s2[1] {
            return Err(format!(
                "fc1.weight {s1:?} and fc2.weight {s2:?} are not [r, n_embd] and [n_ff, r]"
            ));
        }
        F32Predictor::new(s1[1], s1[0], s2[0], fc1, fc2).map_err(|e| e.to_string())
    }

    /// Reads a predictor file: `.pt` (a torch state dict, PowerInfer's form) or safetensors.
    pub fn read(path: impl AsRef<Path>) -> Result<F32Predictor> {
        let path = path.as_ref();
        if path.extension().is_some_and(|e| e == "pt") {
            let entries = pt::read_state_dict(path).map_err(|source| PredictorError::Pt {
                path: path.to_path_buf(),
                source,
            })?;
            let find = |name: &str| {
                entries
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, t)| t)
                    .ok_or_else(|| PredictorError::Format {
                        path: path.to_path_buf(),
                        msg: format!("no {name}"),
                    })
            };
            let (t1, t2) = (find("fc1.weight")?, find("fc2.weight")?);
            return F32Predictor::from_shaped(
                t1.shape(),
                t1.to_f32_vec(),
                t2.shape(),
                t2.to_f32_vec(),
            )
            .map_err(|msg| PredictorError::Format {
                path: path.to_path_buf(),
                msg,
            });
        }
        let bytes = std::fs::read(path).map_err(|source| PredictorError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        F32Predictor::from_safetensors_bytes(&bytes).map_err(|msg| PredictorError::Format {
            path: path.to_path_buf(),
            msg,
        })
    }
}

/// The layer of a predictor tensor `blk.N.fc1.weight` / `blk.N.fc2.weight`; `None` for any
/// other tensor.
pub fn predictor_layer(name: &str) -> Option<usize> {
    let (n, tail) = name.strip_prefix("blk.")?.split_once('.')?;
    matches!(tail, "fc1.weight" | "fc2.weight")
        .then(|| n.parse().ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use powerinfer_kernels_cpu::ThreadPool;

    fn sample() -> F32Predictor {
        let (e, r, f) = (8, 4, 6);
        let fc1 = (0..r * e)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) / 8.0)
            .collect();
        let fc2 = (0..f * r)
            .map(|i| ((i * 5 % 9) as f32 - 4.0) / 4.0)
            .collect();
        F32Predictor::new(e, r, f, fc1, fc2).unwrap()
    }

    /// f64 definition of the scores.
    fn reference(p: &F32Predictor, h: &[f32]) -> Vec<f64> {
        let hid: Vec<f64> = (0..p.rank)
            .map(|j| {
                (0..p.n_embd)
                    .map(|c| p.fc1[j * p.n_embd + c] as f64 * h[c] as f64)
                    .sum::<f64>()
                    .max(0.0)
            })
            .collect();
        (0..p.n_ff)
            .map(|i| {
                (0..p.rank)
                    .map(|j| p.fc2[i * p.rank + j] as f64 * hid[j])
                    .sum()
            })
            .collect()
    }

    #[test]
    fn scores_match_the_definition_and_shapes_are_checked() {
        let p = sample();
        let pool = ThreadPool::single();
        let mm = MatMul::new(&pool);
        let t = 3;
        let h: Vec<f32> = (0..t * 8)
            .map(|i| ((i * 3 % 7) as f32 - 3.0) / 2.0)
            .collect();
        let mut out = vec![0f32; t * 6];
        let v = p.view();
        assert_eq!((v.rank(), v.n_embd(), v.n_ff()), (4, 8, 6));
        assert_eq!(v.bytes_per_token(), 4 * (32 + 24));
        v.scores(&mm, &h, t, &mut out).unwrap();
        for k in 0..t {
            let want = reference(&p, &h[k * 8..(k + 1) * 8]);
            for (a, b) in out[k * 6..(k + 1) * 6].iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
        assert!(matches!(
            v.scores(&mm, &h[1..], t, &mut out),
            Err(PredictorError::Shape(_))
        ));
        assert!(matches!(
            v.scores(&mm, &h, t, &mut out[1..]),
            Err(PredictorError::Shape(_))
        ));
        // fc1 rank 4, fc2 rows of 3: mismatch.
        let raw1 = vec![0u8; 4 * 8 * 4];
        let raw2 = vec![0u8; 6 * 3 * 4];
        let w1 = Weights::new(GgmlType::F32, 4, 8, &raw1).unwrap();
        let w2 = Weights::new(GgmlType::F32, 6, 3, &raw2).unwrap();
        assert!(matches!(
            Predictor::new(w1, w2),
            Err(PredictorError::Shape(_))
        ));
        assert!(F32Predictor::new(8, 4, 6, vec![0.0; 31], vec![0.0; 24]).is_err());
        // Raw bytes of a quantized fc2 whose rows are not whole blocks: a kernel error.
        assert!(matches!(
            Predictor::from_bytes(GgmlType::F32, &raw1, GgmlType::Q4_0, &[0; 18], 8, 4, 6),
            Err(PredictorError::Kernel(_))
        ));
    }

    #[test]
    fn active_set_is_inclusive() {
        let s = [0.5, -1.0, 0.0, f32::NAN, 2.0];
        let mut a = Vec::new();
        active_set(&s, 0.0, &mut a);
        assert_eq!(a, [0, 2, 4]);
        let mut m = Vec::new();
        active_mask(&s, 0.5, &mut m);
        assert_eq!(m, [true, false, false, false, true]);
    }

    #[test]
    fn safetensors_and_pt_round_trip() {
        let p = sample();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(safetensors_file_name(0));
        p.write_safetensors(&path, FileDtype::F32).unwrap();
        assert_eq!(F32Predictor::read(&path).unwrap(), p);
        // The values are multiples of 1/8 and 1/4: exact in f16.
        p.write_safetensors(&path, FileDtype::F16).unwrap();
        assert_eq!(F32Predictor::read(&path).unwrap(), p);
        let pt_path = dir.path().join(pt_file_name(0));
        let t1 = pt::PtTensor::from_f32(vec![4, 8], p.fc1()).unwrap();
        let t2 = pt::PtTensor::from_f32(vec![6, 4], p.fc2()).unwrap();
        pt::write_state_dict(
            &pt_path,
            &[("fc1.weight".into(), t1), ("fc2.weight".into(), t2)],
        )
        .unwrap();
        assert_eq!(F32Predictor::read(&pt_path).unwrap(), p);
        let back = F32Predictor::from_view(&p.view()).unwrap();
        assert_eq!(back, p);
        std::fs::write(&path, b"junk").unwrap();
        assert!(matches!(
            F32Predictor::read(&path),
            Err(PredictorError::Format { .. })
        ));
    }
}
