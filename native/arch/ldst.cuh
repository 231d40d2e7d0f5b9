// Raw global-memory loads and stores, one per access width (1, 2, 4, 8, 16 bytes).
// The only place the copy path spells PTX; atoms compose these. Pointers may be local or
// a peer's NVLink-mapped memory (generic addressing of global memory).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace purlin::arch {

// The register type that carries one access of W bytes.
template <int W> struct Vec;
template <> struct Vec<1> { using type = uint8_t; };
template <> struct Vec<2> { using type = uint16_t; };
template <> struct Vec<4> { using type = uint32_t; };
template <> struct Vec<8> { using type = uint2; };
template <> struct Vec<16> { using type = uint4; };

// Streaming load: coherent (not .nc, so data written by a peer after an acquire is seen), and
// not kept in L1 because a copy reads each byte once.
template <int W>
__device__ __forceinline__ typename Vec<W>::type ld_stream(const void* p) {
  using T = typename Vec<W>::type;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  if constexpr (W == 16) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else if constexpr (W == 8) {
    uint2 v;
    asm volatile("ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
  } else if constexpr (W == 4) {
    uint32_t v;
    asm volatile("ld.global.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
  } else {
    return *static_cast<const T*>(p);
  }
#else
  return *static_cast<const T*>(p);
#endif
}

template <int W>
__device__ __forceinline__ void st_global(void* p, typename Vec<W>::type v) {
  if constexpr (W == 16) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :
                 : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
  } else if constexpr (W == 8) {
    asm volatile("st.global.v2.u32 [%0], {%1, %2};" : : "l"(p), "r"(v.x), "r"(v.y) : "memory");
  } else {
    *static_cast<typename Vec<W>::type*>(p) = v;
  }
}

}  // namespace purlin::arch
