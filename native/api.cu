// extern "C" CUDA entry points of purlin_sglang._native. The binding layer only checks and
// converts arguments; each kernel lives in kernels/ and launches through kernels::launch().
#include <cuda_runtime.h>

#include "kernels/bulk_copy_kernel.cuh"
#include "kernels/copy_kernel.cuh"
#include "kernels/launch.cuh"
#include "purlin/native.h"

PURLIN_API const char* purlin_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

PURLIN_API int purlin_cuda_device_count(int* count) {
  if (count == nullptr) return cudaErrorInvalidValue;
  *count = 0;
  return static_cast<int>(cudaGetDeviceCount(count));
}

PURLIN_API int purlin_native_last_device(void) { return purlin::kernels::last_device().load(); }

PURLIN_API int purlin_copy_atom(void* dst, const void* src, size_t bytes, void* stream, int max_blocks, int device) {
  const cudaError_t err = purlin::kernels::use_device(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(
      purlin::kernels::launch_copy(dst, src, bytes, static_cast<cudaStream_t>(stream), max_blocks));
}

PURLIN_API int purlin_copy_atom_bulk(void* dst, const void* src, size_t bytes, void* stream, int max_blocks,
                                     int device) {
  const cudaError_t err = purlin::kernels::use_device(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(
      purlin::kernels::launch_bulk_copy(dst, src, bytes, static_cast<cudaStream_t>(stream), max_blocks));
}
