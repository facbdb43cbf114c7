// AVX2 dot and dequantisation kernels of the GGUF linears, for CPUs without AVX-512 VNNI
// (Zen 2/3, Intel client chips before Alder Lake): rows of a GGUF-packed weight times a few
// rows of x quantized per 32 (gguf_activation.h, natural layout), one thread.
//
// A row is walked in chunks of 32 elements: the block's quants unpack into one register of 32
// unsigned bytes u (the common form of gguf_blocks.h, w = a * u + b per 16 elements), which meets
// 32 int8 of x through vpmaddubsw (pairs, int16) and vpmaddwd by ones (int32 lanes of 4
// elements), then a * dx * sum(u * q) in one FMA and b * dx * sum(q) in scalars (Activation's
// s16). u <= 63 for every type but Q8_0, so a pair sum stays below 2 * 63 * 127 (no int16
// saturation); Q8_0 keeps its signed quants instead (|w| times x with w's sign: at most
// 2 * 128 * 127) and has no b term.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gguf_activation.h"  // MINIVLLM_GGUF_VNNI: then the AVX-512 kernels, not these
#include "gguf_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MINIVLLM_GGUF_VNNI)
#define MINIVLLM_GGUF_AVX2 1

#include <immintrin.h>

namespace {

using namespace minivllm::gguf;

// half_at with the F16C instruction (without AVX512-FP16, GCC converts _Float16 in software).
inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 16 bytes -> [low nibbles | high nibbles]: one broadcast load, one shift of the upper half.
inline __m256i nibbles_lo_hi(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i v = _mm256_broadcastsi128_si256(raw);
  const __m256i both = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// Bit i of the 32-bit word at p as 0x10 in byte i (the fifth bit of Q5_0 / Q5_1 quants).
inline __m256i fifth_bits(const uint8_t* p) {
  const __m256i word = _mm256_set1_epi32(static_cast<int32_t>(u32_at(p)));
  // byte i takes byte i / 8 of the word, then tests bit i % 8 of it
  const __m256i spread = _mm256_shuffle_epi8(
      word, _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// (bytes >> s) & mask per byte, for one shift s < 8 of every byte.
inline __m256i bits_of(const uint8_t* p, int s, int mask) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(s)), _mm256_set1_epi8(mask));
}

// One GGUF block type, 32 elements at a time: `scales` fills a[], b[] of a block (legacy: [0]
// only, per 32; K-quants: per 16, from gguf_blocks.h), `quants` the u (or Q8_0's signed q) of
// chunk j of the block.
template <int Q>
struct Avx2Block {
  static constexpr bool kLegacy = Q == kQ4_0 || Q == kQ4_1 || Q == kQ5_0 || Q == kQ5_1 ||
                                  Q == kQ8_0;
  static constexpr bool kSigned = Q == kQ8_0;
  static constexpr int kChunks = kLegacy ? 1 : 8;
  // (a, b) constant over each 32 elements: legacy blocks, and Q4_K / Q5_K (a scale per 32)
  static constexpr bool kPer32 = kLegacy || Q == kQ4_K || Q == kQ5_K;

  static void scales(const uint8_t* blk, float* a, float* b) {
    if constexpr (Q == kQ4_1 || Q == kQ5_1) {  // d and m: one conversion
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(u32_at(blk))));
      a[0] = _mm_cvtss_f32(dm);
      b[0] = _mm_cvtss_f32(_mm_movehdup_ps(dm));
    } else if constexpr (kLegacy) {
      const float d = half_f16c(blk);
      a[0] = d;
      if constexpr (Q == kQ4_0) b[0] = -8.0f * d;
      else if constexpr (Q == kQ5_0) b[0] = -16.0f * d;
      else b[0] = 0.0f;  // Q8_0: signed quants
    } else {
      k_scales(Q, blk, a, b);
    }
  }

  static __m256i quants(const uint8_t* blk, int j) {
    if constexpr (Q == kQ4_0) return nibbles_lo_hi(blk + 2);
    if constexpr (Q == kQ4_1) return nibbles_lo_hi(blk + 4);
    if constexpr (Q == kQ5_0) return _mm256_or_si256(nibbles_lo_hi(blk + 6), fifth_bits(blk + 2));
    if constexpr (Q == kQ5_1) return _mm256_or_si256(nibbles_lo_hi(blk + 8), fifth_bits(blk + 4));
    if constexpr (Q == kQ8_0) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    const int h = j / 4, g = j % 4, c = j / 2, hi = j % 2;  // 128-half, 32-group, 64-chunk
    if constexpr (Q == kQ2_K) return bits_of(blk + 16 + 32 * h, 2 * g, 3);
    if constexpr (Q == kQ3_K)
      return _mm256_add_epi8(bits_of(blk + 32 + 32 * h, 2 * g, 3),
                             _mm256_slli_epi16(bits_of(blk, j, 1), 2));
    if constexpr (Q == kQ4_K) return bits_of(blk + 16 + 32 * c, 4 * hi, 0x0F);
    if constexpr (Q == kQ5_K)
      return _mm256_or_si256(bits_of(blk + 48 + 32 * c, 4 * hi, 0x0F),
                             _mm256_slli_epi16(bits_of(blk + 16, j, 1), 4));
    // Q6_K: nibbles of ql[64h + 32(g % 2) + l], 2 bits of qh[32h + l]
    return _mm256_or_si256(bits_of(blk + 64 * h + 32 * (g % 2), 4 * (g / 2), 0x0F),
                           _mm256_slli_epi16(bits_of(blk + 128 + 32 * h, 2 * g, 3), 4));
  }

  // a of chunk j as 8 lanes of 4 elements, for the types with a scale per 16 (not kPer32).
  static __m256 lanes16(const float* a, int j) {
    return _mm256_set_m128(_mm_set1_ps(a[2 * j + 1]), _mm_set1_ps(a[2 * j]));
  }
};

// sum(u * q) per int32 lane of 4 elements (Q8_0: sum(w * q) with signed w).
template <bool Signed>
inline __m256i lane_sums(__m256i u, __m256i q) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Signed)
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(q, u)),
                             ones);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), ones);
}

// Rows ahead the kernel prefetches: the weight streams from DRAM once (on the 2-core Zen 3 box
// 16 rows gave 5-10% more decode tok/s than 8).
constexpr int kAvx2Ahead = 16;

// out[r][mm] for r < rows (<= R) weight rows and MC tokens of act from row m0, as
// dot_rows_scalar (gguf_dot.h): each row's chunk is unpacked once for the MC tokens. Per chunk
// and token the int32 lane sums take one FMA with a * dx (x's block scale, a scalar: legacy
// types broadcast it, K-quants multiply their two 16-element scales by it); the b term is
// summed apart in scalars, b * s16 per 16 elements.
template <int Q, int R, int MC>
void dot_rows_avx2(const uint8_t* w, int64_t w_stride, int64_t k, const Activation& act,
                   RowShape rs, int64_t m0, int rows, float* out /* [rows, MC] */) {
  using B = Avx2Block<Q>;
  const Geometry g = geometry(Q);
  const int8_t* xq = act.q.data() + m0 * rs.kp;
  const float *xdx = act.dx.data() + m0 * rs.lanes, *xs16 = act.s16.data() + m0 * (rs.kp / 16);
  const uint8_t* row[R];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r) row[r] = w + std::min(r, rows - 1) * w_stride;
  __m256 acc[R][MC];
  float bsum[R][MC];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int mm = 0; mm < MC; ++mm) acc[r][mm] = _mm256_setzero_ps(), bsum[r][mm] = 0.0f;
  for (int64_t blk = 0; blk < k / g.elems; ++blk) {
    #pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = row[r] + blk * g.bytes;
      // one prefetch per cache line of the rows kAvx2Ahead on (past the end: never faults)
      if ((blk * g.bytes) % 64 < g.bytes)
        _mm_prefetch(reinterpret_cast<const char*>(p + kAvx2Ahead * w_stride), _MM_HINT_T0);
      float a[16], b[16];
      B::scales(p, a, b);
      for (int j = 0; j < B::kChunks; ++j) {
        const __m256i u = B::quants(p, j);
        const int64_t c = blk * (g.elems / 32) + j;  // 32-element block of x
        #pragma GCC unroll 4
        for (int mm = 0; mm < MC; ++mm) {
          const __m256i q = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq + mm * rs.kp + 32 * c));
          const float dx = xdx[mm * rs.lanes + 8 * c];
          const float* s16 = xs16 + mm * (rs.kp / 16) + 2 * c;
          const __m256 sums = _mm256_cvtepi32_ps(lane_sums<B::kSigned>(u, q));
          if constexpr (B::kPer32) {  // one (a, b) for the chunk's 32 elements
            const int s = B::kLegacy ? 0 : 2 * j;
            acc[r][mm] = _mm256_fmadd_ps(sums, _mm256_set1_ps(a[s] * dx), acc[r][mm]);
            if constexpr (!B::kSigned) bsum[r][mm] += b[s] * (s16[0] + s16[1]);
          } else {
            const __m256 scale = _mm256_mul_ps(B::lanes16(a, j), _mm256_set1_ps(dx));
            acc[r][mm] = _mm256_fmadd_ps(sums, scale, acc[r][mm]);
            bsum[r][mm] += b[2 * j] * s16[0] + b[2 * j + 1] * s16[1];
          }
        }
      }
    }
  }
  // every (r, mm) reduced (a runtime bound here would keep acc in memory), `rows` stored
  float sums[R][MC];
  #pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 4
    for (int mm = 0; mm < MC; ++mm) sums[r][mm] = minivllm::hsum8(acc[r][mm]) + bsum[r][mm];
  for (int r = 0; r < rows; ++r)
    for (int mm = 0; mm < MC; ++mm) out[r * MC + mm] = sums[r][mm];
}

// Rows [n0, n1) x the m tokens of act from its row a0 into y (+ bias), as gemm_rows_vnni: 4 rows
// for one token, 2 rows x up to 4 tokens otherwise (8 accumulators of 16 registers).
template <int Q>
void gemm_rows_avx2(const uint8_t* w, int64_t w_stride, const Activation& act, RowShape rs,
                    int64_t k, int64_t a0, int64_t m, int64_t n0, int64_t n1, const void* bias,
                    void* y, int64_t y_stride, int dt) {
  float out[4 * 4];
  const int R = m == 1 ? 4 : 2;
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    const uint8_t* wn = w + n * w_stride;
    for (int64_t m0 = 0; m0 < m;) {
      const int mc = static_cast<int>(std::min<int64_t>(4, m - m0));
      if (R == 4) dot_rows_avx2<Q, 4, 1>(wn, w_stride, k, act, rs, a0 + m0, rows, out);
      else if (mc == 4) dot_rows_avx2<Q, 2, 4>(wn, w_stride, k, act, rs, a0 + m0, rows, out);
      else if (mc == 3) dot_rows_avx2<Q, 2, 3>(wn, w_stride, k, act, rs, a0 + m0, rows, out);
      else if (mc == 2) dot_rows_avx2<Q, 2, 2>(wn, w_stride, k, act, rs, a0 + m0, rows, out);
      else dot_rows_avx2<Q, 2, 1>(wn, w_stride, k, act, rs, a0 + m0, rows, out);
      store_sums(out, rows, mc, n, m0, bias, y, y_stride, dt);
      m0 += mc;
    }
  }
}

// 8 consecutive outputs at out[at..] in element type dt.
inline void store8(void* out, int64_t at, int dt, __m256 v) {
  if (dt == kF32) return _mm256_storeu_ps(static_cast<float*>(out) + at, v);
  __m128i* o = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + at);
  if (dt == kF16) return _mm_storeu_si128(o, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(o, minivllm::cvt_bf16x8(v));
}

// One row of cols elements into out[at..] (dequant_row_scalar's values: fma(a, u, b) per
// element; Q8_0 a * q, the same single rounding of gguf-py's d * q).
template <int Q>
void dequant_row_avx2(const uint8_t* w, int64_t cols, void* out, int64_t at, int dt) {
  using B = Avx2Block<Q>;
  const Geometry g = geometry(Q);
  for (int64_t blk = 0; blk < cols / g.elems; ++blk) {
    const uint8_t* p = w + blk * g.bytes;
    float a[16], b[16];
    B::scales(p, a, b);
    for (int j = 0; j < B::kChunks; ++j) {
      const __m256i u = B::quants(p, j);
      const __m128i halves[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
      const int64_t e = at + blk * g.elems + 32 * j;
      for (int hf = 0; hf < 2; ++hf) {  // 16 elements: one (a, b)
        const int s = B::kLegacy ? 0 : 2 * j + hf;
        const __m256 av = _mm256_set1_ps(a[s]), bv = _mm256_set1_ps(b[s]);
        const __m128i h8 = _mm_srli_si128(halves[hf], 8);
        const __m256i w0 = B::kSigned ? _mm256_cvtepi8_epi32(halves[hf])
                                      : _mm256_cvtepu8_epi32(halves[hf]);
        const __m256i w1 = B::kSigned ? _mm256_cvtepi8_epi32(h8) : _mm256_cvtepu8_epi32(h8);
        store8(out, e + 16 * hf, dt, _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(w0), bv));
        store8(out, e + 16 * hf + 8, dt, _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(w1), bv));
      }
    }
  }
}

}  // namespace

#endif  // MINIVLLM_GGUF_AVX2
