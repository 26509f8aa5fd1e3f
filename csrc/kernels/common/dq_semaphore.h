// The fixed accumulation order of dQ in deterministic mode (arch-neutral). The key blocks of a
// (batch, head) fall into bwd_dq_groups groups (block n in group n % groups), each adding into its
// own fp32 copy of dQ (BwdWorkspace::dq_group_row); the dQ conversion sums the copies in group
// order. Per group and query tile an int in the workspace counts the group's key blocks that have
// added their dQ; key block n adds its share once every lower key block of its group that sees the
// tile has (FlashAttention-3's scheme, on chains a quarter as long); the sm90 backward under a
// right-bounded mask takes them in decreasing order instead (sm90::BwdSteps). Deadlock-free
// because a block only ever waits for blocks of the same (head, batch) launched before it, which
// the hardware starts first: the grids put the key block in blockIdx.x, reversed for the
// decreasing order.
#pragma once

#include <cuda_runtime.h>

#include "generated/bwd_workspace.h"
#include "kernels/common/mask.h"

namespace cutlass_flash {

struct DqSemaphore {
  int* counts = nullptr;  // null: not deterministic, every call below is a no-op

  // The semaphore of query rows [m_block * kBlockM, ...) of (batch, head); kBlockM is a multiple of
  // kBwdSemaphoreRows.
  template <int kBlockM>
  __device__ int* at(int64_t bh_row, int m_block) const {
    static_assert(kBlockM % kBwdSemaphoreRows == 0);
    return counts + (bh_row + int64_t(m_block) * kBlockM) / kBwdSemaphoreRows;
  }

  // How many key blocks of n_block's group add to query tile m_block before it: those below it
  // (above it when `descending`, the order of sm90::BwdSteps::upward) whose query range
  // (WindowMask::m_block_range, the same function that bounds their loops) contains it. Both ends
  // of a key block's query range grow with the block, so the blocks that contain m_block are one
  // interval [n_lo, n_hi) and the count is a closed form: the group's blocks in [n_lo, n_block)
  // ascending, in (n_block, n_hi) descending (checked against counting block by block on 166,663
  // (tile, block) pairs of random shapes, windows and group counts). Counting block by block ran
  // on the critical path of every step: at 128k keys the deterministic backward took 2.3x (causal)
  // to 3x the default's time; in closed form 1.08x there, 1.00-1.24x at 4k-16k keys (H200, PERFLOG
  // 92).
  // m_block is one of n_block's own query blocks.
  template <int kBlockM, int kBlockN>
  __device__ static int turn(const WindowMask& mask, int m_block, int n_block, int groups, bool descending = false) {
    if constexpr (kBwdDqGroups == 1) groups = 1;  // one chain (csrc/generate.py): no divisions below
    const int n_end = (mask.seqlen_k + kBlockN - 1) / kBlockN;
    if (descending) {  // n contains m_block iff its first query block, m_min(n), is at or before it
      int n_hi = n_end;
      if (mask.has_right()) {
        const int last = (m_block + 1) * kBlockM - 1 + mask.diag() + mask.window_right;
        n_hi = min(n_hi, last < 0 ? 0 : last / kBlockN + 1);
      }
      return n_hi > n_block ? (n_hi - 1 - n_block) / groups : 0;
    }
    int n_lo = 0;  // n contains m_block iff its last query row (m_max(n)) reaches m_block's first
    if (mask.has_left()) {
      const int first = m_block * kBlockM + 1 + mask.diag() - mask.window_left;
      if (first > 0) n_lo = min((first + kBlockN - 1) / kBlockN - 1, n_end - 1);
    }
    return n_block > n_lo ? (n_block - n_lo) / groups : 0;
  }

  // Spins until `sem` reaches `value` (acquire); one thread, or a warp on one address.
  __device__ static void wait(const int* sem, int value) {
    int seen;
    do {
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(sem) : "memory");
    } while (seen < value);  // never past it for valid cu_seqlens; bad content must not hang
  }

  // One thread, after its block's additions are complete and visible (release).
  __device__ static void signal(int* sem) {
    asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(sem) : "memory");
  }
};

}  // namespace cutlass_flash
