// GGUF block formats (scalar, portable): every supported type decoded into one common form.
//
// Each block (32 elements for the legacy types, a 256-element super-block for the K-quants)
// becomes unsigned integers u[i] (0..255) and, per 16 elements, an fp32 pair (a, b) with
// x[i] = a * u[i] + b. Signed types shift their quants up (Q4_0: u = q + 8, b = -8a; Q8_0:
// u = q + 128), so the int8 dot kernels can use u8 x s8 products. a and b are formed exactly as
// gguf-py's dequantizers form their factors, and every product a * u is exact in fp32 except
// Q6_K's, so fma(a, u, b) reproduces gguf-py's result bit for bit (Q6_K: one rounding of
// a * (u - 32), as gguf-py's a * q).
#pragma once

#include <cstdint>
#include <cstring>

namespace minivllm::gguf {

// GGMLQuantizationType values.
enum QType : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
};

// Every block type with a kernel, for the type switches that instantiate one template per type.
#define MINIVLLM_GGUF_BLOCK_TYPES(X) \
  X(kQ4_0) X(kQ4_1) X(kQ5_0) X(kQ5_1) X(kQ8_0) X(kQ2_K) X(kQ3_K) X(kQ4_K) X(kQ5_K) X(kQ6_K)

struct Geometry {
  int elems;  // elements per block
  int bytes;  // bytes per block
};

// {0, 0}: not supported.
inline Geometry geometry(int qtype) {
  switch (qtype) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ2_K: return {256, 84};
    case kQ3_K: return {256, 110};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline float half_at(const uint8_t* p) {  // little-endian IEEE fp16 -> fp32 (exact)
  _Float16 h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 6-bit (scale, min) pair j < 8 of a Q4_K / Q5_K super-block's 12 scale bytes.
inline void scale_min_k4(const uint8_t* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The 16 signed 6-bit scales of a Q3_K super-block (scale bytes at s).
inline int scale_q3k(const uint8_t* s, int i) {
  const int lo = (s[i % 8] >> (4 * (i / 8))) & 0x0F;
  const int hi = (s[8 + i % 4] >> (2 * (i / 4))) & 0x03;
  return (lo | (hi << 4)) - 32;
}

// a[16], b[16] of one K-quant super-block (per 16 elements).
inline void k_scales(int qtype, const uint8_t* blk, float* a, float* b) {
  switch (qtype) {
    case kQ2_K: {
      const float d = half_at(blk + 80), dmin = half_at(blk + 82);
      for (int i = 0; i < 16; ++i) {
        a[i] = d * static_cast<float>(blk[i] & 0x0F);
        b[i] = -(dmin * static_cast<float>(blk[i] >> 4));
      }
      break;
    }
    case kQ3_K: {
      const float d = half_at(blk + 108);
      for (int i = 0; i < 16; ++i) {
        a[i] = d * static_cast<float>(scale_q3k(blk + 96, i));
        b[i] = -4.0f * a[i];
      }
      break;
    }
    case kQ4_K:
    case kQ5_K: {
      const float d = half_at(blk), dmin = half_at(blk + 2);
      for (int j = 0; j < 8; ++j) {
        int sc, mn;
        scale_min_k4(blk + 4, j, &sc, &mn);
        a[2 * j] = a[2 * j + 1] = d * static_cast<float>(sc);
        b[2 * j] = b[2 * j + 1] = -(dmin * static_cast<float>(mn));
      }
      break;
    }
    default: {  // kQ6_K
      const float d = half_at(blk + 208);
      for (int i = 0; i < 16; ++i) {
        a[i] = d * static_cast<float>(static_cast<int8_t>(blk[192 + i]));
        b[i] = -32.0f * a[i];
      }
    }
  }
}

// u[256] of one K-quant super-block.
inline void k_quants(int qtype, const uint8_t* blk, uint8_t* u) {
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, g = (i % 128) / 32, l = i % 32;  // half, 32-group in it, lane
    const int j = i / 32, c = i / 64, hi = (i / 32) % 2;   // 32-group, 64-chunk, upper half
    switch (qtype) {
      case kQ2_K: u[i] = (blk[16 + 32 * h + l] >> (2 * g)) & 3; break;
      case kQ3_K:
        u[i] = ((blk[32 + 32 * h + l] >> (2 * g)) & 3) + 4 * ((blk[l] >> j) & 1);
        break;
      case kQ4_K: u[i] = (blk[16 + 32 * c + l] >> (4 * hi)) & 0x0F; break;
      case kQ5_K:
        u[i] = ((blk[48 + 32 * c + l] >> (4 * hi)) & 0x0F) | (((blk[16 + l] >> j) & 1) << 4);
        break;
      default: {  // kQ6_K: nibbles of ql[64h + 32(g % 2) + l], 2 bits of qh[32h + l]
        const int nib = (blk[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 0x0F;
        u[i] = nib | (((blk[128 + 32 * h + l] >> (2 * g)) & 3) << 4);
      }
    }
  }
}

// u[32], a[2], b[2] of one legacy block.
inline void legacy_block(int qtype, const uint8_t* blk, uint8_t* u, float* a, float* b) {
  const float d = half_at(blk);
  const bool has_min = qtype == kQ4_1 || qtype == kQ5_1;
  if (qtype == kQ8_0) {
    for (int i = 0; i < 32; ++i) u[i] = blk[2 + i] ^ 0x80;  // int8 q -> q + 128
  } else {
    const bool five = qtype == kQ5_0 || qtype == kQ5_1;
    const int qh_at = has_min ? 4 : 2, qs_at = qh_at + (five ? 4 : 0);
    const uint32_t qh = five ? u32_at(blk + qh_at) : 0;
    for (int i = 0; i < 16; ++i) {
      u[i] = (blk[qs_at + i] & 0x0F) | (((qh >> i) & 1) << 4);
      u[i + 16] = (blk[qs_at + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    }
  }
  const float offset = qtype == kQ4_0 ? -8.0f : qtype == kQ5_0 ? -16.0f : -128.0f;
  a[0] = a[1] = d;
  b[0] = b[1] = has_min ? half_at(blk + 2) : offset * d;
}

// One block of any supported type: u[elems], a[elems / 16], b[elems / 16].
inline void decode_block(int qtype, const uint8_t* blk, uint8_t* u, float* a, float* b) {
  if (geometry(qtype).elems == 32) {
    legacy_block(qtype, blk, u, a, b);
  } else {
    k_scales(qtype, blk, a, b);
    k_quants(qtype, blk, u);
  }
}

}  // namespace minivllm::gguf
