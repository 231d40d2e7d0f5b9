// extern "C" entry points of the SNAC interpreter: argument checks, then one launch through
// kernels::launch(). One kernel per reduce dtype (the op and source count are run-time switches
// inside it), and one copy-only kernel (dtype 0) for copy schedules of any element type; each of
// the two kernel kinds (p.packets, purlin/encoding.h KernelKind): the staged interpreter and the
// packet kernel. The host picks the kind per schedule; nothing here knows an algorithm.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "kernels/launch.cuh"
#include "purlin/encoding.h"
#include "purlin/native.h"
#include "snac/interpreter.cuh"
#include "snac/packet.cuh"

namespace {

using purlin::snac::kKernelPacket;
using purlin::snac::kKernelStaged;
using purlin::snac::snac_kernel;
using purlin::snac::snac_packet_kernel;
using purlin::snac::SnacConfig;
using Kernel = void (*)(PurlinSnacParams);

// The compiled variants: the staged interpreter, the packet kernel with the call check, and the packet
// kernel without it (desc_off < 0: snac/packet.cuh kCheck).
enum Variant : int { kStaged = 0, kPacketChecked = 1, kPacketUnchecked = 2 };

Variant variant_of(const PurlinSnacParams& p) {
  return p.packets != kKernelPacket ? kStaged : p.desc_off >= 0 ? kPacketChecked : kPacketUnchecked;
}

template <class T>
Kernel pick(int variant) {
  return variant == kPacketUnchecked ? snac_packet_kernel<T, false>
         : variant == kPacketChecked ? snac_packet_kernel<T, true>
                                     : snac_kernel<T>;
}

Kernel kernel_for(long long dtype, int variant) {
  switch (dtype) {
    case 0: return pick<void>(variant);
    case PURLIN_DTYPE_BFLOAT16: return pick<__nv_bfloat16>(variant);
    case PURLIN_DTYPE_FLOAT16: return pick<__half>(variant);
    case PURLIN_DTYPE_FLOAT32: return pick<float>(variant);
    case PURLIN_DTYPE_FLOAT64: return pick<double>(variant);
    case PURLIN_DTYPE_INT32: return pick<int32_t>(variant);
    case PURLIN_DTYPE_INT64: return pick<int64_t>(variant);
    default: return nullptr;
  }
}

unsigned threads_for(int variant) { return variant == kStaged ? SnacConfig::kThreads : SnacConfig::kPacketThreads; }

// The fewest resident blocks per SM over EVERY interpreter and packet kernel, each at its own block
// size, on the current device `dev` (cached per device; loads every kernel): every one of them needs
// all blocks of all ranks on the GPU co-resident.
cudaError_t min_blocks_per_sm(int dev, int* out) {
  static std::atomic<int> cache[purlin::kernels::kMaxDevices] = {};
  return purlin::kernels::per_device_cached(cache, dev, out, [](int, int* v) {
    int best = -1;
    for (long long d = 0; d <= PURLIN_DTYPE_INT64; ++d) {
      for (int variant = kStaged; variant <= kPacketUnchecked; ++variant) {
        int n = 0;
        const cudaError_t e = purlin::kernels::blocks_per_sm(kernel_for(d, variant), threads_for(variant), &n);
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
  const int variant = variant_of(p);
  const Kernel k = kernel_for(p.dtype, variant);
  if (k == nullptr || (p.packets != kKernelStaged && p.packets != kKernelPacket) || p.world < 1 ||
      p.world > PURLIN_SNAC_MAX_RANKS || p.rank < 0 || p.rank >= p.world ||
      p.blocks < 1 || p.blocks > PURLIN_SNAC_EPOCH_WORDS || p.n_ops < 0 || p.n_updates < 0 ||
      (p.n_ops > 0 && p.ops == nullptr) ||
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
  const purlin::kernels::LaunchShape shape{unsigned(p.blocks), threads_for(variant), 0};
  return static_cast<int>(purlin::kernels::launch(k, shape, static_cast<cudaStream_t>(stream), p));
}

PURLIN_API int purlin_snac_occupancy(int device, int* blocks_per_sm, int* sm_count) {
  return static_cast<int>(purlin::kernels::device_occupancy(device, min_blocks_per_sm, blocks_per_sm, sm_count));
}
