//! Checks the type each layer's predictor is stored in against held-out inputs from the model's
//! own forward pass: `quantize` and `convert` run a short calibration text through the model,
//! collect every layer's predictor input, and measure each candidate type against the F32
//! predictor ([`powerinfer_predictor::storage`]).

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::{MatMul, ThreadPool};
use powerinfer_predictor::predictor::F32Predictor;
use powerinfer_predictor::storage::{choose_storage, StorageChoice, StorageMargin};

use powerinfer_engine::{Engine, EngineError, FfnObserver, Result};

/// A short built-in calibration text (varied English prose, numbers and code), used when the
/// caller gives none.
pub const CALIBRATION_TEXT: &str = "\
The river rose through the night, and by morning the lower fields were under water. Farmers \
moved their animals to the hills while the children watched from the bridge. In the city, \
the council met at nine to discuss the budget for the new library, which had grown from 4.2 \
million to almost 6 million over two years. \"We cannot keep borrowing,\" said the treasurer. \
A recipe for bread: mix 500 g of flour, 350 ml of warm water, 10 g of salt and 7 g of yeast; \
knead for ten minutes, let it rise for an hour, shape it, and bake at 230 degrees for 35 \
minutes. The function below returns the largest element of a list:\n\
def largest(xs):\n    best = xs[0]\n    for x in xs[1:]:\n        if x > best:\n            \
best = x\n    return best\n\
Questions about the history of mathematics often begin with Euclid, whose Elements organized \
geometry as a chain of proofs from a handful of axioms. Centuries later, Descartes joined \
algebra and geometry, and Newton and Leibniz each developed the calculus. Today, students \
learn that the derivative of x squared is two x, and that the area under a curve can be found \
by integration. On Tuesday, the weather will be cloudy with a chance of rain in the afternoon; \
temperatures will stay between 12 and 17 degrees.\n";

struct Collector {
    layers: Vec<Vec<f32>>,
}

impl FfnObserver for Collector {
    fn observe(&mut self, layer: usize, _t: usize, h: &[f32], _act: &[f32], _s: Option<&[f32]>) {
        if let Some(l) = self.layers.get_mut(layer) {
            l.extend_from_slice(h);
        }
    }
}

/// Runs `tokens` through `engine` (fresh sequences of at most `ctx` tokens) and returns each
/// layer's predictor inputs, `tokens.len() × n_embd` values per layer.
pub fn collect_predictor_inputs(
    engine: &Engine,
    tokens: &[u32],
    ctx: usize,
) -> Result<Vec<Vec<f32>>> {
    let n_layer = engine.model().hparams().n_layer;
    let mut c = Collector {
        layers: vec![Vec::new(); n_layer],
    };
    let mut session = engine.session();
    for chunk in tokens.chunks(ctx.max(1)) {
        session.reset();
        session.eval_observed(chunk, &mut c)?;
    }
    Ok(c.layers)
}

/// Layer `layer`'s predictor as stored in `engine`'s file, in f32; `None` for a layer without
/// one.
pub fn stored_predictor(engine: &Engine, layer: usize) -> Result<Option<F32Predictor>> {
    match engine.model().predictor(layer)? {
        Some(p) => Ok(Some(F32Predictor::from_view(&p)?)),
        None => Ok(None),
    }
}

/// For every layer of `engine` with a predictor: the cheapest of `candidates` (cheapest first)
/// within `margin` of `references[layer]` (default: the predictor stored in the file) on the
/// held-out `inputs` of [`collect_predictor_inputs`], at the engine's threshold. `None` for
/// layers without a predictor.
pub fn choose_predictor_types(
    engine: &Engine,
    inputs: &[Vec<f32>],
    candidates: &[GgmlType],
    margin: &StorageMargin,
    references: Option<&[F32Predictor]>,
) -> Result<Vec<Option<StorageChoice>>> {
    let n_embd = engine.model().hparams().n_embd;
    // A pool of the engine's size for the check (the engine's own is not part of its API).
    let pool = ThreadPool::new(engine.threads());
    let mm = MatMul::new(&pool);
    let mut out = Vec::with_capacity(inputs.len());
    for (layer, h) in inputs.iter().enumerate() {
        let owned;
        let reference = match references {
            Some(r) => r.get(layer).ok_or_else(|| {
                EngineError::Invalid(format!("no reference predictor for layer {layer}"))
            })?,
            None => match stored_predictor(engine, layer)? {
                Some(p) => {
                    owned = p;
                    &owned
                }
                None => {
                    out.push(None);
                    continue;
                }
            },
        };
        let t = h.len() / n_embd;
        let choice = choose_storage(reference, candidates, margin, &mm, h, t, engine.threshold())?;
        out.push(Some(choice));
    }
    Ok(out)
}
