// Where one sequence of a batch lives (arch-neutral): its rows in the tensors, in the LSE and in
// the backward workspace, and its lengths. The one place for per-sequence offsets: dense batches
// (a batch stride) and variable-length ones (cu_seqlens, AttnProblem) differ only here, so the
// mainloops see one (seqlen, head_dim) matrix per (sequence, head) either way.
#pragma once

#include <cstdint>

#include "cutlass_flash/params.h"
#include "generated/bwd_workspace.h"

namespace cutlass_flash {

struct SeqInfo {
  int batch;
  int q_start = 0, k_start = 0;  // first row of the sequence in the packed tensors (varlen)
  int seqlen_q, seqlen_k;

  // Variable-length: the offsets clamped to [0, total] and each length to the problem's maximum,
  // so that no cu_seqlens content takes an access past a tensor (AttnProblem); seqused can only
  // shorten a sequence within its slot, so it needs no clamp of its own beyond >= 0.
  __host__ __device__ SeqInfo(const AttnProblem& p, int b) : batch(b), seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k) {
    if (p.is_varlen()) {
      q_start = clamp_offset(p.cu_seqlens_q[b], p.total_q);
      k_start = clamp_offset(p.cu_seqlens_k[b], p.total_k);
      seqlen_q = min(clamp_offset(p.cu_seqlens_q[b + 1], p.total_q) - q_start, p.seqlen_q);
      seqlen_k = min(clamp_offset(p.cu_seqlens_k[b + 1], p.total_k) - k_start, p.seqlen_k);
      seqlen_q = max(seqlen_q, 0);
      seqlen_k = max(seqlen_k, 0);
      if (p.seqused_q != nullptr) seqlen_q = min(seqlen_q, max(p.seqused_q[b], 0));
      if (p.seqused_k != nullptr) seqlen_k = min(seqlen_k, max(p.seqused_k[b], 0));
    }
  }

  // Row 0 of (this sequence, head) in a query-side tensor (q, o, dout, dq) ...
  template <typename Element>
  __host__ __device__ Element* q_rows(const AttnProblem& p, const TensorRef4& t, int head) const {
    return rows<Element>(p, t, q_start, head);
  }
  // ... and in a key-side one (k, v, dk, dv).
  template <typename Element>
  __host__ __device__ Element* k_rows(const AttnProblem& p, const TensorRef4& t, int head) const {
    return rows<Element>(p, t, k_start, head);
  }

  // Index of the first LSE row of (this sequence, head): float (batch, nheads, seqlen_q), or
  // (nheads, total_q) when variable-length (FlashAttention-2's layouts), contiguous.
  __host__ __device__ int64_t lse_row(const AttnProblem& p, int head) const {
    return p.is_varlen() ? int64_t(head) * p.total_q + q_start : (int64_t(batch) * p.nheads + head) * p.seqlen_q;
  }

  // Index of the first row of (this sequence, head) in the backward workspace's per-query-row
  // arrays (BwdWorkspace: seqlen_q rounded up per (batch, head) when dense; per head, each
  // sequence from its first row rounded up plus kBwdRowAlign per earlier sequence when
  // variable-length, which keeps the sequences' rounded rows apart).
  // rows_per_head: BwdWorkspace::rows_per_head.
  __host__ __device__ int64_t workspace_row(const AttnProblem& p, int64_t rows_per_head, int head) const {
    if (!p.is_varlen()) return (int64_t(batch) * p.nheads + head) * rows_per_head;
    const int64_t first = (int64_t(q_start) + kBwdRowAlign - 1) / kBwdRowAlign * kBwdRowAlign;
    return int64_t(head) * rows_per_head + first + int64_t(batch) * kBwdRowAlign;
  }

 private:
  __host__ __device__ static int clamp_offset(int x, int total) { return min(max(x, 0), total); }

  template <typename Element>
  __host__ __device__ Element* rows(const AttnProblem& p, const TensorRef4& t, int start, int head) const {
    const int64_t offset = p.is_varlen() ? int64_t(start) * t.row_stride : int64_t(batch) * t.batch_stride;
    return static_cast<Element*>(t.ptr) + offset + int64_t(head) * t.head_stride;
  }
};

}  // namespace cutlass_flash
