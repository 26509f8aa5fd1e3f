// Host launcher of the sm90 forward kernel: builds the TMA descriptors from the caller's pointers
// and strides and launches one persistent block per SM (fewer when there are fewer tiles).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cute/tensor.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
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

// cuTensorMapReplaceAddress, resolved once through the runtime (the library links no libcuda, so
// that it loads on a machine without a driver); null if the driver lacks it.
inline PFN_cuTensorMapReplaceAddress_v12000 tensor_map_replace_address() {
  static const PFN_cuTensorMapReplaceAddress_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult query;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapReplaceAddress", &p, 12000, cudaEnableDefault, &query);
    return err == cudaSuccess && query == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapReplaceAddress_v12000>(p) : nullptr;
  }();
  return fn;
}

template <typename Tma>
bool replace_address(Tma& tma, const void* ptr) {
  auto* desc = reinterpret_cast<CUtensorMap*>(const_cast<cute::TmaDescriptor*>(tma.get_tma_descriptor()));
  return tensor_map_replace_address()(desc, const_cast<void*>(ptr)) == CUDA_SUCCESS;
}

// What the TMA descriptors depend on besides the base addresses.
struct FwdPlanKey {
  AttnProblem problem;
  int64_t strides[4][3];

  FwdPlanKey(const FwdParams& p) : problem(p.problem) {
    const TensorRef4* refs[4] = {&p.q, &p.k, &p.v, &p.o};
    for (int i = 0; i < 4; ++i) {
      strides[i][0] = refs[i]->batch_stride;
      strides[i][1] = refs[i]->row_stride;
      strides[i][2] = refs[i]->head_stride;
    }
  }
  bool operator==(const FwdPlanKey& o) const {
    const AttnProblem &a = problem, &b = o.problem;
    return a.batch == b.batch && a.seqlen_q == b.seqlen_q && a.seqlen_k == b.seqlen_k && a.nheads == b.nheads &&
           a.nheads_kv == b.nheads_kv && a.head_dim == b.head_dim && a.softmax_scale == b.softmax_scale &&
           a.window_left == b.window_left && a.window_right == b.window_right && a.dtype == b.dtype &&
           std::memcmp(strides, o.strides, sizeof(strides)) == 0;
  }
};

template <typename Traits>
FwdKernelParams<Traits> make_fwd_kernel_params(const FwdParams& params) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  const AttnProblem& p = params.problem;
  FwdKernelParams<Traits> kp{};
  kp.problem = p;
  kp.o = params.o;
  kp.lse = params.lse;
  kp.num_m_blocks = ceil_div(p.seqlen_q, Traits::kBlockM);
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
  return kp;
}

// Kernel parameters for `params`, from a per-thread plan of the last shapes seen: encoding the
// four TMA descriptors resolves the driver entry point on every encode (CUTLASS's wrapper), while
// patching the base addresses of a cached plan is a few stores. PERFLOG.md, entry 12, has the
// measured per-call overhead.
template <typename Traits>
FwdKernelParams<Traits> fwd_kernel_params(const FwdParams& params) {
  struct Plan {
    FwdPlanKey key;
    FwdKernelParams<Traits> kp;
  };
  thread_local std::optional<Plan> plan;
  const FwdPlanKey key(params);
  if (plan && plan->key == key && tensor_map_replace_address() != nullptr) {
    FwdKernelParams<Traits> kp = plan->kp;
    kp.o = params.o;
    kp.lse = params.lse;
    if (replace_address(kp.tma_q, params.q.ptr) && replace_address(kp.tma_k, params.k.ptr) &&
        replace_address(kp.tma_v, params.v.ptr) && replace_address(kp.tma_o, params.o.ptr))
      return kp;
  }
  FwdKernelParams<Traits> kp = make_fwd_kernel_params<Traits>(params);
  plan.emplace(Plan{key, kp});
  return kp;
}

// Launches the forward kernel of one configuration (FwdTraits); run_fwd picks the configuration of
// a head dim, and benchmarks/tune_sm90.cu times others. tile_group > 0 replaces the causal
// schedule's computed group size (tuning only).
template <typename Traits>
Status run_fwd_traits(const FwdParams& params, cudaStream_t stream, int tile_group = 0) {
  using Element = typename Traits::Element;
  const AttnProblem& p = params.problem;
  for (auto [ref, name] : {std::pair{&params.q, "q"}, {&params.k, "k"}, {&params.v, "v"}, {&params.o, "out"}})
    if (Status s = check_tma_ref<Element>(*ref, name); !s.ok()) return s;
  FwdKernelParams<Traits> kp = fwd_kernel_params<Traits>(params);

  int num_sms = 0;
  if (Status s = multiprocessor_count(num_sms); !s.ok()) return s;
  const int grid = PersistentTileScheduler::grid_size(kp.num_m_blocks * p.nheads * p.batch, num_sms);
  kp.tile_group = tile_group > 0 ? std::min(tile_group, p.nheads * p.batch)
                                 : PersistentTileScheduler::group_size(p.nheads * p.batch);
  kp.tile_counter = static_cast<int*>(params.workspace);
  if (cudaError_t e = cudaMemsetAsync(kp.tile_counter, 0, sizeof(int), stream); e != cudaSuccess)
    return cuda_status(e, "sm90 forward: zeroing the tile counter");
  constexpr auto kernel = fwd_kernel<Traits>;
  if (Status s = ensure_smem_limit<kernel>(Traits::kSmemBytes); !s.ok()) return s;
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(kp);
  return cuda_status(cudaGetLastError(), "sm90 forward launch");
}

template <int kHeadDim, typename Element>
Status run_fwd(const FwdParams& params, cudaStream_t stream) {
  constexpr FwdTile kTile = fwd_tile(kHeadDim);
  return run_fwd_traits<FwdTraits<kHeadDim, kTile.block_m, kTile.block_n, kTile.stages, Element>>(params, stream);
}

}  // namespace cutlass_flash::sm90
