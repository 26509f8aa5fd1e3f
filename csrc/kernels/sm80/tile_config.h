// Tile shapes of the sm80 kernels, per head dim: the one place they are chosen.
//
// Starting point: FlashAttention-2's measured choices for A100 (sm80, 164 KB shared memory per
// SM), which also fit Hopper's 227 KB. Forward: 128 query rows per block with 4 warps (32 rows
// per warp keeps the S tile in registers); the key block shrinks as the head dim grows so
// Q + K + V stay in shared memory and registers do not spill. Backward: K/V tile resident per
// block, queries streamed; 8 warps. See PERFLOG.md for what was measured on our GPU.
#pragma once

namespace cutlass_flash::sm80 {

struct FwdTile {
  int block_m, block_n, warps;
  int kv_stages = 1;  // K and V buffers in shared memory (FwdTraits::kKVStages)
};

// The forward with every feature (the score features, packed batches, narrow head dims).
constexpr FwdTile fwd_tile(int head_dim) {
  // d = 64: 128x64, not FA2's 128x128: ptxas spills 40-292 B at 128x128 and none at 128x64;
  // measured 0.89-0.92x FA2 on the H200 (128x128: 0.80-0.86x).
  // d = 96/128: 128x32: no spills (128x64 spills 244 B) and +1-3% on the H200 at d = 128
  // (0.89-0.93x FA2 against 0.87-0.93x); 8 warps at 128x64 measured 0.67-0.72x.
  // d = 192/256: 128x64 with 8 warps (16 rows per warp: 4 warps would need twice the O
  // accumulator registers per thread).
  return head_dim <= 64 ? FwdTile{128, 64, 4} : head_dim <= 128 ? FwdTile{128, 32, 4} : FwdTile{128, 64, 8};
}

// The plain forward (PlainScores: no score feature, packed batch or narrow head dim)
// has the registers the features took: at d = 96 / 128 it runs FlashAttention-2's 128 x 64 tile
// (sm_90 SASS 0 B / 196 B of spills: 0.88-0.92x FA2 against 0.72-0.86x at 128 x 32, H200, bf16 and
// fp16, 1k-8k, PERFLOG.md entry 93). At d = 64 FA2's 128 x 128 spilled 52 B and measured 1-3%
// slower than 128 x 64. At d = 256, FA2's choice on GPUs with 228 KB of shared memory per SM
// (H100): 64 x 64 with 4 warps, two blocks per SM (2 x 96 KB), so that one block's softmax runs
// under the other's GEMMs; at 128 x 64 with 8 warps, 17% of warp cycles stalled on the shared-memory
// queue (MIO throttle) against FA2's 7% (ncu, H200).
// Up to d = 128, two K and V buffers (48 / 96 KB at d = 64 / 128): with one, the d = 64 kernel's
// barriers took 20% of its stall samples waiting on the key block's loads (FA2's 128-key blocks
// give each load twice the work to hide under); two measured +2-4% at d = 64 and d = 128 (H200,
// PERFLOG.md entry 95). The launcher keeps one where two would cost a block per SM (an A100 at
// d = 128: 164 KB holds two 64 KB blocks, one 96 KB).
constexpr FwdTile fwd_plain_tile(int head_dim) {
  return head_dim <= 64    ? FwdTile{128, 64, 4, 2}
         : head_dim <= 128 ? FwdTile{128, 64, 4, 2}
         : head_dim <= 192 ? fwd_tile(head_dim)
                           : FwdTile{64, 64, 4};
}

struct BwdTile {
  int block_m, block_n, warps;
  int atom_m_sdp;  // warps along M for S = Q K^T and dP = dO V^T
  int atom_n_dkv;  // warps along N for dK, dV
  int atom_m_dq;   // warps along M for dQ
  int q_stages;    // 2: the next Q block loads during the current one
  // true: the thread's shared/global-memory offsets used after the dP GEMM (P/dS stores, dV/dK/dQ
  // GEMMs, Q/dO loads) are recomputed in each iteration instead of being held in registers through
  // it, the register peak (bwd_mainloop.h). ptxas (nvcc 13.0), SASS instructions of one query block
  // (loop body, sm_80/sm_90) with false -> true: d = 64: 1802/1817 -> 1855/1889; d = 96:
  // 1158/1185 -> 1154/1164; d = 128: 4 B spilled on sm_80 -> none, 1478/1516 -> 1473/1411;
  // d = 192: 1110/1118 -> 1107/1124; d = 256: 1338/1361 -> 1348/1356. No spills otherwise.
  bool late_offsets;
};

constexpr BwdTile bwd_tile(int head_dim) {
  // The block keeps K, V (block_n x d) and accumulates dK, dV in registers; the m-loop streams
  // Q, dO. FlashAttention-2's sm80 choices. Above 128, a second Q stage would need 176 KB of
  // shared memory at d = 256, more than an A100 has (164 KB), so Q is single-buffered there.
  // d = 96 spreads the dQ warps 4 x 2 so that the dQ MMA's 32-column extent divides 96.
  return head_dim <= 64    ? BwdTile{128, 128, 8, 4, 4, 4, 2, false}
         : head_dim <= 96  ? BwdTile{64, 128, 8, 2, 4, 4, 2, true}
         : head_dim <= 128 ? BwdTile{64, 128, 8, 2, 4, 2, 2, true}
                           : BwdTile{64, 64, 8, 4, 2, 2, 1, false};
}

// The plain backward (PlainScores, no deterministic order) on GPUs with the shared memory for it
// (the launcher asks): two Q stages at every head dim, FlashAttention-2's choice on an H100
// (176 KB at d = 256). d = 256 measured 0.93-1.03x FA2 against 0.89-0.96x with one stage (H200,
// bf16, 1k-16k, PERFLOG.md entry 94); an A100 runs bwd_tile's single stage.
constexpr BwdTile bwd_plain_tile(int head_dim) {
  BwdTile tile = bwd_tile(head_dim);
  tile.q_stages = 2;
  return tile;
}

}  // namespace cutlass_flash::sm80
