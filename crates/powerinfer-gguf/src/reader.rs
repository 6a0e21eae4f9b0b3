//! Reading GGUF and PowerInfer files: header, metadata and tensor directory parsed up front,
//! tensor data borrowed from a memory map (or any byte buffer) on demand.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use bytemuck::Pod;
use memmap2::Mmap;

use crate::error::{GgufError, Result};
use crate::metadata::{Array, Metadata, Value, ValueType};
use crate::types::GgmlType;

/// `general.alignment` when the key is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The key that sets the data alignment (a `u32`).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Deepest nesting of metadata arrays accepted (real files nest at most 2 levels; the limit
/// keeps recursion bounded on malicious input).
pub const MAX_ARRAY_DEPTH: u32 = 64;
/// Most dimensions a ggml tensor has.
pub const MAX_DIMS: usize = 4;
/// `general.architecture` of PowerInfer's GPU-index files, in which ggml type id 18 means I32.
pub const GPU_INDEX_ARCH: &str = "generic.gpu_index";
/// The ggml type id PowerInfer's (older) ggml gave I32; see [`GPU_INDEX_ARCH`].
pub const LEGACY_I32_TYPE_ID: u32 = 18;

/// Which magic a file has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FileKind {
    /// `GGUF`: a dense llama.cpp model file.
    Gguf,
    /// `PWRI`: a PowerInfer sparse model file (or GPU-index file); otherwise plain GGUF v3.
    PowerInfer,
}

impl FileKind {
    /// The four magic bytes.
    pub fn magic(self) -> [u8; 4] {
        match self {
            FileKind::Gguf => *b"GGUF",
            FileKind::PowerInfer => *b"PWRI",
        }
    }

    /// The magic as text (`"GGUF"` or `"PWRI"`).
    pub fn magic_str(self) -> &'static str {
        match self {
            FileKind::Gguf => "GGUF",
            FileKind::PowerInfer => "PWRI",
        }
    }
}

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    shape: Vec<u64>,
    ggml_type: GgmlType,
    type_id: u32,
    offset: u64,
    n_elements: u64,
    n_bytes: u64,
}

impl TensorInfo {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Dimensions in ggml order: `shape()[0]` (ne0) is the contiguous one.
    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    /// Element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// The type id as stored in the file (differs from `ggml_type().id()` only for I32
    /// tensors of GPU-index files, stored as 18).
    pub fn type_id(&self) -> u32 {
        self.type_id
    }

    /// Offset of the data relative to the start of the data section.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Number of elements (product of the shape; 1 for zero dimensions).
    pub fn n_elements(&self) -> u64 {
        self.n_elements
    }

    /// Size of the data in bytes.
    pub fn n_bytes(&self) -> u64 {
        self.n_bytes
    }
}

/// A parsed file minus its tensor data: kind, version, alignment, metadata, tensor directory.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    kind: FileKind,
    version: u32,
    alignment: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    data_offset: u64,
}

impl GgufHeader {
    /// Parses and validates everything but the tensor bytes. `bytes` is the whole file: tensor
    /// ranges are checked against its length (no tensor byte is read).
    pub fn parse(bytes: &[u8]) -> Result<GgufHeader> {
        parse(bytes)
    }

    /// Magic.
    pub fn kind(&self) -> FileKind {
        self.kind
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Tensor directory in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Absolute file offset where the data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    fn info_or_err(&self, name: &str) -> Result<&TensorInfo> {
        self.tensor_info(name)
            .ok_or_else(|| GgufError::TensorNotFound {
                name: name.to_string(),
            })
    }
}

/// An open GGUF or PowerInfer file: the parsed [`GgufHeader`] plus the file's bytes, by
/// default a read-only memory map. `GgufFile<&[u8]>` or `GgufFile<Vec<u8>>` work on bytes in
/// memory.
pub struct GgufFile<B = Mmap> {
    bytes: B,
    header: GgufHeader,
}

impl GgufFile<Mmap> {
    /// Maps `path` and parses its header, metadata and tensor directory. No tensor byte is
    /// touched (the OS pages them in when [`tensor_data`](GgufFile::tensor_data) slices are
    /// read).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile<Mmap>> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        // SAFETY: the map is read-only and lives as long as the returned GgufFile. Like every
        // mmap-based model reader (llama.cpp included), this relies on the file not being
        // truncated or modified by another process while it is mapped; that would change the
        // bytes under us or raise SIGBUS. Model files are written once (our writer renames a
        // complete temporary file into place) and then only read.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| GgufError::io(path, e))?;
        #[cfg(target_os = "linux")]
        {
            // Only a hint. Where the file system keeps large folios (ext4 and XFS on recent
            // kernels), pages read in through a huge-page mapping land in the page cache as
            // 2 MiB folios, and every later mapping of them (by any process) gets 2 MiB TLB
            // entries: weight streaming during decode then pays far fewer TLB misses and the
            // first touch far fewer page faults. Files already cached in small pages stay so.
            let _ = mmap.advise(memmap2::Advice::HugePage);
        }
        GgufFile::from_bytes(mmap)
    }

    /// Reads the whole of `path` into anonymous memory (transparent huge pages requested where
    /// the OS offers them) instead of mapping the file, like llama.cpp's `--no-mmap`: loading
    /// costs a copy, but the weights no longer live in 4 KiB page-cache pages.
    pub fn open_in_memory(path: impl AsRef<Path>) -> Result<GgufFile<Mmap>> {
        let path = path.as_ref();
        let mut file = File::open(path).map_err(|e| GgufError::io(path, e))?;
        let len = file.metadata().map_err(|e| GgufError::io(path, e))?.len();
        let len = usize::try_from(len).map_err(|_| {
            GgufError::io(
                path,
                std::io::Error::other("file larger than the address space"),
            )
        })?;
        let mut anon =
            memmap2::MmapMut::map_anon(len.max(1)).map_err(|e| GgufError::io(path, e))?;
        #[cfg(target_os = "linux")]
        {
            // Only a hint: without transparent huge pages the memory is still correct.
            let _ = anon.advise(memmap2::Advice::HugePage);
        }
        copy_file(&mut file, &mut anon[..len]).map_err(|e| GgufError::io(path, e))?;
        let map = anon.make_read_only().map_err(|e| GgufError::io(path, e))?;
        GgufFile::from_bytes(map)
    }
}

/// Reads all of `out.len()` bytes of `file` into `out`, several threads reading their own parts
/// (positioned reads) where the OS has them: the first touch of fresh memory costs more than
/// the copy, and the threads fault their parts in side by side (`docs/tuning.md`, "Reading a
/// file into memory").
fn copy_file(file: &mut File, out: &mut [u8]) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        /// Bytes per positioned read (a few huge pages).
        const PIECE: usize = 8 << 20;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = out.len().div_ceil(threads.max(1)).max(1);
        let file = &*file;
        std::thread::scope(|s| {
            let parts: Vec<_> = out
                .chunks_mut(per)
                .enumerate()
                .map(|(t, part)| {
                    s.spawn(move || -> std::io::Result<()> {
                        let start = (t * per) as u64;
                        for (k, piece) in part.chunks_mut(PIECE).enumerate() {
                            file.read_exact_at(piece, start + (k * PIECE) as u64)?;
                        }
                        Ok(())
                    })
                })
                .collect();
            parts
                .into_iter()
                .try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })
    }
    #[cfg(not(unix))]
    {
        use std::io::Read;
        file.read_exact(out)
    }
}

impl<B: AsRef<[u8]>> GgufFile<B> {
    /// Parses a file held in `bytes`.
    pub fn from_bytes(bytes: B) -> Result<GgufFile<B>> {
        let header = parse(bytes.as_ref())?;
        Ok(GgufFile { bytes, header })
    }

    /// The parsed header, metadata and tensor directory.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// Magic.
    pub fn kind(&self) -> FileKind {
        self.header.kind
    }

    /// Format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// Data alignment in bytes.
    pub fn alignment(&self) -> u64 {
        self.header.alignment
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }

    /// Tensor directory in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The tensor named `name`.
    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor_info(name)
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_ref()
    }

    /// The bytes of `info`'s tensor.
    ///
    /// # Panics
    ///
    /// If `info` does not come from this file's directory and its range lies outside this
    /// file (a caller bug, not a property of the input; use
    /// [`tensor_data`](Self::tensor_data) to go by name).
    pub fn data_of(&self, info: &TensorInfo) -> &[u8] {
        if info.n_bytes == 0 {
            return &[];
        }
        // Parsing checked that data_offset + offset + n_bytes <= len, so these fit in usize.
        let start = (self.header.data_offset + info.offset) as usize;
        &self.bytes.as_ref()[start..start + info.n_bytes as usize]
    }

    /// The bytes of the tensor named `name`.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        Ok(self.data_of(self.header.info_or_err(name)?))
    }

    fn typed<T: Pod>(
        &self,
        name: &str,
        ok: impl Fn(GgmlType) -> bool,
        expected: &str,
    ) -> Result<&[T]> {
        let info = self.header.info_or_err(name)?;
        if !ok(info.ggml_type) {
            return Err(GgufError::TensorTypeMismatch {
                name: name.to_string(),
                expected: expected.to_string(),
                found: info.ggml_type,
            });
        }
        let data = self.data_of(info);
        if data.is_empty() {
            return Ok(&[]);
        }
        bytemuck::try_cast_slice(data).map_err(|_| GgufError::MisalignedView {
            name: name.to_string(),
            align: std::mem::align_of::<T>(),
        })
    }

    /// An F32 tensor as `&[f32]` (no copy). Fails if the tensor is not F32 or (only possible
    /// for in-memory buffers) its bytes are not 4-byte aligned.
    pub fn tensor_f32(&self, name: &str) -> Result<&[f32]> {
        self.typed(name, |t| t == GgmlType::F32, "F32")
    }

    /// An F16 tensor as `&[half::f16]` (no copy).
    pub fn tensor_f16(&self, name: &str) -> Result<&[half::f16]> {
        self.typed(name, |t| t == GgmlType::F16, "F16")
    }

    /// An I32 tensor as `&[i32]` (no copy).
    pub fn tensor_i32(&self, name: &str) -> Result<&[i32]> {
        self.typed(name, |t| t == GgmlType::I32, "I32")
    }

    /// A tensor of element type `ty` viewed as a slice of `T` (for example
    /// `tensor_as::<BlockQ4_0>(name, GgmlType::Q4_0)`). The caller picks a `T` whose size is
    /// `ty`'s block size in bytes; a size that does not divide the data is an error.
    pub fn tensor_as<T: Pod>(&self, name: &str, ty: GgmlType) -> Result<&[T]> {
        let info = self.header.info_or_err(name)?;
        if info.ggml_type != ty {
            return Err(GgufError::TensorTypeMismatch {
                name: name.to_string(),
                expected: ty.name().to_string(),
                found: info.ggml_type,
            });
        }
        let data = self.data_of(info);
        if data.len() % std::mem::size_of::<T>().max(1) != 0 {
            return Err(GgufError::TensorTypeMismatch {
                name: name.to_string(),
                expected: format!("{} bytes per element", std::mem::size_of::<T>()),
                found: info.ggml_type,
            });
        }
        if data.is_empty() {
            return Ok(&[]);
        }
        bytemuck::try_cast_slice(data).map_err(|_| GgufError::MisalignedView {
            name: name.to_string(),
            align: std::mem::align_of::<T>(),
        })
    }

    /// A quantized tensor as a slice of its blocks, e.g. `tensor_blocks::<BlockQ4_0>(name)`.
    /// The block struct decides the expected type ([`GgmlBlock::TYPE`]).
    pub fn tensor_blocks<T: GgmlBlock>(&self, name: &str) -> Result<&[T]> {
        self.tensor_as(name, T::TYPE)
    }
}

/// A `#[repr(C)]` block struct that is the storage unit of one [`GgmlType`]: every struct in
/// [`crate::quants::blocks`].
pub trait GgmlBlock: Pod {
    /// The type whose blocks this struct holds.
    const TYPE: GgmlType;
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what,
                offset: self.offset(),
                needed: n,
                available: self.remaining(),
            });
        }
        let s = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Checks that `count` items of at least `min_size` bytes can fit in what is left;
    /// `at` is where the count was stored. Returns a safe `Vec` capacity.
    fn check_count(&self, count: u64, min_size: u64, what: &'static str, at: u64) -> Result<usize> {
        let available = self.remaining();
        match count.checked_mul(min_size) {
            Some(need) if need <= available => Ok(count as usize),
            _ => Err(GgufError::CountTooLarge {
                what,
                offset: at,
                count,
                min_size,
                available,
            }),
        }
    }

    fn string(&mut self, what: &'static str) -> Result<String> {
        let at = self.offset();
        let len = self.u64(what)?;
        if len > self.remaining() {
            return Err(GgufError::Truncated {
                what,
                offset: at,
                needed: len.saturating_add(8),
                available: self.remaining() + 8,
            });
        }
        let start = self.offset();
        let raw = self.take(len, what)?;
        std::str::from_utf8(raw)
            .map(str::to_owned)
            .map_err(|_| GgufError::InvalidUtf8 { offset: start })
    }

    fn value_type(&mut self) -> Result<ValueType> {
        let at = self.offset();
        let id = self.u32("value type")?;
        ValueType::from_id(id).ok_or(GgufError::UnknownValueType { offset: at, id })
    }

    fn bool(&mut self) -> Result<bool> {
        let at = self.offset();
        match self.array::<1>("bool")?[0] {
            0 => Ok(false),
            1 => Ok(true),
            value => Err(GgufError::InvalidBool { offset: at, value }),
        }
    }

    fn value(&mut self, ty: ValueType, depth: u32) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>("u8")?[0]),
            ValueType::I8 => Value::I8(self.array::<1>("i8")?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array("u16")?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array("i16")?)),
            ValueType::U32 => Value::U32(self.u32("u32")?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array("i32")?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array("f32")?)),
            ValueType::Bool => Value::Bool(self.bool()?),
            ValueType::String => Value::String(self.string("string")?),
            ValueType::Array => Value::Array(self.array_value(depth)?),
            ValueType::U64 => Value::U64(self.u64("u64")?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array("i64")?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array("f64")?)),
        })
    }

    fn array_value(&mut self, depth: u32) -> Result<Array> {
        let at = self.offset();
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::TooDeep {
                offset: at,
                max: MAX_ARRAY_DEPTH,
            });
        }
        let elem = self.value_type()?;
        let count_at = self.offset();
        let count = self.u64("array count")?;
        let n = self.check_count(count, elem.min_size(), "array", count_at)?;
        macro_rules! fixed {
            ($variant:ident, $t:ty, $what:literal) => {{
                let raw = self.take(n as u64 * std::mem::size_of::<$t>() as u64, $what)?;
                Array::$variant(
                    raw.chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                        .collect(),
                )
            }};
        }
        Ok(match elem {
            ValueType::U8 => Array::U8(self.take(n as u64, "u8 array")?.to_vec()),
            ValueType::I8 => fixed!(I8, i8, "i8 array"),
            ValueType::U16 => fixed!(U16, u16, "u16 array"),
            ValueType::I16 => fixed!(I16, i16, "i16 array"),
            ValueType::U32 => fixed!(U32, u32, "u32 array"),
            ValueType::I32 => fixed!(I32, i32, "i32 array"),
            ValueType::F32 => fixed!(F32, f32, "f32 array"),
            ValueType::U64 => fixed!(U64, u64, "u64 array"),
            ValueType::I64 => fixed!(I64, i64, "i64 array"),
            ValueType::F64 => fixed!(F64, f64, "f64 array"),
            ValueType::Bool => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.bool()?);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.string("string in array")?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}

fn parse(bytes: &[u8]) -> Result<GgufHeader> {
    let mut c = Cursor { bytes, pos: 0 };
    let magic = c.array::<4>("magic")?;
    let kind = match &magic {
        b"GGUF" => FileKind::Gguf,
        b"PWRI" => FileKind::PowerInfer,
        _ => return Err(GgufError::BadMagic { found: magic }),
    };
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return Err(GgufError::VersionOne),
        _ => return Err(GgufError::UnsupportedVersion { version }),
    }
    let n_tensors_at = c.offset();
    let n_tensors = c.u64("tensor count")?;
    let n_kv_at = c.offset();
    let n_kv = c.u64("key-value count")?;

    // A key-value pair takes at least 8 (key length) + 4 (type) + 1 bytes.
    let n_kv = c.check_count(n_kv, 13, "key-value pairs", n_kv_at)?;
    let mut metadata = Metadata::new();
    for _ in 0..n_kv {
        let at = c.offset();
        let key = c.string("metadata key")?;
        let ty = c.value_type()?;
        let value = c.value(ty, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey { key, offset: at });
        }
        metadata.push_new(key, value);
    }

    let alignment = match metadata.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(Value::U32(a)) => {
            return Err(GgufError::BadAlignment {
                reason: format!("{a} is not a non-zero power of two"),
            })
        }
        Some(other) => {
            return Err(GgufError::BadAlignment {
                reason: format!("type is {}, expected u32", other.value_type()),
            })
        }
    };
    let gpu_index = matches!(metadata.get("general.architecture"), Some(Value::String(a)) if a == GPU_INDEX_ARCH);

    // A tensor info takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
    let n_tensors = c.check_count(n_tensors, 24, "tensor infos", n_tensors_at)?;
    let mut tensors = Vec::with_capacity(n_tensors);
    let mut by_name = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let at = c.offset();
        let name = c.string("tensor name")?;
        let dims_at = c.offset();
        let n_dims = c.u32("tensor n_dims")?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                name,
                offset: dims_at,
                n_dims,
            });
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            shape.push(c.u64("tensor dimension")?);
        }
        let type_at = c.offset();
        let type_id = c.u32("tensor type")?;
        let ggml_type = if gpu_index && type_id == LEGACY_I32_TYPE_ID {
            Some(GgmlType::I32)
        } else {
            GgmlType::from_id(type_id)
        };
        let Some(ggml_type) = ggml_type else {
            return Err(GgufError::UnknownGgmlType {
                name,
                offset: type_at,
                id: type_id,
            });
        };
        let offset = c.u64("tensor offset")?;
        // ggml stores dimensions and sizes as int64: everything must fit in 63 bits.
        let n_elements = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64 && shape.iter().all(|&d| d <= i64::MAX as u64));
        let Some(n_elements) = n_elements else {
            return Err(GgufError::ShapeOverflow {
                name,
                offset: at,
                shape,
            });
        };
        if n_elements % ggml_type.block_size() as u64 != 0 {
            return Err(GgufError::NotWholeBlocks {
                name,
                offset: at,
                n_elements,
                ggml_type,
                block_size: ggml_type.block_size(),
            });
        }
        let Some(n_bytes) = ggml_type
            .bytes_for(n_elements)
            .filter(|&b| b <= i64::MAX as u64)
        else {
            return Err(GgufError::ShapeOverflow {
                name,
                offset: at,
                shape,
            });
        };
        if by_name.contains_key(&name) {
            return Err(GgufError::DuplicateTensor { name, offset: at });
        }
        by_name.insert(name.clone(), i);
        tensors.push(TensorInfo {
            name,
            shape,
            ggml_type,
            type_id,
            offset,
            n_elements,
            n_bytes,
        });
    }

    let end_of_infos = c.offset();
    let data_offset = end_of_infos.div_ceil(alignment) * alignment;
    let file_len = bytes.len() as u64;
    for t in &tensors {
        if t.offset % alignment != 0 {
            return Err(GgufError::MisalignedOffset {
                name: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        if t.n_bytes == 0 {
            continue;
        }
        let start = data_offset.saturating_add(t.offset);
        let end = start.saturating_add(t.n_bytes);
        if end > file_len {
            return Err(GgufError::TensorOutOfBounds {
                name: t.name.clone(),
                start,
                end,
                file_len,
            });
        }
    }
    // Overlap: sort non-empty tensors by offset; each must end before the next starts.
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        if pair[0].offset + pair[0].n_bytes > pair[1].offset {
            return Err(GgufError::OverlappingTensors {
                first: pair[0].name.clone(),
                second: pair[1].name.clone(),
                offset: pair[1].offset,
            });
        }
    }

    Ok(GgufHeader {
        kind,
        version,
        alignment,
        metadata,
        tensors,
        by_name,
        data_offset,
    })
}
