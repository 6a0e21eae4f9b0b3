//! AVX2 kernels of attention over a Q8_0 or Q4_0 cache (x86-64, AVX2 with FMA and F16C), for
//! the group's query heads of one kv head:
//!
//! - [`scores`]: eight positions per vector, one per lane. The eight rows' blocks are loaded
//!   and transposed in registers so that each lane holds four bytes of its row, multiplied with
//!   the query head's four Q8_0 bytes in the integer domain (`vpmaddubsw` then `vpmaddwd`): Q8_0 values
//!   through their magnitudes and the query's bytes given their signs (`|k|·sign(q, k)`, at most
//!   2·127·127 per 16-bit pair, so nothing saturates), Q4_0 nibbles as they are (unsigned, so
//!   `x + 8`; the offset's products `8·Σq` taken back per block). Each transposed vector serves
//!   every head, and no sum is horizontal.
//! - [`accumulate`]: the output's weighted sum (also over an F16 V cache), sixteen values of up
//!   to four heads in registers over all the positions, each row's values decoded once per four
//!   heads.
//!
//! Every function is `unsafe` because it requires those CPU features: callers must hold an
//! `Isa` for which `is_avx2()` is true (built only for an available AVX2 backend). Memory
//! accesses stay inside the slices passed (lengths asserted).

#![deny(unsafe_op_in_unsafe_fn)]

use core::arch::x86_64::*;

/// The block types these kernels read.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Blocks {
    /// 34-byte blocks: f16 scale, 32 signed bytes (−128 read as magnitude 128 unsigned, so any
    /// byte is exact).
    Q8_0,
    /// 18-byte blocks: f16 scale, 16 bytes of two nibbles (values `0..16` low, `16..32` high),
    /// each value `nibble − 8`.
    Q4_0,
}

impl Blocks {
    fn bytes(self) -> usize {
        match self {
            Blocks::Q8_0 => 34,
            Blocks::Q4_0 => 18,
        }
    }
}

/// The query heads of one kv head, quantized to 32-blocks.
pub(crate) struct QueryBlocks<'a> {
    /// Values, `heads · d`, each in `−127..=127`.
    pub q: &'a [i8],
    /// Scale per block, `heads · d / 32`.
    pub d: &'a [f32],
    /// Σq per block, `heads · d / 32`.
    pub sum: &'a [i32],
}

/// `out[h·n + p] = Σ_b kd[p][b] · qd[h][b] · Σ_i k[p][b][i] · q[h][b][i]` for the `n` rows of
/// `rows` (`head_bytes` each: `d / 32` blocks of `ty`) and the query heads `q` (heads of `d`
/// values), eight positions at a time, up to eight heads per pass.
///
/// # Safety
/// AVX2, FMA and F16C available. Lengths as asserted: `d` a multiple of 32,
/// `head_bytes = d / 32 · ty.bytes()`, `rows.len() ≥ n · head_bytes`, `out.len() ≥ heads · n`,
/// `d / 32` scales and sums per head, `8 · head_bytes < 2³¹`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn scores(
    ty: Blocks,
    rows: &[u8],
    head_bytes: usize,
    n: usize,
    q: &QueryBlocks<'_>,
    d: usize,
    out: &mut [f32],
) {
    let heads = q.q.len() / d.max(1);
    let nb = d / 32;
    assert!(
        d % 32 == 0
            && head_bytes == nb * ty.bytes()
            && rows.len() >= n * head_bytes
            && out.len() >= heads * n
            && q.d.len() >= heads * nb
            && q.sum.len() >= heads * nb
            && i32::try_from(8 * head_bytes).is_ok()
    );
    let mut h0 = 0;
    while h0 < heads {
        let hn = (heads - h0).min(8);
        let at = (h0, n, head_bytes);
        macro_rules! heads {
            ($q4:literal) => {
                match hn {
                    8 => scores_heads::<8, $q4>(rows, at, q, d, out),
                    7 => scores_heads::<7, $q4>(rows, at, q, d, out),
                    6 => scores_heads::<6, $q4>(rows, at, q, d, out),
                    5 => scores_heads::<5, $q4>(rows, at, q, d, out),
                    4 => scores_heads::<4, $q4>(rows, at, q, d, out),
                    3 => scores_heads::<3, $q4>(rows, at, q, d, out),
                    2 => scores_heads::<2, $q4>(rows, at, q, d, out),
                    _ => scores_heads::<1, $q4>(rows, at, q, d, out),
                }
            };
        }
        // SAFETY: the caller's features; the asserted lengths (heads `h0..h0 + hn`).
        unsafe {
            match ty {
                Blocks::Q8_0 => heads!(false),
                Blocks::Q4_0 => heads!(true),
            }
        }
        h0 += hn;
    }
}

/// [`scores`] for the `H` heads `h0..h0 + H` (`(h0, n, head_bytes)`) of a Q4_0 (`Q4`) or
/// Q8_0 cache.
///
/// # Safety
/// As [`scores`] (checked there), with `h0 + H ≤ heads`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_heads<const H: usize, const Q4: bool>(
    rows: &[u8],
    (h0, n, head_bytes): (usize, usize, usize),
    q: &QueryBlocks<'_>,
    d: usize,
    out: &mut [f32],
) {
    let nb = d / 32;
    let bb = if Q4 { Blocks::Q4_0 } else { Blocks::Q8_0 }.bytes();
    let ones = _mm256_set1_epi16(1);
    let nibble = _mm256_set1_epi8(0x0f);
    // The query's four bytes at `at` of head `h`'s block `b`, in every lane.
    let qb = |h: usize, b: usize, at: usize| {
        let i = (h0 + h) * d + b * 32 + at;
        assert!(i + 4 <= q.q.len());
        // SAFETY: `i + 4 ≤ q.q.len()` (asserted).
        _mm256_set1_epi32(unsafe { (q.q.as_ptr().add(i) as *const i32).read_unaligned() })
    };
    // The last group's blocks when it has fewer than eight rows, zeros after them.
    let mut tail = [0u8; 8 * 34];
    let mut p0 = 0;
    while p0 < n {
        let np = (n - p0).min(8);
        let mut acc = [_mm256_setzero_ps(); H];
        for b in 0..nb {
            // Rows `p0..p0 + 8`, block `b`: eight blocks `stride` bytes apart from `base`.
            let (base, stride) = if np == 8 {
                (rows[p0 * head_bytes + b * bb..].as_ptr(), head_bytes)
            } else {
                tail.fill(0);
                for r in 0..np {
                    let from = &rows[(p0 + r) * head_bytes + b * bb..][..bb];
                    tail[r * bb..][..bb].copy_from_slice(from);
                }
                (tail.as_ptr(), bb)
            };
            // SAFETY: eight blocks of `bb` bytes lie at `base + r·stride` (rows of `rows`, or
            // `tail`).
            let (kd, k) = unsafe { transpose_blocks::<Q4>(base, stride) };
            let mut dot = [_mm256_setzero_si256(); H];
            match Q4 {
                false => {
                    for (j, &k) in k.iter().enumerate() {
                        let k_abs = _mm256_abs_epi8(k);
                        for (h, dh) in dot.iter_mut().enumerate() {
                            let signed = _mm256_sign_epi8(qb(h, b, 4 * j), k);
                            let pairs = _mm256_maddubs_epi16(k_abs, signed);
                            *dh = _mm256_add_epi32(*dh, _mm256_madd_epi16(pairs, ones));
                        }
                    }
                }
                true => {
                    // Sixteen-bit sums of eight nibble products each (≤ 8·15·127, no
                    // saturation), widened once per block.
                    let mut sums = [_mm256_setzero_si256(); H];
                    for (j, &g) in k.iter().take(4).enumerate() {
                        let lo = _mm256_and_si256(g, nibble);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(g), nibble);
                        for (h, sh) in sums.iter_mut().enumerate() {
                            let a = _mm256_maddubs_epi16(lo, qb(h, b, 4 * j));
                            let c = _mm256_maddubs_epi16(hi, qb(h, b, 16 + 4 * j));
                            *sh = _mm256_add_epi16(*sh, _mm256_add_epi16(a, c));
                        }
                    }
                    for (h, (dh, sh)) in dot.iter_mut().zip(sums).enumerate() {
                        let offset = _mm256_set1_epi32(8 * q.sum[(h0 + h) * nb + b]);
                        *dh = _mm256_sub_epi32(_mm256_madd_epi16(sh, ones), offset);
                    }
                }
            }
            for (h, (ah, dh)) in acc.iter_mut().zip(dot).enumerate() {
                let scale = _mm256_mul_ps(kd, _mm256_set1_ps(q.d[(h0 + h) * nb + b]));
                *ah = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dh), scale, *ah);
            }
        }
        for (h, ah) in acc.iter().enumerate() {
            let dst = &mut out[(h0 + h) * n + p0..][..np];
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds 8 values.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *ah) };
            dst.copy_from_slice(&lanes[..np]);
        }
        p0 += 8;
    }
}

/// Eight blocks (rows `r = 0..8` at `base + r·stride`) as eight lanes: their scales as f32,
/// and vector `j` holding each row's value bytes `4j..4j + 4` (Q8_0: `j < 8`; Q4_0: `j < 4`,
/// the rest zero). Rows `r` and `r + 4` are loaded into the two halves of one vector and the
/// halves transposed as 4×4 dwords.
///
/// # Safety
/// AVX2 and F16C available; `bb` bytes readable at each `base + r·stride`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_blocks<const Q4: bool>(
    base: *const u8,
    stride: usize,
) -> (__m256, [__m256i; 8]) {
    // SAFETY (whole body): every read is inside row `r`'s block (the caller): the scale's two
    // bytes at 0, sixteen value bytes at `2 + 16·half` (Q8_0 has 32, Q4_0 16).
    unsafe {
        let row = |r: usize| base.add(r * stride);
        let scale = |r: usize| (row(r) as *const i16).read_unaligned();
        let kd = _mm256_cvtph_ps(_mm_setr_epi16(
            scale(0),
            scale(1),
            scale(2),
            scale(3),
            scale(4),
            scale(5),
            scale(6),
            scale(7),
        ));
        let mut out = [_mm256_setzero_si256(); 8];
        let halves = if Q4 { 1 } else { 2 };
        for half in 0..halves {
            let at = 2 + 16 * half;
            let pair = |r: usize| {
                _mm256_loadu2_m128i(
                    row(r + 4).add(at) as *const __m128i,
                    row(r).add(at) as *const __m128i,
                )
            };
            let (a, b, c, e) = (pair(0), pair(1), pair(2), pair(3));
            let ab_lo = _mm256_unpacklo_epi32(a, b);
            let ab_hi = _mm256_unpackhi_epi32(a, b);
            let ce_lo = _mm256_unpacklo_epi32(c, e);
            let ce_hi = _mm256_unpackhi_epi32(c, e);
            out[4 * half] = _mm256_unpacklo_epi64(ab_lo, ce_lo);
            out[4 * half + 1] = _mm256_unpackhi_epi64(ab_lo, ce_lo);
            out[4 * half + 2] = _mm256_unpacklo_epi64(ab_hi, ce_hi);
            out[4 * half + 3] = _mm256_unpackhi_epi64(ab_hi, ce_hi);
        }
        (kd, out)
    }
}

/// The rows [`accumulate`] reads.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ValueRows {
    /// Rows of blocks.
    Blocks(Blocks),
    /// Rows of f16 values.
    F16,
}

impl ValueRows {
    /// Bytes of a row of `d` values.
    fn row_bytes(self, d: usize) -> usize {
        match self {
            ValueRows::Blocks(b) => d / 32 * b.bytes(),
            ValueRows::F16 => 2 * d,
        }
    }
}

/// `acc[h·d + c] += Σ_p w[h·n + p] · V[p][c]` for the `n` rows of `ty` at `rows[p·stride..]`
/// and the heads of `acc` (`heads = acc.len() / d`): sixteen values of up to four heads held in
/// registers over all the positions, each row's sixteen values decoded (times their block's
/// scale) once per four heads.
///
/// # Safety
/// AVX2, FMA and F16C available. Lengths as asserted: `d` a multiple of 32 for blocks, of 16 for
/// F16; `stride` at least a row; the last row inside `rows`; `w.len() ≥ heads · n`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn accumulate(
    ty: ValueRows,
    rows: &[u8],
    stride: usize,
    n: usize,
    w: &[f32],
    d: usize,
    acc: &mut [f32],
) {
    let heads = acc.len() / d.max(1);
    let row_bytes = ty.row_bytes(d);
    let whole = match ty {
        ValueRows::Blocks(_) => d % 32 == 0,
        ValueRows::F16 => d % 16 == 0,
    };
    assert!(
        whole
            && stride >= row_bytes
            && (n == 0 || (n - 1) * stride + row_bytes <= rows.len())
            && w.len() >= heads * n
    );
    let mut h0 = 0;
    while h0 < heads {
        let hn = (heads - h0).min(4);
        for c in 0..d / 16 {
            let at = (h0, c, n, stride);
            macro_rules! heads {
                ($kind:expr) => {
                    match hn {
                        4 => accumulate_chunk::<4, { $kind }>(rows, at, w, d, acc),
                        3 => accumulate_chunk::<3, { $kind }>(rows, at, w, d, acc),
                        2 => accumulate_chunk::<2, { $kind }>(rows, at, w, d, acc),
                        _ => accumulate_chunk::<1, { $kind }>(rows, at, w, d, acc),
                    }
                };
            }
            // SAFETY: the caller's features; the asserted lengths (heads `h0..h0 + hn`, values
            // `16c..16c + 16` of every row).
            unsafe {
                match ty {
                    ValueRows::Blocks(Blocks::Q8_0) => heads!(KIND_Q8_0),
                    ValueRows::Blocks(Blocks::Q4_0) => heads!(KIND_Q4_0),
                    ValueRows::F16 => heads!(KIND_F16),
                }
            }
        }
        h0 += hn;
    }
}

/// [`accumulate_chunk`]'s row kinds.
const KIND_Q8_0: u8 = 0;
const KIND_Q4_0: u8 = 1;
const KIND_F16: u8 = 2;

/// [`accumulate`] for the `H` heads `h0..h0 + H` and values `16c..16c + 16`
/// (`(h0, c, n, stride)`) of rows of `KIND`.
///
/// # Safety
/// As [`accumulate`] (checked there), with `h0 + H ≤ heads` and `16c + 16 ≤ d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate_chunk<const H: usize, const KIND: u8>(
    rows: &[u8],
    (h0, c, n, stride): (usize, usize, usize, usize),
    w: &[f32],
    d: usize,
    acc: &mut [f32],
) {
    // The chunk's bytes in a row: F16 values `16c..`; for blocks, chunk `c` is half `c % 2` of
    // block `c / 2` (Q8_0 bytes `16·half..`, Q4_0 the low (half 0) or high (half 1) nibbles
    // of all sixteen bytes), whose scale comes first.
    let (block, half) = (c / 2, c % 2);
    let (first, len) = match KIND {
        KIND_Q8_0 => (block * 34, 34),
        KIND_Q4_0 => (block * 18, 18),
        _ => (32 * c, 32),
    };
    assert!(n == 0 || ((n - 1) * stride + first + len <= rows.len() && (h0 + H) * n <= w.len()));
    let (eight, fifteen) = (_mm256_set1_epi32(8), _mm256_set1_epi32(15));
    let mut lo = [_mm256_setzero_ps(); H];
    let mut hi = [_mm256_setzero_ps(); H];
    let mut b = rows.as_ptr().wrapping_add(first);
    for p in 0..n {
        // SAFETY: `b` is row `p`'s chunk (`len` bytes inside `rows`, asserted): F16 values, or
        // a block: the scale's two bytes, then the values (32 bytes for Q8_0, 16 for Q4_0), so
        // every load stays inside it; weight `(h0 + h)·n + p` exists (asserted).
        unsafe {
            let (v0, v1) = if KIND == KIND_F16 {
                (
                    _mm256_cvtph_ps(_mm_loadu_si128(b as *const __m128i)),
                    _mm256_cvtph_ps(_mm_loadu_si128(b.add(16) as *const __m128i)),
                )
            } else {
                let scale = _mm256_cvtph_ps(_mm_set1_epi16((b as *const i16).read_unaligned()));
                let x = b.add(2);
                let (i0, i1) = if KIND == KIND_Q4_0 {
                    let u0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(x as *const __m128i));
                    let u1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(x.add(8) as *const __m128i));
                    let (u0, u1) = if half == 0 {
                        (_mm256_and_si256(u0, fifteen), _mm256_and_si256(u1, fifteen))
                    } else {
                        (_mm256_srli_epi32::<4>(u0), _mm256_srli_epi32::<4>(u1))
                    };
                    (_mm256_sub_epi32(u0, eight), _mm256_sub_epi32(u1, eight))
                } else {
                    let x = x.add(16 * half);
                    (
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64(x as *const __m128i)),
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64(x.add(8) as *const __m128i)),
                    )
                };
                (
                    _mm256_mul_ps(_mm256_cvtepi32_ps(i0), scale),
                    _mm256_mul_ps(_mm256_cvtepi32_ps(i1), scale),
                )
            };
            let wp = w.as_ptr().add(h0 * n + p);
            for h in 0..H {
                let wh = _mm256_broadcast_ss(&*wp.add(h * n));
                lo[h] = _mm256_fmadd_ps(wh, v0, lo[h]);
                hi[h] = _mm256_fmadd_ps(wh, v1, hi[h]);
            }
        }
        b = b.wrapping_add(stride);
    }
    for h in 0..H {
        let dst = &mut acc[(h0 + h) * d + 16 * c..][..16];
        // SAFETY: `dst` holds 16 values.
        unsafe {
            let p = dst.as_mut_ptr();
            _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), lo[h]));
            _mm256_storeu_ps(p.add(8), _mm256_add_ps(_mm256_loadu_ps(p.add(8)), hi[h]));
        }
    }
}
