// The plain reduce kernel: dst[0:n] = op(srcs[0][0:n], ..., srcs[k-1][0:n]) for k = 1..8 sources.
//
// Host side, plan_reduce() checks the pointers share their misalignment modulo 16 (they are
// element-aligned by contract). If they do, the range splits into a head (elements up to the
// first 16-byte aligned dst address), a body of 16-byte vectors, and a tail (< one vector); the
// kernel reduces the body with the vector atom and the head and tail element-wise. If they do
// not, the whole range goes element-wise (correct, slower; collectives keep buffers aligned).
#pragma once
#include <cstddef>
#include <cstdint>

#include "atoms/reduce.cuh"
#include "kernels/launch.cuh"
#include "purlin/native.h"

namespace purlin::kernels {

// Compile-time choices of the reduce kernel.
struct ReduceConfig {
  static constexpr unsigned kThreads = 512;
  static constexpr unsigned kBlocksPerSm = 2;  // 1024 resident threads per SM, <= 64 registers each
  static constexpr int kMaxSources = 8;
  // Independent 16-byte vectors each thread has in flight per tile: about 8 across all sources
  // (128 B per thread, 128 KB per SM), so few sources get a deeper unroll.
  static constexpr int unroll(int k) { return k >= 5 ? 1 : (k >= 3 ? 2 : (k == 2 ? 4 : 8)); }
};

// Run-time arguments: the one parameter struct of the reduce kernel (passed by value, so the
// source pointers travel in the kernel's parameter space and the host array may be reused).
struct ReduceParams {
  char* dst;
  const char* srcs[ReduceConfig::kMaxSources];  // the first nsrc are used
  int nsrc;
  size_t head;   // elements reduced one by one before the body
  size_t n_vec;  // 16-byte vectors in the body, at element `head` (16-byte aligned in every pointer)
  size_t tail;   // elements reduced one by one after the body
};

template <class T, atoms::ReduceOp O, int K>
__global__ void __launch_bounds__(ReduceConfig::kThreads, ReduceConfig::kBlocksPerSm)
reduce_kernel(ReduceParams p) {
  constexpr size_t E = sizeof(T);
  constexpr size_t kPerVec = 16 / E;
  const char* src[K];
#pragma unroll
  for (int k = 0; k < K; ++k) src[k] = p.srcs[k];
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t n_threads = size_t(gridDim.x) * blockDim.x;
  if (p.n_vec > 0) {
    const char* body[K];
#pragma unroll
    for (int k = 0; k < K; ++k) body[k] = src[k] + p.head * E;
    atoms::reduce_vectors<T, O, K, ReduceConfig::unroll(K)>(p.dst + p.head * E, body, p.n_vec, blockIdx.x,
                                                            gridDim.x, threadIdx.x, blockDim.x);
  }
  atoms::reduce_elements<T, O, K>(p.dst, src, 0, p.head, tid, n_threads);
  atoms::reduce_elements<T, O, K>(p.dst, src, p.head + p.n_vec * kPerVec, p.tail, tid, n_threads);
}

// Element size of a PURLIN_DTYPE_* code, 0 if the code is unknown.
inline size_t reduce_elem_size(int dtype) {
  switch (dtype) {
    case PURLIN_DTYPE_BFLOAT16:
    case PURLIN_DTYPE_FLOAT16: return 2;
    case PURLIN_DTYPE_FLOAT32:
    case PURLIN_DTYPE_INT32: return 4;
    case PURLIN_DTYPE_FLOAT64:
    case PURLIN_DTYPE_INT64: return 8;
    default: return 0;
  }
}

// Split n elements of size E into head / 16-byte body / tail when every pointer agrees with dst
// modulo 16; otherwise everything is "head" (element-wise).
inline ReduceParams plan_reduce(void* dst, const void* const* srcs, int nsrc, size_t n, size_t E) {
  ReduceParams p{};
  p.dst = static_cast<char*>(dst);
  p.nsrc = nsrc;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) & 15u;
  bool same = true;
  for (int k = 0; k < nsrc; ++k) {
    p.srcs[k] = static_cast<const char*>(srcs[k]);
    same = same && ((reinterpret_cast<uintptr_t>(srcs[k]) & 15u) == mis);
  }
  if (!same) {
    p.head = n;
    return p;
  }
  p.head = mis == 0 ? 0 : (16 - mis) / E;
  if (p.head > n) p.head = n;
  const size_t per_vec = 16 / E;
  p.n_vec = (n - p.head) / per_vec;
  p.tail = n - p.head - p.n_vec * per_vec;
  return p;
}

// Blocks: enough for one tile per block (or one element per thread of the element-wise part),
// up to a full device (or max_blocks if > 0).
inline unsigned reduce_blocks(const ReduceParams& p, int unroll, int sm_count, int max_blocks) {
  const size_t tile = size_t(ReduceConfig::kThreads) * unroll;
  size_t want = (p.n_vec + tile - 1) / tile;
  const size_t scalar = (p.head + p.tail + ReduceConfig::kThreads - 1) / ReduceConfig::kThreads;
  if (scalar > want) want = scalar;
  size_t cap = size_t(sm_count > 0 ? sm_count : 1) * ReduceConfig::kBlocksPerSm;
  if (max_blocks > 0 && size_t(max_blocks) < cap) cap = size_t(max_blocks);
  if (want > cap) want = cap;
  return unsigned(want < 1 ? 1 : want);
}

template <class T, atoms::ReduceOp O, int K>
inline cudaError_t launch_reduce_k(const ReduceParams& p, int sm_count, int max_blocks, cudaStream_t stream) {
  LaunchShape shape{reduce_blocks(p, ReduceConfig::unroll(K), sm_count, max_blocks), ReduceConfig::kThreads, 0};
  return launch(reduce_kernel<T, O, K>, shape, stream, p);
}

template <class T, atoms::ReduceOp O>
inline cudaError_t launch_reduce_op(const ReduceParams& p, int sm_count, int max_blocks, cudaStream_t stream) {
  switch (p.nsrc) {
    case 1: return launch_reduce_k<T, O, 1>(p, sm_count, max_blocks, stream);
    case 2: return launch_reduce_k<T, O, 2>(p, sm_count, max_blocks, stream);
    case 3: return launch_reduce_k<T, O, 3>(p, sm_count, max_blocks, stream);
    case 4: return launch_reduce_k<T, O, 4>(p, sm_count, max_blocks, stream);
    case 5: return launch_reduce_k<T, O, 5>(p, sm_count, max_blocks, stream);
    case 6: return launch_reduce_k<T, O, 6>(p, sm_count, max_blocks, stream);
    case 7: return launch_reduce_k<T, O, 7>(p, sm_count, max_blocks, stream);
    case 8: return launch_reduce_k<T, O, 8>(p, sm_count, max_blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <class T>
inline cudaError_t launch_reduce_t(const ReduceParams& p, int op, int sm_count, int max_blocks, cudaStream_t stream) {
  switch (op) {
    case PURLIN_REDUCE_SUM: return launch_reduce_op<T, atoms::ReduceOp::kSum>(p, sm_count, max_blocks, stream);
    case PURLIN_REDUCE_MAX: return launch_reduce_op<T, atoms::ReduceOp::kMax>(p, sm_count, max_blocks, stream);
    case PURLIN_REDUCE_MIN: return launch_reduce_op<T, atoms::ReduceOp::kMin>(p, sm_count, max_blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

// Checks every argument (codes, counts, null pointers, element alignment) before touching the
// device; nbytes == 0 with valid codes is a no-op. Returns the launch's cudaError_t.
inline cudaError_t launch_reduce(void* dst, const void* const* srcs, int nsrc, size_t nbytes, int dtype, int op,
                                 cudaStream_t stream, int max_blocks) {
  const size_t E = reduce_elem_size(dtype);
  if (E == 0 || op < PURLIN_REDUCE_SUM || op > PURLIN_REDUCE_MIN) return cudaErrorInvalidValue;
  if (nsrc < 1 || nsrc > ReduceConfig::kMaxSources || srcs == nullptr || max_blocks < 0) return cudaErrorInvalidValue;
  if (nbytes % E != 0) return cudaErrorInvalidValue;
  if (nbytes == 0) return cudaSuccess;
  if (dst == nullptr || reinterpret_cast<uintptr_t>(dst) % E != 0) return cudaErrorInvalidValue;
  for (int k = 0; k < nsrc; ++k) {
    if (srcs[k] == nullptr || reinterpret_cast<uintptr_t>(srcs[k]) % E != 0) return cudaErrorInvalidValue;
  }
  int sm_count = 0;
  cudaError_t err = current_sm_count(&sm_count);
  if (err != cudaSuccess) return err;
  const ReduceParams p = plan_reduce(dst, srcs, nsrc, nbytes / E, E);
  switch (dtype) {
    case PURLIN_DTYPE_BFLOAT16: return launch_reduce_t<__nv_bfloat16>(p, op, sm_count, max_blocks, stream);
    case PURLIN_DTYPE_FLOAT16: return launch_reduce_t<__half>(p, op, sm_count, max_blocks, stream);
    case PURLIN_DTYPE_FLOAT32: return launch_reduce_t<float>(p, op, sm_count, max_blocks, stream);
    case PURLIN_DTYPE_FLOAT64: return launch_reduce_t<double>(p, op, sm_count, max_blocks, stream);
    case PURLIN_DTYPE_INT32: return launch_reduce_t<int32_t>(p, op, sm_count, max_blocks, stream);
    case PURLIN_DTYPE_INT64: return launch_reduce_t<int64_t>(p, op, sm_count, max_blocks, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace purlin::kernels
