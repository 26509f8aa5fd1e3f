// Backward preprocess, shared by every kernel family: per query row, D = rowsum(dO * O) and the
// log-sum-exp scaled to log2; the fp32 dQ accumulator zeroed, and the dQ semaphores when
// deterministic. One warp per row, 8 elements (16 bytes) per lane. Rows past seqlen_q (up to the
// workspace's rounded row count) get D = 0 and LSE = +inf, so P = exp2(S - LSE) = 0 there.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

#include "cutlass_flash/params.h"
#include "generated/bwd_workspace.h"
#include "kernels/common/block_info.h"

namespace cutlass_flash {

struct BwdPreprocess {
  static constexpr int kWarps = 8;
  static constexpr int kRowsPerBlock = 64;
  static_assert(kBwdRowAlign % kRowsPerBlock == 0 && kRowsPerBlock % kBwdSemaphoreRows == 0);

  static dim3 grid(const BwdParams& params) {
    const BwdWorkspace ws = bwd_workspace_layout(params.problem, params.deterministic);
    return dim3(unsigned(ws.seqlen_q_rounded / kRowsPerBlock), params.problem.nheads, params.problem.batch);
  }
};

template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(BwdPreprocess::kWarps * 32) bwd_preprocess_kernel(const __grid_constant__ BwdParams params) {
  constexpr int kRows = BwdPreprocess::kRowsPerBlock, kWarps = BwdPreprocess::kWarps;
  const AttnProblem& p = params.problem;
  const BwdWorkspace ws = bwd_workspace_layout(p, params.deterministic);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.y;
  const SeqInfo seq(p, blockIdx.z);
  // Every row the main kernels read: the sequence's rows rounded up to whole query tiles.
  if (blockIdx.x * kRows >= (seq.seqlen_q + kBwdRowAlign - 1) / kBwdRowAlign * kBwdRowAlign) return;
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
      sem[(g * ws.rows + bh_row + blockIdx.x * kRows) / kBwdSemaphoreRows + threadIdx.x] = 0;
  }
  for (int r = warp; r < kRows; r += kWarps) {
    const int row = blockIdx.x * kRows + r;
    for (int g = 0; g < ws.dq_groups; ++g) {
      float4* dq_row = reinterpret_cast<float4*>(dq_accum + (g * ws.rows + bh_row + row) * kHeadDim);
      for (int c = lane; c < kHeadDim / 4; c += 32) dq_row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float acc = 0.f;
    if (row < seq.seqlen_q) {
      for (int c = lane * 8; c < kHeadDim; c += 32 * 8) {
        const uint4 ov = *reinterpret_cast<const uint4*>(o + row * params.o.row_stride + c);
        const uint4 dv = *reinterpret_cast<const uint4*>(dout + row * params.dout.row_stride + c);
        const Element* oe = reinterpret_cast<const Element*>(&ov);
        const Element* de = reinterpret_cast<const Element*>(&dv);
        CUTE_UNROLL
        for (int i = 0; i < 8; ++i) acc += float(oe[i]) * float(de[i]);
      }
    }
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffff, acc, offset);
    if (lane == 0) {
      dpsum[bh_row + row] = acc;
      lse_log2[bh_row + row] = row < seq.seqlen_q ? lse[row] * float(M_LOG2E) : INFINITY;
    }
  }
}

}  // namespace cutlass_flash
