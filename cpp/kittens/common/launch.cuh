// Host-side launch helpers.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace kittens {

// Raise a kernel's dynamic shared-memory limit once per device (the attribute is per device,
// and one process may drive several GPUs). Cheap after the first call; never synchronises.
// `Kernel` is a template argument (not a function parameter) so that each kernel gets its own
// record: kernels with the same signature must not share one.
template <auto Kernel>
cudaError_t allow_dynamic_shared(int bytes) {
  static std::atomic<uint64_t> done_devices{0};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? (uint64_t(1) << device) : 0;
  if (bit && (done_devices.load(std::memory_order_relaxed) & bit)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && bit) done_devices.fetch_or(bit, std::memory_order_relaxed);
  return err;
}

// The current device's multiprocessor count (e.g. to size a persistent grid), looked up
// once per device.
inline cudaError_t multiprocessor_count(int* count) {
  static std::atomic<int> counts[64] = {};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  if (device < 64 && (*count = counts[device].load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  if (cudaError_t err = cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device); err != cudaSuccess)
    return err;
  if (device < 64) counts[device].store(*count, std::memory_order_relaxed);
  return cudaSuccess;
}

// Launch `Kernel` on `stream` with `bytes` of dynamic shared memory, raising its limit first;
// returns the launch status, never synchronises.
template <auto Kernel, typename... Args>
cudaError_t launch_with_shared(dim3 grid, int threads, int bytes, cudaStream_t stream, const Args&... args) {
  if (cudaError_t err = allow_dynamic_shared<Kernel>(bytes); err != cudaSuccess) return err;
  Kernel<<<grid, threads, bytes, stream>>>(args...);
  return cudaGetLastError();
}

}  // namespace kittens
