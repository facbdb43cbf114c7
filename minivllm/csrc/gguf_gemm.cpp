// Linears and dequantisation straight from GGUF-packed weights (uint8 block rows as in the file).
//
// Decode steps (few rows of x) are bound by streaming the packed weight once, so they never
// widen it: x is quantized to int8 per 32 elements (scale amax / 127, as llama.cpp's Q8_0), and
// each weight chunk of 64 quants (unsigned bytes, gguf_simd.h) meets x's int8 through
// vpdpbusd (64 multiply-adds per instruction, int32 sums per 4 elements). With the common form
// x_w = a * u + b per element, a 4-element lane adds a * dx * sum(u * q) + b * dx * sum(q), so
// the per-block scales cost two fp32 FMAs per 64 elements and per token. Without AVX-512 VNNI a
// scalar loop computes the same sums. Prompt chunks instead dequantise the weight 16 rows at a
// time into an L2-sized bf16 tile and run the AMX GEMM (gemm_amx.cpp) on it, tile by tile.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_math.h"
#include "gguf_blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define MINIVLLM_GGUF_VNNI 1
#include "gguf_simd.h"
#endif

extern "C" int minivllm_gemm_amx_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t,
                                      const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                                      int64_t, int32_t);

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

// Geometry of a row for the kernels: units of `blocks` blocks (the last unit of a row may hold
// fewer, nb_last), kp = k padded to whole units, lanes = fp32 lanes of dx / s4 per row.
// split: the activation layout of NibbleUnit (each block's two halves in separate registers).
struct RowShape {
  int64_t units, kp, lanes;
  int nb_last;
  bool split;
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
};

#if MINIVLLM_GGUF_VNNI
inline __m512 load16(const void* x, int64_t at, int dt) {
  if (dt == kF32) return _mm512_loadu_ps(static_cast<const float*>(x) + at);
  const __m256i h = _mm256_loadu_si256((const __m256i*)(static_cast<const uint16_t*>(x) + at));
  if (dt == kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// quantize_block below, vectorised (the same values: round to nearest even either way).
void quantize_block_simd(const void* x, int64_t at, int dt, int64_t blk, bool split, int8_t* q,
                         float* dx, float* s4) {
  const __m512 v0 = load16(x, at, dt), v1 = load16(x, at + 16, dt);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  const __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id))));
  const __m128i q1 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id))));
  const __m128i ones = _mm_set1_epi8(1), zero = _mm_setzero_si128();
  if (!split) {  // 8 lanes: sums of 4 consecutive q
    _mm_storeu_si128((__m128i*)(q + 32 * blk), q0);
    _mm_storeu_si128((__m128i*)(q + 32 * blk + 16), q1);
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1),
                                             _mm256_set_m128i(q1, q0));
    _mm256_storeu_ps(dx + 8 * blk, _mm256_set1_ps(d));
    _mm256_storeu_ps(s4 + 8 * blk, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d)));
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
void quantize_block(const void* x, int64_t at, int dt, int64_t blk, bool split, int8_t* q,
                    float* dx, float* s4) {
#if MINIVLLM_GGUF_VNNI
  return quantize_block_simd(x, at, dt, blk, split, q, dx, s4);
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
    for (int j = 0; j < 8; ++j) {
      dx[8 * blk + j] = d;
      s4[8 * blk + j] = d * static_cast<float>(qb[4 * j] + qb[4 * j + 1] + qb[4 * j + 2] +
                                               qb[4 * j + 3]);
    }
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
void zero_block(int64_t blk, bool split, int8_t* q, float* dx, float* s4) {
  const int64_t unit = blk / 4, jb = blk % 4;
  if (!split) {
    std::fill_n(q + 32 * blk, 32, 0);
    std::fill_n(dx + 8 * blk, 8, 0.0f);
    std::fill_n(s4 + 8 * blk, 8, 0.0f);
    return;
  }
  std::fill_n(q + 128 * unit + 16 * jb, 16, 0);
  std::fill_n(q + 128 * unit + 64 + 16 * jb, 16, 0);
  std::fill_n(dx + 16 * unit + 4 * jb, 4, 0.0f);
  std::fill_n(s4 + 16 * unit + 4 * jb, 4, 0.0f);
}

bool quantize_rows(const void* x, int64_t x_stride, int dt, int64_t m, int64_t k, RowShape rs,
                   Activation* act) {
  try {  // NOTE: resize, then zero only the padding: every other entry is written below
    act->q.resize(m * rs.kp);
    act->dx.resize(m * rs.lanes);
    act->s4.resize(m * rs.lanes);
  } catch (...) {
    return false;
  }
  for (int64_t r = 0; r < m; ++r) {
    int8_t* q = act->q.data() + r * rs.kp;
    float *dx = act->dx.data() + r * rs.lanes, *s4 = act->s4.data() + r * rs.lanes;
    for (int64_t c = 0; c < k; c += 32)
      quantize_block(x, r * x_stride + c, dt, c / 32, rs.split, q, dx, s4);
    for (int64_t c = k; c < rs.kp; c += 32) zero_block(c / 32, rs.split, q, dx, s4);
  }
  return true;
}

// out[r][mm] = sum over k of row (n0 + r) of the weight times token (m0 + mm) of x, for
// r < rows and mm < mc, from the int8 sums (scalar: any CPU).
void dot_rows_scalar(int qtype, const uint8_t* w, int64_t w_stride, int64_t k,
                     const Activation& act, RowShape rs, int64_t m0, int mc, int rows,
                     float* out /* [rows, mc] */) {
  const Geometry g = geometry(qtype);
  uint8_t u[256];
  float a[16], b[16];
  for (int r = 0; r < rows; ++r) {
    for (int mm = 0; mm < mc; ++mm) out[r * mc + mm] = 0.0f;
    for (int64_t blk = 0; blk < k / g.elems; ++blk) {
      decode_block(qtype, w + r * w_stride + blk * g.bytes, u, a, b);
      for (int mm = 0; mm < mc; ++mm) {
        const int64_t at = blk * g.elems;  // natural layout (rs.split is false here)
        const int8_t* q = act.q.data() + (m0 + mm) * rs.kp + at;
        float sum = 0.0f;
        for (int s = 0; s < g.elems / 16; ++s) {
          int32_t isum = 0;
          for (int i = 0; i < 16; ++i) isum += u[16 * s + i] * q[16 * s + i];
          const int64_t lane = (m0 + mm) * rs.lanes + at / 4 + 4 * s;
          const float* s4 = act.s4.data() + lane;
          sum += a[s] * act.dx[lane] * static_cast<float>(isum) +
                 b[s] * (s4[0] + s4[1] + s4[2] + s4[3]);
        }
        out[r * mc + mm] += sum;
      }
    }
  }
}

#if MINIVLLM_GGUF_VNNI
// As dot_rows_scalar for R rows (rows < R: the last row is repeated, its extra sums dropped)
// and MC tokens, with vpdpbusd: the R rows' chunks are unpacked once per MC tokens.
template <int Q, int R, int MC>
void dot_rows_vnni(const Unit<Q>& unit, const uint8_t* w, int64_t w_stride, RowShape rs,
                   const Activation& act, int64_t m0, int rows, float* out /* [rows, MC] */) {
  using State = typename Unit<Q>::State;
  const int8_t* xq = act.q.data();  // hoisted: the stores below may not alias them
  const float *xdx = act.dx.data(), *xs4 = act.s4.data();
  const uint8_t* row[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) row[r] = w + std::min(r, rows - 1) * w_stride;
  __m512 acc[R][MC];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) acc[r][mm] = _mm512_setzero_ps();
  for (int64_t un = 0; un < rs.units; ++un) {
    const int nb = un + 1 == rs.units ? rs.nb_last : Unit<Q>::kBlocks;
    State st[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) Unit<Q>::begin(row[r] + un * Unit<Q>::kUnitBytes, &st[r]);
    for (int c = 0; c < Unit<Q>::kChunks; ++c) {
      const int64_t e = un * Unit<Q>::kChunks + c;  // 64-element chunk of the row
      __m512i u[R][Unit<Q>::kRegs];
      __m512 a[R], b[R];
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        unit.chunk(row[r] + un * Unit<Q>::kUnitBytes, nb, c, st[r], u[r], &a[r], &b[r]);
      #pragma GCC unroll 8
      for (int mm = 0; mm < MC; ++mm) {
        const int8_t* q = xq + (m0 + mm) * rs.kp + 64 * Unit<Q>::kRegs * e;
        const __m512i q0 = _mm512_loadu_si512(q);
        const int64_t lane = (m0 + mm) * rs.lanes + 16 * e;
        const __m512 dx = _mm512_loadu_ps(xdx + lane), s4 = _mm512_loadu_ps(xs4 + lane);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[r][0], q0);
          if constexpr (Unit<Q>::kRegs == 2)
            isum = _mm512_dpbusd_epi32(isum, u[r][1], _mm512_loadu_si512(q + 64));
          acc[r][mm] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(a[r], dx),
                                       acc[r][mm]);
          acc[r][mm] = _mm512_fmadd_ps(b[r], s4, acc[r][mm]);
        }
      }
    }
  }
  // every (r, mm) reduced (a runtime bound here would keep acc in memory), `rows` stored
  float sums[R][MC];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) sums[r][mm] = _mm512_reduce_add_ps(acc[r][mm]);
  for (int r = 0; r < rows; ++r)
    for (int mm = 0; mm < MC; ++mm) out[r * MC + mm] = sums[r][mm];
}

// Rows [n0, n1) x all m tokens into y (+ bias): groups of 4 rows for one token, 2 rows x up to
// 8 tokens (the accumulators stay in registers) otherwise.
template <int Q>
void gemm_rows_vnni(const uint8_t* w, int64_t w_stride, const Activation& act, RowShape rs,
                    int64_t m, int64_t n0, int64_t n1, const void* bias, void* y,
                    int64_t y_stride, int dt) {
  const Unit<Q> unit;
  float out[4 * 8];
  const int R = m == 1 ? 4 : 2;
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    const uint8_t* wn = w + n * w_stride;
    for (int64_t m0 = 0; m0 < m;) {
      const int64_t left = m - m0;
      const int mc = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
      if (R == 4) dot_rows_vnni<Q, 4, 1>(unit, wn, w_stride, rs, act, m0, rows, out);
      else if (mc == 8) dot_rows_vnni<Q, 2, 8>(unit, wn, w_stride, rs, act, m0, rows, out);
      else if (mc == 4) dot_rows_vnni<Q, 2, 4>(unit, wn, w_stride, rs, act, m0, rows, out);
      else if (mc == 2) dot_rows_vnni<Q, 2, 2>(unit, wn, w_stride, rs, act, m0, rows, out);
      else dot_rows_vnni<Q, 2, 1>(unit, wn, w_stride, rs, act, m0, rows, out);
      for (int r = 0; r < rows; ++r) {
        const float bv = bias == nullptr ? 0.0f : load_elem(bias, n + r, dt);
        for (int mm = 0; mm < mc; ++mm)
          store_elem(y, (m0 + mm) * y_stride + n + r, dt, out[r * mc + mm] + bv);
      }
      m0 += mc;
    }
  }
}
#endif  // MINIVLLM_GGUF_VNNI

void gemm_rows_scalar(int qtype, const uint8_t* w, int64_t w_stride, const Activation& act,
                      RowShape rs, int64_t k, int64_t m, int64_t n0, int64_t n1, const void* bias,
                      void* y, int64_t y_stride, int dt) {
  float out[8];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < m; m0 += 8) {
      const int mc = static_cast<int>(std::min<int64_t>(8, m - m0));
      dot_rows_scalar(qtype, w + n * w_stride, w_stride, k, act, rs, m0, mc, 1, out);
      const float bv = bias == nullptr ? 0.0f : load_elem(bias, n, dt);
      for (int mm = 0; mm < mc; ++mm) store_elem(y, (m0 + mm) * y_stride + n, dt, out[mm] + bv);
    }
}

void gemm_rows(int qtype, const uint8_t* w, int64_t w_stride, const Activation& act,
               RowShape rs, int64_t k, int64_t m, int64_t n0, int64_t n1, const void* bias,
               void* y, int64_t y_stride, int dt) {
#if MINIVLLM_GGUF_VNNI
  switch (qtype) {
#define MINIVLLM_GGUF_CASE(Q)                                                         \
  case Q: return gemm_rows_vnni<Q>(w, w_stride, act, rs, m, n0, n1, bias, y, y_stride, dt);
    MINIVLLM_GGUF_CASE(kQ4_0) MINIVLLM_GGUF_CASE(kQ4_1) MINIVLLM_GGUF_CASE(kQ5_0)
    MINIVLLM_GGUF_CASE(kQ5_1) MINIVLLM_GGUF_CASE(kQ8_0) MINIVLLM_GGUF_CASE(kQ2_K)
    MINIVLLM_GGUF_CASE(kQ3_K) MINIVLLM_GGUF_CASE(kQ4_K) MINIVLLM_GGUF_CASE(kQ5_K)
    MINIVLLM_GGUF_CASE(kQ6_K)
#undef MINIVLLM_GGUF_CASE
  }
#endif
  gemm_rows_scalar(qtype, w, w_stride, act, rs, k, m, n0, n1, bias, y, y_stride, dt);
}

}  // namespace

#include "gguf_dequant.h"

extern "C" {

// 1 when the int8 kernels use AVX-512 VNNI (else the scalar loop).
int minivllm_gguf_has_vnni() {
#if MINIVLLM_GGUF_VNNI
  return 1;
#else
  return 0;
#endif
}

// y [m, n] (+ bias [n]) = x [m, k] W^T for W [n, k] stored as GGUF blocks of `qtype`, rows
// w_stride bytes apart; x, bias and y of element type dt (0 fp32, 1 bf16, 2 fp16), rows of x
// and y x_stride / y_stride elements apart. 0; 1: bad type or k; 3: out of memory.
int minivllm_gguf_gemm(int32_t qtype, const void* x, int64_t x_stride, int32_t dt,
                       const uint8_t* w, int64_t w_stride, const void* bias, void* y,
                       int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
  const Geometry g = geometry(qtype);
  if (g.elems == 0 || k % g.elems != 0 || m < 1 || dt < 0 || dt > 2) return 1;
  const RowShape rs = row_shape(qtype, k, minivllm_gguf_has_vnni());
  const int64_t rows_per_step = 4;  // threads take whole 4-row groups
  const int64_t groups = (n + rows_per_step - 1) / rows_per_step;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    static thread_local Activation act;
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t n0 = std::min(n, groups * t / threads * rows_per_step);
    const int64_t n1 = std::min(n, groups * (t + 1) / threads * rows_per_step);
    if (n0 < n1) {
      if (!quantize_rows(x, x_stride, dt, m, k, rs, &act)) {
#pragma omp atomic write
        failed = 1;
      } else {
        gemm_rows(qtype, w, w_stride, act, rs, k, m, n0, n1, bias, y, y_stride, dt);
      }
    }
  }
  return failed ? 3 : 0;
}

// out [rows, cols] (rows out_stride elements apart, type dt) = W dequantised. 0; 1: bad args.
int minivllm_gguf_dequant(int32_t qtype, const uint8_t* w, int64_t w_stride, int64_t rows,
                          int64_t cols, void* out, int64_t out_stride, int32_t dt,
                          int32_t num_threads) {
  const Geometry g = geometry(qtype);
  if (g.elems == 0 || cols % g.elems != 0 || dt < 0 || dt > 2) return 1;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    dequant_rows(qtype, w, w_stride, rows * t / threads, rows * (t + 1) / threads, cols, out,
                 out_stride, dt);
  }
  return 0;
}

// As minivllm_gguf_gemm for bf16 x / bias / y and many rows of x (prompt chunks): W is
// dequantised tile by tile (tile_rows rows, a multiple of 32) into one bf16 tile [tile_rows,
// k] and multiplied with the AMX GEMM. Each thread dequantises the 16-row blocks the GEMM
// then gives it (the same split), so its part of the tile is already in its L2.
// Needs n % 16 == 0; 2: no AMX here; 3: out of memory.
int minivllm_gguf_gemm_amx_bf16(int32_t qtype, const uint16_t* x, int64_t x_stride,
                                const uint8_t* w, int64_t w_stride, const uint16_t* bias,
                                uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                                int64_t tile_rows, int32_t num_threads) {
  const Geometry g = geometry(qtype);
  if (g.elems == 0 || k % g.elems != 0 || n % 16 != 0 || m < 1 || tile_rows % 32 != 0 ||
      tile_rows < 32)
    return 1;
  static thread_local std::vector<uint16_t> tile;  // the calling thread's
  try {
    tile.resize(std::min(tile_rows, n) * k);
  } catch (...) {
    return 3;
  }
  uint16_t* buf = tile.data();  // (inside the parallel region `tile` would be each thread's own)
  for (int64_t n0 = 0; n0 < n; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, n - n0), blocks = rows / 16;
#pragma omp parallel num_threads(num_threads)
    {
      const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
      dequant_rows(qtype, w + n0 * w_stride, w_stride, blocks * t / threads * 16,
                   blocks * (t + 1) / threads * 16, k, buf, k, kBF16);
    }
    const int rc = minivllm_gemm_amx_bf16(x, x_stride, buf, k,
                                          bias == nullptr ? nullptr : bias + n0, y + n0,
                                          y_stride, m, rows, k, num_threads);
    if (rc != 0) return rc;
  }
  return 0;
}

}  // extern "C"
