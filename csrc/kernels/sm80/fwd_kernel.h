// sm80 forward kernel: one thread block per (query block, head, batch).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "cutlass_flash/params.h"
#include "kernels/common/block_info.h"
#include "kernels/common/score_policy.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_order.h"
#include "kernels/sm80/fwd_epilogue.h"
#include "kernels/sm80/fwd_mainloop.h"

namespace cutlass_flash::sm80 {

using namespace cute;

// Composed as fwd_kernel<Mainloop, Epilogue, Scheduler> like the sm90 family's.
template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::Traits::kNThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams params, const __grid_constant__ typename Scheduler::Params sched) {
  using Traits = typename Mainloop::Traits;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  // Each thread owns 2 rows of every 16-row MMA tile it covers.
  constexpr int kRows = 2 * kBlockM / (16 * Traits::kNWarps);
  extern __shared__ __align__(128) char smem[];

  const AttnProblem& p = params.problem;
  const TileCoord tile = Scheduler::get(sched, /*longest_first=*/p.window_right >= 0);
  if (tile.block < 0) return;  // past a packed batch's query blocks
  const int m_block = tile.block, head = tile.head;
  const SeqInfo seq(p, tile.batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;  // past the sequence's rows
  const int head_kv = head / (p.nheads / p.nheads_kv);
  const WindowMask mask(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  int n_min, n_max;
  mask.n_block_range<kBlockM, kBlockN>(m_block, n_min, n_max);

  auto gmem_tensor = [](Element* ptr, int rows, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
  };
  Tensor mQ = gmem_tensor(seq.q_rows<Element>(p, params.q, head), seq.seqlen_q, params.q.row_stride);
  Tensor mK = gmem_tensor(seq.k_rows<Element>(p, params.k, head_kv), seq.seqlen_k, params.k.row_stride);
  Tensor mV = gmem_tensor(seq.k_rows<Element>(p, params.v, head_kv), seq.seqlen_k, params.v.row_stride);
  Tensor mO = gmem_tensor(seq.q_rows<Element>(p, params.o, head), seq.seqlen_q, params.o.row_stride);
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));

  Tensor acc_o = partition_fragment_C(typename Traits::TiledMma{}, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);
  Tensor lse = make_tensor<float>(Shape<Int<kRows>>{});
  using Score = typename Mainloop::Score;
  typename Mainloop::template Softmax<kRows> softmax(Score::scale_log2(p));
  // No key visible to any row of this block (n_min == n_max): O = 0 and LSE = +inf (or the sink),
  // finalize's empty rows.
  if (n_min < n_max)
    Mainloop::run(gQ, gK, gV, smem, p, Score(p, mask, tile.batch, head), m_block, n_min, n_max, acc_o, softmax);
  Tensor o_rc = rowcol_view(acc_o);
  Score::finalize(softmax, o_rc, lse, p, head);

  float* lse_out = params.lse + seq.lse_row(p, head) + m_block * kBlockM;
  Epilogue::store(acc_o, lse, gO, lse_out, smem, seq.seqlen_q - m_block * kBlockM, tile_cols<Traits::kNarrow>(p));
}

}  // namespace cutlass_flash::sm80
