// Helpers shared by the C++ CPU kernels: scalar ones written so that the loops calling them
// vectorise (bfloat16 read as raw bits, rounded back as c10 does; exp(x) for x <= 0), and a
// dtype dispatch that hands the kernels bfloat16 as those raw bits.
#pragma once

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace trident_kernels {

// bfloat16 read as raw bits: c10::BFloat16's conversions are scalar, and at prefill sizes
// they were most of an RMSNorm's time (docs/benchmarks.md, "Method").
struct Bf16Bits {
  uint16_t bits;
};
static_assert(sizeof(Bf16Bits) == sizeof(c10::BFloat16), "read in place of c10::BFloat16");

// The CPU runs AVX2 with FMA: the widening bf16 linear's path, and the quantized linear's
// where the CPU has no AVX512-VNNI.
inline bool cpu_has_avx2_fma() {
#if defined(__x86_64__) && defined(__GNUC__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

inline float widen(float v) { return v; }
inline float widen(c10::Half v) { return static_cast<float>(v); }
inline float widen(Bf16Bits v) {
  const uint32_t wide = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

template <typename storage_t>
inline storage_t round_to(float f) {
  return static_cast<storage_t>(f);
}

// Round to nearest even, as c10::BFloat16 does; NaN stays NaN.
template <>
inline Bf16Bits round_to<Bf16Bits>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return {(u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded)};
}

#ifdef __AVX512F__
// 16 bfloat16 values (raw bits) widened to float32, as widen does one.
inline __m512 widen16(const uint16_t* src) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// exp(x) for x <= 0, vectorisable: 2^(x log2 e) split into an integer power, set in the
// exponent bits, and a degree-6 polynomial of the fraction (relative error ~2e-7); below
// -87 the result is 0, as float32 underflow would make it.
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.f ? -87.f : x;
  const float t = clamped * 1.44269504088896341f;
  const float whole = __builtin_floorf(t);
  const float f = t - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

#ifdef __AVX512F__
// exp_nonpositive of sixteen values, the same operations lane by lane (a lane below its cut-off
// is 0), so a vector loop keeps the scalar one's bits.
inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_US);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(kept, p, _mm512_castsi512_ps(bits));
}
#endif

// x * sigmoid(x), with sigmoid from exp(-|x|) so that the exponential never overflows.
inline float silu(float x) {
  const float e = exp_nonpositive(x > 0.f ? -x : x);
  return x * ((x >= 0.f ? 1.f : e) / (1.f + e));
}

// One row's RMSNorm in the reference's rounding order, src and dst of `dim` values (they
// may be the same): normalised in float32; LLaMA's weight * round(normed), or with
// unit_offset Gemma's round(normed * (1 + weight)) in float32.
template <typename storage_t>
inline void rms_normalize_row(const storage_t* src, const storage_t* weight, storage_t* dst, int64_t dim, float eps,
                              bool unit_offset) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < dim; ++i) {
    const float v = widen(src[i]);
    squares += v * v;
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
  if (unit_offset) {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) dst[i] = round_to<storage_t>(widen(src[i]) * inv * (1.f + widen(weight[i])));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      const float normed = widen(round_to<storage_t>(widen(src[i]) * inv));
      dst[i] = round_to<storage_t>(widen(weight[i]) * normed);
    }
  }
}

// The grain of an at::parallel_for over rows of `row_elements` elements: a task of at least
// 64K elements, so a decode step's norms, rotary and gated activation (32 rows of a few
// thousand) run on the calling thread. On an idle core a second thread would pay for
// itself from ~16K elements, but the worker's cores are shared with the scheduler and
// tokenizer: a region then waits until its teammate is scheduled again, which can cost
// far more than the op's own work (docs/benchmarks.md, "Method").
inline int64_t rows_per_task(int64_t row_elements) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_elements, 1));
}

// Runs body(begin, end) over [0, n) in chunks of `chunk`, which the region's threads claim
// one at a time, where at::parallel_for hands each thread a fixed share. On cores shared
// with other processes a thread the OS preempts for a moment then holds up only the chunk it
// is in: its teammate goes on claiming the rest, instead of finishing its own share and
// waiting at the region's end for the other half. Beside a process that wakes many times a
// step this shortens the median and the tail of decode steps, and alone it costs nothing
// (docs/benchmarks.md, "Method").
template <typename Body>
void parallel_for_claimed(int64_t n, int64_t chunk, const Body& body) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    body(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      body(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// parallel_for_claimed for a body that prefetches what it reads next: each thread claims its
// next chunk before it runs the current one, and body(begin, end, next_begin) learns where that
// next chunk starts (n when there is none), so that a chunk's last item can prefetch the next
// chunk's first instead of leaving it to a cold start. A thread holds at most one chunk ahead.
template <typename Body>
void parallel_for_claimed_ahead(int64_t n, int64_t chunk, const Body& body) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    body(0, n, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;) {
      const int64_t ahead = next.fetch_add(1, std::memory_order_relaxed);
      body(c * chunk, std::min(n, (c + 1) * chunk), ahead < chunks ? ahead * chunk : n);
      c = ahead;
    }
  });
}

// Calls `body(storage_t{}, element_t{})` for the tensor's dtype: element_t is its c10 type,
// storage_t how a kernel reads it (bfloat16 as Bf16Bits).
template <typename Body>
void dispatch_float_dtype(const at::Tensor& t, const char* op, const Body& body) {
  switch (t.scalar_type()) {
    case at::kFloat: body(float{}, float{}); break;
    case at::kBFloat16: body(Bf16Bits{}, c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}, c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16, not ", t.scalar_type());
  }
}

// An optional bias of n values as a contiguous float32 tensor, undefined when absent.
inline at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  TORCH_CHECK(bias->numel() == n, "bias [n]");
  return bias->to(at::kFloat).contiguous();
}

// A tensor's data as storage_t (Bf16Bits for bfloat16).
template <typename storage_t, typename element_t>
storage_t* bits_of(const at::Tensor& t) {
  return reinterpret_cast<storage_t*>(t.data_ptr<element_t>());
}

}  // namespace trident_kernels
