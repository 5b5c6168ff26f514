// The greedy token of each row of logits: the index of its largest value, the first one on
// ties, the first NaN if there is one (as torch's max(dim).indices).
//
// torch's CPU max over the vocabulary is a measurable part of a decode step at a wide
// vocabulary; this is several times faster (docs/benchmarks.md, "Kernels"). A row is two
// AVX-512 passes: the largest value (and whether any is NaN), then the first 16-wide block
// holding it. Builds without AVX-512 (AVX2 hosts) take the same two passes over the bits as
// ordered integers, in plain loops the compiler vectorises. bfloat16 only, the dtype of a CPU
// worker's greedy logits (sampler.py keeps torch for the others).
//
// Registered as torch.ops.trident.greedy_argmax (its fake kernel for tracing is in
// cpu_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <limits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using trident_kernels::Bf16Bits;
using trident_kernels::widen;

#ifdef __AVX512F__
// bfloat16, 16 values a step: the largest (a NaN never wins _mm512_max_ps's second operand)
// and whether any is NaN, then the first 16-wide block that holds the largest.
int64_t row_argmax(const Bf16Bits* row, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(row);
  const auto load = [&](int64_t i) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, bits + i));
    // Lanes past the row read as -inf, which never beats a value of the row.
    return _mm512_mask_blend_ps(m, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  };
  __m512 lane_best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nans = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = load(i);
    nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lane_best = _mm512_max_ps(v, lane_best);
  }
  if (nans) {
    for (int64_t i = 0; i < n; ++i)
      if (widen(row[i]) != widen(row[i])) return i;
  }
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(lane_best));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load(i), best, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // unreachable: best is one of the row's values
}
#else
// bfloat16 bits as an int16 in the order of the values: negatives reversed, -0 onto +0 (they
// compare equal, so the first of them wins). Branch-free, so that the loops vectorise. NaN
// is tested apart.
inline int16_t order_key(uint16_t bits) {
  const auto s = static_cast<int16_t>(bits);
  const int16_t negative = static_cast<int16_t>(s >> 15);  // 0 or -1
  return static_cast<int16_t>((s ^ (negative & 0x7FFF)) - negative);
}

int64_t row_argmax(const Bf16Bits* row, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(row);
  int16_t best = std::numeric_limits<int16_t>::min();
  uint16_t largest_magnitude = 0;  // above 0x7F80 (infinity): there is a NaN
  for (int64_t i = 0; i < n; ++i) {
    largest_magnitude = std::max<uint16_t>(largest_magnitude, bits[i] & 0x7FFFu);
    best = std::max(best, order_key(bits[i]));
  }
  if (largest_magnitude > 0x7F80u) {
    for (int64_t i = 0; i < n; ++i)
      if ((bits[i] & 0x7FFFu) > 0x7F80u) return i;
  }
  // Blocks of 64 keys compared at once, then the first hit inside the block that has one.
  constexpr int64_t kBlock = 64;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    int16_t hits = 0;
    for (int64_t i = start; i < end; ++i) hits |= static_cast<int16_t>(order_key(bits[i]) == best);
    if (!hits) continue;
    for (int64_t i = start; i < end; ++i)
      if (order_key(bits[i]) == best) return i;
  }
  return 0;  // unreachable: best is one of the row's keys
}
#endif

// logits [rows, vocab] bfloat16 -> [rows] int64.
at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kBFloat16,
              "greedy_argmax: bfloat16 logits [rows, vocab], vocab > 0");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  const Bf16Bits* data = trident_kernels::bits_of<Bf16Bits, c10::BFloat16>(x);
  at::parallel_for(0, rows, trident_kernels::rows_per_task(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = row_argmax(data + r * vocab, vocab);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) { m.def("greedy_argmax(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(trident, CPU, m) { m.impl("greedy_argmax", &greedy_argmax); }
