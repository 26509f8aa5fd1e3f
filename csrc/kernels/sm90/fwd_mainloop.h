// sm90 forward mainloop: the producer's TMA loads and the consumers' wgmma + softmax loop.
//
// Per tile the producer loads K[n_max-1], Q, then K[n], V[n+1] for n descending, then V[n_min]:
// the order the consumers use them in. Iteration n of a consumer warpgroup (64 query rows) issues
// S_n = Q K_n^T and O += P_{n+1} V_{n+1} back to back, then computes the softmax of S_n while the
// P V GEMM runs (FlashAttention-3's intra-warpgroup overlap; it holds with P staged in shared
// memory, mma_p_smem: with P in registers ptxas waits for P V before the exponentials). Across
// warpgroups, named barriers let one warpgroup issue its GEMMs while the other runs its
// exponentials (ping-pong), so the tensor cores stay busy through the softmax.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "kernels/common/mask.h"
#include "kernels/common/softmax.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/utils.h"

namespace cutlass_flash::sm90 {

using namespace cute;

// Ping-pong of GEMM issue between consumer warpgroups. Warpgroup w waits on its barrier before
// issuing and, after issuing, arrives on every other warpgroup's barrier; a barrier completes with
// w's 128 threads plus one arrival of each other warpgroup, so issue goes round-robin.
template <int kNMmaWarpGroups>
struct WarpScheduler {
  static constexpr int kThreads = kNMmaWarpGroups * 128;
  int wg;  // consumer warpgroup index, 0-based

  __device__ static int barrier(int w) { return int(FwdBarrier::kWarpSchedulerWG1) + w; }

  // Warpgroup w starts with the arrivals of every later warpgroup, so warpgroup 0 issues first.
  __device__ void init() const {
    for (int w = 0; w < wg; ++w) cutlass::arch::NamedBarrier::arrive(kThreads, barrier(w));
  }
  __device__ void sync() const { cutlass::arch::NamedBarrier::sync(kThreads, barrier(wg)); }
  __device__ void arrive() const {
    CUTE_UNROLL
    for (int d = 1; d < kNMmaWarpGroups; ++d)
      cutlass::arch::NamedBarrier::arrive(kThreads, barrier((wg + d) % kNMmaWarpGroups));
  }
};

template <typename Traits>
struct FwdMainloop {
  using Element = typename Traits::Element;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename PipelineKV::PipelineState;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  // ---- producer (one thread) ----

  struct ProducerState {
    PipelineState k = cutlass::make_producer_start_state<PipelineKV>();
    PipelineState v = cutlass::make_producer_start_state<PipelineKV>();
    int tiles = 0;  // tiles with at least one key block loaded so far
  };

  template <typename TmaCopy, typename TensorG, typename TensorS>
  __device__ __forceinline__ static void load_kv(const TmaCopy& tma, PipelineKV& pipeline, PipelineState& state,
                                 const TensorG& g, TensorS& s, int n_block) {
    pipeline.producer_acquire(state);
    copy(tma.with(*pipeline.producer_get_barrier(state), 0), g(_, n_block), s(_, state.index()));
    ++state;
  }

  template <typename Params>
  __device__ __forceinline__ static void load(const Params& params, typename Traits::SharedStorage& shared, PipelineKV& pipeline_k,
                              PipelineKV& pipeline_v, ProducerState& st, const TileCoord& tile, int n_min,
                              int n_max) {
    const AttnProblem& p = params.problem;
    const int head_kv = tile.head / (p.nheads / p.nheads_kv);
    Tensor mQ = params.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.nheads, p.batch));
    Tensor mK = params.tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.nheads_kv, p.batch));
    Tensor mV = params.tma_v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.nheads_kv, p.batch));
    // Q as 64-row slabs, one per consumer warpgroup: (64, d, slab)
    Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), Shape<_64, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gK = local_tile(mK(_, _, head_kv, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor gV = local_tile(mV(_, _, head_kv, tile.batch), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(shared.qo.data()), typename Traits::SmemLayoutSlab{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));

    load_kv(params.tma_k, pipeline_k, st.k, tKgK, tKsK, n_max - 1);
    // Q of the previous tile must be free: its last S GEMM done (or, with O in its place, O stored).
    if (st.tiles > 0) shared.q_empty.wait((st.tiles - 1) & 1);
    shared.q_full.arrive_and_expect_tx(Traits::kQBytes);
    CUTE_UNROLL
    for (int w = 0; w < Traits::kNMmaWarpGroups; ++w) {
      Tensor dst = make_tensor(tQsQ.data() + w * Traits::kSlabElems, tQsQ.layout());
      copy(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full), 0),
           tQgQ(_, tile.block * Traits::kNMmaWarpGroups + w), dst);
    }
    for (int n = n_max - 2; n >= n_min; --n) {
      load_kv(params.tma_k, pipeline_k, st.k, tKgK, tKsK, n);
      load_kv(params.tma_v, pipeline_v, st.v, tVgV, tVsV, n + 1);
    }
    load_kv(params.tma_v, pipeline_v, st.v, tVgV, tVsV, n_min);
    ++st.tiles;
  }

  // ---- consumers (one warpgroup each) ----

  struct ConsumerState {
    PipelineState k, v;
    int tiles = 0;
  };

  // S of a tile's first (highest) key block: issued in this warpgroup's ping-pong turn and waited
  // for (no P V is pending yet); the K stage is released.
  template <typename TiledMma, typename TensorQ, typename TensorK, typename TensorS>
  __device__ __forceinline__ static void first_s_gemm(TiledMma& mma, const TensorQ& tSrQ, const TensorK& tSrK,
                                                      TensorS& tSrS, PipelineKV& pipeline_k, ConsumerState& st,
                                                      const WarpScheduler<Traits::kNMmaWarpGroups>& scheduler) {
    pipeline_k.consumer_wait(st.k);
    scheduler.sync();
    gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma, tSrQ, tSrK(_, _, _, st.k.index()), tSrS);
    scheduler.arrive();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipeline_k.consumer_release(st.k);
    ++st.k;
  }

  // Computes the unnormalised O (acc_o) of warpgroup `wg`'s 64 rows of the tile and their
  // softmax statistics. `tid` is the thread's index in its warpgroup.
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void mma(typename Traits::SharedStorage& shared, PipelineKV& pipeline_k,
                                             PipelineKV& pipeline_v, ConsumerState& st,
                                             const WarpScheduler<Traits::kNMmaWarpGroups>& scheduler,
                                             const WindowMask& mask, int m_block, int n_min, int n_max, int wg,
                                             int tid, AccO& acc_o, Softmax& softmax) {
    if constexpr (Traits::kPInSmem) {
      mma_p_smem(shared, pipeline_k, pipeline_v, st, scheduler, mask, m_block, n_min, n_max, wg, tid, acc_o, softmax);
    } else {
      mma_p_registers(shared, pipeline_k, pipeline_v, st, scheduler, mask, m_block, n_min, n_max, wg, tid, acc_o,
                      softmax);
    }
  }

  // P from registers (RS wgmma).
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void mma_p_registers(typename Traits::SharedStorage& shared,
                                                         PipelineKV& pipeline_k, PipelineKV& pipeline_v,
                                                         ConsumerState& st,
                                                         const WarpScheduler<Traits::kNMmaWarpGroups>& scheduler,
                                                         const WindowMask& mask, int m_block, int n_min, int n_max,
                                                         int wg, int tid, AccO& acc_o, Softmax& softmax) {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    Tensor sQ = make_tensor(make_smem_ptr(shared.qo.data() + wg * Traits::kSlabElems), typename Traits::SmemLayoutSlab{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // wgmma descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, N, K, stage)
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
    Tensor acc_o_rc = rowcol_view(acc_o);
    const int row_offset = m_block * kBlockM + wg * 64;

    // P of the previous key block, as the register A operand of its P V GEMM.
    using FragS = decltype(partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{}));
    Tensor tOrP = make_tensor<Element>(acc_as_a_layout(FragS{}.layout()));
    auto to_p = [&](auto& tSrS) {
      Tensor p = convert_type<Element>(tSrS);
      copy(make_tensor(p.data(), acc_as_a_layout(tSrS.layout())), tOrP);
    };
    // Whether key block n needs element-wise masking for any row of the tile (one uniform test).
    auto needs_mask = [&](int n) { return mask.block_needs_mask<kBlockM, kBlockN>(m_block, n); };
    auto scores = [&](auto& tSrS, int n_block, bool masked) {
      if (masked) mask.apply(tSrS, tScS, row_offset, n_block * kBlockN);
    };

    shared.q_full.wait(st.tiles & 1);
    // First (highest) key block: S only; its P V waits for the next iteration.
    int n_block = n_max - 1;
    {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
      first_s_gemm(mma_qk, tSrQ, tSrK, tSrS, pipeline_k, st, scheduler);
      scores(tSrS, n_block, needs_mask(n_block));
      Tensor s_rc = rowcol_view(tSrS);
      softmax.template max_and_exp</*kFirst=*/true>(s_rc);
      to_p(tSrS);
    }
    auto correction = make_tensor<float>(Shape<Int<Softmax::kRows>>{});
    fill(correction, 1.f);
    for (--n_block; n_block >= n_min; --n_block) {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
      pipeline_k.consumer_wait(st.k);
      scheduler.sync();
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, st.k.index()), tSrS);
      Softmax::rescale(acc_o_rc, correction);
      pipeline_v.consumer_wait(st.v);
      gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma_pv, tOrP, tOrV(_, _, _, st.v.index()), acc_o);
      scheduler.arrive();
      warpgroup_wait<1>();  // S done; P V still running
      warpgroup_fence_operand(tSrS);  // reads of S stay below the wait
      pipeline_k.consumer_release(st.k);
      ++st.k;
      scores(tSrS, n_block, needs_mask(n_block));
      Tensor s_rc = rowcol_view(tSrS);
      correction = softmax.template max_and_exp</*kFirst=*/false>(s_rc);
      // ptxas places this wait at the top of its basic block (after the mask branch), ahead of
      // the exponentials, so today P V does not overlap the softmax of its own warpgroup, only
      // the other warpgroup's (PERFLOG.md, entry 10).
      warpgroup_wait<0>();
      pipeline_v.consumer_release(st.v);
      ++st.v;
      to_p(tSrS);
    }
    // Q has no reader left in this tile.
    if constexpr (!Traits::kOAliasesQ) shared.q_empty.arrive();
    Softmax::rescale(acc_o_rc, correction);
    pipeline_v.consumer_wait(st.v);
    gemm</*kZeroInit=*/false, /*kWait=*/0>(mma_pv, tOrP, tOrV(_, _, _, st.v.index()), acc_o);
    pipeline_v.consumer_release(st.v);
    ++st.v;
    ++st.tiles;
  }

  // P staged in shared memory (SS wgmma), two buffers per warpgroup. Step n retires the previous
  // P V (wait<0>) and rescales O, issues S_n and P_{n+1} V_{n+1} (from one buffer) back to back,
  // then runs the softmax of S_n and writes P_n into the other buffer while P V runs. No wgmma
  // wait follows the softmax inside its step, so ptxas cannot hoist one above the exponentials
  // (PERFLOG.md, entry 10); no register operand of a running wgmma is written (ptxas C7513) and O
  // is read only with no wgmma in flight (C7514).
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void mma_p_smem(typename Traits::SharedStorage& shared, PipelineKV& pipeline_k,
                                                    PipelineKV& pipeline_v, ConsumerState& st,
                                                    const WarpScheduler<Traits::kNMmaWarpGroups>& scheduler,
                                                    const WindowMask& mask, int m_block, int n_min, int n_max, int wg,
                                                    int tid, AccO& acc_o, Softmax& softmax) {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    Tensor sQ = make_tensor(make_smem_ptr(shared.qo.data() + wg * Traits::kSlabElems), typename Traits::SmemLayoutSlab{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});
    Tensor sP = make_tensor(make_smem_ptr(shared.p.data() + wg * int(cosize_v<typename Traits::SmemLayoutP>)),
                            typename Traits::SmemLayoutP{});  // (64, N, 2)
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);
    Tensor tSrK = thr_qk.partition_fragment_B(sK);
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);
    Tensor tOsP = thr_pv.partition_fragment_A(sP);  // (MMA, M, K, buffer) descriptors
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
    Tensor acc_o_rc = rowcol_view(acc_o);
    const int row_offset = m_block * kBlockM + wg * 64;
    auto copy_p = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_qk);
    auto thr_copy_p = copy_p.get_thread_slice(tid);
    Tensor tPsP = thr_copy_p.partition_D(sP);  // (CPY, M, N, buffer)
    const int p_barrier = int(FwdBarrier::kEpilogueWG1) + wg;

    auto needs_mask = [&](int n) { return mask.block_needs_mask<kBlockM, kBlockN>(m_block, n); };
    auto apply_mask = [&](auto& tSrS, int n) { mask.apply(tSrS, tScS, row_offset, n * kBlockN); };
    // The warpgroup's P must be complete in shared memory, and visible to the tensor cores,
    // before any of its threads issues the GEMM that reads it.
    auto write_p = [&](auto& tSrS, int buf) CUTLASS_LAMBDA_FUNC_INLINE {
      Tensor rP = convert_type<Element>(tSrS);
      copy(copy_p, thr_copy_p.retile_S(rP), tPsP(_, _, _, buf));
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(128, p_barrier);
    };

    shared.q_full.wait(st.tiles & 1);
    int n_block = n_max - 1, buf = 0;
    {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
      first_s_gemm(mma_qk, tSrQ, tSrK, tSrS, pipeline_k, st, scheduler);
      if (needs_mask(n_block)) apply_mask(tSrS, n_block);
      Tensor s_rc = rowcol_view(tSrS);
      softmax.template max_and_exp</*kFirst=*/true>(s_rc);
      write_p(tSrS, buf);
    }
    auto correction = make_tensor<float>(Shape<Int<Softmax::kRows>>{});
    fill(correction, 1.f);
    bool pv_in_flight = false;
    PipelineState v_in_flight;
    auto step = [&](int n, auto masked) CUTLASS_LAMBDA_FUNC_INLINE {
      warpgroup_wait<0>();  // the previous P V (it ran during the last softmax): O is free
      warpgroup_fence_operand(acc_o);
      if (pv_in_flight) pipeline_v.consumer_release(v_in_flight);
      Softmax::rescale(acc_o_rc, correction);
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
      pipeline_k.consumer_wait(st.k);
      scheduler.sync();
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, st.k.index()), tSrS);
      pipeline_v.consumer_wait(st.v);
      gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma_pv, tOsP(_, _, _, buf), tOrV(_, _, _, st.v.index()), acc_o);
      v_in_flight = st.v;
      pv_in_flight = true;
      ++st.v;
      scheduler.arrive();
      warpgroup_wait<1>();  // S done; P V still running
      warpgroup_fence_operand(tSrS);
      pipeline_k.consumer_release(st.k);
      ++st.k;
      if constexpr (decltype(masked)::value) apply_mask(tSrS, n);
      Tensor s_rc = rowcol_view(tSrS);
      correction = softmax.template max_and_exp</*kFirst=*/false>(s_rc);
      buf ^= 1;
      write_p(tSrS, buf);  // the other buffer: its last reader was retired above
    };
    // Blocks needing a mask come first (the diagonal and the end of the keys) and, with a left
    // window edge, last; the middle ones run the unmasked body.
    for (--n_block; n_block >= n_min && needs_mask(n_block); --n_block) step(n_block, cute::true_type{});
    for (; n_block >= n_min && !needs_mask(n_block); --n_block) step(n_block, cute::false_type{});
    for (; n_block >= n_min; --n_block) step(n_block, cute::true_type{});
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    if (pv_in_flight) pipeline_v.consumer_release(v_in_flight);
    if constexpr (!Traits::kOAliasesQ) shared.q_empty.arrive();  // Q has no reader left
    Softmax::rescale(acc_o_rc, correction);
    pipeline_v.consumer_wait(st.v);
    gemm</*kZeroInit=*/false, /*kWait=*/0>(mma_pv, tOsP(_, _, _, buf), tOrV(_, _, _, st.v.index()), acc_o);
    pipeline_v.consumer_release(st.v);
    ++st.v;
    ++st.tiles;
  }
};

}  // namespace cutlass_flash::sm90
