// Linears and dequantisation straight from GGUF-packed weights (uint8 block rows as in the file).
//
// Decode steps (few rows of x) are bound by streaming the packed weight once, so they never
// widen it: x is quantized to int8 per 32 elements (scale amax / 127, as llama.cpp's Q8_0;
// gguf_activation.h) and meets the packed blocks in the dot kernels of gguf_dot.h (16+ rows
// without AMX: the x^T tiles of gguf_tiles.h). More rows of x on AMX CPUs (batched decode steps,
// prompt chunks) take gguf_amx.cpp: bf16 strips of the weight into AMX tiles.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include "kernels.h"
#include <cstring>
#include <vector>

#include <omp.h>

#include "cpu_math.h"
#include "gguf_activation.h"  // MINIVLLM_GGUF_VNNI, element access, x's int8 quantization
#include "gguf_blocks.h"
#include "gguf_dot.h"
#include "gguf_tiles.h"
#include "gguf_x8.h"
#include "work_split.h"

namespace {

using namespace minivllm::gguf;
using minivllm::WorkSplit;

// Output rows per unit of work a thread takes (the dot kernel's 4-row groups).
constexpr int64_t kGroupRows = 4;

#if MINIVLLM_GGUF_VNNI
template <int Q>
bool gemm_rows_simd(const uint8_t* w, int64_t w_stride, const Activation& act, RowShape rs,
                    int64_t m, int64_t n, const void* bias, void* y, int64_t y_stride, int dt,
                    WorkSplit* split, int t, TiledActivation* tiled) {
  const bool tiles = m >= kTileMinRows;
  if (tiles && !tile_activation<Q>(act, rs, m, tiled)) return false;
  int64_t g0, g1;
  while (split->next(t, &g0, &g1)) {
    const int64_t n0 = g0 * kGroupRows, n1 = std::min(n, g1 * kGroupRows);
    if (tiles) gemm_rows_tiled<Q>(w, w_stride, *tiled, rs, m, n0, n1, bias, y, y_stride, dt);
    else gemm_rows_vnni<Q>(w, w_stride, act, rs, 0, m, n0, n1, bias, y, y_stride, dt);
  }
  return true;
}
#endif

// Thread t's share of the n output rows (row groups from `split`) into y. false: out of memory.
bool gemm_rows(int qtype, const uint8_t* w, int64_t w_stride, const Activation& act,
               RowShape rs, int64_t k, int64_t m, int64_t n, const void* bias, void* y,
               int64_t y_stride, int dt, WorkSplit* split, int t, TiledActivation* tiled) {
#if MINIVLLM_GGUF_VNNI
  switch (qtype) {
#define MINIVLLM_GGUF_CASE(Q)                                                                   \
  case Q:                                                                                       \
    return gemm_rows_simd<Q>(w, w_stride, act, rs, m, n, bias, y, y_stride, dt, split, t, tiled);
    MINIVLLM_GGUF_BLOCK_TYPES(MINIVLLM_GGUF_CASE)
#undef MINIVLLM_GGUF_CASE
  }
#endif
  (void)tiled;
  int64_t g0, g1;
  while (split->next(t, &g0, &g1))
    gguf_dot_rows(qtype, w, w_stride, act, rs, k, 0, m, g0 * kGroupRows,
                  std::min(n, g1 * kGroupRows), bias, y, y_stride, dt);
  return true;
}

// minivllm_gguf_gemm for a weight in the x8 layout (gguf_x8.h): threads take whole groups.
int gemm_x8(int qtype, const void* x, int64_t x_stride, int dt, const uint8_t* w,
            int64_t row_bytes, const void* bias, void* y, int64_t y_stride, int64_t m, int64_t n,
            int64_t k, int num_threads) {
#if MINIVLLM_GGUF_X8
  if (!x8_type(qtype) || k % geometry(qtype).elems != 0 || n % kX8Rows != 0 || m < 1 || dt < 0 || dt > 2) return 1;
  const RowShape rs = x8_row_shape(qtype, k);
  WorkSplit split(n / kX8Rows, num_threads);
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    static thread_local Activation act;
    const int t = omp_get_thread_num();
    if (!quantize_rows(x, x_stride, dt, m, k, rs, &act)) {
#pragma omp atomic write
      failed = 1;
    } else {
      int64_t g0, g1;
      while (split.next(t, &g0, &g1))
        x8_gemm(qtype, w, row_bytes, act, rs, k, 0, m, g0 * kX8Rows, g1 * kX8Rows, bias, y,
                y_stride, dt);
    }
  }
  return failed ? 3 : 0;
#else
  (void)qtype, (void)x, (void)x_stride, (void)dt, (void)w, (void)row_bytes, (void)bias, (void)y;
  (void)y_stride, (void)m, (void)n, (void)k, (void)num_threads;
  return 1;  // the layout exists only where its kernels do (AVX2 or AVX-512 VNNI)
#endif
}

}  // namespace

#include "gguf_dequant.h"

extern "C" {

// 1 when the int8 kernels use AVX-512 VNNI (else AVX2 or the scalar loop).
int minivllm_gguf_has_vnni() {
#if MINIVLLM_GGUF_VNNI
  return 1;
#else
  return 0;
#endif
}

// 1 when the int8 dot and dequantisation kernels are the AVX2 ones (no VNNI; else scalar).
int minivllm_gguf_has_avx2() {
#if MINIVLLM_GGUF_AVX2
  return 1;
#else
  return 0;
#endif
}

// Rows per group of the x8 layout (gguf_x8.h): 8 with the AVX2 kernels, 16 with AVX-512 VNNI;
// 0 where no kernel reads the layout.
int minivllm_gguf_has_x8() {
#if MINIVLLM_GGUF_X8
  return kX8Rows;
#else
  return 0;
#endif
}

// 1 when this build's x8 kernels read `qtype` in the layout: Q4_0, Q4_1, Q8_0 with the AVX2 or
// VNNI kernels, also Q5_0, Q5_1 and the K-quants Q2_K ... Q6_K with VNNI; else 0.
int minivllm_gguf_has_x8_type(int32_t qtype) { return MINIVLLM_GGUF_X8 && x8_type(qtype) ? 1 : 0; }

// y [m, n] (+ bias [n]) = x [m, k] W^T for W [n, k] stored as GGUF blocks of `qtype`, rows
// w_stride bytes apart; x, bias and y of element type dt (0 fp32, 1 bf16, 2 fp16), rows of x
// and y x_stride / y_stride elements apart. 0; 1: bad type or k; 3: out of memory.
int minivllm_gguf_gemm(int32_t qtype, const void* x, int64_t x_stride, int32_t dt,
                       const uint8_t* w, int64_t w_stride, const void* bias, void* y,
                       int64_t y_stride, int64_t m, int64_t n, int64_t k, int32_t num_threads) {
  if (qtype & kX8Layout)
    return gemm_x8(qtype & ~kX8Layout, x, x_stride, dt, w, w_stride, bias, y, y_stride, m, n, k,
                   num_threads);
  const Geometry g = geometry(qtype);
  if (g.elems == 0 || k % g.elems != 0 || m < 1 || dt < 0 || dt > 2) return 1;
  const RowShape rs = row_shape(qtype, k, minivllm_gguf_has_vnni());
  WorkSplit split((n + kGroupRows - 1) / kGroupRows, num_threads);
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    static thread_local Activation act;
    static thread_local TiledActivation tiled;
    const int t = omp_get_thread_num();
    if (!quantize_rows(x, x_stride, dt, m, k, rs, &act) ||
        !gemm_rows(qtype, w, w_stride, act, rs, k, m, n, bias, y, y_stride, dt, &split, t,
                   &tiled)) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed ? 3 : 0;
}

// out [rows, cols] (rows out_stride elements apart, type dt) = W dequantised. 0; 1: bad args.
// (x8 layout: w starts a group of kX8Rows rows; any row count.)
int minivllm_gguf_dequant(int32_t qtype, const uint8_t* w, int64_t w_stride, int64_t rows,
                          int64_t cols, void* out, int64_t out_stride, int32_t dt,
                          int32_t num_threads) {
  const int base = qtype & ~kX8Layout;
  const Geometry g = geometry(base);
  if (g.elems == 0 || cols % g.elems != 0 || dt < 0 || dt > 2) return 1;
  if (base != qtype && !x8_type(base)) return 1;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t r0 = rows * t / threads, r1 = rows * (t + 1) / threads;
    if (base == qtype) dequant_rows(qtype, w, w_stride, r0, r1, cols, out, out_stride, dt);
    else dequant_rows_at(base, w, w_stride, nullptr, r0, r1, cols, out, out_stride, dt, true);
  }
  return 0;
}

// out [n, cols] (rows out_stride elements apart, type dt) = rows ids[0..n) of W [rows, cols]
// (qtype blocks, either layout) dequantised: an embedding lookup in one call. 0; 1: bad args;
// 2: an id outside [0, rows).
int minivllm_gguf_embedding(int32_t qtype, const uint8_t* w, int64_t w_stride, int64_t rows,
                            const int64_t* ids, int64_t n, int64_t cols, void* out,
                            int64_t out_stride, int32_t dt, int32_t num_threads) {
  const int base = qtype & ~kX8Layout;
  const Geometry g = geometry(base);
  if (g.elems == 0 || cols % g.elems != 0 || dt < 0 || dt > 2) return 1;
  if (base != qtype && !x8_type(base)) return 1;
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= rows) return 2;
#pragma omp parallel num_threads(n < 64 ? 1 : num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    dequant_rows_at(base, w, w_stride, ids, n * t / threads, n * (t + 1) / threads, cols, out,
                    out_stride, dt, base != qtype);
  }
  return 0;
}

// W [rows, row_bytes] (rows a multiple of minivllm_gguf_x8_rows()) into the x8 layout in place (to_x8 = 0: back to
// the file's). 0; 1: a type without the layout or a partial group.
int minivllm_gguf_repack_x8(int32_t qtype, uint8_t* w, int64_t row_bytes, int64_t rows,
                            int32_t to_x8, int32_t num_threads) {
  if (!x8_type(qtype) || rows % kX8Rows != 0 || row_bytes % x8_block_bytes(qtype))
    return 1;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<uint8_t> copy(kX8Rows * row_bytes);
#pragma omp for
    for (int64_t gr = 0; gr < rows / kX8Rows; ++gr) {
      uint8_t* group = w + gr * kX8Rows * row_bytes;
      std::memcpy(copy.data(), group, copy.size());
      if (to_x8) {
        x8_group_from_plain(qtype, copy.data(), row_bytes, group);
      } else {
        for (int r = 0; r < kX8Rows; ++r)
          x8_row_to_plain(qtype, copy.data(), row_bytes, r, group + r * row_bytes);
      }
    }
  }
  return 0;
}

}  // extern "C"
