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
  Status s = cuda_status(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
                         "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  if (s.ok() && device < kMaxDevices) done[device].store(true, std::memory_order_release);
  return s;
}

// An attribute of the current device, queried once per device (persistent grids size themselves
// by the multiprocessor count on every call).
template <cudaDeviceAttr kAttr>
Status device_attribute(int& value, const char* what) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_status(err, "cudaGetDevice");
  if (device < kMaxDevices && (value = cached[device].load(std::memory_order_relaxed)) > 0) return Status::Ok();
  if (cudaError_t err = cudaDeviceGetAttribute(&value, kAttr, device); err != cudaSuccess)
    return cuda_status(err, what);
  if (device < kMaxDevices) cached[device].store(value, std::memory_order_relaxed);
  return Status::Ok();
}

// Blocks of kKernel (threads threads, smem bytes of dynamic shared memory, its limit raised by
// ensure_smem_limit) resident per multiprocessor of the current device, queried once per device.
template <auto kKernel>
Status resident_blocks(int threads, int smem, int& blocks) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return cuda_status(err, "cudaGetDevice");
  if (device < kMaxDevices && (blocks = cached[device].load(std::memory_order_relaxed)) > 0) return Status::Ok();
  if (cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, threads, smem);
      err != cudaSuccess)
    return cuda_status(err, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (device < kMaxDevices) cached[device].store(blocks, std::memory_order_relaxed);
  return Status::Ok();
}

inline Status multiprocessor_count(int& count) {
  return device_attribute<cudaDevAttrMultiProcessorCount>(count, "cudaDeviceGetAttribute(MultiProcessorCount)");
}

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

// kNotBuilt (NotImplementedError in Python) before anything is launched when a kernel's tile needs
// more shared memory per block than the device has: the sm80 family's tiles are sized for the
// 163 KiB of an A100 (the sm90 family's for the 227 KiB of an H100), and GPUs of compute
// capability 8.6 / 8.9 (RTX 30xx / 40xx, A10, L4, L40S) have 99 KiB: there
// cudaFuncSetAttribute would fail with a bare "invalid argument".
// The shared memory a block of the current device may opt in to.
inline Status smem_per_block_optin(int& bytes) {
  return device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(
      bytes, "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
}

inline Status check_smem_fits(int smem_bytes, const char* what) {
  int limit = 0;
  if (Status s = smem_per_block_optin(limit); !s.ok()) return s;
  if (smem_bytes <= limit) return Status::Ok();
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess)
    prop.name[0] = '\0';
  return {Status::kNotBuilt,
          std::string("cutlass_flash: the ") + what + " needs " + std::to_string(smem_bytes / 1024) +
              " KiB of shared memory per block, and " + (prop.name[0] ? prop.name : "this GPU") + " (sm" +
              std::to_string(prop.major) + std::to_string(prop.minor) + ") has " + std::to_string(limit / 1024) +
              " KiB; this build has no smaller tile configuration of it for this GPU (kernels whose tiles fit, "
              "at smaller head dims or the forward alone, still run)"};
}

}  // namespace cutlass_flash
