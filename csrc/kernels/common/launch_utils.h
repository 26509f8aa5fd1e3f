// Host-side helpers shared by the launchers of every kernel family.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <string>

#include "cutlass_flash/api.h"

namespace cutlass_flash {

inline Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return {Status::kCudaError, std::string(what) + ": " + cudaGetErrorString(err)};
}

// Raises a kernel's dynamic shared-memory limit once per device (cudaFuncSetAttribute is per
// device), so the per-call path does no attribute work after the first launch. The flags are per
// kernel: a template parameter, not the kernel's type, which every kernel of a direction shares.
template <auto kKernel>
Status ensure_smem_limit(int smem_bytes) {
  if (smem_bytes <= 48 * 1024) return Status::Ok();
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices] = {};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_status(err, "cudaGetDevice");
  if (device < kMaxDevices && done[device].load(std::memory_order_acquire)) return Status::Ok();
  Status s = cuda_status(
      cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
      "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (s.ok() && device < kMaxDevices) done[device].store(true, std::memory_order_release);
  return s;
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// An attribute of the current device, queried once per device (persistent grids size themselves
// by the multiprocessor count on every call).
template <cudaDeviceAttr kAttr>
Status device_attribute(int& value, const char* what) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_status(err, "cudaGetDevice");
  if (device < kMaxDevices && (value = cached[device].load(std::memory_order_relaxed)) > 0) return Status::Ok();
  if (cudaError_t err = cudaDeviceGetAttribute(&value, kAttr, device); err != cudaSuccess) return cuda_status(err, what);
  if (device < kMaxDevices) cached[device].store(value, std::memory_order_relaxed);
  return Status::Ok();
}

inline Status multiprocessor_count(int& count) {
  return device_attribute<cudaDevAttrMultiProcessorCount>(count, "cudaDeviceGetAttribute(MultiProcessorCount)");
}

}  // namespace cutlass_flash
