// Host launcher of the sm80 backward for one head dim and element type: preprocess, main kernel,
// dQ conversion, all on the caller's stream.
#pragma once

#include "kernels/common/bwd_preprocess.h"
#include "kernels/common/tile_scheduler.h"
#include "kernels/sm80/bwd_kernel.h"
#include "kernels/sm80/bwd_traits.h"
#include "kernels/sm80/launch.h"
#include "kernels/common/launch_utils.h"
#include "kernels/sm80/tile_config.h"

namespace cutlass_flash::sm80 {

template <int kHeadDim, typename Element>
Status run_bwd(const BwdParams& params, cudaStream_t stream) {
  constexpr BwdTile kTile = bwd_tile(kHeadDim);
  using Traits = BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.warps, kTile.atom_m_sdp, kTile.atom_n_dkv,
                           kTile.atom_m_dq, kTile.q_stages, Element, kTile.late_offsets>;
  const AttnProblem& p = params.problem;
  bwd_preprocess_kernel<kFamilyArch, kHeadDim, Element><<<BwdPreprocess::grid(params, kFamilyArch), BwdPreprocess::kWarps * 32, 0, stream>>>(params);
  if (Status s = cuda_status(cudaGetLastError(), "sm80 backward preprocess launch"); !s.ok()) return s;

  constexpr auto kernel = bwd_kernel<BwdMainloop<Traits>, BwdEpilogue<Traits>, GridTileScheduler>;
  if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
  const dim3 grid = GridTileScheduler::grid(ceil_div(p.seqlen_k, kTile.block_n), p.nheads_kv, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(params);
  if (Status s = cuda_status(cudaGetLastError(), "sm80 backward launch"); !s.ok()) return s;

  const dim3 q_grid(ceil_div(p.seqlen_q, kTile.block_m), p.nheads, p.batch);
  bwd_convert_dq_kernel<Traits><<<q_grid, Traits::kNThreads, 0, stream>>>(params);
  return cuda_status(cudaGetLastError(), "sm80 backward dQ conversion launch");
}

}  // namespace cutlass_flash::sm80
