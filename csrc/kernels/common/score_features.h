// Which optional score modifiers (softcap, ALiBi, dropout) a kernel instantiation compiles in: a
// policy type of the mainloops. In an instantiation that has a feature it is a runtime switch
// (Softcap::on(), Alibi::on(), Dropout::on()); in one without, the code is compiled out and the
// launcher sends it only the calls that do not use it (covers()).
//
// Why both exist: the switches cost the sm90 backward's calls without any feature 4-9% at d = 64
// (mean 7%) and about 2% at d = 128 / 256 (PERFLOG.md entry 50), against the same kernel with the
// three compiled out; the forward keeps softcap and ALiBi as switches and compiles dropout in only
// where its switch cost more than 2% (FwdTraits::kDropoutKernel).
#pragma once

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
using NoDropout = ScoreFeatures<true, true, false>;
using PlainScores = ScoreFeatures<false, false, false>;

}  // namespace cutlass_flash
