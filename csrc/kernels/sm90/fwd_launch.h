// Host launcher of the sm90 forward kernel: builds the TMA descriptors from the caller's pointers
// and strides and launches one persistent block per SM (fewer when there are fewer tiles).
#pragma once

#include <cute/tensor.hpp>

#include "kernels/common/launch_utils.h"
#include "kernels/sm90/fwd_kernel.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tile_config.h"
#include "kernels/sm90/tile_scheduler.h"
#include "kernels/sm90/tma_plan.h"

namespace cutlass_flash::sm90 {

template <typename Traits>
FwdKernelParams<Traits> make_fwd_kernel_params(const FwdParams& params) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim, kHeadDimV = Traits::kHeadDimV;
  const AttnProblem& p = params.problem;
  FwdKernelParams<Traits> kp{};
  kp.problem = p;
  kp.o = params.o;
  kp.lse = params.lse;
  kp.scheduler.num_m_blocks = ceil_div(p.seqlen_q, Traits::kBlockM);
  auto q = gmem_tensor<const Element>(params.q, true, p);
  auto k = gmem_tensor<const Element>(params.k, false, p);
  auto v = gmem_tensor<const Element>(params.v, false, p, p.cols_v());
  auto o = gmem_tensor<Element>(params.o, true, p, p.cols_v());
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, typename Traits::SmemLayoutSlab{}, Shape<_64, Int<kHeadDim>>{}, _1{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Traits::SmemLayoutK{}),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Traits::SmemLayoutV{}),
                           Shape<Int<kBlockN>, Int<kHeadDimV>>{}, _1{});
  kp.tma_o = make_tma_copy(SM90_TMA_STORE{}, o, typename Traits::SmemLayoutSlabO{}, Shape<_64, Int<kHeadDimV>>{}, _1{});
  return kp;
}

// Kernel parameters for `params`: a cached plan with the base addresses patched (tma_plan.h).
template <typename Traits>
FwdKernelParams<Traits> fwd_kernel_params(const FwdParams& params) {
  const TmaPlanKey<4> key(params.problem, {&params.q, &params.k, &params.v, &params.o});
  return cached_kernel_params<FwdKernelParams<Traits>>(key, [&] { return make_fwd_kernel_params<Traits>(params); },
                                                       [&](FwdKernelParams<Traits>& kp) {
    // Per-call fields: the plan's key holds only what the descriptors depend on (the score
    // parameters and the cu_seqlens pointers of a cached problem would be stale).
    kp.problem = params.problem;
    kp.o = params.o;
    kp.lse = params.lse;
    return replace_address(kp.tma_q, params.q.ptr) && replace_address(kp.tma_k, params.k.ptr) &&
           replace_address(kp.tma_v, params.v.ptr) && replace_address(kp.tma_o, params.o.ptr);
  });
}

// Launches the forward kernel of one configuration (FwdTraits); run_fwd picks the configuration of
// a head dim, and benchmarks/tune_sm90.cu times others. tile_group > 0 replaces the causal
// schedule's computed group size (tuning only).
template <typename Traits, typename Features = AllScoreFeatures>
Status run_fwd_traits(const FwdParams& params, cudaStream_t stream, int tile_group = 0) {
  using Element = typename Traits::Element;
  const AttnProblem& p = params.problem;
  for (auto [ref, name] : {std::pair{&params.q, "q"}, {&params.k, "k"}, {&params.v, "v"}, {&params.o, "out"}})
    if (Status s = check_tma_ref<Element>(*ref, name, "forward"); !s.ok()) return s;
  if (Status s = check_smem_fits(Traits::kSmemBytes, "sm90 forward"); !s.ok()) return s;
  FwdKernelParams<Traits> kp = fwd_kernel_params<Traits>(params);

  int grid = 0;
  const VarlenTilesArgs prep = p.is_varlen() ? fwd_varlen_args(params) : VarlenTilesArgs{};
  if (Status s = DynamicTileScheduler::launch_grid(p, params.workspace, tile_group, Traits::kBlockM, stream,
                                                   kp.scheduler, grid, prep);
      !s.ok())
    return s;
  constexpr auto kernel = fwd_kernel<FwdMainloop<Traits, Features>, FwdEpilogue<Traits>, DynamicTileScheduler>;
  if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(kp);
  return cuda_status(cudaGetLastError(), "sm90 forward launch");
}

// The forward's configuration of a head dim, and of a head dim of V of its own (sm90/tile_config.h).
template <int kHeadDim, typename Element, int kHeadDimV = kHeadDim>
using FwdTraitsOf = FwdTraits<kHeadDim, fwd_tile(kHeadDim, kHeadDimV).block_m, fwd_tile(kHeadDim, kHeadDimV).block_n,
                              fwd_tile(kHeadDim, kHeadDimV).stages, Element, kHeadDimV>;

// Whether that configuration needs CuTe's extended wgmma shapes: the generated translation unit
// checks it against the generator's table.
template <int kHeadDim, typename Element>
constexpr bool fwd_extended_gmma() {
  return FwdTraitsOf<kHeadDim, Element>::kExtendedGmma;
}

template <int kHeadDim, typename Element, int kHeadDimV = kHeadDim>
Status run_fwd_v(const FwdParams& params, cudaStream_t stream) {
  using Traits = FwdTraitsOf<kHeadDim, Element, kHeadDimV>;
  if constexpr (Traits::kProbsKernel) {
    if (NoProbsStage::covers(params.problem)) return run_fwd_traits<Traits, NoProbsStage>(params, stream);
  }
  return run_fwd_traits<Traits>(params, stream);
}

// Declared in sm90/launch.h: AttnProblem::head_dim_v picks one of kHeadDimsV, or 0 V at kHeadDim.
template <int kHeadDim, typename Element, int... kHeadDimsV>
Status run_fwd(const FwdParams& params, cudaStream_t stream) {
  return with_head_dim_v<kHeadDim, kHeadDimsV...>(params.problem, "sm90 forward", [&](auto v) {
    return run_fwd_v<kHeadDim, Element, decltype(v)::value>(params, stream);
  });
}

}  // namespace cutlass_flash::sm90
