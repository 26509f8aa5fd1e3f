// The tiles of a packed (variable-length) batch, found on the GPU (arch-neutral).
//
// A grid sized by the longest sequence gives every sequence max_seqlen's tiles: with one 32k
// document and 2000 of 64 tokens, 99.6% of the forward's (sequence, head, block) tiles were empty,
// and skipping them still cost a claim or a block launch each (the packed forward ran at 0.17x
// FlashAttention-3's). Instead one block of `varlen_tiles_kernel` scans cu_seqlens once per call
// and writes the real (sequence, block) tiles of one side (query rows or key rows) at one block
// size into the workspace, in sequence order with blocks ascending. No host synchronisation: the
// host sizes the list by a bound (`capacity`), and grids launched with that bound end the blocks
// past the list's count.
//
// Every kernel reads a tile through VarlenTiles::at (common/tile_order.h): one load, where a
// search over the sequences' prefix sums would cost a dependent load per level.
#pragma once

#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstddef>
#include <cstdint>

#include "cutlass_flash/params.h"
#include "generated/bwd_workspace.h"
#include "kernels/common/block_info.h"
#include "kernels/common/launch_utils.h"
#include "kernels/common/tile_order.h"
#include "kernels/common/varlen_workspace.h"

namespace cutlass_flash {

// One launch prepares a packed batch's call: block 0 builds up to two tile lists (a backward needs
// the query rows' and the key blocks'; each list's header is zeroed, the forward's tile counter
// with it), and the other blocks write the rows that belong to no sequence (after the last one,
// cu_seqlens[batch] to the tensor's end: the padding of a static buffer; and a slot's rows past
// its seqused length), which no tile covers, of up to three 16-bit outputs as zeros and of the
// LSE as +inf, as the dense op gives rows that see no key.
struct VarlenTilesArgs {
  static constexpr int kMaxLists = 2, kMaxClears = 3;
  // A (rows, heads, head_dim) output of 16-bit elements whose padding rows are zeroed.
  struct Clear {
    void* ptr;
    int64_t row_stride, head_stride;  // elements
    int heads;
    bool keys;  // rows of the key side (dk, dv), else of the query side (out, dq)
  };
  AttnProblem problem;
  VarlenTiles lists[kMaxLists];
  int num_lists = 0;
  Clear clears[kMaxClears];
  int num_clears = 0;
  float* lse = nullptr;  // (nheads, total_q), or null
};

constexpr int kVarlenTilesThreads = 1024;
// Blocks that write the padding rows (grid-stride): 1-2 waves of stores, and only a block's start
// when there is none.
constexpr int kVarlenClearBlocks = 64;

// Block 0: per list, the sequences' tile counts in chunks of kThreads, an exclusive scan over each
// chunk carried across chunks, and each warp writing its 32 sequences' tiles with all lanes (a
// long sequence's tiles written by one thread took ~2048 dependent stores at 128k tokens).
template <int kThreads>
__device__ void build_tile_lists(const VarlenTilesArgs& args) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const AttnProblem& p = args.problem;
  const int tid = threadIdx.x, lane = tid % 32;
  bool cut = false;  // thread 0: a list was cut at its capacity
  for (int l = 0; l < args.num_lists; ++l) {
    const VarlenTiles& list = args.lists[l];
    int carry = 0;       // tiles of the earlier chunks, at most list.capacity
    int64_t wanted = 0;  // tiles of every sequence: above the capacity only for bad cu_seqlens
    for (int base = 0; base < p.batch; base += kThreads) {
      const int b = base + tid;
      int n = 0;
      if (b < p.batch) {
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
      wanted += chunk_total;
      carry = int(min(int64_t(carry) + chunk_total, int64_t(list.capacity)));
      __syncthreads();  // scan_storage is reused by the next chunk
    }
    if (tid == 0) {
      list.count[0] = carry;
      list.count[1] = 0;
      cut = cut || wanted > list.capacity;
    }
  }
  // Every list of the launch carries whether any was cut (VarlenTiles::truncated).
  if (tid == 0)
    for (int l = 0; l < args.num_lists; ++l) args.lists[l].count[2] = cut;
}

// Rows [first, first + rows) of every head of `t` zeroed, 16 bytes a store, by the threads
// start, start + stride, ... (over (row, head, chunk)).
__device__ inline void zero_rows(const VarlenTilesArgs::Clear& t, int first, int rows, int head_dim, int64_t start,
                                 int64_t stride) {
  const int chunks = head_dim / 8;
  const int64_t per_row = int64_t(t.heads) * chunks;
  for (int64_t i = start; i < int64_t(rows) * per_row; i += stride) {
    const int64_t row = i / per_row, rest = i % per_row;
    const int64_t offset = (first + row) * t.row_stride + rest / chunks * t.head_stride + rest % chunks * 8;
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(t.ptr) + offset) = make_uint4(0, 0, 0, 0);
  }
}

// LSE rows [first, first + rows) of every head set to +inf, by the threads start, start + stride, ...
__device__ inline void lse_inf_rows(const VarlenTilesArgs& args, int first, int rows, int64_t start, int64_t stride) {
  const AttnProblem& p = args.problem;
  for (int64_t i = start; i < int64_t(rows) * p.nheads; i += stride)
    args.lse[i / rows * p.total_q + first + i % rows] = INFINITY;
}

// Blocks 1..: the rows that belong to no sequence. Those after the last sequence, block-strided
// over (output, row, head, chunk); with seqused_q / seqused_k also each slot's unused end,
// [first row + used length, cu_seqlens[b + 1]) (SeqInfo's clamps: no access past a tensor), one
// block a sequence with the sequences strided over the blocks (no search for a row's sequence).
__device__ inline void clear_padding_rows(const VarlenTilesArgs& args) {
  const AttnProblem& p = args.problem;
  const int head_dim = p.cols();  // the tensors' own columns
  const int q_first = min(max(p.cu_seqlens_q[p.batch], 0), p.total_q);
  const int k_first = min(max(p.cu_seqlens_k[p.batch], 0), p.total_k);
  const int64_t stride = int64_t(gridDim.x - 1) * blockDim.x,
                start = int64_t(blockIdx.x - 1) * blockDim.x + threadIdx.x;
  for (int c = 0; c < args.num_clears; ++c) {
    const VarlenTilesArgs::Clear& t = args.clears[c];
    const int first = t.keys ? k_first : q_first;
    zero_rows(t, first, (t.keys ? p.total_k : p.total_q) - first, head_dim, start, stride);
  }
  if (args.lse != nullptr) lse_inf_rows(args, q_first, p.total_q - q_first, start, stride);
  if (p.seqused_q == nullptr && p.seqused_k == nullptr) return;
  for (int b = blockIdx.x - 1; b < p.batch; b += gridDim.x - 1) {
    const SeqInfo seq(p, b);
    const int q_used = seq.q_start + seq.seqlen_q, k_used = seq.k_start + seq.seqlen_k;
    // The slot's end clamped as its start; none when it lies before the used rows' end (bad content).
    const int q_gap = p.seqused_q ? max(min(max(p.cu_seqlens_q[b + 1], 0), p.total_q) - q_used, 0) : 0;
    const int k_gap = p.seqused_k ? max(min(max(p.cu_seqlens_k[b + 1], 0), p.total_k) - k_used, 0) : 0;
    for (int c = 0; c < args.num_clears; ++c) {
      const VarlenTilesArgs::Clear& t = args.clears[c];
      zero_rows(t, t.keys ? k_used : q_used, t.keys ? k_gap : q_gap, head_dim, threadIdx.x, blockDim.x);
    }
    if (args.lse != nullptr) lse_inf_rows(args, q_used, q_gap, threadIdx.x, blockDim.x);
  }
}

// (A template, so that every translation unit that includes it may define it.)
template <int kThreads>
__global__ void __launch_bounds__(kThreads) varlen_tiles_kernel(const __grid_constant__ VarlenTilesArgs args) {
  if (blockIdx.x == 0)
    build_tile_lists<kThreads>(args);
  else
    clear_padding_rows(args);
}

// Host: `t`'s padding rows to be zeroed by the launch of `args`.
inline void add_padding_clear(VarlenTilesArgs& args, const TensorRef4& t, int heads, bool keys) {
  args.clears[args.num_clears++] = {t.ptr, t.row_stride, t.head_stride, heads, keys};
}

// Host: launches the kernel for `args` on `stream`.
inline cudaError_t launch_varlen_tiles(const VarlenTilesArgs& args, cudaStream_t stream) {
  const int blocks = 1 + (args.num_clears > 0 || args.lse != nullptr ? kVarlenClearBlocks : 0);
  varlen_tiles_kernel<kVarlenTilesThreads><<<blocks, kVarlenTilesThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

// Host: a packed forward's launch arguments, its rows outside every sequence of out (0) and lse
// (+inf) set; the caller adds its list of query blocks.
inline VarlenTilesArgs fwd_varlen_args(const FwdParams& params) {
  VarlenTilesArgs args;
  args.problem = params.problem;
  add_padding_clear(args, params.o, params.problem.nheads, /*keys=*/false);
  args.lse = params.lse;
  return args;
}

// Host: a packed backward's preparation, launched on `stream` (both families): the query rows in
// kBwdRowAlign tiles (`rows`: preprocess, dQ conversion) and the key blocks of block_n rows
// (`keys`: the main kernel), after the family's BwdWorkspace arrays (varlen_workspace.h), and the
// rows outside every sequence of dq, dk and dv zeroed. `what` names the family in errors.
inline Status launch_bwd_varlen_prep(const BwdParams& params, int arch, int block_n, cudaStream_t stream,
                                     VarlenTiles& rows, VarlenTiles& keys, const char* what) {
  const AttnProblem& p = params.problem;
  char* lists = static_cast<char*>(params.workspace) + bwd_workspace_layout(p, params.deterministic, arch).total_bytes;
  rows = VarlenTiles::at_storage(lists, p, kBwdRowAlign, /*keys=*/false);
  keys = VarlenTiles::at_storage(lists + bwd_varlen_q_bytes(p), p, block_n, /*keys=*/true);
  VarlenTilesArgs args;
  args.problem = p;
  args.lists[0] = rows;
  args.lists[1] = keys;
  args.num_lists = 2;
  add_padding_clear(args, params.dq, p.nheads, /*keys=*/false);
  add_padding_clear(args, params.dk, p.nheads_kv, /*keys=*/true);
  add_padding_clear(args, params.dv, p.nheads_kv, /*keys=*/true);
  return cuda_status(launch_varlen_tiles(args, stream), (std::string(what) + ": packed batch tile lists").c_str());
}

}  // namespace cutlass_flash
