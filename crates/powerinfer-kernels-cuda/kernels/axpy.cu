// Sparse axpy over the down rows of a GPU slice: for every token t,
//   dst[t, c] += sum over j of a'[t, j] * W[j, c],   a'[t, j] = a[t * N + row] if selected else 0,
// with row = bucket ? bucket[j] : j, and neuron `row` selected for token t when
// (p == NULL or p[t * N + row] >= theta) and a[t * N + row] != 0.
// Weight: n_rows rows of M elements of type TY, `row_bytes` apart (M % 32 == 0 when quantized).
// dst: T tokens of M floats, which the host zeroes first (or not, to add the product to what dst
// holds: Gpu::sparse_axpy_add). Blocks add their partial sums into dst
// with atomicAdd: several row chunks may update the same output, never losing an update.
//
// axpy_*_t1 (per token, the decode path). Grid: (ceil(M / (8 * T1_THREADS)),
// ceil(n_rows / T1_ROWS), T), T1_THREADS threads. A block first compacts the selected rows of
// its T1_ROWS (in order, by warp ballots) into a shared list of (row, activation), returns when
// there is none, and then visits only those rows, T1_U rows in flight per thread. Each thread
// owns 8 consecutive columns: one 16-byte load per row for F16, two for F32, 8 bytes of a block
// (plus its scale) for Q8_0 / Q4_0 (Q4_0: the low or high nibbles of 8 bytes). Partial sums go
// through shared memory so that the atomicAdds of a warp hit consecutive addresses.
// F32 / F16 rows whose length or stride does not allow 16-byte loads, and the last columns of
// a row, are read element by element.
//
// axpy_*_t8 (many tokens). Grid: (ceil(M / blockDim.x), ceil(n_rows / ROWS_PER_BLOCK),
// ceil(T / 8)); one output column per thread. A block stages the selected activations of its
// ROWS_PER_BLOCK rows and 8 tokens in shared memory, skips rows whose activations are all zero
// for its tokens and accumulates in registers (each weight element loaded once per 8 tokens).
#include "common.cuh"

#define ROWS_PER_BLOCK 128

#define T1_THREADS 256
#define T1_ROWS 64
#define T1_U 4

// 8 consecutive weights of one row starting at column c (c % 8 == 0), as loaded.
struct W8 {
    uint4 a, b;
};

template <int TY>
__device__ __forceinline__ W8 load_w8(const u8* row, int c) {
    W8 r;
    if (TY == TY_F32) {
        const uint4* q = (const uint4*)(row + 4 * (long)c);
        r.a = q[0];
        r.b = q[1];
    } else if (TY == TY_F16) {
        r.a = *(const uint4*)(row + 2 * (long)c);
        r.b = r.a;
    } else {
        const int bb = TY == TY_Q8_0 ? Q8_0_BYTES : Q4_0_BYTES;
        const u8* blk = row + (long)(c >> 5) * bb;
        int part = (c & 31) >> 3;
        int off = TY == TY_Q8_0 ? 2 + 8 * part : 2 + 8 * (part & 1);
        r.a.x = load_u32_a2(blk + off);
        r.a.y = load_u32_a2(blk + off + 4);
        r.a.z = *(const u16*)blk;
        r.a.w = (u32)part;
        r.b = r.a;
    }
    return r;
}

// acc[e] += v * weight e of w.
template <int TY>
__device__ __forceinline__ void fma_w8(const W8& w, float v, float* acc) {
    if (TY == TY_F32) {
        acc[0] += v * __int_as_float((int)w.a.x);
        acc[1] += v * __int_as_float((int)w.a.y);
        acc[2] += v * __int_as_float((int)w.a.z);
        acc[3] += v * __int_as_float((int)w.a.w);
        acc[4] += v * __int_as_float((int)w.b.x);
        acc[5] += v * __int_as_float((int)w.b.y);
        acc[6] += v * __int_as_float((int)w.b.z);
        acc[7] += v * __int_as_float((int)w.b.w);
    } else if (TY == TY_F16) {
        acc[0] += v * h2f((u16)(w.a.x & 0xffff));
        acc[1] += v * h2f((u16)(w.a.x >> 16));
        acc[2] += v * h2f((u16)(w.a.y & 0xffff));
        acc[3] += v * h2f((u16)(w.a.y >> 16));
        acc[4] += v * h2f((u16)(w.a.z & 0xffff));
        acc[5] += v * h2f((u16)(w.a.z >> 16));
        acc[6] += v * h2f((u16)(w.a.w & 0xffff));
        acc[7] += v * h2f((u16)(w.a.w >> 16));
    } else {
        float s = v * h2f((u16)w.a.z);
        u32 lo = w.a.x, hi = w.a.y;
        float bias;
        if (TY == TY_Q8_0) {
            lo ^= 0x80808080u;  // int8 -> biased uint8 (q + 128)
            hi ^= 0x80808080u;
            bias = 8388736.0f;
        } else {
            int shift = (w.a.w & 2) ? 4 : 0;
            lo = (lo >> shift) & 0x0F0F0F0Fu;
            hi = (hi >> shift) & 0x0F0F0F0Fu;
            bias = 8388616.0f;
        }
#pragma unroll
        for (int k = 0; k < 4; k++) {
            acc[k] += s * byte_f(lo, k, bias);
            acc[4 + k] += s * byte_f(hi, k, bias);
        }
    }
}

template <int TY>
__device__ __forceinline__ void axpy_t1(const u8* w, long row_bytes, int n_rows, int M,
                                        const float* a, int T, const float* p,
                                        const u32* bucket, float theta, int N, float* dst) {
    __shared__ int lrow[T1_ROWS];
    __shared__ float lact[T1_ROWS];
    __shared__ int wcount[T1_ROWS / 32];
    __shared__ float4 part[2 * T1_THREADS];
    int tid = threadIdx.x, lane = tid & 31;
    int j0 = blockIdx.y * T1_ROWS;
    int nrow = min(T1_ROWS, n_rows - j0);
    int t = blockIdx.z;
    if (nrow <= 0 || t >= T) return;
    // Ordered compaction of the selected rows (warp-uniform: T1_ROWS % 32 == 0).
    if (tid < T1_ROWS) {
        float v = 0.0f;
        if (tid < nrow) {
            long k = (long)t * N + (bucket ? (long)bucket[j0 + tid] : (long)(j0 + tid));
            float av = a[k];  // loaded with the score, not after it
            if (p == 0 || p[k] >= theta) v = av;
        }
        u32 live = __ballot_sync(0xffffffffu, v != 0.0f);
        if (lane == 0) wcount[tid >> 5] = __popc(live);
        if (v != 0.0f) {
            int pos = __popc(live & ((1u << lane) - 1u));
            lrow[(tid >> 5) * 32 + pos] = tid;
            lact[(tid >> 5) * 32 + pos] = v;
        }
    }
    __syncthreads();
    // The rows selected by warp w sit at lrow[32 w .. 32 w + wcount[w]).
    int total = 0;
#pragma unroll
    for (int s = 0; s < T1_ROWS / 32; s++) total += wcount[s];
    if (total == 0) return;  // block-uniform
    int c0 = (blockIdx.x * T1_THREADS + tid) * 8;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = 0.0f;
    const u8* wb = w + (long)j0 * row_bytes;
    bool vec = TY == TY_Q8_0 || TY == TY_Q4_0 ||
               ((M & 7) == 0 && (row_bytes & 15) == 0);
    if (c0 < M) {
#pragma unroll 1
        for (int seg = 0; seg < T1_ROWS / 32; seg++) {
            int n = wcount[seg];
            const int* rl = lrow + 32 * seg;
            const float* al = lact + 32 * seg;
            if (vec && c0 + 8 <= M) {
                int i = 0;
                for (; i + T1_U <= n; i += T1_U) {
                    W8 q[T1_U];
#pragma unroll
                    for (int u = 0; u < T1_U; u++) q[u] = load_w8<TY>(wb + rl[i + u] * row_bytes, c0);
#pragma unroll
                    for (int u = 0; u < T1_U; u++) fma_w8<TY>(q[u], al[i + u], acc);
                }
                for (; i < n; i++) fma_w8<TY>(load_w8<TY>(wb + rl[i] * row_bytes, c0), al[i], acc);
            } else {
                for (int i = 0; i < n; i++) {
                    const u8* r = wb + rl[i] * row_bytes;
                    for (int e = 0; e < 8 && c0 + e < M; e++) acc[e] += al[i] * weight_at<TY>(r, c0 + e);
                }
            }
        }
    }
    // Transpose through shared memory: the atomics of a warp then cover consecutive columns.
    float4 lo, hi;
    lo.x = acc[0], lo.y = acc[1], lo.z = acc[2], lo.w = acc[3];
    hi.x = acc[4], hi.y = acc[5], hi.z = acc[6], hi.w = acc[7];
    part[2 * tid] = lo;
    part[2 * tid + 1] = hi;
    __syncthreads();
    const float* pf = (const float*)part;
    int base = blockIdx.x * T1_THREADS * 8;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        int i = e * T1_THREADS + tid;
        float v = pf[i];
        if (base + i < M && v != 0.0f) atomicAdd(dst + (long)t * M + base + i, v);
    }
}

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

#define AXPY_T1(NAME, TY)                                                                      \
    extern "C" __global__ void NAME(const u8* w, long row_bytes, int n_rows, int M,            \
                                    const float* a, int T, const float* p, const u32* bucket,  \
                                    float theta, int N, float* dst) {                          \
        axpy_t1<TY>(w, row_bytes, n_rows, M, a, T, p, bucket, theta, N, dst);                  \
    }

AXPY_T1(axpy_f32_t1, TY_F32)
AXPY_T1(axpy_f16_t1, TY_F16)
AXPY_T1(axpy_q8_0_t1, TY_Q8_0)
AXPY_T1(axpy_q4_0_t1, TY_Q4_0)
AXPY(axpy_f32_t8, TY_F32, 8)
AXPY(axpy_f16_t8, TY_F16, 8)
AXPY(axpy_q8_0_t8, TY_Q8_0, 8)
AXPY(axpy_q4_0_t8, TY_Q4_0, 8)
