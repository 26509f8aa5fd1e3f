// Compile-time configuration of the sm90 forward kernel: warpgroup roles, wgmma tiled MMAs,
// shared-memory layouts, TMA copy types, pipelines and the shared-storage struct.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cutlass_flash/params.h"
#include "kernels/sm90/tile_scheduler.h"
#include "kernels/sm90/utils.h"

namespace cutlass_flash::sm90 {

using namespace cute;

// kHeadDimV: the head dim of V and O where it differs from Q's and K's (MLA's (192, 128): the
// P V GEMM and O are a third narrower than at kHeadDim).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, typename Element_, int kHeadDimV_ = kHeadDim_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kHeadDimV = kHeadDimV_;

  // Warpgroup 0 produces (one thread issues every TMA load); warpgroups 1.. consume, 64 query
  // rows each.
  static constexpr int kNMmaWarpGroups = kBlockM / 64;
  static constexpr int kNMmaThreads = kNMmaWarpGroups * 128;
  static constexpr int kNThreads = kNMmaThreads + 128;
  static_assert(kBlockM % 64 == 0 && (kNMmaWarpGroups == 2 || kNMmaWarpGroups == 3));
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0 && kHeadDimV % 16 == 0);
  // setmaxnreg: the producer gives its registers to the consumers. 65536 registers a block:
  // 2 consumer warpgroups: 128 x 24 + 256 x 240 = 64512; 3: 128 x 32 + 384 x 160 = 65536.
  static constexpr int kProducerRegs = kNMmaWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kNMmaWarpGroups == 2 ? 240 : 160;
  // The score policy's probability stage in a kernel of its own, chosen at launch (the other one,
  // NoProbsStage, without it), and applied to the 16-bit P once the previous block's P V GEMM is
  // done (ScorePolicy::fwd_probs16) rather than to the fp32 P under it (fwd_probs).
  // score_policy.h says why at these head dims.
  static constexpr bool kProbsKernel = kHeadDim <= 64 || kHeadDim >= 128;
  static constexpr bool kProbsOnP16 = kHeadDim <= 64 || kHeadDim >= 192;
  // Ping-pong of GEMM issue between the consumer warpgroups in the key-block loop (fwd_mainloop.h;
  // a tile's first S GEMM always goes in turn). Off at (192, 128), as FlashAttention-3 has it off
  // at d > 128: a key block costs 2800 SM cycles instead of 2900 (2560 of tensor work), +1.5-2.3%
  // from 2k (PERFLOG 106). Off in the loop and at the tile's start too, causal tiles lost 4%.
  // Without it the loop keeps P in two register buffers (32 more registers a thread): +3-5% without
  // a mask, +1-4% causal (PERFLOG 107).
  static constexpr bool kLoopPingPong = !(kHeadDim == 192 && kHeadDimV == 128);

  // Each consumer warpgroup multiplies its own 64 query rows: one wgmma atom tall.
  using TileShapeQK = Shape<_64, Int<kBlockN>, Int<kHeadDim>>;   // S = Q K^T: (M, N, K=d)
  using TileShapePV = Shape<_64, Int<kHeadDimV>, Int<kBlockN>>;  // O += P V: (M, N=d_v, K)
  // S: both operands in shared memory. O: P from registers (the softmax output, never stored),
  // V read transposed from its (key, d) shared-memory tile (MN-major B).
  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileShapeQK>()));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>()));
  static_assert(size<1>(typename TiledMmaQK::AtomShape_MNK{}) == kBlockN &&
                    size<1>(typename TiledMmaPV::AtomShape_MNK{}) == kHeadDimV,
                "one wgmma per k16 slice: a wgmma N outside CuTe's standard shapes needs "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before any CUTLASS header (list this "
                "instantiation in csrc/generate.py's Family.extended_gmma)");
  // Whether a GEMM's N needs CuTe's extended wgmma shapes (sm90/utils.h: standard_gmma_n).
  static constexpr bool kExtendedGmma =
      !standard_gmma_n(kBlockN) || !standard_gmma_n(kHeadDim) || !standard_gmma_n(kHeadDimV);

  // Swizzled K-major layouts (128-byte swizzle when a row is a multiple of 64 elements), as TMA
  // writes them and wgmma reads them without bank conflicts.
  template <int kRows, int kCols = kHeadDim>
  using SmemAtom =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kRows>, Int<kCols>>());
  // Q and O are stacks of 64-row slabs, one per consumer warpgroup (O's TMA store is per slab).
  using SmemLayoutSlab = decltype(tile_to_shape(SmemAtom<64>{}, Shape<_64, Int<kHeadDim>>{}));
  using SmemLayoutSlabO = decltype(tile_to_shape(SmemAtom<64, kHeadDimV>{}, Shape<_64, Int<kHeadDimV>>{}));
  static constexpr int kSlabElems = cosize_v<SmemLayoutSlab>, kSlabElemsO = cosize_v<SmemLayoutSlabO>;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom<kBlockN>{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV =
      decltype(tile_to_shape(SmemAtom<kBlockN, kHeadDimV>{}, Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

  static constexpr int kQElems = kNMmaWarpGroups * kSlabElems, kOElems = kNMmaWarpGroups * kSlabElemsO;
  static constexpr int kKElems = cosize_v<SmemLayoutK>, kVElems = cosize_v<SmemLayoutV>;
  static constexpr int kSeparateOBytes = (kQElems + kOElems + kKElems + kVElems) * int(sizeof(Element));
  static constexpr int kMaxSmemBytes = 227 * 1024;
  // When Q, O and the K/V stages do not fit side by side (d = 192, 256, (192, 128)), O is staged
  // in V's stages, as FlashAttention-3: every V read of the tile is done by then. The K/V thread
  // stores it (o_full) before it loads the next tile's V there, so the consumers wait for no
  // store, and the next Q and first K blocks load during the tile's last P V GEMM and epilogue.
  // Staged in Q's place instead, the next tile's first GEMM waited for O's store and then Q's
  // load (ncu, (192, 128), 2k: 4% of the stall samples; PERFLOG.md entry 103).
  static constexpr bool kOInV = kSeparateOBytes + 1024 > kMaxSmemBytes;
  static_assert(!kOInV || kOElems <= kVElems, "O's slabs fit in V's stages");
  // Where O fits in one stage ((192, 128): two 16 KiB slabs in a 32 KiB stage), it goes in the
  // stage of the tile's next-to-last V block, which every warpgroup releases before its last P V
  // GEMM: a warpgroup stages its O once that stage is released (FwdEpilogue::OSlot), not after a
  // barrier with the other warpgroup's last P V GEMM, half a ping-pong step behind. With two
  // stages that is also the stage the next tile's first V loads into, after the store.
  static constexpr bool kOInOneStage = kOInV && kStages == 2 && kOElems <= kVElems / kStages;

  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(Element);

  // TMA: global tensors are viewed as (seqlen, d, head, batch) with the caller's strides.
  using GmemLayout = Layout<Shape<int32_t, int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t, int64_t>>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      SmemLayoutSlab{}, Shape<_64, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      take<0, 2>(SmemLayoutV{}), Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{}));
  using TmaO =
      decltype(make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element*>(nullptr)), GmemLayout{}),
                             SmemLayoutSlabO{}, Shape<_64, Int<kHeadDimV>>{}, _1{}));

  using PipelineKV = cutlass::PipelineTmaAsync<kStages>;

  struct SharedStorage {
    cute::array_aligned<Element, kQElems + (kOInV ? 0 : kOElems), 1024> qo;  // Q, then O unless in V's stages
    cute::array_aligned<Element, kKElems, 1024> k;
    cute::array_aligned<Element, kVElems, 1024> v;
    typename PipelineKV::SharedStorage pipeline_k;
    typename PipelineKV::SharedStorage pipeline_v;
    // Per consumer warpgroup and its slab of Q (FwdMainloop::publish). q_full also publishes the
    // tile (`tile[i & 1]`: its coordinates and key-block range, written by the producer before its
    // arrival): every tile, including those that load no Q and the end marker (coord.block < 0),
    // completes one phase of each q_full and (except the last) of each q_empty.
    cutlass::arch::ClusterTransactionBarrier q_full[kNMmaWarpGroups];
    cutlass::arch::ClusterBarrier q_empty[kNMmaWarpGroups];
    TileWork tile[2];
    DynamicTileScheduler::SharedStorage scheduler;  // the tile thread's hand-over to the K/V thread
    // kOInV: one phase per tile with keys, once every consumer has staged its O in V's stages
    // (the K/V thread stores it: FwdEpilogue::store_staged).
    cutlass::arch::ClusterBarrier o_full;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= kMaxSmemBytes, "sm90 forward tile does not fit in shared memory");

  // Arrivals that free a warpgroup's slab of Q for the next tile: its threads, after its last S GEMM.
  static constexpr int kQEmptyArrivals = kNMmaThreads / kNMmaWarpGroups;
};

// Named barriers of the consumer warpgroups (ids after CUTLASS's reserved ones).
enum class FwdBarrier : int {
  kPingPongWG1 = 0,  // + warpgroup index - 1: ping-pong of GEMM issue
  kEpilogueWG1 = 3,  // + warpgroup index - 1: a warpgroup's O staging in shared memory
  kVClip = 6,        // every consumer: a packed sequence's last V block cleared past its keys
  kOInV = 7,         // every consumer: V's stages read, O may be staged in them (FwdTraits::kOInV)
};

// Kernel parameters: the library's plain FwdParams plus the TMA descriptors built from them.
template <typename Traits>
struct FwdKernelParams {
  AttnProblem problem;
  TensorRef4 o;  // for tiles that see no key, stored directly
  float* lse;
  DynamicTileScheduler::Params scheduler;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaK tma_k;
  typename Traits::TmaV tma_v;
  typename Traits::TmaO tma_o;
};

}  // namespace cutlass_flash::sm90
