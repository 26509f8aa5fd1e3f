// Accumulator tiles out through shared memory, shared by both families: 16-bit values put at their
// (row, col) of a shared tile two columns at a time, then whole rows written to global memory in
// 16-byte stores.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

namespace cutlass_flash {

// Converted 16-bit accumulator values `r` to their places in a shared tile (`dst`: the tile
// partitioned as the accumulator), two consecutive columns per 4-byte store.
template <typename Regs, typename Dst>
__device__ __forceinline__ void store_pairs(const Regs& r, Dst&& dst) {
  static_assert(decltype(cute::size<0, 0>(r))::value == 2, "accumulator pairs are two consecutive columns");
  CUTE_UNROLL
  for (int i = 0; i < cute::size(r); i += 2)
    *reinterpret_cast<uint32_t*>(&dst(i)) = uint32_t(r(i).raw()) | uint32_t(r(i + 1).raw()) << 16;
}

// Rows [first, first + kRows) of the (row, col) shared tile `s` to `dst`'s rows of the same index
// (row stride `row_stride` elements) in 16-byte stores by kThreads threads (tid in [0, kThreads));
// rows at or past `rows_left`, and columns at or past `cols` (the tensor's own width,
// AttnProblem::cols), are left alone. `s` keeps 8 consecutive columns from a multiple of 8
// contiguous (a padded row or a 16-byte swizzle). kUnroll = false keeps the loop rolled, where
// unrolled it spilled (the forward's partial slab).
template <int kRows, int kCols, int kThreads, bool kUnroll = true, typename Smem, typename Element>
__device__ __forceinline__ void store_rows_16b(const Smem& s, int first, Element* dst, int64_t row_stride,
                                               int rows_left, int cols, int tid) {
  constexpr int kChunks = kCols * int(sizeof(Element)) / 16;  // 16-byte chunks per row
  static_assert(kRows * kChunks % kThreads == 0);
  auto copy_chunk = [&](int i) {
    const int row = first + i / kChunks, col = i % kChunks * 8;
    if (row < rows_left && col < cols)
      *reinterpret_cast<uint4*>(dst + int64_t(row) * row_stride + col) = *reinterpret_cast<const uint4*>(&s(row, col));
  };
  if constexpr (kUnroll) {
    CUTE_UNROLL
    for (int k = 0; k < kRows * kChunks / kThreads; ++k) copy_chunk(tid + kThreads * k);
  } else {
#pragma unroll 1
    for (int i = tid; i < kRows * kChunks; i += kThreads) copy_chunk(i);
  }
}

// Zeros to rows [0, min(kRows, rows_left)) and columns [0, cols) of `dst` (row stride
// `row_stride` elements), in 16-byte stores by kThreads threads (tid in [0, kThreads)).
template <int kRows, int kCols, int kThreads, typename Element>
__device__ __forceinline__ void zero_rows_16b(Element* dst, int64_t row_stride, int rows_left, int cols, int tid) {
  constexpr int kChunks = kCols * int(sizeof(Element)) / 16;  // 16-byte chunks per row
#pragma unroll 1
  for (int i = tid; i < kRows * kChunks; i += kThreads) {
    const int row = i / kChunks, col = i % kChunks * 8;
    if (row < rows_left && col < cols)
      *reinterpret_cast<uint4*>(dst + int64_t(row) * row_stride + col) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace cutlass_flash
