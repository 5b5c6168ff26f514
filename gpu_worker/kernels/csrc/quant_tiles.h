// The tile kernels of csrc/quant_linear.cpp, shared with csrc/fused_moe_gguf.cpp: the packed
// layouts' constants and the functions that compute a few input rows of one panel of 16
// output columns from int8 activations (int8_activations.h). quant_linear.cpp's header
// comment describes the layouts and the arithmetic; every caller sums each output block by
// block in k order, so a row's result does not depend on the rows beside it.
#pragma once

#include <torch/types.h>

#include "amx_int8_tiles.h"
#include "int8_activations.h"
#include "kernel_common.h"

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace trident_kernels::quant {

using trident_kernels::kActivationBlock;
using trident_kernels::QuantizedRows;
constexpr int64_t kPanelColumns = 16;
constexpr int64_t kU4 = 0, kI8 = 1, kI5 = 2, kI6 = 3;
// Rows a tile computes at most: on AVX-512, two zmm registers a row (its block's integer sum
// and its float32 sum) of the 32; AVX2 has 16 ymm registers and needs four a row.
constexpr int kMaxTileRows = 8;
constexpr int kAvx2TileRows = 3;
// How far ahead of its reads a tile of several rows prefetches the weights (past a panel's
// end: into the next one, which follows it in memory and is most often the thread's next).
constexpr int64_t kPrefetchBytes = 2048;

inline bool cpu_has_avx512_vnni() {
#if defined(__AVX512F__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

// "amx_int8", "avx512_vnni", "avx2" or "" (none in this build on this CPU): the path "auto" takes.
inline std::string find_best_path() {
  if (trident_kernels::amx_int8::cpu_has_amx_int8()) return "amx_int8";
  if (cpu_has_avx512_vnni()) return "avx512_vnni";
#ifdef __AVX2__
  if (cpu_has_avx2_fma()) return "avx2";
#endif
  return "";
}

// Bytes of a panel's codes per block: 16 columns x block k at 4, 5, 6 or 8 bits.
constexpr int64_t code_bytes(int64_t layout, int64_t block) {
  return layout == kU4 ? block * 8 : layout == kI5 ? block * 10 : layout == kI6 ? block * 12 : block * 16;
}

// The dot's excess from the unsigned storage of signed codes (c + bias): bias * sum(qx).
constexpr int32_t code_bias(int64_t layout) {
  return layout == kI8 ? 128 : layout == kI6 ? 32 : layout == kI5 ? 16 : 0;
}

inline bool valid_layout(int64_t layout, int64_t block) {
  if (layout == kI8) return block == 16 || block == 32;
  return layout == kI6 ? block == 16 : (layout == kU4 || layout == kI5) && block == 32;
}

// The integer sum of a row's codes over weight block b (16 or 32 k).
template <int64_t kBlock>
inline int32_t block_code_sum(const QuantizedRows& x, int64_t row, int64_t b) {
  const int32_t* s = x.sum16 + row * (x.k / 16);
  return kBlock == 16 ? s[b] : s[2 * b] + s[2 * b + 1];
}

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Computes kRows rows of one panel into result[r * 16 + column] (float32, before the bias).
using TileFn = void (*)(const uint8_t* panel, int64_t blocks, int64_t block_bytes, const QuantizedRows& x,
                        int64_t row0, float* result);

#ifdef __AVX2__

template <bool kHalfScales>
inline __m256 load_scales8(const uint8_t* p) {
  if constexpr (kHalfScales) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
}

// The int32 dot of each lane's 4 unsigned bytes w with the 4 signed bytes of x (x broadcast).
inline __m256i dot_u8_s8(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// The same for signed bytes w (I8 codes c + 128 turned back to c): |c| times x with c's sign.
inline __m256i dot_s8_s8(__m256i w_biased, __m256i x) {
  const __m256i w = _mm256_xor_si256(w_biased, _mm256_set1_epi8(static_cast<char>(0x80)));
  return dot_u8_s8(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 0x10 in byte i where bit i of `bits` is set, else 0: I5's fifth bits of 32 code bytes.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit_of_byte = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit_of_byte), bit_of_byte);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// I6's 4 code vectors of a block (c + 32, 0..63) from 3 vectors at p, `stride` bytes apart:
// two of nibbles (low: codes 0 and 1, high: codes 2 and 3) and one of top bits, bits 2g..2g+1
// of each byte for code vector g. The 16-bit shifts carry bits across bytes only where 0x30
// does not look.
inline void six_bit_codes(const uint8_t* p, int64_t stride, __m256i* c) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + stride));
  const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * stride));
  const __m256i nibble = _mm256_set1_epi8(0x0F), top_bits = _mm256_set1_epi8(0x30);
  c[0] = _mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_slli_epi16(top, 4), top_bits));
  c[1] = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_and_si256(_mm256_slli_epi16(top, 2), top_bits));
  c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), nibble), _mm256_and_si256(top, top_bits));
  c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble),
                         _mm256_and_si256(_mm256_srli_epi16(top, 2), top_bits));
}

template <int64_t kLayout, int64_t kBlock, bool kHalfScales, int kRows>
void avx2_tile(const uint8_t* panel, int64_t blocks, int64_t block_bytes, const QuantizedRows& x, int64_t row0,
               float* result) {
  constexpr int64_t kCodeBytes = code_bytes(kLayout, kBlock);
  constexpr int64_t kScaleBytes = kHalfScales ? 2 : 4;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = panel + b * block_bytes;
    __m256i dot[kRows][2];
    for (int r = 0; r < kRows; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    if constexpr (kLayout == kU4 || kLayout == kI5) {
      for (int g = 0; g < 4; ++g) {
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * g + 32 * half));
          __m256i lo = _mm256_and_si256(v, nibble);
          __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
          if constexpr (kLayout == kI5) {
            const uint8_t* masks = wb + 256 + 16 * g + 4 * half;  // this half's 32 bits of masks 2g, 2g + 1
            lo = _mm256_or_si256(lo, fifth_bits(load_u32(masks)));
            hi = _mm256_or_si256(hi, fifth_bits(load_u32(masks + 8)));
          }
          for (int r = 0; r < kRows; ++r) {
            const int8_t* qr = x.q + (row0 + r) * x.k + b * kBlock + 4 * g;
            const __m256i part = _mm256_add_epi32(dot_u8_s8(lo, _mm256_set1_epi32(load_i32(qr))),
                                                  dot_u8_s8(hi, _mm256_set1_epi32(load_i32(qr + 16))));
            dot[r][half] = _mm256_add_epi32(dot[r][half], part);
          }
        }
      }
    } else if constexpr (kLayout == kI6) {
      for (int half = 0; half < 2; ++half) {
        __m256i c[4];
        six_bit_codes(wb + 32 * half, 64, c);
        for (int g = 0; g < 4; ++g) {
          for (int r = 0; r < kRows; ++r) {
            const int8_t* qr = x.q + (row0 + r) * x.k + b * kBlock + 4 * g;
            dot[r][half] = _mm256_add_epi32(dot[r][half], dot_u8_s8(c[g], _mm256_set1_epi32(load_i32(qr))));
          }
        }
      }
    } else {
      for (int g = 0; g < kBlock / 4; ++g) {
        for (int half = 0; half < 2; ++half) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * g + 32 * half));
          for (int r = 0; r < kRows; ++r) {
            const int8_t* qr = x.q + (row0 + r) * x.k + b * kBlock + 4 * g;
            dot[r][half] = _mm256_add_epi32(dot[r][half], dot_s8_s8(v, _mm256_set1_epi32(load_i32(qr))));
          }
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 sw = load_scales8<kHalfScales>(wb + kCodeBytes + 8 * half * kScaleBytes);
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = row0 + r;
        const float sx = x.scale[row * (x.k / kActivationBlock) + b * kBlock / kActivationBlock];
        __m256i signed_dot = dot[r][half];
        if constexpr (kLayout == kI5 || kLayout == kI6)  // I8's codes were made signed before the dot
          signed_dot = _mm256_sub_epi32(signed_dot,
                                        _mm256_set1_epi32(code_bias(kLayout) * block_code_sum<kBlock>(x, row, b)));
        acc[r][half] = _mm256_fmadd_ps(_mm256_mul_ps(sw, _mm256_set1_ps(sx)), _mm256_cvtepi32_ps(signed_dot),
                                       acc[r][half]);
        if constexpr (kLayout == kU4) {
          const __m256 mw = load_scales8<kHalfScales>(wb + kCodeBytes + (16 + 8 * half) * kScaleBytes);
          acc[r][half] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.sum32[row * (x.k / 32) + b]), acc[r][half]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_ps(result + r * kPanelColumns, acc[r][0]);
    _mm256_storeu_ps(result + r * kPanelColumns + 8, acc[r][1]);
  }
}

#endif  // __AVX2__

#ifdef __AVX512F__
#pragma GCC push_options
#pragma GCC target("avx512vnni")

template <bool kHalfScales>
inline __m512 load_scales16(const uint8_t* p) {
  if constexpr (kHalfScales) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
}

template <int64_t kLayout, int64_t kBlock, bool kHalfScales, int kRows>
void vnni_tile(const uint8_t* panel, int64_t blocks, int64_t block_bytes, const QuantizedRows& x, int64_t row0,
               float* result) {
  constexpr int64_t kCodeBytes = code_bytes(kLayout, kBlock);
  constexpr int64_t kScaleBytes = kHalfScales ? 2 : 4;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = panel + b * block_bytes;
    if constexpr (kRows > 1)  // one row alone ran slower with it: its reads stream already
      for (int64_t line = 0; line < block_bytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
    // One row alone gets two integer sums, so that its chain of vpdpbusd is half as long;
    // more rows are chains enough.
    __m512i even[kRows], odd[kRows];
    for (int r = 0; r < kRows; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    if constexpr (kLayout == kU4 || kLayout == kI5) {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * g);
        __m512i lo = _mm512_and_si512(v, nibble);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        if constexpr (kLayout == kI5) {
          const __m512i sixteen = _mm512_set1_epi8(0x10);
          lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(load_u64(wb + 256 + 16 * g)), lo, sixteen);
          hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(load_u64(wb + 256 + 16 * g + 8)), hi, sixteen);
        }
        for (int r = 0; r < kRows; ++r) {
          const int8_t* qr = x.q + (row0 + r) * x.k + b * kBlock + 4 * g;
          even[r] = _mm512_dpbusd_epi32(even[r], lo, _mm512_set1_epi32(load_i32(qr)));
          __m512i& second = kRows == 1 ? odd[r] : even[r];
          second = _mm512_dpbusd_epi32(second, hi, _mm512_set1_epi32(load_i32(qr + 16)));
        }
      }
    } else {
      __m512i six[4];
      if constexpr (kLayout == kI6) {  // as six_bit_codes, 64 bytes at a time
        const __m512i a = _mm512_loadu_si512(wb), b = _mm512_loadu_si512(wb + 64), top = _mm512_loadu_si512(wb + 128);
        const __m512i top_bits = _mm512_set1_epi8(0x30);
        six[0] = _mm512_or_si512(_mm512_and_si512(a, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 4), top_bits));
        six[1] = _mm512_or_si512(_mm512_and_si512(b, nibble), _mm512_and_si512(_mm512_slli_epi16(top, 2), top_bits));
        six[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), nibble), _mm512_and_si512(top, top_bits));
        six[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b, 4), nibble),
                                 _mm512_and_si512(_mm512_srli_epi16(top, 2), top_bits));
      }
      for (int g = 0; g < kBlock / 4; g += 2) {
        __m512i v0, v1;
        if constexpr (kLayout == kI6) {
          v0 = six[g];
          v1 = six[g + 1];
        } else {
          v0 = _mm512_loadu_si512(wb + 64 * g);
          v1 = _mm512_loadu_si512(wb + 64 * (g + 1));
        }
        for (int r = 0; r < kRows; ++r) {
          const int8_t* qr = x.q + (row0 + r) * x.k + b * kBlock + 4 * g;
          even[r] = _mm512_dpbusd_epi32(even[r], v0, _mm512_set1_epi32(load_i32(qr)));
          __m512i& second = kRows == 1 ? odd[r] : even[r];
          second = _mm512_dpbusd_epi32(second, v1, _mm512_set1_epi32(load_i32(qr + 4)));
        }
      }
    }
    const __m512 sw = load_scales16<kHalfScales>(wb + kCodeBytes);
    for (int r = 0; r < kRows; ++r) {
      const int64_t row = row0 + r;
      const float sx = x.scale[row * (x.k / kActivationBlock) + b * kBlock / kActivationBlock];
      __m512i dot = kRows == 1 ? _mm512_add_epi32(even[r], odd[r]) : even[r];
      if constexpr (kLayout != kU4)
        dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(code_bias(kLayout) * block_code_sum<kBlock>(x, row, b)));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(sw, _mm512_set1_ps(sx)), _mm512_cvtepi32_ps(dot), acc[r]);
      if constexpr (kLayout == kU4) {
        const __m512 mw = load_scales16<kHalfScales>(wb + kCodeBytes + 16 * kScaleBytes);
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.sum32[row * (x.k / 32) + b]), acc[r]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(result + r * kPanelColumns, acc[r]);
}

#pragma GCC pop_options
#endif  // __AVX512F__

template <int64_t kLayout, int64_t kBlock, bool kHalfScales, int... kRows>
constexpr std::array<TileFn, kMaxTileRows> tile_table(bool vnni, std::integer_sequence<int, kRows...>) {
#ifdef __AVX512F__
  if (vnni) return {&vnni_tile<kLayout, kBlock, kHalfScales, kRows + 1>...};
#endif
#ifdef __AVX2__
  return {&avx2_tile<kLayout, kBlock, kHalfScales, kRows + 1>...};
#else
  return {};
#endif
}

// tiles[r - 1] computes r rows, for the layout, block, scale type and path.
inline std::array<TileFn, kMaxTileRows> pick_tiles(bool vnni, int64_t layout, int64_t block, bool half_scales) {
  const auto rows = std::make_integer_sequence<int, kMaxTileRows>{};
  if (layout == kU4) return half_scales ? tile_table<kU4, 32, true>(vnni, rows) : tile_table<kU4, 32, false>(vnni, rows);
  if (layout == kI5) return half_scales ? tile_table<kI5, 32, true>(vnni, rows) : tile_table<kI5, 32, false>(vnni, rows);
  if (layout == kI6) return half_scales ? tile_table<kI6, 16, true>(vnni, rows) : tile_table<kI6, 16, false>(vnni, rows);
  if (block == 16) return half_scales ? tile_table<kI8, 16, true>(vnni, rows) : tile_table<kI8, 16, false>(vnni, rows);
  return half_scales ? tile_table<kI8, 32, true>(vnni, rows) : tile_table<kI8, 32, false>(vnni, rows);
}

// Checks packed weights [ceil(n / 16), k / block, block bytes] uint8 of layout and block for
// an n x k weight, as quant_linear.py packs them; the error names `op`.
inline void check_packed(const at::Tensor& packed, int64_t n, int64_t k, int64_t layout, int64_t block,
                         bool half_scales, const char* op) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(), op,
              ": packed weights [panels, blocks, bytes] uint8");
  TORCH_CHECK(valid_layout(layout, block), op, ": layout 0 (U4, block 32), 1 (I8, block 16 or 32), ",
              "2 (I5, block 32) or 3 (I6, block 16)");
  const int64_t blocks = packed.size(1), block_bytes = packed.size(2);
  const int64_t scale_count = layout == kU4 ? 2 : 1;
  TORCH_CHECK(k % kActivationBlock == 0 && blocks * block == k, op, ": x has ", k, " features, the weights ",
              blocks * block, " (a multiple of 32)");
  TORCH_CHECK(packed.size(0) == (n + kPanelColumns - 1) / kPanelColumns &&
                  block_bytes == code_bytes(layout, block) + scale_count * kPanelColumns * (half_scales ? 2 : 4),
              op, ": packed weights of another shape or layout");
}

// Whether `path` ("auto", "amx_int8", "avx512_vnni" or "avx2") takes AMX-INT8 tiles for each 16
// rows (amx_int8_tiles.h).
inline bool use_amx_int8(c10::string_view path) {
  static const std::string best = find_best_path();
  return path == "amx_int8" || (path == "auto" && best == "amx_int8");
}

// Whether `path` runs the AVX512-VNNI tiles (the amx_int8 path's rows short of a tile do); an
// error naming `op` where that path is not in this build for this CPU.
inline bool use_vnni(c10::string_view path, const char* op) {
  static const std::string best = find_best_path();
  const bool amx = use_amx_int8(path);
  const bool vnni = amx || path == "avx512_vnni" || (path == "auto" && best == "avx512_vnni");
  TORCH_CHECK(path == "auto" || path == "amx_int8" || path == "avx512_vnni" || path == "avx2", op,
              ": path auto, amx_int8, avx512_vnni or avx2");
  TORCH_CHECK(!best.empty() && (!vnni || best != "avx2") && (!amx || best == "amx_int8"), op, ": the ",
              std::string(path), " path is not in this build for this CPU");
  return vnni;
}

}  // namespace trident_kernels::quant
