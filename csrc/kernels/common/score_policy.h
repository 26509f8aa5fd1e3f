// The score modifiers of a call as one policy object, the only way the mainloops of both families
// (sm80, sm90; forward and backward) see softcap, ALiBi, the window / causal mask and dropout.
//
// ScoreFeatures<softcap, alibi, dropout> says which modifiers an instantiation compiles in. In one
// that has a feature it is a runtime switch (off: one predicated branch per key block); in one
// without, its code is compiled out and the launcher sends it only the calls that do not use it
// (covers()). Why both exist, measured against the same kernel with the three compiled out:
// - sm90 backward: the switches cost calls without any feature 4-9% at d = 64 and about 2% at
//   d = 128 / 256 (PERFLOG.md entry 50);
// - sm90 forward: dropout's switch cost more than 2% only where FwdTraits::kDropoutKernel says;
// - sm80 forward and backward: the three switches cost plain calls up to a third of the forward
//   (PERFLOG.md entry 93), so every sm80 head dim has a plain instantiation.
//
// ScorePolicy<Features> is built once per tile from (params, batch, head) and holds the order the
// math needs, written once for every mainloop: before the softmax, tanh (softcap) -> bias (ALiBi)
// -> mask (tanh(-inf) would be -1; the bias is measured from the mask's diagonal); after it,
// dropout on P; in the backward, dS = P (dP - D) with dropout's and tanh's factors. Attention sinks
// join the softmax's denominator at its end (finalize); the backward needs nothing else of them
// (the LSE includes the sink), but their own gradient (common/bwd_preprocess.h).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <type_traits>

#include "cutlass_flash/params.h"
#include "kernels/common/alibi.h"
#include "kernels/common/dropout.h"
#include "kernels/common/mask.h"
#include "kernels/common/softcap.h"

namespace cutlass_flash {

template <bool kSoftcap_, bool kAlibi_, bool kDropout_>
struct ScoreFeatures {
  static constexpr bool kSoftcap = kSoftcap_, kAlibi = kAlibi_, kDropout = kDropout_;

  // Whether a call with problem p runs correctly on this instantiation.
  static bool covers(const AttnProblem& p) {
    return (kSoftcap || p.softcap == 0.f) && (kAlibi || p.alibi_slopes == nullptr) && (kDropout || p.dropout_p == 0.f);
  }
};

using AllScoreFeatures = ScoreFeatures<true, true, true>;
using NoDropout = ScoreFeatures<true, true, false>;
using PlainScores = ScoreFeatures<false, false, false>;

template <typename Features_>
struct ScorePolicy {
  using Features = Features_;
  WindowMask mask;
  // The modifiers' values are derived from the parameters (constant memory) where they are used,
  // not held: a held softcap (three floats) spilled 16 B in the sm80 d = 256 forward.
  const AttnProblem* p;
  int batch, head;

  __device__ ScorePolicy(const AttnProblem& problem, const WindowMask& m, int b, int h)
      : mask(m), p(&problem), batch(b), head(h) {}

  __device__ Softcap softcap() const { return Softcap(*p); }
  __device__ Alibi alibi() const { return Alibi(*p, batch, head); }
  __device__ Dropout dropout() const { return Dropout(*p, batch, head); }
  __device__ bool softcap_on() const { return Features::kSoftcap && softcap().on(); }
  __device__ bool alibi_on() const { return Features::kAlibi && alibi().on(); }
  __device__ bool dropout_on() const { return Features::kDropout && dropout().on(); }

  // What the softmax multiplies the scores by after before_softmax: cap under softcap, else the
  // softmax scale; scale_log2, times log2(e) for exp2.
  __host__ __device__ static float softmax_scale(const AttnProblem& p) {
    return Features::kSoftcap ? Softcap::softmax_scale(p) : p.softmax_scale;
  }
  __host__ __device__ static float scale_log2(const AttnProblem& p) { return softmax_scale(p) * float(M_LOG2E); }
  // What the kept probabilities are multiplied by (O, dV, dP): 1 / keep rate under dropout.
  __host__ __device__ static float keep_scale(const AttnProblem& p) {
    return Features::kDropout ? Dropout::keep_scale(p) : 1.f;
  }

  // The softmax's last step (OnlineSoftmax::finalize) with the call's scales and attention sink
  // (AttnProblem::sinks, one logit per query head). Static and given the head so that a kernel
  // holds nothing of the policy across its mainloop for it.
  template <typename Softmax, typename TensorO, typename TensorL>
  __device__ static void finalize(Softmax& softmax, TensorO& acc_o, TensorL& lse, const AttnProblem& p, int head) {
    softmax.finalize(acc_o, lse, softmax_scale(p), keep_scale(p), p.sinks != nullptr ? p.sinks[head] : -INFINITY);
  }

  // tanh -> bias -> mask on a tile of raw scores s (q.k), in place. coords: each score's (row, col)
  // in the tile (WindowMask::apply's convention, kTransposed for (key, query) tiles), row0 / col0
  // the tile's offsets in the sequence; masked: whether the tile crosses the mask
  // (WindowMask::block_needs_mask; a bool or a callable, is_masked). tanh(x) and slope() let a
  // mainloop with registers to spare use values it holds (Softcap::tanh_scores with the
  // derivative, a slope read once per head).
  template <bool kTransposed = false, typename TensorS, typename TensorC, typename Masked, typename Tanh,
            typename Slope>
  __device__ void before_softmax(TensorS& s, const TensorC& coords, int row0, int col0, Masked&& masked, Tanh&& tanh,
                                 Slope&& slope) const {
    if (softcap_on()) tanh(s);
    if (alibi_on()) Alibi::apply_slope<kTransposed>(slope(), s, coords, mask, row0, col0);
    if (is_masked(masked)) mask.template apply<kTransposed>(s, coords, row0, col0);
  }
  template <bool kTransposed = false, typename TensorS, typename TensorC, typename Masked>
  __device__ void before_softmax(TensorS& s, const TensorC& coords, int row0, int col0, Masked&& masked) const {
    before_softmax<kTransposed>(s, coords, row0, col0, masked, [&](TensorS& x) { softcap().tanh_scores(x); },
                                [&] { return alibi().slope(); });
  }

  // `masked` of before_softmax: a bool, or a callable asked after tanh and the bias. Asked before
  // them, the sm80 forward's compiler merged the three branches into one predicated stream (115
  // more predicate moves per key block at d = 128, 15-27% slower with a feature on an H200).
  template <typename Masked>
  __device__ static bool is_masked(Masked&& masked) {
    if constexpr (std::is_invocable_v<Masked>)
      return masked();
    else
      return masked;
  }

  // Dropout on P after the row sums (those of the undropped P): op(p, keep) on each probability
  // (Dropout::Zero in the forward; Dropout::Negate in the backward, the mask carried in the sign
  // to dS and the dV GEMM). Arguments as Dropout::apply.
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorP, typename TensorC, typename Op>
  __device__ void drop(TensorP&& probs, const TensorC& c, int row0, int col0, Op op) const {
    if (dropout_on()) dropout().template apply<kTransposed, kPairStep, kAlign>(probs, c, row0, col0, op);
  }

  // drop() in two halves, for a mainloop whose registers allow the Philox draws only before S is
  // live: the keep bits drawn ahead (Dropout::keep_bits; 0 when off), then applied to P.
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorC>
  __device__ uint64_t keep_bits(const TensorC& c, int row0, int col0) const {
    return dropout_on() ? dropout().template keep_bits<kTransposed, kPairStep, kAlign>(c, row0, col0) : 0;
  }
  template <typename TensorP, typename Op>
  __device__ void drop_bits(TensorP&& probs, uint64_t bits, Op op) const {
    if (dropout_on()) Dropout::apply_bits(probs, bits, op);
  }
  // drop(..., Zero) on the 16-bit P (the sm90 forward's, Dropout::zero_dropped_p16).
  template <int kAlign, typename TensorP, typename TensorC>
  __device__ void drop_p16(TensorP&& p16, const TensorC& c, int row0, int col0) const {
    if (dropout_on()) dropout().template zero_dropped_p16<kAlign>(p16, c, row0, col0);
  }

  // Backward: dS = P (dP - D) in place of dP, on (query, key) views of P and dP; dpsum(q): D of
  // view row q. Under dropout dP is the GEMM's times the keep scale and a dropped P (negated by
  // drop(..., Negate)) has dP = 0: dS = (-P) D.
  template <typename TensorP, typename TensordS, typename Dpsum>
  __device__ void scores_grad(const TensorP& probs, TensordS& ds, Dpsum&& dpsum) const {
    using namespace cute;
    if (dropout_on()) {
      const float keep_scale = Dropout::keep_scale(*p);
      CUTE_UNROLL
      for (int qi = 0; qi < size<0>(ds); ++qi) {
        const float d_q = dpsum(qi);
        CUTE_UNROLL
        for (int ki = 0; ki < size<1>(ds); ++ki)
          ds(qi, ki) = probs(qi, ki) * (probs(qi, ki) >= 0.f ? ds(qi, ki) * keep_scale - d_q : d_q);
      }
    } else {
      CUTE_UNROLL
      for (int qi = 0; qi < size<0>(ds); ++qi) {
        const float d_q = dpsum(qi);
        CUTE_UNROLL
        for (int ki = 0; ki < size<1>(ds); ++ki) ds(qi, ki) = probs(qi, ki) * (ds(qi, ki) - d_q);
      }
    }
  }

  // Backward: dS times tanh's derivative, t recovered from P (Softcap::dtanh); lse_log2(q): the
  // LSE of view row q, times log2(e).
  template <typename TensorP, typename TensordS, typename Lse>
  __device__ void softcap_grad(const TensorP& probs, TensordS& ds, Lse&& lse_log2) const {
    using namespace cute;
    if (!softcap_on()) return;
    const Softcap softcap = this->softcap();
    CUTE_UNROLL
    for (int qi = 0; qi < size<0>(ds); ++qi) {
      const float lse_q = lse_log2(qi);
      CUTE_UNROLL
      for (int ki = 0; ki < size<1>(ds); ++ki) ds(qi, ki) *= softcap.dtanh(fabsf(probs(qi, ki)), lse_q);
    }
  }

  // Backward: P for the dV GEMM, the dropped ones (negative) zeroed.
  template <typename TensorP>
  __device__ void dropped_to_zero(TensorP& probs) const {
    if (!dropout_on()) return;
    CUTE_UNROLL
    for (int i = 0; i < cute::size(probs); ++i) probs(i) = fmaxf(probs(i), 0.f);
  }
};

}  // namespace cutlass_flash
