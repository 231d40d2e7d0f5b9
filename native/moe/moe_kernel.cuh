// The MoE dispatch and combine kernels (plans: purlin_sglang/snac/moe.py). One launch per call
// and rank; every block of a rank's grid runs every phase; the grids of all ranks on a GPU must be
// co-resident (the host sizes them). All state is in device memory and carries an epoch, so a
// captured CUDA graph replays correctly and nothing is zeroed between calls.
//
// My region's own words (State, at state_off): per kind (dispatch, combine) the epoch of the last
// call, a monotonic arrival counter (a call adds `blocks`: the last block to arrive notifies) and
// an exit counter (the last block to exit stores the epoch); a fatal word (a timed-out wait or a
// mismatch: later kernels exit at once).
//
// dispatch, epoch e, parity e & 1:
//   put rows   warp per (token, destination rank): header + payload into slot [me][pos] of the
//              destination's receive region (parity); each token once per rank
//   notify     the last block to arrive writes, to EVERY rank (also when I send it nothing), my
//              count word [epoch, tokens, meta, rows per its local expert], epoch last (release)
//   wait       threads 0..world-1 poll my count words of epoch e (bounded by timeout_ns)
//   expand     warp per received token: one row per slot at le*world*capacity + offset(src, le) + j;
//              rows with j >= capacity are not written (the overflow is recorded: never silent)
// combine, epoch e:
//   put back   warp per valid row: to slot t*K + k of its source's return region (parity)
//   notify     the last block writes done[me] = e in every rank's region (release)
//   wait       threads poll done[q] >= e for every q
//   reduce     y[t] = sum_k w[t,k] * ret[t*K+k], float32 (no FMA contraction), k = 0..K-1
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "purlin/encoding.h"
#include "purlin/native.h"
#include "snac/ops.cuh"

namespace purlin::moe {

using snac::globaltimer;
using snac::ld_acquire_sys;
using snac::ld_relaxed_sys;
using snac::st_release_sys;
using snac::st_volatile;

struct MoeConfig {
  static constexpr unsigned kThreads = 512;
};

// StateWord and ErrorCode: purlin/encoding.h (exported by purlin_native_layout).

__device__ __forceinline__ char* own(const PurlinMoeParams& p) { return static_cast<char*>(p.bases[p.rank]); }
__device__ __forceinline__ long long* state(const PurlinMoeParams& p) {
  return reinterpret_cast<long long*>(own(p) + p.state_off);
}

// Record an error in the host-mapped record (the first one stays). Fatal ones also set my fatal word.
__device__ inline void record(const PurlinMoeParams& p, long long code, long long kind, long long peer,
                              long long expert, long long count, long long cap, long long epoch, long long seen,
                              bool fatal) {
  if (fatal) {
    auto* f = reinterpret_cast<unsigned long long*>(state(p) + kFatal);
    if (atomicCAS(f, 0ull, 1ull) != 0ull) return;
  }
  long long* h = p.host_error;
  if (h == nullptr || *reinterpret_cast<volatile long long*>(h) != 0) return;
  st_volatile(h + 1, kind);
  st_volatile(h + 2, p.rank);
  st_volatile(h + 3, peer);
  st_volatile(h + 4, expert);
  st_volatile(h + 5, count);
  st_volatile(h + 6, cap);
  st_volatile(h + 7, epoch);
  st_volatile(h + 8, seen);
  __threadfence_system();
  st_volatile(h, code);
}

// Wait until *w >= target (relaxed polls, then one acquire); false on timeout or a fatal error.
__device__ inline bool wait_ge(const PurlinMoeParams& p, const long long* w, long long target, int kind,
                               long long peer) {
  long long v = ld_relaxed_sys(w);
  if (v < target) {
    const unsigned long long t0 = globaltimer();
    const volatile long long* fatal = state(p) + kFatal;
    while ((v = ld_relaxed_sys(w)) < target) {
      if (*fatal) return false;
      if (globaltimer() - t0 > static_cast<unsigned long long>(p.timeout_ns)) {
        record(p, kTimeout, kind, peer, -1, 0, 0, target, v, true);
        return false;
      }
    }
  }
  (void)ld_acquire_sys(w);
  return true;
}

// A warp copies n bytes (a multiple of 16; both pointers 16-byte aligned).
__device__ __forceinline__ void warp_copy16(char* dst, const char* src, long long n, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  const long long nv = n >> 4;
  long long i = lane;
  for (; i + 96 < nv; i += 128) {
    const int4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
    d[i] = a;
    d[i + 32] = b;
    d[i + 64] = c;
    d[i + 96] = e;
  }
  for (; i < nv; i += 32) d[i] = s[i];
}

// The last block of this call to arrive (counter adds one per block and call): true in every thread.
__device__ inline bool arrive_last(long long* counter, long long epoch, int* s_flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const unsigned long long old = atomicAdd(reinterpret_cast<unsigned long long*>(counter), 1ull);
    *s_flag = old == static_cast<unsigned long long>(epoch) * gridDim.x - 1;
    if (*s_flag) __threadfence();
  }
  __syncthreads();
  return *s_flag != 0;
}

__device__ inline void finish(long long* exit_counter, long long* epoch_word, long long epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long old = atomicAdd(reinterpret_cast<unsigned long long*>(exit_counter), 1ull);
    if (old == static_cast<unsigned long long>(epoch) * gridDim.x - 1) st_volatile(epoch_word, epoch);
  }
}

__device__ __forceinline__ long long* count_word(const PurlinMoeParams& p, long long rank, int par, long long producer) {
  return reinterpret_cast<long long*>(static_cast<char*>(p.bases[rank]) + p.count_off +
                                      (par * p.world + producer) * p.count_bytes);
}

__device__ __forceinline__ long long meta(const PurlinMoeParams& p) {
  return (p.payload_bytes << 24) | (p.topk << 16) | (p.local << 0);
}

__global__ void __launch_bounds__(MoeConfig::kThreads) moe_dispatch_kernel(PurlinMoeParams p) {
  __shared__ int s_cnt[PURLIN_MOE_MAX_EXPERTS];  // [world][local] rows from each source (raw)
  __shared__ int s_off[PURLIN_MOE_MAX_EXPERTS];  // [world][local] offset of each source in its group
  __shared__ int s_tstart[PURLIN_MOE_MAX_RANKS + 1];
  __shared__ long long s_e;
  __shared__ int s_flag, s_fail, s_bad;  // s_bad: a producer's rows have another shape (set apart from
                                         // s_fail so that every branch below reads a flag fixed before a barrier)
  long long* st = state(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  if (tid == 0) {
    s_e = reinterpret_cast<volatile long long*>(st)[kDispEpoch] + 1;
    s_fail = reinterpret_cast<volatile long long*>(st)[kFatal] != 0;
    s_bad = 0;
  }
  __syncthreads();
  const long long e = s_e;
  const int par = int(e & 1);
  const long long W = p.world, K = p.topk, L = p.local, cap = p.capacity;
  if (s_fail) {
    finish(st + kDispExit, st + kDispEpoch, e);
    return;
  }
  // put rows
  const long long items = p.tokens * W;
  for (long long it = (long long)blockIdx.x * nwarps + warp; it < items; it += (long long)gridDim.x * nwarps) {
    const long long t = it / W, d = (it % W + p.rank + 1) % W;
    const long long pos = p.send_pos[t * W + d];
    if (pos < 0) continue;
    char* slot = static_cast<char*>(p.bases[d]) + p.recv_off + par * p.recv_parity_bytes +
                 (p.rank * p.max_tokens + pos) * p.slot_bytes;
    int* h = reinterpret_cast<int*>(slot);
    if (lane == 0) {
      h[0] = int(t);
      h[1 + 2 * K] = __float_as_int(p.scales != nullptr ? p.scales[t] : 1.0f);
    }
    if (lane < K) {
      const bool mine = p.dst[t * K + lane] == d;
      h[1 + lane] = mine ? int(p.le[t * K + lane]) : -1;
      h[1 + K + lane] = mine ? int(p.j[t * K + lane]) : -1;
    }
    warp_copy16(slot + p.hdr_bytes, static_cast<const char*>(p.x) + t * p.payload_bytes, p.payload_bytes, lane);
  }
  // notify: my count word to every rank, every call
  if (arrive_last(st + kDispArrive, e, &s_flag)) {
    for (long long i = tid; i < W * (L + 2); i += blockDim.x) {
      const long long d = i / (L + 2), c = i % (L + 2);
      long long* cw = count_word(p, d, par, p.rank);
      if (c == 0) cw[1] = p.tokens_to[d];
      else if (c == 1) cw[2] = meta(p);
      else reinterpret_cast<int*>(cw + 3)[c - 2] = int(p.counts[d * L + c - 2]);
    }
    __syncthreads();
    if (tid < W) {
      __threadfence_system();
      st_release_sys(count_word(p, tid, par, p.rank), e);
    }
  }
  // wait for every producer's count word of this epoch
  if (tid < W && !wait_ge(p, count_word(p, p.rank, par, tid), e, 0, tid)) s_fail = 1;
  __syncthreads();
  if (!s_fail) {
    if (tid < W) {
      const long long* cw = count_word(p, p.rank, par, tid);
      if (cw[2] != meta(p)) {
        record(p, kMismatch, 0, tid, -1, cw[2], meta(p), e, 0, true);
        s_bad = 1;
      }
      s_tstart[tid + 1] = int(cw[1]);
    }
    for (long long i = tid; i < W * L; i += blockDim.x) {
      const long long q = i / L, c = i % L;
      s_cnt[i] = reinterpret_cast<const int*>(count_word(p, p.rank, par, q) + 3)[c];
    }
    __syncthreads();
  }
  if (!s_fail && !s_bad) {
    for (long long le = tid; le < L; le += blockDim.x) {
      int acc = 0;
      for (long long q = 0; q < W; ++q) {
        s_off[q * L + le] = acc;
        acc += min(s_cnt[q * L + le], int(cap));
      }
    }
    if (tid == 0) {
      s_tstart[0] = 0;
      for (long long q = 0; q < W; ++q) s_tstart[q + 1] += s_tstart[q];
    }
    __syncthreads();
    if (blockIdx.x == 0) {
      for (long long i = tid; i < W * L; i += blockDim.x) {
        if (s_cnt[i] > cap) record(p, kOverflow, 0, i / L, p.rank * L + i % L, s_cnt[i], cap, e, 0, false);
      }
      if (tid == 0 && p.bad_ids != nullptr && *p.bad_ids > 0) record(p, kBadIds, 0, -1, -1, *p.bad_ids, 0, e, 0, false);
      for (long long le = tid; le < L; le += blockDim.x) {
        p.out_counts[le] = s_off[(W - 1) * L + le] + min(s_cnt[(W - 1) * L + le], int(cap));
      }
    }
    // expand: a warp per received token, one row per slot routed here
    const long long n_recv = s_tstart[W];
    char* recv = own(p) + p.recv_off + par * p.recv_parity_bytes;
    for (long long g = (long long)blockIdx.x * nwarps + warp; g < n_recv; g += (long long)gridDim.x * nwarps) {
      int q = 0;
      while (s_tstart[q + 1] <= g) ++q;
      const char* slot = recv + (q * p.max_tokens + (g - s_tstart[q])) * p.slot_bytes;
      const int* h = reinterpret_cast<const int*>(slot);
      const long long t = h[0];
      const float sc = __int_as_float(h[1 + 2 * K]);
      for (long long k = 0; k < K; ++k) {
        const int le = h[1 + k], jj = h[1 + K + k];
        if (le < 0 || jj >= cap) continue;
        const long long row = le * W * cap + s_off[q * L + le] + jj;
        warp_copy16(static_cast<char*>(p.out_x) + row * p.payload_bytes, slot + p.hdr_bytes, p.payload_bytes, lane);
        if (lane == 0) {
          p.out_expert[row] = le;
          p.out_src[row] = q;
          p.out_slot[row] = t * K + k;
          if (p.out_scales != nullptr) p.out_scales[row] = sc;
        }
      }
    }
    // padding rows: expert -1
    const long long rows = L * W * cap;
    for (long long r = (long long)blockIdx.x * blockDim.x + tid; r < rows; r += (long long)gridDim.x * blockDim.x) {
      const long long le = r / (W * cap), pos = r % (W * cap);
      if (pos >= s_off[(W - 1) * L + le] + min(s_cnt[(W - 1) * L + le], int(cap))) {
        p.out_expert[r] = -1;
        p.out_src[r] = -1;
        p.out_slot[r] = -1;
        if (p.out_scales != nullptr) p.out_scales[r] = 1.0f;
      }
    }
  }
  finish(st + kDispExit, st + kDispEpoch, e);
}

template <class T>
__device__ __forceinline__ float to_f(T v);
template <>
__device__ __forceinline__ float to_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <class T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

// y[t] 16-byte chunk c: float32 sum over k in order, products and sums rounded separately (no FMA).
template <class T>
__device__ inline void reduce_rows(const PurlinMoeParams& p, const char* ret) {
  constexpr int kVec = 16 / sizeof(T);
  const long long chunks = p.ret_bytes / 16, K = p.topk;
  const long long items = p.tokens * chunks;
  for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += (long long)gridDim.x * blockDim.x) {
    const long long t = it / chunks, c = it % chunks;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (long long k = 0; k < K; ++k) {
      if (p.dst[t * K + k] < 0) continue;
      const float w = p.weights[t * K + k];
      const int4 raw = *reinterpret_cast<const int4*>(ret + (t * K + k) * p.ret_bytes + c * 16);
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, to_f<T>(v[i])));
    }
    int4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < kVec; ++i) o[i] = from_f<T>(acc[i]);
    *reinterpret_cast<int4*>(static_cast<char*>(p.y) + t * p.ret_bytes + c * 16) = out;
  }
}

__global__ void __launch_bounds__(MoeConfig::kThreads) moe_combine_kernel(PurlinMoeParams p) {
  __shared__ long long s_e;
  __shared__ int s_flag, s_fail;
  long long* st = state(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  if (tid == 0) {
    s_e = reinterpret_cast<volatile long long*>(st)[kCombEpoch] + 1;
    s_fail = reinterpret_cast<volatile long long*>(st)[kFatal] != 0;
  }
  __syncthreads();
  const long long e = s_e;
  const int par = int(e & 1);
  const long long W = p.world;
  if (s_fail) {
    finish(st + kCombExit, st + kCombEpoch, e);
    return;
  }
  // put back: every valid row to slot t*K + k of its source
  const long long rows = p.local * W * p.capacity;
  for (long long r = (long long)blockIdx.x * nwarps + warp; r < rows; r += (long long)gridDim.x * nwarps) {
    const int q = p.row_src[r];
    if (q < 0) continue;
    char* dst = static_cast<char*>(p.bases[q]) + p.ret_off + par * p.ret_parity_bytes + p.row_slot[r] * p.ret_bytes;
    warp_copy16(dst, static_cast<const char*>(p.expert_out) + r * p.ret_bytes, p.ret_bytes, lane);
  }
  if (arrive_last(st + kCombArrive, e, &s_flag) && tid < W) {
    __threadfence_system();
    st_release_sys(reinterpret_cast<long long*>(static_cast<char*>(p.bases[tid]) + p.done_off + p.rank * 8), e);
  }
  if (tid < W && !wait_ge(p, reinterpret_cast<const long long*>(own(p) + p.done_off + tid * 8), e, 1, tid)) s_fail = 1;
  __syncthreads();
  if (!s_fail) {
    const char* ret = own(p) + p.ret_off + par * p.ret_parity_bytes;
    switch (p.dtype) {
      case PURLIN_DTYPE_BFLOAT16: reduce_rows<__nv_bfloat16>(p, ret); break;
      case PURLIN_DTYPE_FLOAT16: reduce_rows<__half>(p, ret); break;
      default: reduce_rows<float>(p, ret); break;
    }
  }
  finish(st + kCombExit, st + kCombEpoch, e);
}

}  // namespace purlin::moe
