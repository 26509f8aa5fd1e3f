// sm90 forward mainloop: the producer's TMA loads and the consumers' wgmma + softmax loop.
//
// Per tile the producer publishes the tile (its index and Q, through q_full[w] per consumer
// warpgroup w) and loads K[n_max-1], then K[n], V[n+1] for n descending, then V[n_min]: the order
// the consumers use them in.
// Iteration n of a consumer warpgroup (64 query rows) issues S_n = Q K_n^T and
// O += P_{n+1} V_{n+1} back to back, then computes the softmax of S_n while the P V GEMM runs
// (FlashAttention-3's intra-warpgroup overlap, pinned in place by warpgroup_wait_all_after, see
// utils.h). Across warpgroups, named barriers let one warpgroup issue its GEMMs while the other
// runs its exponentials (ping-pong), so the tensor cores stay busy through the softmax. Where
// Traits::kLoopPingPong is off, only a tile's first S GEMM goes in turn (so the warpgroups start
// the tile half a GEMM apart), the loop's GEMMs are issued as each warpgroup gets to them, and P
// alternates between two register buffers, so that a step's P V GEMM runs under its whole softmax
// (the step waits for the previous one's behind its own S GEMM).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "kernels/common/score_policy.h"
#include "kernels/common/softmax.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/utils.h"

namespace cutlass_flash::sm90 {

using namespace cute;

// Ping-pong of GEMM issue between consumer warpgroups. Warpgroup w waits on its barrier before
// issuing and, after issuing, arrives on every other warpgroup's barrier; a barrier completes with
// w's 128 threads plus one arrival of each other warpgroup, so issue goes round-robin.
template <int kNMmaWarpGroups>
struct PingPong {
  static constexpr int kThreads = kNMmaWarpGroups * 128;
  int wg;  // consumer warpgroup index, 0-based

  __device__ static int barrier(int w) { return int(FwdBarrier::kPingPongWG1) + w; }

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

// Features: the score modifiers compiled in (common/score_policy.h); without the probability
// stage where Traits::kProbsKernel gives it a kernel of its own.
template <typename Traits_, typename Features_ = AllScoreFeatures>
struct FwdMainloop {
  using Traits = Traits_;
  using Features = Features_;
  using Score = ScorePolicy<Features>;
  using Element = typename Traits::Element;
  using PipelineKV = typename Traits::PipelineKV;
  using PipelineState = typename PipelineKV::PipelineState;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;

  // ---- producer: two threads of warpgroup 0 ----
  //
  // The tile thread claims tiles (sm90/tile_scheduler.h), hands each tile's key range to the K/V
  // thread and publishes the tile to the consumers with its Q; the K/V thread streams K and V
  // through the pipelines. One thread doing both spilled its 24 registers once tiles were claimed
  // from a global counter.

  struct KVState {
    PipelineState k = cutlass::make_producer_start_state<PipelineKV>();
    PipelineState v = cutlass::make_producer_start_state<PipelineKV>();
  };

  // Tile thread: publishes the i-th tile of this block once the consumers are done with the
  // previous tile's Q: its coordinates and key-block range, decoded here once so that the
  // consumers hold nothing of the tile order across their tile loop (decoding it themselves, the
  // d = 256 consumers spilled the tile count: PERFLOG 65), and Q when the tile has keys. An end
  // marker (coord.block < 0) ends the consumers' loop.
  //
  // Each warpgroup reads only its own 64-row slab of Q, so each slab has its barriers (q_full[w],
  // q_empty[w]) and loads as soon as its warpgroup has released the previous tile's: the first
  // warpgroup, half a ping-pong step ahead, does not wait for the last one's last S GEMM. The tile
  // (`tile[i & 1]`) is written once its buffer's previous tile, i - 2, has been read by every
  // warpgroup: warpgroup 0 has released tile i - 1 (waited for here), and every other warpgroup
  // tile i - 2 (waited for when tile i - 1 was published).
  template <typename Params>
  __device__ __forceinline__ static void publish(const Params& params, typename Traits::SharedStorage& shared, int i,
                                                 const TileWork& w) {
    const bool loads_q = w.coord.block >= 0 && w.n_min < w.n_max;
    const TileCoord& tile = w.coord;
    const AttnProblem& p = params.problem;
    // Q as 64-row slabs, one per consumer warpgroup: (64, d, slab)
    Tensor gQ = local_tile(sequence_rows<true>(params.tma_q, p, SeqInfo(p, tile.batch), tile.head),
                           Shape<_64, Int<kHeadDim>>{}, make_coord(_, _0{}));
    Tensor sQ = make_tensor(make_smem_ptr(shared.qo.data()), typename Traits::SmemLayoutSlab{});
    auto [tQgQ, tQsQ] = tma_partition(params.tma_q, _0{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    CUTE_UNROLL
    for (int wg = 0; wg < Traits::kNMmaWarpGroups; ++wg) {
      if (i > 0) shared.q_empty[wg].wait((i - 1) & 1);
      if (wg == 0) shared.tile[i & 1] = w;
      if (!loads_q) {
        shared.q_full[wg].arrive();
        continue;
      }
      shared.q_full[wg].arrive_and_expect_tx(Traits::kQBytes / Traits::kNMmaWarpGroups);
      Tensor dst = make_tensor(tQsQ.data() + wg * Traits::kSlabElems, tQsQ.layout());
      copy(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.q_full[wg]), 0, kEvictFirst),
           tQgQ(_, tile.block * Traits::kNMmaWarpGroups + wg), dst);
    }
  }

  template <typename TmaCopy, typename TensorG, typename TensorS>
  __device__ __forceinline__ static void load_stage(const TmaCopy& tma, PipelineKV& pipeline, PipelineState& state,
                                                    const TensorG& g, TensorS& s, int n_block) {
    pipeline.producer_acquire(state);
    copy(tma.with(*pipeline.producer_get_barrier(state), 0, kEvictLast), g(_, n_block), s(_, state.index()));
    ++state;
  }

  // K/V thread: K[n_max-1], then K[n], V[n+1] for n descending, then V[n_min]. With O staged in
  // V's stages (Traits::kOInV) before_v (the previous tile's O stores) runs before the tile's first
  // V, after its first two K blocks.
  template <typename Params, typename BeforeV>
  __device__ __forceinline__ static void load_kv(const Params& params, typename Traits::SharedStorage& shared,
                                                 PipelineKV& pipeline_k, PipelineKV& pipeline_v, KVState& st,
                                                 const TileCoord& tile, int n_min, int n_max, BeforeV&& before_v) {
    const AttnProblem& p = params.problem;
    const int head_kv = tile.head / (p.nheads / p.nheads_kv);
    const SeqInfo seq(p, tile.batch);
    Tensor gK = local_tile(sequence_rows<false>(params.tma_k, p, seq, head_kv), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));
    // V's width: its own head dim, else p.head_dim as K's (the kernels without one compile as
    // they did before there was one: a constant here moved their uniform registers around).
    Tensor gV = local_tile(sequence_rows<false>(params.tma_v, p, seq, head_kv, kHeadDimV == kHeadDim ? 0 : kHeadDimV),
                           Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(_, _0{}));
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    load_stage(params.tma_k, pipeline_k, st.k, tKgK, tKsK, n_max - 1);
    int n = n_max - 2;
    if constexpr (Traits::kOInV) {
      if (n >= n_min) load_stage(params.tma_k, pipeline_k, st.k, tKgK, tKsK, n);
      before_v();
      if (n >= n_min) {
        load_stage(params.tma_v, pipeline_v, st.v, tVgV, tVsV, n + 1);
        --n;
      }
    }
#pragma unroll 1
    for (; n >= n_min; --n) {
      load_stage(params.tma_k, pipeline_k, st.k, tKgK, tKsK, n);
      load_stage(params.tma_v, pipeline_v, st.v, tVgV, tVsV, n + 1);
    }
    load_stage(params.tma_v, pipeline_v, st.v, tVgV, tVsV, n_min);
  }

  // ---- consumers (one warpgroup each) ----

  struct ConsumerState {
    PipelineState k, v;
    int tiles = 0;  // tiles received so far (phases of q_full)
  };

  // Where the tile just computed stages its O (FwdEpilogue::OSlot, kOInV): with two stages the
  // stage of the V block before the tile's last (st.v - 2: the same index, the other parity), which
  // is also where the next tile's first V loads.
  template <typename OSlot>
  __device__ __forceinline__ static OSlot o_slot(const ConsumerState& st) {
    static_assert(!Traits::kOInOneStage || Traits::kStages == 2);
    return {int(st.v.index()), st.v.phase() ^ 1u};
  }

  // The next tile (waits for its publication; Q, if the tile has any, has landed too).
  __device__ __forceinline__ static TileWork receive(typename Traits::SharedStorage& shared, ConsumerState& st,
                                                     int wg) {
    shared.q_full[wg].wait(st.tiles & 1);
    const TileWork w = shared.tile[st.tiles & 1];
    ++st.tiles;
    return w;
  }

  // Waits for a stage and releases it unread: a key block this warpgroup's rows do not see.
  __device__ __forceinline__ static void pass_stage(PipelineKV& pipeline, PipelineState& state) {
    pipeline.consumer_wait(state);
    pipeline.consumer_release(state);
    ++state;
  }

  // S of a tile's first (highest) key block: issued in this warpgroup's ping-pong turn and waited
  // for (no P V is pending yet); the K stage is released.
  template <typename TiledMma, typename TensorQ, typename TensorK, typename TensorS>
  __device__ __forceinline__ static void first_s_gemm(TiledMma& mma, const TensorQ& tSrQ, const TensorK& tSrK,
                                                      TensorS& tSrS, PipelineKV& pipeline_k, ConsumerState& st,
                                                      const PingPong<Traits::kNMmaWarpGroups>& scheduler) {
    pipeline_k.consumer_wait(st.k);
    scheduler.sync();
    gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma, tSrQ, tSrK(_, _, _, st.k.index()), tSrS);
    scheduler.arrive();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    pipeline_k.consumer_release(st.k);
    ++st.k;
  }

  // Q has no reader left in this tile: the producer may load the next one over it.
  __device__ __forceinline__ static void release_q(typename Traits::SharedStorage& shared, int wg) {
    shared.q_empty[wg].arrive();
  }

  // A packed sequence whose keys end inside its last key block (n_max - 1): the TMA unit clips
  // rows only at the packed tensor's end, so that block's K and V hold the next sequence's first
  // rows. K's need nothing (their scores are replaced by -inf, not multiplied), but P = 0 times a
  // NaN or Inf in V is NaN: the consumers zero those V rows in shared memory before any of them
  // multiplies the block (its stage is the first V of the tile), each thread a share of the 16-byte
  // chunks, then meet at a barrier outside the ping-pong turns. Dense batches need none of it: the
  // TMA unit fills rows past seqlen_k with zeros.
  __device__ __forceinline__ static void clear_v_past_keys(typename Traits::SharedStorage& shared,
                                                           PipelineKV& pipeline_v, const ConsumerState& st,
                                                           int valid_rows, int wg, int tid) {
    pipeline_v.consumer_wait(st.v);
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
    clear_smem_rows(sV(_, _, st.v.index()), valid_rows, wg * 128 + tid, Traits::kNMmaThreads);
    cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(FwdBarrier::kVClip));
  }

  // Computes the unnormalised O (acc_o) of warpgroup `wg`'s 64 rows of the tile and their
  // softmax statistics. `tid` is the thread's index in its warpgroup. P goes from the softmax's
  // registers straight into the P V GEMM (RS wgmma).
  template <typename AccO, typename Softmax>
  __device__ __forceinline__ static void mma(typename Traits::SharedStorage& shared, PipelineKV& pipeline_k,
                                             PipelineKV& pipeline_v, ConsumerState& st,
                                             const PingPong<Traits::kNMmaWarpGroups>& scheduler, const Score& score,
                                             int m_block, int n_min, int n_max, bool packed, int wg, int tid,
                                             AccO& acc_o, Softmax& softmax) {
    const WindowMask& mask = score.mask;
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(tid);
    auto thr_pv = mma_pv.get_thread_slice(tid);
    Tensor sQ =
        make_tensor(make_smem_ptr(shared.qo.data() + wg * Traits::kSlabElems), typename Traits::SmemLayoutSlab{});
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutVt{});
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // wgmma descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, N, K, stage)
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<_64, Int<kBlockN>>{}));
    Tensor acc_o_rc = rowcol_view(acc_o);
    const int row_offset = m_block * kBlockM + wg * 64;

    // P of the previous key block, kept in convert_type's own register order and viewed as the A
    // operand of its P V GEMM. Copying it element-wise into a tensor of the A layout cost ~150
    // PRMT/LOP3/SHF per step at d = 128 (16-bit moves regrouped by the compiler).
    using FragS = decltype(partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{}));
    decltype(convert_type<Element>(FragS{})) rP;
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
    auto to_p = [&](auto& tSrS) { rP = convert_type<Element>(tSrS); };
    // Whether key block n needs element-wise masking for any row of the tile (one uniform test).
    auto needs_mask = [&](int n) { return mask.block_needs_mask<kBlockM, kBlockN>(m_block, n); };
    auto scores = [&](auto& tSrS, int n_block, bool masked) {
      score.before_softmax(tSrS, tScS, row_offset, n_block * kBlockN, masked);
    };
    // The probability stage after max_and_exp (whose row sums are those of P before it): on the
    // fp32 P while the previous P V GEMM runs, or on the 16-bit P after it (Traits::kProbsOnP16).
    constexpr int kAlign = Score::probs_align(kBlockN);
    auto probs_fp32 = [&](auto& s_rc, int n_block) {
      if constexpr (!Traits::kProbsOnP16)
        score.template fwd_probs</*kTransposed=*/false, 8, kAlign>(s_rc, rowcol_view(tScS), row_offset,
                                                                   n_block * kBlockN);
    };
    auto probs_p16 = [&](auto& p, int n_block) {
      if constexpr (Traits::kProbsOnP16)
        score.template fwd_probs16<kAlign>(rowcol_view(p), rowcol_view(tScS), row_offset, n_block * kBlockN);
    };

    // Key blocks of the tile above this warpgroup's last row (a 192-row tile spans 1.5 key blocks
    // of the diagonal at d = 64; 128 rows span 1.6 at d = 256) are not multiplied: their K and V
    // stages are waited for and released, and their ping-pong turns passed, so the pipelines and
    // the turn order stay in step with the other warpgroups.
    if (packed && n_max * kBlockN > mask.seqlen_k)
      clear_v_past_keys(shared, pipeline_v, st, mask.seqlen_k - (n_max - 1) * kBlockN, wg, tid);
    const int wg_rows_end = min(row_offset + 64, mask.seqlen_q);
    const int n_top = max(n_min + 1, min(n_max, mask.n_block_end<kBlockN>(row_offset, wg_rows_end)));
    for (int n = n_max - 1; n >= n_top; --n) {
      pass_stage(pipeline_k, st.k);
      if constexpr (Traits::kLoopPingPong) {
        scheduler.sync();
        scheduler.arrive();
      }
    }

    // First (highest) key block: S only; its P V waits for the next iteration.
    int n_block = n_top - 1;
    {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
      first_s_gemm(mma_qk, tSrQ, tSrK, tSrS, pipeline_k, st, scheduler);
      scores(tSrS, n_block, needs_mask(n_block));
      Tensor s_rc = rowcol_view(tSrS);
      softmax.template max_and_exp</*kFirst=*/true>(s_rc);
      probs_fp32(s_rc, n_block);
      to_p(tSrS);
      probs_p16(rP, n_block);
    }
    for (int n = n_max - 1; n >= n_top; --n) pass_stage(pipeline_v, st.v);
    auto correction = make_tensor<float>(Shape<Int<Softmax::kRows>>{});
    fill(correction, 1.f);
    if constexpr (!Traits::kLoopPingPong) {
      // P in two register buffers, alternating by key block: a step packs its P into the buffer
      // that the previous step's P V GEMM read, which it waits for behind its own S GEMM (before
      // the rescale of O), so its own P V GEMM runs under the whole softmax. With one buffer,
      // ptxas put the wait for P V at the top of the softmax (PERFLOG 107).
      decltype(rP) rP2;
      Tensor tOrP2 = make_tensor(rP2.data(), tOrP.layout());
      PipelineState v_busy = st.v;  // the V stage of the P V GEMM in flight, if pv_busy
      bool pv_busy = false;
      auto step = [&](auto& tOrP_in, auto& p_out) {
        Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
        pipeline_k.consumer_wait(st.k);
        gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, st.k.index()), tSrS);
        warpgroup_wait<1>();  // the previous step's P V (it read p_out); S still running
        warpgroup_fence_operand(acc_o);
        if (pv_busy) pipeline_v.consumer_release(v_busy);
        Softmax::rescale(acc_o_rc, correction);
        pipeline_v.consumer_wait(st.v);
        gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma_pv, tOrP_in, tOrV(_, _, _, st.v.index()), acc_o);
        v_busy = st.v;
        pv_busy = true;
        ++st.v;
        warpgroup_wait<1>();            // S done; P V still running
        warpgroup_fence_operand(tSrS);  // reads of S stay below the wait
        pipeline_k.consumer_release(st.k);
        ++st.k;
        scores(tSrS, n_block, needs_mask(n_block));
        Tensor s_rc = rowcol_view(tSrS);
        correction = softmax.template max_and_exp</*kFirst=*/false>(s_rc);
        probs_fp32(s_rc, n_block);
        p_out = convert_type<Element>(tSrS);
        probs_p16(p_out, n_block);
      };
      auto last_pv = [&](auto& tOrP_last) {
        release_q(shared, wg);
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_o);
        if (pv_busy) pipeline_v.consumer_release(v_busy);
        Softmax::rescale(acc_o_rc, correction);
        pipeline_v.consumer_wait(st.v);
        gemm</*kZeroInit=*/false, /*kWait=*/0>(mma_pv, tOrP_last, tOrV(_, _, _, st.v.index()), acc_o);
        pipeline_v.consumer_release(st.v);
        ++st.v;
      };
      for (--n_block;;) {
        if (n_block < n_min) {
          last_pv(tOrP);
          break;
        }
        step(tOrP, rP2);
        --n_block;
        if (n_block < n_min) {
          last_pv(tOrP2);
          break;
        }
        step(tOrP2, rP);
        --n_block;
      }
      return;
    }
    // With ping-pong: one P buffer, the loop's GEMMs issued in turn.
    for (--n_block; n_block >= n_min; --n_block) {
      Tensor tSrS = partition_fragment_C(mma_qk, Shape<_64, Int<kBlockN>>{});
      pipeline_k.consumer_wait(st.k);
      scheduler.sync();
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, st.k.index()), tSrS);
      Softmax::rescale(acc_o_rc, correction);
      pipeline_v.consumer_wait(st.v);
      gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma_pv, tOrP, tOrV(_, _, _, st.v.index()), acc_o);
      scheduler.arrive();
      warpgroup_wait<1>();            // S done; P V still running
      warpgroup_fence_operand(tSrS);  // reads of S stay below the wait
      pipeline_k.consumer_release(st.k);
      ++st.k;
      scores(tSrS, n_block, needs_mask(n_block));
      Tensor s_rc = rowcol_view(tSrS);
      correction = softmax.template max_and_exp</*kFirst=*/false>(s_rc);
      probs_fp32(s_rc, n_block);
      // P V ran behind the exponentials; it must be done before its P registers are rewritten.
      warpgroup_wait_all_after(softmax.row_sum(0) + softmax.row_sum(Softmax::kRows - 1));
      pipeline_v.consumer_release(st.v);
      ++st.v;
      to_p(tSrS);
      probs_p16(rP, n_block);
    }
    release_q(shared, wg);
    Softmax::rescale(acc_o_rc, correction);
    pipeline_v.consumer_wait(st.v);
    gemm</*kZeroInit=*/false, /*kWait=*/0>(mma_pv, tOrP, tOrV(_, _, _, st.v.index()), acc_o);
    pipeline_v.consumer_release(st.v);
    ++st.v;
  }
};

}  // namespace cutlass_flash::sm90
