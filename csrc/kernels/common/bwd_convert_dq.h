// The backward's dQ conversion, shared by both families: dq = softmax_scale * the fp32 workspace,
// one block of kThreads per query tile. Each thread reads back the accumulators it held in its
// family's dQ MMA (Traits::TiledMmadQ) through `load` (the family's workspace order), converts
// them and puts them at their (row, col) of a padded shared tile, from which the block writes whole
// rows in 16-byte stores. Stored straight from the accumulator layout (2-byte stores, 8 rows per
// warp instruction) the conversion took 152-195 us at 16k tokens x 2048 on an H100 (sm90, 2.5x
// FlashAttention-3's postprocess, PERFLOG 45) and 126-135 us on an H200 (sm80, twice
// FlashAttention-2's 61-66 us, PERFLOG 95).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>
#include <type_traits>

#include "cutlass_flash/params.h"
#include "generated/bwd_workspace.h"
#include "kernels/common/block_info.h"
#include "kernels/common/convert.h"
#include "kernels/common/tile_order.h"
#include "kernels/common/tile_store.h"

namespace cutlass_flash {

// load(acc, tile, tid, add): the thread's accumulators of one dQ copy (`tile`: the query tile's
// fp32 rows), assigned (add: std::false_type) or added (std::true_type). kArch: the family whose
// workspace layout holds the tile (bwd_workspace_layout).
template <int kArch, typename Traits, int kThreads, bool kPacked, typename Load>
__device__ __forceinline__ void convert_dq(const BwdParams& params, const VarlenTiles& rows, Load load) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  // 16 bytes of padding per row: the accumulator layout's 8 rows per store instruction then fall
  // in different banks (row pitch kHeadDim * 2 + 16 bytes), and each row stays 16-byte aligned.
  constexpr int kPitch = kHeadDim + 16 / int(sizeof(Element));
  __shared__ alignas(16) Element smem[kBlockM * kPitch];
  const AttnProblem& p = params.problem;
  const BwdWorkspace ws = bwd_workspace_layout(p, params.deterministic, kArch);
  const int tid = threadIdx.x, head = blockIdx.y;
  int batch = blockIdx.z, m_block = blockIdx.x;
  if (kPacked && !rows.part(blockIdx.x, kBlockM, batch, m_block)) return;  // past a packed batch's rows
  const SeqInfo seq(p, batch);
  if (m_block * kBlockM >= seq.seqlen_q) return;  // past the sequence's rows
  const int64_t bh_row = seq.workspace_row(p, ws.rows_per_head, head);
  const float* tile = reinterpret_cast<const float*>(static_cast<const char*>(params.workspace) + ws.dq_accum_offset) +
                      (bh_row + int64_t(m_block) * kBlockM) * kHeadDim;
  typename Traits::TiledMmadQ mma_dq;
  auto thr = mma_dq.get_thread_slice(tid);
  Tensor acc = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  load(acc, tile, tid, std::false_type{});
  // Deterministic mode: the dQ groups' copies (BwdWorkspace::dq_group_row), summed in group order.
  for (int g = 1; g < ws.dq_groups; ++g) load(acc, tile + g * ws.rows * kHeadDim, tid, std::true_type{});
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) acc(i) *= p.softmax_scale;
  Tensor r = convert_type<Element>(acc);
  Tensor sdq = make_tensor(make_smem_ptr(smem), Shape<Int<kBlockM>, Int<kHeadDim>>{}, Stride<Int<kPitch>, _1>{});
  store_pairs(r, thr.partition_C(sdq));
  __syncthreads();
  Element* dq = seq.q_rows<Element>(p, params.dq, head) + int64_t(m_block) * kBlockM * params.dq.row_stride;
  store_rows_16b<kBlockM, kHeadDim, kThreads>(sdq, 0, dq, params.dq.row_stride, seq.seqlen_q - m_block * kBlockM,
                                              p.cols(), tid);
}

}  // namespace cutlass_flash
