// Host launcher of the sm80 forward kernel for one head dim and element type.
#pragma once

#include <type_traits>

#include "kernels/common/tile_order.h"
#include "kernels/common/varlen_tiles.h"
#include "kernels/sm80/fwd_kernel.h"
#include "kernels/sm80/fwd_traits.h"
#include "kernels/sm80/launch.h"
#include "kernels/common/launch_utils.h"
#include "kernels/sm80/tile_config.h"

namespace cutlass_flash::sm80 {

template <typename Traits, typename Features, typename Scheduler>
Status launch_fwd(const FwdParams& params, const GridTileParams& sched, cudaStream_t stream) {
  constexpr auto kernel = fwd_kernel<FwdMainloop<Traits, Features>, FwdEpilogue<Traits>, Scheduler>;
  if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
  const AttnProblem& p = params.problem;
  const dim3 grid = Scheduler::grid(sched, ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(params, sched);
  return cuda_status(cudaGetLastError(), "sm80 forward launch");
}

// The plain dense forward: on StagedTraits (two K/V buffers, fwd_plain_tile) where as many of its
// blocks stay resident per SM as of Traits' (one buffer), else on Traits.
template <typename StagedTraits, typename Traits>
Status launch_fwd_plain(const FwdParams& params, cudaStream_t stream) {
  if constexpr (!std::is_same_v<StagedTraits, Traits>) {
    constexpr auto staged =
        fwd_kernel<FwdMainloop<StagedTraits, PlainScores>, FwdEpilogue<StagedTraits>, DenseGridTileMap>;
    constexpr auto single = fwd_kernel<FwdMainloop<Traits, PlainScores>, FwdEpilogue<Traits>, DenseGridTileMap>;
    int limit = 0, staged_blocks = 0, single_blocks = 0;
    if (Status s = smem_per_block_optin(limit); !s.ok()) return s;
    if (StagedTraits::kSmemBytes <= limit) {
      Status s = ensure_smem_limit<staged>(StagedTraits::kSmemBytes);
      if (s.ok()) s = ensure_smem_limit<single>(Traits::kSmemBytes);
      if (s.ok()) s = resident_blocks<staged>(StagedTraits::kNThreads, StagedTraits::kSmemBytes, staged_blocks);
      if (s.ok()) s = resident_blocks<single>(Traits::kNThreads, Traits::kSmemBytes, single_blocks);
      if (!s.ok()) return s;
      if (staged_blocks >= single_blocks)
        return launch_fwd<StagedTraits, PlainScores, DenseGridTileMap>(params, {}, stream);
    }
  }
  return launch_fwd<Traits, PlainScores, DenseGridTileMap>(params, {}, stream);
}

// Three instantiations (four up to d = 128): the calls without score features or a packed batch
// run one with those compiled out (PlainScores, DenseGridTileMap: the runtime switches
// cost those calls up to a third, PERFLOG.md entry 93), on two K/V buffers where the device allows
// (launch_fwd_plain); tensors narrower than the tile (head_dim_real) one with all of them that
// predicates by column (FwdTraits::kNarrow); every other call the one with all of them.
template <int kHeadDim, typename Element>
Status run_fwd(const FwdParams& params, cudaStream_t stream) {
  constexpr FwdTile kTile = fwd_tile(kHeadDim);
  using Traits = FwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.warps, Element>;
  using NarrowTraits = FwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.warps, Element, /*kNarrow=*/true>;
  if (Status s = check_smem_fits(Traits::kSmemBytes, "sm80 forward"); !s.ok()) return s;
  const AttnProblem& p = params.problem;
  const bool narrow = p.cols() != kHeadDim;
  if (!narrow && !p.is_varlen() && PlainScores::covers(p)) {
    constexpr FwdTile kPlain = fwd_plain_tile(kHeadDim);
    using PlainTraits = FwdTraits<kHeadDim, kPlain.block_m, kPlain.block_n, kPlain.warps, Element>;
    using StagedTraits =
        FwdTraits<kHeadDim, kPlain.block_m, kPlain.block_n, kPlain.warps, Element, /*kNarrow=*/false, kPlain.kv_stages>;
    if (Status s = check_smem_fits(PlainTraits::kSmemBytes, "sm80 forward"); !s.ok()) return s;
    return launch_fwd_plain<StagedTraits, PlainTraits>(params, stream);
  }
  // A packed batch: its query blocks are listed first (common/varlen_tiles.h), one block each.
  GridTileMap::Params sched;
  if (p.is_varlen()) {
    sched.tiles = VarlenTiles::at_storage(params.workspace, p, kTile.block_m, /*keys=*/false);
    VarlenTilesArgs args = fwd_varlen_args(params);
    args.lists[0] = sched.tiles;
    args.num_lists = 1;
    if (Status s = cuda_status(launch_varlen_tiles(args, stream), "sm80 forward: packed batch tile list"); !s.ok())
      return s;
  }
  return narrow ? launch_fwd<NarrowTraits, AllScoreFeatures, GridTileMap>(params, sched, stream)
                : launch_fwd<Traits, AllScoreFeatures, GridTileMap>(params, sched, stream);
}

}  // namespace cutlass_flash::sm80
