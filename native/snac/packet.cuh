// The latency regime: flag-in-data packets (opcodes kPacketPut / kPacketReduce of snac/ops.cuh).
//
// A packet is 16 bytes, {data lo, flag, data hi, sig}: 8 bytes of payload, the call's epoch and its
// signature, written with one 128-bit volatile store; each 8-byte half (4 data + 4 flag bytes) lands
// whole, so a reader that sees flag equal to the epoch and sig equal to the signature has the whole
// payload. No fence and no separate signal is needed: data and flag travel together.
// The signature is epoch ^ (the call's fingerprint mod 2^32) when the call check is on (desc_off), the
// epoch itself when it is off. So the check costs nothing on the hot path: packets of a different
// call (another fingerprint at the same epoch) never look ready, the wait stalls, and the stalled wait
// reads the producer's descriptor and records the mismatch (poll_pending). The epoch word alone keeps
// stale packets out, exactly as with the check off; the signature cannot let one in, because a stale
// packet's flag word already differs. (A packet torn between its halves, the new flag with an old sig
// of another call, would pass only if the two calls' fingerprints differ by exactly epoch ^ old epoch.)
// Payload costs 2x bytes on the wire, so the planner uses packets only for small payloads
// (tuning.packet_max_bytes).
//
// Producers PUSH packets into each consumer's receive window (in the consumer's workspace):
// window[parity][producer], parity = epoch & 1. The epoch counts the packet calls a block has run:
// one word per block in the rank's own workspace, read at kernel start and bumped by that block
// at its exit, never reset (CUDA graphs replay). Every block runs every call, so all blocks of all
// ranks agree on the epoch of a call without waiting for each other.
// A window parity is rewritten two packet calls later; by then its reader has finished reading it,
// because the writer has itself received the reader's packets of the call in between, which the
// reader sends only after its previous kernel ended (stream order). So no acknowledgement exists.
//
// Thread t handles packets t, t + threads, ... in every packet op of a call, so a rank's own input
// element is read (puts, the reduce, a copy) and its output written by one thread: in place is safe.
// A reduce issues its loads of every source's packet before checking any flag, and so does a run of
// copies (one record per producer: exec_packet_copies), so waiting for world - 1 producers costs
// about one round trip, not one per producer; a run of one-consumer puts (a sliced input) loads its
// slices together too (exec_packet_puts_1).
#pragma once
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "atoms/reduce.cuh"
#include "snac/ops.cuh"

namespace purlin::snac {

// kPacketBytes, kPacketPayload: purlin/encoding.h.

// A packet call's epoch (flag word) and signature (sig word), see above.
struct Epoch {
  uint32_t e, sig;
};

template <bool kCheck>
__device__ __forceinline__ Epoch call_epoch(const PurlinSnacParams& p, long long before) {
  const uint32_t e = uint32_t(before + 1);
  return {e, kCheck && desc_on(p) ? e ^ uint32_t(p.desc_fp) : e};
}

__device__ __forceinline__ void st_packet(char* p, uint64_t data, Epoch ep) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(uint32_t(data)), "r"(ep.e),
               "r"(uint32_t(data >> 32)), "r"(ep.sig)
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

// The packets of an n-byte push: at least one. An empty push (a V form's empty slice, planner.py
// has_packet_form) still carries one packet, and its consumer still waits for it: the window-reuse
// argument above needs a push between every ordered pair of ranks in every packet call.
__device__ __forceinline__ size_t packet_count(size_t n) {
  return n == 0 ? 1 : (n + kPacketPayload - 1) / kPacketPayload;
}

// Payload j (8 bytes) of an n-byte buffer; the tail packet is zero padded (nothing is read past n).
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

// Window [parity][producer] in `owner`'s workspace.
__device__ __forceinline__ char* window(const PurlinSnacParams& p, long long owner, long long producer, Epoch e) {
  return static_cast<char*>(p.bases[owner]) + p.window_off + ((long long)(e.e & 1u) * p.world + producer) * p.window_bytes;
}

// PACKET_PUT: w1 src ref, w2 payload bytes, w3 number of consumers, w4.. the consumers (rotated
// from rank + 1). Each payload word is loaded once and stored to every consumer's window.
__device__ inline void exec_packet_put(const long long* o, const PurlinSnacParams& p, Epoch e) {
  const char* src = resolve(p, o[1]);
  const size_t n = size_t(o[2]);
  const int m = int(o[3]);
  constexpr int kMax = PURLIN_SNAC_OP_WORDS - 4;
  char* win[kMax];
#pragma unroll
  for (int c = 0; c < kMax; ++c) win[c] = c < m ? window(p, o[4 + c], p.rank, e) : nullptr;
  const size_t packets = packet_count(n);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < packets; j += stride) {
    const uint64_t v = load_payload(src, j, n);
#pragma unroll
    for (int c = 0; c < kMax; ++c) {
      if (c < m) st_packet(win[c] + j * kPacketBytes, v, e);
    }
  }
}

// A run of m <= 8 PACKET_PUT records of one consumer each (a sliced input: slice c to consumer c), as one
// loop: payload word j of every record is loaded before the first store, so the slices' loads overlap
// instead of costing one memory round trip per record. Same thread mapping as above.
__device__ inline void exec_packet_puts_1(const long long* o, int m, const PurlinSnacParams& p, Epoch e) {
  const char* src[8];
  char* win[8];
  size_t n[8], packets[8];
  size_t most = 0;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const long long* r = o + s * kOpWords;
    src[s] = s < m ? resolve(p, r[1]) : nullptr;
    n[s] = s < m ? size_t(r[2]) : 0;
    win[s] = s < m ? window(p, r[4], p.rank, e) : nullptr;
    packets[s] = s < m ? packet_count(n[s]) : 0;
    most = packets[s] > most ? packets[s] : most;
  }
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < most; j += stride) {
    uint64_t v[8];
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (j < packets[s]) v[s] = load_payload(src[s], j, n[s]);
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (j < packets[s]) st_packet(win[s] + j * kPacketBytes, v[s], e);
    }
  }
}

__device__ __forceinline__ bool packet_ready(const uint4& v, Epoch e) { return v.y == e.e && v.w == e.sig; }

// The producer of a window source ref, or -1 for a direct one.
__device__ __forceinline__ int window_producer(long long ref) {
  return ref_buf(ref) == kWindow ? ref_rank(ref) : -1;
}

// Re-poll packet `off` of the window sources in `pending` (bit s: source s, at src[s], pushed by rank
// peers[s]) until each carries this call's epoch and signature (e); false on a timeout (recorded, naming
// the first producer still missing and its op: `index`, plus s when `per_source`: a run of copies, one
// record per source) or a broken workspace.
template <bool kCheck>
__device__ __forceinline__ bool poll_pending(const PurlinSnacParams& p, const int* peers, const char* const* src,
                                          size_t off, unsigned pending, Epoch e, long long index, bool per_source,
                                          uint4* v) {
  const long long* err = reinterpret_cast<const long long*>(static_cast<const char*>(p.bases[p.rank]) + p.error_off);
  const unsigned long long t0 = globaltimer();
  for (unsigned n = 1; pending != 0u; ++n) {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (pending & (1u << s)) {
        v[s] = ld_packet(src[s] + off);
        if (packet_ready(v[s], e)) pending &= ~(1u << s);
      }
    }
    if (pending != 0u && (n & 255u) == 0) {
      if (ld_relaxed_sys(err) != 0) return false;
      const unsigned long long dt = globaltimer() - t0;
      int miss = 0;  // the first source still missing (constant indices keep v[] in registers)
      uint32_t seen = 0;
#pragma unroll
      for (int s = 7; s >= 0; --s) {
        if (pending & (1u << s)) {
          miss = s;
          seen = v[s].y;
        }
      }
      const long long peer = peers[miss];
      const long long op = per_source ? index + miss : index;
      if (kCheck && dt > static_cast<unsigned long long>(kDescAfterNs) && desc_mismatch(p, op, kPacketKind, peer, 0)) {
        return false;
      }
      if (dt > static_cast<unsigned long long>(p.timeout_ns)) {
        record_timeout(p, op, kPacketKind, peer, 0, e.e, seen);
        return false;
      }
    }
  }
  return true;
}

// PACKET_REDUCE: sub = op, nsrc = k: w1 dst ref, w2 bytes, w3.. sources in rank order; a source
// with buf kWindow is the packets that rank pushed into my window, any other is read directly.
template <class T, atoms::ReduceOp O, bool kCheck>
__device__ inline bool packet_reduce(const long long* o, const PurlinSnacParams& p, Epoch e, long long index) {
  using N = arch::Num<T>;
  using Bits = typename N::Bits;
  using Acc = typename N::Acc;
  constexpr int kE = kPacketPayload / int(sizeof(Bits));
  const size_t n = size_t(o[2]);
  const int k = nsrc_of(o[0]);
  char* dst = resolve(p, o[1]);
  const char* src[8];
  int peers[8];
  unsigned windows = 0;  // bit s: source s is a window (packets), else read directly
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    peers[s] = s < k ? window_producer(o[3 + s]) : -1;
    if (peers[s] >= 0) windows |= 1u << s;
    src[s] = s >= k ? nullptr : peers[s] >= 0 ? window(p, p.rank, peers[s], e) : resolve(p, o[3 + s]);
  }
  const size_t packets = packet_count(n);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < packets; j += stride) {
    const size_t off = j * kPacketBytes;
    uint4 v[8];
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // every window load in flight before the first flag check
      if (windows & (1u << s)) v[s] = ld_packet(src[s] + off);
    }
    unsigned pending = 0;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if ((windows & (1u << s)) && !packet_ready(v[s], e)) pending |= 1u << s;
    }
    if (pending != 0u && !poll_pending<kCheck>(p, peers, src, off, pending, e, index, false, v)) return false;
    Acc acc[kE];
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (s < k) {
        const uint64_t w = (windows & (1u << s)) ? (uint64_t(v[s].x) | (uint64_t(v[s].z) << 32))
                                                 : load_payload(src[s], j, n);
#pragma unroll
        for (int x = 0; x < kE; ++x) {
          const Acc a = N::to_acc(static_cast<Bits>(w >> (8 * sizeof(Bits) * x)));
          acc[x] = s == 0 ? a : atoms::Combine<O>::apply(acc[x], a);
        }
      }
    }
    uint64_t out = 0;
#pragma unroll
    for (int x = 0; x < kE; ++x) out |= uint64_t(N::from_acc(acc[x])) << (8 * sizeof(Bits) * x);
    store_payload(dst, j, n, out);
  }
  return true;
}

// PACKET_COPY: w1 dst ref, w2 bytes, w3 src ref (a window: that producer's packets; else direct).
// A run of m <= 8 consecutive copy records `o` (one per producer: all_gather, all_to_all and their V
// forms) runs as one loop: packet j of every window in the run is loaded before the first flag check,
// as a reduce loads its sources, so waiting for world - 1 producers costs about one round trip, not one
// per record (measured: records one after another cost about 0.5 us each at 8 ranks, the all_gather
// 10.4 us against the all_reduce's 6.5 us at 1 KiB). Thread t still handles packets t, t + threads, ...
// of every record. A window read of 0 bytes still waits for its one empty packet (packet_count).
template <bool kCheck>
__device__ inline bool exec_packet_copies(const long long* o, int m, const PurlinSnacParams& p, Epoch e,
                                          long long index) {
  char* dst[8];
  const char* src[8];
  size_t n[8], packets[8];
  int peers[8];
  size_t most = 0;
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    const long long* r = o + s * kOpWords;
    peers[s] = s < m ? window_producer(r[3]) : -1;
    n[s] = s < m ? size_t(r[2]) : 0;
    dst[s] = s < m ? resolve(p, r[1]) : nullptr;
    src[s] = s >= m ? nullptr : peers[s] >= 0 ? window(p, p.rank, peers[s], e) : resolve(p, r[3]);
    // a direct copy of nothing, or onto itself, moves nothing
    packets[s] = s >= m || (peers[s] < 0 && (n[s] == 0 || src[s] == dst[s])) ? 0 : packet_count(n[s]);
    most = packets[s] > most ? packets[s] : most;
  }
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t j = size_t(blockIdx.x) * blockDim.x + threadIdx.x; j < most; j += stride) {
    const size_t off = j * kPacketBytes;
    uint4 v[8];
    unsigned pending = 0;
#pragma unroll
    for (int s = 0; s < 8; ++s) {  // every window load in flight before the first flag check
      if (peers[s] >= 0 && j < packets[s]) v[s] = ld_packet(src[s] + off);
    }
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (peers[s] >= 0 && j < packets[s] && !packet_ready(v[s], e)) pending |= 1u << s;
    }
    if (pending != 0u && !poll_pending<kCheck>(p, peers, src, off, pending, e, index, true, v)) return false;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      if (j < packets[s]) {
        const uint64_t w = peers[s] >= 0 ? (uint64_t(v[s].x) | (uint64_t(v[s].z) << 32)) : load_payload(src[s], j, n[s]);
        store_payload(dst[s], j, n[s], w);
      }
    }
  }
  return true;
}

template <class T, bool kCheck>
__device__ inline bool exec_packet_reduce(const long long* o, const PurlinSnacParams& p, Epoch e, long long index) {
  switch (sub_of(o[0])) {
    case PURLIN_REDUCE_SUM: return packet_reduce<T, atoms::ReduceOp::kSum, kCheck>(o, p, e, index);
    case PURLIN_REDUCE_MAX: return packet_reduce<T, atoms::ReduceOp::kMax, kCheck>(o, p, e, index);
    default: return packet_reduce<T, atoms::ReduceOp::kMin, kCheck>(o, p, e, index);
  }
}


// The packet kernel: runs a schedule made only of packet ops (kernel kind kKernelPacket, purlin/encoding.h),
// apart from the staged interpreter (snac/interpreter.cuh) so neither carries the other's registers.
// Each block reads its epoch word at the start and bumps it at its exit; there are no mirrors, no
// arrival counters and no exit counter. Same grid as the interpreter (p.blocks).
//
// kCheck: the call check compiled in. The launch picks the instantiation without it when the check is
// off (native.h desc_off < 0), so the descriptor code then costs nothing (measured: with it compiled
// in but off, the bf16 kernel had 21% more instructions and ran about 1 us slower). With it, the call
// costs block 0's descriptor push and the signature in every packet; the descriptor is read only by a
// stalled wait (poll_pending), never on the hot path (not by the thread of packet 0 for every producer).
// Records of a packet schedule kept in shared memory (3 KiB); a longer table is read from global memory.
// At 8 ranks the longest packet schedule (all_to_all and its V forms) has 15 records.
constexpr long long kPacketTableRecords = 32;

template <class T, bool kCheck>
__global__ void __launch_bounds__(SnacConfig::kPacketThreads, 1) snac_packet_kernel(PurlinSnacParams p) {
  char* me = own(p);
  long long* epoch_word = reinterpret_cast<long long*>(me + p.epoch_off) + blockIdx.x;
  const long long before = *epoch_word;  // loaded together with the error word below and the table
  // The op table in shared memory (kPacketTableRecords): loaded once by the whole block, so reading a
  // record costs no memory round trip (from global memory, each record's words are a dependent load).
  __shared__ long long table[kPacketTableRecords * kOpWords];
  const long long* ops = p.ops;
  if (p.n_ops <= kPacketTableRecords) {
    for (long long w = threadIdx.x; w < p.n_ops * kOpWords; w += blockDim.x) table[w] = p.ops[w];
    ops = table;
  }
  if (__syncthreads_or(threadIdx.x == 0 && ld_relaxed_sys(reinterpret_cast<const long long*>(me + p.error_off)) != 0)) {
    return;
  }
  const Epoch epoch = call_epoch<kCheck>(p, before);
  if constexpr (kCheck) push_descriptor(p);
  for (long long i = 0; i < p.n_ops; ++i) {
    const long long* o = ops + i * kOpWords;
    switch (opcode_of(o[0])) {
      case kPacketPut: {  // consecutive one-consumer puts (a sliced input) run 8 at a time (exec_packet_puts_1)
        long long run = 0;
        while (i + run < p.n_ops && opcode_of(ops[(i + run) * kOpWords]) == kPacketPut &&
               ops[(i + run) * kOpWords + 3] == 1) {
          ++run;
        }
        if (run < 2) {
          exec_packet_put(o, p, epoch);
          break;
        }
        for (long long g = 0; g < run; g += 8) {
          exec_packet_puts_1(o + g * kOpWords, int(run - g < 8 ? run - g : 8), p, epoch);
        }
        i += run - 1;
        break;
      }
      case kPacketReduce:
        if constexpr (std::is_same_v<T, void>) {  // a reduce in the copy-only kernel: never skipped
          if (threadIdx.x == 0) record_bad_record(p, i, o[0]);
          return;
        } else {
          if (!reduce_record_ok(o[0])) {
            if (threadIdx.x == 0) record_bad_record(p, i, o[0]);
            return;
          }
          if (__syncthreads_or(!exec_packet_reduce<T, kCheck>(o, p, epoch, i))) return;
        }
        break;
      case kPacketCopy: {  // a run of copies, 8 records at a time (exec_packet_copies)
        const long long run = run_length(ops, p.n_ops, i, kPacketCopy);
        bool ok = true;
        for (long long g = 0; g < run && ok; g += 8) {
          ok = exec_packet_copies<kCheck>(o + g * kOpWords, int(run - g < 8 ? run - g : 8), p, epoch, i + g);
        }
        if (__syncthreads_or(!ok)) return;
        i += run - 1;
        break;
      }
      default:  // an unknown opcode (or a staged one): recorded, never skipped
        if (threadIdx.x == 0) record_bad_record(p, i, o[0]);
        return;
    }
  }
  __syncthreads();  // every thread of this block has read the epoch (and finished its packets)
  // A call with no packet op (0 bytes, on every rank alike) is no packet call: it moves no epoch,
  // since it carries none of the packets the window-reuse argument above relies on.
  if (threadIdx.x == 0 && p.n_ops > 0) *epoch_word = before + 1;
}

}  // namespace purlin::snac
