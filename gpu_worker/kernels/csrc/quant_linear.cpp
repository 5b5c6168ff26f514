// y = x @ w.T (+ bias) on quantized weights, for GGUF's block formats repacked into four
// layouts (gpu_worker/quant_linear.py converts them, exactly):
//   U4: unsigned 4-bit codes c with a scale s and a min m per block of 32 along k: w = s c + m;
//   I8: signed 8-bit codes c with a scale s per block of 16 or 32 along k: w = s c;
//   I5: signed 5-bit codes c (-16..15) with a scale s per block of 32 along k: w = s c (Q5_0,
//       in 5.5 bits a weight where I8 takes 8.5);
//   I6: signed 6-bit codes c (-32..31) with a scale s per block of 16 along k: w = s c (Q6_K,
//       in 8 bits a weight with its float32 scales where I8 takes 10).
//
// The activations are quantized per row and per block of 32 to int8, as llama.cpp does
// (x ~ sx qx, sx = max|x| / 127, qx = round(x / sx)), so that each block's dot product is an
// integer one: vpdpbusd (AVX512-VNNI) multiplies 64 unsigned bytes by 64 signed bytes and adds
// each 4 products into an int32 lane; on AVX2, vpmaddubsw + vpmaddwd do the same in two steps.
// Per output column and block b:  acc += (s_b sx_b) * dot_b (+ m_b * (sx_b * sum(qx_b)) for U4).
// docs/benchmarks.md ("Method") says why int8 and not float activations.
//
// Unsigned weights are what vpdpbusd wants: U4 codes are 0..15, I8 codes are stored +128
// (0..255), I5 codes +16 (0..31) and I6 codes +32 (0..63); their dot with qx then exceeds the
// signed one by that bias times sum(qx_b), which the row's quantization already counted
// (sum16). AVX2's vpmaddubsw would saturate on 255 * 127 * 2, so its I8 path turns the code
// back to signed and multiplies |c| by qx with c's sign (at most 128 * 127 * 2, no
// saturation); I5's and I6's codes (at most 63 * 127 * 2) go in as they are. Both paths reach
// the same integer dot and then run the same float operations in the same order: their
// results are the same bits.
//
// The packed layout: output columns in panels of 16; a panel's blocks one after another, each
//   codes: 16 columns x 4 consecutive k in each 64 bytes (one lane of vpdpbusd a column);
//     U4: block_k / 8 such vectors (4), the low nibbles holding k 0..15, the high k 16..31;
//     I8: block_k / 4 such vectors of (c + 128);
//     I5: U4's 4 vectors of nibbles (the low 4 bits of c + 16), then the fifth bits: 8 masks of
//       64 bits, mask 2g + h for vector g's low (h = 0) or high (h = 1) nibbles, bit i for
//       byte i of that vector (AVX-512 adds 16 under the mask; AVX2 spreads 32 bits to bytes);
//     I6 (block 16): 2 vectors of nibbles of c + 32 (vector h's low nibbles: codes of vector h,
//       high: of vector 2 + h), then one of their top bits (bits 2g, 2g + 1 for code vector g);
//   then the 16 scales (float16 where every scale is exactly a float16, else float32), and for
//   U4 the 16 mins in the same type.
// Above kOneThreadRows rows, a thread claims a block of rows and a few panels at a time
// (parallel_for_claimed in kernel_common.h); each panel is read front to back; up to
// kMaxTileRows input rows share each decoded vector of weights.
//
// Each output element is summed block by block in k order whatever the batch and the thread
// count: a row's result does not depend on the rows beside it. Rounded once, at the end.
//
// Where the CPU has AMX-INT8, the "amx_int8" path takes each 16 rows of a panel on AMX tiles
// (csrc/amx_int8_tiles.h) and the rows left over on the VNNI tile, with the same bits.
//
// Registered as torch.ops.trident.quant_linear / quant_linear_rows / quant_linear_best_path;
// the fake kernels for tracing are in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "int8_activations.h"
#include "kernel_common.h"
#include "quant_tiles.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using namespace trident_kernels::quant;
using trident_kernels::cpu_has_avx2_fma;

// Calls of up to this many rows run on the calling thread alone: they read their weights at
// the memory's pace from one core, so a second thread adds no bandwidth, and a parallel
// region per call (one per linear layer of a step) costs its fork and join, far more where a
// teammate is descheduled by the scheduler process or other load (docs/benchmarks.md,
// "Kernels"). The split changes no bits.
constexpr int64_t kOneThreadRows = 4;

std::string quant_linear_best_path() {
  static const std::string best = find_best_path();
  return best;
}

// AMX's tile of 16 rows (amx_int8_tiles.h), the decoding of a panel's codes that it reads,
// the tile configuration it needs on the thread that runs it, and the release of the tile
// state after; all nullptr where the path does not use AMX.
struct WideTile {
  void (*tile)(const uint8_t* panel, const uint8_t* codes, int64_t blocks, int64_t block_bytes,
               const QuantizedRows& x, int64_t row0, float* result);
  const uint8_t* (*decode)(const uint8_t* panel, int64_t blocks, int64_t block_bytes, uint8_t* scratch);
  void (*configure)();
  void (*release)();
};

#if defined(TRIDENT_AMX) && defined(__AVX512F__)
template <int64_t kLayout, int64_t kBlock, bool kHalfScales>
constexpr WideTile amx_tile() {
  namespace amx = trident_kernels::amx_int8;
  return {&amx::tile<kLayout, kBlock, kHalfScales, code_bytes(kLayout, kBlock), code_bias(kLayout)>,
          &amx::decode_panel<kLayout, kBlock>, &amx::configure_tiles<kBlock>, &amx::release_tiles};
}
#endif

WideTile pick_wide_tile(bool amx, int64_t layout, int64_t block, bool half_scales) {
#if defined(TRIDENT_AMX) && defined(__AVX512F__)
  if (!amx) return {nullptr, nullptr, nullptr, nullptr};
  if (layout == kU4) return half_scales ? amx_tile<kU4, 32, true>() : amx_tile<kU4, 32, false>();
  if (layout == kI5) return half_scales ? amx_tile<kI5, 32, true>() : amx_tile<kI5, 32, false>();
  if (layout == kI6) return half_scales ? amx_tile<kI6, 16, true>() : amx_tile<kI6, 16, false>();
  if (block == 16) return half_scales ? amx_tile<kI8, 16, true>() : amx_tile<kI8, 16, false>();
  return half_scales ? amx_tile<kI8, 32, true>() : amx_tile<kI8, 32, false>();
#else
  return {nullptr, nullptr, nullptr, nullptr};
#endif
}

// The int8 activations of a block of rows, which stay in L2 while the block passes each
// panel of a claim: the claim's panels then stream the block once, not all the rows.
constexpr int64_t kRowBlockBytes = 256 * 1024;

template <typename storage_t>
void run_panels(const uint8_t* packed, int64_t n, int64_t blocks, int64_t block_bytes, const QuantizedRows& x,
                int64_t rows, const std::array<TileFn, kMaxTileRows>& tiles, int64_t tile_rows, WideTile wide,
                const float* bias, storage_t* out) {
  constexpr int64_t kWideRows = trident_kernels::amx_int8::kTileRows;
  const int64_t panels = (n + kPanelColumns - 1) / kPanelColumns;
  const int64_t panel_bytes = blocks * block_bytes;
  // Rows in blocks of a multiple of every tile's row count, so that no block ends in a short
  // tile; the work items are (row block, claim of panels), a row block's items one after the
  // other. The grouping of rows into tiles changes no bits.
  const int64_t row_step = std::lcm(kWideRows, tile_rows);
  const int64_t row_block = std::max(row_step, kRowBlockBytes / x.k / row_step * row_step);
  const int64_t row_blocks = (rows + row_block - 1) / row_block;
  // Claims of ~32 KB of weights, and at least 4 items a thread where the panels allow.
  const int64_t by_size = std::max<int64_t>(1, 32768 / panel_bytes);
  const int64_t by_count = std::max<int64_t>(1, panels * row_blocks / (4 * std::max(1, at::get_num_threads())));
  const int64_t claim = std::min(by_size, by_count);
  const int64_t claims = (panels + claim - 1) / claim;
  // A claimed panel's B tiles for the wide tile, decoded (16 columns x a block of at most 32 k).
  const int64_t decoded_panel_bytes = blocks * kPanelColumns * 32;
  const auto compute = [&](int64_t begin, int64_t end) {
    alignas(64) float result[kWideRows * kPanelColumns];
    // Kept by the thread, as quant_linear's scratch: a call runs compute once per claim.
    thread_local std::vector<uint8_t> decoded;
    thread_local std::vector<const uint8_t*> codes;
    uint8_t* scratch = nullptr;
    if (wide.tile) {
      wide.configure();
      decoded.resize(static_cast<size_t>(claim * decoded_panel_bytes + 64));
      codes.resize(static_cast<size_t>(claim));
      scratch = decoded.data() + (64 - reinterpret_cast<uintptr_t>(decoded.data()) % 64) % 64;
    }
    for (int64_t item = begin; item < end; ++item) {
      const int64_t first_row = item / claims * row_block, last_row = std::min(rows, first_row + row_block);
      const int64_t first_panel = item % claims * claim, last_panel = std::min(panels, first_panel + claim);
      // Each 16 rows on the wide tile where there is one, the rest on the narrow tiles. Each
      // claimed panel is decoded once for all the block's tiles, and a tile's rows stay in L1
      // while it passes the claim's panels.
      const bool any_wide = wide.tile && last_row - first_row >= kWideRows;
      for (int64_t panel = first_panel; any_wide && panel < last_panel; ++panel)
        codes[panel - first_panel] = wide.decode(packed + panel * panel_bytes, blocks, block_bytes,
                                                 scratch + (panel - first_panel) * decoded_panel_bytes);
      for (int64_t row0 = first_row, tile = 0; row0 < last_row; row0 += tile) {
        const bool wide_rows = any_wide && last_row - row0 >= kWideRows;
        tile = wide_rows ? kWideRows : std::min<int64_t>(tile_rows, last_row - row0);
        for (int64_t panel = first_panel; panel < last_panel; ++panel) {
          const uint8_t* weights = packed + panel * panel_bytes;
          if (wide_rows)
            wide.tile(weights, codes[panel - first_panel], blocks, block_bytes, x, row0, result);
          else
            tiles[tile - 1](weights, blocks, block_bytes, x, row0, result);
          const int64_t column0 = panel * kPanelColumns;
          const int64_t columns = std::min(kPanelColumns, n - column0);
          for (int64_t r = 0; r < tile; ++r) {
            storage_t* dst = out + (row0 + r) * n + column0;
            for (int64_t c = 0; c < columns; ++c) {
              const float v = result[r * kPanelColumns + c];
              dst[c] = trident_kernels::round_to<storage_t>(bias ? v + bias[column0 + c] : v);
            }
          }
        }
      }
    }
    if (wide.tile) wide.release();
  };
  if (rows <= kOneThreadRows)
    compute(0, row_blocks * claims);
  else
    trident_kernels::parallel_for_claimed(row_blocks * claims, 1, compute);
}

// x [rows, k] (float32, bfloat16 or float16); packed [ceil(n / 16), k / block, block bytes]
// uint8 as quant_linear.py lays it out; layout 0 (U4), 1 (I8), 2 (I5) or 3 (I6); path "auto",
// "amx_int8", "avx512_vnni" or "avx2" (the tests run each on one CPU) -> [rows, n] in x's dtype.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features, int64_t layout, int64_t block, bool half_scales, c10::string_view path) {
  TORCH_CHECK(x.dim() == 2, "quant_linear: x [rows, k]");
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  check_packed(packed, n, k, layout, block, half_scales, "quant_linear");
  const int64_t blocks = packed.size(1), block_bytes = packed.size(2);
  const bool vnni = use_vnni(path, "quant_linear");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const at::Tensor xc = x.contiguous();
  // The quantized rows live in a buffer kept by the calling thread: a decode step makes ~200
  // calls, and four allocations a call were a fifth of a small layer's time.
  thread_local std::vector<int32_t> scratch;
  const at::Tensor bias_f = trident_kernels::float_bias(bias, n);
  const auto tiles = pick_tiles(vnni, layout, block, half_scales);
  const WideTile wide =
      pick_wide_tile(use_amx_int8(path) && rows >= trident_kernels::amx_int8::kTileRows, layout, block, half_scales);
#ifdef __AVX2__
  trident_kernels::dispatch_float_dtype(x, "quant_linear", [&](auto storage, auto element) {
    using storage_t = decltype(storage);
    using element_t = decltype(element);
    const QuantizedRows xq = trident_kernels::quantize_into(scratch, trident_kernels::bits_of<storage_t, element_t>(xc), rows, k);
    run_panels(packed.data_ptr<uint8_t>(), n, blocks, block_bytes, xq, rows, tiles, vnni ? kMaxTileRows : kAvx2TileRows,
               wide, bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, trident_kernels::bits_of<storage_t, element_t>(out));
  });
#endif
  return out;
}

inline float scale_at(const uint8_t* p, bool half_scales, int64_t column) {
  if (half_scales) {
    c10::Half h;
    std::memcpy(&h, p + 2 * column, sizeof(h));
    return static_cast<float>(h);
  }
  float f;
  std::memcpy(&f, p + 4 * column, sizeof(f));
  return f;
}

// Rows `ids` of the dequantized weight in `dtype`: scale * code (+ min) in float32, one
// rounding each, as quant_linear.py's dequantize (the embedding lookup of a tied LM head).
at::Tensor quant_linear_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t out_features, int64_t layout,
                             int64_t block, bool half_scales, at::ScalarType dtype) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "quant_linear_rows: packed weights [panels, blocks, bytes] uint8");
  TORCH_CHECK(valid_layout(layout, block), "quant_linear_rows: layout 0 (U4, block 32), 1 (I8, block 16 or 32), ",
              "2 (I5, block 32) or 3 (I6, block 16)");
  const int64_t blocks = packed.size(1), block_bytes = packed.size(2), k = blocks * block;
  const int64_t scale_bytes = half_scales ? 2 : 4, codes = code_bytes(layout, block);
  const at::Tensor flat_ids = ids.reshape({-1}).to(at::kLong).contiguous();
  TORCH_CHECK(packed.size(0) == (out_features + kPanelColumns - 1) / kPanelColumns,
              "quant_linear_rows: packed weights of another shape");
  const int64_t count = flat_ids.numel(), limit = out_features;
  const int64_t* id = flat_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < limit, "quant_linear_rows: id ", id[i], " out of range");
  at::Tensor out = at::empty({count, k}, packed.options().dtype(dtype));
  const uint8_t* data = packed.data_ptr<uint8_t>();
  trident_kernels::dispatch_float_dtype(out, "quant_linear_rows", [&](auto storage, auto element) {
    using storage_t = decltype(storage);
    storage_t* dst = trident_kernels::bits_of<storage_t, decltype(element)>(out);
    at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t column = id[i] % kPanelColumns;
        const uint8_t* panel = data + (id[i] / kPanelColumns) * blocks * block_bytes;
        storage_t* row = dst + i * k;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* wb = panel + b * block_bytes;
          const float scale = scale_at(wb + codes, half_scales, column);
          if (layout == kU4) {  // 32 k in 4 groups, two nibbles a byte
            const float min = scale_at(wb + codes + kPanelColumns * scale_bytes, half_scales, column);
            for (int64_t g = 0; g < 4; ++g) {
              const uint8_t* lane = wb + 64 * g + 4 * column;
              for (int64_t j = 0; j < 4; ++j) {
                const float lo = scale * static_cast<float>(lane[j] & 15), hi = scale * static_cast<float>(lane[j] >> 4);
                row[b * 32 + 4 * g + j] = trident_kernels::round_to<storage_t>(lo + min);
                row[b * 32 + 16 + 4 * g + j] = trident_kernels::round_to<storage_t>(hi + min);
              }
            }
          } else if (layout == kI5) {  // U4's nibbles, and the fifth bit of byte i of vector 2g + h at bit i
            for (int64_t g = 0; g < 4; ++g) {
              const uint8_t* lane = wb + 64 * g + 4 * column;
              const uint64_t low_masks = load_u64(wb + 256 + 16 * g), high_masks = load_u64(wb + 256 + 16 * g + 8);
              for (int64_t j = 0; j < 4; ++j) {
                const int64_t bit = 4 * column + j;
                const int32_t lo = (lane[j] & 15) | static_cast<int32_t>((low_masks >> bit) & 1) << 4;
                const int32_t hi = (lane[j] >> 4) | static_cast<int32_t>((high_masks >> bit) & 1) << 4;
                row[b * 32 + 4 * g + j] = trident_kernels::round_to<storage_t>(scale * static_cast<float>(lo - 16));
                row[b * 32 + 16 + 4 * g + j] = trident_kernels::round_to<storage_t>(scale * static_cast<float>(hi - 16));
              }
            }
          } else if (layout == kI6) {  // code vector g: nibbles of vector g % 2 (low, then high), top bits 2g..2g+1
            for (int64_t g = 0; g < 4; ++g) {
              for (int64_t j = 0; j < 4; ++j) {
                const int64_t lane = 4 * column + j;
                const int32_t nibble = (wb[64 * (g % 2) + lane] >> (4 * (g / 2))) & 15;
                const int32_t code = nibble | ((wb[128 + lane] >> (2 * g)) & 3) << 4;
                row[b * 16 + 4 * g + j] = trident_kernels::round_to<storage_t>(scale * static_cast<float>(code - 32));
              }
            }
          } else {
            for (int64_t g = 0; g < block / 4; ++g) {
              const uint8_t* lane = wb + 64 * g + 4 * column;
              for (int64_t j = 0; j < 4; ++j)
                row[b * block + 4 * g + j] =
                    trident_kernels::round_to<storage_t>(scale * static_cast<float>(static_cast<int32_t>(lane[j]) - 128));
            }
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def(
      "quant_linear(Tensor x, Tensor packed, Tensor? bias, int out_features, int layout, int block, bool half_scales, "
      "str path='auto') -> Tensor");
  m.def("quant_linear_rows(Tensor packed, Tensor ids, int out_features, int layout, int block, bool half_scales, "
      "ScalarType dtype) -> Tensor");
  m.def("quant_linear_best_path() -> str");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_linear_rows", &quant_linear_rows);
}

TORCH_LIBRARY_IMPL(trident, CompositeExplicitAutograd, m) {
  m.impl("quant_linear_best_path", &quant_linear_best_path);
}
