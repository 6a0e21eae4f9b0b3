// A small CPU emulation of the CUDA features the kernels in kernels/*.cu use, so that the real
// kernel sources compile with g++ and run on the CPU in tests/emu.rs. Each CUDA thread of a block
// is a fiber (ucontext) on the calling OS thread; a fiber runs until it reaches a barrier
// (__syncthreads, or the exchange inside a warp shuffle / ballot) and the scheduler releases a
// barrier once every live thread of the block (or warp) waits at it. Threads that return leave
// the barriers, as on a GPU. Blocks run one after another, so __shared__ variables are function
// statics. A deadlock (divergent barriers) aborts.
#pragma once
#include <math.h>
#include <ucontext.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CUDA_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct emu_dim {
    unsigned x, y, z;
};
inline emu_dim threadIdx{0, 0, 0};
inline emu_dim blockIdx{0, 0, 0};
inline emu_dim blockDim{1, 1, 1};
inline emu_dim gridDim{1, 1, 1};

struct float4 {
    float x, y, z, w;
};
struct uint4 {
    unsigned x, y, z, w;
};

enum EmuState { EMU_RUN, EMU_WAIT_BLOCK, EMU_WAIT_WARP, EMU_DONE };
struct EmuFiber {
    ucontext_t ctx;
    EmuState state;
};
constexpr size_t EMU_STACK = 64 * 1024;
inline ucontext_t emu_sched;
inline std::vector<EmuFiber> emu_fibers;
inline std::vector<char> emu_stacks;
inline unsigned emu_cur = 0;
inline void (*emu_body)(void*) = nullptr;
inline void* emu_arg = nullptr;
inline std::vector<float> emu_fx;
inline std::vector<unsigned> emu_ux;
// Per thread: the A (4 registers) and B (2) fragments of its warp's current mma.
inline std::vector<unsigned> emu_frag;

inline void emu_wait(EmuState s) {
    emu_fibers[emu_cur].state = s;
    swapcontext(&emu_fibers[emu_cur].ctx, &emu_sched);
}

inline void __syncthreads() { emu_wait(EMU_WAIT_BLOCK); }

inline float __shfl_xor_sync(unsigned, float v, int o) {
    unsigned t = threadIdx.x;
    emu_fx[t] = v;
    emu_wait(EMU_WAIT_WARP);
    float r = emu_fx[(t & ~31u) | ((t & 31u) ^ (unsigned)o)];
    emu_wait(EMU_WAIT_WARP);
    return r;
}

// A warp barrier (memory is shared by all fibers anyway).
inline void __syncwarp(unsigned = 0xffffffffu) { emu_wait(EMU_WAIT_WARP); }

inline unsigned __ballot_sync(unsigned, bool p) {
    unsigned t = threadIdx.x, w = t >> 5;
    emu_ux[t] = p ? 1u : 0u;
    emu_wait(EMU_WAIT_WARP);
    unsigned bits = 0;
    for (unsigned l = 0; l < 32 && w * 32 + l < blockDim.x; l++) bits |= emu_ux[w * 32 + l] << l;
    emu_wait(EMU_WAIT_WARP);
    return bits;
}

// Warp-wide mma.sync: every lane deposits its fragments, then computes its own outputs from
// the whole warp's (the PTX fragment layouts: kernels/matmul.cu, mma_s8 and mma_f16). `elem`
// returns A(r, k) when b is false, B(k, c) when true, from the deposited registers.
template <class Elem, class Out>
inline void emu_mma(const unsigned* a, const unsigned* b, int kdim, Elem elem, Out out) {
    unsigned t = threadIdx.x, w0 = t & ~31u, lane = t & 31u;
    for (int i = 0; i < 4; i++) emu_frag[t * 6 + i] = a[i];
    for (int i = 0; i < 2; i++) emu_frag[t * 6 + 4 + i] = b[i];
    emu_wait(EMU_WAIT_WARP);
    unsigned g = lane >> 2, q = lane & 3;
    double sums[4];
    for (int i = 0; i < 4; i++) {
        unsigned r = g + 8 * (i >> 1), c = 2 * q + (i & 1);
        double s = 0.0;
        for (int k = 0; k < kdim; k++) s += elem(w0, false, r, k) * elem(w0, true, c, k);
        sums[i] = s;
    }
    emu_wait(EMU_WAIT_WARP);
    out(sums);
}

// mma.m16n8k32 s8: A(r, k) in lane (r % 8) * 4 + (k % 16) / 4, register (r / 8) + 2 (k / 16),
// byte k % 4; B(k, c) in lane c * 4 + (k % 16) / 4, register 4 + k / 16, byte k % 4.
inline void emu_mma_m16n8k32_s8(int* d, const unsigned* a, const unsigned* b) {
    auto elem = [](unsigned w0, bool isb, unsigned rc, int k) -> double {
        unsigned lane = w0 + rc % 8 * 4 + (k % 16) / 4;
        unsigned reg = isb ? 4 + k / 16 : rc / 8 + 2 * (k / 16);
        return (double)(signed char)(emu_frag[lane * 6 + reg] >> (8 * (k % 4)));
    };
    emu_mma(a, b, 32, elem, [d](double* s) {
        for (int i = 0; i < 4; i++) d[i] += (int)s[i];
    });
}

// mma.m16n8k16 f16 (f32 accumulate): A(r, k) in lane (r % 8) * 4 + (k % 8) / 2, register
// (r / 8) + 2 (k / 8), half k % 2; B(k, c) in lane c * 4 + (k % 8) / 2, register 4 + k / 8.
inline float emu_h2f(unsigned short h);
inline void emu_mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b) {
    auto elem = [](unsigned w0, bool isb, unsigned rc, int k) -> double {
        unsigned lane = w0 + rc % 8 * 4 + (k % 8) / 2;
        unsigned reg = isb ? 4 + k / 8 : rc / 8 + 2 * (k / 8);
        return (double)emu_h2f((unsigned short)(emu_frag[lane * 6 + reg] >> (16 * (k % 2))));
    };
    emu_mma(a, b, 16, elem, [d](double* s) {
        for (int i = 0; i < 4; i++) d[i] += (float)s[i];
    });
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }

// PTX prmt (default mode): byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {y:x}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint64_t v = ((uint64_t)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++)
        r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}

// One OS thread runs all fibers, so a plain read-modify-write is atomic here.
inline float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline int min(int a, int b) { return a < b ? a : b; }

inline float emu_h2f(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline unsigned short emu_f2h(float f) {
    _Float16 v = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}

inline void emu_fiber_main() {
    emu_body(emu_arg);
    emu_fibers[emu_cur].state = EMU_DONE;  // returning resumes emu_sched (uc_link)
}

// Runs one block of n threads to completion.
inline void emu_run_block(unsigned n) {
    if (emu_stacks.size() < n * EMU_STACK) emu_stacks.resize(n * EMU_STACK);
    emu_fibers.assign(n, EmuFiber{});
    emu_fx.assign(n, 0.0f);
    emu_ux.assign(n, 0u);
    emu_frag.assign(n * 6, 0u);
    for (unsigned t = 0; t < n; t++) {
        EmuFiber& f = emu_fibers[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = emu_stacks.data() + t * EMU_STACK;
        f.ctx.uc_stack.ss_size = EMU_STACK;
        f.ctx.uc_link = &emu_sched;
        makecontext(&f.ctx, emu_fiber_main, 0);
        f.state = EMU_RUN;
    }
    for (;;) {
        for (unsigned t = 0; t < n; t++) {
            if (emu_fibers[t].state != EMU_RUN) continue;
            emu_cur = t;
            threadIdx = {t, 0, 0};
            swapcontext(&emu_sched, &emu_fibers[t].ctx);
        }
        // Every fiber now waits or is done: release the barriers that are complete.
        bool any_live = false, all_at_block = true, released = false;
        for (unsigned w = 0; w * 32 < n; w++) {
            bool live = false, all_at_warp = true;
            for (unsigned t = w * 32; t < n && t < w * 32 + 32; t++) {
                if (emu_fibers[t].state == EMU_DONE) continue;
                live = true;
                if (emu_fibers[t].state != EMU_WAIT_WARP) all_at_warp = false;
                if (emu_fibers[t].state != EMU_WAIT_BLOCK) all_at_block = false;
            }
            any_live = any_live || live;
            if (live && all_at_warp) {
                for (unsigned t = w * 32; t < n && t < w * 32 + 32; t++)
                    if (emu_fibers[t].state == EMU_WAIT_WARP) emu_fibers[t].state = EMU_RUN;
                released = true;
            }
        }
        if (!any_live) return;
        if (!released && all_at_block) {
            for (unsigned t = 0; t < n; t++)
                if (emu_fibers[t].state == EMU_WAIT_BLOCK) emu_fibers[t].state = EMU_RUN;
            released = true;
        }
        if (!released) abort();  // divergent barriers: a real GPU would hang too
    }
}

// Runs `f` as a grid of (gx, gy, gz) blocks of bx threads, one block after another.
template <class F>
void emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, F f) {
    blockDim = {bx, 1, 1};
    gridDim = {gx, gy, gz};
    emu_body = [](void* c) { (*(F*)c)(); };
    emu_arg = (void*)&f;
    for (unsigned z = 0; z < gz; z++)
        for (unsigned y = 0; y < gy; y++)
            for (unsigned x = 0; x < gx; x++) {
                blockIdx = {x, y, z};
                emu_run_block(bx);
            }
}
