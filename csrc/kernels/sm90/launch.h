// Entry points of the Hopper (FlashAttention-3-style, wgmma + TMA) kernel family. The generated
// translation units include fwd_launch.h / bwd_launch.h and instantiate run_fwd / run_bwd for one head dim and one
// element type (cutlass::half_t or cutlass::bfloat16_t). Built for sm_90a only: wgmma and setmaxnreg do not exist in
// plain sm_90.
#pragma once

#include <cuda_runtime_api.h>

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

}  // namespace cutlass_flash::sm90
