// Shared definitions of the powerinfer-rs CUDA kernels. NVRTC compiles each kernels/*.cu file
// with this file pasted in place of its `#include "common.cuh"` line (see src/nvrtc.rs): no CUDA
// headers are used, so bare NVRTC is enough. f16 values are handled as raw 16-bit integers and
// converted with the PTX `cvt` instruction. tests/emu.rs also compiles these sources as C++ on
// the CPU (with CUDA_EMULATION defined) to test the kernels' logic without a GPU.
typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

// ggml type ids (the weight type a kernel instance reads).
#define TY_F32 0
#define TY_F16 1
#define TY_Q4_0 2
#define TY_Q8_0 8

// ggml block layouts: Q8_0 = f16 scale + 32 int8 (34 bytes); Q4_0 = f16 scale + 16 bytes of
// nibbles (18 bytes), element e < 16 in the low nibble of byte e, element e + 16 in its high one.
#define QK 32
#define Q8_0_BYTES 34
#define Q4_0_BYTES 18

#ifndef CUDA_EMULATION
__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#else
// CPU emulation of the kernels (tests/emu): conversions from the emulation header.
__device__ __forceinline__ float h2f(u16 h) { return emu_h2f(h); }
__device__ __forceinline__ u16 f2h(float f) { return emu_f2h(f); }
#endif

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum (MAX false) or maximum (MAX true) over the block; every thread gets the result. `red` is
// __shared__ float[32]. Ends with the block synchronised so `red` can be reused.
template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : (MAX ? -3.402823466e38f : 0.0f);
    r = MAX ? warp_max(r) : warp_sum(r);
    __syncthreads();
    return r;
}

__device__ __forceinline__ float block_sum(float v, float* red) { return block_reduce<false>(v, red); }

__device__ __forceinline__ float block_max(float v, float* red) { return block_reduce<true>(v, red); }

// The activation of a gated FFN neuron from its gate and up products (relu_gate, silu_gate and
// the fused gated products use this one definition): GATE_RELU ReLU(g) * u, GATE_DRELU
// ReLU(g) * ReLU(u), GATE_SILU silu(g) * u with silu(x) = x * ((x >= 0 ? 1 : e) / (1 + e)),
// e = exp(-|x|), the CPU kernels' form (the exponential never overflows).
#define GATE_RELU 0
#define GATE_DRELU 1
#define GATE_SILU 2
__device__ __forceinline__ float gate_act(int kind, float g, float u) {
    if (kind == GATE_SILU) {
        float e = expf(-fabsf(g));
        float num = g >= 0.0f ? 1.0f : e;
        return g * (num / (1.0f + e)) * u;
    }
    return fmaxf(g, 0.0f) * (kind == GATE_DRELU ? fmaxf(u, 0.0f) : u);
}

// a * b rounded once (no contraction into an fma), as the CPU quantizer computes it.
__device__ __forceinline__ float fmul_rn(float a, float b) {
#ifdef CUDA_EMULATION
    volatile float r = a * b;
    return r;
#else
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#endif
}

// Lane `lane` of the warp that quantizes 32-block b (of n_blocks) holding value v: writes its
// int8 value and (lane 0) the block's scale into xq (n_blocks * 32 int8 values, then n_blocks
// f32 scales). d = amax / 127, id = 1 / d (0 when amax = 0), q = trunc(x * id +
// copysign(0.5-, x * id)) clamped to +-127: round half away from zero, the same IEEE operations
// as the CPU quantizer. All 32 lanes of the warp call it.
__device__ __forceinline__ void quantize_q8_lane(float v, long b, int lane, long n_blocks, u8* xq) {
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    float id = d > 0.0f ? 1.0f / d : 0.0f;
    float t = fmul_rn(v, id);
    int q = (int)(t + (t < 0.0f ? -0.49999997f : 0.49999997f));
    q = q > 127 ? 127 : (q < -127 ? -127 : q);
    ((i8*)xq)[b * 32 + lane] = (i8)q;
    if (lane == 0) ((float*)(xq + n_blocks * 32))[b] = d;
}

// 4 bytes at a 2-byte aligned address.
__device__ __forceinline__ u32 load_u32_a2(const u8* p) {
    const u16* h = (const u16*)p;
    return (u32)h[0] | ((u32)h[1] << 16);
}

// Byte k of w as a float, minus `bias`, exactly: the float with bits 0x4B0000xx is 2^23 + xx, so
// one byte permute and one subtraction replace a (slow) integer-to-float conversion.
__device__ __forceinline__ float byte_f(u32 w, int k, float bias) {
    return __int_as_float((int)__byte_perm(w, 0x4B000000u, 0x7440u | (u32)k)) - bias;
}

// Element c of a weight row of type TY starting at byte pointer `row`.
template <int TY>
__device__ __forceinline__ float weight_at(const u8* row, int c) {
    if (TY == TY_F32) {
        return ((const float*)row)[c];
    } else if (TY == TY_F16) {
        return h2f(((const u16*)row)[c]);
    } else if (TY == TY_Q8_0) {
        const u8* b = row + (long)(c >> 5) * Q8_0_BYTES;
        return h2f(*(const u16*)b) * (float)(i8)b[2 + (c & 31)];
    } else {
        const u8* b = row + (long)(c >> 5) * Q4_0_BYTES;
        int e = c & 31;
        int byte = b[2 + (e & 15)];
        int nib = e < 16 ? (byte & 15) : (byte >> 4);
        return h2f(*(const u16*)b) * (float)(nib - 8);
    }
}
