/*
 * Golden data for the K-quant quantizers, produced by llama.cpp's reference code.
 *
 * Built and run by scripts/kquant-golden, which links this file against llama.cpp's
 * ggml/src/ggml-quants.c. It generates seeded f32 test blocks of varied distributions,
 * quantizes them with quantize_row_q{2,3,4,5,6}_K_ref, dequantizes the results with
 * dequantize_row_q*_K and writes into the directory given as the first argument:
 *
 *   input.f32       every test block, 256 little-endian f32 each, cases one after another
 *   q2_k.bin ...    the blocks llama.cpp produced for each type, in the same order
 *   manifest.txt    "case NAME FIRST_BLOCK N_BLOCKS" per case, then
 *                   "dequant TYPE NAME HASH": FNV-1a 64 of the bytes of llama.cpp's
 *                   dequantization of that case's blocks of that type
 *
 * The second argument is a free-form description of the llama.cpp source, copied into the
 * manifest's header. The data generator uses integer arithmetic and exact float scalings
 * only, so the inputs do not depend on the C library; they are stored anyway.
 */

#include "ggml-quants.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ggml-quants.c refers to these; none of the functions used here calls them. */
void ggml_abort(const char *file, int line, const char *fmt, ...) {
    va_list args;
    fprintf(stderr, "ggml_abort at %s:%d: ", file, line);
    va_start(args, fmt);
    vfprintf(stderr, fmt, args);
    va_end(args);
    fputc('\n', stderr);
    abort();
}
size_t ggml_row_size(enum ggml_type type, int64_t ne) {
    (void)type;
    (void)ne;
    fprintf(stderr, "unexpected call to ggml_row_size\n");
    abort();
}
size_t ggml_type_size(enum ggml_type type) {
    (void)type;
    fprintf(stderr, "unexpected call to ggml_type_size\n");
    abort();
}
const char *ggml_type_name(enum ggml_type type) {
    (void)type;
    return "?";
}

#define BLOCK 256
#define MAX_BLOCKS 128

/* SplitMix64. */
static uint64_t rng_state;
static uint64_t next_u64(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
/* Uniform in [0, 1) on a grid of 2^-24: exact in f32. */
static float unit(void) { return (float)(next_u64() >> 40) * (1.0f / 16777216.0f); }
static float uniform(float lo, float hi) { return lo + (hi - lo) * unit(); }
static unsigned below(unsigned n) { return (unsigned)(next_u64() % n); }
/* Irwin-Hall: the sum of 12 uniforms minus 6, close to a standard normal, no libm. */
static float normal(void) {
    float s = 0.0f;
    for (int i = 0; i < 12; ++i) s += unit();
    return s - 6.0f;
}
static float pow10i(int e) {
    float r = 1.0f;
    for (; e > 0; --e) r *= 10.0f;
    for (; e < 0; ++e) r /= 10.0f;
    return r;
}
static float f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static float input[MAX_BLOCKS * BLOCK];
static int n_blocks;

struct test_case {
    const char *name;
    int first;
    int count;
};
static struct test_case cases[64];
static int n_cases;

static float *begin_case(const char *name, int count) {
    if (n_blocks + count > MAX_BLOCKS) {
        fprintf(stderr, "too many blocks\n");
        exit(1);
    }
    cases[n_cases].name = name;
    cases[n_cases].first = n_blocks;
    cases[n_cases].count = count;
    ++n_cases;
    float *x = input + (size_t)n_blocks * BLOCK;
    n_blocks += count;
    return x;
}

static void generate(void) {
    float *x;
    int n;

    n = 12 * BLOCK;
    x = begin_case("normal", 12);
    for (int i = 0; i < n; ++i) x[i] = normal();

    n = 6 * BLOCK;
    x = begin_case("uniform", 6);
    for (int i = 0; i < n; ++i) x[i] = uniform(-1.0f, 1.0f);

    n = 3 * BLOCK;
    x = begin_case("positive", 3);
    for (int i = 0; i < n; ++i) x[i] = unit();

    n = 2 * BLOCK;
    x = begin_case("negative", 2);
    for (int i = 0; i < n; ++i) x[i] = -unit();

    n = 2 * BLOCK;
    x = begin_case("shifted_normal", 2);
    for (int i = 0; i < n; ++i) x[i] = 3.0f + normal();

    x = begin_case("zeros", 1);
    for (int i = 0; i < BLOCK; ++i) x[i] = 0.0f;

    x = begin_case("constant", 2);
    for (int i = 0; i < BLOCK; ++i) x[i] = 0.75f;
    for (int i = 0; i < BLOCK; ++i) x[BLOCK + i] = -2.5f;

    /* Each sub-block of 16 constant, at its own value. */
    n = 2 * BLOCK;
    x = begin_case("constant_sub_blocks", 2);
    for (int s = 0; s < n / 16; ++s) {
        float v = uniform(-2.0f, 2.0f);
        for (int i = 0; i < 16; ++i) x[16 * s + i] = v;
    }

    /* Below GROUP_MAX_EPS: every sub-block counts as zero. */
    n = 2 * BLOCK;
    x = begin_case("tiny_1e-30", 2);
    for (int i = 0; i < n; ++i) x[i] = normal() * 1e-30f;

    /* f16-subnormal super-block scales. */
    n = 2 * BLOCK;
    x = begin_case("small_1e-6", 2);
    for (int i = 0; i < n; ++i) x[i] = normal() * 1e-6f;

    x = begin_case("f32_subnormal", 1);
    for (int i = 0; i < BLOCK; ++i) x[i] = normal() * 1e-40f;

    n = 2 * BLOCK;
    x = begin_case("large_1e4", 2);
    for (int i = 0; i < n; ++i) x[i] = normal() * 1e4f;

    /* Sums of squares overflow to infinity. */
    n = 2 * BLOCK;
    x = begin_case("huge_1e20", 2);
    for (int i = 0; i < n; ++i) x[i] = normal() * 1e20f;

    /* Every sub-block of 16 at its own magnitude, 1e-4 to 1e4. */
    n = 4 * BLOCK;
    x = begin_case("mixed_scale", 4);
    for (int s = 0; s < n / 16; ++s) {
        float m = pow10i((int)below(9) - 4);
        for (int i = 0; i < 16; ++i) x[16 * s + i] = normal() * m;
    }

    /* Half the sub-blocks of 32 zero. */
    n = 2 * BLOCK;
    x = begin_case("zero_sub_blocks", 2);
    for (int s = 0; s < n / 32; ++s)
        for (int i = 0; i < 32; ++i) x[32 * s + i] = (s % 2) ? normal() : 0.0f;

    n = 3 * BLOCK;
    x = begin_case("outliers", 3);
    for (int i = 0; i < n; ++i) x[i] = normal();
    for (int b = 0; b < 3; ++b)
        for (int k = 0; k < 1 + b; ++k) x[b * BLOCK + below(BLOCK)] *= 50.0f;

    n = 2 * BLOCK;
    x = begin_case("one_hot", 2);
    for (int i = 0; i < n; ++i) x[i] = 0.0f;
    x[below(BLOCK)] = 1.5f;
    x[BLOCK + below(BLOCK)] = -0.3f;

    n = 2 * BLOCK;
    x = begin_case("sparse", 2);
    for (int i = 0; i < n; ++i) x[i] = below(10) == 0 ? normal() : 0.0f;

    /* Integers and half-integers: many rounding ties. */
    n = 3 * BLOCK;
    x = begin_case("grid", 3);
    for (int i = 0; i < BLOCK; ++i) x[i] = (float)((int)below(16) - 8);
    for (int i = BLOCK; i < 2 * BLOCK; ++i) x[i] = 0.5f * (float)((int)below(9) - 4);
    for (int i = 2 * BLOCK; i < n; ++i) x[i] = (float)((int)below(3) - 1);

    /* Infinities and NaNs (quiet, zero payload) among normal values. */
    {
        const float inf = f32_from_bits(0x7f800000u);
        const float nan = f32_from_bits(0x7fc00000u);
        n = 5 * BLOCK;
        x = begin_case("specials", 5);
        for (int i = 0; i < n; ++i) x[i] = normal();
        x[below(BLOCK)] = nan;
        x[BLOCK + below(BLOCK)] = inf;
        x[2 * BLOCK + below(BLOCK)] = -inf;
        for (int k = 0; k < 6; ++k) {
            float v = k % 3 == 0 ? nan : k % 3 == 1 ? inf : -inf;
            x[3 * BLOCK + below(BLOCK)] = v;
        }
        for (int i = 4 * BLOCK; i < n; ++i) x[i] = nan;
    }
}

static uint64_t fnv1a(const void *data, size_t len) {
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < len; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

static void write_file(const char *dir, const char *name, const void *data, size_t len) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, len, f) != len || fclose(f) != 0) {
        fprintf(stderr, "writing %s failed\n", path);
        exit(1);
    }
}

typedef void (*quantize_fn)(const float *, void *, int64_t);
typedef void (*dequantize_fn)(const void *, float *, int64_t);

struct kquant {
    const char *name;
    size_t block_bytes;
    quantize_fn quantize;
    dequantize_fn dequantize;
};

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s OUTPUT_DIR SOURCE_DESCRIPTION\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    const struct kquant types[] = {
        {"q2_k", sizeof(block_q2_K), (quantize_fn)quantize_row_q2_K_ref,
         (dequantize_fn)dequantize_row_q2_K},
        {"q3_k", sizeof(block_q3_K), (quantize_fn)quantize_row_q3_K_ref,
         (dequantize_fn)dequantize_row_q3_K},
        {"q4_k", sizeof(block_q4_K), (quantize_fn)quantize_row_q4_K_ref,
         (dequantize_fn)dequantize_row_q4_K},
        {"q5_k", sizeof(block_q5_K), (quantize_fn)quantize_row_q5_K_ref,
         (dequantize_fn)dequantize_row_q5_K},
        {"q6_k", sizeof(block_q6_K), (quantize_fn)quantize_row_q6_K_ref,
         (dequantize_fn)dequantize_row_q6_K},
    };
    const int n_types = (int)(sizeof types / sizeof types[0]);

    rng_state = 0x6b71616e74ull; /* "kquant" */
    generate();
    write_file(dir, "input.f32", input, (size_t)n_blocks * BLOCK * sizeof(float));

    char path[4096];
    snprintf(path, sizeof path, "%s/manifest.txt", dir);
    FILE *manifest = fopen(path, "w");
    if (!manifest) {
        fprintf(stderr, "writing %s failed\n", path);
        return 1;
    }
    fprintf(manifest, "# K-quant golden data from llama.cpp's reference quantizers (%s),\n", argv[2]);
    fprintf(manifest, "# written by scripts/kquant-golden; crates/powerinfer-gguf/tests/kquant_golden.rs reads it.\n");
    for (int c = 0; c < n_cases; ++c)
        fprintf(manifest, "case %s %d %d\n", cases[c].name, cases[c].first, cases[c].count);

    static float dequantized[MAX_BLOCKS * BLOCK];
    for (int t = 0; t < n_types; ++t) {
        size_t bytes = types[t].block_bytes * (size_t)n_blocks;
        unsigned char *blocks = calloc(bytes, 1);
        if (!blocks) return 1;
        types[t].quantize(input, blocks, (int64_t)n_blocks * BLOCK);
        char name[64];
        snprintf(name, sizeof name, "%s.bin", types[t].name);
        write_file(dir, name, blocks, bytes);
        types[t].dequantize(blocks, dequantized, (int64_t)n_blocks * BLOCK);
        for (int c = 0; c < n_cases; ++c) {
            uint64_t h = fnv1a(dequantized + (size_t)cases[c].first * BLOCK,
                               (size_t)cases[c].count * BLOCK * sizeof(float));
            fprintf(manifest, "dequant %s %s %016llx\n", types[t].name, cases[c].name,
                    (unsigned long long)h);
        }
        free(blocks);
    }
    if (fclose(manifest) != 0) return 1;
    fprintf(stderr, "%d blocks in %d cases, %d types\n", n_blocks, n_cases, n_types);
    return 0;
}
