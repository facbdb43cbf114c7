// MoE top-k routing on CPU in one native call.
//
// minivllm_moe_topk: router logits [T, E] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32),
// softmax or sigmoid scores, optionally renormalised over the k chosen, times a scaling factor.
// The experts themselves run in fused_moe.cpp (bf16) and fused_moe_gguf.cpp (GGUF blocks).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_math.h"
#include "kernels.h"

namespace {
// Top-k of one token's scores s[0..E): indices by descending score, ties to the lower index
// (torch.topk leaves their order unspecified; bf16 router logits do tie).
void topk_row(const float* s, int32_t e, int32_t k, int64_t* ids, float* vals) {
  int32_t filled = 0;
  for (int32_t i = 0; i < e; ++i) {
    if (filled == k && !(s[i] > vals[k - 1])) continue;
    int32_t pos = filled < k ? filled++ : k - 1;
    while (pos > 0 && s[i] > vals[pos - 1]) {  // insertion: shift smaller ones down
      vals[pos] = vals[pos - 1];
      ids[pos] = ids[pos - 1];
      --pos;
    }
    vals[pos] = s[i];
    ids[pos] = i;
  }
}

// fp32 scores of one token's logits (bf16 or fp32): softmax over E, or elementwise sigmoid.
template <typename T>
void scores_row(const T* logits, int32_t e, int32_t scoring, float* s) {
  float m = -INFINITY;
  for (int32_t i = 0; i < e; ++i) {
    s[i] = minivllm::to_float(logits[i]);
    m = std::max(m, s[i]);
  }
  if (scoring == 1) {
    for (int32_t i = 0; i < e; ++i) s[i] = 1.0f / (1.0f + std::exp(-s[i]));
    return;
  }
  float sum = 0.0f;
  for (int32_t i = 0; i < e; ++i) sum += (s[i] = std::exp(s[i] - m));
  for (int32_t i = 0; i < e; ++i) s[i] /= sum;
}

template <typename T>
void route(const T* logits, int64_t stride, int64_t t_count, int32_t e, int32_t k,
           int32_t scoring, int32_t renormalize, float scale, int64_t* ids, float* weights,
           int32_t num_threads) {
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> s(e);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < t_count; ++t) {
      scores_row(logits + t * stride, e, scoring, s.data());
      int64_t* id = ids + t * k;
      float* w = weights + t * k;
      topk_row(s.data(), e, k, id, w);
      float sum = 0.0f;
      for (int32_t j = 0; j < k; ++j) sum += w[j];
      const float f = renormalize ? scale / sum : scale;
      for (int32_t j = 0; j < k; ++j) w[j] *= f;
    }
  }
}

}  // namespace

extern "C" {

// logits [T, E] (rows `stride` apart; dtype 0 bf16, 1 fp32) -> ids [T, k] int64 and
// weights [T, k] fp32. scoring 0 softmax, 1 sigmoid. Returns 1 on bad sizes.
int minivllm_moe_topk(const void* logits, int64_t stride, int32_t dtype, int64_t t_count,
                      int32_t e, int32_t k, int32_t scoring, int32_t renormalize, float scale,
                      int64_t* ids, float* weights, int32_t num_threads) {
  if (k < 1 || k > e || (scoring != 0 && scoring != 1) || (dtype != 0 && dtype != 1)) return 1;
  if (dtype == 0)
    route(static_cast<const uint16_t*>(logits), stride, t_count, e, k, scoring, renormalize,
          scale, ids, weights, num_threads);
  else
    route(static_cast<const float*>(logits), stride, t_count, e, k, scoring, renormalize, scale,
          ids, weights, num_threads);
  return 0;
}

}  // extern "C"
