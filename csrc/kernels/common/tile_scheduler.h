// Maps thread blocks to (tile, head, batch) work items (arch-neutral).
#pragma once

#include <cuda_runtime_api.h>

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
// order of decreasing m (heads and batches inner), so the short tiles fill the tail, and odd
// rounds are walked backwards (block b takes the round's tile gridDim.x - 1 - b): a block that got
// one of the longest tiles of a round gets one of the shortest of the next. A plain stride gave
// block b the same m again and again whenever gridDim.x is close to a multiple of the number of
// query blocks: 132 = 22 x 6 at 1k tokens and d = 64, 132 = 128 + 4 at 16k and d = 128, measured
// at 46% and 70% of the non-causal rate (PERFLOG.md).
struct PersistentTileScheduler {
  int num_blocks;  // query blocks per (head, batch)
  int nheads;
  int num_tiles;
  bool longest_first;

  __host__ __device__ PersistentTileScheduler(int num_blocks_, int nheads_, int batch, bool longest_first_)
      : num_blocks(num_blocks_), nheads(nheads_), num_tiles(num_blocks_ * nheads_ * batch),
        longest_first(longest_first_) {}

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
      const int hb = tile % head_batch_count;
      return {num_blocks - 1 - tile / head_batch_count, hb % nheads, hb / nheads};
    }
    const int hb = tile / num_blocks;
    return {tile % num_blocks, hb % nheads, hb / nheads};
  }
};

}  // namespace cutlass_flash
