// Host launcher of the sm90 backward: preprocess (shared with sm80), main kernel, dQ conversion,
// all on the caller's stream.
#pragma once

#include <cute/tensor.hpp>

#include "generated/bwd_workspace.h"
#include "kernels/common/bwd_preprocess.h"
#include "kernels/common/launch_utils.h"
#include "kernels/common/tile_order.h"
#include "kernels/common/varlen_tiles.h"
#include "kernels/sm90/bwd_epilogue.h"
#include "kernels/sm90/bwd_kernel.h"
#include "kernels/sm90/bwd_mainloop_split_d.h"
#include "kernels/sm90/bwd_traits.h"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tile_config.h"
#include "kernels/sm90/tma_plan.h"

namespace cutlass_flash::sm90 {

template <typename Traits>
BwdKernelParams<Traits> make_bwd_kernel_params(const BwdParams& params) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  const AttnProblem& p = params.problem;
  BwdKernelParams<Traits> kp{};
  kp.problem = p;
  auto q = gmem_tensor<const Element>(params.q, true, p);
  auto dout = gmem_tensor<const Element>(params.dout, true, p, p.cols_v());
  auto k = gmem_tensor<const Element>(params.k, false, p);
  auto v = gmem_tensor<const Element>(params.v, false, p, p.cols_v());
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, take<0, 2>(typename Traits::SmemLayoutQ{}),
                           Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
  kp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, dout, take<0, 2>(typename Traits::SmemLayoutdO{}),
                            Shape<Int<kBlockM>, Int<kHeadDimV>>{}, _1{});
  kp.tma_k =
      make_tma_copy(SM90_TMA_LOAD{}, k, typename Traits::SmemLayoutKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  kp.tma_v =
      make_tma_copy(SM90_TMA_LOAD{}, v, typename Traits::SmemLayoutV{}, Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{});
  return kp;
}

// Kernel parameters for `params`: a cached plan (tma_plan.h) with the per-call fields set.
template <typename Traits>
BwdKernelParams<Traits> bwd_kernel_params(const BwdParams& params) {
  const TmaPlanKey<4> key(params.problem, {&params.q, &params.dout, &params.k, &params.v});
  BwdKernelParams<Traits> kp = cached_kernel_params<BwdKernelParams<Traits>>(
      key, [&] { return make_bwd_kernel_params<Traits>(params); }, [&](BwdKernelParams<Traits>& kp) {
    return replace_address(kp.tma_q, params.q.ptr) && replace_address(kp.tma_do, params.dout.ptr) &&
           replace_address(kp.tma_k, params.k.ptr) && replace_address(kp.tma_v, params.v.ptr);
  });
  // Every per-call field is set here, not taken from the cached plan: the plan's key holds only
  // what the descriptors depend on (a cached score parameter or cu_seqlens pointer would be stale).
  kp.problem = params.problem;
  const BwdWorkspace ws = bwd_workspace_layout(params.problem, params.deterministic, kFamilyArch);
  char* workspace = static_cast<char*>(params.workspace);
  kp.dk = params.dk;
  kp.dv = params.dv;
  kp.dq_accum = reinterpret_cast<float*>(workspace + ws.dq_accum_offset);
  kp.dpsum = reinterpret_cast<const float*>(workspace + ws.dpsum_offset);
  kp.lse_log2 = reinterpret_cast<const float*>(workspace + ws.lse_log2_offset);
  kp.dq_semaphore = params.deterministic ? reinterpret_cast<int*>(workspace + ws.dq_semaphore_offset) : nullptr;
  kp.rows_per_head = ws.rows_per_head;
  kp.dq_group_rows = ws.rows;
  kp.dq_groups = ws.dq_groups;
  return kp;
}

template <typename Mainloop>
Status run_bwd_mainloop(const BwdParams& params, cudaStream_t stream) {
  using Traits = typename Mainloop::Traits;
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  const AttnProblem& p = params.problem;
  for (auto [ref, name] : {std::pair{&params.q, "q"}, {&params.k, "k"}, {&params.v, "v"}, {&params.dout, "dout"}})
    if (Status s = check_tma_ref<Element>(*ref, name, "backward"); !s.ok()) return s;
  if (Status s = check_smem_fits(Traits::kSmemBytes, "sm90 backward"); !s.ok()) return s;

  // A packed batch: its query rows (preprocess, dQ conversion) and key blocks (main kernel) are
  // listed first, so that every grid covers the real tiles (common/varlen_tiles.h), and the rows
  // after its last sequence of dq, dk and dv are zeroed.
  VarlenTiles rows, keys;
  if (p.is_varlen()) {
    if (Status s = launch_bwd_varlen_prep(params, kFamilyArch, Traits::kBlockN, stream, rows, keys, "sm90 backward");
        !s.ok())
      return s;
  }

  const dim3 pre_grid = BwdPreprocess::grid(params, kFamilyArch, rows);
  if (p.is_varlen())
    bwd_preprocess_kernel<kFamilyArch, kHeadDim, Element, true>
        <<<pre_grid, BwdPreprocess::kWarps * 32, 0, stream>>>(params, rows);
  else
    bwd_preprocess_kernel<kFamilyArch, kHeadDim, Element, false>
        <<<pre_grid, BwdPreprocess::kWarps * 32, 0, stream>>>(params, rows);
  if (Status s = cuda_status(cudaGetLastError(), "sm90 backward preprocess launch"); !s.ok()) return s;

  // The TMA descriptors after a launch: encoded before this thread's first launch of the
  // library (an autograd thread, the low-level pair), cuTensorMapEncodeTiled returned
  // CUDA_ERROR_INVALID_CONTEXT (201) and the kernel ran on a garbage descriptor.
  BwdKernelParams<Traits> kp = bwd_kernel_params<Traits>(params);
  kp.scheduler.tiles = keys;
  // Dense calls run the kernel without the packed path (DenseGridTileMap says why).
  if (p.is_varlen()) {
    constexpr auto kernel = bwd_kernel<Mainloop, BwdEpilogue<Traits>, GridTileMap>;
    if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
    kernel<<<GridTileMap::grid(kp.scheduler, 0, p.nheads_kv, 1), Traits::kNThreads, Traits::kSmemBytes, stream>>>(kp);
  } else {
    constexpr auto kernel = bwd_kernel<Mainloop, BwdEpilogue<Traits>, DenseGridTileMap>;
    if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
    const dim3 grid = DenseGridTileMap::grid({}, ceil_div(p.seqlen_k, Traits::kBlockN), p.nheads_kv, p.batch);
    kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(kp);
  }
  if (Status s = cuda_status(cudaGetLastError(), "sm90 backward launch"); !s.ok()) return s;

  const dim3 q_grid = rows.count != nullptr
                          ? dim3(unsigned(rows.capacity * (kBwdRowAlign / Traits::kBlockM)), p.nheads, 1)
                          : dim3(ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  if (p.is_varlen())
    bwd_convert_dq_kernel<Traits, true><<<q_grid, Traits::kNMmaThreads, 0, stream>>>(params, rows);
  else
    bwd_convert_dq_kernel<Traits, false><<<q_grid, Traits::kNMmaThreads, 0, stream>>>(params, rows);
  return cuda_status(cudaGetLastError(), "sm90 backward dQ conversion launch");
}

// The calls without any score feature (most of training, PlainScores::covers) run the
// instantiation that has none of them compiled in; the others run the one with all of them.
template <template <typename, typename> class Mainloop, typename Traits>
Status run_bwd_features(const BwdParams& params, cudaStream_t stream) {
  if (PlainScores::covers(params.problem)) return run_bwd_mainloop<Mainloop<Traits, PlainScores>>(params, stream);
  return run_bwd_mainloop<Mainloop<Traits, AllScoreFeatures>>(params, stream);
}

// The backward's layout and traits of a head dim, and of a head dim of V of its own (the query-rows
// layout only; sm90/tile_config.h).
template <int kHeadDim, typename Element, int kHeadDimV = kHeadDim>
using BwdTraitsOf = std::conditional_t<
    bwd_tile(kHeadDim).layout == BwdLayout::kKeysPerWarpgroup,
    BwdTraits<kHeadDim, bwd_tile(kHeadDim).block_m, bwd_tile(kHeadDim).mma_warpgroups, bwd_tile(kHeadDim).stages,
              Element>,
    std::conditional_t<
        bwd_tile(kHeadDim).layout == BwdLayout::kSplitD,
        BwdTraitsSplitD<kHeadDim, bwd_tile(kHeadDim).block_m, bwd_tile(kHeadDim).stages, Element>,
        BwdTraitsSplitDQueryRows<kHeadDim, bwd_tile(kHeadDim).block_m, bwd_tile(kHeadDim).block_n,
                                 bwd_tile(kHeadDim).mma_warpgroups, bwd_tile(kHeadDim).stages, Element, kHeadDimV>>>;

// Whether they need CuTe's extended wgmma shapes: the generated translation unit checks it
// against the generator's table.
template <int kHeadDim, typename Element>
constexpr bool bwd_extended_gmma() {
  return BwdTraitsOf<kHeadDim, Element>::kExtendedGmma;
}

// Whether the features instantiation's steps hold the score policy's values (64-query steps,
// ScorePolicy::Held), so that it takes every combination of the score features in one call: the
// generated translation unit checks it against the generator's table
// (Family.all_features_bwd_head_dims).
template <int kHeadDim, typename Element>
constexpr bool bwd_holds_feature_values() {
  return BwdTraitsOf<kHeadDim, Element>::kHoldsFeatureValues;
}

template <int kHeadDim, typename Element, int kHeadDimV = kHeadDim>
Status run_bwd_v(const BwdParams& params, cudaStream_t stream) {
  using Traits = BwdTraitsOf<kHeadDim, Element, kHeadDimV>;
  static_assert(Traits::kBlockN == bwd_tile(kHeadDim).block_n &&
                Traits::kNMmaWarpGroups == bwd_tile(kHeadDim).mma_warpgroups && Traits::kHeadDimV == kHeadDimV);
  if constexpr (bwd_tile(kHeadDim).layout == BwdLayout::kKeysPerWarpgroup)
    return run_bwd_features<BwdMainloop, Traits>(params, stream);
  else
    return run_bwd_features<BwdMainloopSplitD, Traits>(params, stream);
}

// Declared in sm90/launch.h: AttnProblem::head_dim_v picks one of kHeadDimsV, or 0 V at kHeadDim.
template <int kHeadDim, typename Element, int... kHeadDimsV>
Status run_bwd(const BwdParams& params, cudaStream_t stream) {
  return with_head_dim_v<kHeadDim, kHeadDimsV...>(params.problem, "sm90 backward", [&](auto v) {
    return run_bwd_v<kHeadDim, Element, decltype(v)::value>(params, stream);
  });
}

}  // namespace cutlass_flash::sm90
