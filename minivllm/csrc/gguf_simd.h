// AVX-512 (BW, VBMI) unpacking of GGUF blocks, 64 quants per register.
//
// The common form of gguf_blocks.h, vectorised: `Unit<Q>` walks a row in units (four 4/5-bit
// legacy blocks, two Q8_0 blocks, or one K-quant super-block) and gives, for each chunk of a
// unit, kRegs registers of 64 quants u (unsigned bytes) and a, b as 16 fp32 lanes, lane j
// holding the factors of the 4 elements in int32 lane j of a vpdpbusd over each register.
// Legacy blocks are fetched with masked loads (no read past the row) and put in place with one
// two-source byte permute; their scales with one word permute and one fp16 conversion, so the
// scale work per 64 quants stays at a few instructions (on Intel, 512-bit ops issue on two ports
// only: at ~2 GHz, 18 GB/s per core leaves ~4 cycles per 64 Q4_1 quants).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include <immintrin.h>

#include "gguf_blocks.h"

namespace minivllm::gguf {

// Bytes 0..63 of a 64-byte table whose byte t is f(t).
template <typename F>
inline __m512i byte_table(F f) {
  alignas(64) uint8_t t[64];
  for (int i = 0; i < 64; ++i) t[i] = static_cast<uint8_t>(f(i));
  return _mm512_load_si512(t);
}

template <typename F>
inline __m512i word_table(F f) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = static_cast<uint16_t>(f(i));
  return _mm512_load_si512(t);
}

inline __mmask64 first_bytes(int n) { return n >= 64 ? ~0ull : n <= 0 ? 0 : (1ull << n) - 1; }

// 16 fp16 values (256 bits) -> 16 fp32 lanes.
inline __m512 halves(__m256i h) { return _mm512_cvtph_ps(h); }

// The first `bytes` bytes at p (<= 128; the rest zero) as two registers, never reading past
// them. A whole unit (bytes == N) takes plain loads: a masked load costs an extra vector uop,
// and vector ports are what these kernels run out of.
template <int N>
inline void load_unit(const uint8_t* p, int bytes, bool whole, __m512i* lo, __m512i* hi) {
  static_assert(N > 64 && N <= 128);
  if (whole && (N == 72 || N == 80 || N == 96)) {
    *lo = _mm512_loadu_si512(p);
    const void* tail = p + 64;
    if constexpr (N == 72) *hi = _mm512_zextsi128_si512(_mm_loadl_epi64((const __m128i*)tail));
    else if constexpr (N == 80) *hi = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i*)tail));
    else *hi = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i*)tail));
    return;
  }
  *lo = _mm512_maskz_loadu_epi8(first_bytes(bytes), p);
  *hi = _mm512_maskz_loadu_epi8(first_bytes(bytes - 64), p + 64);
}

// The 4-bit and 5-bit legacy types: a unit is four blocks (fewer at the end of a row), one
// chunk of 128 elements in two registers: u[0] the four blocks' elements 0..15 (their low
// nibbles), u[1] their elements 16..31 (high nibbles), so lane j of both belongs to block j / 4
// and one (a, b) vector serves 128 elements (the activations are laid out to match).
template <int Q>
struct NibbleUnit {
  static constexpr int kBytes = Q == kQ4_0 ? 18 : Q == kQ4_1 ? 20 : Q == kQ5_0 ? 22 : 24;
  static constexpr bool kMin = Q == kQ4_1 || Q == kQ5_1;
  static constexpr bool kFive = Q == kQ5_0 || Q == kQ5_1;
  static constexpr int kQh = kMin ? 4 : 2, kQs = kQh + (kFive ? 4 : 0);
  static constexpr float kOffset = Q == kQ4_0 ? -8.0f : -16.0f;
  static constexpr int kChunks = 1, kRegs = 2, kBlocks = 4, kUnitBytes = 4 * kBytes;
  static constexpr bool kSplit = true;  // activation layout: split halves of each block
  struct State {};
  static inline void begin(const uint8_t*, State*) {}

  __m512i gather, scale_idx;
  NibbleUnit() {
    gather = byte_table([](int t) { return (t / 16) * kBytes + kQs + t % 16; });
    // words: d of blocks 0..3 (x4 each), then their mins likewise
    scale_idx = word_table([](int w) { return (w % 16) / 4 * (kBytes / 2) + w / 16; });
  }

  // nb: blocks in this unit (1..4).
  inline void chunk(const uint8_t* p, int nb, int, const State&, __m512i* u, __m512* a,
                    __m512* b) const {
    __m512i lo, hi;
    load_unit<kUnitBytes>(p, nb * kBytes, nb == kBlocks, &lo, &hi);
    const __m512i qs = _mm512_permutex2var_epi8(lo, gather, hi);
    const __m512i mask = _mm512_set1_epi8(0x0F);
    u[0] = _mm512_and_si512(qs, mask);
    u[1] = _mm512_and_si512(_mm512_srli_epi16(qs, 4), mask);
    if constexpr (kFive) {  // bit i of a block's qh: element i's fifth bit
      uint64_t low = 0, high = 0;
      for (int j = 0; j < nb; ++j) {
        const uint64_t qh = u32_at(p + j * kBytes + kQh);
        low |= (qh & 0xFFFF) << (16 * j);
        high |= (qh >> 16) << (16 * j);
      }
      u[0] = _mm512_mask_add_epi8(u[0], low, u[0], _mm512_set1_epi8(16));
      u[1] = _mm512_mask_add_epi8(u[1], high, u[1], _mm512_set1_epi8(16));
    }
    const __m512i s = _mm512_permutex2var_epi16(lo, scale_idx, hi);
    *a = halves(_mm512_castsi512_si256(s));
    *b = kMin ? halves(_mm512_extracti64x4_epi64(s, 1))
              : _mm512_mul_ps(*a, _mm512_set1_ps(kOffset));
  }
};

// Q8_0: a unit is four blocks (fewer at the end of a row), one chunk of 128 elements in the
// split layout of NibbleUnit: u[0] the blocks' elements 0..15, u[1] their elements 16..31, so
// one scale conversion serves four blocks. u = q + 128.
struct Q8Unit {
  static constexpr int kBytes = 34;
  static constexpr int kChunks = 1, kRegs = 2, kBlocks = 4, kUnitBytes = 4 * kBytes;
  static constexpr bool kSplit = true;
  struct State {};
  static inline void begin(const uint8_t*, State*) {}

  __m512i first, second, scale_idx;
  Q8Unit() {
    // first halves from bytes p[0..128), second halves from p[8..136)
    first = byte_table([](int t) { return (t / 16) * kBytes + 2 + t % 16; });
    second = byte_table([](int t) { return (t / 16) * kBytes + 10 + t % 16; });
    scale_idx = word_table([](int w) { return (w % 16) / 4 * (kBytes / 2); });
  }

  inline void chunk(const uint8_t* p, int nb, int, const State&, __m512i* u, __m512* a,
                    __m512* b) const {
    __m512i r0, r1, r2, r3;  // bytes [0, 64), [64, 128), [8, 72), [72, 136) of the unit
    if (nb == kBlocks) {
      r0 = _mm512_loadu_si512(p);
      r1 = _mm512_loadu_si512(p + 64);
      r2 = _mm512_loadu_si512(p + 8);
      r3 = _mm512_loadu_si512(p + 72);
    } else {
      const int bytes = nb * kBytes;
      r0 = _mm512_maskz_loadu_epi8(first_bytes(bytes), p);
      r1 = _mm512_maskz_loadu_epi8(first_bytes(bytes - 64), p + 64);
      r2 = _mm512_maskz_loadu_epi8(first_bytes(bytes - 8), p + 8);
      r3 = _mm512_maskz_loadu_epi8(first_bytes(bytes - 72), p + 72);
    }
    const __m512i flip = _mm512_set1_epi8(-128);
    u[0] = _mm512_xor_si512(_mm512_permutex2var_epi8(r0, first, r1), flip);
    u[1] = _mm512_xor_si512(_mm512_permutex2var_epi8(r2, second, r3), flip);
    *a = halves(_mm512_castsi512_si256(_mm512_permutex2var_epi16(r0, scale_idx, r1)));
    *b = _mm512_mul_ps(*a, _mm512_set1_ps(-128.0f));
  }
};

// The K-quants: a unit is one super-block, 4 chunks; scales decoded (scalar) once per unit.
template <int Q>
struct KUnit {
  static constexpr int kBytes = Q == kQ2_K ? 84 : Q == kQ3_K ? 110 : Q == kQ4_K ? 144
                              : Q == kQ5_K ? 176 : 210;
  static constexpr int kChunks = 4, kRegs = 1, kBlocks = 1, kUnitBytes = kBytes;
  static constexpr bool kSplit = false;
  struct State {
    __m512 a, b;  // a, b of the current super-block, per 16 elements
  };

  // NOTE: vectorised: scalar stores of a[16] read back as one vector stalled (no store
  // forwarding) and made K-quants 3x slower than Q4_1 per byte.
  static inline void begin(const uint8_t* p, State* st) {
    const __m128i f = _mm_set1_epi8(0x0F);
    const auto to_ps = [](__m128i bytes) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    };
    if constexpr (Q == kQ4_K || Q == kQ5_K) {  // a: 8 scales x d, then 8 mins x -dmin
      const __m128i v = _mm_loadu_si128((const __m128i*)(p + 4));  // scale bytes s[0..12)
      const __m128i lo = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7,
                                                            8, 9, 10, 11));
      const __m128i up = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1,
                                                            -1, -1, 4, 5, 6, 7));
      const __m128i keep = _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0,
                                         0, 0);
      const __m128i mins_hi = _mm_and_si128(_mm_srli_epi16(lo, 4),
                                            _mm_setr_epi32(0, 0, 0, 0x0F0F0F0F));
      const __m128i six = _mm_or_si128(
          _mm_or_si128(_mm_and_si128(lo, keep), mins_hi),
          _mm_and_si128(_mm_srli_epi16(up, 2), _mm_set1_epi8(0x30)));
      const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(half_at(p)),
                                           _mm256_set1_ps(-half_at(p + 2)), 1);
      st->a = _mm512_mul_ps(to_ps(six), dd);
    } else if constexpr (Q == kQ6_K) {
      st->a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128((const __m128i*)(p + 192)))),
                            _mm512_set1_ps(half_at(p + 208)));
      st->b = _mm512_mul_ps(st->a, _mm512_set1_ps(-32.0f));
    } else if constexpr (Q == kQ2_K) {
      const __m128i v = _mm_loadu_si128((const __m128i*)p);
      st->a = _mm512_mul_ps(to_ps(_mm_and_si128(v, f)), _mm512_set1_ps(half_at(p + 80)));
      st->b = _mm512_mul_ps(to_ps(_mm_and_si128(_mm_srli_epi16(v, 4), f)),
                            _mm512_set1_ps(-half_at(p + 82)));
    } else {  // Q3_K: 4 low bits from s[i % 8] >> 4 (i / 8), 2 high from s[8 + i % 4] >> 2 (i / 4)
      const __m128i v = _mm_loadu_si128((const __m128i*)(p + 96 - 4));  // bytes 92..108
      const __m128i low = _mm_and_si128(
          _mm_srlv_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 8, 9, 10, 11, 4, 5, 6, 7,
                                                           8, 9, 10, 11)),
                         _mm_setr_epi16(0, 0, 0, 0, 4, 4, 4, 4)), f);
      const __m128i high = _mm_and_si128(
          _mm_srlv_epi16(_mm_shuffle_epi8(v, _mm_setr_epi8(12, 13, 14, 15, 12, 13, 14, 15, 12,
                                                           13, 14, 15, 12, 13, 14, 15)),
                         _mm_setr_epi16(0, 0, 2, 2, 4, 4, 6, 6)), _mm_set1_epi8(3));
      const __m512i sc = _mm512_sub_epi32(
          _mm512_cvtepu8_epi32(_mm_or_si128(low, _mm_slli_epi16(high, 4))), _mm512_set1_epi32(32));
      st->a = _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(half_at(p + 108)));
      st->b = _mm512_mul_ps(st->a, _mm512_set1_ps(-4.0f));
    }
  }

  // Two 32-element groups from one 32-byte span: element 32g + l of the chunk is
  // (span[l] >> shift_g) & mask, g = 0, 1.
  static inline __m512i pair(const uint8_t* span, int shift0, int shift1, int mask) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)span));
    const __m512i sh = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi16(shift0),
                                               _mm512_set1_epi16(shift1));
    return _mm512_and_si512(_mm512_srlv_epi16(v, sh), _mm512_set1_epi8(mask));
  }

  // bit_g of span[l] for element 32g + l, as a 64-bit mask.
  static inline __mmask64 bits(const uint8_t* span, int bit0, int bit1) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)span));
    const __m512i sel = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(1 << bit0),
                                                _mm512_set1_epi8(1 << bit1));
    return _mm512_test_epi8_mask(v, sel);
  }

  inline void chunk(const uint8_t* p, int, int c, const State& st, __m512i* u, __m512* a,
                    __m512* b) const {
    const int h = c / 2, odd = c % 2;  // 128-element half; upper 64 of it
    __m512i q;
    if constexpr (Q == kQ2_K || Q == kQ3_K) {
      const int base = Q == kQ2_K ? 16 : 32;
      q = pair(p + base + 32 * h, 4 * odd, 4 * odd + 2, 3);
      if constexpr (Q == kQ3_K) q = _mm512_mask_add_epi8(q, bits(p, 2 * c, 2 * c + 1), q,
                                                         _mm512_set1_epi8(4));
    } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
      q = pair(p + (Q == kQ4_K ? 16 : 48) + 32 * c, 0, 4, 0x0F);
      if constexpr (Q == kQ5_K) q = _mm512_mask_add_epi8(q, bits(p + 16, 2 * c, 2 * c + 1), q,
                                                         _mm512_set1_epi8(16));
    } else {  // Q6_K: low or high nibbles of 64 ql bytes, 2 bits of the half's qh
      const __m512i ql = _mm512_loadu_si512(p + 64 * h);
      const __m512i nib = _mm512_and_si512(odd ? _mm512_srli_epi16(ql, 4) : ql,
                                           _mm512_set1_epi8(0x0F));
      const __m512i qh = pair(p + 128 + 32 * h, 4 * odd, 4 * odd + 2, 3);
      q = _mm512_or_si512(nib, _mm512_slli_epi16(qh, 4));
    }
    u[0] = q;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if constexpr (Q == kQ4_K || Q == kQ5_K) {  // lane j: 32-group 2c + j / 8 (st.a: a, then b)
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(2 * c), _mm512_srli_epi32(lane, 3));
      *a = _mm512_permutexvar_ps(idx, st.a);
      *b = _mm512_permutexvar_ps(_mm512_add_epi32(idx, _mm512_set1_epi32(8)), st.a);
    } else {  // lane j of chunk c covers elements 64c + 4j..: 16-element group 4c + j / 4
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * c), _mm512_srli_epi32(lane, 2));
      *a = _mm512_permutexvar_ps(idx, st.a);
      *b = _mm512_permutexvar_ps(idx, st.b);
    }
  }
};

template <int Q>
using Unit = std::conditional_t<(Q == kQ8_0), Q8Unit,
                                std::conditional_t<(Q < kQ2_K), NibbleUnit<Q>, KUnit<Q>>>;

}  // namespace minivllm::gguf
