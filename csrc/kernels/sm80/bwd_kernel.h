// sm80 backward kernels: preprocess (D = rowsum(dO * O), zeroed dQ scratch), the main kernel (one
// thread block per (key block, head, batch)) and the dQ conversion (fp32 scratch -> dq).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include <cmath>

#include "cutlass_flash/params.h"
#include "kernels/common/block_info.h"
#include "kernels/common/mask.h"
#include "kernels/common/tile_scheduler.h"
#include "kernels/sm80/bwd_epilogue.h"
#include "kernels/sm80/bwd_mainloop.h"
#include "kernels/sm80/workspace.h"

namespace cutlass_flash::sm80 {

using namespace cute;

// Row kernels (preprocess, dQ conversion): one warp per row, 8 elements (16 bytes) per lane.
constexpr int kRowKernelWarps = 8;
constexpr int kRowKernelRowsPerBlock = 64;

template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(kRowKernelWarps * 32) bwd_preprocess_kernel(const __grid_constant__ BwdParams params) {
  const AttnProblem& p = params.problem;
  const BwdWorkspace ws = bwd_workspace_layout(p);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int64_t bh_row = (int64_t(batch) * p.nheads + head) * ws.seqlen_q_rounded;
  float* dq_accum = reinterpret_cast<float*>(static_cast<char*>(params.workspace) + ws.dq_accum_offset);
  float* dpsum = reinterpret_cast<float*>(static_cast<char*>(params.workspace) + ws.dpsum_offset);
  const Element* o = BlockInfo::slice<const Element>(params.o, batch, head);
  const Element* dout = BlockInfo::slice<const Element>(params.dout, batch, head);
  for (int r = warp; r < kRowKernelRowsPerBlock; r += kRowKernelWarps) {
    const int row = blockIdx.x * kRowKernelRowsPerBlock + r;
    // dQ tiles are stored thread-major, so every row of every tile is zeroed, past seqlen_q too.
    float4* dq_row = reinterpret_cast<float4*>(dq_accum + (bh_row + row) * kHeadDim);
    for (int c = lane; c < kHeadDim / 4; c += 32) dq_row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
    if (row >= p.seqlen_q) continue;
    float acc = 0.f;
    for (int c = lane * 8; c < kHeadDim; c += 32 * 8) {
      const uint4 ov = *reinterpret_cast<const uint4*>(o + row * params.o.row_stride + c);
      const uint4 dv = *reinterpret_cast<const uint4*>(dout + row * params.dout.row_stride + c);
      const Element* oe = reinterpret_cast<const Element*>(&ov);
      const Element* de = reinterpret_cast<const Element*>(&dv);
      CUTE_UNROLL
      for (int i = 0; i < 8; ++i) acc += float(oe[i]) * float(de[i]);
    }
    acc += __shfl_xor_sync(0xffffffff, acc, 16);
    acc += __shfl_xor_sync(0xffffffff, acc, 8);
    acc += __shfl_xor_sync(0xffffffff, acc, 4);
    acc += __shfl_xor_sync(0xffffffff, acc, 2);
    acc += __shfl_xor_sync(0xffffffff, acc, 1);
    if (lane == 0) dpsum[bh_row + row] = acc;
  }
}

// dq = softmax_scale * dQ scratch, one thread block per query tile, each thread reading back the
// accumulators it would have held in the main kernel's dQ MMA (coalesced) and writing them at
// their (row, col).
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads) bwd_convert_dq_kernel(const __grid_constant__ BwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;
  const AttnProblem& p = params.problem;
  const BwdWorkspace ws = bwd_workspace_layout(p);
  const int tid = threadIdx.x, m_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  const int64_t bh_row = (int64_t(batch) * p.nheads + head) * ws.seqlen_q_rounded;
  const float* dq_tile = reinterpret_cast<const float*>(static_cast<const char*>(params.workspace) +
                                                        ws.dq_accum_offset) +
                         bh_row * kHeadDim + m_block * (kBlockM * kHeadDim);
  typename Traits::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) = dq_tile[dq_accum_index<Traits>(i, tid)] * p.softmax_scale;
  Tensor rdq = convert_type<Element>(acc_dq);
  Tensor mdq = make_tensor(make_gmem_ptr(BlockInfo::slice<Element>(params.dq, batch, head)),
                           make_shape(p.seqlen_q, Int<kHeadDim>{}), make_stride(params.dq.row_stride, _1{}));
  Tensor tdq = thr_dq.partition_C(local_tile(mdq, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0)));
  Tensor tcoord = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const int rows_left = p.seqlen_q - m_block * kBlockM;
  CUTE_UNROLL
  for (int i = 0; i < size(rdq); ++i) {
    if (get<0>(tcoord(i)) < rows_left) tdq(i) = rdq(i);
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1) bwd_kernel(const __grid_constant__ BwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  extern __shared__ __align__(128) char smem[];

  const AttnProblem& p = params.problem;
  // Key blocks near the start are seen by the most query rows under a causal mask: natural order
  // already starts the longest blocks first.
  const TileCoord tile = GridTileScheduler::get(/*longest_first=*/false);
  const int n_block = tile.block, head = tile.head, batch = tile.batch;
  const int head_kv = head / (p.nheads / p.nheads_kv);
  const WindowMask mask(p.seqlen_q, p.seqlen_k, p.window_left, p.window_right);
  int m_min, m_max;
  mask.m_block_range<kBlockM, kBlockN>(n_block, m_min, m_max);

  auto rows_tensor = [](Element* ptr, int rows, int64_t row_stride) {
    return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kHeadDim>{}), make_stride(row_stride, _1{}));
  };
  using QTile = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using KTile = Shape<Int<kBlockN>, Int<kHeadDim>>;
  Tensor gQ = local_tile(rows_tensor(BlockInfo::slice<Element>(params.q, batch, head), p.seqlen_q, params.q.row_stride),
                         QTile{}, make_coord(_, 0));
  Tensor gdO = local_tile(rows_tensor(BlockInfo::slice<Element>(params.dout, batch, head), p.seqlen_q,
                                      params.dout.row_stride), QTile{}, make_coord(_, 0));
  Tensor gK = local_tile(rows_tensor(BlockInfo::slice<Element>(params.k, batch, head_kv), p.seqlen_k,
                                     params.k.row_stride), KTile{}, make_coord(n_block, 0));
  Tensor gV = local_tile(rows_tensor(BlockInfo::slice<Element>(params.v, batch, head_kv), p.seqlen_k,
                                     params.v.row_stride), KTile{}, make_coord(n_block, 0));
  Tensor gdK = local_tile(rows_tensor(BlockInfo::slice<Element>(params.dk, batch, head), p.seqlen_k,
                                      params.dk.row_stride), KTile{}, make_coord(n_block, 0));
  Tensor gdV = local_tile(rows_tensor(BlockInfo::slice<Element>(params.dv, batch, head), p.seqlen_k,
                                      params.dv.row_stride), KTile{}, make_coord(n_block, 0));

  const BwdWorkspace ws = bwd_workspace_layout(p);
  const int64_t bh_row = (int64_t(batch) * p.nheads + head) * ws.seqlen_q_rounded;
  char* workspace = static_cast<char*>(params.workspace);
  float* dq_accum = reinterpret_cast<float*>(workspace + ws.dq_accum_offset) + bh_row * kHeadDim;
  const float* dpsum = reinterpret_cast<const float*>(workspace + ws.dpsum_offset) + bh_row;
  const float* lse = params.lse + (int64_t(batch) * p.nheads + head) * p.seqlen_q;

  Tensor acc_dk = partition_fragment_C(typename Traits::TiledMmadKV{}, KTile{});
  Tensor acc_dv = partition_fragment_C(typename Traits::TiledMmadKV{}, KTile{});
  clear(acc_dk);
  clear(acc_dv);
  if (m_min < m_max) {
    BwdMainloop<Traits>::run(gQ, gdO, gK, gV, dq_accum, lse, dpsum, smem, mask, n_block, m_min, m_max,
                             p.softmax_scale * float(M_LOG2E), acc_dk, acc_dv);
  }
  BwdEpilogue<Traits>::store(acc_dk, acc_dv, gdK, gdV, p.softmax_scale, smem, p.seqlen_k - n_block * kBlockN);
}

}  // namespace cutlass_flash::sm80
