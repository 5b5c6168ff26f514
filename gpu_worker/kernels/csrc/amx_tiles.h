// The AMX-BF16 pieces shared by the kernels that multiply on AMX tiles (amx_linear.cpp,
// fused_moe.cpp): asking Linux for the tile state, the packed weight layout, packing input
// rows into tiles, and the inner loop that sums one block of 32 output columns.
//
// AMX multiplies a 16 x 32 tile of bfloat16 inputs by a 32 x 16 tile of bfloat16 weights into a
// 16 x 16 tile of float32 sums (TDPBF16PS).
//
// Packed weight layout: the weight's output columns in blocks of 32 (two tiles of 16 columns),
// each block's k in chunks of 32, each chunk two 1 KB tiles of 16 k-pairs x 16 columns x a pair:
// tile[p][2 c + j] = w[column c][k0 + 2 p + j], the layout TDPBF16PS reads its second source in.
// k and n are zero-padded to multiples of 32; a padded k multiplies zeros and adds exact zeros.
// A k-pair's row of a tile is also the 64 bytes one AVX512-BF16 vdpbf16ps reads for 16
// columns, so kernels without AMX can read the same packed weights.
//
// Input tiles: 16 rows of a chunk's 32 k, contiguous (1 KB), a row tile's chunks one after the
// other. Read in place, a tile's 16 rows lie k * 2 bytes apart, a stride that maps them onto a
// few L1 sets (4 KB apart at k = 2,048), and every chunk's loads miss.
//
// Batch invariance: block_sums sums an output over k-chunks 0, 1, 2, ... on one accumulator
// tile, whatever the number of rows or the row's position in its tile; TDPBF16PS computes each
// element of the tile from its own row and column only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

// AMX intrinsics arrived in GCC 11.
#if defined(__x86_64__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TRIDENT_AMX 1
#endif

namespace trident_kernels::amx {

constexpr int64_t kTileRows = 16;      // rows of an input tile and of an accumulator tile
constexpr int64_t kTileColumns = 16;   // float32 columns of an accumulator tile
constexpr int64_t kChunk = 32;         // k of one TDPBF16PS (16 pairs)
constexpr int64_t kBlockColumns = 32;  // output columns a packed block holds (two weight tiles)
constexpr int64_t kTileElements = kTileRows * kChunk;  // bfloat16 elements of an input or weight tile
constexpr int64_t kBlockChunkElements = 2 * kTileElements;

inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

#ifdef TRIDENT_AMX
// Linux hands a process AMX's 8 KB of tile state only on request (arch_prctl).
constexpr int kArchRequestXcompPerm = 0x1023;
constexpr int kXfeatureTileData = 18;

inline bool request_amx_permission() {
  static const bool granted = syscall(SYS_arch_prctl, kArchRequestXcompPerm, kXfeatureTileData) == 0;
  return granted;
}
#endif

inline bool cpu_has_amx_bf16() {
#ifdef TRIDENT_AMX
  return __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile") && request_amx_permission();
#else
  return false;
#endif
}

// Column block `block` of a weight [n, k] (row-major bfloat16 bits) into its packed place
// `dst` (chunks * kBlockChunkElements elements, zeroed by the caller).
inline void pack_weight_block(const uint16_t* src, int64_t n, int64_t k, int64_t block, uint16_t* dst) {
  const int64_t columns = std::min(kBlockColumns, n - block * kBlockColumns);
  for (int64_t c = 0; c < columns; ++c) {
    const uint16_t* row = src + (block * kBlockColumns + c) * k;
    const int64_t tile = c / kTileColumns, column = c % kTileColumns;
    for (int64_t kk = 0; kk < k; ++kk) {
      const int64_t chunk = kk / kChunk, pair = (kk % kChunk) / 2, half = kk % 2;
      dst[(chunk * 2 + tile) * kTileElements + pair * kChunk + 2 * column + half] = row[kk];
    }
  }
}

// One row tile: row_of(r) for r in 0..15 gives that row's k bfloat16 values, or nullptr for a
// padding row (zeros); its k-chunks first_chunk .. first_chunk + chunks - 1 are copied into
// `chunks` input tiles from `tiles`; k past `k` is zeros.
template <typename RowOf>
void pack_input_tile(const RowOf& row_of, int64_t k, int64_t first_chunk, int64_t chunks, uint16_t* tiles) {
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    uint16_t* tile = tiles + chunk * kTileElements;
    const int64_t k0 = (first_chunk + chunk) * kChunk, width = std::min(kChunk, k - k0);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const uint16_t* row = row_of(r);
      uint16_t* dst = tile + r * kChunk;
      if (row != nullptr) {
        std::memcpy(dst, row + k0, width * 2);
        std::fill(dst + width, dst + kChunk, 0);
      } else {
        std::fill(dst, dst + kChunk, 0);
      }
    }
  }
}

#ifdef TRIDENT_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

// The palette every tile of these kernels uses: 16 rows of 64 bytes.
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

// Loads TileConfig on the calling thread. The configuration is a static: GCC's
// _tile_loadconfig declares an 8-byte read, so the stores of a configuration built on the
// stack just before it may be dropped.
inline void load_tile_config() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

// Where a block's float32 sums [32 rows][32 columns] are, `ld` floats a row.
struct SumsAt {
  float* sums;
  int64_t ld;
};

// Tiles: 0-3 accumulators (rows a/b x columns 0-15/16-31), 4-5 inputs (rows a, b), 6-7 weights
// (columns 0-15, 16-31). Adds `chunks` k-chunks of one 32-column block for 16 or 32 rows to the
// sums `from` (zeros when its pointer is null) and stores them to `to`; a kernel that splits k
// into spans parks the sums in memory between spans, and they come back with the same bits.
// x_a / x_b: the first input tile of each 16 rows (packed by pack_input_tile: a tile a chunk,
// 1 KB apart). The caller calls load_tile_config first.
// `prefetch_bytes` bytes from `prefetch` (the weights a later call reads) are requested into L2,
// spread over the chunks: the hardware prefetcher stops at each 4 KB page, and while a block's
// later rows reread its weights from L2 nothing else would keep memory busy. Prefetches change
// no sums.
template <bool kTwoRowTiles>
void block_sums(const uint16_t* x_a, const uint16_t* x_b, const uint16_t* block, int64_t chunks, SumsAt from,
                SumsAt to, const uint16_t* prefetch = nullptr, int64_t prefetch_bytes = 0) {
  const char* prefetch_bytes_at = reinterpret_cast<const char*>(prefetch);
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
    for (int64_t offset = chunk * prefetch_bytes / chunks / 64 * 64; offset < (chunk + 1) * prefetch_bytes / chunks;
         offset += 64)
      _mm_prefetch(prefetch_bytes_at + offset, _MM_HINT_T1);
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

// All of k in one go, from zeros, into `sums` [32][32] float32.
template <bool kTwoRowTiles>
void block_sums(const uint16_t* x_a, const uint16_t* x_b, const uint16_t* block, int64_t chunks, float* sums) {
  block_sums<kTwoRowTiles>(x_a, x_b, block, chunks, SumsAt{nullptr, 0}, SumsAt{sums, kBlockColumns});
}

#pragma GCC pop_options
#endif

}  // namespace trident_kernels::amx
