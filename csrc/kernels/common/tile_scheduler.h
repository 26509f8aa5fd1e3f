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

}  // namespace cutlass_flash
