// The int8 dot kernels of the GGUF linears (gguf_gemm.cpp) and of the GGUF MoE experts
// (fused_moe_gguf.cpp): rows of a GGUF-packed weight times a few rows of x quantized per 32
// (gguf_activation.h), one thread.
//
// The weight's quants, unpacked 64 to a register as unsigned bytes (gguf_simd.h), meet x's int8
// through vpdpbusd (64 multiply-adds per instruction, int32 sums per 4 elements). With the common
// form w = a * u + b per element (gguf_blocks.h), an int32 lane adds a * dx * sum(u * q) +
// b * dx * sum(q): the per-block scales cost one multiply and two FMAs per 16 lanes and row of x.
// Without AVX-512 VNNI / VBMI: the AVX2 kernels of gguf_avx2.h, else a scalar loop.
#pragma once

#include <algorithm>
#include <cstdint>

#include "gguf_activation.h"  // MINIVLLM_GGUF_VNNI, element access, x's int8 quantization
#include "gguf_avx2.h"        // MINIVLLM_GGUF_AVX2: CPUs with AVX2 but not AVX-512 VNNI
#include "gguf_blocks.h"
#include "gguf_x8.h"          // the x8 layout of the AVX2 kernels

namespace {

using namespace minivllm::gguf;

// Rows of x from which gguf_gemm.cpp takes the x^T tiles of gguf_tiles.h instead of these
// kernels, where VNNI is built (one full group of 16 tokens: there the tiles win).
constexpr int64_t kTileMinRows = 16;

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
// Rows ahead the dot kernels prefetch: the hardware prefetcher alone left a 30 MB Q8_0 LM head
// at 6.7 GB/s on one thread, 8 rows ahead 13-15 GB/s (4: 10.7; 16, 32: no better).
constexpr int kAhead = 8;

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
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = row[r] + un * Unit<Q>::kUnitBytes;
      // the same unit of the rows kAhead rows on (past the end: a prefetch never faults)
      for (int off = 0; off < Unit<Q>::kUnitBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * w_stride + off), _MM_HINT_T0);
      Unit<Q>::begin(p, &st[r]);
    }
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

// Rows [n0, n1) x the m tokens of act from its row a0 into y (+ bias; y row i: act row a0 + i):
// groups of 4 rows for one token, 2 rows x up to 8 tokens (the accumulators stay in registers)
// otherwise.
template <int Q>
void gemm_rows_vnni(const uint8_t* w, int64_t w_stride, const Activation& act, RowShape rs,
                    int64_t a0, int64_t m, int64_t n0, int64_t n1, const void* bias, void* y,
                    int64_t y_stride, int dt) {
  const Unit<Q> unit;
  float out[4 * 8];
  const int R = m == 1 ? 4 : 2;
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
    const uint8_t* wn = w + n * w_stride;
    for (int64_t m0 = 0; m0 < m;) {
      const int64_t left = m - m0;
      const int mc = left >= 8 ? 8 : left >= 4 ? 4 : static_cast<int>(left);  // 3: one pass
      if (R == 4) dot_rows_vnni<Q, 4, 1>(unit, wn, w_stride, rs, act, a0 + m0, rows, out);
      else if (mc == 8) dot_rows_vnni<Q, 2, 8>(unit, wn, w_stride, rs, act, a0 + m0, rows, out);
      else if (mc == 4) dot_rows_vnni<Q, 2, 4>(unit, wn, w_stride, rs, act, a0 + m0, rows, out);
      else if (mc == 3) dot_rows_vnni<Q, 2, 3>(unit, wn, w_stride, rs, act, a0 + m0, rows, out);
      else if (mc == 2) dot_rows_vnni<Q, 2, 2>(unit, wn, w_stride, rs, act, a0 + m0, rows, out);
      else dot_rows_vnni<Q, 2, 1>(unit, wn, w_stride, rs, act, a0 + m0, rows, out);
      store_sums(out, rows, mc, n, m0, bias, y, y_stride, dt);
      m0 += mc;
    }
  }
}
#endif  // MINIVLLM_GGUF_VNNI

void gemm_rows_scalar(int qtype, const uint8_t* w, int64_t w_stride, const Activation& act,
                      RowShape rs, int64_t k, int64_t a0, int64_t m, int64_t n0, int64_t n1,
                      const void* bias, void* y, int64_t y_stride, int dt) {
  float out[8];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < m; m0 += 8) {
      const int mc = static_cast<int>(std::min<int64_t>(8, m - m0));
      dot_rows_scalar(qtype, w + n * w_stride, w_stride, k, act, rs, a0 + m0, mc, 1, out);
      const float bv = bias == nullptr ? 0.0f : load_elem(bias, n, dt);
      for (int mm = 0; mm < mc; ++mm) store_elem(y, (m0 + mm) * y_stride + n, dt, out[mm] + bv);
    }
}

// Rows [n0, n1) of W (qtype blocks, rows w_stride bytes apart, k columns) times act rows
// [a0, a0 + m) into y rows [0, m) (+ bias): the vectorised kernels where built, else scalar.
// An x8 weight needs act quantized with x8_row_shape (gguf_x8.h).
inline void gguf_dot_rows(int qtype, const uint8_t* w, int64_t w_stride, const Activation& act,
                          RowShape rs, int64_t k, int64_t a0, int64_t m, int64_t n0, int64_t n1,
                          const void* bias, void* y, int64_t y_stride, int dt) {
#if MINIVLLM_GGUF_X8
  if (qtype & kX8Layout) {  // rows in whole groups (gguf_x8.h)
    x8_gemm(qtype & ~kX8Layout, w, w_stride, act, rs, k, a0, m, n0, n1, bias, y, y_stride, dt);
    return;
  }
#endif
#if MINIVLLM_GGUF_VNNI
  switch (qtype) {
#define MINIVLLM_GGUF_CASE(Q)                                                                   \
  case Q:                                                                                       \
    return gemm_rows_vnni<Q>(w, w_stride, act, rs, a0, m, n0, n1, bias, y, y_stride, dt);
    MINIVLLM_GGUF_BLOCK_TYPES(MINIVLLM_GGUF_CASE)
#undef MINIVLLM_GGUF_CASE
  }
#elif MINIVLLM_GGUF_AVX2
  switch (qtype) {
#define MINIVLLM_GGUF_CASE(Q)                                                                   \
  case Q:                                                                                       \
    return gemm_rows_avx2<Q>(w, w_stride, act, rs, k, a0, m, n0, n1, bias, y, y_stride, dt);
    MINIVLLM_GGUF_BLOCK_TYPES(MINIVLLM_GGUF_CASE)
#undef MINIVLLM_GGUF_CASE
  }
#endif
  gemm_rows_scalar(qtype, w, w_stride, act, rs, k, a0, m, n0, n1, bias, y, y_stride, dt);
}

}  // namespace
