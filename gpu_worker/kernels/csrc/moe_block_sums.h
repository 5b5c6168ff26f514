// The block sums of fused_moe.cpp, in its three paths over the same packed weights and input
// tiles (amx_tiles.h's layout): "amx" (TDPBF16PS tiles), "avx512_bf16" (vdpbf16ps) and
// "portable" (plain C++ in vdpbf16ps's order). fused_moe.cpp's header comment says how their
// bits compare; kernel_for picks one, for_each_item runs a region's work items on it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "kernel_common.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace trident_kernels::moe {

namespace amx = trident_kernels::amx;
using amx::kBlockChunkElements;
using amx::kBlockColumns;
using amx::kChunk;
using amx::kTileElements;
using amx::kTileRows;

enum class Path { kAmx, kAvx512Bf16, kPortable };

// ---- Block sums: one 32-column block of packed weights for `rows` (1..32) rows of input tiles
// into sums [32][32] float32 (rows past `rows` are left undefined). x_a / x_b: the first input
// tile of rows 0-15 / 16-31.

inline void portable_block_sums(const uint16_t* x_a, const uint16_t* x_b, int64_t rows, const uint16_t* block,
                                int64_t chunks, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* x = (r < kTileRows ? x_a : x_b) + (r % kTileRows) * kChunk;
    float* acc = sums + r * kBlockColumns;
    std::fill(acc, acc + kBlockColumns, 0.f);
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      const uint16_t* xc = x + chunk * kTileElements;
      for (int64_t p = 0; p < kChunk / 2; ++p) {
        const float x_even = widen(Bf16Bits{xc[2 * p]}), x_odd = widen(Bf16Bits{xc[2 * p + 1]});
        for (int64_t tile = 0; tile < 2; ++tile) {
          const uint16_t* w = block + chunk * kBlockChunkElements + tile * kTileElements + p * kChunk;
          float* a = acc + tile * amx::kTileColumns;
#pragma omp simd
          for (int64_t c = 0; c < amx::kTileColumns; ++c) {
            const float odd = a[c] + x_odd * widen(Bf16Bits{w[2 * c + 1]});
            a[c] = odd + x_even * widen(Bf16Bits{w[2 * c]});
          }
        }
      }
    }
  }
}

#ifdef __AVX512F__
#pragma GCC push_options
#pragma GCC target("avx512bf16")

// kRows rows from `x` (rows of an input tile, kChunk apart), each into its row of `sums`.
template <int kRows>
inline void avx512_bf16_rows(const uint16_t* x, const uint16_t* block, int64_t chunks, float* sums) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const uint16_t* weights = block + chunk * kBlockChunkElements;
    const uint16_t* xc = x + chunk * kTileElements;
    for (int64_t p = 0; p < kChunk / 2; ++p) {
      const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(weights + p * kChunk);
      const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(weights + kTileElements + p * kChunk);
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, xc + r * kChunk + 2 * p, sizeof(pair));
        const __m512bh x_pair = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x_pair, w_lo);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x_pair, w_hi);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(sums + r * kBlockColumns, acc[r][0]);
    _mm512_storeu_ps(sums + r * kBlockColumns + amx::kTileColumns, acc[r][1]);
  }
}

// Up to 8 rows at a time (16 accumulators): each line of weights loaded serves them all.
inline void avx512_bf16_block_sums(const uint16_t* x_a, const uint16_t* x_b, int64_t rows, const uint16_t* block,
                                   int64_t chunks, float* sums) {
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const uint16_t* x = (r0 < kTileRows ? x_a : x_b) + (r0 % kTileRows) * kChunk;
    float* s = sums + r0 * kBlockColumns;
    const int64_t left = rows - r0;
    if (left >= 8) {
      avx512_bf16_rows<8>(x, block, chunks, s);
    } else if (left >= 4) {
      avx512_bf16_rows<4>(x, block, chunks, s);
      if (left > 4) avx512_bf16_rows<4>(x + 4 * kChunk, block, chunks, s + 4 * kBlockColumns);
    } else {
      for (int64_t r = 0; r < left; ++r) avx512_bf16_rows<1>(x + r * kChunk, block, chunks, s + r * kBlockColumns);
    }
  }
}

#pragma GCC pop_options
#endif

#ifdef TRIDENT_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

inline void amx_block_sums(const uint16_t* x_a, const uint16_t* x_b, int64_t rows, const uint16_t* block,
                           int64_t chunks, float* sums) {
  if (rows > kTileRows) {
    amx::block_sums<true>(x_a, x_b, block, chunks, sums);
  } else {
    amx::block_sums<false>(x_a, nullptr, block, chunks, sums);
  }
}

inline void amx_load_tiles() {
  amx::load_tile_config();
}

inline void amx_release_tiles() { _tile_release(); }

#pragma GCC pop_options
#endif

using BlockSums = void (*)(const uint16_t*, const uint16_t*, int64_t, const uint16_t*, int64_t, float*);

struct Kernel {
  BlockSums sums;
  bool tiles;  // AMX: each thread loads the tile configuration before its sums, and releases it after
};

inline Kernel kernel_for(Path path) {
  switch (path) {
#ifdef TRIDENT_AMX
    case Path::kAmx: return {&amx_block_sums, true};
#endif
#ifdef __AVX512F__
    case Path::kAvx512Bf16: return {&avx512_bf16_block_sums, false};
#endif
    default: return {&portable_block_sums, false};
  }
}

// Runs body(item) for items [0, n), claimed one at a time by the region's threads; on the AMX
// path each claim has the tile configuration loaded.
template <typename Body>
inline void for_each_item(const Kernel& kernel, int64_t n, const Body& body) {
  trident_kernels::parallel_for_claimed(n, 1, [&](int64_t begin, int64_t end) {
#ifdef TRIDENT_AMX
    if (kernel.tiles) amx_load_tiles();
#endif
    for (int64_t item = begin; item < end; ++item) body(item);
#ifdef TRIDENT_AMX
    if (kernel.tiles) amx_release_tiles();
#endif
  });
}

}  // namespace trident_kernels::moe
