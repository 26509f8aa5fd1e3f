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
#include "kernels/common/mask.h"
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
// semaphores == nullptr: no order (atomics as they come).
struct BwdDqOrder {
  int* semaphores;
  int64_t bh_row;
  int n_block;

  template <int kBlockM, int kBlockN>
  __device__ void before(const WindowMask& mask, int m_block) const {
    if (semaphores == nullptr) return;
    if (threadIdx.x == 0)
      DqSemaphore::wait(DqSemaphore{semaphores}.at<kBlockM>(bh_row, m_block),
                        DqSemaphore::turn<kBlockM, kBlockN>(mask, m_block, n_block));
    __syncthreads();
  }
  template <int kBlockM>
  __device__ void after(int m_block) const {
    if (semaphores == nullptr) return;
    __threadfence();  // this thread's atomics are performed before the signal
    __syncthreads();
    if (threadIdx.x == 0) DqSemaphore::signal(DqSemaphore{semaphores}.at<kBlockM>(bh_row, m_block));
  }
};

template <typename Traits>
struct BwdMainloop {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kQStages = Traits::kQStages;

  // gQ, gdO: (kBlockM, d, num_m); gK, gV: (kBlockN, d); dq_accum: this (batch, head)'s fp32 dQ
  // tiles in thread-major order (dq_accum_index); lse, dpsum: this (batch, head)'s rows. Runs
  // query blocks [m_min, m_max).
  template <typename TensorQ, typename TensorK, typename TensorAcc>
  __device__ static void run(const TensorQ& gQ, const TensorQ& gdO, const TensorK& gK, const TensorK& gV,
                             float* dq_accum, const float* lse, const float* dpsum, char* smem,
                             const WindowMask& mask, int n_block, int m_min, int m_max, float scale_log2,
                             TensorAcc& acc_dk, TensorAcc& acc_dv, const BwdDqOrder& dq_order) {
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

    // Global -> shared.
    typename Traits::GmemCopyIn gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tid);
    Tensor tQgQ = gmem_thr.partition_S(gQ);
    Tensor tQsQ = gmem_thr.partition_D(sQ);
    Tensor tdOgdO = gmem_thr.partition_S(gdO);
    Tensor tdOsdO = gmem_thr.partition_D(sdO);
    Tensor tKgK = gmem_thr.partition_S(gK);
    Tensor tKsK = gmem_thr.partition_D(sK);
    Tensor tVgV = gmem_thr.partition_S(gV);
    Tensor tVsV = gmem_thr.partition_D(sV);
    Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tKVcKV = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

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
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor tScS_rc = rowcol_view(tScS);
    auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, mma_sdp);
    auto thr_pds = copy_pds.get_thread_slice(tid);
    Tensor tPsP = thr_pds.partition_D(sP);
    Tensor tdSsdS = thr_pds.partition_D(sdS);

    // dV += P^T dO and dK += dS^T Q.
    typename Traits::TiledMmadKV mma_dkv;
    auto thr_dkv = mma_dkv.get_thread_slice(tid);
    Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwizzle);
    Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOtNoSwizzle);
    Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwizzle);
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwizzle);
    auto copy_a_dkv = make_tiled_copy_A(typename Traits::SmemCopyAtomT{}, mma_dkv);
    auto thr_a_dkv = copy_a_dkv.get_thread_slice(tid);
    Tensor tdVsPt = thr_a_dkv.partition_S(sPt);
    Tensor tdKsdSt = thr_a_dkv.partition_S(sdSt);
    auto copy_b_dkv = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dkv);
    auto thr_b_dkv = copy_b_dkv.get_thread_slice(tid);
    Tensor tdVsdOt = thr_b_dkv.partition_S(sdOt);
    Tensor tdKsQt = thr_b_dkv.partition_S(sQt);

    // dQ = dS K.
    typename Traits::TiledMmadQ mma_dq;
    auto thr_dq = mma_dq.get_thread_slice(tid);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwizzle);
    auto copy_a_dq = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
    auto thr_a_dq = copy_a_dq.get_thread_slice(tid);
    Tensor tdQsdS = thr_a_dq.partition_S(sdS);
    auto copy_b_dq = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dq);
    auto thr_b_dq = copy_b_dq.get_thread_slice(tid);
    Tensor tdQsKt = thr_b_dq.partition_S(sKt);

    const int seqlen_q = mask.seqlen_q;
    const int rows_k = mask.seqlen_k - n_block * kBlockN;
    auto load_q = [&](int m, int stage) {
      Tensor dst = make_tensor(tQsQ.data() + stage * kQTile, tQsQ.layout());
      copy_rows(gmem_copy, tQgQ(_, _, _, m), dst, tQcQ, seqlen_q - m * kBlockM);
    };
    copy_rows(gmem_copy, tKgK, tKsK, tKVcKV, rows_k);
    copy_rows(gmem_copy, tVgV, tVsV, tKVcKV, rows_k);
    load_q(m_max - 1, 0);
    copy_rows(gmem_copy, tdOgdO(_, _, _, m_max - 1), tdOsdO, tQcQ, seqlen_q - (m_max - 1) * kBlockM);
    cp_async_fence();

    constexpr int kRows = decltype(size<0>(tScS_rc))::value;
    int stage = 0;
    for (int m = m_max - 1; m >= m_min; --m) {
      // Per-row LSE (pre-scaled to log2) and D = rowsum(dO * O). Rows past the end get
      // LSE = +inf so that P = 0 there, and D = 0.
      float lse_r[kRows], dpsum_r[kRows];
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
        load_q(m - 1, stage ^ 1);
        cp_async_fence();
      }
      Tensor tSsQ_m = make_tensor(tSsQ.data() + stage * kQTile, tSsQ.layout());
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ_m, tSsK, mma_sdp, copy_a_sdp, copy_b_sdp, thr_a_sdp, thr_b_sdp);
      if (mask.block_needs_mask<kBlockM, kBlockN>(m, n_block)) {
        mask.apply(acc_s, tScS, m * kBlockM, n_block * kBlockN);
      }
      Tensor p_rc = rowcol_view(acc_s);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(p_rc); ++ni) p_rc(mi, ni) = exp2f(p_rc(mi, ni) * scale_log2 - lse_r[mi]);
      }

      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, mma_sdp, copy_a_sdp, copy_b_sdp, thr_a_sdp, thr_b_sdp);
      Tensor ds_rc = rowcol_view(acc_dp);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(ds_rc); ++ni) ds_rc(mi, ni) = p_rc(mi, ni) * (ds_rc(mi, ni) - dpsum_r[mi]);
      }
      Tensor rP = convert_type<Element>(acc_s);
      Tensor rdS = convert_type<Element>(acc_dp);
      copy(copy_pds, thr_pds.retile_S(rP), tPsP);
      copy(copy_pds, thr_pds.retile_S(rdS), tdSsdS);
      __syncthreads();  // P and dS visible

      gemm_ss(acc_dv, tdVrPt, tdVrdO, tdVsPt, tdVsdOt, mma_dkv, copy_a_dkv, copy_b_dkv, thr_a_dkv, thr_b_dkv);
      __syncthreads();  // every warp finished reading dO(m)
      if (m > m_min) {
        copy_rows(gmem_copy, tdOgdO(_, _, _, m - 1), tdOsdO, tQcQ, seqlen_q - (m - 1) * kBlockM);
        cp_async_fence();
      }

      Tensor tdKsQt_m = make_tensor(tdKsQt.data() + stage * kQTile, tdKsQt.layout());
      gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt_m, mma_dkv, copy_a_dkv, copy_b_dkv, thr_a_dkv, thr_b_dkv);
      if (kQStages == 1 && m > m_min) {
        __syncthreads();  // every warp finished reading Q(m)
        load_q(m - 1, 0);
        cp_async_fence();
      }

      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      clear(acc_dq);
      gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, copy_a_dq, copy_b_dq, thr_a_dq, thr_b_dq);
      float* dq_tile = dq_accum + m * (kBlockM * kHeadDim);
      dq_order.before<kBlockM, kBlockN>(mask, m);
      CUTE_UNROLL
      for (int i = 0; i < size(acc_dq); ++i) atomicAdd(dq_tile + dq_accum_index<Traits>(i, tid), acc_dq(i));
      dq_order.after<kBlockM>(m);
      if (kQStages == 2) stage ^= 1;
    }
  }
};

}  // namespace cutlass_flash::sm80
