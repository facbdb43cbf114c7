// Dequantisation of GGUF block rows into fp32 / bf16 / fp16 rows (gguf_gemm.cpp; bf16 strips for
// the AMX tiles of gguf_amx.cpp).
//
// x = fma(a, u, b) in fp32 reproduces gguf-py's dequantizers bit for bit (see gguf_blocks.h),
// then one rounding to the output type.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_math.h"
#include "gguf_activation.h"
#include "gguf_avx2.h"
#include "gguf_blocks.h"
#include "gguf_x8_layout.h"

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
  _mm512_storeu_si512(o, minivllm::cvt_bf16x32(hi, lo));  // one op for 32 roundings
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

#if MINIVLLM_BF16_SIMD
// One row of a 4/5-bit legacy type as bf16 by table lookup: per block the 32 values fma(a, t, b)
// (t = 0..31; 4-bit: t % 16) are formed and rounded to bf16 once, in one register, and each
// element fetches its own with one word permute (vpermw, index u). Per 32 elements that is one
// FMA (two for 5 bits), one conversion and two permutes, against the widening, conversion and
// FMA per 16 of dequant_row_vnni; the values are the same.
template <int Q>
void dequant_row_table_bf16(const NibbleUnit<Q>& unit, const uint8_t* w, RowShape rs,
                            uint16_t* out) {
  alignas(64) float ab[2][16];  // a, b spilled: broadcast from memory (loads, not permutes)
  const __m512 t_lo = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 t_hi = _mm512_add_ps(t_lo, _mm512_set1_ps(16.0f));
  __m512i pick[4];  // word i of block j: u[0] (i < 16) or u[1] byte 16j + i % 16, zero-extended
  for (int j = 0; j < 4; ++j)
    pick[j] = byte_table([j](int t) { return (t / 32) * 64 + 16 * j + (t % 32) / 2; });
  for (int64_t un = 0; un < rs.units; ++un) {
    const int nb = un + 1 == rs.units ? rs.nb_last : NibbleUnit<Q>::kBlocks;
    __m512i u[2];
    __m512 a, b;
    unit.chunk(w + un * NibbleUnit<Q>::kUnitBytes, nb, 0, {}, u, &a, &b);
    _mm512_store_ps(ab[0], a);
    _mm512_store_ps(ab[1], b);
    for (int j = 0; j < nb; ++j) {
      const __m512 aj = _mm512_set1_ps(ab[0][4 * j]), bj = _mm512_set1_ps(ab[1][4 * j]);
      const __m512 lo = _mm512_fmadd_ps(aj, t_lo, bj);
      const __m512 hi = NibbleUnit<Q>::kFive ? _mm512_fmadd_ps(aj, t_hi, bj) : lo;
      const __m512i table = minivllm::cvt_bf16x32(hi, lo);
      const __m512i idx = _mm512_maskz_permutex2var_epi8(0x5555555555555555ull, u[0], pick[j],
                                                         u[1]);
      _mm512_storeu_si512(out + 32 * (4 * un + j), _mm512_permutexvar_epi16(idx, table));
    }
  }
}

// One Q4_0 / Q4_1 row as bf16 by table lookup, straight from the block bytes: word i of a block's
// index register holds quant byte i % 16 (elements 16.. shifted down a nibble); vpermw reads
// only its low 5 bits, and the table repeats its 16 values, so the other nibble's bit 4 is
// harmless. Scales are converted 4 blocks at a time and broadcast from memory (load ports: the
// permute port is what this loop runs out of).
template <int Q>
void dequant_row_q4_bf16(const uint8_t* w, RowShape rs, uint16_t* out) {
  using U = NibbleUnit<Q>;
  alignas(64) float ab[16];  // lanes 0-3: d of the unit's blocks, 4-7: their b
  const __m512 t16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // scale words: d_j (word j * kBytes / 2), then m_j (Q4_1) or d_j again (Q4_0: b = -8 d)
  const __m512i sidx = word_table([](int i) {
    return (i % 4) * (U::kBytes / 2) + (i >= 4 && i < 8 && U::kMin ? 1 : 0);
  });
  const __m512 bmul = _mm512_setr_ps(1, 1, 1, 1, U::kMin ? 1 : -8, U::kMin ? 1 : -8,
                                     U::kMin ? 1 : -8, U::kMin ? 1 : -8, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512i pick[4];  // byte 2i of block j's index register: quant byte i % 16 of block j
  for (int j = 0; j < 4; ++j)
    pick[j] = byte_table([j](int t) { return j * U::kBytes + U::kQs + (t % 32) / 2; });
  for (int64_t un = 0; un < rs.units; ++un) {
    const int nb = un + 1 == rs.units ? rs.nb_last : U::kBlocks;
    __m512i lo, hi;
    load_unit<U::kUnitBytes>(w + un * U::kUnitBytes, nb * U::kBytes, nb == U::kBlocks, &lo, &hi);
    const __m512i sw = _mm512_permutex2var_epi16(lo, sidx, hi);
    _mm512_store_ps(ab, _mm512_mul_ps(halves(_mm512_castsi512_si256(sw)), bmul));
    asm volatile("" : : "r"(ab) : "memory");  // keep the broadcasts as loads from ab
    for (int j = 0; j < nb; ++j) {
      const __m512i bytes = _mm512_maskz_permutex2var_epi8(0x5555555555555555ull, lo, pick[j], hi);
      const __m512i idx = _mm512_mask_srli_epi16(bytes, 0xFFFF0000u, bytes, 4);
      const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(ab[j]), t16, _mm512_set1_ps(ab[4 + j]));
      const __m512i table = minivllm::cvt_bf16x32(t, t);
      _mm512_storeu_si512(out + 32 * (4 * un + j), _mm512_permutexvar_epi16(idx, table));
    }
  }
}

// One Q8_0 row as bf16: d * q straight from the int8 quants (exact in fp32, as fma(a, u, b)).
inline void dequant_row_q8_bf16(const Q8Unit& unit, const uint8_t* w, RowShape rs,
                                uint16_t* out) {
  alignas(64) float d[16];
  for (int64_t un = 0; un < rs.units; ++un) {
    const int nb = un + 1 == rs.units ? rs.nb_last : Q8Unit::kBlocks;
    const uint8_t* p = w + un * Q8Unit::kUnitBytes;
    const int bytes = nb * Q8Unit::kBytes;
    const __m512i r0 = _mm512_maskz_loadu_epi8(first_bytes(bytes), p);
    const __m512i r1 = _mm512_maskz_loadu_epi8(first_bytes(bytes - 64), p + 64);
    _mm512_store_ps(d, halves(_mm512_castsi512_si256(
                           _mm512_permutex2var_epi16(r0, unit.scale_idx, r1))));
    for (int j = 0; j < nb; ++j) {
      const uint8_t* q = p + j * Q8Unit::kBytes + 2;
      const __m512 dj = _mm512_set1_ps(d[4 * j]);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
      const __m512 hi = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + 16))));
      _mm512_storeu_si512(out + 32 * (4 * un + j),
                          minivllm::cvt_bf16x32(_mm512_mul_ps(hi, dj),
                                                       _mm512_mul_ps(lo, dj)));
    }
  }
}

// One 16-row group of an x8 Q4_0 / Q4_1 weight (`blocks` blocks a row) -> 16 bf16 rows of `out`
// (k elements apart), read straight from the interleaved bytes (gguf_amx.cpp's strips, the
// dequantised tiles): the 16 rows' d (and m) are one load each, the quants come out as rows by
// x8_rows4, and each row's 32 values are looked up in its own 16-entry table as
// dequant_row_q4_bf16 does (the same fp32 values, the same bf16 results). `ahead`: where to
// prefetch the bytes of each block as it is read (the strips' next panel), or null.
template <int Q>
void dequant_group_q4_x8(const uint8_t* group, int64_t blocks, int64_t k, uint16_t* out,
                         const uint8_t* ahead) {
  constexpr int kHeader = Q == kQ4_1 ? 4 : 2, kBlock = kHeader + 16;
  alignas(64) float ab[2][16];  // rows' a (d) and b (m, or -8 d), broadcast from memory
  const __m512 t16 = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i pick[4];  // byte 2i: byte i % 16 of lane L (row 4L + j of rows[j])
  for (int lane = 0; lane < 4; ++lane)
    pick[lane] = byte_table([lane](int t) { return 16 * lane + (t % 32) / 2; });
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* gb = group + b * 16 * kBlock;
    if (ahead != nullptr)
      for (int off = 0; off < 16 * kBlock; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * 16 * kBlock + off), _MM_HINT_T0);
    const __m512 d = halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb)));
    _mm512_store_ps(ab[0], d);
    _mm512_store_ps(ab[1], Q == kQ4_1 ? halves(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(gb + 32)))
                                      : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)));
    asm volatile("" : : "r"(ab) : "memory");  // keep the broadcasts as loads from ab
    __m512i rows[4];
    x8_rows4(gb + 16 * kHeader, rows);
    for (int r = 0; r < 16; ++r) {
      const __m512i bytes =
          _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, pick[r / 4], rows[r % 4]);
      const __m512i idx = _mm512_mask_srli_epi16(bytes, 0xFFFF0000u, bytes, 4);
      const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(ab[0][r]), t16, _mm512_set1_ps(ab[1][r]));
      _mm512_storeu_si512(out + r * k + 32 * b,
                          _mm512_permutexvar_epi16(idx, minivllm::cvt_bf16x32(t, t)));
    }
  }
}

// The same for Q8_0 (d * q, as dequant_row_q8_bf16): the 8 quant units as two x8_rows4 passes
// (elements 0-15, 16-31), spilled so a row's 16 bytes are one load.
inline void dequant_group_q8_x8(const uint8_t* group, int64_t blocks, int64_t k, uint16_t* out,
                                const uint8_t* ahead) {
  constexpr int kBlock = 34;
  alignas(64) float d[16];
  alignas(64) uint8_t q[2][4][64];  // [half][j][lane L: row 4L + j's 16 bytes]
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* gb = group + b * 16 * kBlock;
    if (ahead != nullptr)
      for (int off = 0; off < 16 * kBlock; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + b * 16 * kBlock + off), _MM_HINT_T0);
    _mm512_store_ps(d, halves(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gb))));
    for (int half = 0; half < 2; ++half) {
      __m512i rows[4];
      x8_rows4(gb + 32 + 256 * half, rows);
      for (int j = 0; j < 4; ++j) _mm512_store_si512(q[half][j], rows[j]);
    }
    for (int r = 0; r < 16; ++r) {
      const __m512 dr = _mm512_set1_ps(d[r]);
      const auto values = [&](int half) {
        const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(
            &q[half][r % 4][16 * (r / 4)]));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), dr);
      };
      _mm512_storeu_si512(out + r * k + 32 * b, minivllm::cvt_bf16x32(values(1), values(0)));
    }
  }
}

// Whether dequant_group_x8 reads this type straight from its groups.
constexpr bool x8_group_direct(int qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0;
}

// One 16-row x8 group of an x8_group_direct type, `cols` values a row -> 16 bf16 rows of out,
// out_stride elements apart.
inline void dequant_group_x8(int qtype, const uint8_t* group, int64_t cols, uint16_t* out,
                             int64_t out_stride, const uint8_t* ahead = nullptr) {
  if (qtype == kQ8_0) dequant_group_q8_x8(group, cols / 32, out_stride, out, ahead);
  else if (qtype == kQ4_1) dequant_group_q4_x8<kQ4_1>(group, cols / 32, out_stride, out, ahead);
  else dequant_group_q4_x8<kQ4_0>(group, cols / 32, out_stride, out, ahead);
}
#endif  // MINIVLLM_BF16_SIMD

// One row into bf16 out[0, cols): the fastest of the above for the type.
template <int Q>
inline void dequant_row_bf16(const Unit<Q>& unit, const uint8_t* w, RowShape rs, int64_t cols,
                             uint16_t* out) {
#if MINIVLLM_BF16_SIMD
  if constexpr (Q == kQ8_0) return dequant_row_q8_bf16(unit, w, rs, out);
  if constexpr (Q == kQ4_0 || Q == kQ4_1) return dequant_row_q4_bf16<Q>(w, rs, out);
  if constexpr (Q == kQ5_0 || Q == kQ5_1) return dequant_row_table_bf16<Q>(unit, w, rs, out);
#endif
  dequant_row_vnni<Q>(unit, w, rs, cols, out, 0, kBF16);
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
      if (dt == kBF16)                                                                       \
        dequant_row_bf16<Q>(unit, w + r * w_stride, rs, cols,                                \
                            static_cast<uint16_t*>(out) + r * out_stride);                   \
      else                                                                                   \
        dequant_row_vnni<Q>(unit, w + r * w_stride, rs, cols, out, r * out_stride, dt);      \
    return;                                                                                  \
  }
    MINIVLLM_GGUF_BLOCK_TYPES(MINIVLLM_GGUF_CASE)
#undef MINIVLLM_GGUF_CASE
  }
#elif MINIVLLM_GGUF_AVX2
  switch (qtype) {
#define MINIVLLM_GGUF_CASE(Q)                                                                \
  case Q:                                                                                    \
    for (int64_t r = r0; r < r1; ++r)                                                        \
      dequant_row_avx2<Q>(w + r * w_stride, cols, out, r * out_stride, dt);                  \
    return;
    MINIVLLM_GGUF_BLOCK_TYPES(MINIVLLM_GGUF_CASE)
#undef MINIVLLM_GGUF_CASE
  }
#endif
  for (int64_t r = r0; r < r1; ++r)
    dequant_row_scalar(qtype, w + r * w_stride, cols, out, r * out_stride, dt);
}

// Rows [i0, i1) of out: row ids[i] of W (ids null: row i), rows w_stride bytes apart, in the
// x8 layout (gguf_x8_layout.h: un-interleaved to the plain bytes first, then the kernels above)
// or not.
inline void dequant_rows_at(int qtype, const uint8_t* w, int64_t w_stride, const int64_t* ids,
                            int64_t i0, int64_t i1, int64_t cols, void* out, int64_t out_stride,
                            int dt, bool x8) {
  static thread_local std::vector<uint8_t> plain;
  const size_t group_bytes = static_cast<size_t>(kX8Rows * w_stride);
  if (x8 && plain.size() < group_bytes) plain.resize(group_bytes);
  const int64_t elem = dt == kF32 ? 4 : 2;
  for (int64_t i = i0; i < i1; ++i) {
#if MINIVLLM_GGUF_VNNI && MINIVLLM_BF16_SIMD
    if (x8 && ids == nullptr && dt == kBF16 && x8_group_direct(qtype) && i % kX8Rows == 0 &&
        i + kX8Rows <= i1) {  // a whole group of a type read in place
      dequant_group_x8(qtype, w + i * w_stride, cols, static_cast<uint16_t*>(out) + i * out_stride,
                       out_stride);
      i += kX8Rows - 1;
      continue;
    }
#endif
    if (x8 && ids == nullptr && i % kX8Rows == 0 && i + kX8Rows <= i1) {
      // a whole group: un-interleaved in one sequential pass (row by row, each row's units
      // are 2-4 bytes out of every kX8Rows times that), then dequantised as plain rows
      x8_group_to_plain(qtype, w + i * w_stride, w_stride, plain.data());
      dequant_rows(qtype, plain.data(), w_stride, 0, kX8Rows, cols,
                   static_cast<char*>(out) + i * out_stride * elem, out_stride, dt);
      i += kX8Rows - 1;
      continue;
    }
    const int64_t row = ids == nullptr ? i : ids[i];
    const uint8_t* src = w + row * w_stride;
    if (x8) {
      x8_row_to_plain(qtype, w, w_stride, row, plain.data());
      src = plain.data();
    }
    dequant_rows(qtype, src, 0, 0, 1, cols, static_cast<char*>(out) + i * out_stride * elem, 0,
                 dt);
  }
}

}  // namespace
