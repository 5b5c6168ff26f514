// y = x @ w.T (+ bias) in bfloat16 for the few rows of a decode step (1 to ~64), on weights
// packed once for AVX512-BF16's dot-product instruction (vdpbf16ps).
//
// vdpbf16ps multiplies 16 pairs of bfloat16 by 16 pairs and adds each pair's two products to
// a float32 lane: 64 flops an instruction. oneDNN's matmul, built for many rows, stays well
// below that peak at decode batch sizes and below the memory's pace at one row
// (docs/benchmarks.md, "Method"); this kernel reads each weight line once for a whole tile of
// rows, which is what makes small batches faster.
//
// The packed layout ("VNNI"): the weight's output columns in panels of 32, each panel's
// k-pairs one after the other, each k-pair two 64-byte cache lines holding [w[n][k], w[n][k+1]]
// for the panel's 32 columns. The threads claim two panels (72 KB at k = 576) at a time
// (parallel_for_claimed in kernel_common.h), each claim a stream read front to back. Per
// panel, up to kTileRows input rows at a time hold 2 x kTileRows float32 accumulators (24
// of the 32 registers): each loaded line of weights is used kTileRows times, and each
// broadcast pair of x twice. Later row tiles read the panel (36 KB for k = 576) again from
// L2.
//
// Each row is summed in the same order whatever the batch: a row's result does not depend
// on which other rows share its step. Rounded to bfloat16 once, at the end (nearest even).
//
// Registered as torch.ops.trident.vnni_pack_weight / vnni_linear / cpu_has_avx512_bf16; the
// fake kernels for tracing are in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanelColumns = 32;
constexpr int kTileRows = 12;
// Panels a thread claims at a time (parallel_for_claimed): 72 KB of weights at k = 576.
constexpr int64_t kPanelsPerClaim = 2;
// How many k-pairs (two cache lines each) ahead of its reads the first row tile prefetches.
constexpr int64_t kPrefetchPairs = 16;

bool cpu_has_avx512_bf16() {
#if defined(__AVX512F__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// weight [n, k] bfloat16, k even -> [ceil(n / 32), k / 2, 64] bfloat16, zero columns past n.
at::Tensor vnni_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "vnni_pack_weight: weight [n, k] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % 2 == 0, "vnni_pack_weight: k must be even, not ", k);
  const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns, pairs = k / 2;
  at::Tensor packed = at::zeros({panels, pairs, 2 * kPanelColumns}, weight.options());
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t columns = std::min(kPanelColumns, n - panel * kPanelColumns);
      for (int64_t c = 0; c < columns; ++c) {
        const uint16_t* row = src + (panel * kPanelColumns + c) * k;
        uint16_t* out = dst + panel * pairs * 2 * kPanelColumns + 2 * c;
        for (int64_t p = 0; p < pairs; ++p) {
          out[p * 2 * kPanelColumns] = row[2 * p];
          out[p * 2 * kPanelColumns + 1] = row[2 * p + 1];
        }
      }
    }
  });
  return packed;
}

#ifdef __AVX512F__
#pragma GCC push_options
#pragma GCC target("avx512bf16")

// One panel's columns for kRows input rows (x as int32 k-pairs, `pairs` a row), added to the
// bias and rounded into out[row * ldo + column], the first `columns` (<= 32) columns.
template <int kRows>
void panel_tile(const int32_t* x_pairs, int64_t pairs, const uint16_t* panel, const uint16_t* ahead,
                const float* bias, int64_t columns, uint16_t* out, int64_t ldo) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if (ahead != nullptr) {  // a k-pair of the panel is two cache lines
      _mm_prefetch(reinterpret_cast<const char*>(ahead + p * 2 * kPanelColumns), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + p * 2 * kPanelColumns + kPanelColumns), _MM_HINT_T0);
    }
    const __m512bh w_lo = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kPanelColumns);
    const __m512bh w_hi = (__m512bh)_mm512_loadu_si512(panel + p * 2 * kPanelColumns + kPanelColumns);
    for (int r = 0; r < kRows; ++r) {
      const __m512bh x_pair = (__m512bh)_mm512_set1_epi32(x_pairs[r * pairs + p]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x_pair, w_lo);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x_pair, w_hi);
    }
  }
  const __mmask16 lo_mask = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 hi_mask = columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  const __m512 b_lo = bias ? _mm512_maskz_loadu_ps(lo_mask, bias) : _mm512_setzero_ps();
  const __m512 b_hi = bias ? _mm512_maskz_loadu_ps(hi_mask, bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b_lo));
    const __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b_hi));
    _mm256_mask_storeu_epi16(out + r * ldo, lo_mask, (__m256i)lo);
    _mm256_mask_storeu_epi16(out + r * ldo + 16, hi_mask, (__m256i)hi);
  }
}

using TileFn = void (*)(const int32_t*, int64_t, const uint16_t*, const uint16_t*, const float*, int64_t, uint16_t*,
                        int64_t);

template <int... kRows>
constexpr auto make_tile_table(std::integer_sequence<int, kRows...>) {
  return std::array<TileFn, sizeof...(kRows)>{&panel_tile<kRows + 1>...};
}
// kTileFns[r - 1] takes r rows.
constexpr auto kTileFns = make_tile_table(std::make_integer_sequence<int, kTileRows>{});

void vnni_linear_panels(const int32_t* x_pairs, int64_t rows, int64_t pairs, const uint16_t* packed, const float* bias,
                        int64_t n, uint16_t* out) {
  const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns;
  const int64_t panel_elements = pairs * 2 * kPanelColumns;
  trident_kernels::parallel_for_claimed(panels, kPanelsPerClaim, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      const int64_t column0 = panel * kPanelColumns;
      const int64_t columns = std::min(kPanelColumns, n - column0);
      const uint16_t* weights = packed + panel * panel_elements;
      // The first row tile brings the panel in from memory, prefetching a few lines ahead
      // (past the panel's end: into the next one, which follows it in memory).
      const uint16_t* ahead = weights + kPrefetchPairs * 2 * kPanelColumns;
      for (int64_t row0 = 0; row0 < rows; row0 += kTileRows) {
        const int64_t tile = std::min<int64_t>(kTileRows, rows - row0);
        kTileFns[tile - 1](x_pairs + row0 * pairs, pairs, weights, row0 == 0 ? ahead : nullptr,
                           bias ? bias + column0 : nullptr, columns, out + row0 * n + column0, n);
      }
    }
  });
}

#pragma GCC pop_options
#endif

// x [rows, k] bfloat16; packed from vnni_pack_weight of a [n, k] weight; bias [n] or none -> [rows, n].
at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                       int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "vnni_linear: bfloat16 input");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 2 * kPanelColumns, "x [rows, k], packed weight");
  const int64_t rows = x.size(0), k = x.size(1), pairs = packed.size(1);
  TORCH_CHECK(k == 2 * pairs && packed.size(0) == (n + kPanelColumns - 1) / kPanelColumns,
              "vnni_linear: x has ", k, " features, the packed weight ", 2 * pairs, " (", n, " outputs)");
  TORCH_CHECK(cpu_has_avx512_bf16(), "vnni_linear: this CPU has no AVX512-BF16 (cpu_kernels.py does not call it then)");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#ifdef __AVX512F__
  const at::Tensor xc = x.contiguous();
  const at::Tensor bias_f = trident_kernels::float_bias(bias, n);
  vnni_linear_panels(reinterpret_cast<const int32_t*>(xc.data_ptr<c10::BFloat16>()), rows, pairs,
                     reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                     bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, n,
                     reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("vnni_pack_weight(Tensor weight) -> Tensor");
  m.def("vnni_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("cpu_has_avx512_bf16() -> bool");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("vnni_pack_weight", &vnni_pack_weight);
  m.impl("vnni_linear", &vnni_linear);
}

TORCH_LIBRARY_IMPL(trident, CompositeExplicitAutograd, m) { m.impl("cpu_has_avx512_bf16", &cpu_has_avx512_bf16); }
