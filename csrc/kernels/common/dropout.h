// Dropout on P (arch-neutral), Algorithm 2 of FlashAttention: each probability is kept with
// probability 1 - dropout_p and the kept ones are scaled by the inverse of that rate (in the
// forward's output normalisation and the backward's dV, once per row or tile, not per score). The
// softmax statistics (row sums, LSE) are those of the undropped P, as in FlashAttention-2. A
// runtime switch, uniform per call (off: one predicated branch per key block), or a kernel of its
// own where the path cost registers (sm90::FwdTraits::kProbsKernel).
//
// The keep mask is a pure function of (sequence b, query head h, query row i, key column j), the
// coordinates within the sequence, so every kernel family, tile shape and direction draws the
// same mask, and a sequence's mask does not depend on the rest of a packed batch:
//   i = 16 I + 8 a + r,  j = 32 J + 16 e + 8 c + 2 t + g   (a, c, e, g in {0, 1}; r < 8; t < 4)
//   words = Philox(counter = (J, I, h * 32 + r * 4 + t, b + offset), key = seed)   (4 x 32 bits)
//   u     = byte 2 e + c of word 2 g + a
//   keep  = u < threshold,  threshold = round((1 - dropout_p) * 256)  (float32 arithmetic)
// with (seed, offset) the two int64 of the call's rng_state (drawn from torch's CUDA generator).
// The kept scores are scaled by 256 / threshold (the inverse of the keep rate drawn, so the
// expectation is exact; dropout_p is in effect rounded to a multiple of 1/256, as in
// FlashAttention-2). One Philox call covers the 16 scores {i, i + 8} x {j, j + 1, j + 8, j + 9,
// j + 16, ...} of a 16 x 32 tile: in an m16n8 or wgmma accumulator a thread holds exactly those of
// one (I, J, r, t) when its n8 column groups are adjacent (the forwards) and the tile's columns
// start at a multiple of 32 (else half of them); the sm80 backward's warps alternate n8 groups
// (4 or 8 used); S^T in the sm90 backward (2 keys per thread) draws the calls in the forward's
// roles and shuffles the scores to their threads (8 used).
// cutlass_flash/dropout.py computes the same mask in torch (the tests' reference).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>
#include <type_traits>

#include "cutlass_flash/params.h"
#include "kernels/common/philox.h"

namespace cutlass_flash {

struct Dropout {
  // The tile's (batch, head), which the kernels hold anyway; the rng_state is read from
  // global memory where it is used, once per key block.
  const AttnProblem* p = nullptr;
  int batch = 0, head = 0;

  // What apply() does to a score: the forward zeroes the dropped probabilities; the backward
  // negates them (the mask travels in the sign bit from P's recomputation, where dS needs the
  // undropped P, to the dV GEMM, which takes max(P, 0)).
  struct Zero {
    template <typename T>
    __device__ void operator()(T& x, bool keep) const {
      x = keep ? x : T(0);
    }
  };
  struct Negate {
    __device__ void operator()(float& x, bool keep) const { x = keep ? x : -x; }
  };

  Dropout() = default;
  __host__ __device__ Dropout(const AttnProblem& problem, int b, int h) : p(&problem), batch(b), head(h) {}

  __host__ __device__ bool on() const { return p->dropout_p > 0.f; }

  // What a tile's first column (a multiple of its width) is a multiple of, of 32 at most: the
  // kAlign of for_each_keep.
  static constexpr int column_align(int block_n) { return block_n % 32 == 0 ? 32 : block_n % 16 == 0 ? 16 : 8; }

  __host__ __device__ static uint32_t keep_threshold(float dropout_p) {
    return uint32_t((1.f - dropout_p) * 256.f + 0.5f);
  }
  // What the kept probabilities are multiplied by (the forward's O, the backward's dV and dP):
  // 1 / keep rate; 0 when nothing is kept (O and the gradients are then 0).
  __host__ __device__ static float keep_scale(const AttnProblem& p) {
    if (p.dropout_p == 0.f) return 1.f;
    const uint32_t threshold = keep_threshold(p.dropout_p);
    return threshold > 0 ? 256.f / float(threshold) : 0.f;
  }

  // The Philox call that holds query row i and key column j (the header's function); rng: the
  // call's rng_state (seed lo, hi, offset lo, hi).
  __device__ uint4 call(const uint4& rng, int i, int j) const {
    const uint32_t sub = (uint32_t(head) << 5) | (uint32_t(i & 7) << 2) | (uint32_t(j & 7) >> 1);
    return Philox::generate(make_uint4(uint32_t(j) >> 5, uint32_t(i) >> 4, sub, uint32_t(batch) + rng.z), rng.x, rng.y);
  }

  // Calls f(mi, ni, keep) for each score (mi, ni) of a register tile of P. c: the tile's (row,
  // col) coordinates (an identity tensor partitioned like the accumulator, in the same view as the
  // scores); offsets added to them give positions in the sequence. Non-transposed: rows are
  // queries, the accumulator's rows r and r + 8 of each m16 slice are view rows 2u, 2u + 1, its
  // column pairs (2t, 2t + 1) view columns 2k, 2k + 1, pair k + 1 kPairStep columns right of pair k
  // (8: adjacent n8 groups); kAlign: what the tile's first column is a multiple of (of 32 at most),
  // so that kAlign / kPairStep consecutive pairs share one Philox call. kTransposed: the view is
  // (query, key) of S^T (the sm90 backward's colrow view, coordinates (key, query) as
  // WindowMask::apply), query pairs along view rows, key rows r, r + 8 along view columns 2v, 2v + 1.
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorC, typename Fn>
  __device__ void for_each_keep(const TensorC& c, int row_offset, int col_offset, Fn&& f) const {
    using namespace cute;
    const uint4 rng = *reinterpret_cast<const uint4*>(p->rng_state);
    const uint32_t threshold = keep_threshold(p->dropout_p);
    auto bits = [&](int i, int j) { return call(rng, i, j); };
    // Byte `b` of word w against the threshold (one PRMT: the byte into the low 8 bits).
    auto keep = [&](uint32_t w, uint32_t b) { return __byte_perm(w, 0u, 0x4440u | b) < threshold; };
    constexpr int kRows = decltype(size<0>(c))::value, kCols = decltype(size<1>(c))::value;
    if constexpr (!kTransposed) {
      constexpr int kSpan = kAlign < 32 ? kAlign : 32;  // columns one call's pairs may span
      constexpr int kPairs = kSpan / kPairStep > 0 ? kSpan / kPairStep : 1;
      static_assert(kRows % 2 == 0 && (kCols / 2) % kPairs == 0);
      CUTE_UNROLL
      for (int u = 0; u < kRows / 2; ++u) {
        CUTE_UNROLL
        for (int k = 0; k < kCols / 2; k += kPairs) {
          const int i = get<0>(c(2 * u, 2 * k)) + row_offset, j = get<1>(c(2 * u, 2 * k)) + col_offset;
          const uint4 r = bits(i, j);
          const uint32_t w[4] = {r.x, r.y, r.z, r.w};
          // Byte 2 e + c of the call's first pair: 0 when its 4 pairs are a whole 32-column group.
          const uint32_t b0 = kPairStep == 8 && kPairs == 4 ? 0u : (uint32_t(j) >> 3) & 3;
          CUTE_UNROLL
          for (int kk = 0; kk < kPairs; ++kk) {
            // Score x of a pair: row + 8 (a) = x / 2, column + 1 (g) = x % 2: word 2 g + a.
            CUTE_UNROLL
            for (int x = 0; x < 4; ++x)
              f(2 * u + x / 2, 2 * (k + kk) + x % 2, keep(w[2 * (x % 2) + x / 2], b0 + kk * (kPairStep / 8)));
          }
        }
      }
    } else {
      // S^T (the sm90 backward): a thread holds keys r', r' + 8 (r' = lane / 4) of its warp's 16
      // and queries 2 q' + p + 8 j (q' = lane % 4). Drawing its own calls, a thread would use 4
      // scores of each (the two keys of one query pair). So the calls are drawn in the forward's
      // roles instead: per 16 queries, lane L draws call (r = L / 4, t = L % 4) of the warp's 16
      // keys (8 of whose 16 bytes fall on them), packs those 8 bytes in two words (g = 0, 1), and
      // each thread takes its 8 scores from the 2 lanes holding them: 1 call and 4 shuffles per 8
      // scores, where drawing its own took 2 calls.
      static_assert(kRows % 4 == 0 && kCols == 2);
      const int lane = threadIdx.x % 32;
      const int i0 = get<1>(c(0, 0)) + row_offset;  // 16-aligned query block + 2 q'
      const int j0 = get<0>(c(0, 0)) + col_offset;  // the warp's 16-aligned key slab + r'
      const int slab = j0 & ~15;
      // Bytes 2 e, 2 e + 1 (c = 0, 1) of words 2 g (a = 0) and 2 g + 1 (a = 1): packed byte 2 a + c.
      const uint32_t e2 = 2 * ((uint32_t(slab) >> 4) & 1);
      const uint32_t pack = e2 | ((e2 + 1) << 4) | ((e2 + 4) << 8) | ((e2 + 5) << 12);
      const bool g = j0 & 1;
      const int src = 8 * (lane & 3) + ((lane >> 2) >> 1);  // the call of query pair p = 0; + 4: p = 1
      CUTE_UNROLL
      for (int ib = 0; ib < kRows / 4; ++ib) {
        const uint4 r = bits((i0 & ~15) + 16 * ib + (lane >> 2), slab + 2 * (lane & 3));
        const uint32_t packed0 = __byte_perm(r.x, r.y, pack), packed1 = __byte_perm(r.z, r.w, pack);
        CUTE_UNROLL
        for (int p = 0; p < 2; ++p) {
          const uint32_t v0 = __shfl_sync(0xffffffff, packed0, src + 4 * p);
          const uint32_t v1 = __shfl_sync(0xffffffff, packed1, src + 4 * p);
          const uint32_t v = g ? v1 : v0;
          // View row 4 ib + 2 a + p is query 16 ib + 8 a + 2 q' + p; view column c key r' + 8 c.
          CUTE_UNROLL
          for (int x = 0; x < 4; ++x) f(4 * ib + 2 * (x / 2) + p, x % 2, keep(v, x));
        }
      }
    }
  }

  // op(score, keep) on each score of s (the view c describes, as for_each_keep).
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorS, typename TensorC, typename Op>
  __device__ void apply(TensorS&& s, const TensorC& c, int row_offset, int col_offset, Op op) const {
    for_each_keep<kTransposed, kPairStep, kAlign>(c, row_offset, col_offset,
                                                  [&](int mi, int ni, bool keep) { op(s(mi, ni), keep); });
  }

  // Zeroes the dropped scores of a 16-bit P (rows are queries, the sm90 forward's layout as
  // for_each_keep's non-transposed view with kPairStep 8; c and the offsets as there), two at a
  // time: a thread's column pair (2 t, 2 t + 1) of a row is one 32-bit register, and word 2 g + a
  // of a call holds the bytes of column g of row half a. Per call, 3 instructions per word compare
  // its 4 bytes with the threshold at once (the result in each byte's top bit, below), then per
  // pair one PRMT spreads the two bytes' top bits over their 16-bit halves (its sign-replicating
  // selector) and one AND applies them: 2.5 instructions per 2 scores, where a PRMT, a compare and
  // a select per score, plus packing the bits (keep_bits / apply_bits), took 6-7 per score.
  template <int kAlign, typename TensorP, typename TensorC>
  __device__ void zero_dropped_p16(TensorP&& p_rc, const TensorC& c, int row_offset, int col_offset) const {
    using namespace cute;
    static_assert(sizeof(typename std::decay_t<TensorP>::value_type) == 2);
    const uint4 rng = *reinterpret_cast<const uint4*>(p->rng_state);
    const uint32_t threshold = keep_threshold(p->dropout_p);
    if (threshold > 255) return;  // every byte is below 256: all kept
    // Bytewise x < t (t = threshold in every byte) into each byte's top bit: with the top bits
    // set in x and cleared in t, d = (x | 0x80..) - (t & 0x7f..) borrows across no byte, and d's
    // top bit says low7(x) >= low7(t); x < t when top(x) < top(t), or they are equal and not d.
    const uint32_t t4 = threshold * 0x01010101u;
    auto below = [&](uint32_t x) {
      const uint32_t d = (x | 0x80808080u) - (t4 & 0x7f7f7f7fu);
      return (~x & t4) | (~(x ^ t4) & ~d);
    };
    constexpr int kRows = decltype(size<0>(c))::value, kGroups = decltype(size<1>(c))::value / 2;  // n8 groups
    static_assert(kRows % 2 == 0 && (kAlign == 16 || kAlign == 32));
    static_assert(decltype(p_rc.layout()(make_coord(_0{}, _1{})))::value == 1 &&
                      decltype(p_rc.layout()(make_coord(_0{}, _2{})))::value % 2 == 0,
                  "a row's column pair is one 32-bit register");
    // kShift: the tile's first n8 group's place in its 32-column group (0, or 2 for a tile that
    // starts 16 columns in: d = 256's 80-column key blocks, every second one). A call covers the
    // groups up to the next 32-column boundary, so a tile of 80 columns takes 3 calls per row pair,
    // where calls of 2 groups each (as for_each_keep with kAlign 16) took 5.
    auto zero = [&](auto shift) {
      constexpr int kShift = decltype(shift)::value;
      CUTE_UNROLL
      for (int u = 0; u < kRows / 2; ++u) {
        uint32_t keep[2][2];  // [row half a][column g]: each byte's keep bit in its top bit
        CUTE_UNROLL
        for (int n = 0; n < kGroups; ++n) {
          if (n == 0 || (kShift + n) % 4 == 0) {
            const uint4 r = call(rng, get<0>(c(2 * u, 2 * n)) + row_offset, get<1>(c(2 * u, 2 * n)) + col_offset);
            keep[0][0] = below(r.x), keep[1][0] = below(r.y), keep[0][1] = below(r.z), keep[1][1] = below(r.w);
          }
          // Bytes 0, 1 of the mask from byte b of keep[a][0], bytes 2, 3 from byte b of
          // keep[a][1] (selector 4 + b), each as its top bit replicated (selector bit 3).
          const uint32_t b = (kShift + n) % 4, sel = (0x8u | b) * 0x11u | ((0xCu | b) * 0x11u) << 8;
          CUTE_UNROLL
          for (int a = 0; a < 2; ++a) {
            uint32_t mask;
            asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mask) : "r"(keep[a][0]), "r"(keep[a][1]), "r"(sel));
            *reinterpret_cast<uint32_t*>(&p_rc(2 * u + a, 2 * n)) &= mask;
          }
        }
      }
    };
    if (kAlign == 16 && (col_offset & 16))
      zero(cute::Int<2>{});
    else
      zero(cute::Int<0>{});
  }

  // The keep bits of a tile, bit mi + rows * ni (at most 64 scores per thread: the tiles that
  // take this path have 32-64), for kernels that draw them where fewer registers are live than
  // where they are applied (apply_bits): the sm80 forward, before S.
  template <bool kTransposed, int kPairStep, int kAlign, typename TensorC>
  __device__ uint64_t keep_bits(const TensorC& c, int row_offset, int col_offset) const {
    constexpr int kRows = decltype(cute::size<0>(c))::value;
    static_assert(decltype(cute::size(c))::value <= 64);
    uint64_t bits = 0;
    for_each_keep<kTransposed, kPairStep, kAlign>(
        c, row_offset, col_offset, [&](int mi, int ni, bool keep) { bits |= uint64_t(keep) << (mi + kRows * ni); });
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
