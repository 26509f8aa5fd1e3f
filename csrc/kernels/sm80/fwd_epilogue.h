// sm80 forward epilogue: O (fp32 registers) -> 16-bit -> shared memory -> 16-byte global stores,
// and the log-sum-exp of each row for the backward pass.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/sm80/utils.h"

namespace cutlass_flash::sm80 {

using namespace cute;

template <typename Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  // gO: (kBlockM, d) of this block; lse_out: the row of LSE for this block's first query row;
  // rows_left: valid query rows from this block's first one. smem may alias Q: the mainloop's
  // last barrier comes after its last read of Q.
  template <typename TensorAcc, typename TensorL, typename TensorGO, typename Cols>
  __device__ static void store(const TensorAcc& acc_o, const TensorL& lse, TensorGO& gO, float* lse_out, char* smem,
                               int rows_left, Cols cols) {
    const int tid = threadIdx.x;
    Tensor sO = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
    typename Traits::TiledMma tiled_mma;

    Tensor rO = convert_type<Element>(acc_o);
    auto copy_r2s = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
    auto thr_r2s = copy_r2s.get_thread_slice(tid);
    Tensor taccOrO = thr_r2s.retile_S(rO);
    Tensor taccOsO = thr_r2s.partition_D(sO);
    copy(copy_r2s, taccOrO, taccOsO);

    // The quad lane holding column 0 writes the LSE of its rows.
    Tensor tOcO = rowcol_view(
        tiled_mma.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{})));
    // A whole block (every dense call whose seqlen_q is a multiple of kBlockM) stores without a
    // per-row test: with them, the compiler sank each shared-memory read into its row's branch,
    // and the d = 64 forward at 1k tokens spent 6.2% of its stall samples in this epilogue
    // against FlashAttention-2's 5.0% (ncu, H200, PERFLOG.md entry 99).
    const bool whole = rows_left >= kBlockM;
    if (get<1>(tOcO(0, 0)) == 0) {
      CUTE_UNROLL
      for (int mi = 0; mi < size<0>(tOcO); ++mi) {
        const int row = get<0>(tOcO(mi, 0));
        if (whole || row < rows_left) lse_out[row] = lse(mi);
      }
    }
    __syncthreads();

    typename Traits::GmemCopyO copy_s2g;
    auto thr_s2g = copy_s2g.get_thread_slice(tid);
    Tensor tOsO = thr_s2g.partition_S(sO);
    Tensor tOgO = thr_s2g.partition_D(gO);
    Tensor tOcOg = thr_s2g.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tOrOg = make_fragment_like(tOsO);
    copy(copy_s2g, tOsO, tOrOg);
    if (Cols::kAll && whole)
      copy(copy_s2g, tOrOg, tOgO);
    else
      store_rows(copy_s2g, tOrOg, tOgO, tOcOg, rows_left, cols);
  }
};

}  // namespace cutlass_flash::sm80
