// sm90 forward kernel, composed as fwd_kernel<Mainloop, Epilogue, Scheduler>: a persistent,
// warp-specialized block. Warpgroup 0 claims tiles (Scheduler), publishes each to the consumers
// and loads Q, K and V with TMA through mbarrier pipelines; warpgroups 1.. each own 64 query rows
// of the tile and run the wgmma + softmax mainloop, then the epilogue, tile after tile.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include <cmath>

#include "cutlass_flash/params.h"
#include "kernels/common/score_policy.h"
#include "kernels/common/softmax.h"
#include "kernels/common/tile_order.h"
#include "kernels/sm90/fwd_epilogue.h"
#include "kernels/sm90/fwd_mainloop.h"
#include "kernels/sm90/fwd_traits.h"

namespace cutlass_flash::sm90 {

using namespace cute;

template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::Traits::kNThreads, 1)
    fwd_kernel(const __grid_constant__ FwdKernelParams<typename Mainloop::Traits> params) {
  using Traits = typename Mainloop::Traits;
  using Score = typename Mainloop::Score;
  using PipelineKV = typename Traits::PipelineKV;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  extern __shared__ __align__(1024) char smem[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem);

  const AttnProblem& p = params.problem;
  const int warp_group = cutlass::canonical_warp_group_idx();
  // The masks and the tile order are built after each role's setmaxnreg, not here: values live
  // across it were spilled at d = 256. A tile's mask is its sequence's (variable-length batches:
  // per-sequence lengths, SeqInfo).
  auto tile_mask = [&](const TileCoord& tile) {
    const SeqInfo seq(p, tile.batch);
    return WindowMask(seq.seqlen_q, seq.seqlen_k, p.window_left, p.window_right);
  };

  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
    for (int w = 0; w < Traits::kNMmaWarpGroups; ++w) {
      shared.q_full[w].init(1);
      shared.q_empty[w].init(Traits::kQEmptyArrivals);
    }
    if constexpr (Traits::kOInV) shared.o_full.init(Traits::kNMmaThreads);
    Scheduler::init(shared.scheduler);
  }
  typename PipelineKV::Params pipeline_params;
  pipeline_params.transaction_bytes = Traits::kKBytes;
  pipeline_params.role = warp_group == 0 ? PipelineKV::ThreadCategory::Producer : PipelineKV::ThreadCategory::Consumer;
  pipeline_params.is_leader = threadIdx.x == 0;
  pipeline_params.num_consumers = Traits::kNMmaThreads;
  PipelineKV pipeline_k(shared.pipeline_k, pipeline_params, Shape<_1, _1, _1>{});
  if constexpr (Traits::kVBytes != Traits::kKBytes) pipeline_params.transaction_bytes = Traits::kVBytes;
  PipelineKV pipeline_v(shared.pipeline_v, pipeline_params, Shape<_1, _1, _1>{});
  __syncthreads();  // barriers initialised before any thread waits on them

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    // The persistent protocol: sm90/tile_scheduler.h.
    if (threadIdx.x == 0) {  // K/V thread (and, with O in V's stages, O's stores)
      typename Mainloop::KVState state;
      TileCoord staged{-1, 0, 0};  // the last tile with keys: its O is staged in V's stages
      int stored = 0;              // phases of o_full
      auto store_staged = [&] {
        if constexpr (Traits::kOInV) {
          if (staged.block < 0) return;
          shared.o_full.wait(stored++ & 1);
          // O's stage: a constant where O does not go in one stage, so that the d = 192 / 256 K/V
          // thread holds no stage index across the store.
          Epilogue::store_staged(params, shared, staged, Traits::kOInOneStage ? int(state.v.index()) : 0);
        }
      };
      for (int i = 0;; ++i) {
        const TileWork w = Scheduler::take(shared.scheduler, i);
        if (w.coord.block < 0) break;
        if (w.n_min < w.n_max) {
          Mainloop::load_kv(params, shared, pipeline_k, pipeline_v, state, w.coord, w.n_min, w.n_max, store_staged);
          staged = w.coord;
        }
      }
      store_staged();
    } else if (threadIdx.x == 32) {  // tile thread
      const auto order = Scheduler::order(params.scheduler, p);
      const TileWork end{{-1, 0, 0}, 0, 0};
      for (int i = 0, t = Scheduler::first();; ++i, t = Scheduler::next(params.scheduler)) {
        TileWork w = end;
        if (t < order.num_tiles) {
          w.coord = order.coord(t);
          tile_mask(w.coord).template n_block_range<kBlockM, kBlockN>(w.coord.block, w.n_min, w.n_max);
        }
        Scheduler::hand_over(shared.scheduler, i, w);
        Mainloop::publish(params, shared, i, w);
        if (w.coord.block < 0) break;
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int wg = warp_group - 1, tid = int(threadIdx.x) % 128;
    const PingPong<Traits::kNMmaWarpGroups> ping_pong{wg};
    ping_pong.init();
    typename Mainloop::ConsumerState state;
    typename Traits::TiledMmaPV mma_pv;
    for (TileWork w = Mainloop::receive(shared, state, wg); w.coord.block >= 0;
         w = Mainloop::receive(shared, state, wg)) {
      const TileCoord& tile = w.coord;
      const int n_min = w.n_min, n_max = w.n_max;
      const WindowMask mask = tile_mask(tile);
      Tensor acc_o = partition_fragment_C(mma_pv, Shape<_64, Int<Traits::kHeadDimV>>{});
      clear(acc_o);
      Tensor acc_o_rc = rowcol_view(acc_o);
      OnlineSoftmax<decltype(size<0>(acc_o_rc))::value> softmax(Score::scale_log2(p));
      // A tile whose rows see no key (causal with seqlen_q > seqlen_k, a window) takes the same
      // epilogue with O = 0 and lse = +inf (finalize's empty rows). A separate, non-inlined store
      // for it cost the d = 256 kernel 8 B of spills around the call (PERFLOG 65).
      if (n_min < n_max)
        Mainloop::mma(shared, pipeline_k, pipeline_v, state, ping_pong, Score(p, mask, tile.batch, tile.head),
                      tile.block, n_min, n_max, p.is_varlen(), wg, tid, acc_o, softmax);
      else
        Mainloop::release_q(shared, wg);
      Tensor lse = make_tensor<float>(Shape<Int<decltype(size<0>(acc_o_rc))::value>>{});
      Score::finalize(softmax, acc_o_rc, lse, p, tile.head);
      Epilogue::store(params, shared, tile, acc_o, lse, n_min < n_max,
                      Mainloop::template o_slot<typename Epilogue::OSlot>(state));
    }
    Epilogue::finish(tid);
  }
}

}  // namespace cutlass_flash::sm90
