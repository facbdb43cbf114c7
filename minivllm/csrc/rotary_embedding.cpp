// Rotary position embedding of bf16 query/key rows, in place (vLLM's rotary_embedding op).
//
// Eager torch rotates a decode step's q/k with ~8 small ops per layer (index_select of cos/sin,
// roll, two products, an add, views); this is one pass over the rows (AVX-512 for NeoX halves),
// and a native call that a CPU graph (compilation/cpu_graph.py) can record. Roundings follow
// eager bf16: each product x * cos and x * sin is rounded to bf16, then their sum/difference is
// rounded again, so the result is bit-identical to RotaryEmbedding.forward_native on bf16.

#include <cstdint>
#include "kernels.h"

#include <omp.h>
#if MINIVLLM_BF16_SIMD
#include <immintrin.h>
#endif

#include "cpu_math.h"

namespace {

using minivllm::store;
using minivllm::to_float;

inline float round_bf16(float x) {
  uint16_t b;
  store(x, &b);
  return to_float(b);
}

#if MINIVLLM_BF16_SIMD
// NeoX halves 16 pairs at a time: the same roundings as the scalar loop below.
inline void rotate_neox16(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int half) {
  int i = 0;
  for (; i < half; i += 16) {
    const __mmask16 live = half - i >= 16 ? 0xFFFF : (__mmask16)((1u << (half - i)) - 1);
    const __m512 x1 = minivllm::load_bf16x16(x + i, live), x2 = minivllm::load_bf16x16(x + i + half, live);
    const __m512 c = minivllm::load_bf16x16(cos + i, live), s = minivllm::load_bf16x16(sin + i, live);
    using minivllm::round_bf16_16;
    const __m512 o1 = _mm512_sub_ps(round_bf16_16(_mm512_mul_ps(x1, c)),
                                    round_bf16_16(_mm512_mul_ps(x2, s)));
    const __m512 o2 = _mm512_add_ps(round_bf16_16(_mm512_mul_ps(x2, c)),
                                    round_bf16_16(_mm512_mul_ps(x1, s)));
    _mm256_mask_storeu_epi16(x + i, live, minivllm::cvt_bf16x16(o1));
    _mm256_mask_storeu_epi16(x + i + half, live, minivllm::cvt_bf16x16(o2));
  }
}
#elif defined(__AVX2__)
// rotate_neox16 with AVX2, 8 pairs at a time; returns the pairs done (the rest: scalar).
inline int rotate_neox8(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int half) {
  using minivllm::round_bf16_8;
  using minivllm::widen_bf16x8;
  int i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 x1 = widen_bf16x8(x + i), x2 = widen_bf16x8(x + i + half);
    const __m256 c = widen_bf16x8(cos + i), s = widen_bf16x8(sin + i);
    const __m256 o1 = _mm256_sub_ps(round_bf16_8(_mm256_mul_ps(x1, c)),
                                    round_bf16_8(_mm256_mul_ps(x2, s)));
    const __m256 o2 = _mm256_add_ps(round_bf16_8(_mm256_mul_ps(x2, c)),
                                    round_bf16_8(_mm256_mul_ps(x1, s)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x + i), minivllm::cvt_bf16x8(o1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(x + i + half), minivllm::cvt_bf16x8(o2));
  }
  return i;
}
#endif

// One head of `head_size` values: the first `rotary_dim` rotated by cos/sin [rotary_dim / 2].
// NeoX pairs element i with i + rotary_dim / 2; GPT-J pairs 2i with 2i + 1.
inline void rotate_head(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int half,
                        bool neox) {
#if MINIVLLM_BF16_SIMD
  if (neox) {
    rotate_neox16(x, cos, sin, half);
    return;
  }
#endif
  int i = 0;
#if !MINIVLLM_BF16_SIMD && defined(__AVX2__)
  if (neox) i = rotate_neox8(x, cos, sin, half);
#endif
  for (; i < half; ++i) {
    uint16_t* p1 = neox ? x + i : x + 2 * i;
    uint16_t* p2 = neox ? x + i + half : x + 2 * i + 1;
    const float x1 = to_float(*p1), x2 = to_float(*p2);
    const float c = to_float(cos[i]), s = to_float(sin[i]);
    const float o1 = round_bf16(x1 * c) - round_bf16(x2 * s);
    const float o2 = round_bf16(x2 * c) + round_bf16(x1 * s);
    store(o1, p1);
    store(o2, p2);
  }
}

}  // namespace

extern "C" {

// query [T, >= num_q_heads * head_size] (rows q_stride elements apart), key likewise (null: no
// key); cos_sin_cache bf16 [max_position, rotary_dim] (cos half, then sin half); positions
// int64 [T]. Returns 0; 1: bad shapes; 2: a position outside the cache.
int minivllm_rotary_embedding_bf16(const int64_t* positions, int64_t num_tokens,
                                   uint16_t* query, int64_t q_stride, int32_t num_q_heads,
                                   uint16_t* key, int64_t k_stride, int32_t num_k_heads,
                                   const uint16_t* cos_sin_cache, int64_t max_position,
                                   int32_t head_size, int32_t rotary_dim, int32_t is_neox,
                                   int32_t num_threads) {
  if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > head_size) return 1;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (positions[t] < 0 || positions[t] >= max_position) return 2;
  const int half = rotary_dim / 2;
  const int64_t heads = num_q_heads + (key != nullptr ? num_k_heads : 0);
  const int64_t work = num_tokens * heads;
  // A decode step has ~12 heads of 64 values: threads only pay off for prompt chunks.
  const int threads = work >= 256 ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t w = 0; w < work; ++w) {
    const int64_t t = w / heads, h = w % heads;
    const uint16_t* cos = cos_sin_cache + positions[t] * rotary_dim;
    uint16_t* x = h < num_q_heads ? query + t * q_stride + h * head_size
                                  : key + t * k_stride + (h - num_q_heads) * head_size;
    rotate_head(x, cos, cos + half, half, is_neox != 0);
  }
  return 0;
}

}  // extern "C"
