// Host-side checks of the library, shared by api.cpp and the Python bindings. No CuTe, no torch.
#pragma once

#include <string>

#include "cutlass_flash/api.h"
#include "cutlass_flash/params.h"

namespace cutlass_flash::dispatch {

// Checks the shapes and scalars of `problem` for kernel family `arch` and `direction`: sizes
// positive, nheads a multiple of nheads_kv, dtype known, softmax_scale finite, the score features'
// fields valid (kernels/common/score_policy.h), arch a known family with `direction`, head_dim one
// of its instantiated sizes. Says nothing about whether this build
// contains the kernel (run_fwd/run_bwd answer kNotBuilt for that).
Status check_problem(const AttnProblem& problem, int arch, Direction direction);

// "fp16" / "bf16".
const char* dtype_name(DType dtype);

// The knobs this build was made with, "CUTLASS_FLASH_ARCHS=80 CUTLASS_FLASH_HEAD_DIMS=64 ...".
std::string build_config();

}  // namespace cutlass_flash::dispatch
