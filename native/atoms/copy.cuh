// The copy atom: move n_vec vectors of W bytes from src to dst with a set of cooperating thread
// blocks ("workers"). Composable: a kernel (the plain copy, later SNAC consumers) decides which
// workers take part and on what range. Both pointers must be W-aligned; see plan_copy() in
// kernels/copy_kernel.cuh for how arbitrary pointers are split into head, body and tail.
#pragma once
#include <cstddef>

#include "arch/ldst.cuh"

namespace purlin::atoms {

// Worker `worker` of `n_workers`, each a block of `lanes` threads (this thread is `lane`).
// Work goes in tiles of lanes*UNROLL vectors, handed out grid-stride; within a tile each thread
// issues UNROLL independent loads before its first store, and every load/store of the warp is
// contiguous (coalesced).
template <int W, int UNROLL>
__device__ __forceinline__ void copy_vectors(void* __restrict__ dst, const void* __restrict__ src,
                                             size_t n_vec, size_t worker, size_t n_workers,
                                             unsigned lane, unsigned lanes) {
  using T = typename arch::Vec<W>::type;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t tile = size_t(lanes) * UNROLL;
  const size_t full_tiles = n_vec / tile;
  for (size_t t = worker; t < full_tiles; t += n_workers) {
    const size_t i0 = t * tile + lane;
    T v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) v[u] = arch::ld_stream<W>(s + (i0 + size_t(u) * lanes) * W);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) arch::st_global<W>(d + (i0 + size_t(u) * lanes) * W, v[u]);
  }
  // The last partial tile (fewer than lanes*UNROLL vectors), spread over all workers' threads.
  const size_t stride = n_workers * lanes;
  for (size_t i = full_tiles * tile + worker * lanes + lane; i < n_vec; i += stride) {
    arch::st_global<W>(d + i * W, arch::ld_stream<W>(s + i * W));
  }
}

// Byte-wise copy of a few bytes (a head or tail shorter than one vector): thread `tid` of the
// whole set copies byte tid.
__device__ __forceinline__ void copy_bytes(void* dst, const void* src, size_t n, size_t tid) {
  if (tid < n) static_cast<char*>(dst)[tid] = static_cast<const char*>(src)[tid];
}

}  // namespace purlin::atoms
