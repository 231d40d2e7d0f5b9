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

// The device this library's runtime last launched on or queried (-1: none yet); purlin_native_last_device.
inline std::atomic<int>& last_device() {
  static std::atomic<int> device{-1};
  return device;
}

// Make `device` the calling thread's current device of this library's (static) runtime; -1 keeps
// the current one. Every entry point calls this before it launches or queries a device: the runtime
// keeps its own current device, which need not be the one of the caller's stream (torch's).
// cudaSetDevice only when the device differs (as torch's device guard does; so nothing changes in
// the common case, also during graph capture). Nothing is restored. *used (optional): the device
// now current.
inline cudaError_t use_device(int device, int* used = nullptr) {
  int dev = -1;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess && device >= 0 && device != dev) {
    err = cudaSetDevice(device);
    dev = device;
  }
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // returned here; not left for the next launch's cudaGetLastError to report
    return err;
  }
  last_device().store(dev, std::memory_order_relaxed);
  if (used != nullptr) *used = dev;
  return cudaSuccess;
}

constexpr int kMaxDevices = 64;

template <class Params>
inline cudaError_t launch(void (*kernel)(Params), LaunchShape shape, cudaStream_t stream, const Params& params) {
  if (shape.blocks == 0) return cudaSuccess;  // nothing to do
  kernel<<<shape.blocks, shape.threads, shape.smem_bytes, stream>>>(params);
  return cudaGetLastError();
}

// A positive per-device value, computed once by compute(dev, &value) and kept in cache[dev] (cheap
// after the first call, and legal during graph capture).
template <class F>
inline cudaError_t per_device_cached(std::atomic<int>* cache, int dev, int* out, F compute) {
  const bool keep = dev >= 0 && dev < kMaxDevices;
  if (keep) {
    const int v = cache[dev].load(std::memory_order_relaxed);
    if (v > 0) {
      *out = v;
      return cudaSuccess;
    }
  }
  int v = 0;
  const cudaError_t err = compute(dev, &v);
  if (err != cudaSuccess) return err;
  if (keep && v > 0) cache[dev].store(v, std::memory_order_relaxed);
  *out = v;
  return cudaSuccess;
}

// Multiprocessor count of device `dev`.
inline cudaError_t device_sm_count(int dev, int* out) {
  static std::atomic<int> cache[kMaxDevices] = {};
  return per_device_cached(cache, dev, out, [](int d, int* v) {
    return cudaDeviceGetAttribute(v, cudaDevAttrMultiProcessorCount, d);
  });
}

// The same for the current device of this library's runtime.
inline cudaError_t current_sm_count(int* out) {
  int dev = 0;
  const cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  return device_sm_count(dev, out);
}

// Resident blocks per SM of `kernel` at `threads` threads on the current device. Loads the kernel
// now: with lazy module loading, a first launch while another rank's kernel spins could need a
// context synchronization (a deadlock for co-resident ranks).
template <class Params>
inline cudaError_t blocks_per_sm(void (*kernel)(Params), unsigned threads, int* out) {
  cudaFuncAttributes attr;
  const cudaError_t err = cudaFuncGetAttributes(&attr, kernel);
  if (err != cudaSuccess) return err;
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, kernel, int(threads), 0);
}

// For kernels whose blocks wait for each other: make `device` current (use_device), then refuse a
// grid of `blocks` blocks that cannot all be resident at once (cudaErrorCooperativeLaunchTooLarge,
// nothing launched) instead of letting it hang. per_sm(dev, &n): resident blocks per SM on dev.
template <class F>
inline cudaError_t use_device_coresident(int device, long long blocks, F per_sm) {
  int dev = 0, n = 0, sms = 0;
  cudaError_t err = use_device(device, &dev);
  if (err == cudaSuccess) err = per_sm(dev, &n);
  if (err == cudaSuccess) err = device_sm_count(dev, &sms);
  if (err != cudaSuccess) return err;
  return blocks > static_cast<long long>(n) * sms ? cudaErrorCooperativeLaunchTooLarge : cudaSuccess;
}

// (per_sm(dev, ...) on `device`, made current; its SM count): the occupancy entry points.
template <class F>
inline cudaError_t device_occupancy(int device, F per_sm, int* blocks_per_sm, int* sm_count) {
  if (blocks_per_sm == nullptr || sm_count == nullptr || device < -1) return cudaErrorInvalidValue;
  int dev = 0;
  cudaError_t err = use_device(device, &dev);
  if (err == cudaSuccess) err = per_sm(dev, blocks_per_sm);
  if (err == cudaSuccess) err = device_sm_count(dev, sm_count);
  return err;
}

}  // namespace purlin::kernels
