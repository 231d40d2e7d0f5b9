// The plain copy kernel: dst[0:bytes] = src[0:bytes] for arbitrary pointers and sizes.
//
// Host side, plan_copy() picks the widest access width W (16, 8, 4, 2 or 1 bytes) at which dst
// and src agree in alignment, then splits the range into a head (bytes up to the first W-aligned
// dst byte), a body of W-byte vectors and a tail (< W bytes). The kernel copies the body with the
// copy atom and the head and tail byte-wise.
#pragma once
#include <cstddef>
#include <cstdint>

#include "atoms/copy.cuh"
#include "kernels/launch.cuh"

namespace purlin::kernels {

// Compile-time choices of the copy kernel.
struct CopyConfig {
  static constexpr unsigned kThreads = 512;
  static constexpr unsigned kBlocksPerSm = 4;  // 2048 resident threads per SM on sm80/sm90
  static constexpr int kUnroll = 4;            // independent loads in flight per thread (64 B at W=16)
};

// Run-time arguments: the one parameter struct of the copy kernel.
struct CopyParams {
  char* dst;
  const char* src;
  size_t head;   // bytes copied byte-wise before the body
  size_t n_vec;  // W-byte vectors in the body, starting at dst + head (W-aligned)
  size_t tail;   // bytes copied byte-wise after the body
};

template <int W>
__global__ void __launch_bounds__(CopyConfig::kThreads) copy_kernel(CopyParams p) {
  const size_t body_bytes = p.n_vec * W;
  atoms::copy_vectors<W, CopyConfig::kUnroll>(p.dst + p.head, p.src + p.head, p.n_vec, blockIdx.x, gridDim.x,
                                              threadIdx.x, blockDim.x);
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  atoms::copy_bytes(p.dst, p.src, p.head, tid);
  atoms::copy_bytes(p.dst + p.head + body_bytes, p.src + p.head + body_bytes, p.tail, tid);
}

// The widest power of two <= 16 at which dst and src share their misalignment.
inline int copy_width(const void* dst, const void* src) {
  const uintptr_t x = (reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src)) & 15u;
  return x == 0 ? 16 : int(x & (~x + 1));  // lowest set bit
}

inline CopyParams plan_copy(void* dst, const void* src, size_t bytes, int width) {
  CopyParams p{static_cast<char*>(dst), static_cast<const char*>(src), 0, 0, 0};
  const size_t mis = reinterpret_cast<uintptr_t>(dst) & size_t(width - 1);
  p.head = mis == 0 ? 0 : size_t(width) - mis;
  if (p.head > bytes) p.head = bytes;
  p.n_vec = (bytes - p.head) / size_t(width);
  p.tail = bytes - p.head - p.n_vec * size_t(width);
  return p;
}

// Blocks for n_vec vectors: one tile per block up to a full device (or max_blocks if > 0).
inline unsigned copy_blocks(size_t n_vec, int sm_count, int max_blocks) {
  const size_t tile = size_t(CopyConfig::kThreads) * CopyConfig::kUnroll;
  size_t want = (n_vec + tile - 1) / tile;
  size_t cap = size_t(sm_count > 0 ? sm_count : 1) * CopyConfig::kBlocksPerSm;
  if (max_blocks > 0 && size_t(max_blocks) < cap) cap = size_t(max_blocks);
  if (want > cap) want = cap;
  return unsigned(want < 1 ? 1 : want);  // head/tail bytes need one block even with no body
}

template <int W>
inline cudaError_t launch_copy_w(const CopyParams& p, int sm_count, int max_blocks, cudaStream_t stream) {
  LaunchShape shape{copy_blocks(p.n_vec, sm_count, max_blocks), CopyConfig::kThreads, 0};
  return launch(copy_kernel<W>, shape, stream, p);
}

inline cudaError_t launch_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream, int max_blocks) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr || max_blocks < 0) return cudaErrorInvalidValue;
  int sm_count = 0;
  cudaError_t err = current_sm_count(&sm_count);
  if (err != cudaSuccess) return err;
  const int w = copy_width(dst, src);
  const CopyParams p = plan_copy(dst, src, bytes, w);
  switch (w) {
    case 16: return launch_copy_w<16>(p, sm_count, max_blocks, stream);
    case 8: return launch_copy_w<8>(p, sm_count, max_blocks, stream);
    case 4: return launch_copy_w<4>(p, sm_count, max_blocks, stream);
    case 2: return launch_copy_w<2>(p, sm_count, max_blocks, stream);
    default: return launch_copy_w<1>(p, sm_count, max_blocks, stream);
  }
}

}  // namespace purlin::kernels
