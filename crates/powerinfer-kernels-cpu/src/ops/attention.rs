//! Scaled dot-product attention of new tokens over an F16 KV cache, with grouped-query heads.
//!
//! # KV cache layout
//! One layer's K cache and V cache are each a row-major `f16` array `[n_pos][n_kv_head][head_dim]`:
//! row `p` (the key or value of the token at position `p`) is `n_kv_head · head_dim` contiguous
//! values, head after head. The engine appends one row per token (K after RoPE), and passes the
//! filled prefix `&cache[..n_pos · n_kv_head · head_dim]`; the number of positions attended is
//! taken from that length. V uses the same layout as K (not ggml's transposed V): the weighted
//! sum then adds whole contiguous rows, which vectorises well, and appending a token is one copy.
//!
//! # What is computed
//! For query head `h` (of `n_head`), kv head `h / (n_head / n_kv_head)` (GQA; MHA when equal):
//! `s_p = scale · (q_h · K[p])` in f32 (K widened from f16, q kept in f32), `w = softmax(s)`
//! (max-subtracted, f32 exponentials), `out_h = Σ_p w_p · V[p]` accumulated in f32. The
//! definition is [`crate::reference::ops::attention`].
//!
//! llama.cpp rounds q and the softmax weights to f16 before its F16 matrix products; this kernel
//! keeps them in f32 (closer to the exact result).
//!
//! On AVX-512, grouped queries (several query heads per kv head, `head_dim` a multiple of 16)
//! take the lane path: up to sixteen query rows, (token, head) pairs of one kv head, one per
//! vector lane. Their queries are transposed once; each tile of sixteen positions is widened
//! once for all of them; a score is one FMA chain per lane over the head's values (no
//! horizontal sums); positions past a row's own last are `-inf`; the softmax runs down the
//! lanes; and the V rows are added into four rows at a time, each row over its own positions
//! in order. A row's result thus does not depend on which rows share its item, so a prompt
//! block and token-by-token calls agree bit for bit (measurements: `docs/tuning.md`).
//!
//! The AVX2 path, for grouped queries (several query heads per kv head, `head_dim` a multiple
//! of 8), works on tiles of eight positions: their K head rows are widened to f32 once for all
//! the group's query heads, each head's eight scores come from eight FMA accumulators reduced
//! together, then the tile's V rows are widened once and added with the softmax weights, four
//! independent 8-lane FMA chains at a time (faster than the per-position path; measurements:
//! `docs/tuning.md`). With one query head per kv head (or other
//! head sizes) it computes each `q·k` with FMA over the f16 row (widened by F16C) and adds the
//! weighted V rows four positions at a time. Both add the V rows position after position with
//! the same FMAs (same bits); the scores' sums are grouped differently. The scalar path widens
//! each K/V head row once into an f32 buffer and uses plain f32 loops the compiler can
//! vectorise.
//!
//! # Threads
//! The work is split into items (kv head, part of its query-head group, token), ordered
//! kv-head-major so that the items a thread takes in turn reuse the same K/V columns; a group is
//! split into parts only when there are fewer items than threads. Thread `i` of the
//! [`ThreadPool`] takes items `i, i + n, i + 2n, …`, which spreads the growing cost of later
//! tokens of a causal block evenly. The query heads of one item are processed together so each K
//! and V row is loaded once for all of them; each thread accumulates in its own buffer and copies
//! the finished heads to `out`. Results do not depend on the number of threads (bit for bit).

use std::sync::Mutex;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::check_len;
use super::isa::Isa;
use super::softmax::{exp_sub_sum_with, max_with, scale_in_place};
use crate::{Backend, KernelError, ThreadPool};

/// Shape and scale of an attention.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionParams {
    /// Number of query heads.
    pub n_head: usize,
    /// Number of key/value heads; must divide `n_head`.
    pub n_kv_head: usize,
    /// Size of each head.
    pub head_dim: usize,
    /// Factor applied to `q · k` before the softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
}

impl AttentionParams {
    /// Parameters with the usual scale `1 / sqrt(head_dim)` (computed in f32, as llama.cpp).
    pub fn new(n_head: usize, n_kv_head: usize, head_dim: usize) -> Self {
        AttentionParams {
            n_head,
            n_kv_head,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
        }
    }

    /// Length of one token's queries (and of one output row): `n_head · head_dim`.
    pub fn q_len(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Length of one KV cache row: `n_kv_head · head_dim`.
    pub fn kv_row_len(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    pub(super) fn validate(&self) -> Result<(), KernelError> {
        if self.n_head == 0 || self.n_kv_head == 0 || self.head_dim == 0 {
            return Err(KernelError::Shape(format!(
                "attention: n_head {}, n_kv_head {} and head_dim {} must be positive",
                self.n_head, self.n_kv_head, self.head_dim
            )));
        }
        if self.n_head % self.n_kv_head != 0 {
            return Err(KernelError::Shape(format!(
                "attention: n_kv_head {} does not divide n_head {}",
                self.n_kv_head, self.n_head
            )));
        }
        if self.n_head.checked_mul(self.head_dim).is_none() {
            return Err(KernelError::Shape(
                "attention: n_head · head_dim overflows".into(),
            ));
        }
        Ok(())
    }
}

/// Attention of one new token: `q` holds its `n_head × head_dim` queries, `k` and `v` the first
/// `n_pos` rows of the layer's caches (the token's own row included, see the
/// [module docs](self)), `out` receives `n_head × head_dim` values.
///
/// Errors: invalid `params`, `q.len()` or `out.len()` not `n_head · head_dim`, `k.len()` not a
/// positive multiple of `n_kv_head · head_dim`, or `v.len() != k.len()`.
pub fn attention(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_block_isa(Isa::detect(), pool, q, k, v, 1, params, out)
}

/// [`attention`] on an explicit backend (errors if this CPU cannot run it).
pub fn attention_with(
    backend: Backend,
    pool: &ThreadPool,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_block_isa(Isa::new(backend)?, pool, q, k, v, 1, params, out)
}

/// Causal attention of a block of `n_tokens` new tokens whose K/V rows are the **last**
/// `n_tokens` rows of `k`/`v`: with `n_pos = k.len() / (n_kv_head · head_dim)` and
/// `p0 = n_pos - n_tokens`, token `t` (queries `q[t · n_head · head_dim ..]`) attends to
/// positions `0..=p0 + t`. Equal, bit for bit, to `n_tokens` calls of [`attention`] with the
/// caches cut after each token's row.
///
/// Errors: as [`attention`], with `q.len()` and `out.len()` equal to
/// `n_tokens · n_head · head_dim`, and `n_tokens ≤ n_pos`.
#[allow(clippy::too_many_arguments)]
pub fn attention_block(
    pool: &ThreadPool,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    n_tokens: usize,
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_block_isa(Isa::detect(), pool, q, k, v, n_tokens, params, out)
}

/// [`attention_block`] on an explicit backend (errors if this CPU cannot run it).
#[allow(clippy::too_many_arguments)]
pub fn attention_block_with(
    backend: Backend,
    pool: &ThreadPool,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    n_tokens: usize,
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_block_isa(Isa::new(backend)?, pool, q, k, v, n_tokens, params, out)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn attention_block_isa(
    isa: Isa,
    pool: &ThreadPool,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    n_tokens: usize,
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    params.validate()?;
    let q_len = params.q_len();
    let kv_row = params.kv_row_len();
    let block_len = n_tokens
        .checked_mul(q_len)
        .ok_or_else(|| KernelError::Shape("attention: n_tokens · q_len overflows".into()))?;
    check_len("attention: q", block_len, q.len())?;
    check_len("attention: out", block_len, out.len())?;
    check_len("attention: v", k.len(), v.len())?;
    if k.len() % kv_row != 0 {
        return Err(KernelError::Shape(format!(
            "attention: K cache length {} is not a whole number of rows of {}",
            k.len(),
            kv_row
        )));
    }
    let n_pos = k.len() / kv_row;
    if n_tokens > n_pos {
        return Err(KernelError::Shape(format!(
            "attention: {n_tokens} new tokens but only {n_pos} cache rows"
        )));
    }
    if n_tokens == 0 {
        return Ok(());
    }
    if n_pos == 0 {
        return Err(KernelError::Shape("attention: empty KV cache".into()));
    }

    let d = params.head_dim;
    let group = params.n_head / params.n_kv_head;
    #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
    if isa.is_avx512() && group >= 2 && d % 16 == 0 {
        attention_lanes(isa, pool, q, k, v, n_tokens, params, out);
        return Ok(());
    }
    // Split each query-head group into `parts` so that there are enough items for the threads.
    let n_threads = pool.n_threads();
    let base_items = n_tokens * params.n_kv_head;
    let mut parts = 1;
    while base_items * parts < n_threads && parts < group {
        parts += 1;
        while group % parts != 0 {
            parts += 1;
        }
    }
    let heads_per_item = group / parts;
    // The tiled AVX2 path (`attend_group`) for grouped queries: eight positions' head rows
    // widened once for all the query heads of a group (not once per head), eight scores per
    // reduction. Chosen from the model's group size, not the item's, so that results do not
    // depend on how many threads split a group. With one query head per kv head (MHA) a tile
    // saves nothing (it measured slower); those, and head sizes that are
    // not a multiple of 8, take the per-position path.
    let tiled = group >= 2;
    let item_len = heads_per_item * d;
    let p0 = n_pos - n_tokens;

    // Work items are ordered kv-head-group-major, token-minor, so that consecutive items of a
    // thread reuse the same K/V columns (cache-friendly for prompt blocks). Item `i` covers group
    // part `gi = i / n_tokens` (query heads from `gi · heads_per_item`, all of kv head
    // `gi / parts`) of token `t = i % n_tokens`, i.e. output chunk `t · items_per_token + gi`.
    let items_per_token = params.n_kv_head * parts;
    let n_items = n_tokens * items_per_token;
    let chunk_of = |i: usize| (i % n_tokens) * items_per_token + i / n_tokens;
    let run_item = |i: usize, o: &mut [f32], scratch: &mut Scratch| {
        let t = i % n_tokens;
        let first_head = (i / n_tokens) * heads_per_item;
        let kv_head = first_head / group;
        let q_item = &q[t * q_len + first_head * d..][..item_len];
        attend_group(
            isa,
            q_item,
            k,
            v,
            kv_row,
            kv_head * d,
            d,
            p0 + t + 1,
            params.scale,
            tiled,
            o,
            scratch,
        );
    };

    // Each output chunk is behind its own (uncontended) lock, so threads can write disjoint parts
    // of `out` without unsafe code.
    let chunks: Vec<Mutex<&mut [f32]>> = out.chunks_exact_mut(item_len).map(Mutex::new).collect();
    for_items(pool, n_items, |i, scratch| {
        let mut o = chunks[chunk_of(i)]
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        run_item(i, &mut o, scratch);
    });
    Ok(())
}

/// Runs `f(i, scratch)` for every item `i < n_items` with the running thread's [`Scratch`]:
/// thread `t` of `pool` takes items `t, t + n, t + 2n, …`, which spreads the growing cost of a
/// causal block's later tokens evenly.
fn for_items<F: Fn(usize, &mut Scratch) + Sync>(pool: &ThreadPool, n_items: usize, f: F) {
    let n_threads = pool.n_threads();
    let run = |first: usize| {
        SCRATCH.with(|sc| {
            let mut scratch = sc.borrow_mut();
            for i in (first..n_items).step_by(n_threads) {
                f(i, &mut scratch);
            }
        })
    };
    if n_threads == 1 {
        run(0);
    } else {
        pool.run(run);
    }
}

/// Query rows (one (token, head) each) per item of the AVX-512 lane path: one per lane.
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
const LANES: usize = 16;

/// [`attention_block_isa`] for grouped queries on AVX-512 (`group ≥ 2`, `head_dim` a multiple
/// of 16): the query rows of each kv head, token after token and head after head, are cut into
/// items of up to [`LANES`] rows (fewer where that leaves a thread without one), which
/// [`attend_lanes`] computes together. Every row is computed alike whatever item and thread
/// take it, so results do not depend on the block or the thread count.
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
#[allow(clippy::too_many_arguments)]
fn attention_lanes(
    isa: Isa,
    pool: &ThreadPool,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    n_tokens: usize,
    params: &AttentionParams,
    out: &mut [f32],
) {
    let (d, n_kv) = (params.head_dim, params.n_kv_head);
    let g = params.n_head / n_kv;
    let kv_row = params.kv_row_len();
    let p0 = k.len() / kv_row - n_tokens;
    let rows_kv = n_tokens * g;
    let n_threads = pool.n_threads();
    let mut per_item = LANES;
    while per_item > 1 && n_kv * rows_kv.div_ceil(per_item) < n_threads {
        per_item = per_item.div_ceil(2);
    }
    let per_kv = rows_kv.div_ceil(per_item);
    let n_items = n_kv * per_kv;
    // Output chunk `t · n_kv + kv`: token t's heads of kv head `kv` (`g · d` values). Each is
    // behind its own (nearly uncontended) lock, so threads write disjoint rows without unsafe
    // code.
    let chunks: Vec<Mutex<&mut [f32]>> = out.chunks_exact_mut(g * d).map(Mutex::new).collect();
    let run_item = |i: usize, scratch: &mut Scratch| {
        let kv = i / per_kv;
        let r0 = (i % per_kv) * per_item;
        let rows = r0..(r0 + per_item).min(rows_kv);
        attend_lanes(isa, q, k, v, params, kv, rows.clone(), p0, scratch);
        let mut r = rows.start;
        while r < rows.end {
            let t = r / g;
            let end = ((t + 1) * g).min(rows.end);
            let mut o = chunks[t * n_kv + kv]
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for rr in r..end {
                o[(rr % g) * d..][..d].copy_from_slice(&scratch.acc[(rr - rows.start) * d..][..d]);
            }
            r = end;
        }
    };
    for_items(pool, n_items, run_item);
}

/// Attention of the query rows `rows` of kv head `kv` (row `ρ`: token `ρ / g`, the group's head
/// `ρ % g`; token `t` attends to positions `0..=p0 + t`), into `s.acc` (`rows.len() · d`
/// values, row after row). Row `r` takes lane `r` of every vector: its queries, transposed
/// once, multiply K tiles of sixteen positions (widened once for all rows) into its scores;
/// positions past its own last are `-inf`; the softmax runs down the lanes; V tiles add into
/// the rows four at a time, each row over its own positions only, in order.
#[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
#[allow(clippy::too_many_arguments)]
fn attend_lanes(
    isa: Isa,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    params: &AttentionParams,
    kv: usize,
    rows: std::ops::Range<usize>,
    p0: usize,
    s: &mut Scratch,
) {
    let (d, g) = (params.head_dim, params.n_head / params.n_kv_head);
    let (q_len, kv_row, kv_off) = (params.q_len(), params.kv_row_len(), kv * d);
    let n = rows.len();
    assert!((1..=LANES).contains(&n) && d % 16 == 0 && isa.is_avx512());
    // Each row's last position + 1; lanes past `n` repeat the last row's (their zero queries
    // give scores no one reads).
    let mut lim = [0usize; LANES];
    let qt = &mut s.qt;
    qt.clear();
    qt.resize(LANES * d, 0.0);
    for (r, rho) in rows.clone().enumerate() {
        let (t, hl) = (rho / g, rho % g);
        lim[r] = p0 + t + 1;
        for (c, &x) in q[t * q_len + (kv * g + hl) * d..][..d].iter().enumerate() {
            qt[c * LANES + r] = x;
        }
    }
    let (n_min, n_max) = (lim[0], lim[n - 1]);
    lim[n..].fill(n_max);
    assert!(n_max * kv_row <= k.len() && k.len() == v.len());
    let sc = &mut s.scores;
    sc.resize(n_max * LANES, 0.0);
    let tile = &mut s.tile;
    tile.resize(LANES * d, 0.0);
    // The rows of positions `pt..pt + np` of `src`, widened into `tile`, after requesting the
    // next tile's.
    let load = |src: &[f16], pt: usize, np: usize, tile: &mut [f32]| {
        for p in (pt + LANES..n_max).take(LANES) {
            prefetch_head(src, p * kv_row + kv_off, d);
        }
        // SAFETY: `is_avx512()` (asserted) is only true for an available AVX-512 backend; `d`
        // is a multiple of 16 and rows `pt..pt + np` (below `n_max`) lie in `src` (asserted).
        unsafe {
            super::x86_512::widen_rows16(src, pt * kv_row + kv_off, kv_row, d, &mut tile[..np * d])
        };
    };
    for pt in (0..n_max).step_by(LANES) {
        let np = (n_max - pt).min(LANES);
        load(k, pt, np, tile);
        // SAFETY: as above; `qt` and `tile` hold 16 rows of `d`, `sc` `16·np` values from `pt`.
        unsafe {
            super::x86_512::scores_rows16(
                qt,
                tile,
                d,
                np,
                params.scale,
                &mut sc[pt * LANES..][..np * LANES],
            )
        };
    }
    for p in n_min..n_max {
        for (r, &l) in lim[..n].iter().enumerate() {
            if p >= l {
                sc[p * LANES + r] = f32::NEG_INFINITY;
            }
        }
    }
    // SAFETY: as above; `sc` holds `16·n_max` values.
    let inv = unsafe { super::x86_512::softmax_rows16(&mut sc[..n_max * LANES], n_max) };
    let acc = &mut s.acc;
    acc.clear();
    acc.resize(n * d, 0.0);
    for pt in (0..n_max).step_by(LANES) {
        let np = (n_max - pt).min(LANES);
        load(v, pt, np, tile);
        let upto: [usize; LANES] = std::array::from_fn(|r| lim[r].saturating_sub(pt).min(np));
        // SAFETY: as above; `acc` holds `n` rows of `d`, the tile `np` rows, the weights
        // `16·np` values, every limit is at most `np`.
        unsafe {
            super::x86_512::axpy_rows(
                acc,
                d,
                &sc[pt * LANES..][..np * LANES],
                0,
                &upto[..n],
                &tile[..np * d],
            )
        };
    }
    for (oh, &s) in acc.chunks_exact_mut(d).zip(&inv) {
        scale_in_place(isa, oh, s);
    }
}

/// Positions ahead whose K or V head row the per-position path prefetches (the tiled path
/// prefetches the next tile's rows). The rows of one kv head are `kv_row` values apart (8 KiB
/// for LLaMA-7B's 32 heads of 128, 1 KiB for TinyLlama's 4 kv heads of 64), strides the
/// hardware prefetchers do not run far enough ahead on (measurements: `docs/tuning.md`).
const KV_PREFETCH_AHEAD: usize = 8;

/// Prefetches the `d` values at `src[start..]` (as far as they exist) into L1.
#[inline]
fn prefetch_head(src: &[f16], start: usize, d: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (start + d).min(src.len());
        let mut i = start;
        while i < end {
            // SAFETY: a prefetch never faults and changes no state the program can observe; the
            // address is inside `src` (`i < end <= src.len()`); SSE is part of x86-64's baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().add(i) as *const i8) };
            // 32 f16 values: one 64-byte line.
            i += 32;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, start, d);
}

thread_local! {
    /// Each thread's [`Scratch`], kept between calls (one token's attention is short: buffers
    /// allocated per call showed up beside the arithmetic).
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Per-thread buffers of [`attend_group`].
#[derive(Default)]
struct Scratch {
    /// Scores, then softmax weights, of every query head of the group: `[head][position]`.
    scores: Vec<f32>,
    /// One K or V head row widened to f32 (scalar path).
    row: Vec<f32>,
    /// The group's outputs while they are accumulated (thread-local, so threads never write
    /// to neighbouring cache lines of `out` position after position).
    acc: Vec<f32>,
    /// 1 / (sum of the exponentials) of each query head.
    inv_sum: Vec<f32>,
    /// Eight K or V head rows widened to f32 (AVX2 path; sixteen on the AVX-512 lane path),
    /// shared by the group's query heads.
    tile: Vec<f32>,
    /// The lane path's queries, transposed: `[value][lane]`.
    #[cfg_attr(not(all(target_arch = "x86_64", powerinfer_avx512)), allow(dead_code))]
    qt: Vec<f32>,
}

/// Positions per tile of the AVX2 path: their K (then V) head rows are widened once for all the
/// query heads of a group, and eight scores come out of one reduction.
const TILE: usize = 8;

/// Attention of `q.len() / d` query heads sharing one kv head over cache rows `0..n_ctx`.
/// `kv_off` is the offset of that kv head inside a cache row of `kv_row` values.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    isa: Isa,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    kv_row: usize,
    kv_off: usize,
    d: usize,
    n_ctx: usize,
    scale: f32,
    tiled: bool,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    let g = q.len() / d;
    let scores = &mut scratch.scores;
    scores.clear();
    scores.resize(g * n_ctx, 0.0);
    let row = &mut scratch.row;
    row.resize(d, 0.0);
    let acc = &mut scratch.acc;
    acc.clear();
    acc.resize(q.len(), 0.0);
    let tiled = tiled && isa.is_avx2() && d % 8 == 0;
    // Positions per tile.
    let tw = TILE;
    let tile = &mut scratch.tile;
    // The head rows of positions `p0..p0 + np` of `src` (K or V) widened into `tile`, after
    // requesting the next tile's rows; returns `np`.
    let load_tile = |src: &[f16], p0: usize, tile: &mut [f32]| {
        let np = (n_ctx - p0).min(tw);
        for p in (p0 + tw..n_ctx).take(tw) {
            prefetch_head(src, p * kv_row + kv_off, d);
        }
        widen_rows(
            isa,
            src,
            p0 * kv_row + kv_off,
            kv_row,
            d,
            &mut tile[..np * d],
        );
        np
    };
    if tiled {
        tile.clear();
        tile.resize(tw * d, 0.0);
        for p0 in (0..n_ctx).step_by(tw) {
            let np = load_tile(k, p0, tile);
            tile[np * d..].fill(0.0);
            for (j, qh) in q.chunks_exact(d).enumerate() {
                let s = dots8(isa, qh, tile, scale);
                scores[j * n_ctx + p0..][..np].copy_from_slice(&s[..np]);
            }
        }
    } else {
        for (p, krow) in k.chunks_exact(kv_row).take(n_ctx).enumerate() {
            if p + KV_PREFETCH_AHEAD < n_ctx {
                prefetch_head(k, (p + KV_PREFETCH_AHEAD) * kv_row + kv_off, d);
            }
            let kh = &krow[kv_off..kv_off + d];
            if isa.is_avx2() {
                for (j, qh) in q.chunks_exact(d).enumerate() {
                    scores[j * n_ctx + p] = dot_f32_f16(isa, qh, kh) * scale;
                }
            } else {
                // Widen the row once (in bulk, which `half` vectorises where it can), then
                // plain f32.
                kh.convert_to_f32_slice(row);
                for (j, qh) in q.chunks_exact(d).enumerate() {
                    scores[j * n_ctx + p] = dot_f32(qh, row) * scale;
                }
            }
        }
    }
    let inv = &mut scratch.inv_sum;
    inv.clear();
    inv.resize(g, 0.0);
    for (srow, inv_j) in scores.chunks_exact_mut(n_ctx).zip(inv.iter_mut()) {
        let m = max_with(isa, srow);
        // Scores are finite for finite inputs; guard against a row of -inf anyway (all zeros).
        if m == f32::NEG_INFINITY {
            srow.fill(0.0);
            *inv_j = 0.0;
        } else {
            let sum = exp_sub_sum_with(isa, srow, m);
            *inv_j = (1.0 / sum) as f32;
        }
    }
    let mut p_start = 0;
    if tiled {
        for p0 in (0..n_ctx).step_by(tw) {
            let np = load_tile(v, p0, tile);
            for (j, oh) in acc.chunks_exact_mut(d).enumerate() {
                axpy_tile(isa, oh, &scores[j * n_ctx + p0..][..np], tile);
            }
        }
        p_start = n_ctx;
    } else if isa.is_avx2() {
        // Four positions per pass over the output: a quarter of the loads and stores of `out`.
        p_start = n_ctx - n_ctx % 4;
        for p in (0..p_start).step_by(4) {
            for r in (p + KV_PREFETCH_AHEAD..n_ctx).take(4) {
                prefetch_head(v, r * kv_row + kv_off, d);
            }
            let vh = |r: usize| &v[(p + r) * kv_row + kv_off..][..d];
            let rows = [vh(0), vh(1), vh(2), vh(3)];
            for (j, oh) in acc.chunks_exact_mut(d).enumerate() {
                let w = &scores[j * n_ctx + p..][..4];
                axpy4_f16(isa, oh, [w[0], w[1], w[2], w[3]], rows);
            }
        }
    }
    for (p, vrow) in v.chunks_exact(kv_row).take(n_ctx).enumerate().skip(p_start) {
        if p + KV_PREFETCH_AHEAD < n_ctx {
            prefetch_head(v, (p + KV_PREFETCH_AHEAD) * kv_row + kv_off, d);
        }
        let vh = &vrow[kv_off..kv_off + d];
        if isa.is_avx2() {
            for (j, oh) in acc.chunks_exact_mut(d).enumerate() {
                axpy_f16(isa, oh, scores[j * n_ctx + p], vh);
            }
        } else {
            vh.convert_to_f32_slice(row);
            for (j, oh) in acc.chunks_exact_mut(d).enumerate() {
                let w = scores[j * n_ctx + p];
                for (o, &x) in oh.iter_mut().zip(row.iter()) {
                    *o += w * x;
                }
            }
        }
    }
    for (oh, &s) in acc.chunks_exact_mut(d).zip(inv.iter()) {
        scale_in_place(isa, oh, s);
    }
    out.copy_from_slice(acc);
}

/// Σ `a[i]·b[i]` in f32 with eight partial sums (which the compiler keeps in vector registers),
/// combined by a fixed tree, then the tail in order.
#[inline]
pub(super) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ac = a.chunks_exact(8);
    let bc = b.chunks_exact(8);
    let (at, bt) = (ac.remainder(), bc.remainder());
    for (xs, ys) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += xs[l] * ys[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&x, &y) in at.iter().zip(bt) {
        sum += x * y;
    }
    sum
}

/// AVX2 `q · k` (callers check `isa.is_avx2()`; the scalar path widens rows in bulk instead).
#[inline]
pub(super) fn dot_f32_f16(isa: Isa, q: &[f32], k: &[f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C);
        // `q` and `k` both have length `head_dim`.
        return unsafe { super::x86::dot_f32_f16(q, k) };
    }
    let _ = isa;
    q.iter().zip(k).map(|(&a, &b)| a * b.to_f32()).sum()
}

/// AVX2 f16 → f32 of head rows: row `r` of `dst` (`d` values) from
/// `src[start + r·stride..][..d]` (callers check `isa.is_avx2()` and `d % 8 == 0`).
#[inline]
fn widen_rows(isa: Isa, src: &[f16], start: usize, stride: usize, d: usize, dst: &mut [f32]) {
    // Every source row lies inside `src` (checked once here, not per value).
    let rows = dst.len() / d.max(1);
    assert!(rows == 0 || start + (rows - 1) * stride + d <= src.len());
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C);
        // `d` is a multiple of 8 (caller), the rows lie inside `src` (asserted above).
        unsafe { super::x86::widen_rows_f16(src, start, stride, d, dst) };
        return;
    }
    let _ = isa;
    for (r, row) in dst.chunks_exact_mut(d).enumerate() {
        src[start + r * stride..][..d].convert_to_f32_slice(row);
    }
}

/// AVX2 `scale · (q · tile[r])` for the 8 rows of a tile (callers check `isa.is_avx2()` and
/// `d % 8 == 0`).
#[inline]
fn dots8(isa: Isa, q: &[f32], tile: &[f32], scale: f32) -> [f32; 8] {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C);
        // `tile` holds 8 rows of `q.len()` values, a multiple of 8 (caller).
        return unsafe { super::x86::dots8(q, tile, scale) };
    }
    let _ = isa;
    std::array::from_fn(|r| dot_f32(q, &tile[r * q.len()..][..q.len()]) * scale)
}

/// AVX2 `acc += w[r] · tile[r]` over the tile's first `w.len()` rows, in order (callers check
/// `isa.is_avx2()` and `d % 8 == 0`).
#[inline]
pub(super) fn axpy_tile(isa: Isa, acc: &mut [f32], w: &[f32], tile: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C);
        // `tile` holds `w.len() ≤ 8` rows of `acc.len()` values, a multiple of 8 (caller).
        unsafe { super::x86::axpy_tile(acc, w, tile) };
        return;
    }
    let _ = isa;
    let d = acc.len();
    for (r, &a) in w.iter().enumerate() {
        for (o, &x) in acc.iter_mut().zip(&tile[r * d..][..d]) {
            *o += a * x;
        }
    }
}

/// AVX2 `acc += Σ_r a[r] · v[r]` (callers check `isa.is_avx2()`).
#[inline]
fn axpy4_f16(isa: Isa, acc: &mut [f32], a: [f32; 4], v: [&[f16]; 4]) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C);
        // `acc` and every row of `v` have length `head_dim`.
        unsafe { super::x86::axpy4_f16(acc, a, v) };
        return;
    }
    let _ = isa;
    for (r, row) in v.iter().enumerate() {
        for (o, &x) in acc.iter_mut().zip(row.iter()) {
            *o += a[r] * x.to_f32();
        }
    }
}

/// AVX2 `acc += a · v` (callers check `isa.is_avx2()`).
#[inline]
pub(super) fn axpy_f16(isa: Isa, acc: &mut [f32], a: f32, v: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: `is_avx2()` is only true for an available AVX2 backend (AVX2, FMA, F16C);
        // `acc` and `v` both have length `head_dim`.
        unsafe { super::x86::axpy_f16(acc, a, v) };
        return;
    }
    let _ = isa;
    for (o, &x) in acc.iter_mut().zip(v) {
        *o += a * x.to_f32();
    }
}

/// One side's part of a token's attention over a range of positions, per query head: the
/// largest score, the sum of `exp(score − max)`, and the V rows weighted by those exponentials
/// (not yet divided by the sum). Parts over disjoint ranges merge exactly into the attention
/// over their union ([`merge_parts`]), so two devices can each attend to their share of a KV
/// cache (Q-Infer's attention split).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AttentionPart {
    /// Per head, the largest score (`-inf` for an empty range).
    pub max: Vec<f32>,
    /// Per head, `Σ exp(score − max)` (0 for an empty range).
    pub sum: Vec<f32>,
    /// Per head, `head_dim` values: `Σ exp(score − max) · V[p]`.
    pub acc: Vec<f32>,
}

impl AttentionPart {
    /// The part of an empty range for `params`' heads.
    pub fn empty(params: &AttentionParams) -> AttentionPart {
        AttentionPart {
            max: vec![f32::NEG_INFINITY; params.n_head],
            sum: vec![0.0; params.n_head],
            acc: vec![0.0; params.q_len()],
        }
    }
}

/// The part ([`AttentionPart`]) of one token's attention over the positions whose K and V rows
/// are `k` and `v` (whole rows of the layout in the [module docs](self); any number, none
/// included), with the queries `q` (`n_head · head_dim`). Scores, exponentials and sums in f32.
///
/// Errors: invalid `params`, `q.len()` not `n_head · head_dim`, `k.len()` not a multiple of a
/// row or not `v.len()`.
pub fn attention_part(
    q: &[f32],
    k: &[f16],
    v: &[f16],
    params: &AttentionParams,
    part: &mut AttentionPart,
) -> Result<(), KernelError> {
    params.validate()?;
    let (hd, kv_row) = (params.head_dim, params.kv_row_len());
    check_len("attention part: q", params.q_len(), q.len())?;
    check_len("attention part: v", k.len(), v.len())?;
    if k.len() % kv_row != 0 {
        return Err(KernelError::Shape(format!(
            "attention part: K length {} is not a whole number of rows of {kv_row}",
            k.len()
        )));
    }
    let n_pos = k.len() / kv_row;
    *part = AttentionPart::empty(params);
    if n_pos == 0 {
        return Ok(());
    }
    let group = params.n_head / params.n_kv_head;
    let mut kf = vec![0f32; hd];
    let mut scores = vec![0f32; n_pos];
    for h in 0..params.n_head {
        let off = (h / group) * hd;
        let qh = &q[h * hd..][..hd];
        for (p, s) in scores.iter_mut().enumerate() {
            k[p * kv_row + off..][..hd].convert_to_f32_slice(&mut kf);
            *s = params.scale * qh.iter().zip(&kf).map(|(a, b)| a * b).sum::<f32>();
        }
        let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let acc = &mut part.acc[h * hd..][..hd];
        let mut sum = 0f32;
        for (p, &s) in scores.iter().enumerate() {
            let w = (s - m).exp();
            sum += w;
            v[p * kv_row + off..][..hd].convert_to_f32_slice(&mut kf);
            for (a, &x) in acc.iter_mut().zip(&kf) {
                *a += w * x;
            }
        }
        part.max[h] = m;
        part.sum[h] = sum;
    }
    Ok(())
}

/// The attention over the union of two parts' disjoint ranges into `out` (`n_head · head_dim`):
/// per head both parts rescaled to the larger maximum, `(acc_a·e^(m_a−m) + acc_b·e^(m_b−m)) /
/// (l_a·e^(m_a−m) + l_b·e^(m_b−m))`.
///
/// Errors: the parts' or `out`'s lengths not those of `params`, or both ranges empty.
pub fn merge_parts(
    a: &AttentionPart,
    b: &AttentionPart,
    params: &AttentionParams,
    out: &mut [f32],
) -> Result<(), KernelError> {
    params.validate()?;
    let (nh, hd) = (params.n_head, params.head_dim);
    for p in [a, b] {
        check_len("attention part: max", nh, p.max.len())?;
        check_len("attention part: sum", nh, p.sum.len())?;
        check_len("attention part: acc", nh * hd, p.acc.len())?;
    }
    check_len("attention part: out", nh * hd, out.len())?;
    for h in 0..nh {
        let m = a.max[h].max(b.max[h]);
        if m == f32::NEG_INFINITY {
            return Err(KernelError::Shape(
                "attention parts: both ranges are empty".into(),
            ));
        }
        let scale = |mx: f32| {
            if mx == f32::NEG_INFINITY {
                0.0
            } else {
                (mx - m).exp()
            }
        };
        let (sa, sb) = (scale(a.max[h]), scale(b.max[h]));
        let inv = 1.0 / (a.sum[h] * sa + b.sum[h] * sb);
        let (xa, xb) = (&a.acc[h * hd..][..hd], &b.acc[h * hd..][..hd]);
        for ((o, &x), &y) in out[h * hd..][..hd].iter_mut().zip(xa).zip(xb) {
            *o = (x * sa + y * sb) * inv;
        }
    }
    Ok(())
}
