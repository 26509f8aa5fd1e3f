// Host side of the TMA descriptors, shared by the sm90 launchers: global tensor views of the
// caller's (batch, seqlen, heads, d) tensors, their alignment check, and a per-thread cache of the
// kernel parameters keyed on everything the descriptors depend on but the base addresses.
// Encoding a descriptor resolves the driver entry point on every call (CUTLASS's wrapper), while
// patching the base addresses of a cached plan is a few stores (PERFLOG.md, entry 12).
#pragma once

#include <cuda.h>
#include <cute/tensor.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "cutlass_flash/api.h"
#include "cutlass_flash/params.h"

namespace cutlass_flash::sm90 {

// TMA reads and writes global memory in 16-byte units: the base address and every stride but
// the innermost must be multiples of 16 bytes (the Python layer already requires this).
template <typename Element>
Status check_tma_ref(const TensorRef4& t, const char* name, const char* direction) {
  constexpr int64_t kAlign = 16 / int64_t(sizeof(Element));
  const bool ok = reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && t.batch_stride % kAlign == 0 &&
                  t.row_stride % kAlign == 0 && t.head_stride % kAlign == 0;
  if (ok) return Status::Ok();
  return {Status::kInvalidArgument, std::string("sm90 ") + direction + ": " + name +
                                        " must be 16-byte aligned with strides that are multiples of 16 bytes"};
}

// (seqlen, d, head, batch) view of a query-side (kQuery) or key-side tensor, the order the
// kernels' TMA copies index; (total, d, head, 1) for a variable-length batch (sequence_rows).
// d is the columns in memory (AttnProblem::cols): the boxes stay the tile's full width, and TMA
// fills their columns past d with zeros on loads and leaves them out of stores.
// cols: the tensor's columns where not p.cols() (v and o of AttnProblem::head_dim_v).
template <typename Element>
auto gmem_tensor(const TensorRef4& t, bool query_side, const AttnProblem& p, int cols = 0) {
  using namespace cute;
  const int rows = p.is_varlen() ? (query_side ? p.total_q : p.total_k) : (query_side ? p.seqlen_q : p.seqlen_k);
  const int nheads = query_side ? p.nheads : p.nheads_kv;
  return make_tensor(make_gmem_ptr(static_cast<Element*>(t.ptr)),
                     make_layout(make_shape(int32_t(rows), int32_t(cols > 0 ? cols : p.cols()), int32_t(nheads),
                                            int32_t(p.is_varlen() ? 1 : p.batch)),
                                 make_stride(t.row_stride, _1{}, t.head_stride, t.batch_stride)));
}

// cuTensorMapReplaceAddress (CUDA 12.0 signature), resolved once through the runtime (the library
// links no libcuda, so that it loads on a machine without a driver); null if the driver lacks it.
// Declared here rather than taken from cudaTypedefs.h, which CUTLASS includes inside its own
// namespace, so that the global typedef exists only when no CUTLASS header came first.
using ReplaceAddressFn = CUresult (*)(CUtensorMap*, void*);
inline ReplaceAddressFn tensor_map_replace_address() {
  static const ReplaceAddressFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult query;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapReplaceAddress", &p, 12000, cudaEnableDefault, &query);
    return err == cudaSuccess && query == cudaDriverEntryPointSuccess ? reinterpret_cast<ReplaceAddressFn>(p) : nullptr;
  }();
  return fn;
}

template <typename Tma>
bool replace_address(Tma& tma, const void* ptr) {
  auto* desc = reinterpret_cast<CUtensorMap*>(const_cast<cute::TmaDescriptor*>(tma.get_tma_descriptor()));
  return tensor_map_replace_address()(desc, const_cast<void*>(ptr)) == CUDA_SUCCESS;
}

// What N descriptors depend on besides their base addresses: the problem's shapes and the
// strides. The launchers set every other field of the kernel parameters (the problem included)
// on each call.
template <int N>
struct TmaPlanKey {
  AttnProblem problem;
  int64_t strides[N][3];

  TmaPlanKey(const AttnProblem& p, const std::array<const TensorRef4*, N>& refs) : problem(p) {
    for (int i = 0; i < N; ++i) {
      strides[i][0] = refs[i]->batch_stride;
      strides[i][1] = refs[i]->row_stride;
      strides[i][2] = refs[i]->head_stride;
    }
  }
  bool operator==(const TmaPlanKey& o) const {
    const AttnProblem &a = problem, &b = o.problem;
    return a.batch == b.batch && a.seqlen_q == b.seqlen_q && a.seqlen_k == b.seqlen_k && a.nheads == b.nheads &&
           a.nheads_kv == b.nheads_kv && a.head_dim == b.head_dim && a.cols() == b.cols() && a.cols_v() == b.cols_v() &&
           a.softmax_scale == b.softmax_scale && a.window_left == b.window_left && a.window_right == b.window_right &&
           a.dtype == b.dtype && a.is_varlen() == b.is_varlen() && a.total_q == b.total_q && a.total_k == b.total_k &&
           std::memcmp(strides, o.strides, sizeof(strides)) == 0;
  }
};

// The kernel parameters of the last key seen on this thread, one cache per KernelParams type.
// `make()` builds them from scratch; `patch(kp)` sets the per-call fields of a cached copy and
// returns false if a base address could not be replaced (then they are rebuilt).
template <typename KernelParams, int N, typename Make, typename Patch>
KernelParams cached_kernel_params(const TmaPlanKey<N>& key, Make&& make, Patch&& patch) {
  struct Plan {
    TmaPlanKey<N> key;
    KernelParams kp;
  };
  thread_local std::optional<Plan> plan;
  if (plan && plan->key == key && tensor_map_replace_address() != nullptr) {
    KernelParams kp = plan->kp;
    if (patch(kp)) return kp;
  }
  KernelParams kp = make();
  plan.emplace(Plan{key, kp});
  return kp;
}

}  // namespace cutlass_flash::sm90
