// sm80 backward mainloop (FlashAttention-2): one key block stays in shared memory while the query
// blocks that see it stream through. Per query block m:
//   S = Q K^T -> P = exp(S - LSE);  dP = dO V^T -> dS = P (dP - D);  P, dS -> shared memory;
//   dV += P^T dO;  dK += dS^T Q;  dQ(m) += dS K (fp32 atomics into the caller's scratch).
// Loads: Q(m-1) is issued at the top of iteration m into the other Q stage (single stage: after the
// dK GEMM, its last reader); dO(m-1) right after the dV GEMM, its last reader.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "kernels/common/dq_semaphore.h"
#include "kernels/common/score_policy.h"
#include "kernels/sm80/utils.h"

namespace cutlass_flash::sm80 {

using namespace cute;

// Position of a thread's i-th dQ accumulator inside its fp32 scratch tile: thread-major, so each
// atomicAdd instruction of a warp covers 32 consecutive floats (4 full 32-byte sectors) instead of
// 8 rows x 4 column pairs of the MMA layout (8 half-used sectors). The dQ conversion kernel
// reads the tile back with the same map.
template <typename Traits>
__device__ __forceinline__ int dq_accum_index(int i, int tid) {
  return i * Traits::kNThreads + tid;
}

// Deterministic mode's order of the dQ additions of one (batch, head): before adding query tile
// m, the block waits for the lower key blocks that see it; after, it signals the next.
// semaphores == nullptr: no order (atomics as they come). kOrdered = false compiles the order
// out: its fence made ptxas emit the dQ additions as ATOMG (an atomic whose completion the fence
// can wait for) instead of REDG in the whole kernel, and 15% of the d = 256 backward's warp cycles
// stalled on the full load/store queue (LG throttle) against FlashAttention-2's 0.04% (ncu, H200).
template <bool kOrdered>
struct BwdDqOrder {
  int* semaphores;
  int64_t bh_row;  // the row of the block's dQ group (BwdWorkspace::dq_group_row included)
  int n_block;
  int groups;

  template <int kBlockM, int kBlockN>
  __device__ void before(const WindowMask& mask, int m_block) const {
    if (!kOrdered || semaphores == nullptr) return;
    if (threadIdx.x == 0)
      DqSemaphore::wait(DqSemaphore{semaphores}.at<kBlockM>(bh_row, m_block),
                        DqSemaphore::turn<kBlockM, kBlockN>(mask, m_block, n_block, groups));
    __syncthreads();
  }
  template <int kBlockM>
  __device__ void after(int m_block) const {
    if (!kOrdered || semaphores == nullptr) return;
    __threadfence();  // this thread's atomics are performed before the signal
    __syncthreads();
    if (threadIdx.x == 0) DqSemaphore::signal(DqSemaphore{semaphores}.at<kBlockM>(bh_row, m_block));
  }
};

// threadIdx.x (of a block of kNThreads threads), read where it is called: the compiler cannot
// prove it equal to an earlier read, so the thread offsets derived from it are computed after this
// point instead of being hoisted out of the loop and held in registers across it. The range is
// restated for the compiler (what it knows of threadIdx.x), so that offsets like i * kNThreads + t
// still fold into one address plus constants.
template <int kNThreads>
__device__ __forceinline__ int tid_here() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  __builtin_assume(t >= 0 && t < kNThreads);
  return t;
}

// Features: the score modifiers compiled in (common/score_policy.h); kOrderedDq: whether
// deterministic mode's dQ order is (BwdDqOrder).
template <typename Traits_, typename Features_ = AllScoreFeatures, bool kOrderedDq = true>
struct BwdMainloop {
  using Traits = Traits_;
  using Features = Features_;
  using DqOrder = BwdDqOrder<kOrderedDq>;
  using Score = ScorePolicy<Features>;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kQStages = Traits::kQStages;
  static constexpr int kNThreads = Traits::kNThreads;

  // The thread index that offsets computed inside the loop derive from. kLateOffsets: a fresh read,
  // so they are computed where used; otherwise threadIdx.x as read at the start, so the compiler
  // hoists them out of the loop and keeps them in registers (no recomputation) where it has room.
  __device__ static int loop_tid() {
    if constexpr (Traits::kLateOffsets) {
      return tid_here<kNThreads>();
    } else {
      const int t = threadIdx.x;
      __builtin_assume(t >= 0 && t < kNThreads);
      return t;
    }
  }

  // gQ, gdO: (kBlockM, d, num_m); gK, gV: (kBlockN, d); dq_accum: this (batch, head)'s fp32 dQ
  // tiles in thread-major order (dq_accum_index); lse, dpsum: this (batch, head)'s rows. Runs
  // query blocks [m_min, m_max).
  template <typename TensorQ, typename TensorK, typename TensorAcc>
  __device__ static void run(const TensorQ& gQ, const TensorQ& gdO, const TensorK& gK, const TensorK& gV,
                             float* dq_accum, const float* lse, const float* dpsum, char* smem, const AttnProblem& p,
                             const Score& score, int n_block, int m_min, int m_max, float scale_log2, TensorAcc& acc_dk,
                             TensorAcc& acc_dv, const DqOrder& dq_order) {
    const WindowMask& mask = score.mask;
    const int tid = threadIdx.x;
    constexpr int kQTile = Traits::kQTile, kKVTile = Traits::kKVTile, kPTile = Traits::kPTile;
    Element* base = reinterpret_cast<Element*>(smem);
    Tensor sQ = make_tensor(make_smem_ptr(base), typename Traits::SmemLayoutQdO{});  // stage 0
    Tensor sdO = make_tensor(make_smem_ptr(base + kQStages * kQTile), typename Traits::SmemLayoutQdO{});
    Tensor sK = make_tensor(sdO.data() + kQTile, typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(sK.data() + kKVTile, typename Traits::SmemLayoutKV{});
    Tensor sP = make_tensor(sV.data() + kKVTile, typename Traits::SmemLayoutPdS{});
    Tensor sdS = make_tensor(sP.data() + kPTile, typename Traits::SmemLayoutPdS{});
    Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQdOt{});
    Tensor sQtNoSwizzle = make_tensor(sQ.data(), typename Traits::SmemLayoutQdOtNoSwizzle{});
    Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQdOt{});
    Tensor sdOtNoSwizzle = make_tensor(sdO.data(), typename Traits::SmemLayoutQdOtNoSwizzle{});
    Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
    Tensor sKtNoSwizzle = make_tensor(sK.data(), typename Traits::SmemLayoutKtNoSwizzle{});
    Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});
    Tensor sPtNoSwizzle = make_tensor(sP.data(), typename Traits::SmemLayoutPdStNoSwizzle{});
    Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});
    Tensor sdStNoSwizzle = make_tensor(sdS.data(), typename Traits::SmemLayoutPdStNoSwizzle{});

    // Register budget: the peak is the dP GEMM, where the dK and dV accumulators, P (fp32) and dP
    // are all live. Only what S = Q K^T and dP = dO V^T need is partitioned here, once; the
    // thread's offsets into everything used after dP (P/dS stores, the dV, dK, dQ GEMMs, the
    // global loads) and its S coordinates are derived inside the loop from loop_tid(), which with
    // Traits::kLateOffsets keeps them from being hoisted and held through the dP GEMM.
    typename Traits::GmemCopyIn gmem_copy;
    // Global -> shared copy of one (rows, d) tile, rows at or past `rows` zero-filled.
    auto load_tile = [&](const auto& g_tile, auto& s_tile, int rows, int t) {
      auto thr = gmem_copy.get_thread_slice(t);
      Tensor tcoord = thr.partition_S(make_identity_tensor(shape(g_tile)));
      Tensor dst = thr.partition_D(s_tile);
      copy_rows(gmem_copy, thr.partition_S(g_tile), dst, tcoord, FirstOf{rows},
                tile_cols<Traits::kNarrow>(p));  // p: constant memory
    };
    // A query block below the last one: every row exists (AllOf).
    auto load_full_tile = [&](const auto& g_tile, auto& s_tile, int t) {
      auto thr = gmem_copy.get_thread_slice(t);
      Tensor tcoord = thr.partition_S(make_identity_tensor(shape(g_tile)));
      Tensor dst = thr.partition_D(s_tile);
      copy_rows(gmem_copy, thr.partition_S(g_tile), dst, tcoord, AllOf{}, tile_cols<Traits::kNarrow>(p));
    };

    // S = Q K^T and dP = dO V^T.
    typename Traits::TiledMmaSdP mma_sdp;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
    Tensor tSrK = thr_sdp.partition_fragment_B(sK);
    Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
    Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
    auto copy_a_sdp = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
    auto thr_a_sdp = copy_a_sdp.get_thread_slice(tid);
    Tensor tSsQ = thr_a_sdp.partition_S(sQ);
    Tensor tdPsdO = thr_a_sdp.partition_S(sdO);
    auto copy_b_sdp = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
    auto thr_b_sdp = copy_b_sdp.get_thread_slice(tid);
    Tensor tSsK = thr_b_sdp.partition_S(sK);
    Tensor tdPsV = thr_b_sdp.partition_S(sV);
    auto s_coords = [&](int t) {  // (row, col) of each of the thread's S entries
      return mma_sdp.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    };
    auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);

    // dV += P^T dO and dK += dS^T Q.
    typename Traits::TiledMmadKV mma_dkv;
    auto copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomT{}, mma_dkv);
    auto copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dkv);

    // dQ = dS K.
    typename Traits::TiledMmadQ mma_dq;
    auto copy_a_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
    auto copy_b_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dq);

    const int seqlen_q = mask.seqlen_q;
    auto q_stage = [&](int stage) { return make_tensor(sQ.data() + stage * kQTile, sQ.layout()); };
    {
      const int t = loop_tid();  // not held across the loop for the next head's call
      const int rows_k = mask.seqlen_k - n_block * kBlockN;
      load_tile(gK, sK, rows_k, t);
      load_tile(gV, sV, rows_k, t);
      Tensor sQ0 = q_stage(0);
      load_tile(gQ(_, _, m_max - 1), sQ0, seqlen_q - (m_max - 1) * kBlockM, t);
      load_tile(gdO(_, _, m_max - 1), sdO, seqlen_q - (m_max - 1) * kBlockM, t);
      cp_async_fence();
    }

    constexpr int kRows = decltype(size<0>(rowcol_view(s_coords(0))))::value;
    int stage = 0;
    for (int m = m_max - 1; m >= m_min; --m) {
      // Per-row LSE (pre-scaled to log2) and D = rowsum(dO * O). Rows past the end get
      // LSE = +inf so that P = 0 there, and D = 0.
      float lse_r[kRows], dpsum_r[kRows];
      Tensor tScS = s_coords(loop_tid());
      Tensor tScS_rc = rowcol_view(tScS);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const int row = m * kBlockM + get<0>(tScS_rc(mi, 0));
        lse_r[mi] = row < seqlen_q ? lse[row] * float(M_LOG2E) : INFINITY;
        dpsum_r[mi] = row < seqlen_q ? dpsum[row] : 0.f;
      }
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      cp_async_wait<0>();
      __syncthreads();  // Q(m), dO(m) visible; every warp finished iteration m+1's reads
      if (kQStages == 2 && m > m_min) {
        Tensor sQ_next = q_stage(stage ^ 1);
        load_full_tile(gQ(_, _, m - 1), sQ_next, loop_tid());
        cp_async_fence();
      }
      Tensor tSsQ_m = make_tensor(tSsQ.data() + stage * kQTile, tSsQ.layout());
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ_m, tSsK, mma_sdp, copy_a_sdp, copy_b_sdp, thr_a_sdp, thr_b_sdp);
      {
        // The thread's first (row, col) goes into the offsets, so each entry's coordinates are
        // compile-time constants: with tScS itself, its 16 column indices were hoisted out of the
        // loop and held in registers through the dP GEMM (d = 64: 12 of the 36 B spilled).
        const auto c0 = s_coords(loop_tid())(0);
        score.before_softmax(acc_s, make_coord_tensor(tScS.layout()), m * kBlockM + get<0>(c0),
                             n_block * kBlockN + get<1>(c0), mask.block_needs_mask<kBlockM, kBlockN>(m, n_block));
      }
      Tensor p_rc = rowcol_view(acc_s);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(p_rc); ++ni) p_rc(mi, ni) = exp2f(p_rc(mi, ni) * scale_log2 - lse_r[mi]);
      }
      if (score.probs_on()) {  // the probability stage on P, until dS is computed
        const auto c0 = s_coords(loop_tid())(0);
        score.template bwd_probs</*kTransposed=*/false, /*kPairStep=*/8 * Traits::kWarpsNSdP,
                                 Score::probs_align(kBlockN)>(p_rc, rowcol_view(make_coord_tensor(tScS.layout())),
                                                              m * kBlockM + get<0>(c0), n_block * kBlockN + get<1>(c0));
      }

      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, mma_sdp, copy_a_sdp, copy_b_sdp, thr_a_sdp, thr_b_sdp);
      Tensor ds_rc = rowcol_view(acc_dp);
      score.scores_grad(p_rc, ds_rc, [&](int mi) { return dpsum_r[mi]; },
                        [&] { return [&](int mi) { return lse_r[mi]; }; });
      score.probs_for_dv(acc_s);  // P for the dV GEMM
      const int t = loop_tid();   // everything below: offsets computed here, after the peak
      {
        Tensor rP = convert_type<Element>(acc_s);
        Tensor rdS = convert_type<Element>(acc_dp);
        auto thr_pds = copy_pds.get_thread_slice(t);
        copy(copy_pds, thr_pds.retile_S(rP), thr_pds.partition_D(sP));
        copy(copy_pds, thr_pds.retile_S(rdS), thr_pds.partition_D(sdS));
      }
      __syncthreads();  // P and dS visible

      auto thr_dkv = mma_dkv.get_thread_slice(t);
      auto thr_a_dkv = copy_a_dkv.get_thread_slice(t);
      auto thr_b_dkv = copy_b_dkv.get_thread_slice(t);
      {
        Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwizzle);
        Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOtNoSwizzle);
        gemm_ss(acc_dv, tdVrPt, tdVrdO, thr_a_dkv.partition_S(sPt), thr_b_dkv.partition_S(sdOt), mma_dkv, copy_a_dkv,
                copy_b_dkv, thr_a_dkv, thr_b_dkv);
      }
      __syncthreads();  // every warp finished reading dO(m)
      if (m > m_min) {
        load_full_tile(gdO(_, _, m - 1), sdO, t);
        cp_async_fence();
      }

      {
        Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwizzle);
        Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwizzle);
        Tensor tdKsQt = thr_b_dkv.partition_S(sQt);
        Tensor tdKsQt_m = make_tensor(tdKsQt.data() + stage * kQTile, tdKsQt.layout());
        gemm_ss(acc_dk, tdKrdSt, tdKrQt, thr_a_dkv.partition_S(sdSt), tdKsQt_m, mma_dkv, copy_a_dkv, copy_b_dkv,
                thr_a_dkv, thr_b_dkv);
      }
      if (kQStages == 1 && m > m_min) {
        __syncthreads();  // every warp finished reading Q(m)
        Tensor sQ0 = q_stage(0);
        load_full_tile(gQ(_, _, m - 1), sQ0, t);
        cp_async_fence();
      }

      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      {
        auto thr_dq = mma_dq.get_thread_slice(t);
        Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
        Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwizzle);
        auto thr_a_dq = copy_a_dq.get_thread_slice(t);
        auto thr_b_dq = copy_b_dq.get_thread_slice(t);
        gemm_ss(acc_dq, tdQrdS, tdQrKt, thr_a_dq.partition_S(sdS), thr_b_dq.partition_S(sKt), mma_dq, copy_a_dq,
                copy_b_dq, thr_a_dq, thr_b_dq);
      }
      // This thread's first accumulator of tile m; the i-th is i * kNThreads floats further
      // (dq_accum_index), so every atomic addresses it with an immediate offset instead of a 64-bit
      // address computation of its own.
      float* dq_thr = dq_accum + m * (kBlockM * kHeadDim) + dq_accum_index<Traits>(0, t);
      dq_order.template before<kBlockM, kBlockN>(mask, m);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); ++i) atomicAdd(dq_thr + i * kNThreads, acc_dq(i));
      dq_order.template after<kBlockM>(m);
      if (kQStages == 2) stage ^= 1;
    }
  }
};

}  // namespace cutlass_flash::sm80
