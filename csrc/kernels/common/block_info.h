// Where one (batch, head) slice of a tensor, of the LSE and of the backward workspace starts
// (arch-neutral): the one place for per-sequence offsets. Variable-length batches (cu_seqlens)
// will extend this: a per-batch row offset and sequence lengths read here, so the mainloops keep
// seeing one (seqlen, head_dim) matrix per (batch, head).
#pragma once

#include <cstdint>

#include "cutlass_flash/params.h"

namespace cutlass_flash {

struct BlockInfo {
  template <typename Element>
  __host__ __device__ static Element* slice(const TensorRef4& t, int batch, int head) {
    return static_cast<Element*>(t.ptr) + batch * t.batch_stride + head * t.head_stride;
  }

  // Index of the first LSE row of (batch, head): float (batch, nheads, seqlen_q), contiguous.
  __host__ __device__ static int64_t lse_row(const AttnProblem& p, int batch, int head) {
    return (int64_t(batch) * p.nheads + head) * p.seqlen_q;
  }

  // Index of the first row of (batch, head) in the backward workspace's per-query-row arrays,
  // which hold `rows_per_head` (seqlen_q rounded up, generated/bwd_workspace.h) rows per head.
  __host__ __device__ static int64_t workspace_row(const AttnProblem& p, int64_t rows_per_head, int batch, int head) {
    return (int64_t(batch) * p.nheads + head) * rows_per_head;
  }
};

}  // namespace cutlass_flash
