// Paged decode attention for CPU: one query token per sequence, keys and values read straight
// out of the paged KV cache through the block table (no gather into a workspace, no padding).
//
// Built on first use by minivllm/_custom_ops.py (g++ -O3 -march=native -fopenmp) and called through
// ctypes with raw pointers; the OpenMP runtime is the one torch already loaded (same soname).
//
// Layout (elements, not bytes):
//   q / out   row r of a [T, num_heads * head_size] matrix starts at r * row_stride;
//             query head h of that row at + h * head_size
//   caches    slot s (= block_id * block_size + offset) of KV head kh starts at
//             s * slot_stride + kh * head_size  (the [num_blocks, block_size, nKV, d] cache)
//   table     block_table[i * table_stride + j] is the j-th block of sequence i
//
// The unit of work is a (sequence, KV head) pair: the num_heads / num_kv_heads query heads that
// share a KV head (GQA) read each key and value row once. A thread takes a whole sequence (its KV
// heads in turn) when there are enough sequences for both threads, else single pairs. Scores,
// softmax and the weighted sum of values are computed in fp32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include "kernels.h"
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "fp8_kv.h"

namespace {

using minivllm::exp_nonpositive;
using minivllm::softmax_rows;
using minivllm::store;
using minivllm::to_float;


// D > 0: the head size as a compile-time constant (fully unrolled dot products); 0: head_size.
template <typename T, typename C, int D>
void attend_one(const T* q, const C* k_cache, const C* v_cache, int64_t slot_stride,
                const int32_t* table, int32_t seq_len, int32_t window, int32_t kv_head,
                int32_t group, int32_t head_size_rt, int32_t block_size, float scale, T* out,
                std::vector<float>& buf) {
  const int32_t d = D > 0 ? D : head_size_rt;
  const int32_t start = (window > 0 && seq_len > window) ? seq_len - window : 0;
  const int32_t n = seq_len - start;
  if (n <= 0) {  // nothing visible (cannot happen for a real decode row): zeros, not NaN
    for (int32_t i = 0; i < group * d; ++i) store(0.0f, out + i);
    return;
  }
  // buf: q [group, d] | acc [group, d] | scores [group, n]
  buf.resize(static_cast<size_t>(group) * (2 * d + n));
  float* qf = buf.data();
  float* acc = qf + group * d;
  float* scores = acc + group * d;
  for (int32_t i = 0; i < group * d; ++i) {
    qf[i] = to_float(q[i]) * scale;
    acc[i] = 0.0f;
  }
  const C* k_head = k_cache + static_cast<int64_t>(kv_head) * d;
  const C* v_head = v_cache + static_cast<int64_t>(kv_head) * d;
  // Positions [start, seq_len) walked block by block: no division per key.
  for (int32_t b = start / block_size, p = start; p < seq_len; ++b) {  // scores
    const C* k = k_head + static_cast<int64_t>(table[b]) * block_size * slot_stride;
    const int32_t stop = std::min(seq_len, (b + 1) * block_size);
    for (int32_t j = p - b * block_size; p < stop; ++p, ++j) {
      const C* kr = k + j * slot_stride;
      for (int32_t g = 0; g < group; ++g) {
        const float* qg = qf + g * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int32_t i = 0; i < d; ++i) s += qg[i] * to_float(kr[i]);
        scores[g * n + (p - start)] = s;
      }
    }
  }
  float inv_sum[64];  // group <= 64 is checked by the caller
  softmax_rows(scores, group, n, inv_sum);
  for (int32_t b = start / block_size, p = start; p < seq_len; ++b) {  // weighted sum of values
    const C* v = v_head + static_cast<int64_t>(table[b]) * block_size * slot_stride;
    const int32_t stop = std::min(seq_len, (b + 1) * block_size);
    for (int32_t j = p - b * block_size; p < stop; ++p, ++j) {
      const C* vr = v + j * slot_stride;
      for (int32_t g = 0; g < group; ++g) {
        const float w = scores[g * n + (p - start)];
        float* ag = acc + g * d;
#pragma omp simd
        for (int32_t i = 0; i < d; ++i) ag[i] += w * to_float(vr[i]);
      }
    }
  }
  for (int32_t g = 0; g < group; ++g)
    for (int32_t i = 0; i < d; ++i) store(acc[g * d + i] * inv_sum[g], out + g * d + i);
}

// Software prefetch of one block (the hardware prefetcher cannot guess the next block: the block
// table scatters a sequence over the cache). `base` is the block's first slot; the whole block,
// every KV head, is contiguous (block_size * slot_stride elements), so the first head's pass
// brings the other heads' rows into L2 too (a thread attends all heads of its sequence in turn).
template <typename T>
inline void prefetch_block(const T* base, int32_t block_size, int64_t slot_stride) {
  const int64_t lines = (block_size * slot_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  for (int64_t l = 0; l < lines; ++l)
    __builtin_prefetch(reinterpret_cast<const char*>(base) + 64 * l, 0, 2);  // to L2
}

// Prefetching for one (sequence, KV head) pass. `own`: fetch this sequence's blocks one ahead
// (its first KV head: nothing of it is cached yet). The cursor walks another sequence's blocks,
// keys then values: a sequence's later KV heads find their rows in L2 and leave memory idle, so
// they pull in the sequence the thread takes next, one block per block they compute.
template <typename C>
struct Prefetch {
  bool own = true;
  const C* k_cache = nullptr;
  const C* v_cache = nullptr;
  int64_t block_stride = 0, slot_stride = 0;
  int32_t block_size = 0;
  const int32_t* table = nullptr;  // the other sequence's blocks [first, first + blocks)
  int32_t first = 0, blocks = 0, done = 0;

  void aim(const int32_t* seq_table, int32_t seq_len, int32_t window) {
    const int32_t start = (window > 0 && seq_len > window) ? seq_len - window : 0;
    table = seq_table;
    first = start / block_size;
    blocks = seq_len > 0 ? (seq_len - 1) / block_size - first + 1 : 0;
    done = 0;
  }
  void step() {
    if (done >= 2 * blocks) return;
    const C* cache = done < blocks ? k_cache : v_cache;
    prefetch_block<C>(cache + table[first + done % blocks] * block_stride, block_size, slot_stride);
    ++done;
  }
};

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 elements as fp32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bf16: zero-extend to 32 bits, shift into the high half
  return minivllm::widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The same computation as attend_one with G query heads per KV head and head size D known at
// compile time, so the queries (G x D/16 vectors) and the output accumulators stay in registers
// for the whole pass over the keys / values.
template <typename T, typename C, int G, int D>
void attend_one_avx512(const T* q, const C* k_cache, const C* v_cache, int64_t slot_stride,
                       const int32_t* table, int32_t seq_len, int32_t window, int32_t kv_head,
                       int32_t block_size, float scale, T* out, std::vector<float>& buf,
                       Prefetch<C>& pf) {
  const bool fetch = pf.own;
  constexpr int V = D / 16;
  const int32_t start = (window > 0 && seq_len > window) ? seq_len - window : 0;
  const int32_t n = seq_len - start;
  if (n <= 0) {
    for (int32_t i = 0; i < G * D; ++i) store(0.0f, out + i);
    return;
  }
  buf.resize(static_cast<size_t>(G) * n);
  float* scores = buf.data();  // [G, n]
  __m512 qv[G][V];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) qv[g][c] = _mm512_mul_ps(load16(q + g * D + c * 16), _mm512_set1_ps(scale));
  const C* k_head = k_cache + static_cast<int64_t>(kv_head) * D;
  const C* v_head = v_cache + static_cast<int64_t>(kv_head) * D;
  const int32_t last_block = (seq_len - 1) / block_size;
  const int64_t block_stride = static_cast<int64_t>(block_size) * slot_stride;
  if (fetch)
    prefetch_block<C>(k_cache + table[start / block_size] * block_stride, block_size, slot_stride);
  __m512 partial[G][16];
  for (int32_t b = start / block_size, p = start; p < seq_len; ++b) {  // scores
    const C* k = k_head + static_cast<int64_t>(table[b]) * block_stride;
    pf.step();
    if (fetch && b < last_block)
      prefetch_block<C>(k_cache + table[b + 1] * block_stride, block_size, slot_stride);
    else if (fetch)  // the values are read next
      prefetch_block<C>(v_cache + table[start / block_size] * block_stride, block_size,
                           slot_stride);
    const int32_t stop = std::min(seq_len, (b + 1) * block_size);
    for (int32_t j = p - b * block_size; p < stop; ++p, ++j) {
      const C* kr = k + j * slot_stride;
      __m512 kv[V];
      for (int c = 0; c < V; ++c) kv[c] = load16(kr + c * 16);
      const int32_t r = (p - start) % 16;  // 16 keys' partial sums, reduced together
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < V; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
        partial[g][r] = a;
      }
      if (r == 15 || p + 1 == seq_len) {
        const int32_t first = p - start - r;
        for (int g = 0; g < G; ++g) {
          for (int32_t z = r + 1; z < 16; ++z) partial[g][z] = _mm512_setzero_ps();
          _mm512_mask_storeu_ps(scores + g * n + first, static_cast<__mmask16>((1u << (r + 1)) - 1),
                                minivllm::sum_lanes16(partial[g]));
        }
      }
    }
  }
  float inv_sum[G];
  softmax_rows(scores, G, n, inv_sum);
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < V; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int32_t b = start / block_size, p = start; p < seq_len; ++b) {  // weighted sum of values
    const C* v = v_head + static_cast<int64_t>(table[b]) * block_stride;
    pf.step();
    if (fetch && b < last_block)
      prefetch_block<C>(v_cache + table[b + 1] * block_stride, block_size, slot_stride);
    const int32_t stop = std::min(seq_len, (b + 1) * block_size);
    for (int32_t j = p - b * block_size; p < stop; ++p, ++j) {
      const C* vr = v + j * slot_stride;
      __m512 vv[V];
      for (int c = 0; c < V; ++c) vv[c] = load16(vr + c * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * n + (p - start)]);
        for (int c = 0; c < V; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float tmp[D];
    for (int c = 0; c < V; ++c)
      _mm512_store_ps(tmp + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv_sum[g])));
    for (int i = 0; i < D; ++i) store(tmp[i], out + g * D + i);
  }
}

// Dispatch to a compile-time (G, D); false when there is no specialization for them.
template <typename T, typename C, int D>
bool attend_fixed_d(int32_t group, const T* q, const C* kc, const C* vc, int64_t ss,
                    const int32_t* t, int32_t len, int32_t w, int32_t kh, int32_t bs, float sc,
                    T* o, std::vector<float>& buf, Prefetch<C>& fetch) {
  switch (group) {
#define MINIVLLM_CASE(G) \
    case G: attend_one_avx512<T, C, G, D>(q, kc, vc, ss, t, len, w, kh, bs, sc, o, buf, fetch); return true;
    MINIVLLM_CASE(1) MINIVLLM_CASE(2) MINIVLLM_CASE(3) MINIVLLM_CASE(4)
    MINIVLLM_CASE(5) MINIVLLM_CASE(6) MINIVLLM_CASE(7) MINIVLLM_CASE(8)
#undef MINIVLLM_CASE
    default: return false;
  }
}

template <typename T, typename C>
bool attend_fast(int32_t head_size, int32_t group, const T* q, const C* kc, const C* vc,
                 int64_t ss, const int32_t* t, int32_t len, int32_t w, int32_t kh, int32_t bs,
                 float sc, T* o, std::vector<float>& buf, Prefetch<C>& fetch) {
  if (head_size == 64) return attend_fixed_d<T, C, 64>(group, q, kc, vc, ss, t, len, w, kh, bs, sc, o, buf, fetch);
  if (head_size == 128) return attend_fixed_d<T, C, 128>(group, q, kc, vc, ss, t, len, w, kh, bs, sc, o, buf, fetch);
  return false;
}
#else
template <typename T, typename C>
bool attend_fast(int32_t, int32_t, const T*, const C*, const C*, int64_t, const int32_t*, int32_t,
                 int32_t, int32_t, int32_t, float, T*, std::vector<float>&, Prefetch<C>&) {
  return false;  // no AVX-512: the portable loops below
}
#endif

// One (sequence, KV head) pair: the AVX-512 specialization when there is one, else the loops.
template <typename T, typename C>
void attend_pair(const T* qi, const C* k_cache, const C* v_cache, int64_t slot_stride,
                 const int32_t* ti, int32_t len, int32_t window, int32_t kh, int32_t group,
                 int32_t head_size, int32_t block_size, float scale, T* oi,
                 std::vector<float>& buf, Prefetch<C>& pf) {
  if (attend_fast<T, C>(head_size, group, qi, k_cache, v_cache, slot_stride, ti, len, window, kh,
                     block_size, scale, oi, buf, pf))
    return;
  if (head_size == 64)
    attend_one<T, C, 64>(qi, k_cache, v_cache, slot_stride, ti, len, window, kh, group, head_size,
                      block_size, scale, oi, buf);
  else if (head_size == 128)
    attend_one<T, C, 128>(qi, k_cache, v_cache, slot_stride, ti, len, window, kh, group, head_size,
                       block_size, scale, oi, buf);
  else
    attend_one<T, C, 0>(qi, k_cache, v_cache, slot_stride, ti, len, window, kh, group, head_size,
                     block_size, scale, oi, buf);
}

// The step's new keys/values (row rows[i] of k_new / v_new, rows k_stride / v_stride apart) into
// their slots
// (slots[rows[i]]), one row per sequence, before any thread reads the cache: it saves the two
// scatter ops a decode step would otherwise run per layer.
template <typename T, typename C>
void write_new_kv(const T* k_new, int64_t k_stride, const T* v_new, int64_t v_stride,
                  const int64_t* slots, const int64_t* rows, int32_t num_seqs, C* k_cache,
                  C* v_cache, int64_t slot_stride, int64_t row_elems) {
#pragma omp for schedule(static)
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int64_t slot = slots[rows[i]];
    const T* k = k_new + rows[i] * k_stride;
    const T* v = v_new + rows[i] * v_stride;
    if constexpr (std::is_same_v<T, C>) {
      std::copy_n(k, row_elems, k_cache + slot * slot_stride);
      std::copy_n(v, row_elems, v_cache + slot * slot_stride);
    } else {  // an fp8 cache
      for (int64_t e = 0; e < row_elems; ++e) {
        k_cache[slot * slot_stride + e] = from_float<C>(to_float(k[e]));
        v_cache[slot * slot_stride + e] = from_float<C>(to_float(v[e]));
      }
    }
  }  // (the implicit barrier: every new row is in place before attention reads)
}

template <typename T, typename C>
int paged_decode(const T* q, int64_t q_row_stride, C* k_cache, C* v_cache,
                 int64_t slot_stride, const int32_t* block_table, int64_t table_stride,
                 const int32_t* seq_lens, const int64_t* rows, T* out, int64_t out_row_stride,
                 int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_size,
                 int32_t block_size, int32_t window, float scale, int32_t num_threads,
                 const T* k_new, int64_t k_stride, const T* v_new, int64_t v_stride,
                 const int64_t* slots) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > 64)
    return 1;
  const int32_t group = num_heads / num_kv_heads;
  // One sequence per task when there are enough of them (its KV heads in turn, so the blocks
  // fetched for the first head serve the others from L2); else one (sequence, KV head) each.
  const int32_t per_task = num_seqs >= 4 * num_threads ? num_kv_heads : 1;
  const int64_t tasks = static_cast<int64_t>(num_seqs) * num_kv_heads / per_task;
  int64_t claimed = 0;  // tasks handed out so far (claimed one ahead, see Prefetch)
#pragma omp parallel num_threads(num_threads)
  {
    if (slots != nullptr)
      write_new_kv<T, C>(k_new, k_stride, v_new, v_stride, slots, rows, num_seqs, k_cache,
                         v_cache, slot_stride, static_cast<int64_t>(num_kv_heads) * head_size);
    std::vector<float> buf;
    Prefetch<C> pf;
    pf.k_cache = k_cache;
    pf.v_cache = v_cache;
    pf.block_size = block_size;
    pf.slot_stride = slot_stride;
    pf.block_stride = static_cast<int64_t>(block_size) * slot_stride;
    // Dynamic (sequence lengths differ, so equal-count chunks would be unbalanced), and each
    // thread claims its next task before it starts the current one, to prefetch it meanwhile.
    int64_t t, next;
#pragma omp atomic capture
    t = claimed++;
    for (; t < tasks; t = next) {
#pragma omp atomic capture
      next = claimed++;
      for (int32_t h = 0; h < per_task; ++h) {
        const int64_t pair = t * per_task + h;  // (sequence, KV head) pairs, sequence-major
        const int64_t i = pair / num_kv_heads;
        const int32_t kh = static_cast<int32_t>(pair % num_kv_heads);
        pf.own = per_task == 1 || h == 0;
        if (h == 1 && next < tasks)  // per_task > 1: tasks are sequences
          pf.aim(block_table + next * table_stride, seq_lens[next], window);
        else if (h == 0)
          pf.blocks = 0;
        const int64_t col = static_cast<int64_t>(kh) * group * head_size;
        const T* qi = q + rows[i] * q_row_stride + col;
        T* oi = out + rows[i] * out_row_stride + col;
        const int32_t* ti = block_table + i * table_stride;
        attend_pair<T, C>(qi, k_cache, v_cache, slot_stride, ti, seq_lens[i], window, kh, group,
                       head_size, block_size, scale, oi, buf, pf);
      }
    }
  }
  return 0;
}

}  // namespace

// The C entry points, one per storage type (bf16 travels as its raw 16 bits). slots: null, or
// the step's slot mapping, to write k_new / v_new's decode rows into the cache first.
#define MINIVLLM_PAGED_DECODE(NAME, T)                                                        \
  int NAME(const T* q, int64_t q_row_stride, T* k_cache, T* v_cache,                          \
           int64_t slot_stride, const int32_t* block_table, int64_t table_stride,             \
           const int32_t* seq_lens, const int64_t* rows, T* out, int64_t out_row_stride,      \
           int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_size,      \
           int32_t block_size, int32_t window, float scale, int32_t num_threads,              \
           const T* k_new, int64_t k_stride, const T* v_new, int64_t v_stride,                \
           const int64_t* slots) {                                                            \
    return paged_decode<T, T>(q, q_row_stride, k_cache, v_cache, slot_stride, block_table,       \
                           table_stride, seq_lens, rows, out, out_row_stride, num_seqs,       \
                           num_heads, num_kv_heads, head_size, block_size, window, scale,     \
                           num_threads, k_new, k_stride, v_new, v_stride, slots);             \
  }

extern "C" {
MINIVLLM_PAGED_DECODE(minivllm_paged_decode_bf16, uint16_t)
MINIVLLM_PAGED_DECODE(minivllm_paged_decode_f32, float)

// bf16 queries over an fp8 cache (the cache's bytes: format 0 e4m3fn, 1 e5m2); the bf16 k_new /
// v_new rows are rounded into it.
int minivllm_paged_decode_bf16_fp8(
    int32_t format, const uint16_t* q, int64_t q_row_stride, uint8_t* k_cache, uint8_t* v_cache,
    int64_t slot_stride, const int32_t* block_table, int64_t table_stride,
    const int32_t* seq_lens, const int64_t* rows, uint16_t* out, int64_t out_row_stride,
    int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t head_size,
    int32_t block_size, int32_t window, float scale, int32_t num_threads,
    const uint16_t* k_new, int64_t k_stride, const uint16_t* v_new, int64_t v_stride,
    const int64_t* slots) {
  const auto run = [&](auto* k, auto* v) {
    return paged_decode(q, q_row_stride, k, v, slot_stride, block_table, table_stride, seq_lens,
                        rows, out, out_row_stride, num_seqs, num_heads, num_kv_heads, head_size,
                        block_size, window, scale, num_threads, k_new, k_stride, v_new, v_stride,
                        slots);
  };
  if (format == 0)
    return run(reinterpret_cast<Fp8E4M3*>(k_cache), reinterpret_cast<Fp8E4M3*>(v_cache));
  if (format == 1)
    return run(reinterpret_cast<Fp8E5M2*>(k_cache), reinterpret_cast<Fp8E5M2*>(v_cache));
  return 1;
}
}  // extern "C"
