//! PyTorch `.pt` files (the zip format of `torch.save`, torch ≥ 1.6) without torch.
//!
//! A `.pt` file is a zip archive of stored (uncompressed) entries under one folder `P/`:
//! `P/data.pkl` (a pickle of the saved object), `P/data/<key>` (the raw little-endian bytes of
//! each storage), `P/version` and `P/byteorder`. The pickle rebuilds tensors by calling
//! `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`,
//! where `storage` is a persistent id `('storage', torch.FloatStorage, key, 'cpu', numel)`.
//!
//! [`read`] runs a small pickle machine over `data.pkl` that understands exactly these
//! constructs (plus `collections.OrderedDict` for state dicts and `_rebuild_parameter`) and
//! returns either one tensor or a dictionary of tensors ([`PtObject`]). It handles any pickle
//! protocol up to 5, any archive folder name, and strided (non-contiguous) tensors. The legacy
//! pre-1.6 tar format is refused with [`PtError::NotZip`].
//!
//! [`write_tensor`] and [`write_state_dict`] write files that `torch.load` reads (protocol 2,
//! folder `archive/`, storages 64-byte aligned as torch aligns them). Written files are
//! byte-for-byte deterministic (fixed zip timestamps) and appear atomically: the bytes go to a
//! temporary file next to the destination, which is renamed when complete.

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::{Cursor, Read, Write};
use std::path::Path;
use std::rc::Rc;

use half::{bf16, f16};

/// Why a `.pt` file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum PtError {
    /// The file could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The bytes are not a zip archive (a legacy pre-1.6 torch file, or not a torch file).
    #[error("not a zip archive (legacy torch files are not supported): {0}")]
    NotZip(String),
    /// The archive lacks an entry the format needs.
    #[error("missing archive entry {0:?}")]
    MissingEntry(String),
    /// The pickle is malformed or uses something this reader does not implement.
    #[error("pickle: {0}")]
    Pickle(String),
    /// The pickled object is not what the caller asked for (e.g. a dict where a tensor was
    /// expected), or names a storage type this reader does not know.
    #[error("unexpected object: {0}")]
    Unexpected(String),
    /// A tensor's shape, strides or offset do not fit its storage, or its data length does not
    /// match its shape.
    #[error("bad tensor: {0}")]
    BadTensor(String),
}

/// Result type of this module.
pub type Result<T> = std::result::Result<T, PtError>;

/// Element type of a torch tensor, named after its legacy storage class.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PtDtype {
    /// `torch.float32` (`FloatStorage`).
    F32,
    /// `torch.float16` (`HalfStorage`).
    F16,
    /// `torch.bfloat16` (`BFloat16Storage`).
    BF16,
    /// `torch.float64` (`DoubleStorage`).
    F64,
    /// `torch.int64` (`LongStorage`).
    I64,
    /// `torch.int32` (`IntStorage`).
    I32,
    /// `torch.int16` (`ShortStorage`).
    I16,
    /// `torch.int8` (`CharStorage`).
    I8,
    /// `torch.uint8` (`ByteStorage`).
    U8,
    /// `torch.bool` (`BoolStorage`).
    Bool,
}

impl PtDtype {
    const ALL: [PtDtype; 10] = [
        PtDtype::F32,
        PtDtype::F16,
        PtDtype::BF16,
        PtDtype::F64,
        PtDtype::I64,
        PtDtype::I32,
        PtDtype::I16,
        PtDtype::I8,
        PtDtype::U8,
        PtDtype::Bool,
    ];

    /// The legacy storage class name in module `torch` (`"FloatStorage"`, ...).
    pub fn storage_name(self) -> &'static str {
        match self {
            PtDtype::F32 => "FloatStorage",
            PtDtype::F16 => "HalfStorage",
            PtDtype::BF16 => "BFloat16Storage",
            PtDtype::F64 => "DoubleStorage",
            PtDtype::I64 => "LongStorage",
            PtDtype::I32 => "IntStorage",
            PtDtype::I16 => "ShortStorage",
            PtDtype::I8 => "CharStorage",
            PtDtype::U8 => "ByteStorage",
            PtDtype::Bool => "BoolStorage",
        }
    }

    /// The dtype whose storage class is `name`.
    pub fn from_storage_name(name: &str) -> Option<PtDtype> {
        PtDtype::ALL.into_iter().find(|d| d.storage_name() == name)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            PtDtype::F64 | PtDtype::I64 => 8,
            PtDtype::F32 | PtDtype::I32 => 4,
            PtDtype::F16 | PtDtype::BF16 | PtDtype::I16 => 2,
            PtDtype::I8 | PtDtype::U8 | PtDtype::Bool => 1,
        }
    }

    fn value_at(self, b: &[u8]) -> f64 {
        match self {
            PtDtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]).into(),
            PtDtype::F16 => f16::from_le_bytes([b[0], b[1]]).to_f64(),
            PtDtype::BF16 => bf16::from_le_bytes([b[0], b[1]]).to_f64(),
            PtDtype::F64 => f64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            PtDtype::I64 => i64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as f64,
            PtDtype::I32 => i32::from_le_bytes([b[0], b[1], b[2], b[3]]).into(),
            PtDtype::I16 => i16::from_le_bytes([b[0], b[1]]).into(),
            PtDtype::I8 => (b[0] as i8).into(),
            PtDtype::U8 | PtDtype::Bool => b[0].into(),
        }
    }
}

/// A dense tensor: element type, shape (torch order, outermost first) and its elements in
/// row-major order as little-endian bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct PtTensor {
    dtype: PtDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d))
}

impl PtTensor {
    /// A tensor from its little-endian element bytes; the length must match the shape.
    pub fn from_bytes(dtype: PtDtype, shape: Vec<usize>, data: Vec<u8>) -> Result<PtTensor> {
        let n = numel(&shape)
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| PtError::BadTensor(format!("shape {shape:?} overflows")))?;
        if n != data.len() {
            return Err(PtError::BadTensor(format!(
                "shape {shape:?} of {dtype:?} needs {n} bytes, got {}",
                data.len()
            )));
        }
        Ok(PtTensor { dtype, shape, data })
    }

    /// An f32 tensor; `values.len()` must match the shape.
    pub fn from_f32(shape: Vec<usize>, values: &[f32]) -> Result<PtTensor> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        PtTensor::from_bytes(PtDtype::F32, shape, data)
    }

    /// An f16 tensor; `values.len()` must match the shape.
    pub fn from_f16(shape: Vec<usize>, values: &[f16]) -> Result<PtTensor> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        PtTensor::from_bytes(PtDtype::F16, shape, data)
    }

    /// Element type.
    pub fn dtype(&self) -> PtDtype {
        self.dtype
    }

    /// Shape, outermost dimension first (torch order).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len() / self.dtype.size()
    }

    /// The elements as little-endian bytes, row-major.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// The elements converted to f64 (integers exactly up to 2^53).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.data
            .chunks_exact(self.dtype.size())
            .map(|b| self.dtype.value_at(b))
            .collect()
    }

    /// The elements converted to f32.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        self.data
            .chunks_exact(self.dtype.size())
            .map(|b| self.dtype.value_at(b) as f32)
            .collect()
    }
}

/// What a `.pt` file holds: one tensor, or a dictionary of tensors (a state dict) in file
/// order.
#[derive(Clone, Debug, PartialEq)]
pub enum PtObject {
    /// `torch.save(tensor)`.
    Tensor(PtTensor),
    /// `torch.save({name: tensor, ...})` or a module's `state_dict()`.
    Dict(Vec<(String, PtTensor)>),
}

// ------------------------------------------------------------------------------------------
// Reading

/// Reads a `.pt` file.
pub fn read(path: impl AsRef<Path>) -> Result<PtObject> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| PtError::Io {
        path: path.display().to_string(),
        source,
    })?;
    read_bytes(&bytes)
}

/// Reads a `.pt` file that holds one tensor.
pub fn read_tensor(path: impl AsRef<Path>) -> Result<PtTensor> {
    match read(path)? {
        PtObject::Tensor(t) => Ok(t),
        PtObject::Dict(_) => Err(PtError::Unexpected(
            "a dictionary where a tensor was expected".into(),
        )),
    }
}

/// Reads a `.pt` file that holds a dictionary of tensors (a state dict), in file order.
pub fn read_state_dict(path: impl AsRef<Path>) -> Result<Vec<(String, PtTensor)>> {
    match read(path)? {
        PtObject::Dict(d) => Ok(d),
        PtObject::Tensor(_) => Err(PtError::Unexpected(
            "a tensor where a dictionary was expected".into(),
        )),
    }
}

/// Reads the bytes of a `.pt` file.
pub fn read_bytes(bytes: &[u8]) -> Result<PtObject> {
    let mut zip =
        zip::ZipArchive::new(Cursor::new(bytes)).map_err(|e| PtError::NotZip(e.to_string()))?;
    let pkl_name = zip
        .file_names()
        .filter(|n| n.ends_with("data.pkl") && n.matches('/').count() == 1)
        .min()
        .map(str::to_string)
        .ok_or_else(|| PtError::MissingEntry("<folder>/data.pkl".into()))?;
    let prefix = pkl_name.trim_end_matches("data.pkl").to_string();
    let pkl = read_entry(&mut zip, &pkl_name)?;
    let obj = Unpickler::new(&pkl).run()?;
    let mut storages: HashMap<String, Vec<u8>> = HashMap::new();
    let mut load = |r: &TensorRef| -> Result<PtTensor> {
        if !storages.contains_key(&r.key) {
            let data = read_entry(&mut zip, &format!("{prefix}data/{}", r.key))?;
            storages.insert(r.key.clone(), data);
        }
        materialize(r, &storages[&r.key])
    };
    match &obj {
        Obj::Tensor(r) => Ok(PtObject::Tensor(load(r)?)),
        Obj::Dict(d) => {
            let mut out = Vec::new();
            for (k, v) in d.borrow().iter() {
                let name = match k {
                    Obj::Str(s) => s.clone(),
                    other => {
                        return Err(PtError::Unexpected(format!(
                            "dictionary key {}",
                            other.describe()
                        )))
                    }
                };
                match v {
                    Obj::Tensor(r) => out.push((name, load(r)?)),
                    other => {
                        return Err(PtError::Unexpected(format!(
                            "entry {name:?} is {}, not a tensor",
                            other.describe()
                        )))
                    }
                }
            }
            Ok(PtObject::Dict(out))
        }
        other => Err(PtError::Unexpected(format!(
            "the file holds {}, not a tensor or a dictionary of tensors",
            other.describe()
        ))),
    }
}

fn read_entry(zip: &mut zip::ZipArchive<Cursor<&[u8]>>, name: &str) -> Result<Vec<u8>> {
    let mut f = zip
        .by_name(name)
        .map_err(|_| PtError::MissingEntry(name.to_string()))?;
    // The declared size is the file's word: reserve at most 64 MiB on it (a larger entry grows
    // as it is read), so a hostile header cannot make the allocator fail.
    let mut out = Vec::with_capacity(f.size().min(64 << 20) as usize);
    f.read_to_end(&mut out).map_err(|source| PtError::Io {
        path: name.to_string(),
        source,
    })?;
    Ok(out)
}

/// Gathers a (possibly strided) tensor view out of its storage bytes.
fn materialize(r: &TensorRef, storage: &[u8]) -> Result<PtTensor> {
    let es = r.dtype.size();
    let n_storage = storage.len() / es;
    if r.shape.len() != r.stride.len() {
        return Err(PtError::BadTensor(format!(
            "size {:?} and stride {:?} differ in length",
            r.shape, r.stride
        )));
    }
    let n = numel(&r.shape)
        .ok_or_else(|| PtError::BadTensor(format!("shape {:?} overflows", r.shape)))?;
    // More elements than the storage holds means a view whose elements overlap (stride 0, as
    // `expand` makes): `torch.save` writes none for a parameter, and a hostile file could use it
    // to ask for an unbounded copy of a tiny storage.
    if n > n_storage {
        return Err(PtError::BadTensor(format!(
            "size {:?} has {n} elements, more than its storage's {n_storage} (an overlapping view)",
            r.shape
        )));
    }
    let mut data = Vec::with_capacity(n * es);
    if n > 0 {
        // Highest element index touched must lie inside the storage.
        let max = r
            .shape
            .iter()
            .zip(&r.stride)
            .try_fold(r.offset, |acc, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
            });
        match max {
            Some(m) if m < n_storage => {}
            _ => {
                return Err(PtError::BadTensor(format!(
                    "offset {} size {:?} stride {:?} exceed a storage of {n_storage} elements",
                    r.offset, r.shape, r.stride
                )))
            }
        }
        let mut idx = vec![0usize; r.shape.len()];
        for _ in 0..n {
            let e: usize = r.offset + idx.iter().zip(&r.stride).map(|(i, s)| i * s).sum::<usize>();
            data.extend_from_slice(&storage[e * es..(e + 1) * es]);
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < r.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    PtTensor::from_bytes(r.dtype, r.shape.clone(), data)
}

#[derive(Clone, Debug)]
struct TensorRef {
    dtype: PtDtype,
    key: String,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

type Shared<T> = Rc<RefCell<T>>;

#[derive(Clone, Debug)]
enum Obj {
    Mark,
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    /// Bytes (only their length is kept).
    Bytes(usize),
    /// Shared like Python's (a memoized tuple used twice is one value, not two copies).
    Tuple(Rc<Vec<Obj>>),
    List(Shared<Vec<Obj>>),
    Dict(Shared<Vec<(Obj, Obj)>>),
    Global(String, String),
    Storage(PtDtype, String),
    Tensor(TensorRef),
    /// The result of a call this reader does not model (kept so unrelated parts of a pickle,
    /// such as a state dict's `_metadata`, do not fail the whole file).
    Opaque(String),
}

/// Drops nested containers with a work list instead of the compiler's recursive drop: a
/// hostile pickle can nest tuples or lists a million deep (within [`MAX_STACK`], or through the
/// memo with a short stack), which a recursive drop turned into a stack overflow. (Containers
/// are shared, never deep-copied, so no other operation walks the nesting.)
impl Drop for Obj {
    fn drop(&mut self) {
        let mut work = Vec::new();
        self.take_children(&mut work);
        while let Some(mut o) = work.pop() {
            o.take_children(&mut work);
            // `o` holds no children now: its own drop does not recurse.
        }
    }
}

impl Obj {
    /// Moves the values this object alone holds (a tuple's, list's or dictionary's when no
    /// other reference shares it) into `out`.
    fn take_children(&mut self, out: &mut Vec<Obj>) {
        match self {
            Obj::Tuple(v) => {
                if let Some(v) = Rc::get_mut(v) {
                    out.append(v);
                }
            }
            Obj::List(l) => {
                if let Some(cell) = Rc::get_mut(l) {
                    out.append(cell.get_mut());
                }
            }
            Obj::Dict(d) => {
                if let Some(cell) = Rc::get_mut(d) {
                    for (k, v) in cell.get_mut().drain(..) {
                        out.push(k);
                        out.push(v);
                    }
                }
            }
            _ => {}
        }
    }

    fn describe(&self) -> String {
        match self {
            Obj::Mark => "a mark".into(),
            Obj::None => "None".into(),
            Obj::Bool(b) => format!("bool {b}"),
            Obj::Int(i) => format!("int {i}"),
            Obj::Float(f) => format!("float {f}"),
            Obj::Str(s) => format!("string {s:?}"),
            Obj::Bytes(n) => format!("{n} bytes"),
            Obj::Tuple(_) => "a tuple".into(),
            Obj::List(_) => "a list".into(),
            Obj::Dict(_) => "a dictionary".into(),
            Obj::Global(m, n) => format!("{m}.{n}"),
            Obj::Storage(..) => "a storage".into(),
            Obj::Tensor(_) => "a tensor".into(),
            Obj::Opaque(what) => format!("the result of {what}"),
        }
    }

    fn as_usize(&self, what: &str) -> Result<usize> {
        match self {
            Obj::Int(i) if *i >= 0 => Ok(*i as usize),
            other => Err(PtError::Pickle(format!(
                "{what}: expected a non-negative int, got {}",
                other.describe()
            ))),
        }
    }

    fn as_usize_tuple(&self, what: &str) -> Result<Vec<usize>> {
        match self {
            Obj::Tuple(v) => v.iter().map(|x| x.as_usize(what)).collect(),
            Obj::List(v) => v.borrow().iter().map(|x| x.as_usize(what)).collect(),
            other => Err(PtError::Pickle(format!(
                "{what}: expected a tuple, got {}",
                other.describe()
            ))),
        }
    }
}

/// Deepest stack the machine accepts (a guard against hostile files).
const MAX_STACK: usize = 1 << 20;

struct Unpickler<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Obj>,
    memo: HashMap<u64, Obj>,
}

impl<'a> Unpickler<'a> {
    fn new(data: &'a [u8]) -> Unpickler<'a> {
        Unpickler {
            data,
            pos: 0,
            stack: Vec::new(),
            memo: HashMap::new(),
        }
    }

    fn err<T>(&self, msg: impl Into<String>) -> Result<T> {
        Err(PtError::Pickle(format!(
            "at byte {}: {}",
            self.pos,
            msg.into()
        )))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.pos.checked_add(n) {
            Some(end) if end <= self.data.len() => {
                let s = &self.data[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            _ => self.err(format!("truncated (needs {n} more bytes)")),
        }
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn line(&mut self) -> Result<String> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return self.err("unterminated line");
        };
        let s = String::from_utf8_lossy(&rest[..n]).into_owned();
        self.pos += n + 1;
        Ok(s)
    }

    fn len_prefixed(&mut self, n: u64) -> Result<&'a [u8]> {
        let n = usize::try_from(n).or_else(|_| self.err("length overflows"))?;
        self.take(n)
    }

    fn utf8(&self, b: &[u8]) -> Result<String> {
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => self.err("string is not UTF-8"),
        }
    }

    fn push(&mut self, o: Obj) -> Result<()> {
        if self.stack.len() >= MAX_STACK {
            return self.err("stack too deep");
        }
        self.stack.push(o);
        Ok(())
    }

    fn pop(&mut self) -> Result<Obj> {
        match self.stack.pop() {
            Some(Obj::Mark) | None => self.err("stack underflow"),
            Some(o) => Ok(o),
        }
    }

    fn top(&mut self) -> Result<&mut Obj> {
        match self.stack.last_mut() {
            Some(Obj::Mark) | None => Err(PtError::Pickle(format!(
                "at byte {}: stack underflow",
                self.pos
            ))),
            Some(o) => Ok(o),
        }
    }

    /// Pops everything down to the last mark (removing it), in push order.
    fn pop_mark(&mut self) -> Result<Vec<Obj>> {
        let Some(m) = self.stack.iter().rposition(|o| matches!(o, Obj::Mark)) else {
            return self.err("no mark on the stack");
        };
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        Ok(items)
    }

    fn memo_get(&mut self, key: u64) -> Result<()> {
        match self.memo.get(&key) {
            Some(o) => {
                let o = o.clone();
                self.push(o)
            }
            None => self.err(format!("memo key {key} not set")),
        }
    }

    fn memo_put(&mut self, key: u64) -> Result<()> {
        let o = self.top()?.clone();
        self.memo.insert(key, o);
        Ok(())
    }

    fn set_items(&mut self, items: Vec<Obj>) -> Result<()> {
        if items.len() % 2 != 0 {
            return self.err("odd number of dictionary items");
        }
        match self.top()? {
            Obj::Dict(d) => {
                let mut d = d.borrow_mut();
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
                Ok(())
            }
            // Items set on an object this reader does not model are dropped.
            Obj::Opaque(_) => Ok(()),
            other => {
                let what = other.describe();
                self.err(format!("setting items on {what}"))
            }
        }
    }

    fn append(&mut self, items: Vec<Obj>) -> Result<()> {
        match self.top()? {
            Obj::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            Obj::Opaque(_) => Ok(()),
            other => {
                let what = other.describe();
                self.err(format!("appending to {what}"))
            }
        }
    }

    fn persistent_load(&self, pid: Obj) -> Result<Obj> {
        let Obj::Tuple(t) = &pid else {
            return self.err(format!("persistent id is {}", pid.describe()));
        };
        match t.as_slice() {
            [Obj::Str(tag), Obj::Global(module, name), key, _location, _numel]
                if tag == "storage" =>
            {
                if module != "torch" {
                    return self.err(format!("storage type {module}.{name}"));
                }
                let Some(dtype) = PtDtype::from_storage_name(name) else {
                    return Err(PtError::Unexpected(format!("storage type torch.{name}")));
                };
                let key = match key {
                    Obj::Str(s) => s.clone(),
                    Obj::Int(i) => i.to_string(),
                    other => return self.err(format!("storage key {}", other.describe())),
                };
                if key.contains('/') || key.contains("..") {
                    return self.err(format!("storage key {key:?}"));
                }
                Ok(Obj::Storage(dtype, key))
            }
            _ => self.err("persistent id is not ('storage', type, key, location, numel)"),
        }
    }

    fn reduce(&self, callable: Obj, args: Obj) -> Result<Obj> {
        let Obj::Global(module, name) = &callable else {
            return Ok(Obj::Opaque(callable.describe()));
        };
        let args = match &args {
            Obj::Tuple(a) => a,
            other => return self.err(format!("call arguments are {}", other.describe())),
        };
        match (module.as_str(), name.as_str()) {
            ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {
                if args.len() < 4 {
                    return self.err(format!("{name} with {} arguments", args.len()));
                }
                let Obj::Storage(dtype, key) = &args[0] else {
                    return self.err(format!("{name} of {}", args[0].describe()));
                };
                Ok(Obj::Tensor(TensorRef {
                    dtype: *dtype,
                    key: key.clone(),
                    offset: args[1].as_usize("storage offset")?,
                    shape: args[2].as_usize_tuple("size")?,
                    stride: args[3].as_usize_tuple("stride")?,
                }))
            }
            ("torch._utils", "_rebuild_parameter")
            | ("torch._utils", "_rebuild_parameter_with_state") => match args.first() {
                Some(t @ Obj::Tensor(_)) => Ok(t.clone()),
                _ => self.err("_rebuild_parameter without a tensor"),
            },
            ("collections", "OrderedDict") | ("builtins", "dict") | ("__builtin__", "dict") => {
                if !args.is_empty() {
                    return Ok(Obj::Opaque(format!("{module}.{name}(...)")));
                }
                Ok(Obj::Dict(Rc::new(RefCell::new(Vec::new()))))
            }
            _ => Ok(Obj::Opaque(format!("{module}.{name}"))),
        }
    }

    fn run(mut self) -> Result<Obj> {
        loop {
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return self.err(format!("pickle protocol {proto}"));
                    }
                }
                0x95 => {
                    self.u64()?;
                }
                b'.' => {
                    let o = self.pop()?;
                    return Ok(o);
                }
                b'(' => self.push(Obj::Mark)?,
                b'0' => {
                    if self.stack.pop().is_none() {
                        return self.err("stack underflow");
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let o = self.top()?.clone();
                    self.push(o)?;
                }
                b'N' => self.push(Obj::None)?,
                0x88 => self.push(Obj::Bool(true))?,
                0x89 => self.push(Obj::Bool(false))?,
                b'J' => {
                    let v = self.u32()? as i32;
                    self.push(Obj::Int(v.into()))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Obj::Int(v.into()))?
                }
                b'M' => {
                    let b = self.take(2)?;
                    self.push(Obj::Int(u16::from_le_bytes([b[0], b[1]]).into()))?
                }
                0x8a => {
                    let n = self.u8()? as usize;
                    let b = self.take(n)?;
                    if n > 8 {
                        return self.err("integer wider than 64 bits");
                    }
                    let mut v: i64 = 0;
                    for (i, &x) in b.iter().enumerate() {
                        v |= i64::from(x) << (8 * i);
                    }
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n);
                    }
                    self.push(Obj::Int(v))?
                }
                b'I' | b'L' => {
                    let l = self.line()?;
                    let t = l.trim_end_matches('L');
                    let o = match t {
                        "00" => Obj::Bool(false),
                        "01" => Obj::Bool(true),
                        _ => match t.parse::<i64>() {
                            Ok(v) => Obj::Int(v),
                            Err(_) => return self.err(format!("integer {l:?}")),
                        },
                    };
                    self.push(o)?
                }
                b'G' => {
                    let b = self.take(8)?;
                    self.push(Obj::Float(f64::from_be_bytes(b.try_into().expect("8"))))?
                }
                b'F' => {
                    let l = self.line()?;
                    match l.parse::<f64>() {
                        Ok(v) => self.push(Obj::Float(v))?,
                        Err(_) => return self.err(format!("float {l:?}")),
                    }
                }
                b'X' => {
                    let n = self.u32()?;
                    let b = self.len_prefixed(n.into())?;
                    let s = self.utf8(b)?;
                    self.push(Obj::Str(s))?
                }
                0x8c => {
                    let n = self.u8()?;
                    let b = self.len_prefixed(n.into())?;
                    let s = self.utf8(b)?;
                    self.push(Obj::Str(s))?
                }
                0x8d => {
                    let n = self.u64()?;
                    let b = self.len_prefixed(n)?;
                    let s = self.utf8(b)?;
                    self.push(Obj::Str(s))?
                }
                b'U' | b'T' => {
                    let n = if op == b'U' {
                        u64::from(self.u8()?)
                    } else {
                        u64::from(self.u32()?)
                    };
                    // Python 2 str: bytes, decoded as Latin-1 as Python 3 does by default.
                    let b = self.len_prefixed(n)?;
                    self.push(Obj::Str(b.iter().map(|&c| char::from(c)).collect()))?
                }
                b'C' | b'B' | 0x8e => {
                    let n = match op {
                        b'C' => u64::from(self.u8()?),
                        b'B' => u64::from(self.u32()?),
                        _ => self.u64()?,
                    };
                    let b = self.len_prefixed(n)?.len();
                    self.push(Obj::Bytes(b))?
                }
                b')' => self.push(Obj::Tuple(Rc::new(Vec::new())))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Obj::Tuple(Rc::new(items)))?
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n
                        || self.stack[self.stack.len() - n..]
                            .iter()
                            .any(|o| matches!(o, Obj::Mark))
                    {
                        return self.err("stack underflow");
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.push(Obj::Tuple(Rc::new(items)))?
                }
                b']' => self.push(Obj::List(Rc::new(RefCell::new(Vec::new()))))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Obj::List(Rc::new(RefCell::new(items))))?
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.append(items)?
                }
                b'}' => self.push(Obj::Dict(Rc::new(RefCell::new(Vec::new()))))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    self.push(Obj::Dict(Rc::new(RefCell::new(Vec::new()))))?;
                    self.set_items(items)?
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?
                }
                0x8f => self.push(Obj::Opaque("set()".into()))?,
                0x90 => {
                    self.pop_mark()?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.push(Obj::Global(module, name))?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (&module, &name) {
                        (Obj::Str(m), Obj::Str(n)) => {
                            self.push(Obj::Global(m.clone(), n.clone()))?
                        }
                        _ => return self.err("STACK_GLOBAL of non-strings"),
                    }
                }
                b'R' => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let o = self.reduce(callable, args)?;
                    self.push(o)?
                }
                0x81 => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let o = self.reduce(cls, args)?;
                    self.push(o)?
                }
                b'b' => {
                    // BUILD: set state on the object below; the objects modelled here
                    // (tensors, dicts) have no state that matters.
                    self.pop()?;
                    self.top()?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let o = self.persistent_load(pid)?;
                    self.push(o)?
                }
                b'P' => {
                    let l = self.line()?;
                    return self.err(format!("text persistent id {l:?}"));
                }
                b'q' => {
                    let k = self.u8()?;
                    self.memo_put(k.into())?
                }
                b'r' => {
                    let k = self.u32()?;
                    self.memo_put(k.into())?
                }
                b'p' => {
                    let l = self.line()?;
                    match l.parse::<u64>() {
                        Ok(k) => self.memo_put(k)?,
                        Err(_) => return self.err(format!("memo key {l:?}")),
                    }
                }
                0x94 => {
                    let k = self.memo.len() as u64;
                    self.memo_put(k)?
                }
                b'h' => {
                    let k = self.u8()?;
                    self.memo_get(k.into())?
                }
                b'j' => {
                    let k = self.u32()?;
                    self.memo_get(k.into())?
                }
                b'g' => {
                    let l = self.line()?;
                    match l.parse::<u64>() {
                        Ok(k) => self.memo_get(k)?,
                        Err(_) => return self.err(format!("memo key {l:?}")),
                    }
                }
                other => {
                    self.pos -= 1;
                    return self.err(format!("unsupported opcode 0x{other:02x}"));
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// Writing

/// Pickle protocol-2 writer for the few constructs `torch.save` needs.
struct Pickler {
    out: Vec<u8>,
}

impl Pickler {
    fn op(&mut self, b: u8) {
        self.out.push(b);
    }

    fn global(&mut self, module: &str, name: &str) {
        self.op(b'c');
        self.out.extend_from_slice(module.as_bytes());
        self.op(b'\n');
        self.out.extend_from_slice(name.as_bytes());
        self.op(b'\n');
    }

    fn string(&mut self, s: &str) {
        self.op(b'X');
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
    }

    fn int(&mut self, v: usize) {
        if let Ok(x) = i32::try_from(v) {
            self.op(b'J');
            self.out.extend_from_slice(&x.to_le_bytes());
        } else {
            self.op(0x8a);
            self.op(8);
            self.out.extend_from_slice(&(v as i64).to_le_bytes());
        }
    }

    fn int_tuple(&mut self, v: &[usize]) {
        self.op(b'(');
        for &x in v {
            self.int(x);
        }
        self.op(b't');
    }

    fn empty_ordered_dict(&mut self) {
        self.global("collections", "OrderedDict");
        self.op(b')');
        self.op(b'R');
    }

    fn tensor(&mut self, t: &PtTensor, key: &str) {
        self.global("torch._utils", "_rebuild_tensor_v2");
        self.op(b'(');
        // Persistent id of the storage.
        self.op(b'(');
        self.string("storage");
        self.global("torch", t.dtype.storage_name());
        self.string(key);
        self.string("cpu");
        self.int(t.numel());
        self.op(b't');
        self.op(b'Q');
        self.int(0);
        self.int_tuple(&t.shape);
        let mut stride = vec![1usize; t.shape.len()];
        for d in (0..t.shape.len().saturating_sub(1)).rev() {
            stride[d] = stride[d + 1] * t.shape[d + 1];
        }
        self.int_tuple(&stride);
        self.op(0x89); // requires_grad = False
        self.empty_ordered_dict(); // backward hooks
        self.op(b't');
        self.op(b'R');
    }
}

/// The bytes of a `.pt` file holding `obj`.
pub fn to_bytes(obj: &PtObject) -> Result<Vec<u8>> {
    let mut p = Pickler { out: Vec::new() };
    p.op(0x80);
    p.op(2);
    let tensors: Vec<&PtTensor> = match obj {
        PtObject::Tensor(t) => {
            p.tensor(t, "0");
            vec![t]
        }
        PtObject::Dict(entries) => {
            p.empty_ordered_dict();
            if !entries.is_empty() {
                p.op(b'(');
                for (i, (name, t)) in entries.iter().enumerate() {
                    p.string(name);
                    p.tensor(t, &i.to_string());
                }
                p.op(b'u');
            }
            entries.iter().map(|(_, t)| t).collect()
        }
    };
    p.op(b'.');
    let storages: Vec<&[u8]> = tensors.iter().map(|t| t.bytes()).collect();
    archive(&p.out, &storages)
}

/// A `.pt` zip archive of the pickle `pkl` and the storages `data/0`, `data/1`, ….
fn archive(pkl: &[u8], storages: &[&[u8]]) -> Result<Vec<u8>> {
    let zip_err = |e: zip::result::ZipError| PtError::Io {
        path: "<zip>".into(),
        source: std::io::Error::other(e),
    };
    let io_err = |source| PtError::Io {
        path: "<zip>".into(),
        source,
    };
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Stored)
        .unix_permissions(0o644);
    zip.start_file("archive/data.pkl", opts).map_err(zip_err)?;
    zip.write_all(pkl).map_err(io_err)?;
    zip.start_file("archive/byteorder", opts).map_err(zip_err)?;
    zip.write_all(b"little").map_err(io_err)?;
    for (i, data) in storages.iter().enumerate() {
        zip.start_file(format!("archive/data/{i}"), opts.with_alignment(64))
            .map_err(zip_err)?;
        zip.write_all(data).map_err(io_err)?;
    }
    zip.start_file("archive/version", opts).map_err(zip_err)?;
    zip.write_all(b"3\n").map_err(io_err)?;
    Ok(zip.finish().map_err(zip_err)?.into_inner())
}

/// Writes `bytes` to `path` through a temporary file in the same folder, renamed when complete.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("path has no file name"))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".partial-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

fn write_obj(path: &Path, obj: &PtObject) -> Result<()> {
    let bytes = to_bytes(obj)?;
    write_atomic(path, &bytes).map_err(|source| PtError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Writes one tensor as `torch.save(tensor)` would.
pub fn write_tensor(path: impl AsRef<Path>, tensor: &PtTensor) -> Result<()> {
    write_obj(path.as_ref(), &PtObject::Tensor(tensor.clone()))
}

/// Writes a state dict (an `OrderedDict` of tensors, in the given order).
pub fn write_state_dict(path: impl AsRef<Path>, entries: &[(String, PtTensor)]) -> Result<()> {
    write_obj(path.as_ref(), &PtObject::Dict(entries.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_round_trip() {
        let t = PtTensor::from_f32(vec![5], &[1.0, -2.5, 0.0, 3.25, 1e-3]).unwrap();
        let bytes = to_bytes(&PtObject::Tensor(t.clone())).unwrap();
        assert_eq!(read_bytes(&bytes).unwrap(), PtObject::Tensor(t));
    }

    #[test]
    fn state_dict_round_trip_and_determinism() {
        let a = PtTensor::from_f32(vec![2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let b = PtTensor::from_f16(vec![3], &[f16::from_f32(0.5); 3]).unwrap();
        let d = PtObject::Dict(vec![("fc1.weight".into(), a), ("fc2.weight".into(), b)]);
        let bytes = to_bytes(&d).unwrap();
        assert_eq!(bytes, to_bytes(&d).unwrap());
        assert_eq!(read_bytes(&bytes).unwrap(), d);
        // Storage data is 64-byte aligned in the archive, as torch writes it.
        let pos = bytes
            .windows(12)
            .position(|w| w == bytemuck_f32(&[1.0, 2.0, 3.0]))
            .unwrap();
        assert_eq!(pos % 64, 0);
    }

    fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn strided_view_is_gathered() {
        // A transposed 2x3 view of a 3x2 storage: element (i, j) at offset j*2 + i.
        let r = TensorRef {
            dtype: PtDtype::F32,
            key: "0".into(),
            offset: 0,
            shape: vec![2, 3],
            stride: vec![1, 2],
        };
        let storage = bytemuck_f32(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let t = materialize(&r, &storage).unwrap();
        assert_eq!(t.to_f32_vec(), [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);
        let bad = TensorRef {
            offset: 1,
            stride: vec![1, 3],
            ..r.clone()
        };
        assert!(matches!(
            materialize(&bad, &storage),
            Err(PtError::BadTensor(_))
        ));
        // An overlapping view (stride 0) of one element as 2⁴⁰: refused before any copy.
        let broadcast = TensorRef {
            shape: vec![1 << 40],
            stride: vec![0],
            ..r
        };
        assert!(matches!(
            materialize(&broadcast, &storage),
            Err(PtError::BadTensor(_))
        ));
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(matches!(read_bytes(b"not a zip"), Err(PtError::NotZip(_))));
        let t = PtTensor::from_f32(vec![1], &[1.0]).unwrap();
        let mut bytes = to_bytes(&PtObject::Tensor(t)).unwrap();
        // Corrupt the pickle's protocol number: still a zip, the pickle is refused or the
        // CRC check fails; either way an error, never a panic.
        let pos = bytes.windows(2).position(|w| w == [0x80, 2]).unwrap();
        bytes[pos + 1] = 9;
        assert!(read_bytes(&bytes).is_err());
    }

    /// A state dict's pickle with 1–6 random byte edits (bit flips, overwrites, insertions,
    /// deletions, 32-bit ints of 0, −1 or 2³¹−1), and storages cut short: reading the archive
    /// is an error or a result, never a panic.
    fn mutated_pickle(muts: &[(usize, u8, u8)], cut: Option<usize>) -> Result<PtObject> {
        let a = PtTensor::from_f32(vec![3], &[1.0, 2.0, 3.0]).unwrap();
        let b = PtTensor::from_f16(vec![2, 2], &[f16::ONE; 4]).unwrap();
        let mut p = Pickler { out: Vec::new() };
        p.op(0x80);
        p.op(2);
        p.empty_ordered_dict();
        p.op(b'(');
        p.string("a");
        p.tensor(&a, "0");
        p.string("b");
        p.tensor(&b, "1");
        p.op(b'u');
        p.op(b'.');
        let mut pkl = p.out;
        for &(pos, kind, byte) in muts {
            let at = pos % (pkl.len() + 1);
            match kind % 6 {
                0 if at < pkl.len() => pkl[at] ^= 1 << (byte % 8),
                1 if at < pkl.len() => pkl[at] = byte,
                2 => pkl.insert(at, byte),
                3 if at < pkl.len() => {
                    pkl.remove(at);
                }
                4 | 5 => {
                    let v: [u8; 4] = match byte % 3 {
                        0 => [0; 4],
                        1 => [0xFF; 4],
                        _ => 0x7FFF_FFFFu32.to_le_bytes(),
                    };
                    for (k, x) in v.iter().enumerate() {
                        if let Some(slot) = pkl.get_mut(at + k) {
                            *slot = *x;
                        }
                    }
                }
                _ => {}
            }
        }
        let a_bytes = a.bytes();
        let a_data = &a_bytes[..cut.map_or(a_bytes.len(), |c| c % (a_bytes.len() + 1))];
        read_bytes(&archive(&pkl, &[a_data, b.bytes()])?)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 3000, ..Default::default() })]
        #[test]
        fn mutated_pickles_never_panic(
            muts in proptest::collection::vec((0usize..400, 0u8..6, proptest::prelude::any::<u8>()), 1..7),
            cut in proptest::option::of(0usize..64),
        ) {
            let _ = mutated_pickle(&muts, cut);
        }
    }

    /// Containers nested about a million deep (tuples through marks, up to the stack limit;
    /// lists through the memo, with a stack of one) and a list that holds itself: an error (not
    /// a tensor), not a stack overflow or a hang. Before the iterative drop of `Obj`, the
    /// tuples overflowed a test thread's stack and aborted the process.
    #[test]
    fn deeply_nested_pickles_are_refused_without_overflow() {
        let n = MAX_STACK - 4;
        let mut tuples = vec![0x80, 2];
        tuples.extend(std::iter::repeat_n(b'(', n));
        tuples.push(b')');
        tuples.extend(std::iter::repeat_n(b't', n));
        tuples.push(b'.');
        assert!(Unpickler::new(&tuples).run().is_ok());
        assert!(matches!(
            read_bytes(&archive(&tuples, &[]).unwrap()),
            Err(PtError::Unexpected(_))
        ));

        let mut lists = vec![0x80, 2, b']', b'q', 0];
        for _ in 0..1_000_000 {
            // [new, memo[0]] → new holds the previous list; memo[0] = new; pop.
            lists.extend_from_slice(&[b']', b'h', 0, b'a', b'q', 0, b'0']);
        }
        lists.extend_from_slice(&[b'h', 0, b'.']);
        assert!(matches!(
            read_bytes(&archive(&lists, &[]).unwrap()),
            Err(PtError::Unexpected(_))
        ));

        let itself = [0x80, 2, b']', b'q', 0, b'h', 0, b'a', b'.'];
        assert!(matches!(
            read_bytes(&archive(&itself, &[]).unwrap()),
            Err(PtError::Unexpected(_))
        ));
    }

    /// Tuples memoized and nested twice per step (`t = (t, t)`, 64 steps: 2⁶⁴ leaves if each
    /// reference were a copy) and a tuple nested a million deep then memoized: Python's pickle
    /// shares such values, and so must this reader (a copy per memo use was exponential in
    /// memory, and a recursive copy of the deep tuple overflowed the stack).
    #[test]
    fn shared_and_deep_tuples_are_not_copied() {
        let mut doubling = vec![0x80, 2, b')', b'q', 0];
        for _ in 0..64 {
            // (memo[0], memo[0]) → memo[0]; the previous one popped.
            doubling.extend_from_slice(&[b'h', 0, b'h', 0, 0x86, b'q', 0, b'0']);
        }
        doubling.push(b'.');
        assert!(Unpickler::new(&doubling).run().is_ok());

        let n = MAX_STACK - 4;
        let mut deep = vec![0x80, 2];
        deep.extend(std::iter::repeat_n(b'(', n));
        deep.push(b')');
        deep.extend(std::iter::repeat_n(b't', n));
        deep.extend_from_slice(&[b'q', 0, b'h', 0, b'.']);
        assert!(Unpickler::new(&deep).run().is_ok());
    }

    #[test]
    fn unmutated_pickle_reads() {
        let PtObject::Dict(d) = mutated_pickle(&[], None).unwrap() else {
            panic!("expected a dictionary");
        };
        assert_eq!(d.len(), 2);
        assert_eq!(d[1].1.shape(), &[2, 2]);
        assert!(
            mutated_pickle(&[], Some(5)).is_err(),
            "a short storage is refused"
        );
    }

    #[test]
    fn truncated_pickles_never_panic() {
        let t = PtTensor::from_f32(vec![2], &[1.0, 2.0]).unwrap();
        let mut p = Pickler { out: Vec::new() };
        p.op(0x80);
        p.op(2);
        p.tensor(&t, "0");
        p.op(b'.');
        for n in 0..p.out.len() {
            assert!(Unpickler::new(&p.out[..n]).run().is_err());
        }
        assert!(Unpickler::new(&p.out).run().is_ok());
    }
}
