// Tile shapes of the sm90 forward kernel, per head dim: the one place they are chosen.
//
// block_m is 64 rows per consumer warpgroup (one wgmma atom is 64 rows tall): 128 = two consumer
// warpgroups ping-ponging, 192 = three. block_n is the key block of one pipeline stage. Shared
// memory (227 KiB a block) bounds block_n x stages; past it the output tile reuses the query tile's
// shared memory (see FwdTraits::kOAliasesQ). Reasons and measurements: PERFLOG.md.
#pragma once

namespace cutlass_flash::sm90 {

struct FwdTile {
  int block_m;
  int block_n;
  int stages;
};

constexpr FwdTile fwd_tile(int head_dim) {
  // d = 64: three consumer warpgroups at 160 registers each (S 64 floats a thread, O 32, P 32):
  // more rows in flight per K/V byte loaded. d = 96 spilled 100 bytes that way (S 64 + O 48 +
  // P 32 at 160 registers), so it takes two warpgroups at 240.
  if (head_dim <= 64) return {192, 128, 2};
  if (head_dim <= 96) return {128, 128, 2};
  // d = 128: Q 32 KiB + 2 x (K 32 + V 32) + O 32 = 192 KiB.
  if (head_dim <= 128) return {128, 128, 2};
  // With O in Q's place: d = 192: Q/O 48 + 2 x (K 36 + V 36) = 192 KiB;
  // d = 256: Q/O 64 + 2 x (K 40 + V 40) = 224 KiB.
  if (head_dim <= 192) return {128, 96, 2};
  return {128, 80, 2};
}

}  // namespace cutlass_flash::sm90
