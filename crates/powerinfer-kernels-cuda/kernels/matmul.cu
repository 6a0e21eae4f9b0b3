// Dense and row-sparse matrix products: dst[t, row] = dot(W_j, x_t) with one warp per weight row.
//
// Weight: n_rows rows of K elements of type TY, `row_bytes` bytes apart. Row j of the weight is
// neuron `row = bucket ? bucket[j] : j` of the full matrix. x: T tokens of K floats (token-major).
// p: scores, T tokens of N floats, or NULL for a dense product. dst: T tokens of N floats.
// For every (j, t) the kernel writes dst[t * N + row]: the dot product when p is NULL or
// p[t * N + row] >= theta, else 0. It never writes the slice-local index j (unless row == j) and
// writes each output once, so a bucket without duplicates gives race-free results. Entries of
// rows that are not in the bucket are left untouched (the host zeroes them first).
// Quantized types need K % 32 == 0. Grid: (ceil(n_rows / warps per block), ceil(T / tokens per
// block)): matmul_* take NT = 8 tokens per block, matmul_*_t1 one token per block (the decode
// path: fewer registers, more loads in flight per lane).
//
// Memory access: each lane keeps U independent weight loads in flight per loop iteration (the
// main loop runs while all U are in range, a one-step loop takes the tail). Quantized blocks are
// only 2-byte aligned, so a lane reads its 4 weight bytes as two u16 loads; 8 lanes share a block
// so that the x reads (one float4 per lane) stay contiguous across the warp.
#include "common.cuh"

#define NT 8

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

// F32 rows: U float4 loads in flight per lane when K % 4 == 0.
template <int NTT, int U>
__device__ __forceinline__ void dot_f32(const u8* row, const float* x, int K, int ntok, int lane,
                                        float* acc) {
    const float* w = (const float*)row;
    if ((K & 3) == 0) {
        const float4* w4 = (const float4*)w;
        int n4 = K >> 2, i = lane;
        for (; i + 32 * (U - 1) < n4; i += 32 * U) {
            float4 a[U];
#pragma unroll
            for (int u = 0; u < U; u++) a[u] = w4[i + 32 * u];
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int t = 0; t < NTT; t++) {
                    if (NTT == 1 || t < ntok) {
                        float4 b = ((const float4*)(x + (long)t * K))[i + 32 * u];
                        acc[t] += a[u].x * b.x + a[u].y * b.y + a[u].z * b.z + a[u].w * b.w;
                    }
                }
            }
        }
        for (; i < n4; i += 32) {
            float4 a = w4[i];
#pragma unroll
            for (int t = 0; t < NTT; t++) {
                if (NTT == 1 || t < ntok) {
                    float4 b = ((const float4*)(x + (long)t * K))[i];
                    acc[t] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                }
            }
        }
    } else {
        for (int i = lane; i < K; i += 32) {
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

// F16 rows: U 16-byte loads (8 halves each) in flight per lane when K % 8 == 0.
template <int NTT, int U>
__device__ __forceinline__ void dot_f16(const u8* row, const float* x, int K, int ntok, int lane,
                                        float* acc) {
    const u16* w = (const u16*)row;
    if ((K & 7) == 0) {
        const uint4* w8 = (const uint4*)w;
        int n8 = K >> 3, i = lane;
        for (; i + 32 * (U - 1) < n8; i += 32 * U) {
            uint4 q[U];
#pragma unroll
            for (int u = 0; u < U; u++) q[u] = w8[i + 32 * u];
#pragma unroll
            for (int u = 0; u < U; u++) {
                float a[8];
                halves8(q[u], a);
                fma8<NTT>(a, x, K, 8 * (i + 32 * u), ntok, acc);
            }
        }
        for (; i < n8; i += 32) {
            float a[8];
            halves8(w8[i], a);
            fma8<NTT>(a, x, K, 8 * i, ntok, acc);
        }
    } else {
        for (int i = lane; i < K; i += 32) {
            float a = h2f(w[i]);
#pragma unroll
            for (int t = 0; t < NTT; t++)
                if (NTT == 1 || t < ntok) acc[t] += a * x[(long)t * K + i];
        }
    }
}

// One lane's part of a quantized block: 4 consecutive elements c..c+3, from the 4 bytes w (as
// loaded) and the block's f16 scale h; nibble `shift` selects the Q4_0 half.
template <int TY, int NTT>
__device__ __forceinline__ void quant_fma(u32 w, u16 h, int shift, const float* x, int K, int c,
                                          int ntok, float* acc) {
    float q[4];
    if (TY == TY_Q8_0) {
        w ^= 0x80808080u;  // int8 -> biased uint8 (q + 128)
#pragma unroll
        for (int k = 0; k < 4; k++) q[k] = byte_f(w, k, 8388736.0f);
    } else {
        w = (w >> shift) & 0x0F0F0F0Fu;
#pragma unroll
        for (int k = 0; k < 4; k++) q[k] = byte_f(w, k, 8388616.0f);
    }
    float d = h2f(h);
#pragma unroll
    for (int t = 0; t < NTT; t++) {
        if (NTT == 1 || t < ntok) {
            float4 xv = *((const float4*)(x + (long)t * K + c));
            acc[t] += d * (q[0] * xv.x + q[1] * xv.y + q[2] * xv.z + q[3] * xv.w);
        }
    }
}

// Quantized rows: lane part s = lane % 8 of block b holds elements 4s..4s+3 (Q8_0: bytes
// 2 + 4s..; Q4_0: low nibbles of bytes 2 + 4s.. for s < 4, high nibbles of bytes 2 + 4(s - 4)..
// otherwise), so a warp step covers 4 consecutive blocks; U steps are in flight per iteration.
template <int TY, int NTT, int U>
__device__ __forceinline__ void dot_quant(const u8* row, const float* x, int K, int ntok,
                                          int lane, float* acc) {
    const int bb = TY == TY_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES;
    int nb = K >> 5, s = lane & 7;
    int off = TY == TY_Q8_0 ? 2 + 4 * s : 2 + 4 * (s & 3);
    int shift = TY == TY_Q8_0 ? 0 : (s & 4);
    int b = lane >> 3;
    for (; b + 4 * (U - 1) < nb; b += 4 * U) {
        u32 w[U];
        u16 h[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const u8* blk = row + (long)(b + 4 * u) * bb;
            h[u] = *(const u16*)blk;
            w[u] = load_u32_a2(blk + off);
        }
#pragma unroll
        for (int u = 0; u < U; u++)
            quant_fma<TY, NTT>(w[u], h[u], shift, x, K, (b + 4 * u) * 32 + 4 * s, ntok, acc);
    }
    for (; b < nb; b += 4) {
        const u8* blk = row + (long)b * bb;
        quant_fma<TY, NTT>(load_u32_a2(blk + off), *(const u16*)blk, shift, x, K, b * 32 + 4 * s,
                           ntok, acc);
    }
}

// Adds the partial dot products of this lane for up to NTT tokens into acc.
template <int TY, int NTT>
__device__ __forceinline__ void dot_tile(const u8* row, const float* x, int K, int ntok, int lane,
                                         float* acc) {
    if (TY == TY_F32) {
        dot_f32<NTT, NTT == 1 ? 4 : 1>(row, x, K, ntok, lane, acc);
    } else if (TY == TY_F16) {
        dot_f16<NTT, NTT == 1 ? 4 : 2>(row, x, K, ntok, lane, acc);
    } else {
        dot_quant<TY, NTT, NTT == 1 ? 8 : 1>(row, x, K, ntok, lane, acc);
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
    if (any) dot_tile<TY, NTT>(w + (long)j * row_bytes, x + (long)t0 * K, K, ntok, lane, acc);
#pragma unroll
    for (int t = 0; t < NTT; t++) {
        if (t < ntok) {
            float s = warp_sum(acc[t]);
            if (lane == 0) dst[(long)(t0 + t) * N + row] = act[t] ? s : 0.0f;
        }
    }
}

#define MATMUL(NAME, TY, NTT)                                                                  \
    extern "C" __global__ void NAME(const u8* w, long row_bytes, int n_rows, int K,            \
                                    const float* x, int T, const float* p, const u32* bucket,  \
                                    float theta, int N, float* dst) {                          \
        matmul_rows<TY, NTT>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);         \
    }

MATMUL(matmul_f32, TY_F32, NT)
MATMUL(matmul_f16, TY_F16, NT)
MATMUL(matmul_q8_0, TY_Q8_0, NT)
MATMUL(matmul_q4_0, TY_Q4_0, NT)
MATMUL(matmul_f32_t1, TY_F32, 1)
MATMUL(matmul_f16_t1, TY_F16, 1)
MATMUL(matmul_q8_0_t1, TY_Q8_0, 1)
MATMUL(matmul_q4_0_t1, TY_Q4_0, 1)
