// The C entry points of the native kernels, one home for their prototypes: each kernel's source
// includes this header (so a definition that drifts from it fails to compile), the CPU-graph
// replay (graph_replay.cpp) calls them through it, and _custom_ops.py reads it for its ctypes
// argument types (one prototype per `int name(...);`, each parameter typed with int64_t,
// int32_t, float or a pointer). Every kernel returns 0 on success, else an error code of its
// own; the minivllm_*has_* queries return 1 when their fast path is compiled in and usable.
#pragma once

#include <cstdint>

extern "C" {

int minivllm_has_gemv_bf16(void);
int minivllm_has_gemm_amx(void);
int minivllm_gguf_has_vnni(void);
int minivllm_gguf_has_avx2(void);
int minivllm_gguf_has_x8(void);  // the x8 layout's rows per group where built (8, 16), else 0
int minivllm_gguf_has_x8_type(int32_t qtype);  // 1 when this build has the x8 layout for qtype

int minivllm_paged_decode_bf16(const uint16_t* q, int64_t q_row_stride, uint16_t* k_cache,
                               uint16_t* v_cache, int64_t slot_stride, const int32_t* block_table,
                               int64_t table_stride, const int32_t* seq_lens, const int64_t* rows,
                               uint16_t* out, int64_t out_row_stride, int32_t num_seqs,
                               int32_t num_heads, int32_t num_kv_heads, int32_t head_size,
                               int32_t block_size, int32_t window, float scale,
                               int32_t num_threads, const uint16_t* k_new, int64_t k_stride,
                               const uint16_t* v_new, int64_t v_stride, const int64_t* slots);
int minivllm_paged_decode_f32(const float* q, int64_t q_row_stride, float* k_cache,
                              float* v_cache, int64_t slot_stride, const int32_t* block_table,
                              int64_t table_stride, const int32_t* seq_lens, const int64_t* rows,
                              float* out, int64_t out_row_stride, int32_t num_seqs,
                              int32_t num_heads, int32_t num_kv_heads, int32_t head_size,
                              int32_t block_size, int32_t window, float scale,
                              int32_t num_threads, const float* k_new, int64_t k_stride,
                              const float* v_new, int64_t v_stride, const int64_t* slots);
// bf16 queries over an fp8 cache of bytes in `format` (0: e4m3fn, 1: e5m2; else 1 returned);
// bf16 k_new / v_new are rounded into it.
int minivllm_paged_decode_bf16_fp8(
    int32_t format, const uint16_t* q, int64_t q_row_stride, uint8_t* k_cache, uint8_t* v_cache,
    int64_t slot_stride, const int32_t* block_table, int64_t table_stride,
    const int32_t* seq_lens, const int64_t* rows, uint16_t* out, int64_t out_row_stride,
    int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_size,
    int32_t block_size, int32_t window, float scale, int32_t num_threads,
    const uint16_t* k_new, int64_t k_stride, const uint16_t* v_new, int64_t v_stride,
    const int64_t* slots);
int minivllm_gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                       int64_t w_row_stride, const uint16_t* bias, uint16_t* y,
                       int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads);
int minivllm_gemm_amx_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                           int64_t w_stride, const uint16_t* bias, uint16_t* y, int64_t y_stride,
                           int64_t m, int64_t n, int64_t k, int32_t num_threads);
int minivllm_gemm_amx_silu_mul_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                                    int64_t w_stride, const uint16_t* bias, uint16_t* y,
                                    int64_t y_stride, int64_t m, int64_t d, int64_t k,
                                    int32_t num_threads);
int minivllm_silu_mul_bf16(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                           int64_t m, int64_t d, int32_t num_threads);
int minivllm_rms_norm_bf16(const uint16_t* x, int64_t x_stride, int64_t group,
                           const uint16_t* residual, int64_t r_stride, uint16_t* new_residual,
                           const uint16_t* w, uint16_t* out, int64_t m, int64_t d, float eps,
                           int32_t num_threads);
int minivllm_prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                                    int64_t k_stride, const uint16_t* v, int64_t v_stride,
                                    uint16_t* out, int64_t out_stride, int32_t len,
                                    int32_t num_heads, int32_t num_kv_heads, int32_t head_size,
                                    float scale, int32_t num_threads);
int minivllm_argmax_bf16(const uint16_t* x, int64_t rows, int64_t cols, int64_t row_stride,
                         int64_t* out, int32_t num_threads);
int minivllm_lora_shrink_expand_bf16(const uint16_t* x, int64_t x_stride, uint16_t* out,
                                     int64_t out_stride, const uint16_t* lora_a,
                                     const uint16_t* lora_b, const int64_t* token_slots,
                                     const int64_t* slices, int64_t num_tokens,
                                     int64_t num_slices, int64_t rank, int64_t in_dim,
                                     int64_t out_dim, int64_t num_loras, int32_t num_threads);
int minivllm_gguf_gemm(int32_t qtype, const void* x, int64_t x_stride, int32_t dt,
                       const uint8_t* w, int64_t w_stride, const void* bias, void* y,
                       int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads);
int minivllm_gguf_gemm_amx_bf16(int32_t qtype, const uint16_t* x, int64_t x_stride,
                                const uint8_t* w, int64_t w_stride, const uint16_t* bias,
                                uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                                int32_t num_threads);
int minivllm_gguf_dequant(int32_t qtype, const uint8_t* w, int64_t w_stride, int64_t rows,
                          int64_t cols, void* out, int64_t out_stride, int32_t dt,
                          int32_t num_threads);
int minivllm_gguf_embedding(int32_t qtype, const uint8_t* w, int64_t w_stride, int64_t rows,
                            const int64_t* ids, int64_t n, int64_t cols, void* out,
                            int64_t out_stride, int32_t dt, int32_t num_threads);
int minivllm_gguf_repack_x8(int32_t qtype, uint8_t* w, int64_t row_bytes, int64_t rows,
                            int32_t to_x8, int32_t num_threads);
int minivllm_rotary_embedding_bf16(const int64_t* positions, int64_t num_tokens,
                                   uint16_t* query, int64_t q_stride, int32_t num_q_heads,
                                   uint16_t* key, int64_t k_stride, int32_t num_k_heads,
                                   const uint16_t* cos_sin_cache, int64_t max_position,
                                   int32_t head_size, int32_t rotary_dim, int32_t is_neox,
                                   int32_t num_threads);
int minivllm_gather_rows(const uint8_t* table, int64_t table_stride, int64_t num_table_rows,
                         const int64_t* ids, int64_t n, int64_t row_bytes, uint8_t* out,
                         int64_t out_stride);
int minivllm_moe_topk(const void* logits, int64_t stride, int32_t dtype, int64_t t_count,
                      int32_t e, int32_t k, int32_t scoring, int32_t renormalize, float scale,
                      int64_t* ids, float* weights, int32_t num_threads);
int minivllm_fused_experts_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w13,
                                const uint16_t* w2, const int64_t* ids, const float* weights,
                                const int64_t* expert_map, int64_t num_global, int64_t num_local,
                                int64_t t_count, int32_t k, int64_t h, int64_t inter,
                                uint16_t* out, int64_t out_stride, int32_t num_threads,
                                int32_t use_amx);
int minivllm_fused_experts_gguf(const uint16_t* x, int64_t x_stride, const uint8_t* w13,
                                int32_t w13_type, int64_t w13_row_bytes, const uint8_t* w2,
                                int32_t w2_type, int64_t w2_row_bytes, const int64_t* ids,
                                const float* weights, const int64_t* expert_map,
                                int64_t num_global, int64_t num_local, int64_t t_count, int32_t k,
                                int64_t h, int64_t inter, uint16_t* out, int64_t out_stride,
                                int32_t num_threads);

}  // extern "C"
