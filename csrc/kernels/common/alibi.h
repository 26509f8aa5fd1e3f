// ALiBi (arch-neutral), FlashAttention-2's: the scaled score of query i and key j gets
// -slope * |i + seqlen_k - seqlen_q - j| (the distance to the bottom-right-aligned diagonal)
// before the softmax, with one slope per (batch, head). A runtime switch, uniform per call:
// off (no slopes) costs one predicated branch per key block.
#pragma once

#include <cmath>

#include "cutlass_flash/params.h"
#include "kernels/common/mask.h"
#include "kernels/common/softcap.h"

namespace cutlass_flash {

struct Alibi {
  // Which slope: the (batch, head) of the tile, the same values the kernels hold for their own
  // addressing, so that the switch adds no register live through the key loop (a held slope
  // spilled 4 B at sm90 d = 256). The slope is read where it is used, once per key block.
  // p: the kernel's parameters (constant memory: reading it costs no register either).
  const AttnProblem* p = nullptr;
  int batch = 0, head = 0;

  Alibi() = default;
  __host__ __device__ Alibi(const AttnProblem& problem, int b, int h) : p(&problem), batch(b), head(h) {}

  __host__ __device__ bool on() const { return p->alibi_slopes != nullptr; }

  // The tile's slope, divided by the scale the softmax applies after the bias: the kernels
  // multiply their scores (scale * q.k, or tanh(.) under softcap) by Softcap::softmax_scale inside
  // the softmax, and the bias is added before that (FlashAttention-2 divides its slope by
  // scale_softmax the same way). A global load and a reciprocal, read where it is used (once per
  // key block), or once per head by a mainloop with registers to spare.
  __device__ float slope() const {
    return p->alibi_slopes[batch * p->alibi_batch_stride + head] / Softcap::softmax_scale(*p);
  }

  // Adds the bias of `slope` (slope()) to a tile of scores; coords, offsets and kTransposed as
  // WindowMask::apply (whose diagonal the distance is measured from).
  template <bool kTransposed = false, typename TensorS, typename TensorC>
  __device__ static void apply_slope(float slope, TensorS& scores, const TensorC& coords, const WindowMask& mask,
                                     int row_offset, int col_offset) {
    // distance = |row + row_offset + diag - col - col_offset|. Each entry's (row - col) differs from
    // the first entry's by a compile-time constant, so the distance is one float base plus a
    // constant: an FADD per score instead of an integer-to-float conversion, which runs on the
    // pipe the softmax's exponentials saturate.
    const int row0 = cute::get<(kTransposed ? 1 : 0)>(coords(0));
    const int col0 = cute::get<(kTransposed ? 0 : 1)>(coords(0));
    const float base = float(row0 + row_offset + mask.diag() - col0 - col_offset);
    CUTE_UNROLL
    for (int i = 0; i < cute::size(scores); ++i) {
      const int row = cute::get<(kTransposed ? 1 : 0)>(coords(i)) - row0;
      const int col = cute::get<(kTransposed ? 0 : 1)>(coords(i)) - col0;
      scores(i) -= slope * fabsf(base + float(row - col));
    }
  }
};

}  // namespace cutlass_flash
