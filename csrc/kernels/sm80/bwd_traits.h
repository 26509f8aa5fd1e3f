// Compile-time description of one sm80 backward kernel (FlashAttention-2 algorithm): three tiled
// MMAs (S/dP, dK/dV, dQ), shared-memory layouts and their transposed views.
#pragma once

#include <cute/tensor.hpp>

#include "kernels/sm80/fwd_traits.h"

namespace cutlass_flash::sm80 {

using namespace cute;

template <typename Element, int kWarps, int kAtomM>
using BwdTiledMma = TiledMMA<MMA_Atom<Mma16816<Element>>, Layout<Shape<Int<kAtomM>, Int<kWarps / kAtomM>, _1>>,
                             Tile<Int<16 * kAtomM>, Int<16 * kWarps / kAtomM>, _16>>;

// The same shared-memory tile read transposed: a (rows, cols) layout viewed as (cols, rows).
template <typename SmemLayout, int kRows, int kCols>
using Transposed = decltype(composition(SmemLayout{}, make_layout(Shape<Int<kCols>, Int<kRows>>{}, GenRowMajor{})));

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kAtomMSdP, int kAtomNdKV, int kAtomMdQ,
          int kQStages_, typename Element_, bool kLateOffsets_, bool kNarrow_ = false>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kQStages = kQStages_;
  static constexpr bool kLateOffsets = kLateOffsets_;  // tile_config.h: BwdTile::late_offsets
  static constexpr bool kNarrow = kNarrow_;            // as FwdTraits::kNarrow

  using TiledMmaSdP = BwdTiledMma<Element, kNWarps, kAtomMSdP>;  // (kBlockM, kBlockN) tiles
  // Warps along N of S: above 1, a thread's n8 column groups are 8 * kWarpsNSdP columns apart.
  static constexpr int kWarpsNSdP = kNWarps / kAtomMSdP;
  using TiledMmadKV = BwdTiledMma<Element, kNWarps, kAtomNdKV>;  // (kBlockN, d) tiles
  using TiledMmadQ = BwdTiledMma<Element, kNWarps, kAtomMdQ>;    // (kBlockM, d) tiles
  // Each tiled MMA must tile its output exactly: a partial tile would make the fragments cover
  // more than the block (the dQ scratch tile would overflow into its neighbour).
  static_assert(kBlockM % (16 * kAtomMSdP) == 0 && kBlockN % (16 * kNWarps / kAtomMSdP) == 0);
  static_assert(kBlockN % (16 * kAtomNdKV) == 0 && kHeadDim % (16 * kNWarps / kAtomNdKV) == 0);
  static_assert(kBlockM % (16 * kAtomMdQ) == 0 && kHeadDim % (16 * kNWarps / kAtomMdQ) == 0);

  using Smem = SmemTileLayout<Element, kHeadDim>;
  using SmemLayoutQdO = typename Smem::template Tile<kBlockM>;
  using SmemLayoutKV = typename Smem::template Tile<kBlockN>;
  using SmemLayoutQdOt = Transposed<SmemLayoutQdO, kBlockM, kHeadDim>;  // (d, kBlockM)
  using SmemLayoutQdOtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQdOt{}));
  using SmemLayoutKt = Transposed<SmemLayoutKV, kBlockN, kHeadDim>;  // (d, kBlockN)
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));

  // P and dS tiles (kBlockM, kBlockN), written from registers, read transposed for dV and dK.
  static constexpr int kPBlockN = kBlockN >= 64 ? 64 : 32;
  using SmemLayoutAtomPdS = decltype(composition(Swizzle<(kPBlockN == 64 ? 3 : 2), 3, 3>{},
                                                 Layout<Shape<_8, Int<kPBlockN>>, Stride<Int<kPBlockN>, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = Transposed<SmemLayoutPdS, kBlockM, kBlockN>;  // (kBlockN, kBlockM)
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomStore = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemThreads = typename Smem::template GmemThreadLayout<kNThreads>;
  using GmemCopyIn = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{}, GmemThreads{},
                                              Layout<Shape<_1, _8>>{}));
  using GmemCopyOut =
      decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreads{}, Layout<Shape<_1, _8>>{}));

  // Shared memory, in order: Q (kQStages), dO, K, V, P, dS. dK and dV reuse the start at the end.
  static constexpr int kQTile = kBlockM * kHeadDim;
  static constexpr int kKVTile = kBlockN * kHeadDim;
  static constexpr int kPTile = kBlockM * kBlockN;
  static constexpr int kSmemElems = (kQStages + 1) * kQTile + 2 * kKVTile + 2 * kPTile;
  static constexpr int kSmemBytes = int(sizeof(Element)) * kSmemElems;
  static_assert(2 * kKVTile <= kSmemElems, "the dK/dV epilogue reuses the front of shared memory");
};

}  // namespace cutlass_flash::sm80
