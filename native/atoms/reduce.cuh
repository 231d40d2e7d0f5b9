// The reduce atom: dst[i] = op(srcs[0][i], srcs[1][i], ..., srcs[K-1][i]) with a set of cooperating
// thread blocks ("workers"), K = 1..8 sources known at compile time. Any pointer may be local or a
// peer's NVLink-mapped memory. Composable like the copy atom: a kernel (the plain reduce, later
// SNAC consumers) decides which workers take part and on what range.
//
// Semantics (bitwise those of the CPU engine, engines/cpu.py `_reduce`): each element is
// converted to the accumulator type (arch/numeric.cuh), combined in source order
// ((s0 op s1) op s2) ..., and converted back once. max/min follow torch.maximum/minimum: if
// either operand is NaN the result is NaN (CUDA's fmaxf/fminf would return the other operand).
// When the operands compare equal (only +0 vs -0 can differ) the later source's value is kept,
// like torch's vectorized CPU kernel; torch's own scalar path keeps the earlier one, so the sign
// of a zero from max/min of +0 and -0 is not part of the contract. NaN payloads are not either.
//
// dst may be exactly one of the sources (in place): every element is read from all sources by
// the thread that then writes it. Other overlaps are not allowed.
#pragma once
#include <cstddef>
#include <cstdint>

#include "arch/ldst.cuh"
#include "arch/numeric.cuh"

namespace purlin::atoms {

enum class ReduceOp : int { kSum, kMax, kMin };

template <ReduceOp O> struct Combine;

template <> struct Combine<ReduceOp::kSum> {
  template <class A> static __device__ __forceinline__ A apply(A acc, A x) { return arch::add_rn(acc, x); }
};
// NaN-propagating (torch.maximum): acc if acc is NaN or larger, else x (NaN or not).
template <> struct Combine<ReduceOp::kMax> {
  template <class A> static __device__ __forceinline__ A apply(A acc, A x) {
    return (acc > x || acc != acc) ? acc : x;
  }
};
template <> struct Combine<ReduceOp::kMin> {
  template <class A> static __device__ __forceinline__ A apply(A acc, A x) {
    return (acc < x || acc != acc) ? acc : x;
  }
};

// One element's bits from / to global memory (coherent loads: see arch::ld_stream).
template <class Bits>
__device__ __forceinline__ Bits load_bits(const char* p) {
  if constexpr (sizeof(Bits) == 8) {
    const uint2 v = arch::ld_stream<8>(p);
    return uint64_t(v.x) | (uint64_t(v.y) << 32);
  } else {
    return static_cast<Bits>(arch::ld_stream<int(sizeof(Bits))>(p));
  }
}

template <class Bits>
__device__ __forceinline__ void store_bits(char* p, Bits b) {
  if constexpr (sizeof(Bits) == 8) {
    arch::st_global<8>(p, make_uint2(uint32_t(b), uint32_t(b >> 32)));
  } else {
    arch::st_global<int(sizeof(Bits))>(p, b);
  }
}

// A 16-byte vector as the accumulators of its 16/sizeof(T) elements (element 0 at the lowest
// address), and back.
template <class T>
struct Vec16 {
  using N = arch::Num<T>;
  using Bits = typename N::Bits;
  using Acc = typename N::Acc;
  static constexpr int kElems = 16 / int(sizeof(Bits));

  static __device__ __forceinline__ void unpack(const uint4& v, Acc (&out)[kElems]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(Bits) == 2) {
        out[2 * i] = N::to_acc(Bits(w[i] & 0xffffu));
        out[2 * i + 1] = N::to_acc(Bits(w[i] >> 16));
      } else if constexpr (sizeof(Bits) == 4) {
        out[i] = N::to_acc(w[i]);
      } else if (i % 2 == 0) {
        out[i / 2] = N::to_acc(uint64_t(w[i]) | (uint64_t(w[i + 1]) << 32));
      }
    }
  }

  static __device__ __forceinline__ uint4 pack(const Acc (&in)[kElems]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (sizeof(Bits) == 2) {
        w[i] = N::pack2(in[2 * i], in[2 * i + 1]);
      } else if constexpr (sizeof(Bits) == 4) {
        w[i] = N::from_acc(in[i]);
      } else {
        const uint64_t b = N::from_acc(in[i / 2]);
        w[i] = (i % 2 == 0) ? uint32_t(b) : uint32_t(b >> 32);
      }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }

  // Combine K loaded vectors, in source order, into one stored vector.
  template <ReduceOp O, int K>
  static __device__ __forceinline__ uint4 combine(const uint4 (&v)[K]) {
    Acc acc[kElems];
    unpack(v[0], acc);
#pragma unroll
    for (int k = 1; k < K; ++k) {
      Acc x[kElems];
      unpack(v[k], x);
#pragma unroll
      for (int j = 0; j < kElems; ++j) acc[j] = Combine<O>::apply(acc[j], x[j]);
    }
    return pack(acc);
  }
};

// Body: n_vec 16-byte vectors at dst and at every src (all 16-byte aligned). Worker `worker` of
// `n_workers`, each a block of `lanes` threads (this thread is `lane`). Work goes in tiles of
// lanes*UNROLL vectors, handed out grid-stride; within a tile each thread issues all K*UNROLL
// loads before its first combine, and every load/store of a warp is contiguous (coalesced).
template <class T, ReduceOp O, int K, int UNROLL>
__device__ __forceinline__ void reduce_vectors(char* dst, const char* const (&src)[K], size_t n_vec,
                                               size_t worker, size_t n_workers, unsigned lane,
                                               unsigned lanes) {
  using V = Vec16<T>;
  const size_t tile = size_t(lanes) * UNROLL;
  const size_t full_tiles = n_vec / tile;
  for (size_t t = worker; t < full_tiles; t += n_workers) {
    const size_t i0 = t * tile + lane;
    uint4 v[UNROLL][K];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
      for (int k = 0; k < K; ++k) v[u][k] = arch::ld_stream<16>(src[k] + (i0 + size_t(u) * lanes) * 16);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      arch::st_global<16>(dst + (i0 + size_t(u) * lanes) * 16, V::template combine<O, K>(v[u]));
    }
  }
  // The last partial tile (fewer than lanes*UNROLL vectors), spread over all workers' threads.
  const size_t stride = n_workers * lanes;
  for (size_t i = full_tiles * tile + worker * lanes + lane; i < n_vec; i += stride) {
    uint4 v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] = arch::ld_stream<16>(src[k] + i * 16);
    arch::st_global<16>(dst + i * 16, V::template combine<O, K>(v));
  }
}

// Element-wise: n elements starting at element `first` of dst and of every src, one element per
// thread of the whole set (thread `tid` of `n_threads`), grid-stride. Used for heads and tails
// shorter than a vector, and for sources whose alignment differs from dst's modulo 16.
template <class T, ReduceOp O, int K>
__device__ __forceinline__ void reduce_elements(char* dst, const char* const (&src)[K], size_t first, size_t n,
                                                size_t tid, size_t n_threads) {
  using N = arch::Num<T>;
  using Bits = typename N::Bits;
  constexpr size_t E = sizeof(Bits);
  for (size_t i = tid; i < n; i += n_threads) {
    const size_t off = (first + i) * E;
    Bits b[K];
#pragma unroll
    for (int k = 0; k < K; ++k) b[k] = load_bits<Bits>(src[k] + off);
    typename N::Acc acc = N::to_acc(b[0]);
#pragma unroll
    for (int k = 1; k < K; ++k) acc = Combine<O>::apply(acc, N::to_acc(b[k]));
    store_bits<Bits>(dst + off, N::from_acc(acc));
  }
}

}  // namespace purlin::atoms
