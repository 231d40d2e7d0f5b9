// extern "C" entry points of the SNAC interpreter: argument checks, then one launch through
// kernels::launch(). One kernel per reduce dtype (the op and source count are run-time switches
// inside it), and one copy-only kernel (dtype 0) for copy schedules of any element type; each in
// two kinds: the staged interpreter and the packet kernel (p.packets).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "kernels/launch.cuh"
#include "purlin/native.h"
#include "snac/interpreter.cuh"
#include "snac/packet.cuh"

namespace {

using purlin::snac::snac_kernel;
using purlin::snac::snac_packet_kernel;
using purlin::snac::SnacConfig;
using Kernel = void (*)(PurlinSnacParams);

// packets: 0 the staged interpreter, 1 the packet kernel with the call check, 2 the packet kernel
// without it (desc_off < 0: snac/packet.cuh kCheck).
template <class T>
Kernel pick(long long packets) {
  return packets == 2 ? snac_packet_kernel<T, false> : packets ? snac_packet_kernel<T, true> : snac_kernel<T>;
}

Kernel kernel_for(long long dtype, long long packets) {
  switch (dtype) {
    case 0: return pick<void>(packets);
    case PURLIN_DTYPE_BFLOAT16: return pick<__nv_bfloat16>(packets);
    case PURLIN_DTYPE_FLOAT16: return pick<__half>(packets);
    case PURLIN_DTYPE_FLOAT32: return pick<float>(packets);
    case PURLIN_DTYPE_FLOAT64: return pick<double>(packets);
    case PURLIN_DTYPE_INT32: return pick<int32_t>(packets);
    case PURLIN_DTYPE_INT64: return pick<int64_t>(packets);
    default: return nullptr;
  }
}

unsigned threads_for(long long packets) {
  return packets ? purlin::snac::SnacConfig::kPacketThreads : purlin::snac::SnacConfig::kThreads;
}

// The fewest resident blocks per SM over EVERY interpreter and packet kernel, each at its own block
// size, on the current device `dev` (cached per device; loads every kernel): every one of them needs
// all blocks of all ranks on the GPU co-resident.
cudaError_t min_blocks_per_sm(int dev, int* out) {
  static std::atomic<int> cache[purlin::kernels::kMaxDevices] = {};
  return purlin::kernels::per_device_cached(cache, dev, out, [](int, int* v) {
    int best = -1;
    for (long long d = 0; d <= PURLIN_DTYPE_INT64; ++d) {
      for (long long packets = 0; packets <= 2; ++packets) {
        int n = 0;
        const cudaError_t e = purlin::kernels::blocks_per_sm(kernel_for(d, packets), threads_for(packets), &n);
        if (e != cudaSuccess) return e;
        if (best < 0 || n < best) best = n;
      }
    }
    *v = best;
    return cudaSuccess;
  });
}

}  // namespace

PURLIN_API int purlin_snac_execute(const PurlinSnacParams* params, void* stream) {
  if (params == nullptr) return cudaErrorInvalidValue;
  const PurlinSnacParams& p = *params;
  const Kernel k = kernel_for(p.dtype, p.packets ? (p.desc_off >= 0 ? 1 : 2) : 0);
  if (k == nullptr || p.world < 1 || p.world > PURLIN_SNAC_MAX_RANKS || p.rank < 0 || p.rank >= p.world ||
      p.blocks < 1 || p.blocks > PURLIN_SNAC_EPOCH_WORDS || p.n_ops < 0 || p.n_updates < 0 || (p.n_ops > 0 && p.ops == nullptr) ||
      p.arrive_slots < 1 || p.timeout_ns <= 0 || p.device < -1 || p.device >= purlin::kernels::kMaxDevices ||
      p.desc_off < -1 || (p.desc_off >= 0 && (p.desc_off % 8 != 0 || p.desc_seq < 0))) {
    return cudaErrorInvalidValue;
  }
  for (long long r = 0; r < p.world; ++r) {
    if (p.bases[r] == nullptr) return cudaErrorInvalidValue;
  }
  // The blocks of one grid wait for each other (arrival counters, barriers): all must be resident.
  const cudaError_t err = purlin::kernels::use_device_coresident(int(p.device), p.blocks, min_blocks_per_sm);
  if (err != cudaSuccess) return static_cast<int>(err);
  const purlin::kernels::LaunchShape shape{unsigned(p.blocks), threads_for(p.packets), 0};
  return static_cast<int>(purlin::kernels::launch(k, shape, static_cast<cudaStream_t>(stream), p));
}

PURLIN_API int purlin_snac_occupancy(int device, int* blocks_per_sm, int* sm_count) {
  return static_cast<int>(purlin::kernels::device_occupancy(device, min_blocks_per_sm, blocks_per_sm, sm_count));
}
