// y = x @ w.T (+ bias) on quantized weights, for GGUF's block formats repacked into four
// layouts (gpu_worker/quant_linear.py converts them, exactly):
//   U4: unsigned 4-bit codes c with a scale s and a min m per block of 32 along k: w = s c + m;
//   I8: signed 8-bit codes c with a scale s per block of 16 or 32 along k: w = s c;
//   I5: signed 5-bit codes c (-16..15) with a scale s per block of 32 along k: w = s c (Q5_0,
//       in 5.5 bits a weight where I8 takes 8.5);
//   I6: signed 6-bit codes c (-32..31) with a scale s per block of 16 along k: w = s c (Q6_K,
//       in 8 bits a weight with its float32 scales where I8 takes 10).
//
// The activations are quantized per row and per block of 32 to int8, as llama.cpp does
// (x ~ sx qx, sx = max|x| / 127, qx = round(x / sx)), so that each block's dot product is an
// integer one: vpdpbusd (AVX512-VNNI) multiplies 64 unsigned bytes by 64 signed bytes and adds
// each 4 products into an int32 lane; on AVX2, vpmaddubsw + vpmaddwd do the same in two steps.
// Per output column and block b:  acc += (s_b sx_b) * dot_b (+ m_b * (sx_b * sum(qx_b)) for U4).
// docs/benchmarks.md ("Method") says why int8 and not float activations.
//
// Unsigned weights are what vpdpbusd wants: U4 codes are 0..15, I8 codes are stored +128
// (0..255), I5 codes +16 (0..31) and I6 codes +32 (0..63); their dot with qx then exceeds the
// signed one by that bias times sum(qx_b), which the row's quantization already counted
// (sum16). AVX2's vpmaddubsw would saturate on 255 * 127 * 2, so its I8 path turns the code
// back to signed and multiplies |c| by qx with c's sign (at most 128 * 127 * 2, no
// saturation); I5's and I6's codes (at most 63 * 127 * 2) go in as they are. Both paths reach
// the same integer dot and then run the same float operations in the same order: their
// results are the same bits.
//
// The packed layout: output columns in panels of 16; a panel's blocks one after another, each
//   codes: 16 columns x 4 consecutive k in each 64 bytes (one lane of vpdpbusd a column);
//     U4: block_k / 8 such vectors (4), the low nibbles holding k 0..15, the high k 16..31;
//     I8: block_k / 4 such vectors of (c + 128);
//     I5: U4's 4 vectors of nibbles (the low 4 bits of c + 16), then the fifth bits: 8 masks of
//       64 bits, mask 2g + h for vector g's low (h = 0) or high (h = 1) nibbles, bit i for
//       byte i of that vector (AVX-512 adds 16 under the mask; AVX2 spreads 32 bits to bytes);
//     I6 (block 16): 2 vectors of nibbles of c + 32 (vector h's low nibbles: codes of vector h,
//       high: of vector 2 + h), then one of their top bits (bits 2g, 2g + 1 for code vector g);
//   then the 16 scales (float16 where every scale is exactly a float16, else float32), and for
//   U4 the 16 mins in the same type.
// Above kOneThreadRows rows, a thread claims a few panels at a time (parallel_for_claimed in
// kernel_common.h); each panel is read front to back; up to kMaxTileRows input rows share each
// decoded vector of weights.
//
// Each output element is summed block by block in k order whatever the batch and the thread
// count: a row's result does not depend on the rows beside it. Rounded once, at the end.
//
// Where the CPU has AMX-INT8, the "amx_int8" path takes each 16 rows of a panel on AMX tiles
// (csrc/amx_int8_tiles.h) and the rows left over on the VNNI tile, with the same bits.
//
// Registered as torch.ops.trident.quant_linear / quant_linear_rows / quant_linear_best_path;
// the fake kernels for tracing are in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "amx_int8_tiles.h"
#include "int8_activations.h"
#include "kernel_common.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using trident_kernels::cpu_has_avx2_fma;
using trident_kernels::kActivationBlock;
using trident_kernels::QuantizedRows;

constexpr int64_t kPanelColumns = 16;
constexpr int64_t kU4 = 0, kI8 = 1, kI5 = 2, kI6 = 3;
// Rows a tile computes at most: on AVX-512, two zmm registers a row (its block's integer sum
// and its float32 sum) of the 32; AVX2 has 16 ymm registers and needs four a row.
constexpr int kMaxTileRows = 8;
constexpr int kAvx2TileRows = 3;
// Calls of up to this many rows run on the calling thread alone: they read their weights at
// the memory's pace from one core, so a second thread adds no bandwidth, and a parallel
// region per call (one per linear layer of a step) costs its fork and join, far more where a
// teammate is descheduled by the scheduler process or other load (docs/benchmarks.md,
// "Kernels"). The split changes no bits.
constexpr int64_t kOneThreadRows = 4;
// How far ahead of its reads a tile of several rows prefetches the weights (past a panel's
// end: into the next one, which follows it in memory and is most often the thread's next).
constexpr int64_t kPrefetchBytes = 2048;


bool cpu_has_avx512_vnni() {
#if defined(__AVX512F__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

// "amx_int8", "avx512_vnni", "avx2" or "" (none in this build on this CPU): the path "auto" takes.
std::string find_best_path() {
  if (trident_kernels::amx_int8::cpu_has_amx_int8()) return "amx_int8";
  if (cpu_has_avx512_vnni()) return "avx512_vnni";
#ifdef __AVX2__
  if (cpu_has_avx2_fma()) return "avx2";
#endif
  return "";
}

std::string quant_linear_best_path() {
  static const std::string best = find_best_path();
  return best;
}

// Bytes of a panel's codes per block: 16 columns x block k at 4, 5, 6 or 8 bits.
constexpr int64_t code_bytes(int64_t layout, int64_t block) {
  return layout == kU4 ? block * 8 : layout == kI5 ? block * 10 : layout == kI6 ? block * 12 : block * 16;
}

// The dot's excess from the unsigned storage of signed codes (c + bias): bias * sum(qx).
constexpr int32_t code_bias(int64_t layout) {
  return layout == kI8 ? 128 : layout == kI6 ? 32 : layout == kI5 ? 16 : 0;
}


bool valid_layout(int64_t layout, int64_t block) {
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

// AMX's tile of 16 rows (amx_int8_tiles.h) and the tile configuration it needs on the thread
// that runs it, and the release of the tile state after; all nullptr where the path does not
// use AMX.
struct WideTile {
  TileFn tile;
  void (*configure)();
  void (*release)();
};

#if defined(TRIDENT_AMX) && defined(__AVX512F__)
template <int64_t kLayout, int64_t kBlock, bool kHalfScales>
constexpr WideTile amx_tile() {
  return {&trident_kernels::amx_int8::tile<kLayout, kBlock, kHalfScales, code_bytes(kLayout, kBlock), code_bias(kLayout)>,
          &trident_kernels::amx_int8::configure_tiles<kBlock>, &trident_kernels::amx_int8::release_tiles};
}
#endif

WideTile pick_wide_tile(bool amx, int64_t layout, int64_t block, bool half_scales) {
#if defined(TRIDENT_AMX) && defined(__AVX512F__)
  if (!amx) return {nullptr, nullptr, nullptr};
  if (layout == kU4) return half_scales ? amx_tile<kU4, 32, true>() : amx_tile<kU4, 32, false>();
  if (layout == kI5) return half_scales ? amx_tile<kI5, 32, true>() : amx_tile<kI5, 32, false>();
  if (layout == kI6) return half_scales ? amx_tile<kI6, 16, true>() : amx_tile<kI6, 16, false>();
  if (block == 16) return half_scales ? amx_tile<kI8, 16, true>() : amx_tile<kI8, 16, false>();
  return half_scales ? amx_tile<kI8, 32, true>() : amx_tile<kI8, 32, false>();
#else
  return {nullptr, nullptr, nullptr};
#endif
}

// tiles[r - 1] computes r rows, for the layout, block, scale type and path.
std::array<TileFn, kMaxTileRows> pick_tiles(bool vnni, int64_t layout, int64_t block, bool half_scales) {
  const auto rows = std::make_integer_sequence<int, kMaxTileRows>{};
  if (layout == kU4) return half_scales ? tile_table<kU4, 32, true>(vnni, rows) : tile_table<kU4, 32, false>(vnni, rows);
  if (layout == kI5) return half_scales ? tile_table<kI5, 32, true>(vnni, rows) : tile_table<kI5, 32, false>(vnni, rows);
  if (layout == kI6) return half_scales ? tile_table<kI6, 16, true>(vnni, rows) : tile_table<kI6, 16, false>(vnni, rows);
  if (block == 16) return half_scales ? tile_table<kI8, 16, true>(vnni, rows) : tile_table<kI8, 16, false>(vnni, rows);
  return half_scales ? tile_table<kI8, 32, true>(vnni, rows) : tile_table<kI8, 32, false>(vnni, rows);
}

template <typename storage_t>
void run_panels(const uint8_t* packed, int64_t n, int64_t blocks, int64_t block_bytes, const QuantizedRows& x,
                int64_t rows, const std::array<TileFn, kMaxTileRows>& tiles, int64_t tile_rows, WideTile wide,
                const float* bias, storage_t* out) {
  const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns;
  const int64_t panel_bytes = blocks * block_bytes;
  // Claims of ~32 KB of weights, and at least 4 claims a thread where the panels allow.
  const int64_t by_size = std::max<int64_t>(1, 32768 / panel_bytes);
  const int64_t by_count = std::max<int64_t>(1, panels / (4 * std::max(1, at::get_num_threads())));
  const int64_t claim = std::min(by_size, by_count);
  const auto compute = [&](int64_t begin, int64_t end) {
    alignas(64) float result[trident_kernels::amx_int8::kTileRows * kPanelColumns];
    if (wide.tile) wide.configure();
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t column0 = panel * kPanelColumns;
      const int64_t columns = std::min(kPanelColumns, n - column0);
      for (int64_t row0 = 0, tile = 0; row0 < rows; row0 += tile) {
        // Each 16 rows on the wide tile where there is one, the rest on the narrow tiles.
        const bool wide_rows = wide.tile && rows - row0 >= trident_kernels::amx_int8::kTileRows;
        tile = wide_rows ? trident_kernels::amx_int8::kTileRows : std::min<int64_t>(tile_rows, rows - row0);
        (wide_rows ? wide.tile : tiles[tile - 1])(packed + panel * panel_bytes, blocks, block_bytes, x, row0, result);
        for (int64_t r = 0; r < tile; ++r) {
          storage_t* dst = out + (row0 + r) * n + column0;
          for (int64_t c = 0; c < columns; ++c) {
            const float v = result[r * kPanelColumns + c];
            dst[c] = trident_kernels::round_to<storage_t>(bias ? v + bias[column0 + c] : v);
          }
        }
      }
    }
    if (wide.tile) wide.release();
  };
  if (rows <= kOneThreadRows)
    compute(0, panels);
  else
    trident_kernels::parallel_for_claimed(panels, claim, compute);
}

// x [rows, k] (float32, bfloat16 or float16); packed [ceil(n / 16), k / block, block bytes]
// uint8 as quant_linear.py lays it out; layout 0 (U4), 1 (I8), 2 (I5) or 3 (I6); path "auto",
// "amx_int8", "avx512_vnni" or "avx2" (the tests run each on one CPU) -> [rows, n] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t layout, int64_t block, bool half_scales, c10::string_view path) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x [rows, k]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "quant_linear: packed weights [panels, blocks, bytes] uint8");
  TORCH_CHECK(valid_layout(layout, block), "quant_linear: layout 0 (U4, block 32), 1 (I8, block 16 or 32), ",
              "2 (I5, block 32) or 3 (I6, block 16)");
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  const int64_t blocks = packed.size(1), block_bytes = packed.size(2);
  const int64_t scale_count = layout == kU4 ? 2 : 1;
  TORCH_CHECK(k % kActivationBlock == 0 && blocks * block == k, "quant_linear: x has ", k,
              " features, the weights ", blocks * block, " (a multiple of 32)");
  TORCH_CHECK(packed.size(0) == (n + kPanelColumns - 1) / kPanelColumns &&
                  block_bytes == code_bytes(layout, block) + scale_count * kPanelColumns * (half_scales ? 2 : 4),
              "quant_linear: packed weights of another shape or layout");
  static const std::string best = find_best_path();
  const bool amx = path == "amx_int8" || (path == "auto" && best == "amx_int8");
  const bool vnni = amx || path == "avx512_vnni" || (path == "auto" && best == "avx512_vnni");
  TORCH_CHECK(path == "auto" || path == "amx_int8" || path == "avx512_vnni" || path == "avx2",
              "quant_linear: path auto, amx_int8, avx512_vnni or avx2");
  TORCH_CHECK(!best.empty() && (!vnni || best != "avx2") && (!amx || best == "amx_int8"), "quant_linear: the ",
              std::string(path), " path is not in this build for this CPU");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const at::Tensor xc = x.contiguous();
  // The quantized rows live in a buffer kept by the calling thread: a decode step makes ~200
  // calls, and four allocations a call were a fifth of a small layer's time.
  thread_local std::vector<int32_t> scratch;
  const int64_t scale_count_x = rows * (k / kActivationBlock), sum_count = rows * (k / 16);
  scratch.resize(static_cast<size_t>(2 * scale_count_x + sum_count + (rows * k + 3) / 4));
  float* x_scale = reinterpret_cast<float*>(scratch.data());
  float* x_sum32 = x_scale + scale_count_x;
  int32_t* x_sum16 = scratch.data() + 2 * scale_count_x;
  int8_t* x_codes = reinterpret_cast<int8_t*>(x_sum16 + sum_count);
  const at::Tensor bias_f = trident_kernels::float_bias(bias, n);
  const QuantizedRows xq{x_codes, x_scale, x_sum16, x_sum32, k};
  const auto tiles = pick_tiles(vnni, layout, block, half_scales);
  const WideTile wide = pick_wide_tile(amx && rows >= trident_kernels::amx_int8::kTileRows, layout, block, half_scales);
#ifdef __AVX2__
  trident_kernels::dispatch_float_dtype(x, "quant_linear", [&](auto storage, auto element) {
    using storage_t = decltype(storage);
    using element_t = decltype(element);
    trident_kernels::quantize_rows(trident_kernels::bits_of<storage_t, element_t>(xc), rows, k, x_codes, x_scale, x_sum16, x_sum32);
    run_panels(packed.data_ptr<uint8_t>(), n, blocks, block_bytes, xq, rows, tiles, vnni ? kMaxTileRows : kAvx2TileRows,
               wide, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr,
               trident_kernels::bits_of<storage_t, element_t>(out));
  });
#endif
  return out;
}

inline float scale_at(const uint8_t* p, bool half_scales, int64_t column) {
  if (half_scales) {
    c10::Half h;
    std::memcpy(&h, p + 2 * column, sizeof(h));
    return static_cast<float>(h);
  }
  float f;
  std::memcpy(&f, p + 4 * column, sizeof(f));
  return f;
}

// Rows `ids` of the dequantized weight in `dtype`: scale * code (+ min) in float32, one
// rounding each, as quant_linear.py's dequantize (the embedding lookup of a tied LM head).
at::Tensor quant_linear_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t out_features, int64_t layout,
                             int64_t block, bool half_scales, at::ScalarType dtype) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "quant_linear_rows: packed weights [panels, blocks, bytes] uint8");
  TORCH_CHECK(valid_layout(layout, block), "quant_linear_rows: layout 0 (U4, block 32), 1 (I8, block 16 or 32), ",
              "2 (I5, block 32) or 3 (I6, block 16)");
  const int64_t blocks = packed.size(1), block_bytes = packed.size(2), k = blocks * block;
  const int64_t scale_bytes = half_scales ? 2 : 4, codes = code_bytes(layout, block);
  const at::Tensor flat_ids = ids.reshape({-1}).to(at::kLong).contiguous();
  TORCH_CHECK(packed.size(0) == (out_features + kPanelColumns - 1) / kPanelColumns,
              "quant_linear_rows: packed weights of another shape");
  const int64_t count = flat_ids.numel(), limit = out_features;
  const int64_t* id = flat_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < limit, "quant_linear_rows: id ", id[i], " out of range");
  at::Tensor out = at::empty({count, k}, packed.options().dtype(dtype));
  const uint8_t* data = packed.data_ptr<uint8_t>();
  trident_kernels::dispatch_float_dtype(out, "quant_linear_rows", [&](auto storage, auto element) {
    using storage_t = decltype(storage);
    storage_t* dst = trident_kernels::bits_of<storage_t, decltype(element)>(out);
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t column = id[i] % kPanelColumns;
        const uint8_t* panel = data + (id[i] / kPanelColumns) * blocks * block_bytes;
        storage_t* row = dst + i * k;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* wb = panel + b * block_bytes;
          const float scale = scale_at(wb + codes, half_scales, column);
          if (layout == kU4) {  // 32 k in 4 groups, two nibbles a byte
            const float min = scale_at(wb + codes + kPanelColumns * scale_bytes, half_scales, column);
            for (int64_t g = 0; g < 4; ++g) {
              const uint8_t* lane = wb + 64 * g + 4 * column;
              for (int64_t j = 0; j < 4; ++j) {
                const float lo = scale * static_cast<float>(lane[j] & 15), hi = scale * static_cast<float>(lane[j] >> 4);
                row[b * 32 + 4 * g + j] = trident_kernels::round_to<storage_t>(lo + min);
                row[b * 32 + 16 + 4 * g + j] = trident_kernels::round_to<storage_t>(hi + min);
              }
            }
          } else if (layout == kI5) {  // U4's nibbles, and the fifth bit of byte i of vector 2g + h at bit i
            for (int64_t g = 0; g < 4; ++g) {
              const uint8_t* lane = wb + 64 * g + 4 * column;
              const uint64_t low_masks = load_u64(wb + 256 + 16 * g), high_masks = load_u64(wb + 256 + 16 * g + 8);
              for (int64_t j = 0; j < 4; ++j) {
                const int64_t bit = 4 * column + j;
                const int32_t lo = (lane[j] & 15) | static_cast<int32_t>((low_masks >> bit) & 1) << 4;
                const int32_t hi = (lane[j] >> 4) | static_cast<int32_t>((high_masks >> bit) & 1) << 4;
                row[b * 32 + 4 * g + j] = trident_kernels::round_to<storage_t>(scale * static_cast<float>(lo - 16));
                row[b * 32 + 16 + 4 * g + j] = trident_kernels::round_to<storage_t>(scale * static_cast<float>(hi - 16));
              }
            }
          } else if (layout == kI6) {  // code vector g: nibbles of vector g % 2 (low, then high), top bits 2g..2g+1
            for (int64_t g = 0; g < 4; ++g) {
              for (int64_t j = 0; j < 4; ++j) {
                const int64_t lane = 4 * column + j;
                const int32_t nibble = (wb[64 * (g % 2) + lane] >> (4 * (g / 2))) & 15;
                const int32_t code = nibble | ((wb[128 + lane] >> (2 * g)) & 3) << 4;
                row[b * 16 + 4 * g + j] = trident_kernels::round_to<storage_t>(scale * static_cast<float>(code - 32));
              }
            }
          } else {
            for (int64_t g = 0; g < block / 4; ++g) {
              const uint8_t* lane = wb + 64 * g + 4 * column;
              for (int64_t j = 0; j < 4; ++j)
                row[b * block + 4 * g + j] =
                    trident_kernels::round_to<storage_t>(scale * static_cast<float>(static_cast<int32_t>(lane[j]) - 128));
            }
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def(
      "quant_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, int layout, int block, bool half_scales, "
      "str path='auto') -> Tensor");
  m.def("quant_linear_rows(Tensor packed, Tensor ids, int out_features, int layout, int block, bool half_scales, "
      "ScalarType dtype) -> Tensor");
  m.def("quant_linear_best_path() -> str");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_rows", &quant_linear_rows);
}

TORCH_LIBRARY_IMPL(trident, CompositeExplicitAutograd, m) {
  m.impl("quant_linear_best_path", &quant_linear_best_path);
}
