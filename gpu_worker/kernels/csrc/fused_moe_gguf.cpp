// A mixture-of-experts FFN on CPU over a GGUF's quantized expert weights, in one op: each
// token's k routed experts (SwiGLU: down(silu(gate x) * up x)), weighted by its routing weights
// and summed. The weights stay in the layouts of csrc/quant_linear.cpp (U4, I8, I5, I6: its
// header comment describes them), and every dot product is quant_linear.cpp's own tile
// (quant_tiles.h) on int8 activations (int8_activations.h).
//
// Weights: each projection of every expert as one packed weight (layers/fused_moe_gguf.py
// stacks the experts' rows, so that all of them share one layout and scale type): gate_up
// [E * 2 I, H], each expert's rows as runs of 16 gate rows and the same 16 up rows, so that
// panel pair p yields intermediate columns 16 p .. 16 p + 15; down [E * H, I]. I and H are
// multiples of 32 (the quantization blocks' width), so every expert starts on a panel.
//
// Grouped by expert: the (token, slot) pairs are counting-sorted by expert id (moe_routing.h),
// their input rows gathered in that order and quantized, and each expert's weights read once
// per pass for all of its rows (a pass: up to kTokensPerPass tokens, every decode step in
// one). Three phases, the first two over work items that threads claim a few at a time:
//   1. gate_up: items (expert, 16 intermediate columns): the gate and up panels' float32 sums
//      rounded to x's dtype, then silu, rounded, times up, rounded: what the dense path's
//      quant_linear and silu_and_mul compute (layer_elementwise.cpp). The activation rows
//      are then quantized as quant_linear quantizes its input.
//   2. down: items (expert, 16 output columns); each (token, slot)'s float32 sums go to a
//      scratch [tokens, k, hidden], not rounded (as the bf16 fused op keeps them).
//   3. per token, the weighted sum over its slots in slot order (moe_routing.h's sum_slots),
//      rounded to x's dtype once.
// So every float32 sum is, bit for bit, the one quant_linear computes for the same expert and
// row; in float32 activations the op equals each expert's own QuantLinear layers weighted in
// slot order, and in bf16 it differs from them only by their rounding of down's output.
//
// Batch invariance: each output is summed block by block in k order on its own accumulator
// (quant_linear.cpp), whatever the rows beside it in its tile or the thread, and the weighted
// sum runs in slot order: a token's bits depend on its own inputs and routing only.
//
// Registered as torch.ops.trident.fused_moe_gguf; the fake kernel for tracing is in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "int8_activations.h"
#include "kernel_common.h"
#include "moe_routing.h"
#include "quant_tiles.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace {

using namespace trident_kernels::quant;
using trident_kernels::round_to;
using trident_kernels::widen;
using trident_kernels::moe::group_by_expert;
using trident_kernels::moe::Groups;
using trident_kernels::moe::kTokensPerPass;

// One projection of every expert, packed as quant_linear.py packs one weight of their stacked rows.
struct Projection {
  const uint8_t* packed;
  int64_t panels;  // per expert
  int64_t blocks, block_bytes;
  std::array<TileFn, kMaxTileRows> tiles;

  const uint8_t* panel(int64_t expert, int64_t p) const { return packed + (expert * panels + p) * blocks * block_bytes; }

  // Rows [row0, row0 + rows) of x (rows <= kMaxTileRows) through a panel into result[r * 16 + column].
  void sums(const uint8_t* panel, const QuantizedRows& x, int64_t row0, int64_t rows, float* result) const {
    tiles[rows - 1](panel, blocks, block_bytes, x, row0, result);
  }
};

// Items a claim holds: about 32 KB of weights, and at least 4 claims a thread where the items
// allow (as quant_linear.cpp's panels).
int64_t claim_size(int64_t items, int64_t item_bytes) {
  const int64_t by_size = std::max<int64_t>(1, 32768 / item_bytes);
  const int64_t by_count = std::max<int64_t>(1, items / (4 * std::max(1, at::get_num_threads())));
  return std::min(by_size, by_count);
}

template <typename T>
T* scratch_of(at::Tensor& buffer, int64_t count) {
  buffer = at::empty({count * static_cast<int64_t>(sizeof(T))}, at::kByte);
  return reinterpret_cast<T*>(buffer.data_ptr<uint8_t>());
}

struct Shapes {
  int64_t hidden, inter, k, experts, tile_rows;
};

// One pass of `tokens` tokens: x [tokens, hidden], ids / weights [tokens, k] -> out [tokens, hidden].
template <typename storage_t>
void moe_pass(const Shapes& s, const storage_t* x, const int32_t* ids, const float* weights, int64_t tokens,
              const Projection& gate_up, const Projection& down, storage_t* out) {
  const int64_t pairs = tokens * s.k;
  const Groups g = group_by_expert(ids, pairs, s.experts);
  const int64_t groups = static_cast<int64_t>(g.experts.size());
  at::Tensor gathered_buffer, act_buffer, scratch_buffer;
  storage_t* gathered = scratch_of<storage_t>(gathered_buffer, pairs * s.hidden);
  at::parallel_for(0, pairs, trident_kernels::rows_per_task(s.hidden), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) std::copy_n(x + (g.pairs[i] / s.k) * s.hidden, s.hidden, gathered + i * s.hidden);
  });
  std::vector<int32_t> x_codes, act_codes;
  const QuantizedRows xq = trident_kernels::quantize_into(x_codes, gathered, pairs, s.hidden);

  storage_t* act = scratch_of<storage_t>(act_buffer, pairs * s.inter);
  const int64_t act_panels = s.inter / kPanelColumns, gate_up_items = groups * act_panels;
  const int64_t gate_up_claim = claim_size(gate_up_items, 2 * gate_up.blocks * gate_up.block_bytes);
  trident_kernels::parallel_for_claimed(gate_up_items, gate_up_claim, [&](int64_t begin, int64_t end) {
    alignas(64) float gate_sums[kMaxTileRows * kPanelColumns], up_sums[kMaxTileRows * kPanelColumns];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t group = item / act_panels, p = item % act_panels, expert = g.experts[group];
      const int64_t first = g.first_pair[group], count = g.first_pair[group + 1] - first;
      for (int64_t r0 = 0; r0 < count; r0 += s.tile_rows) {
        const int64_t rows = std::min(s.tile_rows, count - r0);
        gate_up.sums(gate_up.panel(expert, 2 * p), xq, first + r0, rows, gate_sums);
        gate_up.sums(gate_up.panel(expert, 2 * p + 1), xq, first + r0, rows, up_sums);
        for (int64_t r = 0; r < rows; ++r) {
          storage_t* dst = act + (first + r0 + r) * s.inter + p * kPanelColumns;
          for (int64_t c = 0; c < kPanelColumns; ++c) {
            const float gate = widen(round_to<storage_t>(gate_sums[r * kPanelColumns + c]));
            const float up = widen(round_to<storage_t>(up_sums[r * kPanelColumns + c]));
            const float activated = widen(round_to<storage_t>(trident_kernels::silu(gate)));
            dst[c] = round_to<storage_t>(activated * up);
          }
        }
      }
    }
  });
  const QuantizedRows aq = trident_kernels::quantize_into(act_codes, act, pairs, s.inter);

  float* scratch = scratch_of<float>(scratch_buffer, pairs * s.hidden);
  const int64_t down_items = groups * down.panels;
  trident_kernels::parallel_for_claimed(
      down_items, claim_size(down_items, down.blocks * down.block_bytes), [&](int64_t begin, int64_t end) {
        alignas(64) float sums[kMaxTileRows * kPanelColumns];
        for (int64_t item = begin; item < end; ++item) {
          const int64_t group = item / down.panels, p = item % down.panels, expert = g.experts[group];
          const int64_t first = g.first_pair[group], count = g.first_pair[group + 1] - first;
          for (int64_t r0 = 0; r0 < count; r0 += s.tile_rows) {
            const int64_t rows = std::min(s.tile_rows, count - r0);
            down.sums(down.panel(expert, p), aq, first + r0, rows, sums);
            for (int64_t r = 0; r < rows; ++r)
              std::copy_n(sums + r * kPanelColumns, kPanelColumns,
                          scratch + g.pairs[first + r0 + r] * s.hidden + p * kPanelColumns);
          }
        }
      });
  trident_kernels::moe::sum_slots(scratch, weights, tokens, s.k, s.hidden, out);
}

// x [T, H] (float32, bfloat16 or float16); topk_ids [T, k] int32; topk_weights [T, k] float32;
// gate_up and down packed as the module docstring of layers/fused_moe_gguf.py says, each with
// its layout, block and scale type (quant_linear's arguments); path "auto", "avx512_vnni" or
// "avx2" -> [T, H] in x's dtype.
at::Tensor fused_moe_gguf(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                          const at::Tensor& gate_up, int64_t gate_up_layout, int64_t gate_up_block,
                          bool gate_up_half_scales, const at::Tensor& down, int64_t down_layout, int64_t down_block,
                          bool down_half_scales, c10::string_view path) {
  TORCH_CHECK(x.dim() == 2, "fused_moe_gguf: x [tokens, hidden]");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
              "fused_moe_gguf: topk_ids [tokens, k] int32");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes(),
              "fused_moe_gguf: topk_weights [tokens, k] float32");
  TORCH_CHECK(down.dim() == 3 && x.size(1) > 0 && x.size(1) % kPanelColumns == 0, "fused_moe_gguf: down [E * H / 16, blocks, bytes]");
  const int64_t tokens = x.size(0), hidden = x.size(1), inter = down.size(1) * down_block;
  const int64_t experts = down.size(0) / (hidden / kPanelColumns);
  check_packed(down, experts * hidden, inter, down_layout, down_block, down_half_scales, "fused_moe_gguf (down)");
  check_packed(gate_up, experts * 2 * inter, hidden, gate_up_layout, gate_up_block, gate_up_half_scales,
               "fused_moe_gguf (gate_up)");
  const bool vnni = use_vnni(path, "fused_moe_gguf");
  const Projection gate_up_w{gate_up.data_ptr<uint8_t>(), 2 * inter / kPanelColumns, gate_up.size(1), gate_up.size(2),
                             pick_tiles(vnni, gate_up_layout, gate_up_block, gate_up_half_scales)};
  const Projection down_w{down.data_ptr<uint8_t>(), hidden / kPanelColumns, down.size(1), down.size(2),
                          pick_tiles(vnni, down_layout, down_block, down_half_scales)};
  const Shapes s{hidden, inter, topk_ids.size(1), experts, vnni ? kMaxTileRows : kAvx2TileRows};
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  const at::Tensor xc = x.contiguous(), ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
#ifdef __AVX2__
  trident_kernels::dispatch_float_dtype(x, "fused_moe_gguf", [&](auto storage, auto element) {
    using storage_t = decltype(storage);
    using element_t = decltype(element);
    const storage_t* x_rows = trident_kernels::bits_of<storage_t, element_t>(xc);
    storage_t* out_rows = trident_kernels::bits_of<storage_t, element_t>(out);
    for (int64_t t0 = 0; t0 < tokens; t0 += kTokensPerPass) {
      const int64_t pass = std::min(kTokensPerPass, tokens - t0);
      moe_pass(s, x_rows + t0 * hidden, ids.data_ptr<int32_t>() + t0 * s.k, weights.data_ptr<float>() + t0 * s.k, pass,
               gate_up_w, down_w, out_rows + t0 * hidden);
    }
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def(
      "fused_moe_gguf(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, int gate_up_layout, "
      "int gate_up_block, bool gate_up_half_scales, Tensor down, int down_layout, int down_block, "
      "bool down_half_scales, str path='auto') -> Tensor");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) { m.impl("fused_moe_gguf", &fused_moe_gguf); }
