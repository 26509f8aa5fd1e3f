// wgmma helpers: issuing a GEMM as one batch, and views of the accumulator registers; the TMA
// coordinates of one sequence.
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "cutlass_flash/params.h"
#include "kernels/common/block_info.h"
#include "kernels/common/convert.h"
#include "kernels/common/tile_store.h"

namespace cutlass_flash::sm90 {

// threadIdx.x, read where it is used: the compiler can neither hoist what derives from it out of a
// loop nor keep it live across one. The forward's epilogue (its barrier id and shared-memory
// addresses, derived from the warpgroup index before the tile loop, spilled at d = 256: PERFLOG 65).
__device__ __forceinline__ int opaque_thread_idx() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

using namespace cute;

// L2 eviction priorities of TMA loads and bulk reduce-adds, as FlashAttention-3 gives them: data
// that other blocks read again soon (the forward's K and V, read by every query tile of a head;
// the backward's Q and dO, read by every key block; the dQ accumulator, added to by every key
// block) is kept over data read once (the forward's Q). Measured against none on an H100: within
// the runs' spread (medians +0.4% forward, +1.1% backward, PERFLOG.md entry 85), so the lower L2
// hit rate of entry 78 (77.6% against FA3's 89.6%) is not what the d = 128 forward waits on.
static __device__ constexpr TMA::CacheHintSm90 kEvictFirst = TMA::CacheHintSm90::EVICT_FIRST;
static __device__ constexpr TMA::CacheHintSm90 kEvictLast = TMA::CacheHintSm90::EVICT_LAST;

// The wgmma N extents CuTe's GMMA op selectors offer without CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
// (cute/arch/mma_sm90.hpp). Any other N (80, 48, ...) needs that macro, whose 76k lines of atoms
// cost about 23 s of nvcc per translation unit (14.6 s in cudafe++, 7.8 s in cicc, measured on a
// file that only includes cute/tensor.hpp), so the generator defines it only in the translation
// units whose tiles need it (csrc/generate.py: Family.extended_gmma) and each of them checks its
// entry against the traits' kExtendedGmma.
constexpr bool standard_gmma_n(int n) {
  return n == 8 || n == 16 || n == 32 || n == 64 || n == 96 || n == 128 || n == 192 || n == 256;
}

// C (+)= A * B as one wgmma batch over the K slices. kWait >= 0 waits until at most kWait batches
// are in flight; -1 returns at once, leaving the GEMM running behind the caller's next work.
// A is a shared-memory descriptor tensor or registers (then fenced, as wgmma reads them late).
template <bool kZeroInit, int kWait, typename TiledMma, typename TensorA, typename TensorB, typename TensorC>
__device__ __forceinline__ void gemm(TiledMma& mma, const TensorA& a, const TensorB& b, TensorC& c) {
  constexpr bool kAInRegisters = !is_same_v<typename TensorA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(c);
  if constexpr (kAInRegisters) warpgroup_fence_operand(const_cast<TensorA&>(a));
}

// warpgroup_wait<0>() that stays below the computation of `gate`. ptxas schedules a wgmma wait at
// the top of its basic block, whatever the order in the source (PERFLOG.md, entries 10 and 13):
// after the softmax it would retire P V before the exponentials instead of behind them. A copy of
// the wait predicated on `gate != -1` becomes a branch that needs `gate`, so the block, and the
// plain wait after it, start below the computation of `gate`. Correctness rests on the plain wait
// alone. `gate` is a sum of softmax row sums (>= 0, or NaN/inf), never -1, so every thread takes
// the predicated wait and the warp stays converged, as `.aligned` requires.
__device__ __forceinline__ void warpgroup_wait_all_after(float gate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.neu.f32 p, %0, 0fBF800000;\n"
      "@p wgmma.wait_group.sync.aligned 0;\n"
      "}\n" ::"f"(gate)
      : "memory");
  warpgroup_wait<0>();
}

// wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) -> (rows, cols) = ((2, MMA_M), (2, N/8, MMA_N)).
// Per 64-row atom a thread holds rows r and r + 8 (mode 0,1) and column pairs (mode 0,0) of
// every 8-column group, so a row is spread over the 4 threads of a quad, as on sm80.
template <typename Layout>
__device__ __forceinline__ auto acc_rowcol_layout(Layout l) {
  static_assert(decltype(rank<0>(l))::value == 3 && decltype(rank(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

template <typename Tensor>
__device__ __forceinline__ auto rowcol_view(Tensor&& t) {
  return make_tensor(t.data(), acc_rowcol_layout(t.layout()));
}

// The transpose of acc_rowcol_layout: (cols, rows) of the accumulator. The backward computes
// S^T (keys as wgmma rows) and reads it per query, the accumulator's columns.
template <typename Layout>
__device__ __forceinline__ auto acc_colrow_layout(Layout l) {
  auto rc = acc_rowcol_layout(l);
  return make_layout(get<1>(rc), get<0>(rc));
}

template <typename Tensor>
__device__ __forceinline__ auto colrow_view(Tensor&& t) {
  return make_tensor(t.data(), acc_colrow_layout(t.layout()));
}

// The S accumulator, converted to 16-bit, re-read as the register A operand of O += P V: pairs of
// 8-column groups make one k16 slice ((2, 2, 2), MMA_M, N/16).
template <typename Layout>
__device__ __forceinline__ auto acc_as_a_layout(Layout l) {
  static_assert(decltype(size<0, 0>(l))::value == 2 && decltype(size<0, 1>(l))::value == 2);
  auto v = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(v)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(v), get<2>(l))));
}

// Bulk asynchronous copies of contiguous bytes (no tensor map): global -> shared, completing on an
// mbarrier's transaction count, and shared -> global as an fp32 reduce-add performed in L2.
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint64_t& mbarrier) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   cast_smem_ptr_to_uint(smem)),
               "l"(gmem), "r"(bytes), "r"(cast_smem_ptr_to_uint(&mbarrier))
               : "memory");
}

__device__ __forceinline__ void bulk_reduce_add(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.L2::cache_hint.add.f32 [%0], [%1], %2, %3;" ::"l"(gmem),
      "r"(cast_smem_ptr_to_uint(smem)), "r"(bytes), "l"(uint64_t(kEvictLast))
      : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Waits until the bulk groups committed so far have read their shared memory (kRead) or have
// completed, their writes performed.
template <bool kRead>
__device__ __forceinline__ void bulk_wait_all() {
  if constexpr (kRead) {
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  } else {
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

// dst[0..3] += v in L2, no value returned (REDG.E.ADD.F32x4). atomicAdd(float4*) compiles to
// ATOMG, which returns the old values: at d = 256 the split-d backward's warps spent 48% of their
// stall cycles on the L1TEX scoreboard behind those returns, and L2 ran at 93% of its peak
// (ncu, PERFLOG.md entry 23).
__device__ __forceinline__ void red_add(float4* dst, float4 v) {
  asm volatile("red.global.add.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dst), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w), "l"(uint64_t(kEvictLast))
               : "memory");
}

// Orders the async proxy's global accesses (bulk reduce-adds) against the generic proxy's.
__device__ __forceinline__ void fence_proxy_async_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// The columns in memory of a tensor whose tile is kWidth wide in a kernel of head dim kHeadDim:
// the problem's (AttnProblem::cols) at kHeadDim, else exactly kWidth (V, O, dO and dV of a kernel
// with a head dim of V of its own; the host API refuses head_dim_real beside head_dim_v).
template <int kHeadDim, int kWidth>
__device__ __forceinline__ int cols_in_memory(const AttnProblem& p) {
  return kWidth == kHeadDim ? p.cols() : kWidth;
}

// The TMA coordinate tensor of (sequence seq, head) of a query-side (kQuery) or key-side tensor
// as (rows, d): the descriptor's (seqlen, d, head, batch), or for a variable-length batch its
// (total, d, head, 1) from the sequence's first row (tma_plan.h, gmem_tensor). Loads past the
// sequence read the next one's rows, which the mask and the per-sequence lengths leave unused.
// cols: the tile's width where not p.head_dim (v and o at AttnProblem::head_dim_v).
template <bool kQuery, typename Tma>
__device__ __forceinline__ auto sequence_rows(const Tma& tma, const AttnProblem& p, const SeqInfo& seq, int head,
                                              int cols = 0) {
  const bool varlen = p.is_varlen();
  const int rows = varlen ? (kQuery ? p.total_q : p.total_k) : (kQuery ? p.seqlen_q : p.seqlen_k);
  Tensor m = tma.get_tma_tensor(
      make_shape(rows, cols > 0 ? cols : p.head_dim, kQuery ? p.nheads : p.nheads_kv, varlen ? 1 : p.batch));
  return domain_offset(make_coord(kQuery ? seq.q_start : seq.k_start, _0{}), m(_, _, head, varlen ? 0 : seq.batch));
}

// Zeroes rows [first_row, kRows) of a (kRows, kCols) K-major tile in shared memory (wgmma's
// layouts keep 8 consecutive columns in 16 contiguous bytes), in 16-byte stores shared by
// `threads` threads (this one: `t`), and orders them before wgmma's reads (fence.proxy.async); the
// caller syncs the threads before any of them multiplies the tile. A packed sequence's block that
// runs past its rows holds the next sequence's: its scores are masked, but 0 x NaN = NaN in the
// GEMMs that read those rows.
template <typename TensorS>
__device__ __forceinline__ void clear_smem_rows(TensorS&& s, int first_row, int t, int threads) {
  constexpr int kRows = decltype(size<0>(s))::value, kChunks = decltype(size<1>(s))::value / 8;
#pragma unroll 1
  for (int i = t; i < (kRows - first_row) * kChunks; i += threads)
    *reinterpret_cast<uint4*>(&s(first_row + i / kChunks, i % kChunks * 8)) = make_uint4(0, 0, 0, 0);
  cutlass::arch::fence_view_async_shared();
}

}  // namespace cutlass_flash::sm90
