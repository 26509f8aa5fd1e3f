// Online softmax over register tiles (arch-neutral).
//
// Works on a score tile viewed as (rows, cols) where a row is spread over the 4 threads of a quad,
// which holds for both mma.sync m16n8k16 and wgmma accumulators. Exponentials use exp2 with the
// softmax scale folded into log2(e), so each score costs one FFMA and one MUFU.EX2.
//
// The running row max that offsets the exponentials is raised only when a key block's max
// exceeds it by more than kRescaleThreshold (log2 units), so P stays <= 2^8 and the output
// accumulator is rescaled only in the steps where some row of the warp raised its max (after the
// first few key blocks, rarely): the rescale is d / 2 FMULs per thread and step (64 at d = 128, a
// tenth of a consumer warp's instructions per step, ncu). Stale or not, the offset cancels in
// O = sum(P V) / sum(P) and LSE = offset + log(sum(P)); P <= 256 keeps bf16/fp16's relative
// precision and adds at most 8 bits to the fp32 row sums (FlashAttention-4's conditional rescaling).
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace cutlass_flash {

// fmaxf is one FMNMX; `a > b ? a : b` (NaN-propagating on one side) costs an FSETP and an FSEL,
// a dependent pair on the critical path of the row max.
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

// Reduces across the 4 threads of a quad (lanes differing in bits 0 and 1).
template <typename Op>
__device__ __forceinline__ float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}

// kRowsTogether: the order of max_and_exp's work over the thread's rows (see there).
template <int kNRows, bool kRowsTogether = false>
struct OnlineSoftmax {
  static constexpr int kRows = kNRows;
  cute::Tensor<cute::ArrayEngine<float, kNRows>, cute::Layout<cute::Shape<cute::Int<kNRows>>>> row_max, row_sum;
  float scale_log2;

  __device__ explicit OnlineSoftmax(float softmax_scale_log2) : scale_log2(softmax_scale_log2) {
    cute::fill(row_max, -INFINITY);
    cute::fill(row_sum, 0.f);
  }

  // A row whose max is -inf (every entry masked so far) uses 0 as its offset, so exp2 gives 0
  // instead of NaN from (-inf) - (-inf).
  __device__ __forceinline__ float scaled_max(float m) const { return m == -INFINITY ? 0.f : m * scale_log2; }

  static constexpr float kRescaleThreshold = 8.f;

  // The thread's max of row mi of this tile and the running max (this tile's alone if kFirst).
  template <bool kFirst, typename TensorS>
  __device__ __forceinline__ float row_max_of(const TensorS& scores, int mi) const {
    float m = kFirst ? -INFINITY : row_max(mi);
    CUTE_UNROLL
    for (int ni = 0; ni < cute::size<1>(scores); ++ni) m = MaxOp{}(m, scores(mi, ni));
    return m;
  }

  // Whether the row's offset moves to the new max m. A row that has seen only masked keys (max
  // -inf) takes the new max whatever it is.
  template <bool kFirst>
  __device__ __forceinline__ bool raises(float m, float m_old) const {
    return kFirst || m_old == -INFINITY || (m - m_old) * scale_log2 > kRescaleThreshold;
  }

  // Row mi's exponentials at its (updated) offset, and its running sum.
  template <bool kFirst, typename TensorS>
  __device__ __forceinline__ void exp_row(TensorS& scores, int mi, float correction) {
    const float offset = scaled_max(row_max(mi));
    float s = 0.f;
    CUTE_UNROLL
    for (int ni = 0; ni < cute::size<1>(scores); ++ni) {
      scores(mi, ni) = exp2f(scores(mi, ni) * scale_log2 - offset);
      s += scores(mi, ni);
    }
    row_sum(mi) = kFirst ? s : row_sum(mi) * correction + s;
  }

  // Turns `scores` (rows, cols) into unnormalised probabilities in place and returns, per row,
  // the factor exp(old_max - new_max) by which the output accumulator must be rescaled (1 where
  // the max was kept). The rescale is left to the caller: the sm90 mainloop applies it later,
  // once no wgmma is writing the accumulator. The row sums stay per-thread partial sums until
  // finalize(), saving two shuffles per row per tile.
  //
  // Two orders of the same arithmetic (kRowsTogether):
  // - false: one pass per row; the kept-or-raised choice compiles to a branch per row.
  // - true: in phases over all the thread's rows (max, shuffles, offsets, exponentials), the choice
  //   as selects, so one row's shuffles and exponentials overlap the next row's. In the sm80 plain
  //   forward, the row-by-row order stalled 20% of warp cycles on the short scoreboard against
  //   FlashAttention-2's 7% (d = 128, ncu, H200); the phased one made it 1.08-1.16x faster. The
  //   kernels with the score features and the sm90 forward keep the row-by-row order: phased, the
  //   sm90 forward at d = 64 / 128 measured 1-3% slower and the sm80 features forward at d = 64
  //   2-6% slower (PERFLOG.md entry 94).
  template <bool kFirst, typename TensorS>
  __device__ __forceinline__ auto max_and_exp(TensorS& scores) {
    static_assert(decltype(cute::size<0>(scores))::value == kNRows);
    auto correction = cute::make_tensor<float>(cute::Shape<cute::Int<kNRows>>{});
    if constexpr (kRowsTogether) {
      float m[kNRows];
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) m[mi] = row_max_of<kFirst>(scores, mi);
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) m[mi] = quad_allreduce(m[mi], MaxOp{});
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        const float m_old = row_max(mi);
        const bool raise = raises<kFirst>(m[mi], m_old);
        const float c = exp2f(scaled_max(m_old) - scaled_max(m[mi]));
        correction(mi) = kFirst || !raise ? 1.f : c;
        row_max(mi) = raise ? m[mi] : m_old;
      }
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) exp_row<kFirst>(scores, mi, correction(mi));
    } else {
      CUTE_UNROLL
      for (int mi = 0; mi < kNRows; ++mi) {
        const float m_old = row_max(mi);
        float m = kFirst ? -INFINITY : m_old;
        CUTE_UNROLL
        for (int ni = 0; ni < cute::size<1>(scores); ++ni) m = MaxOp{}(m, scores(mi, ni));
        m = quad_allreduce(m, MaxOp{});
        const bool raise = raises<kFirst>(m, m_old);
        correction(mi) = kFirst || !raise ? 1.f : exp2f(scaled_max(m_old) - scaled_max(m));
        if (raise) row_max(mi) = m;
        const float offset = scaled_max(row_max(mi));
        float s = 0.f;
        CUTE_UNROLL
        for (int ni = 0; ni < cute::size<1>(scores); ++ni) {
          scores(mi, ni) = exp2f(scores(mi, ni) * scale_log2 - offset);
          s += scores(mi, ni);
        }
        row_sum(mi) = kFirst ? s : row_sum(mi) * correction(mi) + s;
      }
    }
    return correction;
  }

  // Multiplies each row of acc_o (rows, d) by its correction factor from max_and_exp(), unless
  // every factor of the warp is 1 (a warp-uniform skip: the whole warp must call it).
  template <typename TensorO, typename TensorC>
  __device__ __forceinline__ static void rescale(TensorO& acc_o, const TensorC& correction) {
    bool any = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) any |= correction(mi) != 1.f;
    if (!__any_sync(0xffffffff, any)) return;
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      CUTE_UNROLL
      for (int di = 0; di < cute::size<1>(acc_o); ++di) acc_o(mi, di) *= correction(mi);
    }
  }

  // max_and_exp() and the rescale in one step, for mainloops with no GEMM in flight on acc_o.
  template <bool kFirst, typename TensorS, typename TensorO>
  __device__ __forceinline__ void update(TensorS& scores, TensorO& acc_o) {
    const auto correction = max_and_exp<kFirst>(scores);
    if constexpr (!kFirst) rescale(acc_o, correction);
  }

  // Normalises acc_o (times o_scale: ScorePolicy::keep_scale) and returns the per-row log-sum-exp
  // (natural log) in `lse`. Rows that saw no key (sum 0) get out = 0 and lse = +inf, as
  // FlashAttention does. sink (natural log units, -inf: none): one more term of every row's
  // denominator, e^sink, with no value (attention sinks); the row's offset moves to the sink where
  // the sink is larger, so neither term overflows. A row with no key then gets lse = sink.
  template <typename TensorO, typename TensorL>
  __device__ __forceinline__ void finalize(TensorO& acc_o, TensorL& lse, float softmax_scale, float o_scale,
                                           float sink = -INFINITY) {
    CUTE_UNROLL
    for (int mi = 0; mi < kNRows; ++mi) {
      float sum = quad_allreduce(row_sum(mi), SumOp{});
      const bool empty = sum == 0.f || sum != sum;
      float offset = row_max(mi) * softmax_scale, factor = o_scale;
      if (sink != -INFINITY) {
        const float top = empty ? sink : fmaxf(offset, sink);
        const float kept = empty ? 0.f : expf(offset - top);
        sum = (empty ? 0.f : sum * kept) + expf(sink - top);
        factor *= kept;
        offset = top;
      }
      const bool none = sink == -INFINITY && empty;
      const float inv = none ? 1.f : factor / sum;
      lse(mi) = none ? INFINITY : offset + logf(sum);
      CUTE_UNROLL
      for (int di = 0; di < cute::size<1>(acc_o); ++di) acc_o(mi, di) *= inv;
    }
  }
};

}  // namespace cutlass_flash
