// Scratch layout of the sm80 backward, shared by the launcher and the host API. No CuTe here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cutlass_flash/params.h"

#if defined(__CUDACC__)
#define CUTLASS_FLASH_HOST_DEVICE __host__ __device__
#else
#define CUTLASS_FLASH_HOST_DEVICE
#endif

namespace cutlass_flash::sm80 {

// Rows are padded to a multiple of 128 (the largest query tile of any backward config), so the main
// kernel can accumulate whole tiles of dQ without bounds checks on the fp32 scratch.
constexpr int kWorkspaceRowAlign = 128;

struct BwdWorkspace {
  int64_t seqlen_q_rounded;
  size_t dq_accum_offset;  // float[batch][nheads][seqlen_q_rounded * head_dim]: per query tile,
                           // thread-major (bwd_mainloop.h, dq_accum_index)
  size_t dpsum_offset;     // float[batch][nheads][seqlen_q_rounded], rowsum(dO * O)
  size_t total_bytes;
};

CUTLASS_FLASH_HOST_DEVICE inline size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

CUTLASS_FLASH_HOST_DEVICE inline BwdWorkspace bwd_workspace_layout(const AttnProblem& p) {
  BwdWorkspace w{};
  w.seqlen_q_rounded = (p.seqlen_q + kWorkspaceRowAlign - 1) / kWorkspaceRowAlign * kWorkspaceRowAlign;
  const size_t rows = size_t(p.batch) * p.nheads * w.seqlen_q_rounded;
  w.dq_accum_offset = 0;
  w.dpsum_offset = align_up(rows * p.head_dim * sizeof(float), 256);
  w.total_bytes = align_up(w.dpsum_offset + rows * sizeof(float), 256);
  return w;
}

}  // namespace cutlass_flash::sm80
