// The latency regime: flag-in-data packets (opcodes kPacketPut / kPacketReduce of snac/ops.cuh).
//
// A packet is 16 bytes, {data lo, flag, data hi, flag}: 8 bytes of payload and the call's epoch
// twice, written with one 128-bit volatile store; each 8-byte half (4 data + 4 flag bytes) lands
// whole, so a reader that sees both flags equal to the epoch has the whole payload. No fence and no
// separate signal is needed: data and flag travel together. Payload costs 2x bytes on the wire, so
// the planner uses packets only for small payloads (tuning.packet_max_bytes).
//
// Producers PUSH packets into each consumer's receive window (in the consumer's workspace):
// window[parity][producer], parity = epoch & 1. The epoch counts this rank's packet calls (a word
// in its own workspace, bumped by the kernel's last block at exit, never reset: CUDA graphs replay).
// A window parity is rewritten two packet calls later; by then its reader has finished reading it,
// because the writer has itself received the reader's packets of the call in between, which the
// reader sends only after its previous kernel ended (stream order). So no acknowledgement exists.
//
// Thread t handles packets t, t + threads, ... in every packet op of a call, so a rank's own input
// element is read (puts, the reduce) and its output written by one thread: in place is safe.
#pragma once
#include <cstddef>
#include <cstdint>

#include "atoms/reduce.cuh"
#include "snac/ops.cuh"

namespace purlin::snac {

constexpr int kPacketBytes = 16;
constexpr int kPacketPayload = 8;

__device__ __forceinline__ void st_packet(char* p, uint64_t data, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(uint32_t(data)), "r"(flag),
               "r"(uint32_t(data >> 32)), "r"(flag)
               : "memory");
}

__device__ __forceinline__ uint4 ld_packet(const char* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Payload j (8 bytes) of an n-byte buffer; the tail packet is zero padded.
__device__ __forceinline__ uint64_t load_payload(const char* src, size_t j, size_t n) {
  const size_t off = j * kPacketPayload;
  if (off + kPacketPayload <= n && (reinterpret_cast<uintptr_t>(src + off) & 7u) == 0) {
    return *reinterpret_cast<const uint64_t*>(src + off);
  }
  uint64_t v = 0;
  for (size_t b = 0; b < kPacketPayload && off + b < n; ++b) v |= uint64_t(static_cast<uint8_t>(src[off + b])) << (8 * b);
  return v;
}

__device__ __forceinline__ void store_payload(char* dst, size_t j, size_t n, uint64_t v) {
  const size_t off = j * kPacketPayload;
  if (off + kPacketPayload <= n && (reinterpret_cast<uintptr_t>(dst + off) & 7u) == 0) {
    *reinterpret_cast<uint64_t*>(dst + off) = v;
    return;
  }
  for (size_t b = 0; b < kPacketPayload && off + b < n; ++b) dst[off + b] = static_cast<char>(v >> (8 * b));
}

__device__ __forceinline__ uint32_t packet_epoch(const PurlinSnacParams& p) {
  return uint32_t(ld_relaxed_sys(reinterpret_cast<const long long*>(static_cast<const char*>(p.bases[p.rank]) +
                                                                    p.epoch_off)) + 1);
}

// Window [parity][producer] in `owner`'s workspace.
__device__ __forceinline__ char* window(const PurlinSnacParams& p, long long owner, long long producer, uint32_t e) {
  return static_cast<char*>(p.bases[owner]) + p.window_off + ((long long)(e & 1u) * p.world + producer) * p.window_bytes;
}

// PACKET_PUT: w1 src ref, w2 payload bytes, w3 number of consumers, w4.. the consumers (rotated
// from rank + 1). Each payload word is loaded once and stored to every consumer's window.
__device__ inline void exec_packet_put(const long long* o, const PurlinSnacParams& p, uint32_t e) {
  const char* src = resolve(p, o[1]);
  const size_t n = size_t(o[2]);
  const int m = int(o[3]);
  char* win[PURLIN_SNAC_OP_WORDS - 4];
  for (int c = 0; c < m; ++c) win[c] = window(p, o[4 + c], p.rank, e);
  const size_t packets = (n + kPacketPayload - 1) / kPacketPayload;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < packets; j += stride) {
    const uint64_t v = load_payload(src, j, n);
    for (int c = 0; c < m; ++c) st_packet(win[c] + j * kPacketBytes, v, e);
  }
}

// Wait for packet `pk` carrying epoch e; false on a timeout (recorded) or a broken workspace.
__device__ inline bool poll_packet(const PurlinSnacParams& p, const char* pk, uint32_t e, long long index,
                                   long long peer, uint64_t* out) {
  uint4 v = ld_packet(pk);
  if (v.y != e || v.w != e) {
    const long long* err = reinterpret_cast<const long long*>(static_cast<const char*>(p.bases[p.rank]) + p.error_off);
    const unsigned long long t0 = globaltimer();
    for (unsigned n = 1;; ++n) {
      v = ld_packet(pk);
      if (v.y == e && v.w == e) break;
      if ((n & 255u) == 0) {
        if (ld_relaxed_sys(err) != 0) return false;
        if (globaltimer() - t0 > static_cast<unsigned long long>(p.timeout_ns)) {
          record_timeout(p, index, kPacketKind, peer, 0, e, v.y);
          return false;
        }
      }
    }
  }
  *out = uint64_t(v.x) | (uint64_t(v.z) << 32);
  return true;
}

// PACKET_REDUCE: sub = op, nsrc = k: w1 dst ref, w2 bytes, w3.. sources in rank order; a source
// with buf kWindow is the packets that rank pushed into my window, any other is read directly.
template <class T, atoms::ReduceOp O>
__device__ inline bool packet_reduce(const long long* o, const PurlinSnacParams& p, uint32_t e, long long index) {
  using N = arch::Num<T>;
  using Bits = typename N::Bits;
  using Acc = typename N::Acc;
  constexpr int kE = kPacketPayload / int(sizeof(Bits));
  const size_t n = size_t(o[2]);
  const int k = int((o[0] >> 16) & 0xff);
  char* dst = resolve(p, o[1]);
  const char* src[8];
  int peer[8];  // the producer of a window source, -1 for a direct one
  for (int s = 0; s < k && s < 8; ++s) {
    const unsigned long long ref = static_cast<unsigned long long>(o[3 + s]);
    peer[s] = int(ref >> 62) == kWindow ? int((ref >> 48) & 0x3fff) : -1;
    src[s] = peer[s] >= 0 ? window(p, p.rank, peer[s], e) : resolve(p, o[3 + s]);
  }
  const size_t packets = (n + kPacketPayload - 1) / kPacketPayload;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < packets; j += stride) {
    Acc acc[kE];
    for (int s = 0; s < k; ++s) {
      uint64_t w;
      if (peer[s] >= 0) {
        if (!poll_packet(p, src[s] + j * kPacketBytes, e, index, peer[s], &w)) return false;
      } else {
        w = load_payload(src[s], j, n);
      }
#pragma unroll
      for (int x = 0; x < kE; ++x) {
        const Acc v = N::to_acc(static_cast<Bits>(w >> (8 * sizeof(Bits) * x)));
        acc[x] = s == 0 ? v : atoms::Combine<O>::apply(acc[x], v);
      }
    }
    uint64_t out = 0;
#pragma unroll
    for (int x = 0; x < kE; ++x) out |= uint64_t(N::from_acc(acc[x])) << (8 * sizeof(Bits) * x);
    store_payload(dst, j, n, out);
  }
  return true;
}

template <class T>
__device__ inline bool exec_packet_reduce(const long long* o, const PurlinSnacParams& p, uint32_t e, long long index) {
  switch (int((o[0] >> 8) & 0xff)) {
    case PURLIN_REDUCE_SUM: return packet_reduce<T, atoms::ReduceOp::kSum>(o, p, e, index);
    case PURLIN_REDUCE_MAX: return packet_reduce<T, atoms::ReduceOp::kMax>(o, p, e, index);
    default: return packet_reduce<T, atoms::ReduceOp::kMin>(o, p, e, index);
  }
}

}  // namespace purlin::snac
