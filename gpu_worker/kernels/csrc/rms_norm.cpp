// RMSNorm in one pass per row, in the reference's order: normalise in float32, round to
// the model dtype, then multiply by the weight (LLaMA's `weight * x.float().normed.to(dtype)`).
//
// In torch that is ~10 ops (casts, pow, mean, add, rsqrt, mul, cast, mul), each its own
// kernel and OpenMP region, two norms a layer of every decode step. Here: one pass to sum
// the squares, one to scale (bfloat16 converted as raw bits, vectorised), an order of
// magnitude faster at one row (docs/benchmarks.md, "Kernels").
//
// With unit_offset (Gemma), the weight w scales by (1 + w) and the product is taken in
// float32 before the one rounding (Gemma's `(normed.float() * (1 + w.float())).to(dtype)`).
//
// add_rms_norm also adds the sublayer's output to the residual stream first (the add is
// otherwise its own op and region, 30 a step).
//
// Registered as torch.ops.trident.rms_norm and .add_rms_norm (fake kernels in cpu_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace {

using trident_kernels::bits_of;
using trident_kernels::dispatch_float_dtype;
using trident_kernels::rms_normalize_row;
using trident_kernels::round_to;
using trident_kernels::rows_per_task;
using trident_kernels::widen;

// normalise(x) into `out`; with `delta`, first sum = x + delta (rounded to the dtype, as
// torch's add does) into `sum`, and normalise that: the residual add before a layer's norm.
template <typename storage_t>
void rms_norm_rows(const storage_t* x, const storage_t* delta, storage_t* sum, const storage_t* weight,
                   storage_t* out, int64_t rows, int64_t dim, float eps, bool unit_offset) {
  at::parallel_for(0, rows, rows_per_task(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const storage_t* src = x + row * dim;
      if (delta != nullptr) {
        const storage_t* dr = delta + row * dim;
        storage_t* sr = sum + row * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) sr[i] = round_to<storage_t>(widen(src[i]) + widen(dr[i]));
        src = sr;
      }
      rms_normalize_row(src, weight, out + row * dim, dim, eps, unit_offset);
    }
  });
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: weight [dim] for x [..., dim]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
}

// x [..., dim]; weight [dim] in x's dtype -> x's shape and dtype.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool unit_offset) {
  check_norm_args(x, weight);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t dim = x.size(-1), rows = dim ? xc.numel() / dim : 0;
  dispatch_float_dtype(xc, "rms_norm", [&](auto zero, auto element) {
    using storage_t = decltype(zero);
    using element_t = decltype(element);
    rms_norm_rows<storage_t>(bits_of<storage_t, element_t>(xc), nullptr, nullptr, bits_of<storage_t, element_t>(wc),
                             bits_of<storage_t, element_t>(out), rows, dim, static_cast<float>(eps), unit_offset);
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual stream after a sublayer, and the next
// sublayer's normalised input, in one pass.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta,
                                                const at::Tensor& weight, double eps, bool unit_offset) {
  check_norm_args(x, weight);
  TORCH_CHECK(x.sizes() == delta.sizes() && x.scalar_type() == delta.scalar_type(),
              "add_rms_norm: x and delta must share a shape and a dtype");
  const at::Tensor xc = x.contiguous(), dc = delta.contiguous(), wc = weight.contiguous();
  at::Tensor sum = at::empty_like(xc), out = at::empty_like(xc);
  const int64_t dim = x.size(-1), rows = dim ? xc.numel() / dim : 0;
  dispatch_float_dtype(xc, "rms_norm", [&](auto zero, auto element) {
    using storage_t = decltype(zero);
    using element_t = decltype(element);
    rms_norm_rows<storage_t>(bits_of<storage_t, element_t>(xc), bits_of<storage_t, element_t>(dc),
                             bits_of<storage_t, element_t>(sum), bits_of<storage_t, element_t>(wc),
                             bits_of<storage_t, element_t>(out), rows, dim, static_cast<float>(eps), unit_offset);
  });
  return {sum, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset=False) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps, bool unit_offset=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
