// Where one (batch, head) slice of a tensor starts (arch-neutral). Variable-length batches
// (cu_seqlens) will extend this: a per-batch row offset and sequence lengths read here, so the
// mainloops keep seeing one (seqlen, head_dim) matrix per (batch, head).
#pragma once

#include <cstdint>

#include "cutlass_flash/params.h"

namespace cutlass_flash {

struct BlockInfo {
  template <typename Element>
  __host__ __device__ static Element* slice(const TensorRef4& t, int batch, int head) {
    return static_cast<Element*>(t.ptr) + batch * t.batch_stride + head * t.head_stride;
  }
};

}  // namespace cutlass_flash
