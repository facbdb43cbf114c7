// MoE experts on CPU in one native call (routing: moe_topk.cpp).
//
// minivllm_fused_experts_bf16: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]) for bf16 x [T, H]
// and the stacked weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], read in
// place (no copy, no gather of weight tensors). The (token, expert) pairs are counting-sorted by
// expert (stable: tokens ascending), their rows gathered into one contiguous group per expert,
// and each active expert runs the AMX GEMMs of gemm_amx.cpp on its group: gate_up (SiluAndMul
// after it), then down, all in one parallel region. Decode-sized groups: every thread computes
// a slice of every active expert's rows (one token streams exactly its k experts' weights, all
// threads busy); prompt-sized groups: each thread takes whole experts. Each active expert's
// weight is streamed once for all of its rows. The k outputs of a token are summed in fp32 with
// their routing weights and rounded to bf16 once.
//
// minivllm_fused_experts_gguf: the same with the experts kept in their GGUF blocks (a .gguf
// MoE file's ffn_{gate,up,down}_exps, packed), each expert GEMM through gguf_gemm.cpp's int8
// dot kernel or gguf_amx.cpp's strips, as a plain GGUF linear of that many rows would run.
//
// Roundings: h = SiluAndMul and the down output are rounded to bf16 as the unfused bf16 ops do
// (the same kernels); the weighted top-k sum is fp32 (eager rounds each product and each add).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "cpu_math.h"
#include "kernels.h"
#include "work_split.h"

#if MINIVLLM_BF16_SIMD
#define MINIVLLM_MOE_NATIVE 1  // the expert kernels: bf16 dot products (cpu_math.h), AMX when here
#include <immintrin.h>
#include <omp.h>
#endif
#if MINIVLLM_MOE_NATIVE && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MINIVLLM_MOE_AMX 1
#endif

extern "C" int minivllm_has_gemm_amx();  // gemm_amx.cpp: AMX usable here

namespace {

// Scratch rows reused across calls (grown, never shrunk): the gathered inputs [N, H], the
// activations [N, I] and the expert outputs [N, H] of the N pairs, bf16. Kept here, not passed
// in, so that a recorded call (compilation/cpu_graph.py) never points at a freed buffer.
struct Scratch {
  std::mutex lock;
  uint16_t* data = nullptr;
  int64_t elems = 0;

  uint16_t* get(int64_t need) {
    if (need > elems) {
      std::free(data);
      data = static_cast<uint16_t*>(std::aligned_alloc(64, ((need * 2 + 63) / 64) * 64));
      elems = data == nullptr ? 0 : need;
    }
    return data;
  }
};
Scratch g_scratch;

// The pairs sorted by local expert: offsets [E_local + 1], pair_of_slot [N] (t * k + j) and
// slot_of_pair [T * k] (-1: another rank's expert).
struct Groups {
  std::vector<int64_t> offsets, pair_of_slot, slot_of_pair;
};

[[maybe_unused]] Groups sort_pairs(const int64_t* ids, int64_t pairs, const int64_t* expert_map,
                  int64_t num_global, int64_t num_local) {
  Groups g;
  g.offsets.assign(num_local + 1, 0);
  g.slot_of_pair.assign(pairs, -1);
  std::vector<int64_t> local(pairs);
  for (int64_t p = 0; p < pairs; ++p) {
    int64_t id = ids[p];
    if (expert_map != nullptr) id = (id >= 0 && id < num_global) ? expert_map[id] : -1;
    local[p] = (id >= 0 && id < num_local) ? id : -1;
    if (local[p] >= 0) ++g.offsets[local[p] + 1];
  }
  for (int64_t e = 0; e < num_local; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> next(g.offsets.begin(), g.offsets.end() - 1);
  g.pair_of_slot.resize(g.offsets[num_local]);
  for (int64_t p = 0; p < pairs; ++p) {
    if (local[p] < 0) continue;
    const int64_t slot = next[local[p]]++;
    g.pair_of_slot[slot] = p;
    g.slot_of_pair[p] = slot;
  }
  return g;
}

#ifdef MINIVLLM_MOE_NATIVE
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32 lanes
  return minivllm::widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), minivllm::cvt_bf16x16(v));
}

constexpr int64_t kRowsPerExpert = 32;  // average rows per active expert for whole experts

// y [m, n] (rows y_stride apart, bf16) = x [m, k] W^T for bf16 x, W [n, k] (rows x_stride /
// w_stride apart), k % 32 == 0, with bf16 pair dot products (vdpbf16ps or its emulation in
// cpu_math.h; fp32 sums, one bf16 rounding): the expert GEMM on CPUs without AMX (AMD Zen 4,
// Ice Lake). Four weight rows at a
// time (16 KB at k = 2048: they stay in L1 while every row of x meets them), so the weight
// streams from memory once whatever m is.
void gemm_dot(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
              uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
  constexpr int kRows = 4;
  for (int64_t n0 = 0; n0 < n; n0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, n - n0));
    for (int64_t i = 0; i < m; ++i) {
      __m512 acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < k; c += 32) {
        const __m512i xv = _mm512_loadu_si512(x + i * x_stride + c);
        for (int r = 0; r < rows; ++r)
          acc[r] = minivllm::dot_bf16x32(
              acc[r], _mm512_loadu_si512(w + (n0 + r) * w_stride + c), xv);
      }
      for (int r = 0; r < rows; ++r)
        minivllm::store(_mm512_reduce_add_ps(acc[r]), y + i * y_stride + n0 + r);
    }
  }
}

// One expert's weight matrix as the kernels read it: bf16 rows (qtype -1) or GGUF block rows
// of `qtype` (packed, as in the .gguf file), experts `expert_bytes` and rows `row_bytes` apart.
struct ExpertWeights {
  const uint8_t* base;
  int32_t qtype;
  int64_t expert_bytes, row_bytes;

  const uint8_t* at(int64_t e, int64_t row) const {
    return base + e * expert_bytes + row * row_bytes;
  }
};

// GGUF weights: rows of x up to which the int8 dot kernel beats the AMX strips (as
// GGUF_DOT_MAX_ROWS of kernels/gguf_linear.py for a plain linear).
constexpr int64_t kGgufDotMaxRows = 4;

// One expert GEMM of a thread, y [m, n] = x [m, k] W[e, row0 : row0 + n]^T: bf16 weights through
// the AMX kernel of gemm_amx.cpp on one thread or gemm_dot; GGUF blocks through the int8 dot
// kernel of gguf_gemm.cpp (x quantized per 32) or, for more rows, gguf_amx.cpp's strips.
// 0, or the kernel's error code.
int expert_gemm(bool amx, const uint16_t* x, int64_t x_stride, const ExpertWeights& w, int64_t e,
                int64_t row0, uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
  const uint8_t* rows = w.at(e, row0);
  if (w.qtype >= 0) {
    if (amx && m > kGgufDotMaxRows &&
        minivllm_gguf_gemm_amx_bf16(w.qtype, x, x_stride, rows, w.row_bytes, nullptr, y,
                                    y_stride, m, n, k, 1) == 0)
      return 0;
    return minivllm_gguf_gemm(w.qtype, x, x_stride, 1, rows, w.row_bytes, nullptr, y, y_stride,
                              m, n, k, 1);
  }
  const uint16_t* wb = reinterpret_cast<const uint16_t*>(rows);
  const int64_t w_stride = w.row_bytes / 2;
#ifdef MINIVLLM_MOE_AMX
  if (amx)
    return minivllm_gemm_amx_bf16(x, x_stride, wb, w_stride, nullptr, y, y_stride, m, n, k, 1);
#endif
  (void)amx;
  gemm_dot(x, x_stride, wb, w_stride, y, y_stride, m, n, k);
  return 0;
}

// h [rows, I] = SiluAndMul of gu [rows, 2I] (gate columns, then up), columns [c0, c1).
void silu_mul_rows(const uint16_t* gu, int64_t rows, int64_t inter, int64_t c0, int64_t c1,
                   uint16_t* hs) {
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* row = gu + i * 2 * inter;
    for (int64_t c = c0; c < c1; c += 16)
      store16(hs + i * inter + c, minivllm::silu_mul16(load16(row + c), load16(row + inter + c)));
  }
}

// This thread's share [begin, end) of `count` rows, in whole 16-row blocks.
inline void share(int64_t count, int64_t t, int64_t threads, int64_t* begin, int64_t* end) {
  const int64_t blocks = count / 16;
  *begin = 16 * (blocks * t / threads);
  *end = 16 * (blocks * (t + 1) / threads);
}

// Phase 1, this thread's rows [r0, r1) of every active expert's gate and up projections (each
// thread a slice of every expert, so uneven expert loads stay balanced): gate and up into
// gu [N, 2I] (bf16, as the separate linears round them), then h = silu(gate) * up into
// hs [N, I]: the same bits as the fused gate_up epilogue of gemm_amx.cpp.
int gate_up_slice(bool amx, const uint16_t* xs, const ExpertWeights& w13, const Groups& g,
                  int64_t num_local, int64_t h, int64_t inter, int64_t r0, int64_t r1,
                  uint16_t* gu, uint16_t* hs) {
  for (int64_t e = 0; e < num_local && r0 < r1; ++e) {
    const int64_t begin = g.offsets[e], rows = g.offsets[e + 1] - begin;
    if (rows == 0) continue;
    uint16_t* out = gu + begin * 2 * inter;
    for (int half = 0; half < 2; ++half) {  // gate rows [0, I), up rows [I, 2I)
      const int64_t off = half * inter + r0;
      const int rc = expert_gemm(amx, xs + begin * h, h, w13, e, off, out + off, 2 * inter,
                                 rows, r1 - r0, h);
      if (rc != 0) return rc;
    }
    silu_mul_rows(out, rows, inter, r0, r1, hs + begin * inter);
  }
  return 0;
}

// Phase 2, this thread's output columns [c0, c1) of every active expert's down projection:
// ys [N, H] (bf16) = hs W2^T.
int down_slice(bool amx, const uint16_t* hs, const ExpertWeights& w2, const Groups& g,
               int64_t num_local, int64_t h, int64_t inter, int64_t c0, int64_t c1,
               uint16_t* ys) {
  for (int64_t e = 0; e < num_local && c0 < c1; ++e) {
    const int64_t begin = g.offsets[e], rows = g.offsets[e + 1] - begin;
    if (rows == 0) continue;
    const int rc = expert_gemm(amx, hs + begin * inter, inter, w2, e, c0, ys + begin * h + c0, h,
                               rows, c1 - c0, inter);
    if (rc != 0) return rc;
  }
  return 0;
}

// Expert e on all of its rows in this thread: hs = SiluAndMul(x W13^T) (bf16 weights on AMX:
// fused into the GEMM; else through gu), ys = hs W2^T.
int whole_expert(bool amx, const uint16_t* xs, const ExpertWeights& w13, const ExpertWeights& w2,
                 const Groups& g, int64_t e, int64_t h, int64_t inter, uint16_t* gu,
                 uint16_t* hs, uint16_t* ys) {
  const int64_t begin = g.offsets[e], rows = g.offsets[e + 1] - begin;
  bool fused = false;
#ifdef MINIVLLM_MOE_AMX
  if (amx && w13.qtype < 0) {
    const int rc = minivllm_gemm_amx_silu_mul_bf16(
        xs + begin * h, h, reinterpret_cast<const uint16_t*>(w13.at(e, 0)), h, nullptr,
        hs + begin * inter, inter, rows, inter, h, 1);
    if (rc != 0) return rc;
    fused = true;
  }
#endif
  if (!fused) {
    const int rc = expert_gemm(amx, xs + begin * h, h, w13, e, 0, gu + begin * 2 * inter,
                               2 * inter, rows, 2 * inter, h);
    if (rc != 0) return rc;
    silu_mul_rows(gu + begin * 2 * inter, rows, inter, 0, inter, hs + begin * inter);
  }
  return expert_gemm(amx, hs + begin * inter, inter, w2, e, 0, ys + begin * h, h, rows, h, inter);
}

// Phase 3, columns [c0, c1): out[t] = sum_j w[t, j] * ys[slot(t, j)] in fp32, rounded to bf16
// once; tokens without a local pair get zeros.
void combine_slice(const uint16_t* ys, int64_t h, const Groups& g, const float* weights,
                   int64_t t_count, int32_t k, int64_t c0, int64_t c1, uint16_t* out,
                   int64_t out_stride) {
  std::vector<float> acc(c1 - c0);
  for (int64_t t = 0; t < t_count; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int32_t j = 0; j < k; ++j) {
      const int64_t slot = g.slot_of_pair[t * k + j];
      if (slot < 0) continue;
      const float w = weights[t * k + j];
      const uint16_t* row = ys + slot * h + c0;
#pragma omp simd
      for (int64_t c = 0; c < c1 - c0; ++c) acc[c] += w * minivllm::to_float(row[c]);
    }
    uint16_t* dst = out + t * out_stride + c0;
    for (int64_t c = 0; c < c1 - c0; ++c) minivllm::store(acc[c], dst + c);
  }
}
#endif  // MINIVLLM_MOE_NATIVE

}  // namespace

#ifdef MINIVLLM_MOE_NATIVE
namespace {

// The experts of one layer for both weight kinds (see the entry points below).
int run_experts(const uint16_t* x, int64_t x_stride, const ExpertWeights& w13,
                const ExpertWeights& w2, const int64_t* ids, const float* weights,
                const int64_t* expert_map, int64_t num_global, int64_t num_local, int64_t t_count,
                int32_t k, int64_t h, int64_t inter, uint16_t* out, int64_t out_stride,
                int32_t num_threads, bool amx) {
  const Groups g = sort_pairs(ids, t_count * k, expert_map, num_global, num_local);
  const int64_t n = g.offsets[num_local];
  std::lock_guard<std::mutex> guard(g_scratch.lock);
  uint16_t* xs = g_scratch.get(std::max<int64_t>(n, 1) * (2 * h + 3 * inter));
  if (xs == nullptr) return 3;
  uint16_t* gu = xs + n * h;        // [N, 2I]
  uint16_t* hs = gu + n * 2 * inter;  // [N, I]
  uint16_t* ys = hs + n * inter;    // [N, H]
  // Many rows per expert (prompts): each thread takes whole experts, whose activations then
  // stay in its cache between the two GEMMs. Few (decode): every thread streams a slice of every
  // active expert, so that 8 active experts still keep all threads streaming.
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_local; ++e)
    if (g.offsets[e + 1] > g.offsets[e]) active.push_back(e);
  const bool by_expert = static_cast<int64_t>(active.size()) >= 4 * num_threads &&
                         n >= kRowsPerExpert * static_cast<int64_t>(active.size());
  minivllm::WorkSplit gate_up_split(inter / 16, num_threads), down_split(h / 16, num_threads);
  int failed = 0;
  // One parallel region for the whole layer (a region per expert GEMM cost a wake-up each,
  // and on a busy box a descheduled thread stalls every one of them).
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    for (int64_t s = n * t / threads; s < n * (t + 1) / threads; ++s)
      std::memcpy(xs + s * h, x + (g.pair_of_slot[s] / k) * x_stride, h * 2);
#pragma omp barrier
    int64_t b, e;
    int rc = 0;
    if (by_expert) {  // whole experts per thread: gate_up (SiluAndMul fused), then down
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < static_cast<int64_t>(active.size()); ++i) {
        const int r = whole_expert(amx, xs, w13, w2, g, active[i], h, inter, gu, hs, ys);
        if (r != 0) rc = r;
      }
    } else {          // slices of every expert, 16 columns a unit, stolen when one is done
      while (rc == 0 && gate_up_split.next(t, &b, &e))
        rc = gate_up_slice(amx, xs, w13, g, num_local, h, inter, 16 * b, 16 * e, gu, hs);
#pragma omp barrier
      while (rc == 0 && down_split.next(t, &b, &e))
        rc = down_slice(amx, hs, w2, g, num_local, h, inter, 16 * b, 16 * e, ys);
#pragma omp barrier
    }
    share(h, t, threads, &b, &e);
    combine_slice(ys, h, g, weights, t_count, k, b, e, out, out_stride);
    if (rc != 0) {
#pragma omp atomic write
      failed = rc;
    }
  }
  return failed;
}

}  // namespace
#endif  // MINIVLLM_MOE_NATIVE

extern "C" {

// x [T, H] (rows x_stride apart), w13 [E_local, 2I, H] and w2 [E_local, H, I] contiguous bf16,
// ids [T, k] int64 global expert ids, weights [T, k] fp32, expert_map [num_global] int64
// (global -> local, -1: not here) or null, out [T, H] (rows out_stride apart).
// use_amx 0: the AVX-512 bf16 dot GEMMs even where AMX is usable (what CPUs without it run).
// Needs H % 32 == 0, I % 32 == 0 and AVX-512 (F + BW): 1 bad sizes, 2 no AVX-512 in this build,
// 3 out of memory.
int minivllm_fused_experts_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w13,
                                const uint16_t* w2, const int64_t* ids, const float* weights,
                                const int64_t* expert_map, int64_t num_global, int64_t num_local,
                                int64_t t_count, int32_t k, int64_t h, int64_t inter,
                                uint16_t* out, int64_t out_stride, int32_t num_threads,
                                int32_t use_amx) {
  if (h % 32 != 0 || inter % 32 != 0 || k < 1 || t_count < 0) return 1;
#ifndef MINIVLLM_MOE_NATIVE
  (void)use_amx;
  return 2;  // no AVX-512 in this build: the torch path keeps the experts
#else
  const ExpertWeights a{reinterpret_cast<const uint8_t*>(w13), -1, 2 * inter * h * 2, h * 2};
  const ExpertWeights b{reinterpret_cast<const uint8_t*>(w2), -1, h * inter * 2, inter * 2};
  return run_experts(x, x_stride, a, b, ids, weights, expert_map, num_global, num_local, t_count,
                     k, h, inter, out, out_stride, num_threads,
                     use_amx != 0 && minivllm_has_gemm_amx() != 0);
#endif
}

// The same for GGUF-packed experts: w13 [E_local, 2I, row bytes of H] of GGML type w13_type and
// w2 [E_local, H, row bytes of I] of w2_type, uint8 block rows w13_row_bytes / w2_row_bytes
// apart, experts contiguous. Each expert's rows take the int8 dot kernel (up to 4) or the AMX
// strips. Needs H and I multiples of both types' block sizes and of 32: 1 bad sizes or type,
// 2 no AVX-512 in this build, 3 out of memory.
int minivllm_fused_experts_gguf(const uint16_t* x, int64_t x_stride, const uint8_t* w13,
                                int32_t w13_type, int64_t w13_row_bytes, const uint8_t* w2,
                                int32_t w2_type, int64_t w2_row_bytes, const int64_t* ids,
                                const float* weights, const int64_t* expert_map,
                                int64_t num_global, int64_t num_local, int64_t t_count, int32_t k,
                                int64_t h, int64_t inter, uint16_t* out, int64_t out_stride,
                                int32_t num_threads) {
  if (h % 32 != 0 || inter % 32 != 0 || k < 1 || t_count < 0 || w13_type < 0 || w2_type < 0)
    return 1;
#ifndef MINIVLLM_MOE_NATIVE
  (void)x, (void)x_stride, (void)w13, (void)w13_row_bytes, (void)w2, (void)w2_row_bytes;
  (void)ids, (void)weights, (void)expert_map, (void)num_global, (void)num_local;
  (void)out, (void)out_stride, (void)num_threads;
  return 2;
#else
  const ExpertWeights a{w13, w13_type, 2 * inter * w13_row_bytes, w13_row_bytes};
  const ExpertWeights b{w2, w2_type, h * w2_row_bytes, w2_row_bytes};
  return run_experts(x, x_stride, a, b, ids, weights, expert_map, num_global, num_local, t_count,
                     k, h, inter, out, out_stride, num_threads, minivllm_has_gemm_amx() != 0);
#endif
}

}  // extern "C"
