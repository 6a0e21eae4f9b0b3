//! The operations of a device program and the ids of what they read and write.

use powerinfer_kernels_cpu::ffn::FfnAct;
use powerinfer_kernels_cpu::ops::attention::AttentionParams;
use powerinfer_kernels_cpu::ops::rope::RopeParams;

use crate::error::{EngineError, Result};

/// What a device's program reads and writes: f32 values `off .. off + len` of buffer `buf`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    /// The buffer.
    pub(crate) buf: BufId,
    /// First value.
    pub(crate) off: usize,
    /// Values.
    pub(crate) len: usize,
}

impl Span {
    /// Whether `n` host values fit this span exactly (a write of `n` values into it).
    pub(crate) fn check_write(self, n: usize) -> Result<()> {
        if n == self.len {
            Ok(())
        } else {
            Err(EngineError::Device(format!(
                "a write of {n} values into a span of {}",
                self.len
            )))
        }
    }

    /// Values `off .. off + len` of this span (`off + len` must not exceed its length; the
    /// device checks every span against its buffer).
    pub(crate) fn part(self, off: usize, len: usize) -> Span {
        Span {
            buf: self.buf,
            off: self.off + off,
            len,
        }
    }
}

/// A weight matrix held by a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct MatId(pub(crate) usize);

/// A layer's hot FFN slice held by a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct HotId(pub(crate) usize);

/// An f32 buffer in device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BufId(pub(crate) usize);

impl BufId {
    /// Values `off .. off + len` of the buffer.
    pub(crate) fn span(self, off: usize, len: usize) -> Span {
        Span {
            buf: self,
            off,
            len,
        }
    }
}

/// One sequence's keys and values in device memory, for some layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct KvId(pub(crate) usize);

/// Which rows of a table [`Op::GetRows`] takes, from the step's parameters
/// ([`Device::set_step`](super::Device::set_step)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowsOf {
    /// The tokens' ids.
    Ids,
    /// The tokens' positions plus an offset (OPT's learned position embeddings).
    Positions(usize),
}

/// One operation of a device program. Each runs after the ones queued before it, on the
/// device's buffers; none returns anything to the host. Token ranges (`from`, `n`) index the
/// tokens of the step's parameters ([`Device::set_step`](super::Device::set_step)).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Op {
    /// `y = W x` for `t` tokens (`x`: `t × cols`, `y`: `t × rows`).
    MatMul {
        m: MatId,
        x: Span,
        y: Span,
        t: usize,
    },
    /// Rows of a held matrix as f32 (`y`: `n × cols`), one per token `from .. from + n`.
    GetRows {
        m: MatId,
        rows: RowsOf,
        from: usize,
        n: usize,
        y: Span,
    },
    /// RMSNorm (no bias) or LayerNorm (with bias) of the rows of `x` into `y`; `w` (and `b`)
    /// of the rows' width. With `add`, first `x += add` (the residual add before a norm, in the
    /// same launch), written back to `x`.
    Norm {
        x: Span,
        add: Option<Span>,
        w: BufId,
        b: Option<BufId>,
        eps: f32,
        y: Span,
    },
    /// Adds `b` to every row of `y` (a bias; rows of `b`'s width).
    AddRows { y: Span, b: BufId },
    /// `y += x`.
    Add { y: Span, x: Span },
    /// `y = x`.
    Copy { x: Span, y: Span },
    /// `y = 0`.
    Zero { y: Span },
    /// RoPE in place ([`RopeOp`]).
    Rope(RopeOp),
    /// K and V rows stored in a KV store, then causal attention over it ([`AttentionOp`]).
    Attention(AttentionOp),
    /// Predictor scores ([`PredictorOp`]).
    Predictor(PredictorOp),
    /// The hot part of a sparse FFN ([`HotFfnOp`]).
    HotFfn(HotFfnOp),
    /// `gate = act(gate, up)` element-wise (a dense FFN's activation; `Relu` reads no `up`).
    Activate { act: FfnAct, gate: Span, up: Span },
    /// Records the time the stream reaches this point in mark `slot` ([`Device::elapsed`](super::Device::elapsed)).
    Mark { slot: usize },
}

/// [`Op::Rope`]: RoPE in place, in one launch, over the step's first `n` tokens of Q
/// (`n_head` heads of `head_dim`, `n` = `q.len / (n_head · head_dim)`) and of K (`n_head_kv`
/// heads) at their positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RopeOp {
    pub(crate) q: Span,
    pub(crate) k: Span,
    pub(crate) n_head: usize,
    pub(crate) n_head_kv: usize,
    pub(crate) head_dim: usize,
    pub(crate) params: RopeParams,
}

/// [`Op::Predictor`]: predictor scores `fc2 · ReLU(fc1 · x)` of `t` tokens (`hidden`:
/// `t × rank` scratch).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PredictorOp {
    pub(crate) fc1: MatId,
    pub(crate) fc2: MatId,
    pub(crate) x: Span,
    pub(crate) hidden: Span,
    pub(crate) scores: Span,
    pub(crate) t: usize,
}

/// [`Op::Attention`]: K and V of the step's tokens `at .. at + n` stored at their positions
/// (the step's, [`Device::set_step`](super::Device::set_step)) of layer `layer` of `kv`, then causal attention of their
/// queries `q` into `out`: token `i` sees positions `0 ..= position(i)`. The positions are not
/// part of the op, so a decode step's program is the same for every token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttentionOp {
    pub(crate) kv: KvId,
    pub(crate) layer: usize,
    pub(crate) k: Span,
    pub(crate) v: Span,
    pub(crate) q: Span,
    pub(crate) out: Span,
    pub(crate) at: usize,
    pub(crate) n: usize,
    pub(crate) params: AttentionParams,
}

/// [`Op::HotFfn`]: the hot part of a sparse FFN for `t` tokens: the sum over the slice's
/// enabled neurons with `score ≥ threshold` of `act(gate·x, up·x (+ bias)) · down` is written
/// to `y` (`t × n_embd`), or added to it with `accumulate` (the FFN's residual add, no zeroing
/// first); `count` (`t` values), if given, gets how many neurons each token computed: written,
/// or, for one token of a gated FFN, added to it (the fused products count while they run; the
/// caller zeroes the counts first, one [`Op::Zero`] for every layer's counts of a step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct HotFfnOp {
    pub(crate) hot: HotId,
    pub(crate) x: Span,
    pub(crate) scores: Span,
    pub(crate) threshold: f32,
    pub(crate) t: usize,
    pub(crate) y: Span,
    pub(crate) accumulate: bool,
    pub(crate) count: Option<Span>,
}
