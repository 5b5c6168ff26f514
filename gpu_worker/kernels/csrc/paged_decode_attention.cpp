// Decode attention straight from the paged KV pool: one query per row, each row's keys
// read once, where the pool has them.
//
// The torch path (attention.py) gathers every row's K and V into a padded copy and then
// runs two batched matmuls and a softmax over it: the KV bytes cross memory three times
// (read, write the copy, read it again), and rows are padded to their group's longest.
// Here a row's K rows are read once to score the query heads (all heads of a GQA group
// share each K row), the scores become probabilities in place, and its V rows are read
// once to sum them: no copy, no padding. Scores, probabilities and sums are float32
// whatever the dtype, so the output is closer to float32 attention than the torch path's
// (which rounds the scores to the model dtype before its softmax).
//
// Three implementations: for bfloat16 with head dim 64 (SmolLM2, most small LLaMAs), 128
// (Llama 3, Qwen, Mistral) or 256 (Gemma 3) and 1, 2, 3, 4 or 8 query heads per KV head, an
// AVX-512 one, which keeps what it can of a GQA group's queries and outputs in registers,
// and an AVX2 one with the same work items; and a portable one (any dtype, any head dim)
// that the compiler vectorises. Their speed against the torch path is in docs/benchmarks.md
// (benchmarks/bench_decode_attention.py).
//
// A sliding window (Mistral, Gemma 3's local layers) is a row's last `window` keys: the
// same loops over a shorter span of its indices; 0 means the whole row.
//
// Registered as torch.ops.trident.paged_decode_attention (a fake kernel for tracing is in
// cpu_kernels.py), so torch.compile treats it as one opaque op.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "attention_common.h"
#include "kernel_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace trident_attention {

// The largest of p[0, len): the same value in any order, so sixteen lanes at a time (the
// compiler keeps std::max's reduction scalar, one dependent compare a score).
inline float peak_of(const float* p, int64_t len) {
#ifdef __AVX512F__
  __m512 peak = _mm512_set1_ps(p[0]);
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) peak = _mm512_max_ps(peak, _mm512_loadu_ps(p + t));
  const __mmask16 rest = static_cast<__mmask16>((1u << (len - t)) - 1);
  peak = _mm512_mask_max_ps(peak, rest, peak, _mm512_maskz_loadu_ps(rest, p + t));
  return _mm512_reduce_max_ps(peak);
#elif defined(TRIDENT_FAST_DECODE_BF16)
  __m256 peaks[2] = {_mm256_set1_ps(p[0]), _mm256_set1_ps(p[0])};  // two chains: a max's latency is 2-3 cycles
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    peaks[0] = _mm256_max_ps(peaks[0], _mm256_loadu_ps(p + t));
    peaks[1] = _mm256_max_ps(peaks[1], _mm256_loadu_ps(p + t + 8));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(peaks[0], peaks[1]));
  float peak = lanes[0];
  for (int l = 1; l < 8; ++l) peak = std::max(peak, lanes[l]);
  for (; t < len; ++t) peak = std::max(peak, p[t]);
  return peak;
#else
  float peak = p[0];
  for (int64_t t = 1; t < len; ++t) peak = std::max(peak, p[t]);
  return peak;
#endif
}

#ifdef __AVX512F__
// The sum is the order the portable loop below took when the compiler vectorised it for
// AVX-512 (the bits every row had before this loop was written out): lane l sums the
// exponentials at l, l + 16, ... of the whole sixteens in order; lane 0 then adds the rest of
// them one by one, and the lanes are added in order 0 to 15. Written out, the rest are one masked
// vector of exponentials instead of one scalar call each.
__attribute__((noinline)) void softmax_in_place(float* p, int64_t len) {
  const __m512 peak = _mm512_set1_ps(peak_of(p, len));
  __m512 lanes = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) {
    const __m512 e = trident_kernels::exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(p + t), peak));
    _mm512_storeu_ps(p + t, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  const int64_t rest = len - t;
  const __mmask16 rest_mask = static_cast<__mmask16>((1u << rest) - 1);
  alignas(64) float tail[16], lane[16];
  const __m512 e = trident_kernels::exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest_mask, p + t), peak));
  _mm512_mask_storeu_ps(p + t, rest_mask, e);
  _mm512_store_ps(tail, e);
  _mm512_store_ps(lane, lanes);
  float sum = lane[0];
  for (int64_t j = 0; j < rest; ++j) sum += tail[j];
  for (int l = 1; l < 16; ++l) sum += lane[l];
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (t = 0; t + 16 <= len; t += 16) _mm512_storeu_ps(p + t, _mm512_mul_ps(_mm512_loadu_ps(p + t), inv));
  _mm512_mask_storeu_ps(p + t, rest_mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(rest_mask, p + t), inv));
}
#else
__attribute__((noinline)) void softmax_in_place(float* p, int64_t len) {
  const float peak = peak_of(p, len);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    p[t] = trident_kernels::exp_nonpositive(p[t] - peak);
    sum += p[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) p[t] *= inv;
}
#endif

}  // namespace trident_attention

namespace {

using namespace trident_attention;

// Widening loads, written so that the compiler vectorises them: bfloat16 is the top half
// of a float32, so widening is a 16-bit shift of the raw bits.
inline void widen(const float* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i];
}

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#ifdef __AVX512F__
// The fast path: bfloat16, head dim kDim (64, 128 or 256), AVX-512. One work item is a
// (row, KV head) and its `kGroup` query heads: each K and V row is read once for the group.
// Scores: sixteen keys at a time are widened into L1 and each query head takes their sixteen
// scores at once (scores_of_16: the sum of each score's lanes is vertical, sixteen sums in
// the additions of one); a head of 256 scores key by key with one sum_lanes each, the same
// bits. Where a group's queries fit in 16 registers (64 x up to 4 heads, 128 x 2, 256 x 1)
// they stay there for the whole row; otherwise they are float32 in L1 and feed the FMAs as
// memory operands (the load ports are idle anyway). The outputs are summed kColumns vectors
// at a time, in passes over the row's V rows: the first pass prefetches every line of each V
// row, so later passes read them from cache. A score's and an output's arithmetic is shared
// with the query-tile kernel (attention_common.h).

template <int kGroup, int kDim>
void decode_item_bf16(const uint16_t* q, float scale, const uint16_t* kv, const int64_t* tokens, int64_t len,
                      int64_t token_stride, int64_t k_offset, int64_t v_offset, float* probs, float* out) {
  constexpr int kVecs = kDim / 16;
  constexpr bool kQueryInRegisters = kGroup * kVecs <= 16;
  // Scores sixteen keys at a time (one sum_lanes_of_16 for sixteen sum_lanes) where a head's
  // query and the sixteen keys' lanes fit the registers; a head of 256 scores key by key.
  constexpr bool kScoreBlocks = kVecs <= 8;
  // Output vectors summed a pass: kGroup x kColumns accumulators <= 16.
  constexpr int kColumns = std::min(kVecs, kGroup == 1 ? 16 : kGroup == 2 ? 8 : kGroup <= 4 ? 4 : 2);
  static_assert(kVecs % kColumns == 0, "column passes tile the head");
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 qv[kQueryInRegisters ? kGroup : 1][kVecs];
  alignas(64) float qf[kQueryInRegisters ? 16 : kGroup * kDim];
#pragma GCC unroll 16
  for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 16
    for (int c = 0; c < kVecs; ++c) {
      const __m512 scaled = _mm512_mul_ps(widen16(q + g * kDim + c * 16), scale_v);
      if constexpr (kQueryInRegisters)
        qv[g][c] = scaled;
      else
        _mm512_store_ps(qf + g * kDim + c * 16, scaled);
    }
  const auto query = [&](int g, int c) {
    if constexpr (kQueryInRegisters)
      return qv[g][c];
    else
      return _mm512_load_ps(qf + g * kDim + c * 16);
  };
  if constexpr (kScoreBlocks) {
    alignas(64) float keys[kKeysAtOnce * kDim];
    for (int64_t t0 = 0; t0 < len; t0 += kKeysAtOnce) {
      widen_keys<kDim>(keys, kv, tokens + t0, len - t0, token_stride, k_offset);
      // The same keys' V rows, towards L2: the output passes find them there, where their own
      // prefetch, a few keys ahead of work that is faster than a trip to memory, would come late.
      for (int64_t j = t0; j < std::min(t0 + kKeysAtOnce, len); ++j)
        prefetch_head_to_l2<kDim>(kv + tokens[j] * token_stride + v_offset);
      const __mmask16 mask = static_cast<__mmask16>((1u << std::min(kKeysAtOnce, len - t0)) - 1);
#pragma GCC unroll 8
      for (int g = 0; g < kGroup; ++g)
        _mm512_mask_storeu_ps(probs + g * len + t0, mask,
                              scores_of_16<kVecs>([&](int c) { return query(g, c); }, keys));
    }
  } else {
    for (int64_t t = 0; t < len; ++t) {
      if (t + kPrefetchAhead < len) prefetch_head<kDim>(kv + tokens[t + kPrefetchAhead] * token_stride + k_offset);
      const uint16_t* k = kv + tokens[t] * token_stride + k_offset;
      __m512 kc[kVecs];
#pragma GCC unroll 16
      for (int c = 0; c < kVecs; ++c) kc[c] = widen16(k + c * 16);
#pragma GCC unroll 8
      for (int g = 0; g < kGroup; ++g)
        probs[g * len + t] =
            sum_lanes(dot_lanes<kVecs>([&](int c) { return query(g, c); }, [&](int c) { return kc[c]; }));
    }
  }
  for (int g = 0; g < kGroup; ++g) softmax_in_place(probs + g * len, len);
  for (int column0 = 0; column0 < kVecs; column0 += kColumns) {
    __m512 acc[kGroup][kColumns];
#pragma GCC unroll 8
    for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 16
      for (int c = 0; c < kColumns; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      if (column0 == 0 && t + kPrefetchAhead < len)
        prefetch_head<kDim>(kv + tokens[t + kPrefetchAhead] * token_stride + v_offset);
      const uint16_t* v = kv + tokens[t] * token_stride + v_offset + column0 * 16;
      __m512 vc[kColumns];
#pragma GCC unroll 16
      for (int c = 0; c < kColumns; ++c) vc[c] = widen16(v + c * 16);
      add_weighted_value<kGroup, kColumns>(acc, probs + t, len, vc);
    }
#pragma GCC unroll 8
    for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 16
      for (int c = 0; c < kColumns; ++c) _mm512_storeu_ps(out + g * kDim + (column0 + c) * 16, acc[g][c]);
  }
}

#elif defined(TRIDENT_FAST_DECODE_BF16)
// The AVX2 path (CPUs without AVX-512), the same work items. A GQA group's queries do not fit
// in 16 registers, so they stay float32 in L1 and feed the multiply-adds from memory. Scores: a
// token's K row is widened kChunk vectors at a time (a head of 64 at once), each query head
// summing into its own kChains accumulators; each score's lanes wait in L1 and eight scores'
// are summed at once (sum_lanes_of_8). Outputs: kColumns vectors at a time, in passes over the
// row's V rows (later passes read them from cache).
inline __m256 widen8(const uint16_t* src) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

constexpr int64_t kKeysAtOnce = 8;  // scores whose lanes are summed together

// Lane j: the sum of v[j]'s lanes as a halving tree (l and l + 4, then l and l + 2, then l and
// l + 1), eight sums at once: vertical additions and shuffles in place of eight horizontal sums.
inline __m256 sum_lanes_of_8(const __m256 (&v)[8]) {
  // fourths[m]: lanes 0-3 the pairs (l, l + 4) of v[2m], lanes 4-7 those of v[2m + 1].
  __m256 fourths[4];
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m)
    fourths[m] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x20),
                               _mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x31));
  // halves[m]: in 128-bit lane q, the pairs (l, l + 2) of v[4m + q] (lanes 0-1) and v[4m + 2 + q] (2-3).
  __m256 halves[2];
#pragma GCC unroll 2
  for (int m = 0; m < 2; ++m)
    halves[m] = _mm256_add_ps(_mm256_shuffle_ps(fourths[2 * m], fourths[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm256_shuffle_ps(fourths[2 * m], fourths[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // In 128-bit lane q, the sums of v[q], v[2 + q], v[4 + q], v[6 + q].
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// The first n lanes of v to dst (AMD's masked stores are slow: a whole vector where it can).
inline void store_first(float* dst, __m256 v, int64_t n) {
  if (n == kKeysAtOnce) return _mm256_storeu_ps(dst, v);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(dst, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane), v);
}

template <int kGroup, int kDim>
void decode_item_bf16(const uint16_t* q, float scale, const uint16_t* kv, const int64_t* tokens, int64_t len,
                      int64_t token_stride, int64_t k_offset, int64_t v_offset, float* probs, float* out) {
  constexpr int kVecs = kDim / 8;
  constexpr int kChunk = kDim == 64 ? 8 : 4;       // K vectors in registers at once
  constexpr int kChains = kGroup <= 4 ? 2 : 1;     // accumulators per score: kGroup x kChains <= 8
  constexpr int kColumns = kGroup <= 3 ? 4 : kGroup <= 6 ? 2 : 1;  // accumulators: kGroup x kColumns <= 12
  alignas(32) float qf[kGroup * kDim];
  for (int i = 0; i < kGroup * kDim; ++i) qf[i] = trident_kernels::widen(trident_kernels::Bf16Bits{q[i]}) * scale;
  alignas(32) float lanes[kGroup][kKeysAtOnce][8] = {};  // each score's lanes, summed eight at a time
  for (int64_t t0 = 0; t0 < len; t0 += kKeysAtOnce) {
    const int64_t n = std::min(kKeysAtOnce, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      if (t + kPrefetchAhead < len) prefetch_head<kDim>(kv + tokens[t + kPrefetchAhead] * token_stride + k_offset);
      const uint16_t* k = kv + tokens[t] * token_stride + k_offset;
      __m256 s[kGroup][kChains];
#pragma GCC unroll 8
      for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 2
        for (int i = 0; i < kChains; ++i) s[g][i] = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int chunk0 = 0; chunk0 < kVecs; chunk0 += kChunk) {
        __m256 kc[kChunk];
#pragma GCC unroll 8
        for (int c = 0; c < kChunk; ++c) kc[c] = widen8(k + (chunk0 + c) * 8);
#pragma GCC unroll 8
        for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 8
          for (int c = 0; c < kChunk; ++c)
            s[g][c % kChains] =
                _mm256_fmadd_ps(_mm256_load_ps(qf + g * kDim + (chunk0 + c) * 8), kc[c], s[g][c % kChains]);
      }
#pragma GCC unroll 8
      for (int g = 0; g < kGroup; ++g) {
        if constexpr (kChains == 2) s[g][0] = _mm256_add_ps(s[g][0], s[g][1]);
        _mm256_store_ps(lanes[g][j], s[g][0]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < kGroup; ++g) {
      __m256 v[kKeysAtOnce];
#pragma GCC unroll 8
      for (int j = 0; j < kKeysAtOnce; ++j) v[j] = _mm256_load_ps(lanes[g][j]);
      store_first(probs + g * len + t0, sum_lanes_of_8(v), n);
    }
  }
  for (int g = 0; g < kGroup; ++g) softmax_in_place(probs + g * len, len);
  for (int column0 = 0; column0 < kVecs; column0 += kColumns) {
    __m256 acc[kGroup][kColumns];
#pragma GCC unroll 8
    for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < kColumns; ++c) acc[g][c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      if (column0 == 0 && t + kPrefetchAhead < len)
        prefetch_head<kDim>(kv + tokens[t + kPrefetchAhead] * token_stride + v_offset);
      const uint16_t* v = kv + tokens[t] * token_stride + v_offset + column0 * 8;
#pragma GCC unroll 8
      for (int c = 0; c < kColumns; ++c) {
        const __m256 vc = widen8(v + c * 8);
#pragma GCC unroll 8
        for (int g = 0; g < kGroup; ++g)
          acc[g][c] = _mm256_fmadd_ps(_mm256_broadcast_ss(probs + g * len + t), vc, acc[g][c]);
      }
    }
#pragma GCC unroll 8
    for (int g = 0; g < kGroup; ++g)
#pragma GCC unroll 8
      for (int c = 0; c < kColumns; ++c) _mm256_storeu_ps(out + g * kDim + (column0 + c) * 8, acc[g][c]);
  }
}
#endif

#ifdef TRIDENT_FAST_DECODE_BF16
template <int kGroup, int kDim>
void decode_rows_bf16(const c10::BFloat16* q, const c10::BFloat16* kv, const int64_t* kv_indices,
                      const int64_t* kv_rows, const int64_t* kv_lens, c10::BFloat16* out, int64_t rows,
                      int64_t kv_heads, int64_t max_kv, double scale, int64_t window) {
  const int64_t heads = kv_heads * kGroup, token_stride = 2 * kv_heads * kDim;
  const auto* q_bits = reinterpret_cast<const uint16_t*>(q);
  const auto* kv_bits = reinterpret_cast<const uint16_t*>(kv);
  auto* out_bits = reinterpret_cast<trident_kernels::Bf16Bits*>(out);
  trident_kernels::parallel_for_claimed(rows * kv_heads, 2 * kv_heads, [&](int64_t begin, int64_t end) {
    std::vector<float> probs(kGroup * max_kv), result(kGroup * kDim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kv_head = item % kv_heads;
      const int64_t first_head = kv_head * kGroup;
      const int64_t first_key = window_start(kv_lens[row], window);
      decode_item_bf16<kGroup, kDim>(q_bits + (row * heads + first_head) * kDim, static_cast<float>(scale), kv_bits,
                                     kv_indices + index_row(kv_rows, row) * max_kv + first_key,
                                     kv_lens[row] - first_key, token_stride,
                                     kv_head * kDim, (kv_heads + kv_head) * kDim, probs.data(), result.data());
      trident_kernels::Bf16Bits* dst = out_bits + (row * heads + first_head) * kDim;
#pragma omp simd
      for (int64_t i = 0; i < kGroup * kDim; ++i)
        dst[i] = trident_kernels::round_to<trident_kernels::Bf16Bits>(result[i]);
    }
  });
}

// The (head dim, query heads per KV head) pairs that have a fast path; others take decode_rows.
bool decode_bf16(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const int64_t* kv_rows,
                 const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
  const int64_t rows = q.size(0), dim = q.size(2), kv_heads = kv.size(2), group = q.size(1) / kv_heads;
  const auto run = [&](auto kernel) {
    kernel(q.data_ptr<c10::BFloat16>(), kv.data_ptr<c10::BFloat16>(), idx.data_ptr<int64_t>(), kv_rows,
           lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), rows, kv_heads, idx.size(1), scale, window);
    return true;
  };
  const auto of_group = [&](auto dim_constant) {
    constexpr int kDim = decltype(dim_constant)::value;
    switch (group) {
      case 1: return run(decode_rows_bf16<1, kDim>);
      case 2: return run(decode_rows_bf16<2, kDim>);
      case 3: return run(decode_rows_bf16<3, kDim>);
      case 4: return run(decode_rows_bf16<4, kDim>);
      case 8: return run(decode_rows_bf16<8, kDim>);
      default: return false;
    }
  };
  switch (dim) {
    case 64: return of_group(std::integral_constant<int, 64>{});
    case 128: return of_group(std::integral_constant<int, 128>{});
    case 256: return of_group(std::integral_constant<int, 256>{});
    default: return false;
  }
}
#endif

// kDim: the head dim as a compile-time constant (the common 64, 128 and 256, so that the
// compiler unrolls the per-head loops into registers), or 0 for any other, read from `dim`.
template <typename scalar_t, int64_t kDim>
void decode_rows(const scalar_t* q, const scalar_t* kv, const int64_t* kv_indices, const int64_t* kv_rows,
                 const int64_t* kv_lens, scalar_t* out, int64_t rows, int64_t heads, int64_t kv_heads,
                 int64_t runtime_dim, int64_t max_kv, double scale, int64_t window) {
  const int64_t dim = kDim ? kDim : runtime_dim;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = 2 * kv_heads * dim;  // pool layout [pool tokens, 2 (K, V), kv_heads, dim]
  const int64_t half = kv_heads * dim;              // K of every head, then V of every head
  // One work item is a row: each token's K (then V) of all heads is one contiguous read.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(heads * dim), acc(heads * dim), kvf(half), probs(heads * max_kv);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t first_key = window_start(kv_lens[row], window);
      const int64_t len = kv_lens[row] - first_key;
      const int64_t* tokens = kv_indices + index_row(kv_rows, row) * max_kv + first_key;
      const scalar_t* q_row = q + row * heads * dim;
      for (int64_t i = 0; i < heads * dim; ++i) qf[i] = static_cast<float>(q_row[i]) * static_cast<float>(scale);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetchAhead < len) __builtin_prefetch(kv + tokens[t + kPrefetchAhead] * token_stride);
        widen(kv + tokens[t] * token_stride, kvf.data(), half);
        for (int64_t j = 0; j < kv_heads; ++j) {
          const float* kj = kvf.data() + j * dim;
          for (int64_t h = j * group; h < (j + 1) * group; ++h) {
            const float* qh = qf.data() + h * dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < dim; ++d) dot += qh[d] * kj[d];
            probs[h * max_kv + t] = dot;
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) softmax_in_place(probs.data() + h * max_kv, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        if (t + kPrefetchAhead < len) __builtin_prefetch(kv + tokens[t + kPrefetchAhead] * token_stride + half);
        widen(kv + tokens[t] * token_stride + half, kvf.data(), half);
        for (int64_t j = 0; j < kv_heads; ++j) {
          const float* vj = kvf.data() + j * dim;
          for (int64_t h = j * group; h < (j + 1) * group; ++h) {
            const float w = probs[h * max_kv + t];
            float* ah = acc.data() + h * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) ah[d] += w * vj[d];
          }
        }
      }
      scalar_t* out_row = out + row * heads * dim;
      for (int64_t i = 0; i < heads * dim; ++i) out_row[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

// q [rows, heads, dim]; kv_cache [pool tokens, 2, kv_heads, dim]; kv_indices [index rows, max_kv]
// (pool index of each sequence's keys, past its length unused); kv_lens [rows]: the keys each
// query row sees, the first kv_lens[row] of its index row; kv_rows [rows] (optional): the index
// row of each query row, else row i reads index row i -> [rows, heads, dim].
//
// Each (query row, KV head) is one work item, summed over its keys in order by one thread:
// a query's output does not depend on the other rows of the call, nor on whether it is a
// decode token or one of a prompt chunk's tokens (the worker's batch invariance rests on it).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& kv_indices,
                                  const at::Tensor& kv_lens, double scale, int64_t window,
                                  const std::optional<at::Tensor>& kv_rows_opt) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 4 && kv_indices.dim() == 2 && kv_lens.dim() == 1,
              "paged_decode_attention: q [rows, heads, dim], kv_cache [tokens, 2, kv_heads, dim], "
              "kv_indices [index rows, max_kv], kv_lens [rows]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache must share a dtype");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong, "indices must be int64");
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(1) == 2 && kv_cache.size(3) == dim && heads % kv_heads == 0, "shape mismatch");
  TORCH_CHECK(kv_lens.size(0) == rows, "one length per query row");
  at::Tensor kv_rows_c;
  if (kv_rows_opt.has_value() && kv_rows_opt->defined()) {
    kv_rows_c = kv_rows_opt->contiguous();
    TORCH_CHECK(kv_rows_c.scalar_type() == at::kLong && kv_rows_c.dim() == 1 && kv_rows_c.size(0) == rows,
                "kv_rows: one int64 index row per query row");
  } else {
    TORCH_CHECK(kv_indices.size(0) == rows, "one index row per query row (or kv_rows)");
  }
  const int64_t* kv_rows = kv_rows_c.defined() ? kv_rows_c.data_ptr<int64_t>() : nullptr;
  const at::Tensor qc = q.contiguous(), kvc = kv_cache.contiguous();
  const at::Tensor idx = kv_indices.contiguous(), lens = kv_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const auto rows_of = [&](auto kernel) {
      kernel(qc.data_ptr<scalar_t>(), kvc.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(), kv_rows,
             lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), rows, heads, kv_heads, dim, idx.size(1), scale,
             window);
    };
    if (dim == 64) {
      rows_of(decode_rows<scalar_t, 64>);
    } else if (dim == 128) {
      rows_of(decode_rows<scalar_t, 128>);
    } else if (dim == 256) {
      rows_of(decode_rows<scalar_t, 256>);
    } else {
      rows_of(decode_rows<scalar_t, 0>);
    }
  };
#ifdef TRIDENT_FAST_DECODE_BF16
  if (q.scalar_type() == at::kBFloat16 && kv_rows && query_tiles_bf16(qc, kvc, idx, kv_rows, lens, out, scale, window))
    return out;
  if (q.scalar_type() == at::kBFloat16 && decode_bf16(qc, kvc, idx, kv_rows, lens, out, scale, window)) return out;
#endif
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(c10::BFloat16{}); break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16, not ", q.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(trident, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor kv_indices, Tensor kv_lens, float scale, int window=0, "
      "Tensor? kv_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
