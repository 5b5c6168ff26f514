// The AMX-INT8 tile of csrc/quant_linear.cpp: 16 input rows of one panel of 16 output columns,
// for every layout (U4, I8, I5, I6), with the same bits as the AVX512-VNNI tile.
//
// A panel's packed codes are already AMX's B layout: "16 columns x 4 consecutive k in each 64
// bytes" is one row of an int8 B tile, so a block of 32 k is a B tile of 8 rows (4 for a block
// of 16). I8's codes (c + 128) are read in place; U4's nibbles, I5's nibbles and fifth bits and
// I6's nibbles and top bits are decoded into the same unsigned bytes the VNNI tile makes, once
// a panel (decode_panel) for all the tiles of 16 rows that the caller runs on it. The A tile is
// the 16 rows' int8 codes of the block, read in place (`k` bytes apart). TDPBSUD multiplies
// signed A by unsigned B into int32 sums.
//
// Same bits as the VNNI tile: each block's int32 dot per row and column is exact whichever
// instruction sums it, and the float operations after it are the VNNI tile's, in its order
// (subtract the storage bias times the block's code sum, then acc += (sw * sx) * dot, then for
// U4 acc += mw * sum32), one block after the other. So a call may use this tile for some rows
// and the VNNI tile for the rest and no row's bits change.
#pragma once

#include "amx_tiles.h"
#include "int8_activations.h"

#include <cstdint>
#include <cstring>

namespace trident_kernels::amx_int8 {

constexpr int64_t kTileRows = 16;

inline bool cpu_has_amx_int8() {
#if defined(TRIDENT_AMX) && defined(__AVX512F__)
  return __builtin_cpu_supports("amx-int8") && __builtin_cpu_supports("amx-tile") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
         amx::request_amx_permission();
#else
  return false;
#endif
}

#if defined(TRIDENT_AMX) && defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni")

// Tiles 0-1 and 6-7: the int32 dots of two pairs of blocks in flight; 2-3: a pair's A tiles
// (16 rows x kBlock int8); 4-5: its B tiles (kBlock / 4 rows x 64 bytes).
// The configuration is a static: GCC's _tile_loadconfig tells the compiler it reads 8 bytes
// only, so the stores of a configuration on the stack may be dropped.
struct alignas(64) Int8TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit Int8TileConfig(int64_t block) {
    for (int t = 0; t < 2; ++t) {
      colsb[t] = 64;
      rows[t] = kTileRows;
      colsb[2 + t] = static_cast<uint16_t>(block);
      rows[2 + t] = kTileRows;
      colsb[4 + t] = 64;
      rows[4 + t] = static_cast<uint8_t>(block / 4);
      colsb[6 + t] = 64;
      rows[6 + t] = kTileRows;
    }
  }
};

template <int64_t kBlock>
void configure_tiles() {
  static const Int8TileConfig config(kBlock);
  _tile_loadconfig(&config);
}

// Gives the tile state back (as amx_linear.cpp does), so that a thread that leaves the kernel
// does not carry 8 KB of it through every context switch.
inline void release_tiles() { _tile_release(); }

// Block b's B tile, decoded at `scratch` (kBlock / 4 x 64 bytes); I8's needs none.
template <int64_t kLayout, int64_t kBlock>
inline void weight_tile(const uint8_t* wb, uint8_t* scratch) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if constexpr (kLayout == 0 || kLayout == 2) {  // U4, I5: low nibbles k 0..15, high k 16..31
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(wb + 64 * g);
      __m512i lo = _mm512_and_si512(v, nibble);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      if constexpr (kLayout == 2) {
        const __m512i sixteen = _mm512_set1_epi8(0x10);
        uint64_t low_mask, high_mask;
        std::memcpy(&low_mask, wb + 256 + 16 * g, 8);
        std::memcpy(&high_mask, wb + 256 + 16 * g + 8, 8);
        lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(low_mask), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(high_mask), hi, sixteen);
      }
      _mm512_store_si512(scratch + 64 * g, lo);
      _mm512_store_si512(scratch + 64 * (4 + g), hi);
    }
  } else if constexpr (kLayout == 3) {  // I6 (block 16): as the VNNI tile's six_bit_codes
    const __m512i a = _mm512_loadu_si512(wb), b = _mm512_loadu_si512(wb + 64), top = _mm512_loadu_si512(wb + 128);
    const __m512i top_bits = _mm512_set1_epi8(0x30);
    _mm512_store_si512(scratch,
                       _mm512_or_si512(_mm512_and_si512(a, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 4), top_bits)));
    _mm512_store_si512(scratch + 64,
                       _mm512_or_si512(_mm512_and_si512(b, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 2), top_bits)));
    _mm512_store_si512(scratch + 128, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), nibble),
                                                      _mm512_and_si512(top, top_bits)));
    _mm512_store_si512(scratch + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), nibble),
                                                      _mm512_and_si512(_mm512_srli_epi16(top, 2), top_bits)));
  }
}

// The int32 dots of one block or two into tiles 0-1 (kOdd false) or 6-7: A tiles 2 and 3 from
// `a` (`a_stride` bytes a row, the next block kBlock bytes on), B tiles 4 and 5 from `b`
// (`b_stride` bytes a block). GCC's tile intrinsics take literal tile numbers only.
template <bool kOdd, int64_t kBlock>
inline void dot_pair(const int8_t* a, int64_t a_stride, const uint8_t* b, int64_t b_stride, bool two) {
  _tile_loadd(2, a, a_stride);
  _tile_loadd(4, b, 64);
  if (two) {
    _tile_loadd(3, a + kBlock, a_stride);
    _tile_loadd(5, b + b_stride, 64);
  }
  if constexpr (kOdd) {
    _tile_zero(6);
    _tile_dpbsud(6, 2, 4);
    if (two) {
      _tile_zero(7);
      _tile_dpbsud(7, 3, 5);
    }
  } else {
    _tile_zero(0);
    _tile_dpbsud(0, 2, 4);
    if (two) {
      _tile_zero(1);
      _tile_dpbsud(1, 3, 5);
    }
  }
}

template <bool kOdd>
inline void store_pair(int32_t* first, int32_t* second, bool two) {
  if constexpr (kOdd) {
    _tile_stored(6, first, 64);
    if (two) _tile_stored(7, second, 64);
  } else {
    _tile_stored(0, first, 64);
    if (two) _tile_stored(1, second, 64);
  }
}

// A panel's B tiles, block after block, `code_stride(kLayout, kBlock, block_bytes)` bytes
// apart: decoded into `scratch` (blocks x kBlock / 4 x 64 bytes, 64-byte aligned), or I8's
// codes in place. A caller decodes a panel once for all the 16-row tiles it runs on it.
template <int64_t kLayout, int64_t kBlock>
const uint8_t* decode_panel(const uint8_t* panel, int64_t blocks, int64_t block_bytes, uint8_t* scratch) {
  if constexpr (kLayout == 1) return panel;
  for (int64_t b = 0; b < blocks; ++b) weight_tile<kLayout, kBlock>(panel + b * block_bytes, scratch + b * kBlock * 16);
  return scratch;
}

constexpr int64_t code_stride(int64_t layout, int64_t block, int64_t block_bytes) {
  return layout == 1 ? block_bytes : block * 16;
}

// 16 rows from row0 of one panel into result[r * 16 + column] (float32, before the bias), as
// the VNNI tile would, from the panel's B tiles at `codes` (decode_panel's); the caller has
// run configure_tiles<kBlock>() on this thread. kLayout: 0 U4, 1 I8, 2 I5, 3 I6
// (quant_linear.cpp's numbering); kCodeBytes, kBias: that file's code_bytes and code_bias of
// the layout.
template <int64_t kLayout, int64_t kBlock, bool kHalfScales, int64_t kCodeBytes, int32_t kBias>
void tile(const uint8_t* panel, const uint8_t* codes, int64_t blocks, int64_t block_bytes, const QuantizedRows& x,
          int64_t row0, float* result) {
  constexpr int64_t kScaleBytes = kHalfScales ? 2 : 4;
  alignas(64) int32_t dots[2][kTileRows * 16];
  const int64_t scales_per_row = x.k / kActivationBlock;
  const int64_t stride = code_stride(kLayout, kBlock, block_bytes);
  __m512 acc[kTileRows];
  for (int r = 0; r < kTileRows; ++r) acc[r] = _mm512_setzero_ps();
  const auto load_scales = [](const uint8_t* p) {
    if constexpr (kHalfScales) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    else return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  };
  // The float operations of one block, in the VNNI tile's order.
  const auto add_block = [&](int64_t b, const int32_t* dot) {
    const uint8_t* wb = panel + b * block_bytes;
    const __m512 sw = load_scales(wb + kCodeBytes);
    // Unrolled, so that the 16 rows' sums stay in registers.
#pragma GCC unroll 16
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t row = row0 + r;
      const float sx = x.scale[row * scales_per_row + b * kBlock / kActivationBlock];
      __m512i d = _mm512_load_si512(dot + 16 * r);
      if constexpr (kBias != 0) {
        const int32_t* s = x.sum16 + row * (x.k / 16);
        const int32_t code_sum = kBlock == 16 ? s[b] : s[2 * b] + s[2 * b + 1];
        d = _mm512_sub_epi32(d, _mm512_set1_epi32(kBias * code_sum));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_set1_ps(sx)), _mm512_cvtepi32_ps(d), acc[r]);
      if constexpr (kLayout == 0) {
        const __m512 mw = load_scales(wb + kCodeBytes + 16 * kScaleBytes);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sum32[row * (x.k / 32) + b]), acc[r]);
      }
    }
  };
  // Blocks in pairs; pair p's dots in tiles 0-1 (p even) or 6-7 (p odd), so that the AMX unit
  // sums the next pair while the float operations of this one run.
  const int8_t* rows = x.q + row0 * x.k;
  const int64_t pairs = (blocks + 1) / 2;
  const auto issue = [&](int64_t p) {
    const int64_t b = 2 * p;
    const bool two = b + 1 < blocks;
    if (p % 2 == 0)
      dot_pair<false, kBlock>(rows + b * kBlock, x.k, codes + b * stride, stride, two);
    else
      dot_pair<true, kBlock>(rows + b * kBlock, x.k, codes + b * stride, stride, two);
  };
  issue(0);
  for (int64_t p = 0; p < pairs; ++p) {
    if (p + 1 < pairs) issue(p + 1);
    const int64_t b = 2 * p;
    const bool two = b + 1 < blocks;
    if (p % 2 == 0)
      store_pair<false>(dots[0], dots[1], two);
    else
      store_pair<true>(dots[0], dots[1], two);
    add_block(b, dots[0]);
    if (two) add_block(b + 1, dots[1]);
  }
  for (int r = 0; r < kTileRows; ++r) _mm512_storeu_ps(result + r * 16, acc[r]);
}

#pragma GCC pop_options
#endif

}  // namespace trident_kernels::amx_int8
