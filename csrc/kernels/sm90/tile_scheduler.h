// The sm90 forward's persistent tile protocol, in one place: who claims a tile, who is told of it,
// and in what order.
//
// The grid has at most one block per SM (host: `launch_grid`). Block b starts with tile b and
// claims the next ones from a global counter as it finishes tiles (`first`, `next`), which keeps
// the causal longest-first order balanced whatever the tile lengths; a static stride made the
// rate depend on how lengths fell onto blocks (PERFLOG.md, entry 18). Tile indices map to
// (query block, head, batch) in PersistentTileOrder's order (common/tile_order.h), or,
// for a packed batch, over the real tiles that varlen_tiles_kernel lists (FwdTileOrder).
//
// Inside a block, the producer warpgroup's tile thread claims and decodes each tile one ahead of
// the consumers and
//   - hands it, with its key-block range, to the producer's K/V thread (`hand_over` / `take`,
//     through the work_full / work_empty barriers; an end marker, coord.block < 0, ends the K/V
//     thread's loop);
//   - publishes its index to the consumer warpgroups together with Q (FwdMainloop::publish /
//     receive, through q_full; an index past the last tile ends their loop), and the consumers
//     decode it with `order`.
#pragma once

#include <cutlass/arch/barrier.h>

#include <algorithm>

#include "cutlass_flash/params.h"
#include "kernels/common/launch_utils.h"
#include "kernels/common/tile_order.h"
#include "kernels/common/varlen_tiles.h"

namespace cutlass_flash::sm90 {

// A tile as the tile thread hands it to the K/V thread: coordinates and key-block range.
struct TileWork {
  TileCoord coord;
  int n_min, n_max;
};

// The persistent forward's tile order, dense or packed. A packed batch's tiles are its list's
// (sequence, query block) tiles times the heads: without a causal mask heads outer and the list
// inner (a sequence's query blocks in flight together share its K and V, as the dense order's);
// with one, in groups of `group` heads, the list reversed (each sequence's longest query blocks
// first) with the group's heads inner, as the dense causal order within a (head, batch) group.
struct FwdTileOrder {
  PersistentTileOrder dense;
  VarlenTiles list;  // packed batches: list.count != nullptr
  int rows;          // list.size()
  int num_tiles;

  __device__ TileCoord coord(int t) const {
    if (list.count == nullptr) return dense.coord(t);
    if (!dense.longest_first) return list.at(t % rows, t / rows);
    const int first = t / (dense.group * rows) * dense.group;
    const int size = min(dense.group, dense.nheads - first), local = t - first * rows;
    return list.at(rows - 1 - local / size, first + local % size);
  }
};

struct DynamicTileScheduler {
  struct Params {
    int num_m_blocks;   // query blocks per (head, batch)
    int group;          // PersistentTileOrder::group (causal)
    int* counter;       // tiles claimed after each block's first, zeroed before each launch
    VarlenTiles tiles;  // packed batches: the query blocks (tiles.count == nullptr when dense)
  };

  struct SharedStorage {
    cutlass::arch::ClusterBarrier work_full;
    cutlass::arch::ClusterBarrier work_empty;
    TileWork work;
  };

  // Host: fills `sp` (num_m_blocks already set) and `grid` for problem `p`, and zeroes the counter
  // (a caller-owned int, FwdParams::workspace) on `stream`. group > 0 replaces the causal group
  // size (benchmarks/tune_sm90.cu).
  // A packed batch: the list of its query blocks is built on the stream first (kBlockM rows a
  // tile; workspace: varlen_workspace.h) by the launch of `prep` (its padding rows to clear set
  // by the caller), and the list's header holds the counter.
  static Status launch_grid(const AttnProblem& p, void* workspace, int group, int block_m, cudaStream_t stream,
                            Params& sp, int& grid, VarlenTilesArgs prep = {}) {
    int num_sms = 0;
    if (Status s = multiprocessor_count(num_sms); !s.ok()) return s;
    if (p.is_varlen()) {
      sp.tiles = VarlenTiles::at_storage(workspace, p, block_m, /*keys=*/false);
      if (int64_t(sp.tiles.capacity) * p.nheads >= INT_MAX)
        return {Status::kInvalidArgument, "sm90 forward: more than 2^31 tiles in the packed batch"};
      grid = PersistentTileOrder::grid_size(sp.tiles.capacity * p.nheads, num_sms);
      sp.group = group > 0 ? std::min(group, p.nheads) : PersistentTileOrder::group_size(p.nheads);
      sp.counter = sp.tiles.count + 1;
      prep.problem = p;
      prep.lists[0] = sp.tiles;
      prep.num_lists = 1;
      return cuda_status(launch_varlen_tiles(prep, stream), "sm90 forward: packed batch tile list");
    }
    sp.tiles = VarlenTiles{};
    grid = PersistentTileOrder::grid_size(sp.num_m_blocks * p.nheads * p.batch, num_sms);
    sp.group = group > 0 ? std::min(group, p.nheads * p.batch) : PersistentTileOrder::group_size(p.nheads * p.batch);
    sp.counter = static_cast<int*>(workspace);
    return cuda_status(cudaMemsetAsync(sp.counter, 0, sizeof(int), stream), "sm90 forward: zeroing the tile counter");
  }

  // The tile order; a causal mask (a right window bound) takes the longest tiles first.
  __device__ static FwdTileOrder order(const Params& sp, const AttnProblem& p) {
    FwdTileOrder o{
        PersistentTileOrder(sp.num_m_blocks, p.nheads, p.batch, /*longest_first=*/p.window_right >= 0, sp.group),
        sp.tiles, 0, 0};
    o.num_tiles = o.dense.num_tiles;
    if (sp.tiles.count != nullptr) {
      o.rows = sp.tiles.size();
      o.num_tiles = o.rows * p.nheads;
    }
    return o;
  }

  __device__ static void init(SharedStorage& shared) {
    shared.work_full.init(1);
    shared.work_empty.init(1);
  }

  // ---- tile thread ----
  __device__ static int first() { return int(blockIdx.x); }
  __device__ static int next(const Params& sp) { return atomicAdd(sp.counter, 1) + int(gridDim.x); }

  // Hands the i-th tile of this block to the K/V thread once it has taken the previous one.
  __device__ static void hand_over(SharedStorage& shared, int i, const TileWork& w) {
    if (i > 0) shared.work_empty.wait((i - 1) & 1);
    shared.work = w;
    shared.work_full.arrive();
  }

  // ---- K/V thread ----
  __device__ static TileWork take(SharedStorage& shared, int i) {
    shared.work_full.wait(i & 1);
    const TileWork w = shared.work;
    shared.work_empty.arrive();
    return w;
  }
};

}  // namespace cutlass_flash::sm90
