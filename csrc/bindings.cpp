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

// The problem's fields by their AttnProblem names, the one list the binding has of them (Python's
// _ops._problem builds the keyword arguments); pointers as integers (0: null).
struct Field {
  const char* name;
  bool required;
  void (*set)(AttnProblem&, py::handle);
};
template <typename T>
const T* pointer(py::handle v) {
  return reinterpret_cast<const T*>(v.cast<uintptr_t>());
}
const Field kProblemFields[] = {
    {"batch", true, [](AttnProblem& p, py::handle v) { p.batch = v.cast<int>(); }},
    {"seqlen_q", true, [](AttnProblem& p, py::handle v) { p.seqlen_q = v.cast<int>(); }},
    {"seqlen_k", true, [](AttnProblem& p, py::handle v) { p.seqlen_k = v.cast<int>(); }},
    {"nheads", true, [](AttnProblem& p, py::handle v) { p.nheads = v.cast<int>(); }},
    {"nheads_kv", true, [](AttnProblem& p, py::handle v) { p.nheads_kv = v.cast<int>(); }},
    {"head_dim", true, [](AttnProblem& p, py::handle v) { p.head_dim = v.cast<int>(); }},
    {"head_dim_real", false, [](AttnProblem& p, py::handle v) { p.head_dim_real = v.cast<int>(); }},
    {"head_dim_v", false, [](AttnProblem& p, py::handle v) { p.head_dim_v = v.cast<int>(); }},
    {"softmax_scale", true, [](AttnProblem& p, py::handle v) { p.softmax_scale = v.cast<float>(); }},
    {"window_left", true, [](AttnProblem& p, py::handle v) { p.window_left = v.cast<int>(); }},
    {"window_right", true, [](AttnProblem& p, py::handle v) { p.window_right = v.cast<int>(); }},
    {"softcap", false, [](AttnProblem& p, py::handle v) { p.softcap = v.cast<float>(); }},
    {"alibi_slopes", false, [](AttnProblem& p, py::handle v) { p.alibi_slopes = pointer<float>(v); }},
    {"alibi_batch_stride", false, [](AttnProblem& p, py::handle v) { p.alibi_batch_stride = v.cast<int64_t>(); }},
    {"dropout_p", false, [](AttnProblem& p, py::handle v) { p.dropout_p = v.cast<float>(); }},
    {"rng_state", false, [](AttnProblem& p, py::handle v) { p.rng_state = pointer<uint64_t>(v); }},
    {"sinks", false, [](AttnProblem& p, py::handle v) { p.sinks = pointer<float>(v); }},
    {"dtype", true, [](AttnProblem& p, py::handle v) { p.dtype = parse_dtype(v.cast<std::string>()); }},
    {"cu_seqlens_q", false, [](AttnProblem& p, py::handle v) { p.cu_seqlens_q = pointer<int>(v); }},
    {"cu_seqlens_k", false, [](AttnProblem& p, py::handle v) { p.cu_seqlens_k = pointer<int>(v); }},
    {"seqused_q", false, [](AttnProblem& p, py::handle v) { p.seqused_q = pointer<int>(v); }},
    {"seqused_k", false, [](AttnProblem& p, py::handle v) { p.seqused_k = pointer<int>(v); }},
    {"total_q", false, [](AttnProblem& p, py::handle v) { p.total_q = v.cast<int>(); }},
    {"total_k", false, [](AttnProblem& p, py::handle v) { p.total_k = v.cast<int>(); }},
};

AttnProblem problem(const py::kwargs& kw) {
  AttnProblem p;
  for (const auto& item : kw) {
    const std::string key = py::cast<std::string>(item.first);
    const Field* field = nullptr;
    for (const Field& f : kProblemFields)
      if (key == f.name) field = &f;
    if (field == nullptr) throw py::type_error("cutlass_flash: unknown problem argument '" + key + "'");
    field->set(p, item.second);
  }
  for (const Field& f : kProblemFields)
    if (f.required && !kw.contains(f.name))
      throw py::type_error(std::string("cutlass_flash: missing problem argument '") + f.name + "'");
  return p;
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// The fields FwdParams and BwdParams share.
template <typename Params>
void set_common(Params& params, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, uintptr_t workspace,
                const AttnProblem& p) {
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

void fwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, uintptr_t lse, uintptr_t workspace,
         int arch, uintptr_t stream, const py::kwargs& kw) {
  FwdParams params;
  set_common(params, q, k, v, o, workspace, problem(kw));
  params.lse = reinterpret_cast<float*>(lse);
  run_without_gil([&] { return run_fwd(params, arch, as_stream(stream)); });
}

void bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& dout, uintptr_t lse,
         const Tensor& dq, const Tensor& dk, const Tensor& dv, uintptr_t workspace, int arch, bool deterministic,
         uintptr_t dsink_rows, uintptr_t stream, const py::kwargs& kw) {
  BwdParams params;
  set_common(params, q, k, v, o, workspace, problem(kw));
  params.dout = tensor(dout);
  params.lse = reinterpret_cast<const float*>(lse);
  params.dq = tensor(dq);
  params.dk = tensor(dk);
  params.dv = tensor(dv);
  params.deterministic = deterministic;
  params.dsink_rows = reinterpret_cast<float*>(dsink_rows);
  run_without_gil([&] { return run_bwd(params, arch, as_stream(stream)); });
}

// Scratch bytes of a direction's call, after the problem checks that call would make.
template <Direction kDir>
size_t workspace_bytes(const AttnProblem& p, int arch, bool deterministic) {
  check(dispatch::check_problem(p, arch, kDir));
  return kDir == Direction::kForward ? fwd_workspace_bytes(p, arch) : bwd_workspace_bytes(p, arch, deterministic);
}

py::list built() {
  py::list out;
  for (const KernelKey& k : built_kernels())
    out.append(py::make_tuple(k.arch, k.direction == Direction::kForward ? "fwd" : "bwd", k.head_dim,
                              dispatch::dtype_name(k.dtype)));
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

  // The problem's fields are keyword arguments of fwd, bwd and the workspace sizes, by their
  // AttnProblem names (kProblemFields).
  m.def("fwd", &fwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("lse_ptr"),
        py::arg("workspace_ptr"), py::kw_only(), py::arg("arch"), py::arg("stream"),
        "Forward pass. q/k/v/o: (ptr, batch_stride, row_stride, head_stride) in elements, the "
        "last dim contiguous; lse_ptr: float32 (batch, nheads, seqlen_q), contiguous; "
        "cu_seqlens_q/_k (int32 device pointers, both or 0) make a variable-length batch of packed "
        "(total_q / total_k rows) tensors, seqlen_q/_k then the longest lengths and the LSE "
        "(nheads, total_q); seqused_q/_k (int32 device pointers, batch entries each, or 0; "
        "variable-length only): sequence b uses the first seqused[b] rows of its slot, the rest "
        "written as 0 (lse +inf); sinks: float32 device pointer (nheads) or 0; "
        "workspace_ptr: fwd_workspace_bytes(...) bytes, aligned to _catalog.FWD_WORKSPACE_ALIGN (0 when that is 0); "
        "dtype: 'fp16' | 'bf16'; arch: kernel family (80, 90); stream: cudaStream_t as an int; "
        "the other keywords: the fields of AttnProblem (params.h). Asynchronous.");
  m.def("bwd", &bwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"), py::arg("dout"), py::arg("lse_ptr"),
        py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("workspace_ptr"), py::kw_only(), py::arg("arch"),
        py::arg("deterministic"), py::arg("dsink_rows_ptr") = 0, py::arg("stream"),
        "Backward pass. dq/dk/dv shaped like q/k/v (dk/dv per kv head); "
        "workspace_ptr: bwd_workspace_bytes(...) bytes, 256-byte aligned, need not be zeroed; "
        "deterministic: dQ accumulated in a fixed order; dsink_rows_ptr (with sinks): float32 "
        "shaped like the LSE, each row's part of the sinks' gradient (BwdParams::dsink_rows).");
  m.def("fwd_workspace_bytes", [](int arch, const py::kwargs& kw) {
    return workspace_bytes<Direction::kForward>(problem(kw), arch, false);
  }, py::kw_only(), py::arg("arch"), "Scratch bytes fwd needs for this problem.");
  m.def("bwd_workspace_bytes", [](int arch, bool deterministic, const py::kwargs& kw) {
    return workspace_bytes<Direction::kBackward>(problem(kw), arch, deterministic);
  }, py::kw_only(), py::arg("arch"), py::arg("deterministic"), "Scratch bytes bwd needs for this problem.");
  m.def("built_kernels", &built, "The instantiations of this build: [(arch, 'fwd'|'bwd', head_dim, 'fp16'|'bf16')].");
  m.def("build_config", &build_config, "The build knobs this library was built with, {env var: value}.");
}
