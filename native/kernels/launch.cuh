// The one generic launcher: every kernel takes ONE parameter struct by value, and every entry
// point launches through launch(), which returns the launch's cudaError_t (never aborts).
#pragma once
#include <atomic>
#include <cuda_runtime.h>

namespace purlin::kernels {

struct LaunchShape {
  unsigned blocks = 0;
  unsigned threads = 0;
  size_t smem_bytes = 0;
};

template <class Params>
inline cudaError_t launch(void (*kernel)(Params), LaunchShape shape, cudaStream_t stream, const Params& params) {
  if (shape.blocks == 0) return cudaSuccess;  // nothing to do
  kernel<<<shape.blocks, shape.threads, shape.smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

// Multiprocessor count of the current device, cached per device (cheap after the first call,
// and legal during graph capture).
inline cudaError_t current_sm_count(int* out) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices) {
    int v = cache[dev].load(std::memory_order_relaxed);
    if (v > 0) {
      *out = v;
      return cudaSuccess;
    }
  }
  int v = 0;
  err = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(v, std::memory_order_relaxed);
  *out = v;
  return cudaSuccess;
}

}  // namespace purlin::kernels
