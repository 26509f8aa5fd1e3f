// The dispatch table of a build. Its one definition, `table()`, is generated per build by
// csrc/generate.py into the build directory: it lists only the instantiations the build's knobs
// selected, plus the catalogue of every family the generator knows (for error messages).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "cutlass_flash/api.h"
#include "cutlass_flash/params.h"

namespace cutlass_flash::dispatch {

using FwdFn = Status (*)(const FwdParams&, cudaStream_t);
using BwdFn = Status (*)(const BwdParams&, cudaStream_t);

// One built instantiation; `fwd` is set for Direction::kForward keys, `bwd` for kBackward.
struct Entry {
  KernelKey key;
  FwdFn fwd;
  BwdFn bwd;
};

// One kernel family the generator knows, whether or not this build contains it.
struct CatalogFamily {
  int arch;
  bool has_fwd;
  bool has_bwd;
  const int* head_dims;
  size_t num_head_dims;
  const char* sass_knob;  // e.g. "CUTLASS_FLASH_SM80_SASS"
  size_t fwd_workspace_bytes;
  bool varlen_fwd;  // the forward takes variable-length batches (AttnProblem::cu_seqlens_q / _k)
  bool varlen_bwd;  // the backward does
  bool narrow_fwd;  // the forward takes tensors narrower than its tile (AttnProblem::head_dim_real)
  bool narrow_bwd;  // the backward does
  // Head dims whose forward / backward kernels take every combination of the score features in
  // one call (the others refuse the calls that kernels/common/score_policy.h's
  // score_features_combined names).
  const int* all_features_fwd;
  size_t num_all_features_fwd;
  const int* all_features_bwd;
  size_t num_all_features_bwd;
  // (head_dim, head_dim_v) pairs, flattened (two ints each), whose forward / backward kernels
  // have V, O (and dO, dV) at a head dim of their own (AttnProblem::head_dim_v; csrc/generate.py:
  // Family.head_dims_v).
  const int* head_dims_v_fwd;
  size_t num_head_dims_v_fwd;
  const int* head_dims_v_bwd;
  size_t num_head_dims_v_bwd;
};

// A build knob as it was set for this build ("CUTLASS_FLASH_HEAD_DIMS", "64,128").
struct Knob {
  const char* name;
  const char* value;
};

struct Table {
  const Entry* entries;
  size_t num_entries;
  const CatalogFamily* catalog;
  size_t num_catalog;
  // The selection knobs of this build.
  const int* archs;
  size_t num_archs;
  const int* head_dims;
  size_t num_head_dims;
  const DType* dtypes;
  size_t num_dtypes;
  bool fwd_only;
  const Knob* knobs;
  size_t num_knobs;
};

// Defined in the build's generated dispatch_table.cpp.
const Table& table();

}  // namespace cutlass_flash::dispatch
