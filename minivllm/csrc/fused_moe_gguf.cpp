// GGUF-packed MoE experts on CPU in one native call (a .gguf MoE file's ffn_{gate,up,down}_exps,
// packed as in the file): minivllm_fused_experts_gguf, the same sum as fused_moe.cpp's bf16
// experts (pairs sorted by expert, gate_up, SiluAndMul rounded to bf16, down, the fp32 top-k
// sum: moe_common.h), each expert GEMM through the int8 dot kernels of gguf_dot.h or, for more
// than kGgufDotMaxRows rows on AMX CPUs, gguf_amx.cpp's bf16 strips, as a plain GGUF linear of
// that many rows would run. It builds on every CPU (gguf_dot.h picks VNNI, AVX2 or scalar).
// Q4_0/Q4_1/Q8_0 experts in the x8 layout (gguf_x8.h; AVX2 and VNNI builds) run x8 kernels
// for every decode row count: x is quantized once in the natural layout and each group of kX8Rows
// rows yields kX8Rows sums per load.
//
// Prompt-sized groups: each thread takes whole experts (gguf_gemm.cpp per expert GEMM).
// Decode-sized groups (a few rows per expert, up to every expert active): x is quantized to int8
// once per layer, h once after SiluAndMul, and the threads split pieces of kPieceRows weight
// rows taken expert after expert (WorkSplit), so that each thread streams long runs of
// consecutive weight rows, which the dot kernel's prefetch and the hardware follow. (Slices of
// 16 rows of every expert, as the bf16 experts take them, quantized x again for each slice and
// expert and jumped to another expert every 20 KB: 1.3-1.5x slower for 8-64 tokens.)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_dot.h"
#include "kernels.h"
#include "moe_common.h"
#include "work_split.h"

namespace {

// Rows of x up to which the int8 dot kernel beats the AMX strips (GGUF_DOT_MAX_ROWS of
// kernels/gguf_linear.py for a plain linear).
constexpr int64_t kGgufDotMaxRows = 4;

// One expert matrix set as the kernels read it: GGUF block rows of `qtype`, experts
// `expert_bytes` and rows `row_bytes` apart.
struct ExpertBlocks {
  const uint8_t* base;
  int32_t qtype;
  int64_t expert_bytes, row_bytes;

  const uint8_t* at(int64_t e, int64_t row = 0) const {
    return base + e * expert_bytes + row * row_bytes;
  }
};

// The sizes and buffers of one layer's call.
struct Layer {
  ExpertBlocks w13, w2;
  int64_t h, inter;
  bool amx;
  uint16_t *xs, *gu, *hs, *ys;  // bf16 [N, H], [N, 2I], [N, I], [N, H]
};

// Whether m rows of x take bf16 x for matrix w (the AMX strips, gguf_gemm.cpp's x^T tiles)
// rather than the dot kernel on x quantized once (decode pieces). x8 weights have one kernel
// for every decode row count, which reads x quantized once (on AMX too: the strips would
// dequantise every active expert for a few rows each; whole experts of a prompt still take them).
inline bool from_bf16_rows(const Layer& L, const ExpertBlocks& w, int64_t m) {
  if (w.qtype & kX8Layout) return false;
  return m >= kTileMinRows || (L.amx && m > kGgufDotMaxRows);
}

// y [m, n] = x [m, k] W^T on one thread for the n weight rows from `rows` (of w's type): the
// strips for more than kGgufDotMaxRows rows on AMX, else gguf_gemm.cpp (x quantized in the
// call). 0 or its error.
int expert_gemm(const Layer& L, const ExpertBlocks& w, const uint8_t* rows, const uint16_t* x,
                int64_t x_stride, uint16_t* y, int64_t y_stride, int64_t m, int64_t n,
                int64_t k) {
  if (L.amx && m > kGgufDotMaxRows &&
      minivllm_gguf_gemm_amx_bf16(w.qtype, x, x_stride, rows, w.row_bytes, nullptr, y, y_stride,
                                  m, n, k, 1) == 0)
    return 0;
  return minivllm_gguf_gemm(w.qtype, x, x_stride, 1, rows, w.row_bytes, nullptr, y, y_stride, m,
                            n, k, 1);
}

// Expert e on all of its rows in this thread (prompts): gu, hs = SiluAndMul, ys.
int whole_expert(const Layer& L, const Groups& g, int64_t e) {
  const int64_t begin = g.offsets[e], rows = g.rows(e), h = L.h, inter = L.inter;
  const int rc = expert_gemm(L, L.w13, L.w13.at(e), L.xs + begin * h, h,
                             L.gu + begin * 2 * inter, 2 * inter, rows, 2 * inter, h);
  if (rc != 0) return rc;
  silu_mul_rows(L.gu + begin * 2 * inter, rows, inter, 0, inter, L.hs + begin * inter);
  return expert_gemm(L, L.w2, L.w2.at(e), L.hs + begin * inter, inter, L.ys + begin * h, h, rows,
                     h, inter);
}

// Rows [r0, r1) of expert e's matrix w for its rows of x into y [rows, n] (from the expert's
// first slot), as a linear of that many rows computes them: the dot kernel on act (x quantized
// once), or for more rows (the AMX strips, gguf_gemm.cpp's x^T tiles) from bf16 x.
int expert_piece(const Layer& L, const ExpertBlocks& w, const Groups& g, int64_t e,
                 const uint16_t* x, const Activation& act, RowShape rs, int64_t k, int64_t r0,
                 int64_t r1, uint16_t* y, int64_t y_stride) {
  const int64_t begin = g.offsets[e], rows = g.rows(e);
  if (from_bf16_rows(L, w, rows))
    return expert_gemm(L, w, w.at(e, r0), x + begin * k, k, y + begin * y_stride + r0, y_stride,
                       rows, r1 - r0, k);
  gguf_dot_rows(w.qtype, w.at(e), w.row_bytes, act, rs, k, begin, rows, r0, r1, nullptr,
                y + begin * y_stride, y_stride, kBF16);
  return 0;
}

// This thread's pieces of one projection (n rows per expert) over the active experts.
int projection(const Layer& L, const ExpertBlocks& w, const Groups& g,
               const std::vector<int64_t>& active, minivllm::WorkSplit* split, int t,
               const uint16_t* x, const Activation& act, RowShape rs, int64_t k, int64_t n,
               uint16_t* y, int64_t y_stride) {
  return for_each_piece(split, t, n, [&](int64_t ai, int64_t r0, int64_t r1) {
    return expert_piece(L, w, g, active[ai], x, act, rs, k, r0, r1, y, y_stride);
  });
}

Activation g_act_x, g_act_h;  // x and h quantized for the decode path (under g_scratch.lock)

// Decode-sized groups, inside the layer's parallel region (see the file comment): quantize x,
// gate_up pieces, SiluAndMul + quantize h, down pieces. 0 or a kernel's error.
int decode_experts(const Layer& L, const Groups& g, const std::vector<int64_t>& active,
                   const uint16_t* x, int64_t x_stride, int32_t k, RowShape rs_x, RowShape rs_h,
                   minivllm::WorkSplit* gate_up, minivllm::WorkSplit* down) {
  const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t n = g.offsets.back(), s0 = n * t / threads, s1 = n * (t + 1) / threads;
  for (int64_t s = s0; s < s1; ++s)
    quantize_row(x, (g.pair_of_slot[s] / k) * x_stride, kBF16, L.h, rs_x, s, &g_act_x);
#pragma omp barrier
  int rc = projection(L, L.w13, g, active, gate_up, t, L.xs, g_act_x, rs_x, L.h, 2 * L.inter,
                      L.gu, 2 * L.inter);
#pragma omp barrier
  silu_mul_rows(L.gu + s0 * 2 * L.inter, s1 - s0, L.inter, 0, L.inter, L.hs + s0 * L.inter);
  for (int64_t s = s0; s < s1; ++s)
    quantize_row(L.hs, s * L.inter, kBF16, L.inter, rs_h, s, &g_act_h);
#pragma omp barrier
  if (rc == 0)
    rc = projection(L, L.w2, g, active, down, t, L.hs, g_act_h, rs_h, L.inter, L.h, L.ys, L.h);
#pragma omp barrier
  return rc;
}

int run_experts(Layer L, const uint16_t* x, int64_t x_stride, const int64_t* ids,
                const float* weights, const int64_t* expert_map, int64_t num_global,
                int64_t num_local, int64_t t_count, int32_t k, uint16_t* out, int64_t out_stride,
                int32_t num_threads) {
  const Groups g = sort_pairs(ids, t_count * k, expert_map, num_global, num_local);
  const int64_t n = g.offsets[num_local], h = L.h, inter = L.inter;
  std::lock_guard<std::mutex> guard(g_scratch.lock);
  L.xs = g_scratch.get(std::max<int64_t>(n, 1) * (2 * h + 3 * inter));
  if (L.xs == nullptr) return 3;
  L.gu = L.xs + n * h;
  L.hs = L.gu + n * 2 * inter;
  L.ys = L.hs + n * inter;
  const std::vector<int64_t> active = active_experts(g, num_local);
  const int64_t count = static_cast<int64_t>(active.size());
  const bool by_expert = whole_experts(count, n, num_threads);
  const bool vnni = minivllm_gguf_has_vnni() != 0;
  // (x8 weights read x as the x8 kernels' records: gguf_x8.h)
  const int q13 = L.w13.qtype & ~kX8Layout, q2 = L.w2.qtype & ~kX8Layout;
  const RowShape rs_x = L.w13.qtype & kX8Layout ? x8_row_shape(q13, h) : row_shape(q13, h, vnni);
  const RowShape rs_h =
      L.w2.qtype & kX8Layout ? x8_row_shape(q2, inter) : row_shape(q2, inter, vnni);
  if (!by_expert && !(reserve_rows(n, rs_x, &g_act_x) && reserve_rows(n, rs_h, &g_act_h)))
    return 3;
  // bf16 rows of x: whole experts' GEMMs, and decode pieces of experts with many rows
  int64_t most = 0;
  for (const int64_t e : active) most = std::max(most, g.rows(e));
  const bool gather =
      by_expert || from_bf16_rows(L, L.w13, most) || from_bf16_rows(L, L.w2, most);
  minivllm::WorkSplit gate_up(count * pieces_of(2 * inter), num_threads);
  minivllm::WorkSplit down(count * pieces_of(h), num_threads);
  int failed = 0;
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    int rc = 0;
    if (gather) {
      for (int64_t s = n * t / threads; s < n * (t + 1) / threads; ++s)
        std::memcpy(L.xs + s * h, x + (g.pair_of_slot[s] / k) * x_stride, h * 2);
#pragma omp barrier
    }
    if (by_expert) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < count; ++i) {
        const int r = whole_expert(L, g, active[i]);
        if (r != 0) rc = r;
      }
    } else {
      rc = decode_experts(L, g, active, x, x_stride, k, rs_x, rs_h, &gate_up, &down);
    }
    finish_layer(L.ys, h, g, weights, t_count, k, out, out_stride, rc, &failed);
  }
  return failed;
}

}  // namespace

extern "C" {

// minivllm_fused_experts_bf16's sum (fused_moe.cpp) for GGUF-packed experts: w13 [E_local, 2I,
// row bytes of H] of GGML type w13_type and w2 [E_local, H, row bytes of I] of w2_type, uint8
// block rows w13_row_bytes / w2_row_bytes apart, experts contiguous. Needs H and I multiples of
// both types' block sizes and of 32: 1 bad sizes or type, 3 out of memory.
int minivllm_fused_experts_gguf(const uint16_t* x, int64_t x_stride, const uint8_t* w13,
                                int32_t w13_type, int64_t w13_row_bytes, const uint8_t* w2,
                                int32_t w2_type, int64_t w2_row_bytes, const int64_t* ids,
                                const float* weights, const int64_t* expert_map,
                                int64_t num_global, int64_t num_local, int64_t t_count, int32_t k,
                                int64_t h, int64_t inter, uint16_t* out, int64_t out_stride,
                                int32_t num_threads) {
  if (h % 32 != 0 || inter % 32 != 0 || k < 1 || t_count < 0 || w13_type < 0 || w2_type < 0)
    return 1;
  // the x8 layout (gguf_x8.h) only where its kernels are built, for its types, in whole groups
  // of kX8Rows rows per expert
  if ((w13_type | w2_type) & kX8Layout) {
    if (!MINIVLLM_GGUF_X8) return 1;
    if ((w13_type & kX8Layout) && (!x8_type(w13_type & ~kX8Layout) || 2 * inter % kX8Rows != 0))
      return 1;
    if ((w2_type & kX8Layout) && (!x8_type(w2_type & ~kX8Layout) || h % kX8Rows != 0)) return 1;
  }
  const Geometry g13 = geometry(w13_type & ~kX8Layout), g2 = geometry(w2_type & ~kX8Layout);
  if (g13.elems == 0 || g2.elems == 0 || h % g13.elems != 0 || inter % g2.elems != 0) return 1;
  const Layer layer{{w13, w13_type, 2 * inter * w13_row_bytes, w13_row_bytes},
                    {w2, w2_type, h * w2_row_bytes, w2_row_bytes},
                    h, inter, minivllm_has_gemm_amx() != 0,
                    nullptr, nullptr, nullptr, nullptr};
  return run_experts(layer, x, x_stride, ids, weights, expert_map, num_global, num_local, t_count,
                     k, out, out_stride, num_threads);
}

}  // extern "C"
