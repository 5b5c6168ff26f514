// Attention for a prompt chunk's queries, a tile of consecutive queries at a time: each K and V
// row the tile's queries read is loaded once for all of them, where the decode kernel
// (paged_decode_attention.cpp) loads it once per query.
//
// With batch invariance every query of a step is a row of paged_decode_attention (attention.py,
// `QueryKeys`), a prompt chunk's too; that op hands the rows to this kernel when it is given
// kv_rows. A tile is up to kQueries rows that read the same row of indices at consecutive
// lengths (a prompt chunk's tokens in order), and one work item is a tile and a KV head: its
// kQueries x kGroup query heads (about 16).
//
// A query's output is the same bits as the decode kernel's for it: every value it sums, it sums
// in the same order (attention_common.h holds the shared steps).
// - Scores: sixteen keys at a time are widened to float32 in L1 (widen_keys); each query head's
//   sixteen scores are scores_of_16, as the decode kernel's. Lanes past a query's keys are not
//   stored.
// - Softmax: the decode kernel's function, over the query's keys only.
// - Outputs: each query head's sum over its keys in order (add_weighted_value), one 16-column
//   slice of the head a pass over the tile's V rows, with one accumulator per query head; a key
//   outside a query's span adds nothing to it (not even a zero product).

#include <ATen/Parallel.h>
#include <torch/types.h>

#include "attention_common.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace trident_attention {

#ifdef __AVX512F__
namespace {

// Query heads of a tile: kQueries x kGroup accumulators fit the 32 vector registers beside the
// V row and the broadcast probabilities.
template <int kGroup>
constexpr int kQueries = std::max(1, 16 / kGroup);

constexpr int64_t kValueBlock = 64;  // keys an output pass sums before the next column
// Floats before each query head's probabilities: a block's masked store may start up to 15
// keys before them.
constexpr int64_t kProbsPad = kKeysAtOnce;

// One query's keys: index positions [begin, end) of its sequence's row.
struct KeySpan {
  int64_t begin, end;
};

template <int kGroup, int kDim>
void tile_item(const uint16_t* q, int64_t q_row_stride, int queries, const KeySpan* spans, float scale,
               const uint16_t* kv, const int64_t* tokens, int64_t token_stride, int64_t k_offset, int64_t v_offset,
               float* keys, float* qf, float* probs, int64_t probs_stride, float* out) {
  constexpr int kVecs = kDim / 16;
  constexpr int kHeads = kQueries<kGroup> * kGroup;
  const __m512 scale_v = _mm512_set1_ps(scale);
  // qf: each query head's scaled vectors, then the same with their halves swapped (scores_of_16_paired).
  for (int i = 0; i < queries; ++i)
    for (int g = 0; g < kGroup; ++g)
      for (int c = 0; c < kVecs; ++c) {
        const __m512 scaled = _mm512_mul_ps(widen16(q + i * q_row_stride + g * kDim + c * 16), scale_v);
        _mm512_store_ps(qf + ((i * kGroup + g) * 2 * kVecs + c) * 16, scaled);
        _mm512_store_ps(qf + ((i * kGroup + g) * 2 * kVecs + kVecs + c) * 16, swap_halves(scaled));
      }
  const int64_t first = spans[0].begin, last = spans[queries - 1].end;
  // Scores.
  for (int64_t t0 = first; t0 < last; t0 += kKeysAtOnce) {
    widen_key_pairs<kDim>(keys, kv, tokens + t0, last - t0, token_stride, k_offset);
    for (int i = 0; i < queries; ++i) {
      const KeySpan span = spans[i];
      if (span.end <= t0 || span.begin >= t0 + kKeysAtOnce) continue;
      const int64_t lo = std::max<int64_t>(span.begin - t0, 0), hi = std::min<int64_t>(span.end - t0, kKeysAtOnce);
      const __mmask16 mask = static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
      for (int g = 0; g < kGroup; ++g) {
        const float* qh = qf + (i * kGroup + g) * 2 * kDim;
        float* row = probs + (i * kGroup + g) * probs_stride + kProbsPad;
        _mm512_mask_storeu_ps(row + (t0 - span.begin), mask,
                              scores_of_16_paired<kVecs>([&](int c) { return _mm512_load_ps(qh + c * 16); },
                                                  [&](int c) { return _mm512_load_ps(qh + (kVecs + c) * 16); }, keys));
      }
    }
  }
  for (int i = 0; i < queries; ++i)
    for (int g = 0; g < kGroup; ++g)
      softmax_in_place(probs + (i * kGroup + g) * probs_stride + kProbsPad, spans[i].end - spans[i].begin);
  // Outputs, kValueBlock keys at a time (their V rows and probabilities stay in L1 for the
  // column passes); between blocks the sums wait in `out`. Keys [all_begin, all_end) are in
  // every query's span: no test per query there.
  const int64_t all_begin = spans[queries - 1].begin, all_end = spans[0].end;
  for (int64_t block0 = first; block0 < last; block0 += kValueBlock) {
    const int64_t block_end = std::min(last, block0 + kValueBlock);
    for (int c = 0; c < kVecs; ++c) {
      // acc[i][g]: query i's head g, column slice c.
      __m512 acc[kQueries<kGroup>][kGroup][1];
#pragma GCC unroll 16
      for (int h = 0; h < kHeads; ++h)
        acc[h / kGroup][h % kGroup][0] =
            block0 == first ? _mm512_setzero_ps() : _mm512_load_ps(out + (h * kVecs + c) * 16);
      for (int64_t t = block0; t < block_end; ++t) {
        if (c == 0 && t + kPrefetchAhead < last)
          prefetch_head<kDim>(kv + tokens[t + kPrefetchAhead] * token_stride + v_offset);
        const bool every_query = t >= all_begin && t < all_end;
        const __m512 v[1] = {widen16(kv + tokens[t] * token_stride + v_offset + c * 16)};
#pragma GCC unroll 16
        for (int i = 0; i < kQueries<kGroup>; ++i) {
          if (i >= queries || (!every_query && (t < spans[i].begin || t >= spans[i].end))) continue;
          const float* p = probs + i * kGroup * probs_stride + kProbsPad + (t - spans[i].begin);
          add_weighted_value<kGroup, 1>(acc[i], p, probs_stride, v);
        }
      }
#pragma GCC unroll 16
      for (int h = 0; h < kHeads; ++h) _mm512_store_ps(out + (h * kVecs + c) * 16, acc[h / kGroup][h % kGroup][0]);
    }
  }
}

template <int kGroup, int kDim>
void tile_rows(const c10::BFloat16* q, const c10::BFloat16* kv, const int64_t* kv_indices, const int64_t* kv_rows,
               const int64_t* kv_lens, c10::BFloat16* out, int64_t rows, int64_t kv_heads, int64_t max_kv,
               double scale, int64_t window) {
  constexpr int kVecs = kDim / 16;
  constexpr int kHeads = kQueries<kGroup> * kGroup;
  const int64_t heads = kv_heads * kGroup, token_stride = 2 * kv_heads * kDim;
  // Tiles: up to kQueries rows of one index row at consecutive lengths.
  std::vector<int64_t> tile_starts;
  for (int64_t row = 0; row < rows;) {
    tile_starts.push_back(row);
    int64_t next = row + 1;
    while (next < rows && next - row < kQueries<kGroup> && kv_rows[next] == kv_rows[row] &&
           kv_lens[next] == kv_lens[row] + (next - row))
      ++next;
    row = next;
  }
  tile_starts.push_back(rows);
  const int64_t tiles = static_cast<int64_t>(tile_starts.size()) - 1;
  const auto* q_bits = reinterpret_cast<const uint16_t*>(q);
  const auto* kv_bits = reinterpret_cast<const uint16_t*>(kv);
  auto* out_bits = reinterpret_cast<trident_kernels::Bf16Bits*>(out);
  const int64_t probs_stride = (kProbsPad + max_kv + 15) / 16 * 16;
  trident_kernels::parallel_for_claimed(tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float keys[kKeysAtOnce * kDim], qf[2 * kHeads * kDim], result[kHeads * kDim];
    std::vector<float> probs(kHeads * probs_stride);
    KeySpan spans[kQueries<kGroup>];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / kv_heads, kv_head = item % kv_heads;
      const int64_t row0 = tile_starts[tile];
      const int queries = static_cast<int>(tile_starts[tile + 1] - row0);
      for (int i = 0; i < queries; ++i) spans[i] = {window_start(kv_lens[row0 + i], window), kv_lens[row0 + i]};
      const int64_t first_head = kv_head * kGroup;
      tile_item<kGroup, kDim>(q_bits + (row0 * heads + first_head) * kDim, heads * kDim, queries, spans,
                              static_cast<float>(scale), kv_bits, kv_indices + kv_rows[row0] * max_kv, token_stride,
                              kv_head * kDim, (kv_heads + kv_head) * kDim, keys, qf, probs.data(), probs_stride,
                              result);
      for (int i = 0; i < queries; ++i) {
        trident_kernels::Bf16Bits* dst = out_bits + ((row0 + i) * heads + first_head) * kDim;
        const float* src = result + i * kGroup * kDim;
#pragma omp simd
        for (int64_t e = 0; e < kGroup * kDim; ++e) dst[e] = trident_kernels::round_to<trident_kernels::Bf16Bits>(src[e]);
      }
    }
  });
}

}  // namespace
#endif

bool query_tiles_bf16(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& idx, const int64_t* kv_rows,
                      const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
#ifdef __AVX512F__
  const int64_t rows = q.size(0), dim = q.size(2), kv_heads = kv.size(2), group = q.size(1) / kv_heads;
  const auto run = [&](auto kernel) {
    kernel(q.data_ptr<c10::BFloat16>(), kv.data_ptr<c10::BFloat16>(), idx.data_ptr<int64_t>(), kv_rows,
           lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), rows, kv_heads, idx.size(1), scale, window);
    return true;
  };
  const auto of_group = [&](auto dim_constant) {
    constexpr int kDim = decltype(dim_constant)::value;
    switch (group) {
      case 1: return run(tile_rows<1, kDim>);
      case 2: return run(tile_rows<2, kDim>);
      case 3: return run(tile_rows<3, kDim>);
      case 4: return run(tile_rows<4, kDim>);
      case 8: return run(tile_rows<8, kDim>);
      default: return false;
    }
  };
  // A head of 256 (Gemma 3) would keep its query in 16 registers beside 16 keys' lanes: the
  // decode kernel's loop serves it.
  switch (dim) {
    case 64: return of_group(std::integral_constant<int, 64>{});
    case 128: return of_group(std::integral_constant<int, 128>{});
    default: return false;
  }
#else
  return false;
#endif
}

}  // namespace trident_attention
