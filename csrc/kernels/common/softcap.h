// Gemma 2's logit cap (arch-neutral): the scaled scores x = softmax_scale * s become
// cap * tanh(x / cap) before the softmax. A runtime switch, uniform per call: off (cap = 0) costs
// one predicated branch per key block.
//
// Forward: t = tanh(s * softmax_scale / cap) replaces s, and the softmax scales by cap instead of
// softmax_scale (so its LSE is that of the capped scores). Backward: P = exp2(t * cap * log2(e) -
// LSE * log2(e)) and the gradient of x is dS * (1 - t^2). t is recovered from P where it is needed
// (t * cap * log2(e) = log2(P) + LSE * log2(e)) rather than held through the dP GEMM, which would
// take one more register per score.
#pragma once

#include <cmath>

#include "cutlass_flash/params.h"

namespace cutlass_flash {

struct Softcap {
  float cap;       // 0: off
  float pre;       // softmax_scale / cap: what multiplies s inside tanh
  float cap_log2;  // cap * log2(e)

  __host__ __device__ explicit Softcap(const AttnProblem& p)
      : cap(p.softcap),
        pre(p.softcap > 0.f ? p.softmax_scale / p.softcap : 0.f),
        cap_log2(p.softcap * float(M_LOG2E)) {}

  __host__ __device__ bool on() const { return cap > 0.f; }

  // The scale the softmax applies to the scores after tanh_scores: cap when on, else the softmax
  // scale itself.
  __host__ __device__ static float softmax_scale(const AttnProblem& p) {
    return p.softcap > 0.f ? p.softcap : p.softmax_scale;
  }

  // s -> tanh(s * softmax_scale / cap), in place (before the mask: tanh(-inf) would be -1).
  template <typename Tensor>
  __device__ void tanh_scores(Tensor& s) const {
    CUTE_UNROLL
    for (int i = 0; i < size(s); ++i) s(i) = tanhf(s(i) * pre);
  }

  // 1 - t^2 for a probability p = exp2(t * cap_log2 - lse_log2); 0 where p is 0 (masked, or
  // underflowed), where the gradient is 0 whatever the factor.
  __device__ float dtanh(float p, float lse_log2) const {
    const float t = (log2f(p) + lse_log2) / cap_log2;
    return p > 0.f ? 1.f - t * t : 0.f;
  }
};

}  // namespace cutlass_flash
