// Host side of the kernel library (csrc/include/cutlass_flash/api.h): checks the parameters and
// dispatches to the instantiation the build's generated table lists. Errors are Status values;
// nothing here aborts or lets an exception escape. No torch, no Python, no CuTe.
#include "cutlass_flash/api.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "cutlass_flash/params.h"
#include "dispatch/table.h"
#include "dispatch/validate.h"
#include "generated/bwd_workspace.h"
#include "kernels/common/score_policy.h"
#include "kernels/common/varlen_workspace.h"

namespace cutlass_flash {
namespace dispatch {
namespace {

using std::to_string;

const char* direction_word(Direction d) { return d == Direction::kForward ? "forward" : "backward"; }

std::string prefix(Direction d) { return std::string("cutlass_flash ") + direction_word(d) + ": "; }

Status make(Status::Code code, std::string message) { return Status{code, std::move(message)}; }

bool dtype_known(DType d) { return d == DType::kFloat16 || d == DType::kBFloat16; }

const CatalogFamily* find_family(int arch) {
  const Table& t = table();
  for (size_t i = 0; i < t.num_catalog; ++i)
    if (t.catalog[i].arch == arch) return &t.catalog[i];
  return nullptr;
}

template <typename T>
bool contains(const T* xs, size_t n, T x) {
  for (size_t i = 0; i < n; ++i)
    if (xs[i] == x) return true;
  return false;
}

std::string join_ints(const int* xs, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += (i ? ", " : "") + to_string(xs[i]);
  return s;
}

std::string known_families() {
  const Table& t = table();
  std::string s;
  for (size_t i = 0; i < t.num_catalog; ++i) s += (i ? ", " : "") + to_string(t.catalog[i].arch);
  return s;
}

// Elements of 16-bit types per 16 bytes: the kernels move Q/K/V/O/dO in 16-byte vectors.
constexpr int64_t kVecElems = 8;
constexpr uintptr_t kVecBytes = 16;

// One (batch, seqlen, heads, head_dim) tensor, or (total, heads, head_dim) for a variable-length
// batch (batch_stride unused). A stride is checked only where its dimension has more than one
// index: torch reports arbitrary strides (0 after expand(), say) for size-1 dimensions, and the
// kernels never multiply them by anything but 0.
Status check_tensor(Direction dir, const char* name, const TensorRef4& t, const AttnProblem& p, int seqlen, int heads) {
  if (t.ptr == nullptr) return make(Status::kInvalidArgument, prefix(dir) + name + " is a null pointer");
  if (reinterpret_cast<uintptr_t>(t.ptr) % kVecBytes != 0)
    return make(Status::kInvalidArgument,
                prefix(dir) + name + " is not 16-byte aligned (the kernels load 16-byte vectors)");
  struct Dim {
    const char* stride_name;
    int64_t stride;
    int64_t extent;
  } dims[] = {{"batch_stride", t.batch_stride, p.is_varlen() ? 1 : p.batch},
              {"row_stride", t.row_stride, seqlen},
              {"head_stride", t.head_stride, heads}};
  for (const Dim& d : dims) {
    if (d.extent <= 1) continue;
    if (d.stride <= 0)
      return make(Status::kInvalidArgument,
                  prefix(dir) + name + "." + d.stride_name + " = " + to_string(d.stride) + " must be positive");
    if (d.stride % kVecElems != 0)
      return make(Status::kInvalidArgument,
                  prefix(dir) + name + "." + d.stride_name + " = " + to_string(d.stride) +
                      " must be a multiple of 8 elements (16 bytes); make the tensor contiguous");
  }
  return Status::Ok();
}

// Rows of a query-side / key-side tensor: per sequence, or packed.
int rows_q(const AttnProblem& p) { return p.is_varlen() ? p.total_q : p.seqlen_q; }
int rows_k(const AttnProblem& p) { return p.is_varlen() ? p.total_k : p.seqlen_k; }

Status check_scalar_ptr(Direction dir, const char* name, const void* ptr, uintptr_t align) {
  if (ptr == nullptr) return make(Status::kInvalidArgument, prefix(dir) + name + " is a null pointer");
  if (reinterpret_cast<uintptr_t>(ptr) % align != 0)
    return make(Status::kInvalidArgument, prefix(dir) + name + " is not " + to_string(align) + "-byte aligned");
  return Status::Ok();
}

std::string knob_value(const char* name) {
  const Table& t = table();
  for (size_t i = 0; i < t.num_knobs; ++i)
    if (std::string(t.knobs[i].name) == name) return t.knobs[i].value;
  return "";
}

std::string with_added(const std::string& list, const std::string& item) {
  return list.empty() ? item : list + "," + item;
}

// The table has no entry for a key of a known family with an instantiated head dim: say which
// knob left it out.
Status not_built(const KernelKey& key) {
  const Table& t = table();
  const std::string hd = to_string(key.head_dim);
  const std::string dt = dtype_name(key.dtype);
  std::vector<std::string> fixes;
  if (!contains(t.archs, t.num_archs, key.arch))
    fixes.push_back(std::string("CUTLASS_FLASH_ARCHS including ") + to_string(key.arch) +
                    " (e.g. CUTLASS_FLASH_ARCHS=" + with_added(knob_value("CUTLASS_FLASH_ARCHS"), to_string(key.arch)) +
                    ")");
  if (!contains(t.head_dims, t.num_head_dims, key.head_dim))
    fixes.push_back("CUTLASS_FLASH_HEAD_DIMS including " + hd +
                    " (e.g. CUTLASS_FLASH_HEAD_DIMS=" + with_added(knob_value("CUTLASS_FLASH_HEAD_DIMS"), hd) + ")");
  if (!contains(t.dtypes, t.num_dtypes, key.dtype))
    fixes.push_back("CUTLASS_FLASH_DTYPES including " + dt +
                    " (e.g. CUTLASS_FLASH_DTYPES=" + with_added(knob_value("CUTLASS_FLASH_DTYPES"), dt) + ")");
  if (key.direction == Direction::kBackward && t.fwd_only) fixes.push_back("CUTLASS_FLASH_FWD_ONLY unset (or 0)");
  std::string fix;
  for (size_t i = 0; i < fixes.size(); ++i) fix += (i ? " and " : "") + fixes[i];
  if (fix.empty()) fix = "the default knobs";
  return make(Status::kNotBuilt, "cutlass_flash was built without the sm" + to_string(key.arch) + " " +
                                     direction_word(key.direction) + " kernel for head_dim " + hd + ", " + dt +
                                     "; rebuild with " + fix + ". This build: " + build_config());
}

const Entry* find_entry(const KernelKey& key) {
  const Table& t = table();
  for (size_t i = 0; i < t.num_entries; ++i) {
    const KernelKey& k = t.entries[i].key;
    if (k.arch == key.arch && k.direction == key.direction && k.head_dim == key.head_dim && k.dtype == key.dtype)
      return &t.entries[i];
  }
  return nullptr;
}

Status internal_error(Direction dir, const char* what) {
  return make(Status::kCudaError, prefix(dir) + "internal error: " + what);
}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "fp16";
    case DType::kBFloat16:
      return "bf16";
  }
  return "unknown dtype";
}

std::string build_config() {
  const Table& t = table();
  std::string s;
  for (size_t i = 0; i < t.num_knobs; ++i) s += std::string(i ? " " : "") + t.knobs[i].name + "=" + t.knobs[i].value;
  return s;
}

Status check_problem(const AttnProblem& p, int arch, Direction dir) {
  const struct {
    const char* name;
    int value;
  } sizes[] = {{"batch", p.batch},   {"seqlen_q", p.seqlen_q},   {"seqlen_k", p.seqlen_k},
               {"nheads", p.nheads}, {"nheads_kv", p.nheads_kv}, {"head_dim", p.head_dim}};
  for (const auto& s : sizes)
    if (s.value <= 0)
      return make(Status::kInvalidArgument, prefix(dir) + s.name + " = " + to_string(s.value) + " must be positive");
  if (p.head_dim_real != 0 && (p.head_dim_real < 0 || p.head_dim_real > p.head_dim || p.head_dim_real % 8 != 0))
    return make(Status::kInvalidArgument,
                prefix(dir) + "head_dim_real = " + to_string(p.head_dim_real) +
                    " must be 0 or a multiple of 8 up to head_dim = " + to_string(p.head_dim));
  if (p.nheads % p.nheads_kv != 0)
    return make(Status::kInvalidArgument, prefix(dir) + "nheads = " + to_string(p.nheads) +
                                              " must be a multiple of nheads_kv = " + to_string(p.nheads_kv));
  if (!dtype_known(p.dtype))
    return make(Status::kInvalidArgument, prefix(dir) + "unknown dtype value " + to_string(static_cast<int>(p.dtype)));
  if (!std::isfinite(p.softmax_scale))
    return make(Status::kInvalidArgument, prefix(dir) + "softmax_scale must be finite");
  if (const char* error = score_fields_error(p)) return make(Status::kInvalidArgument, prefix(dir) + error);
  if ((p.cu_seqlens_q == nullptr) != (p.cu_seqlens_k == nullptr))
    return make(Status::kInvalidArgument,
                prefix(dir) + "cu_seqlens_q and cu_seqlens_k must be given together (variable-length) or not at all");
  if (!p.is_varlen() && (p.seqused_q != nullptr || p.seqused_k != nullptr))
    return make(Status::kInvalidArgument,
                prefix(dir) + "seqused_q / seqused_k apply to variable-length batches only (need cu_seqlens)");
  if (p.is_varlen()) {
    for (const void* ptr : {static_cast<const void*>(p.cu_seqlens_q), static_cast<const void*>(p.cu_seqlens_k),
                            static_cast<const void*>(p.seqused_q), static_cast<const void*>(p.seqused_k)})
      if (reinterpret_cast<uintptr_t>(ptr) % alignof(int) != 0)
        return make(Status::kInvalidArgument, prefix(dir) + "cu_seqlens / seqused are not 4-byte aligned int32 arrays");
    if (p.total_q <= 0 || p.total_k <= 0)
      return make(Status::kInvalidArgument, prefix(dir) + "total_q = " + to_string(p.total_q) +
                                                " and total_k = " + to_string(p.total_k) + " must be positive");
  }
  if (reinterpret_cast<uintptr_t>(p.sinks) % alignof(float) != 0)
    return make(Status::kInvalidArgument, prefix(dir) + "sinks must be a 4-byte aligned float32 array (nheads)");
  const CatalogFamily* fam = find_family(arch);
  if (fam == nullptr)
    return make(Status::kInvalidArgument,
                prefix(dir) + "unknown kernel family arch = " + to_string(arch) + " (known: " + known_families() + ")");
  if (const char* combined = score_features_combined(p);
      combined != nullptr &&
      !(dir == Direction::kForward ? contains(fam->all_features_fwd, fam->num_all_features_fwd, p.head_dim)
                                   : contains(fam->all_features_bwd, fam->num_all_features_bwd, p.head_dim)))
    return make(Status::kNotBuilt, prefix(dir) + "the sm" + to_string(arch) + " family's " + direction_word(dir) +
                                       " at head_dim = " + to_string(p.head_dim) + " does not take " + combined +
                                       " (csrc/generate.py: Family.all_features says why)");
  if (p.head_dim_real != 0 && p.head_dim_real != p.head_dim &&
      !(dir == Direction::kForward ? fam->narrow_fwd : fam->narrow_bwd))
    return make(Status::kInvalidArgument, prefix(dir) + "the sm" + to_string(arch) + " family's " +
                                              direction_word(dir) +
                                              " takes no head_dim_real (pad the tensors to head_dim)");
  if (p.head_dim_v != 0) {
    bool built = false;
    const bool fwd = dir == Direction::kForward;
    const int* pairs = fwd ? fam->head_dims_v_fwd : fam->head_dims_v_bwd;
    const size_t num_pairs = fwd ? fam->num_head_dims_v_fwd : fam->num_head_dims_v_bwd;
    for (size_t i = 0; i + 1 < num_pairs; i += 2)
      built = built || (pairs[i] == p.head_dim && pairs[i + 1] == p.head_dim_v);
    if (!built || p.head_dim_real != 0)
      return make(Status::kInvalidArgument, prefix(dir) + "the sm" + to_string(arch) + " family's " +
                                                direction_word(dir) + " has no kernel for head_dim_v = " +
                                                to_string(p.head_dim_v) + " at head_dim = " + to_string(p.head_dim) +
                                                " (csrc/generate.py: Family.head_dims_v; pad v to head_dim)");
  }
  if (p.is_varlen() && !(dir == Direction::kForward ? fam->varlen_fwd : fam->varlen_bwd))
    return make(Status::kNotBuilt, prefix(dir) + "the sm" + to_string(arch) + " family has no variable-length " +
                                       direction_word(dir) + " kernel (cu_seqlens)");
  if (!contains(fam->head_dims, fam->num_head_dims, p.head_dim))
    return make(Status::kInvalidArgument, prefix(dir) + "head_dim = " + to_string(p.head_dim) +
                                              " is not an instantiated size of the sm" + to_string(arch) + " family (" +
                                              join_ints(fam->head_dims, fam->num_head_dims) +
                                              "); pad the head dim up to the next one");
  if ((dir == Direction::kForward && !fam->has_fwd) || (dir == Direction::kBackward && !fam->has_bwd))
    return make(Status::kNotBuilt, "cutlass_flash has no " + std::string(direction_word(dir)) + " kernel in the sm" +
                                       to_string(arch) + " family");
  return Status::Ok();
}

// Validates a call, finds its kernel and runs it: the steps every direction shares. `checks` are
// the direction's tensor checks, evaluated inside the guard; `launch` is the Entry member to call.
// No exception leaves the library: one escaping a check or a launcher becomes an internal error.
template <typename Params, typename Checks, typename Launch>
Status run_direction(Direction dir, const Params& params, int arch, cudaStream_t stream, Checks&& checks,
                     Launch Entry::*launch) {
  try {
    const AttnProblem& p = params.problem;
    if (Status s = check_problem(p, arch, dir); !s.ok()) return s;
    for (const Status& s : checks(p))
      if (!s.ok()) return s;
    const KernelKey key{arch, dir, p.head_dim, p.dtype};
    const Entry* e = find_entry(key);
    if (e == nullptr || e->*launch == nullptr) return not_built(key);
    return (e->*launch)(params, stream);
  } catch (const std::exception& ex) {
    return internal_error(dir, ex.what());
  } catch (...) {
    return internal_error(dir, "unknown exception");
  }
}

}  // namespace dispatch

Status run_fwd(const FwdParams& params, int arch, cudaStream_t stream) {
  constexpr Direction dir = Direction::kForward;
  return dispatch::run_direction(dir, params, arch, stream, [&](const AttnProblem& p) {
    return std::array{
        dispatch::check_tensor(dir, "q", params.q, p, dispatch::rows_q(p), p.nheads),
        dispatch::check_tensor(dir, "k", params.k, p, dispatch::rows_k(p), p.nheads_kv),
        dispatch::check_tensor(dir, "v", params.v, p, dispatch::rows_k(p), p.nheads_kv),
        dispatch::check_tensor(dir, "o", params.o, p, dispatch::rows_q(p), p.nheads),
        dispatch::check_scalar_ptr(dir, "lse", params.lse, alignof(float)),
        fwd_workspace_bytes(p, arch) == 0
            ? Status::Ok()
            : dispatch::check_scalar_ptr(dir, "workspace", params.workspace, kFwdWorkspaceAlign),
    };
  }, &dispatch::Entry::fwd);
}

Status run_bwd(const BwdParams& params, int arch, cudaStream_t stream) {
  constexpr Direction dir = Direction::kBackward;
  return dispatch::run_direction(dir, params, arch, stream, [&](const AttnProblem& p) {
    return std::array{
        dispatch::check_tensor(dir, "q", params.q, p, dispatch::rows_q(p), p.nheads),
        dispatch::check_tensor(dir, "k", params.k, p, dispatch::rows_k(p), p.nheads_kv),
        dispatch::check_tensor(dir, "v", params.v, p, dispatch::rows_k(p), p.nheads_kv),
        dispatch::check_tensor(dir, "o", params.o, p, dispatch::rows_q(p), p.nheads),
        dispatch::check_tensor(dir, "dout", params.dout, p, dispatch::rows_q(p), p.nheads),
        dispatch::check_scalar_ptr(dir, "lse", params.lse, alignof(float)),
        dispatch::check_tensor(dir, "dq", params.dq, p, dispatch::rows_q(p), p.nheads),
        dispatch::check_tensor(dir, "dk", params.dk, p, dispatch::rows_k(p), p.nheads_kv),
        dispatch::check_tensor(dir, "dv", params.dv, p, dispatch::rows_k(p), p.nheads_kv),
        dispatch::check_scalar_ptr(dir, "workspace", params.workspace, 256),
        params.dsink_rows == nullptr ? Status::Ok()
        : p.sinks == nullptr
            ? dispatch::make(Status::kInvalidArgument, dispatch::prefix(dir) + "dsink_rows needs sinks")
            : dispatch::check_scalar_ptr(dir, "dsink_rows", params.dsink_rows, alignof(float)),
    };
  }, &dispatch::Entry::bwd);
}

size_t fwd_workspace_bytes(const AttnProblem& problem, int arch) {
  const dispatch::CatalogFamily* fam = dispatch::find_family(arch);
  if (fam == nullptr) return 0;
  // A packed batch's tile list holds the family's scratch in its header (varlen_workspace.h).
  return problem.is_varlen() ? std::max(size_t(fam->fwd_workspace_bytes), fwd_varlen_bytes(problem))
                             : fam->fwd_workspace_bytes;
}

size_t bwd_workspace_bytes(const AttnProblem& problem, int arch, bool deterministic) {
  if (problem.batch <= 0 || problem.nheads <= 0 || problem.seqlen_q <= 0 || problem.head_dim <= 0) return 0;
  const dispatch::CatalogFamily* fam = dispatch::find_family(arch);
  if (fam == nullptr || !fam->has_bwd) return 0;  // no backward kernel in that family
  return bwd_workspace_layout(problem, deterministic, arch).total_bytes + bwd_varlen_bytes(problem);
}

const std::vector<KernelKey>& built_kernels() {
  static const std::vector<KernelKey> keys = [] {
    std::vector<KernelKey> v;
    const dispatch::Table& t = dispatch::table();
    v.reserve(t.num_entries);
    for (size_t i = 0; i < t.num_entries; ++i) v.push_back(t.entries[i].key);
    return v;
  }();
  return keys;
}

}  // namespace cutlass_flash
