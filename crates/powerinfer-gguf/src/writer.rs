//! Writing GGUF and PowerInfer files, tensor data streamed one tensor at a time.
//!
//! Layout and padding are those of llama.cpp's and the PyPI `gguf` package's writers: header,
//! key-value pairs, tensor infos, zero padding up to the alignment, then each tensor's data
//! followed by zero padding up to the alignment (the last tensor included). Tensor offsets
//! are the running sum of the padded sizes, in declaration order. For the same metadata and
//! tensors, the output is byte-identical to `gguf.GGUFWriter`'s (a test checks this).

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::error::{GgufError, Result};
use crate::metadata::{Array, Metadata, Value};
use crate::reader::{FileKind, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAX_DIMS};
use crate::types::GgmlType;

/// Longest tensor name ggml can hold (`GGML_MAX_NAME` is 64 including the terminating NUL).
pub const MAX_TENSOR_NAME_LEN: usize = 63;

/// The format version this writer emits.
pub const WRITE_VERSION: u32 = 3;

struct PendingTensor {
    name: String,
    shape: Vec<u64>,
    type_id: u32,
    n_bytes: u64,
}

/// Writes a GGUF or PowerInfer file to any [`Write`] (a [`Seek`](std::io::Seek) is not
/// needed).
///
/// Use: add metadata with [`add_kv`](Self::add_kv), declare every tensor with
/// [`add_tensor`](Self::add_tensor), then hand over each tensor's bytes in declaration order
/// with [`write_tensor_data`](Self::write_tensor_data) or
/// [`write_tensor_from`](Self::write_tensor_from), and call [`finish`](Self::finish). The
/// header is written when the first tensor's data arrives (or at `finish`), so only one
/// tensor's bytes (or none, with a reader) are ever held by the writer.
pub struct GgufWriter<W: Write> {
    out: W,
    kind: FileKind,
    metadata: Metadata,
    tensors: Vec<PendingTensor>,
    names: std::collections::HashSet<String>,
    header_written: bool,
    next: usize,
    pos: u64,
    alignment: u64,
}

impl<W: Write> GgufWriter<W> {
    /// A writer of a `kind` file to `out`, which should be empty (offsets count from the
    /// first byte written).
    pub fn new(out: W, kind: FileKind) -> GgufWriter<W> {
        GgufWriter {
            out,
            kind,
            metadata: Metadata::new(),
            tensors: Vec::new(),
            names: Default::default(),
            header_written: false,
            next: 0,
            pos: 0,
            alignment: DEFAULT_ALIGNMENT,
        }
    }

    fn before_header(&self, what: &str) -> Result<()> {
        if self.header_written {
            return Err(GgufError::Writer(format!(
                "{what} after tensor data was started"
            )));
        }
        Ok(())
    }

    /// Adds a key-value pair (kept in insertion order). Adding an existing key replaces its
    /// value in place, as `gguf.GGUFWriter` does. `general.alignment` must be a `u32` power
    /// of two and sets the data alignment.
    pub fn add_kv(&mut self, key: impl Into<String>, value: Value) -> Result<()> {
        self.before_header("adding metadata")?;
        let key = key.into();
        if key == ALIGNMENT_KEY {
            match value {
                Value::U32(a) if a.is_power_of_two() => self.alignment = u64::from(a),
                _ => {
                    return Err(GgufError::BadAlignment {
                        reason: format!("{value:?} is not a u32 power of two"),
                    })
                }
            }
        }
        self.metadata.insert(key, value);
        Ok(())
    }

    /// Adds every entry of `metadata`, in its order.
    pub fn add_metadata(&mut self, metadata: &Metadata) -> Result<()> {
        for (k, v) in metadata.iter() {
            self.add_kv(k, v.clone())?;
        }
        Ok(())
    }

    /// Sets the data alignment by writing `general.alignment` (a `u32` power of two).
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        self.add_kv(ALIGNMENT_KEY, Value::U32(alignment))
    }

    /// The data alignment in effect.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Declares the next tensor: name (unique, at most 63 bytes), shape in ggml order (ne0
    /// first, at most 4 dimensions; a dimension may be 0) and type.
    pub fn add_tensor(&mut self, name: &str, shape: &[u64], ty: GgmlType) -> Result<()> {
        self.add_tensor_with_id(name, shape, ty, ty.id())
    }

    /// [`add_tensor`](Self::add_tensor) storing `type_id` in the file instead of `ty.id()`
    /// (for the GPU-index file, whose I32 is id 18).
    pub(crate) fn add_tensor_with_id(
        &mut self,
        name: &str,
        shape: &[u64],
        ty: GgmlType,
        type_id: u32,
    ) -> Result<()> {
        self.before_header("adding a tensor")?;
        if name.len() > MAX_TENSOR_NAME_LEN {
            return Err(GgufError::Writer(format!(
                "tensor name {name:?} is longer than {MAX_TENSOR_NAME_LEN} bytes"
            )));
        }
        if shape.len() > MAX_DIMS {
            return Err(GgufError::Writer(format!(
                "tensor {name:?} has {} dimensions, at most {MAX_DIMS} allowed",
                shape.len()
            )));
        }
        if self.names.contains(name) {
            return Err(GgufError::Writer(format!("duplicate tensor name {name:?}")));
        }
        let n_elements = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| {
                GgufError::Writer(format!("tensor {name:?}: shape {shape:?} overflows"))
            })?;
        let n_bytes = ty.bytes_for(n_elements).ok_or_else(|| {
            GgufError::Writer(format!(
                "tensor {name:?}: {n_elements} elements is not a whole number of {ty} blocks of {}",
                ty.block_size()
            ))
        })?;
        self.names.insert(name.to_string());
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            shape: shape.to_vec(),
            type_id,
            n_bytes,
        });
        Ok(())
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.write_all(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> Result<()> {
        const ZEROS: [u8; 256] = [0; 256];
        let mut n = self.pos.next_multiple_of(self.alignment) - self.pos;
        while n > 0 {
            let k = n.min(ZEROS.len() as u64) as usize;
            self.put(&ZEROS[..k])?;
            n -= k as u64;
        }
        Ok(())
    }

    fn put_string(&mut self, s: &str) -> Result<()> {
        self.put(&(s.len() as u64).to_le_bytes())?;
        self.put(s.as_bytes())
    }

    fn put_value(&mut self, v: &Value) -> Result<()> {
        match v {
            Value::U8(x) => self.put(&x.to_le_bytes()),
            Value::I8(x) => self.put(&x.to_le_bytes()),
            Value::U16(x) => self.put(&x.to_le_bytes()),
            Value::I16(x) => self.put(&x.to_le_bytes()),
            Value::U32(x) => self.put(&x.to_le_bytes()),
            Value::I32(x) => self.put(&x.to_le_bytes()),
            Value::F32(x) => self.put(&x.to_le_bytes()),
            Value::Bool(x) => self.put(&[u8::from(*x)]),
            Value::String(s) => self.put_string(s),
            Value::Array(a) => self.put_array(a),
            Value::U64(x) => self.put(&x.to_le_bytes()),
            Value::I64(x) => self.put(&x.to_le_bytes()),
            Value::F64(x) => self.put(&x.to_le_bytes()),
        }
    }

    fn put_array(&mut self, a: &Array) -> Result<()> {
        self.put(&a.elem_type().id().to_le_bytes())?;
        self.put(&(a.len() as u64).to_le_bytes())?;
        macro_rules! each {
            ($v:expr) => {{
                for x in $v {
                    self.put(&x.to_le_bytes())?;
                }
                Ok(())
            }};
        }
        match a {
            Array::U8(v) => self.put(v),
            Array::I8(v) => each!(v),
            Array::U16(v) => each!(v),
            Array::I16(v) => each!(v),
            Array::U32(v) => each!(v),
            Array::I32(v) => each!(v),
            Array::F32(v) => each!(v),
            Array::U64(v) => each!(v),
            Array::I64(v) => each!(v),
            Array::F64(v) => each!(v),
            Array::Bool(v) => {
                for &b in v {
                    self.put(&[u8::from(b)])?;
                }
                Ok(())
            }
            Array::String(v) => {
                for s in v {
                    self.put_string(s)?;
                }
                Ok(())
            }
            Array::Array(v) => {
                for inner in v {
                    self.put_array(inner)?;
                }
                Ok(())
            }
        }
    }

    /// Writes header, metadata and tensor infos (done automatically by the first tensor
    /// write or by `finish`; calling it twice is an error).
    pub fn write_header(&mut self) -> Result<()> {
        self.before_header("writing the header")?;
        self.header_written = true;
        self.put(&self.kind.magic())?;
        self.put(&WRITE_VERSION.to_le_bytes())?;
        self.put(&(self.tensors.len() as u64).to_le_bytes())?;
        self.put(&(self.metadata.len() as u64).to_le_bytes())?;
        let metadata = std::mem::take(&mut self.metadata);
        for (k, v) in metadata.iter() {
            self.put_string(k)?;
            self.put(&v.value_type().id().to_le_bytes())?;
            self.put_value(v)?;
        }
        self.metadata = metadata;
        let tensors = std::mem::take(&mut self.tensors);
        let mut offset = 0u64;
        for t in &tensors {
            self.put_string(&t.name)?;
            self.put(&(t.shape.len() as u32).to_le_bytes())?;
            for d in &t.shape {
                self.put(&d.to_le_bytes())?;
            }
            self.put(&t.type_id.to_le_bytes())?;
            self.put(&offset.to_le_bytes())?;
            offset += t.n_bytes.next_multiple_of(self.alignment);
        }
        self.tensors = tensors;
        self.pad()
    }

    fn next_tensor(&mut self, name: &str) -> Result<u64> {
        if !self.header_written {
            self.write_header()?;
        }
        let Some(t) = self.tensors.get(self.next) else {
            return Err(GgufError::Writer(format!(
                "data for {name:?} but all {} declared tensors are written",
                self.tensors.len()
            )));
        };
        if t.name != name {
            return Err(GgufError::Writer(format!(
                "data for {name:?} but the next declared tensor is {:?}",
                t.name
            )));
        }
        Ok(t.n_bytes)
    }

    /// Writes the data of the next declared tensor, which must be called `name` and have
    /// exactly its size in bytes, then pads to the alignment.
    pub fn write_tensor_data(&mut self, name: &str, data: &[u8]) -> Result<()> {
        let n = self.next_tensor(name)?;
        if data.len() as u64 != n {
            return Err(GgufError::Writer(format!(
                "tensor {name:?} needs {n} bytes, got {}",
                data.len()
            )));
        }
        self.put(data)?;
        self.next += 1;
        self.pad()
    }

    /// Like [`write_tensor_data`](Self::write_tensor_data), copying exactly the tensor's size
    /// from `reader` (in chunks; a short reader is an error).
    pub fn write_tensor_from(&mut self, name: &str, reader: &mut dyn Read) -> Result<()> {
        let n = self.next_tensor(name)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut left = n;
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let got = match reader.read(&mut buf[..want]) {
                Ok(0) => {
                    return Err(GgufError::Writer(format!(
                        "tensor {name:?}: reader ended {left} bytes early"
                    )))
                }
                Ok(k) => k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(GgufError::Write(e)),
            };
            self.put(&buf[..got])?;
            left -= got as u64;
        }
        self.next += 1;
        self.pad()
    }

    /// Checks that every declared tensor was written (writing the header if there are no
    /// tensors), flushes and returns the output.
    pub fn finish(mut self) -> Result<W> {
        if !self.header_written {
            self.write_header()?;
        }
        if self.next != self.tensors.len() {
            return Err(GgufError::Writer(format!(
                "finished after {} of {} tensors; next missing: {:?}",
                self.next,
                self.tensors.len(),
                self.tensors[self.next].name
            )));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

impl GgufWriter<AtomicFile> {
    /// A writer to `path`: the bytes go to a temporary file next to it, which
    /// [`AtomicFile::commit`] (after [`finish`](GgufWriter::finish)) renames to `path`.
    /// Dropping the writer or the `AtomicFile` without committing removes the temporary.
    pub fn create(path: impl AsRef<Path>, kind: FileKind) -> Result<GgufWriter<AtomicFile>> {
        Ok(GgufWriter::new(AtomicFile::create(path.as_ref())?, kind))
    }
}

/// A file written under a temporary name and renamed into place on [`commit`](Self::commit),
/// so readers never see a half-written file.
pub struct AtomicFile {
    file: Option<BufWriter<File>>,
    temp: PathBuf,
    dest: PathBuf,
}

impl AtomicFile {
    /// Creates `<dir>/.<name>.partial-<pid>` for a later rename to `dest`.
    pub fn create(dest: &Path) -> Result<AtomicFile> {
        let name = dest
            .file_name()
            .ok_or_else(|| GgufError::Writer(format!("{} has no file name", dest.display())))?;
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".partial-{}", std::process::id()));
        let temp = dest.with_file_name(temp_name);
        let file = File::create(&temp).map_err(|e| GgufError::io(&temp, e))?;
        Ok(AtomicFile {
            file: Some(BufWriter::with_capacity(1 << 20, file)),
            temp,
            dest: dest.to_path_buf(),
        })
    }

    /// Flushes, syncs and renames the temporary file to its destination.
    pub fn commit(mut self) -> Result<()> {
        let Some(w) = self.file.take() else {
            return Ok(());
        };
        let file = w
            .into_inner()
            .map_err(|e| GgufError::io(&self.temp, e.into_error()))?;
        file.sync_all().map_err(|e| GgufError::io(&self.temp, e))?;
        drop(file);
        std::fs::rename(&self.temp, &self.dest).map_err(|e| GgufError::io(&self.dest, e))
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match &mut self.file {
            Some(f) => f.write(buf),
            None => Err(io::Error::other("file already committed")),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match &mut self.file {
            Some(f) => f.flush(),
            None => Ok(()),
        }
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}
