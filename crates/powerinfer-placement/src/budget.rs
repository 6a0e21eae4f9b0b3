//! Exact byte accounting of a VRAM budget, in PowerInfer's order (reference §3.2):
//!
//! 1. dense tensors, queued by class — attention (`blk.N.attn_*`), predictors (`blk.N.fc1`,
//!    `blk.N.fc2`), FFN norms (`blk.N.ffn_norm.*`), output (`output.*`, `output_norm.*`) —
//!    each class in layer order; a tensor goes to the GPU if its bytes fit in what is left, and
//!    at the first one that does not fit, placing stops (the dense offload is then incomplete);
//! 2. the KV cache for the context length, only after a complete dense offload, as two equal
//!    chunks (V, then K) of `n_layer · n_ctx · n_embd_gqa · 2` bytes (f16), each reserved if it
//!    fits;
//! 3. a scratch reserve (compute buffers), if it fits;
//! 4. the rest is the FFN budget, spent by the solver on neuron rows; it is 0 when the dense
//!    offload is incomplete or the scratch did not fit (PowerInfer then skips the split).
//!
//! Token embeddings, position embeddings, `rope_freqs` and the FFN matrices themselves never
//! count as dense tensors (they stay in host memory). One neuron of layer `l` costs the bytes of
//! its rows in `ffn_up`, `ffn_gate` (if any) and `ffn_down_t`: `n_embd` elements each, in that
//! tensor's type ([`powerinfer_gguf::GgmlType::bytes_for`]).

use powerinfer_gguf::{GgmlType, GgufFile};

use crate::error::{PlacementError, Result};

/// The offloading class of a dense tensor, in PowerInfer's priority order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DenseClass {
    /// Attention weights and norms (`blk.N.attn_*`).
    Attention,
    /// The activation predictor (`blk.N.fc1`, `blk.N.fc2`).
    Predictor,
    /// The FFN input norm (`blk.N.ffn_norm.*`).
    FfnNorm,
    /// The output head and final norm (`output.*`, `output_norm.*`).
    Output,
}

/// A tensor that is offloaded whole (not per neuron).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenseTensor {
    /// Tensor name.
    pub name: String,
    /// Its offloading class.
    pub class: DenseClass,
    /// Its layer (`None` for output tensors).
    pub layer: Option<usize>,
    /// Bytes of its data.
    pub bytes: u64,
}

/// The types a KV cache stores K and V in (ggml's: F16, Q8_0, Q4_0, ...), for its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvTypes {
    /// Keys.
    pub k: GgmlType,
    /// Values.
    pub v: GgmlType,
}

impl KvTypes {
    /// Both F16 (the default of llama.cpp, PowerInfer and this project).
    pub const F16: KvTypes = KvTypes {
        k: GgmlType::F16,
        v: GgmlType::F16,
    };

    /// Bytes of `n` values of K and of V together.
    pub fn pair_bytes(&self, n: u64) -> u64 {
        let of = |ty: GgmlType| ty.bytes_for(n).unwrap_or(u64::MAX);
        of(self.k).saturating_add(of(self.v))
    }
}

/// The shape facts the accounting needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    /// Number of layers.
    pub n_layer: usize,
    /// Hidden size.
    pub n_embd: u64,
    /// Width of K and V per token and layer (`n_embd / n_head · n_head_kv`).
    pub n_embd_gqa: u64,
    /// FFN width of each layer.
    pub n_ff: Vec<usize>,
    /// Bytes of one neuron of each layer (its up, gate and down_t rows together).
    pub neuron_bytes: Vec<u64>,
}

/// The dense tensors and shape of a model: everything needed to split a VRAM budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VramBudget {
    /// Shape facts.
    pub shape: ModelShape,
    /// Dense tensors in offloading order (class, then layer, then file order).
    pub dense: Vec<DenseTensor>,
}

/// How a VRAM budget was split. Invariant:
/// `dense_gpu_bytes + kv_gpu_bytes + scratch_bytes + ffn_budget_bytes <= budget_bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VramPlan {
    /// The whole budget.
    pub budget_bytes: u64,
    /// Bytes of the dense tensors placed on the GPU.
    pub dense_gpu_bytes: u64,
    /// Bytes of all dense tensors.
    pub dense_total_bytes: u64,
    /// Number of dense tensors placed on the GPU (a prefix of [`VramBudget::dense`]).
    pub dense_gpu_count: usize,
    /// Whether every dense tensor was placed.
    pub dense_complete: bool,
    /// Bytes of the whole f16 KV cache for the context length.
    pub kv_total_bytes: u64,
    /// Bytes of the KV cache reserved on the GPU (0, one chunk or both).
    pub kv_gpu_bytes: u64,
    /// Scratch bytes reserved (0 if they did not fit).
    pub scratch_bytes: u64,
    /// What is left for FFN neuron rows.
    pub ffn_budget_bytes: u64,
}

impl VramPlan {
    /// Budget left after dense, KV, scratch and `ffn_used` bytes of neuron rows.
    pub fn left_after(&self, ffn_used: u64) -> u64 {
        self.budget_bytes
            .saturating_sub(self.dense_gpu_bytes + self.kv_gpu_bytes + self.scratch_bytes)
            .saturating_sub(ffn_used)
    }
}

/// `blk.N.rest` → `(N, rest)`.
fn split_block_name(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (n, rest) = rest.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

fn classify(name: &str) -> Option<(DenseClass, Option<usize>)> {
    if let Some((layer, rest)) = split_block_name(name) {
        let class = if rest.starts_with("attn_") {
            DenseClass::Attention
        } else if rest.starts_with("fc1.") || rest.starts_with("fc2.") {
            DenseClass::Predictor
        } else if rest.starts_with("ffn_norm.") {
            DenseClass::FfnNorm
        } else {
            return None;
        };
        return Some((class, Some(layer)));
    }
    if name.starts_with("output.") || name.starts_with("output_norm.") {
        return Some((DenseClass::Output, None));
    }
    None
}

impl VramBudget {
    /// Accounting from a shape and a list of dense tensors (sorted here into offloading order;
    /// the sort is stable, so tensors of one class and layer keep their given order).
    pub fn new(shape: ModelShape, mut dense: Vec<DenseTensor>) -> Result<VramBudget> {
        if shape.n_ff.len() != shape.n_layer || shape.neuron_bytes.len() != shape.n_layer {
            return Err(PlacementError::Invalid(format!(
                "{} layers but {} FFN widths and {} neuron sizes",
                shape.n_layer,
                shape.n_ff.len(),
                shape.neuron_bytes.len()
            )));
        }
        dense.sort_by_key(|t| (t.class, t.layer));
        Ok(VramBudget { shape, dense })
    }

    /// Accounting of a PowerInfer sparse model file. Needs `{arch}.embedding_length`,
    /// `{arch}.attention.head_count` (and `head_count_kv`, default = head_count) and, per
    /// layer, `ffn_up.weight` and `ffn_down_t.weight` of shape `[n_embd, n_ff]`
    /// (`ffn_gate.weight` if the architecture has one).
    pub fn from_gguf<B: AsRef<[u8]>>(file: &GgufFile<B>) -> Result<VramBudget> {
        let md = file.metadata();
        let arch = md.get_str("general.architecture")?.to_string();
        let n_embd = md.get_uint(&format!("{arch}.embedding_length"))?;
        let n_head = md.get_uint(&format!("{arch}.attention.head_count"))?;
        let kv_key = format!("{arch}.attention.head_count_kv");
        let n_head_kv = if md.contains_key(&kv_key) {
            md.get_uint(&kv_key)?
        } else {
            n_head
        };
        if n_head == 0 || n_embd % n_head != 0 {
            return Err(PlacementError::Model(format!(
                "embedding length {n_embd} is not a multiple of the head count {n_head}"
            )));
        }
        let n_embd_gqa = n_embd / n_head * n_head_kv;
        let n_layer = md.get_uint(&format!("{arch}.block_count"))? as usize;

        let mut dense = Vec::new();
        let mut n_ff = vec![None::<usize>; n_layer];
        let mut neuron_bytes = vec![0u64; n_layer];
        let mut has_down_t = vec![false; n_layer];
        for t in file.tensors() {
            let name = t.name();
            if let Some((layer, rest)) = split_block_name(name) {
                let ffn = matches!(
                    rest,
                    "ffn_up.weight" | "ffn_gate.weight" | "ffn_down_t.weight"
                );
                if ffn {
                    if layer >= n_layer {
                        return Err(PlacementError::Model(format!(
                            "{name}: layer {layer} but block_count is {n_layer}"
                        )));
                    }
                    let shape = t.shape();
                    if shape.len() != 2 || shape[0] != n_embd {
                        return Err(PlacementError::Model(format!(
                            "{name}: shape {shape:?} is not [n_embd = {n_embd}, n_ff]"
                        )));
                    }
                    let width = shape[1] as usize;
                    if *n_ff[layer].get_or_insert(width) != width {
                        return Err(PlacementError::Model(format!(
                            "{name}: FFN width {width} differs from the layer's other FFN tensors"
                        )));
                    }
                    let row = t.ggml_type().bytes_for(n_embd).ok_or_else(|| {
                        PlacementError::Model(format!(
                            "{name}: a row of {n_embd} {} values is not whole blocks",
                            t.ggml_type().name()
                        ))
                    })?;
                    neuron_bytes[layer] += row;
                    has_down_t[layer] |= rest == "ffn_down_t.weight";
                    continue;
                }
            }
            if let Some((class, layer)) = classify(name) {
                dense.push(DenseTensor {
                    name: name.to_string(),
                    class,
                    layer,
                    bytes: t.n_bytes(),
                });
            }
        }
        if !has_down_t.iter().any(|&d| d) && file.tensor_info("blk.0.ffn_down.weight").is_some() {
            return Err(PlacementError::Model(
                "a dense GGUF file: it has no PowerInfer predictor (blk.N.fc1/fc2) or \
                 ffn_down_t tensors, so there are no neuron rows to place; use the model's \
                 PowerInfer file (*.powerinfer.gguf)"
                    .into(),
            ));
        }
        let mut widths = Vec::with_capacity(n_layer);
        for (l, w) in n_ff.into_iter().enumerate() {
            match (w, has_down_t[l]) {
                (Some(w), true) => widths.push(w),
                (None, _) => {
                    return Err(PlacementError::Model(format!(
                        "layer {l} has no blk.{l}.ffn_up.weight"
                    )))
                }
                (Some(_), false) => {
                    return Err(PlacementError::Model(format!(
                        "layer {l} has no blk.{l}.ffn_down_t.weight (not a PowerInfer sparse \
                         file?)"
                    )))
                }
            }
        }
        VramBudget::new(
            ModelShape {
                n_layer,
                n_embd,
                n_embd_gqa,
                n_ff: widths,
                neuron_bytes,
            },
            dense,
        )
    }

    /// Bytes of the whole f16 KV cache (K and V) for `n_ctx` tokens:
    /// `2 · n_layer · n_ctx · n_embd_gqa · 2`. Saturates instead of overflowing.
    pub fn kv_bytes(&self, n_ctx: u64) -> u64 {
        self.kv_bytes_of(n_ctx, KvTypes::F16)
    }

    /// Bytes of the whole KV cache for `n_ctx` tokens, K and V of `types`.
    pub fn kv_bytes_of(&self, n_ctx: u64, types: KvTypes) -> u64 {
        let (k, v) = self.kv_chunks(n_ctx, types);
        k.saturating_add(v)
    }

    /// Bytes of the K cache and of the V cache for `n_ctx` tokens.
    fn kv_chunks(&self, n_ctx: u64, types: KvTypes) -> (u64, u64) {
        let values = (self.shape.n_layer as u64)
            .saturating_mul(n_ctx)
            .saturating_mul(self.shape.n_embd_gqa);
        let of = |ty: GgmlType| ty.bytes_for(values).unwrap_or(u64::MAX);
        (of(types.k), of(types.v))
    }

    /// Splits `budget_bytes` (see the module documentation for the order), the KV cache F16.
    pub fn plan(&self, budget_bytes: u64, n_ctx: u64, scratch_bytes: u64) -> VramPlan {
        self.plan_with(budget_bytes, n_ctx, scratch_bytes, KvTypes::F16)
    }

    /// [`VramBudget::plan`] with the KV cache's K and V of `types`: a smaller cache leaves more
    /// of the budget to neuron rows.
    pub fn plan_with(
        &self,
        budget_bytes: u64,
        n_ctx: u64,
        scratch_bytes: u64,
        types: KvTypes,
    ) -> VramPlan {
        let mut left = budget_bytes;
        let mut dense_gpu_bytes = 0u64;
        let mut dense_gpu_count = 0usize;
        for t in &self.dense {
            if t.bytes > left {
                break;
            }
            left -= t.bytes;
            dense_gpu_bytes += t.bytes;
            dense_gpu_count += 1;
        }
        let dense_total_bytes = self.dense.iter().map(|t| t.bytes).sum();
        let dense_complete = dense_gpu_count == self.dense.len();
        let kv_total_bytes = self.kv_bytes_of(n_ctx, types);
        let mut kv_gpu_bytes = 0;
        let mut scratch = 0;
        let mut ffn_budget_bytes = 0;
        if dense_complete {
            let (k, v) = self.kv_chunks(n_ctx, types);
            for chunk in [k, v] {
                if chunk <= left {
                    left -= chunk;
                    kv_gpu_bytes += chunk;
                }
            }
            if scratch_bytes <= left {
                left -= scratch_bytes;
                scratch = scratch_bytes;
                ffn_budget_bytes = left;
            }
        }
        VramPlan {
            budget_bytes,
            dense_gpu_bytes,
            dense_total_bytes,
            dense_gpu_count,
            dense_complete,
            kv_total_bytes,
            kv_gpu_bytes,
            scratch_bytes: scratch,
            ffn_budget_bytes,
        }
    }
}
