// extern "C" entry points of the SNAC interpreter: argument checks, then one launch through
// kernels::launch(). One kernel per reduce dtype (the op and source count are run-time switches
// inside it), and one copy-only kernel (dtype 0) for copy schedules of any element type.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/launch.cuh"
#include "purlin/native.h"
#include "snac/interpreter.cuh"

namespace {

using purlin::snac::snac_kernel;
using purlin::snac::SnacConfig;
using Kernel = void (*)(PurlinSnacParams);

Kernel kernel_for(long long dtype) {
  switch (dtype) {
    case 0: return snac_kernel<void>;
    case PURLIN_DTYPE_BFLOAT16: return snac_kernel<__nv_bfloat16>;
    case PURLIN_DTYPE_FLOAT16: return snac_kernel<__half>;
    case PURLIN_DTYPE_FLOAT32: return snac_kernel<float>;
    case PURLIN_DTYPE_FLOAT64: return snac_kernel<double>;
    case PURLIN_DTYPE_INT32: return snac_kernel<int32_t>;
    case PURLIN_DTYPE_INT64: return snac_kernel<int64_t>;
    default: return nullptr;
  }
}

}  // namespace

PURLIN_API int purlin_snac_execute(const PurlinSnacParams* params, void* stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const PurlinSnacParams& p = *params;
  const Kernel k = kernel_for(p.dtype);
  if (k == nullptr || p.world < 1 || p.world > PURLIN_SNAC_MAX_RANKS || p.rank < 0 || p.rank >= p.world ||
      p.blocks < 1 || p.blocks > 65535 || p.n_ops < 0 || p.n_updates < 0 || (p.n_ops > 0 && p.ops == nullptr) ||
      p.arrive_slots < 1 || p.timeout_ns <= 0) {
    return cudaErrorInvalidValue;
  }
  for (long long r = 0; r < p.world; ++r) {
    if (p.bases[r] == nullptr) return cudaErrorInvalidValue;
  }
  const purlin::kernels::LaunchShape shape{unsigned(p.blocks), SnacConfig::kThreads, 0};
  return static_cast<int>(purlin::kernels::launch(k, shape, static_cast<cudaStream_t>(stream), p));
}

PURLIN_API int purlin_snac_occupancy(int dtype, int* blocks_per_sm, int* sm_count) {
  const Kernel k = kernel_for(dtype);
  if (k == nullptr || blocks_per_sm == nullptr || sm_count == nullptr) return cudaErrorInvalidValue;
  // Load every interpreter kernel now: with lazy module loading, a first launch while another
  // rank's kernel spins could need a context synchronization (a deadlock for co-resident ranks).
  for (long long d = 0; d <= PURLIN_DTYPE_INT64; ++d) {
    cudaFuncAttributes attr;
    const cudaError_t e = cudaFuncGetAttributes(&attr, kernel_for(d));
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks_per_sm, k, SnacConfig::kThreads, 0);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(purlin::kernels::current_sm_count(sm_count));
}
