// Batched LoRA for one linear layer of a step (minivllm/lora/punica_wrapper.py), bf16:
//   out[t] += B[slot(t)] (A[slot(t)] x[t])      for every token t with slot(t) >= 0
// in one call. torch needs four or five calls per layer for this (gather by slot, two bmm,
// index_add), and at decode sizes each small bf16 bmm costs ~0.1-0.2 ms on the 2-core box:
// more than the layer itself. Here each token meets only its own adapter's rows, in fp32.
// Used for steps of up to 64 tokens: larger ones are GEMM-sized, where torch's bmm wins.
// Consecutive tokens of one slot (the runner sorts requests by adapter) go in groups of up to
// kGroup, so each weight row loaded from cache serves the whole group.
//
// Layout (L slots, n packed slices, R = max rank, nR = n * R):
//   lora_a [L, nR, in]    slice k's A in rows [k*R, (k+1)*R)
//   lora_b [L, nR, out]   slice k's B^T in rows [k*R, (k+1)*R), columns slices[2k] + [0,
//                         slices[2k+1]); only these diagonal blocks are read
// out is updated in place, rounded once (fp32 out + fp32 delta -> bf16, nearest even).
#include <cstdint>
#include <vector>

#include "cpu_math.h"
#include "kernels.h"

namespace {

using minivllm::store;
using minivllm::to_float;

constexpr int kGroup = 4;

#if defined(__AVX512F__)
inline __m512 load16_bf16(const uint16_t* p) {  // 16 bf16 -> 16 fp32
  return minivllm::widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// shrink[r][j] = A[j] . x_r for the group's g tokens (rows x_r of x, `x_stride` apart).
void shrink_rows(const uint16_t* a, const uint16_t* x, int64_t x_stride, int g,
                 int64_t rank_rows, int64_t in_dim, float* shrink) {
  for (int64_t j = 0; j < rank_rows; ++j) {
    const uint16_t* row = a + j * in_dim;
    int64_t i = 0;
#if MINIVLLM_BF16_SIMD
    __m512 acc[kGroup];
    for (int r = 0; r < g; ++r) acc[r] = _mm512_setzero_ps();
    for (; i + 32 <= in_dim; i += 32) {  // bf16 pair dot products, fp32 sums
      const __m512i av = _mm512_loadu_si512(row + i);
      for (int r = 0; r < g; ++r)
        acc[r] = minivllm::dot_bf16x32(acc[r], av, _mm512_loadu_si512(x + r * x_stride + i));
    }
    float sums[kGroup];
    for (int r = 0; r < g; ++r) sums[r] = _mm512_reduce_add_ps(acc[r]);
#else
    float sums[kGroup] = {0.f, 0.f, 0.f, 0.f};
#endif
    for (; i < in_dim; ++i)
      for (int r = 0; r < g; ++r) sums[r] += to_float(row[i]) * to_float(x[r * x_stride + i]);
    for (int r = 0; r < g; ++r) shrink[r * rank_rows + j] = sums[r];
  }
}

// out_r[o] = bf16(out_r[o] + sum_j shrink[r][j] * B[j][o]) over one diagonal block of B.
void expand_block(const uint16_t* b, int64_t b_stride, const float* shrink, int64_t shrink_stride,
                  int g, int64_t rank, int64_t size, uint16_t* out, int64_t out_stride) {
  int64_t o = 0;
#if defined(__AVX512F__)
  for (; o + 16 <= size; o += 16) {
    __m512 acc[kGroup];
    for (int r = 0; r < g; ++r) acc[r] = load16_bf16(out + r * out_stride + o);
    for (int64_t j = 0; j < rank; ++j) {
      const __m512 bv = load16_bf16(b + j * b_stride + o);
      for (int r = 0; r < g; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(shrink[r * shrink_stride + j]), bv, acc[r]);
    }
    alignas(64) float tmp[16];
    for (int r = 0; r < g; ++r) {
      _mm512_store_ps(tmp, acc[r]);
      for (int l = 0; l < 16; ++l) store(tmp[l], out + r * out_stride + o + l);
    }
  }
#endif
  for (; o < size; ++o)
    for (int r = 0; r < g; ++r) {
      float acc = to_float(out[r * out_stride + o]);
      for (int64_t j = 0; j < rank; ++j) acc += shrink[r * shrink_stride + j] * to_float(b[j * b_stride + o]);
      store(acc, out + r * out_stride + o);
    }
}

}  // namespace

extern "C" int minivllm_lora_shrink_expand_bf16(
    const uint16_t* x, int64_t x_stride, uint16_t* out, int64_t out_stride,
    const uint16_t* lora_a, const uint16_t* lora_b, const int64_t* token_slots,
    const int64_t* slices, int64_t num_tokens, int64_t num_slices, int64_t rank,
    int64_t in_dim, int64_t out_dim, int64_t num_loras, int32_t num_threads) {
  const int64_t rank_rows = num_slices * rank;
  std::vector<int64_t> groups;  // first token of each group of one slot (base tokens skipped)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = token_slots[t];
    if (slot >= num_loras) return 1;  // a slot outside the table
    if (slot < 0) continue;           // the base model
    if (groups.empty() || t - groups.back() >= kGroup || token_slots[groups.back()] != slot ||
        token_slots[t - 1] != slot)
      groups.push_back(t);
  }
  const int64_t num_groups = static_cast<int64_t>(groups.size());
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> shrink(kGroup * rank_rows);
#pragma omp for schedule(dynamic)
    for (int64_t n = 0; n < num_groups; ++n) {
      const int64_t t0 = groups[n], slot = token_slots[t0];
      int g = 1;
      while (g < kGroup && t0 + g < num_tokens && token_slots[t0 + g] == slot &&
             (n + 1 == num_groups || t0 + g < groups[n + 1]))
        ++g;
      shrink_rows(lora_a + slot * rank_rows * in_dim, x + t0 * x_stride, x_stride, g,
                  rank_rows, in_dim, shrink.data());
      const uint16_t* b = lora_b + slot * rank_rows * out_dim;
      for (int64_t k = 0; k < num_slices; ++k) {  // one diagonal block of B per slice
        const int64_t offset = slices[2 * k];
        expand_block(b + k * rank * out_dim + offset, out_dim, shrink.data() + k * rank,
                     rank_rows, g, rank, slices[2 * k + 1], out + t0 * out_stride + offset,
                     out_stride);
      }
    }
  }
  return 0;
}
