// Register-layout helpers, shared-memory GEMM loops and predicated tile copies for mma.sync
// (SM80_16x8x16) kernels.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "cutlass_flash/params.h"
#include "kernels/common/convert.h"

namespace cutlass_flash::sm80 {

using namespace cute;

// (MMA=4, MMA_M, MMA_N) accumulator -> ((2, MMA_M), (2, MMA_N)) = (rows, cols). In an m16n8
// accumulator, values {0,1} share a row and {2,3} sit 8 rows below.
template <typename Layout>
__device__ __forceinline__ auto acc_rowcol_layout(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4);
  static_assert(decltype(rank(acc))::value == 3);
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

template <typename Tensor>
__device__ __forceinline__ auto rowcol_view(Tensor&& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// An m16n8k16 accumulator (MMA=4, MMA_M, MMA_N) re-read as the A operand of the next GEMM:
// ((4, 2), MMA_M, MMA_N / 2), two n8 accumulator tiles making one k16 operand tile.
template <typename Layout>
__device__ __forceinline__ auto acc_as_a_layout(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4);
  auto l = logical_divide(acc, Shape<X, X, _2>{});  // (4, MMA_M, (2, MMA_N / 2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// acc += A * B with both operands in shared memory; the ldmatrix of k-slice i+1 is issued before
// the MMAs of slice i so the shared-memory latency hides behind the tensor cores.
template <typename TensorAcc, typename TensorRA, typename TensorRB, typename TensorSA, typename TensorSB,
          typename TiledMma, typename CopyA, typename CopyB, typename ThrCopyA, typename ThrCopyB>
__device__ __forceinline__ void gemm_ss(TensorAcc& acc, TensorRA& rA, TensorRB& rB, const TensorSA& sA,
                                        const TensorSB& sB, const TiledMma& mma, const CopyA& copy_a,
                                        const CopyB& copy_b, const ThrCopyA& thr_a, const ThrCopyB& thr_b) {
  Tensor rA_view = thr_a.retile_D(rA);
  Tensor rB_view = thr_b.retile_D(rB);
  copy(copy_a, sA(_, _, _0{}), rA_view(_, _, _0{}));
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k < size<2>(rA) - 1) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A * B with A already in registers (the probabilities P) and B in shared memory.
template <typename TensorAcc, typename TensorRA, typename TensorRB, typename TensorSB, typename TiledMma,
          typename CopyB, typename ThrCopyB>
__device__ __forceinline__ void gemm_rs(TensorAcc& acc, const TensorRA& rA, TensorRB& rB, const TensorSB& sB,
                                        const TiledMma& mma, const CopyB& copy_b, const ThrCopyB& thr_b) {
  Tensor rB_view = thr_b.retile_D(rB);
  copy(copy_b, sB(_, _, _0{}), rB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k < size<2>(rA) - 1) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// The rows or columns of a (rows, head_dim) tile that exist in memory: all of them (AllOf), or
// the first n (FirstOf). Columns: a narrow head dim read in place (AttnProblem::cols, a multiple of
// 8); only the kernels built for narrow tensors (Traits::kNarrow) predicate by column: predicates
// in every kernel cost the plain calls 3% (15% at d = 256, forward) on an H100 (PERFLOG.md entry
// 92). Rows: a block that ends past the sequence; the mainloops walk their key (query) blocks from
// the last down, so only the first block they load can, and the loads inside the loop take AllOf
// (the d = 128 backward's loop had a branch per copied row, 16 per query block).
struct AllOf {
  static constexpr bool kAll = true;
  __device__ bool has(int) const { return true; }
};
struct FirstOf {
  static constexpr bool kAll = false;
  int n;
  __device__ bool has(int i) const { return i < n; }
};
template <bool kNarrow>
__device__ __forceinline__ auto tile_cols(const AttnProblem& p) {
  if constexpr (kNarrow)
    return FirstOf{p.cols()};
  else
    return AllOf{};
}

// Global -> shared copy of a (rows, head_dim) tile, partitioned by a cp.async tiled copy:
// (CPY, CPY_M, CPY_K). The rows not in `rows` and the columns not in `cols` are zero-filled in
// shared memory instead of read, so a partial tile never reads out of bounds and never feeds
// garbage (possibly NaN) into the next GEMM (zero columns add nothing to it). Each copy moves 8
// columns.
template <typename TiledCopy, typename TensorG, typename TensorS, typename TensorC, typename Rows,
          typename Cols = AllOf>
__device__ __forceinline__ void copy_rows(const TiledCopy& tiled_copy, const TensorG& src, TensorS& dst,
                                          const TensorC& coords, Rows rows, Cols cols = {}) {
  if constexpr (Rows::kAll && Cols::kAll) {
    copy(tiled_copy, src, dst);
  } else {
    CUTE_UNROLL
    for (int m = 0; m < size<1>(src); ++m) {
      if constexpr (Cols::kAll) {
        if (rows.has(get<0>(coords(0, m, 0)))) {
          copy(tiled_copy, src(_, m, _), dst(_, m, _));
        } else {
          clear(dst(_, m, _));
        }
      } else {
        CUTE_UNROLL
        for (int k = 0; k < size<2>(src); ++k) {
          if (rows.has(get<0>(coords(0, m, k))) && cols.has(get<1>(coords(0, m, k)))) {
            copy(tiled_copy, src(_, m, k), dst(_, m, k));
          } else {
            clear(dst(_, m, k));
          }
        }
      }
    }
  }
}

// Shared -> global copy of a (rows, head_dim) tile, skipping rows at or past `max_rows` and the
// columns not in `cols`.
template <typename TiledCopy, typename TensorS, typename TensorG, typename TensorC, typename Cols = AllOf>
__device__ __forceinline__ void store_rows(const TiledCopy& tiled_copy, const TensorS& src, TensorG& dst,
                                           const TensorC& coords, int max_rows, Cols cols = {}) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (get<0>(coords(0, m, k)) < max_rows && cols.has(get<1>(coords(0, m, k))))
        copy(tiled_copy, src(_, m, k), dst(_, m, k));
    }
  }
}

}  // namespace cutlass_flash::sm80
