// Kernel entry templates, one explicit specialization per instantiation. No CuTe, no CUTLASS here.
//
// csrc/generate.py writes csrc/generated/<dir>_sm<arch>_hdim<d>_<dtype>.cu, each defining one
// specialization, e.g.
//   template <> Status run_fwd_kernel<80, 128, DType::kBFloat16>(const FwdParams&, cudaStream_t);
// which forwards to the kernel family's launcher (sm80::run_fwd<128, cutlass::bfloat16_t>). The
// build's dispatch table (also generated) declares the specializations it lists and takes their
// addresses. The primary templates are never defined: using an instantiation that was not
// generated is a link error, not a silent fallback.
#pragma once

#include <cuda_runtime_api.h>

#include "cutlass_flash/api.h"
#include "cutlass_flash/params.h"

namespace cutlass_flash {

template <int Arch, int HeadDim, DType D>
Status run_fwd_kernel(const FwdParams& params, cudaStream_t stream);

template <int Arch, int HeadDim, DType D>
Status run_bwd_kernel(const BwdParams& params, cudaStream_t stream);

}  // namespace cutlass_flash
