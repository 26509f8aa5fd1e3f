// sm90 backward mainloop of the split-d layouts (BwdTraitsSplitD, d = 256, and
// BwdTraitsSplitDQueryRows, d = 192): the producer's loads are the keys-per-warpgroup layout's
// (BwdMainloop); the consumers' step differs.
//
// Per query block, consumer warpgroup w of W (columns d_w = [w d / W, (w + 1) d / W) of the head
// dim; keys as rows: queries q_w = [32 w, 32 w + 32) of the block, all keys; queries as rows: all
// queries, keys k_w = [w kBlockN / W, ...)):
//   S^T(:, q_w) = K Q(q_w)^T, dP^T(:, q_w) = V dO(q_w)^T, or S(:, k_w) = Q K(k_w)^T, dP(:, k_w) =
//   dO V(k_w)^T;  P, dS as in the other layout;
//   its share of P and dS to shared memory; every warpgroup's share written ->
//   dQ(:, d_w) = dS K(:, d_w), dV(:, d_w) += P^T dO(:, d_w), dK(:, d_w) += dS^T Q(:, d_w) (queries
//   as rows: as dV^T(d_w, :) += dO(:, d_w)^T P, dK^T(d_w, :) += Q(:, d_w)^T dS);
//   dQ(:, d_w) added to the workspace with 16-byte reductions (red) while dV and dK run.
// Deterministic mode adds a fourth role, the dQ warp (warp 2 of the producer warpgroup): it waits
// for each step's turn and passes it on, so that the consumers only meet it at two named barriers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernels/common/block_info.h"
#include "kernels/common/dq_semaphore.h"
#include "kernels/common/mask.h"
#include "kernels/sm90/bwd_mainloop.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/utils.h"

namespace cutlass_flash::sm90 {

using namespace cute;

template <typename Traits_, typename Features_ = AllScoreFeatures>
struct BwdMainloopSplitD : BwdMainloop<Traits_, Features_> {
  using Base = BwdMainloop<Traits_, Features_>;
  using Traits = Traits_;
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr bool kScoresTransposed = Traits::kScoresTransposed;
  // A warpgroup's queries: half the step's with keys as rows, all of them with queries as rows.
  static constexpr int kQueriesPerWarpgroup = kScoresTransposed ? kBlockM / 2 : kBlockM;
  // The consumers and the dQ warp, at the deterministic turn's two barriers.
  static constexpr int kTurnThreads = Traits::kNMmaThreads + 32;
  static constexpr bool kAllHaveDv = Traits::kdVWarpGroups == Traits::kNMmaWarpGroups;

  // The thread whose slice of TiledMmadV a consumer thread partitions with: itself, or where its
  // warpgroup has no share of dV (and so never multiplies it) the last one that has.
  __device__ static int dv_thread(int tid) {
    return kAllHaveDv ? tid : cute::min(tid, Traits::kdVWarpGroups * 128 - 1);
  }

  using Base::dq_row;

  // ---- dQ warp (deterministic mode only) ----

  // Per step, in the consumers' order: waits until the lower key blocks of the group have added
  // their dQ to the step's query tile, lets the consumers add theirs (kdQTurn), waits for them to
  // have issued it (kdQAdded) and passes the turn on with one release, which publishes the
  // consumers' reductions (cumulativity through the barrier: CUTLASS's GenericBarrier::arrive_inc
  // pattern). The consumers used to do this themselves: one thread's spin on the semaphore, an L2
  // round trip even when the turn had come, and the release's wait for the reductions to reach L2,
  // each step on the path between their GEMMs (deterministic / default 0.54-0.67, PERFLOG.md
  // entries 52 and 57). Here the wait for step i + 1's turn overlaps step i + 1's GEMMs.
  template <typename Params>
  __device__ static void dq_warp(const Params& params, typename Traits::SharedStorage&, const BwdSteps& steps,
                                 const WindowMask& mask, int n_block) {
    if (params.semaphores() == nullptr || steps.count() == 0) return;
    // The walk's direction as a template parameter (BwdSteps::first<kUpward>() says why).
    if (steps.upward())
      pass_turns<true>(params, steps, mask, n_block);
    else
      pass_turns<false>(params, steps, mask, n_block);
  }

  template <bool kUpward, typename Params>
  __device__ static void pass_turns(const Params& params, const BwdSteps& steps, const WindowMask& mask, int n_block) {
    const bool leader = threadIdx.x % 32 == 0;
    auto turn = [&](int m) { return DqSemaphore::turn<kBlockM, kBlockN>(mask, m, n_block, params.dq_groups, kUpward); };
    const int first = steps.template first<kUpward>(), end = steps.template end<kUpward>();
    // A head's rows follow the previous head's at rows_per_head (SeqInfo::workspace_row, both
    // layouts): one running row instead of the sequence's offsets, which spilled 12 B at the
    // producer's 24 registers.
    int64_t row = dq_row(params, steps, steps.head_begin, n_block);
    int m = first, h = 0;
    int next_turn = turn(m);
#pragma unroll 1
    while (true) {
      int* semaphore = DqSemaphore{params.semaphores()}.at<kBlockM>(row, m);
      // Every lane polls (one address: one request for the warp), so no branch on the lane: with
      // lane 0 polling alone the compiler lost track of the warp's convergence once the walk had
      // two directions (a divergence check and a re-read of the thread index on each step's
      // path; deterministic d = 256 0.93-0.97x without a causal mask, PERFLOG.md entry 62).
      DqSemaphore::wait(semaphore, next_turn);
      cutlass::arch::NamedBarrier::arrive(kTurnThreads, int(BwdBarrier::kdQTurn));
      // The next step's turn is counted while the consumers add this one's: the count walks the
      // group's other key blocks (up to 32 at 8k keys), about as long as a poll of L2.
      m += BwdSteps::step_of(kUpward);
      if (m == end) {
        m = first;
        row += params.rows_per_head;
        ++h;
      }
      if (h < steps.heads) next_turn = turn(m);
      cutlass::arch::NamedBarrier::sync(kTurnThreads, int(BwdBarrier::kdQAdded));
      if (leader) DqSemaphore::signal(semaphore);
      if (h == steps.heads) break;
    }
  }

  template <bool kPacked, typename Params, typename AccK, typename AccV>
  __device__ static void mma(const Params& params, typename Traits::SharedStorage& shared, Pipeline& pipeline_q,
                             Pipeline& pipeline_do, const BwdSteps& steps, const WindowMask& mask, int n_block, int tid,
                             AccK& acc_dk, AccV& acc_dv) {
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadV mma_dv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    // wgmma descriptors from the warpgroup's first thread, warp-uniform (bwd_mainloop.h says why).
    const int wg_thread = __shfl_sync(0xffffffff, tid / 128, 0) * 128;
    auto wg_sdp = mma_sdp.get_thread_slice(wg_thread);
    auto wg_dkv = mma_dkv.get_thread_slice(wg_thread);
    auto wg_dv = mma_dv.get_thread_slice(dv_thread(wg_thread));
    auto wg_dq = mma_dq.get_thread_slice(wg_thread);
    // Whether this warpgroup has a share of dV (Traits::kdVWarpGroups; all of them unless V has a
    // head dim of its own).
    const bool has_dv = kAllHaveDv || wg_thread < Traits::kdVWarpGroups * 128;

    auto [tSrK, tSrQ, tdPrV, tdPrdO, tdQrdS_, tdQrK_] = Base::score_and_dq_operands(wg_sdp, wg_dq, shared);
    // Plain references for the step's lambda (capturing a structured binding is C++20).
    auto& tdQrdS = tdQrdS_;
    auto& tdQrK = tdQrK_;
    // dV (+)= P^T dO and dK (+)= dS^T Q read P^T, dS^T (key, query) and dO^T, Q^T (d, query)
    // through the transposed views of their tiles: as A and B (keys as rows), or as B and A (the
    // transposed products dV^T = dO^T P, dK^T = Q^T dS, queries as rows).
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutdOt{});
    Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdSt{});
    Tensor sPt = make_tensor(make_smem_ptr(shared.p.data()), typename Traits::SmemLayoutdSt{});
    auto operand = [&](const auto& thr, auto& s, auto is_a) {
      if constexpr (decltype(is_a)::value)
        return thr.partition_fragment_A(s);
      else
        return thr.partition_fragment_B(s);
    };
    constexpr bool kSwap = Traits::kdKVTransposed;
    Tensor tdVrP = operand(wg_dv, sPt, cute::bool_constant<!kSwap>{});  // (MMA, M or N, K, buffer)
    Tensor tdKrdS = operand(wg_dkv, sdSt, cute::bool_constant<!kSwap>{});
    Tensor tdVrdO = operand(wg_dv, sdOt, cute::bool_constant<kSwap>{});  // (MMA, N or M, K, stage)
    Tensor tdKrQ = operand(wg_dkv, sQt, cute::bool_constant<kSwap>{});
    auto dkv_gemm = [&](auto& mma, const auto& scores, const auto& rows, auto& acc) {
      if constexpr (kSwap)
        gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma, rows, scores, acc);
      else
        gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma, scores, rows, acc);
    };

    // P and dS from registers to shared memory with stmatrix (the other layout's dS^T copy), in
    // the orientation of the score accumulators.
    auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s = r2s.get_thread_slice(tid);
    Tensor tPsP =
        thr_r2s.partition_D(make_tensor(make_smem_ptr(shared.p.data()), typename Traits::SmemLayoutdSScores{}));
    Tensor tdSsdS =
        thr_r2s.partition_D(make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdSScores{}));

    // Coordinates of each score accumulator ((key, query) or (query, key)), for the mask.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(typename Traits::ScoreShape{}));
    constexpr int kQueries = decltype(size<0>(Base::query_key_view(tScS)))::value;  // queries per thread
    static_assert(kQueries == (kScoresTransposed ? kQueriesPerWarpgroup / 4 : kBlockM / 32));
    const float scale_log2 = Base::Score::scale_log2(params.problem);
    // This warpgroup's first query in the step's LSE and D.
    const int query_offset = kScoresTransposed ? (tid / 128) * kQueriesPerWarpgroup : 0;

    PipelineState st_q, st_do;
    shared.kv_full.wait(0);
    const bool packed = kPacked && params.problem.is_varlen();
    if (packed && (n_block + 1) * kBlockN > mask.seqlen_k) Base::clear_kv_past(shared, mask, n_block, tid);
    // The query block whose rows end past the sequence (-1: none), one register across the loop.
    const int clear_m = packed && mask.seqlen_q % kBlockM != 0 ? mask.seqlen_q / kBlockM : -1;
    int i = 0;
#pragma unroll 1
    for (int h = steps.head_begin; h < steps.head_begin + steps.heads; ++h) {
      const int64_t row = dq_row(params, steps, h, n_block);
      const typename Base::Score score(params.problem, mask, steps.batch, h);
      const typename Base::HeadValues head = score.template head_values<Traits::kHoldsFeatureValues>();
#pragma unroll 1
      for (int m = steps.first(), end = steps.end(); m != end; m += steps.step, ++i) {
        if constexpr (kPacked) {
          if (m == clear_m) Base::clear_rows_past(shared, pipeline_q, st_q, pipeline_do, st_do, mask, m, tid);
        }
        const int buf = i % Traits::kdSBuffers;
        Tensor acc_s = partition_fragment_C(mma_sdp, typename Traits::ScoreShape{});
        Tensor acc_dp = partition_fragment_C(mma_sdp, typename Traits::ScoreShape{});
        Base::template scores<kQueriesPerWarpgroup>(mma_sdp, tSrK, tSrQ, tdPrV, tdPrdO, pipeline_q, st_q, pipeline_do,
                                                    st_do, shared, query_offset, score, head, tScS, m, n_block,
                                                    scale_log2, acc_s, acc_dp);
        Tensor rP = convert_type<Element>(acc_s);
        Tensor rdS = convert_type<Element>(acc_dp);
        copy(r2s, thr_r2s.retile_S(rP), tPsP(_, _, _, buf));
        copy(r2s, thr_r2s.retile_S(rdS), tdSsdS(_, _, _, buf));
        // Every warpgroup's P and dS are in shared memory (generic-proxy stores, read next by
        // wgmma). Buffer buf was last read two steps ago, which every warpgroup finished (each
        // waits for all its GEMMs before the next step's barrier).
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(BwdBarrier::kdSReady));
        // dQ, dV (kDv) and dK, each path with all its wgmma and their waits: with the dV GEMM and the
        // wait's count under two branches of their own, ptxas serialized every wgmma of the kernel
        // (C7514: a wait after each; 0.83-0.87x FlashAttention-3's backward at (192, 128)).
        auto dq_dv_dk = [&](auto dv) {
          constexpr bool kDv = decltype(dv)::value;
          Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
          gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, acc_dq);
          if constexpr (kDv) dkv_gemm(mma_dv, tdVrP(_, _, _, buf), tdVrdO(_, _, _, st_do.index()), acc_dv);
          dkv_gemm(mma_dkv, tdKrdS(_, _, _, buf), tdKrQ(_, _, _, st_q.index()), acc_dk);
          warpgroup_wait<kDv ? 2 : 1>();  // dQ done, dV and dK running
          warpgroup_fence_operand(acc_dq);
          add_dq(params, acc_dq, row, m, tid);
          warpgroup_wait<0>();
          if constexpr (kDv) warpgroup_fence_operand(acc_dv);
          warpgroup_fence_operand(acc_dk);
        };
        if (has_dv)
          dq_dv_dk(cute::true_type{});
        else
          dq_dv_dk(cute::false_type{});
        pipeline_do.consumer_release(st_do);
        ++st_do;
        pipeline_q.consumer_release(st_q);
        ++st_q;
      }
    }
  }

  // Adds the step's dQ to the query tile's fp32 rows in the workspace, in the layout of the other
  // layout's bulk add (dq_index: each warp's 16-byte reductions cover 512 consecutive bytes), so the
  // dQ conversion kernel is shared. Deterministic mode: once the dQ warp has seen the turn come,
  // and the dQ warp is told when the reductions are issued (dq_warp). The reductions are written
  // out in each branch: shared by both modes between two predicated barriers, the compiler
  // rescheduled the default step (+9 instructions before the dS barrier) and the default backward
  // measured 0.97-1.00x at d = 192 / 256 (PERFLOG.md entry 57).
  template <typename Params, typename AccdQ>
  __device__ static void add_dq(const Params& params, const AccdQ& acc_dq, int64_t row, int m, int tid) {
    // The thread's first vector, then constant steps of kNMmaThreads vectors (dq_index): one 64-bit
    // address a step, the others immediate offsets of the reductions. Indexed as dq_index(4 j, tid)
    // (an int), each reduction had an add and a widening multiply of its own.
    float4* dst = reinterpret_cast<float4*>(params.dq_accum + (row + int64_t(m) * kBlockM) * kHeadDim) +
                  dq_index<Traits>(0, tid) / 4;
    static_assert(dq_index<Traits>(4, 0) / 4 == Traits::kNMmaThreads);
    auto add = [&] {
      CUTE_UNROLL
      for (int j = 0; j < size(acc_dq) / 4; ++j)
        red_add(dst + j * Traits::kNMmaThreads,
                make_float4(acc_dq(4 * j), acc_dq(4 * j + 1), acc_dq(4 * j + 2), acc_dq(4 * j + 3)));
    };
    if (params.semaphores() != nullptr) {
      cutlass::arch::NamedBarrier::sync(kTurnThreads, int(BwdBarrier::kdQTurn));
      add();
      cutlass::arch::NamedBarrier::arrive(kTurnThreads, int(BwdBarrier::kdQAdded));
    } else {
      add();
    }
  }
};

}  // namespace cutlass_flash::sm90
