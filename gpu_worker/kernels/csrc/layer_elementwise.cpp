// The elementwise steps of a decoder layer between its matmuls, one op each instead of
// several: SwiGLU's silu(gate) * up (GeGLU's gelu_tanh(gate) * up for Gemma), the rotary
// embedding of q and k, and (in decode steps) that rotary together with the per-head q/k
// norms where the family has them and the write of the new K and V into the pool.
//
// In torch, SwiGLU is split + silu + mul and the rotary is mul + cat + mul + add over
// sliced views: each op its own dispatch and OpenMP region, which at decode sizes costs
// more than the op's arithmetic, on every layer of every step. The results round to the dtype where torch's ops round (after
// each op), so bfloat16 results are those bits but for a rare last-bit difference of the
// exponential (a polynomial here, Sleef in torch).
//
// The build (cpu_kernels.py) turns off contracting a * b + c into one fused multiply-add:
// torch rounds the product first, and so must the rotary's float32 path to give its bits.
//
// Registered as torch.ops.trident.silu_and_mul, .gelu_tanh_and_mul, .rotary and .rotary_write_kv (fake kernels
// in cpu_kernels.py).

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using trident_kernels::Bf16Bits;
using trident_kernels::bits_of;
using trident_kernels::dispatch_float_dtype;
using trident_kernels::exp_nonpositive;
using trident_kernels::rms_normalize_row;
using trident_kernels::round_to;
using trident_kernels::rows_per_task;
using trident_kernels::silu;
using trident_kernels::widen;

// gelu with the tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as
// torch's approximate="tanh" orders it: tanh rounded to float32, then 1 + tanh (which
// cancels for x below about -3, in torch as here, so those tiny results differ from it by
// a few float32 steps). tanh from e = exp(-2|y|), never overflowing; (1 - e) / (1 + e) in
// double, so that tanh rounds once.
inline float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * (x * x * x));  // torch's order
  const double e = exp_nonpositive(-2.f * (inner < 0.f ? -inner : inner));
  const float magnitude = static_cast<float>((1.0 - e) / (1.0 + e));
  return 0.5f * x * (1.f + (inner < 0.f ? -magnitude : magnitude));
}

// activation(gate) rounded to bfloat16 and widened back, for each of the 65,536 values of a
// bfloat16 gate: the gated activations look a gate up instead of evaluating the exponential's
// polynomial and a division per element, which made them compute-bound at prefill sizes. The
// table is filled by the very expression the other dtypes evaluate, so the bits are the same.
// float16 keeps evaluating it: its product passes a NaN's payload on, and which of two NaN
// operands it keeps is the compiled code's choice (bfloat16 rounds every NaN to one value).
template <float (*activation)(float)>
const float* bf16_activation_table() {
  static const std::vector<float> table = [] {
    std::vector<float> values(65536);
    for (uint32_t bits = 0; bits < values.size(); ++bits)
      values[bits] = widen(round_to<Bf16Bits>(activation(widen(Bf16Bits{static_cast<uint16_t>(bits)}))));
    return values;
  }();
  return table.data();
}

// One bfloat16 row: o = round(table[gate] * up), n values. AVX-512 gathers the table 16 values
// at a time (compilers emulate a gather with scalar loads); widening and rounding as widen and
// round_to<Bf16Bits> do, NaN to 0x7FC0.
void looked_up_times_up(const Bf16Bits* gate, const Bf16Bits* up, Bf16Bits* o, int64_t n, const float* table) {
  int64_t i = 0;
#if defined(__AVX512F__)
  using trident_kernels::widen16;
  const __m512i half_ulp = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), infinity = _mm512_set1_epi32(0x7F800000);
  const __m512i quiet_nan = _mm512_set1_epi32(0x7FC0);
  for (; i + 16 <= n; i += 16) {
    const __m512i index = _mm512_srli_epi32(_mm512_castps_si512(widen16(&gate[i].bits)), 16);
    const __m512 product = _mm512_mul_ps(_mm512_i32gather_ps(index, table, 4), widen16(&up[i].bits));
    const __m512i u = _mm512_castps_si512(product);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half_ulp), odd), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), infinity);
    rounded = _mm512_mask_mov_epi32(rounded, nan, quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), _mm512_cvtepi32_epi16(rounded));
  }
#endif
  for (; i < n; ++i) o[i] = round_to<Bf16Bits>(table[gate[i].bits] * widen(up[i]));
}

// gate_up [rows, 2 * inter] (gate, then up) -> activation(gate) * up [rows, inter]; the
// activation rounds to the dtype before the product, as torch's two ops do. bfloat16 is handed
// to bf16_gated_activation before it gets here.
template <float (*activation)(float)>
at::Tensor gated_activation(const at::Tensor& gate_up, const char* op) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, op, ": gate_up [rows, 2 * inter]");
  const at::Tensor in = gate_up.contiguous();
  const int64_t rows = in.size(0), inter = in.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, in.options());
  dispatch_float_dtype(in, op, [&](auto zero, auto element) {
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
          const float activated = widen(round_to<storage_t>(activation(widen(gate[i]))));
          o[i] = round_to<storage_t>(activated * widen(up[i]));
        }
      }
    });
  });
  return out;
}

// gated_activation for bfloat16 gate_up, through the table. Not inlined into the ops, so that
// gated_activation's float16 code stays as it was compiled before (see the table).
template <float (*activation)(float)>
__attribute__((noinline)) at::Tensor bf16_gated_activation(const at::Tensor& gate_up) {
  const at::Tensor in = gate_up.contiguous();
  const int64_t rows = in.size(0), inter = in.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, in.options());
  const Bf16Bits* src = bits_of<Bf16Bits, c10::BFloat16>(in);
  Bf16Bits* dst = bits_of<Bf16Bits, c10::BFloat16>(out);
  const float* table = bf16_activation_table<activation>();
  at::parallel_for(0, rows, rows_per_task(inter), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      looked_up_times_up(src + row * 2 * inter, src + row * 2 * inter + inter, dst + row * inter, inter, table);
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  if (gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kBFloat16)
    return bf16_gated_activation<silu>(gate_up);
  return gated_activation<silu>(gate_up, "silu_and_mul");
}

at::Tensor gelu_tanh_and_mul(const at::Tensor& gate_up) {
  if (gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kBFloat16)
    return bf16_gated_activation<gelu_tanh>(gate_up);
  return gated_activation<gelu_tanh>(gate_up, "gelu_tanh_and_mul");
}

// One head of one token: x * cos + swap_halves(x) * signed_sin into o (dim values).
// signed_sin holds -sin in its first half, so this is the reference's
// x * cos + rotate_half(x) * sin, each product rounded before the sum as torch rounds it.
template <typename storage_t>
inline void rotate_head(const storage_t* x, const storage_t* c, const storage_t* s, storage_t* o, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float lo = widen(x[i]), hi = widen(x[i + half]);
    const float lo_cos = widen(round_to<storage_t>(lo * widen(c[i])));
    const float hi_sin = widen(round_to<storage_t>(hi * widen(s[i])));
    o[i] = round_to<storage_t>(lo_cos + hi_sin);
    const float hi_cos = widen(round_to<storage_t>(hi * widen(c[i + half])));
    const float lo_sin = widen(round_to<storage_t>(lo * widen(s[i + half])));
    o[i + half] = round_to<storage_t>(hi_cos + lo_sin);
  }
}

void check_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t tokens,
                  int64_t dim, const char* op) {
  TORCH_CHECK(cos.numel() == tokens * dim && signed_sin.numel() == tokens * dim, op, ": tables [tokens, 1, dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type(), op,
              ": tables in x's dtype");
}

// x [tokens, heads, dim] (any strides, last dim contiguous); cos, signed_sin [tokens, 1, dim]
// -> the rotated x [tokens, heads, dim], contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rotary: x [tokens, heads, even dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  check_tables(x, cos, signed_sin, tokens, dim, "rotary");
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
      for (int64_t t = begin; t < end; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate_head(src + t * token_stride + h * head_stride, cos_t + t * dim, sin_t + t * dim,
                      dst + (t * heads + h) * dim, dim / 2);
    });
  });
  return out;
}

// A decode step's qkv [tokens, (heads + 2 kv_heads) * dim] -> the rotated q [tokens, heads,
// dim]; the rotated k and the v of token t go straight into kv_cache[loc[t]] ([pool tokens,
// 2, kv_heads, dim]). In torch this is a rotary, five slices and views, a stack and an
// index_copy_ (~10 ops a layer); the K bits are the rotary's.
//
// With q_norm and k_norm (Qwen3, Gemma 3: [dim] weights, in qkv's dtype), each q and k head
// is RMS-normalised first, as rms_norm would (rounded to the dtype, then rotated): the same
// bits without two norm ops, their slices and the cat that puts qkv back together.
at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                           at::Tensor& kv_cache, const at::Tensor& loc, int64_t heads, int64_t kv_heads,
                           const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                           double eps, bool unit_offset) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && kv_cache.dim() == 4 && kv_cache.is_contiguous() &&
                  kv_cache.size(1) == 2 && kv_cache.size(2) == kv_heads,
              "rotary_write_kv: qkv [tokens, (heads + 2 kv_heads) dim], kv_cache [pool, 2, kv_heads, dim]");
  const int64_t tokens = qkv.size(0), dim = kv_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim && dim % 2 == 0, "rotary_write_kv: qkv width ",
              qkv.size(1), " is not (", heads, " + 2 x ", kv_heads, ") x ", dim);
  TORCH_CHECK(qkv.scalar_type() == kv_cache.scalar_type(), "rotary_write_kv: qkv and kv_cache share a dtype");
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == tokens && loc.scalar_type() == at::kLong,
              "rotary_write_kv: loc, int64 [tokens]");
  check_tables(qkv, cos, signed_sin, tokens, dim, "rotary_write_kv");
  const bool normed = q_norm.has_value() && q_norm->defined();
  TORCH_CHECK(normed == (k_norm.has_value() && k_norm->defined()), "rotary_write_kv: q_norm and k_norm go together");
  at::Tensor q_weight, k_weight;
  if (normed) {
    q_weight = q_norm->contiguous();
    k_weight = k_norm->contiguous();
    TORCH_CHECK(q_weight.numel() == dim && k_weight.numel() == dim && q_weight.scalar_type() == qkv.scalar_type() &&
                    k_weight.scalar_type() == qkv.scalar_type(),
                "rotary_write_kv: q_norm and k_norm [dim] in qkv's dtype");
  }
  const at::Tensor cc = cos.contiguous(), sc = signed_sin.contiguous(), slots = loc.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t pool = kv_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < pool, "rotary_write_kv: pool index ", slot[t], " out of [0, ", pool, ")");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  const int64_t row_stride = qkv.stride(0), kv_token = 2 * kv_heads * dim;
  dispatch_float_dtype(qkv, "rotary_write_kv", [&](auto zero, auto element) {
    using storage_t = decltype(zero);
    using element_t = decltype(element);
    const storage_t* src = reinterpret_cast<const storage_t*>(qkv.data_ptr<element_t>());
    const storage_t* cos_t = bits_of<storage_t, element_t>(cc);
    const storage_t* sin_t = bits_of<storage_t, element_t>(sc);
    const storage_t* q_w = normed ? bits_of<storage_t, element_t>(q_weight) : nullptr;
    const storage_t* k_w = normed ? bits_of<storage_t, element_t>(k_weight) : nullptr;
    storage_t* q_out = bits_of<storage_t, element_t>(q);
    storage_t* pool_bits = bits_of<storage_t, element_t>(kv_cache);
    const float norm_eps = static_cast<float>(eps);
    at::parallel_for(0, tokens, rows_per_task((heads + 2 * kv_heads) * dim), [&](int64_t begin, int64_t end) {
      std::vector<storage_t> head(normed ? dim : 0);
      // One head rotated into `dst`, from its normalised copy where the family norms it.
      const auto rotate = [&](const storage_t* x, const storage_t* weight, const storage_t* c, const storage_t* s,
                              storage_t* dst) {
        if (weight != nullptr) {
          rms_normalize_row(x, weight, head.data(), dim, norm_eps, unit_offset);
          x = head.data();
        }
        rotate_head(x, c, s, dst, dim / 2);
      };
      for (int64_t t = begin; t < end; ++t) {
        const storage_t* row = src + t * row_stride;
        const storage_t *c = cos_t + t * dim, *s = sin_t + t * dim;
        storage_t* entry = pool_bits + slot[t] * kv_token;  // K of every KV head, then V of every KV head
        for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, q_w, c, s, q_out + (t * heads + h) * dim);
        for (int64_t h = 0; h < kv_heads; ++h) rotate(row + (heads + h) * dim, k_w, c, s, entry + h * dim);
        std::copy_n(row + (heads + kv_heads) * dim, kv_heads * dim, entry + kv_heads * dim);
      }
    });
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_and_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor");
  m.def(
      "rotary_write_kv(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor loc, int heads, "
      "int kv_heads, Tensor? q_norm=None, Tensor? k_norm=None, float eps=0., bool unit_offset=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rotary", &rotary);
  m.impl("rotary_write_kv", &rotary_write_kv);
}
