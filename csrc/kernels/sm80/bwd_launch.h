// Host launcher of the sm80 backward for one head dim and element type: preprocess, main kernel,
// dQ conversion, all on the caller's stream.
#pragma once

#include <type_traits>

#include "kernels/common/bwd_preprocess.h"
#include "kernels/common/tile_order.h"
#include "kernels/common/varlen_tiles.h"
#include "kernels/sm80/bwd_kernel.h"
#include "kernels/sm80/bwd_traits.h"
#include "kernels/sm80/launch.h"
#include "kernels/common/launch_utils.h"
#include "kernels/sm80/tile_config.h"

namespace cutlass_flash::sm80 {

// The main kernel over n_blocks key blocks of each (head, batch), or over a packed batch's list
// (sched.tiles).
template <typename Traits, typename Features, typename Scheduler, bool kOrderedDq = true>
Status launch_bwd_main(const BwdParams& params, const GridTileParams& sched, int n_blocks, cudaStream_t stream) {
  constexpr auto kernel = bwd_kernel<BwdMainloop<Traits, Features, kOrderedDq>, BwdEpilogue<Traits>, Scheduler>;
  if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
  const AttnProblem& p = params.problem;
  const dim3 grid = Scheduler::grid(sched, n_blocks, p.nheads_kv, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(params, sched);
  return cuda_status(cudaGetLastError(), "sm80 backward launch");
}

// The plain dense backward: on PlainTraits (bwd_plain_tile) where the device's shared memory
// allows, else on Traits.
template <typename PlainTraits, typename Traits>
Status launch_bwd_plain(const BwdParams& params, int n_blocks, cudaStream_t stream) {
  if constexpr (!std::is_same_v<PlainTraits, Traits>) {
    int limit = 0;
    if (Status s = smem_per_block_optin(limit); !s.ok()) return s;
    if (PlainTraits::kSmemBytes <= limit)
      return launch_bwd_main<PlainTraits, PlainScores, DenseGridTileMap, /*kOrderedDq=*/false>(params, {}, n_blocks,
                                                                                               stream);
  }
  return launch_bwd_main<Traits, PlainScores, DenseGridTileMap, /*kOrderedDq=*/false>(params, {}, n_blocks, stream);
}

template <int kHeadDim, typename Element>
Status run_bwd(const BwdParams& params, cudaStream_t stream) {
  constexpr BwdTile kTile = bwd_tile(kHeadDim);
  using Traits = BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.warps, kTile.atom_m_sdp, kTile.atom_n_dkv,
                           kTile.atom_m_dq, kTile.q_stages, Element, kTile.late_offsets>;
  using NarrowTraits = BwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.warps, kTile.atom_m_sdp,
                                 kTile.atom_n_dkv, kTile.atom_m_dq, kTile.q_stages, Element, kTile.late_offsets,
                                 /*kNarrow=*/true>;
  constexpr BwdTile kPlain = bwd_plain_tile(kHeadDim);
  using PlainTraits = BwdTraits<kHeadDim, kPlain.block_m, kPlain.block_n, kPlain.warps, kPlain.atom_m_sdp,
                                kPlain.atom_n_dkv, kPlain.atom_m_dq, kPlain.q_stages, Element, kPlain.late_offsets>;
  const AttnProblem& p = params.problem;
  if (Status s = check_smem_fits(Traits::kSmemBytes, "sm80 backward"); !s.ok()) return s;
  // A packed batch: its query rows (preprocess, dQ conversion) and key blocks (main kernel) are
  // listed first, so that every grid covers the real tiles (common/varlen_tiles.h).
  VarlenTiles rows;
  GridTileMap::Params sched;
  if (p.is_varlen()) {
    if (Status s =
            launch_bwd_varlen_prep(params, kFamilyArch, kTile.block_n, stream, rows, sched.tiles, "sm80 backward");
        !s.ok())
      return s;
  }
  const dim3 pre_grid = BwdPreprocess::grid(params, kFamilyArch, rows);
  if (p.is_varlen())
    bwd_preprocess_kernel<kFamilyArch, kHeadDim, Element, true>
        <<<pre_grid, BwdPreprocess::kWarps * 32, 0, stream>>>(params, rows);
  else
    bwd_preprocess_kernel<kFamilyArch, kHeadDim, Element, false>
        <<<pre_grid, BwdPreprocess::kWarps * 32, 0, stream>>>(params, rows);
  if (Status s = cuda_status(cudaGetLastError(), "sm80 backward preprocess launch"); !s.ok()) return s;

  // Four instantiations (five at d > 128): dense calls run kernels without the packed path
  // (DenseGridTileMap: register spills), and those without score features or
  // deterministic mode one with them compiled out too (PlainScores: the switches cost those calls
  // up to a tenth, PERFLOG.md entry 93; BwdDqOrder<false>), with two Q stages where shared memory
  // allows (launch_bwd_plain); tensors narrower than the tile (head_dim_real), dense or packed, one
  // that predicates by column (BwdTraits::kNarrow).
  const int n_blocks = ceil_div(p.seqlen_k, kTile.block_n);
  const Status s = p.cols() != kHeadDim
                       ? launch_bwd_main<NarrowTraits, AllScoreFeatures, GridTileMap>(params, sched, n_blocks, stream)
                   : p.is_varlen()
                       ? launch_bwd_main<Traits, AllScoreFeatures, GridTileMap>(params, sched, n_blocks, stream)
                   : PlainScores::covers(p) && !params.deterministic
                       ? launch_bwd_plain<PlainTraits, Traits>(params, n_blocks, stream)
                       : launch_bwd_main<Traits, AllScoreFeatures, DenseGridTileMap>(params, {}, n_blocks, stream);
  if (!s.ok()) return s;

  static_assert(kBwdRowAlign % kTile.block_m == 0, "dQ conversion blocks split the packed row tiles");
  const dim3 q_grid = rows.count != nullptr
                          ? dim3(unsigned(rows.capacity * (kBwdRowAlign / kTile.block_m)), p.nheads, 1)
                          : dim3(ceil_div(p.seqlen_q, kTile.block_m), p.nheads, p.batch);
  if (p.is_varlen())
    bwd_convert_dq_kernel<Traits, true><<<q_grid, Traits::kNThreads, 0, stream>>>(params, rows);
  else
    bwd_convert_dq_kernel<Traits, false><<<q_grid, Traits::kNThreads, 0, stream>>>(params, rows);
  return cuda_status(cudaGetLastError(), "sm80 backward dQ conversion launch");
}

}  // namespace cutlass_flash::sm80
