//! PowerInfer's GPU-index file (`<model>.generated.gpuidx`): which FFN neurons of each layer
//! live on the GPU.
//!
//! The file is a PWRI-magic GGUF v3 with keys `general.architecture = "generic.gpu_index"`,
//! `generic.gpu_index.block_count` (u32) and `split.vram_capacity` (u64), and per layer `i`
//! two 1-D I32 tensors, in the order gpu_idx(0), gpu_bucket(0), gpu_idx(1), ...:
//! `blk.i.gpu_idx` (shape `[n_ff]`, 1 if the neuron is on the GPU, else 0) and `blk.i.gpu_bucket`
//! (shape `[k]`, the GPU neurons' indices, ascending). PowerInfer's ggml numbered I32 as type id 18
//! (today's IQ3_XXS), and its C++ loader reads the tensors by position, so the writer
//! emits id 18 in exactly that order; the reader accepts 18 and today's 26 and finds tensors
//! by name.
//!
//! A layer with no GPU neurons (k = 0) gets a bucket of shape `[0]` with no data bytes (at
//! the same offset as the next tensor). This is what the PyPI `gguf` writer produces for an
//! empty array, which is how PowerInfer's Python exporter writes it; ggml accepts a zero
//! dimension, and PowerInfer's loader ignores the bucket when k is 0.

use std::io::Write;
use std::path::Path;

use crate::error::{GgufError, Result};
use crate::metadata::{Metadata, Value};
use crate::reader::{FileKind, GgufFile, GPU_INDEX_ARCH, LEGACY_I32_TYPE_ID};
use crate::types::GgmlType;
use crate::writer::GgufWriter;

/// Key holding the number of layers.
pub const BLOCK_COUNT_KEY: &str = "generic.gpu_index.block_count";
/// Key holding the VRAM budget (bytes) the placement was solved for.
pub const VRAM_CAPACITY_KEY: &str = "split.vram_capacity";
/// Key holding the architecture (`"generic.gpu_index"`).
pub const ARCH_KEY: &str = "general.architecture";

/// The GPU neurons of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGpuIndex {
    n_ff: usize,
    bucket: Vec<u32>,
}

impl LayerGpuIndex {
    /// A layer of `n_ff` neurons whose GPU neurons are `bucket` (strictly ascending, each
    /// `< n_ff`).
    pub fn new(n_ff: usize, bucket: Vec<u32>) -> Result<LayerGpuIndex> {
        if n_ff > i32::MAX as usize {
            return Err(GgufError::GpuIndex(format!(
                "n_ff {n_ff} does not fit in i32"
            )));
        }
        if let Some(w) = bucket.windows(2).find(|w| w[0] >= w[1]) {
            return Err(GgufError::GpuIndex(format!(
                "bucket not strictly ascending: {} then {}",
                w[0], w[1]
            )));
        }
        if let Some(&last) = bucket.last() {
            if last as usize >= n_ff {
                return Err(GgufError::GpuIndex(format!(
                    "bucket entry {last} is not below n_ff = {n_ff}"
                )));
            }
        }
        Ok(LayerGpuIndex { n_ff, bucket })
    }

    /// A layer from its per-neuron mask (`true` = on the GPU).
    pub fn from_mask(mask: &[bool]) -> Result<LayerGpuIndex> {
        let bucket = mask
            .iter()
            .enumerate()
            .filter(|(_, &on)| on)
            .map(|(i, _)| i as u32)
            .collect();
        LayerGpuIndex::new(mask.len(), bucket)
    }

    /// Neurons in the layer (FFN width).
    pub fn n_ff(&self) -> usize {
        self.n_ff
    }

    /// Indices of the GPU neurons, ascending.
    pub fn bucket(&self) -> &[u32] {
        &self.bucket
    }

    /// Number of GPU neurons.
    pub fn k(&self) -> usize {
        self.bucket.len()
    }

    /// The `gpu_idx` tensor: 1 for GPU neurons, 0 for the others.
    pub fn gpu_idx(&self) -> Vec<i32> {
        let mut v = vec![0i32; self.n_ff];
        for &i in &self.bucket {
            v[i as usize] = 1;
        }
        v
    }
}

/// The contents of a GPU-index file.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuIndex {
    /// Layers in order (layer `i` is `blk.i`).
    pub layers: Vec<LayerGpuIndex>,
    /// The VRAM budget in bytes the placement was made for (`split.vram_capacity`).
    pub vram_capacity: u64,
    /// Metadata beyond the three standard keys (e.g. provenance), in file order.
    pub extra: Metadata,
}

fn i32_values(name: &str, data: &[u8]) -> Vec<i32> {
    debug_assert_eq!(data.len() % 4, 0, "{name}: I32 size checked by the parser");
    data.chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl GpuIndex {
    /// Reads and validates a GPU-index file.
    pub fn open(path: impl AsRef<Path>) -> Result<GpuIndex> {
        GpuIndex::from_gguf(&GgufFile::open(path)?)
    }

    /// Reads and validates a GPU index from a parsed file.
    pub fn from_gguf<B: AsRef<[u8]>>(file: &GgufFile<B>) -> Result<GpuIndex> {
        let md = file.metadata();
        let arch = md.get_str(ARCH_KEY)?;
        if arch != GPU_INDEX_ARCH {
            return Err(GgufError::GpuIndex(format!(
                "general.architecture is {arch:?}, expected {GPU_INDEX_ARCH:?}"
            )));
        }
        let n_layers = md.get_uint(BLOCK_COUNT_KEY)?;
        let vram_capacity = md.get_uint(VRAM_CAPACITY_KEY)?;
        let expected_tensors = n_layers
            .checked_mul(2)
            .filter(|&n| n == file.tensors().len() as u64);
        if expected_tensors.is_none() {
            return Err(GgufError::GpuIndex(format!(
                "{BLOCK_COUNT_KEY} = {n_layers} needs {} tensors, the file has {}",
                n_layers.saturating_mul(2),
                file.tensors().len()
            )));
        }
        let mut layers = Vec::with_capacity(n_layers as usize);
        for i in 0..n_layers {
            let idx_name = format!("blk.{i}.gpu_idx");
            let bucket_name = format!("blk.{i}.gpu_bucket");
            let mut vectors = [&idx_name, &bucket_name].map(|name| -> Result<Vec<i32>> {
                let info = file
                    .tensor_info(name)
                    .ok_or_else(|| GgufError::TensorNotFound { name: name.clone() })?;
                if info.ggml_type() != GgmlType::I32 {
                    return Err(GgufError::GpuIndex(format!(
                        "{name} has type {} (id {}), expected I32 (id {LEGACY_I32_TYPE_ID} or {})",
                        info.ggml_type(),
                        info.type_id(),
                        GgmlType::I32.id()
                    )));
                }
                if info.shape().len() != 1 {
                    return Err(GgufError::GpuIndex(format!(
                        "{name} has shape {:?}, expected one dimension",
                        info.shape()
                    )));
                }
                Ok(i32_values(name, file.data_of(info)))
            });
            let bucket = std::mem::replace(&mut vectors[1], Ok(Vec::new()))?;
            let gpu_idx = std::mem::replace(&mut vectors[0], Ok(Vec::new()))?;
            if let Some((j, v)) = gpu_idx.iter().enumerate().find(|(_, &v)| v != 0 && v != 1) {
                return Err(GgufError::GpuIndex(format!(
                    "{idx_name}[{j}] = {v}, expected 0 or 1"
                )));
            }
            let n_ff = gpu_idx.len();
            let bucket: Vec<u32> = bucket
                .iter()
                .map(|&b| {
                    u32::try_from(b).map_err(|_| {
                        GgufError::GpuIndex(format!("{bucket_name} holds negative index {b}"))
                    })
                })
                .collect::<Result<_>>()?;
            let layer = LayerGpuIndex::new(n_ff, bucket)
                .map_err(|e| GgufError::GpuIndex(format!("{bucket_name}: {e}")))?;
            let k = gpu_idx.iter().filter(|&&v| v == 1).count();
            if k != layer.k() || layer.bucket.iter().any(|&b| gpu_idx[b as usize] != 1) {
                return Err(GgufError::GpuIndex(format!(
                    "{bucket_name} ({} entries) does not list exactly the {k} neurons marked in {idx_name}",
                    layer.k()
                )));
            }
            layers.push(layer);
        }
        let mut extra = Metadata::new();
        for (k, v) in md.iter() {
            if ![ARCH_KEY, BLOCK_COUNT_KEY, VRAM_CAPACITY_KEY].contains(&k) {
                extra.insert(k, v.clone());
            }
        }
        Ok(GpuIndex {
            layers,
            vram_capacity,
            extra,
        })
    }

    /// Writes the file in PowerInfer's layout to `out`.
    pub fn write<W: Write>(&self, out: W) -> Result<W> {
        let mut w = GgufWriter::new(out, FileKind::PowerInfer);
        self.fill(&mut w)?;
        w.finish()
    }

    /// Writes the file to `path` (through a temporary file renamed into place).
    pub fn write_to_path(&self, path: impl AsRef<Path>) -> Result<()> {
        let mut w = GgufWriter::create(path, FileKind::PowerInfer)?;
        self.fill(&mut w)?;
        w.finish()?.commit()
    }

    fn fill<W: Write>(&self, w: &mut GgufWriter<W>) -> Result<()> {
        let n_layers = u32::try_from(self.layers.len())
            .map_err(|_| GgufError::GpuIndex("too many layers".into()))?;
        w.add_kv(ARCH_KEY, Value::String(GPU_INDEX_ARCH.into()))?;
        w.add_kv(BLOCK_COUNT_KEY, Value::U32(n_layers))?;
        w.add_kv(VRAM_CAPACITY_KEY, Value::U64(self.vram_capacity))?;
        for (k, v) in self.extra.iter() {
            if [ARCH_KEY, BLOCK_COUNT_KEY, VRAM_CAPACITY_KEY].contains(&k) {
                return Err(GgufError::GpuIndex(format!(
                    "extra metadata must not set the standard key {k:?}"
                )));
            }
            w.add_kv(k, v.clone())?;
        }
        for (i, l) in self.layers.iter().enumerate() {
            w.add_tensor_with_id(
                &format!("blk.{i}.gpu_idx"),
                &[l.n_ff as u64],
                GgmlType::I32,
                LEGACY_I32_TYPE_ID,
            )?;
            w.add_tensor_with_id(
                &format!("blk.{i}.gpu_bucket"),
                &[l.k() as u64],
                GgmlType::I32,
                LEGACY_I32_TYPE_ID,
            )?;
        }
        for (i, l) in self.layers.iter().enumerate() {
            let idx: Vec<u8> = l.gpu_idx().iter().flat_map(|v| v.to_le_bytes()).collect();
            w.write_tensor_data(&format!("blk.{i}.gpu_idx"), &idx)?;
            let bucket: Vec<u8> = l
                .bucket
                .iter()
                .flat_map(|v| (*v as i32).to_le_bytes())
                .collect();
            w.write_tensor_data(&format!("blk.{i}.gpu_bucket"), &bucket)?;
        }
        Ok(())
    }
}
