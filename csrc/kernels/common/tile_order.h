// Maps thread blocks to (tile, head, batch) work items (arch-neutral).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cutlass_flash/params.h"
#include "kernels/common/varlen_workspace.h"

namespace cutlass_flash {

struct TileCoord {
  int block;  // query block (forward) or key block (backward)
  int head;
  int batch;
};

// The (sequence, block) tiles of one side of a packed batch (query rows or key rows) at one block
// size, in sequence order with blocks ascending; built on the GPU by varlen_tiles_kernel
// (common/varlen_tiles.h) into the workspace (common/varlen_workspace.h).
struct VarlenTiles {
  int2* tiles = nullptr;  // {sequence, block}
  // count[0]: tiles written (at most capacity); count[1]: the forward's tile counter; count[2]:
  // whether a list of the launch was cut at its capacity (bad cu_seqlens: overlapping sequences).
  int* count = nullptr;
  int capacity = 0;
  int block = 0;      // rows per tile
  bool keys = false;  // tiles of key rows (cu_seqlens_k), else of query rows

  // Host: the list of `block`-row tiles at `storage` (16-byte aligned, varlen_list_bytes with a
  // block no larger).
  static VarlenTiles at_storage(void* storage, const AttnProblem& p, int block, bool keys) {
    VarlenTiles t;
    t.count = static_cast<int*>(storage);
    t.tiles = reinterpret_cast<int2*>(static_cast<char*>(storage) + kVarlenListHeaderBytes);
    t.block = block;
    t.keys = keys;
    t.capacity = int(varlen_tile_capacity(keys ? p.total_k : p.total_q, p.batch, block));
    return t;
  }

#if defined(__CUDACC__)
  __device__ int size() const { return *count; }

  // A cut list drops some sequences' last tiles; the deterministic backward's dQ turns then count
  // blocks that never run, so it adds dQ unordered instead of waiting for them (no hang).
  __device__ bool truncated() const { return count[2] != 0; }

  // Tile r (r < size()) as (block, head, sequence).
  __device__ TileCoord at(int r, int head) const {
    const int2 t = tiles[r];
    return {t.y, head, t.x};
  }

  // Grids over parts of `rows` rows of the tiles (rows dividing block; the backward's row
  // kernels): part x as (sequence, block of `rows` rows); false past the list.
  __device__ bool part(int x, int rows, int& batch, int& row_block) const {
    const int parts = block / rows, r = x / parts;
    if (r >= size()) return false;
    const int2 t = tiles[r];
    batch = t.x;
    row_block = t.y * parts + x % parts;
    return true;
  }
#endif
};

// The tile order of a persistent grid (one block per SM): tile index -> (query block, head,
// batch). Blocks take indices in increasing order as they finish tiles (the sm90 kernel hands
// them out through a global counter, sm90/tile_scheduler.h), so the tiles in flight at any time are a
// window of about gridDim.x consecutive indices.
//
// Without a causal mask every tile costs the same, and query blocks are the fastest index, so the
// blocks running at one time share a head's K and V in L2 (at 8k tokens and d = 128, 132 blocks
// span about two heads: 8 MiB of K/V against 60 MiB of L2).
//
// With a causal mask (`longest_first`) query block m costs m + 1 key blocks. Tiles then go in
// order of decreasing m with heads and batches inner, so the short tiles fill the tail, within
// groups of `group` (head, batch) pairs. With every pair inner, the blocks in flight all read
// different heads (at 2k tokens and d = 128: 128 heads, 128 MiB of K/V against 60 MiB of L2) and
// K/V came from DRAM (PERFLOG.md, entry 14); with one to four pairs, a hundred blocks read the
// same K/V blocks at the same moment. kCausalGroup pairs measured within 3% of the best group
// size at d = 128 and 256, 1k to 16k tokens, where group sizes fitted to a quarter of the L2
// lost up to 16% and all pairs 18% (PERFLOG.md, entry 18).
struct PersistentTileOrder {
  int num_blocks;  // query blocks per (head, batch)
  int nheads;
  int num_tiles;
  bool longest_first;
  int group;  // (head, batch) pairs per group when longest_first

  __host__ __device__ PersistentTileOrder(int num_blocks_, int nheads_, int batch, bool longest_first_, int group_ = 1)
      : num_blocks(num_blocks_),
        nheads(nheads_),
        num_tiles(num_blocks_ * nheads_ * batch),
        longest_first(longest_first_),
        group(group_) {}

  static constexpr int kCausalGroup = 16;

  // The group for `head_batch_count` pairs: kCausalGroup, or all of them when fewer.
  __host__ __device__ static int group_size(int head_batch_count) {
    return head_batch_count < kCausalGroup ? head_batch_count : kCausalGroup;
  }

  static int grid_size(int num_tiles, int num_sms) { return num_tiles < num_sms ? num_tiles : num_sms; }

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

// One thread block per tile, tiles fastest. With a causal mask the tile with the highest index has
// the most work; the hardware starts blocks in launch order, so issuing those first shortens the
// tail where a few long blocks run alone on an otherwise idle GPU. A dense grid takes the
// persistent grid's order for it (PersistentTileOrder::coord: query blocks descending, groups
// of kCausalGroup (head, batch) pairs inner), so the last wave is the last group's short blocks;
// with each pair's blocks in turn, the last pair's longest block started a few blocks before the
// end and ran alone.
//
// A packed batch launches its list's capacity of blocks per head (grid.y) instead of the longest
// sequence's blocks for every sequence: block x takes the list's tile x (size() - 1 - x when
// longest first: each sequence's later blocks first, the sequences in reverse order), and the
// blocks past the list's size get block = -1 and end. Within a (sequence, head) blocks still
// start in the order of their block index, which the deterministic dQ protocol relies on
// (common/dq_semaphore.h).
//
// kPackable = false compiles the packed path out (DenseGridTileMap), and the backward kernels
// of both families take their packed-only work from it too: with that path in the one kernel, the
// sm80 backward at 255 registers spilled 48-64 B at d = 64 (0 B without) and the sm90 dense
// backward ran 2-6% slower (A/B on an H200, PERFLOG 91), so dense calls run kernels without it.
struct GridTileParams {
  VarlenTiles tiles;  // packed batches (tiles.count != nullptr)
};

template <bool kPackable_>
struct GridTileMapT {
  static constexpr bool kPackable = kPackable_;
  using Params = GridTileParams;

  static bool packed(const Params& sp) { return kPackable && sp.tiles.count != nullptr; }

  static dim3 grid(const Params& sp, int num_blocks, int nheads, int batch) {
    if (packed(sp)) return dim3(unsigned(sp.tiles.capacity), nheads, 1);
    return dim3(num_blocks, nheads, batch);
  }

#if defined(__CUDACC__)
  // ascending (a dense grid, not longest_first): PersistentTileOrder's groups with the block order
  // reversed, blocks ascending outer and the group's (head, batch) pairs inner.
  __device__ static TileCoord get(const Params& sp, bool longest_first, bool ascending = false) {
    if (kPackable && sp.tiles.count != nullptr) {
      const int n = sp.tiles.size(), x = int(blockIdx.x);
      if (x >= n) return {-1, int(blockIdx.y), 0};
      return sp.tiles.at(longest_first ? n - 1 - x : x, int(blockIdx.y));
    }
    return dense(int(blockIdx.x), int(blockIdx.y), int(blockIdx.z), longest_first, ascending);
  }

  // A dense grid's block (x, y, z): the tile (x, y, z), or in PersistentTileOrder's causal order,
  // or that order's groups with blocks ascending.
  __device__ static TileCoord dense(int x, int y, int z, bool longest_first, bool ascending = false) {
    if (!longest_first && !ascending) return {x, y, z};
    const int pairs = int(gridDim.y * gridDim.z);
    const PersistentTileOrder order(int(gridDim.x), int(gridDim.y), int(gridDim.z), true,
                                    PersistentTileOrder::group_size(pairs));
    TileCoord t = order.coord(x + int(gridDim.x) * (y + int(gridDim.y) * z));
    if (!longest_first) t.block = int(gridDim.x) - 1 - t.block;
    return t;
  }

  // The same tile, read again where it is called: the compiler cannot prove it equal to get()'s,
  // so the addresses a kernel derives from it inside a loop are computed there instead of being
  // held in registers (or spilled) across the loop's body.
  __device__ static TileCoord get_here(const Params& sp, bool longest_first) {
    int x, y, z;
    asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x));
    asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y));
    asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
    if (kPackable && sp.tiles.count != nullptr) {
      // Volatile too: plain loads would be hoisted out of the caller's loop.
      int n, t0, t1;
      asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(n) : "l"(sp.tiles.count));
      asm volatile("ld.global.nc.v2.b32 {%0, %1}, [%2];"
                   : "=r"(t0), "=r"(t1)
                   : "l"(sp.tiles.tiles + (longest_first ? n - 1 - x : x)));
      return {t1, y, t0};
    }
    return dense(x, y, z, longest_first);
  }
#endif
};
using GridTileMap = GridTileMapT</*kPackable=*/true>;
using DenseGridTileMap = GridTileMapT</*kPackable=*/false>;

}  // namespace cutlass_flash
