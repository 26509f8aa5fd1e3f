// Tile shapes of the sm90 forward kernel, per head dim: the one place they are chosen.
//
// block_m is 64 rows per consumer warpgroup (one wgmma atom is 64 rows tall): 128 = two consumer
// warpgroups ping-ponging, 192 = three. block_n is the key block of one pipeline stage. Shared
// memory (227 KiB a block) bounds block_n x stages; past it the output tile reuses the query tile's
// shared memory (see FwdTraits::kOAliasesQ). p_in_smem stages P in shared memory for the P V GEMM,
// which lets it overlap the softmax of its own warpgroup (PERFLOG.md, entries 10-11); it costs
// 2 x 64 x block_n x 2 bytes per consumer warpgroup. Measurements: PERFLOG.md, entries 9 and 11
// (benchmarks/tune_sm90.cu).
#pragma once

namespace cutlass_flash::sm90 {

struct FwdTile {
  int block_m;
  int block_n;
  int stages;
  bool p_in_smem;
};

constexpr FwdTile fwd_tile(int head_dim) {
  // d = 64: three consumer warpgroups (160 registers each): more rows in flight per K/V byte.
  // P in shared memory: +7-9% at >= 2k tokens (418/454 against 383/415 TFLOPS at 2k/8k).
  if (head_dim <= 64) return {192, 128, 2, true};
  // d = 96 spilled 100 bytes on three warpgroups (S 64 + O 48 + P 32 floats at 160 registers).
  // P in shared memory: 480 / 517 / 498 TFLOPS at 1k / 2k / 8k against 439 / 468 / 432.
  if (head_dim <= 96) return {128, 128, 2, true};
  // d = 128: P in shared memory +9% at 8k (575 against 528); Q/O 32 + K/V 128 + P 64 KiB.
  if (head_dim <= 128) return {128, 128, 2, true};
  // With O in Q's place: d = 192: Q/O 48 + 2 x (K 36 + V 36) = 192 KiB. 128x80 with P in
  // shared memory: +3% non-causal, -1-2% causal: not worth a second shape.
  if (head_dim <= 192) return {128, 96, 2, false};
  // d = 256: Q/O 64 + 2 x (K 40 + V 40) = 224 KiB, no room for P; 128x64 with P in shared memory
  // measured the same at 1-2k and 1-7% slower at 8k.
  return {128, 80, 2, false};
}

}  // namespace cutlass_flash::sm90
