// The non-matrix operators of a transformer layer. All tensors are row-major f32 unless noted.
#include "common.cuh"

// The residual add of a norm that follows one (add_rms_norm, add_layer_norm): x[r, i] += a[r, i]
// (when a is not null), written back to x, and the row's value. A thread reads and writes the
// same elements in every loop of a norm, so the later loops read its own sums.
__device__ __forceinline__ float residual(float* xr, const float* ar, int i) {
    if (!ar) return xr[i];
    float v = xr[i] + ar[i];
    xr[i] = v;
    return v;
}

// The conversion a norm writes beside its output for the products that read it (rms_norm_conv,
// layer_norm_conv): CONV_Q8 quantizes it to Q8_0 blocks as quantize_q8 does (n % 32 == 0:
// whole warps cover whole blocks; out: rows * n int8 values, then rows * n / 32 scales),
// CONV_F16 rounds it to f16 values as round_f16 does (out: rows * n floats).
#define CONV_NONE 0
#define CONV_Q8 1
#define CONV_F16 2
__device__ __forceinline__ void convert_out(int conv, float v, long i, long total, u8* out) {
    if (conv == CONV_Q8) {
        quantize_q8_lane(v, i >> 5, threadIdx.x & 31, total >> 5, out);
    } else if (conv == CONV_F16) {
        ((float*)out)[i] = h2f(f2h(v));
    }
}

// y[r, i] = x[r, i] / sqrt(mean_i(x[r, i]^2) + eps) * (w ? w[i] : 1), after x += a when a is not
// null; with conv, the converted output also into out (see convert_out; `rows` rows). One block
// per row. In place when y == x.
__device__ __forceinline__ void rms_norm_rows(float* x, const float* a, const float* w, float* y,
                                              int n, float eps, int conv = CONV_NONE,
                                              int rows = 0, u8* out = 0) {
    __shared__ float red[32];
    float* xr = x + (long)blockIdx.x * n;
    const float* ar = a ? a + (long)blockIdx.x * n : 0;
    float* yr = y + (long)blockIdx.x * n;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = residual(xr, ar, i);
        s += v * v;
    }
    s = block_sum(s, red);
    float scale = rsqrtf(s / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i] * scale * (w ? w[i] : 1.0f);
        yr[i] = v;
        convert_out(conv, v, (long)blockIdx.x * n + i, (long)rows * n, out);
    }
}

extern "C" __global__ void rms_norm(const float* x, const float* w, float* y, int n, float eps) {
    rms_norm_rows((float*)x, 0, w, y, n, eps);
}

// x += a (the residual), then rms_norm of x into y: one launch for an add and the norm after it.
extern "C" __global__ void add_rms_norm(float* x, const float* a, const float* w, float* y, int n,
                                        float eps) {
    rms_norm_rows(x, a, w, y, n, eps);
}

// y[r, i] = (x[r, i] - mean) / sqrt(var + eps) * (w ? w[i] : 1) + (b ? b[i] : 0), population
// variance (two passes over the row), after x += a when a is not null. One block per row; in
// place when y == x.
__device__ __forceinline__ void layer_norm_rows(float* x, const float* a, const float* w,
                                                const float* b, float* y, int n, float eps,
                                                int conv = CONV_NONE, int rows = 0,
                                                u8* out = 0) {
    __shared__ float red[32];
    float* xr = x + (long)blockIdx.x * n;
    const float* ar = a ? a + (long)blockIdx.x * n : 0;
    float* yr = y + (long)blockIdx.x * n;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += residual(xr, ar, i);
    float mean = block_sum(s, red) / (float)n;
    float v = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float d = xr[i] - mean;
        v += d * d;
    }
    float scale = rsqrtf(block_sum(v, red) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float o = (xr[i] - mean) * scale * (w ? w[i] : 1.0f) + (b ? b[i] : 0.0f);
        yr[i] = o;
        convert_out(conv, o, (long)blockIdx.x * n + i, (long)rows * n, out);
    }
}

extern "C" __global__ void layer_norm(const float* x, const float* w, const float* b, float* y,
                                      int n, float eps) {
    layer_norm_rows((float*)x, 0, w, b, y, n, eps);
}

// x += a (the residual), then layer_norm of x into y.
extern "C" __global__ void add_layer_norm(float* x, const float* a, const float* w,
                                          const float* b, float* y, int n, float eps) {
    layer_norm_rows(x, a, w, b, y, n, eps);
}

// rms_norm of `rows` rows into y, and y converted for the products that read it into out (conv:
// CONV_Q8 or CONV_F16, see convert_out): one launch for the norm and the conversion.
extern "C" __global__ void rms_norm_conv(const float* x, const float* w, float* y, int n,
                                         float eps, int rows, int conv, u8* out) {
    rms_norm_rows((float*)x, 0, w, y, n, eps, conv, rows, out);
}

// layer_norm of `rows` rows into y, and y converted into out (as rms_norm_conv).
extern "C" __global__ void layer_norm_conv(const float* x, const float* w, const float* b,
                                           float* y, int n, float eps, int rows, int conv,
                                           u8* out) {
    layer_norm_rows((float*)x, 0, w, b, y, n, eps, conv, rows, out);
}

// Rotary position embedding, in place, on x = T tokens of n_head heads of head_dim floats.
// The first n_rot dimensions of each head rotate; pair i (i < n_rot / 2) turns by angle
// freq_scale * pos[t] * theta_scale^i (theta_scale = base^(-2 / n_rot), computed by the host as
// the CPU kernels compute it), with the power taken by i repeated f32 products and cos and sin
// in f32: the CPU kernels' (and ggml's) operations. Normal mode (neox == 0) pairs (2i, 2i + 1);
// NeoX mode pairs (i, i + n_rot / 2). One thread per (token, head, pair); grid.y = T.
// Pair i of head h of token t of x (n_head heads): see rope.
__device__ __forceinline__ void rope_pair(float* x, const int* pos, int t, int n_head, int h, int i,
                                          int head_dim, int half, float theta_scale,
                                          float freq_scale, int neox) {
    float th = (float)pos[t];
    for (int k = 0; k < i; k++) th *= theta_scale;
    float theta = freq_scale * th;
    float c = cosf(theta), s = sinf(theta);
    float* v = x + ((long)t * n_head + h) * head_dim;
    int i0 = neox ? i : 2 * i;
    int i1 = neox ? i + half : 2 * i + 1;
    float a = v[i0], b = v[i1];
    v[i0] = a * c - b * s;
    v[i1] = a * s + b * c;
}

extern "C" __global__ void rope(float* x, const int* pos, int n_head, int head_dim, int n_rot,
                                float theta_scale, float freq_scale, int neox) {
    int half = n_rot / 2;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_head * half) return;
    rope_pair(x, pos, blockIdx.y, n_head, idx / half, idx % half, head_dim, half, theta_scale,
              freq_scale, neox);
}

// rope of q (n_head heads) and k (n_head_kv heads) in one launch: the threads past q's pairs
// take k's.
extern "C" __global__ void rope_qk(float* q, float* k, const int* pos, int n_head, int n_head_kv,
                                   int head_dim, int n_rot, float theta_scale, float freq_scale,
                                   int neox) {
    int half = n_rot / 2;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (n_head + n_head_kv) * half) return;
    int h = idx / half, i = idx % half;
    if (h < n_head)
        rope_pair(q, pos, blockIdx.y, n_head, h, i, head_dim, half, theta_scale, freq_scale, neox);
    else
        rope_pair(k, pos, blockIdx.y, n_head_kv, h - n_head, i, head_dim, half, theta_scale,
                  freq_scale, neox);
}

// Row softmax of scale * x, in place; one block per row of n floats.
extern "C" __global__ void softmax(float* x, int n, float scale) {
    __shared__ float red[32];
    float* r = x + (long)blockIdx.x * n;
    float m = -3.402823466e38f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) m = fmaxf(m, scale * r[i]);
    m = block_max(m, red);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float e = expf(scale * r[i] - m);
        r[i] = e;
        s += e;
    }
    s = block_sum(s, red);
    float inv = s > 0.0f ? 1.0f / s : 0.0f;  // a row of only -inf gives zeros
    for (int i = threadIdx.x; i < n; i += blockDim.x) r[i] *= inv;
}

// y[i] = max(x[i], 0)
extern "C" __global__ void relu(const float* x, float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(x[i], 0.0f);
}

// y[i] = a[i] + b[i]
extern "C" __global__ void add(const float* a, const float* b, float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

// y[i] += x[i]
extern "C" __global__ void add_inplace(const float* x, float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}

// y[i] = max(y[i], 0)
extern "C" __global__ void relu_inplace(float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fmaxf(y[i], 0.0f);
}

// y[i] = max(y[i], 0) rounded to f16 and back: relu_inplace and round_f16 in one launch (the
// predictor's hidden layer before an F16 fc2).
extern "C" __global__ void relu_round_f16_inplace(float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = h2f(f2h(fmaxf(y[i], 0.0f)));
}

// y[i] = max(g[i], 0) * (relu_u ? max(u[i], 0) : u[i])   (ReLU gating of a sparse FFN)
extern "C" __global__ void relu_gate(const float* g, const float* u, float* y, long n, int relu_u) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = gate_act(relu_u ? GATE_DRELU : GATE_RELU, g[i], u[i]);
}

// y[i] = silu(g[i]) * u[i] (SwiGLU; gate_act in common.cuh).
extern "C" __global__ void silu_gate(const float* g, const float* u, float* y, long n) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = gate_act(GATE_SILU, g[i], u[i]);
}

// y[i] += b[i % n] for `total` values: a bias added to every row of n.
extern "C" __global__ void add_rows(float* y, const float* b, int n, long total) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) y[i] += b[i % n];
}

// Row r of a table of `cols` elements of type TY (`row_bytes` apart) as floats:
// y[r, c] = W[rows[r] + offset, c]. Grid (ceil(cols / threads), n_rows).
template <int TY>
__device__ __forceinline__ void get_rows_t(const u8* w, long row_bytes, int cols,
                                           const int* rows, int offset, float* y) {
    int r = blockIdx.y;
    const u8* src = w + (long)(rows[r] + offset) * row_bytes;
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)
        y[(long)r * cols + c] = weight_at<TY>(src, c);
}

#define GET_ROWS(NAME, TY)                                                                    \
    extern "C" __global__ void NAME(const u8* w, long row_bytes, int cols, const int* rows,   \
                                    int offset, float* y) {                                   \
        get_rows_t<TY>(w, row_bytes, cols, rows, offset, y);                                  \
    }
GET_ROWS(get_rows_f32, TY_F32)
GET_ROWS(get_rows_f16, TY_F16)
GET_ROWS(get_rows_q8_0, TY_Q8_0)
GET_ROWS(get_rows_q4_0, TY_Q4_0)

// out[t] = how many of a hot slice's k rows token t computes: rows j with
// p[t * N + bucket[j]] >= theta (as a float). One block per token.
extern "C" __global__ void count_active(const float* p, const u32* bucket, int k, int N,
                                        float theta, float* out) {
    __shared__ float red[32];
    int t = blockIdx.x;
    float c = 0.0f;
    for (int j = threadIdx.x; j < k; j += blockDim.x)
        c += p[(long)t * N + bucket[j]] >= theta ? 1.0f : 0.0f;
    c = block_sum(c, red);
    if (threadIdx.x == 0) out[t] = c;
}

// Stores K and V of T tokens as f16 at their positions pos[0 .. T) (device memory: a program
// that reads them serves every token): token t's row of `row` floats goes to row pos[t] of the
// position-major caches of n_ctx rows; a position outside the cache writes nothing.
extern "C" __global__ void kv_store(const float* k, const float* v, u16* kc, u16* vc,
                                    const int* pos, int row, int T, int n_ctx) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long)T * row) return;
    int t = (int)(i / row);
    int p = pos[t];
    if (p < 0 || p >= n_ctx) return;
    long o = (long)p * row + (i - (long)t * row);
    kc[o] = f2h(k[i]);
    vc[o] = f2h(v[i]);
}

// Causal attention of T query tokens at positions pos[0 .. T) (device memory) over an f16 KV
// cache of n_ctx positions, with grouped-query heads: token t attends to positions
// 0 ..= pos[t] (within the cache). q, out: T * n_head * head_dim floats; kc, vc: position-major
// caches of n_kv * head_dim halves per position; head h reads KV head h / (n_head / n_kv).
// out[t, h] = sum_pos softmax_pos(scale * q[t, h] . k_pos) v_pos. scratch: T * n_head * n_ctx
// floats. Grid (n_head, T), one block per (head, token).
extern "C" __global__ void attention_f16kv(const float* q, const u16* kc, const u16* vc,
                                           const int* pos, float* out, float* scratch,
                                           int n_head, int n_kv, int head_dim, int n_ctx,
                                           float scale) {
    __shared__ float red[32];
    int h = blockIdx.x, t = blockIdx.y;
    int len = min(pos[t] + 1, n_ctx);
    int kvh = h / (n_head / n_kv);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    long qo = ((long)t * n_head + h) * head_dim;
    const float* qh = q + qo;
    float* s = scratch + ((long)t * n_head + h) * n_ctx;
    long stride = (long)n_kv * head_dim;
    for (int p = warp; p < len; p += nw) {
        const u16* k = kc + (long)p * stride + (long)kvh * head_dim;
        float acc = 0.0f;
        for (int d = lane; d < head_dim; d += 32) acc += qh[d] * h2f(k[d]);
        acc = warp_sum(acc);
        if (lane == 0) s[p] = acc * scale;
    }
    __syncthreads();
    float m = -3.402823466e38f;
    for (int p = threadIdx.x; p < len; p += blockDim.x) m = fmaxf(m, s[p]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int p = threadIdx.x; p < len; p += blockDim.x) {
        float e = expf(s[p] - m);
        s[p] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const u16* v = vc + (long)kvh * head_dim + d;
        float acc = 0.0f;
        for (int p = 0; p < len; p++) acc += s[p] * h2f(v[(long)p * stride]);
        out[qo + d] = acc * inv;
    }
}

// mask[i] = p[i] >= theta for T * N scores.
extern "C" __global__ void threshold_mask(const float* p, u8* mask, long n, float theta) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) mask[i] = p[i] >= theta ? 1 : 0;
}

// Writes the indices i with p[i] >= theta, ascending, to idx[0..count) and count to *count.
// One block of 1024 threads; deterministic order (block-wide prefix sums of warp ballots).
extern "C" __global__ void active_list(const float* p, int n, float theta, u32* idx, u32* count) {
    __shared__ u32 warp_tot[32];
    __shared__ u32 base_s;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (threadIdx.x == 0) base_s = 0;
    __syncthreads();
    for (int start = 0; start < n; start += blockDim.x) {
        int i = start + threadIdx.x;
        bool on = i < n && p[i] >= theta;
        u32 ballot = __ballot_sync(0xffffffffu, on);
        u32 before = __popc(ballot & ((1u << lane) - 1u));
        if (lane == 0) warp_tot[warp] = __popc(ballot);
        __syncthreads();
        u32 off = 0, total = 0;
        for (int k = 0; k < nw; k++) {
            u32 v = warp_tot[k];
            if (k < warp) off += v;
            total += v;
        }
        u32 base = base_s;
        if (on) idx[base + off + before] = (u32)i;
        __syncthreads();
        if (threadIdx.x == 0) base_s = base + total;
        __syncthreads();
    }
    if (threadIdx.x == 0) *count = base_s;
}
