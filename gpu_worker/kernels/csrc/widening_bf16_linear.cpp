// y = x @ w.T (+ bias) in bfloat16 on CPUs with AVX2 and FMA but no bfloat16 arithmetic
// (AVX2-only CPUs): the weights stay bfloat16 in memory, half the bytes
// of float32, and are widened to float32 in registers, where the multiply-adds run.
//
// Without it, torch's bfloat16 matmul on such a CPU is a slow reference path that takes
// nearly all of a decode step, several times the float32 step (docs/benchmarks.md,
// "Kernels"). One stream, bound by reading the weights, is where bfloat16 should win: half
// the bytes a token.
//
// The packed layout: the weight's output columns in panels of 16, each panel k rows of 16
// bfloat16 (32 bytes, half a cache line), read front to back. The threads claim a few
// panels at a time (parallel_for_claimed in kernel_common.h). Per panel, up to kTileRows
// input rows at a time hold 2 x kTileRows float32 accumulators (12 of the 16 registers):
// each widened pair of weight vectors is used kTileRows times. Later row tiles read the
// panel (18 KB at k = 576) again from L1/L2.
//
// Each row is summed in the same order whatever the batch, so a row's result does not
// depend on which other rows share its step. Rounded to bfloat16 once, at the end.
//
// Registered as torch.ops.trident.widening_pack_weight / widening_bf16_linear /
// cpu_has_avx2_fma; the fake kernels for tracing are in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using trident_kernels::Bf16Bits;
using trident_kernels::cpu_has_avx2_fma;

constexpr int64_t kPanelColumns = 16;
constexpr int kTileRows = 6;
// 72 KB of weights a claim at k = 576.
constexpr int64_t kPanelsPerClaim = 4;
// Prefill batches go through the panels this many rows at a time, so that the rows being
// multiplied (96 x 576 float32 = 216 KB) stay in L2 while every panel reads them.
constexpr int64_t kRowBlock = 16 * kTileRows;

// weight [n, k] bfloat16 -> [ceil(n / 16), k, 16] bfloat16, zero columns past n.
at::Tensor widening_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "widening_pack_weight: weight [n, k] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns;
  at::Tensor packed = at::zeros({panels, k, kPanelColumns}, weight.options());
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t columns = std::min(kPanelColumns, n - panel * kPanelColumns);
      for (int64_t c = 0; c < columns; ++c) {
        const uint16_t* row = src + (panel * kPanelColumns + c) * k;
        uint16_t* out = dst + panel * k * kPanelColumns + c;
        for (int64_t i = 0; i < k; ++i) out[i * kPanelColumns] = row[i];
      }
    }
  });
  return packed;
}

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// 8 bfloat16 -> 8 float32: bfloat16 is the top half of a float32.
inline __m256 widen8(const uint16_t* src) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// kPanels adjacent panels' columns for kRows rows of x (float32, k a row), plus the bias,
// rounded into out[row * ldo + column] for the first `columns` (<= 16 kPanels) columns.
// Each accumulator is one chain of dependent multiply-adds, one per k: with fewer than ~8
// chains the FMA latency, not memory, sets the pace, so a tile of few rows takes several
// panels at once (one row: 4 panels, 8 chains). Every column is still summed over k in
// order from zero, so the grouping does not change a bit of the result.
template <int kRows, int kPanels>
void panel_tile(const float* x, int64_t k, const uint16_t* panels, const float* bias, int64_t columns, uint16_t* out,
                int64_t ldo) {
  // The loops are unrolled by pragma: left to GCC 12's own unrolling, which runs after it
  // decides what lives in registers, acc stayed an array in memory, all 12 accumulators
  // stored every k, which the multiply-adds then waited on.
  const int64_t panel_stride = k * kPanelColumns;
  __m256 acc[kRows][kPanels][2];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
    for (int p = 0; p < kPanels; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
#pragma GCC unroll 16
    for (int p = 0; p < kPanels; ++p) {
      const uint16_t* w = panels + p * panel_stride + i * kPanelColumns;
      const __m256 w_lo = widen8(w), w_hi = widen8(w + 8);
#pragma GCC unroll 16
      for (int r = 0; r < kRows; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * k + i);
        acc[r][p][0] = _mm256_fmadd_ps(xv, w_lo, acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xv, w_hi, acc[r][p][1]);
      }
    }
  }
  alignas(32) float sums[kRows][kPanels * kPanelColumns];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 16
    for (int p = 0; p < kPanels; ++p) {
      _mm256_store_ps(sums[r] + p * kPanelColumns, acc[r][p][0]);
      _mm256_store_ps(sums[r] + p * kPanelColumns + 8, acc[r][p][1]);
    }
  for (int r = 0; r < kRows; ++r) {
    uint16_t* dst = out + r * ldo;
    for (int64_t c = 0; c < columns; ++c)
      dst[c] = trident_kernels::round_to<Bf16Bits>(bias ? sums[r][c] + bias[c] : sums[r][c]).bits;
  }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, const float*, int64_t, uint16_t*, int64_t);

// How many panels a tile of r rows takes at once: enough for 8-12 accumulator chains.
constexpr int panels_per_tile(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }
static_assert(kPanelsPerClaim % panels_per_tile(1) == 0 && kPanelsPerClaim % panels_per_tile(2) == 0,
              "a full claim splits into whole groups");

template <int... kRows>
constexpr auto make_tile_table(std::integer_sequence<int, kRows...>) {
  return std::array<TileFn, sizeof...(kRows)>{&panel_tile<kRows + 1, panels_per_tile(kRows + 1)>...};
}
template <int... kRows>
constexpr auto make_single_panel_table(std::integer_sequence<int, kRows...>) {
  return std::array<TileFn, sizeof...(kRows)>{&panel_tile<kRows + 1, 1>...};
}
// kTileFns[r - 1] takes r rows over panels_per_tile(r) panels; kSinglePanelFns[r - 1] over one.
constexpr auto kTileFns = make_tile_table(std::make_integer_sequence<int, kTileRows>{});
constexpr auto kSinglePanelFns = make_single_panel_table(std::make_integer_sequence<int, kTileRows>{});

// Rows [row0, row0 + rows) over panels [begin, end): whole groups of panels_per_tile(rows),
// then one panel at a time for what is left (the last, short claim).
void tile_over_panels(const float* x, int64_t row0, int rows, int64_t k, const uint16_t* packed, const float* bias,
                      int64_t n, int64_t begin, int64_t end, uint16_t* out) {
  const int group = panels_per_tile(rows);
  for (int64_t panel = begin; panel < end;) {
    const bool whole_group = panel + group <= end;
    const int64_t column0 = panel * kPanelColumns;
    const int64_t columns = std::min(kPanelColumns * (whole_group ? group : 1), n - column0);
    const TileFn tile = whole_group ? kTileFns[rows - 1] : kSinglePanelFns[rows - 1];
    tile(x + row0 * k, k, packed + panel * k * kPanelColumns, bias ? bias + column0 : nullptr, columns,
         out + row0 * n + column0, n);
    panel += whole_group ? group : 1;
  }
}

// x is widened to float32 once per row block, here, and every panel reads the block from
// L1/L2: not once per panel, and not through a torch cast per call (a dispatch on each of
// ~120 calls a step).
void widen_rows(const uint16_t* x, int64_t count, float* out) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, widen8(x + i));
  for (; i < count; ++i) out[i] = trident_kernels::widen(Bf16Bits{x[i]});
}

void widening_linear_panels(const uint16_t* x, int64_t rows, int64_t k, const uint16_t* packed, const float* bias,
                            int64_t n, uint16_t* out) {
  const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns;
  std::vector<float> x_block(std::min(rows, kRowBlock) * k);
  for (int64_t block0 = 0; block0 < rows; block0 += kRowBlock) {
    const int64_t block_rows = std::min(rows - block0, kRowBlock);
    const int64_t full_tiles = block_rows / kTileRows * kTileRows;
    widen_rows(x + block0 * k, block_rows * k, x_block.data());
    uint16_t* block_out = out + block0 * n;
    trident_kernels::parallel_for_claimed(panels, kPanelsPerClaim, [&](int64_t begin, int64_t end) {
      // Full tiles panel by panel, so that each panel is read from memory once and then from
      // L1 by the next tiles; the short tile, if any, last, over the claim's panels together.
      for (int64_t panel = begin; panel < end; ++panel)
        for (int64_t row0 = 0; row0 < full_tiles; row0 += kTileRows)
          tile_over_panels(x_block.data(), row0, kTileRows, k, packed, bias, n, panel, panel + 1, block_out);
      if (full_tiles < block_rows)
        tile_over_panels(x_block.data(), full_tiles, static_cast<int>(block_rows - full_tiles), k, packed, bias, n,
                         begin, end, block_out);
    });
  }
}

#pragma GCC pop_options
#endif

// x [rows, k] bfloat16; packed from widening_pack_weight of a [n, k] weight; bias [n] or none -> [rows, n].
at::Tensor widening_bf16_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "widening_bf16_linear: bfloat16 input");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == kPanelColumns, "x [rows, k], packed weight");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k == packed.size(1) && packed.size(0) == (n + kPanelColumns - 1) / kPanelColumns,
              "widening_bf16_linear: x has ", k, " features, the packed weight ", packed.size(1), " (", n, " outputs)");
  TORCH_CHECK(cpu_has_avx2_fma(), "widening_bf16_linear: this CPU has no AVX2/FMA (cpu_kernels.py does not call it then)");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#if defined(__x86_64__)
  const at::Tensor x_rows = x.contiguous();
  const at::Tensor bias_f = trident_kernels::float_bias(bias, n);
  widening_linear_panels(reinterpret_cast<const uint16_t*>(x_rows.data_ptr<c10::BFloat16>()), rows, k,
                         reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                         bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, n,
                         reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("widening_pack_weight(Tensor weight) -> Tensor");
  m.def("widening_bf16_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("cpu_has_avx2_fma() -> bool");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("widening_pack_weight", &widening_pack_weight);
  m.impl("widening_bf16_linear", &widening_bf16_linear);
}

TORCH_LIBRARY_IMPL(trident, CompositeExplicitAutograd, m) { m.impl("cpu_has_avx2_fma", &cpu_has_avx2_fma); }
