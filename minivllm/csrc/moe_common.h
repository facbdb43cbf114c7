// The parts of a MoE layer's expert call that do not depend on how the experts' weights are
// stored (fused_moe.cpp: bf16 rows; fused_moe_gguf.cpp: GGUF blocks): the (token, expert) pairs
// counting-sorted by expert, the scratch rows, SiluAndMul, and the weighted top-k sum.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "cpu_math.h"
#include "work_split.h"

#include <omp.h>

#if MINIVLLM_BF16_SIMD
#define MINIVLLM_MOE_NATIVE 1  // the bf16 expert kernels: bf16 dot products (cpu_math.h), AMX
#include <immintrin.h>
#endif
#if MINIVLLM_MOE_NATIVE || (defined(__AVX2__) && defined(__FMA__))
#define MINIVLLM_MOE_BF16 1    // fused_moe.cpp's bf16 experts (AVX-512, or AVX2 dot products)
#endif

namespace {

// Scratch rows reused across calls (grown, never shrunk), bf16. Kept here, not passed in, so
// that a recorded call (compilation/cpu_graph.py) never points at a freed buffer. One per
// source file that includes this header (its own lock).
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

  int64_t rows(int64_t e) const { return offsets[e + 1] - offsets[e]; }
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

// The local experts with at least one pair, ascending.
[[maybe_unused]] std::vector<int64_t> active_experts(const Groups& g, int64_t num_local) {
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_local; ++e)
    if (g.rows(e) > 0) active.push_back(e);
  return active;
}

// Average rows per active expert from which each thread takes whole experts (prompts).
constexpr int64_t kRowsPerExpert = 32;

// Whole experts per thread (prompt-sized groups: the activations stay in the thread's cache
// between the two GEMMs) or slices of every expert (decode: all threads streaming weights).
inline bool whole_experts(int64_t active, int64_t n, int64_t num_threads) {
  return active >= 4 * num_threads && n >= kRowsPerExpert * active;
}

// Weight rows a decode unit of work covers (a multiple of 16, the AMX kernels' row block).
constexpr int64_t kPieceRows = 64;

inline int64_t pieces_of(int64_t rows) { return (rows + kPieceRows - 1) / kPieceRows; }

// Decode-sized groups: this thread's units of one projection with n weight rows per expert over
// the active experts (unit u: piece u % pieces_of(n) of active expert u / pieces_of(n)), as
// piece(active index, r0, r1) for runs of consecutive units of one expert: each thread streams
// long runs of consecutive weight rows, which the hardware prefetcher follows. 0 or the first
// error piece returns.
template <typename Piece>
int for_each_piece(minivllm::WorkSplit* split, int t, int64_t n, Piece piece) {
  const int64_t pieces = pieces_of(n);
  int64_t b, e;
  while (split->next(t, &b, &e)) {
    for (int64_t u = b; u < e;) {
      const int64_t ai = u / pieces, last = std::min(e, (ai + 1) * pieces);
      const int rc = piece(ai, (u - ai * pieces) * kPieceRows,
                           std::min(n, (last - ai * pieces) * kPieceRows));
      if (rc != 0) return rc;
      u = last;
    }
  }
  return 0;
}

// This thread's share [begin, end) of `count` rows, in whole 16-row blocks.
inline void share(int64_t count, int64_t t, int64_t threads, int64_t* begin, int64_t* end) {
  const int64_t blocks = count / 16;
  *begin = 16 * (blocks * t / threads);
  *end = 16 * (blocks * (t + 1) / threads);
}

#ifdef MINIVLLM_MOE_NATIVE
inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> fp32 lanes
  return minivllm::widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), minivllm::cvt_bf16x16(v));
}
#endif

// h [rows, I] = SiluAndMul of gu [rows, 2I] (gate columns, then up), columns [c0, c1) (without
// AVX-512: silu_mul8 and silu_mul1, the same values).
[[maybe_unused]] void silu_mul_rows(const uint16_t* gu, int64_t rows, int64_t inter, int64_t c0,
                                    int64_t c1, uint16_t* hs) {
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* row = gu + i * 2 * inter;
#ifdef MINIVLLM_MOE_NATIVE
    for (int64_t c = c0; c < c1; c += 16)
      store16(hs + i * inter + c, minivllm::silu_mul16(load16(row + c), load16(row + inter + c)));
#else
    int64_t c = c0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; c + 8 <= c1; c += 8) {
      const __m256 r = minivllm::silu_mul8(minivllm::widen_bf16x8(row + c),
                                           minivllm::widen_bf16x8(row + inter + c));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(hs + i * inter + c), minivllm::cvt_bf16x8(r));
    }
#endif
    for (; c < c1; ++c)
      minivllm::store(minivllm::silu_mul1(minivllm::to_float(row[c]),
                                          minivllm::to_float(row[inter + c])), hs + i * inter + c);
#endif
  }
}

// Columns [c0, c1): out[t] = sum_j w[t, j] * ys[slot(t, j)] in fp32, rounded to bf16 once;
// tokens without a local pair get zeros.
[[maybe_unused]] void combine_slice(const uint16_t* ys, int64_t h, const Groups& g,
                                    const float* weights, int64_t t_count, int32_t k, int64_t c0,
                                    int64_t c1, uint16_t* out, int64_t out_stride) {
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

// The end of a layer's parallel region, in each thread: its columns of the top-k sum of the
// expert outputs ys [N, H] into out, and its error code (rc != 0) into *failed.
inline void finish_layer(const uint16_t* ys, int64_t h, const Groups& g, const float* weights,
                         int64_t t_count, int32_t k, uint16_t* out, int64_t out_stride, int rc,
                         int* failed) {
  int64_t b, e;
  share(h, omp_get_thread_num(), omp_get_num_threads(), &b, &e);
  combine_slice(ys, h, g, weights, t_count, k, b, e, out, out_stride);
  if (rc != 0) {
#pragma omp atomic write
    *failed = rc;
  }
}

}  // namespace
