// AMX helpers shared by the tile kernels (header-only; include only where __AMX_TILE__,
// __AMX_BF16__ and __AVX512BF16__ are defined).
#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace minivllm {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux hands out AMX's 8 KB tile state only on request, once per process.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// Every tile register (0-7) as 16 rows of 64 bytes, the only shape the kernels use.
inline void load_tile_config() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  // GCC (12) does not treat ldtilecfg as a read of cfg: where this function was not inlined it
  // dropped the stores above as dead and ldtilecfg read stack garbage (SIGSEGV, a #GP). The
  // empty asm that may read all memory keeps them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// In place: r[i] lane j <-> r[j] lane i (16 x 16 32-bit elements, 32 shuffles).
// NOTE: fully unrolled and inlined; as a loop the compiler spilled the 48 vectors (pack: 6 vs 2 us).
__attribute__((always_inline)) inline void transpose16x16(__m512i* r) {
  __m512i t[16], u[16];
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    t[i + 2] = _mm512_unpacklo_epi32(r[i + 2], r[i + 3]);
    t[i + 3] = _mm512_unpackhi_epi32(r[i + 2], r[i + 3]);
    // u[i + j]: 128-bit lane L holds column 4L + j of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {  // 4 x 4 transpose of 128-bit lanes across row groups
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// One AMX "B" tile from `count` (<= 16) bf16 rows of 32 elements, `stride` elements apart:
// tile row p holds (row_i[2p], row_i[2p + 1]) for i < 16 (rows past count: zero), i.e. the
// rows' 32-bit transpose. x^T for a GEMM, K^T for attention scores.
inline void pack_b_tile(const uint16_t* rows, int64_t stride, int64_t count, uint32_t* tile) {
  __m512i r[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i)
    r[i] = i < count ? _mm512_loadu_si512(rows + i * stride) : _mm512_setzero_si512();
  transpose16x16(r);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + 16 * i, r[i]);
}

}  // namespace minivllm
