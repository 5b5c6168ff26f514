// y = x @ w.T (+ bias) in bfloat16 on Intel AMX tiles (AMX-BF16), for every number of rows:
// decode steps, prompt chunks and mixed steps alike.
//
// AMX multiplies a 16 x 32 tile of bfloat16 inputs by a 32 x 16 tile of bfloat16 weights into a
// 16 x 16 tile of float32 sums (TDPBF16PS): one instruction does what ~16 AVX512-BF16 dot
// products do, so a step's linear layers stop being bound by arithmetic at the batch sizes a
// server runs, and are bound by reading the weights once.
//
// Packed layout: the weight's output columns in blocks of 32 (two tiles of 16 columns), each
// block's k in chunks of 32, each chunk two 1 KB tiles of 16 k-pairs x 16 columns x a pair:
// tile[p][2 c + j] = w[column c][k0 + 2 p + j], the layout TDPBF16PS reads its second source in.
// k and n are zero-padded to multiples of 32; a padded k multiplies zeros and adds exact zeros.
//
// Loop order: rows in blocks of up to kRowsPerPass; within a pass, k in spans whose inputs
// (copied into 1 KB tiles) fit kSpanInputBytes and so stay in L2; within a span the threads
// claim column blocks, and each column block's span is read from memory once for all the pass's
// rows, 32 rows (four accumulator tiles) at a time. A decode step (<= kRowsPerPass rows, one
// span) therefore streams each weight once. A long prompt chunk on a wide input (the MLP's down
// projection) takes several spans: read whole, its 256 rows of inputs would not fit in L2 and
// every column block would read them again from memory.
//
// Batch invariance: an output's sum runs over k-chunks 0, 1, 2, ... on one accumulator tile,
// whatever the number of rows, the row's position in its tile, or the thread that computes it
// (between spans the float32 sums wait in memory, and come back with the same bits);
// TDPBF16PS computes each element of the tile from its own row and column only. Padded rows are
// zeros that no output reads. So a row's bits depend on its own inputs alone. Rounded to bfloat16
// once, after the bias (nearest even).
//
// Registered as torch.ops.trident.amx_pack_weight / amx_linear / cpu_has_amx_bf16; the fake
// kernels for tracing are in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// AMX intrinsics arrived in GCC 11.
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TRIDENT_AMX 1
#endif

namespace {

constexpr int64_t kTileRows = 16;      // rows of an input tile and of an accumulator tile
constexpr int64_t kTileColumns = 16;   // float32 columns of an accumulator tile
constexpr int64_t kChunk = 32;         // k of one TDPBF16PS (16 pairs)
constexpr int64_t kBlockColumns = 32;  // output columns a packed block holds (two weight tiles)
constexpr int64_t kTileElements = kTileRows * kChunk;  // bfloat16 elements of an input or weight tile
constexpr int64_t kBlockChunkElements = 2 * kTileElements;
// Rows of one pass over the weights. Larger batches (long prompt chunks) read the weights once a pass.
constexpr int64_t kRowsPerPass = 256;
// The input tiles of one k-span of a pass (all of k = 2,048 at 256 rows), kept in L2 while every
// column block is read once.
constexpr int64_t kSpanInputBytes = int64_t{1} << 20;
// Column blocks a thread claims at a time (parallel_for_claimed).
constexpr int64_t kBlocksPerClaim = 1;

#ifdef TRIDENT_AMX
// Linux hands a process AMX's 8 KB of tile state only on request (arch_prctl).
constexpr int kArchRequestXcompPerm = 0x1023;
constexpr int kXfeatureTileData = 18;

bool request_amx_permission() {
  static const bool granted = syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureTileData) == 0;
  return granted;
}
#endif

bool cpu_has_amx_bf16() {
#ifdef TRIDENT_AMX
  return __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") && request_amx_permission();
#else
  return false;
#endif
}

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

// weight [n, k] bfloat16 -> [ceil(n / 32), ceil(k / 32), 2, 16, 32] bfloat16 (see the layout above).
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "amx_pack_weight: weight [n, k] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = round_up(n, kBlockColumns) / kBlockColumns, chunks = round_up(k, kChunk) / kChunk;
  at::Tensor packed = at::zeros({blocks, chunks, 2, kTileRows, kChunk}, weight.options());
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t columns = std::min(kBlockColumns, n - block * kBlockColumns);
      for (int64_t c = 0; c < columns; ++c) {
        const uint16_t* row = src + (block * kBlockColumns + c) * k;
        const int64_t tile = c / kTileColumns, column = c % kTileColumns;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t chunk = kk / kChunk, pair = (kk % kChunk) / 2, half = kk % 2;
          dst[((block * chunks + chunk) * 2 + tile) * kTileElements + pair * kChunk + 2 * column + half] = row[kk];
        }
      }
    }
  });
  return packed;
}

#ifdef TRIDENT_AMX
// `rows` rows of x [rows, k], k-chunks first_chunk .. first_chunk + chunks - 1 -> input tiles
// [ceil(rows / 16)][chunks][16][32]: each tile the 1 KB that TDPBF16PS reads as its first source,
// contiguous. Read in place, a tile's 16 rows lie k * 2 bytes apart, a stride that maps them onto
// a few L1 sets (4 KB apart at k = 2,048), and every chunk's loads miss. Rows past `rows` and k
// past `k` are zeros.
void pack_input_tiles(const uint16_t* x, int64_t rows, int64_t k, int64_t first_chunk, int64_t chunks,
                      uint16_t* tiles) {
  const int64_t row_tiles = round_up(rows, kTileRows) / kTileRows;
  at::parallel_for(0, row_tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        uint16_t* tile = tiles + (t * chunks + chunk) * kTileElements;
        const int64_t k0 = (first_chunk + chunk) * kChunk, width = std::min(kChunk, k - k0);
        for (int64_t r = 0; r < kTileRows; ++r) {
          const int64_t row = t * kTileRows + r;
          uint16_t* dst = tile + r * kChunk;
          if (row < rows) {
            std::memcpy(dst, x + row * k + k0, width * 2);
            std::fill(dst + width, dst + kChunk, 0);
          } else {
            std::fill(dst, dst + kChunk, 0);
          }
        }
      }
    }
  });
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

// The palette every tile of this kernel uses: 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = kTileRows;
    }
  }
};

// Where a block's float32 sums [32 rows][32 columns] are, `ld` floats a row.
struct SumsAt {
  float* sums;
  int64_t ld;
};

// Tiles: 0-3 accumulators (rows a/b x columns 0-15/16-31), 4-5 inputs (rows a, b), 6-7 weights
// (columns 0-15, 16-31). Adds `chunks` k-chunks of one 32-column block for 16 or 32 rows to the
// sums `from` (zeros when its pointer is null) and stores them to `to`. x_a / x_b: the first
// input tile of each 16 rows (packed by pack_input_tiles: a tile a chunk, 1 KB apart).
template <bool kTwoRowTiles>
void block_sums(const uint16_t* x_a, const uint16_t* x_b, const uint16_t* block, int64_t chunks, SumsAt from,
                SumsAt to) {
  const int64_t from_ld = from.ld * sizeof(float), to_ld = to.ld * sizeof(float);
  const int64_t row_b = kTileRows * from.ld;
  if (from.sums) {
    _tile_loadd(0, from.sums, from_ld);
    _tile_loadd(1, from.sums + kTileColumns, from_ld);
    if (kTwoRowTiles) {
      _tile_loadd(2, from.sums + row_b, from_ld);
      _tile_loadd(3, from.sums + row_b + kTileColumns, from_ld);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if (kTwoRowTiles) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const uint16_t* weights = block + chunk * kBlockChunkElements;
    _tile_loadd(4, x_a + chunk * kTileElements, 64);
    _tile_loadd(6, weights, 64);
    _tile_loadd(7, weights + kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kTwoRowTiles) {
      _tile_loadd(5, x_b + chunk * kTileElements, 64);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, to.sums, to_ld);
  _tile_stored(1, to.sums + kTileColumns, to_ld);
  if (kTwoRowTiles) {
    _tile_stored(2, to.sums + kTileRows * to.ld, to_ld);
    _tile_stored(3, to.sums + kTileRows * to.ld + kTileColumns, to_ld);
  }
}

// sums [rows][32] + bias, rounded into out[row * n + column] for the first `columns` columns.
void round_block(const float* sums, int64_t rows, const float* bias, int64_t columns, uint16_t* out, int64_t n) {
  const __mmask16 lo_mask = columns >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << columns) - 1);
  const __mmask16 hi_mask =
      columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : static_cast<__mmask16>((1u << (columns - 16)) - 1);
  const __m512 b_lo = bias ? _mm512_maskz_loadu_ps(lo_mask, bias) : _mm512_setzero_ps();
  const __m512 b_hi = bias ? _mm512_maskz_loadu_ps(hi_mask, bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = sums + r * kBlockColumns;
    const __m256bh lo = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(row), b_lo));
    const __m256bh hi = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(row + 16), b_hi));
    _mm256_mask_storeu_epi16(out + r * n, lo_mask, (__m256i)lo);
    _mm256_mask_storeu_epi16(out + r * n + 16, hi_mask, (__m256i)hi);
  }
}

// One k-span of a pass: `rows` (<= kRowsPerPass) rows, their k-chunks first_chunk ..
// first_chunk + span_chunks - 1 packed by pack_input_tiles, against every column block. `partial`
// [rows rounded up to 32][blocks * 32] float32 holds the sums between spans (unused with one
// span); the last span rounds them into `out`.
void amx_span(const uint16_t* tiles, int64_t rows, const uint16_t* packed, int64_t chunks, int64_t first_chunk,
              int64_t span_chunks, float* partial, const float* bias, int64_t n, uint16_t* out) {
  const int64_t blocks = round_up(n, kBlockColumns) / kBlockColumns, partial_ld = blocks * kBlockColumns;
  const int64_t block_elements = chunks * kBlockChunkElements, row_tile_elements = span_chunks * kTileElements;
  const bool first = first_chunk == 0, last = first_chunk + span_chunks == chunks;
  trident_kernels::parallel_for_claimed(blocks, kBlocksPerClaim, [&](int64_t begin, int64_t end) {
    const TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float sums[2 * kTileRows * kBlockColumns];
    for (int64_t block = begin; block < end; ++block) {
      const uint16_t* weights = packed + block * block_elements + first_chunk * kBlockChunkElements;
      const int64_t column0 = block * kBlockColumns, columns = std::min(kBlockColumns, n - column0);
      for (int64_t row0 = 0; row0 < rows; row0 += 2 * kTileRows) {
        const uint16_t* x_a = tiles + (row0 / kTileRows) * row_tile_elements;
        const int64_t tile_rows = std::min(2 * kTileRows, rows - row0);
        const SumsAt held{partial + row0 * partial_ld + column0, partial_ld};
        const SumsAt from = first ? SumsAt{nullptr, 0} : held, to = last ? SumsAt{sums, kBlockColumns} : held;
        if (tile_rows > kTileRows) {
          block_sums<true>(x_a, x_a + row_tile_elements, weights, span_chunks, from, to);
        } else {
          block_sums<false>(x_a, nullptr, weights, span_chunks, from, to);
        }
        if (last)
          round_block(sums, tile_rows, bias ? bias + column0 : nullptr, columns, out + row0 * n + column0, n);
      }
    }
    _tile_release();
  });
}

#pragma GCC pop_options
#endif

// x [rows, k] bfloat16; packed from amx_pack_weight of a [n, k] weight; bias [n] or none -> [rows, n].
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "amx_linear: bfloat16 input");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == kTileRows &&
                  packed.size(4) == kChunk,
              "amx_linear: x [rows, k], a weight packed by amx_pack_weight");
  const int64_t rows = x.size(0), k = x.size(1), chunks = packed.size(1);
  TORCH_CHECK(round_up(k, kChunk) == chunks * kChunk && packed.size(0) == round_up(n, kBlockColumns) / kBlockColumns,
              "amx_linear: x has ", k, " features, the packed weight ", chunks * kChunk, " (", n, " outputs)");
  TORCH_CHECK(cpu_has_amx_bf16(), "amx_linear: this CPU has no AMX-BF16 (cpu_kernels.py does not call it then)");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
#ifdef TRIDENT_AMX
  const at::Tensor bias_f = trident_kernels::float_bias(bias, n);
  const at::Tensor xc = x.contiguous();
  const auto* x_bits = reinterpret_cast<const uint16_t*>(xc.data_ptr<c10::BFloat16>());
  auto* out_bits = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t most_rows = round_up(std::min(rows, kRowsPerPass), 2 * kTileRows);
  const int64_t span_chunks = std::clamp<int64_t>(kSpanInputBytes / (most_rows * kChunk * 2), 1, chunks);
  std::vector<uint16_t> tiles(most_rows * span_chunks * kChunk);
  std::vector<float> partial(span_chunks < chunks ? most_rows * packed.size(0) * kBlockColumns : 0);
  for (int64_t row0 = 0; row0 < rows; row0 += kRowsPerPass) {
    const int64_t pass_rows = std::min(kRowsPerPass, rows - row0);
    for (int64_t first_chunk = 0; first_chunk < chunks; first_chunk += span_chunks) {
      const int64_t span = std::min(span_chunks, chunks - first_chunk);
      pack_input_tiles(x_bits + row0 * k, pass_rows, k, first_chunk, span, tiles.data());
      amx_span(tiles.data(), pass_rows, reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), chunks,
               first_chunk, span, partial.data(), bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, n,
               out_bits + row0 * n);
    }
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(trident, m) {
  m.def("amx_pack_weight(Tensor weight) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("cpu_has_amx_bf16() -> bool");
}

TORCH_LIBRARY_IMPL(trident, CPU, m) {
  m.impl("amx_pack_weight", &amx_pack_weight);
  m.impl("amx_linear", &amx_linear);
}

TORCH_LIBRARY_IMPL(trident, CompositeExplicitAutograd, m) { m.impl("cpu_has_amx_bf16", &cpu_has_amx_bf16); }
