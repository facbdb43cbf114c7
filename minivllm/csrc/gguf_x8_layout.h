// The "x8" layout of GGUF weights for the int8 dot kernels (gguf_x8.h, gguf_x8_k.h): the
// same bytes as the file, with the blocks of kX8Rows consecutive rows interleaved (8 rows for
// the AVX2 kernels, 16 for the AVX-512 VNNI ones; the layout is named after its first, 8-row
// form), so one vector load holds 4 quant bytes of each of the group's rows and the int32 lanes
// of vpmaddwd / vpdpbusd are the rows' dot products (no horizontal sums, no byte permutes).
//
// Rows G*g..G*g+G-1 (G = kX8Rows) keep their place (bytes [G*g, G*g + G) * row_bytes), laid out
// block by block (G * block bytes each). A block is a run of units (x8_units): its fp16 fields
// (2 bytes) and 4-byte chunks, in file order; the unit at byte o of a block holds the group's G
// copies at G * o + r * (unit bytes) for row r. So for Q4_0 / Q4_1 / Q8_0:
//   header: each 2-byte field f (d, then Q4_1's m) as G fp16, at 2Gf + 2r;
//   quants: 4-byte chunk c of every row, at G * header + 4Gc + 4r;
// Q4_0 / Q4_1 chunk c holds elements 4c..4c+3 (low nibbles) and 16+4c.. (high), Q8_0 chunk c
// elements 4c..4c+3. Q5's high bits and the K-quants' scale bytes are chunks too (the VNNI
// kernels read those types). Rows must come in whole groups. Dequantisation and embedding rows
// un-interleave to the plain block bytes first, so their values are the plain layout's, bit
// for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gguf_activation.h"  // MINIVLLM_GGUF_VNNI
#include "gguf_avx2.h"        // MINIVLLM_GGUF_AVX2
#include "gguf_blocks.h"

namespace {

using namespace minivllm::gguf;

// The qtype bit that marks a weight in the x8 layout (kernels.h: minivllm_gguf_gemm).
constexpr int kX8Layout = 1 << 8;
#if MINIVLLM_GGUF_VNNI
constexpr int kX8Rows = 16;  // one 512-bit register of int32 / fp32 lanes
constexpr int kX8Tokens = 8;  // tokens per pass over a group: 8 sums + 8 accumulators of 32 zmm
#else
constexpr int kX8Rows = 8;
constexpr int kX8Tokens = 4;  // 16 ymm registers
#endif
// Whether this build's dot kernels read the layout (gguf_gemm.cpp: else the flag is refused).
#if MINIVLLM_GGUF_AVX2 || MINIVLLM_GGUF_VNNI
#define MINIVLLM_GGUF_X8 1
#else
#define MINIVLLM_GGUF_X8 0
#endif

// The byte units of a block, in file order: lead fp16 fields (2 bytes), then 4-byte chunks
// (quants, Q5's high bits, K-quant scales), then trailing fp16 fields (Q6_K's d). In the layout,
// the unit at byte o of a block holds the group's G copies at G * o + r * (unit bytes) for row r.
struct X8Units {
  int lead2, n4, trail2;
};
constexpr X8Units x8_units(int qtype) {
  switch (qtype) {
    case kQ4_0: return {1, 4, 0};
    case kQ4_1: return {2, 4, 0};
    case kQ8_0: return {1, 8, 0};
    case kQ5_0: return {1, 5, 0};   // d, qh, 16 quant bytes
    case kQ5_1: return {2, 5, 0};
    case kQ4_K: return {2, 35, 0};  // d, dmin, 12 scale bytes, 128 quant bytes
    case kQ5_K: return {2, 43, 0};  // ... then 32 qh bytes before the quants
    case kQ6_K: return {0, 52, 1};  // 128 ql, 64 qh, 16 scale bytes, then d
    case kQ2_K: return {0, 20, 2};  // 16 scale bytes, 64 quant bytes, then d, dmin
    case kQ3_K: return {0, 27, 1};  // 32 hmask bytes, 64 quant bytes, 12 scale bytes, then d
    default: return {0, 0, 0};
  }
}
constexpr int x8_block_bytes(int qtype) {
  return 2 * x8_units(qtype).lead2 + 4 * x8_units(qtype).n4 + 2 * x8_units(qtype).trail2;
}

// The types with the layout in this build: the legacy three everywhere the x8 kernels are
// built; the 5-bit and K-quant types with the AVX-512 VNNI kernels only (gguf_x8_k.h).
constexpr bool x8_type(int qtype) {
  if (qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0) return true;
#if MINIVLLM_GGUF_VNNI
  return qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ2_K || qtype == kQ3_K ||
         qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K;
#else
  return false;
#endif
}

// Bytes of a legacy block's header (fp16 fields) and quants (x8_dot_group's types).
constexpr int x8_header(int qtype) { return 2 * x8_units(qtype).lead2; }
constexpr int x8_quants(int qtype) { return 4 * x8_units(qtype).n4; }

// Copies one row's units between a plain block pb and a group block gb (to_plain: gb -> pb).
// (Constant-size copies per loop: a variable size made each unit a memcpy call, and the
// dequantisation of x8 K-quant rows 1.5-2x slower than the file layout's.)
template <bool kToPlain>
inline void x8_move_units(int qtype, uint8_t* gb, uint8_t* pb, int r) {
  const X8Units u = x8_units(qtype);
  const auto move = [&](int o, auto bytes) {
    uint8_t* g = gb + kX8Rows * o + bytes.value * r;
    if constexpr (kToPlain) std::memcpy(pb + o, g, bytes.value);
    else std::memcpy(g, pb + o, bytes.value);
  };
  using Two = std::integral_constant<int, 2>;
  using Four = std::integral_constant<int, 4>;
  int o = 0;
  for (int f = 0; f < u.lead2; ++f, o += 2) move(o, Two{});
  for (int c = 0; c < u.n4; ++c, o += 4) move(o, Four{});
  for (int f = 0; f < u.trail2; ++f, o += 2) move(o, Two{});
}

// Row `row` of an x8 weight starting at w (rows row_bytes apart) -> its plain block bytes.
inline void x8_row_to_plain(int qtype, const uint8_t* w, int64_t row_bytes, int64_t row,
                            uint8_t* plain) {
  const int bs = x8_block_bytes(qtype), r = static_cast<int>(row % kX8Rows);
  uint8_t* group = const_cast<uint8_t*>(w) + (row - r) * row_bytes;  // read only (to_plain)
  for (int64_t b = 0; b < row_bytes / bs; ++b)
    x8_move_units<true>(qtype, group + b * kX8Rows * bs, plain + b * bs, r);
}

#if MINIVLLM_GGUF_VNNI
// Four consecutive 4-byte units of a 16-row group's block (256 bytes at src, [unit][row][4])
// as rows: lane L (128 bits) of rows[j] = row 4L+j's 16 bytes (the 4 units in order). Lane L
// of unit register u holds rows 4L..4L+3, so this is a 4x4 dword transpose inside each lane.
inline void x8_rows4(const uint8_t* src, __m512i rows[4]) {
  const __m512i a0 = _mm512_loadu_si512(src), a1 = _mm512_loadu_si512(src + 64);
  const __m512i a2 = _mm512_loadu_si512(src + 128), a3 = _mm512_loadu_si512(src + 192);
  const __m512i t0 = _mm512_unpacklo_epi32(a0, a1), t1 = _mm512_unpackhi_epi32(a0, a1);
  const __m512i t2 = _mm512_unpacklo_epi32(a2, a3), t3 = _mm512_unpackhi_epi32(a2, a3);
  rows[0] = _mm512_unpacklo_epi64(t0, t2);
  rows[1] = _mm512_unpackhi_epi64(t0, t2);
  rows[2] = _mm512_unpacklo_epi64(t1, t3);
  rows[3] = _mm512_unpackhi_epi64(t1, t3);
}

// One block of a 16-row group -> the 16 rows' plain blocks (at pb, rows row_bytes apart). Four
// consecutive 4-byte units go out as rows (x8_rows4), one 128-bit store per row (16 stores
// where the unit-by-unit copy made 64). The lead fp16 fields (one or two: a dword per row) and
// a last 1-3 chunks go out as one dword scatter each; a lone fp16 field's dword also writes the
// next unit's first 2 bytes, which that unit's stores then overwrite. Trailing fp16 fields
// (K-quants) are copied one by one: a dword there would reach past the block.
inline void x8_block_to_plain16(const X8Units& u, const uint8_t* gb, uint8_t* pb,
                                int64_t row_bytes, __m512i row_offsets) {
  const auto words = [gb](int at) {  // 16 fp16 fields at gb + at, zero-extended to dwords
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb + at)));
  };
  int o = 0;
  if (u.lead2 > 0) {
    __m512i lead = words(0);
    if (u.lead2 == 2) lead = _mm512_or_si512(lead, _mm512_slli_epi32(words(32), 16));
    _mm512_i32scatter_epi32(pb, row_offsets, lead, 1);
    o = 2 * u.lead2;
  }
  int c = 0;
  for (; c + 4 <= u.n4; c += 4, o += 16) {
    __m512i rows[4];
    x8_rows4(gb + 16 * o, rows);
    uint8_t* dst = pb + o;
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j * row_bytes),
                       _mm512_castsi512_si128(rows[j]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (4 + j) * row_bytes),
                       _mm512_extracti32x4_epi32(rows[j], 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (8 + j) * row_bytes),
                       _mm512_extracti32x4_epi32(rows[j], 2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (12 + j) * row_bytes),
                       _mm512_extracti32x4_epi32(rows[j], 3));
    }
  }
  for (; c < u.n4; ++c, o += 4)
    _mm512_i32scatter_epi32(pb + o, row_offsets, _mm512_loadu_si512(gb + 16 * o), 1);
  for (int f = 0; f < u.trail2; ++f, o += 2)
    for (int r = 0; r < 16; ++r) std::memcpy(pb + r * row_bytes + o, gb + 16 * o + 2 * r, 2);
}
#endif

// One x8 group at `group` -> its kX8Rows plain rows (row_bytes apart) at plain.
inline void x8_group_to_plain(int qtype, const uint8_t* group, int64_t row_bytes,
                              uint8_t* plain) {
  const int bs = x8_block_bytes(qtype);
#if MINIVLLM_GGUF_VNNI
  const X8Units u = x8_units(qtype);
  const __m512i row_offsets =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(row_bytes)));
  for (int64_t b = 0; b < row_bytes / bs; ++b)
    x8_block_to_plain16(u, group + b * kX8Rows * bs, plain + b * bs, row_bytes, row_offsets);
#else
  for (int64_t b = 0; b < row_bytes / bs; ++b)
    for (int r = 0; r < kX8Rows; ++r)
      x8_move_units<true>(qtype, const_cast<uint8_t*>(group) + b * kX8Rows * bs,
                          plain + r * row_bytes + b * bs, r);
#endif
}

// kX8Rows plain rows (row_bytes apart) -> one x8 group (kX8Rows * row_bytes bytes).
inline void x8_group_from_plain(int qtype, const uint8_t* plain, int64_t row_bytes,
                                uint8_t* group) {
  const int bs = x8_block_bytes(qtype);
  for (int64_t b = 0; b < row_bytes / bs; ++b)
    for (int r = 0; r < kX8Rows; ++r)
      x8_move_units<false>(qtype, group + b * kX8Rows * bs,
                           const_cast<uint8_t*>(plain) + r * row_bytes + b * bs, r);
}

}  // namespace
