// bf16 matrix-vector products y = W x (+ b) for decode-sized linears (one token, or a few on
// CPUs without AMX).
//
// At one token a linear layer only streams its weight once, so its speed is memory bandwidth.
// oneDNN's blocked GEMM reached ~11 GB/s on the 2-core box at M = 1; this plain loop over the
// checkpoint's row-major [N, K] weight, 4 rows at a time with bf16 pair dot products
// (vdpbf16ps, 32 multiply-adds per instruction, or cpu_math.h's emulation; fp32 sums),
// reaches ~15 GB/s: two sequential streams, one per thread (one weight row at a time for one
// token: ~25 GB/s on Zen 4). AVX2 CPUs run the 4-row loop in 8-lane registers.

#include <cstdint>
#include "kernels.h"

#include "cpu_math.h"
#include "work_split.h"

#if MINIVLLM_BF16_SIMD
#include <immintrin.h>
#include <omp.h>

constexpr int kRows = 4;  // rows per step: 4 independent accumulators hide the FMA latency

// Row w (k = 32 * chunks bf16) . x: four accumulators over interleaved chunks hide vdpbf16ps's
// latency (fp32 sums).
inline float row_dot(const uint16_t* w, const uint16_t* x, int64_t chunks) {
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                 _mm512_setzero_ps()};
  int64_t c = 0;
  for (; c + 4 <= chunks; c += 4)
    for (int j = 0; j < 4; ++j)
      a[j] = minivllm::dot_bf16x32(a[j], _mm512_loadu_si512(w + (c + j) * 32),
                                   _mm512_loadu_si512(x + (c + j) * 32));
  for (int j = 0; c < chunks; ++c, ++j)
    a[j] = minivllm::dot_bf16x32(a[j], _mm512_loadu_si512(w + c * 32),
                                 _mm512_loadu_si512(x + c * 32));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]),
                                            _mm512_add_ps(a[2], a[3])));
}

// Rows [r0, r0 + kRows) of y (fewer at the end) for all m rows of x. One row of x: one weight
// row at a time, so each thread's weight reads are one sequential stream across rows, which the
// hardware prefetcher follows past each 4 KB row (4 rows side by side are 4 streams restarting
// at every row's page: 21-23 GB/s against 24-27 on Zen 4, 2 threads, [32768, 2048] and
// [5120, 2048]). More rows of x: 4 weight rows side by side, each loaded once for every row
// of x (one weight row with 4 rows of x in registers was 0.6-0.9x that at 4-8 rows).
inline void gemv_rows(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                      int64_t w_row_stride, const uint16_t* bias, uint16_t* y, int64_t y_stride,
                      int64_t m, int64_t n, int64_t chunks, int64_t r0) {
  const int rows = n - r0 < kRows ? static_cast<int>(n - r0) : kRows;
  if (m == 1) {
    for (int r = 0; r < rows; ++r) {
      float s = row_dot(w + (r0 + r) * w_row_stride, x, chunks);
      if (bias != nullptr) s += minivllm::to_float(bias[r0 + r]);
      minivllm::store(s, y + r0 + r);
    }
    return;
  }
  // Each weight row keeps row_dot's four accumulators over the same interleaved chunks and
  // sums them in its order, so a row of y is bit-identical whatever m is: a request's tokens do
  // not depend on how many rows share its step (batched decode, draft verification).
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* xi = x + i * x_stride;
    __m512 acc[kRows][4];
    for (int r = 0; r < kRows; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 4 <= chunks; c += 4)
      for (int j = 0; j < 4; ++j) {
        const __m512i xv = _mm512_loadu_si512(xi + (c + j) * 32);
        for (int r = 0; r < rows; ++r)
          acc[r][j] = minivllm::dot_bf16x32(
              acc[r][j], _mm512_loadu_si512(w + (r0 + r) * w_row_stride + (c + j) * 32), xv);
      }
    for (int j = 0; c < chunks; ++c, ++j) {
      const __m512i xv = _mm512_loadu_si512(xi + c * 32);
      for (int r = 0; r < rows; ++r)
        acc[r][j] = minivllm::dot_bf16x32(
            acc[r][j], _mm512_loadu_si512(w + (r0 + r) * w_row_stride + c * 32), xv);
    }
    for (int r = 0; r < rows; ++r) {
      float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]),
                                                   _mm512_add_ps(acc[r][2], acc[r][3])));
      if (bias != nullptr) s += minivllm::to_float(bias[r0 + r]);
      minivllm::store(s, y + i * y_stride + r0 + r);
    }
  }
}

#define MINIVLLM_GEMV 1

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

constexpr int kRows = 4;

// As the AVX-512 gemv_rows, for AVX2 CPUs (Zen 2/3, client Intel): x and the weight widened
// 8 at a time, two accumulators per row (fp32 sums; another summation order than there).
inline void gemv_rows(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                      int64_t w_row_stride, const uint16_t* bias, uint16_t* y, int64_t y_stride,
                      int64_t m, int64_t n, int64_t chunks, int64_t r0) {
  const int rows = n - r0 < kRows ? static_cast<int>(n - r0) : kRows;
  const uint16_t* wr[kRows];
  for (int r = 0; r < kRows; ++r) wr[r] = w + (r0 + (r < rows ? r : rows - 1)) * w_row_stride;
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* xi = x + i * x_stride;
    __m256 acc[kRows][2];
    for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < chunks * 32; e += 16) {
      const __m256 x0 = minivllm::widen_bf16x8(xi + e), x1 = minivllm::widen_bf16x8(xi + e + 8);
      for (int r = 0; r < kRows; ++r) {
        acc[r][0] = _mm256_fmadd_ps(minivllm::widen_bf16x8(wr[r] + e), x0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(minivllm::widen_bf16x8(wr[r] + e + 8), x1, acc[r][1]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      float s = minivllm::hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
      if (bias != nullptr) s += minivllm::to_float(bias[r0 + r]);
      minivllm::store(s, y + i * y_stride + r0 + r);
    }
  }
}

#define MINIVLLM_GEMV 1
#endif

#if MINIVLLM_GEMV

extern "C" {

int minivllm_has_gemv_bf16() { return 1; }

// y [m, n] (rows y_stride apart) = x [m, k] (rows x_stride apart) W^T (+ bias [n] or null) for
// w [n, k] with rows w_row_stride apart; k % 32 == 0. Each step's 4 weight rows (<= 16 KB at
// k = 2048) stay in L1 while every row of x meets them, so the weight streams once for all m
// rows (batched decode steps on CPUs without AMX).
int minivllm_gemv_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                       int64_t w_row_stride, const uint16_t* bias, uint16_t* y,
                       int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
  if (k % 32 != 0 || m < 1) return 1;
  const int64_t chunks = k / 32;
  minivllm::WorkSplit split((n + kRows - 1) / kRows, num_threads);
#pragma omp parallel num_threads(num_threads)
  {
    int64_t g0, g1;
    while (split.next(omp_get_thread_num(), &g0, &g1))
      for (int64_t r0 = g0 * kRows; r0 < n && r0 < g1 * kRows; r0 += kRows)
        gemv_rows(x, x_stride, w, w_row_stride, bias, y, y_stride, m, n, chunks, r0);
  }
  return 0;
}

}  // extern "C"

#else

extern "C" {
int minivllm_has_gemv_bf16() { return 0; }  // neither AVX-512 (F + BW) nor AVX2: oneDNN's GEMM
int minivllm_gemv_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*,
                       uint16_t*, int64_t, int64_t, int64_t, int64_t, int32_t) {
  return 2;
}
}  // extern "C"

#endif
