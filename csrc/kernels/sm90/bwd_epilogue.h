// sm90 backward epilogue: dK (scaled by softmax_scale) and dV of the block's keys from the
// consumers' registers, staged in V's shared tile, to the caller's tensors; and the dQ postprocess
// (fp32 workspace -> dq, common/bwd_convert_dq.h).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "cutlass_flash/params.h"
#include "kernels/common/tile_order.h"
#include "generated/bwd_workspace.h"
#include "kernels/common/block_info.h"
#include "kernels/common/bwd_convert_dq.h"
#include "kernels/common/convert.h"
#include "kernels/sm90/bwd_mainloop.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/launch.h"

namespace cutlass_flash::sm90 {

using namespace cute;

template <typename Traits>
struct BwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;

  // Writes one (kBlockN, d) accumulator of consumer thread `tid` (scaled by `scale`) to rows
  // [n_block * kBlockN, ...) of `out` (sequence seq, head_kv), rows past its seqlen_k left alone:
  // dK (kIsV false, d = kHeadDim) or dV (d = kHeadDimV, from the warpgroups with a share of it).
  // Once per block, after the whole query loop: staged in `smem` (V's shared tile, or K's for dK
  // where V's is narrower), then written in 16-byte row stores. Keys-per-warpgroup layout: each
  // warpgroup alone reads its 64 rows of V, so it stages and writes those rows on its own; split-d
  // layouts: the warpgroups read all of K and V, so all consumers stage (each its columns) and
  // write together. Stored straight from the accumulators (4 bytes, 8 rows per warp instruction),
  // d = 128 backward ran 7-10% slower at 1k-2k tokens (PERFLOG 46).
  template <bool kIsV, typename Acc>
  __device__ static void store(const AttnProblem& p, const TensorRef4& out, const Acc& acc, float scale,
                               const SeqInfo& seq, int head_kv, int n_block, int tid, Element* smem) {
    constexpr bool kOwnRows = Traits::kOwnVRows;
    constexpr int kThreads = kOwnRows ? 128 : Traits::kNMmaThreads;  // threads that stage together
    constexpr int kRows = kOwnRows ? 64 : kBlockN;                   // and the rows they write
    constexpr int kCols = kIsV ? Traits::kHeadDimV : kHeadDim;
    using TiledMma = std::conditional_t<kIsV, typename Traits::TiledMmadV, typename Traits::TiledMmadKV>;
    using SmemLayout = std::conditional_t<kIsV, typename Traits::SmemLayoutV, typename Traits::SmemLayoutKV>;
    using SmemLayoutT = std::conditional_t<kIsV, typename Traits::SmemLayoutVt, typename Traits::SmemLayoutKt>;
    // A warpgroup without a share of dV (Traits::kdVWarpGroups) stages nothing.
    constexpr int kStagingThreads = kIsV ? Traits::kdVWarpGroups * 128 : Traits::kNMmaThreads;
    const int group = tid / kThreads;
    const int barrier = kOwnRows ? int(BwdBarrier::kEpilogueWG1) + group : int(BwdBarrier::kEpilogue);
    TiledMma mma;
    Tensor scaled = make_tensor_like(acc);
    CUTE_UNROLL
    for (int i = 0; i < size(acc); ++i) scaled(i) = acc(i) * scale;
    Tensor r = convert_type<Element>(scaled);
    Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
    // Every thread of the group is past its last read of K and V (and of the previous call's
    // staging).
    cutlass::arch::NamedBarrier::sync(kThreads, barrier);
    if (kStagingThreads == Traits::kNMmaThreads || tid < kStagingThreads) {
      if constexpr (Traits::kdKVTransposed) {
        // (d, key) accumulators: stmatrix's transposing form writes 8 consecutive d of a key (16
        // bytes) per row of its 8 x 8 matrices. Element-wise 2-byte stores through the transposed
        // view spilled 224 B (their swizzled addresses, computed ahead) at d = 192.
        Tensor st = make_tensor(make_smem_ptr(smem), SmemLayoutT{});
        auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U16x8_STSM_T, Element>{}, mma);
        auto thr_r2s = r2s.get_thread_slice(tid);
        copy(r2s, thr_r2s.retile_S(r), thr_r2s.partition_D(st));
      } else {
        store_pairs(r, mma.get_thread_slice(tid).partition_C(s));
      }
    }
    cutlass::arch::NamedBarrier::sync(kThreads, barrier);
    Element* base = seq.k_rows<Element>(p, out, head_kv) + int64_t(n_block) * kBlockN * out.row_stride;
    store_rows_16b<kRows, kCols, kThreads>(s, kRows * group, base, out.row_stride, seq.seqlen_k - n_block * kBlockN,
                                           cols_in_memory<kHeadDim, kCols>(p), tid % kThreads);
  }
};

// dq = softmax_scale * the fp32 workspace (common/bwd_convert_dq.h), one block of kNMmaThreads
// per query tile, each thread reading back the accumulators it staged in the main kernel
// (dq_index: coalesced float4 loads).
template <typename Traits, bool kPacked>
__global__ void __launch_bounds__(Traits::kNMmaThreads)
    bwd_convert_dq_kernel(const __grid_constant__ BwdParams params, const __grid_constant__ VarlenTiles rows) {
  convert_dq<kFamilyArch, Traits, Traits::kNMmaThreads, kPacked>(params, rows,
                                                                 [](auto& acc, const float* tile, int tid, auto add) {
    CUTE_UNROLL
    for (int j = 0; j < size(acc) / 4; ++j) {
      const float4 v = reinterpret_cast<const float4*>(tile)[dq_index<Traits>(4 * j, tid) / 4];
      if constexpr (decltype(add)::value) {
        acc(4 * j) += v.x;
        acc(4 * j + 1) += v.y;
        acc(4 * j + 2) += v.z;
        acc(4 * j + 3) += v.w;
      } else {
        acc(4 * j) = v.x;
        acc(4 * j + 1) = v.y;
        acc(4 * j + 2) = v.z;
        acc(4 * j + 3) = v.w;
      }
    }
  });
}

}  // namespace cutlass_flash::sm90
