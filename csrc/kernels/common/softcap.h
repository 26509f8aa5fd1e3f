// Gemma 2's logit cap (arch-neutral): the scaled scores x = softmax_scale * s become
// cap * tanh(x / cap) before the softmax. A runtime switch, uniform per call: off (cap = 0) costs
// one predicated branch per key block.
//
// Forward: t = tanh(s * softmax_scale / cap) replaces s, and the softmax scales by cap instead of
// softmax_scale (so its LSE is that of the capped scores). Backward: P = exp2(t * cap * log2(e) -
// LSE * log2(e)) and the gradient of x is dS * (1 - t^2). Where registers allow (the sm90 backward
// with 64-query steps), 1 - t^2 is held through the dP GEMM in fp16, half a register per score
// (+4-13% at d = 128, PERFLOG.md entry 66); elsewhere t is recovered from P where it is needed
// (t * cap * log2(e) = log2(P) + LSE * log2(e)), a third MUFU operation per score.
#pragma once

#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

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

  // s -> tanh(s * softmax_scale / cap) in place, and 1 - t^2 of each score into `dt` (two fp16
  // per 32-bit word, in s's element order) for the backward to hold instead of recovering t from P
  // (dtanh: a log2 per score on the MUFU pipe beside tanh and exp2).
  template <typename Tensor, typename Words>
  __device__ void tanh_scores(Tensor& s, Words& dt) const {
    static_assert(2 * sizeof(Words) / sizeof(uint32_t) >= decltype(cute::size(s))::value);
    CUTE_UNROLL
    for (int i = 0; i < size(s); i += 2) {
      const float t0 = tanhf(s(i) * pre), t1 = tanhf(s(i + 1) * pre);
      s(i) = t0;
      s(i + 1) = t1;
      const __half2 d = __floats2half2_rn(fmaf(-t0, t0, 1.f), fmaf(-t1, t1, 1.f));
      dt[i / 2] = reinterpret_cast<const uint32_t&>(d);
    }
  }
  // Element i of what tanh_scores(s, dt) stored.
  template <typename Words>
  __device__ static float held_dtanh(const Words& dt, int i) {
    const uint32_t w = dt[i / 2];
    return __half2float(reinterpret_cast<const __half&>(reinterpret_cast<const uint16_t*>(&w)[i % 2]));
  }

  // 1 - t^2 for a probability p = exp2(t * cap_log2 - lse_log2); 0 where p is 0 (masked, or
  // underflowed), where the gradient is 0 whatever the factor.
  __device__ float dtanh(float p, float lse_log2) const {
    const float t = (log2f(p) + lse_log2) / cap_log2;
    return p > 0.f ? 1.f - t * t : 0.f;
  }
};

}  // namespace cutlass_flash
