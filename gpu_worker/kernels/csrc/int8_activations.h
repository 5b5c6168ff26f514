// Activations quantized per row and per block of 32 k to int8, for the integer dot products
// of csrc/quant_linear.cpp (as llama.cpp's Q8 activations): x ~ scale * code, scale =
// max|x| / 127, code = round(x / scale) to nearest even, with the sums of the codes that the
// kernels' block terms need.
#pragma once

#include <ATen/Parallel.h>

#include "kernel_common.h"

#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace trident_kernels {

constexpr int64_t kActivationBlock = 32;

// The activations of one call, quantized per row and per 32 k.
struct QuantizedRows {
  const int8_t* q;         // [rows, k]
  const float* scale;      // [rows, k / 32]
  const int32_t* sum16;    // [rows, k / 16]: sum of q over each 16 k
  const float* sum32;      // [rows, k / 32]: scale * the sum of q over each 32 k (U4's min term)
  int64_t k;
};

#ifdef __AVX2__

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const trident_kernels::Bf16Bits* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// Each 32 k of each row: scale = max|x| / 127, codes = round(x / scale) (to nearest even), and
// their sums. A NaN is no larger than the max, and its code is -127 (max(NaN, -127) is -127).
template <typename storage_t>
void quantize_rows(const storage_t* x, int64_t rows, int64_t k, int8_t* q, float* scale, int32_t* sum16,
                   float* sum32) {
  const int64_t blocks = k / kActivationBlock;
  // A block is a few nanoseconds: up to a 64-row decode step at k = 2048 (4,096 blocks, two
  // tasks at most) a parallel region costs about what it saves.
  at::parallel_for(0, rows * blocks, 2048, [&](int64_t begin, int64_t end) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 lowest = _mm256_set1_ps(-127.f), highest = _mm256_set1_ps(127.f);
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t i = begin; i < end; ++i) {
      const storage_t* src = x + i * kActivationBlock;  // rows are contiguous: block i of the whole
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = load8(src + 8 * j);
        amax = _mm256_max_ps(_mm256_and_ps(v[j], magnitude), amax);  // a NaN lane keeps amax
      }
      const float block_max = max8(amax);
      const __m256 inverse = _mm256_set1_ps(block_max > 0.f ? 127.f / block_max : 0.f);
      __m256i codes[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 scaled = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[j], inverse), lowest), highest);
        codes[j] = _mm256_cvtps_epi32(scaled);
      }
      // packs interleaves the 128-bit halves: the permute puts the 32 bytes back in k order.
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]),
                                               _mm256_packs_epi32(codes[2], codes[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kActivationBlock),
                          _mm256_permutevar8x32_epi32(bytes, in_order));
      const int32_t first = sum8(_mm256_add_epi32(codes[0], codes[1]));
      const int32_t second = sum8(_mm256_add_epi32(codes[2], codes[3]));
      scale[i] = block_max / 127.f;
      sum32[i] = scale[i] * static_cast<float>(first + second);
      sum16[2 * i] = first;
      sum16[2 * i + 1] = second;
    }
  });
}

// Quantizes x [rows, k] into `buffer` (resized to fit, so that a caller may keep one across
// calls) and returns the rows as the kernels read them.
template <typename storage_t>
QuantizedRows quantize_into(std::vector<int32_t>& buffer, const storage_t* x, int64_t rows, int64_t k) {
  const int64_t scale_count = rows * (k / kActivationBlock), sum_count = rows * (k / 16);
  buffer.resize(static_cast<size_t>(2 * scale_count + sum_count + (rows * k + 3) / 4));
  float* scale = reinterpret_cast<float*>(buffer.data());
  float* sum32 = scale + scale_count;
  int32_t* sum16 = buffer.data() + 2 * scale_count;
  int8_t* codes = reinterpret_cast<int8_t*>(sum16 + sum_count);
  quantize_rows(x, rows, k, codes, scale, sum16, sum32);
  return {codes, scale, sum16, sum32, k};
}

#endif  // __AVX2__

}  // namespace trident_kernels
