// Sparse axpy over the down rows of a GPU slice: for every token t,
//   dst[t, c] += sum over j of a'[t, j] * W[j, c],   a'[t, j] = a[t * N + row] if selected else 0,
// with row = bucket ? bucket[j] : j, and neuron `row` selected for token t when
// (p == NULL or p[t * N + row] >= theta) and a[t * N + row] != 0.
// Weight: n_rows rows of M elements of type TY, `row_bytes` apart (M % 32 == 0 when quantized).
// dst: T tokens of M floats, which the host zeroes first.
//
// Grid: (ceil(M / blockDim.x), ceil(n_rows / ROWS_PER_BLOCK), ceil(T / NT)); one output column
// per thread. A block stages the selected activations of its ROWS_PER_BLOCK rows and NT tokens in
// shared memory, skips rows whose activations are all zero for its tokens, accumulates in
// registers and adds its partial sums into dst with atomicAdd: several row chunks may update the
// same output, never losing an update.
// NT = 1 is the sparse per-token kernel; NT = 8 is the tiled kernel for many tokens (each
// weight element loaded once per 8 tokens).
#include "common.cuh"

#define ROWS_PER_BLOCK 128

template <int TY, int NT>
__device__ __forceinline__ void axpy_rows(const u8* w, long row_bytes, int n_rows, int M,
                                          const float* a, int T, const float* p,
                                          const u32* bucket, float theta, int N, float* dst) {
    __shared__ float act[ROWS_PER_BLOCK][NT];
    __shared__ int live[ROWS_PER_BLOCK];
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    int j0 = blockIdx.y * ROWS_PER_BLOCK;
    int nrow = min(ROWS_PER_BLOCK, n_rows - j0);
    int t0 = blockIdx.z * NT;
    int ntok = min(NT, T - t0);
    if (nrow <= 0 || ntok <= 0) return;
    for (int i = threadIdx.x; i < ROWS_PER_BLOCK; i += blockDim.x) {
        int any = 0;
        long row = i < nrow ? (bucket ? (long)bucket[j0 + i] : (long)(j0 + i)) : 0;
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = 0.0f;
            if (i < nrow && t < ntok) {
                long k = (long)(t0 + t) * N + row;
                if (p == 0 || p[k] >= theta) v = a[k];
            }
            act[i][t] = v;
            any |= v != 0.0f;
        }
        live[i] = any;
    }
    __syncthreads();
    if (c >= M) return;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    for (int i = 0; i < nrow; i++) {
        if (!live[i]) continue;
        float wv = weight_at<TY>(w + (long)(j0 + i) * row_bytes, c);
#pragma unroll
        for (int t = 0; t < NT; t++) acc[t] += act[i][t] * wv;
    }
#pragma unroll
    for (int t = 0; t < NT; t++)
        if (t < ntok && acc[t] != 0.0f) atomicAdd(dst + (long)(t0 + t) * M + c, acc[t]);
}

#define AXPY(NAME, TY, NTOK)                                                                   \
    extern "C" __global__ void NAME(const u8* w, long row_bytes, int n_rows, int M,            \
                                    const float* a, int T, const float* p, const u32* bucket,  \
                                    float theta, int N, float* dst) {                          \
        axpy_rows<TY, NTOK>(w, row_bytes, n_rows, M, a, T, p, bucket, theta, N, dst);          \
    }

AXPY(axpy_f32_t1, TY_F32, 1)
AXPY(axpy_f16_t1, TY_F16, 1)
AXPY(axpy_q8_0_t1, TY_Q8_0, 1)
AXPY(axpy_q4_0_t1, TY_Q4_0, 1)
AXPY(axpy_f32_t8, TY_F32, 8)
AXPY(axpy_f16_t8, TY_F16, 8)
AXPY(axpy_q8_0_t8, TY_Q8_0, 8)
AXPY(axpy_q4_0_t8, TY_Q4_0, 8)
