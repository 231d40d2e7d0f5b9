// extern "C" entry points of the MoE kernels (native/moe/): argument checks, then one launch.
#include <cuda_runtime.h>

#include <atomic>

#include "kernels/launch.cuh"
#include "moe/moe_kernel.cuh"
#include "purlin/native.h"

namespace {

using Kernel = void (*)(PurlinMoeParams);

int check(const PurlinMoeParams* params) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const PurlinMoeParams& p = *params;
  if (p.world < 1 || p.world > PURLIN_MOE_MAX_RANKS || p.rank < 0 || p.rank >= p.world || p.blocks < 1 ||
      p.local < 1 || p.local * p.world > PURLIN_MOE_MAX_EXPERTS || p.topk < 1 ||
      p.topk > purlin::moe::MoeConfig::kMaxTopk || p.tokens < 0 ||
      p.tokens > p.max_tokens || p.capacity < 1 || p.payload_bytes % 16 || p.hdr_bytes % 16 || p.slot_bytes % 16 ||
      p.ret_bytes % 16 || p.timeout_ns <= 0 || p.device < -1 || p.device >= purlin::kernels::kMaxDevices ||
      (p.one_pass != 0 && p.one_pass != 1) || (p.one_pass && (p.ptr_off <= 0 || p.ddone_off <= 0)) ||
      (p.decode != 0 && p.decode != 1) ||
      (p.decode && (p.decode_tokens < 1 || p.decode_tokens > purlin::moe::MoeConfig::kChunk ||
                    p.tokens > p.decode_tokens || p.win_off <= 0 || p.win_bytes <= 0 || p.rwin_off <= 0 ||
                    p.rwin_parity_bytes <= 0))) {
    return cudaErrorInvalidValue;
  }
  for (long long r = 0; r < p.world; ++r) {
    if (p.bases[r] == nullptr) return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

// Max resident blocks per SM of both MoE kernels (the smaller) on the current device `dev`; loads both
// kernels (cached per device).
cudaError_t min_blocks_per_sm(int dev, int* out) {
  static std::atomic<int> cache[purlin::kernels::kMaxDevices] = {};
  return purlin::kernels::per_device_cached(cache, dev, out, [](int, int* v) {
    const Kernel kernels[] = {purlin::moe::moe_dispatch_kernel, purlin::moe::moe_combine_kernel,
                              purlin::moe::moe_dispatch_one_pass_kernel, purlin::moe::moe_combine_one_pass_kernel,
                              purlin::moe::moe_dispatch_decode_kernel, purlin::moe::moe_combine_decode_kernel};
    int least = 1 << 30;
    for (Kernel k : kernels) {
      int per = 0;
      const cudaError_t e = purlin::kernels::blocks_per_sm(k, purlin::moe::MoeConfig::kThreads, &per);
      if (e != cudaSuccess) return e;
      least = per < least ? per : least;
    }
    *v = least;
    return cudaSuccess;
  });
}

int launch(Kernel k, const PurlinMoeParams* params, void* stream) {
  int err = check(params);
  if (err != cudaSuccess) return err;
  // The blocks of one grid wait for each other (the last-block counters): all must be resident.
  const cudaError_t e = purlin::kernels::use_device_coresident(int(params->device), params->blocks, min_blocks_per_sm);
  if (e != cudaSuccess) return static_cast<int>(e);
  const purlin::kernels::LaunchShape shape{unsigned(params->blocks), purlin::moe::MoeConfig::kThreads, 0};
  return static_cast<int>(purlin::kernels::launch(k, shape, static_cast<cudaStream_t>(stream), *params));
}

}  // namespace

PURLIN_API int purlin_moe_dispatch(const PurlinMoeParams* params, void* stream) {
  if (params != nullptr) {
    const PurlinMoeParams& p = *params;
    const bool fp8_source = p.x_dtype == PURLIN_DTYPE_BFLOAT16 || p.x_dtype == PURLIN_DTYPE_FLOAT16 ||
                            p.x_dtype == PURLIN_DTYPE_FLOAT32;
    if ((p.ids_bytes != 4 && p.ids_bytes != 8) || (p.quant != 0 && p.quant != 1) || (p.quant && !fp8_source) ||
        (p.tokens > 0 && (p.x == nullptr || p.ids == nullptr || p.out_valid == nullptr)) ||
        ((p.one_pass == 1 || p.decode == 1) && p.tokens > 0 && p.out_ref == nullptr)) {
      return cudaErrorInvalidValue;
    }
  }
  if (params != nullptr && params->decode == 1) return launch(purlin::moe::moe_dispatch_decode_kernel, params, stream);
  const bool one_pass = params != nullptr && params->one_pass == 1;
  return launch(one_pass ? purlin::moe::moe_dispatch_one_pass_kernel : purlin::moe::moe_dispatch_kernel, params,
                stream);
}

PURLIN_API int purlin_moe_combine(const PurlinMoeParams* params, void* stream) {
  if (params != nullptr && ((params->dtype != PURLIN_DTYPE_BFLOAT16 && params->dtype != PURLIN_DTYPE_FLOAT16 &&
                             params->dtype != PURLIN_DTYPE_FLOAT32) ||
                            (params->reject != 0 && params->reject != 1) ||
                            ((params->one_pass == 1 || params->decode == 1) && params->tokens > 0 && !params->reject &&
                             params->row_ref == nullptr) ||
                            (params->decode == 1 && !params->reject && params->row_counts == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (params != nullptr && params->decode == 1) return launch(purlin::moe::moe_combine_decode_kernel, params, stream);
  const bool one_pass = params != nullptr && params->one_pass == 1;
  return launch(one_pass ? purlin::moe::moe_combine_one_pass_kernel : purlin::moe::moe_combine_kernel, params, stream);
}

PURLIN_API int purlin_moe_occupancy(int device, int* blocks_per_sm, int* sm_count) {
  return static_cast<int>(purlin::kernels::device_occupancy(device, min_blocks_per_sm, blocks_per_sm, sm_count));
}
