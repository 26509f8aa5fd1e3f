// Maps thread blocks to (tile, head, batch) work items (arch-neutral).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace cutlass_flash {

struct TileCoord {
  int block;  // query block (forward) or key block (backward)
  int head;
  int batch;
};

// One thread block per tile, tiles fastest. With a causal mask the tile with the highest index has
// the most work; the hardware starts blocks in launch order, so issuing those first shortens the
// tail where a few long blocks run alone on an otherwise idle GPU.
struct GridTileScheduler {
  static dim3 grid(int num_blocks, int nheads, int batch) { return dim3(num_blocks, nheads, batch); }

  __device__ static TileCoord get(bool longest_first) {
    const int b = longest_first ? int(gridDim.x) - 1 - int(blockIdx.x) : int(blockIdx.x);
    return {b, int(blockIdx.y), int(blockIdx.z)};
  }
};

// A persistent grid (one block per SM) walking the tiles in rounds of gridDim.x tiles: in round r
// block b takes tile r * gridDim.x + b. Every warp of a block computes the same sequence, so the
// producer and the consumers need no communication to agree on the next tile.
//
// Without a causal mask every tile costs the same, and query blocks are the fastest index, so the
// blocks running at one time share a head's K and V in L2 (at 8k tokens and d = 128, 132 blocks
// span about two heads: 8 MiB of K/V against 60 MiB of L2).
//
// With a causal mask (`longest_first`) query block m costs m + 1 key blocks. Tiles then go in
// order of decreasing m with heads and batches inner, so the short tiles fill the tail, within
// groups of `group` (head, batch) pairs whose K and V fit in about half the L2: with every head
// inner, the 132 blocks of a round all read different heads (at 2k tokens and d = 128: 128
// heads, 128 MiB of K/V against 60 MiB of L2) and K/V came from DRAM at every tile (PERFLOG.md,
// entry 14). Odd rounds are walked backwards (block b takes the round's tile gridDim.x - 1 - b):
// a block that got one of the longest tiles of a round gets one of the shortest of the next. A
// plain stride gave block b the same m again and again whenever gridDim.x is close to a multiple
// of the number of query blocks: 132 = 22 x 6 at 1k tokens and d = 64, 132 = 128 + 4 at 16k and
// d = 128, measured at 46% and 70% of the non-causal rate (PERFLOG.md, entry 8).
struct PersistentTileScheduler {
  int num_blocks;  // query blocks per (head, batch)
  int nheads;
  int num_tiles;
  bool longest_first;
  int group;  // (head, batch) pairs per group when longest_first

  __host__ __device__ PersistentTileScheduler(int num_blocks_, int nheads_, int batch, bool longest_first_,
                                              int group_ = 1)
      : num_blocks(num_blocks_), nheads(nheads_), num_tiles(num_blocks_ * nheads_ * batch),
        longest_first(longest_first_), group(group_) {}

  // Pairs whose K and V (kv_bytes each) fit in `budget_bytes`, but enough for 4 rounds of `grid`
  // tiles: the odd-round reversal balances blocks only while a round and the next stay in one
  // group (one head per group at d = 256 and 16k tokens ran at 475 TFLOPS against 717 with all
  // heads inner).
  static int group_size(int64_t budget_bytes, int64_t kv_bytes, int head_batch_count, int num_blocks, int grid) {
    int64_t g = kv_bytes > 0 ? budget_bytes / kv_bytes : head_batch_count;
    const int64_t min_g = (4 * int64_t(grid) + num_blocks - 1) / num_blocks;
    if (g < min_g) g = min_g;
    return g < 1 ? 1 : g > head_batch_count ? head_batch_count : int(g);
  }

  static int grid_size(int num_tiles, int num_sms) { return num_tiles < num_sms ? num_tiles : num_sms; }

  // The tile this block takes in round `round` (>= num_tiles: the block is done).
  __device__ int tile(int round) const {
    const int g = int(gridDim.x), b = int(blockIdx.x);
    return round * g + (longest_first && (round & 1) ? g - 1 - b : b);
  }
  __device__ bool valid(int tile) const { return tile < num_tiles; }

  __host__ __device__ TileCoord coord(int tile) const {
    if (longest_first) {
      const int head_batch_count = num_tiles / num_blocks;
      const int g = tile / (group * num_blocks), first = g * group;
      const int size = head_batch_count - first < group ? head_batch_count - first : group;
      const int t = tile - first * num_blocks;  // index inside the group: m outer, pairs inner
      const int hb = first + t % size;
      return {num_blocks - 1 - t / size, hb % nheads, hb / nheads};
    }
    const int hb = tile / num_blocks;
    return {tile % num_blocks, hb % nheads, hb / nheads};
  }
};

}  // namespace cutlass_flash
