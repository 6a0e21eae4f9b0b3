//! The placement result ([`GpuSplit`]) and its GPU-index file.
//!
//! The file is `<model path>.generated.gpuidx` (PowerInfer's name, next to the model), written
//! through [`powerinfer_gguf::GpuIndex`]. Its `split.vram_capacity` is the FFN budget the
//! solver was given (as PowerInfer), and extra keys record what made it ([`Provenance`]):
//! `powerinfer_rs.budget_bytes`, `.n_ctx`, `.scratch_bytes`, `.group_size`, `.mode`,
//! `.stats_digest` (FNV-1a 64 of the statistics), `.model_size` and `.model_mtime`
//! (nanoseconds since the Unix epoch).
//!
//! Lifecycle (PowerInfer's, reference §2): [`check_cached`] accepts an existing file only if
//! its provenance equals the current one, its `vram_capacity` does not exceed the current FFN
//! budget, and its layers match the statistics; otherwise the caller rebuilds and overwrites.

use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use powerinfer_gguf::{GpuIndex, LayerGpuIndex, Metadata, Value};

use crate::error::{PlacementError, Result};

/// The GPU neurons of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSplit {
    /// FFN width.
    pub n_ff: usize,
    /// GPU neuron indices, ascending.
    pub bucket: Vec<u32>,
    /// Sum of the statistics of the GPU neurons.
    pub gpu_mass: f64,
    /// Sum of the statistics of all neurons.
    pub total_mass: f64,
}

impl LayerSplit {
    /// A layer; `bucket` must be strictly ascending and below `n_ff`.
    pub fn new(n_ff: usize, bucket: Vec<u32>, gpu_mass: f64, total_mass: f64) -> Result<Self> {
        if bucket.windows(2).any(|w| w[0] >= w[1])
            || bucket.last().is_some_and(|&b| b as usize >= n_ff)
        {
            return Err(PlacementError::Invalid(format!(
                "bucket of a layer of {n_ff} neurons is not strictly ascending below n_ff"
            )));
        }
        Ok(LayerSplit {
            n_ff,
            bucket,
            gpu_mass,
            total_mass,
        })
    }

    /// Number of GPU neurons.
    pub fn k(&self) -> usize {
        self.bucket.len()
    }

    /// Share of the layer's activation mass on the GPU (0 when the layer has no mass).
    pub fn mass_share(&self) -> f64 {
        if self.total_mass > 0.0 {
            self.gpu_mass / self.total_mass
        } else {
            0.0
        }
    }
}

/// Per-layer GPU neuron lists and the bytes of neuron rows they take.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuSplit {
    /// Layers in order.
    pub layers: Vec<LayerSplit>,
    /// Bytes of the GPU neurons' rows (up, gate, down_t).
    pub ffn_bytes: u64,
}

impl GpuSplit {
    /// Every neuron on the CPU (`--disable-gpu-index`, or no statistics).
    pub fn all_cpu(n_ff: &[usize]) -> GpuSplit {
        GpuSplit {
            layers: n_ff
                .iter()
                .map(|&n| LayerSplit {
                    n_ff: n,
                    bucket: Vec::new(),
                    gpu_mass: 0.0,
                    total_mass: 0.0,
                })
                .collect(),
            ffn_bytes: 0,
        }
    }

    /// The GPU-index contents for this split (`vram_capacity` = the FFN budget solved for).
    pub fn to_gpu_index(&self, vram_capacity: u64, provenance: &Provenance) -> Result<GpuIndex> {
        let layers = self
            .layers
            .iter()
            .map(|l| LayerGpuIndex::new(l.n_ff, l.bucket.clone()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(GpuIndex {
            layers,
            vram_capacity,
            extra: provenance.to_metadata(),
        })
    }

    /// A split read back from a GPU-index file; masses from `stats` and bytes from
    /// `neuron_bytes` (both one entry per layer of the file).
    pub fn from_gpu_index(
        index: &GpuIndex,
        stats: &[Vec<f32>],
        neuron_bytes: &[u64],
    ) -> Result<GpuSplit> {
        if index.layers.len() != stats.len() || stats.len() != neuron_bytes.len() {
            return Err(PlacementError::Invalid(format!(
                "GPU index has {} layers, statistics {}, model {}",
                index.layers.len(),
                stats.len(),
                neuron_bytes.len()
            )));
        }
        let mut layers = Vec::with_capacity(stats.len());
        let mut ffn_bytes = 0u64;
        for (l, (li, values)) in index.layers.iter().zip(stats).enumerate() {
            if li.n_ff() != values.len() {
                return Err(PlacementError::Invalid(format!(
                    "layer {l}: GPU index has {} neurons, statistics {}",
                    li.n_ff(),
                    values.len()
                )));
            }
            let gpu_mass = li
                .bucket()
                .iter()
                .map(|&i| f64::from(values[i as usize]))
                .sum();
            let total_mass = values.iter().map(|&v| f64::from(v)).sum();
            ffn_bytes += li.k() as u64 * neuron_bytes[l];
            layers.push(LayerSplit::new(
                li.n_ff(),
                li.bucket().to_vec(),
                gpu_mass,
                total_mass,
            )?);
        }
        Ok(GpuSplit { layers, ffn_bytes })
    }
}

/// What a GPU-index file was made from; a cached file with different provenance is stale.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Provenance {
    /// The whole VRAM budget in bytes.
    pub budget_bytes: u64,
    /// Context length the KV cache was sized for.
    pub n_ctx: u64,
    /// Scratch reserve in bytes.
    pub scratch_bytes: u64,
    /// Neuron group size.
    pub group_size: u32,
    /// Solver mode (`"max"` or `"balanced:<ratio>"`, plus minimum and cap when set).
    pub mode: String,
    /// [`stats_digest`] of the statistics.
    pub stats_digest: u64,
    /// Model file size in bytes.
    pub model_size: u64,
    /// Model file modification time, nanoseconds since the Unix epoch (0 if unknown).
    pub model_mtime: u64,
    /// The KV cache's types the budget was split with (`K/V`, ggml's names; an index written
    /// before there were types holds none and was split with `F16/F16`).
    pub kv_types: String,
}

/// Provenance key prefix.
pub const KEY_PREFIX: &str = "powerinfer_rs.";

impl Provenance {
    /// Size and modification time of the model file at `path`, as `(size, mtime_ns)`.
    pub fn model_identity(path: &Path) -> Result<(u64, u64)> {
        let md = std::fs::metadata(path).map_err(|source| PlacementError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mtime = md
            .modified()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_nanos().min(u128::from(u64::MAX)) as u64);
        Ok((md.len(), mtime))
    }

    /// The provenance as GGUF metadata (`powerinfer_rs.*` keys).
    pub fn to_metadata(&self) -> Metadata {
        let mut md = Metadata::new();
        let k = |s: &str| format!("{KEY_PREFIX}{s}");
        md.insert(k("budget_bytes"), Value::U64(self.budget_bytes));
        md.insert(k("n_ctx"), Value::U64(self.n_ctx));
        md.insert(k("scratch_bytes"), Value::U64(self.scratch_bytes));
        md.insert(k("group_size"), Value::U32(self.group_size));
        md.insert(k("mode"), Value::String(self.mode.clone()));
        md.insert(k("stats_digest"), Value::U64(self.stats_digest));
        md.insert(k("model_size"), Value::U64(self.model_size));
        md.insert(k("model_mtime"), Value::U64(self.model_mtime));
        md.insert(k("kv_types"), Value::String(self.kv_types.clone()));
        md
    }

    /// Provenance read from GGUF metadata; `None` if a key is missing or mistyped.
    pub fn from_metadata(md: &Metadata) -> Option<Provenance> {
        let u = |s: &str| md.get(&format!("{KEY_PREFIX}{s}"))?.as_u64();
        Some(Provenance {
            budget_bytes: u("budget_bytes")?,
            n_ctx: u("n_ctx")?,
            scratch_bytes: u("scratch_bytes")?,
            group_size: md.get(&format!("{KEY_PREFIX}group_size"))?.as_u32()?,
            mode: md.get(&format!("{KEY_PREFIX}mode"))?.as_str()?.to_string(),
            stats_digest: u("stats_digest")?,
            model_size: u("model_size")?,
            model_mtime: u("model_mtime")?,
            kv_types: match md.get(&format!("{KEY_PREFIX}kv_types")) {
                Some(v) => v.as_str()?.to_string(),
                None => "F16/F16".to_string(),
            },
        })
    }
}

/// FNV-1a, 64 bit, of `bytes` continuing from `hash` (start with [`FNV_OFFSET`]).
pub fn fnv1a64(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// FNV-1a 64 offset basis.
pub const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// A stable digest of statistics: FNV-1a 64 over, per layer, its length (u64 LE) then its
/// values (f32 LE).
pub fn stats_digest(stats: &[Vec<f32>]) -> u64 {
    let mut h = FNV_OFFSET;
    for layer in stats {
        h = fnv1a64(h, &(layer.len() as u64).to_le_bytes());
        for v in layer {
            h = fnv1a64(h, &v.to_le_bytes());
        }
    }
    h
}

/// PowerInfer's cache path: the model path with `.generated.gpuidx` appended.
pub fn gpuidx_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_os_string();
    s.push(".generated.gpuidx");
    PathBuf::from(s)
}

/// Loads the cached GPU index at `path` if it can be reused: `Ok(index)`, or `Err(reason)`
/// saying why it must be (re)built (missing, unreadable, stale provenance, capacity above
/// `ffn_budget`, or layer shapes unlike `n_ff`).
pub fn check_cached(
    path: &Path,
    provenance: &Provenance,
    ffn_budget: u64,
    n_ff: &[usize],
) -> std::result::Result<GpuIndex, String> {
    if !path.exists() {
        return Err("no cached GPU index".into());
    }
    let index = GpuIndex::open(path).map_err(|e| format!("cached GPU index unreadable: {e}"))?;
    match Provenance::from_metadata(&index.extra) {
        None => return Err("cached GPU index has no provenance".into()),
        Some(p) if &p != provenance => {
            return Err(format!(
                "cached GPU index is stale ({})",
                differences(&p, provenance).join(", ")
            ))
        }
        Some(_) => {}
    }
    if index.vram_capacity > ffn_budget {
        return Err(format!(
            "cached GPU index needs {} bytes, the FFN budget is {ffn_budget}",
            index.vram_capacity
        ));
    }
    let widths: Vec<usize> = index.layers.iter().map(|l| l.n_ff()).collect();
    if widths != n_ff {
        return Err("cached GPU index has other layer shapes than the model".into());
    }
    Ok(index)
}

fn differences(a: &Provenance, b: &Provenance) -> Vec<&'static str> {
    let mut d = Vec::new();
    let mut chk = |same: bool, name: &'static str| {
        if !same {
            d.push(name);
        }
    };
    chk(a.budget_bytes == b.budget_bytes, "budget");
    chk(a.n_ctx == b.n_ctx, "context length");
    chk(a.scratch_bytes == b.scratch_bytes, "scratch");
    chk(a.group_size == b.group_size, "group size");
    chk(a.mode == b.mode, "mode");
    chk(a.stats_digest == b.stats_digest, "statistics");
    chk(a.model_size == b.model_size, "model size");
    chk(a.model_mtime == b.model_mtime, "model time");
    chk(a.kv_types == b.kv_types, "KV cache types");
    d
}
