// Batched x (16+ rows: batched decode steps, prompt chunks) times GGUF-packed weights on CPUs
// without AMX: int8 products of one weight row with 16 tokens at a time (gguf_gemm.cpp).
//
// The dot kernel of gguf_gemm.cpp pairs a register of one row's quants with a register of one
// token's, so each vpdpbusd (64 multiply-adds) is followed by a conversion and three fp32 ops on
// the block scales: 5 vector ops per 64. Here x is transposed ("tiled"): a register holds the
// same 4 elements of 16 tokens, and one vpdpbusd multiplies them with 4 quants of a weight row
// broadcast to all lanes. The 4 lanes of a scale group (16 elements sharing the weight's (a, b)
// and x's block scale: a K-quant 16-group, or half of a legacy block in each of its two split
// registers) then sum in int32 before one scaling, so per 16 tokens and group a row costs
// 4 x kRegs vpdpbusd and 4 fp32 ops: 2.5-3x fewer vector ops than the dot kernel per product.
// The values are the dot kernel's, summed in another order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gguf_activation.h"

namespace {

constexpr int kTileTokens = 16;          // tokens per register of x^T
constexpr int64_t kTokenBlock = 256;     // tokens whose x^T (<= 400 KB at k = 1536) stays in L2

// x^T in groups of 16 tokens, for chunks e of the row (64 * kRegs elements each):
// q [group][e][reg][lane 16][token 16] int32 (4 int8 each), and per scale group (4 lanes) of
// each chunk dx, sx [group][e][4][token 16]: x's block scale, and dx * the sum of the group's q.
// Tokens past m are zero (with zero scales).
struct TiledActivation {
  std::vector<int32_t> q;
  std::vector<float> dx, sx;
};

}  // namespace

#if MINIVLLM_GGUF_VNNI
namespace {

// act (quantize_rows's layout, m rows) -> xt; false: out of memory.
template <int Q>
bool tile_activation(const Activation& act, RowShape rs, int64_t m, TiledActivation* xt) {
  using U = Unit<Q>;
  const int64_t chunks = rs.units * U::kChunks, groups = (m + kTileTokens - 1) / kTileTokens;
  try {
    xt->q.assign(groups * chunks * U::kRegs * 256, 0);
    xt->dx.assign(groups * chunks * 64, 0.0f);
    xt->sx.assign(groups * chunks * 64, 0.0f);
  } catch (...) {
    return false;
  }
  for (int64_t tok = 0; tok < m; ++tok) {
    const int64_t tg = tok / kTileTokens, t = tok % kTileTokens;
    const int32_t* q = reinterpret_cast<const int32_t*>(act.q.data() + tok * rs.kp);
    const float *dx = act.dx.data() + tok * rs.lanes, *s4 = act.s4.data() + tok * rs.lanes;
    for (int64_t e = 0; e < chunks; ++e) {
      int32_t* dst = xt->q.data() + (tg * chunks + e) * U::kRegs * 256 + t;
      for (int g = 0; g < U::kRegs; ++g)
        for (int j = 0; j < 16; ++j) dst[(g * 16 + j) * 16] = q[(e * U::kRegs + g) * 16 + j];
      const int64_t at = (tg * chunks + e) * 64 + t;
      float *tdx = xt->dx.data() + at, *tsx = xt->sx.data() + at;
      for (int grp = 0; grp < 4; ++grp) {
        const int64_t lane = 16 * e + 4 * grp;
        tdx[16 * grp] = dx[lane];
        tsx[16 * grp] = s4[lane] + s4[lane + 1] + s4[lane + 2] + s4[lane + 3];
      }
    }
  }
  return true;
}

// out[r][16 t + i] = row r of the weight (rows < R: the last row repeated) times token
// 16 (g0 + t) + i, for t < G groups of 16 tokens.
template <int Q, int R, int G>
void tile_rows(const Unit<Q>& unit, const uint8_t* w, int64_t w_stride, RowShape rs, int rows,
               const TiledActivation& xt, int64_t g0, float* out /* [R][G * 16] */) {
  using U = Unit<Q>;
  const int64_t chunks = rs.units * U::kChunks;
  const int64_t g_stride = chunks * U::kRegs * 256;  // int32 of x^T per group of tokens
  const uint8_t* row[R];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r) row[r] = w + std::min(r, rows - 1) * w_stride;
  __m512 acc[R][G];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < G; ++t) acc[r][t] = _mm512_setzero_ps();
  alignas(64) int32_t ub[R][U::kRegs][16];  // the chunk's quants, broadcast from memory
  alignas(64) float ab[R][2][16];
  for (int64_t un = 0; un < rs.units; ++un) {
    const int nb = un + 1 == rs.units ? rs.nb_last : U::kBlocks;
    typename U::State st[R];
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) U::begin(row[r] + un * U::kUnitBytes, &st[r]);
    for (int c = 0; c < U::kChunks; ++c) {
      const int64_t e = un * U::kChunks + c;
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i u[U::kRegs];
        __m512 a, b;
        unit.chunk(row[r] + un * U::kUnitBytes, nb, c, st[r], u, &a, &b);
        for (int g = 0; g < U::kRegs; ++g) _mm512_store_si512(ub[r][g], u[g]);
        _mm512_store_ps(ab[r][0], a);
        _mm512_store_ps(ab[r][1], b);
      }
      const int32_t* xq = xt.q.data() + g0 * g_stride + e * U::kRegs * 256;
      const float* xdx = xt.dx.data() + (g0 * chunks + e) * 64;
      const float* xsx = xt.sx.data() + (g0 * chunks + e) * 64;
      for (int grp = 0; grp < 4; ++grp) {
        __m512i isum[R][G];
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          #pragma GCC unroll 8
          for (int t = 0; t < G; ++t) isum[r][t] = _mm512_setzero_si512();
        #pragma GCC unroll 2
        for (int g = 0; g < U::kRegs; ++g)
          #pragma GCC unroll 4
          for (int l = 0; l < 4; ++l) {
            const int j = 4 * grp + l;
            __m512i xv[G];
            #pragma GCC unroll 8
            for (int t = 0; t < G; ++t)
              xv[t] = _mm512_loadu_si512(xq + t * g_stride + (g * 16 + j) * 16);
            #pragma GCC unroll 8
            for (int r = 0; r < R; ++r) {
              const __m512i wb = _mm512_set1_epi32(ub[r][g][j]);
              #pragma GCC unroll 8
              for (int t = 0; t < G; ++t)
                isum[r][t] = _mm512_dpbusd_epi32(isum[r][t], wb, xv[t]);
            }
          }
        #pragma GCC unroll 8
        for (int t = 0; t < G; ++t) {
          const __m512 dx = _mm512_loadu_ps(xdx + t * chunks * 64 + 16 * grp);
          const __m512 sx = _mm512_loadu_ps(xsx + t * chunks * 64 + 16 * grp);
          #pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512 ad = _mm512_mul_ps(_mm512_set1_ps(ab[r][0][4 * grp]), dx);
            acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][t]), ad, acc[r][t]);
            acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(ab[r][1][4 * grp]), sx, acc[r][t]);
          }
        }
      }
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int t = 0; t < G; ++t) _mm512_storeu_ps(out + (r * G + t) * 16, acc[r][t]);
}

// Rows [n0, n1) x all m tokens of xt into y (+ bias): 4 rows x 2 groups of 16 tokens per
// call, token blocks of kTokenBlock outermost (their x^T stays in L2 while every row meets it).
template <int Q>
void gemm_rows_tiled(const uint8_t* w, int64_t w_stride, const TiledActivation& xt, RowShape rs,
                     int64_t m, int64_t n0, int64_t n1, const void* bias, void* y,
                     int64_t y_stride, int dt) {
  constexpr int R = 4, G = 2;
  const Unit<Q> unit;
  float out[R * G * 16];
  const int64_t groups = (m + kTileTokens - 1) / kTileTokens;
  const int64_t block_groups = kTokenBlock / kTileTokens;
  for (int64_t b0 = 0; b0 < groups; b0 += block_groups) {
    const int64_t b1 = std::min(groups, b0 + block_groups);
    for (int64_t n = n0; n < n1; n += R) {
      const int rows = static_cast<int>(std::min<int64_t>(R, n1 - n));
      const uint8_t* wn = w + n * w_stride;
      for (int64_t g0 = b0; g0 < b1; g0 += G) {
        const int gc = static_cast<int>(std::min<int64_t>(G, b1 - g0));
        if (gc == 2) tile_rows<Q, R, 2>(unit, wn, w_stride, rs, rows, xt, g0, out);
        else tile_rows<Q, R, 1>(unit, wn, w_stride, rs, rows, xt, g0, out);
        const int64_t tokens = std::min<int64_t>(gc * kTileTokens, m - g0 * kTileTokens);
        for (int r = 0; r < rows; ++r) {
          const float bv = bias == nullptr ? 0.0f : load_elem(bias, n + r, dt);
          for (int64_t i = 0; i < tokens; ++i)
            store_elem(y, (g0 * kTileTokens + i) * y_stride + n + r, dt,
                       out[r * gc * 16 + i] + bv);
        }
      }
    }
  }
}

}  // namespace
#endif  // MINIVLLM_GGUF_VNNI
