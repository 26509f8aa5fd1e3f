// Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the
// counter-based generator behind cuRAND's and PyTorch's CUDA random numbers (there with 10
// rounds): 128 random bits from a 128-bit counter and a 64-bit key, with no state to carry, so
// any tile can regenerate the bits of any element (a backward recomputes the forward's draws
// instead of storing them). The Python package has the same function in torch (the tests'
// reference, checked against Random123's known-answer vectors).
#pragma once

#include <cstdint>

#include "generated/philox_rounds.h"

namespace cutlass_flash {

struct Philox {
  static constexpr int kRounds = kPhiloxRounds;  // csrc/generate.py's (generated/philox_rounds.h)

  // One round multiplies two 32-bit words into 64-bit products (one IMAD.WIDE each) and mixes the
  // halves with the other words and the key (one 3-input LOP3 each).
  __host__ __device__ __forceinline__ static uint4 generate(uint4 ctr, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      if (i > 0) {
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
      }
      const uint64_t p0 = uint64_t(0xD2511F53u) * ctr.x;
      const uint64_t p1 = uint64_t(0xCD9E8D57u) * ctr.z;
      ctr = make_uint4(uint32_t(p1 >> 32) ^ ctr.y ^ k0, uint32_t(p1), uint32_t(p0 >> 32) ^ ctr.w ^ k1, uint32_t(p0));
    }
    return ctr;
  }
};

}  // namespace cutlass_flash
