// RMSNorm of bf16 rows, optionally after adding the residual (RMSNorm's fused residual form).
//
// torch.rms_norm on a decode-sized bf16 row runs ~12 small ops (~50 us in a decode step, 61 calls
// per step on a 30-layer model); this is one pass. Roundings follow eager: x + residual rounded
// to bf16 (the new residual), then y = bf16(float(x) * rstd * float(w)) with
// rstd = 1 / sqrt(mean(x^2) + eps) summed in fp32.

#include <cmath>
#include <cstdint>
#include "kernels.h"

#include "cpu_math.h"

#if MINIVLLM_BF16_SIMD
#include <immintrin.h>

namespace {

inline void store_bf16(uint16_t* p, __mmask16 live, __m512 v) {
  _mm256_mask_storeu_epi16(p, live, minivllm::cvt_bf16x16(v));
}

inline __mmask16 live_mask(int64_t left) {
  return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
}

// x (and residual) -> out (and new_residual); one row of d values.
void norm_row(const uint16_t* x, const uint16_t* residual, uint16_t* new_residual,
              const uint16_t* w, uint16_t* out, int64_t d, float eps) {
  __m512 acc = _mm512_setzero_ps();
  const uint16_t* src = x;
  if (residual != nullptr) {
    for (int64_t j = 0; j < d; j += 16) {
      const __mmask16 live = live_mask(d - j);
      const __m512 sum = _mm512_add_ps(minivllm::load_bf16x16(x + j, live), minivllm::load_bf16x16(residual + j, live));
      store_bf16(new_residual + j, live, sum);   // rounded: the norm reads the bf16 sum
    }
    src = new_residual;
  }
  for (int64_t j = 0; j < d; j += 16) {
    const __m512 v = minivllm::load_bf16x16(src + j, live_mask(d - j));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + eps);
  const __m512 scale = _mm512_set1_ps(rstd);
  for (int64_t j = 0; j < d; j += 16) {
    const __mmask16 live = live_mask(d - j);
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(minivllm::load_bf16x16(src + j, live), scale),
                                   minivllm::load_bf16x16(w + j, live));
    store_bf16(out + j, live, v);
  }
}

}  // namespace

#else

namespace {

// norm_row without AVX-512 (AVX2 CPUs, others): the same roundings, sums in 16 lanes as there;
// plain loops the compiler vectorises.
void norm_row(const uint16_t* x, const uint16_t* residual, uint16_t* new_residual,
              const uint16_t* w, uint16_t* out, int64_t d, float eps) {
  using minivllm::to_float;
  const uint16_t* src = x;
  if (residual != nullptr) {
    for (int64_t j = 0; j < d; ++j)
      minivllm::store(to_float(x[j]) + to_float(residual[j]), new_residual + j);
    src = new_residual;
  }
  float acc[16] = {};
  for (int64_t j = 0; j < d; ++j) acc[j % 16] += to_float(src[j]) * to_float(src[j]);
  float sum = 0.0f;
  for (int l = 0; l < 16; ++l) sum += acc[l];
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j)
    minivllm::store(to_float(src[j]) * rstd * to_float(w[j]), out + j);
}

}  // namespace

#endif

extern "C" {

// x [m, d] in groups of `group` rows: row i at x + (i / group) * x_stride + (i % group) * d
// (group 1: rows x_stride apart; group H: the H heads of each token of a [T, H * d] view, e.g.
// q inside a fused qkv output); residual [m, d] or null (rows r_stride apart; group 1 only);
// w [d]; out and new_residual contiguous [m, d] (new_residual only with a residual).
int minivllm_rms_norm_bf16(const uint16_t* x, int64_t x_stride, int64_t group,
                           const uint16_t* residual, int64_t r_stride, uint16_t* new_residual,
                           const uint16_t* w, uint16_t* out, int64_t m, int64_t d, float eps,
                           int32_t num_threads) {
  if (m < 0 || d <= 0 || group < 1 || (group > 1 && residual != nullptr)) return 1;
  // One thread below ~32K values: waking the second costs more than it saves.
  const int threads = m * d < 32768 ? 1 : num_threads;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    norm_row(x + (i / group) * x_stride + (i % group) * d,
             residual ? residual + i * r_stride : nullptr,
             residual ? new_residual + i * d : nullptr, w, out + i * d, d, eps);
  }
  return 0;
}

}  // extern "C"
