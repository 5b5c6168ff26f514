// What the two attention kernels share: the decode kernel (paged_decode_attention.cpp, one query
// per work item) and the query-tile kernel (query_tile_attention.cpp, a prompt chunk's
// consecutive queries per work item). The worker's batch invariance asks a query's output to be
// the same bits from either (a resumed request re-prefills the tokens it had decoded, then
// decodes on from them), so each step of a query's arithmetic that both take is written once,
// here: the score's lanes (dot_lanes), their sum (sum_lanes, and sum_lanes_of_16 for sixteen
// scores at once in the same order; scores_of_16 for sixteen keys widened by widen_keys), the
// softmax, the order of the keys, and each key's term in an output sum (add_weighted_value).

#pragma once

#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define TRIDENT_FAST_DECODE_BF16 1
#include <immintrin.h>
#endif

namespace trident_attention {

// Tokens ahead to prefetch: a row's pool entries are scattered (page size 1, rows decoding
// side by side), so each is a fresh trip to memory (~100 ns) against ~20 ns of work a token.
constexpr int64_t kPrefetchAhead = 16;

// The first of a row's `len` keys its query sees: the last `window` of them (0: all).
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

// The row of kv_indices that query row `row` reads its keys from: its own, or kv_rows[row]
// when given (every query of a prompt chunk reads its sequence's one row of indices).
inline int64_t index_row(const int64_t* kv_rows, int64_t row) { return kv_rows ? kv_rows[row] : row; }

// Scores to probabilities, in place, over one query head's `len` keys. Defined once (in
// paged_decode_attention.cpp) and never inlined: both kernels run the same machine code.
void softmax_in_place(float* p, int64_t len);

#ifdef TRIDENT_FAST_DECODE_BF16
// Every cache line of one head's kDim bfloat16 values (two for 64, eight for 256).
template <int kDim>
inline void prefetch_head(const uint16_t* head) {
#pragma GCC unroll 8
  for (int i = 0; i < kDim; i += 32) __builtin_prefetch(head + i);
}

// The same lines, towards L2 only (a long row's V rows, fetched well before use, would
// otherwise evict the K rows in L1).
template <int kDim>
inline void prefetch_head_to_l2(const uint16_t* head) {
#pragma GCC unroll 8
  for (int i = 0; i < kDim; i += 32) __builtin_prefetch(head + i, 0, 2);
}
#endif

#ifdef __AVX512F__
using trident_kernels::widen16;

// The 16 lanes of a score (query . key), before their sum: lane l sums the products of elements
// l, l + 16, ... in order, on kChains chains (two for a long head) added at the end.
template <int kVecs, typename Query, typename Key>
inline __m512 dot_lanes(const Query& query, const Key& key) {
  constexpr int kChains = kVecs >= 8 ? 2 : 1;
  __m512 s[kChains];
#pragma GCC unroll 2
  for (int i = 0; i < kChains; ++i) s[i] = _mm512_mul_ps(query(i), key(i));
#pragma GCC unroll 16
  for (int c = kChains; c < kVecs; ++c) s[c % kChains] = _mm512_fmadd_ps(query(c), key(c), s[c % kChains]);
  if constexpr (kChains == 2) s[0] = _mm512_add_ps(s[0], s[1]);
  return s[0];
}

// The sum of a vector's lanes as a halving tree: lanes l and l + 8, then l and l + 4, l and l + 2,
// l and l + 1 (GCC's _mm512_reduce_add_ps, written out so that no compiler's choice changes it).
inline float sum_lanes(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 eighths = _mm256_add_ps(hi, lo);
  const __m128 quarters = _mm_add_ps(_mm256_extractf128_ps(eighths, 1), _mm256_castps256_ps128(eighths));
  const __m128 halves = _mm_add_ps(quarters, _mm_shuffle_ps(quarters, quarters, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(halves) + _mm_cvtss_f32(_mm_shuffle_ps(halves, halves, 1));
}

constexpr int64_t kKeysAtOnce = 16;  // keys a score block widens: one sum_lanes_of_16

// Lane j: sum_lanes(v[j]), with the same additions of the same pairs, sixteen sums at a time
// (15 vector additions where sixteen sum_lanes take 60 scalar ones), from the first halving on:
// eighths[m] holds in lanes 0-7 the pairs (l, l + 8) of v[2m] summed, in lanes 8-15 those of
// v[2m + 1].
inline __m512 sum_lanes_of_16(const __m512 (&eighths)[8]) {
  __m512 quarters[4], halves[2];
  // quarters[m]: 128-bit lane q holds the four pairs (l, l + 4) of v[4m + q].
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m)
    quarters[m] = _mm512_add_ps(_mm512_shuffle_f32x4(eighths[2 * m], eighths[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                                _mm512_shuffle_f32x4(eighths[2 * m], eighths[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  // halves[m]: 128-bit lane q holds the pairs (l, l + 2) of v[q] and v[4 + q] (m = 0), of v[8 + q]
  // and v[12 + q] (m = 1).
#pragma GCC unroll 2
  for (int m = 0; m < 2; ++m)
    halves[m] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(quarters[2 * m], quarters[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Lane 4q + j: the sum of v[4j + q].
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// The K rows of one head for the first min(16, remaining) of `tokens`, widened into `keys`
// [16][kDim] (rows past them zero), and the next sixteen's lines prefetched.
template <int kDim>
inline void widen_keys(float* keys, const uint16_t* kv, const int64_t* tokens, int64_t remaining,
                       int64_t token_stride, int64_t k_offset) {
  constexpr int kVecs = kDim / 16;
  const int64_t n = std::min(kKeysAtOnce, remaining);
  for (int64_t j = 0; j < n; ++j) {
    if (kKeysAtOnce + j < remaining) prefetch_head<kDim>(kv + tokens[kKeysAtOnce + j] * token_stride + k_offset);
    const uint16_t* k = kv + tokens[j] * token_stride + k_offset;
#pragma GCC unroll 16
    for (int c = 0; c < kVecs; ++c) _mm512_store_ps(keys + (j * kVecs + c) * 16, widen16(k + c * 16));
  }
  for (int64_t j = n; j < kKeysAtOnce; ++j)
#pragma GCC unroll 16
    for (int c = 0; c < kVecs; ++c) _mm512_store_ps(keys + (j * kVecs + c) * 16, _mm512_setzero_ps());
}

// Lane j: one query head's score against key j of `keys` (widen_keys), the bits that
// sum_lanes(dot_lanes(...)) gives that key alone; `query(c)` is the head's scaled vector c.
template <int kVecs, typename Query>
inline __m512 scores_of_16(const Query& query, const float* keys) {
  __m512 qv[kVecs];
#pragma GCC unroll 16
  for (int c = 0; c < kVecs; ++c) qv[c] = query(c);
  __m512 lanes[kKeysAtOnce];
#pragma GCC unroll 16
  for (int j = 0; j < kKeysAtOnce; ++j)
    lanes[j] = dot_lanes<kVecs>([&](int c) { return qv[c]; },
                                [&](int c) { return _mm512_load_ps(keys + (j * kVecs + c) * 16); });
  // eighths[m]: lanes 0-7 the pairs (l, l + 8) of lanes[2m], lanes 8-15 those of lanes[2m + 1].
  __m512 eighths[kKeysAtOnce / 2];
#pragma GCC unroll 8
  for (int m = 0; m < kKeysAtOnce / 2; ++m)
    eighths[m] = _mm512_add_ps(_mm512_shuffle_f32x4(lanes[2 * m], lanes[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                               _mm512_shuffle_f32x4(lanes[2 * m], lanes[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  return sum_lanes_of_16(eighths);
}

// widen_keys in another layout, for the query-tile kernel, whose many query heads a block
// (against the decode kernel's few) pay for the pairing many times over. Keys 2m and 2m + 1
// (a, b) are stored as kVecs pairs of vectors: for column slice c, [a's lanes 0-7, b's lanes
// 8-15] and then [a's lanes 8-15, b's lanes 0-7], so that the first halving of each score's
// lanes (sum_lanes_of_16) is one vertical addition of the two (scores_of_16_paired) instead of
// shuffles.
template <int kDim>
inline void widen_key_pairs(float* keys, const uint16_t* kv, const int64_t* tokens, int64_t remaining,
                            int64_t token_stride, int64_t k_offset) {
  constexpr int kVecs = kDim / 16;
  const int64_t n = std::min(kKeysAtOnce, remaining);
  // Quadwords (four values) of slices c (even) and c + 1 of a (0-7) and b (8-15) into the 128-bit
  // lanes of a vector whose low (high) four words each lane widen to the first (second) vector.
  const __m512i even = _mm512_setr_epi64(0, 2, 1, 3, 10, 8, 11, 9);
  const __m512i odd = _mm512_setr_epi64(4, 6, 5, 7, 14, 12, 15, 13);
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j = 0; j < kKeysAtOnce; j += 2) {
    for (int64_t ahead = kKeysAtOnce + j; ahead < std::min(kKeysAtOnce + j + 2, remaining); ++ahead)
      prefetch_head<kDim>(kv + tokens[ahead] * token_stride + k_offset);
    const uint16_t* a = j < n ? kv + tokens[j] * token_stride + k_offset : nullptr;
    const uint16_t* b = j + 1 < n ? kv + tokens[j + 1] * token_stride + k_offset : nullptr;
    float* out = keys + j * kDim;
#pragma GCC unroll 8
    for (int c = 0; c < kVecs; c += 2) {
      const __m512i ra = a ? _mm512_loadu_si512(a + c * 16) : zero;
      const __m512i rb = b ? _mm512_loadu_si512(b + c * 16) : zero;
      const __m512i lo = _mm512_permutex2var_epi64(ra, even, rb), hi = _mm512_permutex2var_epi64(ra, odd, rb);
      _mm512_store_si512(out + (2 * c) * 16, _mm512_unpacklo_epi16(zero, lo));
      _mm512_store_si512(out + (2 * c + 1) * 16, _mm512_unpackhi_epi16(zero, lo));
      _mm512_store_si512(out + (2 * c + 2) * 16, _mm512_unpacklo_epi16(zero, hi));
      _mm512_store_si512(out + (2 * c + 3) * 16, _mm512_unpackhi_epi16(zero, hi));
    }
  }
}

// A vector with its 256-bit halves swapped: the query for the second vector of a pair of keys.
inline __m512 swap_halves(__m512 v) { return _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)); }

// scores_of_16 for keys widened by widen_key_pairs: lane j, one query head's score against key
// j, the bits that sum_lanes(dot_lanes(...)) gives that key alone; `query(c)` is the head's
// scaled vector c and `swapped(c)` swap_halves of it (a caller that scores many blocks keeps both
// at hand). Each pair of keys takes dot_lanes twice, with the query and with its halves swapped,
// and the halving sum_lanes_of_16 starts with is their sum (each lane's addition the same,
// operands swapped).
template <int kVecs, typename Query, typename Swapped>
inline __m512 scores_of_16_paired(const Query& query, const Swapped& swapped, const float* keys) {
  __m512 eighths[kKeysAtOnce / 2];
#pragma GCC unroll 8
  for (int m = 0; m < kKeysAtOnce / 2; ++m) {
    const float* pair = keys + 2 * m * kVecs * 16;
    const __m512 first = dot_lanes<kVecs>(query, [&](int c) { return _mm512_load_ps(pair + (2 * c) * 16); });
    const __m512 second = dot_lanes<kVecs>(swapped,
                                           [&](int c) { return _mm512_load_ps(pair + (2 * c + 1) * 16); });
    eighths[m] = _mm512_add_ps(second, first);
  }
  return sum_lanes_of_16(eighths);
}

// One key's term in kHeads query heads' output sums, over kColumns 16-column slices of its V
// row (widened): acc[h][c] += p[h * p_stride] * v[c]. Every output value is such a sum over its
// query's keys in order from zero, one rounding a term, in both kernels.
template <int kHeads, int kColumns>
inline void add_weighted_value(__m512 (&acc)[kHeads][kColumns], const float* p, int64_t p_stride,
                               const __m512 (&v)[kColumns]) {
#pragma GCC unroll 16
  for (int c = 0; c < kColumns; ++c)
#pragma GCC unroll 16
    for (int h = 0; h < kHeads; ++h) acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * p_stride]), v[c], acc[h][c]);
}
#endif

// The query-tile kernel over every query row (query_tile_attention.cpp): false where it has no
// path for this head dim, GQA group or instruction set, and the decode kernel's loop runs instead.
// Arguments as paged_decode_attention's, contiguous; kv_rows given.
bool query_tiles_bf16(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const int64_t* kv_rows,
                      const at::Tensor& lens, at::Tensor& out, double scale, int64_t window);

}  // namespace trident_attention
