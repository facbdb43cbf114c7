// Replay of a CPU graph's recorded kernel calls from one native loop (compilation/cpu_graph.py).
//
// A batch-1 decode step of a 30-layer model is ~270 kernel calls; replayed from Python, each
// costs a ctypes call (~1-1.5 us, ~0.35 ms a step, ~4% of it). Here a graph is a table of
// records, one per call: [opcode, its arguments as int64], pointers and integers as their
// values and floats as their IEEE bits in the low 32 bits, dispatched by a switch with every
// argument converted to its prototype's type (kernels.h), so no call relies on an ABI trick.
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace {

constexpr int64_t kRecordSlots = 26;  // opcode + up to 25 arguments (the fp8 paged decode's)

// The kernels a graph may hold, in the order of kOpNames (their opcode: the position).
enum Op : int64_t {
  kPagedDecodeBf16, kPagedDecodeF32, kGemvBf16, kGemmAmxBf16, kGemmAmxSiluMulBf16,
  kSiluMulBf16, kRmsNormBf16, kPrefillAttentionBf16, kArgmaxBf16, kGgufGemm, kGgufGemmAmxBf16,
  kGgufDequant, kRotaryEmbeddingBf16, kGatherRows, kMoeTopk, kFusedExpertsBf16,
  kLoraShrinkExpandBf16, kFusedExpertsGguf, kGgufEmbedding, kGgufRepackX8, kPagedDecodeBf16Fp8,
  kNumOps
};
const char* const kOpNames[kNumOps] = {
    "minivllm_paged_decode_bf16", "minivllm_paged_decode_f32", "minivllm_gemv_bf16",
    "minivllm_gemm_amx_bf16", "minivllm_gemm_amx_silu_mul_bf16", "minivllm_silu_mul_bf16",
    "minivllm_rms_norm_bf16", "minivllm_prefill_attention_bf16", "minivllm_argmax_bf16",
    "minivllm_gguf_gemm", "minivllm_gguf_gemm_amx_bf16", "minivllm_gguf_dequant",
    "minivllm_rotary_embedding_bf16", "minivllm_gather_rows", "minivllm_moe_topk",
    "minivllm_fused_experts_bf16", "minivllm_lora_shrink_expand_bf16",
    "minivllm_fused_experts_gguf", "minivllm_gguf_embedding",
    "minivllm_gguf_repack_x8", "minivllm_paged_decode_bf16_fp8"};

// One argument slot as the type its parameter has.
struct Arg {
  int64_t v;
  template <typename T>
  operator T*() const { return reinterpret_cast<T*>(v); }
  operator int64_t() const { return v; }
  operator int32_t() const { return static_cast<int32_t>(v); }
  operator float() const {
    const uint32_t bits = static_cast<uint32_t>(v);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
};

template <typename T>
int paged_decode(int (*fn)(const T*, int64_t, T*, T*, int64_t, const int32_t*, int64_t,
                           const int32_t*, const int64_t*, T*, int64_t, int32_t, int32_t,
                           int32_t, int32_t, int32_t, int32_t, float, int32_t, const T*,
                           int64_t, const T*, int64_t, const int64_t*),
                 const Arg* a) {
  return fn(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12],
            a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23]);
}

int run(const int64_t* record) {
  const Arg* a = reinterpret_cast<const Arg*>(record + 1);
  switch (record[0]) {
    case kPagedDecodeBf16: return paged_decode<uint16_t>(minivllm_paged_decode_bf16, a);
    case kPagedDecodeF32: return paged_decode<float>(minivllm_paged_decode_f32, a);
    case kGemvBf16:
      return minivllm_gemv_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                                a[10]);
    case kGemmAmxBf16:
      return minivllm_gemm_amx_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                                    a[10]);
    case kGemmAmxSiluMulBf16:
      return minivllm_gemm_amx_silu_mul_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
                                             a[8], a[9], a[10]);
    case kSiluMulBf16: return minivllm_silu_mul_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6]);
    case kRmsNormBf16:
      return minivllm_rms_norm_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                                    a[10], a[11]);
    case kPrefillAttentionBf16:
      return minivllm_prefill_attention_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
                                             a[8], a[9], a[10], a[11], a[12], a[13]);
    case kArgmaxBf16: return minivllm_argmax_bf16(a[0], a[1], a[2], a[3], a[4], a[5]);
    case kGgufGemm:
      return minivllm_gguf_gemm(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                                a[10], a[11], a[12]);
    case kGgufGemmAmxBf16:
      return minivllm_gguf_gemm_amx_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8],
                                         a[9], a[10], a[11]);
    case kGgufDequant:
      return minivllm_gguf_dequant(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8]);
    case kRotaryEmbeddingBf16:
      return minivllm_rotary_embedding_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
                                            a[8], a[9], a[10], a[11], a[12], a[13]);
    case kGatherRows:
      return minivllm_gather_rows(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    case kMoeTopk:
      return minivllm_moe_topk(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                               a[10], a[11]);
    case kFusedExpertsBf16:
      return minivllm_fused_experts_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8],
                                         a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16]);
    case kLoraShrinkExpandBf16:
      return minivllm_lora_shrink_expand_bf16(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7],
                                              a[8], a[9], a[10], a[11], a[12], a[13], a[14]);
    case kFusedExpertsGguf:
      return minivllm_fused_experts_gguf(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8],
                                         a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16],
                                         a[17], a[18], a[19]);
    case kGgufEmbedding:
      return minivllm_gguf_embedding(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9],
                                     a[10]);
    case kGgufRepackX8: return minivllm_gguf_repack_x8(a[0], a[1], a[2], a[3], a[4], a[5]);
    case kPagedDecodeBf16Fp8:
      return minivllm_paged_decode_bf16_fp8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8],
                                            a[9], a[10], a[11], a[12], a[13], a[14], a[15],
                                            a[16], a[17], a[18], a[19], a[20], a[21], a[22],
                                            a[23], a[24]);
  }
  return -1;  // not an opcode
}

}  // namespace

extern "C" {

// The opcode of the kernel named `name` (its C symbol), or -1 when a graph cannot replay it
// here (the graph then replays from Python).
int minivllm_graph_opcode(const char* name) {
  for (int i = 0; i < kNumOps; ++i)
    if (std::strcmp(name, kOpNames[i]) == 0) return i;
  return -1;
}

int minivllm_graph_record_slots() { return static_cast<int>(kRecordSlots); }

// Runs records [n, kRecordSlots] in order; stops at the first call that does not return 0:
// its return code, with *failed_at its index (0 when all ran).
int minivllm_graph_replay(const int64_t* records, int64_t n, int64_t* failed_at) {
  for (int64_t i = 0; i < n; ++i) {
    const int rc = run(records + i * kRecordSlots);
    if (rc != 0) {
      *failed_at = i;
      return rc;
    }
  }
  *failed_at = 0;
  return 0;
}

}  // extern "C"
