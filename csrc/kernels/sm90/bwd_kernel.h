// sm90 backward kernel, composed as bwd_kernel<Mainloop, Epilogue, Scheduler>: one block per (key
// block, kv head, batch), warp-specialized. Warpgroup 0 loads (one thread: K, V, then Q and LSE
// per step; another: dO and D), and its warp 2 is the dQ warp: in the keys-per-warpgroup layout
// it adds dQ to the workspace, in the split-d layouts it passes the deterministic turns.
// Warpgroups 1.. run the wgmma mainloop (bwd_mainloop.h: each owns 64 of the block's keys;
// bwd_mainloop_split_d.h: each owns a share of the head dim) over every query head of the
// kv head's group, so GQA/MQA dK and dV are summed in registers in a fixed order and written once.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cutlass_flash/params.h"
#include "kernels/common/mask.h"
#include "kernels/common/tile_order.h"
#include "kernels/sm90/bwd_epilogue.h"
#include "kernels/sm90/bwd_mainloop.h"
#include "kernels/sm90/bwd_traits.h"

namespace cutlass_flash::sm90 {

using namespace cute;

template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::Traits::kNThreads, 1)
    bwd_kernel(const __grid_constant__ BwdKernelParams<typename Mainloop::Traits> params) {
  using Traits = typename Mainloop::Traits;
  using Pipeline = typename Traits::Pipeline;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kQThread = 0, kdOThread = 32;  // lane 0 of warps 0 and 1
  constexpr int kdQWarp = 2;
  extern __shared__ __align__(1024) char smem[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem);

  const AttnProblem& p = params.problem;
  const int warp_group = cutlass::canonical_warp_group_idx();
  // Key blocks. Under a causal mask (right-bounded, left-unbounded) key block n sees the queries
  // from about its own rows on, so the lowest blocks take longest. In the grid's order each
  // (head, batch) pair's blocks started after the previous pair's, and the last pair's longest
  // block ran near alone at the end (up to one block's work per SM: 22 of ~250 steps at 2k tokens,
  // d = 192). They go ascending instead, over groups of PersistentTileOrder::kCausalGroup pairs,
  // as the forward's causal order: +0.5-7.6% at d = 64-256, 2k / 8k; groups sized to 80% of L2 as
  // FlashAttention-3's (SingleTileBwdLPTScheduler: 2 pairs at 8k, d = 192) ran up to 5% behind
  // (PERFLOG.md entry 103). Blocks in flight walk their queries down from the same last block, so
  // L2 holds a band of a group's Q and dO, not all of it.
  // Deterministic mode relies on the blocks a block waits for starting first
  // (common/dq_semaphore.h): under a right-bounded mask it adds dQ in decreasing key-block order
  // (BwdSteps::upward) and launches the highest block first, else the grid's order. Only with one
  // dQ copy (below
  // kBwdDqGroupsMinSeqlenKRightBounded = 8k keys, and variable-length batches): the blocks in
  // flight then read Q, dO and dQ from all of a head's query blocks instead of a band of them, and
  // at 8k keys the upward walk measured 0.42-0.52x of the default speed at d = 128 / 256 where the
  // downward walk with four dQ copies keeps 0.77-0.81x (PERFLOG.md entry 62).
  const bool upward = params.semaphores() != nullptr && p.window_right >= 0 && params.dq_groups == 1;
  const bool ascending = params.semaphores() == nullptr && p.window_left < 0 && p.window_right >= 0;
  const TileCoord tile = Scheduler::get(params.scheduler, /*longest_first=*/upward, ascending);
  if constexpr (Scheduler::kPackable) {
    if (tile.block < 0) return;  // past a packed batch's key blocks
  }
  const int n_block = tile.block, head_kv = tile.head;
  // Built after each role's setmaxnreg: values live across it are spilled (forward, entry 16).
  // The mask is the sequence's (variable-length batches: per-sequence lengths, SeqInfo); a key
  // block past its sequence's keys has no steps.
  auto make_mask = [&] {
    const SeqInfo seq(p, tile.batch);
    return WindowMask(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  };
  auto make_steps = [&](const WindowMask& mask) {
    const int group = p.nheads / p.nheads_kv;
    BwdSteps steps{tile.batch, head_kv * group, group, 0, 0, BwdSteps::step_of(upward)};
    mask.m_block_range<kBlockM, kBlockN>(n_block, steps.m_min, steps.m_max);
    if (n_block * kBlockN >= mask.seqlen_k || steps.m_max < steps.m_min) steps.m_max = steps.m_min;
    return steps;
  };

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    shared.kv_full.init(1);
    if constexpr (Traits::kDqThread) {
      for (int b = 0; b < Traits::kdQBuffers; ++b) {
        shared.dq_full[b].init(Traits::kNMmaThreads);
        shared.dq_empty[b].init(1);
      }
    }
  }
  // The leader of a pipeline is its producer thread: it arms the full barrier with the stage's
  // transaction bytes (a pipeline whose loads come from a non-leader never completes a stage).
  auto pipeline_params = [&](int producer_thread) {
    typename Pipeline::Params params;
    params.transaction_bytes =
        (producer_thread == kdOThread ? Traits::kdOBytes : Traits::kQBytes) + Traits::kRowStatBytes;
    params.role = warp_group == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    params.is_leader = int(threadIdx.x) == producer_thread;
    params.num_consumers = Traits::kNMmaThreads;
    return params;
  };
  Pipeline pipeline_q(shared.pipeline_q, pipeline_params(kQThread), Shape<_1, _1, _1>{});
  Pipeline pipeline_do(shared.pipeline_do, pipeline_params(kdOThread), Shape<_1, _1, _1>{});
  __syncthreads();  // barriers initialised before any thread waits on them

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x == kQThread) {  // K and V, then Q with its LSE
      const BwdSteps steps = make_steps(make_mask());
      if (steps.count() > 0) {
        Mainloop::load_kv(params, shared, steps, n_block, head_kv);
        Mainloop::template load_rows<false>(params.tma_q, p, params.rows_per_head, pipeline_q, shared.q.data(),
                                            shared.lse_log2.data(), params.lse_log2, steps);
      }
    } else if (threadIdx.x == kdOThread) {  // dO with its D
      Mainloop::template load_rows<true>(params.tma_do, p, params.rows_per_head, pipeline_do, shared.dout.data(),
                                         shared.dpsum.data(), params.dpsum, make_steps(make_mask()));
    } else if (threadIdx.x / 32 == kdQWarp) {
      const WindowMask mask = make_mask();
      Mainloop::dq_warp(params, shared, make_steps(mask), mask, n_block);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const WindowMask mask = make_mask();
    const BwdSteps steps = make_steps(mask);
    const int tid = int(threadIdx.x) - 128;
    Tensor acc_dk = partition_fragment_C(typename Traits::TiledMmadKV{}, typename Traits::dKVShape{});
    Tensor acc_dv = partition_fragment_C(typename Traits::TiledMmadV{}, typename Traits::dVShape{});
    clear(acc_dk);
    clear(acc_dv);
    if (steps.count() > 0)
      Mainloop::template mma<Scheduler::kPackable>(params, shared, pipeline_q, pipeline_do, steps, mask, n_block, tid,
                                                   acc_dk, acc_dv);
    const SeqInfo seq(p, tile.batch);
    // dK staged in V's tile, or in K's where V's is narrower (a head dim of V of its own).
    Element* dk_staging = Traits::kHeadDimV == Traits::kHeadDim ? shared.v.data() : shared.k.data();
    Epilogue::template store<false>(p, params.dk, acc_dk, p.softmax_scale, seq, head_kv, n_block, tid, dk_staging);
    Epilogue::template store<true>(p, params.dv, acc_dv, ScorePolicy<AllScoreFeatures>::keep_scale(p), seq, head_kv,
                                   n_block, tid, shared.v.data());
  }
}

}  // namespace cutlass_flash::sm90
