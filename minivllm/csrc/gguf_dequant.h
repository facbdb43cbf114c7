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
// 32 consecutive outputs (lo: the first 16) at out[at..].
inline void store32(void* out, int64_t at, int dt, __m512 lo, __m512 hi) {
  if (dt == kF32) {
    _mm512_storeu_ps(static_cast<float*>(out) + at, lo);
    _mm512_storeu_ps(static_cast<float*>(out) + at + 16, hi);
    return;
  }
  uint16_t* o = static_cast<uint16_t*>(out) + at;
  if (dt == kF16) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(lo, kRound));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm512_cvtps_ph(hi, kRound));
    return;
  }
#if defined(__AVX512BF16__)
  _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));  // one op for 32 roundings
#else
  alignas(64) float f[32];
  _mm512_store_ps(f, lo);
  _mm512_store_ps(f + 16, hi);
  for (int i = 0; i < 32; ++i) minivllm::store(f[i], o + i);
#endif
}

// fma(a, u, b) for the 16 quants at u (lanes of a, b: one value for all 16).
inline __m512 dequant16(const uint8_t* u, __m512 a, __m512 b) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)u)));
  return _mm512_fmadd_ps(a, q, b);
}

// One row. Every 16 quants of a register share one (a, b) (a block's half, or a K-quant
// 16-group), broadcast from its first lane; in the split layout block s's two halves (u[0],
// u[1] at 16s) are its 32 consecutive outputs, else slices s, s + 1 of u[0] are.
template <int Q>
void dequant_row_vnni(const Unit<Q>& unit, const uint8_t* w, RowShape rs, int64_t cols,
                      void* out, int64_t at, int dt) {
  using U = Unit<Q>;
  alignas(64) uint8_t ub[U::kRegs][64];
  for (int64_t un = 0; un < rs.units; ++un) {
    const int nb = un + 1 == rs.units ? rs.nb_last : U::kBlocks;
    const uint8_t* p = w + un * U::kUnitBytes;
    typename U::State st;
    U::begin(p, &st);
    for (int c = 0; c < U::kChunks; ++c) {
      __m512i u[U::kRegs];
      __m512 a, b;
      unit.chunk(p, nb, c, st, u, &a, &b);
      for (int g = 0; g < U::kRegs; ++g) _mm512_store_si512(ub[g], u[g]);
      const int64_t e0 = (un * U::kChunks + c) * 64 * U::kRegs;  // first output of the chunk
      if constexpr (U::kSplit) {
        for (int s = 0; s < nb; ++s) {
          const __m512i lane = _mm512_set1_epi32(4 * s);
          const __m512 as = _mm512_permutexvar_ps(lane, a), bs = _mm512_permutexvar_ps(lane, b);
          store32(out, at + e0 + 32 * s, dt, dequant16(ub[0] + 16 * s, as, bs),
                  dequant16(ub[1] + 16 * s, as, bs));
        }
      } else {
        for (int s = 0; s < 4; s += 2) {
          const __m512i l0 = _mm512_set1_epi32(4 * s), l1 = _mm512_set1_epi32(4 * s + 4);
          store32(out, at + e0 + 16 * s, dt,
                  dequant16(ub[0] + 16 * s, _mm512_permutexvar_ps(l0, a),
                            _mm512_permutexvar_ps(l0, b)),
                  dequant16(ub[0] + 16 * s + 16, _mm512_permutexvar_ps(l1, a),
                            _mm512_permutexvar_ps(l1, b)));
        }
      }
    }
  }
  (void)cols;
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
    MINIVLLM_GGUF_BLOCK_TYPES(MINIVLLM_GGUF_CASE)
#undef MINIVLLM_GGUF_CASE
  }
#endif
  for (int64_t r = r0; r < r1; ++r)
    dequant_row_scalar(qtype, w + r * w_stride, cols, out, r * out_stride, dt);
}

}  // namespace
