// y = x @ w.T (+ bias) for a bfloat16 batch of one or two rows: a decode step of one or
// two streams.
//
// At so few rows a linear layer is a read of its weight and nothing else: each weight is
// used once per row. oneDNN's matmul (packed_linear.py) read SmolLM2's weights at ~14 GB/s
// on 2 Zen 4 cores, where the cores stream plain memory at ~30 GB/s: its blocked kernels
// are built for many rows. Here each thread walks its own band of output columns, one
// weight row after the other (one stream, prefetched a few rows ahead), widening bfloat16
// to float32 (a 16-bit shift) and accumulating in float32 registers for every input row
// at once; the input rows are widened once, up front, and stay in L1. The result is
// rounded to bfloat16 once, at the end. Measured: SmolLM2's 120 layer weights at one row in
// 8.3-9.9 ms against oneDNN's 11.8-15.1 ms (21-26 GB/s against 14-18).
//
// Registered as torch.ops.trident.small_batch_linear (its fake kernel for tracing is in
// cpu_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxRows = 2;  // from 4 rows, oneDNN was faster (docs/benchmarks.md)
constexpr int64_t kPrefetchRows = 2;

#ifdef __AVX512F__
inline __m512 widen16(const uint16_t* src, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, src);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// One output column of every input row: the dot products of weight row n with kRows rows
// of x (already float32, [kRows, k]). Four independent accumulators per input row hide
// the FMA latency; the weight row is read once, front to back, one stream per thread.
template <int kRows>
inline void dot_column(const float* xf, const uint16_t* w_row, const uint16_t* w_ahead, int64_t k, float* sums) {
  constexpr int kUnroll = 4;
  __m512 acc[kRows][kUnroll];
  for (int r = 0; r < kRows; ++r)
    for (int u = 0; u < kUnroll; ++u) acc[r][u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16 * kUnroll) {
    _mm_prefetch(reinterpret_cast<const char*>(w_ahead + i), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w_ahead + i + 32), _MM_HINT_T0);
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = i + 16 * u;
      const int64_t left = k - at;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      const __m512 wv = widen16(w_row + at, mask);
      for (int r = 0; r < kRows; ++r)
        acc[r][u] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, xf + r * k + at), wv, acc[r][u]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

template <int kRows>
void linear_rows(const float* xf, const uint16_t* w, const c10::BFloat16* bias, c10::BFloat16* out, int64_t n_total,
                 int64_t k) {
  at::parallel_for(0, n_total, 64, [&](int64_t begin, int64_t end) {
    float sums[kRows];
    for (int64_t n = begin; n < end; ++n) {
      // The row kPrefetchRows ahead, at the same offset: the hardware prefetcher ramps up
      // too slowly for rows of 1-3 KB.
      const int64_t ahead = std::min(n + kPrefetchRows, end - 1);
      dot_column<kRows>(xf, w + n * k, w + ahead * k, k, sums);
      const float b = bias ? static_cast<float>(bias[n]) : 0.f;
      for (int r = 0; r < kRows; ++r) out[r * n_total + n] = static_cast<c10::BFloat16>(sums[r] + b);
    }
  });
}
#endif

// x [rows, k] bfloat16 with 1 <= rows <= 2; weight [n, k] bfloat16; bias [n] or none -> [rows, n].
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "small_batch_linear: bfloat16 input and weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [rows, k], weight [n, k]");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "small_batch_linear: 1 to ", kMaxRows, " rows, not ", rows);
  at::Tensor out = at::empty({rows, n}, x.options());
#ifdef __AVX512F__
  // Widened here rather than by x.to(float): a torch op per call costs as much as a small layer's read.
  const at::Tensor xc = x.contiguous();
  const auto* x_bits = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  std::vector<float> xf(rows * k);
  auto* xf_bits = reinterpret_cast<uint32_t*>(xf.data());
  for (int64_t i = 0; i < rows * k; ++i) xf_bits[i] = static_cast<uint32_t>(x_bits[i]) << 16;
  const at::Tensor wc = weight.contiguous();
  const c10::BFloat16* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n, "bias [n] bfloat16");
    bias_c = bias->contiguous();
    bias_ptr = bias_c.data_ptr<c10::BFloat16>();
  }
  const auto* w_bits = reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>());
  const float* x_ptr = xf.data();
  c10::BFloat16* out_ptr = out.data_ptr<c10::BFloat16>();
  switch (rows) {
    case 1: linear_rows<1>(x_ptr, w_bits, bias_ptr, out_ptr, n, k); break;
    default: linear_rows<2>(x_ptr, w_bits, bias_ptr, out_ptr, n, k); break;
  }
#else
  TORCH_CHECK(false, "small_batch_linear: this build has no AVX-512 (cpu_kernels.py does not call it then)");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("small_batch_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) { m.impl("small_batch_linear", &small_batch_linear); }
