// y = x @ w.T (+ bias) in bfloat16 on Intel AMX tiles (AMX-BF16), for every number of rows:
// decode steps, prompt chunks and mixed steps alike.
//
// AMX multiplies a 16 x 32 tile of bfloat16 inputs by a 32 x 16 tile of bfloat16 weights into a
// 16 x 16 tile of float32 sums (TDPBF16PS): one instruction does what ~16 AVX512-BF16 dot
// products do, so a step's linear layers stop being bound by arithmetic at the batch sizes a
// server runs, and are bound by reading the weights once.
//
// The packed weight layout, the input tiles and the inner loop are amx_tiles.h's (shared with
// fused_moe.cpp).
//
// Loop order: rows in blocks of up to kRowsPerPass; within a pass, k in spans whose inputs
// (copied into 1 KB tiles) fit kSpanInputBytes and so stay in L2; within a span the threads
// claim column blocks, and each column block's span is read from memory once for all the pass's
// rows, 32 rows (four accumulator tiles) at a time. A decode step (<= kRowsPerPass rows, one
// span) therefore streams each weight once. A long prompt chunk on a wide input (the MLP's down
// projection) takes several spans: read whole, its 256 rows of inputs would not fit in L2 and
// every column block would read them again from memory.
// A column block's span is not held in L1 across the row tiles with the sums parked in memory
// between short spans: every park is four tile stores and four tile loads, and at spans short
// enough for L1 they cost more than the L2 reads they save (measured at 64-256 rows a pass).
// The exception is two row passes (33-64 rows) on a wide input, a decode step's down
// projection: there a pass's input tiles and the block's span do not both stay in L2, and the
// second row pass would read the block's weights from memory again. Those blocks go in short
// sub-spans, each summed for both row passes while its weights are in L1, so the weights are
// read from memory once.
//
// Batch invariance: an output's sum runs over k-chunks 0, 1, 2, ... on one accumulator tile,
// whatever the number of rows, the row's position in its tile, or the thread that computes it
// (between spans and sub-spans the float32 sums wait in memory, and come back with the same
// bits);
// TDPBF16PS computes each element of the tile from its own row and column only. Padded rows are
// zeros that no output reads. So a row's bits depend on its own inputs alone. Rounded to bfloat16
// once, after the bias (nearest even).
//
// Registered as torch.ops.trident.amx_pack_weight / amx_linear / cpu_has_amx_bf16; the fake
// kernels for tracing are in cpu_kernels.py.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include "amx_tiles.h"
#include "kernel_common.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

namespace amx = trident_kernels::amx;
using trident_kernels::amx::cpu_has_amx_bf16;
using trident_kernels::amx::kBlockChunkElements;
using trident_kernels::amx::kBlockColumns;
using trident_kernels::amx::kChunk;
using trident_kernels::amx::kTileElements;
using trident_kernels::amx::kTileRows;
using trident_kernels::amx::round_up;
using trident_kernels::amx::SumsAt;

// Rows of one pass over the weights. Larger batches (long prompt chunks) read the weights once a pass.
constexpr int64_t kRowsPerPass = 256;
// The input tiles of one k-span of a pass (all of k = 2,048 at 256 rows), kept in L2 while every
// column block is read once.
constexpr int64_t kSpanInputBytes = int64_t{1} << 20;
// What a pass keeps in L2 (its span's input tiles and a block's weights, with the next
// block's on their way) without evicting the weights before its second row pass reads them.
constexpr int64_t kL2PassBytes = int64_t{1} << 20;
// Chunks of a sub-span: its weights and one row pass's inputs for it stay in L1 while both row
// passes read them.
constexpr int64_t kSubSpanChunks = 8;
// Claims per thread (parallel_for_claimed_ahead): enough to even out the threads' shares.
constexpr int64_t kClaimsPerThread = 16;
// Row tiles (16 rows each) whose input tiles the calling thread packs alone: a decode step's
// inputs (up to 64 rows, at most 1 MB at k = 8,192) are copied from cache in less time than
// waking the other threads into a parallel region and joining them again costs, and on cores
// shared with other processes a region's join waits for every teammate to be scheduled.
constexpr int64_t kRowTilesPackedAlone = 4;

// weight [n, k] bfloat16 -> [ceil(n / 32), ceil(k / 32), 2, 16, 32] bfloat16 (the layout in amx_tiles.h).
at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2, "amx_pack_weight: weight [n, k] bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t blocks = round_up(n, kBlockColumns) / kBlockColumns, chunks = round_up(k, kChunk) / kChunk;
  at::Tensor packed = at::zeros({blocks, chunks, 2, kTileRows, kChunk}, weight.options());
  const at::Tensor w = weight.contiguous();
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block)
      amx::pack_weight_block(src, n, k, block, dst + block * chunks * kBlockChunkElements);
  });
  return packed;
}

#ifdef TRIDENT_AMX
// `rows` rows of x [rows, k], k-chunks first_chunk .. first_chunk + chunks - 1 -> input tiles
// [ceil(rows / 16)][chunks][16][32] (amx_tiles.h).
void pack_input_tiles(const uint16_t* x, int64_t rows, int64_t k, int64_t first_chunk, int64_t chunks,
                      uint16_t* tiles) {
  const int64_t row_tiles = round_up(rows, kTileRows) / kTileRows;
  at::parallel_for(0, row_tiles, kRowTilesPackedAlone, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto row_of = [&](int64_t r) -> const uint16_t* {
        const int64_t row = t * kTileRows + r;
        return row < rows ? x + row * k : nullptr;
      };
      amx::pack_input_tile(row_of, k, first_chunk, chunks, tiles + t * chunks * kTileElements);
    }
  });
}

// The calling thread's buffer for a pass's input tiles, grown when a call needs more and kept
// between calls: pack_input_tiles writes every element, so it needs no zeroing, and a decode
// step's linears would otherwise zero and free a fresh buffer each (up to 1 MB for the down
// projection).
uint16_t* input_tiles_buffer(int64_t elements) {
  thread_local std::vector<uint16_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < elements) buffer.resize(elements);
  return buffer.data();
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

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
  const int64_t span_bytes = span_chunks * kBlockChunkElements * 2;
  const int64_t passes = round_up(rows, 2 * kTileRows) / (2 * kTileRows);
  // Two row passes on a wide input (a decode step's down projection) take the span in
  // sub-spans, each summed for both passes before the next (sums parked in `sums` between them).
  const int64_t span_input_bytes = round_up(rows, kTileRows) * span_chunks * kChunk * 2;
  const bool in_sub_spans = passes == 2 && span_input_bytes + 2 * span_bytes > kL2PassBytes;
  const int64_t sub_chunks = in_sub_spans ? std::min(kSubSpanChunks, span_chunks) : span_chunks;
  const int64_t calls = round_up(span_chunks, sub_chunks) / sub_chunks * passes;
  const int64_t per_claim = std::max<int64_t>(1, blocks / (kClaimsPerThread * at::get_num_threads()));
  trident_kernels::parallel_for_claimed_ahead(blocks, per_claim, [&](int64_t begin, int64_t end, int64_t next_begin) {
    amx::load_tile_config();
    // One [32][32] float32 tile pair a row pass: the block's sums, rounded into `out` at the end.
    alignas(64) float sums[2 * 2 * kTileRows * kBlockColumns];
    for (int64_t block = begin; block < end; ++block) {
      const uint16_t* weights = packed + block * block_elements + first_chunk * kBlockChunkElements;
      const int64_t column0 = block * kBlockColumns, columns = std::min(kBlockColumns, n - column0);
      // The next block's span (the next claim's first at a claim's end) is fetched into L2 while
      // this one is summed, a share per block_sums call: left to the hardware prefetcher, a
      // claim's first block would wait on memory, and a decode step's o and down projections
      // claim two or three blocks at a time.
      const int64_t next_block = block + 1 < end ? block + 1 : next_begin;
      const char* next = next_block < blocks
                             ? reinterpret_cast<const char*>(packed + next_block * block_elements +
                                                             first_chunk * kBlockChunkElements)
                             : nullptr;
      for (int64_t sub0 = 0; sub0 < span_chunks; sub0 += sub_chunks) {
        const int64_t sub_span = std::min(sub_chunks, span_chunks - sub0);
        const bool sub_first = sub0 == 0, sub_last = sub0 + sub_span == span_chunks;
        for (int64_t row0 = 0; row0 < rows; row0 += 2 * kTileRows) {
          const int64_t pass = row0 / (2 * kTileRows);
          const uint16_t* x_a = tiles + (row0 / kTileRows) * row_tile_elements + sub0 * kTileElements;
          const int64_t tile_rows = std::min(2 * kTileRows, rows - row0);
          const SumsAt held{partial + row0 * partial_ld + column0, partial_ld};
          const SumsAt parked{sums + (in_sub_spans ? pass : 0) * 2 * kTileRows * kBlockColumns, kBlockColumns};
          const SumsAt from = sub_first ? (first ? SumsAt{nullptr, 0} : held) : parked;
          const SumsAt to = sub_last && !last ? held : parked;
          const int64_t call = sub0 / sub_chunks * passes + pass;
          const int64_t share_from = call * span_bytes / calls, share_to = (call + 1) * span_bytes / calls;
          const auto* prefetch = next ? reinterpret_cast<const uint16_t*>(next + share_from) : nullptr;
          const int64_t prefetch_bytes = next ? share_to - share_from : 0;
          const uint16_t* sub_weights = weights + sub0 * kBlockChunkElements;
          if (tile_rows > kTileRows) {
            amx::block_sums<true>(x_a, x_a + row_tile_elements, sub_weights, sub_span, from, to, prefetch,
                                  prefetch_bytes);
          } else {
            amx::block_sums<false>(x_a, nullptr, sub_weights, sub_span, from, to, prefetch, prefetch_bytes);
          }
          if (last && sub_last)
            round_block(parked.sums, tile_rows, bias ? bias + column0 : nullptr, columns, out + row0 * n + column0, n);
        }
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
  uint16_t* tiles = input_tiles_buffer(most_rows * span_chunks * kChunk);
  std::vector<float> partial(span_chunks < chunks ? most_rows * packed.size(0) * kBlockColumns : 0);
  for (int64_t row0 = 0; row0 < rows; row0 += kRowsPerPass) {
    const int64_t pass_rows = std::min(kRowsPerPass, rows - row0);
    for (int64_t first_chunk = 0; first_chunk < chunks; first_chunk += span_chunks) {
      const int64_t span = std::min(span_chunks, chunks - first_chunk);
      pack_input_tiles(x_bits + row0 * k, pass_rows, k, first_chunk, span, tiles);
      amx_span(tiles, pass_rows, reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()), chunks,
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
