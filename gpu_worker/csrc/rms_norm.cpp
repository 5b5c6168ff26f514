// RMSNorm in one pass per row, in the reference's order: normalise in float32, round to
// the model dtype, then multiply by the weight (LLaMA's `weight * x.float().normed.to(dtype)`).
//
// In torch that is ~10 ops (casts, pow, mean, add, rsqrt, mul, cast, mul), each its own
// kernel and OpenMP region: ~45 us per call at one row on 2 Zen 4 cores, 61 calls a
// decode step of SmolLM2. Here: one pass to sum the squares, one to scale, ~1-3 us a row
// of 576 (bfloat16 converted as raw bits, vectorised).
//
// Registered as torch.ops.trident.rms_norm (fake kernel in cpu_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// bfloat16 as raw bits, so that the loops below vectorise: c10::BFloat16's conversions are
// scalar, and at 2,048 prefill rows they were most of the op's time (1.9 ms a call).
inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

// Round to nearest even, as c10::BFloat16 does; NaN stays NaN.
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

void rms_norm_rows_bf16(const uint16_t* x, const uint16_t* weight, uint16_t* out, int64_t rows, int64_t dim,
                        float eps) {
  const int64_t grain = std::max<int64_t>(1, 16384 / dim);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const uint16_t* xr = x + row * dim;
      uint16_t* dst = out + row * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = bf16_bits_to_float(xr[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const float normed = bf16_bits_to_float(float_to_bf16_bits(bf16_bits_to_float(xr[i]) * inv));
        dst[i] = float_to_bf16_bits(bf16_bits_to_float(weight[i]) * normed);
      }
    }
  });
}

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t rows, int64_t dim, float eps) {
  // Rows are independent; below ~16K elements a second thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, 16384 / dim);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xr = x + row * dim;
      scalar_t* dst = out + row * dim;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = static_cast<float>(xr[i]);
        squares += v * v;
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const scalar_t normed = static_cast<scalar_t>(static_cast<float>(xr[i]) * inv);
        dst[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * static_cast<float>(normed));
      }
    }
  });
}

// x [..., dim]; weight [dim] in x's dtype -> x's shape and dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight [dim] for x [..., dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t dim = x.size(-1), rows = dim ? xc.numel() / dim : 0;
  const auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, dim,
                            static_cast<float>(eps));
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16:
      rms_norm_rows_bf16(reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(wc.data_ptr<c10::BFloat16>()),
                         reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), rows, dim,
                         static_cast<float>(eps));
      break;
    case at::kHalf: run(c10::Half{}); break;
    default: TORCH_CHECK(false, "rms_norm: float32, bfloat16 or float16, not ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) { m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(trident, CPU, m) { m.impl("rms_norm", &rms_norm); }
