// Entry points of the Hopper (FlashAttention-3-style, wgmma + TMA) kernel family. The generated
// translation units include fwd_launch.h / bwd_launch.h and instantiate run_fwd / run_bwd for one head dim and one
// element type (cutlass::half_t or cutlass::bfloat16_t). Built for sm_90a only: wgmma and setmaxnreg do not exist in
// plain sm_90.
#pragma once

#include <cuda_runtime_api.h>

#include <string>
#include <type_traits>

#include "cutlass_flash/api.h"
#include "cutlass_flash/params.h"

namespace cutlass_flash::sm90 {

// This family's arch, as the generator's Family.arch and the host API name it (bwd_workspace_layout
// reads it: which families walk upwards).
inline constexpr int kFamilyArch = 90;

// kHeadDimsV: the head dims of V with kernels of their own at kHeadDim (csrc/generate.py:
// Family.head_dims_v), chosen by AttnProblem::head_dim_v.
template <int kHeadDim, typename Element, int... kHeadDimsV>
Status run_fwd(const FwdParams& params, cudaStream_t stream);

template <int kHeadDim, typename Element, int... kHeadDimsV>
Status run_bwd(const BwdParams& params, cudaStream_t stream);

// run_fwd's and run_bwd's choice: run(std::integral_constant<int, V>) for V = the problem's
// head_dim_v among kHeadDimsV, V = kHeadDim where head_dim_v is 0, else kNotBuilt.
template <int kHeadDim, int... kHeadDimsV, typename Run>
Status with_head_dim_v(const AttnProblem& p, const char* what, Run&& run) {
  if (p.head_dim_v == 0) return run(std::integral_constant<int, kHeadDim>{});
  Status s{Status::kNotBuilt, std::string(what) + ": no kernel for v's head dim " + std::to_string(p.head_dim_v) +
                                  " at head dim " + std::to_string(kHeadDim)};
  ((p.head_dim_v == kHeadDimsV ? (void)(s = run(std::integral_constant<int, kHeadDimsV>{})) : (void)0), ...);
  return s;
}

}  // namespace cutlass_flash::sm90
