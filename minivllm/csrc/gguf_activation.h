// Element access and the int8 quantization of x for the GGUF kernels (gguf_gemm.cpp,
// gguf_amx.cpp). MINIVLLM_GGUF_VNNI: the AVX-512 (VNNI, VBMI, BW) paths are compiled in.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define MINIVLLM_GGUF_VNNI 1
#include "gguf_simd.h"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "gguf_blocks.h"

namespace {

using namespace minivllm::gguf;

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };  // element types of x, bias, y, outputs

inline float load_elem(const void* p, int64_t i, int dt) {
  if (dt == kF32) return static_cast<const float*>(p)[i];
  if (dt == kBF16) return minivllm::to_float(static_cast<const uint16_t*>(p)[i]);
  _Float16 h = static_cast<const _Float16*>(p)[i];
  return static_cast<float>(h);
}

inline void store_elem(void* p, int64_t i, int dt, float v) {
  if (dt == kF32) static_cast<float*>(p)[i] = v;
  else if (dt == kBF16) minivllm::store(v, static_cast<uint16_t*>(p) + i);
  else static_cast<_Float16*>(p)[i] = static_cast<_Float16>(v);
}

// The dot kernels' sums out [rows, mc] (+ bias[n + r]) into y: output rows m0 + mm, columns n + r.
inline void store_sums(const float* out, int rows, int mc, int64_t n, int64_t m0, const void* bias,
                       void* y, int64_t y_stride, int dt) {
  for (int r = 0; r < rows; ++r) {
    const float bv = bias == nullptr ? 0.0f : load_elem(bias, n + r, dt);
    for (int mm = 0; mm < mc; ++mm)
      store_elem(y, (m0 + mm) * y_stride + n + r, dt, out[r * mc + mm] + bv);
  }
}

// Geometry of a row for the kernels: units of `blocks` blocks (the last unit of a row may hold
// fewer, nb_last), kp = k padded to whole units, lanes = fp32 lanes of dx / s4 per row.
// split: the activation layout of NibbleUnit (each block's two halves in separate registers).
// x8: the x8 kernels' records instead (x8_row_shape, gguf_x8.h), x8_b their b-term factor;
// x8_offset: the quants' offset o of Q3_K (4) / Q6_K (32), whose records carry -o * sum(q).
struct RowShape {
  int64_t units, kp, lanes;
  int nb_last;
  bool split;
  bool x8 = false;
  float x8_b = 0.0f;
  int x8_offset = 0;
};

RowShape row_shape(int qtype, int64_t k, bool simd) {
  const Geometry g = geometry(qtype);
  if (g.elems == 256) return {k / 256, k, k / 4, 1, false};
  const int per_unit = simd ? 4 : 2;
  const int64_t blocks = k / 32, units = (blocks + per_unit - 1) / per_unit;
  const int64_t kp = units * per_unit * 32;
  const int nb_last = static_cast<int>(blocks - (units - 1) * per_unit);
  return {units, kp, per_unit == 4 ? kp / 8 : kp / 4, nb_last, per_unit == 4};
}

// x quantized per 32 elements: q [m, kp] int8 (zeros past k), and per fp32 lane (4 elements of
// one vpdpbusd lane; in the split layout, 4 of each half) dx [m, lanes] (the block's scale) and
// s4 [m, lanes] (dx * the sum of the lane's q). One copy per thread: a copy written by one core
// made the other core fetch it line by line, every call (as in gemm_amx.cpp).
struct Activation {
  std::vector<int8_t> q;
  std::vector<float> dx, s4;
  // dx * the sum of q per 16 elements [m, kp / 16], in the natural layout only: for the AVX2
  // kernels (gguf_avx2.h: one scalar FMA per 16 elements for the b term instead of a vector one
  // per 32)
  std::vector<float> s16;
  // RowShape::x8: [m, k / 32] records of kX8Record bytes instead of all the above: a block's 32
  // q, then as floats its dx, x8_b * S (S = dx * sum(q), as the two s16 of the block sum) and
  // the two halves' dx * sums (the 16-element sub-blocks of Q2_K), so that a token's whole
  // block is one pointer's fixed offsets in the x8 kernels. With RowShape::x8_offset (Q3_K,
  // Q6_K) the halves' terms are int32 -o * sum(q) instead, where their integer sums start.
  std::vector<uint8_t> x8;
};

constexpr int64_t kX8Record = 48;  // bytes of one block's record (Activation::x8)

#if MINIVLLM_GGUF_VNNI
inline __m512 load16(const void* x, int64_t at, int dt) {
  if (dt == kF32) return _mm512_loadu_ps(static_cast<const float*>(x) + at);
  const __m256i h = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(x) + at));
  if (dt == kF16) return _mm512_cvtph_ps(h);
  return minivllm::widen_bf16x16(h);
}

// quantize_block below, vectorised (the same values: round to nearest even either way).
void quantize_block_simd(const void* x, int64_t at, int dt, int64_t blk, bool split, int8_t* q,
                         float* dx, float* s4, float* s16) {
  const __m512 v0 = load16(x, at, dt), v1 = load16(x, at + 16, dt);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m512 scale = _mm512_set1_ps(id);
  const __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, scale)));
  const __m128i q1 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, scale)));
  const __m128i ones = _mm_set1_epi8(1), zero = _mm_setzero_si128();
  if (!split) {  // 8 lanes: sums of 4 consecutive q
    _mm_storeu_si128((__m128i*)(q + 32 * blk), q0);
    _mm_storeu_si128((__m128i*)(q + 32 * blk + 16), q1);
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1),
                                             _mm256_set_m128i(q1, q0));
    _mm256_storeu_ps(dx + 8 * blk, _mm256_set1_ps(d));
    _mm256_storeu_ps(s4 + 8 * blk, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d)));
    if (s16 != nullptr) {  // the two halves' sums, as the scalar path writes them
      alignas(32) int32_t l[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(l), sums);
      s16[2 * blk] = d * static_cast<float>(l[0] + l[1] + l[2] + l[3]);
      s16[2 * blk + 1] = d * static_cast<float>(l[4] + l[5] + l[6] + l[7]);
    }
    return;
  }
  const int64_t unit = blk / 4, jb = blk % 4;  // 4 lanes: 4 q of each half
  _mm_storeu_si128((__m128i*)(q + 128 * unit + 16 * jb), q0);
  _mm_storeu_si128((__m128i*)(q + 128 * unit + 64 + 16 * jb), q1);
  const __m128i sums = _mm_dpbusd_epi32(_mm_dpbusd_epi32(zero, ones, q0), ones, q1);
  _mm_storeu_ps(dx + 16 * unit + 4 * jb, _mm_set1_ps(d));
  _mm_storeu_ps(s4 + 16 * unit + 4 * jb, _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(d)));
}
#endif

// Block `blk` of one row of x (elements from `at`) into row buffers q, dx, s4.
inline void quantize_block(const void* x, int64_t at, int dt, int64_t blk, bool split, int8_t* q,
                    float* dx, float* s4, float* s16) {
#if MINIVLLM_GGUF_VNNI
  return quantize_block_simd(x, at, dt, blk, split, q, dx, s4, s16);
#endif
  float v[32], amax = 0.0f;
  for (int i = 0; i < 32; ++i) {
    v[i] = load_elem(x, at + i, dt);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  int8_t qb[32];
  for (int i = 0; i < 32; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
  if (!split) {
    std::memcpy(q + 32 * blk, qb, 32);
    int half[2] = {0, 0};
    for (int j = 0; j < 8; ++j) {
      const int sum = qb[4 * j] + qb[4 * j + 1] + qb[4 * j + 2] + qb[4 * j + 3];
      dx[8 * blk + j] = d;
      s4[8 * blk + j] = d * static_cast<float>(sum);
      half[j / 4] += sum;
    }
    s16[2 * blk] = d * static_cast<float>(half[0]);
    s16[2 * blk + 1] = d * static_cast<float>(half[1]);
    return;
  }
  const int64_t unit = blk / 4, jb = blk % 4;  // 128-element unit, block in it
  std::memcpy(q + 128 * unit + 16 * jb, qb, 16);
  std::memcpy(q + 128 * unit + 64 + 16 * jb, qb + 16, 16);
  for (int j = 0; j < 4; ++j) {
    int sum = 0;
    for (int i = 0; i < 4; ++i) sum += qb[4 * j + i] + qb[16 + 4 * j + i];
    dx[16 * unit + 4 * jb + j] = d;
    s4[16 * unit + 4 * jb + j] = d * static_cast<float>(sum);
  }
}

// A padding block past k: q = 0 and finite scales (the weight's padding is zero: 0 * finite).
inline void zero_block(int64_t blk, bool split, int8_t* q, float* dx, float* s4, float* s16) {
  const int64_t unit = blk / 4, jb = blk % 4;
  if (!split) {
    std::fill_n(q + 32 * blk, 32, 0);
    std::fill_n(dx + 8 * blk, 8, 0.0f);
    std::fill_n(s4 + 8 * blk, 8, 0.0f);
    if (s16 != nullptr) std::fill_n(s16 + 2 * blk, 2, 0.0f);
    return;
  }
  std::fill_n(q + 128 * unit + 16 * jb, 16, 0);
  std::fill_n(q + 128 * unit + 64 + 16 * jb, 16, 0);
  std::fill_n(dx + 16 * unit + 4 * jb, 4, 0.0f);
  std::fill_n(s4 + 16 * unit + 4 * jb, 4, 0.0f);
}

// Room for m rows of x in act (entries not yet written). false: out of memory.
inline bool reserve_rows(int64_t m, RowShape rs, Activation* act) {
  try {
    if (rs.x8) {
      act->x8.resize(m * rs.units * kX8Record);
      return true;
    }
    act->q.resize(m * rs.kp);
    act->dx.resize(m * rs.lanes);
    act->s4.resize(m * rs.lanes);
    act->s16.resize(rs.split ? 0 : m * rs.kp / 16);
  } catch (...) {
    return false;
  }
  return true;
}

// The row of x at element `at` (k elements) into row r of act (sized by reserve_rows).
inline void quantize_row(const void* x, int64_t at, int dt, int64_t k, RowShape rs, int64_t r,
                         Activation* act) {
  if (rs.x8) {  // one block at a time through quantize_block's natural layout: the same values
    uint8_t* rec = act->x8.data() + r * rs.units * kX8Record;
    int8_t q[32];
    float dx[8], s4[8], s16[2];
    for (int64_t b = 0; b < rs.units; ++b, rec += kX8Record) {
      quantize_block(x, at + 32 * b, dt, 0, false, q, dx, s4, s16);
      const float tail[4] = {dx[0], rs.x8_b * (s16[0] + s16[1]), s16[0], s16[1]};
      std::memcpy(rec, q, 32);
      std::memcpy(rec + 32, tail, 16);
      if (rs.x8_offset != 0) {
        int32_t half[2] = {0, 0};
        for (int i = 0; i < 32; ++i) half[i / 16] -= rs.x8_offset * q[i];
        std::memcpy(rec + 40, half, 8);
      }
    }
    return;
  }
  int8_t* q = act->q.data() + r * rs.kp;
  float *dx = act->dx.data() + r * rs.lanes, *s4 = act->s4.data() + r * rs.lanes;
  float* s16 = rs.split ? nullptr : act->s16.data() + r * (rs.kp / 16);
  for (int64_t c = 0; c < k; c += 32)
    quantize_block(x, at + c, dt, c / 32, rs.split, q, dx, s4, s16);
  for (int64_t c = k; c < rs.kp; c += 32) zero_block(c / 32, rs.split, q, dx, s4, s16);
}

// m rows of x (x_stride elements apart) into act.
inline bool quantize_rows(const void* x, int64_t x_stride, int dt, int64_t m, int64_t k,
                          RowShape rs, Activation* act) {
  if (!reserve_rows(m, rs, act)) return false;
  for (int64_t r = 0; r < m; ++r) quantize_row(x, r * x_stride, dt, k, rs, r, act);
  return true;
}

}  // namespace
