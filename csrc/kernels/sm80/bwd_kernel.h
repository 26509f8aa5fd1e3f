// sm80 backward kernels: the main kernel (one thread block per (key block, kv head, batch), over
// every query head of the kv head's group) and the dQ conversion (fp32 scratch -> dq). The
// preprocess is shared with sm90 (kernels/common/bwd_preprocess.h).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cmath>

#include "cutlass_flash/params.h"
#include "kernels/common/block_info.h"
#include "kernels/common/score_policy.h"
#include "kernels/common/bwd_convert_dq.h"
#include "kernels/common/tile_order.h"
#include "kernels/sm80/bwd_epilogue.h"
#include "kernels/sm80/bwd_mainloop.h"
#include "kernels/sm80/launch.h"
#include "generated/bwd_workspace.h"

namespace cutlass_flash::sm80 {

using namespace cute;

// dq = softmax_scale * dQ scratch (common/bwd_convert_dq.h), one thread block per query tile,
// each thread reading back the accumulators it would have held in the main kernel's dQ MMA
// (dq_accum_index: coalesced 4-byte loads).
template <typename Traits, bool kPacked>
__global__ void __launch_bounds__(Traits::kNThreads)
    bwd_convert_dq_kernel(const __grid_constant__ BwdParams params, const __grid_constant__ VarlenTiles rows) {
  convert_dq<kFamilyArch, Traits, Traits::kNThreads, kPacked>(params, rows,
                                                              [](auto& acc, const float* tile, int tid, auto add) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) {
      const float v = tile[dq_accum_index<Traits>(i, tid)];
      if constexpr (decltype(add)::value)
        acc(i) += v;
      else
        acc(i) = v;
    }
  });
}

// The main kernel, composed as bwd_kernel<Mainloop, Epilogue, Scheduler> like the sm90 family's.
template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::Traits::kNThreads, 1)
    bwd_kernel(const __grid_constant__ BwdParams params, const __grid_constant__ typename Scheduler::Params sched) {
  using Traits = typename Mainloop::Traits;
  using Score = typename Mainloop::Score;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  extern __shared__ __align__(128) char smem[];

  const AttnProblem& p = params.problem;
  // Key blocks near the start are seen by the most query rows under a causal mask: natural order
  // already starts the longest blocks first. Deterministic mode relies on lower key blocks
  // starting first (common/dq_semaphore.h).
  const TileCoord tile = Scheduler::get(sched, /*longest_first=*/false);
  if constexpr (Scheduler::kPackable) {
    if (tile.block < 0) return;  // past a packed batch's key blocks
  }
  const int n_block = tile.block, head_kv = tile.head;
  const SeqInfo seq(p, tile.batch);
  if (n_block * kBlockN >= seq.seqlen_k) return;  // past the sequence's keys
  const int group = p.nheads / p.nheads_kv;
  const WindowMask mask(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  int m_min, m_max;
  mask.m_block_range<kBlockM, kBlockN>(n_block, m_min, m_max);

  auto rows_tensor = [](Element* ptr, int rows, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
  };
  using QTile = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using KTile = Shape<Int<kBlockN>, Int<kHeadDim>>;
  // Key block `at.block` of (key, d) tensor t (K, V, dK or dV) of the sequence `in`.
  auto key_tile = [&](const TensorRef4& t, const SeqInfo& in, const TileCoord& at) {
    return local_tile(rows_tensor(in.k_rows<Element>(p, t, at.head), in.seqlen_k, t.row_stride), KTile{},
                      make_coord(at.block, 0));
  };

  const BwdWorkspace ws = bwd_workspace_layout(p, params.deterministic, kFamilyArch);
  char* workspace = static_cast<char*>(params.workspace);
  Tensor acc_dk = partition_fragment_C(typename Traits::TiledMmadKV{}, KTile{});
  Tensor acc_dv = partition_fragment_C(typename Traits::TiledMmadKV{}, KTile{});
  clear(acc_dk);
  clear(acc_dv);
  // The query heads of the group one after the other: GQA/MQA dK and dV summed in registers, in
  // a fixed order.
  for (int g = 0; g < group && m_min < m_max; ++g) {
    const int head = head_kv * group + g;
    const int64_t bh_row = seq.workspace_row(p, ws.rows_per_head, head);
    Tensor gQ = local_tile(rows_tensor(seq.q_rows<Element>(p, params.q, head), seq.seqlen_q, params.q.row_stride),
                           QTile{}, make_coord(_, 0));
    Tensor gdO =
        local_tile(rows_tensor(seq.q_rows<Element>(p, params.dout, head), seq.seqlen_q, params.dout.row_stride),
                   QTile{}, make_coord(_, 0));
    const int64_t dq_row = bh_row + ws.dq_group_row(n_block);
    float* dq_accum = reinterpret_cast<float*>(workspace + ws.dq_accum_offset) + dq_row * kHeadDim;
    const float* dpsum = reinterpret_cast<const float*>(workspace + ws.dpsum_offset) + bh_row;
    const float* lse = params.lse + seq.lse_row(p, head);
    // A packed batch whose tile list was cut (bad cu_seqlens) adds dQ unordered: its turns would
    // wait for blocks that never run (VarlenTiles::truncated).
    const bool ordered =
        params.deterministic && !(Scheduler::kPackable && sched.tiles.count != nullptr && sched.tiles.truncated());
    const typename Mainloop::DqOrder dq_order{
        ordered ? reinterpret_cast<int*>(workspace + ws.dq_semaphore_offset) : nullptr, dq_row, n_block, ws.dq_groups};
    // K and V (loaded again for each query head) from the tile read here: built before the loop,
    // their addresses were held across it and spilled (48 B at d = 64, 92 B at d = 256, sm_80).
    const TileCoord kv = Scheduler::get_here(sched, /*longest_first=*/false);
    const SeqInfo kv_seq(p, kv.batch);
    Tensor gK = key_tile(params.k, kv_seq, kv);
    Tensor gV = key_tile(params.v, kv_seq, kv);
    if (g > 0) __syncthreads();  // the last head's final reads of shared memory are done
    Mainloop::run(gQ, gdO, gK, gV, dq_accum, lse, dpsum, smem, p, Score(p, mask, tile.batch, head), n_block, m_min,
                  m_max, Score::scale_log2(p), acc_dk, acc_dv, dq_order);
  }
  // dK and dV's addresses and rows likewise from the tile read after the loop.
  const TileCoord out = Scheduler::get_here(sched, /*longest_first=*/false);
  const SeqInfo out_seq(p, out.batch);
  Tensor gdK = key_tile(params.dk, out_seq, out);
  Tensor gdV = key_tile(params.dv, out_seq, out);
  Epilogue::store(acc_dk, acc_dv, gdK, gdV, p.softmax_scale, Score::keep_scale(p), smem,
                  out_seq.seqlen_k - out.block * kBlockN, tile_cols<Traits::kNarrow>(p));
}

}  // namespace cutlass_flash::sm80
