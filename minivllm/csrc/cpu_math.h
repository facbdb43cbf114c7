// Small scalar/vector helpers shared by the native kernels (header-only, inline).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace minivllm {

#if defined(__AVX2__)
// The sum of 8 fp32 lanes (the AVX2 kernels' row sums: gemv.cpp, gguf_avx2.h).
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// 8 bf16 at p -> 8 floats (exact: the high halves of fp32 words).
inline __m256 widen_bf16x8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats -> 8 bf16, nearest even, NaN -> 0x7fc0 (store's rounding).
inline __m128i cvt_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// v rounded to its nearest bf16 value (as a float).
inline __m256 round_bf16_8(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(cvt_bf16x8(v)), 16));
}
#endif

inline float to_float(float x) { return x; }

inline float to_float(uint16_t x) {  // bfloat16 bits -> float: the high half of an fp32
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline void store(float x, float* p) { *p = x; }

inline void store(float x, uint16_t* p) {  // float -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *p = 0x7fc0;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 in a form the compiler vectorizes (std::exp is a scalar libm call, which
// cost as much as the whole dot-product pass): 2^(x*log2 e) = 2^k * 2^f with k = round(.) and
// f in [-0.5, 0.5], 2^f by its degree-6 Taylor polynomial (relative error < 2e-7).
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;                   // exp(-87) ~ 1.6e-38: still a normal float
  const float t = x * 1.44269504089f;
  const float k = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
  const float f = (t - k) * 0.69314718056f;         // 2^(t-k) = e^f, |f| <= 0.347
  const float p =
      1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k as a float
  float scale2;
  std::memcpy(&scale2, &bits, sizeof(scale2));
  return p * scale2;
}

// silu(g) * u as eager bf16 computes it, one value (silu_mul16 below without AVX-512): silu in
// fp32 rounded to bf16, then the product (rounded by the caller's store); the same polynomial
// exp and branches as there.
inline float silu_mul1(float g, float u) {
  const float t = exp_nonpositive(-std::fabs(g));
  const float sig = g >= -87.0f ? (g < 0.0f ? t : 1.0f) / (1.0f + t) : 0.0f;
  uint16_t s;
  store(g * sig, &s);
  return to_float(s) * u;
}

#if defined(__AVX2__) && defined(__FMA__)
// silu_mul1 on 8 lanes (the AVX2 form of silu_mul16 below): the same polynomial exp, 2^k by
// adding k to the exponent bits (k >= -126 here: a normal float, as scalef gives), the same
// branches and roundings.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 x = _mm256_max_ps(_mm256_sub_ps(zero, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g)),
                                 _mm256_set1_ps(-87.0f));     // -|g|, clamped
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f));
  const __m256 k = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, k), _mm256_set1_ps(0.69314718056f));
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, one);
  p = _mm256_fmadd_ps(p, f, one);
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));   // exp(-|g|)
  const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(g, zero, _CMP_LT_OQ));
  const __m256 live = _mm256_cmp_ps(g, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m256 sig = _mm256_and_ps(live, _mm256_div_ps(num, _mm256_add_ps(one, e)));
  return _mm256_mul_ps(round_bf16_8(_mm256_mul_ps(g, sig)), u);
}
#endif

#if defined(__AVX512F__)
// 16 bf16 -> 16 floats (exact: the high halves of fp32 words).
inline __m512 widen_bf16x16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// exp_nonpositive on 16 lanes: 2^k by scalef (exact), 2^f by the same polynomial.
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.69314718056f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

#if defined(__AVX512BW__)
// bf16 vector kernels run on every AVX-512 CPU (F + BW): with the AVX-512 BF16 instructions
// where the CPU has them (Sapphire Rapids, Zen 4), else with the same arithmetic in integer and
// fp32 ops (Skylake-X, Cascade Lake, Ice Lake: a few more ops, still far ahead of the torch
// fallbacks there).
#define MINIVLLM_BF16_SIMD 1

// 16 floats -> 16 bf16, nearest even; NaN -> 0x7fc0 (torch's bits) when emulated.
inline __m256i cvt_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
#endif
}

// 32 floats -> 32 bf16 (lo: words 0-15), as _mm512_cvtne2ps_pbh(hi, lo).
inline __m512i cvt_bf16x32(__m512 hi, __m512 lo) {
#if defined(__AVX512BF16__)
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#else
  return _mm512_inserti64x4(_mm512_castsi256_si512(cvt_bf16x16(lo)), cvt_bf16x16(hi), 1);
#endif
}

// acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] for 32 bf16 in a and b (as _mm512_dpbf16_ps).
inline __m512 dot_bf16x32(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  // the odd pair first, as the instruction's definition adds them
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                        _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
}

// 16 bf16 at p (lanes outside `live` zero, never read) -> 16 floats.
inline __m512 load_bf16x16(const uint16_t* p, __mmask16 live = 0xFFFF) {
  return widen_bf16x16(_mm256_maskz_loadu_epi16(live, p));
}

// 16 floats rounded to bf16 (nearest even) and widened back: what a bf16 tensor would hold.
inline __m512 round_bf16_16(__m512 v) { return widen_bf16x16(cvt_bf16x16(v)); }

// silu(g) * u as eager bf16 computes it from bf16 g, u: silu in fp32 rounded to bf16, then the
// product (rounded by the caller's store). sigmoid(g) from t = exp(-|g|) <= 1 (no overflow):
// 1 / (1 + t) for g >= 0, t / (1 + t) below; 0 below g = -87 (where t would leave the normal
// range: eager's value there is under 1e-36 in size, and exactly 0 below -88.7).
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 t = exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __mmask16 live = _mm512_cmp_ps_mask(g, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 num = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), neg, t);
  const __m512 sig = _mm512_maskz_div_ps(live, num, _mm512_add_ps(_mm512_set1_ps(1.0f), t));
  return _mm512_mul_ps(round_bf16_16(_mm512_mul_ps(g, sig)), u);
}
#endif  // __AVX512BW__

// out[j] = sum of the 16 lanes of v[j], j < 16: a transpose-add tree (~3 ops per vector instead
// of ~8 for one horizontal sum each); each level halves the vectors, the last permute restores
// the order.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 r[8], s[4], t[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: 8 partials of v[2i] | of v[2i+1]
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarter k: 4 partials of v[4i+k]
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * i], r[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter k: 2 partials of v[8i+k], 2 of v[8i+4+k]
    t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // element 4k+m of u is the sum of v[4m+k]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, u);
}
#endif

// scores [group, n] (rows `stride` floats apart; 0: stride = n) -> unnormalized exp(s - max) in
// place; inv_sum[g] = 1 / row sum. NOTE: explicitly vectorized: the scalar loops cost as much
// as the whole pass over the values.
inline void softmax_rows(float* scores, int32_t group, int32_t n, float* inv_sum,
                         int32_t stride = 0) {
  for (int32_t g = 0; g < group; ++g) {
    float* sg = scores + g * (stride > 0 ? stride : n);
#if defined(__AVX512F__)
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    __m512 mv = neg_inf;
    for (int32_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(neg_inf, live, sg + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 sum = _mm512_setzero_ps();
    for (int32_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sg + j), m));
      _mm512_mask_storeu_ps(sg + j, live, e);
      sum = _mm512_mask_add_ps(sum, live, sum, e);
    }
    inv_sum[g] = 1.0f / _mm512_reduce_add_ps(sum);
#else
    float m = sg[0];
    for (int32_t j = 1; j < n; ++j) m = sg[j] > m ? sg[j] : m;
    float sum = 0.0f;
    for (int32_t j = 0; j < n; ++j) {
      sg[j] = exp_nonpositive(sg[j] - m);
      sum += sg[j];
    }
    inv_sum[g] = 1.0f / sum;
#endif
  }
}

}  // namespace minivllm
