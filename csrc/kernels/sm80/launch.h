// Entry points of the Ampere-style (FlashAttention-2) kernel family. The generated translation
// units include fwd_launch.h or bwd_launch.h (one direction each, to keep compile units small) and
// instantiate these for one head dim and one element type (cutlass::half_t or cutlass::bfloat16_t).
#pragma once

#include <cuda_runtime_api.h>

#include "cutlass_flash/api.h"
#include "cutlass_flash/params.h"

namespace cutlass_flash::sm80 {

// This family's arch, as the generator's Family.arch and the host API name it (bwd_workspace_layout
// reads it: which families walk upwards).
inline constexpr int kFamilyArch = 80;

template <int kHeadDim, typename Element>
Status run_fwd(const FwdParams& params, cudaStream_t stream);

template <int kHeadDim, typename Element>
Status run_bwd(const BwdParams& params, cudaStream_t stream);

}  // namespace cutlass_flash::sm80
