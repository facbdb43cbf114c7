// The "x8" layout of GGUF weights for the dot kernels without AMX (gguf_x8.h, gguf_x8_k.h): the
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

// One x8 group at `group` -> its kX8Rows plain rows (row_bytes apart) at plain.
inline void x8_group_to_plain(int qtype, const uint8_t* group, int64_t row_bytes,
                              uint8_t* plain) {
  const int bs = x8_block_bytes(qtype);
  for (int64_t b = 0; b < row_bytes / bs; ++b)
    for (int r = 0; r < kX8Rows; ++r)
      x8_move_units<true>(qtype, const_cast<uint8_t*>(group) + b * kX8Rows * bs,
                          plain + r * row_bytes + b * bs, r);
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
