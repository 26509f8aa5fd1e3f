// sm90 forward epilogue: O through shared memory and a TMA store, one 64-row slab per consumer
// warpgroup (so warpgroups never wait for each other), and the log-sum-exp from registers.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cute/arch/copy_sm90_tma.hpp>

#include <cmath>
#include <cstdint>

#include "cutlass_flash/params.h"
#include "kernels/common/block_info.h"
#include "kernels/common/tile_order.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/utils.h"

namespace cutlass_flash::sm90 {

using namespace cute;

template <typename Traits>
struct FwdEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM, kHeadDimV = Traits::kHeadDimV;  // O is (rows, kHeadDimV)

  // Where a tile's O is staged in V's stages (Traits::kOInV): V's stage `stage` (its first with
  // Traits::kOInOneStage), once the consumers' use of it with parity `released` is released.
  struct OSlot {
    int stage;
    uint32_t released;
  };

  __device__ __forceinline__ static Element* smem_o(typename Traits::SharedStorage& shared, int wg, int stage) {
    if constexpr (!Traits::kOInV) return shared.qo.data() + Traits::kQElems + wg * Traits::kSlabElemsO;
    const int stage_offset = Traits::kOInOneStage ? stage * (Traits::kVElems / Traits::kStages) : 0;
    return shared.v.data() + stage_offset + wg * Traits::kSlabElemsO;
  }

  // Writes warpgroup wg's rows of lse: each row's value sits in all 4 threads of its quad; the
  // first writes.
  template <typename Params, typename Lse>
  __device__ __forceinline__ static void store_lse(const Params& params, const TileCoord& tile, const Lse& lse, int wg,
                                                   int tid) {
    const AttnProblem& p = params.problem;
    typename Traits::TiledMmaPV mma_pv;
    Tensor tOcO =
        rowcol_view(mma_pv.get_thread_slice(tid).partition_C(make_identity_tensor(Shape<_64, Int<kHeadDimV>>{})));
    const SeqInfo seq(p, tile.batch);
    const int first_row = tile.block * kBlockM + wg * 64;
    const int rows_left = seq.seqlen_q - first_row;
    float* out = params.lse + seq.lse_row(p, tile.head) + first_row;
    if (tid % 4 == 0) {
      CUTE_UNROLL
      for (int mi = 0; mi < size(lse); ++mi) {
        const int row = get<0>(tOcO(mi, 0));
        if (row < rows_left) out[row] = lse(mi);
      }
    }
  }

  // Warpgroup wg's rows of the tile in out (its first), and how many of them the sequence has
  // (rows_left, 64 or more for a full slab).
  template <typename Params>
  __device__ __forceinline__ static Element* slab_rows(const Params& params, const TileCoord& tile, int wg,
                                                       int& rows_left) {
    const AttnProblem& p = params.problem;
    const SeqInfo seq(p, tile.batch);
    const int first_row = tile.block * kBlockM + wg * 64;
    rows_left = seq.seqlen_q - first_row;
    return seq.q_rows<Element>(p, params.o, tile.head) + int64_t(first_row) * params.o.row_stride;
  }

  // A variable-length sequence's last slab (fewer than 64 rows), from shared memory: the TMA unit
  // clips only at the packed tensor's end and would write the next sequence's first rows, so the
  // warpgroup copies the rows it owns in 16-byte stores. (Stored from the accumulators instead,
  // 2 bytes and 8 rows per warp instruction, every slab of a varlen batch cost the forward 4-14%:
  // PERFLOG 45.) Not unrolled: unrolled, the d = 64 kernel with the score policy's probability
  // stage (FwdTraits::kProbsKernel) spilled 312 B.
  template <typename Params>
  __device__ __forceinline__ static void store_partial_slab(const Params& params, const Element* slab,
                                                            const TileCoord& tile, int wg, int tid) {
    int rows_left;
    Element* o = slab_rows(params, tile, wg, rows_left);
    Tensor sO = make_tensor(make_smem_ptr(slab), typename Traits::SmemLayoutSlabO{});
    store_rows_16b<64, kHeadDimV, 128, /*kUnroll=*/false>(
        sO, 0, o, params.o.row_stride, rows_left, cols_in_memory<Traits::kHeadDim, kHeadDimV>(params.problem), tid);
  }

  // O = 0 of a tile whose rows see no key, straight to global memory: with O staged in V's stages
  // (Traits::kOInV) such a tile, which the K/V thread never waits for, may not write them.
  template <typename Params>
  __device__ __forceinline__ static void store_zero_slab(const Params& params, const TileCoord& tile, int wg, int tid) {
    int rows_left;
    Element* o = slab_rows(params, tile, wg, rows_left);
    zero_rows_16b<64, kHeadDimV, 128>(o, params.o.row_stride, rows_left,
                                      cols_in_memory<Traits::kHeadDim, kHeadDimV>(params.problem), tid);
  }

  // Whether warpgroup wg's slab of the tile is a variable-length sequence's last, partial one:
  // the TMA unit clips rows only at the packed tensor's end (dense: past seqlen_q), so the threads
  // copy it instead.
  template <typename Params>
  __device__ __forceinline__ static bool partial_slab(const Params& params, const TileCoord& tile, int wg) {
    const AttnProblem& p = params.problem;
    return p.is_varlen() && SeqInfo(p, tile.batch).seqlen_q - (tile.block * kBlockM + wg * 64) < 64;
  }

  // The TMA store of warpgroup wg's slab of the tile (not a partial one), by one thread.
  template <typename Params, typename SmemO>
  __device__ __forceinline__ static void store_slab(const Params& params, const SmemO& sO, const TileCoord& tile,
                                                    int wg) {
    const AttnProblem& p = params.problem;
    // O's tile width (a named copy: the lambda would odr-use the member); p.head_dim where V has
    // no head dim of its own, as in mainloop.h's load of V.
    const int cols = kHeadDimV == Traits::kHeadDim ? p.head_dim : kHeadDimV;
    auto store = [&](auto mO) {
      Tensor gO =
          local_tile(mO, Shape<_64, Int<kHeadDimV>>{}, make_coord(tile.block * Traits::kNMmaWarpGroups + wg, _0{}));
      auto [tOgO, tOsSlab] =
          tma_partition(params.tma_o, _0{}, Layout<_1>{}, group_modes<0, 2>(sO), group_modes<0, 2>(gO));
      copy(params.tma_o, tOsSlab, tOgO);
    };
    if (p.is_varlen())
      store(sequence_rows<true>(params.tma_o, p, SeqInfo(p, tile.batch), tile.head, cols));
    else
      store(params.tma_o.get_tma_tensor(make_shape(p.seqlen_q, cols, p.nheads, p.batch))(_, _, tile.head, tile.batch));
  }

  // With O in V's stages (Traits::kOInV), the K/V thread's part: the TMA stores of a tile the
  // consumers staged (o_full), waited for until they have read shared memory, before it loads
  // the next tile's V there. The consumers go on to their next tile without waiting for them.
  template <typename Params>
  __device__ __forceinline__ static void store_staged(const Params& params, typename Traits::SharedStorage& shared,
                                                      const TileCoord& tile, int stage) {
    CUTE_UNROLL
    for (int wg = 0; wg < Traits::kNMmaWarpGroups; ++wg) {
      if (!partial_slab(params, tile, wg))
        store_slab(params, make_tensor(make_smem_ptr(smem_o(shared, wg, stage)), typename Traits::SmemLayoutSlabO{}),
                   tile, wg);
    }
    tma_store_arrive();
    tma_store_wait<0>();
  }

  // acc_o: this thread's part of the normalised output of its warpgroup's 64 rows (fp32);
  // has_keys: whether the tile's rows see any key (else O = 0).
  template <typename Params, typename AccO, typename Lse>
  __device__ __forceinline__ static void store(const Params& params, typename Traits::SharedStorage& shared,
                                               const TileCoord& tile, const AccO& acc_o, const Lse& lse, bool has_keys,
                                               OSlot slot) {
    // The warpgroup and thread index read here, not passed in: what the store derives from them
    // (its shared-memory addresses, its barrier id) was otherwise hoisted out of the tile loop and
    // spilled across the mainloop at d = 256 (PERFLOG 65).
    const int wg = __shfl_sync(0xffffffff, opaque_thread_idx() / 128, 0) - 1, tid = opaque_thread_idx() % 128;
    const bool leader = tid == 0;
    const int barrier = int(FwdBarrier::kEpilogueWG1) + wg;
    typename Traits::TiledMmaPV mma_pv;
    auto copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
    auto thr_copy = copy_o.get_thread_slice(tid);
    Tensor sO = make_tensor(make_smem_ptr(smem_o(shared, wg, slot.stage)), typename Traits::SmemLayoutSlabO{});
    Tensor rO = convert_type<Element>(acc_o);
    Tensor tOrO = thr_copy.retile_S(rO);
    Tensor tOsO = thr_copy.partition_D(sO);
    const bool partial = partial_slab(params, tile, wg);

    if constexpr (Traits::kOInV) {
      if (!has_keys) {
        store_zero_slab(params, tile, wg, tid);
      } else {
        // No warpgroup reads the stages O goes to any more (with kOInOneStage: every consumer has
        // released the stage; else every warpgroup's last P V GEMM is done), and the K/V thread
        // loads no V there before it has stored this O.
        if constexpr (Traits::kOInOneStage)
          shared.pipeline_v.empty_barrier_[slot.stage].wait(slot.released);
        else
          cutlass::arch::NamedBarrier::sync(Traits::kNMmaThreads, int(FwdBarrier::kOInV));
        copy(copy_o, tOrO, tOsO);
        if (partial) {
          cutlass::arch::NamedBarrier::sync(128, barrier);
          store_partial_slab(params, smem_o(shared, wg, slot.stage), tile, wg, tid);
        } else {
          cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by TMA
        }
        shared.o_full.arrive();
      }
    } else {
      // The slab is free once this warpgroup's previous TMA store has read it.
      if (leader) tma_store_wait<0>();
      cutlass::arch::NamedBarrier::sync(128, barrier);
      copy(copy_o, tOrO, tOsO);
      if (!partial) {
        cutlass::arch::fence_view_async_shared();  // generic-proxy writes, read next by TMA
        cutlass::arch::NamedBarrier::sync(128, barrier);
        if (leader) {
          store_slab(params, sO, tile, wg);
          tma_store_arrive();
        }
      } else {
        cutlass::arch::NamedBarrier::sync(128, barrier);
        store_partial_slab(params, smem_o(shared, wg, 0), tile, wg, tid);
        // The next tile's stmatrix may overwrite the slab once every thread has read it.
        cutlass::arch::NamedBarrier::sync(128, barrier);
      }
    }
    store_lse(params, tile, lse, wg, tid);
  }

  // Shared memory must outlive the last TMA store's reads of it.
  __device__ __forceinline__ static void finish(int tid) {
    if (tid == 0) tma_store_wait<0>();
  }
};

}  // namespace cutlass_flash::sm90
