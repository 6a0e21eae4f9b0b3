//! Attention over a KV cache of any [`KvType`]: [`attention_kv`] takes the two caches as
//! [`KvView`]s. Two F16 caches take the F16 kernel of [`super::attention`]; any other type
//! (for K, V or both) this path:
//!
//! - the scores: each K head row of a head-major cache is a row of blocks, multiplied with the
//!   query head prepared once in the format the type's matrix kernels read (quantized to Q8_0
//!   blocks for Q8_0 and Q4_0: the dot products run on integers, as the quantized matrix
//!   products do; f32 for F32 and BF16) by those same row kernels (four rows at a time where
//!   the backend has such a kernel); an F16 K cache (row-major) as the F16 kernel computes a
//!   score;
//! - the softmax in f32, as the F16 kernel;
//! - the output: each V head row added, weighted, by the type's axpy row kernel (the blocks
//!   decoded as they are added), then divided by the sum.
//!
//! On x86-64 with AVX2, Q8_0 and Q4_0 caches take their own kernels (`x86_kv`): the scores with
//! eight positions per vector (the rows' blocks transposed in registers, the products in the
//! integer domain against the same Q8_0 query blocks), the output (also over an F16 V beside a
//! quantized K) with the values of up to four heads in registers over all positions.
//!
//! Work items are (token, kv head), each computing the group's query heads, spread over the
//! pool's threads as the F16 kernel spreads its items; results do not depend on the thread
//! count. The definition is [`crate::reference::ops::attention_kv`].

use std::cell::RefCell;
use std::sync::Mutex;

use half::f16;

use super::attention::{attention_block_isa, axpy_tile, dot_f32, dot_f32_f16, AttentionParams};
use super::check_len;
use super::isa::Isa;
use super::kv::{KvType, KvView};
use super::softmax::{exp_sub_sum_with, max_with, scale_in_place};
use crate::matmul::act::ActBuf;
use crate::matmul::rowops::RowOps;
use crate::matmul::table::row_ops;
use crate::{Backend, KernelError, ThreadPool};

/// Causal attention of a block of `n_tokens` new tokens whose K/V rows are the last
/// `n_tokens` rows of the caches `k` and `v` (any [`KvType`] each): token `t` (queries
/// `q[t · n_head · head_dim ..]`) attends to positions `0..=p0 + t`, `p0 = n_pos − n_tokens`.
/// As [`super::attention::attention_block`] for two F16 caches.
///
/// Errors: invalid `params`; `q` or `out` not `n_tokens · n_head · head_dim`; caches of
/// different lengths, not whole rows, or of heads a type's blocks do not divide;
/// `n_tokens > n_pos`.
#[allow(clippy::too_many_arguments)]
pub fn attention_kv(
    pool: &ThreadPool,
    q: &[f32],
    k: KvView<'_>,
    v: KvView<'_>,
    n_tokens: usize,
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_kv_with(Backend::detect(), pool, q, k, v, n_tokens, params, out)
}

/// [`attention_kv`] on an explicit backend (errors if this CPU cannot run it).
#[allow(clippy::too_many_arguments)]
pub fn attention_kv_with(
    backend: Backend,
    pool: &ThreadPool,
    q: &[f32],
    k: KvView<'_>,
    v: KvView<'_>,
    n_tokens: usize,
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let isa = Isa::new(backend)?;
    if let (KvView::F16(kh), KvView::F16(vh)) = (k, v) {
        return attention_block_isa(isa, pool, q, kh, vh, n_tokens, params, out);
    }
    params.validate()?;
    let (q_len, d) = (params.q_len(), params.head_dim);
    let block_len = n_tokens
        .checked_mul(q_len)
        .ok_or_else(|| KernelError::Shape("attention: n_tokens · q_len overflows".into()))?;
    check_len("attention: q", block_len, q.len())?;
    check_len("attention: out", block_len, out.len())?;
    let k = Cache::new(k, backend, params)?;
    let v = Cache::new(v, backend, params)?;
    let n_pos = k.n_pos;
    check_len("attention: V rows", n_pos, v.n_pos)?;
    if n_tokens > n_pos {
        return Err(KernelError::Shape(format!(
            "attention: {n_tokens} new tokens but only {n_pos} cache rows"
        )));
    }
    if n_tokens == 0 {
        return Ok(());
    }
    let group = params.n_head / params.n_kv_head;
    let p0 = n_pos - n_tokens;
    let n_items = n_tokens * params.n_kv_head;
    // Item i: token i / n_kv_head, kv head i % n_kv_head: output chunk i (the group's heads).
    let chunks: Vec<Mutex<&mut [f32]>> = out.chunks_exact_mut(group * d).map(Mutex::new).collect();
    let run = |first: usize| {
        SCRATCH.with(|sc| {
            let mut s = sc.borrow_mut();
            for i in (first..n_items).step_by(pool.n_threads()) {
                let (t, g) = (i / params.n_kv_head, i % params.n_kv_head);
                let q_item = &q[t * q_len + g * group * d..][..group * d];
                let mut o = chunks[i].lock().unwrap_or_else(|e| e.into_inner());
                let at = (g, p0 + t + 1, d);
                attend(isa, &k, &v, at, q_item, params.scale, &mut o, &mut s);
            }
        })
    };
    if pool.n_threads() == 1 {
        run(0);
    } else {
        pool.run(run);
    }
    Ok(())
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Per-thread buffers.
#[derive(Default)]
struct Scratch {
    /// One query head's scores, then weights.
    scores: Vec<f32>,
    /// One output head while it is accumulated.
    acc: Vec<f32>,
    /// An F16 head row widened (scalar path); decoded V rows.
    row: Vec<f32>,
    /// The query heads quantized to Q8_0 blocks for the VNNI kernels: values, scales, sums.
    qq: Vec<i8>,
    qd: Vec<f32>,
    qsum: Vec<i32>,
}

/// The x86 KV kernels' name for `ty` where `isa` runs them (AVX2; Q8_0 and Q4_0).
#[cfg(target_arch = "x86_64")]
fn x86_blocks(isa: Isa, ty: KvType) -> Option<super::x86_kv::Blocks> {
    use super::x86_kv::Blocks;
    match ty {
        KvType::Q8_0 if isa.is_avx2() => Some(Blocks::Q8_0),
        KvType::Q4_0 if isa.is_avx2() => Some(Blocks::Q4_0),
        _ => None,
    }
}

/// One cache as this path reads it.
enum Side<'a> {
    /// Row-major f16 rows of `kv_row` values.
    F16 { rows: &'a [f16], kv_row: usize },
    /// Head-major rows of blocks of `ty`, read by `ops`.
    Heads {
        ty: KvType,
        ops: RowOps,
        data: &'a [u8],
        head_stride: usize,
        head_bytes: usize,
    },
}

/// A cache and its length.
struct Cache<'a> {
    side: Side<'a>,
    n_pos: usize,
}

impl<'a> std::ops::Deref for Cache<'a> {
    type Target = Side<'a>;

    fn deref(&self) -> &Side<'a> {
        &self.side
    }
}

impl<'a> Cache<'a> {
    /// `view` checked against `params`, with the row kernels of its type on `backend`.
    fn new(
        view: KvView<'a>,
        backend: Backend,
        params: &AttentionParams,
    ) -> Result<Cache<'a>, KernelError> {
        let (kv_row, d) = (params.kv_row_len(), params.head_dim);
        match view {
            KvView::F16(rows) => {
                if rows.len() % kv_row != 0 {
                    return Err(KernelError::Shape(format!(
                        "attention: cache length {} is not a whole number of rows of {kv_row}",
                        rows.len()
                    )));
                }
                Ok(Cache {
                    n_pos: rows.len() / kv_row,
                    side: Side::F16 { rows, kv_row },
                })
            }
            KvView::Heads {
                ty,
                data,
                head_stride,
                n_pos,
            } => {
                ty.check_head(d)?;
                let head_bytes = ty.bytes_of(d);
                let need = (params.n_kv_head - 1) * head_stride + n_pos * head_bytes;
                if n_pos > 0 && (data.len() < need || head_stride < n_pos * head_bytes) {
                    return Err(KernelError::Shape(format!(
                        "attention: {} bytes of {ty} rows for {n_pos} positions of {} heads",
                        data.len(),
                        params.n_kv_head
                    )));
                }
                let ops = row_ops(ty.ggml(), backend).ok_or_else(|| {
                    KernelError::Shape(format!("attention: no kernels for a {ty} cache"))
                })?;
                Ok(Cache {
                    n_pos,
                    side: Side::Heads {
                        ty,
                        ops,
                        data,
                        head_stride,
                        head_bytes,
                    },
                })
            }
        }
    }
}

/// The scores `scale · (q_h · K[p])` of the group's query heads `q` (heads of `d` values)
/// over the first `n` positions of kv head `g`, into `out` (`[head][position]`). Each K row is
/// read once for all the heads: four heads at a time through the type's one-row,
/// four-activation kernel (the matrix products' batch kernel), the rest one at a time.
fn scores(isa: Isa, k: &Side<'_>, g: usize, q: &[f32], d: usize, n: usize, s: &mut Scratch) {
    let heads = q.len() / d;
    let out = &mut s.scores;
    out.clear();
    out.resize(heads * n, 0.0);
    match *k {
        Side::F16 { rows, kv_row } => {
            for p in 0..n {
                let kh = &rows[p * kv_row + g * d..][..d];
                if isa.is_avx2() {
                    for (h, qh) in q.chunks_exact(d).enumerate() {
                        out[h * n + p] = dot_f32_f16(isa, qh, kh);
                    }
                } else {
                    s.row.resize(d, 0.0);
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(kh, &mut s.row);
                    for (h, qh) in q.chunks_exact(d).enumerate() {
                        out[h * n + p] = dot_f32(qh, &s.row);
                    }
                }
            }
        }
        Side::Heads {
            ty,
            ops,
            data,
            head_stride,
            head_bytes,
        } => {
            #[cfg(target_arch = "x86_64")]
            if let Some(blocks) = x86_blocks(isa, ty) {
                let Scratch {
                    qq,
                    qd,
                    qsum,
                    scores,
                    ..
                } = s;
                qq.resize(q.len(), 0);
                qd.resize(q.len() / 32, 0.0);
                crate::matmul::act::quantize_q8(q, qq, qd, None);
                qsum.clear();
                qsum.extend(
                    qq.chunks_exact(32)
                        .map(|b| b.iter().map(|&x| i32::from(x)).sum::<i32>()),
                );
                let query = super::x86_kv::QueryBlocks {
                    q: qq,
                    d: qd,
                    sum: qsum,
                };
                let head = &data[g * head_stride..][..n * head_bytes];
                // SAFETY: `x86_blocks` answers only for an AVX2 path (AVX2, FMA, F16C); the
                // kernel asserts the lengths it relies on.
                unsafe { super::x86_kv::scores(blocks, head, head_bytes, n, &query, d, scores) };
                return;
            }
            // The queries prepared once, in the format the type's kernels read.
            let prepared = ActBuf::new(ops.act, q, d);
            let head = &data[g * head_stride..][..n * head_bytes];
            if let Some(range) = ops.dot_range {
                // Each head over the head's rows: the dense product's own kernel (the rows,
                // a few hundred KB, stay in the core's cache from one head to the next).
                for h in 0..heads {
                    range(
                        head,
                        head_bytes,
                        0..n,
                        &prepared.get(h),
                        &mut out[h * n..][..n],
                    );
                }
                return;
            }
            let r = |p: usize| &head[p * head_bytes..][..head_bytes];
            let quads = heads / 4 * 4;
            let acts: Vec<_> = (0..heads).map(|h| prepared.get(h)).collect();
            let mut four = [0f32; 4];
            for p in 0..n {
                let row = r(p);
                for h0 in (0..quads).step_by(4) {
                    let a = [acts[h0], acts[h0 + 1], acts[h0 + 2], acts[h0 + 3]];
                    (ops.dot4)(row, &a, &mut four);
                    for (j, &v) in four.iter().enumerate() {
                        out[(h0 + j) * n + p] = v;
                    }
                }
                for (h, a) in acts.iter().enumerate().skip(quads) {
                    out[h * n + p] = (ops.dot_batch)(row, a);
                }
            }
        }
    }
}

/// `acc_h += Σ_p w_h[p] · V[p]` for each of the group's heads (`w`: `[head][position]`,
/// `acc`: `[head][value]`), kv head `g`. V rows are decoded to f32 eight at a time (the
/// type's axpy with weight 1 into a zeroed tile) and the tile added to every head, as the F16
/// kernel adds its widened tiles.
fn accumulate(isa: Isa, v: &Side<'_>, g: usize, d: usize, s: &mut Scratch) {
    let heads = s.acc.len() / d;
    let n = s.scores.len() / heads.max(1);
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        use super::x86_kv::ValueRows;
        let fast = match *v {
            Side::F16 { rows, kv_row } if d % 16 == 0 => {
                let bytes: &[u8] = bytemuck::cast_slice(rows);
                Some((ValueRows::F16, &bytes[2 * g * d..], 2 * kv_row))
            }
            Side::Heads {
                ty,
                data,
                head_stride,
                head_bytes,
                ..
            } => x86_blocks(isa, ty).map(|b| {
                let head = &data[g * head_stride..][..n * head_bytes];
                (ValueRows::Blocks(b), head, head_bytes)
            }),
            _ => None,
        };
        if let Some((rows, data, stride)) = fast {
            // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA,
            // F16C); the kernel asserts the lengths it relies on.
            unsafe { super::x86_kv::accumulate(rows, data, stride, n, &s.scores, d, &mut s.acc) };
            return;
        }
    }
    let Scratch {
        scores, acc, row, ..
    } = s;
    row.resize(TILE * d, 0.0);
    for p0 in (0..n).step_by(TILE) {
        let np = (n - p0).min(TILE);
        let tile = &mut row[..np * d];
        match *v {
            Side::F16 { rows, kv_row } => {
                for (j, t) in tile.chunks_exact_mut(d).enumerate() {
                    let vh = &rows[(p0 + j) * kv_row + g * d..][..d];
                    half::slice::HalfFloatSliceExt::convert_to_f32_slice(vh, t);
                }
            }
            Side::Heads {
                ops,
                data,
                head_stride,
                head_bytes,
                ..
            } => {
                tile.fill(0.0);
                let head = &data[g * head_stride + p0 * head_bytes..];
                for (j, t) in tile.chunks_exact_mut(d).enumerate() {
                    (ops.axpy)(&head[j * head_bytes..][..head_bytes], 1.0, t);
                }
            }
        }
        for (h, oh) in acc.chunks_exact_mut(d).enumerate() {
            axpy_tile(isa, oh, &scores[h * n + p0..][..np], tile);
        }
    }
}

/// V rows decoded and added at a time.
const TILE: usize = 8;

/// The attention of the group's query heads `q` (of kv head `g`, heads of `d` values) over the
/// first `n` positions into `out`.
#[allow(clippy::too_many_arguments)]
fn attend(
    isa: Isa,
    k: &Side<'_>,
    v: &Side<'_>,
    (g, n, d): (usize, usize, usize),
    q: &[f32],
    scale: f32,
    out: &mut [f32],
    s: &mut Scratch,
) {
    let heads = q.len() / d;
    scores(isa, k, g, q, d, n, s);
    let mut inv = vec![0f32; heads];
    for (h, inv_h) in inv.iter_mut().enumerate() {
        let sc = &mut s.scores[h * n..][..n];
        for x in sc.iter_mut() {
            *x *= scale;
        }
        let m = max_with(isa, sc);
        if m == f32::NEG_INFINITY {
            sc.fill(0.0);
        } else {
            *inv_h = (1.0 / exp_sub_sum_with(isa, sc, m)) as f32;
        }
    }
    s.acc.clear();
    s.acc.resize(heads * d, 0.0);
    accumulate(isa, v, g, d, s);
    for (h, oh) in s.acc.chunks_exact_mut(d).enumerate() {
        scale_in_place(isa, oh, inv[h]);
    }
    out.copy_from_slice(&s.acc);
}

/// Bytes an attention reads of caches of `ty_k` and `ty_v` holding `n_pos` rows of `kv_row`
/// values each.
pub fn kv_bytes_read(ty_k: KvType, ty_v: KvType, n_pos: usize, kv_row: usize) -> usize {
    n_pos * (ty_k.bytes_of(kv_row) + ty_v.bytes_of(kv_row))
}
