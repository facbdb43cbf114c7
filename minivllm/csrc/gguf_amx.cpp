// bf16 x (5+ rows: batched decode steps, prompt chunks) times GGUF-packed weights with AMX tiles.
//
// Each thread takes its share of 16-row blocks of the weight and walks them once: a block is
// dequantised into a bf16 strip [16, k] (18-48 KB: L1 / L2, never memory) by the type's fastest
// row dequantiser (gguf_dequant.h), and the strip at once meets every row of x in the tile
// products of gemm_amx.cpp's kernel, roles swapped (C[16 n, 16 m] += W[16 n, 32 k] . X^T[32 k,
// 16 m]). So the packed weight streams from memory once per call, each block is dequantised once
// per call whatever the row count (x is packed in chunks of ~1 MB of x^T, each a pass), the
// dequantisation of one block overlaps the tile products of the previous one, and the two
// threads never meet inside a call. The same bf16 weights and tile operations as the bf16 GEMM
// on the dequantised weight: the same results, bit for bit.

#include <algorithm>
#include <cstdint>
#include "kernels.h"
#include <cstdlib>

#include <omp.h>

#include "gguf_activation.h"
#include "gguf_blocks.h"
#include "gguf_dequant.h"
#include "gguf_x8_layout.h"

#if MINIVLLM_GGUF_VNNI && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
#define MINIVLLM_GGUF_AMX 1
#include "amx_utils.h"
#endif

#if MINIVLLM_GGUF_AMX
namespace {

constexpr int kGroups = 4;                 // C tiles 0-3: 64 rows of x per tile pass
constexpr int64_t kPackBytes = 1 << 20;    // x^T packed per chunk of x rows (L2, beside strips)

// A thread's scratch memory, 64-byte aligned, grown on demand and kept across calls.
struct Scratch {
  void* p = nullptr;
  size_t bytes = 0;
  ~Scratch() { std::free(p); }
  void* get(size_t need) {
    if (need > bytes) {
      std::free(p);
      need = (need + 63) / 64 * 64;
      p = std::aligned_alloc(64, need);
      bytes = p == nullptr ? 0 : need;
    }
    return p;
  }
};

// C tile 2a + g (y^T of strip a's 16 weight rows x 16 rows of x of group g0 + g) = strip_a
// [16, k] . x^T, for A strips and G groups (each <= 2: every loaded tile feeds two products,
// so no product waits on the previous one's operands). xp: the pass's B tiles, [k / 32][groups]
// [256] words. work(s) runs after step s's products: dequantisation that overlaps them.
template <int A, int G, typename Work>
void panel_tiles(const uint16_t* const* strips, int64_t k, const uint32_t* xp, int64_t groups,
                 int64_t g0, Work&& work, float (*c)[16][16]) {
  _tile_zero(0);
  if constexpr (G > 1) _tile_zero(1);
  if constexpr (A > 1) _tile_zero(2);
  if constexpr (A > 1 && G > 1) _tile_zero(3);
  for (int64_t s = 0; s < k / 32; ++s) {
    const uint32_t* b = xp + (s * groups + g0) * 256;
    _tile_loadd(4, strips[0] + 32 * s, 2 * k);
    _tile_loadd(6, b, 64);
    if constexpr (A > 1) _tile_loadd(5, strips[1] + 32 * s, 2 * k);
    if constexpr (G > 1) _tile_loadd(7, b + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (G > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (A > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (A > 1 && G > 1) _tile_dpbf16ps(3, 5, 7);
    work(s);
  }
  _tile_stored(0, c[0], 64);
  if constexpr (G > 1) _tile_stored(1, c[1], 64);
  if constexpr (A > 1) _tile_stored(2, c[2], 64);
  if constexpr (A > 1 && G > 1) _tile_stored(3, c[3], 64);
}

// y[i, n0:n0+16] for the `rows` rows of x of C tile c (y^T), + bias, as bf16.
void store_tile(float (*c)[16], int64_t rows, int64_t n0, const uint16_t* bias, uint16_t* y,
                int64_t y_stride) {
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr)
    b = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0))), 16));
  __m512i r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c[i]);
  minivllm::transpose16x16(r);  // row i: y[i, n0:n0+16]
  for (int64_t i = 0; i < std::min<int64_t>(16, rows); ++i)
    _mm256_storeu_si256((__m256i*)(y + i * y_stride + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_castsi512_ps(r[i]), b)));
}

// x rows [0, rows) as B tiles: pass p (64 rows) at xp + p * steps * kGroups * 256, laid out
// [steps][groups of the pass][256].
void pack_x(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k, uint32_t* xp) {
  const int64_t steps = k / 32;
  for (int64_t p = 0; p * 64 < rows; ++p) {
    const int64_t left = rows - 64 * p, groups = std::min<int64_t>(kGroups, (left + 15) / 16);
    uint32_t* dst = xp + p * steps * kGroups * 256;
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t s = 0; s < steps; ++s)
        minivllm::pack_b_tile(x + (64 * p + 16 * g) * x_stride + 32 * s, x_stride,
                              left - 16 * g, dst + (s * groups + g) * 256);
  }
}

// Dequantises rows [next, target) of a panel (32 rows of w into `panel`, rows k apart),
// prefetching each row's successor one panel on (`ahead`: false at the thread's last panel).
// An x8 weight (gguf_x8_layout.h: 16-row groups, the panels' own grain) of Q4_0 / Q4_1 / Q8_0 is
// dequantised a whole group at a time from the interleaved bytes; other types have each group
// un-interleaved into `plain` (16 plain rows) when its first row is due and dequantised as plain
// rows. Either way the values are the file layout's, bit for bit.
template <int Q>
struct PanelFill {
  const Unit<Q>& unit;
  RowShape rs;
  const uint8_t* w;  // the panel's first row (null: nothing to fill)
  int64_t w_stride, k, rows, next = 0;
  uint16_t* panel;
  bool ahead;
  uint8_t* plain = nullptr;  // x8 weights: [kX8Rows, row bytes] scratch; null: the file layout
  void upto(int64_t target) {
    const int64_t row_bytes = k / geometry(Q).elems * geometry(Q).bytes;
    if constexpr (Q == kQ4_0 || Q == kQ4_1 || Q == kQ8_0) {
      if (plain != nullptr) {  // x8: whole 16-row groups, dequantised in place
        for (; next < std::min(target, rows); next += kX8Rows) {
          // (each block's successor one panel on is prefetched as the block is read)
          const uint8_t* group = w + next * w_stride;
          dequant_group_x8(Q, group, k, panel + next * k, k,
                           ahead ? group + 32 * w_stride : nullptr);
        }
        return;
      }
    }
    for (; next < std::min(target, rows); ++next) {
      const uint8_t* row = w + next * w_stride;
      if (ahead)
        for (int64_t off = 0; off < row_bytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(row + 32 * w_stride + off), _MM_HINT_T0);
      if (plain != nullptr) {
        if (next % kX8Rows == 0) x8_group_to_plain(Q, row, row_bytes, plain);
        row = plain + (next % kX8Rows) * row_bytes;
      }
      dequant_row_bf16<Q>(unit, row, rs, k, panel + next * k);
    }
  }
};

// All passes of a packed chunk of x (`rows` rows) over one panel of `strips` (1, 2) strips of
// weight rows n0.., filling the next panel (`fill`) a little after every tile step of the
// chunk's first 4 pairs of groups (so the dequantisation runs beside tile products).
template <int Q>
void panel_passes(const uint16_t* panel, int strips, int64_t k, const uint32_t* xp,
                  int64_t rows, int64_t n0, const uint16_t* bias, uint16_t* y, int64_t y_stride,
                  PanelFill<Q>& fill) {
  alignas(64) float c[4][16][16];
  const int64_t steps = k / 32;
  const uint16_t* sp[2] = {panel, panel + 16 * k};
  const int64_t pairs = std::min<int64_t>(4, (rows + 31) / 32);  // pairs the fill is spread over
  int64_t done = 0;                                               // tile steps so far
  for (int64_t p = 0; p * 64 < rows; ++p) {
    const int64_t left = std::min<int64_t>(64, rows - 64 * p);
    const int64_t groups = (left + 15) / 16;
    const uint32_t* xpp = xp + p * steps * kGroups * 256;
    for (int64_t g0 = 0; g0 < groups; g0 += 2) {
      auto work = [&](int64_t s) {
        if (done + s < pairs * steps) fill.upto((done + s + 1) * fill.rows / (pairs * steps) + 1);
      };
      const bool two = g0 + 1 < groups;
      if (strips == 2 && two) panel_tiles<2, 2>(sp, k, xpp, groups, g0, work, c);
      else if (strips == 2) panel_tiles<2, 1>(sp, k, xpp, groups, g0, work, c);
      else if (two) panel_tiles<1, 2>(sp, k, xpp, groups, g0, work, c);
      else panel_tiles<1, 1>(sp, k, xpp, groups, g0, work, c);
      done += steps;
      for (int a = 0; a < strips; ++a)
        for (int g = 0; g < (two ? 2 : 1); ++g)
          store_tile(c[2 * a + g], left - 16 * (g0 + g), n0 + 16 * a, bias,
                     y + (64 * p + 16 * (g0 + g)) * y_stride, y_stride);
    }
  }
  fill.upto(fill.rows);
}

// One thread's blocks [begin, end) of 16 weight rows, all m rows of x, two blocks (a panel) at
// a time. false: out of memory.
template <int Q>
bool gemm_blocks(const uint16_t* x, int64_t x_stride, const uint8_t* w, int64_t w_stride,
                 const uint16_t* bias, uint16_t* y, int64_t y_stride, int64_t m, int64_t k,
                 int64_t begin, int64_t end, bool x8) {
  static thread_local Scratch xp_mem, panel_mem, plain_mem;
  uint8_t* plain = nullptr;
  if (x8 && (plain = static_cast<uint8_t*>(plain_mem.get(kX8Rows * w_stride))) == nullptr)
    return false;
  const int64_t chunk = std::max<int64_t>(64, kPackBytes / (2 * k) / 64 * 64);
  const int64_t passes = (std::min(m, chunk) + 63) / 64;
  auto* xp = static_cast<uint32_t*>(xp_mem.get(passes * (k / 32) * kGroups * 256 * 4));
  auto* panels = static_cast<uint16_t*>(panel_mem.get(2 * 32 * k * 2));  // two, alternating
  if (xp == nullptr || panels == nullptr) return false;
  const RowShape rs = row_shape(Q, k, true);
  const Unit<Q> unit;
  minivllm::load_tile_config();
  const auto fill_for = [&](int64_t blk, uint16_t* panel) {  // the panel starting at blk
    const int64_t rows = blk < end ? 16 * std::min<int64_t>(2, end - blk) : 0;
    return PanelFill<Q>{unit, rs, w + blk * 16 * w_stride, w_stride, k, rows, 0, panel,
                        blk + 2 < end, plain};
  };
  for (int64_t m0 = 0; m0 < m; m0 += chunk) {
    const int64_t rows = std::min(chunk, m - m0);
    pack_x(x + m0 * x_stride, x_stride, rows, k, xp);
    PanelFill<Q> first = fill_for(begin, panels);
    first.upto(first.rows);
    for (int64_t blk = begin, i = 0; blk < end; blk += 2, ++i) {
      uint16_t* cur = panels + (i % 2) * 32 * k;
      PanelFill<Q> next = fill_for(blk + 2, panels + ((i + 1) % 2) * 32 * k);
      panel_passes<Q>(cur, static_cast<int>(std::min<int64_t>(2, end - blk)), k, xp, rows,
                      16 * blk, bias, y + m0 * y_stride, y_stride, next);
    }
  }
  _tile_release();
  return true;
}

}  // namespace
#endif  // MINIVLLM_GGUF_AMX

extern "C" {

// y [m, n] (+ bias [n]) = x [m, k] W^T for bf16 x, bias, y and W [n, k] stored as GGUF blocks of
// `qtype` (rows w_stride bytes apart; rows of x / y x_stride / y_stride elements apart), with
// the weight dequantised 16 rows at a time. Needs n % 16 == 0; a weight in the x8 layout
// (`qtype | kX8Layout`, 16-row groups) also rows exactly row-bytes apart. 0; 1: bad arguments;
// 2: no AMX here; 3: out of memory.
int minivllm_gguf_gemm_amx_bf16(int32_t qtype, const uint16_t* x, int64_t x_stride,
                                const uint8_t* w, int64_t w_stride, const uint16_t* bias,
                                uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k,
                                int32_t num_threads) {
  const bool x8 = (qtype & kX8Layout) != 0;
  qtype &= ~kX8Layout;
  const Geometry g = geometry(qtype);
  if (g.elems == 0 || k % g.elems != 0 || k % 32 != 0 || n % 16 != 0 || m < 1) return 1;
  if (x8 && (kX8Rows != 16 || !x8_type(qtype) || w_stride != k / g.elems * g.bytes)) return 1;
#if MINIVLLM_GGUF_AMX
  if (!minivllm::amx_permitted()) return 2;
  const int64_t blocks = n / 16;
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t begin = blocks * t / threads, end = blocks * (t + 1) / threads;
    bool ok = true;
    if (begin < end) {
      switch (qtype) {
#define MINIVLLM_GGUF_CASE(Q)                                                               \
  case Q:                                                                                   \
    ok = gemm_blocks<Q>(x, x_stride, w, w_stride, bias, y, y_stride, m, k, begin, end, x8); \
    break;
        MINIVLLM_GGUF_BLOCK_TYPES(MINIVLLM_GGUF_CASE)
#undef MINIVLLM_GGUF_CASE
      }
    }
    if (!ok) {
#pragma omp atomic write
      failed = 1;
    }
  }
  return failed ? 3 : 0;
#else
  (void)x, (void)x_stride, (void)w, (void)w_stride, (void)bias, (void)y, (void)y_stride;
  (void)num_threads;
  return 2;
#endif
}

}  // extern "C"
