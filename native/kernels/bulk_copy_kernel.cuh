// The Hopper bulk copy kernel: dst[0:bytes] = src[0:bytes] through shared memory with the TMA
// engine (arch/bulk.cuh), for pointers that agree in their 16-byte misalignment.
//
// One thread per block drives a ring of kStages tiles of kTile bytes: bulk loads complete on one
// mbarrier per stage, a tile's bulk store is issued as soon as its load lands, and a stage is
// loaded again once the store issued before it has read it. Tiles are dealt to blocks round-robin.
// The other threads copy the head (bytes before the first 16-aligned dst byte) and the tail
// (< 16 bytes) byte-wise. Launching it needs sm_90 code in the binary: launch_bulk_copy() refuses
// (cudaErrorNotSupported) on older GPUs, on builds without sm_90, and for misaligned pairs.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "arch/bulk.cuh"
#include "atoms/copy.cuh"
#include "kernels/copy_kernel.cuh"
#include "kernels/launch.cuh"

namespace purlin::kernels {

struct BulkConfig {
  static constexpr unsigned kThreads = 32;
  static constexpr uint32_t kTile = 16384;  // bytes per bulk operation
  static constexpr int kStages = 4;         // tiles in flight per block (64 KiB of shared memory)
  static constexpr unsigned kBlocksPerSm = 2;
  static constexpr size_t kSmem = size_t(kTile) * kStages;
};

struct BulkParams {
  char* dst;
  const char* src;
  size_t head;  // bytes before the body, copied byte-wise
  size_t body;  // bytes of the body: a multiple of 16, dst + head and src + head 16-byte aligned
  size_t tail;  // bytes after the body, copied byte-wise
};

__global__ void __launch_bounds__(BulkConfig::kThreads) bulk_copy_kernel(BulkParams p) {
#ifdef PURLIN_HAS_BULK
  extern __shared__ __align__(128) char stage[];
  __shared__ uint64_t bar[BulkConfig::kStages];
  constexpr uint32_t T = BulkConfig::kTile;
  constexpr int S = BulkConfig::kStages;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  atoms::copy_bytes(p.dst, p.src, p.head, tid);
  atoms::copy_bytes(p.dst + p.head + p.body, p.src + p.head + p.body, p.tail, tid);
  const size_t tiles = (p.body + T - 1) / T;
  if (threadIdx.x != 0 || blockIdx.x >= tiles) return;
  const size_t mine = (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
  char* dst = p.dst + p.head;
  const char* src = p.src + p.head;
  for (int s = 0; s < S; ++s) arch::mbar_init(&bar[s], 1);
  arch::mbar_init_fence();
  auto offset = [&](size_t i) { return (blockIdx.x + i * gridDim.x) * size_t(T); };
  auto length = [&](size_t off) { return uint32_t(p.body - off < T ? p.body - off : T); };
  auto load = [&](size_t i) {
    const int s = int(i % S);
    const size_t off = offset(i);
    const uint32_t n = length(off);
    arch::mbar_arrive_expect_tx(&bar[s], n);
    arch::bulk_load(stage + size_t(s) * T, src + off, n, &bar[s]);
  };
  for (size_t i = 0; i < mine && i < size_t(S); ++i) load(i);
  for (size_t i = 0; i < mine; ++i) {
    const int s = int(i % S);
    while (!arch::mbar_try_wait(&bar[s], uint32_t((i / S) & 1))) {
    }
    const size_t off = offset(i);
    arch::bulk_store(dst + off, stage + size_t(s) * T, length(off));
    arch::bulk_commit();
    if (i >= 1 && i - 1 + S < mine) {  // the store of tile i - 1 has read its stage: load it again
      arch::bulk_wait_read<1>();
      load(i - 1 + S);
    }
  }
  arch::bulk_wait_all();
#endif
}

// Whether this build has sm_90+ code of the bulk kernel for the current device (cached per device).
inline cudaError_t bulk_copy_supported(bool* ok) {
  static std::atomic<int> cache[kMaxDevices] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  const int known = dev >= 0 && dev < kMaxDevices ? cache[dev].load(std::memory_order_relaxed) : 0;
  if (known != 0) {
    *ok = known == 1;
    return cudaSuccess;
  }
  int major = 0;
  err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err != cudaSuccess) return err;
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, bulk_copy_kernel);
  if (err != cudaSuccess) return err;
  *ok = major >= 9 && attr.binaryVersion >= 90;  // the kernel body is empty below sm_90
  if (*ok) {
    err = cudaFuncSetAttribute(bulk_copy_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(BulkConfig::kSmem));
    if (err != cudaSuccess) return err;
  }
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(*ok ? 1 : 2, std::memory_order_relaxed);
  return cudaSuccess;
}

inline cudaError_t launch_bulk_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream, int max_blocks) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr || max_blocks < 0) return cudaErrorInvalidValue;
  if (copy_width(dst, src) != 16) return cudaErrorNotSupported;  // bulk copies need 16-byte agreement
  bool ok = false;
  cudaError_t err = bulk_copy_supported(&ok);
  if (err != cudaSuccess) return err;
  if (!ok) return cudaErrorNotSupported;
  int sm_count = 0;
  err = current_sm_count(&sm_count);
  if (err != cudaSuccess) return err;
  BulkParams p{static_cast<char*>(dst), static_cast<const char*>(src), 0, 0, 0};
  const size_t mis = reinterpret_cast<uintptr_t>(dst) & 15u;
  p.head = mis == 0 ? 0 : 16 - mis;
  if (p.head > bytes) p.head = bytes;
  p.body = (bytes - p.head) / 16 * 16;
  p.tail = bytes - p.head - p.body;
  size_t blocks = (p.body + BulkConfig::kTile - 1) / BulkConfig::kTile;
  size_t cap = size_t(sm_count > 0 ? sm_count : 1) * BulkConfig::kBlocksPerSm;
  if (max_blocks > 0 && size_t(max_blocks) < cap) cap = size_t(max_blocks);
  if (blocks > cap) blocks = cap;
  if (blocks < 1) blocks = 1;  // head / tail bytes need one block even with no body
  LaunchShape shape{unsigned(blocks), BulkConfig::kThreads, BulkConfig::kSmem};
  return launch(bulk_copy_kernel, shape, stream, p);
}

}  // namespace purlin::kernels
