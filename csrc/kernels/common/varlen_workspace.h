// Where the tile lists of a packed batch (common/varlen_tiles.h) live in the callers' workspaces,
// and their sizes: host code (csrc/dispatch/api.cpp sizes the workspaces) and kernels alike.
//
// A list is a 16-byte header (int 0: the tile count; int 1: the forward's tile counter, zeroed
// with it) and the tiles. Its capacity is a bound the host knows without reading cu_seqlens; the
// workspace is sized for the smallest block any kernel lists by, so one size serves every
// instantiation of a family.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cutlass_flash/params.h"
#include "generated/bwd_workspace.h"

namespace cutlass_flash {

constexpr int kVarlenMinBlock = 16;
constexpr size_t kVarlenListHeaderBytes = 16;

// Tiles of at most `block` rows over sequences of `total` rows in all: sum of ceil(len_b / block)
// <= (total + batch * (block - 1)) / block when cu_seqlens is monotone. Other content is cut at this bound (wrong
// numbers, never an access outside the list).
CUTLASS_FLASH_HOST_DEVICE inline int64_t varlen_tile_capacity(int total, int batch, int block) {
  return (int64_t(total) + int64_t(batch) * (block - 1)) / block;
}

CUTLASS_FLASH_HOST_DEVICE inline size_t varlen_list_bytes(int total, int batch, int block) {
  return align_up(kVarlenListHeaderBytes + size_t(varlen_tile_capacity(total, batch, block)) * 8, 16);
}

// Forward: one list of query blocks at the workspace's start (its header's second int is the
// sm90 tile counter, so the family's dense bytes are not added).
inline size_t fwd_varlen_bytes(const AttnProblem& p) {
  return p.is_varlen() ? varlen_list_bytes(p.total_q, p.batch, kVarlenMinBlock) : 0;
}

// Backward: after the BwdWorkspace arrays, the query rows in kBwdRowAlign tiles (preprocess and
// dQ conversion), then the main kernel's key blocks.
inline size_t bwd_varlen_q_bytes(const AttnProblem& p) {
  return p.is_varlen() ? varlen_list_bytes(p.total_q, p.batch, kBwdRowAlign) : 0;
}
inline size_t bwd_varlen_bytes(const AttnProblem& p) {
  return p.is_varlen() ? bwd_varlen_q_bytes(p) + varlen_list_bytes(p.total_k, p.batch, kVarlenMinBlock) : 0;
}

}  // namespace cutlass_flash
