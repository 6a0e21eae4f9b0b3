//! Models split over several files (`NAME-00001-of-00003.gguf`, as written by llama.cpp's
//! `gguf-split` and `gguf.GGUFWriter` with a split size), opened as one tensor directory.
//!
//! Each part is a complete GGUF file with keys `split.no` (u16, 0-based), `split.count` (u16)
//! and `split.tensors.count` (i32, tensors in all parts). Metadata of the whole model is that
//! of the first part.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{GgufError, Result};
use crate::metadata::Metadata;
use crate::reader::{GgufFile, TensorInfo};

/// Key: index of this part, from 0.
pub const SPLIT_NO_KEY: &str = "split.no";
/// Key: number of parts.
pub const SPLIT_COUNT_KEY: &str = "split.count";
/// Key: number of tensors in all parts together.
pub const SPLIT_TENSORS_COUNT_KEY: &str = "split.tensors.count";

/// Splits `NAME-00001-of-00003.gguf` into (`NAME`, 1, 3). `None` for other names.
pub fn parse_split_name(path: &Path) -> Option<(String, u32, u32)> {
    let name = path.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    if no.len() != 5 || count.len() != 5 {
        return None;
    }
    let no: u32 = no.parse().ok()?;
    let count: u32 = count.parse().ok()?;
    (no >= 1 && no <= count).then(|| (prefix.to_string(), no, count))
}

/// The path of part `no` (1-based) of `count` next to `prefix`.
pub fn split_path(dir: &Path, prefix: &str, no: u32, count: u32) -> PathBuf {
    dir.join(format!("{prefix}-{no:05}-of-{count:05}.gguf"))
}

/// All parts of a split model, with one tensor directory across them.
pub struct SplitModel {
    parts: Vec<GgufFile<Mmap>>,
    index: HashMap<String, (usize, usize)>,
}

impl SplitModel {
    /// Opens `path` and, if its name is `NAME-0000i-of-0000n.gguf`, all its sibling parts. A
    /// file with another name is opened as a single part.
    pub fn open(path: impl AsRef<Path>) -> Result<SplitModel> {
        let path = path.as_ref();
        let paths = match parse_split_name(path) {
            None => vec![path.to_path_buf()],
            Some((prefix, _, count)) => {
                let dir = path.parent().unwrap_or(Path::new(""));
                (1..=count)
                    .map(|no| split_path(dir, &prefix, no, count))
                    .collect()
            }
        };
        let parts = paths
            .iter()
            .map(GgufFile::open)
            .collect::<Result<Vec<_>>>()?;
        SplitModel::from_parts(parts)
    }

    /// Builds the directory from opened parts in order, checking their split keys (absent
    /// keys are fine for a single part).
    pub fn from_parts(parts: Vec<GgufFile<Mmap>>) -> Result<SplitModel> {
        let n = parts.len();
        if n == 0 {
            return Err(GgufError::Split("no parts".into()));
        }
        let mut total = None;
        for (i, p) in parts.iter().enumerate() {
            let md = p.metadata();
            if n == 1 && !md.contains_key(SPLIT_COUNT_KEY) {
                break;
            }
            let no = md.get_uint(SPLIT_NO_KEY)?;
            let count = md.get_uint(SPLIT_COUNT_KEY)?;
            if no != i as u64 || count != n as u64 {
                return Err(GgufError::Split(format!(
                    "part {} of {n} says split.no = {no}, split.count = {count}",
                    i + 1
                )));
            }
            let t = md.get_uint(SPLIT_TENSORS_COUNT_KEY)?;
            if *total.get_or_insert(t) != t {
                return Err(GgufError::Split(format!(
                    "parts disagree on split.tensors.count ({} vs {t})",
                    total.unwrap_or(0)
                )));
            }
        }
        let mut index = HashMap::new();
        for (pi, p) in parts.iter().enumerate() {
            for (ti, t) in p.tensors().iter().enumerate() {
                if index.insert(t.name().to_string(), (pi, ti)).is_some() {
                    return Err(GgufError::Split(format!(
                        "tensor {:?} appears in more than one part",
                        t.name()
                    )));
                }
            }
        }
        if let Some(t) = total {
            if t != index.len() as u64 {
                return Err(GgufError::Split(format!(
                    "split.tensors.count is {t} but the parts hold {} tensors",
                    index.len()
                )));
            }
        }
        Ok(SplitModel { parts, index })
    }

    /// The parts, in order.
    pub fn parts(&self) -> &[GgufFile<Mmap>] {
        &self.parts
    }

    /// Metadata of the model (that of the first part).
    pub fn metadata(&self) -> &Metadata {
        self.parts[0].metadata()
    }

    /// Every tensor of every part, part by part, in file order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.parts.iter().flat_map(|p| p.tensors())
    }

    /// Number of tensors in all parts.
    pub fn n_tensors(&self) -> usize {
        self.index.len()
    }

    /// The tensor named `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        let &(p, t) = self.index.get(name)?;
        Some(&self.parts[p].tensors()[t])
    }

    /// The bytes of the tensor named `name`, from whichever part holds it.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let &(p, t) = self
            .index
            .get(name)
            .ok_or_else(|| GgufError::TensorNotFound {
                name: name.to_string(),
            })?;
        let part = &self.parts[p];
        Ok(part.data_of(&part.tensors()[t]))
    }
}
