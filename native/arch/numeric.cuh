// Element types of the reduce path: how the bits of one element become an accumulator value and
// back. The only place the reduce path names conversion intrinsics; atoms/reduce.cuh composes
// these with the loads and stores of arch/ldst.cuh.
//
// Semantics follow the CPU engine (engines/cpu.py `_reduce`, i.e. torch on the CPU):
//   bf16, fp16  accumulate in float32; float -> 16-bit rounds to nearest even (torch's .to()).
//   fp32, fp64  accumulate in their own type, IEEE add with round-to-nearest (no FMA, no FTZ:
//               the library is built without --use_fast_math).
//   int32/64    accumulate in their own type; sum wraps modulo 2^32 / 2^64 like torch's.
#pragma once
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace purlin::arch {

// Num<T>: Bits = the unsigned word that holds one element, Acc = the accumulator type.
template <class T> struct Num;

template <> struct Num<__nv_bfloat16> {
  using Bits = uint16_t;
  using Acc = float;
  // bf16 -> f32 is exact: the 16 bits are the top half of the float.
  static __device__ __forceinline__ Acc to_acc(Bits b) { return __uint_as_float(uint32_t(b) << 16); }
  static __device__ __forceinline__ Bits from_acc(Acc x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
  // Two accumulators to one 32-bit word (lo in bits 0-15): one cvt.rn.bf16x2.f32 on sm80+.
  static __device__ __forceinline__ uint32_t pack2(Acc lo, Acc hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return uint32_t(__bfloat16_as_ushort(v.x)) | (uint32_t(__bfloat16_as_ushort(v.y)) << 16);
  }
};

template <> struct Num<__half> {
  using Bits = uint16_t;
  using Acc = float;
  static __device__ __forceinline__ Acc to_acc(Bits b) { return __half2float(__ushort_as_half(b)); }
  static __device__ __forceinline__ Bits from_acc(Acc x) { return __half_as_ushort(__float2half_rn(x)); }
  static __device__ __forceinline__ uint32_t pack2(Acc lo, Acc hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return uint32_t(__half_as_ushort(v.x)) | (uint32_t(__half_as_ushort(v.y)) << 16);
  }
};

template <> struct Num<float> {
  using Bits = uint32_t;
  using Acc = float;
  static __device__ __forceinline__ Acc to_acc(Bits b) { return __uint_as_float(b); }
  static __device__ __forceinline__ Bits from_acc(Acc x) { return __float_as_uint(x); }
};

template <> struct Num<double> {
  using Bits = uint64_t;
  using Acc = double;
  static __device__ __forceinline__ Acc to_acc(Bits b) { return __longlong_as_double(static_cast<long long>(b)); }
  static __device__ __forceinline__ Bits from_acc(Acc x) { return static_cast<Bits>(__double_as_longlong(x)); }
};

template <> struct Num<int32_t> {
  using Bits = uint32_t;
  using Acc = int32_t;
  static __device__ __forceinline__ Acc to_acc(Bits b) { return static_cast<Acc>(b); }
  static __device__ __forceinline__ Bits from_acc(Acc x) { return static_cast<Bits>(x); }
};

template <> struct Num<int64_t> {
  using Bits = uint64_t;
  using Acc = int64_t;
  static __device__ __forceinline__ Acc to_acc(Bits b) { return static_cast<Acc>(b); }
  static __device__ __forceinline__ Bits from_acc(Acc x) { return static_cast<Bits>(x); }
};

// Round-to-nearest adds, spelled out so the compiler never contracts or reassociates them.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
// Integer sums wrap (two's complement), computed unsigned so that overflow is defined.
__device__ __forceinline__ int32_t add_rn(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}
__device__ __forceinline__ int64_t add_rn(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

}  // namespace purlin::arch
