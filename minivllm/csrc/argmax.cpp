// Row-wise argmax of bf16 logits for plain-greedy sampling: out[r] = the first index of the
// largest value in row r. torch's max(dim=-1) on [64, 49152] bf16 takes ~2.5 ms on the 2-core
// box (scalar value/index tracking); 16 fp32 lanes with strict-greater updates keep each lane's
// first maximum, and the lanes are merged by (value, then smallest index).

#include <cmath>
#include <cstdint>
#include "kernels.h"

#include "cpu_math.h"

// Columns [c0, cols) of row into the running maximum (*m, *arg): a later index wins only when
// strictly larger (the first maximum).
inline void first_max(const uint16_t* row, int64_t c0, int64_t cols, float* m, int64_t* arg) {
  for (int64_t c = c0; c < cols; ++c) {
    const float f = minivllm::to_float(row[c]);
    if (f > *m) {
      *m = f;
      *arg = c;
    }
  }
}

// The lanes' maxima (each lane's first) merged into (*m, *arg): by value, then smallest index.
inline void merge_lanes(const float* vals, const int32_t* ids, int lanes, float* m,
                        int64_t* arg) {
  for (int l = 0; l < lanes; ++l)
    if (vals[l] > *m || (vals[l] == *m && ids[l] < *arg)) {
      *m = vals[l];
      *arg = ids[l];
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

extern "C" int minivllm_argmax_bf16(const uint16_t* x, int64_t rows, int64_t cols,
                                    int64_t row_stride, int64_t* out, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * row_stride;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_idx = _mm512_set1_epi32(0);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
      const __m512 v = minivllm::widen_bf16x16(raw);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, gt, v);
      best_idx = _mm512_mask_mov_epi32(best_idx, gt, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, best);
    _mm512_store_si512(ids, best_idx);
    float m = -INFINITY;
    int64_t arg = 0;
    merge_lanes(vals, ids, 16, &m, &arg);
    first_max(row, c, cols, &m, &arg);  // tail: later indices win only when strictly larger
    out[r] = arg;
  }
  return 0;
}

#elif defined(__AVX2__)

// The AVX-512 loop on 8 lanes (the scalar loop took ~0.2 ms of a batch-1 decode step's ~9).
extern "C" int minivllm_argmax_bf16(const uint16_t* x, int64_t rows, int64_t cols,
                                    int64_t row_stride, int64_t* out, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * row_stride;
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i best_idx = _mm256_setzero_si256();
    __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) {
      const __m256 v = minivllm::widen_bf16x8(row + c);
      const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      best = _mm256_blendv_ps(best, v, gt);
      best_idx = _mm256_blendv_epi8(best_idx, idx, _mm256_castps_si256(gt));
      idx = _mm256_add_epi32(idx, step);
    }
    alignas(32) float vals[8];
    alignas(32) int32_t ids[8];
    _mm256_store_ps(vals, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ids), best_idx);
    float m = -INFINITY;
    int64_t arg = 0;
    merge_lanes(vals, ids, 8, &m, &arg);
    first_max(row, c, cols, &m, &arg);
    out[r] = arg;
  }
  return 0;
}

#else

// Without AVX-512: the same first-maximum rule, one value at a time.
extern "C" int minivllm_argmax_bf16(const uint16_t* x, int64_t rows, int64_t cols,
                                    int64_t row_stride, int64_t* out, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * row_stride;
    float m = -INFINITY;
    int64_t arg = 0;
    first_max(row, 0, cols, &m, &arg);
    out[r] = arg;
  }
  return 0;
}

#endif
