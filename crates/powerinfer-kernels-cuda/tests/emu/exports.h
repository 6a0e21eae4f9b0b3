// C entry points of the emulated kernels: emu_<kernel>(grid x, y, z, threads, kernel args...).
// Included after one kernels/*.cu module; EMU_MODULE_* says which.
#define EMU_GRID unsigned gx, unsigned gy, unsigned gz, unsigned bx

#ifdef EMU_MODULE_ROWS
#define EMU_ROWS(NAME)                                                                          \
    extern "C" void emu_##NAME(EMU_GRID, const u8* w, long rb, int n_rows, int K,              \
                               const float* x, int T, const float* p, const u32* bucket,       \
                               float theta, int N, float* dst) {                               \
        emu_launch(gx, gy, gz, bx, [=] { NAME(w, rb, n_rows, K, x, T, p, bucket, theta, N, dst); }); \
    }
#ifdef EMU_MODULE_MATMUL
EMU_ROWS(matmul_f32)
EMU_ROWS(matmul_f16)
EMU_ROWS(matmul_q8_0)
EMU_ROWS(matmul_q4_0)
EMU_ROWS(matmul_f32_t1)
EMU_ROWS(matmul_f16_t1)
EMU_ROWS(matmul_q8_0_t1)
EMU_ROWS(matmul_q4_0_t1)
EMU_ROWS(matmul_f16_mma)
EMU_ROWS(matmul_q8_0_mma)
EMU_ROWS(matmul_q4_0_mma)
#define EMU_GATED(NAME)                                                                         \
    extern "C" void emu_##NAME(EMU_GRID, const u8* wg, const u8* wu, long rb, int n_rows, int K, \
                               const float* x, int T, const float* p, const u32* bucket,       \
                               float theta, int N, int kind, float* count, float* dst) {       \
        emu_launch(gx, gy, gz, bx, [=] { NAME(wg, wu, rb, n_rows, K, x, T, p, bucket, theta, N, kind, count, dst); }); \
    }
EMU_GATED(matmul_gated_f32_t1)
EMU_GATED(matmul_gated_f16_t1)
EMU_GATED(matmul_gated_q8_0_t1)
EMU_GATED(matmul_gated_q4_0_t1)
extern "C" void emu_quantize_q8(EMU_GRID, const float* x, long n_blocks, u8* xq) {
    emu_launch(gx, gy, gz, bx, [=] { quantize_q8(x, n_blocks, xq); });
}
extern "C" void emu_round_f16(EMU_GRID, const float* x, float* y, long n) {
    emu_launch(gx, gy, gz, bx, [=] { round_f16(x, y, n); });
}
#else
EMU_ROWS(axpy_f32_t1)
EMU_ROWS(axpy_f16_t1)
EMU_ROWS(axpy_q8_0_t1)
EMU_ROWS(axpy_q4_0_t1)
EMU_ROWS(axpy_f32_t8)
EMU_ROWS(axpy_f16_t8)
EMU_ROWS(axpy_q8_0_t8)
EMU_ROWS(axpy_q4_0_t8)
#endif
#endif

#ifdef EMU_MODULE_OPS
extern "C" void emu_rms_norm(EMU_GRID, const float* x, const float* w, float* y, int n, float eps) {
    emu_launch(gx, gy, gz, bx, [=] { rms_norm(x, w, y, n, eps); });
}
extern "C" void emu_rope(EMU_GRID, float* x, const int* pos, int n_head, int head_dim, int n_rot,
                         float theta_scale, float freq_scale, int neox) {
    emu_launch(gx, gy, gz, bx, [=] { rope(x, pos, n_head, head_dim, n_rot, theta_scale, freq_scale, neox); });
}
extern "C" void emu_rope_qk(EMU_GRID, float* q, float* k, const int* pos, int n_head, int n_head_kv, int head_dim,
                            int n_rot, float theta_scale, float freq_scale, int neox) {
    emu_launch(gx, gy, gz, bx, [=] { rope_qk(q, k, pos, n_head, n_head_kv, head_dim, n_rot, theta_scale, freq_scale, neox); });
}
extern "C" void emu_silu_gate(EMU_GRID, const float* g, const float* u, float* y, long n) {
    emu_launch(gx, gy, gz, bx, [=] { silu_gate(g, u, y, n); });
}
extern "C" void emu_add_rows(EMU_GRID, float* y, const float* b, int n, long total) {
    emu_launch(gx, gy, gz, bx, [=] { add_rows(y, b, n, total); });
}
extern "C" void emu_add_inplace(EMU_GRID, const float* x, float* y, long n) {
    emu_launch(gx, gy, gz, bx, [=] { add_inplace(x, y, n); });
}
extern "C" void emu_relu_inplace(EMU_GRID, float* y, long n) {
    emu_launch(gx, gy, gz, bx, [=] { relu_inplace(y, n); });
}
extern "C" void emu_relu_round_f16_inplace(EMU_GRID, float* y, long n) {
    emu_launch(gx, gy, gz, bx, [=] { relu_round_f16_inplace(y, n); });
}
#define EMU_GET_ROWS(NAME)                                                                      \
    extern "C" void emu_##NAME(EMU_GRID, const u8* w, long rb, int cols, const int* rows,      \
                               int offset, float* y) {                                          \
        emu_launch(gx, gy, gz, bx, [=] { NAME(w, rb, cols, rows, offset, y); });               \
    }
EMU_GET_ROWS(get_rows_f32)
EMU_GET_ROWS(get_rows_f16)
EMU_GET_ROWS(get_rows_q8_0)
EMU_GET_ROWS(get_rows_q4_0)
extern "C" void emu_count_active(EMU_GRID, const float* p, const u32* bucket, int k, int N, float theta,
                                 float* out) {
    emu_launch(gx, gy, gz, bx, [=] { count_active(p, bucket, k, N, theta, out); });
}
extern "C" void emu_softmax(EMU_GRID, float* x, int n, float scale) {
    emu_launch(gx, gy, gz, bx, [=] { softmax(x, n, scale); });
}
extern "C" void emu_relu(EMU_GRID, const float* x, float* y, long n) {
    emu_launch(gx, gy, gz, bx, [=] { relu(x, y, n); });
}
extern "C" void emu_relu_gate(EMU_GRID, const float* g, const float* u, float* y, long n, int relu_u) {
    emu_launch(gx, gy, gz, bx, [=] { relu_gate(g, u, y, n, relu_u); });
}
extern "C" void emu_kv_store(EMU_GRID, const float* k, const float* v, u16* kc, u16* vc, const int* pos,
                             int row, int T, int n_ctx) {
    emu_launch(gx, gy, gz, bx, [=] { kv_store(k, v, kc, vc, pos, row, T, n_ctx); });
}
extern "C" void emu_attention_f16kv(EMU_GRID, const float* q, const u16* kc, const u16* vc, const int* pos,
                                    float* out, float* scratch, int n_head, int n_kv, int head_dim,
                                    int n_ctx, float scale) {
    emu_launch(gx, gy, gz, bx, [=] { attention_f16kv(q, kc, vc, pos, out, scratch, n_head, n_kv, head_dim, n_ctx, scale); });
}
extern "C" void emu_add_rms_norm(EMU_GRID, float* x, const float* a, const float* w, float* y, int n, float eps) {
    emu_launch(gx, gy, gz, bx, [=] { add_rms_norm(x, a, w, y, n, eps); });
}
extern "C" void emu_add_layer_norm(EMU_GRID, float* x, const float* a, const float* w, const float* b, float* y, int n, float eps) {
    emu_launch(gx, gy, gz, bx, [=] { add_layer_norm(x, a, w, b, y, n, eps); });
}
extern "C" void emu_rms_norm_conv(EMU_GRID, const float* x, const float* w, float* y, int n, float eps, int rows, int conv, u8* out) {
    emu_launch(gx, gy, gz, bx, [=] { rms_norm_conv(x, w, y, n, eps, rows, conv, out); });
}
extern "C" void emu_layer_norm_conv(EMU_GRID, const float* x, const float* w, const float* b, float* y, int n, float eps, int rows, int conv, u8* out) {
    emu_launch(gx, gy, gz, bx, [=] { layer_norm_conv(x, w, b, y, n, eps, rows, conv, out); });
}
extern "C" void emu_layer_norm(EMU_GRID, const float* x, const float* w, const float* b, float* y, int n, float eps) {
    emu_launch(gx, gy, gz, bx, [=] { layer_norm(x, w, b, y, n, eps); });
}
extern "C" void emu_threshold_mask(EMU_GRID, const float* p, u8* mask, long n, float theta) {
    emu_launch(gx, gy, gz, bx, [=] { threshold_mask(p, mask, n, theta); });
}
extern "C" void emu_active_list(EMU_GRID, const float* p, int n, float theta, u32* idx, u32* count) {
    emu_launch(gx, gy, gz, bx, [=] { active_list(p, n, theta, idx, count); });
}
#endif
