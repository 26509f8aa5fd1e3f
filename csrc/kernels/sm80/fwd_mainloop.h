// sm80 forward mainloop: for one query block, stream the key/value blocks through shared memory
// and accumulate O = softmax(Q K^T) V online (FlashAttention-2).
//
// Pipeline, per key block n (walking from the last block down, so the blocks that need masking
// come first): wait for K(n) -> issue the cp.async of V(n) -> S = Q K(n)^T -> mask -> wait for V(n)
// -> issue the cp.async of K(n-1) -> online softmax -> O += P V(n). Each load overlaps one GEMM.
// With two K and V buffers (Traits::kKVStages, the plain kernels), block n-1's loads are issued a
// phase earlier and each overlaps about one whole block's work.
#pragma once

#include <cute/tensor.hpp>

#include <type_traits>

#include "kernels/common/score_policy.h"
#include "kernels/common/softmax.h"
#include "kernels/sm80/utils.h"

namespace cutlass_flash::sm80 {

using namespace cute;

// Features: the score modifiers compiled in (common/score_policy.h).
template <typename Traits_, typename Features_ = AllScoreFeatures>
struct FwdMainloop {
  using Traits = Traits_;
  using Features = Features_;
  using Score = ScorePolicy<Features>;
  // The plain kernels overlap the rows' softmax work (OnlineSoftmax's kRowsTogether) and load the
  // key blocks after the first without row predicates (copy_rows with AllOf). The kernels with the
  // features keep both as they were: with the unpredicated loads their forward measured 3-7%
  // slower at d = 64 (5-9% faster at d = 128, 1% slower at d = 256; H200, PERFLOG.md entry 94).
  static constexpr bool kPlain = std::is_same_v<Features, PlainScores>;
  static constexpr int kStages = Traits::kKVStages;
  static_assert(kPlain || kStages == 1, "two K/V buffers: the plain kernels (no probability draws, full-row loads)");
  template <int kRows>
  using Softmax = OnlineSoftmax<kRows, kPlain>;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  // gQ: (kBlockM, d); gK, gV: (kBlockN, d, num_n_blocks). Runs key blocks [n_min, n_max).
  template <typename TensorQ, typename TensorK, typename TensorV, typename TensorO, typename Softmax>
  __device__ static void run(const TensorQ& gQ, const TensorK& gK, const TensorV& gV, char* smem, const AttnProblem& p,
                             const Score& score, int m_block, int n_min, int n_max, TensorO& acc_o, Softmax& softmax) {
    const WindowMask& mask = score.mask;
    const int tid = threadIdx.x;
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(sK.data() + kStages * size(sK), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
    Tensor sVtNoSwizzle = make_tensor(sV.data(), typename Traits::SmemLayoutVtNoSwizzle{});

    typename Traits::GmemCopyQKV gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tid);
    Tensor tQgQ = gmem_thr.partition_S(gQ);
    Tensor tQsQ = gmem_thr.partition_D(sQ);
    Tensor tKgK = gmem_thr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n)
    Tensor tKsK = gmem_thr.partition_D(sK);
    Tensor tVgV = gmem_thr.partition_S(gV);
    Tensor tVsV = gmem_thr.partition_D(sV);
    Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tid);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
    Tensor tSrK = thr_mma.partition_fragment_B(sK);
    Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
    Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

    auto copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto thr_copy_q = copy_q.get_thread_slice(tid);
    Tensor tSsQ = thr_copy_q.partition_S(sQ);
    auto copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto thr_copy_k = copy_k.get_thread_slice(tid);
    Tensor tSsK = thr_copy_k.partition_S(sK);
    auto copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, tiled_mma);
    auto thr_copy_v = copy_v.get_thread_slice(tid);
    Tensor tOsVt = thr_copy_v.partition_S(sVt);

    const int seqlen_k = mask.seqlen_k;
    const auto cols = tile_cols<Traits::kNarrow>(p);  // p: constant memory
    copy_rows(gmem_copy, tQgQ, tQsQ, tQcQ, FirstOf{mask.seqlen_q - m_block * kBlockM}, cols);
    int n = n_max - 1;
    copy_rows(gmem_copy, tKgK(_, _, _, n), tKsK, tKVcKV, FirstOf{seqlen_k - n * kBlockN}, cols);
    cp_async_fence();

    Tensor o_rc = rowcol_view(acc_o);
    Tensor tScS_rc = rowcol_view(tScS);
    if constexpr (kPlain) {
      // One key block n. kFirst: the softmax's first step and the only block whose rows may end
      // past the keys (V's load predicated by row); masked: a bool or a callable
      // (ScorePolicy::before_softmax). stage: the K / V buffer block n is in (two buffers).
      constexpr int kBuffer = kBlockN * kHeadDim;  // elements of one K or V buffer
      auto at = [](const auto& t, int offset) { return make_tensor(t.data() + offset, t.layout()); };
      int stage = 0;
      // always_inline: called from four loops, nvcc otherwise made the step a function and put the
      // accumulators it captures in local memory (a 3.5 KB stack frame at d = 256).
      auto step = [&](int n, auto first, auto&& masked) __attribute__((always_inline)) {
        constexpr bool kFirst = decltype(first)::value;
        const int here = stage * kBuffer;
        [[maybe_unused]] const int there = (stage ^ 1) * kBuffer;
        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
        clear(acc_s);
        if constexpr (kStages == 2) {
          // Block n - 1's K loads during block n's S GEMM, softmax and O GEMM, its V during block
          // n's softmax and O GEMM and its own S GEMM.
          cp_async_wait<1>();  // K(n); V(n) may be in flight
          __syncthreads();     // K(n) visible to all; every warp done with block n + 1's buffers
          if (n > n_min) {
            Tensor dst = at(tKsK, there);
            copy_rows(gmem_copy, tKgK(_, _, _, n - 1), dst, tKVcKV, AllOf{}, cols);
          }
          cp_async_fence();  // an empty group at the last block keeps the wait counts uniform
        } else {
          cp_async_wait<0>();
          __syncthreads();  // K(n) visible to all; every warp finished reading V(n + 1)
          if constexpr (kFirst)
            copy_rows(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, FirstOf{seqlen_k - n * kBlockN}, cols);
          else
            copy_rows(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, AllOf{}, cols);
          cp_async_fence();
        }
        gemm_ss(acc_s, tSrQ, tSrK, tSsQ, at(tSsK, here), tiled_mma, copy_q, copy_k, thr_copy_q, thr_copy_k);
        score.before_softmax(acc_s, tScS, m_block * kBlockM, n * kBlockN, masked);
        if constexpr (kStages == 2) {
          cp_async_wait<1>();  // V(n); K(n - 1) may be in flight
          __syncthreads();     // V(n) visible to all
          if (n > n_min) {
            Tensor dst = at(tVsV, there);
            copy_rows(gmem_copy, tVgV(_, _, _, n - 1), dst, tKVcKV, AllOf{}, cols);
          }
          cp_async_fence();
        } else {
          cp_async_wait<0>();
          __syncthreads();  // V(n) visible to all; every warp finished reading K(n)
          if (n > n_min) {
            copy_rows(gmem_copy, tKgK(_, _, _, n - 1), tKsK, tKVcKV, AllOf{}, cols);
            cp_async_fence();
          }
        }
        Tensor scores = rowcol_view(acc_s);
        softmax.template update<kFirst>(scores, o_rc);
        Tensor rP = convert_type<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        gemm_rs(acc_o, tOrP, tOrVt, at(tOsVt, here), tiled_mma, copy_v, thr_copy_v);
        if constexpr (kStages == 2) stage ^= 1;
      };
      if constexpr (kStages == 2) {
        copy_rows(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, FirstOf{seqlen_k - n * kBlockN}, cols);
        cp_async_fence();
      }
      // FlashAttention-2's loop order: the first block on its own, then the blocks the mask
      // crosses from the right (the sequence's end, a causal or right window), then those it
      // leaves whole, with no mask and no per-block check, then those a left window crosses. With
      // one loop and a check per block, the d = 256 forward's loop spent 1.4% of its stall samples
      // on the check and 5.5% at its two barriers against FlashAttention-2's 0.3% (ncu, H200,
      // PERFLOG.md entry 99).
      step(n, std::true_type{}, [&] { return mask.block_needs_mask<kBlockM, kBlockN>(m_block, n); });
      for (--n; n >= n_min && mask.block_needs_mask<kBlockM, kBlockN>(m_block, n); --n)
        step(n, std::false_type{}, std::true_type{});
      const int n_whole = max(n_min, mask.n_block_left_whole<kBlockM, kBlockN>(m_block));
      for (; n >= n_whole; --n) step(n, std::false_type{}, std::false_type{});
      for (; n >= n_min; --n) step(n, std::false_type{}, std::true_type{});
    } else {
      for (bool first = true; n >= n_min; --n, first = false) {
        // The probability stage's draws before S is live (Traits::kProbsDrawFirst), or later on P in
        // place.
        constexpr int kAlign = Score::probs_align(kBlockN);
        typename Score::ProbsDraw draw = 0;
        if constexpr (Traits::kProbsDrawFirst)
          draw =
              score.template fwd_probs_draw</*kTransposed=*/false, 8, kAlign>(tScS_rc, m_block * kBlockM, n * kBlockN);
        Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
        clear(acc_s);
        cp_async_wait<0>();
        __syncthreads();  // K(n) visible to all; every warp finished reading V(n+1)
        copy_rows(gmem_copy, tVgV(_, _, _, n), tVsV, tKVcKV, FirstOf{seqlen_k - n * kBlockN}, cols);
        cp_async_fence();

        gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, copy_q, copy_k, thr_copy_q, thr_copy_k);
        score.before_softmax(acc_s, tScS, m_block * kBlockM, n * kBlockN,
                             [&] { return mask.block_needs_mask<kBlockM, kBlockN>(m_block, n); });

        cp_async_wait<0>();
        __syncthreads();  // V(n) visible to all; every warp finished reading K(n)
        if (n > n_min) {
          copy_rows(gmem_copy, tKgK(_, _, _, n - 1), tKsK, tKVcKV, FirstOf{seqlen_k - (n - 1) * kBlockN}, cols);
          cp_async_fence();
        }

        Tensor scores = rowcol_view(acc_s);
        if (first) {
          softmax.template update</*kFirst=*/true>(scores, o_rc);
        } else {
          softmax.template update</*kFirst=*/false>(scores, o_rc);
        }
        // After the row sums: the softmax's statistics are those of P before this stage.
        if constexpr (Traits::kProbsDrawFirst)
          score.fwd_probs_apply(scores, draw);
        else
          score.template fwd_probs</*kTransposed=*/false, 8, kAlign>(scores, tScS_rc, m_block * kBlockM, n * kBlockN);
        Tensor rP = convert_type<Element>(acc_s);
        Tensor tOrP = make_tensor(rP.data(), acc_as_a_layout(rP.layout()));
        gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, copy_v, thr_copy_v);
      }
    }
  }
};

}  // namespace cutlass_flash::sm80
