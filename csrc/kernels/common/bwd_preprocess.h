// Backward preprocess, shared by every kernel family: per query row, D = rowsum(dO * O) and the
// log-sum-exp scaled to log2; the fp32 dQ accumulator zeroed, and the dQ semaphores when
// deterministic. A row is read by a group of kThreadsPerRow threads, 8 elements (16 bytes) each,
// several rows' loads in flight per thread: with one warp per row and one row at a
// time (16 lanes busy at d = 128, 8 at d = 64) the kernel took 115 us at d = 64 (16k tokens x
// 2048, H100) against FlashAttention-3's 92 us (PERFLOG 45). Rows past seqlen_q (up to the
// workspace's rounded row count) get D = 0 and LSE = +inf, so P = exp2(S - LSE) = 0 there.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "cutlass_flash/params.h"
#include "generated/bwd_workspace.h"
#include "kernels/common/block_info.h"
#include "kernels/common/tile_order.h"

namespace cutlass_flash {

struct BwdPreprocess {
  static constexpr int kWarps = 8;
  static constexpr int kRowsPerBlock = 64;
  static_assert(kBwdRowAlign % kRowsPerBlock == 0 && kRowsPerBlock % kBwdSemaphoreRows == 0);

  // rows: a packed batch's query rows in kBwdRowAlign tiles (common/varlen_tiles.h), each taken
  // by kBwdRowAlign / kRowsPerBlock blocks; dense (rows.count null): every sequence's rounded rows.
  static dim3 grid(const BwdParams& params, int arch, const VarlenTiles& rows) {
    if (rows.count != nullptr)
      return dim3(unsigned(rows.capacity * (kBwdRowAlign / kRowsPerBlock)), params.problem.nheads, 1);
    const BwdWorkspace ws = bwd_workspace_layout(params.problem, params.deterministic, arch);
    return dim3(unsigned(ws.seqlen_q_rounded / kRowsPerBlock), params.problem.nheads, params.problem.batch);
  }
};

// kArch: the family whose main kernel follows (its dQ groups, bwd_workspace_layout). kPacked: a
// packed batch's grid over `rows` (dense calls run the kernel without it: a few registers more
// moved the dense backward, PERFLOG 91).
template <int kArch, int kHeadDim, typename Element, bool kPacked>
__global__ void __launch_bounds__(BwdPreprocess::kWarps * 32)
    bwd_preprocess_kernel(const __grid_constant__ BwdParams params, const __grid_constant__ VarlenTiles rows) {
  constexpr int kRows = BwdPreprocess::kRowsPerBlock, kThreads = BwdPreprocess::kWarps * 32;
  const AttnProblem& p = params.problem;
  const BwdWorkspace ws = bwd_workspace_layout(p, params.deterministic, kArch);
  const int head = blockIdx.y;
  int batch = blockIdx.z, block = blockIdx.x;
  if (kPacked && !rows.part(blockIdx.x, kRows, batch, block)) return;
  const SeqInfo seq(p, batch);
  // Every row the main kernels read: the sequence's rows rounded up to whole query tiles.
  if (block * kRows >= (seq.seqlen_q + kBwdRowAlign - 1) / kBwdRowAlign * kBwdRowAlign) return;
  const int64_t bh_row = seq.workspace_row(p, ws.rows_per_head, head);
  char* workspace = static_cast<char*>(params.workspace);
  float* dq_accum = reinterpret_cast<float*>(workspace + ws.dq_accum_offset);
  float* dpsum = reinterpret_cast<float*>(workspace + ws.dpsum_offset);
  float* lse_log2 = reinterpret_cast<float*>(workspace + ws.lse_log2_offset);
  const float* lse = params.lse + seq.lse_row(p, head);
  const Element* o = seq.q_rows<const Element>(p, params.o, head);
  const Element* dout = seq.q_rows<const Element>(p, params.dout, head);
  if (params.deterministic && threadIdx.x < kRows / kBwdSemaphoreRows) {
    int* sem = reinterpret_cast<int*>(workspace + ws.dq_semaphore_offset);
    for (int g = 0; g < ws.dq_groups; ++g)
      sem[(g * ws.rows + bh_row + block * kRows) / kBwdSemaphoreRows + threadIdx.x] = 0;
  }
  // kThreadsPerRow: the row's 16-byte chunks rounded up to a power of two (d = 96: 12 of 16
  // threads load, d = 192: 24 of 32), so the group's shuffle reduction stays inside the group.
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kThreadsPerRow = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static_assert(kChunks <= 32, "one 16-byte chunk per thread and row");
  constexpr int kRowsPerPass = kThreads / kThreadsPerRow, kPasses = kRows / kRowsPerPass;
  const int chunk = threadIdx.x % kThreadsPerRow, row0 = block * kRows + threadIdx.x / kThreadsPerRow;
  // Passes go in batches of kBatch, each batch's loads issued before its reductions: with every
  // pass in flight at once the kernel took 84 registers at d = 128 and 153 at d = 256 (one block
  // of 256 threads per SM); 2 passes a thread keep about 6 blocks resident.
  constexpr int kBatch = kPasses < 2 ? kPasses : 2;
  static_assert(kPasses % kBatch == 0);
  CUTE_UNROLL
  for (int b = 0; b < kPasses; b += kBatch) {
    uint4 ov[kBatch], dv[kBatch];
    CUTE_UNROLL
    for (int i = 0; i < kBatch; ++i) {
      const int row = row0 + (b + i) * kRowsPerPass;
      ov[i] = dv[i] = make_uint4(0, 0, 0, 0);
      if (row < seq.seqlen_q && chunk < kChunks && chunk * 8 < p.cols_v()) {  // the tensors' own columns
        ov[i] = *reinterpret_cast<const uint4*>(o + row * params.o.row_stride + chunk * 8);
        dv[i] = *reinterpret_cast<const uint4*>(dout + row * params.dout.row_stride + chunk * 8);
      }
    }
    if (b == 0) {
      // The block's dQ accumulator rows are contiguous in each group: zeroed with float4 stores
      // while the first loads are in flight.
      for (int g = 0; g < ws.dq_groups; ++g) {
        float4* dq_rows = reinterpret_cast<float4*>(dq_accum + (g * ws.rows + bh_row + block * kRows) * kHeadDim);
        CUTE_UNROLL
        for (int i = threadIdx.x; i < kRows * kHeadDim / 4; i += kThreads) dq_rows[i] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    CUTE_UNROLL
    for (int i = 0; i < kBatch; ++i) {
      const int row = row0 + (b + i) * kRowsPerPass;
      const Element* oe = reinterpret_cast<const Element*>(&ov[i]);
      const Element* de = reinterpret_cast<const Element*>(&dv[i]);
      float acc = 0.f;
      CUTE_UNROLL
      for (int e = 0; e < 8; ++e) acc += float(oe[e]) * float(de[e]);
      CUTE_UNROLL
      for (int offset = kThreadsPerRow / 2; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffff, acc, offset);
      if (chunk == 0) {
        dpsum[bh_row + row] = acc;
        lse_log2[bh_row + row] = row < seq.seqlen_q ? lse[row] * float(M_LOG2E) : INFINITY;
        // The sink's share of the row, P_sink = exp(sink - lse), has no value, so its dP is 0 and
        // dS_sink = P_sink (0 - D).
        if (params.dsink_rows != nullptr && row < seq.seqlen_q)
          params.dsink_rows[seq.lse_row(p, head) + row] = -expf(p.sinks[head] - lse[row]) * acc;
      }
    }
  }
}

}  // namespace cutlass_flash
