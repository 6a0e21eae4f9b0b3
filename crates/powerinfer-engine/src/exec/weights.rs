//! Kernel views of a model's matrices for one evaluation ([`ModelMats`]), and the repacked
//! copies of dense Q4_0 matrices that one-token products read instead ([`Repacked`]).

use std::sync::OnceLock;

use powerinfer_gguf::{GgmlType, GgufFile};
use powerinfer_kernels_cpu::{GemmJob, GemvJob, MatMul, PackedGemvJob, PackedQ4_0, Weights};
use powerinfer_predictor::predictor::Predictor;

use crate::error::Result;
use crate::model::{Ffn, Model, Qkv, TensorRef};

/// A kernel view of one matrix, with the cell of its repacked copy when it is marked for
/// repacking.
pub(crate) struct Mat<'m> {
    /// The file's bytes.
    pub(crate) w: Weights<'m>,
    packed: Option<&'m OnceLock<Option<PackedQ4_0>>>,
}

impl Mat<'_> {
    /// Bytes of the whole matrix.
    pub(crate) fn bytes(&self) -> u64 {
        self.w.data().len() as u64
    }
}

/// The Q/K/V projections of a layer.
pub(crate) enum QkvMats<'m> {
    /// `attn_q`, `attn_k`, `attn_v`.
    Separate([Mat<'m>; 3]),
    /// `attn_qkv` (rows: Q, then K, then V).
    Fused(Mat<'m>),
}

/// The FFN matrices of a layer.
pub(crate) enum FfnMats<'m> {
    /// A dense file's FFN: `down` has `n_embd` rows of `n_ff`.
    Dense {
        /// `ffn_gate`, if the FFN has one.
        gate: Option<Mat<'m>>,
        /// `ffn_up`.
        up: Mat<'m>,
        /// `ffn_down`.
        down: Mat<'m>,
    },
    /// A PowerInfer file's FFN: one row per neuron in all three, and the predictor.
    Sparse {
        /// `ffn_gate`, if the FFN has one.
        gate: Option<Weights<'m>>,
        /// `ffn_up`.
        up: Weights<'m>,
        /// `ffn_down_t`.
        down_t: Weights<'m>,
        /// `fc2 · ReLU(fc1 · h)`.
        predictor: Predictor<'m>,
    },
}

impl FfnMats<'_> {
    /// Bytes of the gate and up matrices.
    pub(crate) fn gate_up_bytes(&self) -> u64 {
        let b = |w: &Weights<'_>| w.data().len() as u64;
        match self {
            FfnMats::Dense { gate, up, .. } => gate.as_ref().map_or(0, |g| g.bytes()) + up.bytes(),
            FfnMats::Sparse { gate, up, .. } => gate.as_ref().map_or(0, b) + b(up),
        }
    }

    /// Bytes of the down matrix (`ffn_down` or `ffn_down_t`).
    pub(crate) fn down_bytes(&self) -> u64 {
        match self {
            FfnMats::Dense { down, .. } => down.bytes(),
            FfnMats::Sparse { down_t, .. } => down_t.data().len() as u64,
        }
    }
}

/// The matrices of a layer.
pub(crate) struct LayerMats<'m> {
    /// Q/K/V.
    pub(crate) qkv: QkvMats<'m>,
    /// `attn_output`.
    pub(crate) wo: Mat<'m>,
    /// The FFN.
    pub(crate) ffn: FfnMats<'m>,
}

/// Views of every matrix of a model for one evaluation.
pub(crate) struct ModelMats<'m> {
    /// Per layer.
    pub(crate) layers: Vec<LayerMats<'m>>,
    /// The output head.
    pub(crate) output: Mat<'m>,
}

/// Repacked copies of the dense Q4_0 matrices of one-token products (`EngineOptions::repack`):
/// each is made at the matrix's first one-token product (so loading and prompts, which read
/// the file's layout, pay nothing) or all at once by [`Repacked::make_all`].
#[derive(Default)]
pub(crate) struct Repacked {
    /// Per layer and [`Slot`]; empty when repacking is off or the CPU has no packed kernel.
    layers: Vec<[OnceLock<Option<PackedQ4_0>>; SLOTS]>,
    output: OnceLock<Option<PackedQ4_0>>,
    on: bool,
}

impl Repacked {
    /// Cells for every layer when `on` and `mm`'s backend has the packed kernel, else none.
    pub(crate) fn new(model: &Model, mm: &MatMul<'_>, on: bool) -> Repacked {
        let on = on && mm.has_packed_q4_0();
        Repacked {
            layers: if on {
                model.layers.iter().map(|_| Default::default()).collect()
            } else {
                Vec::new()
            },
            output: OnceLock::new(),
            on,
        }
    }

    fn cell(
        &self,
        layer: usize,
        slot: Slot,
        t: &TensorRef,
    ) -> Option<&OnceLock<Option<PackedQ4_0>>> {
        (self.on && t.ty == GgmlType::Q4_0).then(|| &self.layers[layer][slot as usize])
    }

    /// Makes every copy no product has made yet.
    pub(crate) fn make_all(&self, mats: &ModelMats<'_>, mm: &MatMul<'_>) {
        let layer_mats = mats.layers.iter().flat_map(|l| {
            let qkv: Vec<&Mat<'_>> = match &l.qkv {
                QkvMats::Separate(m) => m.iter().collect(),
                QkvMats::Fused(m) => vec![m],
            };
            let ffn: Vec<&Mat<'_>> = match &l.ffn {
                FfnMats::Dense { gate, up, down } => gate.iter().chain([up, down]).collect(),
                FfnMats::Sparse { .. } => Vec::new(),
            };
            qkv.into_iter().chain([&l.wo]).chain(ffn)
        });
        for m in std::iter::once(&mats.output).chain(layer_mats) {
            if let Some(cell) = m.packed {
                cell.get_or_init(|| mm.pack_q4_0(&m.w));
            }
        }
    }

    /// Bytes of the copies made so far.
    pub(crate) fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .chain([&self.output])
            .filter_map(|c| c.get().and_then(Option::as_ref))
            .map(PackedQ4_0::bytes)
            .sum()
    }
}

/// A kernel view of `t` in `file`.
fn view<'m>(file: &'m GgufFile, t: &TensorRef) -> Result<Weights<'m>> {
    Ok(Weights::new(t.ty, t.rows, t.cols, file.data_of(&t.info))?)
}

impl<'m> ModelMats<'m> {
    /// Views of every matrix of `model`, with `repacked`'s cells.
    pub(crate) fn new(model: &'m Model, repacked: &'m Repacked) -> Result<ModelMats<'m>> {
        let file = model.file();
        let mut layers = Vec::with_capacity(model.layers.len());
        for (l, layer) in model.layers.iter().enumerate() {
            let mat = |slot: Slot, t: &TensorRef| -> Result<Mat<'m>> {
                Ok(Mat {
                    w: view(file, t)?,
                    packed: repacked.cell(l, slot, t),
                })
            };
            let qkv = match &layer.qkv {
                Qkv::Separate { wq, wk, wv, .. } => {
                    QkvMats::Separate([mat(Slot::Q, wq)?, mat(Slot::K, wk)?, mat(Slot::V, wv)?])
                }
                Qkv::Fused(w) => QkvMats::Fused(mat(Slot::Qkv, w)?),
            };
            let ffn = match &layer.ffn {
                Ffn::Dense { gate, up, down } => FfnMats::Dense {
                    gate: gate.as_ref().map(|g| mat(Slot::Gate, g)).transpose()?,
                    up: mat(Slot::Up, up)?,
                    down: mat(Slot::Down, down)?,
                },
                Ffn::Sparse {
                    gate,
                    up,
                    down_t,
                    fc1,
                    fc2,
                } => FfnMats::Sparse {
                    gate: gate.as_ref().map(|g| view(file, g)).transpose()?,
                    up: view(file, up)?,
                    down_t: view(file, down_t)?,
                    predictor: Predictor::new(view(file, fc1)?, view(file, fc2)?)?,
                },
            };
            layers.push(LayerMats {
                qkv,
                wo: mat(Slot::Wo, &layer.wo)?,
                ffn,
            });
        }
        let output = Mat {
            w: view(file, &model.output)?,
            packed: (repacked.on && model.output.ty == GgmlType::Q4_0).then_some(&repacked.output),
        };
        Ok(ModelMats { layers, output })
    }
}

/// `y = W x` for `t` tokens: through the repacked copy of `m` for one token when it is marked
/// for repacking (bit-identical results), else the ordinary GEMM.
pub(crate) fn product(
    mm: &MatMul<'_>,
    m: &Mat<'_>,
    x: &[f32],
    t: usize,
    y: &mut [f32],
) -> Result<()> {
    match packed_copy(mm, m, t) {
        Some(p) => mm.gemv_packed(p, x, y)?,
        None => mm.gemm(&m.w, x, t, y)?,
    }
    Ok(())
}

/// The repacked copy of `m` for a `t`-token product, made now if this is its first use.
fn packed_copy<'a>(mm: &MatMul<'_>, m: &'a Mat<'_>, t: usize) -> Option<&'a PackedQ4_0> {
    let cell = m.packed.filter(|_| t == 1)?;
    cell.get_or_init(|| mm.pack_q4_0(&m.w)).as_ref()
}

/// Several one-token products `y = W x` in one dispatch (a layer's Q, K and V; a dense FFN's
/// gate and up): [`MatMul::gemv_packed_multi`] when every matrix has a repacked copy,
/// [`MatMul::gemv_multi`] when none has, else one product after another. The same bits as
/// [`product`] on each.
pub(crate) fn products_one_token(
    mm: &MatMul<'_>,
    jobs: &mut [(&Mat<'_>, &[f32], &mut [f32])],
) -> Result<()> {
    let packed: Vec<Option<&PackedQ4_0>> =
        jobs.iter().map(|(m, _, _)| packed_copy(mm, m, 1)).collect();
    if let Some(all) = packed.iter().copied().collect::<Option<Vec<_>>>() {
        let mut pj: Vec<PackedGemvJob<'_>> = jobs
            .iter_mut()
            .zip(all)
            .map(|((_, x, y), w)| PackedGemvJob { w, x, y })
            .collect();
        mm.gemv_packed_multi(&mut pj)?;
    } else if packed.iter().all(Option::is_none) {
        let mut gj: Vec<GemvJob<'_>> = jobs
            .iter_mut()
            .map(|(m, x, y)| GemvJob { w: m.w, x, y })
            .collect();
        mm.gemv_multi(&mut gj)?;
    } else {
        for (m, x, y) in jobs.iter_mut() {
            product(mm, m, x, 1, y)?;
        }
    }
    Ok(())
}

/// Several `t`-token products `y = W x` in one dispatch (a layer's Q, K and V; a dense FFN's
/// gate and up): [`products_one_token`] for one token, [`MatMul::gemm_multi`] for more (the
/// row blocks of all matrices shared out together, a shared input prepared once). The same
/// bits as [`product`] on each.
pub(crate) fn products(
    mm: &MatMul<'_>,
    jobs: &mut [(&Mat<'_>, &[f32], &mut [f32])],
    t: usize,
) -> Result<()> {
    if t == 1 {
        return products_one_token(mm, jobs);
    }
    let mut gj: Vec<GemmJob<'_>> = jobs
        .iter_mut()
        .map(|(m, x, y)| GemmJob { w: m.w, x, y })
        .collect();
    mm.gemm_multi(&mut gj, t)?;
    Ok(())
}

/// A dense matrix of a layer: the ones one-token products may read repacked.
#[derive(Clone, Copy)]
pub(crate) enum Slot {
    Q,
    K,
    V,
    Qkv,
    Wo,
    Gate,
    Up,
    Down,
}

/// Number of [`Slot`]s.
pub(crate) const SLOTS: usize = 8;
