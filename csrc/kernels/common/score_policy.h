// The score modifiers of a call as one policy object, the only way the mainloops of both families
// (sm80, sm90; forward and backward), their launchers and the host API see softcap, ALiBi and
// dropout (and the window / causal mask). A mainloop calls it by stage, never by feature:
//   before_softmax   on the raw scores q.k: tanh (softcap) -> bias (ALiBi) -> mask (tanh(-inf)
//                    would be -1; the bias is measured from the mask's diagonal);
//   fwd_probs*       forward, on P after the row sums (those of the undropped P): dropout, the
//                    dropped probabilities zeroed;
//   bwd_probs        backward, on the recomputed P: dropout, the dropped probabilities negated
//                    (the mask carried in the sign to the scores gradient and the dV GEMM);
//   scores_grad      backward: dS = P (dP - D) with every feature's factor (dropout's keep scale
//                    and mask, tanh's derivative);
//   probs_for_dv     backward: P as the dV GEMM takes it;
//   keep_scale       what O, dV and dP are scaled by (dropout's 1 / keep rate);
//   finalize         the softmax's last step (attention sinks join its denominator there; the
//                    backward needs nothing else of them, the LSE includes the sink, but their own
//                    gradient, common/bwd_preprocess.h).
// A new feature changes this header and its own, not the mainloops.
//
// ScoreFeatures<softcap, alibi, dropout> says which modifiers an instantiation compiles in. In one
// that has a feature it is a runtime switch (off: one predicated branch per key block); in one
// without, its code is compiled out and the launcher sends it only the calls that do not use it
// (covers()). Why both exist, measured against the same kernel with the three compiled out:
// - sm90 backward: the switches cost calls without any feature 4-9% at d = 64 and about 2% at
//   d = 128 / 256 (PERFLOG.md entry 50);
// - sm90 forward: dropout's switch cost more than 2% only where FwdTraits::kProbsKernel gives the
//   probability stage a kernel of its own (NoProbsStage, below, is the kernel without it);
// - sm80 forward and backward: the three switches cost plain calls up to a third of the forward
//   (PERFLOG.md entry 93), so every sm80 head dim has a plain instantiation.
//
// The host part (ScoreFeatures, the checks of a call's fields) needs no CUDA compiler: the host
// API (csrc/dispatch/api.cpp) includes this header too.
#pragma once

#include <cmath>
#include <cstdint>

#include "cutlass_flash/params.h"

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
// Everything but the probability stage (dropout), for kernels that give that stage a kernel of
// its own (sm90::FwdTraits::kProbsKernel): with dropout's path in it the sm90 forward spilled 8 B
// at d = 64 (the 16-score Philox calls beside 128-column S and P) and 8-76 B at d = 192 / 256
// (PERFLOG.md entries 40-41), and at d = 128 the calls without dropout ran 3-14% slower (entry
// 88); the one without it is the kernel as it was, 0 B. At d = 96: one kernel, a runtime switch.
using NoProbsStage = ScoreFeatures<true, true, false>;
using PlainScores = ScoreFeatures<false, false, false>;

// Host checks of a call's score fields: why they cannot run (an error message without the
// direction's prefix), nullptr when they can.
inline const char* score_fields_error(const AttnProblem& p) {
  if (!(std::isfinite(p.softcap) && p.softcap >= 0.f)) return "softcap must be finite and >= 0 (0: off)";
  if (reinterpret_cast<uintptr_t>(p.alibi_slopes) % alignof(float) != 0 || p.alibi_batch_stride < 0)
    return "alibi_slopes must be a 4-byte aligned float32 array with a batch stride >= 0";
  if (!(p.dropout_p >= 0.f && p.dropout_p < 1.f)) return "dropout_p must be in [0, 1)";
  if (p.dropout_p > 0.f && (p.rng_state == nullptr || reinterpret_cast<uintptr_t>(p.rng_state) % 16 != 0))
    return "dropout_p > 0 needs rng_state: two int64 (seed, offset) in device memory, 16-byte aligned";
  return nullptr;
}

// The features of a call that only the kernels taking every combination of the score features
// take in one call (the dispatch table's all_features_fwd / _bwd head dims; csrc/generate.py's
// Family.all_features says why), named for an error message ("... does not take <this>");
// nullptr when the call needs no such kernel. Softcap with ALiBi: a backward that recovers tanh's
// value from P cannot, as the bias shifts P (see Held below).
inline const char* score_features_combined(const AttnProblem& p) {
  return p.softcap > 0.f && p.alibi_slopes != nullptr ? "softcap and alibi_slopes together" : nullptr;
}

}  // namespace cutlass_flash

#if defined(__CUDACC__)

#include <cute/tensor.hpp>

#include <type_traits>

#include "kernels/common/alibi.h"
#include "kernels/common/dropout.h"
#include "kernels/common/mask.h"
#include "kernels/common/softcap.h"

namespace cutlass_flash {

// ScorePolicy<Features> is built once per tile from (params, batch, head) and holds the order the
// math needs, written once for every mainloop.
template <typename Features_>
struct ScorePolicy {
  using Features = Features_;
  WindowMask mask;

 private:
  // The modifiers' values are derived from the parameters (constant memory) where they are used,
  // not held: a held softcap (three floats) spilled 16 B in the sm80 d = 256 forward.
  const AttnProblem* p;
  int batch, head;

  __device__ Softcap softcap() const { return Softcap(*p); }
  __device__ Alibi alibi() const { return Alibi(*p, batch, head); }
  __device__ Dropout dropout() const { return Dropout(*p, batch, head); }
  __device__ bool softcap_on() const { return Features::kSoftcap && softcap().on(); }
  __device__ bool alibi_on() const { return Features::kAlibi && alibi().on(); }
  __device__ bool dropout_on() const { return Features::kDropout && dropout().on(); }

 public:
  __device__ ScorePolicy(const AttnProblem& problem, const WindowMask& m, int b, int h)
      : mask(m), p(&problem), batch(b), head(h) {}

  // What the softmax multiplies the scores by after before_softmax: cap under softcap, else the
  // softmax scale; scale_log2, times log2(e) for exp2.
  __host__ __device__ static float softmax_scale(const AttnProblem& p) {
    return Features::kSoftcap ? Softcap::softmax_scale(p) : p.softmax_scale;
  }
  __host__ __device__ static float scale_log2(const AttnProblem& p) { return softmax_scale(p) * float(M_LOG2E); }
  // What the kept probabilities are multiplied by (O, dV, dP): 1 / keep rate under dropout.
  // ScorePolicy<AllScoreFeatures>::keep_scale reads it from the call whatever a kernel compiles in.
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

  // ---- Values a backward step may hold (sm90::BwdTraits::kHoldsFeatureValues) ----
  //
  // 64-query steps (the sm90 backward at d >= 96) leave registers for values that a 128-query
  // step (d = 64: S^T and dP^T already take 128 registers) recomputes instead: under softcap,
  // tanh's derivative 1 - t^2 held through the dP^T GEMM in 16 bits, half a register per score
  // (+4-13% at d = 128, PERFLOG.md entry 66; at d = 64 recovered from P after it: Softcap::dtanh,
  // a third MUFU operation per score); under ALiBi, the head's slope read once per head (at d = 64
  // once per step, between the S^T GEMM's wait and the exponentials: held, it cost the ALiBi
  // backward there 3-8%, PERFLOG.md entry 65). Recovering tanh's value from P is also why a step
  // that does not hold the derivative cannot take softcap with ALiBi (score_features_combined):
  // the bias shifts P; adding it back cost the softcap backward without ALiBi 3-13% (sm90, d = 64
  // / 128) or spilled (sm80 at 255 registers, and sm90 d = 64 as a separate branch) (PERFLOG.md
  // entry 64).

  // A step's held values, for kScores scores per thread (the accumulator's size): whether tanh is
  // on (read where the step builds this, before its scores), and, when kHold, 1 - t^2 of each
  // score, two fp16 per 32-bit word in the accumulator's order. Filled by before_softmax, read by
  // scores_grad. (In this member order, the switch set in the body, the sm90 d = 192 backward's
  // machine code is that of the two locals this replaced; the other order renamed registers.)
  template <bool kHold, int kScores>
  struct Held {
    static constexpr bool kDtanh = kHold && Features::kSoftcap;
    cute::array<uint32_t, kDtanh ? kScores / 2 : 1> dt;
    bool tanh_on;

    __device__ explicit Held(const ScorePolicy& score) { tanh_on = score.softcap_on(); }
  };

  // A head's values, held through its steps when kHold (ALiBi's slope; 0 when off or not held).
  // Passed by value, as the float it replaced (by reference, the sm90 d = 192 backward's pipeline
  // state took other registers).
  template <bool kHold>
  struct HeadValues {
    float slope;
  };
  template <bool kHold>
  __device__ HeadValues<kHold> head_values() const {
    return {kHold && alibi_on() ? alibi().slope() : 0.f};
  }

  // ---- Before the softmax ----
  //
  // tanh -> bias -> mask on a tile of raw scores s (q.k), in place. coords: each score's (row, col)
  // in the tile (WindowMask::apply's convention, kTransposed for (key, query) tiles), row0 / col0
  // the tile's offsets in the sequence; masked: whether the tile crosses the mask
  // (WindowMask::block_needs_mask; a bool or a callable, is_masked).
  template <bool kTransposed = false, typename TensorS, typename TensorC, typename Masked>
  __device__ void before_softmax(TensorS& s, const TensorC& coords, int row0, int col0, Masked&& masked) const {
    modify_scores<kTransposed>(s, coords, row0, col0, masked, [&](TensorS& x) { softcap().tanh_scores(x); },
                               [&] { return alibi().slope(); });
  }
  // The same for a step that holds values (Held, HeadValues): it stores them in `held` and uses
  // the head's.
  template <bool kTransposed = false, typename TensorS, typename TensorC, typename Masked, bool kHold, int kScores>
  __device__ void before_softmax(TensorS& s, const TensorC& coords, int row0, int col0, Masked&& masked,
                                 Held<kHold, kScores>& held, const HeadValues<kHold>& head_vals) const {
    modify_scores<kTransposed>(s, coords, row0, col0, masked, [&](TensorS& x) {
      if constexpr (Held<kHold, kScores>::kDtanh)
        softcap().tanh_scores(x, held.dt);
      else
        softcap().tanh_scores(x);
    }, [&] { return kHold ? head_vals.slope : alibi().slope(); });
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

  // ---- On the probabilities P, after the row sums ----
  //
  // Arguments as Dropout::apply: probs, a (query, key) view of P, or its transpose (kTransposed);
  // c its coordinates; row0 / col0 the tile's offsets; kPairStep the columns between a thread's
  // column pairs; kAlign what the tile's first column is a multiple of (probs_align).

  // Whether the probability stage does anything in this call (for work a mainloop does only for
  // it, such as coordinates).
  __device__ bool probs_on() const { return dropout_on(); }
  // kAlign of a tile of block_n keys.
  static constexpr int probs_align(int block_n) { return Dropout::column_align(block_n); }

  // Forward: the dropped probabilities zeroed.
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorP, typename TensorC>
  __device__ void fwd_probs(TensorP&& probs, const TensorC& c, int row0, int col0) const {
    if (dropout_on()) dropout().template apply<kTransposed, kPairStep, kAlign>(probs, c, row0, col0, Dropout::Zero{});
  }

  // fwd_probs in two halves, for a mainloop whose registers allow the draws only before S is live
  // (the sm80 forward at d >= 128, FwdTraits::kProbsDrawFirst: on P in place spilled 16 B at d = 128
  // and 60 B at d = 256): the keep bits drawn ahead (Dropout::keep_bits; 0 when off), then applied.
  using ProbsDraw = uint64_t;
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorC>
  __device__ ProbsDraw fwd_probs_draw(const TensorC& c, int row0, int col0) const {
    return dropout_on() ? dropout().template keep_bits<kTransposed, kPairStep, kAlign>(c, row0, col0) : 0;
  }
  template <typename TensorP>
  __device__ void fwd_probs_apply(TensorP&& probs, ProbsDraw draw) const {
    if (dropout_on()) Dropout::apply_bits(probs, draw, Dropout::Zero{});
  }

  // fwd_probs on the 16-bit P (Dropout::zero_dropped_p16, 2.5 instructions per 2 scores), once the
  // previous block's P V GEMM is done (sm90::FwdTraits::kProbsOnP16): against the fp32 P under the
  // GEMM (3 per score), the sm90 forward's dropout kernel measured +14-15% at d = 64 and +11-23% at
  // d = 256 with one kernel at 0 B; at d = 128 the 16-bit P cost 5-11% (PERFLOG.md entry 65), so
  // its dropout kernel keeps the fp32 path.
  template <int kAlign, typename TensorP, typename TensorC>
  __device__ void fwd_probs16(TensorP&& p16, const TensorC& c, int row0, int col0) const {
    if (dropout_on()) dropout().template zero_dropped_p16<kAlign>(p16, c, row0, col0);
  }

  // Backward: the dropped probabilities negated, the mask carried in the sign to scores_grad and
  // probs_for_dv. Drawn on P in place while the dP GEMM runs: in the sm90 backward, bits drawn
  // before the GEMMs and held through them cost the backward without dropout 2-6% at d = 64
  // (PERFLOG.md entry 44).
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorP, typename TensorC>
  __device__ void bwd_probs(TensorP&& probs, const TensorC& c, int row0, int col0) const {
    if (dropout_on()) dropout().template apply<kTransposed, kPairStep, kAlign>(probs, c, row0, col0, Dropout::Negate{});
  }

  // Backward: P for the dV GEMM, the dropped ones (negative) zeroed.
  template <typename TensorP>
  __device__ void probs_for_dv(TensorP& probs) const {
    if (!dropout_on()) return;
    CUTE_UNROLL
    for (int i = 0; i < cute::size(probs); ++i) probs(i) = fmaxf(probs(i), 0.f);
  }

  // ---- The scores gradient (backward) ----
  //
  // dS = P (dP - D) in place of dP, times every feature's factor, on (query, key) views of P
  // (after bwd_probs) and dP; dpsum(q): D of view row q; lse_log2(): the rows' LSE times log2(e),
  // as a callable lse(q), made only where a factor needs it (a mainloop may load it again there
  // rather than hold it). Under dropout dP is the GEMM's times the keep scale and a dropped P
  // (negated by bwd_probs) has dP = 0: dS = (-P) D. Under softcap, times tanh's derivative,
  // t recovered from P (Softcap::dtanh).
  template <typename TensorP, typename TensordS, typename Dpsum, typename Lse>
  __device__ void scores_grad(const TensorP& probs, TensordS& ds, Dpsum&& dpsum, Lse&& lse_log2) const {
    probs_grad(probs, ds, dpsum);
    tanh_grad(probs, ds, lse_log2());
  }
  // The same for a step that holds values (Held): tanh's derivative as held, acc_ds the dP
  // accumulator itself (ds's data, in the order the derivative is held in).
  template <typename TensorP, typename TensordS, typename Dpsum, typename Lse, typename AccdS, bool kHold, int kScores>
  __device__ void scores_grad(const TensorP& probs, TensordS& ds, Dpsum&& dpsum, Lse&& lse_log2, AccdS& acc_ds,
                              const Held<kHold, kScores>& held) const {
    probs_grad(probs, ds, dpsum);
    if constexpr (Held<kHold, kScores>::kDtanh) {
      if (held.tanh_on) {  // the gradient of x = scale * s: through tanh's derivative
        CUTE_UNROLL
        for (int i = 0; i < cute::size(acc_ds); ++i) acc_ds(i) *= Softcap::held_dtanh(held.dt, i);
      }
    } else if (held.tanh_on) {  // as above, t recovered from P
      tanh_grad(probs, ds, lse_log2());
    }
  }

 private:
  // before_softmax with the tanh and the slope it uses: tanh(x) and slope() let a step that holds
  // values use them (Softcap::tanh_scores with the derivative, a slope read once per head).
  template <bool kTransposed, typename TensorS, typename TensorC, typename Masked, typename Tanh, typename Slope>
  __device__ void modify_scores(TensorS& s, const TensorC& coords, int row0, int col0, Masked&& masked, Tanh&& tanh,
                                Slope&& slope) const {
    if (softcap_on()) tanh(s);
    if (alibi_on()) Alibi::apply_slope<kTransposed>(slope(), s, coords, mask, row0, col0);
    if (is_masked(masked)) mask.template apply<kTransposed>(s, coords, row0, col0);
  }

  // dS = P (dP - D), with dropout's keep scale and mask.
  template <typename TensorP, typename TensordS, typename Dpsum>
  __device__ void probs_grad(const TensorP& probs, TensordS& ds, Dpsum&& dpsum) const {
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

  // dS times tanh's derivative, t recovered from P (Softcap::dtanh); lse_log2(q): the LSE of view
  // row q, times log2(e).
  template <typename TensorP, typename TensordS, typename Lse>
  __device__ void tanh_grad(const TensorP& probs, TensordS& ds, Lse&& lse_log2) const {
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
};

}  // namespace cutlass_flash

#endif  // defined(__CUDACC__)
