// Dropout on P (arch-neutral), Algorithm 2 of FlashAttention: each probability is kept with
// probability 1 - dropout_p and the kept ones are scaled by 1 / (1 - dropout_p) (in the forward's
// output normalisation and the backward's dV, once per row or tile, not per score). The softmax
// statistics (row sums, LSE) are those of the undropped P, as in FlashAttention-2. A runtime
// switch, uniform per call: off (dropout_p = 0) costs one predicated branch per key block.
//
// The keep mask is a pure function of (sequence b, query head h, query row i, key column j), the
// coordinates within the sequence, so every kernel family, tile shape and direction draws the
// same mask, and a sequence's mask does not depend on the rest of a packed batch:
//   i = 16 I + 8 a + r,  j = 16 J + 8 c + 2 t + g   (a, c, g in {0, 1}; r < 8; t < 4)
//   bits = Philox(counter = (J, I, h * 32 + r * 4 + t, b + offset), key = seed)   (4 words)
//   u    = 16 bits of word 2 g + a: the low half if c = 0, the high half if c = 1
//   keep = u < threshold,  threshold = round((1 - dropout_p) * 65536)  (float32 arithmetic)
// with (seed, offset) the two int64 of the call's rng_state (drawn from torch's CUDA generator).
// One Philox call covers the 8 scores {i, i + 8} x {j, j + 1, j + 8, j + 9} of a 16 x 16 tile: in
// an m16n8 or wgmma accumulator a thread holds exactly those of one (I, J, r, t), so the forward
// uses all 8; a tile whose n8 column groups alternate between warps (the sm80 backward), or S^T
// (the sm90 backward, queries along the accumulator's columns), uses 4 of them.
// cutlass_flash/dropout.py computes the same mask in torch (the tests' reference).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "cutlass_flash/params.h"
#include "kernels/common/philox.h"

namespace cutlass_flash {

struct Dropout {
  // As Alibi: the tile's (batch, head), which the kernels hold anyway; the rng_state is read from
  // global memory where it is used, once per key block.
  const AttnProblem* p = nullptr;
  int batch = 0, head = 0;

  // What apply() does to a score: the forward zeroes the dropped probabilities; the backward
  // negates them (the mask travels in the sign bit from P's recomputation, where dS needs the
  // undropped P, to the dV GEMM, which takes max(P, 0)).
  struct Zero {
    template <typename T>
    __device__ void operator()(T& x, bool keep) const { x = keep ? x : T(0); }
  };
  struct Negate {
    __device__ void operator()(float& x, bool keep) const { x = keep ? x : -x; }
  };

  Dropout() = default;
  __host__ __device__ Dropout(const AttnProblem& problem, int b, int h) : p(&problem), batch(b), head(h) {}

  __host__ __device__ bool on() const { return p->dropout_p > 0.f; }

  // What the kept probabilities are multiplied by: the forward's O and the backward's dV.
  __host__ __device__ static float keep_scale(const AttnProblem& p) {
    return p.dropout_p > 0.f ? 1.f / (1.f - p.dropout_p) : 1.f;
  }
  __host__ __device__ static uint32_t keep_threshold(float dropout_p) {
    return uint32_t((1.f - dropout_p) * 65536.f + 0.5f);
  }

  // Calls f(mi, ni, keep) for each score (mi, ni) of a register tile of P. c: the tile's (row,
  // col) coordinates (an identity tensor partitioned like the accumulator, in the same view as the
  // scores); offsets added to them give positions in the sequence. Non-transposed: rows are
  // queries, the accumulator's rows r and r + 8 of each m16 slice are view rows 2u, 2u + 1, its
  // column pairs (2t, 2t + 1) view columns 2k, 2k + 1; kPaired8: pair k + 1 is 8 columns right of
  // pair k for even k (one Philox call serves both). kTransposed: the view is (query, key) of S^T
  // (the sm90 backward's colrow view, coordinates (key, query) as WindowMask::apply), query pairs
  // along view rows, key rows r, r + 8 along view columns 2v, 2v + 1.
  // kUnroll: how many Philox calls the compiler may interleave (their temporaries live together).
  template <bool kTransposed, bool kPaired8, int kUnroll = 64, typename TensorC, typename Fn>
  __device__ void for_each_keep(const TensorC& c, int row_offset, int col_offset, Fn&& f) const {
    using namespace cute;
    const uint4 rng = *reinterpret_cast<const uint4*>(p->rng_state);  // seed lo, hi, offset lo, hi
    // The key taken warp-uniform from lane 0, so its 10 round values live in uniform registers
    // (shared by every Philox call) instead of 20 per-thread ones: in per-thread registers the
    // sm90 forward spilled 60-76 B at d = 192 / 256.
    const uint32_t k0 = __shfl_sync(0xffffffff, rng.x, 0), k1 = __shfl_sync(0xffffffff, rng.y, 0);
    const uint32_t threshold = keep_threshold(p->dropout_p);
    const uint32_t c3 = uint32_t(batch) + rng.z;
    auto bits = [&](int i, int j) {
      const uint32_t sub = (uint32_t(head) << 5) | (uint32_t(i & 7) << 2) | (uint32_t(j & 7) >> 1);
      return Philox::generate(make_uint4(uint32_t(j) >> 4, uint32_t(i) >> 4, sub, c3), k0, k1);
    };
    // The 16 bits of half `hi` of word w.
    auto keep = [&](uint32_t w, bool hi) { return (hi ? w >> 16 : w & 0xffffu) < threshold; };
    constexpr int kRows = decltype(size<0>(c))::value, kCols = decltype(size<1>(c))::value;
    if constexpr (!kTransposed) {
      static_assert(kRows % 2 == 0 && kCols % (kPaired8 ? 4 : 2) == 0);
#pragma unroll kUnroll
      for (int u = 0; u < kRows / 2; ++u) {
#pragma unroll kUnroll
        for (int k = 0; k < kCols / 2; k += kPaired8 ? 2 : 1) {
          const int i = get<0>(c(2 * u, 2 * k)) + row_offset, j = get<1>(c(2 * u, 2 * k)) + col_offset;
          const uint4 r = bits(i, j);
          const uint32_t w[4] = {r.x, r.y, r.z, r.w};
          // Score e of a column pair: row + 8 (a) = e / 2, column + 1 (g) = e % 2: word 2 g + a.
          // Its half: c, the pair's column bit 3, 0 then 1 when paired.
          const bool c_first = kPaired8 ? false : ((j >> 3) & 1);
          CUTE_UNROLL
          for (int kk = 0; kk < (kPaired8 ? 2 : 1); ++kk) {
            CUTE_UNROLL
            for (int e = 0; e < 4; ++e)
              f(2 * u + e / 2, 2 * (k + kk) + e % 2, keep(w[2 * (e % 2) + e / 2], kPaired8 ? kk == 1 : c_first));
          }
        }
      }
    } else {
      static_assert(kRows % 4 == 0 && kCols % 2 == 0);
      // View row 4 I' + p + 2 a is query 16 I' + 8 a + 2 (lane % 4) + p, view column 2 v + c key
      // 8 c + lane / 4 (+ 16 v): one call per (I', p, v), its words 2 g + a with g = key & 1.
#pragma unroll kUnroll
      for (int qq = 0; qq < kRows / 2; ++qq) {
        const int q = 4 * (qq / 2) + qq % 2;
#pragma unroll kUnroll
        for (int v = 0; v < kCols / 2; ++v) {
          const int i = get<1>(c(q, 2 * v)) + row_offset, j = get<0>(c(q, 2 * v)) + col_offset;
          const uint4 r = bits(i, j);
          const uint32_t w0 = (j & 1) ? r.z : r.x, w1 = (j & 1) ? r.w : r.y;
          CUTE_UNROLL
          for (int e = 0; e < 4; ++e) f(q + 2 * (e / 2), 2 * v + e % 2, keep(e / 2 ? w1 : w0, e % 2));
        }
      }
    }
  }

  // op(score, keep) on each score of s (the view c describes, as for_each_keep).
  template <bool kTransposed, bool kPaired8, typename TensorS, typename TensorC, typename Op>
  __device__ void apply(TensorS&& s, const TensorC& c, int row_offset, int col_offset, Op op) const {
    for_each_keep<kTransposed, kPaired8>(c, row_offset, col_offset,
                                         [&](int mi, int ni, bool keep) { op(s(mi, ni), keep); });
  }

  // The keep bits of a tile, bit mi + rows * ni (at most 64 scores per thread: the tiles that
  // take this path have 32-64), computed before the tile's GEMMs are issued so that the Philox
  // temporaries are not live beside their accumulators (the sm90 backward at d = 64 spilled 8 B
  // otherwise; the sm90 forward at d = 256 60-76 B), then applied with apply_bits.
  template <bool kTransposed, bool kPaired8, int kUnroll = 64, typename TensorC>
  __device__ uint64_t keep_bits(const TensorC& c, int row_offset, int col_offset) const {
    constexpr int kRows = decltype(cute::size<0>(c))::value;
    static_assert(decltype(cute::size(c))::value <= 64);
    uint64_t bits = 0;
    for_each_keep<kTransposed, kPaired8, kUnroll>(c, row_offset, col_offset, [&](int mi, int ni, bool keep) {
      bits |= uint64_t(keep) << (mi + kRows * ni);
    });
    return bits;
  }

  template <typename TensorS, typename Op>
  __device__ static void apply_bits(TensorS&& s, uint64_t bits, Op op) {
    constexpr int kRows = decltype(cute::size<0>(s))::value;
    CUTE_UNROLL
    for (int ni = 0; ni < cute::size<1>(s); ++ni) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) op(s(mi, ni), (bits >> (mi + kRows * ni)) & 1);
    }
  }
};

}  // namespace cutlass_flash
