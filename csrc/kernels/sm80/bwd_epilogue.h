// sm80 backward epilogue: dK (scaled by the softmax scale) and dV (by ScorePolicy::keep_scale) from
// fp32 registers to 16-bit,
// through shared memory, to 16-byte global stores of the valid key rows.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/sm80/utils.h"

namespace cutlass_flash::sm80 {

using namespace cute;

template <typename Traits>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  template <typename TensorAcc, typename TensorG, typename Cols>
  __device__ static void store(TensorAcc& acc_dk, TensorAcc& acc_dv, TensorG& gdK, TensorG& gdV, float softmax_scale,
                               float dv_scale, char* smem, int rows_left, Cols cols) {
    const int tid = threadIdx.x;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dk); ++i) {
      acc_dk(i) *= softmax_scale;
      acc_dv(i) *= dv_scale;
    }
    Tensor rdK = convert_type<Element>(acc_dk);
    Tensor rdV = convert_type<Element>(acc_dv);

    Tensor sdK = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutKV{});
    Tensor sdV = make_tensor(sdK.data() + int(Traits::kKVTile), typename Traits::SmemLayoutKV{});
    auto copy_r2s = make_tiled_copy_C(typename Traits::SmemCopyAtomStore{}, typename Traits::TiledMmadKV{});
    auto thr_r2s = copy_r2s.get_thread_slice(tid);
    __syncthreads();  // the mainloop's last GEMMs read the shared memory reused here
    copy(copy_r2s, thr_r2s.retile_S(rdK), thr_r2s.partition_D(sdK));
    copy(copy_r2s, thr_r2s.retile_S(rdV), thr_r2s.partition_D(sdV));
    __syncthreads();

    typename Traits::GmemCopyOut copy_s2g;
    auto thr_s2g = copy_s2g.get_thread_slice(tid);
    Tensor tcoord = thr_s2g.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor tdKsdK = thr_s2g.partition_S(sdK);
    Tensor tdVsdV = thr_s2g.partition_S(sdV);
    Tensor tdKrdK = make_fragment_like(tdKsdK);
    Tensor tdVrdV = make_fragment_like(tdVsdV);
    copy(copy_s2g, tdKsdK, tdKrdK);
    copy(copy_s2g, tdVsdV, tdVrdV);
    Tensor tdKgdK = thr_s2g.partition_D(gdK);
    Tensor tdVgdV = thr_s2g.partition_D(gdV);
    store_rows(copy_s2g, tdKrdK, tdKgdK, tcoord, rows_left, cols);
    store_rows(copy_s2g, tdVrdV, tdVgdV, tcoord, rows_left, cols);
  }
};

}  // namespace cutlass_flash::sm80
