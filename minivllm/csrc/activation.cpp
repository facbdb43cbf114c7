// silu(x[:, :d]) * x[:, d:] for bf16 rows (SiluAndMul): the gate/up halves of a gate_up_proj.
//
// inductor's kernel for this spent ~70 us on a [64, 3072] input (its vectorized exp is a ~1 ulp
// libm-grade routine); the polynomial exp of cpu_math.h is enough for a result rounded to bf16.
// Roundings follow eager bf16: silu rounded to bf16, then the product.

#include <cstdint>
#include "kernels.h"

#include "cpu_math.h"

#if MINIVLLM_BF16_SIMD
#include <immintrin.h>

namespace {

void silu_mul_row(const uint16_t* x, int64_t d, uint16_t* y) {
  for (int64_t j = 0; j < d; j += 16) {
    const __mmask16 live = d - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (d - j)) - 1);
    const __m512 r = minivllm::silu_mul16(minivllm::load_bf16x16(x + j, live), minivllm::load_bf16x16(x + d + j, live));
    _mm256_mask_storeu_epi16(y + j, live, minivllm::cvt_bf16x16(r));
  }
}

}  // namespace

#else

namespace {

// Without AVX-512: 8 lanes at a time with AVX2 (silu_mul8), the rest by silu_mul1 (cpu_math.h),
// one value at a time (the scalar loop alone took 20 us for the default model's 1536 values).
void silu_mul_row(const uint16_t* x, int64_t d, uint16_t* y) {
  using minivllm::to_float;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; j + 8 <= d; j += 8) {
    const __m256 r = minivllm::silu_mul8(minivllm::widen_bf16x8(x + j),
                                         minivllm::widen_bf16x8(x + d + j));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + j), minivllm::cvt_bf16x8(r));
  }
#endif
  for (; j < d; ++j)
    minivllm::store(minivllm::silu_mul1(to_float(x[j]), to_float(x[d + j])), y + j);
}

}  // namespace

#endif

extern "C" {

// x [m, 2d] (rows x_stride apart) -> y [m, d] (rows y_stride apart), bf16.
int minivllm_silu_mul_bf16(const uint16_t* x, int64_t x_stride, uint16_t* y, int64_t y_stride,
                           int64_t m, int64_t d, int32_t num_threads) {
  if (m < 0 || d < 0) return 1;
  // One thread below ~32K outputs: waking the second costs more than it saves.
  const int threads = m * d < 32768 ? 1 : num_threads;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < m; ++i) silu_mul_row(x + i * x_stride, d, y + i * y_stride);
  return 0;
}

}  // extern "C"

