// cutlass_flash._C: a thin pybind11 module over the kernel library (cutlass_flash/api.h).
// No torch header: tensors arrive as (ptr, batch_stride, row_stride, head_stride) tuples of ints
// (strides in elements), the stream as the integer value of a cudaStream_t. A non-ok Status
// raises: kNotBuilt -> NotImplementedError, kInvalidArgument -> ValueError, kCudaError ->
// RuntimeError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "cutlass_flash/api.h"
#include "cutlass_flash/params.h"
#include "dispatch/table.h"
#include "dispatch/validate.h"

namespace py = pybind11;
using namespace cutlass_flash;

namespace {

using Tensor = std::tuple<uintptr_t, int64_t, int64_t, int64_t>;

[[noreturn]] void raise(const Status& s) {
  switch (s.code) {
    case Status::kNotBuilt:
      PyErr_SetString(PyExc_NotImplementedError, s.message.c_str());
      throw py::error_already_set();
    case Status::kInvalidArgument:
      throw py::value_error(s.message);
    default:
      throw std::runtime_error(s.message.empty() ? "cutlass_flash: CUDA error" : s.message);
  }
}

void check(const Status& s) {
  if (!s.ok()) raise(s);
}

DType parse_dtype(const std::string& name) {
  if (name == "fp16") return DType::kFloat16;
  if (name == "bf16") return DType::kBFloat16;
  throw py::value_error("cutlass_flash: dtype must be 'fp16' or 'bf16', got '" + name + "'");
}

TensorRef4 tensor(const Tensor& t) {
  TensorRef4 r;
  r.ptr = reinterpret_cast<void*>(std::get<0>(t));
  r.batch_stride = std::get<1>(t);
  r.row_stride = std::get<2>(t);
  r.head_stride = std::get<3>(t);
  return r;
}

AttnProblem problem(int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
                    float softmax_scale, int window_left, int window_right, float softcap,
                    const std::string& dtype, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q,
                    int total_k, uintptr_t alibi_slopes, int64_t alibi_batch_stride, float dropout_p, uintptr_t rng_state,
                    uintptr_t seqused_q, uintptr_t seqused_k, int head_dim_real) {
  AttnProblem p;
  p.batch = batch;
  p.seqlen_q = seqlen_q;
  p.seqlen_k = seqlen_k;
  p.nheads = nheads;
  p.nheads_kv = nheads_kv;
  p.head_dim = head_dim;
  p.head_dim_real = head_dim_real;
  p.softmax_scale = softmax_scale;
  p.window_left = window_left;
  p.window_right = window_right;
  p.softcap = softcap;
  p.dtype = parse_dtype(dtype);
  p.cu_seqlens_q = reinterpret_cast<const int*>(cu_seqlens_q);
  p.cu_seqlens_k = reinterpret_cast<const int*>(cu_seqlens_k);
  p.seqused_q = reinterpret_cast<const int*>(seqused_q);
  p.seqused_k = reinterpret_cast<const int*>(seqused_k);
  p.total_q = total_q;
  p.total_k = total_k;
  p.alibi_slopes = reinterpret_cast<const float*>(alibi_slopes);
  p.alibi_batch_stride = alibi_batch_stride;
  p.dropout_p = dropout_p;
  p.rng_state = reinterpret_cast<const uint64_t*>(rng_state);
  return p;
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// The fields FwdParams and BwdParams share.
template <typename Params>
void set_common(Params& params, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                uintptr_t workspace, const AttnProblem& p) {
  params.problem = p;
  params.q = tensor(q);
  params.k = tensor(k);
  params.v = tensor(v);
  params.o = tensor(o);
  params.workspace = reinterpret_cast<void*>(workspace);
}

// Runs a library call without the GIL (the launch path may block on a full CUDA queue) and raises
// on its Status with the GIL held again.
template <typename F>
void run_without_gil(F&& call) {
  Status s;
  {
    py::gil_scoped_release nogil;
    s = call();
  }
  check(s);
}

void fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, uintptr_t lse,
         uintptr_t workspace, int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
         float softmax_scale, int window_left, int window_right, float softcap, const std::string& dtype,
         uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q, int total_k, uintptr_t alibi_slopes,
         int64_t alibi_batch_stride, float dropout_p, uintptr_t rng_state, uintptr_t seqused_q, uintptr_t seqused_k, int head_dim_real,
         int arch, uintptr_t stream) {
  FwdParams params;
  set_common(params, q, k, v, o, workspace,
             problem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, softmax_scale,
                     window_left, window_right, softcap, dtype, cu_seqlens_q, cu_seqlens_k, total_q, total_k, alibi_slopes,
                     alibi_batch_stride, dropout_p, rng_state, seqused_q, seqused_k, head_dim_real));
  params.lse = reinterpret_cast<float*>(lse);
  run_without_gil([&] { return run_fwd(params, arch, as_stream(stream)); });
}

void bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dout,
         uintptr_t lse, const Tensor& dq, const Tensor& dk, const Tensor& dv, uintptr_t workspace,
         int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
         float softmax_scale, int window_left, int window_right, float softcap, const std::string& dtype,
         uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k, int total_q, int total_k, uintptr_t alibi_slopes,
         int64_t alibi_batch_stride, float dropout_p, uintptr_t rng_state, uintptr_t seqused_q, uintptr_t seqused_k, int head_dim_real,
         int arch, bool deterministic, uintptr_t stream) {
  BwdParams params;
  set_common(params, q, k, v, o, workspace,
             problem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, softmax_scale,
                     window_left, window_right, softcap, dtype, cu_seqlens_q, cu_seqlens_k, total_q, total_k, alibi_slopes,
                     alibi_batch_stride, dropout_p, rng_state, seqused_q, seqused_k, head_dim_real));
  params.dout = tensor(dout);
  params.lse = reinterpret_cast<const float*>(lse);
  params.dq = tensor(dq);
  params.dk = tensor(dk);
  params.dv = tensor(dv);
  params.deterministic = deterministic;
  run_without_gil([&] { return run_bwd(params, arch, as_stream(stream)); });
}

// Scratch bytes of a direction's call, after the problem checks that call would make.
template <Direction kDir>
size_t workspace_bytes(int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv,
                       int head_dim, float softmax_scale, int window_left, int window_right,
                       float softcap, const std::string& dtype, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k,
                       int total_q, int total_k, uintptr_t alibi_slopes, int64_t alibi_batch_stride, float dropout_p, uintptr_t rng_state,
                       uintptr_t seqused_q, uintptr_t seqused_k, int head_dim_real, int arch, bool deterministic) {
  const AttnProblem p = problem(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, softmax_scale, window_left,
                                window_right, softcap, dtype, cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                alibi_slopes, alibi_batch_stride, dropout_p, rng_state, seqused_q, seqused_k, head_dim_real);
  check(dispatch::check_problem(p, arch, kDir));
  return kDir == Direction::kForward ? fwd_workspace_bytes(p, arch) : bwd_workspace_bytes(p, arch, deterministic);
}

size_t fwd_workspace_bytes_py(int batch, int seqlen_q, int seqlen_k, int nheads, int nheads_kv, int head_dim,
                              float softmax_scale, int window_left, int window_right, float softcap,
                              const std::string& dtype, uintptr_t cu_seqlens_q, uintptr_t cu_seqlens_k,
                              int total_q, int total_k, uintptr_t alibi_slopes, int64_t alibi_batch_stride, float dropout_p, uintptr_t rng_state,
                              uintptr_t seqused_q, uintptr_t seqused_k, int head_dim_real, int arch) {
  return workspace_bytes<Direction::kForward>(batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim,
                                              softmax_scale, window_left, window_right, softcap, dtype,
                                              cu_seqlens_q, cu_seqlens_k, total_q, total_k, alibi_slopes,
                                              alibi_batch_stride, dropout_p, rng_state, seqused_q, seqused_k, head_dim_real, arch, false);
}

py::list built() {
  py::list out;
  for (const KernelKey& k : built_kernels())
    out.append(py::make_tuple(k.arch, k.direction == Direction::kForward ? "fwd" : "bwd",
                              k.head_dim, dispatch::dtype_name(k.dtype)));
  return out;
}

py::dict build_config() {
  py::dict d;
  const dispatch::Table& t = dispatch::table();
  for (size_t i = 0; i < t.num_knobs; ++i) d[t.knobs[i].name] = t.knobs[i].value;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cutlass_flash kernel library bindings (pointers and strides in, no torch)";

  // Problem keyword arguments shared by fwd, bwd and bwd_workspace_bytes.
#define CUTLASS_FLASH_PROBLEM_ARGS                                                            \
  py::arg("batch"), py::arg("seqlen_q"), py::arg("seqlen_k"), py::arg("nheads"),              \
      py::arg("nheads_kv"), py::arg("head_dim"), py::arg("softmax_scale"),                    \
      py::arg("window_left"), py::arg("window_right"), py::arg("softcap"), py::arg("dtype"),     \
      py::arg("cu_seqlens_q") = 0, py::arg("cu_seqlens_k") = 0, py::arg("total_q") = 0,          \
      py::arg("total_k") = 0, py::arg("alibi_slopes") = 0, py::arg("alibi_batch_stride") = 0,    \
      py::arg("dropout_p") = 0.f, py::arg("rng_state") = 0, py::arg("seqused_q") = 0,              \
      py::arg("seqused_k") = 0, py::arg("head_dim_real") = 0

  m.def("fwd", &fwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse_ptr"),
        py::arg("workspace_ptr"), py::kw_only(), CUTLASS_FLASH_PROBLEM_ARGS, py::arg("arch"),
        py::arg("stream"),
        "Forward pass. q/k/v/o: (ptr, batch_stride, row_stride, head_stride) in elements, the "
        "last dim contiguous; lse_ptr: float32 (batch, nheads, seqlen_q), contiguous; "
        "cu_seqlens_q/_k (int32 device pointers, both or 0) make a variable-length batch of packed "
        "(total_q / total_k rows) tensors, seqlen_q/_k then the longest lengths and the LSE "
        "(nheads, total_q); seqused_q/_k (int32 device pointers, batch entries each, or 0; "
        "variable-length only): sequence b uses the first seqused[b] rows of its slot, the rest "
        "written as 0 (lse +inf); "
        "workspace_ptr: fwd_workspace_bytes(...) bytes, aligned to _catalog.FWD_WORKSPACE_ALIGN (0 when that is 0); "
        "dtype: 'fp16' | 'bf16'; arch: kernel family (80, 90); stream: cudaStream_t as an int. "
        "Asynchronous.");
  m.def("bwd", &bwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("dout"),
        py::arg("lse_ptr"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("workspace_ptr"),
        py::kw_only(), CUTLASS_FLASH_PROBLEM_ARGS, py::arg("arch"), py::arg("deterministic"),
        py::arg("stream"),
        "Backward pass. dq/dk/dv shaped like q/k/v (dk/dv per kv head); "
        "workspace_ptr: bwd_workspace_bytes(...) bytes, 256-byte aligned, need not be zeroed; "
        "deterministic: dQ accumulated in a fixed order.");
  m.def("fwd_workspace_bytes", &fwd_workspace_bytes_py, py::kw_only(),
        CUTLASS_FLASH_PROBLEM_ARGS, py::arg("arch"), "Scratch bytes fwd needs for this problem.");
  m.def("bwd_workspace_bytes", &workspace_bytes<Direction::kBackward>, py::kw_only(),
        CUTLASS_FLASH_PROBLEM_ARGS, py::arg("arch"), py::arg("deterministic"),
        "Scratch bytes bwd needs for this problem.");
#undef CUTLASS_FLASH_PROBLEM_ARGS
  m.def("built_kernels", &built,
        "The instantiations of this build: [(arch, 'fwd'|'bwd', head_dim, 'fp16'|'bf16')].");
  m.def("build_config", &build_config,
        "The build knobs this library was built with, {env var: value}.");
}
