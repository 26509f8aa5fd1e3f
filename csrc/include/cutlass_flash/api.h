// The kernel library's entry points. Errors are values: a Status and a message, never an abort.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <vector>

#include "cutlass_flash/params.h"

namespace cutlass_flash {

enum class Direction : int { kForward = 0, kBackward = 1 };

// One compiled instantiation: the generator (csrc/generate.py) writes the list.
struct KernelKey {
  int arch;  // kernel family: 80 (Ampere-style, mma.sync) or 90 (Hopper, wgmma)
  Direction direction;
  int head_dim;
  DType dtype;
};

struct Status {
  enum Code : int { kOk = 0, kInvalidArgument = 1, kNotBuilt = 2, kCudaError = 3 };
  Code code = kOk;
  std::string message;
  bool ok() const { return code == kOk; }
  static Status Ok() { return {}; }
};

// Scratch bytes the forward needs (the sm90 family's tile counter; none for sm80).
size_t fwd_workspace_bytes(const AttnProblem& problem, int arch);

// Runs the forward pass with the kernel family `arch`. Asynchronous on `stream`.
Status run_fwd(const FwdParams& params, int arch, cudaStream_t stream);

// Scratch bytes the backward needs (csrc/generated/bwd_workspace.h: fp32 dQ accumulator,
// rowsum(dO*O), scaled LSE, and the dQ semaphores of deterministic mode).
size_t bwd_workspace_bytes(const AttnProblem& problem, int arch, bool deterministic);

// Runs the backward pass (preprocess, main kernel, dQ conversion). Asynchronous on `stream`.
Status run_bwd(const BwdParams& params, int arch, cudaStream_t stream);

// The instantiations this build contains.
const std::vector<KernelKey>& built_kernels();

}  // namespace cutlass_flash
