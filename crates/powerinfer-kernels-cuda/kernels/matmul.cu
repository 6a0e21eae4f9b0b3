// Dense and row-sparse matrix products: dst[t, row] = dot(W_j, x_t), and the activation quantizer
// the quantized products read.
//
// Weight: n_rows rows of K elements of type TY, `row_bytes` bytes apart. Row j of the weight is
// neuron `row = bucket ? bucket[j] : j` of the full matrix. x: T tokens of K floats (token-major)
// for F32/F16 weights; for Q8_0/Q4_0 weights the same T x K activation quantized by quantize_q8
// (`x` then points to its bytes, see there). p: scores, T tokens of N floats, or NULL for a dense
// product. dst: T tokens of N floats.
// For every (j, t) the kernel writes dst[t * N + row]: the dot product when p is NULL or
// p[t * N + row] >= theta, else 0. It never writes the slice-local index j (unless row == j) and
// writes each output once, so a bucket without duplicates gives race-free results. Entries of
// rows that are not in the bucket are left untouched (the host zeroes them first).
// Quantized types need K % 32 == 0. Grid: (ceil(n_rows / 8), ceil(T / tokens per block)), 256
// threads (8 warps), 8 rows per block. matmul_* take NT = 8 tokens per block, one warp per row.
// matmul_*_t1 take one token (the decode path): the block first finds its active rows and then
// spreads their work over all 8 warps (a lone active row of a sparse product gets 8 warps, so 8x
// the loads in flight and an 8x shorter dependent chain; a dense block keeps one warp per row).
//
// Memory access: each lane keeps U independent weight loads in flight per loop iteration (loads
// past the end of the row are predicated off). Quantized blocks are only 2-byte aligned, so a
// lane of the 8-token kernels reads its 4 weight bytes as two u16 loads; 8 lanes share a block so
// that the activation reads stay contiguous across the warp. The one-token quantized kernels
// instead copy chunks of 32 blocks into shared memory with aligned 16-byte cp.async copies and
// give each lane a whole block (see dot_quant_t1).
//
// Quantized products use integer dot products, as the CPU kernels do: per 32-block of a token,
// x is quantized to int8 q = round(x / d) with the f32 scale d = max|x| / 127 (the numbers of
// powerinfer-kernels-cpu's reference::matmul::quantize_activation, bit for bit), and each lane
// adds d_w * d_x * dp4a(w, q) for its 4 elements.
#include "common.cuh"

#define NT 8

// dot(a[0..4], b[0..4]) of signed bytes plus c.
__device__ __forceinline__ int dp4a_s8(u32 a, u32 b, int c) {
#ifdef CUDA_EMULATION
    for (int k = 0; k < 4; k++) c += (int)(i8)(a >> (8 * k)) * (int)(i8)(b >> (8 * k));
    return c;
#else
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
#endif
}

// Quantizes n_blocks blocks of 32 floats (T tokens of K, K % 32 == 0, are T * K / 32 blocks) to
// xq: n_blocks * 32 int8 values, then n_blocks f32 scales (at byte offset n_blocks * 32). Per
// block d = amax / 127, id = 1 / d (0 when amax = 0), q = trunc(x * id + copysign(0.5-, x * id))
// clamped to +-127: round half away from zero, the same IEEE operations as the CPU quantizer.
// One warp per block, 8 blocks per block of 256 threads.
extern "C" __global__ void quantize_q8(const float* x, long n_blocks, u8* xq) {
    long b = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (b >= n_blocks) return;
    quantize_q8_lane(x[b * 32 + lane], b, lane, n_blocks, xq);
}

// y[i] = x[i] rounded to f16 and back: what F16 products multiply (the CPU kernels, as
// ggml's, round the activation to f16 before multiplying F16 rows).
extern "C" __global__ void round_f16(const float* x, float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = h2f(f2h(x[i]));
}

// acc[t] += dot(weights a[0..8], x_t[c..c + 8]) for the first ntok (at most NTT) tokens.
template <int NTT>
__device__ __forceinline__ void fma8(const float* a, const float* x, int K, int c, int ntok,
                                     float* acc) {
#pragma unroll
    for (int t = 0; t < NTT; t++) {
        if (NTT == 1 || t < ntok) {
            const float4* xb = (const float4*)(x + (long)t * K + c);
            float4 b0 = xb[0], b1 = xb[1];
            acc[t] += a[0] * b0.x + a[1] * b0.y + a[2] * b0.z + a[3] * b0.w + a[4] * b1.x +
                      a[5] * b1.y + a[6] * b1.z + a[7] * b1.w;
        }
    }
}

// F32 rows: U float4 loads in flight per lane when K % 4 == 0. `lane` is 0..L-1 of the L lanes
// that share the row. One step (loop iteration) covers U * L float4s from i; loads past the end
// of the row are predicated off. (One guarded loop rather than an unguarded main loop and a tail:
// the guards cost little and ptxas then keeps the register count low.)
template <int NTT, int U>
__device__ __forceinline__ void step_f32(const float4* w4, const float* x, int K, int n4, int i,
                                         int L, int ntok, float* acc) {
    float4 a[U];
#pragma unroll
    for (int u = 0; u < U; u++)
        if (i + L * u < n4) a[u] = w4[i + L * u];
#pragma unroll
    for (int u = 0; u < U; u++) {
        if (i + L * u < n4) {
#pragma unroll
            for (int t = 0; t < NTT; t++) {
                if (NTT == 1 || t < ntok) {
                    float4 b = ((const float4*)(x + (long)t * K))[i + L * u];
                    acc[t] += a[u].x * b.x + a[u].y * b.y + a[u].z * b.z + a[u].w * b.w;
                }
            }
        }
    }
}

template <int NTT, int U>
__device__ __forceinline__ void dot_f32(const u8* row, const float* x, int K, int ntok, int lane,
                                        int L, float* acc) {
    const float* w = (const float*)row;
    if ((K & 3) == 0) {
        const float4* w4 = (const float4*)w;
        int n4 = K >> 2, i = lane;
        for (; i < n4; i += L * U) step_f32<NTT, U>(w4, x, K, n4, i, L, ntok, acc);
    } else {
        for (int i = lane; i < K; i += L) {
            float a = w[i];
#pragma unroll
            for (int t = 0; t < NTT; t++)
                if (NTT == 1 || t < ntok) acc[t] += a * x[(long)t * K + i];
        }
    }
}

// 8 halves of q as floats.
__device__ __forceinline__ void halves8(uint4 q, float* a) {
    a[0] = h2f((u16)(q.x & 0xffff));
    a[1] = h2f((u16)(q.x >> 16));
    a[2] = h2f((u16)(q.y & 0xffff));
    a[3] = h2f((u16)(q.y >> 16));
    a[4] = h2f((u16)(q.z & 0xffff));
    a[5] = h2f((u16)(q.z >> 16));
    a[6] = h2f((u16)(q.w & 0xffff));
    a[7] = h2f((u16)(q.w >> 16));
}

// F16 rows: U 16-byte loads (8 halves each) in flight per lane when K % 8 == 0; steps as F32.
template <int NTT, int U>
__device__ __forceinline__ void step_f16(const uint4* w8, const float* x, int K, int n8, int i,
                                         int L, int ntok, float* acc) {
    uint4 q[U];
#pragma unroll
    for (int u = 0; u < U; u++)
        if (i + L * u < n8) q[u] = w8[i + L * u];
#pragma unroll
    for (int u = 0; u < U; u++) {
        if (i + L * u < n8) {
            float a[8];
            halves8(q[u], a);
            fma8<NTT>(a, x, K, 8 * (i + L * u), ntok, acc);
        }
    }
}

template <int NTT, int U>
__device__ __forceinline__ void dot_f16(const u8* row, const float* x, int K, int ntok, int lane,
                                        int L, float* acc) {
    const u16* w = (const u16*)row;
    if ((K & 7) == 0) {
        const uint4* w8 = (const uint4*)w;
        int n8 = K >> 3, i = lane;
        for (; i < n8; i += L * U) step_f16<NTT, U>(w8, x, K, n8, i, L, ntok, acc);
    } else {
        for (int i = lane; i < K; i += L) {
            float a = h2f(w[i]);
#pragma unroll
            for (int t = 0; t < NTT; t++)
                if (NTT == 1 || t < ntok) acc[t] += a * x[(long)t * K + i];
        }
    }
}

// acc += d_w * d_x * dot(w, q) for one lane's 4 elements of a quantized block: w the 4 weight
// bytes as loaded, nibble `shift` selecting the Q4_0 half; h the block's f16 weight scale; q the
// 4 int8 activation values, dx their block's scale.
template <int TY>
__device__ __forceinline__ float quant_dot(u32 w, u16 h, int shift, u32 q, float dx) {
    if (TY == TY_Q4_0) {
        // Nibbles 0..15 to signed bytes n - 8: n + 120 stays below 256 (no carry between bytes)
        // and flipping bit 7 subtracts 128 modulo 256.
        w = (((w >> shift) & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u;
    }
    // |s| <= 4 * 128 * 127 < 2^22: s as a float by the 2^23 + 2^22 bias trick (an integer add
    // and a float subtraction, both full rate, instead of a conversion).
    int s = dp4a_s8(w, q, 0);
    float sf = __int_as_float(s + 0x4B400000) - 12582912.0f;
    return (h2f(h) * dx) * sf;
}

// Quantized rows: lane part s = lane % 8 of block b holds elements 4s..4s+3 (Q8_0: bytes
// 2 + 4s..; Q4_0: low nibbles of bytes 2 + 4s.. for s < 4, high nibbles of bytes 2 + 4(s - 4)..
// otherwise), so a step of L lanes covers BS = L / 8 consecutive blocks; a loop iteration has U
// steps in flight, from block b. xq: the quantized activation of the tile's first token (K int8
// per token), xd its block scales (K / 32 per token; the activation is small and stays cached,
// so it is read after the weights).
template <int TY, int NTT, int U>
__device__ __forceinline__ void step_quant(const u8* row, const u8* xq, const float* xd, int K,
                                           int nb, int b, int s, int BS, int ntok, float* acc) {
    const int bb = TY == TY_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES;
    const int off = TY == TY_Q8_0 ? 2 + 4 * s : 2 + 4 * (s & 3);
    const int shift = TY == TY_Q8_0 ? 0 : (s & 4);
    u32 w[U];
    u16 h[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        int bu = b + BS * u;
        if (bu < nb) {
            const u8* blk = row + (long)bu * bb;
            h[u] = *(const u16*)blk;
            w[u] = load_u32_a2(blk + off);
        }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        int bu = b + BS * u;
        if (bu < nb) {
#pragma unroll
            for (int t = 0; t < NTT; t++) {
                if (NTT == 1 || t < ntok) {
                    u32 q = *(const u32*)(xq + (long)t * K + bu * 32 + 4 * s);
                    acc[t] += quant_dot<TY>(w[u], h[u], shift, q, xd[(long)t * nb + bu]);
                }
            }
        }
    }
}

template <int TY, int NTT, int U>
__device__ __forceinline__ void dot_quant(const u8* row, const u8* xq, const float* xd, int K,
                                          int ntok, int lane, int L, float* acc) {
    const int BS = L / 8;
    int nb = K >> 5, s = lane & 7, b = lane >> 3;
    for (; b < nb; b += BS * U) step_quant<TY, NTT, U>(row, xq, xd, K, nb, b, s, BS, ntok, acc);
}

// One-token quantized rows (matmul_q8_0_t1 / matmul_q4_0_t1): a lane owns whole 32-blocks. The
// row is cut into chunks of 32 consecutive blocks (576 bytes of Q4_0, 1088 of Q8_0); the G warps
// sharing a row take chunks g, g + G, g + 2G, ... and a warp keeps U chunks in flight per loop
// iteration (U = 4: a whole row of K = 4096). A chunk is copied from global to the warp's shared
// staging area with aligned 16-byte cp.async copies, one commit group per chunk, and the lanes
// wait for chunk u only when they reach it (no registers held, U * 37 or U * 69 of them per warp
// in flight; the one or two 16-byte pieces at the chunk's ends that stick out of it are copied as
// u16 instead, so nothing outside the row is read). Then lane l takes block l of the chunk from shared memory (aligned u32
// reads, shifted by a byte permute since blocks are only 2-byte aligned), its 32 activation
// values (two 16-byte loads, cached) and their scale, and adds d_w * d_x * (the block's exact
// integer dot product, 8 dp4a).
#define CHUNK_BLOCKS 32

__device__ __forceinline__ u32 smem_addr(const void* p) {
#ifdef CUDA_EMULATION
    return 0;
#else
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
#endif
}

// 16 bytes from global `src` (16-byte aligned) to shared `dst` (16-byte aligned), asynchronously.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
#ifdef CUDA_EMULATION
    memcpy(dst, src, 16);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src)
                 : "memory");
#endif
}

// Closes the group of this thread's cp.async copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
#ifndef CUDA_EMULATION
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most n (0..3) of this thread's committed groups are still pending.
__device__ __forceinline__ void cp_async_wait_group(int n) {
#ifndef CUDA_EMULATION
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    }
#endif
}

// Copies bytes [s, e) of global memory (s, e even, e - s <= 16 * (SLOTS - 1)) to shared `dst`,
// the byte at global address a landing at dst + (a - (s & ~15)). All 32 lanes of the warp call it.
template <int SLOTS>
__device__ __forceinline__ void stage_chunk(u8* dst, const u8* s, const u8* e, int lane) {
    const u8* a0 = (const u8*)((unsigned long long)s & ~15ull);
#pragma unroll
    for (int k = 0; k < (SLOTS + 31) / 32; k++) {
        int i = lane + 32 * k;
        const u8* q = a0 + 16 * i;
        if (i < SLOTS && q < e) {
            if (q >= s && q + 16 <= e) {
                cp_async16(dst + 16 * i, q);
            } else {
                for (int b = 0; b < 16; b += 2)
                    if (q + b >= s && q + b < e)
                        *(u16*)(dst + 16 * i + b) = *(const u16*)(q + b);
            }
        }
    }
}

// The 4-byte word at the 2-byte aligned shared offset o: byte permute of two aligned words.
__device__ __forceinline__ void words_a2(const u8* sh, int o, int n, u32* out) {
    const u32* w = (const u32*)(sh + (o & ~3));
    u32 sel = (o & 2) ? 0x5432u : 0x3210u;
    u32 lo = w[0];
#pragma unroll
    for (int i = 0; i < n; i++) {
        u32 hi = w[i + 1];
        out[i] = __byte_perm(lo, hi, sel);
        lo = hi;
    }
}

// acc += d_w * d_x * dot(block, x block) for one block staged at shared offset o.
template <int TY>
__device__ __forceinline__ float block_dot(const u8* sh, int o, const u8* xq, float dx) {
    const uint4* xv = (const uint4*)xq;
    uint4 x0 = xv[0], x1 = xv[1];
    u32 xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
    u16 h = *(const u16*)(sh + o);
    // Two independent dp4a chains, added at the end.
    int s0 = 0, s1 = 0;
    if (TY == TY_Q4_0) {
        u32 w[4];
        words_a2(sh, o + 2, 4, w);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            // sum (n - 8) q = sum n q - 8 sum q: the nibbles n (0..15, element 4i.. in the low
            // nibbles of word i, element 16 + 4i.. in its high ones) are non-negative bytes as
            // they are, and 0xF8F8F8F8 is four bytes of -8 (one and / shift+and per 4 nibbles
            // instead of and, add, xor).
            u32 lo = w[i] & 0x0F0F0F0Fu;
            u32 hi = (w[i] >> 4) & 0x0F0F0F0Fu;
            s0 = dp4a_s8(lo, xs[i], s0);
            s1 = dp4a_s8(hi, xs[4 + i], s1);
            s0 = dp4a_s8(0xF8F8F8F8u, xs[i], s0);
            s1 = dp4a_s8(0xF8F8F8F8u, xs[4 + i], s1);
        }
    } else {
        u32 w[8];
        words_a2(sh, o + 2, 8, w);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s0 = dp4a_s8(w[i], xs[i], s0);
            s1 = dp4a_s8(w[4 + i], xs[4 + i], s1);
        }
    }
    int s = s0 + s1;
    // |s| <= 32 * 128 * 127 < 2^22: exact as a float by the bias trick (see quant_dot).
    float sf = __int_as_float(s + 0x4B400000) - 12582912.0f;
    return (h2f(h) * dx) * sf;
}

// One lane's part of a one-token quantized row shared by G warps (warp g of them): see above.
// stage: the warp's U * SLOTS * 16 bytes of shared memory.
template <int TY, int U, int G>
__device__ __forceinline__ float dot_quant_t1(const u8* row, const u8* xq, const float* xd, int K,
                                              int g, int lane, u8* stage) {
    const int bb = TY == TY_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES;
    const int SLOTS = CHUNK_BLOCKS * bb / 16 + 1;
    int nb = K >> 5, nc = (nb + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
    float acc = 0.0f;
    for (int c0 = g; c0 < nc; c0 += G * U) {
        // One cp.async group per chunk (empty past the row's end), so that chunk u is used as
        // soon as it has landed while the later ones are still in flight.
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + G * u;
            if (c < nc) {
                int b0 = c * CHUNK_BLOCKS, b1 = min(nb, b0 + CHUNK_BLOCKS);
                stage_chunk<SLOTS>(stage + u * SLOTS * 16, row + (long)b0 * bb,
                                   row + (long)b1 * bb, lane);
            }
            cp_async_commit();
        }
        // Not unrolled: the blocks come from shared memory and L1, and ptxas keeps it in 48
        // registers.
#pragma unroll 1
        for (int u = 0; u < U; u++) {
            int c = c0 + G * u;
            int b = c * CHUNK_BLOCKS + lane;
            // Chunk u's group complete in every lane (the u16 copies of its ends included).
            cp_async_wait_group(U - 1 - u);
            __syncwarp();
            if (c < nc && b < nb) {
                const u8* s = row + (long)c * CHUNK_BLOCKS * bb;
                int o = u * SLOTS * 16 + (int)((unsigned long long)s & 15) + lane * bb;
                acc += block_dot<TY>(stage, o, xq + (long)b * 32, xd[b]);
            }
        }
        // The staging area is overwritten by the next iteration's copies.
        __syncwarp();
    }
    return acc;
}

// Adds the partial dot products of lane `lane` (of the L lanes sharing the row, a multiple of 32)
// for up to NTT tokens into acc. x: the tile's first token is at x + xoff (quantized types: at
// xoff of the quantized activation, whose scales follow its T * K values).
template <int TY, int NTT>
__device__ __forceinline__ void dot_tile(const u8* row, const float* x, long xoff, int T, int K,
                                         int ntok, int lane, int L, float* acc) {
    if (TY == TY_F32) {
        dot_f32<NTT, NTT == 1 ? 4 : 1>(row, x + xoff, K, ntok, lane, L, acc);
    } else if (TY == TY_F16) {
        dot_f16<NTT, NTT == 1 ? 4 : 2>(row, x + xoff, K, ntok, lane, L, acc);
    } else {
        const u8* xq = (const u8*)x;
        const float* xd = (const float*)(xq + (long)T * K);
        dot_quant<TY, NTT, NTT == 1 ? 8 : 1>(row, xq + xoff, xd + (xoff >> 5), K, ntok, lane, L,
                                             acc);
    }
}

// One warp per row, NTT tokens per block (grid y).
template <int TY, int NTT>
__device__ __forceinline__ void matmul_rows(const u8* w, long row_bytes, int n_rows, int K,
                                            const float* x, int T, const float* p,
                                            const u32* bucket, float theta, int N, float* dst) {
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n_rows) return;
    int t0 = blockIdx.y * NTT;
    int ntok = min(NTT, T - t0);
    if (ntok <= 0) return;
    long row = bucket ? (long)bucket[j] : (long)j;
    bool act[NTT];
    bool any = false;
#pragma unroll
    for (int t = 0; t < NTT; t++) {
        act[t] = t < ntok && (p == 0 || p[(long)(t0 + t) * N + row] >= theta);
        any = any || act[t];
    }
    float acc[NTT];
#pragma unroll
    for (int t = 0; t < NTT; t++) acc[t] = 0.0f;
    if (any)
        dot_tile<TY, NTT>(w + (long)j * row_bytes, x, (long)t0 * K, T, K, ntok, lane, 32, acc);
#pragma unroll
    for (int t = 0; t < NTT; t++) {
        if (t < ntok) {
            float s = warp_sum(acc[t]);
            if (lane == 0) dst[(long)(t0 + t) * N + row] = act[t] ? s : 0.0f;
        }
    }
}

// One-token kernels: per warp, quantized types stage U = 4 chunks of SLOTS 16-byte slots (see
// dot_quant_t1); a block's 8 warps, plus 16 bytes that the last block's word reads may touch.
#define T1_U 4
#define T1_WARP_STAGE(TY)                                                                     \
    ((TY) == TY_Q8_0 || (TY) == TY_Q4_0                                                       \
         ? T1_U * (CHUNK_BLOCKS * ((TY) == TY_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES) / 16 + 1)       \
         : 0)
#define T1_STAGE(TY) (8 * T1_WARP_STAGE(TY) + 1)

// Lane `lane` of warp g (of the G = 1, 2, 4 or 8 warps sharing the row) of one token's dot
// product with row r, to be added over the warp and the G warps: whole chunks staged in `st`
// (the warp's T1_WARP_STAGE) for quantized types, interleaved float loads for the others. x: the
// token's activation (quantized: its K int8 values, with its K / 32 scales at xd).
template <int TY>
__device__ __forceinline__ float row_dot_t1(const u8* r, const float* x, const float* xd, int K,
                                            int G, int g, int lane, u8* st) {
    float acc[1] = {0.0f};
    if (TY == TY_Q8_0 || TY == TY_Q4_0) {
        const u8* xq = (const u8*)x;
        if (G == 1) return dot_quant_t1<TY, T1_U, 1>(r, xq, xd, K, g, lane, st);
        if (G == 2) return dot_quant_t1<TY, T1_U, 2>(r, xq, xd, K, g, lane, st);
        if (G == 4) return dot_quant_t1<TY, T1_U, 4>(r, xq, xd, K, g, lane, st);
        return dot_quant_t1<TY, T1_U, 8>(r, xq, xd, K, g, lane, st);
    }
    // One inlined copy per G, so that the strides are constants (fewer registers).
    int gl = g * 32 + lane;
    if (G == 1) {
        dot_tile<TY, 1>(r, x, 0, 1, K, 1, gl, 32, acc);
    } else if (G == 2) {
        dot_tile<TY, 1>(r, x, 0, 1, K, 1, gl, 64, acc);
    } else if (G == 4) {
        dot_tile<TY, 1>(r, x, 0, 1, K, 1, gl, 128, acc);
    } else {
        dot_tile<TY, 1>(r, x, 0, 1, K, 1, gl, 256, acc);
    }
    return acc[0];
}

// Lane 0 of the warp for slice row j of a one-token block: *slot = j when the row exists and is
// active (p == NULL or p[row] >= theta, row = bucket ? bucket[j] : j), else -1, and an inactive
// row's output is written 0. The caller synchronizes the block before reading the slots.
__device__ __forceinline__ void mark_active_row(int j, int n_rows, const float* p,
                                                const u32* bucket, float theta, float* dst,
                                                int lane, int* slot) {
    if (lane != 0) return;
    int a = -1;
    if (j < n_rows) {
        long row = bucket ? (long)bucket[j] : (long)j;
        if (p == 0 || p[row] >= theta) {
            a = j;
        } else {
            dst[row] = 0.0f;
        }
    }
    *slot = a;
}

// One token: the block's 8 warps first find which of its 8 rows are active (p >= theta, or all
// for a dense product) and write 0 for the inactive ones; then the n active rows share the warps,
// G = 8 / (n rounded up to a power of two) warps per row, interleaved over the row (G = 1 for a
// dense block, 8 for a single active row), and the G partial sums are added in shared memory.
template <int TY>
__device__ __forceinline__ void matmul_rows_t1(const u8* w, long row_bytes, int n_rows, int K,
                                               const float* x, int T, const float* p,
                                               const u32* bucket, float theta, int N,
                                               float* dst) {
    __shared__ int active[8];  // per warp of the block: its row j when active, else -1
    __shared__ float part[8];  // per warp: its partial sum
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int j = blockIdx.x * 8 + warp;
    mark_active_row(j, n_rows, p, bucket, theta, dst, lane, active + warp);
    __syncthreads();
    // Every thread reads the same flags, so n, G and the early return are uniform in the block.
    int n = 0, mine = -1;
#pragma unroll
    for (int k = 0; k < 8; k++) n += active[k] >= 0;
    if (n == 0) return;
    int G = n > 4 ? 1 : (n > 2 ? 2 : (n > 1 ? 4 : 8));
    int slot = warp / G, g = warp % G;
    int c = 0;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        if (active[k] >= 0) {
            if (c == slot) mine = active[k];
            c++;
        }
    }
    __shared__ uint4 stage[T1_STAGE(TY)];
    // One token: the quantized activation's scales follow its K values.
    const float* xd = (const float*)((const u8*)x + K);
    float acc = mine >= 0 ? row_dot_t1<TY>(w + (long)mine * row_bytes, x, xd, K, G, g, lane,
                                           (u8*)(stage + warp * T1_WARP_STAGE(TY)))
                          : 0.0f;
    float s = warp_sum(acc);
    if (G == 1) {
        if (mine >= 0 && lane == 0) dst[bucket ? (long)bucket[mine] : (long)mine] = s;
        return;
    }
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (mine >= 0 && g == 0 && lane == 0) {
        float sum = 0.0f;
        for (int k = 0; k < G; k++) sum += part[warp + k];
        dst[bucket ? (long)bucket[mine] : (long)mine] = sum;
    }
}

// MINB: blocks per SM the registers must allow (__launch_bounds__): 5 for the one-token kernels
// (at most 48 registers, 40 warps per SM to keep weight loads in flight), 3 for the tiled ones.
#define MATMUL(NAME, TY, NTT, MINB)                                                            \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                    \
        NAME(const u8* w, long row_bytes, int n_rows, int K, const float* x, int T,           \
             const float* p, const u32* bucket, float theta, int N, float* dst) {              \
        if (NTT == 1)                                                                          \
            matmul_rows_t1<TY>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);       \
        else                                                                                   \
            matmul_rows<TY, NTT>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);     \
    }

MATMUL(matmul_f32, TY_F32, NT, 3)
MATMUL(matmul_f16, TY_F16, NT, 3)
MATMUL(matmul_q8_0, TY_Q8_0, NT, 3)
MATMUL(matmul_q4_0, TY_Q4_0, NT, 3)
MATMUL(matmul_f32_t1, TY_F32, 1, 5)
MATMUL(matmul_f16_t1, TY_F16, 1, 5)
MATMUL(matmul_q8_0_t1, TY_Q8_0, 1, 5)
MATMUL(matmul_q4_0_t1, TY_Q4_0, 1, 5)

// Tensor-core products for many tokens (matmul_*_mma; the prompt blocks and decode batches of
// more than NT tokens). A block of MMA_WARPS warps covers MMA_ROWS weight rows, 16 per warp, and
// MMA_TOKENS tokens, 8 tiles of 8: each step along K loads the warp's 16 rows' part of the step
// once into an mma A fragment and multiplies it with every token tile, so a weight row is read
// once per 64 tokens. Rows past n_rows and tokens past T enter as zeros and are not written.
// Quantized rows (matmul_q8_0_mma, matmul_q4_0_mma): a step is one 32-block; the int8 mma gives
// each (row, token) the block's exact integer dot product, added as (d_w * d_x) * dot as the
// other kernels do. F16 rows (matmul_f16_mma): a step is 16 elements; the activation (already
// rounded to f16 values by round_f16) is converted exactly and the mma accumulates in f32.
// Outputs as the other kernels: dst[t * N + row] = the product, or 0 where p[t * N + row] < theta.
#define MMA_WARPS 4
#define MMA_ROWS (16 * MMA_WARPS)
#define MMA_TILES 8
#define MMA_TOKENS (8 * MMA_TILES)

// d += A (16 x 32 int8) * B (32 x 8 int8), one warp (PTX mma.m16n8k32 fragments). Lane
// l = 4 g + q holds a[0]: row g, k 4q..4q+3; a[1]: row g + 8, the same k; a[2]: row g,
// k 16 + 4q..; a[3]: row g + 8, k 16 + 4q..; b[0]: column g, k 4q..4q+3; b[1]: column g,
// k 16 + 4q..; d[0], d[1]: row g, columns 2q, 2q + 1; d[2], d[3]: row g + 8, the same columns.
__device__ __forceinline__ void mma_s8(int* d, const u32* a, const u32* b) {
#ifdef CUDA_EMULATION
    emu_mma_m16n8k32_s8(d, a, b);
#else
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// d += A (16 x 16 f16) * B (16 x 8 f16) in f32, one warp (PTX mma.m16n8k16 fragments; each
// register two halves, the lower k in the low half): a[0]: row g, k 2q, 2q + 1; a[1]: row g + 8;
// a[2]: row g, k 8 + 2q..; a[3]: row g + 8, k 8 + 2q..; b[0]: column g, k 2q..; b[1]: column g,
// k 8 + 2q..; d as mma_s8.
__device__ __forceinline__ void mma_f16(float* d, const u32* a, const u32* b) {
#ifdef CUDA_EMULATION
    emu_mma_m16n8k16_f16(d, a, b);
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Writes a warp's 16 x 64 tile of results: acc[n][i] is row j0 + g (+ 8 for i >= 2), token
// t0 + 8n + 2q + (i & 1).
__device__ __forceinline__ void mma_store(float (*acc)[4], int j0, int n_rows, int t0, int T,
                                          const float* p, const u32* bucket, float theta, int N,
                                          float* dst) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int n = 0; n < MMA_TILES; n++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int j = j0 + g + 8 * (i >> 1);
            long t = t0 + 8 * n + 2 * q + (i & 1);
            if (j < n_rows && t < T) {
                long row = bucket ? (long)bucket[j] : (long)j;
                bool on = p == 0 || p[t * N + row] >= theta;
                dst[t * N + row] = on ? acc[n][i] : 0.0f;
            }
        }
    }
}

// Nibbles 0..15 of the 4 bytes w (low nibbles when shift is 0, high ones when 4) as the signed
// bytes n - 8: n + 120 stays below 256 (no carry between bytes), flipping bit 7 subtracts 128.
__device__ __forceinline__ u32 q4_bytes(u32 w, int shift) {
    return (((w >> shift) & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u;
}

// A fragment half (a[0], a[2] or a[1], a[3]) and scale of one row's block: its bytes
// 4q..4q+3 and 16 + 4q.. of the 32 int8 values, zeros and scale 0 for a row past the end.
template <int TY>
__device__ __forceinline__ float mma_quant_rows(const u8* blk, bool valid, int q, u32* lo,
                                                u32* hi) {
    if (!valid) {
        *lo = 0;
        *hi = 0;
        return 0.0f;
    }
    if (TY == TY_Q4_0) {
        u32 v = load_u32_a2(blk + 2 + 4 * q);
        *lo = q4_bytes(v, 0);
        *hi = q4_bytes(v, 4);
    } else {
        *lo = load_u32_a2(blk + 2 + 4 * q);
        *hi = load_u32_a2(blk + 18 + 4 * q);
    }
    return h2f(*(const u16*)blk);
}

template <int TY>
__device__ __forceinline__ void matmul_rows_mma_quant(const u8* w, long row_bytes, int n_rows,
                                                      int K, const float* x, int T,
                                                      const float* p, const u32* bucket,
                                                      float theta, int N, float* dst) {
    const int bb = TY == TY_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES;
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int j0 = blockIdx.x * MMA_ROWS + (threadIdx.x >> 5) * 16;
    int t0 = blockIdx.y * MMA_TOKENS;
    // Uniform in the warp: no barrier below involves other warps.
    if (j0 >= n_rows || t0 >= T) return;
    int tiles = min(MMA_TILES, (T - t0 + 7) / 8);
    int nb = K >> 5;
    const u8* xq = (const u8*)x;
    const float* xd = (const float*)(xq + (long)T * K);
    bool va = j0 + g < n_rows, vb = j0 + g + 8 < n_rows;
    const u8* ra = w + (long)(va ? j0 + g : 0) * row_bytes;
    const u8* rb = w + (long)(vb ? j0 + g + 8 : 0) * row_bytes;
    float acc[MMA_TILES][4];
#pragma unroll
    for (int n = 0; n < MMA_TILES; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
#pragma unroll 2
    for (int kb = 0; kb < nb; kb++) {
        u32 a[4];
        float da = mma_quant_rows<TY>(ra + (long)kb * bb, va, q, &a[0], &a[2]);
        float db = mma_quant_rows<TY>(rb + (long)kb * bb, vb, q, &a[1], &a[3]);
#pragma unroll
        for (int n = 0; n < MMA_TILES; n++) {
            if (n < tiles) {
                // B: token t0 + 8n + g (column g); C: tokens t0 + 8n + 2q, 2q + 1.
                long tb = t0 + 8 * n + g, tc = t0 + 8 * n + 2 * q;
                u32 b[2] = {0, 0};
                if (tb < T) {
                    const u8* xb = xq + tb * K + kb * 32 + 4 * q;
                    b[0] = *(const u32*)xb;
                    b[1] = *(const u32*)(xb + 16);
                }
                int c[4] = {0, 0, 0, 0};
                mma_s8(c, a, b);
                float x0 = tc < T ? xd[tc * nb + kb] : 0.0f;
                float x1 = tc + 1 < T ? xd[(tc + 1) * nb + kb] : 0.0f;
                acc[n][0] += (da * x0) * (float)c[0];
                acc[n][1] += (da * x1) * (float)c[1];
                acc[n][2] += (db * x0) * (float)c[2];
                acc[n][3] += (db * x1) * (float)c[3];
            }
        }
    }
    mma_store(acc, j0, n_rows, t0, T, p, bucket, theta, N, dst);
}

// Halves k and k + 1 of an F16 row as one register (the lower k in the low half): one aligned
// u32 load when ALIGNED (K % 16 == 0 and 4-byte aligned rows), else two guarded u16 loads.
template <bool ALIGNED>
__device__ __forceinline__ u32 mma_halves(const u16* row, bool valid, int k, int K) {
    if (!valid) return 0;
    if (ALIGNED) return *(const u32*)(row + k);
    u32 lo = k < K ? row[k] : 0, hi = k + 1 < K ? row[k + 1] : 0;
    return lo | (hi << 16);
}

// Activation values k and k + 1 of a token as two halves (exact: they are f16 values already).
__device__ __forceinline__ u32 mma_x_halves(const float* xt, int k, int K) {
    u32 lo = k < K ? f2h(xt[k]) : 0, hi = k + 1 < K ? f2h(xt[k + 1]) : 0;
    return lo | (hi << 16);
}

template <bool ALIGNED>
__device__ __forceinline__ void matmul_rows_mma_f16(const u8* w, long row_bytes, int n_rows,
                                                    int K, const float* x, int T, const float* p,
                                                    const u32* bucket, float theta, int N,
                                                    float* dst) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    int j0 = blockIdx.x * MMA_ROWS + (threadIdx.x >> 5) * 16;
    int t0 = blockIdx.y * MMA_TOKENS;
    if (j0 >= n_rows || t0 >= T) return;
    int tiles = min(MMA_TILES, (T - t0 + 7) / 8);
    bool va = j0 + g < n_rows, vb = j0 + g + 8 < n_rows;
    const u16* ra = (const u16*)(w + (long)(va ? j0 + g : 0) * row_bytes);
    const u16* rb = (const u16*)(w + (long)(vb ? j0 + g + 8 : 0) * row_bytes);
    float acc[MMA_TILES][4];
#pragma unroll
    for (int n = 0; n < MMA_TILES; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
#pragma unroll 2
    for (int k0 = 0; k0 < K; k0 += 16) {
        int k = k0 + 2 * q;
        u32 a[4] = {mma_halves<ALIGNED>(ra, va, k, K), mma_halves<ALIGNED>(rb, vb, k, K),
                    mma_halves<ALIGNED>(ra, va, k + 8, K), mma_halves<ALIGNED>(rb, vb, k + 8, K)};
#pragma unroll
        for (int n = 0; n < MMA_TILES; n++) {
            if (n < tiles) {
                long tb = t0 + 8 * n + g;
                u32 b[2] = {0, 0};
                if (tb < T) {
                    const float* xt = x + tb * K;
                    b[0] = mma_x_halves(xt, k, K);
                    b[1] = mma_x_halves(xt, k + 8, K);
                }
                mma_f16(acc[n], a, b);
            }
        }
    }
    mma_store(acc, j0, n_rows, t0, T, p, bucket, theta, N, dst);
}

// The quantized kernels are bounded to 3 blocks (12 warps) per SM: 168 registers without spills
// (unbounded, ptxas takes ~200 for the 8 token tiles' loads in flight: 2 blocks per SM).
#define MATMUL_MMA_ARGS                                                                        \
    const u8 *w, long row_bytes, int n_rows, int K, const float *x, int T, const float *p,     \
        const u32 *bucket, float theta, int N, float *dst
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 3) matmul_q8_0_mma(MATMUL_MMA_ARGS) {
    matmul_rows_mma_quant<TY_Q8_0>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);
}
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS, 3) matmul_q4_0_mma(MATMUL_MMA_ARGS) {
    matmul_rows_mma_quant<TY_Q4_0>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);
}
extern "C" __global__ void __launch_bounds__(32 * MMA_WARPS) matmul_f16_mma(MATMUL_MMA_ARGS) {
    if ((K & 15) == 0 && (row_bytes & 3) == 0 && ((unsigned long long)w & 3) == 0)
        matmul_rows_mma_f16<true>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);
    else
        matmul_rows_mma_f16<false>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);
}

// A gated FFN's hot neurons for each token (matmul_gated_*_t1; grid (ceil(n_rows / 8), T), 256
// threads): dst[t * N + row] = gate_act(kind, gate_j · x_t, up_j · x_t) for the block's rows j
// active for token t (row = bucket ? bucket[j] : j, p[t * N + row] >= theta), 0 for its
// inactive ones: the gate and up products and the activation in one launch. wg and wu: the gate
// and up rows of one bucket, of one type and row_bytes. x: token t's activation at t * K floats
// (quantized: the T * K int8 values, then the scales, as quantize_q8 writes them). As in
// matmul_*_t1 the block's 8 warps first find its active rows; the n active rows have 2n products
// ("halves"): up to 4 rows, G = 8 / (2n rounded up to a power of two) warps per half; from 5
// rows, warp k computes both halves of active row k. Then one thread per active row adds the
// halves' parts and writes the activation. With count (T floats, zeroed by the caller), each
// block adds its active rows to count[t].
template <int TY>
__device__ __forceinline__ void gated_rows_t1(const u8* wg, const u8* wu, long row_bytes,
                                              int n_rows, int K, const float* x, int T,
                                              const float* p, const u32* bucket, float theta,
                                              int N, int kind, float* count, float* dst) {
    __shared__ int active[8];
    __shared__ float part[2][8];  // [gate, up][warp]
    __shared__ uint4 stage[T1_STAGE(TY)];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int t = blockIdx.y;
    int j = blockIdx.x * 8 + warp;
    const bool quant = TY == TY_Q8_0 || TY == TY_Q4_0;
    // Token t's activation: its K floats, or its K int8 values and (after all T tokens' values)
    // its K / 32 scales.
    const float* xt = quant ? (const float*)((const u8*)x + (long)t * K) : x + (long)t * K;
    const float* xd = (const float*)((const u8*)x + (long)T * K) + (long)t * (K >> 5);
    const float* pt = p ? p + (long)t * N : 0;
    float* dt = dst + (long)t * N;
    mark_active_row(j, n_rows, pt, bucket, theta, dt, lane, active + warp);
    __syncthreads();
    int n = 0, list[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        list[k] = -1;
        if (active[k] >= 0) list[n++] = active[k];
    }
    // The neurons token t computes, added up over the blocks (count_active's count).
    if (count && threadIdx.x == 0 && n > 0) atomicAdd(count + t, (float)n);
    if (n == 0) return;
    u8* st = (u8*)(stage + warp * T1_WARP_STAGE(TY));
    float dots[2] = {0.0f, 0.0f};
    int G = 1, half = -1;
    if (n <= 4) {
        int h2 = 2 * n;
        G = h2 > 4 ? 1 : (h2 > 2 ? 2 : 4);
        half = warp / G;  // halves 2k (gate) and 2k + 1 (up) of active row k
        if (half < h2) {
            int g = warp % G, row = list[half >> 1];
            const u8* r = ((half & 1) ? wu : wg) + (long)row * row_bytes;
            dots[0] = row_dot_t1<TY>(r, xt, xd, K, G, g, lane, st);
        }
    } else if (warp < n) {
        int row = list[warp];
        for (int m = 0; m < 2; m++) {
            const u8* r = (m ? wu : wg) + (long)row * row_bytes;
            dots[m] = row_dot_t1<TY>(r, xt, xd, K, 1, 0, lane, st);
        }
    }
    float s0 = warp_sum(dots[0]), s1 = warp_sum(dots[1]);
    if (lane == 0) {
        part[0][warp] = s0;
        part[1][warp] = s1;
    }
    __syncthreads();
    if (threadIdx.x < n) {
        int k = threadIdx.x;
        float gs = 0.0f, us = 0.0f;
        if (n <= 4) {
            for (int i = 0; i < G; i++) {
                gs += part[0][(2 * k) * G + i];
                us += part[0][(2 * k + 1) * G + i];
            }
        } else {
            gs = part[0][k];
            us = part[1][k];
        }
        int row = list[k];
        dt[bucket ? (long)bucket[row] : (long)row] = gate_act(kind, gs, us);
    }
}

// 4 blocks per SM (at most 64 registers): at 5 (48) the two products' state spills.
#define GATED(NAME, TY)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 4)                                       \
        NAME(const u8* wg, const u8* wu, long row_bytes, int n_rows, int K, const float* x,    \
             int T, const float* p, const u32* bucket, float theta, int N, int kind,           \
             float* count, float* dst) {                                                       \
        gated_rows_t1<TY>(wg, wu, row_bytes, n_rows, K, x, T, p, bucket, theta, N, kind,       \
                          count, dst);                                                         \
    }

GATED(matmul_gated_f32_t1, TY_F32)
GATED(matmul_gated_f16_t1, TY_F16)
GATED(matmul_gated_q8_0_t1, TY_Q8_0)
GATED(matmul_gated_q4_0_t1, TY_Q4_0)
