// The elementwise steps of a decoder layer between its matmuls, one op each instead of
// several: SwiGLU's silu(gate) * up, and the rotary embedding of q and k.
//
// In torch, SwiGLU is split + silu + mul and the rotary is mul + cat + mul + add over
// sliced views: each op its own dispatch and OpenMP region, ~5-25 us apiece at decode
// sizes, 30 layers a step. The results round to the dtype where torch's ops round (after
// each op), so bfloat16 results are those bits but for a rare last-bit difference of the
// exponential (a polynomial here, Sleef in torch).
//
// The build (cpu_kernels.py) turns off contracting a * b + c into one fused multiply-add:
// torch rounds the product first, and so must the rotary's float32 path to give its bits.
//
// Registered as torch.ops.trident.silu_and_mul and .rotary (fake kernels in cpu_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>

namespace {

using trident_kernels::bits_of;
using trident_kernels::dispatch_float_dtype;
using trident_kernels::exp_nonpositive;
using trident_kernels::round_to;
using trident_kernels::rows_per_task;
using trident_kernels::widen;

// x * sigmoid(x), with sigmoid from exp(-|x|) so that the exponential never overflows.
inline float silu(float x) {
  const float e = exp_nonpositive(x > 0.f ? -x : x);
  return x * ((x >= 0.f ? 1.f : e) / (1.f + e));
}

// gate_up [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up [rows, 2 * inter]");
  const at::Tensor in = gate_up.contiguous();
  const int64_t rows = in.size(0), inter = in.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, in.options());
  dispatch_float_dtype(in, "silu_and_mul", [&](auto zero, auto element) {
    using storage_t = decltype(zero);
    const storage_t* src = bits_of<storage_t, decltype(element)>(in);
    storage_t* dst = bits_of<storage_t, decltype(element)>(out);
    at::parallel_for(0, rows, rows_per_task(inter), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const storage_t* gate = src + row * 2 * inter;
        const storage_t* up = gate + inter;
        storage_t* o = dst + row * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
          const float activated = widen(round_to<storage_t>(silu(widen(gate[i]))));
          o[i] = round_to<storage_t>(activated * widen(up[i]));
        }
      }
    });
  });
  return out;
}

// x [tokens, heads, dim] (any strides, last dim contiguous); cos, signed_sin [tokens, 1, dim]
// -> x * cos + swap_halves(x) * signed_sin [tokens, heads, dim], contiguous. signed_sin
// holds -sin in its first half, so this is the reference's x * cos + rotate_half(x) * sin.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary: x [tokens, heads, even dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.numel() == tokens * dim && signed_sin.numel() == tokens * dim, "rotary: tables [tokens, 1, dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type(),
              "rotary: tables in x's dtype");
  const at::Tensor cc = cos.contiguous(), sc = signed_sin.contiguous();
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  dispatch_float_dtype(x, "rotary", [&](auto zero, auto element) {
    using storage_t = decltype(zero);
    using element_t = decltype(element);
    const storage_t* src = reinterpret_cast<const storage_t*>(x.data_ptr<element_t>());
    const storage_t* cos_t = bits_of<storage_t, element_t>(cc);
    const storage_t* sin_t = bits_of<storage_t, element_t>(sc);
    storage_t* dst = bits_of<storage_t, element_t>(out);
    at::parallel_for(0, tokens, rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const storage_t* c = cos_t + t * dim;
        const storage_t* s = sin_t + t * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const storage_t* xh = src + t * token_stride + h * head_stride;
          storage_t* o = dst + (t * heads + h) * dim;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float lo = widen(xh[i]), hi = widen(xh[i + half]);
            const float lo_cos = widen(round_to<storage_t>(lo * widen(c[i])));
            const float hi_sin = widen(round_to<storage_t>(hi * widen(s[i])));
            o[i] = round_to<storage_t>(lo_cos + hi_sin);
            const float hi_cos = widen(round_to<storage_t>(hi * widen(c[i + half])));
            const float lo_sin = widen(round_to<storage_t>(lo * widen(s[i + half])));
            o[i + half] = round_to<storage_t>(hi_cos + lo_sin);
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
}
