//! The type a predictor is stored in: a predictor written as F16, Q8_0 or Q4_0 selects a
//! slightly different active set than the F32 predictor it came from, and a layer whose weights
//! do not survive the conversion (values past F16's range, scales lost to rounding) can select
//! nothing at all. [`stored_quality`] measures a stored type on held-out inputs, against the
//! F32 predictor's own selection, running the stored bytes through the same kernels as the
//! engine; [`choose_storage`] picks the cheapest type within a [`StorageMargin`].

use powerinfer_gguf::quants::{dequantize_to_vec, quantize_to_vec};
use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::MatMul;

use crate::predictor::{F32Predictor, Predictor, PredictorError, Result};

/// How far a stored predictor may drift from the F32 one.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct StorageMargin {
    /// Largest allowed loss of recall against the F32 predictor's active set (0.01: the stored
    /// predictor must select at least 99% of the (token, neuron) pairs the F32 one selects).
    pub recall_drop: f64,
    /// Largest allowed relative rise of the predicted density (0.1: at most 10% more
    /// (token, neuron) pairs selected than the F32 predictor), which costs FFN bytes.
    pub density_rise: f64,
}

impl Default for StorageMargin {
    fn default() -> StorageMargin {
        StorageMargin {
            recall_drop: 0.01,
            density_rise: 0.10,
        }
    }
}

impl StorageMargin {
    /// A margin of `recall_drop` and `density_rise` (see the fields).
    pub fn new(recall_drop: f64, density_rise: f64) -> StorageMargin {
        StorageMargin {
            recall_drop,
            density_rise,
        }
    }
}

/// Storage types tried by [`choose_storage`] by default, cheapest first.
pub const STORAGE_CANDIDATES: [GgmlType; 4] =
    [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::F16, GgmlType::F32];

/// How one stored type of one layer's predictor compares with its F32 form on held-out inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StoredQuality {
    /// The stored type (of both `fc1` and `fc2`).
    pub ty: GgmlType,
    /// Share of the (token, neuron) pairs the F32 predictor selects that the stored one also
    /// selects (1 when the F32 predictor selects nothing).
    pub recall: f64,
    /// Share of all (token, neuron) pairs the stored predictor selects.
    pub density: f64,
    /// The same share for the F32 predictor.
    pub reference_density: f64,
    /// Bytes of `fc1` and `fc2` in this type (read once per token).
    pub bytes: u64,
}

impl StoredQuality {
    /// Whether this stored type is within `margin` of the F32 predictor.
    pub fn within(&self, margin: &StorageMargin) -> bool {
        self.recall >= 1.0 - margin.recall_drop - 1e-12
            && self.density <= self.reference_density * (1.0 + margin.density_rise) + 1e-12
    }
}

/// What [`choose_storage`] found for one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct StorageChoice {
    /// The type to store the layer's predictor in: the cheapest candidate within the margin,
    /// or F32 when none is ([`fell_back`](Self::fell_back)).
    pub ty: GgmlType,
    /// Every candidate measured, in the order tried (candidates whose rows are not whole
    /// blocks of the type are left out), then F32 when the layer fell back to it.
    pub measured: Vec<StoredQuality>,
    /// No candidate was within the margin; the layer is kept in F32.
    pub fell_back: bool,
}

/// Whether `ty` can hold the predictor: both matrices' rows are whole blocks of it.
pub fn can_store(p: &F32Predictor, ty: GgmlType) -> bool {
    let b = ty.block_size();
    p.n_embd() % b == 0 && p.rank() % b == 0
}

/// Measures `ty` for predictor `p` on `t` held-out inputs `h` (`t × n_embd`, the predictor
/// inputs the engine would feed) at threshold `theta`: both forms scored with `mm`'s kernels,
/// the stored one from its quantized bytes.
pub fn stored_quality(
    p: &F32Predictor,
    ty: GgmlType,
    mm: &MatMul<'_>,
    h: &[f32],
    t: usize,
    theta: f32,
) -> Result<StoredQuality> {
    if !can_store(p, ty) {
        return Err(PredictorError::Shape(format!(
            "rows of {} and {} values are not whole {ty} blocks",
            p.n_embd(),
            p.rank()
        )));
    }
    let encode =
        |v: &[f32]| quantize_to_vec(ty, v).map_err(|e| PredictorError::Shape(format!("{ty}: {e}")));
    let (fc1, fc2) = (encode(p.fc1())?, encode(p.fc2())?);
    let stored = Predictor::from_bytes(ty, &fc1, ty, &fc2, p.n_embd(), p.rank(), p.n_ff())?;
    let n = t * p.n_ff();
    let mut want = vec![0f32; n];
    let mut got = vec![0f32; n];
    p.view().scores(mm, h, t, &mut want)?;
    stored.scores(mm, h, t, &mut got)?;
    let (mut both, mut reference, mut selected) = (0u64, 0u64, 0u64);
    for (&a, &b) in want.iter().zip(&got) {
        let (a, b) = (a >= theta, b >= theta);
        both += (a && b) as u64;
        reference += a as u64;
        selected += b as u64;
    }
    let share = |k: u64| if n == 0 { 0.0 } else { k as f64 / n as f64 };
    Ok(StoredQuality {
        ty,
        recall: if reference == 0 {
            1.0
        } else {
            both as f64 / reference as f64
        },
        density: share(selected),
        reference_density: share(reference),
        bytes: (fc1.len() + fc2.len()) as u64,
    })
}

/// The cheapest of `candidates` (tried in order, so list them cheapest first) whose
/// [`stored_quality`] is within `margin`; F32 with [`StorageChoice::fell_back`] when none is.
/// Stops at the first type within the margin.
pub fn choose_storage(
    p: &F32Predictor,
    candidates: &[GgmlType],
    margin: &StorageMargin,
    mm: &MatMul<'_>,
    h: &[f32],
    t: usize,
    theta: f32,
) -> Result<StorageChoice> {
    let mut measured = Vec::new();
    for &ty in candidates {
        if !can_store(p, ty) {
            continue;
        }
        let q = stored_quality(p, ty, mm, h, t, theta)?;
        measured.push(q);
        if q.within(margin) {
            return Ok(StorageChoice {
                ty,
                measured,
                fell_back: false,
            });
        }
    }
    if !measured.iter().any(|q| q.ty == GgmlType::F32) {
        measured.push(stored_quality(p, GgmlType::F32, mm, h, t, theta)?);
    }
    Ok(StorageChoice {
        ty: GgmlType::F32,
        measured,
        fell_back: true,
    })
}

/// The f32 values of a stored tensor (`ty` bytes), for rebuilding the F32 reference of a
/// predictor read from a model file.
pub fn stored_values(ty: GgmlType, bytes: &[u8]) -> Result<Vec<f32>> {
    dequantize_to_vec(ty, bytes).map_err(|e| PredictorError::Shape(format!("{ty}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::Rng;
    use powerinfer_kernels_cpu::ThreadPool;

    /// A random predictor (`n_embd` 64, rank 32, `n_ff` 96) with `fc1` scaled by `s1` and `fc2`
    /// by `s2`, and `t` random inputs; threshold 0 selects about half of the neurons.
    fn setup(s1: f32, s2: f32, t: usize) -> (F32Predictor, Vec<f32>) {
        let (e, r, f) = (64, 32, 96);
        let mut rng = Rng::new(7);
        let mut draw =
            |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| rng.normal() as f32 * s).collect() };
        let fc1 = draw(r * e, s1);
        let fc2 = draw(f * r, s2);
        let h = draw(t * e, 1.0);
        (F32Predictor::new(e, r, f, fc1, fc2).unwrap(), h)
    }

    #[test]
    fn f32_is_exact_and_f16_is_within_the_margin() {
        let (p, h) = setup(0.1, 0.1, 40);
        let pool = ThreadPool::single();
        let mm = MatMul::new(&pool);
        let exact = stored_quality(&p, GgmlType::F32, &mm, &h, 40, 0.0).unwrap();
        assert_eq!(exact.recall, 1.0);
        assert_eq!(exact.density, exact.reference_density);
        assert!(exact.density > 0.3 && exact.density < 0.7, "{exact:?}");
        assert_eq!(exact.bytes, 4 * (32 * 64 + 96 * 32));
        let half = stored_quality(&p, GgmlType::F16, &mm, &h, 40, 0.0).unwrap();
        assert!(half.within(&StorageMargin::default()), "{half:?}");
        assert_eq!(half.bytes * 2, exact.bytes);
        // Q4_0 keeps most of the set but not all of it.
        let q4 = stored_quality(&p, GgmlType::Q4_0, &mm, &h, 40, 0.0).unwrap();
        assert!(q4.recall > 0.8 && q4.recall < 1.0, "{q4:?}");
    }

    #[test]
    fn weights_past_f16_range_fall_back_to_f32() {
        // The products are those of a well-scaled predictor, but fc2's values overflow F16 and
        // fc1's underflow it: stored in F16 the layer selects nothing.
        let (p, h) = setup(1e-7, 1e5, 20);
        let pool = ThreadPool::single();
        let mm = MatMul::new(&pool);
        let half = stored_quality(&p, GgmlType::F16, &mm, &h, 20, 0.0).unwrap();
        assert!(half.recall < 0.05, "{half:?}");
        assert!(!half.within(&StorageMargin::default()));
        let margin = StorageMargin::default();
        let only_f16 = choose_storage(&p, &[GgmlType::F16], &margin, &mm, &h, 20, 0.0).unwrap();
        assert!(only_f16.fell_back);
        assert_eq!(only_f16.ty, GgmlType::F32);
        assert_eq!(only_f16.measured.len(), 2);
        assert_eq!(only_f16.measured[1].recall, 1.0);
        let all = choose_storage(&p, &STORAGE_CANDIDATES, &margin, &mm, &h, 20, 0.0).unwrap();
        assert_eq!(all.ty, GgmlType::F32);
        assert!(!all.fell_back);
        assert_eq!(all.measured.len(), 4);
    }

    #[test]
    fn the_cheapest_type_within_the_margin_wins() {
        let (p, h) = setup(0.1, 0.1, 40);
        let pool = ThreadPool::single();
        let mm = MatMul::new(&pool);
        // A loose margin takes Q4_0 at once; an exact one needs F32.
        let loose = StorageMargin::new(0.5, 1.0);
        let c = choose_storage(&p, &STORAGE_CANDIDATES, &loose, &mm, &h, 40, 0.0).unwrap();
        assert_eq!((c.ty, c.measured.len()), (GgmlType::Q4_0, 1));
        let exact = StorageMargin::new(0.0, 0.0);
        let c = choose_storage(&p, &STORAGE_CANDIDATES, &exact, &mm, &h, 40, 0.0).unwrap();
        let last = c.measured.last().unwrap();
        assert!(last.within(&exact));
        assert!(c.measured[..c.measured.len() - 1]
            .iter()
            .all(|q| !q.within(&exact)));
    }

    #[test]
    fn types_whose_blocks_do_not_fit_are_skipped() {
        let mut rng = Rng::new(3);
        let fc1: Vec<f32> = (0..24 * 40).map(|_| rng.normal() as f32).collect();
        let fc2: Vec<f32> = (0..10 * 24).map(|_| rng.normal() as f32).collect();
        let p = F32Predictor::new(40, 24, 10, fc1, fc2).unwrap();
        let h: Vec<f32> = (0..3 * 40).map(|_| rng.normal() as f32).collect();
        let pool = ThreadPool::single();
        let mm = MatMul::new(&pool);
        assert!(!can_store(&p, GgmlType::Q4_0));
        assert!(stored_quality(&p, GgmlType::Q8_0, &mm, &h, 3, 0.0).is_err());
        let c = choose_storage(
            &p,
            &STORAGE_CANDIDATES,
            &StorageMargin::default(),
            &mm,
            &h,
            3,
            0.0,
        )
        .unwrap();
        assert_eq!(c.measured[0].ty, GgmlType::F16);
    }
}
