// sm90 backward mainloop: the producer's loads, the consumers' step over one query block, and the
// dQ thread's reduce-adds.
//
// A block's work is a list of steps, one per (query head of the kv head's group, query block that
// sees the block's keys), walked in the same order by the three roles:
//   load thread:  K, V once; per step Q + LSE and dO + D through two TMA pipelines;
//   consumers:    S^T = K Q^T, dP^T = V dO^T (issued together), P^T = exp2(S^T - LSE),
//                 dS^T = P^T (dP^T - D); dS^T to shared memory; dV += P^T dO (P^T from registers);
//                 all warpgroups' dS^T written -> dQ = dS K; dK += dS^T Q; dQ staged in fp32;
//   dQ thread:    adds each staged dQ to the workspace with one bulk reduce-add (after the lower
//                 key blocks' additions when deterministic).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "kernels/common/block_info.h"
#include "kernels/common/dq_semaphore.h"
#include "kernels/common/score_policy.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/utils.h"

namespace cutlass_flash::sm90 {

using namespace cute;

// The steps of one block: query heads [head_begin, head_begin + heads) of (batch), query blocks
// [m_min, m_max) of each, walked downwards. Every key block sees the last query blocks (a causal
// mask starts key block n at query block about 2n), so in deterministic mode, where query block
// m takes the key blocks' additions in increasing order (common/dq_semaphore.h), the blocks of a
// head start on the same query block and each waits about one addition for the one below it;
// walked upwards, key block n waited for blocks 0 .. n - 1 to walk 2n steps (0.51-0.70x the
// default order's speed, PERFLOG.md entry 19). The order of the additions, and so the bits, do
// not change.
//
// Deterministic mode under a right-bounded mask (causal, or a window with a right edge) reverses
// both: key block n's query range starts about r n blocks up (r = kBlockN / kBlockM), so walked
// upwards from its first query block, each block reaches a query block r steps after the block
// above it did, and the fixed order is decreasing n (FlashAttention-3's): the block on the
// diagonal adds first, and each block finds its turn already passed instead of waiting for the
// block below it every step (PERFLOG.md entry 61). The blocks are then launched highest first
// (bwd_kernel.h), so a block waits only for blocks started before it.
struct BwdSteps {
  int batch, head_begin, heads, m_min, m_max;  // m_min <= m_max
  int step = -1;                               // step_of(upward)

  __host__ __device__ static constexpr int step_of(bool upward) { return upward ? 1 : -1; }
  __device__ bool upward() const { return step > 0; }
  __device__ int count() const { return heads * (m_max - m_min); }
  // The walk is m = first(), first() + step, ... while m != end(). The templated forms take the
  // direction at compile time (the split-d dQ warp: as a runtime value beside its turn count's
  // loop, the direction spilled 12 B at the producer's 24 registers).
  template <bool kUpward>
  __device__ int first() const {
    return kUpward ? m_min : m_max - 1;
  }
  template <bool kUpward>
  __device__ int end() const {
    return kUpward ? m_max : m_min - 1;
  }
  __device__ int first() const { return upward() ? first<true>() : first<false>(); }
  __device__ int end() const { return upward() ? end<true>() : end<false>(); }
};

// Position of a consumer thread's i-th dQ accumulator in the fp32 staging tile (and in the
// workspace, which holds each query block as its bulk add left it): thread-major in 16-byte
// vectors, so each warp's stores cover 512 consecutive bytes, free of bank conflicts. The
// postprocess reads the tile back with the same map.
template <typename Traits>
__host__ __device__ __forceinline__ constexpr int dq_index(int i, int tid) {
  return ((i / 4) * Traits::kNMmaThreads + tid) * 4 + i % 4;
}

// A per-query statistic (LSE or D) of a step, as each thread needs it along its S^T accumulator's
// columns: query 8 j + 2 (lane % 4) + c for row qi = c + 2 j of colrow_view (the wgmma C layout),
// so each pair c = 0, 1 is two consecutive floats: one 8-byte load per pair, kBlockM / 8 of them.
// (Before the wgmma descriptors moved to uniform registers, holding these kBlockM / 4 values
// spilled at d = 128, and the lanes loaded half of them and exchanged the rest with 2 shuffles
// per value.)
template <int kBlockM>
struct QueryStats {
  float2 v[kBlockM / 8];

  __device__ explicit QueryStats(const float* stats) {
    const int lane = threadIdx.x % 32;
    CUTE_UNROLL
    for (int i = 0; i < kBlockM / 8; ++i) v[i] = *reinterpret_cast<const float2*>(stats + 8 * i + 2 * (lane % 4));
  }
  __device__ float operator()(int qi) const { return qi % 2 ? v[qi / 2].y : v[qi / 2].x; }
};

// The same for score tiles with queries as rows (BwdTraitsSplitDQueryRows): a thread's rows of
// the wgmma C layout, read one float each (two per 64-query atom). `qk`: the tile's (query, key)
// coordinates in the accumulator's row / column view.
template <int kRows>
struct RowStats {
  float v[kRows];

  template <typename Coords>
  __device__ RowStats(const float* stats, const Coords& qk) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) v[i] = stats[get<0>(qk(i, 0))];
  }
  __device__ float operator()(int qi) const { return v[qi]; }
};

// Features: the score modifiers compiled in (common/score_policy.h).
template <typename Traits_, typename Features_ = AllScoreFeatures>
struct BwdMainloop {
  using Traits = Traits_;
  using Features = Features_;
  using Score = ScorePolicy<Features>;
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Pipeline::PipelineState;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kHeadDimV = Traits::kHeadDimV;
  // sequence_rows' width of V and dO: its default (the head dim) unless V has its own.
  static constexpr int kSeqColsV = kHeadDimV == kHeadDim ? 0 : kHeadDimV;

  // ---- load threads ----

  // K and V of the block, once (the Q thread).
  template <typename Params>
  __device__ static void load_kv(const Params& params, typename Traits::SharedStorage& shared, const BwdSteps& steps,
                                 int n_block, int head_kv) {
    const AttnProblem& p = params.problem;
    const SeqInfo seq(p, steps.batch);
    Tensor gK = local_tile(sequence_rows<false>(params.tma_k, p, seq, head_kv), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(n_block, _0{}));
    Tensor gV = local_tile(sequence_rows<false>(params.tma_v, p, seq, head_kv, kSeqColsV),
                           Shape<Int<kBlockN>, Int<kHeadDimV>>{}, make_coord(n_block, _0{}));
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
    auto [tKgK, tKsK] = tma_partition(params.tma_k, _0{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVgV, tVsV] = tma_partition(params.tma_v, _0{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    shared.kv_full.arrive_and_expect_tx(Traits::kKVBytes + Traits::kVBytes);
    copy(params.tma_k.with(reinterpret_cast<uint64_t&>(shared.kv_full), 0), tKgK, tKsK);
    copy(params.tma_v.with(reinterpret_cast<uint64_t&>(shared.kv_full), 0), tVgV, tVsV);
  }

  // Streams a (query, d) tensor with its per-row statistic, one query block per step: Q with
  // LSE (one thread) or dO with D (another; kIsdO: at V's head dim). Two threads: one doing both
  // spilled its registers at the producer's 24 (the 2 x 24 + 2 x 240 budget of setmaxnreg has no
  // room for more).
  template <bool kIsdO, typename Tma>
  __device__ static void load_rows(const Tma& tma, const AttnProblem& p, int64_t rows_per_head, Pipeline& pipeline,
                                   Element* smem, float* smem_stats, const float* stats, const BwdSteps& steps) {
    using SmemLayout = std::conditional_t<kIsdO, typename Traits::SmemLayoutdO, typename Traits::SmemLayoutQ>;
    constexpr int kCols = kIsdO ? kHeadDimV : kHeadDim;
    const SeqInfo seq(p, steps.batch);
    Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
    PipelineState st = cutlass::make_producer_start_state<Pipeline>();
#pragma unroll 1
    for (int h = steps.head_begin; h < steps.head_begin + steps.heads; ++h) {
      Tensor g = local_tile(sequence_rows<true>(tma, p, seq, h, kIsdO ? kSeqColsV : 0),
                            Shape<Int<kBlockM>, Int<kCols>>{}, make_coord(_, _0{}));
      auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
      const float* row_stats = stats + seq.workspace_row(p, rows_per_head, h);
#pragma unroll 1
      for (int mb = steps.first(), end = steps.end(); mb != end; mb += steps.step) {
        pipeline.producer_acquire(st);
        uint64_t& barrier = *pipeline.producer_get_barrier(st);
        copy(tma.with(barrier, 0, kEvictLast), tg(_, mb), ts(_, st.index()));
        bulk_load(smem_stats + st.index() * kBlockM, row_stats + mb * kBlockM, Traits::kRowStatBytes, barrier);
        ++st;
      }
    }
  }

  // A packed sequence that ends inside the key block or inside query block m: the TMA unit clips
  // rows only at the packed tensor's end, so the rows past the sequence are the next one's (or
  // the padding's). Their scores are masked (keys) or meet LSE = +inf and D = 0 (queries), but
  // a NaN or Inf there would still reach dQ, dK and dV through 0 x NaN in the GEMMs: every
  // consumer thread zeroes a share of those rows of K and V (once, after they land) and of Q and
  // dO (in the step of the sequence's last query block, before its GEMMs, where no other barrier
  // of the step is pending), then all meet at kClearRows. Dense batches need none of it: the TMA
  // unit fills rows past the tensor with zeros.
  __device__ static void clear_kv_past(typename Traits::SharedStorage& shared, const WindowMask& mask, int n_block,
                                       int tid) {
    const int valid = mask.seqlen_k - n_block * kBlockN;
    clear_smem_rows(make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{}), valid, tid,
                    Traits::kNMmaThreads);
    clear_smem_rows(make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{}), valid, tid,
                    Traits::kNMmaThreads);
    cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(BwdBarrier::kClearRows));
  }
  __device__ static void clear_rows_past(typename Traits::SharedStorage& shared, Pipeline& pipeline_q,
                                         const PipelineState& st_q, Pipeline& pipeline_do, const PipelineState& st_do,
                                         const WindowMask& mask, int m, int tid) {
    const int valid = mask.seqlen_q - m * kBlockM;
    pipeline_q.consumer_wait(st_q);
    clear_smem_rows(make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{})(_, _, st_q.index()),
                    valid, tid, Traits::kNMmaThreads);
    pipeline_do.consumer_wait(st_do);
    clear_smem_rows(
        make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutdO{})(_, _, st_do.index()), valid,
        tid, Traits::kNMmaThreads);
    cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(BwdBarrier::kClearRows));
  }

  // The first row of this key block's dQ group's copy of query head h in the workspace
  // (BwdWorkspace::dq_group_row; the group is 0 unless deterministic).
  template <typename Params>
  __device__ static int64_t dq_row(const Params& params, const BwdSteps& steps, int h, int n_block) {
    return SeqInfo(params.problem, steps.batch).workspace_row(params.problem, params.rows_per_head, h) +
           (n_block % params.dq_groups) * params.dq_group_rows;
  }

  // ---- dQ warp ----

  // Its lane 0 is the dQ thread.
  template <typename Params>
  __device__ static void dq_warp(const Params&, typename Traits::SharedStorage& shared, const BwdSteps& steps,
                                 const WindowMask&, int) {
    if (threadIdx.x % 32 == 0) store_dq(shared, steps.count());
  }

  // Adds each step's staged dQ where the consumers' dq_target says: the thread keeps no address
  // arithmetic or mask of its own (it spilled at the producer's 24 registers when it did).
  __device__ static void store_dq(typename Traits::SharedStorage& shared, int num_steps) {
    constexpr uint32_t kBytes = Traits::kdQElems * sizeof(float);
#pragma unroll 1
    for (int i = 0; i < num_steps; ++i) {
      const int buf = i % Traits::kdQBuffers;
      shared.dq_full[buf].wait((i / Traits::kdQBuffers) & 1);
      const DqTarget target = shared.dq_target[buf];
      const float* staged = shared.dq.data() + buf * Traits::kdQElems;
      if (target.semaphore != nullptr) {
        DqSemaphore::wait(target.semaphore, target.turn);
        fence_proxy_async_global();  // the lower blocks' additions come before this one
        bulk_reduce_add(target.dst, staged, kBytes);
        bulk_wait_all</*kRead=*/false>();
        fence_proxy_async_global();
        DqSemaphore::signal(target.semaphore);
      } else {
        bulk_reduce_add(target.dst, staged, kBytes);
        bulk_wait_all</*kRead=*/true>();
      }
      shared.dq_empty[buf].arrive();
    }
  }

  // ---- consumers ----

  // The wgmma operands every layout reads from shared memory, as descriptors: (K, Q by stage, V,
  // dO by stage) of S^T = K Q^T and dP^T = V dO^T (or of S = Q K^T and dP = dO V^T, where queries
  // are the rows), and (dS by buffer, K^T) of dQ = dS K.
  template <typename ThrSdP, typename ThrdQ>
  __device__ static auto score_and_dq_operands(const ThrSdP& thr_sdp, const ThrdQ& thr_dq,
                                               typename Traits::SharedStorage& shared) {
    Tensor sK = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(shared.v.data()), typename Traits::SmemLayoutV{});
    Tensor sKt = make_tensor(make_smem_ptr(shared.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sQ = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutdO{});
    Tensor sdS = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdS{});
    if constexpr (Traits::kScoresTransposed)
      return cute::make_tuple(thr_sdp.partition_fragment_A(sK), thr_sdp.partition_fragment_B(sQ),
                              thr_sdp.partition_fragment_A(sV), thr_sdp.partition_fragment_B(sdO),
                              thr_dq.partition_fragment_A(sdS), thr_dq.partition_fragment_B(sKt));
    else
      return cute::make_tuple(thr_sdp.partition_fragment_B(sK), thr_sdp.partition_fragment_A(sQ),
                              thr_sdp.partition_fragment_B(sV), thr_sdp.partition_fragment_A(sdO),
                              thr_dq.partition_fragment_A(sdS), thr_dq.partition_fragment_B(sKt));
  }

  // A step's score tile (S^T or S, Traits::kScoresTransposed) viewed as (query, key).
  template <typename Tensor>
  __device__ static auto query_key_view(Tensor&& t) {
    if constexpr (Traits::kScoresTransposed)
      return colrow_view(t);
    else
      return rowcol_view(t);
  }

  // A per-query statistic (LSE or D) of the step along query_key_view's rows; stats: the
  // warpgroup's first query's (kStatQueries of them), coords: the score tile's coordinates.
  template <int kStatQueries, typename Coords>
  __device__ static auto query_stats(const float* stats, const Coords& coords) {
    if constexpr (Traits::kScoresTransposed)
      return QueryStats<kStatQueries>(stats);
    else
      return RowStats<decltype(size<0>(rowcol_view(coords)))::value>(stats, rowcol_view(coords));
  }

  // The values of a head that its steps hold (Traits::kHoldsFeatureValues; ScorePolicy::HeadValues).
  using HeadValues = typename Score::template HeadValues<Traits::kHoldsFeatureValues>;

  // The first half of a consumer step, shared by every layout: S^T = K Q^T and dP^T = V dO^T
  // (or S and dP, Traits::kScoresTransposed) issued together (after their stage's loads), then in
  // their accumulators P^T = exp2(S^T * scale_log2 - LSE) under the mask and the score policy's
  // stages, while dP^T is computed, and dS^T = P^T (dP^T - D) with the policy's factors; P^T
  // leaves as the dV GEMM takes it (ScorePolicy::probs_for_dv). stats_offset: this warpgroup's
  // first query in the step's LSE and D (kStatQueries of them); head: the head's held values.
  template <int kStatQueries, typename TiledMma, typename FragK, typename FragQ, typename FragV, typename FragdO,
            typename Acc, typename Coords>
  __device__ static void scores(TiledMma& mma_sdp, const FragK& tSrK, const FragQ& tSrQ, const FragV& tdPrV,
                                const FragdO& tdPrdO, Pipeline& pipeline_q, const PipelineState& st_q,
                                Pipeline& pipeline_do, const PipelineState& st_do,
                                typename Traits::SharedStorage& shared, int stats_offset, const Score& score,
                                HeadValues head, const Coords& tScS, int m, int n_block, float scale_log2, Acc& acc_s,
                                Acc& acc_dp) {
    constexpr bool kT = Traits::kScoresTransposed;
    pipeline_q.consumer_wait(st_q);
    if constexpr (kT)
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tSrK, tSrQ(_, _, _, st_q.index()), acc_s);
    else
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tSrQ(_, _, _, st_q.index()), tSrK, acc_s);
    pipeline_do.consumer_wait(st_do);
    if constexpr (kT)
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tdPrV, tdPrdO(_, _, _, st_do.index()), acc_dp);
    else
      gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tdPrdO(_, _, _, st_do.index()), tdPrV, acc_dp);
    warpgroup_wait<1>();  // S^T done, dP^T running
    warpgroup_fence_operand(acc_s);
    typename Score::template Held<Traits::kHoldsFeatureValues, decltype(size(acc_s))::value> held(score);
    score.template before_softmax<kT>(acc_s, tScS, m * kBlockM, n_block * kBlockN,
                                      score.mask.template block_needs_mask<kBlockM, kBlockN>(m, n_block), held, head);
    Tensor s = query_key_view(acc_s);
    const auto lse = query_stats<kStatQueries>(shared.lse_log2.data() + st_q.index() * kBlockM + stats_offset, tScS);
    CUTE_UNROLL
    for (int qi = 0; qi < size<0>(s); ++qi) {
      const float lse_q = lse(qi);
      CUTE_UNROLL
      for (int ki = 0; ki < size<1>(s); ++ki) s(qi, ki) = exp2f(s(qi, ki) * scale_log2 - lse_q);
    }
    // On P in place while dP^T runs.
    score.template bwd_probs<kT, 8, 32>(s, query_key_view(tScS), m * kBlockM, n_block * kBlockN);
    warpgroup_wait<0>();  // dP^T done
    warpgroup_fence_operand(acc_dp);
    Tensor ds = query_key_view(acc_dp);
    const auto dpsum = query_stats<kStatQueries>(shared.dpsum.data() + st_do.index() * kBlockM + stats_offset, tScS);
    // The LSE, where a factor needs it, loaded again from shared memory (still this stage's: Q's
    // stage is released after the dK GEMM) rather than held through the dP^T wait: at d = 64 (128
    // queries per step) holding it spilled 216 B, in every call, the factor on or not.
    score.scores_grad(s, ds, [&](int qi) { return dpsum(qi); }, [&] {
      return query_stats<kStatQueries>(shared.lse_log2.data() + st_q.index() * kBlockM + stats_offset, tScS);
    }, acc_dp, held);
    score.probs_for_dv(acc_s);
  }

  // Runs every step of the block for consumer thread `tid` (0 .. kNMmaThreads) and leaves its
  // unscaled dK and its dV in acc_dk, acc_dv. kPacked: the kernel takes packed batches (the rows
  // past a sequence cleared; compiled out of the dense kernel).
  template <bool kPacked, typename Params, typename AccK, typename AccV>
  __device__ static void mma(const Params& params, typename Traits::SharedStorage& shared, Pipeline& pipeline_q,
                             Pipeline& pipeline_do, const BwdSteps& steps, const WindowMask& mask, int n_block, int tid,
                             AccK& acc_dk, AccV& acc_dv) {
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmadKV mma_dkv;
    typename Traits::TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    // The shared-memory operands (wgmma descriptors) depend on the warpgroup alone. Partitioned for
    // the warpgroup's first thread, taken warp-uniform from lane 0, they are built in uniform
    // registers instead of per-thread ones moved over with R2UR before every wgmma.
    const int wg_thread = __shfl_sync(0xffffffff, tid / 128, 0) * 128;
    auto wg_sdp = mma_sdp.get_thread_slice(wg_thread);
    auto wg_dkv = mma_dkv.get_thread_slice(wg_thread);
    auto wg_dq = mma_dq.get_thread_slice(wg_thread);

    auto [tSrK, tSrQ, tdPrV, tdPrdO, tdQrdS, tdQrK] = score_and_dq_operands(wg_sdp, wg_dq, shared);
    Tensor sQt = make_tensor(make_smem_ptr(shared.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(shared.dout.data()), typename Traits::SmemLayoutdOt{});
    Tensor sdSt = make_tensor(make_smem_ptr(shared.ds.data()), typename Traits::SmemLayoutdSt{});
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);  // (MMA, N, K, stage): dO^T, Q^T as B of dV, dK
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);

    // dS^T from registers to shared memory with stmatrix: 8 consecutive queries (16 bytes) of 4
    // keys per instruction and one address per thread, where 4-byte stores kept 16 swizzled
    // addresses live through the loop (7 registers spilled at d = 128).
    auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
    auto thr_r2s_ds = r2s_ds.get_thread_slice(tid);
    Tensor tdSsdS = thr_r2s_ds.partition_D(sdSt);  // (CPY, M, N, buffer)

    // (key, query) of each S^T accumulator, for the mask.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    constexpr int kQueries = decltype(size<0>(colrow_view(tScS)))::value;  // queries per thread
    static_assert(kQueries == kBlockM / 4);
    const float scale_log2 = Score::scale_log2(params.problem);

    PipelineState st_q, st_do;
    shared.kv_full.wait(0);
    const bool packed = kPacked && params.problem.is_varlen();
    if (packed && (n_block + 1) * kBlockN > mask.seqlen_k) clear_kv_past(shared, mask, n_block, tid);
    // The query block whose rows end past the sequence (-1: none), one register across the loop.
    const int clear_m = packed && mask.seqlen_q % kBlockM != 0 ? mask.seqlen_q / kBlockM : -1;
    int i = 0;
#pragma unroll 1
    for (int h = steps.head_begin; h < steps.head_begin + steps.heads; ++h) {
      const Score score(params.problem, mask, steps.batch, h);
      const HeadValues head = score.template head_values<Traits::kHoldsFeatureValues>();
#pragma unroll 1
      for (int m = steps.first(), end = steps.end(); m != end; m += steps.step, ++i) {
        if constexpr (kPacked) {
          if (m == clear_m) clear_rows_past(shared, pipeline_q, st_q, pipeline_do, st_do, mask, m, tid);
        }
        const int buf = i % Traits::kdSBuffers;
        Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        scores<kBlockM>(mma_sdp, tSrK, tSrQ, tdPrV, tdPrdO, pipeline_q, st_q, pipeline_do, st_do, shared, 0, score,
                        head, tScS, m, n_block, scale_log2, acc_s, acc_dp);
        Tensor rP = convert_type<Element>(acc_s);
        Tensor rdS = convert_type<Element>(acc_dp);
        copy(r2s_ds, thr_r2s_ds.retile_S(rdS), tdSsdS(_, _, _, buf));
        Tensor tdVrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdVrP, tdVrdO(_, _, _, st_do.index()), acc_dv);
        // Every warpgroup's dS^T is in shared memory (generic-proxy stores, read next by wgmma).
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(BwdBarrier::kdSReady));
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_dq, tdQrdS(_, _, _, buf), tdQrK, acc_dq);
        Tensor tdKrdS = make_tensor(rdS.data(), acc_as_a_layout(rdS.layout()));
        gemm</*kZeroInit=*/false, /*kWait=*/-1>(mma_dkv, tdKrdS, tdKrQ(_, _, _, st_q.index()), acc_dk);
        warpgroup_wait<1>();  // dV and dQ done, dK running
        warpgroup_fence_operand(acc_dq);
        warpgroup_fence_operand(rP);  // the dV wgmma read P^T from these registers until here
        pipeline_do.consumer_release(st_do);
        ++st_do;
        const int dq_buf = i % Traits::kdQBuffers;
        // The dQ thread has read this buffer's last dQ (step i - kdQBuffers).
        if (i >= Traits::kdQBuffers) shared.dq_empty[dq_buf].wait((i / Traits::kdQBuffers - 1) & 1);
        if (tid == 0) {
          const int64_t row = dq_row(params, steps, h, n_block);
          DqTarget target{params.dq_accum + (row + int64_t(m) * kBlockM) * kHeadDim, nullptr, 0};
          if (int* semaphores = params.semaphores(); semaphores != nullptr) {
            target.semaphore = DqSemaphore{semaphores}.at<kBlockM>(row, m);
            target.turn = DqSemaphore::turn<kBlockM, kBlockN>(mask, m, n_block, params.dq_groups, steps.upward());
          }
          shared.dq_target[dq_buf] = target;
        }
        float4* dq_stage = reinterpret_cast<float4*>(shared.dq.data() + dq_buf * Traits::kdQElems);
        CUTE_UNROLL
        for (int j = 0; j < size(acc_dq) / 4; ++j)
          dq_stage[dq_index<Traits>(4 * j, tid) / 4] =
              make_float4(acc_dq(4 * j), acc_dq(4 * j + 1), acc_dq(4 * j + 2), acc_dq(4 * j + 3));
        cutlass::arch::fence_view_async_shared();  // read next by the bulk reduce-add
        shared.dq_full[dq_buf].arrive();
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc_dk);
        warpgroup_fence_operand(rdS);
        pipeline_q.consumer_release(st_q);
        ++st_q;
      }
    }
  }
};

}  // namespace cutlass_flash::sm90
