// Compile-time description of one sm80 forward kernel: tile sizes, MMA, shared-memory layouts,
// copy atoms. Everything the mainloop and epilogue need comes from here.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include <type_traits>

namespace cutlass_flash::sm80 {

using namespace cute;

template <typename Element>
using Mma16816 = std::conditional_t<std::is_same_v<Element, cutlass::half_t>, SM80_16x8x16_F32F16F16F32_TN,
                                    SM80_16x8x16_F32BF16BF16F32_TN>;

// Shared-memory layouts for (rows, head_dim) tiles of 16-bit elements: 64-element (128-byte)
// rows swizzled so that ldmatrix and the 16-byte cp.async writes are bank-conflict free.
template <typename Element, int kHeadDim>
struct SmemTileLayout {
  static constexpr int kBlockK = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockK == 64 ? 3 : 2;
  using Atom =
      decltype(composition(Swizzle<kSwizzle, 3, 3>{}, Layout<Shape<_8, Int<kBlockK>>, Stride<Int<kBlockK>, _1>>{}));
  template <int kRows>
  using Tile = decltype(tile_to_shape(Atom{}, Shape<Int<kRows>, Int<kHeadDim>>{}));
  // Global <-> shared copies: 16 bytes (8 elements) per thread per access, rows of kBlockK.
  static constexpr int kThreadsPerRow = kBlockK / 8;
  template <int kThreads>
  using GmemThreadLayout =
      Layout<Shape<Int<kThreads / kThreadsPerRow>, Int<kThreadsPerRow>>, Stride<Int<kThreadsPerRow>, _1>>;
};

// kNarrow: reads and writes tensors narrower than the tile (a head dim zero-padded on chip,
// tile_cols); a separate instantiation, so that the others carry no column predicate.
// kKVStages: K and V buffers in shared memory (FwdMainloop's pipeline depth), 1 or 2.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_, bool kNarrow_ = false,
          int kKVStages_ = 1>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr bool kNarrow = kNarrow_;
  static constexpr int kKVStages = kKVStages_;
  static_assert(kKVStages == 1 || kKVStages == 2);
  // The score policy's probability stage drawn before S is live (ScorePolicy::fwd_probs_draw,
  // which says why) rather than on P in place.
  static constexpr bool kProbsDrawFirst = kHeadDim >= 128;
  static_assert(kBlockM == 16 * kNWarps || kBlockM == 32 * kNWarps, "16 or 32 query rows per warp");
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "the MMA tiles S and O exactly");

  using TiledMma =
      TiledMMA<MMA_Atom<Mma16816<Element>>, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

  using Smem = SmemTileLayout<Element, kHeadDim>;
  using SmemLayoutQ = typename Smem::template Tile<kBlockM>;
  using SmemLayoutKV = typename Smem::template Tile<kBlockN>;
  // V read as the B operand of O = P V needs V^T: the same memory viewed (head_dim, kBlockN).
  using SmemLayoutVt =
      decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;

  using GmemThreads = typename Smem::template GmemThreadLayout<kNThreads>;
  using GmemCopyQKV = decltype(make_tiled_copy(Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>, Element>{},
                                               GmemThreads{}, Layout<Shape<_1, _8>>{}));
  using GmemCopyO =
      decltype(make_tiled_copy(Copy_Atom<UniversalCopy<uint128_t>, Element>{}, GmemThreads{}, Layout<Shape<_1, _8>>{}));

  // Q, then kKVStages K buffers and as many V buffers; O reuses Q's space in the epilogue.
  static constexpr int kSmemBytes = int(sizeof(Element)) * (kBlockM + 2 * kKVStages * kBlockN) * kHeadDim;
};

}  // namespace cutlass_flash::sm80
