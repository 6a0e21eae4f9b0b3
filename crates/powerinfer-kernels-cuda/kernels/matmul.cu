// Dense and row-sparse matrix products: dst[t, row] = dot(W_j, x_t) with one warp per weight row.
//
// Weight: n_rows rows of K elements of type TY, `row_bytes` bytes apart. Row j of the weight is
// neuron `row = bucket ? bucket[j] : j` of the full matrix. x: T tokens of K floats (token-major).
// p: scores, T tokens of N floats, or NULL for a dense product. dst: T tokens of N floats.
// For every (j, t) the kernel writes dst[t * N + row]: the dot product when p is NULL or
// p[t * N + row] >= theta, else 0. It never writes the slice-local index j (unless row == j) and
// writes each output once, so a bucket without duplicates gives race-free results. Entries of
// rows that are not in the bucket are left untouched (the host zeroes them first).
// Quantized types need K % 32 == 0. Grid: (ceil(n_rows / warps per block), ceil(T / NT)).
#include "common.cuh"

#define NT 8

// Adds the partial dot products of this lane for up to NT tokens into acc.
template <int TY>
__device__ __forceinline__ void dot_tile(const u8* row, const float* x, int K, int ntok, int lane,
                                         float* acc) {
    if (TY == TY_F32) {
        const float* w = (const float*)row;
        if ((K & 3) == 0) {
            const float4* w4 = (const float4*)w;
            for (int i = lane; i < (K >> 2); i += 32) {
                float4 a = w4[i];
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < ntok) {
                        float4 b = ((const float4*)(x + (long)t * K))[i];
                        acc[t] += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
                    }
                }
            }
        } else {
            for (int i = lane; i < K; i += 32) {
                float a = w[i];
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (t < ntok) acc[t] += a * x[(long)t * K + i];
            }
        }
    } else if (TY == TY_F16) {
        const u16* w = (const u16*)row;
        if ((K & 7) == 0) {
            const uint4* w8 = (const uint4*)w;
            for (int i = lane; i < (K >> 3); i += 32) {
                uint4 q = w8[i];
                float a[8];
                a[0] = h2f((u16)(q.x & 0xffff)); a[1] = h2f((u16)(q.x >> 16));
                a[2] = h2f((u16)(q.y & 0xffff)); a[3] = h2f((u16)(q.y >> 16));
                a[4] = h2f((u16)(q.z & 0xffff)); a[5] = h2f((u16)(q.z >> 16));
                a[6] = h2f((u16)(q.w & 0xffff)); a[7] = h2f((u16)(q.w >> 16));
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < ntok) {
                        const float4* xb = (const float4*)(x + (long)t * K) + 2 * i;
                        float4 b0 = xb[0], b1 = xb[1];
                        acc[t] += a[0] * b0.x + a[1] * b0.y + a[2] * b0.z + a[3] * b0.w +
                                  a[4] * b1.x + a[5] * b1.y + a[6] * b1.z + a[7] * b1.w;
                    }
                }
            }
        } else {
            for (int i = lane; i < K; i += 32) {
                float a = h2f(w[i]);
#pragma unroll
                for (int t = 0; t < NT; t++)
                    if (t < ntok) acc[t] += a * x[(long)t * K + i];
            }
        }
    } else {
        // Quantized: 8 lanes per 32-element block, 4 consecutive elements per lane.
        int nb = K >> 5;
        int sub = lane & 7;
        for (int b = lane >> 3; b < nb; b += 4) {
            float a[4];
            if (TY == TY_Q8_0) {
                const u8* blk = row + (long)b * Q8_0_BYTES;
                float d = h2f(*(const u16*)blk);
#pragma unroll
                for (int e = 0; e < 4; e++) a[e] = d * (float)(i8)blk[2 + sub * 4 + e];
            } else {
                const u8* blk = row + (long)b * Q4_0_BYTES;
                float d = h2f(*(const u16*)blk);
                int shift = sub < 4 ? 0 : 4;
                int base = (sub & 3) * 4;
#pragma unroll
                for (int e = 0; e < 4; e++)
                    a[e] = d * (float)(((blk[2 + base + e] >> shift) & 15) - 8);
            }
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < ntok) {
                    float4 xv = *((const float4*)(x + (long)t * K + b * 32 + sub * 4));
                    acc[t] += a[0] * xv.x + a[1] * xv.y + a[2] * xv.z + a[3] * xv.w;
                }
            }
        }
    }
}

template <int TY>
__device__ __forceinline__ void matmul_rows(const u8* w, long row_bytes, int n_rows, int K,
                                            const float* x, int T, const float* p,
                                            const u32* bucket, float theta, int N, float* dst) {
    int lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= n_rows) return;
    int t0 = blockIdx.y * NT;
    int ntok = min(NT, T - t0);
    if (ntok <= 0) return;
    long row = bucket ? (long)bucket[j] : (long)j;
    bool act[NT];
    bool any = false;
#pragma unroll
    for (int t = 0; t < NT; t++) {
        act[t] = t < ntok && (p == 0 || p[(long)(t0 + t) * N + row] >= theta);
        any = any || act[t];
    }
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    if (any) dot_tile<TY>(w + (long)j * row_bytes, x + (long)t0 * K, K, ntok, lane, acc);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < ntok) {
            float s = warp_sum(acc[t]);
            if (lane == 0) dst[(long)(t0 + t) * N + row] = act[t] ? s : 0.0f;
        }
    }
}

#define MATMUL(NAME, TY)                                                                       \
    extern "C" __global__ void NAME(const u8* w, long row_bytes, int n_rows, int K,            \
                                    const float* x, int T, const float* p, const u32* bucket,  \
                                    float theta, int N, float* dst) {                          \
        matmul_rows<TY>(w, row_bytes, n_rows, K, x, T, p, bucket, theta, N, dst);              \
    }

MATMUL(matmul_f32, TY_F32)
MATMUL(matmul_f16, TY_F16)
MATMUL(matmul_q8_0, TY_Q8_0)
MATMUL(matmul_q4_0, TY_Q4_0)
