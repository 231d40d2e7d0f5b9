// extern "C" entry points of the MoE kernels (native/moe/): argument checks, then one launch.
#include <cuda_runtime.h>

#include "kernels/launch.cuh"
#include "moe/moe_kernel.cuh"
#include "purlin/native.h"

namespace {

using Kernel = void (*)(PurlinMoeParams);

int check(const PurlinMoeParams* params) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const PurlinMoeParams& p = *params;
  if (p.world < 1 || p.world > PURLIN_MOE_MAX_RANKS || p.rank < 0 || p.rank >= p.world || p.blocks < 1 ||
      p.local < 1 || p.local * p.world > PURLIN_MOE_MAX_EXPERTS || p.topk < 1 || p.topk > 32 || p.tokens < 0 ||
      p.tokens > p.max_tokens || p.capacity < 1 || p.payload_bytes % 16 || p.hdr_bytes % 16 || p.slot_bytes % 16 ||
      p.ret_bytes % 16 || p.timeout_ns <= 0) {
    return cudaErrorInvalidValue;
  }
  for (long long r = 0; r < p.world; ++r) {
    if (p.bases[r] == nullptr) return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

int launch(Kernel k, const PurlinMoeParams* params, void* stream) {
  const int err = check(params);
  if (err != cudaSuccess) return err;
  const purlin::kernels::LaunchShape shape{unsigned(params->blocks), purlin::moe::MoeConfig::kThreads, 0};
  return static_cast<int>(purlin::kernels::launch(k, shape, static_cast<cudaStream_t>(stream), *params));
}

}  // namespace

PURLIN_API int purlin_moe_dispatch(const PurlinMoeParams* params, void* stream) {
  return launch(purlin::moe::moe_dispatch_kernel, params, stream);
}

PURLIN_API int purlin_moe_combine(const PurlinMoeParams* params, void* stream) {
  if (params != nullptr && params->dtype != PURLIN_DTYPE_BFLOAT16 && params->dtype != PURLIN_DTYPE_FLOAT16 &&
      params->dtype != PURLIN_DTYPE_FLOAT32) {
    return cudaErrorInvalidValue;
  }
  return launch(purlin::moe::moe_combine_kernel, params, stream);
}

PURLIN_API int purlin_moe_occupancy(int* blocks_per_sm, int* sm_count) {
  if (blocks_per_sm == nullptr || sm_count == nullptr) return cudaErrorInvalidValue;
  // Load both kernels now (lazy loading during a peer's spin could deadlock co-resident ranks).
  int per[2] = {0, 0};
  const Kernel ks[2] = {purlin::moe::moe_dispatch_kernel, purlin::moe::moe_combine_kernel};
  for (int i = 0; i < 2; ++i) {
    cudaFuncAttributes attr;
    cudaError_t e = cudaFuncGetAttributes(&attr, ks[i]);
    if (e != cudaSuccess) return static_cast<int>(e);
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per[i], ks[i], purlin::moe::MoeConfig::kThreads, 0);
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  *blocks_per_sm = per[0] < per[1] ? per[0] : per[1];
  return static_cast<int>(purlin::kernels::current_sm_count(sm_count));
}
