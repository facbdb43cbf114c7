// bf16 matrix-vector product y = W x (+ b) for one-token linears (batch-1 decode).
//
// At one token a linear layer only streams its weight once, so its speed is memory bandwidth.
// oneDNN's blocked GEMM reached ~11 GB/s on the 2-core box at M = 1; this plain loop over the
// checkpoint's row-major [N, K] weight, 4 rows at a time with AVX-512 BF16 dot products
// (32 multiply-adds per instruction, fp32 accumulation), reaches ~15 GB/s: two sequential
// streams, one per thread.

#include <cstdint>
#include "kernels.h"

#include "cpu_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

constexpr int kRows = 4;  // rows per step: 4 independent accumulators hide the FMA latency

extern "C" {

int minivllm_has_gemv_bf16() { return 1; }

// x [k], w [n, k] with rows w_row_stride apart, bias [n] or null, y [n]; k % 32 == 0.
int minivllm_gemv_bf16(const uint16_t* x, const uint16_t* w, int64_t w_row_stride,
                       const uint16_t* bias, uint16_t* y, int64_t n, int64_t k,
                       int32_t num_threads) {
  if (k % 32 != 0) return 1;
  const int64_t chunks = k / 32;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t r0 = 0; r0 < n; r0 += kRows) {
    const int rows = n - r0 < kRows ? static_cast<int>(n - r0) : kRows;
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + c * 32);
      for (int r = 0; r < rows; ++r) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (r0 + r) * w_row_stride + c * 32);
        acc[r] = _mm512_dpbf16_ps(acc[r], wv, xv);
      }
    }
    for (int r = 0; r < rows; ++r) {
      float s = _mm512_reduce_add_ps(acc[r]);
      if (bias != nullptr) s += minivllm::to_float(bias[r0 + r]);
      minivllm::store(s, y + r0 + r);
    }
  }
  return 0;
}

}  // extern "C"

#else

extern "C" {
int minivllm_has_gemv_bf16() { return 0; }  // no AVX-512 BF16: oneDNN keeps every linear
int minivllm_gemv_bf16(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, uint16_t*,
                       int64_t, int64_t, int32_t) {
  return 2;
}
}  // extern "C"

#endif
