// The x8 kernels: dot products of GGUF weights in the x8 layout (gguf_x8_layout.h, which
// describes it) with x quantized into Activation::x8's records, for the CPUs whose int8 kernels
// are the AVX2 or AVX-512 VNNI ones (AMX CPUs too, up to kGgufDotMaxRows rows; gguf_amx.cpp's
// strips read the layout above that). This file: Q4_0, Q4_1, Q8_0 on both;
// gguf_x8_k.h: Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K on VNNI.
// On AMX CPUs the VNNI sums stay for a few tokens (MoE decode pieces: ~4 per expert): an
// AMX-INT8 version (unpacked chunks as the B tile, the tokens' records as A, one tdpbsud per
// 32-element block, two tile sets in flight) ran 1.5-2.5x slower at 1-64 tokens on Sapphire
// Rapids, since every block's B tile and int32 sums make a round trip through memory that the
// per-block scales (d * dx) force.
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_activation.h"
#include "gguf_avx2.h"
#include "gguf_blocks.h"
#include "gguf_x8_layout.h"

namespace {

using namespace minivllm::gguf;

// Bytes ahead the kernels prefetch, one line at a time (one prefetch per block made the 30 MB
// LM head slower than the plain layout on AVX2).
#ifndef MINIVLLM_X8_AHEAD
#define MINIVLLM_X8_AHEAD 4096
#endif
constexpr int kX8Ahead = MINIVLLM_X8_AHEAD;

#if MINIVLLM_GGUF_AVX2

// One fp32 lane per row of a group, and the few operations x8_dot_group needs.
using X8Acc = __m256;
using X8Int = __m256i;
inline void x8_store(float* p, X8Acc v) { _mm256_store_ps(p, v); }
inline X8Acc x8_zero() { return _mm256_setzero_ps(); }
inline X8Acc x8_set1(float v) { return _mm256_set1_ps(v); }
inline X8Acc x8_mul(X8Acc a, X8Acc b) { return _mm256_mul_ps(a, b); }
inline X8Acc x8_fmadd(X8Acc a, X8Acc b, X8Acc c) { return _mm256_fmadd_ps(a, b, c); }
inline X8Acc x8_cvt(X8Int v) { return _mm256_cvtepi32_ps(v); }
inline X8Acc x8_fp16(const uint8_t* p) {  // the group's 8 fp16 of one header field
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// Q8_0's b term per d * S: none, the AVX2 sums multiply signed quants (x8_block_sums).
constexpr float kX8Q8Bias = 0.0f;

inline __m256i bcast4(const int8_t* p) {  // 4 bytes of x into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Block b of a group x MC tokens: the 8 rows' int32 sums of w_quant * x_quant.
// Q4: u <= 15 and |q| <= 127, so a vpmaddubsw lane is at most 2 * 15 * 127 = 3810 and the
// block's 8 of them sum in int16 (30480) before one vpmaddwd. Q8_0 (signed, |w| times x with
// w's sign: up to 2 * 128 * 127 per lane) widens every chunk.
template <int Q, int MC>
inline void x8_block_sums(const uint8_t* quants, const int8_t* const* xq, X8Int* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Q == kQ8_0) {
    #pragma GCC unroll 4
    for (int mm = 0; mm < MC; ++mm) sums[mm] = _mm256_setzero_si256();
    #pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * c));
      const __m256i aw = _mm256_sign_epi8(w, w);
      #pragma GCC unroll 4
      for (int mm = 0; mm < MC; ++mm) {
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xq[mm] + 4 * c), w));
        sums[mm] = _mm256_add_epi32(sums[mm], _mm256_madd_epi16(p, ones));
      }
    }
    return;
  }
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256i s16[MC];
  #pragma GCC unroll 4
  for (int mm = 0; mm < MC; ++mm) s16[mm] = _mm256_setzero_si256();
  #pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * c));
    const __m256i lo = _mm256_and_si256(w, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
    #pragma GCC unroll 4
    for (int mm = 0; mm < MC; ++mm) {
      s16[mm] = _mm256_add_epi16(s16[mm], _mm256_maddubs_epi16(lo, bcast4(xq[mm] + 4 * c)));
      s16[mm] = _mm256_add_epi16(s16[mm], _mm256_maddubs_epi16(hi, bcast4(xq[mm] + 16 + 4 * c)));
    }
  }
  #pragma GCC unroll 4
  for (int mm = 0; mm < MC; ++mm) sums[mm] = _mm256_madd_epi16(s16[mm], ones);
}


#elif MINIVLLM_GGUF_VNNI

using X8Acc = __m512;
using X8Int = __m512i;
inline void x8_store(float* p, X8Acc v) { _mm512_store_ps(p, v); }
inline X8Acc x8_zero() { return _mm512_setzero_ps(); }
inline X8Acc x8_set1(float v) { return _mm512_set1_ps(v); }
inline X8Acc x8_mul(X8Acc a, X8Acc b) { return _mm512_mul_ps(a, b); }
inline X8Acc x8_fmadd(X8Acc a, X8Acc b, X8Acc c) { return _mm512_fmadd_ps(a, b, c); }
inline X8Acc x8_cvt(X8Int v) { return _mm512_cvtepi32_ps(v); }
inline X8Acc x8_fp16(const uint8_t* p) {  // the group's 16 fp16 of one header field
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Q8_0's b term per d * S: the VNNI sums read q + 128 (x8_block_sums).
constexpr float kX8Q8Bias = -128.0f;

// acc += w (u8) . x's 4 bytes at p (s8) in every lane, the 4 bytes an embedded broadcast
// ({1to16}): GCC 12 keeps _mm512_set1_epi32 a separate vpbroadcastd, one more uop per product
// (1.15x dpbusd throughput in a bare loop on Zen 4).
inline __m512i dpbusd_bcast4(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0"
          : "+v"(acc)
          : "v"(w), "m"(*reinterpret_cast<const int8_t(*)[4]>(p)));
  return acc;
}

// Block b of a 16-row group x MC tokens: the rows' int32 sums of u * x_quant (u: the unsigned
// quants; Q8_0 stores q + 128, corrected by the block's -128 * sum(x_quant) term). Under 4
// tokens each keeps two chains (low / high nibbles, even / odd chunks) so that vpdpbusd's
// latency stays hidden; from 4 the tokens' own chains do.
template <int Q, int MC>
inline void x8_block_sums(const uint8_t* quants, const int8_t* const* xq, X8Int* sums) {
  constexpr bool kTwo = MC < 4;
  __m512i s0[MC], s1[kTwo ? MC : 1];
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) s0[mm] = _mm512_setzero_si512();
  if constexpr (kTwo) {
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) s1[mm] = _mm512_setzero_si512();
  }
  if constexpr (Q == kQ8_0) {
    const __m512i flip = _mm512_set1_epi8(-128);
    #pragma GCC unroll 8
    for (int c = 0; c < 8; c += 2) {
      const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(quants + 64 * c), flip);
      const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(quants + 64 * c + 64), flip);
      #pragma GCC unroll 8
      for (int mm = 0; mm < MC; ++mm) {
        s0[mm] = dpbusd_bcast4(s0[mm], w0, xq[mm] + 4 * c);
        if constexpr (kTwo) s1[mm] = dpbusd_bcast4(s1[mm], w1, xq[mm] + 4 * c + 4);
        else s0[mm] = dpbusd_bcast4(s0[mm], w1, xq[mm] + 4 * c + 4);
      }
    }
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(quants + 64 * c);
      const __m512i lo = _mm512_and_si512(w, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      #pragma GCC unroll 8
      for (int mm = 0; mm < MC; ++mm) {
        s0[mm] = dpbusd_bcast4(s0[mm], lo, xq[mm] + 4 * c);
        if constexpr (kTwo) s1[mm] = dpbusd_bcast4(s1[mm], hi, xq[mm] + 16 + 4 * c);
        else s0[mm] = dpbusd_bcast4(s0[mm], hi, xq[mm] + 16 + 4 * c);
      }
    }
  }
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) {
    if constexpr (kTwo) sums[mm] = _mm512_add_epi32(s0[mm], s1[mm]);
    else sums[mm] = s0[mm];
  }
}


#include "gguf_x8_k.h"  // Q5_0, Q5_1, Q2_K ... Q6_K

#endif  // MINIVLLM_GGUF_AVX2 / MINIVLLM_GGUF_VNNI

// The activation shape the x8 kernels read: x quantized into Activation::x8's records, so a
// token is one pointer with its block's q, dx and b term at fixed offsets. Separate q / dx / s16
// rows took 24 pointers for 8 tokens, which GCC kept partly in xmm registers, and a vaddss +
// vbroadcastss per b term. On Zen 4, a [4096, 2048] Q4_1 weight times 64 rows: 269 vs 246
// GMAC/s on one thread, 514 vs 457 on two. Rows quantized this way are for the x8 kernels only.
inline RowShape x8_row_shape(int qtype, int64_t k) {
#if MINIVLLM_GGUF_X8
  const float q8_b = kX8Q8Bias;
#else
  const float q8_b = 0.0f;  // (no kernel reads the layout in this build)
#endif
  // the b term's factor per d * S (Q4_0 / Q5_0 centre their quants at 8 / 16; the K-quants'
  // min term and Q5_1's m are the weight's own; the 16-element sub-block types read the halves'
  // sums instead)
  const float b = qtype == kQ4_1 || qtype == kQ5_1 || qtype == kQ4_K || qtype == kQ5_K ? 1.0f
                  : qtype == kQ4_0 ? -8.0f : qtype == kQ5_0 ? -16.0f
                  : qtype == kQ2_K || qtype == kQ3_K || qtype == kQ6_K ? 0.0f : q8_b;
  RowShape rs{k / 32, k, 0, 1, false};
  rs.x8 = true;
  rs.x8_b = b;
  rs.x8_offset = qtype == kQ3_K ? 4 : qtype == kQ6_K ? 32 : 0;  // (their integer sums: gguf_x8_k.h)
  return rs;
}

#if MINIVLLM_GGUF_X8

// out[mm] lane r = row r of the group at g (nb blocks) times token mm, whose records start at
// rec + mm * rec_stride bytes: over blocks, d * dx * sum(u * q) + the b term (Q4_1: m * S,
// Q4_0: -8 d * S, Q8_0: kX8Q8Bias * d * S; the record holds S times that factor).
template <int Q, int MC>
void x8_dot_group(const uint8_t* g, int64_t nb, const uint8_t* rec, int64_t rec_stride,
                  X8Acc* out) {
  constexpr int kH = x8_header(Q), kGroupBlock = kX8Rows * (kH + x8_quants(Q));
  const uint8_t* xr[MC];
  X8Acc acc[MC];
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) {
    xr[mm] = rec + mm * rec_stride;
    acc[mm] = x8_zero();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * kGroupBlock;
    const int64_t at = b * kX8Record;
#if MINIVLLM_GGUF_VNNI
    // into L2, 8 KiB ahead, as the K-quants (gguf_x8_k.h): on Zen 4 ([4096, 2048] weights past
    // L3, 2 threads) Q4_1 1 token 32.7 -> 36.2 GB/s, 4 tokens 157 -> 184 GMAC/s, Q8_0 8 tokens
    // 159 -> 197, against L1 and 4 KiB ahead
    x8_prefetch(p, kGroupBlock);
#else
    #pragma GCC unroll 16
    for (int o = 0; o < kGroupBlock; o += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p + kX8Ahead + o), _MM_HINT_T0);
#endif
    const X8Acc d = x8_fp16(p);
    const X8Acc bw = Q == kQ4_1 ? x8_fp16(p + 2 * kX8Rows) : d;  // the b term's weight factor
    const int8_t* xb[MC];
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) xb[mm] = reinterpret_cast<const int8_t*>(xr[mm] + at);
    X8Int sums[MC];
    x8_block_sums<Q, MC>(p + kX8Rows * kH, xb, sums);
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) {
      const float* tail = reinterpret_cast<const float*>(xr[mm] + at + 32);  // dx, b term
      acc[mm] = x8_fmadd(x8_cvt(sums[mm]), x8_mul(d, x8_set1(tail[0])), acc[mm]);
      if constexpr (Q != kQ8_0 || kX8Q8Bias != 0.0f)
        acc[mm] = x8_fmadd(bw, x8_set1(tail[1]), acc[mm]);
    }
  }
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) out[mm] = acc[mm];
}

// x8_dot_group, or gguf_x8_k.h's kernel of a 5-bit or K-quant type (nb: 32-element blocks).
template <int Q, int MC>
inline void x8_dot_any(const uint8_t* g, int64_t nb, const uint8_t* rec, int64_t rec_stride,
                       X8Acc* acc) {
#if MINIVLLM_GGUF_VNNI
  if constexpr (Q != kQ4_0 && Q != kQ4_1 && Q != kQ8_0)
    x8_dot_group_k<Q, MC>(g, nb, rec, rec_stride, acc);
  else  // (the legacy kernel is never instantiated for the other types)
#endif
    x8_dot_group<Q, MC>(g, nb, rec, rec_stride, acc);
}

// x8_dot_any for a runtime count of 1..kX8Tokens tokens.
template <int Q>
inline void x8_dot_tokens(int mc, const uint8_t* g, int64_t nb, const uint8_t* rec,
                          int64_t rec_stride, X8Acc* acc) {
  switch (mc) {
#if MINIVLLM_GGUF_VNNI
    case 8: return x8_dot_any<Q, 8>(g, nb, rec, rec_stride, acc);
    case 7: return x8_dot_any<Q, 7>(g, nb, rec, rec_stride, acc);
    case 6: return x8_dot_any<Q, 6>(g, nb, rec, rec_stride, acc);
    case 5: return x8_dot_any<Q, 5>(g, nb, rec, rec_stride, acc);
#endif
    case 4: return x8_dot_any<Q, 4>(g, nb, rec, rec_stride, acc);
    case 3: return x8_dot_any<Q, 3>(g, nb, rec, rec_stride, acc);
    case 2: return x8_dot_any<Q, 2>(g, nb, rec, rec_stride, acc);
    default: return x8_dot_any<Q, 1>(g, nb, rec, rec_stride, acc);
  }
}

// Rows [n0, n1) (whole groups) of an x8 weight x act rows [a0, a0 + m) into y rows [0, m)
// (+ bias), as gguf_dot_rows: each group meets up to kX8Tokens of them per pass (its rows stay
// in L1 for the next pass).
template <int Q>
void x8_gemm_rows(const uint8_t* w, int64_t row_bytes, const Activation& act, RowShape rs,
                  int64_t k, int64_t a0, int64_t m, int64_t n0, int64_t n1, const void* bias,
                  void* y, int64_t y_stride, int dt) {
  const int64_t nb = k / 32, rec_stride = rs.units * kX8Record;
  alignas(64) float lanes[kX8Tokens][kX8Rows];
  float out[kX8Rows * kX8Tokens];
  for (int64_t n = n0; n < n1; n += kX8Rows) {
    const uint8_t* g = w + n * row_bytes;
    for (int64_t m0 = 0; m0 < m;) {
      const int mc = static_cast<int>(std::min<int64_t>(kX8Tokens, m - m0));
      X8Acc acc[kX8Tokens];
      x8_dot_tokens<Q>(mc, g, nb, act.x8.data() + (a0 + m0) * rec_stride, rec_stride, acc);
      for (int mm = 0; mm < mc; ++mm) x8_store(lanes[mm], acc[mm]);
      for (int r = 0; r < kX8Rows; ++r)
        for (int mm = 0; mm < mc; ++mm) out[r * mc + mm] = lanes[mm][r];
      store_sums(out, kX8Rows, mc, n, m0, bias, y, y_stride, dt);
      m0 += mc;
    }
  }
}

// x8_gemm_rows for a runtime type; false for a type without the layout.
inline bool x8_gemm(int qtype, const uint8_t* w, int64_t row_bytes, const Activation& act,
                    RowShape rs, int64_t k, int64_t a0, int64_t m, int64_t n0, int64_t n1,
                    const void* bias, void* y, int64_t y_stride, int dt) {
  switch (qtype) {
#define MINIVLLM_X8_CASE(Q)                                                                    \
  case Q:                                                                                      \
    x8_gemm_rows<Q>(w, row_bytes, act, rs, k, a0, m, n0, n1, bias, y, y_stride, dt);           \
    return true;
    MINIVLLM_X8_CASE(kQ4_0) MINIVLLM_X8_CASE(kQ4_1) MINIVLLM_X8_CASE(kQ8_0)
#if MINIVLLM_GGUF_VNNI
    MINIVLLM_X8_CASE(kQ5_0) MINIVLLM_X8_CASE(kQ5_1) MINIVLLM_X8_CASE(kQ2_K)
    MINIVLLM_X8_CASE(kQ3_K) MINIVLLM_X8_CASE(kQ4_K) MINIVLLM_X8_CASE(kQ5_K)
    MINIVLLM_X8_CASE(kQ6_K)
#endif
#undef MINIVLLM_X8_CASE
    default: return false;
  }
}

#endif  // MINIVLLM_GGUF_X8

}  // namespace
