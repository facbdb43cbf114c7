// Causal attention of one fresh prompt (no cached context) over its own keys, with AMX tiles.
//
// SDPA's CPU flash kernel spent ~300 us on a 137-token prompt-layer of the default model (9
// heads, d = 64): small GEMM calls per 32-query block. Here both products are tile products:
//   S[16 q, 16 keys] = Q[16 q, d] . K^T          (A: query rows in place, B: K packed)
//   O[16 q, 16 d]   += P[16 q, 32 keys] . V      (A: bf16 probabilities, B: V packed)
// K and V are packed once per call into AMX's pair-interleaved B layout (each KV head's tiles
// serve its whole query-head group); a task is one query head x 16 query rows; it computes its
// scores up to the diagonal, a softmax in fp32 (probabilities rounded to bf16 for the second
// product, as SDPA's bf16 path does; the normalizer sums the fp32 values) and the weighted sum.

#include <algorithm>
#include <cstdint>
#include "kernels.h"
#include <cstdlib>
#include <vector>

#include "cpu_math.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "amx_utils.h"

namespace {

// Tile registers: O accumulators 0-3 (16 q x 16 d each), S accumulator 4, A operand 5 (Q or P),
// B operand 7 (K or V). The intrinsics need literal numbers.

// kp: for each 16-key chunk and 32-dim chunk c, the B tile whose row p holds
// (k[key, 32c + 2p], k[key, 32c + 2p + 1]) for the chunk's 16 keys (keys >= len: zero).
template <int D>
void pack_k(const uint16_t* k, int64_t k_stride, int32_t len, int32_t chunk, uint32_t* kp) {
  for (int c = 0; c < D / 32; ++c)
    minivllm::pack_b_tile(k + static_cast<int64_t>(16 * chunk) * k_stride + 32 * c, k_stride,
                          len - 16 * chunk, kp + (static_cast<int64_t>(chunk) * (D / 32) + c) * 256);
}

// vp: for each 32-key chunk and 16-dim chunk j, the B tile whose row p holds
// (v[2p, 16j + i], v[2p + 1, 16j + i]) for i < 16, keys counted from 32 * chunk (>= len: zero).
template <int D>
void pack_v(const uint16_t* v, int64_t v_stride, int32_t len, int32_t chunk, uint16_t* vp) {
  const __m512i interleave = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int j = 0; j < D / 16; ++j) {
    uint16_t* tile = vp + (static_cast<int64_t>(chunk) * (D / 16) + j) * 512;
    for (int p = 0; p < 16; ++p) {
      const int32_t key = 32 * chunk + 2 * p;
      const __m256i a = key < len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                        v + key * v_stride + 16 * j))
                                  : _mm256_setzero_si256();
      const __m256i b = key + 1 < len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                            v + (key + 1) * v_stride + 16 * j))
                                      : _mm256_setzero_si256();
      _mm512_store_si512(tile + 32 * p,
                         _mm512_permutex2var_epi16(_mm512_castsi256_si512(a), interleave,
                                                   _mm512_castsi256_si512(b)));
    }
  }
}

struct Scratch {
  std::vector<float> s;     // [16, stride] scores
  std::vector<uint16_t> p;  // [16, stride] bf16 probabilities (zero past each row's last key)
  alignas(64) uint16_t q[16 * 128];  // a last, partial query tile, zero-padded
  alignas(64) float o[16 * 64];
};

// S[16, 16 * (i0 / 16 + 1)] (rows sc.s, `stride` apart) = query rows i0.. (rows <= 16) of one
// head times the keys up to the diagonal.
template <int D>
void scores_tile(const uint16_t* q, int64_t q_stride, const uint32_t* kp, int32_t i0,
                 int32_t rows, int64_t stride, Scratch& sc) {
  const uint16_t* qa = q + static_cast<int64_t>(i0) * q_stride;
  int64_t qa_bytes = q_stride * 2;
  if (rows < 16) {  // never read past the prompt's last row
    std::fill(sc.q, sc.q + 16 * D, uint16_t{0});
    for (int r = 0; r < rows; ++r) std::copy(qa + r * q_stride, qa + r * q_stride + D, sc.q + r * D);
    qa = sc.q;
    qa_bytes = D * 2;
  }
  for (int32_t ch = 0; ch <= i0 / 16; ++ch) {
    _tile_zero(4);
    for (int c = 0; c < D / 32; ++c) {
      _tile_loadd(5, qa + 32 * c, qa_bytes);
      _tile_loadd(7, kp + (static_cast<int64_t>(ch) * (D / 32) + c) * 256, 64);
      _tile_dpbf16ps(4, 5, 7);
    }
    _tile_stored(4, sc.s.data() + 16 * ch, stride * 4);
  }
}

// Row r (query i0 + r sees keys [0, i0 + r]): P = exp(scale * (S - max)) as bf16 over the first
// `width` columns (zero past the row's keys; all zero for r >= rows), inv_sum[r] = 1 / sum.
inline void softmax_tile(int32_t i0, int32_t rows, int32_t width, float scale, int64_t stride,
                         Scratch& sc, float* inv_sum) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY), scl = _mm512_set1_ps(scale);
  for (int r = 0; r < 16; ++r) {
    uint16_t* pr = sc.p.data() + r * stride;
    const float* sr = sc.s.data() + r * stride;
    const int32_t n = r < rows ? i0 + r + 1 : 0;
    __m512 mv = neg_inf;
    for (int32_t j = 0; j < n; j += 16) {
      const __mmask16 live = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
      mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(neg_inf, live, sr + j));
    }
    const __m512 m = _mm512_set1_ps(n > 0 ? _mm512_reduce_max_ps(mv) : 0.0f);
    __m512 sum = _mm512_setzero_ps();
    for (int32_t j = 0; j < width; j += 16) {
      const int32_t left = n - j;
      const __mmask16 live = left >= 16 ? 0xFFFF
                             : left <= 0 ? 0
                                         : static_cast<__mmask16>((1u << left) - 1);
      const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m), scl);
      const __m512 e = _mm512_maskz_mov_ps(live, minivllm::exp_nonpositive16(x));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    inv_sum[r] = n > 0 ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
  }
}

// out rows i0.. (rows of them) = (P . V) * inv_sum over the first 32 * p_chunks keys.
template <int D>
void weighted_sum_tile(const uint16_t* vp, uint16_t* out, int64_t out_stride, int32_t i0,
                       int32_t rows, int32_t p_chunks, int64_t stride, const float* inv_sum,
                       Scratch& sc) {
  for (int half = 0; half < D / 64; ++half) {  // 4 output tiles (64 dims) at a time
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int32_t ch = 0; ch < p_chunks; ++ch) {
      _tile_loadd(5, sc.p.data() + 32 * ch, stride * 2);
      const uint16_t* vt = vp + (static_cast<int64_t>(ch) * (D / 16) + 4 * half) * 512;
      _tile_loadd(7, vt, 64);
      _tile_dpbf16ps(0, 5, 7);
      _tile_loadd(7, vt + 512, 64);
      _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(7, vt + 1024, 64);
      _tile_dpbf16ps(2, 5, 7);
      _tile_loadd(7, vt + 1536, 64);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, sc.o, 256);
    _tile_stored(1, sc.o + 16, 256);
    _tile_stored(2, sc.o + 32, 256);
    _tile_stored(3, sc.o + 48, 256);
    for (int r = 0; r < rows; ++r) {
      uint16_t* orow = out + static_cast<int64_t>(i0 + r) * out_stride + 64 * half;
      const __m512 inv = _mm512_set1_ps(inv_sum[r]);
      for (int c = 0; c < 4; ++c) {
        const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(sc.o + 64 * r + 16 * c), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(o));
      }
    }
  }
}

// Rows i0.. (rows <= 16) of one query head: scores, softmax, weighted sum into out.
template <int D>
void attend_tile(const uint16_t* q, int64_t q_stride, const uint32_t* kp, const uint16_t* vp,
                 uint16_t* out, int64_t out_stride, int32_t i0, int32_t rows, float scale,
                 int64_t stride, Scratch& sc) {
  const int32_t p_chunks = (i0 + 16 + 31) / 32;  // 32-key chunks for the second product
  float inv_sum[16];
  scores_tile<D>(q, q_stride, kp, i0, rows, stride, sc);
  softmax_tile(i0, rows, 32 * p_chunks, scale, stride, sc, inv_sum);
  weighted_sum_tile<D>(vp, out, out_stride, i0, rows, p_chunks, stride, inv_sum, sc);
}

template <int D>
int prefill(const uint16_t* q, int64_t q_stride, const uint16_t* k, int64_t k_stride,
            const uint16_t* v, int64_t v_stride, uint16_t* out, int64_t out_stride, int32_t len,
            int32_t num_heads, int32_t num_kv_heads, float scale, int32_t num_threads) {
  const int32_t group = num_heads / num_kv_heads;
  const int32_t k_chunks = (len + 15) / 16, v_chunks = (len + 31) / 32;
  const int64_t kp_head = static_cast<int64_t>(k_chunks) * (D / 32) * 256;  // uint32 words
  const int64_t vp_head = static_cast<int64_t>(v_chunks) * (D / 16) * 512;  // bf16 elements
  uint32_t* kp = static_cast<uint32_t*>(std::aligned_alloc(64, num_kv_heads * kp_head * 4));
  uint16_t* vp = static_cast<uint16_t*>(std::aligned_alloc(64, num_kv_heads * vp_head * 2));
  if (kp == nullptr || vp == nullptr) {
    std::free(kp);
    std::free(vp);
    return 3;
  }
  const int32_t q_tiles = (len + 15) / 16;
  const int64_t stride = 32 * v_chunks + 32;  // score row length, room for the last 32-chunk
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t w = 0; w < static_cast<int64_t>(num_kv_heads) * std::max(k_chunks, v_chunks); ++w) {
      const int32_t kh = static_cast<int32_t>(w / std::max(k_chunks, v_chunks));
      const int32_t ch = static_cast<int32_t>(w % std::max(k_chunks, v_chunks));
      if (ch < k_chunks) pack_k<D>(k + kh * D, k_stride, len, ch, kp + kh * kp_head);
      if (ch < v_chunks) pack_v<D>(v + kh * D, v_stride, len, ch, vp + kh * vp_head);
    }  // implicit barrier: every tile is packed before any is read
    Scratch sc;
    sc.s.resize(16 * stride);
    sc.p.resize(16 * stride);
    minivllm::load_tile_config();
    // Longest tiles (last rows: most keys) first, one task at a time: the work is triangular.
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < static_cast<int64_t>(q_tiles) * num_heads; ++t) {
      const int32_t qt = q_tiles - 1 - static_cast<int32_t>(t / num_heads);
      const int32_t h = static_cast<int32_t>(t % num_heads), kh = h / group;
      const int32_t i0 = 16 * qt;
      attend_tile<D>(q + h * D, q_stride, kp + kh * kp_head, vp + kh * vp_head, out + h * D,
                     out_stride, i0, std::min(16, len - i0), scale, stride, sc);
    }
    _tile_release();
  }
  std::free(kp);
  std::free(vp);
  return 0;
}

}  // namespace

extern "C" {

int minivllm_has_prefill_amx() { return minivllm::amx_permitted() ? 1 : 0; }

// One prompt of len tokens: q [len, num_heads * d], k / v [len, num_kv_heads * d], out like q
// (rows *_stride elements apart, bf16); causal, every key its own prompt's. d = 64 or 128.
int minivllm_prefill_attention_bf16(const uint16_t* q, int64_t q_stride, const uint16_t* k,
                                    int64_t k_stride, const uint16_t* v, int64_t v_stride,
                                    uint16_t* out, int64_t out_stride, int32_t len,
                                    int32_t num_heads, int32_t num_kv_heads, int32_t head_size,
                                    float scale, int32_t num_threads) {
  if (len < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0) return 1;
  if (!minivllm::amx_permitted()) return 2;
  if (head_size == 64)
    return prefill<64>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, len, num_heads,
                       num_kv_heads, scale, num_threads);
  if (head_size == 128)
    return prefill<128>(q, q_stride, k, k_stride, v, v_stride, out, out_stride, len, num_heads,
                        num_kv_heads, scale, num_threads);
  return 1;
}

}  // extern "C"

#else

extern "C" {
int minivllm_has_prefill_amx() { return 0; }  // no AMX: prefills keep SDPA
int minivllm_prefill_attention_bf16(const uint16_t*, int64_t, const uint16_t*, int64_t,
                                    const uint16_t*, int64_t, uint16_t*, int64_t, int32_t, int32_t,
                                    int32_t, int32_t, float, int32_t) {
  return 2;
}
}  // extern "C"

#endif
