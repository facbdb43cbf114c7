// bf16 MoE experts on CPU in one native call (routing: moe_topk.cpp; GGUF-packed experts:
// fused_moe_gguf.cpp; the pair sorting and the top-k sum they share: moe_common.h).
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
// Roundings: h = SiluAndMul and the down output are rounded to bf16 as the unfused bf16 ops do
// (the same kernels); the weighted top-k sum is fp32 (eager rounds each product and each add).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "moe_common.h"
#include "work_split.h"

#if MINIVLLM_MOE_NATIVE && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define MINIVLLM_MOE_AMX 1
#endif

extern "C" int minivllm_has_gemm_amx();  // gemm_amx.cpp: AMX usable here

namespace {

#ifdef MINIVLLM_MOE_BF16
// The bf16 pair dot product of gemm_dot on this build's vectors: kStep bf16 a step into fp32
// lanes, acc[i] += a[2i] b[2i] + a[2i+1] b[2i+1] (vdpbf16ps, or its emulation: the odd element
// of each pair first).
#ifdef MINIVLLM_MOE_NATIVE
constexpr int kStep = 32;
using Lanes = __m512;
inline Lanes zero_lanes() { return _mm512_setzero_ps(); }
inline Lanes dot_step(Lanes acc, const uint16_t* w, __m512i x) {
  return minivllm::dot_bf16x32(acc, _mm512_loadu_si512(w), x);
}
inline __m512i load_step(const uint16_t* x) { return _mm512_loadu_si512(x); }
inline float lane_sum(Lanes v) { return _mm512_reduce_add_ps(v); }
#else  // AVX2 (Zen 2/3)
constexpr int kStep = 16;
using Lanes = __m256;
inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
inline __m256i load_step(const uint16_t* x) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
}
inline Lanes dot_step(Lanes acc, const uint16_t* w, __m256i x) {
  const __m256i a = load_step(w), high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                        _mm256_castsi256_ps(_mm256_and_si256(x, high)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                         _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), acc);
}
inline float lane_sum(Lanes v) { return minivllm::hsum8(v); }
#endif

// y [m, n] (rows y_stride apart, bf16) = x [m, k] W^T for bf16 x, W [n, k] (rows x_stride /
// w_stride apart), k % 32 == 0, with bf16 pair dot products (fp32 sums, one bf16 rounding): the
// expert GEMM on CPUs without AMX (AMD Zen 2-4, Ice Lake). Four weight rows at a time (16 KB at
// k = 2048: they stay in L1 while every row of x meets them), so the weight streams from memory
// once whatever m is.
void gemm_dot(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
              uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
  constexpr int kRows = 4;
  for (int64_t n0 = 0; n0 < n; n0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, n - n0));
    for (int64_t i = 0; i < m; ++i) {
      Lanes acc[kRows];
      for (int r = 0; r < kRows; ++r) acc[r] = zero_lanes();
      for (int64_t c = 0; c < k; c += kStep) {
        const auto xv = load_step(x + i * x_stride + c);
        for (int r = 0; r < rows; ++r) acc[r] = dot_step(acc[r], w + (n0 + r) * w_stride + c, xv);
      }
      for (int r = 0; r < rows; ++r) minivllm::store(lane_sum(acc[r]), y + i * y_stride + n0 + r);
    }
  }
}

// One expert GEMM of a thread, y [m, n] = x [m, k] W[e, row0 : row0 + n]^T for W [E, rows, k]
// (rows w_stride elements apart, experts expert_stride apart): the AMX kernel of gemm_amx.cpp on
// one thread, or gemm_dot. 0, or the kernel's error code.
int expert_gemm(bool amx, const uint16_t* x, int64_t x_stride, const uint16_t* w,
                int64_t expert_stride, int64_t w_stride, int64_t e, int64_t row0, uint16_t* y,
                int64_t y_stride, int64_t m, int64_t n, int64_t k) {
  const uint16_t* wb = w + e * expert_stride + row0 * w_stride;
#ifdef MINIVLLM_MOE_AMX
  if (amx)
    return minivllm_gemm_amx_bf16(x, x_stride, wb, w_stride, nullptr, y, y_stride, m, n, k, 1);
#endif
  (void)amx;
  gemm_dot(x, x_stride, wb, w_stride, y, y_stride, m, n, k);
  return 0;
}

// Phase 1, this thread's rows [r0, r1) of every active expert's gate and up projections (each
// thread a slice of every expert, so uneven expert loads stay balanced): gate and up into
// gu [N, 2I] (bf16, as the separate linears round them), then h = silu(gate) * up into
// hs [N, I]: the same bits as the fused gate_up epilogue of gemm_amx.cpp.
int gate_up_slice(bool amx, const uint16_t* xs, const uint16_t* w13, const Groups& g,
                  const std::vector<int64_t>& active, int64_t h, int64_t inter, int64_t r0,
                  int64_t r1, uint16_t* gu, uint16_t* hs) {
  for (const int64_t e : active) {
    const int64_t begin = g.offsets[e], rows = g.rows(e);
    uint16_t* out = gu + begin * 2 * inter;
    for (int half = 0; half < 2; ++half) {  // gate rows [0, I), up rows [I, 2I)
      const int64_t off = half * inter + r0;
      const int rc = expert_gemm(amx, xs + begin * h, h, w13, 2 * inter * h, h, e, off,
                                 out + off, 2 * inter, rows, r1 - r0, h);
      if (rc != 0) return rc;
    }
    silu_mul_rows(out, rows, inter, r0, r1, hs + begin * inter);
  }
  return 0;
}

// Phase 2, this thread's output columns [c0, c1) of every active expert's down projection:
// ys [N, H] (bf16) = hs W2^T.
int down_slice(bool amx, const uint16_t* hs, const uint16_t* w2, const Groups& g,
               const std::vector<int64_t>& active, int64_t h, int64_t inter, int64_t c0,
               int64_t c1, uint16_t* ys) {
  for (const int64_t e : active) {
    const int64_t begin = g.offsets[e];
    const int rc = expert_gemm(amx, hs + begin * inter, inter, w2, h * inter, inter, e, c0,
                               ys + begin * h + c0, h, g.rows(e), c1 - c0, inter);
    if (rc != 0) return rc;
  }
  return 0;
}

// Expert e on all of its rows in this thread: hs = SiluAndMul(x W13^T) (on AMX: fused into the
// GEMM; else through gu), ys = hs W2^T.
int whole_expert(bool amx, const uint16_t* xs, const uint16_t* w13, const uint16_t* w2,
                 const Groups& g, int64_t e, int64_t h, int64_t inter, uint16_t* gu,
                 uint16_t* hs, uint16_t* ys) {
  const int64_t begin = g.offsets[e], rows = g.rows(e);
  bool fused = false;
#ifdef MINIVLLM_MOE_AMX
  if (amx) {
    const int rc = minivllm_gemm_amx_silu_mul_bf16(xs + begin * h, h, w13 + e * 2 * inter * h, h,
                                                   nullptr, hs + begin * inter, inter, rows,
                                                   inter, h, 1);
    if (rc != 0) return rc;
    fused = true;
  }
#endif
  if (!fused) {
    const int rc = expert_gemm(amx, xs + begin * h, h, w13, 2 * inter * h, h, e, 0,
                               gu + begin * 2 * inter, 2 * inter, rows, 2 * inter, h);
    if (rc != 0) return rc;
    silu_mul_rows(gu + begin * 2 * inter, rows, inter, 0, inter, hs + begin * inter);
  }
  return expert_gemm(amx, hs + begin * inter, inter, w2, h * inter, inter, e, 0, ys + begin * h,
                     h, rows, h, inter);
}

// The experts of one layer (see the entry point below).
int run_experts(const uint16_t* x, int64_t x_stride, const uint16_t* w13, const uint16_t* w2,
                const int64_t* ids, const float* weights, const int64_t* expert_map,
                int64_t num_global, int64_t num_local, int64_t t_count, int32_t k, int64_t h,
                int64_t inter, uint16_t* out, int64_t out_stride, int32_t num_threads, bool amx) {
  const Groups g = sort_pairs(ids, t_count * k, expert_map, num_global, num_local);
  const int64_t n = g.offsets[num_local];
  std::lock_guard<std::mutex> guard(g_scratch.lock);
  uint16_t* xs = g_scratch.get(std::max<int64_t>(n, 1) * (2 * h + 3 * inter));
  if (xs == nullptr) return 3;
  uint16_t* gu = xs + n * h;        // [N, 2I]
  uint16_t* hs = gu + n * 2 * inter;  // [N, I]
  uint16_t* ys = hs + n * inter;    // [N, H]
  const std::vector<int64_t> active = active_experts(g, num_local);
  const bool by_expert = whole_experts(static_cast<int64_t>(active.size()), n, num_threads);
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
        rc = gate_up_slice(amx, xs, w13, g, active, h, inter, 16 * b, 16 * e, gu, hs);
#pragma omp barrier
      while (rc == 0 && down_split.next(t, &b, &e))
        rc = down_slice(amx, hs, w2, g, active, h, inter, 16 * b, 16 * e, ys);
#pragma omp barrier
    }
    finish_layer(ys, h, g, weights, t_count, k, out, out_stride, rc, &failed);
  }
  return failed;
}
#endif  // MINIVLLM_MOE_BF16

}  // namespace

extern "C" {

// x [T, H] (rows x_stride apart), w13 [E_local, 2I, H] and w2 [E_local, H, I] contiguous bf16,
// ids [T, k] int64 global expert ids, weights [T, k] fp32, expert_map [num_global] int64
// (global -> local, -1: not here) or null, out [T, H] (rows out_stride apart).
// use_amx 0: the bf16 dot GEMMs even where AMX is usable (what CPUs without it run).
// Needs H % 32 == 0, I % 32 == 0 and AVX-512 (F + BW) or AVX2: 1 bad sizes, 2 neither in this
// build, 3 out of memory.
int minivllm_fused_experts_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* w13,
                                const uint16_t* w2, const int64_t* ids, const float* weights,
                                const int64_t* expert_map, int64_t num_global, int64_t num_local,
                                int64_t t_count, int32_t k, int64_t h, int64_t inter,
                                uint16_t* out, int64_t out_stride, int32_t num_threads,
                                int32_t use_amx) {
  if (h % 32 != 0 || inter % 32 != 0 || k < 1 || t_count < 0) return 1;
#ifndef MINIVLLM_MOE_BF16
  (void)x, (void)x_stride, (void)w13, (void)w2, (void)ids, (void)weights, (void)expert_map;
  (void)num_global, (void)num_local, (void)out, (void)out_stride, (void)num_threads;
  (void)use_amx;
  return 2;  // no AVX-512 or AVX2 in this build: the torch path keeps the experts
#else
  return run_experts(x, x_stride, w13, w2, ids, weights, expert_map, num_global, num_local,
                     t_count, k, h, inter, out, out_stride, num_threads,
                     use_amx != 0 && minivllm_has_gemm_amx() != 0);
#endif
}

}  // extern "C"
