// bf16 GEMM y = x W^T (+ b) with AMX tiles: decode steps' linears, and prompts' whose weight fits L2.
//
// At M <= 64 a linear is still bound by streaming its weight once; oneDNN's blocked AMX GEMM
// streamed ~9-11 GB/s on the 2-core box. This kernel reads the checkpoint's row-major [N, K]
// weight in place (no packed copy): 16 weight rows x 32 k form an AMX "A" tile, so the roles are
// swapped and each tile product gives y^T: C[16 n, 16 m] += W[16 n, 32 k] . X^T[32 k, 16 m].
// X^T is packed once per call into AMX's pair-interleaved "B" layout (a 32-bit transpose of x),
// and each finished C tile is transposed back while bias is added and it is rounded to bf16.
// Threads split the weight's rows; each streams its own contiguous part, one 16-row block
// prefetched ahead. More rows go 64 at a time, each thread's weight rows then coming from its L2
// (prompt chunks of 128-512 rows: ~25% faster than oneDNN; 2048: about even). A second entry
// fuses SiluAndMul into the gate_up projection's output.

#include <algorithm>
#include <cstdint>
#include "kernels.h"
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cpu_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "amx_utils.h"

namespace {

using minivllm::amx_permitted;
using minivllm::load_tile_config;

constexpr int kMaxGroups = 4;  // C tiles 0-3 hold 16 rows of y^T each: M <= 64
// Tile registers: C 0-3, A (weight) 4, B (packed x^T) 5. The intrinsics need literal numbers.

// xp[(s * groups + g) * 256 ...]: the B tile for k = 32s..32s+31 and m = 16g..16g+15, i.e. row p
// holds (x[m, 32s + 2p], x[m, 32s + 2p + 1]) for the 16 m; rows m >= M are zero.
void pack_x(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, int groups,
            uint32_t* xp) {
  for (int g = 0; g < groups; ++g)
    for (int64_t s = 0; s < k / 32; ++s)
      minivllm::pack_b_tile(x + 16 * g * x_stride + 32 * s, x_stride, m - 16 * g,
                            xp + (s * groups + g) * 256);
}

// The 16 x 16 fp32 C tiles 0..G-1 (y^T for 16 weight rows, tokens 16g..) into c[g].
template <int G>
void store_tiles(float (*c)[16][16]) {
  _tile_stored(0, c[0], 64);
  if constexpr (G > 1) _tile_stored(1, c[1], 64);
  if constexpr (G > 2) _tile_stored(2, c[2], 64);
  if constexpr (G > 3) _tile_stored(3, c[3], 64);
}

// 16 bf16 bias values from b[0..16) as fp32 lanes (zeros without bias).
inline __m512 load_bias(const uint16_t* b) {
  if (b == nullptr) return _mm512_setzero_ps();
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))), 16));
}

// Transposes c[g] (y^T) in place into rows: afterwards row i is y[16g + i, n0:n0+16].
inline void transpose_tile(float (*c)[16]) {
  __m512i r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c[i]);
  minivllm::transpose16x16(r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_store_si512(c[i], r[i]);
}

inline void store_row(uint16_t* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}

// y[m, n0:n0+16] for the 16 weight rows n0.. from the C tiles (y^T blocks), + bias, as bf16.
template <int G>
void store_block(int64_t n0, int64_t m, const uint16_t* bias, uint16_t* y, int64_t y_stride) {
  alignas(64) float c[kMaxGroups][16][16];
  store_tiles<G>(c);
  const __m512 b = load_bias(bias == nullptr ? nullptr : bias + n0);
  for (int g = 0; g < G; ++g) {
    transpose_tile(c[g]);
    const int rows = m - 16 * g < 16 ? static_cast<int>(m - 16 * g) : 16;
    for (int i = 0; i < rows; ++i)
      store_row(y + (16 * g + i) * y_stride + n0, _mm512_add_ps(_mm512_load_ps(c[g][i]), b));
  }
}

// C tiles 0..G-1 = W[16 rows at wb, k] . x^T over all k-steps; prefetches the same span of the
// 16 rows at `next` (the block computed after this one; null: none) into L2 as it goes.
template <int G>
void accumulate(const uint32_t* xp, const uint16_t* wb, const uint16_t* next, int64_t w_stride,
                int64_t steps) {
  const int64_t w_bytes = w_stride * 2;
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (G > 2) _tile_zero(2);
  if constexpr (G > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    if (next != nullptr)
      for (int i = 0; i < 16; ++i) _mm_prefetch(next + i * w_stride + 32 * s, _MM_HINT_T1);
    _tile_loadd(4, wb + 32 * s, w_bytes);
    const uint32_t* b = xp + s * G * 256;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (G > 1) {
      _tile_loadd(5, b + 256, 64);
      _tile_dpbf16ps(1, 4, 5);
    }
    if constexpr (G > 2) {
      _tile_loadd(5, b + 512, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (G > 3) {
      _tile_loadd(5, b + 768, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
}

template <int G>
void gemm_blocks(const uint32_t* xp, const uint16_t* w, int64_t w_stride, const uint16_t* bias,
                 uint16_t* y, int64_t y_stride, int64_t m, int64_t k, int64_t block_begin,
                 int64_t block_end) {
  for (int64_t blk = block_begin; blk < block_end; ++blk) {
    const uint16_t* wb = w + blk * 16 * w_stride;
    accumulate<G>(xp, wb, blk + 1 < block_end ? wb + 16 * w_stride : nullptr, w_stride, k / 32);
    store_block<G>(blk * 16, m, bias, y, y_stride);
  }
}

// Fused SiluAndMul: w holds gate rows [0, d) then up rows [d, 2d); block j of the output
// (y[:, 16j:16j+16] = silu(gate) * up) takes gate block j and up block j in turn. Both are rounded
// to bf16 first, as the separate linear's output would be.
template <int G>
void gemm_silu_mul_blocks(const uint32_t* xp, const uint16_t* w, int64_t w_stride,
                          const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t m,
                          int64_t k, int64_t d, int64_t block_begin, int64_t block_end) {
  alignas(64) float gate[kMaxGroups][16][16], up[kMaxGroups][16][16];
  const uint16_t* w_up = w + d * w_stride;
  for (int64_t blk = block_begin; blk < block_end; ++blk) {
    const uint16_t* wg = w + blk * 16 * w_stride;
    const uint16_t* wu = w_up + blk * 16 * w_stride;
    accumulate<G>(xp, wg, wu, w_stride, k / 32);
    store_tiles<G>(gate);
    accumulate<G>(xp, wu, blk + 1 < block_end ? wg + 16 * w_stride : nullptr, w_stride, k / 32);
    store_tiles<G>(up);
    const __m512 bg = load_bias(bias == nullptr ? nullptr : bias + blk * 16);
    const __m512 bu = load_bias(bias == nullptr ? nullptr : bias + d + blk * 16);
    for (int g = 0; g < G; ++g) {
      transpose_tile(gate[g]);
      transpose_tile(up[g]);
      const int rows = m - 16 * g < 16 ? static_cast<int>(m - 16 * g) : 16;
      for (int i = 0; i < rows; ++i) {
        const __m512 gv = minivllm::round_bf16_16(_mm512_add_ps(_mm512_load_ps(gate[g][i]), bg));
        const __m512 uv = minivllm::round_bf16_16(_mm512_add_ps(_mm512_load_ps(up[g][i]), bu));
        store_row(y + (16 * g + i) * y_stride + blk * 16, minivllm::silu_mul16(gv, uv));
      }
    }
  }
}

// Splits `blocks` 16-row output blocks over the threads; each walks the rows of x in chunks of
// up to 64 (one C tile per 16), packs the chunk's x^T itself (groups * k * 32 bytes, kept across
// calls: sharing one copy written by one core made the other core fetch it line by line, every
// call) and runs body(G, xp, begin, end, m0, rows), G = the chunk's 16-row groups as a
// std::integral_constant. Past the first chunk a thread's weight rows come from its L2.
// 0, or 3 when out of memory.
template <typename Body>
int run_blocks(const uint16_t* x, int64_t x_stride, int64_t m, int64_t k, int64_t blocks,
               int32_t num_threads, Body body) {
  const int64_t chunk = 16 * kMaxGroups;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t begin = blocks * t / threads, end = blocks * (t + 1) / threads;
    static thread_local uint32_t* xp = nullptr;
    static thread_local int64_t xp_words = 0;
    const int64_t need = static_cast<int64_t>((std::min(m, chunk) + 15) / 16) * k * 8;
    if (begin < end && need > xp_words) {
      std::free(xp);
      xp = static_cast<uint32_t*>(std::aligned_alloc(64, need * 4));
      xp_words = xp == nullptr ? 0 : need;
    }
    if (begin < end && xp == nullptr) {
#pragma omp atomic write
      failed = 1;
    } else if (begin < end) {
      load_tile_config();
      for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t rows = std::min(chunk, m - m0);
        const int groups = static_cast<int>((rows + 15) / 16);
        pack_x(x + m0 * x_stride, x_stride, rows, k, groups, xp);
        switch (groups) {  // the C tiles in use, as a compile-time constant
          case 1: body(std::integral_constant<int, 1>{}, xp, begin, end, m0, rows); break;
          case 2: body(std::integral_constant<int, 2>{}, xp, begin, end, m0, rows); break;
          case 3: body(std::integral_constant<int, 3>{}, xp, begin, end, m0, rows); break;
          default: body(std::integral_constant<int, 4>{}, xp, begin, end, m0, rows); break;
        }
      }
      _tile_release();
    }
  }
  return failed ? 3 : 0;
}

}  // namespace

extern "C" {

int minivllm_has_gemm_amx() { return amx_permitted() ? 1 : 0; }

// x [m, k] (rows x_stride apart), w [n, k] (rows w_stride apart), bias [n] or null,
// y [m, n] (rows y_stride apart); all bf16. Needs m >= 1, n % 16 == 0, k % 32 == 0.
int minivllm_gemm_amx_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                           int64_t w_stride, const uint16_t* bias, uint16_t* y, int64_t y_stride,
                           int64_t m, int64_t n, int64_t k, int32_t num_threads) {
  if (m < 1 || n % 16 != 0 || k % 32 != 0) return 1;
  if (!amx_permitted()) return 2;
  return run_blocks(x, x_stride, m, k, n / 16, num_threads,
                    [&](auto g, const uint32_t* xp, int64_t begin, int64_t end, int64_t m0,
                        int64_t rows) {
    gemm_blocks<decltype(g)::value>(xp, w, w_stride, bias, y + m0 * y_stride, y_stride, rows, k,
                                    begin, end);
  });
}

// y [m, d] = silu(x W[:d]^T + b[:d]) * (x W[d:]^T + b[d:]) for w [2d, k], bias [2d] or null;
// as above with d % 16 == 0.
int minivllm_gemm_amx_silu_mul_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w,
                                    int64_t w_stride, const uint16_t* bias, uint16_t* y,
                                    int64_t y_stride, int64_t m, int64_t d, int64_t k,
                                    int32_t num_threads) {
  if (m < 1 || d % 16 != 0 || k % 32 != 0) return 1;
  if (!amx_permitted()) return 2;
  return run_blocks(x, x_stride, m, k, d / 16, num_threads,
                    [&](auto g, const uint32_t* xp, int64_t begin, int64_t end, int64_t m0,
                        int64_t rows) {
    gemm_silu_mul_blocks<decltype(g)::value>(xp, w, w_stride, bias, y + m0 * y_stride, y_stride,
                                             rows, k, d, begin, end);
  });
}

}  // extern "C"

#else

extern "C" {
int minivllm_has_gemm_amx() { return 0; }  // no AMX: oneDNN keeps every batched linear
int minivllm_gemm_amx_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*,
                           uint16_t*, int64_t, int64_t, int64_t, int64_t, int32_t) {
  return 2;
}
int minivllm_gemm_amx_silu_mul_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t,
                                    const uint16_t*, uint16_t*, int64_t, int64_t, int64_t,
                                    int64_t, int32_t) {
  return 2;
}
}  // extern "C"

#endif
