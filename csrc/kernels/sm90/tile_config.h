// Tile shapes of the sm90 forward kernel, per head dim: the one place they are chosen.
//
// block_m is 64 rows per consumer warpgroup (one wgmma atom is 64 rows tall): 128 = two consumer
// warpgroups ping-ponging, 192 = three. block_n is the key block of one pipeline stage. Shared
// memory (227 KiB a block) bounds block_n x stages; past it the output tile is staged in V's
// stages (see FwdTraits::kOInV). Measurements: PERFLOG.md, entries 9 and 13
// (benchmarks/tune_sm90.cu, bf16, TFLOPS at 1k / 2k / 8k tokens, non-causal).
#pragma once

namespace cutlass_flash::sm90 {

struct FwdTile {
  int block_m;
  int block_n;
  int stages;
};

constexpr FwdTile fwd_tile(int head_dim);

// With a head dim of V of its own (FwdTraits::kHeadDimV). (192, 128), MLA's: FlashAttention-3's
// 128 x 128, O in V's stages: Q 48 + 2 x (K 48 + V 32) = 208 KiB.
constexpr FwdTile fwd_tile(int head_dim, int head_dim_v) {
  if (head_dim == 192 && head_dim_v == 128) return {128, 128, 2};
  return fwd_tile(head_dim);
}

constexpr FwdTile fwd_tile(int head_dim) {
  // d = 64: three consumer warpgroups (160 registers each): more rows in flight per K/V byte.
  // 386 / 442 / 464; 128x176 386 / 417 / 454; 192x160 spills 296 B (S 80 + O 32 + P 40 floats).
  if (head_dim <= 64) return {192, 128, 2};
  // d = 96: three consumer warpgroups, as FlashAttention-3 (192 x 144 there, with P through shared
  // memory). tune_sm90, bf16, 1k / 2k / 8k, two runs, non-causal: 192x96 482 / 542 / 604, 128x128
  // 498 / 524 / 545, 128x160 464 / 517 / 550; causal 192x96 330 / 432 / 503, 128x128 342 / 414 /
  // 476 (PERFLOG 83). 192x112 and 192x128 spill (280 / 184 B at 160 registers).
  if (head_dim <= 96) return {192, 96, 2};
  // d = 128: 622 / 672 / 624; FlashAttention-3's 128x176 571 / 588 / 641, 128x160 578 / 627 / 640.
  if (head_dim <= 128) return {128, 128, 2};
  // d = 192, O in V's stages: Q 48 + 2 x (K 36 + V 36) = 192 KiB. 654 / 729 / 755; 128x112
  // 631 / 728 / 718.
  if (head_dim <= 192) return {128, 96, 2};
  // d = 256, O in V's stages: Q 64 + 2 x (K 40 + V 40) = 224 KiB. 666 / 731 / 734; 128x64
  // 645 / 707 / 675. No spills (ptxas -v) since the mask and scheduler are built after setmaxnreg
  // (PERFLOG.md, entry 16).
  return {128, 80, 2};
}

}  // namespace cutlass_flash::sm90

namespace cutlass_flash::sm90 {

// Backward, three layouts (sm90/bwd_traits.h). Keys per warpgroup (d <= 128): a block keeps
// 64 x mma_warpgroups keys, each consumer warpgroup accumulating its 64 keys' dK and dV in
// registers, and streams block_m query rows per step through `stages` buffers of Q and dO.
// Split d: the consumer warpgroups split the head dim of dK, dV and dQ; with keys as rows a
// block keeps 64 keys (two warpgroups), with queries as rows block_n.
enum class BwdLayout { kKeysPerWarpgroup, kSplitD, kSplitDQueryRows };

struct BwdTile {
  BwdLayout layout;
  int block_m;
  int mma_warpgroups;
  int stages;
  int block_n;
};

constexpr BwdTile bwd_tile(int head_dim) {
  // Registers per consumer thread: dK + dV = head_dim, S + dP = block_m (fp32), P and dS in 16 bits
  // block_m / 2, dQ block_m x head_dim / (64 x warpgroups): within 240 at 64 x 128 for d <= 128.
  // d = 64 at block_m 128 spilled 68 B (S + dP 128 registers).
  if (head_dim <= 64) return {BwdLayout::kKeysPerWarpgroup, 128, 2, 2, 128};
  if (head_dim <= 128) return {BwdLayout::kKeysPerWarpgroup, 64, 2, 2, 128};
  // d = 192, FlashAttention-3's tile: 96 keys, three warpgroups of 160 registers (dK^T + dV^T 96,
  // S + dP 32, dQ 32 a thread); shared memory K, V 2 x 36 KiB, Q and dO 2 x 2 x 24 KiB, P and dS
  // 2 x 2 x 12 KiB = 216 KiB. The keys-as-rows split-d layout ran at 0.78-0.81x FlashAttention-3
  // there (64 keys a block, PERFLOG.md entry 82).
  if (head_dim <= 192) return {BwdLayout::kSplitDQueryRows, 64, 3, 2, 96};
  // Split d, keys as rows: dK + dV d / 2, dQ d / 4, S + dP 32 registers a thread; shared memory at
  // d = 256: K, V 2 x 32 KiB, Q and dO 2 x 2 x 32 KiB, P^T and dS^T 2 x 2 x 8 KiB = 224 KiB.
  return {BwdLayout::kSplitD, 64, 2, 2, 64};
}

}  // namespace cutlass_flash::sm90
