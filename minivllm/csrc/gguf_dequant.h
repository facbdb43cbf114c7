// Dequantisation of GGUF block rows into fp32 / bf16 / fp16 rows (part of gguf_gemm.cpp: it
// uses that file's element helpers; include it only there).
//
// x = fma(a, u, b) in fp32 reproduces gguf-py's dequantizers bit for bit (see gguf_blocks.h),
// then one rounding to the output type.
#pragma once

#include <cmath>
#include <cstdint>

#include "gguf_blocks.h"

namespace {

void dequant_row_scalar(int qtype, const uint8_t* w, int64_t cols, void* out, int64_t at,
                        int dt) {
  const Geometry g = geometry(qtype);
  uint8_t u[256];
  float a[16], b[16];
  for (int64_t blk = 0; blk < cols / g.elems; ++blk) {
    decode_block(qtype, w + blk * g.bytes, u, a, b);
    for (int i = 0; i < g.elems; ++i)
      store_elem(out, at + blk * g.elems + i, dt,
                 std::fma(a[i / 16], static_cast<float>(u[i]), b[i / 16]));
  }
}

#if MINIVLLM_GGUF_VNNI
inline void store16(void* out, int64_t at, int dt, __m512 v) {
  if (dt == kF32) {
    _mm512_storeu_ps(static_cast<float*>(out) + at, v);
  } else if (dt == kF16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at),
                        (__m256i)_mm512_cvtneps_pbh(v));
#else
    alignas(64) float f[16];
    _mm512_store_ps(f, v);
    for (int i = 0; i < 16; ++i) store_elem(out, at + i, dt, f[i]);
#endif
  }
}

// 16 quants (slice s of u) as fp32.
inline __m512 slice_ps(__m512i u, int s) {
  __m128i part;
  switch (s) {  // the extract's lane must be a literal
    case 0: part = _mm512_extracti32x4_epi32(u, 0); break;
    case 1: part = _mm512_extracti32x4_epi32(u, 1); break;
    case 2: part = _mm512_extracti32x4_epi32(u, 2); break;
    default: part = _mm512_extracti32x4_epi32(u, 3);
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(part));
}

template <int Q>
void dequant_row_vnni(const Unit<Q>& unit, const uint8_t* w, RowShape rs, int64_t cols,
                      void* out, int64_t at, int dt) {
  using U = Unit<Q>;
  const __m512i lane4 = _mm512_srli_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  for (int64_t un = 0; un < rs.units; ++un) {
    const int nb = un + 1 == rs.units ? rs.nb_last : U::kBlocks;
    const uint8_t* p = w + un * U::kUnitBytes;
    typename U::State st;
    U::begin(p, &st);
    for (int c = 0; c < U::kChunks; ++c) {
      __m512i u[U::kRegs];
      __m512 a, b;
      unit.chunk(p, nb, c, st, u, &a, &b);
      for (int g = 0; g < U::kRegs; ++g)
        for (int s = 0; s < 4; ++s) {  // 16 quants: lanes 4s..4s+3 hold their a, b
          // split layout: block s's half g; else elements in order
          const int64_t e = U::kSplit ? un * 128 + 32 * s + 16 * g : (un * U::kChunks + c) * 64 + 16 * s;
          if (e >= cols) continue;
          const __m512i idx = _mm512_add_epi32(lane4, _mm512_set1_epi32(4 * s));
          const __m512 x = _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, a), slice_ps(u[g], s),
                                           _mm512_permutexvar_ps(idx, b));
          store16(out, at + e, dt, x);
        }
    }
  }
}
#endif  // MINIVLLM_GGUF_VNNI

// Rows [r0, r1) of w (rows w_stride bytes apart) into out (rows out_stride elements apart).
void dequant_rows(int qtype, const uint8_t* w, int64_t w_stride, int64_t r0, int64_t r1,
                  int64_t cols, void* out, int64_t out_stride, int dt) {
#if MINIVLLM_GGUF_VNNI
  const RowShape rs = row_shape(qtype, cols, true);
  switch (qtype) {
#define MINIVLLM_GGUF_CASE(Q)                                                                \
  case Q: {                                                                                  \
    const Unit<Q> unit;                                                                      \
    for (int64_t r = r0; r < r1; ++r)                                                        \
      dequant_row_vnni<Q>(unit, w + r * w_stride, rs, cols, out, r * out_stride, dt);        \
    return;                                                                                  \
  }
    MINIVLLM_GGUF_CASE(kQ4_0) MINIVLLM_GGUF_CASE(kQ4_1) MINIVLLM_GGUF_CASE(kQ5_0)
    MINIVLLM_GGUF_CASE(kQ5_1) MINIVLLM_GGUF_CASE(kQ8_0) MINIVLLM_GGUF_CASE(kQ2_K)
    MINIVLLM_GGUF_CASE(kQ3_K) MINIVLLM_GGUF_CASE(kQ4_K) MINIVLLM_GGUF_CASE(kQ5_K)
    MINIVLLM_GGUF_CASE(kQ6_K)
#undef MINIVLLM_GGUF_CASE
  }
#endif
  for (int64_t r = r0; r < r1; ++r)
    dequant_row_scalar(qtype, w + r * w_stride, cols, out, r * out_stride, dt);
}

}  // namespace
