// The SNAC interpreter: one kernel runs one rank's whole lowered schedule (snac/ops.cuh), every
// block executing every op in order. Data ops are split over the blocks with the copy and reduce
// atoms. A run of consecutive signals is given by the LAST block to arrive at its first one (a monotonic per-op arrival counter,
// never reset: the grid size is fixed per workspace, so each use adds exactly `blocks`). A run of
// consecutive waits is polled by each block, one thread per wait (relaxed loads, then one acquire), bounded by timeout_ns: past
// it, the first block records the error (device word + host-mapped record) and every block exits;
// later kernels of a broken workspace exit at once. Mirrors are written back by the last block to
// finish, after every block has read them, so all state carries across calls and graph replays; a
// schedule with no mirror updates skips that exit counter. Packet schedules run in their own kernel
// (snac/packet.cuh).
#pragma once
#include <cstddef>
#include <cstdint>

#include "atoms/copy.cuh"
#include "atoms/reduce.cuh"
#include "kernels/reduce_kernel.cuh"
#include "snac/ops.cuh"

namespace purlin::snac {

__device__ __forceinline__ long long* word(char* base, long long off, const PurlinSnacParams& p, long long peer,
                                           long long item) {
  return reinterpret_cast<long long*>(base + off + (peer * p.max_items + item) * 8);
}

template <int W>
__device__ __forceinline__ void copy_w(char* dst, const char* src, size_t n) {
  size_t head = (W - (reinterpret_cast<uintptr_t>(dst) & (W - 1))) & (W - 1);
  if (head > n) head = n;
  const size_t n_vec = (n - head) / W;
  const size_t tail = n - head - n_vec * W;
  atoms::copy_vectors<W, SnacConfig::kCopyUnroll>(dst + head, src + head, n_vec, blockIdx.x, gridDim.x,
                                                  threadIdx.x, blockDim.x);
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  atoms::copy_bytes(dst, src, head, tid);
  atoms::copy_bytes(dst + head + n_vec * W, src + head + n_vec * W, tail, tid);
}

__device__ __forceinline__ void exec_copy(const long long* o, const PurlinSnacParams& p) {
  char* dst = resolve(p, o[1]);
  const char* src = resolve(p, o[2]);
  const size_t n = size_t(o[3]);
  if (n == 0 || dst == src) return;
  const uintptr_t x = (reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src)) & 15u;
  switch (x == 0 ? 16 : int(x & (~x + 1))) {
    case 16: copy_w<16>(dst, src, n); break;
    case 8: copy_w<8>(dst, src, n); break;
    case 4: copy_w<4>(dst, src, n); break;
    case 2: copy_w<2>(dst, src, n); break;
    default: copy_w<1>(dst, src, n); break;
  }
}

template <class T, atoms::ReduceOp O, int K>
__device__ __forceinline__ void reduce_span(char* dst, const char* const* srcs, size_t nbytes) {
  constexpr size_t E = sizeof(T);
  constexpr size_t kPerVec = 16 / E;
  const char* src[K];
  bool same = true;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(dst) & 15u;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    src[k] = srcs[k];
    same = same && ((reinterpret_cast<uintptr_t>(src[k]) & 15u) == mis);
  }
  const size_t n = nbytes / E;
  const size_t tid = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t n_threads = size_t(gridDim.x) * blockDim.x;
  if (!same) {
    atoms::reduce_elements<T, O, K>(dst, src, 0, n, tid, n_threads);
    return;
  }
  size_t head = mis == 0 ? 0 : (16 - mis) / E;
  if (head > n) head = n;
  const size_t n_vec = (n - head) / kPerVec;
  const size_t tail = n - head - n_vec * kPerVec;
  if (n_vec > 0) {
    const char* body[K];
#pragma unroll
    for (int k = 0; k < K; ++k) body[k] = src[k] + head * E;
    atoms::reduce_vectors<T, O, K, kernels::ReduceConfig::unroll(K)>(dst + head * E, body, n_vec, blockIdx.x,
                                                                     gridDim.x, threadIdx.x, blockDim.x);
  }
  atoms::reduce_elements<T, O, K>(dst, src, 0, head, tid, n_threads);
  atoms::reduce_elements<T, O, K>(dst, src, head + n_vec * kPerVec, tail, tid, n_threads);
}

template <class T, atoms::ReduceOp O>
__device__ __forceinline__ void reduce_k(int k, char* dst, const char* const* srcs, size_t n) {
  switch (k) {
    case 1: reduce_span<T, O, 1>(dst, srcs, n); break;
    case 2: reduce_span<T, O, 2>(dst, srcs, n); break;
    case 3: reduce_span<T, O, 3>(dst, srcs, n); break;
    case 4: reduce_span<T, O, 4>(dst, srcs, n); break;
    case 5: reduce_span<T, O, 5>(dst, srcs, n); break;
    case 6: reduce_span<T, O, 6>(dst, srcs, n); break;
    case 7: reduce_span<T, O, 7>(dst, srcs, n); break;
    case 8: reduce_span<T, O, 8>(dst, srcs, n); break;
    default: break;
  }
}

template <class T>
__device__ __forceinline__ void exec_reduce(const long long* o, const PurlinSnacParams& p) {
  const size_t n = size_t(o[2]);
  if (n == 0) return;
  const int op = sub_of(o[0]), k = nsrc_of(o[0]);
  char* dst = resolve(p, o[1]);
  const char* srcs[8];
  for (int s = 0; s < k && s < 8; ++s) srcs[s] = resolve(p, o[3 + s]);
  switch (op) {
    case PURLIN_REDUCE_SUM: reduce_k<T, atoms::ReduceOp::kSum>(k, dst, srcs, n); break;
    case PURLIN_REDUCE_MAX: reduce_k<T, atoms::ReduceOp::kMax>(k, dst, srcs, n); break;
    default: reduce_k<T, atoms::ReduceOp::kMin>(k, dst, srcs, n); break;
  }
}

// Thread 0: poll *w until >= target (relaxed polls, then one acquire). False: timed out, broken or
// (call check on) the peer is in another call: its descriptor, loaded together with the first poll
// (no added latency), is compared once the wait completes, and read again while it stalls.
__device__ inline bool wait_ge(const PurlinSnacParams& p, const long long* w, long long target, long long op, int kind,
                               long long peer, long long item) {
  const bool in_call = kind == kNotify || kind == kAck;  // the peer's signal of THIS call (drains: the last one)
  long long seen = in_call ? desc_load(p, peer) : 0;      // the peer's descriptor word 0, latest read
  if (ld_acquire_sys(w) >= target) return !in_call || !desc_differs(p, seen, op, kind, peer, item);
  const long long* err = reinterpret_cast<const long long*>(own(p) + p.error_off);
  const unsigned long long t0 = globaltimer();
  for (unsigned n = 1;; ++n) {
    const long long v = ld_relaxed_sys(w);
    if (v >= target) {
      (void)ld_acquire_sys(w);
      return !in_call || !desc_differs(p, seen, op, kind, peer, item);
    }
    if ((n & 63u) == 0) {
      if (ld_relaxed_sys(err) != 0) return false;
      const unsigned long long dt = globaltimer() - t0;
      if (dt > static_cast<unsigned long long>(kDescAfterNs) && desc_peer(p, peer)) {  // (not a barrier: peer = me)
        seen = desc_load(p, peer);
        if (desc_differs(p, seen, op, kind, peer, item)) return false;
      }
      if (dt > static_cast<unsigned long long>(p.timeout_ns)) {
        record_timeout(p, op, kind, peer, item, target, v);
        return false;
      }
    }
  }
}

// Thread 0, after a __syncthreads: true for the LAST block of the grid to add to the monotonic counter
// ctr this round. One acquire-release add and no fence: its release covers what the barrier ordered
// before it (every thread's copies and reads), and its acquire makes every earlier block's work visible
// to the last block (whose signals, releases after the next barrier, pass it on).
__device__ inline bool last_to_arrive(long long* ctr, const PurlinSnacParams& p) {
  return (fetch_inc_acq_rel_sys(ctr) + 1) % static_cast<unsigned long long>(p.blocks) == 0;
}
// This block has done its share of the ops before `o` (the first of a run of signals); the last block to
// arrive then gives every signal of the run.
__device__ inline bool arrive_last(const long long* o, const PurlinSnacParams& p) {
  return last_to_arrive(reinterpret_cast<long long*>(own(p) + p.arrive_off + o[3] * 8), p);
}

// One thread of the last block: give one signal (a system-scope release store of the new count). No
// fence before it: a release is cumulative, so what this thread saw (the election's acquire, passed on
// by the barrier after it) is visible to the peer that acquires the count.
__device__ inline void give_signal(const long long* o, const PurlinSnacParams& p) {
  const int kind = sub_of(o[0]);
  const long long peer = o[1], item = o[2], k = o[4];
  char* me = own(p);
  char* remote = static_cast<char*>(p.bases[peer]);
  if (kind == kNotify) {
    const long long v = ld_relaxed_sys(word(me, p.sent_off, p, peer, item)) + k;
    st_release_sys(word(remote, p.notify_off, p, p.rank, item), v);
  } else {
    const long long v = ld_relaxed_sys(word(me, p.acked_off, p, peer, item)) + k;
    st_release_sys(word(remote, p.ack_off, p, p.rank, item), v);
  }
}

__device__ inline bool exec_wait(const long long* o, const PurlinSnacParams& p, long long index) {
  const int kind = sub_of(o[0]);
  const long long peer = o[1], item = o[2], k = o[3];
  char* me = own(p);
  const bool notify = kind == kNotify;
  const long long start = ld_relaxed_sys(word(me, notify ? p.expect_off : p.sent_off, p, peer, item));
  const long long* w = word(me, notify ? p.notify_off : p.ack_off, p, peer, item);
  return wait_ge(p, w, start + k, index, kind, peer, item);
}

// Thread 0, after a __syncthreads: every block of the grid meets here (one acquire-release add, then the
// wait's acquire polls: each block's work before it is visible to every block after it; no fence).
__device__ inline bool exec_barrier(const long long* o, const PurlinSnacParams& p, long long index) {
  auto* ctr = reinterpret_cast<long long*>(own(p) + p.arrive_off + o[1] * 8);
  const unsigned long long b = static_cast<unsigned long long>(p.blocks);
  const unsigned long long old = fetch_inc_acq_rel_sys(ctr);
  const long long target = static_cast<long long>((old / b + 1) * b);
  return wait_ge(p, reinterpret_cast<const long long*>(ctr), target, index, kBarrierKind, p.rank, o[1]);
}

// Every thread: some (peer, item) pairs of the drain-all, polled in parallel; true when drained.
__device__ inline bool exec_drain_all(const long long* o, const PurlinSnacParams& p, long long index) {
  const long long items = o[1];
  char* me = own(p);
  for (long long j = threadIdx.x; j < p.world * items; j += blockDim.x) {
    const long long peer = j / items, item = j % items;
    if (peer == p.rank) continue;
    const long long target = ld_relaxed_sys(word(me, p.sent_off, p, peer, item));
    if (!wait_ge(p, word(me, p.ack_off, p, peer, item), target, index, kDrain, peer, item)) return false;
  }
  return true;
}

// Words of a schedule (records, then the mirror update pairs) kept in shared memory (8 KiB): the 8-rank
// one-shot is 25 records and 21 pairs (342 words); a longer table is read from global memory.
constexpr long long kTableWords = 1024;

template <class T>
__global__ void __launch_bounds__(SnacConfig::kThreads, 1) snac_kernel(PurlinSnacParams p) {
  const bool lead = threadIdx.x == 0;
  __shared__ int s_last;
  // The op table in shared memory, loaded once by the whole block: reading a record, finding the end
  // of a run of signals or waits, and the mirror updates at exit then cost no global round trip each
  // (from global memory, each is a dependent load, one after another).
  __shared__ long long table[kTableWords];
  const long long words = p.n_ops * kOpWords + 2 * p.n_updates;
  const long long* ops = p.ops;
  if (words <= kTableWords) {
    for (long long w = threadIdx.x; w < words; w += blockDim.x) table[w] = p.ops[w];
    ops = table;
  }
  char* me = own(p);
  if (__syncthreads_or(lead && ld_relaxed_sys(reinterpret_cast<const long long*>(me + p.error_off)) != 0)) return;
  push_descriptor(p);
  for (long long i = 0; i < p.n_ops; ++i) {
    const long long* o = ops + i * kOpWords;
    const long long w0 = o[0];
    switch (int(w0 & kOpcodeMask)) {  // opcode_of(w0), written out: the switch keeps its value range
      case kCopy: exec_copy(o, p); break;
      case kReduce:
        if constexpr (std::is_same_v<T, void>) {  // a reduce in the copy-only kernel: never skipped
          if (lead) record_bad_record(p, i, w0);
          return;
        } else {
          if (!reduce_record_ok(w0)) {
            if (lead) record_bad_record(p, i, w0);
            return;
          }
          exec_reduce<T>(o, p);
        }
        break;
      case kSignal: {  // a run of signals: one arrival, then the last block gives them all
        const long long n = run_length(ops, p.n_ops, i, kSignal);
        __syncthreads();
        if (lead) s_last = arrive_last(o, p);
        __syncthreads();
        if (s_last) {
          for (long long j = threadIdx.x; j < n; j += blockDim.x) give_signal(o + j * kOpWords, p);
        }
        i += n - 1;
        break;
      }
      case kWait: {  // a run of waits: polled by one thread each, in parallel
        const long long n = run_length(ops, p.n_ops, i, kWait);
        bool ok = true;
        for (long long j = threadIdx.x; j < n; j += blockDim.x) ok = ok && exec_wait(o + j * kOpWords, p, i + j);
        if (__syncthreads_or(!ok)) return;
        i += n - 1;
        break;
      }
      case kDrainAll:
        if (__syncthreads_or(!exec_drain_all(o, p, i))) return;
        break;
      case kBarrier:
        if ((flags_of(w0) & kFlagInPlaceOnly) && p.input != p.output) break;
        __syncthreads();
        if (__syncthreads_or(lead && !exec_barrier(o, p, i))) return;
        break;
      default:  // an unknown opcode (or a packet one): recorded, never skipped
        if (lead) record_bad_record(p, i, w0);
        return;
    }
  }
  if (p.n_updates == 0) return;  // no mirrors to write back: no exit counter, no fences
  __syncthreads();
  if (lead) {  // acquire-release: every block's reads of the mirrors come before the last block's writes
    s_last = last_to_arrive(reinterpret_cast<long long*>(me + p.exit_off), p);
  }
  __syncthreads();
  if (!s_last) return;
  // The last block to finish: every block has read the mirrors. Each pair names another mirror word
  // (one per peer, item and counter), so the block's threads write them back in parallel.
  const long long* up = ops + p.n_ops * kOpWords;
  for (long long u = threadIdx.x; u < p.n_updates; u += blockDim.x) {
    long long* m = reinterpret_cast<long long*>(me + up[2 * u]);
    *m = *m + up[2 * u + 1];
  }
}

}  // namespace purlin::snac
