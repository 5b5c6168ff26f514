// What the fused MoE ops (csrc/fused_moe.cpp on bf16 weights, csrc/fused_moe_gguf.cpp on a
// GGUF's quantized ones) share: a pass's (token, slot) pairs grouped by expert, and the
// weighted sum over each token's slots in slot order.
#pragma once

#include <torch/types.h>

#include "amx_tiles.h"
#include "kernel_common.h"

#include <cstdint>
#include <vector>

namespace trident_kernels::moe {

namespace amx = trident_kernels::amx;

// Tokens of one pass: their inputs, activations and float32 scratch ([tokens, k, hidden]) stay
// bounded for long prompt chunks; a decode step is one pass, so each expert's weights are read
// once.
constexpr int64_t kTokensPerPass = 256;

// A pass's (token, slot) pairs grouped by expert: the experts that have any, ascending, and for
// each its pairs (token * k + slot within the pass, ascending) and its first row tile
// (fused_moe.cpp's input tiles of 16 rows).
struct Groups {
  std::vector<int64_t> experts;
  std::vector<int64_t> first_pair;  // per expert, and one past the last
  std::vector<int64_t> pairs;
  std::vector<int64_t> first_tile;  // per expert, and one past the last
  std::vector<int64_t> tile_group;  // per row tile: its index in `experts`
};

inline Groups group_by_expert(const int32_t* ids, int64_t pairs, int64_t experts) {
  std::vector<int64_t> counts(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "fused_moe: expert id ", ids[p], " outside [0, ", experts, ")");
    ++counts[ids[p] + 1];
  }
  Groups g;
  std::vector<int64_t> group_of(experts, -1);
  g.first_pair.push_back(0);
  g.first_tile.push_back(0);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t count = counts[e + 1];
    if (count == 0) continue;
    group_of[e] = static_cast<int64_t>(g.experts.size());
    g.experts.push_back(e);
    g.first_pair.push_back(g.first_pair.back() + count);
    const int64_t tiles = (count + amx::kTileRows - 1) / amx::kTileRows;
    g.tile_group.insert(g.tile_group.end(), tiles, group_of[e]);
    g.first_tile.push_back(g.first_tile.back() + tiles);
  }
  g.pairs.resize(pairs);
  std::vector<int64_t> next(g.first_pair.begin(), g.first_pair.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) g.pairs[next[group_of[ids[p]]]++] = p;
  return g;
}

// out[t] = sum over slots j = 0, 1, ..., k-1 of weights[t, j] * rows[t, j] in float32 (each
// product rounded, then added, in that order), rounded to storage_t once: rows [tokens, k,
// hidden] float32, weights [tokens, k].
template <typename storage_t>
void sum_slots(const float* rows, const float* weights, int64_t tokens, int64_t k, int64_t hidden, storage_t* out) {
  at::parallel_for(0, tokens, rows_per_task(k * hidden), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* r = rows + t * k * hidden;
      storage_t* o = out + t * hidden;
#pragma omp simd
      for (int64_t h = 0; h < hidden; ++h) {
        float sum = 0.f;
        for (int64_t j = 0; j < k; ++j) sum = sum + weights[t * k + j] * r[j * hidden + h];
        o[h] = round_to<storage_t>(sum);
      }
    }
  });
}

}  // namespace trident_kernels::moe
