// Attention mask as a window around the bottom-right-aligned diagonal (arch-neutral).
//
// Query row i sees key column j iff  j < seqlen_k  and
//   i + diag - window_left <= j <= i + diag + window_right,   diag = seqlen_k - seqlen_q,
// a negative window bound meaning unbounded on that side. No mask is (-1, -1), causal is (-1, 0).
// The same type tells the mainloop which key blocks a query block touches and how many of them
// need element-wise masking, so kernels skip whole blocks above the diagonal.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace cutlass_flash {

struct WindowMask {
  int seqlen_q, seqlen_k;
  int window_left, window_right;

  __host__ __device__ WindowMask(int sq, int sk, int wl, int wr)
      : seqlen_q(sq), seqlen_k(sk), window_left(wl), window_right(wr) {}

  __host__ __device__ bool has_left() const { return window_left >= 0; }
  __host__ __device__ bool has_right() const { return window_right >= 0; }
  __host__ __device__ int diag() const { return seqlen_k - seqlen_q; }

  // One past the last key block that the query rows [m_begin, m_end) touch.
  template <int kBlockN>
  __host__ __device__ int n_block_end(int m_begin, int m_end) const {
    int n_max = (seqlen_k + kBlockN - 1) / kBlockN;
    if (has_right()) {
      const int last_col = m_end - 1 + diag() + window_right;  // inclusive
      n_max = min(n_max, max(0, last_col + kBlockN) / kBlockN);
    }
    return n_max;
  }

  // Key blocks [n_min, n_max) that the query rows [m_begin, m_begin + kBlockM) touch.
  template <int kBlockM, int kBlockN>
  __host__ __device__ void n_block_range(int m_block, int& n_min, int& n_max) const {
    const int m_begin = m_block * kBlockM;
    n_max = n_block_end<kBlockN>(m_begin, min(m_begin + kBlockM, seqlen_q));
    n_min = 0;
    if (has_left()) {
      const int first_col = m_begin + diag() - window_left;
      n_min = max(0, first_col) / kBlockN;
    }
  }

  // The lowest key block that a left window leaves whole for every row of the query block: key
  // blocks below it are masked on the left (block_needs_mask's third case), those from it on are
  // not. 0 without a left window.
  template <int kBlockM, int kBlockN>
  __host__ __device__ int n_block_left_whole(int m_block) const {
    if (!has_left()) return 0;
    const int edge = m_block * kBlockM + kBlockM - 1 + diag() - window_left;  // first column row m_last sees
    return edge <= 0 ? 0 : (edge + kBlockN - 1) / kBlockN;
  }

  // Query blocks [m_min, m_max) that the key rows [n_begin, n_begin + kBlockN) are seen by.
  template <int kBlockM, int kBlockN>
  __host__ __device__ void m_block_range(int n_block, int& m_min, int& m_max) const {
    const int n_begin = n_block * kBlockN;
    const int n_end = min(n_begin + kBlockN, seqlen_k);
    m_max = (seqlen_q + kBlockM - 1) / kBlockM;
    m_min = 0;
    if (has_right()) {  // row i sees column j when i >= j - diag - window_right
      const int first_row = n_begin - diag() - window_right;
      m_min = max(0, first_row) / kBlockM;
    }
    if (has_left()) {  // row i sees column j when i <= j - diag + window_left
      const int last_row = n_end - 1 - diag() + window_left;
      m_max = min(m_max, max(0, last_row + kBlockM) / kBlockM);
    }
  }

  // Whether key block n_block needs element-wise masking for query block m_block: it crosses
  // the end of the keys or a window edge.
  template <int kBlockM, int kBlockN>
  __host__ __device__ bool block_needs_mask(int m_block, int n_block) const {
    const int m_begin = m_block * kBlockM, m_last = m_begin + kBlockM - 1;
    const int n_begin = n_block * kBlockN, n_last = n_begin + kBlockN - 1;
    if (n_last >= seqlen_k) return true;
    if (has_right() && n_last > m_begin + diag() + window_right) return true;
    if (has_left() && n_begin < m_last + diag() - window_left) return true;
    return false;
  }

  // Sets masked entries of a tile of scores to -inf. `coords` holds each entry's (row, col)
  // within the tile (an identity tensor partitioned like the accumulator), so this works for any
  // MMA layout, mma.sync or wgmma. The window bounds become per-row offsets chosen once, so each
  // entry costs two compares and a select, no branch. kTransposed: the tile is S^T, coords are
  // (key, query) and the offsets (query, key), as the sm90 backward's keys-as-rows layouts compute
  // it.
  //
  // Each entry's (row, col) differs from the first entry's by compile-time constants, and the
  // untransposed form compares those against three thresholds relative to the first entry
  // (immediates against 3 registers): as absolute columns, the compiler held one register per
  // distinct column offset of the thread (7 in the sm90 backward at d = 192, queries as rows, where
  // they spilled 44 B). The transposed form keeps the absolute compares: relative, ptxas spilled
  // 20 B of loop-invariant coordinates in the d = 128 backward's features kernel.
  template <bool kTransposed = false, typename TensorS, typename TensorC>
  __device__ void apply(TensorS& scores, const TensorC& coords, int row_offset, int col_offset) const {
    constexpr int kFar = 1 << 30;  // beyond any column index, with room for row + offset
    const int right = (has_right() ? diag() + window_right + 1 : kFar) + row_offset - col_offset;
    const int left = (has_left() ? diag() - window_left : -kFar) + row_offset - col_offset;
    const int end = seqlen_k - col_offset;
    if constexpr (kTransposed) {
      CUTE_UNROLL
      for (int i = 0; i < cute::size(scores); ++i) {
        const int row = cute::get<1>(coords(i)), col = cute::get<0>(coords(i));
        const bool masked = col >= end || col >= row + right || col < row + left;
        scores(i) = masked ? -INFINITY : scores(i);
      }
    } else {
      // Entry (row0 + dr, col0 + dc) is masked when dc >= end0, dc - dr >= right0 or dc - dr < left0.
      const int row0 = cute::get<0>(coords(0)), col0 = cute::get<1>(coords(0));
      const int right0 = right + row0 - col0, left0 = left + row0 - col0, end0 = end - col0;
      CUTE_UNROLL
      for (int i = 0; i < cute::size(scores); ++i) {
        const int dr = cute::get<0>(coords(i)) - row0, dc = cute::get<1>(coords(i)) - col0;
        const bool masked = dc >= end0 || dc - dr >= right0 || dc - dr < left0;
        scores(i) = masked ? -INFINITY : scores(i);
      }
    }
  }
};

}  // namespace cutlass_flash
