// Plain parameter structs for the kernel library. No torch, no Python: pointers, shapes, strides
// (in elements), scalars. The caller owns every buffer, scratch memory included, so the library
// never allocates or synchronises the device (torch's caching allocator and CUDA graphs work).
#pragma once

#include <cstdint>

namespace cutlass_flash {

enum class DType : int { kFloat16 = 0, kBFloat16 = 1 };

// Layout of one (batch, seqlen, nheads, head_dim) tensor: the last dimension is contiguous.
struct TensorRef4 {
  void* ptr = nullptr;
  int64_t batch_stride = 0;
  int64_t row_stride = 0;  // stride between consecutive sequence positions
  int64_t head_stride = 0;
};

// Shapes and masking shared by forward and backward.
//
// Masking is a window relative to the bottom-right-aligned diagonal: query row i sees key column j
// iff  i + (seqlen_k - seqlen_q) - window_left <= j <= i + (seqlen_k - seqlen_q) + window_right,
// a negative bound meaning unbounded. Causal is (window_left = -1, window_right = 0). Sliding
// windows then need no new kernel parameter, only values.
//
// Variable-length batches (FlashAttention's packed layout), when cu_seqlens_q is set: q, o, dout,
// dq are (total_q, nheads, head_dim) and k, v, dk, dv (total_k, nheads_kv, head_dim) tensors
// (batch_stride unused), sequence b owns rows [cu_seqlens[b], cu_seqlens[b + 1]) of each, and
// seqlen_q / seqlen_k are the largest lengths (they size the grids). The LSE is (nheads, total_q).
// Kernels read these through kernels/common/block_info.h only, which clamps every sequence to
// [0, total) and to the maxima: bad cu_seqlens content gives wrong numbers, never an access
// outside the tensors.
//
// Extension point, kept out of the struct until a kernel implements it (an unused field that a
// kernel silently ignores would be a wrong answer waiting to happen): paged KV cache, a block
// table read by the K/V load of the mainloop.
struct AttnProblem {
  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nheads = 0;
  int nheads_kv = 0;
  int head_dim = 0;  // the instantiated head dim (the kernels' tile width)
  // Columns of q, k, v, o, dout, dq, dk, dv in memory, a multiple of 8 up to head_dim (0: head_dim):
  // a head dim without kernels of its own runs on the next instantiated one without a padded copy.
  // The kernels load the real columns, hold zeros in the others (which add nothing to any dot
  // product) and store the real columns only.
  int head_dim_real = 0;
  float softmax_scale = 0.f;
  int window_left = -1;
  int window_right = -1;
  // > 0: the scaled scores x = softmax_scale * q.k become softcap * tanh(x / softcap) before the
  // softmax (Gemma 2); 0: off.
  float softcap = 0.f;
  // The head dim of v and o where it differs from q's and k's and a kernel has it as its own (the
  // forward of MLA's (192, 128)): v and o have head_dim_v columns, q and k head_dim. 0: v and o
  // are as wide as q and k (cols()). Here, in the 4 bytes before the next pointer: no other field
  // moves, and the kernels' parameters keep their layout.
  int head_dim_v = 0;
  // ALiBi: float32 slopes, slope of (batch b, head h) at alibi_slopes[b * alibi_batch_stride + h]
  // (stride 0: one slope per head); the scaled score of query i, key j gets
  // -slope * |i + seqlen_k - seqlen_q - j|. Null: off.
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  // Dropout on P (kernels/common/dropout.h): each probability dropped with probability dropout_p,
  // the kept ones scaled by 1 / (1 - dropout_p); the mask drawn from rng_state, two int64 (seed,
  // offset) in device memory, 16-byte aligned (read by the kernels, so a CUDA graph replays with
  // the values its capture's generator call writes there). dropout_p = 0: off, rng_state unused.
  float dropout_p = 0.f;
  const uint64_t* rng_state = nullptr;
  // Attention sinks (gpt-oss): float32, one logit per query head, in the units of the scaled
  // scores, that joins every row's softmax denominator with no value: out = sum_j e^(x_j) v_j /
  // (e^sink + sum_j e^(x_j)), and the LSE includes it (a row that sees no key gets out = 0 and
  // lse = sink). Null: off.
  const float* sinks = nullptr;
  DType dtype = DType::kBFloat16;
  // Variable-length batches: batch + 1 int32 offsets each (both or neither), and the rows of the
  // packed tensors.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  // Optional, variable-length only (FlashAttention-3's seqused, for static-shape packing under
  // CUDA graphs): batch int32 each; sequence b is the first seqused[b] rows of its slot
  // [cu_seqlens[b], cu_seqlens[b + 1]) (clamped to the slot, negative = 0), each side on its own.
  // The slot's other rows belong to no sequence: written as 0 (out, dq, dk, dv) and +inf (LSE).
  const int* seqused_q = nullptr;
  const int* seqused_k = nullptr;
  int total_q = 0;
  int total_k = 0;

  bool is_causal() const { return window_left < 0 && window_right == 0; }
  // The columns in memory (head_dim_real, else head_dim).
  constexpr int cols() const { return head_dim_real > 0 ? head_dim_real : head_dim; }
  // The columns of v and o in memory.
  constexpr int cols_v() const { return head_dim_v > 0 ? head_dim_v : cols(); }
  constexpr bool is_varlen() const { return cu_seqlens_q != nullptr; }
};

struct FwdParams {
  AttnProblem problem;
  TensorRef4 q, k, v;    // inputs
  TensorRef4 o;          // output, same dtype as q
  float* lse = nullptr;  // output, contiguous (batch, nheads, seqlen_q) or (nheads, total_q), natural log
  // Scratch, at least fwd_workspace_bytes(problem, arch) bytes (may be null when that is 0),
  // 16-byte aligned; need not be zeroed (the sm90 tile counter is zeroed on the stream).
  void* workspace = nullptr;
};

struct BwdParams {
  AttnProblem problem;
  TensorRef4 q, k, v, o, dout;  // inputs
  const float* lse = nullptr;   // contiguous (batch, nheads, seqlen_q) or (nheads, total_q)
  // Outputs, shaped like q, k, v: dk and dv are per kv head (GQA/MQA groups are summed inside the
  // kernels, in a fixed order).
  TensorRef4 dq, dk, dv;
  // Scratch, at least bwd_workspace_bytes(problem, arch, deterministic) bytes, 256-byte aligned;
  // need not be zeroed (the preprocess kernel initialises it on the stream).
  void* workspace = nullptr;
  // dQ accumulated in a fixed order (bit-identical results run to run); otherwise in the order
  // blocks finish, which is faster.
  bool deterministic = false;
  // With problem.sinks: output, laid out as lse; each query row's part of the sink's gradient,
  // -exp(sink - lse) * rowsum(dout * out). The caller sums it over the rows of each head, in a
  // fixed order, so dsinks is as deterministic as the rest. Rows of no sequence (seqused) are not written. May be
  // null (no sink gradient).
  float* dsink_rows = nullptr;
};

}  // namespace cutlass_flash
