// Where one (batch, head) slice of a tensor starts (arch-neutral). Variable-length batches
// (cu_seqlens) change only this struct: per-batch sequence lengths and row offsets.
#pragma once

#include <cstdint>

#include "cutlass_flash/params.h"

namespace cutlass_flash {

struct BlockInfo {
  int seqlen_q, seqlen_k;

  __host__ __device__ explicit BlockInfo(const AttnProblem& p) : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k) {}

  template <typename Element>
  __host__ __device__ static Element* slice(const TensorRef4& t, int batch, int head) {
    return static_cast<Element*>(t.ptr) + batch * t.batch_stride + head * t.head_stride;
  }
};

}  // namespace cutlass_flash
