// Element-type conversion of register tensors (arch-neutral).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace cutlass_flash {

// Converts a register tensor element-wise (packed conversions: F2FP for half/bf16 pairs).
template <typename To, typename Engine, typename Layout>
__device__ __forceinline__ auto convert_type(const cute::Tensor<Engine, Layout>& src) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(cute::size(src))::value;
  cute::Tensor dst = cute::make_tensor<To>(src.layout());
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
  return dst;
}

}  // namespace cutlass_flash
