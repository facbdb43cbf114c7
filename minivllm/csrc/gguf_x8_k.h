// The x8 kernels (gguf_x8.h) of the 5-bit and K-quant types, AVX-512 VNNI builds only: Q5_0,
// Q5_1, Q4_K, Q5_K and Q6_K (Q4_K_M files are Q4_K + Q6_K, and Q5_0 where a row is not a
// multiple of 256). Included by gguf_x8.h inside its VNNI section.
//
// As there, one zmm holds 16 rows' int32 sums (one lane per row), x comes as the 32-element
// records of Activation::x8, and a group meets up to kX8Tokens tokens per pass. Every scale is a
// per-row vector built once per block or sub-block and shared by the pass's tokens:
//   Q5_0 / Q5_1 (32-element blocks): u = nibble | qh bit << 4 (qh bit i for element i);
//   Q4_K / Q5_K (256-element super-blocks of 8 sub-blocks of 32): w = d * sc_j * u - dmin * m_j,
//     sc_j, m_j the 6-bit scales decoded per lane; one x record per sub-block;
//   Q2_K, Q3_K, Q6_K (16 sub-blocks of 16, X8Sub16): w = d * sc_k * (u - o) (Q2_K: d * sc_k * u
//     - dmin * m_k) with u of 2, 3 or 6 bits; a record's halves sum in int32 (the offset term
//     from the record's int32 -o * sum(q): RowShape::x8_offset) and convert once.
#pragma once

namespace {

// vpmultishiftqb control for Q5's high bits: byte B of a qword takes the 8 bits of its lane's qh
// (lane B / 4 of the qword) from 4 below bit `base` + B % 4, so the byte's bit 4 is that qh bit
// (offsets wrap around the qword; only bit 4 is kept).
constexpr uint64_t x8_qh_control(int base) {
  uint64_t v = 0;
  for (int byte = 0; byte < 8; ++byte)
    v |= static_cast<uint64_t>((32 * (byte / 4) + base + byte % 4 - 4) & 63) << (8 * byte);
  return v;
}

// u | (bits & mask): one vpternlogd (A | (B & C)).
inline __m512i x8_or_masked(__m512i u, __m512i bits, int mask) {
  return _mm512_ternarylogic_epi32(u, bits, _mm512_set1_epi8(static_cast<char>(mask)), 0xF8);
}

// sums[mm] = sum over a record's 8 chunks c of unit(c) . the 4 bytes of x at xq[mm] + 4c
// (unit(c): 16 rows' 4 unsigned quants each). Under 4 tokens each keeps two chains, as
// x8_block_sums, so that vpdpbusd's latency stays hidden.
template <int MC, class Unit>
inline void x8_dot_chunks(Unit unit, const int8_t* const* xq, X8Int* sums) {
  constexpr bool kTwo = MC < 4;
  __m512i s1[kTwo ? MC : 1];
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) {
    sums[mm] = _mm512_setzero_si512();
    if constexpr (kTwo) s1[mm] = _mm512_setzero_si512();
  }
  #pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m512i u = unit(c);
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) {
      if (kTwo && c % 2) s1[mm] = dpbusd_bcast4(s1[mm], u, xq[mm] + 4 * c);
      else sums[mm] = dpbusd_bcast4(sums[mm], u, xq[mm] + 4 * c);
    }
  }
  if constexpr (kTwo) {
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) sums[mm] = _mm512_add_epi32(sums[mm], s1[mm]);
  }
}

// acc[mm] += a * dx * sums[mm] + bw * b, dx and b the floats of token mm's record (b: its
// x8_b * S term).
template <int MC>
inline void x8_scale_add(const X8Int* sums, __m512 a, __m512 bw, const int8_t* const* xq,
                         X8Acc* acc) {
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) {
    const float* f = reinterpret_cast<const float*>(xq[mm] + 32);
    acc[mm] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[mm]),
                              _mm512_mul_ps(a, _mm512_set1_ps(f[0])), acc[mm]);
    acc[mm] = _mm512_fmadd_ps(bw, _mm512_set1_ps(f[1]), acc[mm]);
  }
}

// Ends a sub-block for the scheduler (an empty asm on each v[mm]): GCC otherwise interleaves a
// fully unrolled super-block's sub-blocks and spills their sums. By default for 4 tokens or
// fewer only (with more, the interleaving pays where the units' decoding is the smaller part);
// kAnyCount: for every count.
template <int MC, bool kAnyCount = false, class V>
inline void x8_fence(V* v) {
  if constexpr (kAnyCount || MC <= 4) {
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm) __asm__ volatile("" : "+v"(v[mm]));
  }
}

// Part `part` of `parts` of the lines 2 * kX8Ahead bytes past a block of `bytes` at p, into L2.
// A K-quant super-block's group is 21-53 lines, read out of order (Q6_K: its d and scales at
// the end first); into L1 and 4 KiB ahead, as the legacy kernels prefetch, Q6_K streamed 13 GB/s
// from DRAM on two threads (a [16384, 2048] weight x 1 row, 8 of them in turn), 20 this way;
// Q4_K 31 -> 39, Q3_K 23 -> 26 (noisy; never worse). Spread over the super-block's 8 records.
inline void x8_prefetch(const uint8_t* p, int bytes, int part = 0, int parts = 1) {
  const int lines = (bytes + 63) / 64;
  for (int l = lines * part / parts; l < lines * (part + 1) / parts; ++l)
    _mm_prefetch(reinterpret_cast<const char*>(p + 2 * kX8Ahead + 64 * l), _MM_HINT_T1);
}

// Token mm's record of block b: xq[mm] = rec + mm * rec_stride + b * kX8Record.
template <int MC>
inline void x8_records(const uint8_t* rec, int64_t rec_stride, int64_t b, const int8_t** xq) {
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm)
    xq[mm] = reinterpret_cast<const int8_t*>(rec + mm * rec_stride + b * kX8Record);
}

// Q5_0 / Q5_1: a group block is d[16] (Q5_1: m[16]), qh[16] (4 bytes), then 4 quant chunks.
// b term: Q5_0 -16 * d * S (the record's x8_b = -16), Q5_1 m * S.
template <int Q, int MC>
void x8_dot_group_q5(const uint8_t* g, int64_t nb, const uint8_t* rec, int64_t rec_stride,
                     X8Acc* out) {
  constexpr int kH = 2 * kX8Rows * x8_units(Q).lead2, kGroupBlock = kX8Rows * x8_block_bytes(Q);
  const __m512i low = _mm512_set1_epi8(0x0F);
  X8Acc acc[MC];
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) acc[mm] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = g + b * kGroupBlock;
    x8_prefetch(p, kGroupBlock);
    const __m512 d = x8_fp16(p), bw = Q == kQ5_1 ? x8_fp16(p + 2 * kX8Rows) : d;
    const __m512i qh = _mm512_loadu_si512(p + kH);
    const uint8_t* quants = p + kH + 4 * kX8Rows;
    // chunk c < 4: elements 4c.. (low nibbles), c >= 4: 16 + 4(c - 4).. (high); qh bit = element
    const auto unit = [&](int c) {
      const __m512i w = _mm512_loadu_si512(quants + 64 * (c % 4));
      const __m512i nib = _mm512_and_si512(c < 4 ? w : _mm512_srli_epi16(w, 4), low);
      const __m512i hb = _mm512_multishift_epi64_epi8(
          _mm512_set1_epi64(static_cast<long long>(x8_qh_control(4 * c))), qh);
      return x8_or_masked(nib, hb, 0x10);
    };
    const int8_t* xq[MC];
    x8_records<MC>(rec, rec_stride, b, xq);
    X8Int sums[MC];
    x8_dot_chunks<MC>(unit, xq, sums);
    x8_scale_add<MC>(sums, d, bw, xq, acc);
  }
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) out[mm] = acc[mm];
}

// Q4_K / Q5_K: a group block is d[16], dmin[16], 3 chunks of scale bytes, (Q5_K: 8 qh chunks),
// 32 quant chunks. Sub-block j (32 elements) is the low (even j) or high nibbles of quant
// chunks 8 (j / 2).. + 8, its x one record; Q5_K's bit 4 is bit j of qh chunk c's bytes.
template <int Q, int MC>
void x8_dot_group_k45(const uint8_t* g, int64_t nsb, const uint8_t* rec, int64_t rec_stride,
                      X8Acc* out) {
  constexpr int kGroupBlock = kX8Rows * x8_block_bytes(Q), kScales = 4 * kX8Rows;
  constexpr int kQh = kScales + 12 * kX8Rows, kQs = kQh + (Q == kQ5_K ? 32 * kX8Rows : 0);
  const __m512i low = _mm512_set1_epi8(0x0F), six = _mm512_set1_epi32(63);
  const __m512i four = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
  X8Acc acc[MC];
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) acc[mm] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = g + sb * kGroupBlock;
    const __m512 d = x8_fp16(p), mdmin = _mm512_sub_ps(_mm512_setzero_ps(),
                                                         x8_fp16(p + 2 * kX8Rows));
    const __m512i s0 = _mm512_loadu_si512(p + kScales), s1 = _mm512_loadu_si512(p + kScales + 64);
    const __m512i s2 = _mm512_loadu_si512(p + kScales + 128);
    #pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      x8_prefetch(p, kGroupBlock, j, 8);
      // ggml's 6-bit scale and min of sub-block j, from the row's 12 scale bytes s0|s1|s2
      __m512i sc, mn;
      if (j < 4) {
        sc = _mm512_and_si512(_mm512_srli_epi32(s0, 8 * j), six);
        mn = _mm512_and_si512(_mm512_srli_epi32(s1, 8 * j), six);
      } else {
        const int t = 8 * (j - 4);
        sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, t), four),
                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, t + 6), two),
                                               4));
        mn = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, t + 4), four),
                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, t + 6), two),
                                               4));
      }
      const __m512 a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      const __m512 bw = _mm512_mul_ps(mdmin, _mm512_cvtepi32_ps(mn));
      const auto unit = [&](int c) {
        const __m512i w = _mm512_loadu_si512(p + kQs + 64 * (8 * (j / 2) + c));
        const __m512i nib = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(w, 4) : w, low);
        if constexpr (Q == kQ4_K) {
          return nib;
        } else {
          const __m512i qh = _mm512_loadu_si512(p + kQh + 64 * c);
          return x8_or_masked(nib, j <= 4 ? _mm512_slli_epi16(qh, 4 - j)
                                          : _mm512_srli_epi16(qh, j - 4), 0x10);
        }
      };
      const int8_t* xq[MC];
      x8_records<MC>(rec, rec_stride, 8 * sb + j, xq);
      X8Int sums[MC];
      x8_dot_chunks<MC>(unit, xq, sums);
      x8_scale_add<MC>(sums, a, bw, xq, acc);   // the records' x8_b is 1: bw * dx * S
      x8_fence<MC>(acc);
    }
  }
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) out[mm] = acc[mm];
}

// The types of 16-element sub-blocks (Q2_K, Q3_K, Q6_K): sub-block k = 2r + t is half t of the
// super-block's 32-element record r; unit(r, t, c) holds its elements 16t + 4c.. of record r for
// the group's 16 rows; scale(k) its per-row int32 scale; d the rows' super-block scale. A half's
// integer sum starts at the record's int32 b term (-o * sum(q), kOffsetInSums) or, for Q2_K,
// whose min term has its own scale, at 0 (mins(k): -dmin * m_k, times the record's float term).
template <int Q>
struct X8Sub16;

// Q2_K: 4 chunks of scale bytes (low nibble scale, high min), 16 qs chunks, d[16], dmin[16].
// Record r = 4h + j is bits 2j, 2j + 1 of qs bytes 32h..: w = d * sc * u - dmin * m.
template <>
struct X8Sub16<kQ2_K> {
  static constexpr bool kOffsetInSums = false;
  __m512 d, mdmin;
  explicit X8Sub16(const uint8_t* p)
      : d(x8_fp16(p + 80 * kX8Rows)),
        mdmin(_mm512_sub_ps(_mm512_setzero_ps(), x8_fp16(p + 82 * kX8Rows))) {}
  __m512i scale(const uint8_t* p, int k) const {
    const __m512i c = _mm512_loadu_si512(p + 64 * (k / 4));
    return _mm512_and_si512(_mm512_srli_epi32(c, 8 * (k % 4)), _mm512_set1_epi32(15));
  }
  __m512 mins(const uint8_t* p, int k) const {
    const __m512i c = _mm512_loadu_si512(p + 64 * (k / 4));
    const __m512i mn = _mm512_and_si512(_mm512_srli_epi32(c, 8 * (k % 4) + 4),
                                        _mm512_set1_epi32(15));
    return _mm512_mul_ps(mdmin, _mm512_cvtepi32_ps(mn));
  }
  __m512i unit(const uint8_t* p, int r, int t, int c) const {
    const __m512i w = _mm512_loadu_si512(p + 16 * kX8Rows + 64 * (8 * (r / 4) + 4 * t + c));
    return _mm512_and_si512(_mm512_srli_epi16(w, 2 * (r % 4)), _mm512_set1_epi8(3));
  }
};

// Q3_K: 8 hmask chunks, 16 qs chunks, 3 chunks of scale bytes (16 6-bit scales, offset 32),
// d[16]. Record r = 4h + j: u = bits 2j.. of qs bytes 32h.. | hmask bit 4h + j << 2, and
// w = d * (sc - 32) * (u - 4).
template <>
struct X8Sub16<kQ3_K> {
  static constexpr bool kOffsetInSums = true;
  __m512 d;
  explicit X8Sub16(const uint8_t* p) : d(x8_fp16(p + 108 * kX8Rows)) {}
  __m512i scale(const uint8_t* p, int k) const {
    // ggml's unpacking: low 4 bits from byte k % 8 of bytes 0..7 (high nibble from k / 8), high
    // 2 bits from byte k % 4 of bytes 8..11 (bits 2 (k / 4)..)
    const __m512i lo = _mm512_loadu_si512(p + 96 * kX8Rows + 64 * ((k / 4) % 2));
    const __m512i hi = _mm512_loadu_si512(p + 96 * kX8Rows + 128);
    const int b = 8 * (k % 4);
    const __m512i sc = _mm512_or_si512(
        _mm512_and_si512(_mm512_srli_epi32(lo, b + 4 * (k / 8)), _mm512_set1_epi32(15)),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, b + 2 * (k / 4)),
                                           _mm512_set1_epi32(3)), 4));
    return _mm512_sub_epi32(sc, _mm512_set1_epi32(32));
  }
  __m512i unit(const uint8_t* p, int r, int t, int c) const {
    const __m512i w = _mm512_loadu_si512(p + 32 * kX8Rows + 64 * (8 * (r / 4) + 4 * t + c));
    const __m512i q = _mm512_and_si512(_mm512_srli_epi16(w, 2 * (r % 4)), _mm512_set1_epi8(3));
    const __m512i hm = _mm512_loadu_si512(p + 64 * (4 * t + c));
    const int bit = r;  // 4h + j
    return x8_or_masked(q, bit >= 2 ? _mm512_srli_epi16(hm, bit - 2)
                                    : _mm512_slli_epi16(hm, 2 - bit), 0x04);
  }
};

// Q6_K: 32 ql chunks, 16 qh chunks, 4 chunks of int8 scales, then d[16]. Record r = 4h + s is
// the low (s < 2) or high nibbles of ql chunks 16h + 8 (s % 2).. with bits 2s, 2s + 1 of qh
// chunks 8h..: w = d * sc * (u - 32).
template <>
struct X8Sub16<kQ6_K> {
  static constexpr bool kOffsetInSums = true;
  __m512 d;
  explicit X8Sub16(const uint8_t* p) : d(x8_fp16(p + 208 * kX8Rows)) {}
  __m512i scale(const uint8_t* p, int k) const {
    const __m512i sc8 = _mm512_loadu_si512(p + 192 * kX8Rows + 64 * (k / 4));
    return _mm512_srai_epi32(_mm512_slli_epi32(sc8, 24 - 8 * (k % 4)), 24);
  }
  __m512i unit(const uint8_t* p, int r, int t, int c) const {
    const int h = r / 4, s = r % 4, cc = 4 * t + c;
    const __m512i w = _mm512_loadu_si512(p + 64 * (16 * h + 8 * (s % 2) + cc));
    const __m512i nib = _mm512_and_si512(s < 2 ? w : _mm512_srli_epi16(w, 4),
                                         _mm512_set1_epi8(0x0F));
    const __m512i qh = _mm512_loadu_si512(p + 128 * kX8Rows + 64 * (8 * h + cc));
    return x8_or_masked(nib, s < 3 ? _mm512_slli_epi16(qh, 4 - 2 * s)
                                   : _mm512_srli_epi16(qh, 2), 0x30);
  }
};

// One half record (sub-block k = 2r + t) of a 16-element sub-block type for MC tokens:
// isum[mm] += scale(k) * (the record's b term, or 0, + sum of u * q), and Q2_K's min term.
template <int Q, int MC>
inline void x8_sub16_half(const X8Sub16<Q>& st, const uint8_t* p, int r, int t,
                          const int8_t* const* xq, X8Int* isum, X8Acc* acc) {
  X8Int sums[MC];
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm)
    sums[mm] = X8Sub16<Q>::kOffsetInSums
                   ? _mm512_set1_epi32(reinterpret_cast<const int32_t*>(xq[mm] + 40)[t])
                   : _mm512_setzero_si512();
  #pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512i u = st.unit(p, r, t, c);
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm)
      sums[mm] = dpbusd_bcast4(sums[mm], u, xq[mm] + 16 * t + 4 * c);
  }
  const __m512i sc = st.scale(p, 2 * r + t);
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm)
    isum[mm] = _mm512_add_epi32(isum[mm], _mm512_mullo_epi32(sums[mm], sc));
  if constexpr (!X8Sub16<Q>::kOffsetInSums) {
    const __m512 bw = st.mins(p, 2 * r + t);
    #pragma GCC unroll 8
    for (int mm = 0; mm < MC; ++mm)
      acc[mm] = _mm512_fmadd_ps(bw, _mm512_set1_ps(reinterpret_cast<const float*>(xq[mm] + 40)[t]),
                                acc[mm]);
  }
  // Q3_K / Q6_K fence every count. With the integer sums, Q6_K on Zen 4 ([4096, 2048] weights
  // past L3, 2 threads): 1 token 19 -> 36 GB/s, 4 tokens 90 -> 140 GMAC/s, 8 tokens 127 -> 176.
  x8_fence<MC, X8Sub16<Q>::kOffsetInSums>(isum);
}

// A group of a 16-element sub-block type: each record's two halves summed in int32 (|sum| <
// 2^21: Q6_K 2 x 128 x 16 x 32 x 127), then d * dx * that into the fp32 sums: the plain
// layout's int8 products, one conversion per record instead of two scale FMAs per half.
template <int Q, int MC>
void x8_dot_group_sub16(const uint8_t* g, int64_t nsb, const uint8_t* rec, int64_t rec_stride,
                        X8Acc* out) {
  constexpr int kGroupBlock = kX8Rows * x8_block_bytes(Q);
  X8Acc acc[MC];
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) acc[mm] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = g + sb * kGroupBlock;
    const X8Sub16<Q> st(p);
    #pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      x8_prefetch(p, kGroupBlock, r, 8);
      const int8_t* xq[MC];
      x8_records<MC>(rec, rec_stride, 8 * sb + r, xq);
      X8Int isum[MC];
      #pragma GCC unroll 8
      for (int mm = 0; mm < MC; ++mm) isum[mm] = _mm512_setzero_si512();
      x8_sub16_half<Q, MC>(st, p, r, 0, xq, isum, acc);
      x8_sub16_half<Q, MC>(st, p, r, 1, xq, isum, acc);
      #pragma GCC unroll 8
      for (int mm = 0; mm < MC; ++mm) {
        const float dx = reinterpret_cast<const float*>(xq[mm] + 32)[0];
        acc[mm] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[mm]),
                                  _mm512_mul_ps(st.d, _mm512_set1_ps(dx)), acc[mm]);
      }
    }
  }
  #pragma GCC unroll 8
  for (int mm = 0; mm < MC; ++mm) out[mm] = acc[mm];
}

// The kernel of type Q (a 5-bit or K-quant type) for its blocks: nb counts 32-element records
// (8 per super-block).
template <int Q, int MC>
inline void x8_dot_group_k(const uint8_t* g, int64_t nb, const uint8_t* rec, int64_t rec_stride,
                           X8Acc* out) {
  if constexpr (Q == kQ5_0 || Q == kQ5_1) x8_dot_group_q5<Q, MC>(g, nb, rec, rec_stride, out);
  else if constexpr (Q == kQ4_K || Q == kQ5_K)
    x8_dot_group_k45<Q, MC>(g, nb / 8, rec, rec_stride, out);
  else x8_dot_group_sub16<Q, MC>(g, nb / 8, rec, rec_stride, out);
}

}  // namespace
