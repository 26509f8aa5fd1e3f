// The tiles of a packed (variable-length) batch, found on the GPU (arch-neutral).
//
// A grid sized by the longest sequence gives every sequence max_seqlen's tiles: with one 32k
// document and 2000 of 64 tokens, 99.6% of the forward's (sequence, head, block) tiles were empty,
// and skipping them still cost a claim or a block launch each (the packed forward ran at 0.17x
// FlashAttention-3's). Instead a one-block kernel (`varlen_tiles_kernel`) scans cu_seqlens once
// per call and writes the real (sequence, block) tiles of one side (query rows or key rows) at one
// block size into the workspace: in sequence order, blocks ascending, then the padding rows after
// the last sequence as a sequence of their own (index batch, SeqInfo), so that their outputs are
// written too. No host synchronisation: the host sizes the list by a bound (`capacity`), and
// grids launched with that bound end the blocks past the list's count.
//
// Every kernel reads a tile through VarlenTiles::at (common/tile_scheduler.h): one load, where a
// search over the sequences' prefix sums would cost a dependent load per level.
#pragma once

#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "cutlass_flash/params.h"
#include "kernels/common/block_info.h"
#include "kernels/common/tile_scheduler.h"
#include "kernels/common/varlen_workspace.h"

namespace cutlass_flash {

// The arguments of one varlen_tiles_kernel launch: up to two lists (a backward needs the query
// rows' and the key blocks'); each list's header is zeroed (the forward's tile counter with it).
struct VarlenTilesArgs {
  static constexpr int kMaxLists = 2;
  AttnProblem problem;
  VarlenTiles lists[kMaxLists];
  int num_lists = 0;
};

// One block: per list, the sequences' tile counts in chunks of kThreads, an exclusive scan over
// each chunk carried across chunks, and each warp writing its 32 sequences' tiles with all lanes
// (a long sequence's tiles written by one thread took ~2048 dependent stores at 128k tokens).
// (A template, so that every translation unit that includes it may define it.)
constexpr int kVarlenTilesThreads = 1024;

template <int kThreads>
__global__ void __launch_bounds__(kThreads) varlen_tiles_kernel(const __grid_constant__ VarlenTilesArgs args) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const AttnProblem& p = args.problem;
  const int tid = threadIdx.x, lane = tid % 32;
  for (int l = 0; l < args.num_lists; ++l) {
    const VarlenTiles& list = args.lists[l];
    int carry = 0;  // tiles of the earlier chunks, at most list.capacity
    for (int base = 0; base <= p.batch; base += kThreads) {
      const int b = base + tid;
      int n = 0;
      if (b <= p.batch) {
        const SeqInfo seq(p, b);
        n = ((list.keys ? seq.seqlen_k : seq.seqlen_q) + list.block - 1) / list.block;
      }
      int first = 0, chunk_total = 0;
      Scan(scan_storage).ExclusiveSum(n, first, chunk_total);
      first += carry;
      // Sequence (warp base + j) writes tiles [first_j, first_j + n_j), all lanes at once.
      for (int j = 0; j < 32; ++j) {
        const int fj = __shfl_sync(0xffffffff, first, j), nj = __shfl_sync(0xffffffff, n, j);
        const int bj = b - lane + j;
        for (int i = lane; i < nj && fj + i < list.capacity; i += 32) list.tiles[fj + i] = make_int2(bj, i);
      }
      carry = int(min(int64_t(carry) + chunk_total, int64_t(list.capacity)));
      __syncthreads();  // scan_storage is reused by the next chunk
    }
    if (tid == 0) {
      list.count[0] = carry;
      list.count[1] = 0;
    }
  }
}

// Host: launches the kernel for `args` on `stream` (capacities checked against int32 indices).
inline cudaError_t launch_varlen_tiles(const VarlenTilesArgs& args, cudaStream_t stream) {
  varlen_tiles_kernel<kVarlenTilesThreads><<<1, kVarlenTilesThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace cutlass_flash
