// bf16 MoE experts on CPU in one native call (routing: moe_topk.cpp; GGUF-packed experts:
// fused_moe_gguf.cpp; the pair sorting and the top-k sum they share: moe_common.h).
//
// minivllm_fused_experts_bf16: out[t] = sum_j w[t, j] * expert_{id[t, j]}(x[t]) for bf16 x [T, H]
// and the stacked weights w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], read in
// place (no copy, no gather of weight tensors). The (token, expert) pairs are counting-sorted by
// expert (stable: tokens ascending), their rows gathered into one contiguous group per expert,
// and each active expert runs the AMX GEMMs of gemm_amx.cpp on its group: gate_up (SiluAndMul
// after it), then down, all in one parallel region. Decode-sized groups: the threads split
// pieces of kPieceRows weight rows taken expert after expert (moe_common.h: long runs of
// consecutive rows per thread, all threads busy; with gemm_dot's hinted one-row stream a
// Qwen3-30B-A3B layer runs at ~31-37 GB/s of expert weight on Zen 4 at 1-64 tokens, about
// DRAM rate); prompt-sized groups: each thread takes whole experts. Each active
// expert's weight is streamed once for all of its rows. The k outputs of a token are summed in
// fp32 with their routing weights and rounded to bf16 once.
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
// of each pair first). kTokens: rows of x a weight step meets while in registers.
#ifdef MINIVLLM_MOE_NATIVE
constexpr int kStep = 32, kTokens = 4;  // 16 accumulators + 4 weight steps of 32 zmm
using Lanes = __m512;
using Step = __m512i;
inline Lanes zero_lanes() { return _mm512_setzero_ps(); }
inline Step load_step(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline Lanes dot_step(Lanes acc, Step w, Step x) { return minivllm::dot_bf16x32(acc, w, x); }
inline float lane_sum(Lanes v) { return _mm512_reduce_add_ps(v); }
#else  // AVX2 (Zen 2/3)
constexpr int kStep = 16, kTokens = 2;  // 8 accumulators + 4 weight steps of 16 ymm
using Lanes = __m256;
using Step = __m256i;
inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
inline Step load_step(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline Lanes dot_step(Lanes acc, Step a, Step x) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, high)),
                        _mm256_castsi256_ps(_mm256_and_si256(x, high)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)),
                         _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)), acc);
}
inline float lane_sum(Lanes v) { return minivllm::hsum8(v); }
#endif

// How far ahead of a weight row's stream gemm_dot hints lines into L2 (bytes). One row streams
// at a time, so the hardware prefetcher sees one sequential stream; the hint, 8 KB ahead, keeps
// ~128 lines in flight across the row ends where that prefetcher would restart. Measured on
// Zen 4 (Qwen3-30B-A3B experts, 64 tokens, 2 threads): ~33-42 ms against ~56-61 ms for 4-row
// tiles with their next rows hinted into L1; 4 KB ahead or hints into L1 gained little.
constexpr int64_t kAheadBytes = 8192;

// Weight row w [k] times x rows [0, MT) into y[0], y[y_stride], ... (bf16): each weight step is
// loaded once for the MT rows of x, so the first tile's products overlap the row's stream from
// memory. `ahead_end`: hint the weight kAheadBytes ahead while below it (nullptr: no hints; the
// bound is the call's rows, as an expert's rows past them may be inactive and their lines
// wasted bandwidth).
template <int MT>
void dot_tile(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t k,
              const uint16_t* ahead_end, uint16_t* y, int64_t y_stride) {
  constexpr int64_t kAhead = kAheadBytes / sizeof(uint16_t);
  Lanes acc[MT];
  for (int mm = 0; mm < MT; ++mm) acc[mm] = zero_lanes();
  for (int64_t c = 0; c < k; c += kStep) {
    const Step wv = load_step(w + c);
    if (w + c + kAhead < ahead_end)
      _mm_prefetch(reinterpret_cast<const char*>(w + c + kAhead), _MM_HINT_T1);
    for (int mm = 0; mm < MT; ++mm)
      acc[mm] = dot_step(acc[mm], wv, load_step(x + mm * x_stride + c));
  }
  for (int mm = 0; mm < MT; ++mm) minivllm::store(lane_sum(acc[mm]), y + mm * y_stride);
}

// dot_tile for a runtime count of x rows (1..kTokens).
void dot_tile_rows(int mt, const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t k,
                   const uint16_t* ahead_end, uint16_t* y, int64_t y_stride) {
  switch (mt) {
#ifdef MINIVLLM_MOE_NATIVE
    case 4: return dot_tile<4>(x, x_stride, w, k, ahead_end, y, y_stride);
    case 3: return dot_tile<3>(x, x_stride, w, k, ahead_end, y, y_stride);
#endif
    case 2: return dot_tile<2>(x, x_stride, w, k, ahead_end, y, y_stride);
    default: return dot_tile<1>(x, x_stride, w, k, ahead_end, y, y_stride);
  }
}

// y [m, n] (rows y_stride apart, bf16) = x [m, k] W^T for bf16 x, W [n, k] (rows x_stride /
// w_stride apart), k % 32 == 0, with bf16 pair dot products (fp32 sums, one bf16 rounding): the
// expert GEMM on CPUs without AMX (AMD Zen 2-4, Ice Lake). One weight row at a time (4 KB at
// k = 2048: it stays in L1 while every row of x meets it), so the weight streams from memory
// once whatever m is, overlapped with the first kTokens rows' products, which also hint the
// stream ahead.
void gemm_dot(const uint16_t* x, int64_t x_stride, const uint16_t* w, int64_t w_stride,
              uint16_t* y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
  const uint16_t* end = w + n * w_stride;
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* wr = w + r * w_stride;
    for (int64_t i = 0; i < m; i += kTokens) {
      const int mt = static_cast<int>(std::min<int64_t>(kTokens, m - i));
      dot_tile_rows(mt, x + i * x_stride, x_stride, wr, k, i == 0 ? end : nullptr,
                    y + i * y_stride + r, y_stride);
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

// This thread's decode pieces of one projection over the active experts (moe_common.h):
// y [N, n] (bf16, rows from each expert's first slot) = x [N, k] W[e]^T for W [E, n, k].
int projection(bool amx, const uint16_t* x, const uint16_t* w, const Groups& g,
               const std::vector<int64_t>& active, minivllm::WorkSplit* split, int t, int64_t k,
               int64_t n, uint16_t* y) {
  return for_each_piece(split, t, n, [&](int64_t ai, int64_t r0, int64_t r1) {
    const int64_t e = active[ai], begin = g.offsets[e];
    return expert_gemm(amx, x + begin * k, k, w, n * k, k, e, r0, y + begin * n + r0, n,
                       g.rows(e), r1 - r0, k);
  });
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
  const int64_t count = static_cast<int64_t>(active.size());
  const bool by_expert = whole_experts(count, n, num_threads);
  minivllm::WorkSplit gate_up(count * pieces_of(2 * inter), num_threads);
  minivllm::WorkSplit down(count * pieces_of(h), num_threads);
  int failed = 0;
  // One parallel region for the whole layer (a region per expert GEMM cost a wake-up each,
  // and on a busy box a descheduled thread stalls every one of them).
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t s0 = n * t / threads, s1 = n * (t + 1) / threads;
    for (int64_t s = s0; s < s1; ++s)
      std::memcpy(xs + s * h, x + (g.pair_of_slot[s] / k) * x_stride, h * 2);
#pragma omp barrier
    int rc = 0;
    if (by_expert) {  // whole experts per thread: gate_up (SiluAndMul fused), then down
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < count; ++i) {
        const int r = whole_expert(amx, xs, w13, w2, g, active[i], h, inter, gu, hs, ys);
        if (r != 0) rc = r;
      }
    } else {          // decode pieces: gate_up, SiluAndMul of this thread's slots, down
      rc = projection(amx, xs, w13, g, active, &gate_up, t, h, 2 * inter, gu);
#pragma omp barrier
      silu_mul_rows(gu + s0 * 2 * inter, s1 - s0, inter, 0, inter, hs + s0 * inter);
#pragma omp barrier
      if (rc == 0) rc = projection(amx, hs, w2, g, active, &down, t, inter, h, ys);
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
