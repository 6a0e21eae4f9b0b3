//! Integer-dot row kernels of the quantized types (x86-64), instantiated twice from one body:
//! [`avx2`] with `maddubs` + `madd` (AVX2), and [`vnni`] with the AVX-512 VNNI `vpdpbusd`
//! instruction on 256-bit vectors (AVX-512 VL + VNNI), which fuses those two steps. The integer
//! sums are exact on both paths (no `maddubs` saturation can occur for these value ranges), so
//! the two produce bit-identical results.

// Block formats are defined by element index; indexed loops read closest to the format.
#![allow(clippy::needless_range_loop)]
#![deny(unsafe_op_in_unsafe_fn)]

macro_rules! int_kernels {
    ($m:ident, $feat:literal, $doc:literal, { $($helpers:item)* }) => {
        #[doc = $doc]
        pub(crate) mod $m {
        use crate::matmul::act::Act;
        use crate::matmul::scalar::scale_min_k4;
        use crate::matmul::x86::common::{
            f16_scalar, hsum, hsums, hsums_less, q4_0_pair_act, q4_0_pair_weights,
        };
        use std::arch::x86_64::*;

        $($helpers)*

        /// Adds block `b` of `R` Q8_0 rows (`blk[r]` points at row r's block) to the `R × N`
        /// accumulators; each (row, token) pair takes the same operations for any `R` and `N`.
        ///
        /// # Safety
        /// 34 readable bytes at every `blk[r]`; act entries for block `b` exist; features
        /// available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q8_0_block<const R: usize, const N: usize>(
            blk: [*const u8; R],
            b: usize,
            acts: &[&Act<'_>; N],
            acc: &mut [[__m256; N]; R],
        ) {
            // SAFETY: guaranteed by the caller.
            unsafe {
                let mut dw = [_mm256_setzero_ps(); R];
                let mut w = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    dw[r] = _mm256_set1_ps(f16_scalar(blk[r]));
                    w[r] = _mm256_loadu_si256(blk[r].add(2) as *const __m256i);
                }
                for k in 0..N {
                    let x = _mm256_loadu_si256(acts[k].q.as_ptr().add(b * 32) as *const __m256i);
                    let dx = _mm256_broadcast_ss(acts[k].d.get_unchecked(b));
                    for r in 0..R {
                        let s = _mm256_cvtepi32_ps(dot_i8(w[r], x));
                        // d_w·d_x in every lane: the same product as in scalar code.
                        acc[r][k] = _mm256_fmadd_ps(s, _mm256_mul_ps(dw[r], dx), acc[r][k]);
                    }
                }
            }
        }

        /// Adds block `b` of `R` Q4_0 rows (`blk[r]` points at row r's block) to the `R × N`
        /// accumulators: nibbles unsigned (0..15), the −8 offset subtracted exactly in the
        /// integer sums (`dot_u_off`). Each (row, token) pair takes the same operations as
        /// with `R = N = 1`.
        ///
        /// # Safety
        /// 18 readable bytes at every `blk[r]`; act entries for block `b` exist; features
        /// available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q4_0_block<const R: usize, const N: usize>(
            blk: [*const u8; R],
            b: usize,
            acts: &[&Act<'_>; N],
            acc: &mut [[__m256; N]; R],
        ) {
            // SAFETY: guaranteed by the caller.
            unsafe {
                let mut dw = [0f32; R];
                let mut u = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    dw[r] = f16_scalar(blk[r]);
                    u[r] = nibbles32(blk[r].add(2));
                }
                for k in 0..N {
                    let x = _mm256_loadu_si256(acts[k].q.as_ptr().add(b * 32) as *const __m256i);
                    let dx = *acts[k].d.get_unchecked(b);
                    for r in 0..R {
                        let s = _mm256_cvtepi32_ps(dot_u_off::<8>(u[r], x));
                        let d = _mm256_set1_ps(dw[r] * dx);
                        acc[r][k] = _mm256_fmadd_ps(s, d, acc[r][k]);
                    }
                }
            }
        }

        /// Adds blocks `b` and `b + 1` of `R` Q4_0 rows (`blk[r]` points at row r's block `b`)
        /// to the `R × N` accumulators, with activations in [`ActFormat::Q8_0Pairs`](crate::matmul::act::ActFormat::Q8_0Pairs) order: one
        /// vector holds both blocks' low nibbles, one both high nibbles; i32 lanes 0..4 sum
        /// block `b`, lanes 4..8 block `b + 1`, starting from the pair's offset vector (the −8
        /// term). Each (row, token) pair takes the same operations as with `R = N = 1`; the
        /// activation loads are shared by the rows, the weight decoding by the tokens.
        ///
        /// # Safety
        /// 36 readable bytes at every `blk[r]`; `b` even; act entries for the pair exist;
        /// features available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q4_0_pair<const R: usize, const N: usize>(
            blk: [*const u8; R],
            b: usize,
            acts: &[&Act<'_>; N],
            acc: &mut [[__m256; N]; R],
        ) {
            // SAFETY: guaranteed by the caller.
            unsafe {
                let mut lo = [_mm256_setzero_si256(); R];
                let mut hi = [_mm256_setzero_si256(); R];
                let mut dw = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    (lo[r], hi[r], dw[r]) = q4_0_pair_weights(blk[r]);
                }
                for k in 0..N {
                    let (dx, x0, x1, init) = q4_0_pair_act(acts[k], b);
                    for r in 0..R {
                        // d_w·d_x per lane: the same products as in scalar code.
                        let sc = _mm256_mul_ps(dw[r], dx);
                        let si = dot_pair(init, lo[r], x0, hi[r], x1);
                        acc[r][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), sc, acc[r][k]);
                    }
                }
            }
        }

        /// `R` Q4_0 rows · `N` activations in [`ActFormat::Q8_0Pairs`](crate::matmul::act::ActFormat::Q8_0Pairs) order: pairs of blocks
        /// ([`q4_0_pair`]) into one accumulator per (row, token), an odd last block as in
        /// [`q4_0_block`]; fixed-order horizontal sum. Every (row, token) result is the same
        /// for any `R` and `N`.
        ///
        /// # Safety
        /// Every row is the same number of whole 18-byte blocks; every act has values, scales
        /// and pair offsets for them; this module's CPU features available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_q4_0_tile<const R: usize, const N: usize>(
            rows: [&[u8]; R],
            acts: [&Act<'_>; N],
        ) -> [[f32; N]; R] {
            let nb = rows[0].len() / 18;
            debug_assert!(rows.iter().all(|r| r.len() == nb * 18));
            debug_assert!(acts
                .iter()
                .all(|a| a.q.len() >= nb * 32 && a.d.len() >= nb && a.po.len() >= nb / 2 * 8));
            let mut acc = [[_mm256_setzero_ps(); N]; R];
            let p = rows.map(|r| r.as_ptr());
            let mut b = 0;
            // SAFETY: blocks `b`, `b + 1` < nb lie within every row, and the acts have entries
            // for them (the frame prepared them for this row length).
            unsafe {
                while b + 2 <= nb {
                    q4_0_pair(p.map(|p| p.add(b * 18)), b, &acts, &mut acc);
                    b += 2;
                }
                if b < nb {
                    q4_0_block(p.map(|p| p.add(b * 18)), b, &acts, &mut acc);
                }
            }
            let mut out = [[0f32; N]; R];
            for r in 0..R {
                for k in 0..N {
                    // SAFETY: this function's CPU features are available (its contract).
                    out[r][k] = unsafe { hsum(acc[r][k]) };
                }
            }
            out
        }

        /// `R` Q8_0 rows · `N` Q8_0 activations: per block an exact i32 dot, converted and
        /// scaled by `d_w·d_x`; even and odd blocks go to two accumulators per (row, token) (to
        /// hide the FMA latency), summed in a fixed order at the end. Every (row, token) result
        /// is the same for any `R` and `N` (`R·N ≤ 4` keeps the 8 accumulators in registers).
        ///
        /// # Safety
        /// Every row is the same number of whole 34-byte blocks; every act has `32·blocks`
        /// values and one scale per block; this module's CPU features available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_q8_0_tile<const R: usize, const N: usize>(
            rows: [&[u8]; R],
            acts: [&Act<'_>; N],
        ) -> [[f32; N]; R] {
            let nb = rows[0].len() / 34;
            debug_assert!(rows.iter().all(|r| r.len() == nb * 34));
            debug_assert!(acts.iter().all(|a| a.q.len() >= nb * 32 && a.d.len() >= nb));
            let mut acc0 = [[_mm256_setzero_ps(); N]; R];
            let mut acc1 = [[_mm256_setzero_ps(); N]; R];
            let p = rows.map(|r| r.as_ptr());
            let mut b = 0;
            // SAFETY: blocks `b`, `b + 1` < nb lie within every row, and the acts have entries
            // for them (the frame prepared them for this row length).
            unsafe {
                while b + 2 <= nb {
                    q8_0_block(p.map(|p| p.add(b * 34)), b, &acts, &mut acc0);
                    q8_0_block(p.map(|p| p.add((b + 1) * 34)), b + 1, &acts, &mut acc1);
                    b += 2;
                }
                if b < nb {
                    q8_0_block(p.map(|p| p.add(b * 34)), b, &acts, &mut acc0);
                }
            }
            let mut out = [[0f32; N]; R];
            for r in 0..R {
                for k in 0..N {
                    // SAFETY: this function's CPU features are available (its contract).
                    out[r][k] = unsafe { hsum(_mm256_add_ps(acc0[r][k], acc1[r][k])) };
                }
            }
            out
        }

        macro_rules! tile_wrappers {
            ($tile:ident, $dot:ident, $dot4:ident, $rows4:ident) => {
                pub(crate) fn $dot(row: &[u8], a: &Act<'_>) -> f32 {
                    // SAFETY: installed only when this module's CPU features were detected; the
                    // frame passes whole rows and activations prepared for the row length.
                    unsafe { $tile::<1, 1>([row], [a])[0][0] }
                }
                pub(crate) fn $dot4(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
                    // SAFETY: as above, for four activations.
                    *out = unsafe { $tile::<1, 4>([row], [&acts[0], &acts[1], &acts[2], &acts[3]])[0] };
                }
                pub(crate) fn $rows4(rows: [&[u8]; 4], a: &Act<'_>) -> [f32; 4] {
                    // SAFETY: as above, four rows of the same length.
                    unsafe { $tile::<4, 1>(rows, [a]) }.map(|r| r[0])
                }
            };
        }
        tile_wrappers!(dot_q8_0_tile, dot_q8_0, dot4_q8_0, rows4_q8_0);
        tile_wrappers!(dot_q4_0_tile, dot_q4_0, dot4_q4_0, rows4_q4_0);
        pub(crate) fn tile_q4_0(rows: [&[u8]; 2], acts: &[Act<'_>; 4], out: &mut [[f32; 4]; 2]) {
            // SAFETY: as in the wrappers of `tile_wrappers!`, two rows of the same length.
            *out = unsafe { dot_q4_0_tile::<2, 4>(rows, [&acts[0], &acts[1], &acts[2], &acts[3]]) };
        }
        // ---------------------------------------------------------------------------------------------
        // Q4_1 / Q5_0 / Q5_1 × Q8_0 / Q8_1.

        /// The 32 fifth bits of a Q5 block (`qh`, bit j = element j) as bytes 0x10 / 0x00.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn q5_high_bits(qh: u32) -> __m256i {
            // Byte j takes qh byte j/8; OR with a mask that has every bit but bit j%8 set; the byte is
            // all ones exactly when bit j of qh is set.
            let shuf = _mm256_setr_epi64x(
                0x0000_0000_0000_0000,
                0x0101_0101_0101_0101,
                0x0202_0202_0202_0202,
                0x0303_0303_0303_0303,
            );
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
            let bit_mask = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit_mask), _mm256_set1_epi64x(-1));
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        }

        /// The 32 unsigned 4- or 5-bit values of a 32-block: 16 packed bytes at `qs` (element j low
        /// nibble of byte j, element j + 16 high nibble), optionally OR-ed with fifth bits.
        ///
        /// # Safety
        /// 16 readable bytes at `qs`.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn nibbles32(qs: *const u8) -> __m256i {
            // SAFETY: 16 readable bytes (caller).
            let raw = unsafe { _mm_loadu_si128(qs as *const __m128i) };
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(raw), raw);
            _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
        }

        /// Shared frame of the 32-block types with unsigned values `u` (0..31): per block
        /// `d_w·d_x·Σ u·q_x` into a vector accumulator, plus `off · s_x` (`off` = minimum `m`, or
        /// `−bias·d_w`) into a scalar one.
        ///
        /// # Safety
        /// `row` is whole `BYTES`-blocks; every act has values, scales and sums for each block;
        /// this module's CPU features available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_u32blocks<const N: usize, const BYTES: usize, const KIND: u8>(
            row: &[u8],
            acts: [&Act<'_>; N],
        ) -> [f32; N] {
            // KIND: 0 = Q4_1 (d, m, qs), 1 = Q5_0 (d, qh, qs), 2 = Q5_1 (d, m, qh, qs).
            let nb = row.len() / BYTES;
            debug_assert!(acts.iter().all(|a| a.q.len() >= nb * 32
                && a.d.len() >= nb
                && (KIND == 1 || a.s.len() >= nb)));
            // Even and odd blocks into separate accumulators: two dependency chains.
            let mut acc = [[_mm256_setzero_ps(); N]; 2];
            let mut corr = [[0f32; N]; 2];
            for b in 0..nb {
                // SAFETY: block `b` < nb lies within `row`; act entries for block `b` exist.
                unsafe {
                    let blk = row.as_ptr().add(b * BYTES);
                    let dw = f16_scalar(blk);
                    let (off, u) = match KIND {
                        0 => (f16_scalar(blk.add(2)), nibbles32(blk.add(4))),
                        1 => {
                            let qh = std::ptr::read_unaligned(blk.add(2) as *const u32);
                            (0.0, _mm256_or_si256(nibbles32(blk.add(6)), q5_high_bits(qh)))
                        }
                        _ => {
                            let qh = std::ptr::read_unaligned(blk.add(4) as *const u32);
                            (
                                f16_scalar(blk.add(2)),
                                _mm256_or_si256(nibbles32(blk.add(8)), q5_high_bits(qh)),
                            )
                        }
                    };
                    for k in 0..N {
                        let a = acts[k];
                        let x = _mm256_loadu_si256(a.q.as_ptr().add(b * 32) as *const __m256i);
                        // Q5_0: the −16 offset exactly in the integers; Q4_1/Q5_1: `m·s_x`.
                        let si = if KIND == 1 { dot_u_off::<16>(u, x) } else { dot_u4_i8(u, x) };
                        let s = _mm256_cvtepi32_ps(si);
                        let d = _mm256_set1_ps(dw * *a.d.get_unchecked(b));
                        acc[b & 1][k] = _mm256_fmadd_ps(s, d, acc[b & 1][k]);
                        if KIND != 1 {
                            corr[b & 1][k] = off.mul_add(*a.s.get_unchecked(b), corr[b & 1][k]);
                        }
                    }
                }
            }
            let mut out = [0f32; N];
            for k in 0..N {
                // SAFETY: this function's CPU features are available (its contract).
                out[k] = unsafe {
                    hsum(_mm256_add_ps(acc[0][k], acc[1][k])) + (corr[0][k] + corr[1][k])
                };
            }
            out
        }

        macro_rules! u32block_wrappers {
            ($dot:ident, $dot4:ident, $bytes:expr, $kind:expr) => {
                pub(crate) fn $dot(row: &[u8], a: &Act<'_>) -> f32 {
                    // SAFETY: installed only when this module's CPU features were detected; the frame passes whole
                    // rows and activations prepared (with sums) for the row length.
                    unsafe { dot_u32blocks::<1, $bytes, $kind>(row, [a])[0] }
                }
                pub(crate) fn $dot4(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
                    // SAFETY: as above, for four activations.
                    *out = unsafe {
                        dot_u32blocks::<4, $bytes, $kind>(row, [&acts[0], &acts[1], &acts[2], &acts[3]])
                    };
                }
            };
        }
        u32block_wrappers!(dot_q4_1, dot4_q4_1, 20, 0);
        u32block_wrappers!(dot_q5_0, dot4_q5_0, 22, 1);
        u32block_wrappers!(dot_q5_1, dot4_q5_1, 24, 2);

        // ---------------------------------------------------------------------------------------------
        // K-quants × Q8_K.

        /// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) row · `N` Q8_K activations. Per super-block:
        /// for each 64-chunk, `maddubs` of the unsigned values with the activation bytes, `madd` with
        /// the sub-block scales into exact i32 lanes; the minimum term `Σ m_j·Σx` from the activation
        /// group sums in scalar integers.
        ///
        /// # Safety
        /// `row` is whole super-blocks; every act has values, scales and group sums for each;
        /// this module's CPU features available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_q45k<const N: usize, const FIVE: bool>(row: &[u8], acts: [&Act<'_>; N]) -> [f32; N] {
            let bytes = if FIVE { 176 } else { 144 };
            let nb = row.len() / bytes;
            debug_assert!(acts
                .iter()
                .all(|a| a.q.len() >= nb * 256 && a.bs.len() >= nb * 16));
            let mut acc = [_mm256_setzero_ps(); N];
            let mut corr = [0f32; N];
            let low = _mm256_set1_epi8(0x0F);
            for b in 0..nb {
                // SAFETY: super-block `b` < nb lies within `row`; act entries for it exist.
                unsafe {
                    let blk = row.as_ptr().add(b * bytes);
                    let d = f16_scalar(blk);
                    let dmin = f16_scalar(blk.add(2));
                    let scales = std::slice::from_raw_parts(blk.add(4), 12);
                    let mut sc = [0i16; 8];
                    let mut mn = [0i32; 8];
                    for j in 0..8 {
                        let (s_, m_) = scale_min_k4(j, scales);
                        sc[j] = s_ as i16;
                        mn[j] = m_ as i32;
                    }
                    let (qh, qs) = if FIVE {
                        (
                            _mm256_loadu_si256(blk.add(16) as *const __m256i),
                            blk.add(48),
                        )
                    } else {
                        (_mm256_setzero_si256(), blk.add(16))
                    };
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        let raw = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                        let mut lo = _mm256_and_si256(raw, low);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), low);
                        if FIVE {
                            let one = _mm256_set1_epi8(1);
                            let shift = _mm_cvtsi32_si128(2 * c as i32);
                            let h = _mm256_srl_epi16(qh, shift);
                            lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(h, one)));
                            let h1 = _mm256_srli_epi16::<1>(h);
                            hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(h1, one)));
                        }
                        let s_lo = _mm256_set1_epi16(sc[2 * c]);
                        let s_hi = _mm256_set1_epi16(sc[2 * c + 1]);
                        for k in 0..N {
                            let xq = acts[k].q.as_ptr().add(b * 256 + 64 * c);
                            let x0 = _mm256_loadu_si256(xq as *const __m256i);
                            let x1 = _mm256_loadu_si256(xq.add(32) as *const __m256i);
                            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s_lo);
                            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s_hi);
                            sumi[k] = _mm256_add_epi32(sumi[k], _mm256_add_epi32(p0, p1));
                        }
                    }
                    for k in 0..N {
                        let a = acts[k];
                        let bs = a.bs.get_unchecked(b * 16..b * 16 + 16);
                        let mut sum_m = 0i32;
                        for j in 0..8 {
                            sum_m += mn[j] * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
                        }
                        let dx = *a.d.get_unchecked(b);
                        acc[k] =
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[k]), _mm256_set1_ps(d * dx), acc[k]);
                        corr[k] = (dmin * dx).mul_add(sum_m as f32, corr[k]);
                    }
                }
            }
            // SAFETY: this function's CPU features are available (its contract).
            unsafe { hsums_less(acc, corr) }
        }

        /// Q6_K row · `N` Q8_K activations: unsigned 6-bit values (0..63) with `maddubs`, `madd` with the
        /// signed 16-group scales (exact i32), the −32 offset through the activation group sums.
        ///
        /// # Safety
        /// `row` is whole super-blocks; every act has values, scales and group sums for each;
        /// this module's CPU features available.
        #[inline]
        #[target_feature(enable = $feat)]
        unsafe fn dot_q6k_n<const N: usize>(row: &[u8], acts: [&Act<'_>; N]) -> [f32; N] {
            let nb = row.len() / 210;
            debug_assert!(acts
                .iter()
                .all(|a| a.q.len() >= nb * 256 && a.bs.len() >= nb * 16));
            let mut acc = [_mm256_setzero_ps(); N];
            let low = _mm256_set1_epi8(0x0F);
            let three = _mm256_set1_epi8(3);
            for b in 0..nb {
                // SAFETY: super-block `b` < nb lies within `row`; act entries for it exist.
                unsafe {
                    let blk = row.as_ptr().add(b * 210);
                    let d = f16_scalar(blk.add(208));
                    let sc = std::slice::from_raw_parts(blk.add(192) as *const i8, 16);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for n in 0..2 {
                        let ql0 = _mm256_loadu_si256(blk.add(64 * n) as *const __m256i);
                        let ql1 = _mm256_loadu_si256(blk.add(64 * n + 32) as *const __m256i);
                        let qh = _mm256_loadu_si256(blk.add(128 + 32 * n) as *const __m256i);
                        let h = |shift: i32| {
                            let v = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), three);
                            _mm256_slli_epi16::<4>(v)
                        };
                        let q = [
                            _mm256_or_si256(_mm256_and_si256(ql0, low), h(0)),
                            _mm256_or_si256(_mm256_and_si256(ql1, low), h(2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), low), h(4)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), low), h(6)),
                        ];
                        for (quarter, qv) in q.iter().enumerate() {
                            let g = 8 * n + 2 * quarter;
                            let scale = _mm256_set_m128i(
                                _mm_set1_epi16(sc[g + 1] as i16),
                                _mm_set1_epi16(sc[g] as i16),
                            );
                            for k in 0..N {
                                let xq = acts[k].q.as_ptr().add(b * 256 + 128 * n + 32 * quarter);
                                let x = _mm256_loadu_si256(xq as *const __m256i);
                                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(*qv, x), scale);
                                sumi[k] = _mm256_add_epi32(sumi[k], p);
                            }
                        }
                    }
                    for k in 0..N {
                        let a = acts[k];
                        let bs = a.bs.get_unchecked(b * 16..b * 16 + 16);
                        let mut off = 0i32;
                        for g in 0..16 {
                            off += sc[g] as i32 * bs[g] as i32;
                        }
                        let total =
                            _mm256_sub_epi32(sumi[k], _mm256_setr_epi32(32 * off, 0, 0, 0, 0, 0, 0, 0));
                        let dx = *a.d.get_unchecked(b);
                        acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_set1_ps(d * dx), acc[k]);
                    }
                }
            }
            // SAFETY: this function's CPU features are available (its contract).
            unsafe { hsums(acc) }
        }

        pub(crate) fn dot_q4_k(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: installed only when this module's CPU features were detected; the frame passes whole rows and
            // Q8_K activations prepared for the row length.
            unsafe { dot_q45k::<1, false>(row, [a])[0] }
        }
        pub(crate) fn dot4_q4_k(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
            // SAFETY: as in `dot_q4_k`.
            *out = unsafe { dot_q45k::<4, false>(row, [&acts[0], &acts[1], &acts[2], &acts[3]]) };
        }
        pub(crate) fn dot_q5_k(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: as in `dot_q4_k`.
            unsafe { dot_q45k::<1, true>(row, [a])[0] }
        }
        pub(crate) fn dot4_q5_k(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
            // SAFETY: as in `dot_q4_k`.
            *out = unsafe { dot_q45k::<4, true>(row, [&acts[0], &acts[1], &acts[2], &acts[3]]) };
        }
        pub(crate) fn dot_q6_k(row: &[u8], a: &Act<'_>) -> f32 {
            // SAFETY: as in `dot_q4_k`.
            unsafe { dot_q6k_n::<1>(row, [a])[0] }
        }
        pub(crate) fn dot4_q6_k(row: &[u8], acts: &[Act<'_>; 4], out: &mut [f32; 4]) {
            // SAFETY: as in `dot_q4_k`.
            *out = unsafe { dot_q6k_n::<4>(row, [&acts[0], &acts[1], &acts[2], &acts[3]]) };
        }

        }
    };
}

int_kernels!(avx2, "avx2,fma,f16c", "AVX2 + FMA + F16C instantiation.", {
    /// Σ over 32 lanes of `w[i]·x[i]` for signed bytes, as 8 i32 lanes (sign trick:
    /// |w| · sign(x, w) with `maddubs`, exact because |w|, |x| ≤ 127 keep the i16 pair sums in
    /// range).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_i8(w: __m256i, x: __m256i) -> __m256i {
        let aw = _mm256_sign_epi8(w, w);
        let sx = _mm256_sign_epi8(x, w);
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1))
    }

    /// Σ of `u[i]·x[i]` for unsigned bytes `u` ≤ 63 and signed `x`, as 8 i32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_u4_i8(u: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
    }

    /// `init + Σ lo·x0 + Σ hi·x1` per i32 lane (unsigned nibbles, signed activations; the i16
    /// pair sums stay within ±7 620).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_pair(
        init: __m256i,
        lo: __m256i,
        x0: __m256i,
        hi: __m256i,
        x1: __m256i,
    ) -> __m256i {
        let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
        _mm256_add_epi32(init, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }

    /// Σ of `(u[i] − OFF)·x[i]` for unsigned bytes `u` ≤ 31 and signed `x`, as 8 i32 lanes:
    /// the i16 pair sums of `u·x` and `OFF·x` are subtracted before widening (all exact: the
    /// pair sums stay within ±8 000).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_u_off<const OFF: i8>(u: __m256i, x: __m256i) -> __m256i {
        let p = _mm256_maddubs_epi16(u, x);
        let o = _mm256_maddubs_epi16(_mm256_set1_epi8(OFF), x);
        _mm256_madd_epi16(_mm256_sub_epi16(p, o), _mm256_set1_epi16(1))
    }
});

int_kernels!(
    vnni,
    "avx2,fma,f16c",
    "AVX-512 VL + VNNI instantiation (256-bit vectors, `vpdpbusd`, EVEX-encoded through `asm!`
     so that the crate builds with Rust versions whose `target_feature` does not know
     `avx512vnni`). Used only when [`Backend::Avx512`](crate::Backend) was detected.",
    {
        /// `acc + Σ u·x` per i32 lane (u unsigned, x signed bytes): one `vpdpbusd`.
        ///
        /// # Safety
        /// The CPU has AVX-512 VL and VNNI (and AVX2).
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn dpbusd(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
            let mut acc = acc;
            // SAFETY: the caller guarantees AVX-512 VL + VNNI; the instruction only reads and
            // writes the three registers.
            unsafe {
                std::arch::asm!(
                    "{{evex}} vpdpbusd {acc}, {u}, {x}",
                    acc = inout(ymm_reg) acc,
                    u = in(ymm_reg) u,
                    x = in(ymm_reg) x,
                    options(pure, nomem, nostack, preserves_flags)
                );
            }
            acc
        }

        /// As the AVX2 `dot_i8`, with one `vpdpbusd`.
        ///
        /// # Safety
        /// AVX-512 VL + VNNI available.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn dot_i8(w: __m256i, x: __m256i) -> __m256i {
            let aw = _mm256_sign_epi8(w, w);
            let sx = _mm256_sign_epi8(x, w);
            // SAFETY: AVX-512 VL + VNNI available (caller).
            unsafe { dpbusd(_mm256_setzero_si256(), aw, sx) }
        }

        /// As the AVX2 `dot_u4_i8`, with one `vpdpbusd`.
        ///
        /// # Safety
        /// AVX-512 VL + VNNI available.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn dot_u4_i8(u: __m256i, x: __m256i) -> __m256i {
            // SAFETY: AVX-512 VL + VNNI available (caller).
            unsafe { dpbusd(_mm256_setzero_si256(), u, x) }
        }

        /// As the AVX2 `dot_pair`, with two `vpdpbusd`.
        ///
        /// # Safety
        /// AVX-512 VL + VNNI available.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn dot_pair(
            init: __m256i,
            lo: __m256i,
            x0: __m256i,
            hi: __m256i,
            x1: __m256i,
        ) -> __m256i {
            // SAFETY: AVX-512 VL + VNNI available (caller).
            unsafe { dpbusd(dpbusd(init, lo, x0), hi, x1) }
        }

        /// As the AVX2 `dot_u_off`, with two `vpdpbusd`.
        ///
        /// # Safety
        /// AVX-512 VL + VNNI available.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn dot_u_off<const OFF: i8>(u: __m256i, x: __m256i) -> __m256i {
            // SAFETY: AVX-512 VL + VNNI available (caller).
            unsafe {
                let o = dpbusd(_mm256_setzero_si256(), _mm256_set1_epi8(OFF), x);
                _mm256_sub_epi32(dpbusd(_mm256_setzero_si256(), u, x), o)
            }
        }
    }
);
