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

// A persistent grid (one block per SM) walking the tiles with a static stride: block b takes
// tiles b, b + gridDim.x, ... Every warp of a block computes the same sequence, so the producer
// and the consumers need no communication to agree on the next tile. Query blocks are the
// fastest index, so the blocks running at one time share a head's K and V in L2 (at 8k tokens
// and d = 128, 132 blocks span about two heads: 8 MiB of K/V against 60 MiB of L2). With
// `longest_first` (causal) each head's query blocks are taken from the last, which sees the most
// keys, to the first, so the short tiles fill the tail.
struct PersistentTileScheduler {
  int num_blocks;  // query blocks per (head, batch)
  int nheads;
  int num_tiles;
  bool longest_first;

  __host__ __device__ PersistentTileScheduler(int num_blocks_, int nheads_, int batch, bool longest_first_)
      : num_blocks(num_blocks_), nheads(nheads_), num_tiles(num_blocks_ * nheads_ * batch),
        longest_first(longest_first_) {}

  static int grid_size(int num_tiles, int num_sms) { return num_tiles < num_sms ? num_tiles : num_sms; }

  __device__ int first() const { return int(blockIdx.x); }
  __device__ int next(int tile) const { return tile + int(gridDim.x); }
  __device__ bool valid(int tile) const { return tile < num_tiles; }

  __host__ __device__ TileCoord coord(int tile) const {
    const int b = tile % num_blocks, head_batch = tile / num_blocks;
    return {longest_first ? num_blocks - 1 - b : b, head_batch % nheads, head_batch / nheads};
  }
};

}  // namespace cutlass_flash
