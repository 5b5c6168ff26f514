// A mixture-of-experts FFN on CPU for a step's tokens, in one op: each token's k routed experts
// (SwiGLU: down(silu(gate x) * up x)), weighted by its routing weights and summed.
//
// Grouped by expert: the (token, slot) pairs are counting-sorted by expert id, and each expert's
// weights are read once per pass for all of its tokens (a pass: up to kTokensPerPass tokens,
// every decode step in one). Three phases, each an OpenMP region whose threads claim work items
// one at a time (parallel_for_claimed):
//   1. gate_up: items (expert, 16 intermediate columns). The packed gate_up block holds those
//      16 gate columns beside the same 16 up columns (fused_moe.py interleaves them), so the
//      activation round(round(silu(round(g))) * round(u)) follows at once, as the dense MLP
//      rounds it (bf16 gate_up, then silu_and_mul); it is written straight into the input
//      tiles of the down projection.
//   2. down: items (expert, 32 output columns); each (token, slot)'s row of float32 sums goes to
//      a scratch [tokens, k, hidden], not rounded.
//   3. per token, out = sum over slots j = 0, 1, ..., k-1 of weight[j] * scratch[j] in float32
//      (each product rounded, then added, in that order), rounded to bfloat16 once.
//
// Weights: amx_tiles.h's packed layout, one per expert: gate_up [E, 2 I' / 32, H' / 32, 2, 16,
// 32] and down [E, H' / 32, I' / 32, 2, 16, 32] (I', H': padded to multiples of 32 with zeros,
// which add exact zeros). Inputs: the expert's rows gathered into 16-row input tiles.
//
// Three block-sum paths (moe_block_sums.h), over the same packed weights and input tiles:
//   - "amx": TDPBF16PS tiles (amx_tiles.h's block_sums);
//   - "avx512_bf16": vdpbf16ps, 16 columns a register, a k-pair at a time;
//   - "portable": plain C++ in vdpbf16ps's order (per k-pair, the odd product then the even
//     one, each added to the float32 sum: bf16 products are exact in float32), for CPUs
//     without AVX512-BF16; its bits are the avx512_bf16 path's, but for subnormals, which
//     vdpbf16ps flushes to zero.
// AMX's accumulation inside one TDPBF16PS is not the sequence of float32 roundings either
// instruction's pseudocode shows (checked on hardware), so the amx path's bits differ from the
// other two in the last places; each is within the float32 rounding bound of its sums.
//
// Batch invariance: every output's sum runs over k-chunks 0, 1, 2, ... (pairs 0..15 within one)
// on its own accumulator, whatever the other rows of its tile or the thread, and the weighted
// sum over slots runs in slot order. So a token's bits depend on its own inputs and routing
// only: not on the other tokens of the step, their number, its position, or the thread count.
//
// Registered as torch.ops.trident.fused_moe_pack / fused_moe / fused_moe_best_path; the fake
// kernels for tracing are in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "amx_tiles.h"
#include "kernel_common.h"
#include "moe_block_sums.h"
#include "moe_routing.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

namespace amx = trident_kernels::amx;
using amx::kBlockChunkElements;
using amx::kBlockColumns;
using amx::kChunk;
using amx::kTileElements;
using amx::kTileRows;
using amx::round_up;
using trident_kernels::Bf16Bits;
using trident_kernels::round_to;
using trident_kernels::widen;
using trident_kernels::moe::for_each_item;
using trident_kernels::moe::group_by_expert;
using trident_kernels::moe::Groups;
using trident_kernels::moe::kTokensPerPass;
using trident_kernels::moe::Kernel;
using trident_kernels::moe::kernel_for;
using trident_kernels::moe::Path;

// Intermediate columns a gate_up block yields (16 gate and 16 up columns).
constexpr int64_t kActivationColumns = kBlockColumns / 2;
// Input elements a task of the packing region copies at least: a decode step's few tiles are
// copied on the calling thread, since on cores shared with other processes waking a teammate
// can cost more than the copy (kernel_common.h's rows_per_task says the same of the elementwise ops).
constexpr int64_t kPackElementsPerTask = 1 << 20;
// Rows that block sums take at once (two input tiles: the AMX path's four accumulator tiles).
constexpr int64_t kRowsPerCall = 2 * kTileRows;

bool cpu_has_avx512_bf16_build() {
#if defined(__AVX512F__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// "amx", "avx512_bf16" or "portable": the path "auto" takes on this CPU.
std::string fused_moe_best_path() {
  if (amx::cpu_has_amx_bf16()) return "amx";
  return cpu_has_avx512_bf16_build() ? "avx512_bf16" : "portable";
}

Path path_named(c10::string_view name) {
  const std::string wanted = name == "auto" ? fused_moe_best_path() : std::string(name);
  if (wanted == "amx") {
    TORCH_CHECK(amx::cpu_has_amx_bf16(), "fused_moe: this CPU has no AMX-BF16 (or the OS does not grant its tiles)");
    return Path::kAmx;
  }
  if (wanted == "avx512_bf16") {
    TORCH_CHECK(cpu_has_avx512_bf16_build(), "fused_moe: this CPU (or this build) has no AVX512-BF16");
    return Path::kAvx512Bf16;
  }
  TORCH_CHECK(wanted == "portable", "fused_moe: path auto, amx, avx512_bf16 or portable, not ", wanted);
  return Path::kPortable;
}

// weights [E, n, k] bfloat16 -> [E, ceil(n / 32), ceil(k / 32), 2, 16, 32] (amx_tiles.h's layout).
at::Tensor fused_moe_pack(const at::Tensor& weights) {
  TORCH_CHECK(weights.scalar_type() == at::kBFloat16 && weights.dim() == 3, "fused_moe_pack: weights [E, n, k] bf16");
  const int64_t experts = weights.size(0), n = weights.size(1), k = weights.size(2);
  const int64_t blocks = round_up(n, kBlockColumns) / kBlockColumns, chunks = round_up(k, kChunk) / kChunk;
  at::Tensor packed = at::zeros({experts, blocks, chunks, 2, kTileRows, kChunk}, weights.options());
  const at::Tensor w = weights.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, experts * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t expert = item / blocks, block = item % blocks;
      amx::pack_weight_block(src + expert * n * k, n, k, block, dst + item * chunks * kBlockChunkElements);
    }
  });
  return packed;
}

struct Shapes {
  int64_t hidden, k, gate_up_blocks, down_blocks, hidden_chunks, inter_chunks;
};

// One pass of `tokens` tokens: x [tokens, hidden], ids / weights [tokens, k] -> out [tokens, hidden].
void moe_pass(const Kernel& kernel, const Shapes& s, const uint16_t* x, const int32_t* ids, const float* weights,
              int64_t tokens, int64_t experts, const uint16_t* gate_up, const uint16_t* down, uint16_t* out) {
  const Groups g = group_by_expert(ids, tokens * s.k, experts);
  const int64_t groups = static_cast<int64_t>(g.experts.size()), row_tiles = g.first_tile.back();
  const int64_t x_tile_elements = s.hidden_chunks * kTileElements, act_tile_elements = s.inter_chunks * kTileElements;
  const int64_t gate_up_block_elements = s.hidden_chunks * kBlockChunkElements;
  const int64_t down_block_elements = s.inter_chunks * kBlockChunkElements;
  // Every element of these is written before it is read (padding rows and k as zeros).
  const at::Tensor buffers = at::empty({row_tiles * (x_tile_elements + act_tile_elements)}, at::kBFloat16);
  uint16_t* x_tiles = reinterpret_cast<uint16_t*>(buffers.data_ptr<c10::BFloat16>());
  uint16_t* act_tiles = x_tiles + row_tiles * x_tile_elements;
  const at::Tensor scratch_tensor = at::empty({tokens * s.k * s.hidden}, at::kFloat);
  float* scratch = scratch_tensor.data_ptr<float>();

  const int64_t tiles_per_task = std::max<int64_t>(1, kPackElementsPerTask / x_tile_elements);
  at::parallel_for(0, row_tiles, tiles_per_task, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t group = g.tile_group[t], row0 = (t - g.first_tile[group]) * kTileRows;
      const int64_t count = g.first_pair[group + 1] - g.first_pair[group];
      const int64_t* pairs = g.pairs.data() + g.first_pair[group];
      const auto row_of = [&](int64_t r) -> const uint16_t* {
        return row0 + r < count ? x + (pairs[row0 + r] / s.k) * s.hidden : nullptr;
      };
      amx::pack_input_tile(row_of, s.hidden, 0, s.hidden_chunks, x_tiles + t * x_tile_elements);
    }
  });

  // The activation's 16 columns of block b lie in chunk b / 2 of the down projection's input
  // tiles, at column 16 (b % 2); rows past the expert's count are zeros there.
  for_each_item(kernel, groups * s.gate_up_blocks, [&](int64_t item) {
    const int64_t group = item / s.gate_up_blocks, block = item % s.gate_up_blocks;
    const int64_t count = g.first_pair[group + 1] - g.first_pair[group];
    const uint16_t* w = gate_up + (g.experts[group] * s.gate_up_blocks + block) * gate_up_block_elements;
    alignas(64) float sums[kRowsPerCall * kBlockColumns];
    for (int64_t row0 = 0; row0 < count; row0 += kRowsPerCall) {
      const int64_t tile = g.first_tile[group] + row0 / kTileRows, rows = std::min(kRowsPerCall, count - row0);
      const uint16_t* x_a = x_tiles + tile * x_tile_elements;
      kernel.sums(x_a, x_a + x_tile_elements, rows, w, s.hidden_chunks, sums);
      for (int64_t r = 0; r < round_up(rows, kTileRows); ++r) {
        uint16_t* dst = act_tiles + (tile + r / kTileRows) * act_tile_elements + (block / 2) * kTileElements +
                        (r % kTileRows) * kChunk + (block % 2) * kActivationColumns;
        if (r >= rows) {
          std::fill(dst, dst + kActivationColumns, 0);
          continue;
        }
        const float* row = sums + r * kBlockColumns;
#pragma omp simd
        for (int64_t c = 0; c < kActivationColumns; ++c) {
          const float gate = widen(round_to<Bf16Bits>(row[c]));
          const float up = widen(round_to<Bf16Bits>(row[kActivationColumns + c]));
          const float activated = widen(round_to<Bf16Bits>(trident_kernels::silu(gate)));
          dst[c] = round_to<Bf16Bits>(activated * up).bits;
        }
      }
    }
  });

  for_each_item(kernel, groups * s.down_blocks, [&](int64_t item) {
    const int64_t group = item / s.down_blocks, block = item % s.down_blocks;
    const int64_t count = g.first_pair[group + 1] - g.first_pair[group];
    const int64_t* pairs = g.pairs.data() + g.first_pair[group];
    const uint16_t* w = down + (g.experts[group] * s.down_blocks + block) * down_block_elements;
    const int64_t column0 = block * kBlockColumns, columns = std::min(kBlockColumns, s.hidden - column0);
    alignas(64) float sums[kRowsPerCall * kBlockColumns];
    for (int64_t row0 = 0; row0 < count; row0 += kRowsPerCall) {
      const int64_t tile = g.first_tile[group] + row0 / kTileRows, rows = std::min(kRowsPerCall, count - row0);
      const uint16_t* x_a = act_tiles + tile * act_tile_elements;
      kernel.sums(x_a, x_a + act_tile_elements, rows, w, s.inter_chunks, sums);
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(sums + r * kBlockColumns, columns, scratch + pairs[row0 + r] * s.hidden + column0);
    }
  });

  trident_kernels::moe::sum_slots(scratch, weights, tokens, s.k, s.hidden, reinterpret_cast<Bf16Bits*>(out));
}

// x [T, H] bf16; topk_ids [T, k] int32; topk_weights [T, k] float32; gate_up and down packed by
// fused_moe_pack (gate_up's gate and up columns interleaved in 16s: fused_moe.py) -> [T, H] bf16.
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& gate_up, const at::Tensor& down, c10::string_view path) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2, "fused_moe: x [tokens, hidden] bf16");
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0),
              "fused_moe: topk_ids [tokens, k] int32");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat && topk_weights.sizes() == topk_ids.sizes(),
              "fused_moe: topk_weights [tokens, k] float32");
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && down.scalar_type() == at::kBFloat16 && gate_up.dim() == 6 &&
                  down.dim() == 6 && gate_up.size(0) == down.size(0),
              "fused_moe: gate_up and down packed by fused_moe_pack");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = gate_up.size(0);
  const Shapes s{hidden, topk_ids.size(1), gate_up.size(1), down.size(1), gate_up.size(2), down.size(2)};
  TORCH_CHECK(s.hidden_chunks == round_up(hidden, kChunk) / kChunk &&
                  s.down_blocks == round_up(hidden, kBlockColumns) / kBlockColumns &&
                  s.gate_up_blocks == 2 * s.inter_chunks,
              "fused_moe: x has ", hidden, " features; the packed gate_up takes ", s.hidden_chunks * kChunk,
              ", down gives ", s.down_blocks * kBlockColumns, "; gate_up has ", s.gate_up_blocks * kBlockColumns,
              " columns for down's ", s.inter_chunks * kChunk);
  const Kernel kernel = kernel_for(path_named(path));
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  const at::Tensor xc = x.contiguous(), ids = topk_ids.contiguous(), weights = topk_weights.contiguous();
  const auto* x_bits = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const auto* gate_up_bits = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<c10::BFloat16>());
  const auto* down_bits = reinterpret_cast<const uint16_t*>(down.data_ptr<c10::BFloat16>());
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokensPerPass) {
    const int64_t pass = std::min(kTokensPerPass, tokens - t0);
    moe_pass(kernel, s, x_bits + t0 * hidden, ids.data_ptr<int32_t>() + t0 * s.k,
             weights.data_ptr<float>() + t0 * s.k, pass, experts, gate_up_bits, down_bits, out_bits + t0 * hidden);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("fused_moe_pack(Tensor weights) -> Tensor");
  m.def(
      "fused_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, str path=\"auto\") -> "
      "Tensor");
  m.def("fused_moe_best_path() -> str");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("fused_moe_pack", &fused_moe_pack);
  m.impl("fused_moe", &fused_moe);
}

TORCH_LIBRARY_IMPL(trident, CompositeExplicitAutograd, m) { m.impl("fused_moe_best_path", &fused_moe_best_path); }
