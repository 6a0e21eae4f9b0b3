//! The simulated device's memory: every matrix, hot slice, buffer and KV store a separate
//! allocation held against the budget, and the checked views the interpreter reads and writes.

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ffn::FfnAct;
use powerinfer_kernels_cpu::ops::kv::KvBuf;
use powerinfer_kernels_cpu::Weights;
use powerinfer_kernels_cuda::{MemoryBudget, Reservation};

use crate::device::{entry_mut, BufId, HotId, KvRows, KvShape, MatId, Span};
use crate::error::{EngineError, Result};

/// A matrix in device memory.
pub(super) struct DevMat {
    pub(super) ty: GgmlType,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) bytes: Vec<u8>,
    pub(super) _held: Reservation,
}

impl DevMat {
    pub(super) fn view(&self) -> Result<Weights<'_>> {
        Ok(Weights::new(self.ty, self.rows, self.cols, &self.bytes)?)
    }
}

/// A layer's hot neuron rows in device memory, in bucket order.
pub(super) struct DevHot {
    pub(super) gate: Option<DevMat>,
    pub(super) up: DevMat,
    pub(super) down: DevMat,
    pub(super) bucket: Vec<u32>,
    /// Per slot, whether the device computes it (`None`: every slot).
    pub(super) enabled: Option<Vec<bool>>,
    pub(super) up_bias: Option<Vec<f32>>,
    pub(super) act: FfnAct,
    pub(super) _held: Reservation,
}

/// One sequence's K and V rows, per layer, in the store's types (charged at `positions`
/// rows from the start, as a GPU allocates them).
pub(super) struct DevKv {
    pub(super) positions: usize,
    pub(super) k: Vec<KvBuf>,
    pub(super) v: Vec<KvBuf>,
    pub(super) _held: Reservation,
}

/// The mirror of one sequence's first KV rows, per layer (the attention split's share).
pub(super) struct Mirror {
    pub(super) kv: DevKv,
}

/// A buffer in device memory.
pub(super) struct DevBuf {
    pub(super) data: Vec<f32>,
    pub(super) _held: Reservation,
}

/// The device's memory: what was uploaded and allocated.
#[derive(Default)]
pub(super) struct Memory {
    pub(super) mats: Vec<DevMat>,
    /// `None`: freed.
    pub(super) hots: Vec<Option<DevHot>>,
    pub(super) bufs: Vec<DevBuf>,
    pub(super) kvs: Vec<DevKv>,
    pub(super) mirror: Option<Mirror>,
}

/// Neurons' rows staged in host memory for a copy into a hot slice.
pub(super) struct NewRows {
    pub(super) neurons: Vec<u32>,
    pub(super) gate: Option<Vec<u8>>,
    pub(super) up: Vec<u8>,
    pub(super) down: Vec<u8>,
    pub(super) up_bias: Option<Vec<f32>>,
}

/// Bytes a buffer of `n` values of `T` holds.
pub(super) fn bytes_of<T>(n: usize) -> u64 {
    (n * std::mem::size_of::<T>()) as u64
}

pub(super) fn budget_error(e: powerinfer_kernels_cuda::BudgetError) -> EngineError {
    EngineError::DeviceMemory {
        requested: e.requested,
        used: e.used,
        limit: e.limit,
    }
}

/// A store of `shape`, its bytes held against `budget`.
pub(super) fn new_kv(budget: &MemoryBudget, shape: KvShape) -> Result<DevKv> {
    let held = budget.try_reserve(shape.bytes()).map_err(budget_error)?;
    let buf = |ty| {
        KvBuf::new(ty, shape.n_kv_head, shape.head_dim)
            .map_err(|e| EngineError::Device(format!("KV store: {e}")))
    };
    Ok(DevKv {
        positions: shape.positions,
        k: (0..shape.layers)
            .map(|_| buf(shape.types.0))
            .collect::<Result<_>>()?,
        v: (0..shape.layers)
            .map(|_| buf(shape.types.1))
            .collect::<Result<_>>()?,
        _held: held,
    })
}

pub(super) fn mat(mats: &[DevMat], id: MatId) -> Result<&DevMat> {
    mats.get(id.0)
        .ok_or_else(|| EngineError::Device(format!("unknown device matrix {}", id.0)))
}

pub(super) fn hot_mut(mem: &mut Memory, hot: HotId) -> Result<&mut DevHot> {
    entry_mut(&mut mem.hots, hot.0, "hot slice")
}

pub(super) fn buf(bufs: &[DevBuf], id: BufId) -> Result<&[f32]> {
    bufs.get(id.0)
        .map(|b| b.data.as_slice())
        .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", id.0)))
}

pub(super) fn bad_span(s: Span, len: usize) -> EngineError {
    EngineError::Device(format!(
        "values {}..{} of buffer {} of {len}",
        s.off,
        s.off + s.len,
        s.buf.0
    ))
}

pub(super) fn span(bufs: &[DevBuf], s: Span) -> Result<&[f32]> {
    let b = buf(bufs, s.buf)?;
    b.get(s.off..s.off + s.len)
        .ok_or_else(|| bad_span(s, b.len()))
}

pub(super) fn span_vec(bufs: &mut [DevBuf], s: Span) -> Result<&mut Vec<f32>> {
    bufs.get_mut(s.buf.0)
        .map(|b| &mut b.data)
        .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", s.buf.0)))
}

pub(super) fn span_mut(bufs: &mut [DevBuf], s: Span) -> Result<&mut [f32]> {
    let b = span_vec(bufs, s)?;
    let len = b.len();
    b.get_mut(s.off..s.off + s.len)
        .ok_or_else(|| bad_span(s, len))
}

/// The inputs `ins` and the output `out` of an operation, borrowed together: inputs in other
/// buffers than the output are borrowed, those in the output's buffer must not overlap it.
pub(super) fn io<'b>(
    bufs: &'b mut [DevBuf],
    ins: &[Span],
    out: Span,
) -> Result<(Vec<&'b [f32]>, &'b mut [f32])> {
    if out.buf.0 >= bufs.len() {
        return Err(EngineError::Device(format!(
            "unknown device buffer {}",
            out.buf.0
        )));
    }
    for s in ins {
        if s.buf == out.buf && s.off < out.off + out.len && out.off < s.off + s.len {
            return Err(EngineError::Device(
                "an operation reads the values it writes".into(),
            ));
        }
    }
    // Split the table around the output's buffer.
    let (before, rest) = bufs.split_at_mut(out.buf.0);
    let (target, after) = rest.split_first_mut().expect("index checked above");
    let tlen = target.data.len();
    if out.off + out.len > tlen {
        return Err(bad_span(out, tlen));
    }
    // Inputs in the output's buffer lie outside the output span.
    let (lo, hi_all) = target.data.split_at_mut(out.off);
    let (o, hi) = hi_all.split_at_mut(out.len);
    let mut got = Vec::with_capacity(ins.len());
    for s in ins {
        let slice: &[f32] = if s.buf == out.buf {
            if s.off + s.len <= out.off {
                &lo[s.off..s.off + s.len]
            } else {
                let start = s.off - (out.off + out.len);
                hi.get(start..start + s.len)
                    .ok_or_else(|| bad_span(*s, tlen))?
            }
        } else if s.buf.0 < out.buf.0 {
            let b = &before[s.buf.0].data;
            b.get(s.off..s.off + s.len)
                .ok_or_else(|| bad_span(*s, b.len()))?
        } else {
            let i = s.buf.0 - out.buf.0 - 1;
            let b = &after
                .get(i)
                .ok_or_else(|| EngineError::Device(format!("unknown device buffer {}", s.buf.0)))?
                .data;
            b.get(s.off..s.off + s.len)
                .ok_or_else(|| bad_span(*s, b.len()))?
        };
        got.push(slice);
    }
    Ok((got, o))
}

/// The layer's two buffers of `kv`, ready to take rows from position `from` on: rows past it
/// are dropped (what a rolled-back evaluation left), a gap before it is an error.
fn rows_from(
    kv: &mut DevKv,
    layer: usize,
    from: usize,
    rows: usize,
) -> Result<(&mut KvBuf, &mut KvBuf)> {
    let (positions, layers) = (kv.positions, kv.k.len());
    let (Some(k), Some(v)) = (kv.k.get_mut(layer), kv.v.get_mut(layer)) else {
        return Err(EngineError::Device(format!(
            "KV rows of layer {layer} outside the store ({layers} layers)"
        )));
    };
    if from + rows > positions || from > k.len() {
        return Err(EngineError::Device(format!(
            "KV rows {from}..{} of layer {layer}: the store holds {} of {positions} positions",
            from + rows,
            k.len()
        )));
    }
    k.truncate(from);
    v.truncate(from);
    Ok((k, v))
}

/// Stores rows (the canonical bytes of the store's types) in layer `layer` of `kv` from
/// position `from`.
pub(super) fn put_rows(
    kv: &mut DevKv,
    layer: usize,
    from: usize,
    k: &[u8],
    v: &[u8],
) -> Result<()> {
    let rb = (
        kv.k.first().map(KvBuf::row_bytes),
        kv.v.first().map(KvBuf::row_bytes),
    );
    let rows = match rb {
        (Some(a), Some(b)) if a > 0 && k.len() % a == 0 && v.len() == k.len() / a * b => {
            k.len() / a
        }
        _ => {
            return Err(EngineError::Device(format!(
                "KV rows of {} and {} bytes for the store's rows",
                k.len(),
                v.len()
            )))
        }
    };
    let (kb, vb) = rows_from(kv, layer, from, rows)?;
    kb.push_bytes(k).map_err(kv_error)?;
    vb.push_bytes(v).map_err(kv_error)
}

/// Stores rows given in f32 (converted to the store's types, as the host's cache converts
/// them) in layer `layer` of `kv` from position `from`.
pub(super) fn put_rows_f32(
    kv: &mut DevKv,
    layer: usize,
    from: usize,
    k: &[f32],
    v: &[f32],
) -> Result<()> {
    let row = kv.k.first().map_or(0, KvBuf::row_values);
    if row == 0 || k.len() % row != 0 || v.len() != k.len() {
        return Err(EngineError::Device(format!(
            "KV rows of {} and {} values for rows of {row}",
            k.len(),
            v.len()
        )));
    }
    let (kb, vb) = rows_from(kv, layer, from, k.len() / row)?;
    kb.push_f32(k).map_err(kv_error)?;
    vb.push_f32(v).map_err(kv_error)
}

/// Rows `from .. from + n` of layer `layer` of `kv`, in the canonical bytes of its types.
pub(super) fn take_rows(kv: &DevKv, layer: usize, from: usize, n: usize) -> Result<KvRows> {
    let (Some(k), Some(v)) = (kv.k.get(layer), kv.v.get(layer)) else {
        return Err(EngineError::Device(format!(
            "KV rows of layer {layer} outside the store ({} layers)",
            kv.k.len()
        )));
    };
    Ok((
        k.rows_bytes(from, n).map_err(kv_error)?,
        v.rows_bytes(from, n).map_err(kv_error)?,
    ))
}

fn kv_error(e: powerinfer_kernels_cpu::KernelError) -> EngineError {
    EngineError::Device(format!("KV store: {e}"))
}
