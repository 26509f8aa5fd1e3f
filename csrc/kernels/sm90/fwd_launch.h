// Host launcher of the sm90 forward kernel: builds the TMA descriptors from the caller's pointers
// and strides and launches one persistent block per SM (fewer when there are fewer tiles).
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/common/launch_utils.h"
#include "kernels/common/tile_scheduler.h"
#include "kernels/sm90/fwd_kernel.h"
#include "kernels/sm90/fwd_traits.h"
#include "kernels/sm90/launch.h"
#include "kernels/sm90/tile_config.h"

namespace cutlass_flash::sm90 {

// TMA reads and writes global memory in 16-byte units: the base address and every stride but
// the innermost must be multiples of 16 bytes (the Python layer already requires this).
template <typename Element>
Status check_tma_ref(const TensorRef4& t, const char* name) {
  constexpr int64_t kAlign = 16 / int64_t(sizeof(Element));
  const bool ok = reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && t.batch_stride % kAlign == 0 &&
                  t.row_stride % kAlign == 0 && t.head_stride % kAlign == 0;
  if (ok) return Status::Ok();
  return {Status::kInvalidArgument, std::string("sm90 forward: ") + name +
                                        " must be 16-byte aligned with strides that are multiples of 16 bytes"};
}

template <typename Element>
auto gmem_tensor(const TensorRef4& t, int seqlen, const AttnProblem& p, int nheads) {
  using namespace cute;
  return make_tensor(make_gmem_ptr(static_cast<Element*>(t.ptr)),
                     make_layout(make_shape(int32_t(seqlen), int32_t(p.head_dim), int32_t(nheads), int32_t(p.batch)),
                                 make_stride(t.row_stride, _1{}, t.head_stride, t.batch_stride)));
}

// Launches the forward kernel of one configuration (FwdTraits); run_fwd picks the configuration of
// a head dim, and benchmarks/tune_sm90.cu times others.
template <typename Traits>
Status run_fwd_traits(const FwdParams& params, cudaStream_t stream) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const AttnProblem& p = params.problem;
  for (auto [ref, name] : {std::pair{&params.q, "q"}, {&params.k, "k"}, {&params.v, "v"}, {&params.o, "out"}})
    if (Status s = check_tma_ref<Element>(*ref, name); !s.ok()) return s;

  FwdKernelParams<Traits> kp{};
  kp.problem = p;
  kp.o = params.o;
  kp.lse = params.lse;
  kp.num_m_blocks = ceil_div(p.seqlen_q, kBlockM);
  auto q = gmem_tensor<const Element>(params.q, p.seqlen_q, p, p.nheads);
  auto k = gmem_tensor<const Element>(params.k, p.seqlen_k, p, p.nheads_kv);
  auto v = gmem_tensor<const Element>(params.v, p.seqlen_k, p, p.nheads_kv);
  auto o = gmem_tensor<Element>(params.o, p.seqlen_q, p, p.nheads);
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, typename Traits::SmemLayoutSlab{}, Shape<_64, Int<kHeadDim>>{}, _1{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Traits::SmemLayoutK{}),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Traits::SmemLayoutV{}),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  kp.tma_o = make_tma_copy(SM90_TMA_STORE{}, o, typename Traits::SmemLayoutSlab{}, Shape<_64, Int<kHeadDim>>{}, _1{});

  int num_sms = 0;
  if (Status s = multiprocessor_count(num_sms); !s.ok()) return s;
  const PersistentTileScheduler scheduler(kp.num_m_blocks, p.nheads, p.batch, /*longest_first=*/p.window_right >= 0);
  const int grid = PersistentTileScheduler::grid_size(scheduler.num_tiles, num_sms);
  constexpr auto kernel = fwd_kernel<Traits>;
  if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(kp);
  return cuda_status(cudaGetLastError(), "sm90 forward launch");
}

template <int kHeadDim, typename Element>
Status run_fwd(const FwdParams& params, cudaStream_t stream) {
  constexpr FwdTile kTile = fwd_tile(kHeadDim);
  using PSource = std::conditional_t<kTile.p_in_smem, PFromSmem, PFromRegisters>;
  return run_fwd_traits<FwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.stages, Element, PSource>>(params,
                                                                                                        stream);
}

}  // namespace cutlass_flash::sm90
