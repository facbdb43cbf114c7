// fp8 KV-cache elements for csrc/paged_decode_attention.cpp: the two byte formats, their exact
// fp32 values (a table per format, and 16 at a time with AVX-512), and the rounding of a value
// into them, as torch's casts round (to nearest, ties to the even code).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// fp8 KV caches (vLLM's kv_cache_dtype "fp8" / "fp8_e4m3", "fp8_e5m2"): a byte per element,
// unit scales, widened to fp32 as they are read; a decode step's new rows are rounded in here
// (as torch's casts round them: to nearest, ties to the even code).
struct Fp8E4M3 {
  uint8_t bits;
};
struct Fp8E5M2 {
  uint8_t bits;
};

// fp16 bits -> float, exactly (portable: no F16C needed).
inline float half_bits_to_float(uint32_t h) {
  const int e = (h >> 10) & 31, m = h & 1023;
  const float sign = (h & 0x8000) ? -1.0f : 1.0f;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);
  if (e == 31) return m ? NAN : sign * INFINITY;
  return sign * std::ldexp(static_cast<float>(m | 1024), e - 25);
}

// Every byte's value: e5m2 is an fp16's top byte; e4m3fn's 7 magnitude bits shifted up by 7 read
// as an fp16 2^8 too small (normals and subnormals alike), and 0x7F / 0xFF are its NaNs.
struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (uint32_t b = 0; b < 256; ++b) {
      e5m2[b] = half_bits_to_float(b << 8);
      const float mag = (b & 0x7F) == 0x7F ? NAN : half_bits_to_float((b & 0x7F) << 7) * 256.0f;
      e4m3[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
const Fp8Tables kFp8;

inline float to_float(Fp8E4M3 x) { return kFp8.e4m3[x.bits]; }
inline float to_float(Fp8E5M2 x) { return kFp8.e5m2[x.bits]; }

// The fp8 code nearest to x in a table whose codes 0..top are the finite non-negative values in
// increasing order; past top + half its gap (`beyond`: the next value the format lacks), the
// overflow code (e4m3fn: NaN 0x7F; e5m2: inf 0x7C). Ties go to the even code. (Binary search:
// a decode step writes one row of nKV * d values per sequence and layer.)
inline uint8_t nearest_fp8(float x, const float* table, int top, float beyond, uint8_t overflow) {
  if (std::isnan(x)) return 0x7F;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const float a = std::fabs(x);
  int lo = 0, hi = top + 1;  // table[lo] <= a < value(hi), value(top + 1) = beyond
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (table[mid] <= a) lo = mid;
    else hi = mid;
  }
  const float up = hi > top ? beyond : table[hi];
  const float below = a - table[lo], above = up - a;
  const int code = below < above ? lo : below > above ? hi : (lo % 2 == 0 ? lo : hi);
  return sign | static_cast<uint8_t>(code > top ? overflow : code);
}

template <typename C>
inline C from_float(float x);
template <>
inline Fp8E4M3 from_float<Fp8E4M3>(float x) {
  return {nearest_fp8(x, kFp8.e4m3, 0x7E, 512.0f, 0x7F)};
}
template <>
inline Fp8E5M2 from_float<Fp8E5M2>(float x) {
  return {nearest_fp8(x, kFp8.e5m2, 0x7B, 65536.0f, 0x7C)};
}

#if defined(__AVX512F__)
// 16 elements as fp32 lanes (the other element types' load16 live beside the kernel).
inline __m512 load16(const Fp8E5M2* p) {  // each byte the top half of an fp16
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
}
inline __m512 load16(const Fp8E4M3* p) {  // as Fp8Tables: magnitude via fp16, sign, NaNs
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(mag, 7))),
                                 _mm512_set1_ps(256.0f));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F));
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign)),
                            nan, _mm512_set1_ps(NAN));
}
#endif

}  // namespace
