// The device op encoding of a lowered SNAC schedule, and the system-scope signal primitives.
// The host side of this encoding is purlin_sglang/engines/cuda_ops.py: keep the two in step.
//
// A table holds fixed records of PURLIN_SNAC_OP_WORDS int64 words; word 0 is
//   opcode | sub << kSubShift | nsrc << kNsrcShift | flags << kFlagsShift
// and a buffer reference ("ref") is  buf << kRefBufShift | rank << kRefRankShift | byte offset
// (kRefOffsetBits bits), with buf INPUT / OUTPUT (this call's tensors), STAGE (rank's staging) or
// WINDOW (rank's packets to me). Every field is read through the decoders below, which use only the
// constants of purlin/encoding.h (those purlin_native_layout() exports for the load-time check).
// A record the kernel cannot run (an unknown opcode, a reduce in the copy-only kernel, a reduce
// with an unknown operator or source count) is recorded as an error (kErrBadRecord), never skipped.
//   COPY     w1 dst ref, w2 src ref, w3 bytes
//   REDUCE   sub = purlin_reduce_op, nsrc sources: w1 dst ref, w2 bytes, w3.. source refs (rank order)
//   SIGNAL   sub = kind (notify | ack): w1 peer, w2 item, w3 arrival slot, w4 k; the value written
//            is my mirror (sent[peer][item] or acked[peer][item]) at kernel start + k
//   WAIT     sub = kind (notify | ack | drain): w1 peer, w2 item, w3 k; the target is my mirror
//            (expect[peer][item], else sent[peer][item]) at kernel start + k
//   BARRIER  w1 arrival slot; flags bit 0: only when input == output (an in-place call)
//   DRAINALL w1 items: every peer c acked all I notified it for items < w1 (sent[c][i]), polled
//            by one thread per (c, i) in parallel
//   PACKET_PUT     w1 src ref, w2 payload bytes, w3 m, w4.. m consumers: push flag-in-data packets
//                  into each consumer's window (snac/packet.cuh)
//   PACKET_REDUCE  sub = op, nsrc sources: w1 dst ref, w2 bytes, w3.. source refs in rank order;
//                  a ref with buf WINDOW names the packets that rank pushed into my window
//   PACKET_COPY    w1 dst ref, w2 bytes, w3 src ref: a WINDOW ref (the packets that rank pushed
//                  into my window) or a direct ref, copied with the same per-thread packet mapping
// After the records: n_updates pairs (byte offset of a mirror in my workspace, delta).
#pragma once
#include <cstdint>

#include "purlin/encoding.h"
#include "purlin/native.h"

namespace purlin::snac {

// Opcode, Kind, Buf, the shifts, the masks, the flags and the error record: purlin/encoding.h (exported
// by purlin_native_layout and compared with the Python encoder at load).
constexpr unsigned kOpWords = PURLIN_SNAC_OP_WORDS;

// ---- decoding a record: word 0's fields, and a buffer reference's ----------------------------------------------
__device__ __forceinline__ int opcode_of(long long w0) { return int(w0 & kOpcodeMask); }
__device__ __forceinline__ int sub_of(long long w0) { return int((w0 >> kSubShift) & kSubMask); }
__device__ __forceinline__ int nsrc_of(long long w0) { return int((w0 >> kNsrcShift) & kNsrcMask); }
__device__ __forceinline__ long long flags_of(long long w0) { return w0 >> kFlagsShift; }
__device__ __forceinline__ int ref_buf(long long ref) {
  return int(static_cast<unsigned long long>(ref) >> kRefBufShift);
}
__device__ __forceinline__ int ref_rank(long long ref) {
  return int((static_cast<unsigned long long>(ref) >> kRefRankShift) & ((1ull << kRefRankBits) - 1));
}
__device__ __forceinline__ unsigned long long ref_offset(long long ref) {
  return static_cast<unsigned long long>(ref) & ((1ull << kRefOffsetBits) - 1);
}

struct SnacConfig {
  static constexpr unsigned kThreads = 512;
  static constexpr unsigned kPacketThreads = 256;  // the packet kernel (snac/packet.cuh): fewer, fatter threads
  static constexpr int kCopyUnroll = 4;
};

__device__ __forceinline__ char* resolve(const PurlinSnacParams& p, long long ref) {
  const int buf = ref_buf(ref);
  const int rank = ref_rank(ref);
  const unsigned long long off = ref_offset(ref);
  char* base = buf == kInput ? static_cast<char*>(p.input)
             : buf == kOutput ? static_cast<char*>(p.output)
                              : static_cast<char*>(p.bases[rank]) + p.staging_off;
  return base + off;
}

__device__ __forceinline__ long long ld_relaxed_sys(const long long* p) {
  long long v;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ long long ld_acquire_sys(const long long* p) {
  long long v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(long long* p, long long v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
// The same at GPU scope: for signals between ranks whose memory all lies on this GPU.
__device__ __forceinline__ long long ld_relaxed_gpu(const long long* p) {
  long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ long long ld_acquire_gpu(const long long* p) {
  long long v;
  asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(long long* p, long long v) {
  asm volatile("st.release.gpu.global.b64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
// Adds v to *p with release semantics (no result: the adding thread does not wait for it).
__device__ __forceinline__ void red_release_sys(long long* p, long long v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void red_release_gpu(long long* p, long long v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
// Adds 1 to *p, acquire-release, and returns the old value (a last-arriver election without fences).
__device__ __forceinline__ unsigned long long fetch_inc_acq_rel_sys(long long* p) {
  unsigned long long old;
  asm volatile("atom.acq_rel.sys.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(p) : "memory");
  return old;
}
__device__ __forceinline__ unsigned long long fetch_inc_acq_rel_gpu(long long* p) {
  unsigned long long old;
  asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(old) : "l"(p) : "memory");
  return old;
}
__device__ __forceinline__ void st_volatile(long long* p, long long v) {
  asm volatile("st.volatile.global.b64 [%0], %1;" : : "l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ char* own(const PurlinSnacParams& p) { return static_cast<char*>(p.bases[p.rank]); }

// One thread: record the first error of this rank (device word, then the host-mapped record; the
// last three words only for a mismatch, see desc_mismatch).
__device__ inline void record_error(const PurlinSnacParams& p, long long code, long long op, int kind,
                                    long long peer, long long item, long long target, long long seen,
                                    long long peer_info_lo = 0, long long peer_info_hi = 0, long long my_info = 0) {
  auto* err = reinterpret_cast<unsigned long long*>(own(p) + p.error_off);
  if (atomicCAS(err, 0ull, 1ull) != 0ull || p.host_error == nullptr) return;
  long long* h = p.host_error;
  st_volatile(h + kErrOp, op);
  st_volatile(h + kErrKind, kind);
  st_volatile(h + kErrPeer, peer);
  st_volatile(h + kErrItem, item);
  st_volatile(h + kErrRank, p.rank);
  st_volatile(h + kErrTarget, target);
  st_volatile(h + kErrSeen, seen);
  st_volatile(h + kErrTag, p.tag);
  st_volatile(h + kErrPeerInfoLo, peer_info_lo);
  st_volatile(h + kErrPeerInfoHi, peer_info_hi);
  st_volatile(h + kErrMyInfo, my_info);
  __threadfence_system();
  st_volatile(h + kErrCode, code);
}

// Thread 0 of a block: record the first timeout of this rank.
__device__ inline void record_timeout(const PurlinSnacParams& p, long long op, int kind, long long peer,
                                      long long item, long long target, long long seen) {
  record_error(p, kErrTimeout, op, kind, peer, item, target, seen);
}

// One thread: record op `index` (word 0 `w0`) as a record this kernel cannot run; the kernel then
// returns in every thread (every block meets the same record). Kind = the opcode, target = p.dtype.
__device__ inline void record_bad_record(const PurlinSnacParams& p, long long index, long long w0) {
  record_error(p, kErrBadRecord, index, opcode_of(w0), -1, 0, p.dtype, w0);
}

// ---- call descriptors (native.h: desc_off) ----------------------------------------------------------------------
__device__ __forceinline__ long long desc_word(long long seq, long long payload) {
  return static_cast<long long>((static_cast<unsigned long long>(seq) << kDescSeqShift) |
                                (static_cast<unsigned long long>(payload) & ((1ull << kDescSeqShift) - 1)));
}
__device__ __forceinline__ long long* desc_slot(char* base, const PurlinSnacParams& p, long long producer) {
  return reinterpret_cast<long long*>(base + p.desc_off) +
         (producer * PURLIN_SNAC_DESC_RING + p.desc_seq % PURLIN_SNAC_DESC_RING) * PURLIN_SNAC_DESC_WORDS;
}
__device__ __forceinline__ bool desc_on(const PurlinSnacParams& p) { return p.desc_off >= 0; }

// Block 0: thread t < world (t != rank) stores this call's descriptor into peer t's row for me.
// Plain stores, no fence: a peer compares it when one of its waits for me in this call completes
// (with the word it loaded as the wait began, if that was already this call's) or stalls.
__device__ __forceinline__ void push_descriptor(const PurlinSnacParams& p) {
  if (!desc_on(p) || blockIdx.x != 0 || threadIdx.x >= p.world || threadIdx.x == p.rank) return;
  long long* slot = desc_slot(static_cast<char*>(p.bases[threadIdx.x]), p, p.rank);
  st_volatile(slot + 1, desc_word(p.desc_seq, p.desc_info));
  st_volatile(slot + 2, desc_word(p.desc_seq, p.desc_info >> kDescSeqShift));  // the high half: a payload of its own
  st_volatile(slot + 0, desc_word(p.desc_seq, p.desc_fp));
}

__device__ __forceinline__ bool desc_peer(const PurlinSnacParams& p, long long peer) {
  return desc_on(p) && peer >= 0 && peer < p.world && peer != p.rank;
}

// Word 0 of `peer`'s descriptor slot for this call, as it is now in my workspace (0 when the check is off).
__device__ __forceinline__ long long desc_load(const PurlinSnacParams& p, long long peer) {
  return desc_peer(p, peer) ? ld_relaxed_sys(desc_slot(own(p), p, peer)) : 0;
}

// One thread: true (and the mismatch recorded) when `theirs`, word 0 of `peer`'s descriptor as read,
// belongs to this call number and carries another fingerprint than mine. A word of another call
// number (the peer is behind, or ahead by a whole ring, or not yet visible) says nothing.
__device__ inline bool desc_differs(const PurlinSnacParams& p, long long theirs, long long op, int kind, long long peer,
                                    long long item) {
  const long long mine = desc_word(p.desc_seq, p.desc_fp);
  if (!desc_peer(p, peer) || (theirs >> kDescSeqShift) != (mine >> kDescSeqShift) || theirs == mine) return false;
  const long long* slot = desc_slot(own(p), p, peer);
  const long long lo = ld_relaxed_sys(slot + 1), hi = ld_relaxed_sys(slot + 2);  // 0 if of another call
  record_error(p, kErrMismatch, op, kind, peer, item, mine, theirs,
               (lo >> kDescSeqShift) == (mine >> kDescSeqShift) ? lo : 0,
               (hi >> kDescSeqShift) == (mine >> kDescSeqShift) ? hi : 0, p.desc_info);
  return true;
}

// A wait on `peer` that has stalled: its descriptor read again and compared (desc_differs).
__device__ inline bool desc_mismatch(const PurlinSnacParams& p, long long op, int kind, long long peer, long long item) {
  return desc_peer(p, peer) && desc_differs(p, desc_load(p, peer), op, kind, peer, item);
}

// A REDUCE / PACKET_REDUCE word 0 names a known operator and 1 to 8 sources.
__device__ __forceinline__ bool reduce_record_ok(long long w0) {
  const int op = sub_of(w0), k = nsrc_of(w0);
  return op >= PURLIN_REDUCE_SUM && op <= PURLIN_REDUCE_MIN && k >= 1 && k <= PURLIN_REDUCE_MAX_SOURCES;
}

// Records i, i+1, ... of `ops` (either kernel's table, in shared or global memory) with opcode `code`:
// the length of the run starting at i (the interpreter's runs of signals and waits, the packet kernel's
// runs of copies).
__device__ __forceinline__ long long run_length(const long long* ops, long long n_ops, long long i, int code) {
  long long n = 1;
  while (i + n < n_ops && opcode_of(ops[(i + n) * kOpWords]) == code) ++n;
  return n;
}

}  // namespace purlin::snac
