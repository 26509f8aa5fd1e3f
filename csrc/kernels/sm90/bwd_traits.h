// Compile-time configuration of the sm90 backward kernel: warpgroup roles, wgmma tiled MMAs,
// shared-memory layouts, TMA copy types, pipelines and the shared-storage struct.
//
// A block owns kBlockN keys and walks the query blocks that see them. Three layouts:
// - keys per warpgroup (d <= 128, BwdTraits): 64 keys a consumer warpgroup; per query block every
//   warpgroup computes its keys' S^T = K Q^T and dP^T = V dO^T (keys as the wgmma M dimension,
//   FlashAttention-3's "swapAB"), so that P^T and dS^T come out of the accumulators already in the
//   register layout of the A operand of dV += P^T dO and dK += dS^T Q: neither goes through shared
//   memory. dS^T is also stored to shared memory for dQ = dS K, which the warpgroups split along
//   the queries (d = 64) or the head dim;
// - split d, keys as rows (d = 256, BwdTraitsSplitD): 64 keys, two warpgroups splitting the head
//   dim of dK, dV and dQ, S^T as above;
// - split d, queries as rows (d = 192, BwdTraitsSplitDQueryRows): FlashAttention-3's d = 192
//   layout, more keys a block than wgmma's 64-row atom splits among warpgroups.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cutlass_flash/params.h"
#include "kernels/common/tile_order.h"
#include "kernels/sm90/utils.h"

namespace cutlass_flash::sm90 {

using namespace cute;

// Where the dQ thread adds a step's staged dQ, written by the first consumer thread with it.
struct DqTarget {
  float* dst;      // the query tile's fp32 rows in the workspace
  int* semaphore;  // deterministic mode: its semaphore and this key block's turn; else null
  int turn;
};

// What the layouts share: the shapes, the (query, d) and (key, d) tiles in shared memory with
// their transposed views, the dS tile, the TMA copies and the pipelines of Q and dO.
// kSplitCols: the widest column range of the (key, d) and (query, d) tiles that one warpgroup's
// wgmma reads on its own (dQ's columns, or dK/dV's in the split-d layouts). The tiles' swizzle atom
// is chosen to divide it, as a wgmma operand cannot start inside an atom: d = 96 splits into
// 48-column halves (16-column atoms), d = 192 into thirds of 64 (64-column atoms).
// kScoresTransposed: the consumers compute S^T and dP^T (keys as wgmma rows; the score tiles and
// their coordinates are (key, query)), else S and dP ((query, key)).
// kHeadDimV: the head dim of V, dO and dV where it differs from Q's and K's (MLA's (192, 128):
// dP's GEMM and dV's a third smaller than at kHeadDim; BwdTraitsSplitDQueryRows only).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNMmaWarpGroups_, int kStages_, int kSplitCols,
          typename Element_, bool kScoresTransposed_ = true, int kHeadDimV_ = kHeadDim_>
struct BwdTraitsBase {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_, kBlockM = kBlockM_, kBlockN = kBlockN_, kStages = kStages_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kScoresTransposed = kScoresTransposed_;
  // The shape of a step's score tile (S^T or S) as the accumulators hold it.
  using ScoreShape =
      std::conditional_t<kScoresTransposed, Shape<Int<kBlockN>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kBlockN>>>;
  static constexpr int kNMmaWarpGroups = kNMmaWarpGroups_;
  static constexpr int kNMmaThreads = kNMmaWarpGroups * 128;
  static constexpr int kNThreads = kNMmaThreads + 128;
  static_assert(kNMmaWarpGroups == 2 || kNMmaWarpGroups == 3);
  // setmaxnreg moves registers within the block's launch allocation (384 threads x 168 = 64512):
  // 2 consumer warpgroups 128 x 24 + 256 x 240 = 64512. Asking for more than the block holds
  // blocks setmaxnreg.inc forever (seen: 32 + 240 hung the first GPU run).
  static constexpr int kProducerRegs = kNMmaWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kNMmaWarpGroups == 2 ? 240 : 160;
  // 64-query steps (d >= 96) leave registers for the values the score policy lets a step hold
  // through it (ScorePolicy::Held, HeadValues: which, and what holding them measured, there); a
  // 128-query step (d = 64: S^T and dP^T already take 128 registers) recomputes them instead.
  static constexpr bool kHoldsFeatureValues = kBlockM <= 64;

  using WarpGroupsAlongM = Layout<Shape<Int<kNMmaWarpGroups>, _1, _1>>;
  using WarpGroupsAlongN = Layout<Shape<_1, Int<kNMmaWarpGroups>, _1>>;

  template <GMMA::Major kMajor, int kRows, int kCols>
  using SmemAtom =
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<kMajor, Element, Int<kRows>, Int<kCols>>());
  // K and V: (key, d), K-major A operands of S^T / dP^T; K also the MN-major B operand of dQ.
  using SmemLayoutKV =
      decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockN, kSplitCols>{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutKV{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  // Q and dO: (query, d, stage), K-major B operands of S^T / dP^T, and read transposed as the
  // MN-major B operands of dK / dV.
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockM, kSplitCols>{},
                                             Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // V as K and dO as Q, kHeadDimV wide (the same layouts where kHeadDimV = kHeadDim): their atom
  // divides both kSplitCols and kHeadDimV, as a warpgroup's share of dV's columns starts at a
  // multiple of kSplitCols.
  static constexpr int kSplitColsV = cute::gcd(kSplitCols, kHeadDimV);
  using SmemLayoutV =
      decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockN, kSplitColsV>{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}));
  using SmemLayoutVt =
      decltype(composition(SmemLayoutV{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtom<GMMA::Major::K, kBlockM, kSplitColsV>{},
                                              Shape<Int<kBlockM>, Int<kHeadDimV>, Int<kStages>>{}));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  // dS: (query, key, buffer), the A operand of dQ. From S^T it is written through its transpose
  // (key, query), where each thread's accumulator pairs are two consecutive queries: queries
  // contiguous (MN-major); from S, pairs of consecutive keys: keys contiguous (K-major). Two
  // buffers: a warpgroup writes step i + 1's dS while another may still read step i's.
  static constexpr int kdSBuffers = 2;
  using SmemLayoutdS =
      decltype(tile_to_shape(SmemAtom<(kScoresTransposed ? GMMA::Major::MN : GMMA::Major::K), kBlockM, kBlockN>{},
                             Shape<Int<kBlockM>, Int<kBlockN>, Int<kdSBuffers>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>, Int<kdSBuffers>>{}, Step<_2, _1, _3>{})));
  // dS (and P) as the score accumulators hold it: where their stmatrix stores write.
  using SmemLayoutdSScores = std::conditional_t<kScoresTransposed, SmemLayoutdSt, SmemLayoutdS>;

  static constexpr int kQElems = cosize_v<SmemLayoutQ>, kKVElems = cosize_v<SmemLayoutKV>;
  static constexpr int kdOElems = cosize_v<SmemLayoutdO>, kVElems = cosize_v<SmemLayoutV>;
  static constexpr uint32_t kQBytes = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kdOBytes = kBlockM * kHeadDimV * sizeof(Element);
  static constexpr uint32_t kRowStatBytes = kBlockM * sizeof(float);  // LSE or D of one query block
  static constexpr uint32_t kKVBytes = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(Element);

  using GmemLayout = Layout<Shape<int32_t, int32_t, int32_t, int32_t>, Stride<int64_t, _1, int64_t, int64_t>>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                       make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                       SmemLayoutKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmadO = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                       make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                       take<0, 2>(SmemLayoutdO{}), Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{},
                                      make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
                                      SmemLayoutV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{}));

  // Q with its LSE, dO with its D: one pipeline stage each.
  using Pipeline = cutlass::PipelineTmaAsync<kStages>;

  // The shared memory both layouts use; each adds its own after these members.
  struct SharedStorageBase {
    cute::array_aligned<Element, kKVElems, 1024> k;
    cute::array_aligned<Element, kVElems, 1024> v;
    cute::array_aligned<Element, kQElems, 1024> q;
    cute::array_aligned<Element, kdOElems, 1024> dout;
    cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> ds;
  };
};

// Layout "keys per warpgroup" (d <= 128): consumer warpgroup w owns keys [64 w, 64 w + 64) of the
// block, with their dK and dV in registers (d registers a thread); dQ's columns are split between
// the warpgroups and staged in fp32 shared memory for the dQ thread's bulk reduce-add.
template <int kHeadDim_, int kBlockM_, int kNMmaWarpGroups_, int kStages_, typename Element_>
struct BwdTraits : BwdTraitsBase<kHeadDim_, kBlockM_, 64 * kNMmaWarpGroups_, kNMmaWarpGroups_, kStages_,
                                 (kHeadDim_ % 64 == 0 ? kHeadDim_ : kHeadDim_ / kNMmaWarpGroups_), Element_> {
  using Base = BwdTraitsBase<kHeadDim_, kBlockM_, 64 * kNMmaWarpGroups_, kNMmaWarpGroups_, kStages_,
                             (kHeadDim_ % 64 == 0 ? kHeadDim_ : kHeadDim_ / kNMmaWarpGroups_), Element_>;
  using Base::kBlockM;
  using Base::kBlockN;
  using Base::kHeadDim;
  using Base::kNMmaWarpGroups;
  using Base::kStages;
  using typename Base::Element;
  using typename Base::Pipeline;
  using typename Base::WarpGroupsAlongM;
  using typename Base::WarpGroupsAlongN;
  static_assert(kBlockM % 64 == 0 && kHeadDim % (16 * kNMmaWarpGroups) == 0);
  static constexpr bool kDqThread = true;
  // Warpgroup w alone reads V's rows [64 w, 64 w + 64) (dP^T): free for its epilogue's staging.
  static constexpr bool kOwnVRows = true;
  // dK and dV accumulate as (key, d).
  static constexpr bool kdKVTransposed = false;
  using dKVShape = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using dVShape = dKVShape;
  static constexpr int kdVWarpGroups = kNMmaWarpGroups;  // the warpgroups with a share of dV

  // S^T = K Q^T and dP^T = V dO^T: (M = keys, N = queries, K = d), both operands K-major.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(), WarpGroupsAlongM{}));
  // dV += P^T dO and dK += dS^T Q: (M = keys, N = d, K = queries), A from registers, B (dO, Q)
  // read transposed from their (query, d) tiles.
  using TiledMmadKV =
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              WarpGroupsAlongM{}));
  using TiledMmadV = TiledMmadKV;
  // dQ = dS K: (M = queries, N = d, K = keys). Where the step has 64 queries a warpgroup
  // (d = 64: 128), warpgroup w computes rows [64 w, 64 w + 64), all columns; else columns
  // [w d / W, (w + 1) d / W). Split by columns at d = 64, each warpgroup's m128 n32 wgmma read
  // all of dS and K's half twice: 48 KiB of shared memory a warpgroup for 1 MFLOP, 188 B/clk at
  // the tensor rate against the 128 B/clk shared memory delivers; split by rows, 32 KiB (125).
  static constexpr bool kdQRowsPerWarpgroup = kBlockM == 64 * kNMmaWarpGroups;
  static constexpr int kdQCols = kdQRowsPerWarpgroup ? kHeadDim : kHeadDim / kNMmaWarpGroups;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float,
                           Shape<Int<kdQRowsPerWarpgroup ? 64 : kBlockM>, Int<kdQCols>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      std::conditional_t<kdQRowsPerWarpgroup, WarpGroupsAlongM, WarpGroupsAlongN>{}));
  static_assert(size<1>(typename TiledMmaSdP::AtomShape_MNK{}) == kBlockM &&
                    size<1>(typename TiledMmadKV::AtomShape_MNK{}) == kHeadDim &&
                    size<1>(typename TiledMmadQ::AtomShape_MNK{}) == kdQCols,
                "one wgmma per k16 slice: a wgmma N outside CuTe's standard shapes needs "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before any CUTLASS header (list this "
                "instantiation in csrc/generate.py's Family.extended_gmma)");
  // Whether a GEMM's N needs CuTe's extended wgmma shapes (sm90/utils.h: standard_gmma_n).
  static constexpr bool kExtendedGmma =
      !standard_gmma_n(kBlockM) || !standard_gmma_n(kHeadDim) || !standard_gmma_n(kdQCols);

  // dQ of one step in fp32, thread-major (dq_index), reduced into the workspace by one bulk add.
  // Two buffers: the consumers stage step i + 1's dQ while the dQ thread still adds step i's,
  // which in deterministic mode waits for the lower key blocks' additions and for its own to
  // complete before the next block's turn.
  static constexpr int kdQElems = kBlockM * kHeadDim;
  static constexpr int kdQBuffers = 2;

  struct SharedStorage : Base::SharedStorageBase {
    cute::array_aligned<float, kdQElems * kdQBuffers, 128> dq;
    cute::array_aligned<float, kBlockM * kStages, 128> lse_log2;
    cute::array_aligned<float, kBlockM * kStages, 128> dpsum;
    typename Pipeline::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_do;
    cutlass::arch::ClusterTransactionBarrier kv_full;
    // The dQ of a step, per buffer: staged by the consumers (dq_full, every consumer thread
    // arrives), added to the workspace by the producer's dQ thread (dq_empty once the bulk add has
    // read it).
    cutlass::arch::ClusterBarrier dq_full[kdQBuffers];
    cutlass::arch::ClusterBarrier dq_empty[kdQBuffers];
    DqTarget dq_target[kdQBuffers];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "sm90 backward tile does not fit in shared memory");
};

// Layout "head dim per warpgroup" (d = 256, where 2 x 64 x d fp32 accumulators of dK and dV
// exceed a warpgroup's registers): a block of 64 keys; the two consumer warpgroups split S^T and
// dP^T along the queries (32 each), write P^T and dS^T to shared memory, and split dV, dK and dQ
// along the head dim (d / 2 columns each: 2 x d / 4 accumulator registers a thread for dK and dV,
// d / 4 for dQ). dQ goes from registers to the workspace with 16-byte reductions (red, no value
// returned): its fp32 staging tile (64 x d x 4 bytes = 64 KiB at d = 256) does not fit beside K,
// V and two stages of Q and dO (224 KiB).
template <int kHeadDim_, int kBlockM_, int kStages_, typename Element_>
struct BwdTraitsSplitD : BwdTraitsBase<kHeadDim_, kBlockM_, 64, 2, kStages_, kHeadDim_ / 2, Element_> {
  using Base = BwdTraitsBase<kHeadDim_, kBlockM_, 64, 2, kStages_, kHeadDim_ / 2, Element_>;
  using Base::kBlockM;
  using Base::kBlockN;
  using Base::kHeadDim;
  using Base::kStages;
  using typename Base::Element;
  using typename Base::Pipeline;
  using typename Base::WarpGroupsAlongN;
  static_assert(kBlockM == 64 && kHeadDim % 64 == 0);
  static constexpr bool kDqThread = false;
  static constexpr bool kOwnVRows = false;  // both warpgroups read all of V (dP^T split by queries)
  static constexpr bool kdKVTransposed = false;
  using dKVShape = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using dVShape = dKVShape;
  static constexpr int kdVWarpGroups = 2;

  // S^T = K Q^T and dP^T = V dO^T: (M = keys, N = queries, K = d); warpgroup w takes queries
  // [w kBlockM / 2, (w + 1) kBlockM / 2).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM / 2>, Int<kHeadDim>>>(),
      WarpGroupsAlongN{}));
  // dV += P^T dO and dK += dS^T Q: (M = keys, N = d, K = queries), P^T and dS^T read from shared
  // memory (K-major through the transposed view of the dS layout); warpgroup w takes columns
  // [w d / 2, (w + 1) d / 2).
  using TiledMmadKV =
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim / 2>, Int<kBlockM>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              WarpGroupsAlongN{}));
  using TiledMmadV = TiledMmadKV;
  // dQ = dS K: (M = queries, N = d, K = keys), columns split as dK's.
  static constexpr int kdQCols = kHeadDim / 2;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kdQCols>, Int<kBlockN>>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      WarpGroupsAlongN{}));
  static_assert(size<1>(typename TiledMmaSdP::AtomShape_MNK{}) == kBlockM / 2 &&
                    size<1>(typename TiledMmadKV::AtomShape_MNK{}) == kHeadDim / 2 &&
                    size<1>(typename TiledMmadQ::AtomShape_MNK{}) == kdQCols,
                "one wgmma per k16 slice: a wgmma N outside CuTe's standard shapes needs "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before any CUTLASS header (list this "
                "instantiation in csrc/generate.py's Family.extended_gmma)");
  static constexpr bool kExtendedGmma =
      !standard_gmma_n(kBlockM / 2) || !standard_gmma_n(kHeadDim / 2) || !standard_gmma_n(kdQCols);

  struct SharedStorage : Base::SharedStorageBase {
    cute::array_aligned<Element, cosize_v<typename Base::SmemLayoutdS>, 1024> p;  // P^T, as dS
    cute::array_aligned<float, kBlockM * kStages, 128> lse_log2;
    cute::array_aligned<float, kBlockM * kStages, 128> dpsum;
    typename Pipeline::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_do;
    cutlass::arch::ClusterTransactionBarrier kv_full;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "sm90 backward tile does not fit in shared memory");
};

// Layout "head dim per warpgroup, queries as rows" (FlashAttention-3's d = 192 backward): a block
// of kBlockN keys, kNMmaWarpGroups consumer warpgroups. Per query block of 64, warpgroup w computes
// S = Q K^T and dP = dO V^T for all the queries and its kBlockN / W keys (queries as wgmma rows:
// kBlockN need not split into 64-row atoms), writes P and dS to shared memory, and takes columns
// [w d / W, (w + 1) d / W) of dV^T += dO^T P, dK^T += Q^T dS (the head dim as wgmma rows) and of
// dQ = dS K, added to the workspace with 16-byte reductions as in BwdTraitsSplitD. Against that
// layout's 64 keys at d = 192, each step's loads of Q, dO, LSE and D and its P / dS round trip
// serve 1.5x the keys (96). Registers a thread at d = 192, 96 keys, three warpgroups (160 each):
// dK^T + dV^T 96, S + dP 32, dQ 32.
// With a head dim of V of its own (MLA's (192, 128)), dV^T has kHeadDimV rows: warpgroups
// [0, kHeadDimV / (d / W)) take d / W of them each and the others none (wgmma's atom is 64 rows
// tall: 128 rows do not split in three). The block's tensor work per step at (192, 128) is then
// 39 units of 64 x 32 x 64 against 45 on the d = 192 kernel with V padded; the warpgroups with a
// share of dV issue 14 of them, the last one 11.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNMmaWarpGroups_, int kStages_, typename Element_,
          int kHeadDimV_ = kHeadDim_>
struct BwdTraitsSplitDQueryRows
    : BwdTraitsBase<kHeadDim_, kBlockM_, kBlockN_, kNMmaWarpGroups_, kStages_, kHeadDim_ / kNMmaWarpGroups_, Element_,
                    /*kScoresTransposed=*/false, kHeadDimV_> {
  using Base = BwdTraitsBase<kHeadDim_, kBlockM_, kBlockN_, kNMmaWarpGroups_, kStages_, kHeadDim_ / kNMmaWarpGroups_,
                             Element_, false, kHeadDimV_>;
  using Base::kBlockM;
  using Base::kBlockN;
  using Base::kHeadDim;
  using Base::kHeadDimV;
  using Base::kNMmaWarpGroups;
  using Base::kStages;
  using typename Base::Element;
  using typename Base::Pipeline;
  using typename Base::WarpGroupsAlongM;
  using typename Base::WarpGroupsAlongN;
  static constexpr int kKeysPerWarpgroup = kBlockN / kNMmaWarpGroups;
  static constexpr int kdQCols = kHeadDim / kNMmaWarpGroups;
  static_assert(kBlockM == 64 && kKeysPerWarpgroup % 16 == 0 && kdQCols % 64 == 0);
  static constexpr bool kDqThread = false;
  static constexpr bool kOwnVRows = false;  // every warpgroup reads V's rows of its keys for all d
  // dK and dV accumulate transposed, (d, key).
  static constexpr bool kdKVTransposed = true;
  using dKVShape = Shape<Int<kHeadDim>, Int<kBlockN>>;
  using dVShape = Shape<Int<kHeadDimV>, Int<kBlockN>>;
  static constexpr int kdVWarpGroups = kHeadDimV / kdQCols;
  static_assert(kHeadDimV % kdQCols == 0 && kHeadDimV <= kHeadDim);

  // S = Q K^T and dP = dO V^T: (M = queries, N = keys, K = d), both operands K-major; warpgroup
  // w takes keys [w kBlockN / W, (w + 1) kBlockN / W).
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kKeysPerWarpgroup>, Int<kHeadDim>>>(),
      WarpGroupsAlongN{}));
  // dV^T += dO^T P and dK^T += Q^T dS: (M = d, N = keys, K = queries), dO^T / Q^T read through the
  // transposed view of their (query, d) tiles, P / dS through that of their (query, key) tiles
  // (both MN-major); warpgroup w takes rows [w d / W, (w + 1) d / W).
  using TiledMmadKV =
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kBlockM>>,
                                                   GMMA::Major::MN, GMMA::Major::MN>(),
                              WarpGroupsAlongM{}));
  // dV^T over its kdVWarpGroups warpgroups (TiledMmadKV's type where kHeadDimV = kHeadDim).
  using TiledMmadV =
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kBlockM>>,
                                                   GMMA::Major::MN, GMMA::Major::MN>(),
                              Layout<Shape<Int<kdVWarpGroups>, _1, _1>>{}));
  // dQ = dS K: (M = queries, N = d, K = keys), dS K-major, K MN-major; columns split as dK's.
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kdQCols>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      WarpGroupsAlongN{}));
  static_assert(size<1>(typename TiledMmaSdP::AtomShape_MNK{}) == kKeysPerWarpgroup &&
                    size<1>(typename TiledMmadKV::AtomShape_MNK{}) == kBlockN &&
                    size<1>(typename TiledMmadQ::AtomShape_MNK{}) == kdQCols,
                "one wgmma per k16 slice: a wgmma N outside CuTe's standard shapes needs "
                "CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED before any CUTLASS header (list this "
                "instantiation in csrc/generate.py's Family.extended_gmma)");
  static constexpr bool kExtendedGmma =
      !standard_gmma_n(kKeysPerWarpgroup) || !standard_gmma_n(kBlockN) || !standard_gmma_n(kdQCols);

  struct SharedStorage : Base::SharedStorageBase {
    cute::array_aligned<Element, cosize_v<typename Base::SmemLayoutdS>, 1024> p;  // P, as dS
    cute::array_aligned<float, kBlockM * kStages, 128> lse_log2;
    cute::array_aligned<float, kBlockM * kStages, 128> dpsum;
    typename Pipeline::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_do;
    cutlass::arch::ClusterTransactionBarrier kv_full;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "sm90 backward tile does not fit in shared memory");
};

// Named barriers of the consumer warpgroups (ids after CUTLASS's reserved ones).
enum class BwdBarrier : int {
  kdSReady = 0,      // every warpgroup's dS^T (and P^T) of the step is in shared memory
  kdQTurn = 1,       // split-d layouts, deterministic: the dQ warp has seen the block's turn to add dQ
  kdQAdded = 2,      // split-d layouts, deterministic: the consumers have issued their dQ reductions
  kEpilogue = 3,     // split-d layouts: every warpgroup's dK/dV staging in V's tile
  kEpilogueWG1 = 4,  // + warpgroup index, keys-per-warpgroup layout: one warpgroup's staging
  kClearRows = 6,    // every consumer: a packed sequence's rows past its end zeroed (clear_kv_past)
};

// Kernel parameters: the library's plain BwdParams plus the TMA descriptors built from them.
template <typename Traits>
struct BwdKernelParams {
  AttnProblem problem;
  TensorRef4 dk, dv;
  float* dq_accum;  // workspace arrays (generated/bwd_workspace.h), rows rounded per (batch, head)
  const float* dpsum;
  const float* lse_log2;
  int* dq_semaphore;              // null unless deterministic
  int64_t rows_per_head;          // BwdWorkspace::rows_per_head
  int64_t dq_group_rows;          // BwdWorkspace::rows: the row offset between dQ groups' copies
  int dq_groups;                  // BwdWorkspace::dq_groups (1 unless deterministic)
  GridTileMap::Params scheduler;  // a packed batch's key blocks
  typename Traits::TmaQ tma_q;
  typename Traits::TmadO tma_do;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;

  // dq_semaphore, or null where a packed batch's tile list was cut (VarlenTiles::truncated: bad
  // cu_seqlens, whose turns would wait for blocks that never run).
  __device__ int* semaphores() const {
    return scheduler.tiles.count != nullptr && scheduler.tiles.truncated() ? nullptr : dq_semaphore;
  }
};

}  // namespace cutlass_flash::sm90
