// extern "C" entry point of the reduce atom; argument checks and the launch live in
// kernels/reduce_kernel.cuh (its own translation unit: it instantiates dtype x op x nsrc kernels).
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "kernels/reduce_kernel.cuh"
#include "purlin/native.h"

PURLIN_API int purlin_reduce_atom(void* dst, const void* const* srcs, int nsrc, size_t nbytes, int dtype, int op,
                                  void* stream, int max_blocks, int device) {
  const cudaError_t err = purlin::kernels::use_device(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(purlin::kernels::launch_reduce(dst, srcs, nsrc, nbytes, dtype, op,
                                                         static_cast<cudaStream_t>(stream), max_blocks));
}
