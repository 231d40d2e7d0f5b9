// The MoE dispatch and combine kernels (plans: purlin_sglang/moe/plan.py). One launch per call
// and rank; every block of a rank's grid runs every phase; the grids of all ranks on a GPU must be
// co-resident (the host sizes them). All state is in device memory and carries an epoch, so a
// captured CUDA graph replays correctly and nothing is zeroed between calls. Signals between ranks are
// at system scope, or at GPU scope when every rank's region lies on this GPU (p.one_device).
//
// My region's own words (State, at state_off): per kind (dispatch, combine) the epoch of the last
// call and an exit counter (the last block to exit stores the epoch); a fatal word (a timed-out wait or
// a mismatch: later kernels exit at once). (Words kDispArrive and kCombArrive are unused.)
//
// dispatch, epoch e, parity e & 1 (the caller's x and topk ids go in as they are):
//   route      every block counts my rows per global expert and my tokens per destination rank
//              (shared-memory histograms over all ids), and for its own token range, 32 tokens at a
//              time, warp 0 ranks each (t, k) among my slots of its expert (j, in (t, k) order) and
//              each token among my tokens sent to a rank (its slot there)
//   put rows   (token, part of the row) per warp: header + payload into slot [me][pos] of every
//              destination's receive region (parity), each 16-byte unit read (and quantised) once and
//              stored to every destination of the token. FP8, scale = amax / 448 (1 for an all-zero
//              row), q = x * (1 / scale): a bf16 / fp16 row of up to kHeldRowBytes is read once by a
//              group of four warps, held in registers from its amax to its quantisation (held_rows);
//              other rows: the other warps take each token's amax before the puts, which read the
//              row again
//   counts out block 0, once routed (before the puts): to EVERY rank (also when I send it nothing), my
//              count word [epoch, tokens, meta, rows per its local expert], epoch last (release)
//   delivered  each block, its rows put, adds one to ddone[me] in every rank's region (release)
//   wait       threads 0..world-1 poll my count words of epoch e and ddone[q] >= e * blocks: every row
//              of producer q has landed (bounded by timeout_ns)
//   expand     (received token, part of its row) per warp: the slot read once, stored to one row per k at
//              le*world*capacity + offset(src, le) + j; rows with j >= capacity are not written (the
//              overflow is recorded: never silent)
// combine, epoch e:
//   put back   warp per valid row: to slot t*K + k of its source's return region (parity)
//   notify     each block, its rows put back, adds one to done[me] in every rank's region (release); a
//              rank that rejected its arguments first stores e | kRejectBit in its pointer block's c_epoch
//   wait       threads poll done[q] >= e * blocks for every q, then read q's c_epoch (the reject bit)
//   reduce     y[t] = sum_k w[t,k] * ret[t*K+k], float32 (no FMA contraction), k = 0..K-1
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "purlin/encoding.h"
#include "purlin/native.h"
#include "snac/ops.cuh"
#include "snac/packet.cuh"

namespace purlin::moe {

using snac::globaltimer;
using snac::st_volatile;

struct MoeConfig {
  static constexpr unsigned kThreads = 512;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kChunk = 32;  // tokens routed per step: one per lane of warp 0
  static constexpr int kMaxTopk = 32;
  static constexpr float kFp8Max = 448.0f;  // largest finite e4m3
  // FP8 rows read once: a group of kHeldWarps warps holds a token's row in registers (kHeldInt4 16-byte
  // loads a lane, kHeldRowBytes of input at most) from its amax to its quantisation
  static constexpr int kHeldWarps = 4;
  static constexpr int kHeldLanes = kHeldWarps * 32;
  static constexpr int kHeldInt4 = 8;
  static constexpr long long kHeldRowBytes = kHeldLanes * kHeldInt4 * 16;
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

// Warp 0 of block 0 (tid < 32): the received counts cnt[q * L + le] (shared) over capacity, and ids out
// of range; only the first overflow in (source, expert) order is recorded (one writer: a record's words
// never mix two overflows).
__device__ inline void record_counts(const PurlinMoeParams& p, const int* cnt, long long cap, long long e, int nbad) {
  const int lane = threadIdx.x;
  const long long n = p.world * p.local;
  for (long long i0 = 0; i0 < n; i0 += 32) {
    const long long i = i0 + lane;
    const unsigned over = __ballot_sync(0xffffffffu, i < n && cnt[i] > cap);
    if (over != 0u) {
      if (lane == __ffs(over) - 1) {
        record(p, kOverflow, 0, i / p.local, p.rank * p.local + i % p.local, cnt[i], cap, e, 0, false);
      }
      break;
    }
  }
  if (lane == 0 && nbad > 0) record(p, kBadIds, 0, -1, -1, nbad, 0, e, 0, false);
}

// Signals between ranks (count words, done words, arrival counters): at system scope, or at GPU scope
// when every rank's region lies on this GPU (p.one_device: virtual ranks), where system scope orders
// nothing more and costs more. A signal is a release (store, add) or an acquire-release add after a
// __syncthreads, with no fence of its own: a release is cumulative, so what the block's threads did before
// the barrier is visible to the rank that acquires the word (the PTX memory model's release pattern).
__device__ __forceinline__ long long sig_relaxed(const PurlinMoeParams& p, const long long* w) {
  return p.one_device ? snac::ld_relaxed_gpu(w) : snac::ld_relaxed_sys(w);
}
__device__ __forceinline__ long long sig_acquire(const PurlinMoeParams& p, const long long* w) {
  return p.one_device ? snac::ld_acquire_gpu(w) : snac::ld_acquire_sys(w);
}
__device__ __forceinline__ void sig_release(const PurlinMoeParams& p, long long* w, long long v) {
  if (p.one_device) {
    snac::st_release_gpu(w, v);
  } else {
    snac::st_release_sys(w, v);
  }
}
__device__ __forceinline__ void sig_add(const PurlinMoeParams& p, long long* w, long long v) {
  if (p.one_device) {
    snac::red_release_gpu(w, v);
  } else {
    snac::red_release_sys(w, v);
  }
}
// Phase stamps (p.trace, when given): block 0's thread 0 stores the globaltimer at the end of each phase,
// in word `phase` of row `kind` (0 dispatch: start, put, notify, wait, expand, pad; 1 combine: start,
// put_back, notify, wait, reduce; abi.py MOE_TRACE_PHASES). The globaltimer is one clock for every rank of
// a GPU, so the rows of virtual ranks compare: launch skew, who waited for whom.
__device__ __forceinline__ void stamp(const PurlinMoeParams& p, int kind, int phase) {
  if (p.trace != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    st_volatile(p.trace + kind * PURLIN_MOE_TRACE_WORDS + phase, static_cast<long long>(globaltimer()));
  }
}

// Wait until (*w without kRejectBit) >= target (relaxed polls, then one acquire); false on timeout or a
// fatal error. A word that counts per_call a call (arrive_all) is recorded in calls.
__device__ inline bool wait_ge(const PurlinMoeParams& p, const long long* w, long long target, int kind,
                               long long peer, long long per_call = 1) {
  long long v = sig_relaxed(p, w) & ~kRejectBit;
  if (v < target) {
    const unsigned long long t0 = globaltimer();
    const volatile long long* fatal = state(p) + kFatal;
    while ((v = sig_relaxed(p, w) & ~kRejectBit) < target) {
      if (*fatal) return false;
      if (globaltimer() - t0 > static_cast<unsigned long long>(p.timeout_ns)) {
        record(p, kTimeout, kind, peer, -1, 0, 0, target / per_call, v / per_call, true);
        return false;
      }
    }
  }
  (void)sig_acquire(p, w);
  return true;
}

// A warp copies n bytes (a multiple of 16; both pointers 16-byte aligned).
__device__ __forceinline__ void warp_copy16(char* dst, const char* src, long long n, int lane) {
  const int4* s = reinterpret_cast<const int4*>(src);
  int4* d = reinterpret_cast<int4*>(dst);
  constexpr int kUnroll = 8;  // loads in flight per lane
  const long long nv = n >> 4;
  long long i = lane;
  for (; i + 32 * (kUnroll - 1) < nv; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = s[i + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + 32 * u] = v[u];
  }
  for (; i < nv; i += 32) d[i] = s[i];
}

// Every block of this call, once its work is done: adds one to word[me] in every rank's region (release,
// threads 0..W-1; no block waits for another). A rank has seen all of producer q's work of call e once
// its word q reaches e * blocks (every rank's grid has `blocks` blocks). No fence before the adds (the
// signals' note above).
__device__ inline void arrive_all(const PurlinMoeParams& p, long long off) {
  __syncthreads();
  if (threadIdx.x < p.world) {
    sig_add(p, reinterpret_cast<long long*>(static_cast<char*>(p.bases[threadIdx.x]) + off) + p.rank, 1);
  }
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

// ---- dispatch: routing ---------------------------------------------------------------------------------

// The dispatch kernel's shared memory (static, under 48 KiB). The route's arrays are reused once the
// rows are put: cnt / pre as the received count matrix and its offsets, the chunk's arrays as row lists.
struct DispatchShared {
  int cnt[PURLIN_MOE_MAX_EXPERTS];  // route: my rows per global expert; expand: rows from [q][le]
  int pre[PURLIN_MOE_MAX_EXPERTS];  // route: my rows per expert before the chunk; expand: offset of [q][le]
  int tok[PURLIN_MOE_MAX_RANKS];    // my tokens per destination rank
  int tpre[PURLIN_MOE_MAX_RANKS];   // ... before the chunk
  int tstart[PURLIN_MOE_MAX_RANKS + 1];
  union {
    struct {
      int j[MoeConfig::kChunk * MoeConfig::kMaxTopk];  // j of the chunk's slots, -1: skipped
      union {
        int pos[MoeConfig::kChunk * PURLIN_MOE_MAX_RANKS];  // slot of (chunk token, rank) there
        long long ref[MoeConfig::kChunk * MoeConfig::kMaxTopk];  // one pass: receiver << 32 | row, -1: none
      };
    } route;
    long long rows[MoeConfig::kWarps][MoeConfig::kMaxTopk];  // expand: each warp's rows of its token
  } u;
  unsigned long long mask[MoeConfig::kChunk];  // destination ranks of each chunk token
  float scale[MoeConfig::kChunk];
  float amax[2][MoeConfig::kWarps];  // held rows: each warp's part of its token's amax (two tokens in turn)
  long long e;
  int fail, bad, nbad;
};

// Every block of a dispatch (kind 0) or a combine (kind 1), first: this call's epoch into s_e, s_fail set
// by an earlier fatal error, s_clear (the dispatch's bad, the combine's reject seen later) cleared; false (the
// block has finished) when an earlier error ended this rank's kernels.
__device__ inline bool call_begins(const PurlinMoeParams& p, int kind, long long& s_e, int& s_fail, int& s_clear) {
  long long* st = state(p);
  long long* epoch = st + (kind == 0 ? kDispEpoch : kCombEpoch);
  if (threadIdx.x == 0) {
    s_e = *reinterpret_cast<volatile long long*>(epoch) + 1;
    s_fail = reinterpret_cast<volatile long long*>(st)[kFatal] != 0;
    s_clear = 0;
  }
  __syncthreads();
  stamp(p, kind, 0);
  if (s_fail) {
    finish(st + (kind == 0 ? kDispExit : kCombExit), epoch, s_e);
    return false;
  }
  return true;
}

// One block: my count word of epoch e to EVERY rank (also when I send it nothing): [epoch, tokens, meta,
// rows per its local expert], the epoch last (release).
__device__ inline void count_words_out(const PurlinMoeParams& p, const DispatchShared& s, int par, long long e) {
  const long long W = p.world, L = p.local;
  for (long long i = threadIdx.x; i < W * (L + 2); i += blockDim.x) {
    const long long d = i / (L + 2), c = i % (L + 2);
    long long* cw = count_word(p, d, par, p.rank);
    if (c == 0) cw[1] = s.tok[d];
    else if (c == 1) cw[2] = meta(p);
    else reinterpret_cast<int*>(cw + 3)[c - 2] = s.cnt[d * L + c - 2];
  }
  __syncthreads();  // the block's words, then the epoch (a release: cumulative over the barrier's order)
  if (threadIdx.x < W) {
    sig_release(p, count_word(p, threadIdx.x, par, p.rank), e);
  }
}

__device__ __forceinline__ long long load_id(const PurlinMoeParams& p, long long i) {
  return p.ids_bytes == 4 ? static_cast<long long>(static_cast<const int*>(p.ids)[i])
                          : static_cast<const long long*>(p.ids)[i];
}

// The ranks that own one of token t's experts (bit d: rank d). The ids are loaded 8 at a time, so that
// a decode-size call waits for one load, not topk loads in series.
__device__ __forceinline__ unsigned long long token_mask(const PurlinMoeParams& p, long long t, long long E) {
  constexpr int kBatch = 8;
  unsigned long long m = 0;
  for (long long k0 = 0; k0 < p.topk; k0 += kBatch) {
    long long id[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) id[u] = k0 + u < p.topk ? load_id(p, t * p.topk + k0 + u) : -1;
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (id[u] >= 0 && id[u] < E) m |= 1ull << (id[u] / p.local);
    }
  }
  return m;
}

// Every block: my rows per global expert (cnt), per expert those of tokens before t0 (pre), my tokens
// per destination rank (tok) and those before t0 (tpre), ids outside [-1, E) (nbad). Histograms with
// shared atomics: counts do not depend on the order. Every loop issues its loads at once (a decode-size
// call costs a load's latency per loop, not one per top-k column).
__device__ inline void route_counts(const PurlinMoeParams& p, DispatchShared& s, long long t0, long long E) {
  const int tid = threadIdx.x;
  for (long long i = tid; i < E; i += blockDim.x) s.cnt[i] = s.pre[i] = 0;
  for (long long i = tid; i < p.world; i += blockDim.x) s.tok[i] = s.tpre[i] = 0;
  if (tid == 0) s.nbad = 0;
  __syncthreads();
  const long long K = p.topk, slots = p.tokens * K;
  for (long long i = tid; i < slots; i += blockDim.x) {
    const long long id = load_id(p, i);
    if (id >= 0 && id < E) {
      atomicAdd(&s.cnt[id], 1);
      if (i < t0 * K) atomicAdd(&s.pre[id], 1);
    } else if (id != -1) {
      atomicAdd(&s.nbad, 1);
    }
  }
  // tokens per destination: a warp per token, one id per lane (topk <= 32); the lowest lane of each
  // destination counts the token once
  const int lane = tid & 31;
  for (long long t = tid >> 5; t < p.tokens; t += blockDim.x >> 5) {
    const long long id = lane < K ? load_id(p, t * K + lane) : -1;
    const int d = id >= 0 && id < E ? int(id / p.local) : -1;
    const unsigned same = __match_any_sync(0xffffffffu, d);
    if (d >= 0 && (same & ((1u << lane) - 1u)) == 0u) {
      atomicAdd(&s.tok[d], 1);
      if (t < t0) atomicAdd(&s.tpre[d], 1);
    }
  }
  __syncthreads();
}

// Warp 0, lane's slot i of a step of 32 slots (in the chunk where i < end): its expert id (-1: not routed)
// and j, its rank among my slots of that expert in (t, k) order (-1: not routed); advances pre past the
// step's slots.
__device__ __forceinline__ int slot_rank(const PurlinMoeParams& p, DispatchShared& s, long long i, long long end,
                                         int lane, long long E, long long* id_out) {
  const long long id = i < end ? load_id(p, i) : -1;
  const bool valid = i < end && id >= 0 && id < E;
  const unsigned peers = __match_any_sync(0xffffffffu, valid ? int(id) : -2 - lane);
  const int base = valid ? s.pre[id] : 0;
  __syncwarp();
  if (valid && (peers >> lane) == 1u) s.pre[id] = base + __popc(peers);  // the group's highest lane
  __syncwarp();
  *id_out = valid ? id : -1;
  return valid ? base + __popc(peers & ((1u << lane) - 1u)) : -1;
}

// Warp 0: j of every slot of tokens [c0, c0 + n) (slot_rank) and the slot of each (token, destination)
// there (its rank among my tokens sent to that rank); advances pre and tpre past the chunk. Also writes
// out_valid.
__device__ inline void route_chunk(const PurlinMoeParams& p, DispatchShared& s, long long c0, int n, int lane,
                                   long long E) {
  const unsigned full = 0xffffffffu, below = (1u << lane) - 1u;
  const long long K = p.topk, begin = c0 * K, end = (c0 + n) * K;
  for (long long s0 = begin; s0 < end; s0 += 32) {
    const long long i = s0 + lane;
    long long id;
    const int j = slot_rank(p, s, i, end, lane, E, &id);
    if (i < end) {
      s.u.route.j[i - begin] = j;
      p.out_valid[i] = id >= 0 ? 1 : 0;
    }
  }
  const unsigned long long m = lane < n ? token_mask(p, c0 + lane, E) : 0ull;
  if (lane < n) s.mask[lane] = m;
  for (int d = 0; d < p.world; ++d) {
    const bool hit = (m >> d) & 1ull;
    const unsigned bal = __ballot_sync(full, hit);
    const int base = s.tpre[d];
    if (hit) s.u.route.pos[lane * p.world + d] = base + __popc(bal & below);
    __syncwarp();
    if (lane == 0) s.tpre[d] = base + __popc(bal);
    __syncwarp();
  }
}

// ---- dispatch: rows on the wire ------------------------------------------------------------------------

// A lane's running amax over the 16-byte units it reads. 16-bit elements are compared two to a
// word in their own format (max.xorsign.abs: the larger magnitude of each pair, its sign bit not
// meaningful and cleared at the end); a magnitude converts to float exactly, so the result is the
// float amax of the elements (a NaN operand yields the other, as in fmaxf: PTX max without .NaN).
// float elements: fmaxf of |x|.
template <class T>
struct AbsMax {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "16-bit elements (float: below)");
  unsigned w = 0;  // two 16-bit magnitudes
  __device__ __forceinline__ static unsigned max2(unsigned a, unsigned b) {
    unsigned d;
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    } else {
      asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    }
    return d;
  }
  __device__ __forceinline__ void add(const int4& u) {
    w = max2(w, max2(max2(static_cast<unsigned>(u.x), static_cast<unsigned>(u.y)),
                     max2(static_cast<unsigned>(u.z), static_cast<unsigned>(u.w))));
  }
  __device__ __forceinline__ float value() const {
    const unsigned m = w & 0x7fff7fffu;
    const unsigned short lo = static_cast<unsigned short>(m), hi = static_cast<unsigned short>(m >> 16);
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      return fmaxf(__bfloat162float(__ushort_as_bfloat16(lo)), __bfloat162float(__ushort_as_bfloat16(hi)));
    } else {
      return fmaxf(__half2float(__ushort_as_half(lo)), __half2float(__ushort_as_half(hi)));
    }
  }
};
template <>
struct AbsMax<float> {
  float m = 0.0f;
  __device__ __forceinline__ void add(const int4& u) {
    m = fmaxf(fmaxf(m, fabsf(__int_as_float(u.x))), fabsf(__int_as_float(u.y)));
    m = fmaxf(fmaxf(m, fabsf(__int_as_float(u.z))), fabsf(__int_as_float(u.w)));
  }
  __device__ __forceinline__ float value() const { return m; }
};

template <class T>
__device__ __forceinline__ float row_amax(const T* row, long long hidden, int lane) {
  constexpr int kVec = 16 / sizeof(T);
  AbsMax<T> a;
  const int4* v = reinterpret_cast<const int4*>(row);
  for (long long i = lane; i < hidden / kVec; i += 32) a.add(v[i]);
  float m = a.value();
#pragma unroll
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Unit u (16 bytes on the wire) of token t's row: the input's bytes, or 16 elements quantised to FP8
// (x * inv, inv = 1 / scale, each rounded to nearest; the FP8 conversion saturating: bitwise the CPU
// engine's quantize_fp8).
// Two elements a conversion (cvt.rn.satfinite.e4m3x2.f32, the instruction the one-element form also
// issues, its other half unused): element 2j in the low byte of pair j.
template <class T>
__device__ __forceinline__ int4 fp8_pack(const int4* raw, float inv) {  // 16 elements: sizeof(T) int4
  const T* e = reinterpret_cast<const T*>(raw);
  unsigned o[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    unsigned short pair[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int i = 4 * k + 2 * j;
      const float2 f = make_float2(__fmul_rn(to_f<T>(e[i]), inv), __fmul_rn(to_f<T>(e[i + 1]), inv));
      pair[j] = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
    }
    o[k] = static_cast<unsigned>(pair[0]) | (static_cast<unsigned>(pair[1]) << 16);
  }
  return make_int4(static_cast<int>(o[0]), static_cast<int>(o[1]), static_cast<int>(o[2]), static_cast<int>(o[3]));
}

// The factor a token's elements are multiplied by before their FP8 conversion: 1 / scale, correctly
// rounded.
__device__ __forceinline__ float fp8_inverse(float scale) { return __frcp_rn(scale); }

template <class T>
__device__ __forceinline__ int4 fp8_unit(const T* row, long long u, float inv) {
  constexpr int kIn = 16 * sizeof(T) / 16;  // int4 loads per 16 elements
  int4 raw[kIn];
  const int4* src = reinterpret_cast<const int4*>(row) + u * kIn;
#pragma unroll
  for (int i = 0; i < kIn; ++i) raw[i] = src[i];
  return fp8_pack<T>(raw, inv);
}

__device__ __forceinline__ float fp8_scale(float amax) { return amax > 0.0f ? __fdiv_rn(amax, MoeConfig::kFp8Max) : 1.0f; }

// A lane's share of a token's row of 16-bit elements (bf16 or fp16), held in registers: output units
// (16 elements, 16 bytes of FP8) gl + i * kHeldLanes of the row, for gl its lane in the group. One type
// for both element types (a uniform branch per unit), so that the kernel holds one copy of the rows.
struct HeldRow {
  static constexpr int kIn = 2;  // int4 loads per output unit
  static constexpr int kUnits = MoeConfig::kHeldInt4 / kIn;
  int4 raw[MoeConfig::kHeldInt4];

  // Every load at once; the lane's amax of what it holds (0 for none).
  __device__ __forceinline__ float load(const char* row, long long units, int gl, bool bf16) {
    const int4* src = reinterpret_cast<const int4*>(row);
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      const long long u = gl + static_cast<long long>(i) * MoeConfig::kHeldLanes;
#pragma unroll
      for (int j = 0; j < kIn; ++j) {
        if (u < units) raw[i * kIn + j] = src[u * kIn + j];
      }
    }
    AbsMax<__nv_bfloat16> b;
    AbsMax<__half> h;
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      if (gl + static_cast<long long>(i) * MoeConfig::kHeldLanes < units) {
#pragma unroll
        for (int j = 0; j < kIn; ++j) {
          if (bf16) {
            b.add(raw[i * kIn + j]);
          } else {
            h.add(raw[i * kIn + j]);
          }
        }
      }
    }
    return bf16 ? b.value() : h.value();
  }
  __device__ __forceinline__ void quantise(float scale, bool bf16, int4 (&q)[kUnits]) const {
    const float inv = fp8_inverse(scale);
#pragma unroll
    for (int i = 0; i < kUnits; ++i) {
      q[i] = bf16 ? fp8_pack<__nv_bfloat16>(&raw[i * kIn], inv) : fp8_pack<__half>(&raw[i * kIn], inv);
    }
  }
};

// Named barrier of the kHeldLanes threads of held-row group g (barrier 0 is __syncthreads'; g < 4).
__device__ __forceinline__ void group_sync(int g) {
  switch (g) {
    case 0: asm volatile("bar.sync 1, %0;" ::"n"(MoeConfig::kHeldLanes) : "memory"); break;
    case 1: asm volatile("bar.sync 2, %0;" ::"n"(MoeConfig::kHeldLanes) : "memory"); break;
    case 2: asm volatile("bar.sync 3, %0;" ::"n"(MoeConfig::kHeldLanes) : "memory"); break;
    default: asm volatile("bar.sync 4, %0;" ::"n"(MoeConfig::kHeldLanes) : "memory"); break;
  }
}
static_assert(MoeConfig::kWarps / MoeConfig::kHeldWarps <= 4, "group_sync names barriers 1..4");

// FP8 rows of bf16 or fp16 that kHeldRowBytes hold (the others take token_scale, then wire_unit: the row
// read twice).
__device__ __forceinline__ bool rows_held(const PurlinMoeParams& p) {
  return p.quant && p.x_dtype != PURLIN_DTYPE_FLOAT32 && p.payload_bytes * 2 <= MoeConfig::kHeldRowBytes;
}

// Every warp of the block: chunk tokens [0, n) (tokens c0 + tt) read once and quantised by groups of
// kHeldWarps warps, a token per group at a time: each lane loads its units, the group's amax is met in
// shared memory, then `store(tt, t, gw, gl, lane, scale, q)` stores the lane's FP8 units q (unit gl + i *
// kHeldLanes of the row) wherever the path puts them (gw: the warp's index in its group).
template <class Store>
__device__ inline void held_rows(const PurlinMoeParams& p, DispatchShared& s, long long c0, int n, Store store) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int groups = (blockDim.x >> 5) / MoeConfig::kHeldWarps, g = warp / MoeConfig::kHeldWarps;
  const int gw = warp % MoeConfig::kHeldWarps, gl = gw * 32 + lane;
  if (g >= groups) return;
  const long long hidden = p.payload_bytes, units = hidden / 16;
  const bool bf16 = p.x_dtype == PURLIN_DTYPE_BFLOAT16;
  int buf = 0;
  for (int tt = g; tt < n; tt += groups, buf ^= 1) {  // a buffer per turn: one barrier a token suffices
    const long long t = c0 + tt;
    HeldRow row;
    float m = row.load(static_cast<const char*>(p.x) + t * hidden * 2, units, gl, bf16);
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) s.amax[buf][warp] = m;
    group_sync(g);
    float amax = 0.0f;
#pragma unroll
    for (int w = 0; w < MoeConfig::kHeldWarps; ++w) amax = fmaxf(amax, s.amax[buf][g * MoeConfig::kHeldWarps + w]);
    const float scale = fp8_scale(amax);
    int4 q[HeldRow::kUnits];
    row.quantise(scale, bf16, q);
    store(tt, t, gw, gl, lane, scale, q);
  }
}

// A lane's FP8 units q of a held row to the row at dst (one of the token's destinations).
template <int N>
__device__ __forceinline__ void store_held(char* dst, const int4 (&q)[N], int gl, long long units) {
  int4* out = reinterpret_cast<int4*>(dst);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const long long u = gl + static_cast<long long>(i) * MoeConfig::kHeldLanes;
    if (u < units) out[u] = q[i];
  }
}

__device__ __forceinline__ int4 wire_unit(const PurlinMoeParams& p, long long t, long long u, float inv) {
  const char* x = static_cast<const char*>(p.x);
  if (!p.quant) return reinterpret_cast<const int4*>(x + t * p.payload_bytes)[u];
  const long long hidden = p.payload_bytes;  // FP8: one byte per element
  switch (p.x_dtype) {
    case PURLIN_DTYPE_BFLOAT16:
      return fp8_unit(reinterpret_cast<const __nv_bfloat16*>(x) + t * hidden, u, inv);
    case PURLIN_DTYPE_FLOAT16: return fp8_unit(reinterpret_cast<const __half*>(x) + t * hidden, u, inv);
    default: return fp8_unit(reinterpret_cast<const float*>(x) + t * hidden, u, inv);
  }
}

__device__ __forceinline__ float token_scale(const PurlinMoeParams& p, long long t, int lane) {
  const long long hidden = p.payload_bytes;
  const char* x = static_cast<const char*>(p.x);
  float amax;
  switch (p.x_dtype) {
    case PURLIN_DTYPE_BFLOAT16:
      amax = row_amax(reinterpret_cast<const __nv_bfloat16*>(x) + t * hidden, hidden, lane);
      break;
    case PURLIN_DTYPE_FLOAT16: amax = row_amax(reinterpret_cast<const __half*>(x) + t * hidden, hidden, lane); break;
    default: amax = row_amax(reinterpret_cast<const float*>(x) + t * hidden, hidden, lane); break;
  }
  return fp8_scale(amax);
}

// My slot base in rank d's receive region for the chunk token tt (rows go to [me][pos]).
__device__ __forceinline__ char* recv_slot(const PurlinMoeParams& p, const DispatchShared& s, int par, int tt,
                                           int d) {
  return static_cast<char*>(p.bases[d]) + p.recv_off + par * p.recv_parity_bytes +
         (p.rank * p.max_tokens + s.u.route.pos[tt * p.world + d]) * p.slot_bytes;
}

// The destination ranks of a token, rotated to start at rank me + 1 (bit b: rank (b + me + 1) % W), so
// that the ranks do not all write to one peer at once.
__device__ __forceinline__ unsigned long long rotated(unsigned long long m, long long me, long long W) {
  const long long sh = (me + 1) % W;
  const unsigned long long all = W == 64 ? ~0ull : ((1ull << W) - 1ull);
  return sh == 0 ? m : (((m >> sh) | (m << (W - sh))) & all);
}

// Warp: the header of chunk token tt (token t) in each of its destinations.
__device__ inline void put_header(const PurlinMoeParams& p, const DispatchShared& s, int par, int tt, long long t,
                                  long long E, int lane) {
  const long long K = p.topk;
  const long long id = lane < K ? load_id(p, t * K + lane) : -1;
  const bool valid = id >= 0 && id < E;
  for (unsigned long long m = s.mask[tt]; m; m &= m - 1) {
    const int d = __ffsll(static_cast<long long>(m)) - 1;
    int* h = reinterpret_cast<int*>(recv_slot(p, s, par, tt, d));
    if (lane == 0) {
      h[0] = int(t);
      h[1 + 2 * K] = __float_as_int(p.quant ? s.scale[tt] : 1.0f);
    }
    if (lane < K) {
      const bool mine = valid && id / p.local == d;
      h[1 + lane] = mine ? int(id % p.local) : -1;
      h[1 + K + lane] = mine ? s.u.route.j[tt * K + lane] : -1;
    }
  }
}

// Warp: units [u0, u1) of chunk token tt's payload to each of its destinations, each unit read once.
__device__ inline void put_units(const PurlinMoeParams& p, const DispatchShared& s, int par, int tt, long long t,
                                 long long u0, long long u1, int lane) {
  const unsigned long long rot = rotated(s.mask[tt], p.rank, p.world);
  const float inv = p.quant ? fp8_inverse(s.scale[tt]) : 1.0f;
  constexpr int kUnroll = 4;
  for (long long u = u0 + lane; u < u1; u += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (u + 32 * i < u1) v[i] = wire_unit(p, t, u + 32 * i, inv);
    }
    for (unsigned long long m = rot; m; m &= m - 1) {
      const int d = int((__ffsll(static_cast<long long>(m)) - 1 + p.rank + 1) % p.world);
      int4* dst = reinterpret_cast<int4*>(recv_slot(p, s, par, tt, d) + p.hdr_bytes);
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        if (u + 32 * i < u1) dst[u + 32 * i] = v[i];
      }
    }
  }
}

// Every warp: route and put the rows of this block's tokens [t0, t1), kChunk tokens at a time.
__device__ inline void put_rows(const PurlinMoeParams& p, DispatchShared& s, int par, long long t0, long long t1,
                                long long E) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const long long units = p.payload_bytes / 16;
  const bool held = rows_held(p);
  for (long long c0 = t0; c0 < t1; c0 += MoeConfig::kChunk) {
    const int n = int(min(static_cast<long long>(MoeConfig::kChunk), t1 - c0));
    if (warp == 0) {
      route_chunk(p, s, c0, n, lane, E);
    } else if (p.quant && !held) {
      for (int tt = warp - 1; tt < n; tt += nwarps - 1) {
        const float sc = token_scale(p, c0 + tt, lane);
        if (lane == 0) s.scale[tt] = sc;
      }
    }
    __syncthreads();
    if (held) {  // FP8: each row read once, the header written by the group's first warp once the scale is known
      held_rows(p, s, c0, n, [&](int tt, long long t, int gw, int gl, int ln, float scale, const auto& q) {
        if (gw == 0) {
          if (ln == 0) s.scale[tt] = scale;
          __syncwarp();
          put_header(p, s, par, tt, t, E, ln);
        }
        const unsigned long long rot = rotated(s.mask[tt], p.rank, p.world);
        for (unsigned long long m = rot; m; m &= m - 1) {
          const int d = int((__ffsll(static_cast<long long>(m)) - 1 + p.rank + 1) % p.world);
          store_held(recv_slot(p, s, par, tt, d) + p.hdr_bytes, q, gl, units);
        }
      });
      __syncthreads();
      continue;
    }
    // (token, part) items: a token's row is split so that every warp has work when the chunk is short
    const int parts = max(1, nwarps / n);
    const long long per = (units + parts - 1) / parts;
    for (int it = warp; it < n * parts; it += nwarps) {
      const int tt = it / parts, part = it % parts;
      if (part == 0) put_header(p, s, par, tt, c0 + tt, E, lane);
      put_units(p, s, par, tt, c0 + tt, part * per, min(units, (part + 1) * per), lane);
    }
    __syncthreads();
  }
}

// Every block, once the received counts are in s.cnt[q * L + le] and each producer's tokens in s.tstart[q + 1]
// (the receive-slot and decode dispatches): s.pre becomes the offset of each producer in each of my groups
// and s.tstart the producers' first received token; block 0 records overflows and writes out_counts.
__device__ inline void received_offsets(const PurlinMoeParams& p, DispatchShared& s, long long e) {
  const int tid = threadIdx.x;
  const long long W = p.world, L = p.local, cap = p.capacity;
  for (long long le = tid; le < L; le += blockDim.x) {
    int acc = 0;
    for (long long q = 0; q < W; ++q) {
      s.pre[q * L + le] = acc;
      acc += min(s.cnt[q * L + le], int(cap));
    }
  }
  if (tid == 0) {
    s.tstart[0] = 0;
    for (long long q = 0; q < W; ++q) s.tstart[q + 1] += s.tstart[q];
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    if (tid < 32) record_counts(p, s.cnt, cap, e, s.nbad);
    for (long long le = tid; le < L; le += blockDim.x) {
      p.out_counts[le] = s.pre[(W - 1) * L + le] + min(s.cnt[(W - 1) * L + le], int(cap));
    }
  }
}

// The padding rows of my groups (past each group's received rows, received_offsets): expert, source and slot
// -1, scale 1; spread over the grid.
__device__ inline void pad_rows(const PurlinMoeParams& p, const DispatchShared& s) {
  const long long W = p.world, L = p.local, cap = p.capacity, rows = L * W * cap;
  for (long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (long long)gridDim.x * blockDim.x) {
    const long long le = r / (W * cap), pos = r % (W * cap);
    if (pos >= s.pre[(W - 1) * L + le] + min(s.cnt[(W - 1) * L + le], int(cap))) {
      p.out_expert[r] = -1;
      p.out_src[r] = -1;
      p.out_slot[r] = -1;
      if (p.out_scales != nullptr) p.out_scales[r] = 1.0f;
    }
  }
}

// ---- dispatch: expand ----------------------------------------------------------------------------------

// Warp: units [u0, u1) of a received token of producer q (that part of its slot read once) to one row per k
// routed here; the part that starts at unit 0 also writes the rows' expert, source, slot and scale.
__device__ inline void expand_token(const PurlinMoeParams& p, DispatchShared& s, const char* slot, int q,
                                    long long u0, long long u1, int lane, int warp) {
  const long long K = p.topk, W = p.world, cap = p.capacity, L = p.local;
  const int* h = reinterpret_cast<const int*>(slot);
  long long row = -1;
  int le = -1;
  if (lane < K) {
    le = h[1 + lane];
    const int jj = h[1 + K + lane];
    if (le >= 0 && jj < cap) row = le * W * cap + s.pre[q * L + le] + jj;
  }
  const unsigned bal = __ballot_sync(0xffffffffu, row >= 0);
  const int nrows = __popc(bal);
  if (row >= 0) {
    s.u.rows[warp][__popc(bal & ((1u << lane) - 1u))] = row;
  }
  if (row >= 0 && u0 == 0) {
    p.out_expert[row] = le;
    p.out_src[row] = q;
    p.out_slot[row] = static_cast<long long>(h[0]) * K + lane;
    if (p.out_scales != nullptr) p.out_scales[row] = __int_as_float(h[1 + 2 * K]);
  }
  __syncwarp();
  const int4* src = reinterpret_cast<const int4*>(slot + p.hdr_bytes);
  int4* out = static_cast<int4*>(p.out_x);
  const long long units = p.payload_bytes / 16;
  constexpr int kUnroll = 4;
  for (long long u = u0 + lane; u < u1; u += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (u + 32 * i < u1) v[i] = src[u + 32 * i];
    }
    for (int r = 0; r < nrows; ++r) {
      int4* dst = out + s.u.rows[warp][r] * units;
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        if (u + 32 * i < u1) dst[u + 32 * i] = v[i];
      }
    }
  }
  __syncwarp();
}

// Each rank's pointer block, per parity, in its own region at ptr_off (PtrBlock): the one-pass
// dispatch's output pointers and capacity (visible to a peer once it has acquired one of my count words of
// that call, which I release after writing them), and the combine's expert_out with its epoch word
// (released; in the receive-slot combine only a rank that rejected its arguments writes the epoch word, e
// | kRejectBit, before its done adds). ddone[W] and done[W]: each producer's (consumer's) per-block
// arrivals of the dispatch (combine), e * blocks after call e.
struct PtrBlock {  // PURLIN_MOE_PTR_WORDS words
  long long out_x, out_expert, out_src, out_slot, out_scales, capacity, d_pad[2];
  long long c_epoch, expert_out, c_pad[6];
};
static_assert(sizeof(PtrBlock) == PURLIN_MOE_PTR_WORDS * 8, "PtrBlock is PURLIN_MOE_PTR_WORDS words");

__device__ __forceinline__ PtrBlock* ptr_block(const PurlinMoeParams& p, long long rank, int par) {
  return reinterpret_cast<PtrBlock*>(static_cast<char*>(p.bases[rank]) + p.ptr_off) + par;
}
__device__ __forceinline__ long long* ddone_word(const PurlinMoeParams& p, long long rank, long long producer) {
  return reinterpret_cast<long long*>(static_cast<char*>(p.bases[rank]) + p.ddone_off) + producer;
}
__device__ __forceinline__ long long* done_word(const PurlinMoeParams& p, long long rank, long long consumer) {
  return reinterpret_cast<long long*>(static_cast<char*>(p.bases[rank]) + p.done_off) + consumer;
}
__global__ void __launch_bounds__(MoeConfig::kThreads) moe_dispatch_kernel(PurlinMoeParams p) {
  __shared__ DispatchShared s;
  long long* st = state(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  if (!call_begins(p, 0, s.e, s.fail, s.bad)) return;
  const long long e = s.e;
  const int par = int(e & 1);
  const long long W = p.world, L = p.local, E = W * L;
  // route + put rows: this block's tokens
  const long long t0 = p.tokens * blockIdx.x / gridDim.x, t1 = p.tokens * (blockIdx.x + 1) / gridDim.x;
  route_counts(p, s, t0, E);
  // counts out: my count word to every rank, every call, as soon as the counts are known (the rows' arrival
  // is told by the delivered words)
  if (blockIdx.x == 0) count_words_out(p, s, par, e);
  put_rows(p, s, par, t0, t1, E);
  stamp(p, 0, 1);
  // delivered: each block of my grid, its rows put, tells every rank (the barrier in it also orders block
  // 0's reads of cnt above before cnt is overwritten below)
  arrive_all(p, p.ddone_off);
  stamp(p, 0, 2);
  // wait for every producer's count word of this epoch and every row it sent me
  if (tid < W && !(wait_ge(p, count_word(p, p.rank, par, tid), e, 0, tid) &&
                   wait_ge(p, ddone_word(p, p.rank, tid), e * p.blocks, 0, tid, p.blocks))) {
    s.fail = 1;
  }
  __syncthreads();
  stamp(p, 0, 3);
  if (!s.fail) {
    if (tid < W) {
      const long long* cw = count_word(p, p.rank, par, tid);
      if (cw[2] != meta(p)) {
        record(p, kMismatch, 0, tid, -1, cw[2], meta(p), e, 0, true);
        s.bad = 1;
      }
      s.tstart[tid + 1] = int(cw[1]);
    }
    for (long long i = tid; i < W * L; i += blockDim.x) {
      const long long q = i / L, c = i % L;
      s.cnt[i] = reinterpret_cast<const int*>(count_word(p, p.rank, par, q) + 3)[c];
    }
    __syncthreads();
  }
  if (!s.fail && !s.bad) {
    received_offsets(p, s, e);
    // expand: (received token, part of its row) per warp; a row is split into parts (at least 32 units,
    // 512 bytes, each) when there are fewer received tokens than warps in the grid (decode: a few tokens)
    const long long n_recv = s.tstart[W];
    const char* recv = own(p) + p.recv_off + par * p.recv_parity_bytes;
    const long long warps = (long long)gridDim.x * nwarps, units = p.payload_bytes / 16;
    const long long parts = n_recv > 0 ? max(1ll, min(warps / n_recv, (units + 31) / 32)) : 1;
    const long long per = (units + parts - 1) / parts;
    for (long long it = (long long)blockIdx.x * nwarps + warp; it < n_recv * parts; it += warps) {
      const long long g = it / parts, u0 = (it % parts) * per, u1 = min(units, u0 + per);
      int q = 0;
      while (s.tstart[q + 1] <= g) ++q;
      expand_token(p, s, recv + (q * p.max_tokens + (g - s.tstart[q])) * p.slot_bytes, q, u0, u1, lane, warp);
    }
    if (p.trace != nullptr) __syncthreads();  // the stamp: every warp of block 0 done
    stamp(p, 0, 4);
    pad_rows(p, s);
  }
  if (p.trace != nullptr) __syncthreads();
  stamp(p, 0, 5);
  finish(st + kDispExit, st + kDispEpoch, e);
}

// y[t] 16-byte chunk c: float32 sum over k in order, products and sums rounded separately (no FMA).
// row(t, k): where slot (t, k)'s row lies, or nullptr where it adds nothing.
template <class T, class Row>
__device__ inline void reduce_slots(const PurlinMoeParams& p, Row row) {
  constexpr int kVec = 16 / sizeof(T), kLoads = 8;
  const long long chunks = p.ret_bytes / 16, K = p.topk;
  const long long items = p.tokens * chunks;
  for (long long it = (long long)blockIdx.x * blockDim.x + threadIdx.x; it < items;
       it += (long long)gridDim.x * blockDim.x) {
    const long long t = it / chunks, c = it % chunks;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (long long k0 = 0; k0 < K; k0 += kLoads) {  // kLoads loads in flight, then the sums in k order
      int4 raw[kLoads];
      float w[kLoads];
      bool ok[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const long long k = k0 + u;
        const char* r = k < K ? row(t, k) : nullptr;
        ok[u] = r != nullptr;
        if (ok[u]) {
          w[u] = p.weights[t * K + k];
          raw[u] = *reinterpret_cast<const int4*>(r + c * 16);
        }
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        if (!ok[u]) continue;
        const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w[u], to_f<T>(v[i])));
      }
    }
    int4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < kVec; ++i) o[i] = from_f<T>(acc[i]);
    *reinterpret_cast<int4*>(static_cast<char*>(p.y) + t * p.ret_bytes + c * 16) = out;
  }
}

// The receive-slot path: slot (t, k) came back to ret[t * K + k].
template <class T>
__device__ inline void reduce_rows(const PurlinMoeParams& p, const char* ret) {
  const long long K = p.topk;
  reduce_slots<T>(p, [&](long long t, long long k) -> const char* {
    return p.valid[t * K + k] ? ret + (t * K + k) * p.ret_bytes : nullptr;
  });
}

// Put back: every valid row to slot t*K + k of its source. Each block takes a contiguous range of rows,
// kThreads at a time: their sources are read at once (one per thread) and the valid rows listed in shared
// memory; then the warps copy the listed rows, each row split into parts when there are fewer rows than
// warps (decode: a few valid rows among many padding rows).
__device__ inline void put_back(const PurlinMoeParams& p, int par, int* s_rows, int* s_wcnt) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const long long rows = p.local * p.world * p.capacity;
  const long long per = (rows + gridDim.x - 1) / gridDim.x;
  const long long begin = blockIdx.x * per, end = min(rows, begin + per);
  const long long units = p.ret_bytes / 16;
  for (long long base = begin; base < end; base += blockDim.x) {
    const long long r = base + tid;
    const bool ok = r < end && p.row_src[r] >= 0;
    const unsigned bal = __ballot_sync(0xffffffffu, ok);
    if (lane == 0) s_wcnt[warp] = __popc(bal);
    __syncthreads();
    int off = 0, total = 0;
    for (int w = 0; w < nwarps; ++w) {
      off += w < warp ? s_wcnt[w] : 0;
      total += s_wcnt[w];
    }
    if (ok) s_rows[off + __popc(bal & ((1u << lane) - 1u))] = int(r - base);
    __syncthreads();
    const int parts = total > 0 ? max(1, nwarps / total) : 1;
    const long long chunk = (units + parts - 1) / parts;
    for (int it = warp; it < total * parts; it += nwarps) {
      const long long row = base + s_rows[it / parts], u0 = (it % parts) * chunk, u1 = min(units, u0 + chunk);
      if (u0 >= u1) continue;
      char* dst = static_cast<char*>(p.bases[p.row_src[row]]) + p.ret_off + par * p.ret_parity_bytes +
                  p.row_slot[row] * p.ret_bytes;
      warp_copy16(dst + u0 * 16, static_cast<const char*>(p.expert_out) + row * p.ret_bytes + u0 * 16,
                  (u1 - u0) * 16, lane);
    }
    __syncthreads();
  }
}

__global__ void __launch_bounds__(MoeConfig::kThreads) moe_combine_kernel(PurlinMoeParams p) {
  __shared__ long long s_e;
  __shared__ int s_fail;
  __shared__ int s_rows[MoeConfig::kThreads], s_wcnt[MoeConfig::kWarps], s_rej;
  long long* st = state(p);
  const int tid = threadIdx.x;
  if (!call_begins(p, 1, s_e, s_fail, s_rej)) return;
  const long long e = s_e;
  const int par = int(e & 1);
  const long long W = p.world;
  if (tid == 0) {
    // a rank that rejected its arguments puts nothing back and says so before its done adds release it
    if (p.reject && blockIdx.x == 0) ptr_block(p, p.rank, par)->c_epoch = e | kRejectBit;
  }
  if (!p.reject) put_back(p, par, s_rows, s_wcnt);
  stamp(p, 1, 1);
  // done: each block of my grid, its rows put back, tells every rank
  arrive_all(p, p.done_off);
  stamp(p, 1, 2);
  if (tid < W) {
    if (!wait_ge(p, done_word(p, p.rank, tid), e * p.blocks, 1, tid, p.blocks)) {
      s_fail = 1;
    } else if (tid != p.rank && ptr_block(p, tid, par)->c_epoch == (e | kRejectBit)) {  // this epoch's: peers
      if (blockIdx.x == 0) record(p, kRejected, 1, tid, -1, 0, 0, e, 0, false);  // cannot move on before it ends
      s_rej = 1;
    }
  }
  __syncthreads();
  stamp(p, 1, 3);
  if (!s_fail && !s_rej && !p.reject) {
    const char* ret = own(p) + p.ret_off + par * p.ret_parity_bytes;
    switch (p.dtype) {
      case PURLIN_DTYPE_BFLOAT16: reduce_rows<__nv_bfloat16>(p, ret); break;
      case PURLIN_DTYPE_FLOAT16: reduce_rows<__half>(p, ret); break;
      default: reduce_rows<float>(p, ret); break;
    }
  }
  if (p.trace != nullptr) __syncthreads();
  stamp(p, 1, 4);
  finish(st + kCombExit, st + kCombEpoch, e);
}

// ---- one-pass mode -------------------------------------------------------------------------------------
// Virtual ranks (one process: every rank's tensors are addressable by every other rank's kernel). No
// receive slots and no return rows: a source writes each (token, expert) row once, straight into its
// final row of the receiver's out_x, and the combine reads each expert output where it lies.
//
// The pointer block (PtrBlock, above) carries the dispatch's output pointers and the combine's expert_out.
//
// dispatch, epoch e, parity e & 1:
//   route      as above (every block: my rows per global expert, my tokens' j)
//   counts out block 0: my pointer block, then my count word to every rank (release)
//   counts in  threads poll the count word of EVERY (receiver d, producer q) pair of this epoch: a source
//              needs, for its rows to d, the rows that ranks before it send to d (its offset in each group)
//   offsets    cnt[d * L + le] = sum over q < me of min(rows q sends to d's expert le, d's capacity)
//   put        (token, part of its row) per warp: each 16-byte unit read (and quantised) once and stored to
//              every (token, k) row at its receiver: le * W * cap_d + offset + j (j >= cap_d: not written, the
//              receiver records the overflow); the part at unit 0 also writes the row's expert, source,
//              slot and scale there; out_ref[t, k] = d << 32 | row for the combine. FP8 rows as in the
//              receive-slot path: read once where held_rows holds them
//   delivered  each block, its rows put, adds one to ddone[me] in every rank's region (release)
//   pad        each block, for its local experts: out_counts, padding rows (expert -1), overflow records
//   wait       threads poll ddone[q] >= e * blocks for every q: every row of mine has landed
// combine, epoch e:
//   ready out  block 0: expert_out into my pointer block, its epoch word = e (release; a rank that rejected
//              its arguments: e | kRejectBit)
//   ready in   threads poll every rank's epoch word (a reject bit: skip the reduce, record kRejected)
//   reduce     y[t] = sum_k w[t,k] * expert_out_d[row], float32 (no FMA contraction), k = 0..K-1, the rows
//              read where they lie
//   done       each block, its reduce done, adds one to done[me] in every rank's region (release)
//   wait       threads poll done[q] >= e * blocks: no rank reads my expert_out any more when my kernel ends

__device__ __forceinline__ int count_of(const PurlinMoeParams& p, long long rank, int par, long long producer,
                                        long long le) {
  return reinterpret_cast<const int*>(count_word(p, rank, par, producer) + 3)[le];
}

// Warp 0: j of every slot of tokens [c0, c0 + n) (as route_chunk), turned into the slot's row at its
// receiver (ref); writes out_valid and out_ref.
__device__ inline void route_chunk_one_pass(const PurlinMoeParams& p, DispatchShared& s, int par, long long c0, int n,
                                          int lane, long long E) {
  const long long K = p.topk, L = p.local, W = p.world, begin = c0 * K, end = (c0 + n) * K;
  for (long long s0 = begin; s0 < end; s0 += 32) {
    const long long i = s0 + lane;
    long long id;
    const int j = slot_rank(p, s, i, end, lane, E, &id);
    if (i < end) {
      long long ref = -1;
      if (id >= 0) {
        const long long d = id / L, le = id % L, cap = ptr_block(p, d, par)->capacity;
        if (j < cap) ref = (d << 32) | (le * W * cap + s.cnt[id] + j);
      }
      s.u.route.ref[i - begin] = ref;
      p.out_valid[i] = id >= 0 ? 1 : 0;
      p.out_ref[i] = ref;
    }
  }
}

// Warp: units [u0, u1) of chunk token tt (token t) to each of its rows at their receivers, each unit read
// once; the part at unit 0 also writes the rows' expert, source, slot and scale.
// Lane k < topk of a warp: where row (t, k) of chunk token tt goes at its receiver (nullptr: nowhere);
// with `meta`, also the row's expert, source, slot and scale there.
__device__ __forceinline__ char* one_pass_row(const PurlinMoeParams& p, const DispatchShared& s, int par, int tt,
                                              long long t, bool meta, float scale, int lane) {
  const long long K = p.topk;
  const long long ref = lane < K ? s.u.route.ref[tt * K + lane] : -1;
  if (ref < 0) return nullptr;
  const PtrBlock* b = ptr_block(p, ref >> 32, par);
  const long long row = ref & 0xffffffffll;
  if (meta) {
    reinterpret_cast<int*>(b->out_expert)[row] = int(load_id(p, t * K + lane) % p.local);
    reinterpret_cast<int*>(b->out_src)[row] = int(p.rank);
    reinterpret_cast<long long*>(b->out_slot)[row] = t * K + lane;
    if (b->out_scales != 0) reinterpret_cast<float*>(b->out_scales)[row] = scale;
  }
  return reinterpret_cast<char*>(b->out_x) + row * p.payload_bytes;
}

__device__ inline void put_one_pass(const PurlinMoeParams& p, const DispatchShared& s, int par, int tt, long long t,
                                  long long u0, long long u1, int lane) {
  const float scale = p.quant ? s.scale[tt] : 1.0f;
  char* dst = one_pass_row(p, s, par, tt, t, u0 == 0, scale, lane);
  const float inv = p.quant ? fp8_inverse(scale) : 1.0f;
  const unsigned full = 0xffffffffu, has = __ballot_sync(full, dst != nullptr);
  constexpr int kUnroll = 4;
  for (long long b0 = u0; b0 < u1; b0 += 32 * kUnroll) {  // the same trip count in every lane (shuffles)
    const long long u = b0 + lane;
    int4 v[kUnroll];
#pragma unroll
    for (int i = 0; i < kUnroll; ++i) {
      if (u + 32 * i < u1) v[i] = wire_unit(p, t, u + 32 * i, inv);
    }
    for (unsigned m = has; m; m &= m - 1) {
      int4* out = reinterpret_cast<int4*>(__shfl_sync(full, reinterpret_cast<long long>(dst), __ffs(m) - 1));
#pragma unroll
      for (int i = 0; i < kUnroll; ++i) {
        if (u + 32 * i < u1) out[u + 32 * i] = v[i];
      }
    }
  }
}

__global__ void __launch_bounds__(MoeConfig::kThreads) moe_dispatch_one_pass_kernel(PurlinMoeParams p) {
  __shared__ DispatchShared s;
  long long* st = state(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  if (!call_begins(p, 0, s.e, s.fail, s.bad)) return;
  const long long e = s.e;
  const int par = int(e & 1);
  const long long W = p.world, L = p.local, cap = p.capacity, E = W * L;
  const long long t0 = p.tokens * blockIdx.x / gridDim.x, t1 = p.tokens * (blockIdx.x + 1) / gridDim.x;
  route_counts(p, s, t0, E);
  stamp(p, 0, 1);
  // counts out: my pointer block, then my count word to every rank, every call
  if (blockIdx.x == 0) {
    if (tid == 0) {
      PtrBlock* b = ptr_block(p, p.rank, par);
      b->out_x = reinterpret_cast<long long>(p.out_x);
      b->out_expert = reinterpret_cast<long long>(p.out_expert);
      b->out_src = reinterpret_cast<long long>(p.out_src);
      b->out_slot = reinterpret_cast<long long>(p.out_slot);
      b->out_scales = reinterpret_cast<long long>(p.out_scales);
      b->capacity = cap;
    }
    count_words_out(p, s, par, e);
  }
  stamp(p, 0, 2);
  // counts in: every (receiver, producer) pair of this epoch
  for (long long i = tid; i < W * W; i += blockDim.x) {
    if (!wait_ge(p, count_word(p, i / W, par, i % W), e, 0, i % W)) s.fail = 1;
  }
  __syncthreads();  // also: block 0's count words are written before cnt is overwritten below
  stamp(p, 0, 3);
  if (!s.fail && tid < W && count_word(p, p.rank, par, tid)[2] != meta(p)) {
    record(p, kMismatch, 0, tid, -1, count_word(p, p.rank, par, tid)[2], meta(p), e, 0, true);
    s.bad = 1;
  }
  __syncthreads();
  if (!s.fail && !s.bad) {
    // offsets: cnt[d * L + le] = the rows of ranks before me in d's group le
    constexpr int kBatch = 8;  // count words read 8 at a time (not one latency per rank before me)
    for (long long i = tid; i < E; i += blockDim.x) {
      const long long d = i / L, le = i % L, cap_d = ptr_block(p, d, par)->capacity;
      int acc = 0;
      for (long long q0 = 0; q0 < p.rank; q0 += kBatch) {
        int c[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) c[u] = q0 + u < p.rank ? count_of(p, d, par, q0 + u, le) : 0;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) acc += int(min(static_cast<long long>(c[u]), cap_d));
      }
      s.cnt[i] = acc;
    }
    __syncthreads();
    // put: kChunk tokens at a time, a (token, part of its row) per warp
    const long long units = p.payload_bytes / 16;
    const bool held = rows_held(p);
    for (long long c0 = t0; c0 < t1; c0 += MoeConfig::kChunk) {
      const int n = int(min(static_cast<long long>(MoeConfig::kChunk), t1 - c0));
      if (warp == 0) {
        route_chunk_one_pass(p, s, par, c0, n, lane, E);
      } else if (p.quant && !held) {
        for (int tt = warp - 1; tt < n; tt += nwarps - 1) {
          const float sc = token_scale(p, c0 + tt, lane);
          if (lane == 0) s.scale[tt] = sc;
        }
      }
      __syncthreads();
      if (held) {  // FP8: each row read once; the group's first warp writes the rows' metadata
        held_rows(p, s, c0, n, [&](int tt, long long t, int gw, int gl, int ln, float scale, const auto& q) {
          char* dst = one_pass_row(p, s, par, tt, t, gw == 0, scale, ln);
          const unsigned full = 0xffffffffu;
          for (unsigned m = __ballot_sync(full, dst != nullptr); m; m &= m - 1) {
            char* out = reinterpret_cast<char*>(__shfl_sync(full, reinterpret_cast<long long>(dst), __ffs(m) - 1));
            store_held(out, q, gl, units);
          }
        });
        __syncthreads();
        continue;
      }
      const int parts = max(1, nwarps / n);
      const long long per = (units + parts - 1) / parts;
      for (int it = warp; it < n * parts; it += nwarps) {
        const int tt = it / parts, part = it % parts;
        put_one_pass(p, s, par, tt, c0 + tt, part * per, min(units, (part + 1) * per), lane);
      }
      __syncthreads();
    }
  }
  stamp(p, 0, 4);
  // delivered: each block of my grid, its rows put, tells every rank
  arrive_all(p, p.ddone_off);
  stamp(p, 0, 5);
  if (!s.fail && !s.bad) {
    // my local experts' counts (every block: the W * L words read at once; pre is free after the puts),
    // block 0 also the out_counts and overflow records; then the padding rows, spread over the grid
    __syncthreads();
    for (long long i = tid; i < W * L; i += blockDim.x) s.pre[i] = count_of(p, p.rank, par, i / L, i % L);
    __syncthreads();
    for (long long le = tid; le < L; le += blockDim.x) {
      int total = 0;
      for (long long q = 0; q < W; ++q) total += int(min(static_cast<long long>(s.pre[q * L + le]), cap));
      s.cnt[le] = total;
      if (blockIdx.x == 0) p.out_counts[le] = total;
    }
    if (blockIdx.x == 0 && tid < 32) record_counts(p, s.pre, cap, e, s.nbad);
    __syncthreads();
    const long long group = W * cap;
    for (long long r = (long long)blockIdx.x * blockDim.x + tid; r < L * group; r += (long long)gridDim.x * blockDim.x) {
      if (r % group >= s.cnt[r / group]) {
        p.out_expert[r] = -1;
        p.out_src[r] = -1;
        p.out_slot[r] = -1;
        if (p.out_scales != nullptr) p.out_scales[r] = 1.0f;
      }
    }
  }
  __syncthreads();
  stamp(p, 0, 6);
  // wait: every producer's rows to me have landed (also after an error: the counters stay in step)
  if (!s.fail && tid < W && !wait_ge(p, ddone_word(p, p.rank, tid), e * p.blocks, 0, tid, p.blocks)) s.fail = 1;
  if (p.trace != nullptr) __syncthreads();
  stamp(p, 0, 7);
  finish(st + kDispExit, st + kDispEpoch, e);
}

// The one-pass mode: slot (t, k)'s row lies at row_ref's row of its receiver's expert_out (eo[receiver]);
// the dispatch wrote -1 there for a slot that is not routed or over capacity (so valid is not read).
template <class T>
__device__ inline void reduce_one_pass(const PurlinMoeParams& p, const long long* eo) {
  const long long K = p.topk;
  reduce_slots<T>(p, [&](long long t, long long k) -> const char* {
    const long long ref = p.row_ref[t * K + k];
    return ref >= 0 ? reinterpret_cast<const char*>(eo[ref >> 32]) + (ref & 0xffffffffll) * p.ret_bytes : nullptr;
  });
}

__global__ void __launch_bounds__(MoeConfig::kThreads) moe_combine_one_pass_kernel(PurlinMoeParams p) {
  __shared__ long long s_e, s_eo[PURLIN_MOE_MAX_RANKS];
  __shared__ int s_fail, s_rej;
  long long* st = state(p);
  const int tid = threadIdx.x;
  if (!call_begins(p, 1, s_e, s_fail, s_rej)) return;
  const long long e = s_e;
  const int par = int(e & 1);
  const long long W = p.world;
  // ready out: my expert_out for this call (complete: my stream ran the experts before this kernel)
  if (blockIdx.x == 0 && tid == 0) {
    PtrBlock* b = ptr_block(p, p.rank, par);
    b->expert_out = reinterpret_cast<long long>(p.expert_out);
    sig_release(p, &b->c_epoch, p.reject ? (e | kRejectBit) : e);
  }
  stamp(p, 1, 1);
  if (tid < W) {
    const long long* w = &ptr_block(p, tid, par)->c_epoch;
    if (!wait_ge(p, w, e, 1, tid)) {
      s_fail = 1;
    } else if ((sig_relaxed(p, w) & kRejectBit) && tid != p.rank) {
      if (blockIdx.x == 0) record(p, kRejected, 1, tid, -1, 0, 0, e, 0, false);
      s_rej = 1;
    } else {
      s_eo[tid] = ptr_block(p, tid, par)->expert_out;
    }
  }
  __syncthreads();
  stamp(p, 1, 2);
  if (!s_fail && !s_rej && !p.reject) {
    switch (p.dtype) {
      case PURLIN_DTYPE_BFLOAT16: reduce_one_pass<__nv_bfloat16>(p, s_eo); break;
      case PURLIN_DTYPE_FLOAT16: reduce_one_pass<__half>(p, s_eo); break;
      default: reduce_one_pass<float>(p, s_eo); break;
    }
  }
  if (p.trace != nullptr) __syncthreads();
  stamp(p, 1, 3);
  // done: this block reads no expert output any more
  arrive_all(p, p.done_off);
  if (!s_fail && tid < W && !wait_ge(p, done_word(p, p.rank, tid), e * p.blocks, 1, tid, p.blocks)) s_fail = 1;
  if (p.trace != nullptr) __syncthreads();
  stamp(p, 1, 4);
  finish(st + kCombExit, st + kCombEpoch, e);
}


// ---- decode mode ---------------------------------------------------------------------------------------
// A few tokens a rank (tokens <= p.decode_tokens on every rank of the call): one round of flag-in-data
// packets an op (snac/packet.cuh: 16 bytes carry 8 of payload and the epoch twice; a reader that sees its
// epoch has the payload, no fence and no signal word). Either set of ranks (virtual or in separate
// processes): a rank writes only into its peers' windows and reads only its own region and tensors.
//
// Windows, in the receiver's region: dispatch win[parity][producer] (win_off, win_bytes each): the
// producer's header (2 * count_bytes: packets of [tokens, 0, meta lo, meta hi, rows per the receiver's
// local expert]), then decode_tokens slots of 2 * slot_bytes (packets of a token's header and
// row, as the receive slots hold them); return windows [parity] (rwin_off, rwin_parity_bytes): one header
// packet per rank (reject bit), then decode_tokens * topk rows of 2 * ret_bytes (slot t * K + k).
// A window parity is rewritten two calls later, after its writer received its reader's packets of the call
// between, which the reader sends only once its kernel of the call before ended (stream order): every rank
// sends every rank a header every call (also when it sends it no rows) and every rank waits for every
// header, so no acknowledgement exists (the packet collectives' argument). Calls of either mode follow
// each other on one region: block 0 still adds `blocks` to my delivered (dispatch) and done (combine) word
// in every rank, as the normal kernels' blocks do (arrive_all), and waits for none, so a normal call
// after decode ones finds those words at e * blocks.
//
// dispatch, epoch e, parity e & 1:
//   route      every block routes every token (route_counts, route_chunk: one chunk); block 0 writes out_valid
//              and out_ref (receiver << 32 | j, the slot's rank among my rows of its expert; -1: not routed)
//   headers    block 0: my header to EVERY rank
//   put        (token, 16-byte unit of its slot) per thread over the grid: the unit read (and quantised) once
//              and stored as two packets to each destination's window slot (the token's header units are
//              per destination)
//   headers in every block polls every producer's header: tokens, meta, counts (a mismatch: kMismatch,
//              fatal); offsets per (producer, local expert) as the receive-slot path
//   pad        out_counts (block 0, with the overflow records), padding rows (expert -1) over the grid
//   expand     (received token, part of its row) per warp: the token's header packets polled, then each
//              unit's two packets polled and stored to one row per k (j >= capacity: not written)
// combine, epoch e:
//   header     block 0: a header packet to EVERY rank: [1 if I rejected my arguments else 0, my capacity]
//   put back   (valid row, 16-byte unit) per thread over the grid: expert_out's unit as two packets to slot
//              row_slot of the row's source (the valid rows of local expert le are its first row_counts[le])
//   headers in threads poll every rank's header (a reject bit: skip the reduce, record kRejected)
//   reduce     y[t] = sum_k w[t,k] * row(t, k), float32 (no FMA contraction), k = 0..K-1 over the slots that
//              were delivered (out_ref a rank d and j < d's capacity), each unit's packets polled where they land

__device__ __forceinline__ char* dwin(const PurlinMoeParams& p, long long owner, int par, long long producer) {
  return static_cast<char*>(p.bases[owner]) + p.win_off + (par * p.world + producer) * p.win_bytes;
}
__device__ __forceinline__ char* dslot(const PurlinMoeParams& p, long long owner, int par, long long producer,
                                       long long i) {
  return dwin(p, owner, par, producer) + 2 * p.count_bytes + i * 2 * p.slot_bytes;
}
__device__ __forceinline__ long long rwin_head_bytes(const PurlinMoeParams& p) {
  return (p.world * snac::kPacketBytes + 127) / 128 * 128;
}
__device__ __forceinline__ char* rwin_header(const PurlinMoeParams& p, long long owner, int par, long long q) {
  return static_cast<char*>(p.bases[owner]) + p.rwin_off + par * p.rwin_parity_bytes + q * snac::kPacketBytes;
}
__device__ __forceinline__ char* rwin_row(const PurlinMoeParams& p, long long owner, int par, long long slot) {
  return static_cast<char*>(p.bases[owner]) + p.rwin_off + par * p.rwin_parity_bytes + rwin_head_bytes(p) +
         slot * 2 * p.ret_bytes;
}

// Poll the packet at ptr until it carries epoch ep (v: a load already made); false on a timeout (recorded:
// kind, peer) or a fatal error. `other`, when given, is the peer's count word here: a peer that wrote it for
// this epoch took the other mode (recorded as kMismatch). A thread sleeps between its polls (32 ns, doubling
// up to kPollSleepMaxNs) and reads the fatal word, `other` and the clock once every kPollCheck polls: every
// waiting thread of the grid polls (up to all of them, the expand's warps reading the same header packets),
// and polls without a pause load the memory system the producers' packet stores go through.
__device__ inline bool wait_packet(const PurlinMoeParams& p, const char* ptr, snac::Epoch ep, long long e, uint4& v,
                                   int kind, long long peer, const long long* other = nullptr) {
  constexpr unsigned kPollCheck = 16, kPollSleepMaxNs = 512;
  if (snac::packet_ready(v, ep)) return true;
  const unsigned long long t0 = globaltimer();
  const volatile long long* fatal = state(p) + kFatal;
  unsigned sleep_ns = 32;
  for (unsigned n = 1;; ++n) {
    __nanosleep(sleep_ns);
    sleep_ns = min(2 * sleep_ns, kPollSleepMaxNs);
    v = snac::ld_packet(ptr);
    if (snac::packet_ready(v, ep)) return true;
    if (n % kPollCheck != 0) continue;
    if (*fatal) return false;
    if (other != nullptr && sig_relaxed(p, other) == e) {
      record(p, kMismatch, kind, peer, -1, other[2], meta(p) | kDecodeMeta, e, 0, true);
      return false;
    }
    if (globaltimer() - t0 > static_cast<unsigned long long>(p.timeout_ns)) {
      record(p, kTimeout, kind, peer, -1, 0, 0, e, static_cast<long long>(v.y), true);
      return false;
    }
  }
}

// Int i of my decode header to rank d: [tokens, 0, meta lo, meta hi, rows per d's local expert].
__device__ __forceinline__ int decode_header_int(const PurlinMoeParams& p, const DispatchShared& s, long long d,
                                                 long long i) {
  const long long m = meta(p) | kDecodeMeta;
  if (i == 0) return s.tok[d];
  if (i == 1) return 0;
  if (i == 2) return int(uint32_t(m));
  if (i == 3) return int(uint32_t(m >> 32));
  return i - 4 < p.local ? s.cnt[d * p.local + i - 4] : 0;
}

// Ints 4u..4u+3 of chunk token tt's slot header (put_header's words), for every destination at once: val[c]
// with dst[c] -2 (the same at every destination: token index, scale, padding), or the rank that owns the
// slot's expert (-1: none; the int is -1 at every other rank). The unit's ids are loaded together, once, not
// per destination behind the packet stores.
__device__ __forceinline__ void slot_header_unit(const PurlinMoeParams& p, const DispatchShared& s, int tt, long long u,
                                                 long long E, int* val, int* dst) {
  const long long K = p.topk;
  long long id[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const long long i = 4 * u + c;
    id[c] = i >= 1 && i <= 2 * K ? load_id(p, tt * K + (i - 1) % K) : -1;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const long long i = 4 * u + c;
    dst[c] = -2;
    if (i == 0) {
      val[c] = tt;
    } else if (i == 1 + 2 * K) {
      val[c] = __float_as_int(p.quant ? s.scale[tt] : 1.0f);
    } else if (i > 1 + 2 * K) {
      val[c] = 0;
    } else {
      const long long k = (i - 1) % K;
      const bool ok = id[c] >= 0 && id[c] < E;
      dst[c] = ok ? int(id[c] / p.local) : -1;
      val[c] = i <= K ? int(ok ? id[c] % p.local : -1) : s.u.route.j[tt * K + k];
    }
  }
}

// This thread's first item of a grid-stride loop whose items are spread over the grid's blocks a warp's
// worth at a time: warp w of block b takes items (b + gridDim.x * w) * 32 + lane, so a warp's lanes store
// consecutive 16-byte units (coalesced) and a few items still reach every block.
__device__ __forceinline__ long long spread_item() {
  return (static_cast<long long>(blockIdx.x) + static_cast<long long>(gridDim.x) * (threadIdx.x >> 5)) * 32 +
         (threadIdx.x & 31);
}

__device__ __forceinline__ void st_unit(char* dst, const int4& v, snac::Epoch ep) {
  snac::st_packet(dst, uint64_t(uint32_t(v.x)) | (uint64_t(uint32_t(v.y)) << 32), ep);
  snac::st_packet(dst + snac::kPacketBytes, uint64_t(uint32_t(v.z)) | (uint64_t(uint32_t(v.w)) << 32), ep);
}

__global__ void __launch_bounds__(MoeConfig::kThreads) moe_dispatch_decode_kernel(PurlinMoeParams p) {
  __shared__ DispatchShared s;
  long long* st = state(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  if (!call_begins(p, 0, s.e, s.fail, s.bad)) return;
  const long long e = s.e;
  const int par = int(e & 1);
  const snac::Epoch ep{uint32_t(e), uint32_t(e)};
  const long long W = p.world, L = p.local, cap = p.capacity, E = W * L, T = p.tokens, K = p.topk;
  const long long hp = (4 + L + 1) / 2;  // header packets
  // route: every block, every token (T <= decode_tokens <= kChunk)
  route_counts(p, s, 0, E);
  if (warp == 0) {
    route_chunk(p, s, 0, int(T), lane, E);
  } else if (p.quant) {
    for (int tt = warp - 1; tt < T; tt += nwarps - 1) {
      const float sc = token_scale(p, tt, lane);
      if (lane == 0) s.scale[tt] = sc;
    }
  }
  __syncthreads();
  stamp(p, 0, 1);
  if (blockIdx.x == 0) {
    // the delivered words count every dispatch, decode ones too: the normal modes wait for e * blocks
    if (tid < W) sig_add(p, ddone_word(p, tid, p.rank), p.blocks);
    for (long long i = tid; i < T * K; i += blockDim.x) {  // out_ref: the slot's receiver and j
      const long long id = load_id(p, i), j = s.u.route.j[i];
      p.out_ref[i] = id >= 0 && id < E && j >= 0 ? ((id / L) << 32) | j : -1;
    }
    for (long long i = tid; i < W * hp; i += blockDim.x) {  // headers out
      const long long d = i / hp, j = i % hp;
      const uint64_t v = uint64_t(uint32_t(decode_header_int(p, s, d, 2 * j))) |
                         (uint64_t(uint32_t(decode_header_int(p, s, d, 2 * j + 1))) << 32);
      snac::st_packet(dwin(p, d, par, p.rank) + j * snac::kPacketBytes, v, ep);
    }
  }
  if (p.trace != nullptr) __syncthreads();  // the stamp: block 0's headers and out_ref written
  stamp(p, 0, 2);
  // put: (token, unit of its slot) per thread, spread over the grid's blocks
  {
    const long long hunits = p.hdr_bytes / 16, sunits = p.slot_bytes / 16, items = T * sunits;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long it = spread_item(); it < items; it += stride) {
      const int tt = int(it / sunits);
      const long long u = it % sunits;
      const unsigned long long rot = rotated(s.mask[tt], p.rank, p.world);
      int4 v = make_int4(0, 0, 0, 0);
      int hval[4], hdst[4];
      if (u >= hunits) {
        v = wire_unit(p, tt, u - hunits, p.quant ? fp8_inverse(s.scale[tt]) : 1.0f);
      } else {
        slot_header_unit(p, s, tt, u, E, hval, hdst);
      }
      for (unsigned long long m = rot; m; m &= m - 1) {
        const int d = int((__ffsll(static_cast<long long>(m)) - 1 + p.rank + 1) % p.world);
        if (u < hunits) {
          auto at = [&](int c) { return hdst[c] == -2 || hdst[c] == d ? hval[c] : -1; };
          v = make_int4(at(0), at(1), at(2), at(3));
        }
        st_unit(dslot(p, d, par, p.rank, s.u.route.pos[tt * W + d]) + u * 2 * snac::kPacketBytes, v, ep);
      }
    }
  }
  __syncthreads();  // the route's shared arrays are reused below
  stamp(p, 0, 3);
  // headers in: every producer's header (tokens -> tstart[q + 1], meta -> route.j)
  for (long long i = tid; i < W * hp; i += blockDim.x) {
    const long long q = i / hp, j = i % hp;
    const char* ptr = dwin(p, p.rank, par, q) + j * snac::kPacketBytes;
    uint4 v = snac::ld_packet(ptr);
    if (!wait_packet(p, ptr, ep, e, v, 2, q, count_word(p, p.rank, par, q))) {
      s.fail = 1;
      continue;
    }
    const int w[2] = {int(v.x), int(v.z)};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long long idx = 2 * j + h;
      if (idx == 0) s.tstart[q + 1] = w[h];
      else if (idx == 1) continue;
      else if (idx < 4) s.u.route.j[2 * q + idx - 2] = w[h];
      else if (idx - 4 < L) s.cnt[q * L + idx - 4] = w[h];
    }
  }
  __syncthreads();
  if (!s.fail && tid < W) {
    const long long m = (long long)uint32_t(s.u.route.j[2 * tid]) | ((long long)s.u.route.j[2 * tid + 1] << 32);
    if (m != (meta(p) | kDecodeMeta) || s.tstart[tid + 1] > p.decode_tokens) {
      record(p, kMismatch, 0, tid, -1, m, meta(p) | kDecodeMeta, e, s.tstart[tid + 1], true);
      s.bad = 1;
    }
  }
  __syncthreads();
  stamp(p, 0, 4);
  if (!s.fail && !s.bad) {
    received_offsets(p, s, e);
    pad_rows(p, s);
    stamp(p, 0, 5);
    // expand: (received token, part of its row) per warp, each packet polled where it landed
    const long long n_recv = s.tstart[W];
    const long long warps = (long long)gridDim.x * nwarps, units = p.payload_bytes / 16;
    const long long hunits = p.hdr_bytes / 16, hpk = p.hdr_bytes / 8;
    const long long parts = n_recv > 0 ? max(1ll, min(warps / n_recv, (units + 31) / 32)) : 1;
    const long long per = (units + parts - 1) / parts;
    int4* out = static_cast<int4*>(p.out_x);
    bool ok = true;
    for (long long it = (long long)blockIdx.x * nwarps + warp; it < n_recv * parts; it += warps) {
      const long long g = it / parts, u0 = (it % parts) * per, u1 = min(units, u0 + per);
      int q = 0;
      while (s.tstart[q + 1] <= g) ++q;
      const char* slot = dslot(p, p.rank, par, q, g - s.tstart[q]);
      // lane 0 alone waits first for the last packet of the warp's part of the row (a rough sign that the
      // part has landed: packets carry no order): the warp's other lanes then poll packets that are there
      // or nearly, instead of every lane of every expanding warp polling while the producers' stores land
      bool lead = true;
      if (ok && lane == 0 && u1 > u0) {
        const char* last = slot + (hunits + u1 - 1) * 2 * snac::kPacketBytes + snac::kPacketBytes;
        uint4 t = snac::ld_packet(last);
        lead = wait_packet(p, last, ep, e, t, 2, q);
      }
      ok = ok && __shfl_sync(0xffffffffu, lead, 0);
      // the token's header: packets lane and lane + 32 (hpk <= 34)
      uint4 h0 = make_uint4(0, 0, 0, 0), h1 = make_uint4(0, 0, 0, 0);
      if (ok && lane < hpk) {
        h0 = snac::ld_packet(slot + lane * snac::kPacketBytes);
        ok = wait_packet(p, slot + lane * snac::kPacketBytes, ep, e, h0, 2, q);
      }
      if (ok && lane + 32 < hpk) {
        h1 = snac::ld_packet(slot + (lane + 32) * snac::kPacketBytes);
        ok = wait_packet(p, slot + (lane + 32) * snac::kPacketBytes, ep, e, h1, 2, q);
      }
      // int idx of the header (every lane calls it, each with its own idx): lane src offers both halves of
      // both its packets, and the caller picks by its own idx (the source lane's idx may differ in parity)
      auto word = [&](long long idx) -> int {
        const int pk = int(idx >> 1), src = pk & 31;
        const unsigned x0 = __shfl_sync(0xffffffffu, h0.x, src), z0 = __shfl_sync(0xffffffffu, h0.z, src);
        const unsigned x1 = __shfl_sync(0xffffffffu, h1.x, src), z1 = __shfl_sync(0xffffffffu, h1.z, src);
        return int(pk < 32 ? ((idx & 1) ? z0 : x0) : ((idx & 1) ? z1 : x1));
      };
      const int tok = word(0);
      const long long kl = min(static_cast<long long>(lane), K - 1);
      const int le_k = word(1 + kl);
      const int j_k = word(1 + K + kl);
      const float scale = __int_as_float(word(1 + 2 * K));
      long long row = -1;
      if (lane < K && le_k >= 0 && j_k < cap) row = le_k * W * cap + s.pre[q * L + le_k] + j_k;
      if (!__all_sync(0xffffffffu, ok)) {
        ok = false;
        continue;
      }
      const unsigned bal = __ballot_sync(0xffffffffu, row >= 0);
      const int nrows = __popc(bal);
      if (row >= 0) s.u.rows[warp][__popc(bal & ((1u << lane) - 1u))] = row;
      if (row >= 0 && u0 == 0) {
        p.out_expert[row] = le_k;
        p.out_src[row] = q;
        p.out_slot[row] = static_cast<long long>(tok) * K + lane;
        if (p.out_scales != nullptr) p.out_scales[row] = scale;
      }
      __syncwarp();
      constexpr int kUnroll = 4;
      for (long long b0 = u0; b0 < u1; b0 += 32 * kUnroll) {
        uint4 a[kUnroll], b[kUnroll];
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {  // every load in flight, then the flags
          const long long u = b0 + lane + 32 * i;
          if (u < u1) {
            const char* src = slot + (hunits + u) * 2 * snac::kPacketBytes;
            a[i] = snac::ld_packet(src);
            b[i] = snac::ld_packet(src + snac::kPacketBytes);
          }
        }
#pragma unroll
        for (int i = 0; i < kUnroll; ++i) {
          const long long u = b0 + lane + 32 * i;
          if (u >= u1 || !ok) continue;
          const char* src = slot + (hunits + u) * 2 * snac::kPacketBytes;
          ok = wait_packet(p, src, ep, e, a[i], 2, q) && wait_packet(p, src + snac::kPacketBytes, ep, e, b[i], 2, q);
          if (!ok) continue;
          const int4 v = make_int4(int(a[i].x), int(a[i].z), int(b[i].x), int(b[i].z));
          for (int r = 0; r < nrows; ++r) out[s.u.rows[warp][r] * units + u] = v;
        }
      }
      __syncwarp();
    }
    if (!ok) s.fail = 1;
  }
  if (p.trace != nullptr) __syncthreads();
  stamp(p, 0, 6);
  finish(st + kDispExit, st + kDispEpoch, e);
}

// The decode combine's reduce: y[t]'s 16-byte chunk c per thread over the grid, the sum over k in order
// (as reduce_slots), each slot's two packets polled where they land. A slot adds nothing where it was not
// delivered: out_ref -1 (not routed) or j at or over its receiver's capacity (cap[d], from its header).
// A timeout is recorded and ends the thread's work.
template <class T>
__device__ inline void reduce_packets(const PurlinMoeParams& p, int par, snac::Epoch ep, long long e,
                                      const unsigned* cap) {
  constexpr int kVec = 16 / sizeof(T), kLoads = 4;  // two packets a load: 4 slots in flight
  const long long chunks = p.ret_bytes / 16, K = p.topk, items = p.tokens * chunks;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long it = blockIdx.x + (long long)gridDim.x * threadIdx.x; it < items; it += stride) {
    const long long t = it / chunks, c = it % chunks;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = 0.0f;
    for (long long k0 = 0; k0 < K; k0 += kLoads) {
      uint4 a[kLoads], b[kLoads];
      long long src[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const long long k = k0 + u;
        const long long ref = k < K ? p.row_ref[t * K + k] : -1;
        src[u] = ref >= 0 && (ref & 0xffffffffll) < cap[ref >> 32] ? ref >> 32 : -1;
        if (src[u] >= 0) {
          const char* r = rwin_row(p, p.rank, par, t * K + k) + c * 2 * snac::kPacketBytes;
          a[u] = snac::ld_packet(r);
          b[u] = snac::ld_packet(r + snac::kPacketBytes);
        }
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        if (src[u] < 0) continue;
        const char* r = rwin_row(p, p.rank, par, t * K + k0 + u) + c * 2 * snac::kPacketBytes;
        if (!wait_packet(p, r, ep, e, a[u], 3, src[u]) ||
            !wait_packet(p, r + snac::kPacketBytes, ep, e, b[u], 3, src[u])) {
          return;
        }
        const float w = p.weights[t * K + k0 + u];
        const uint4 raw = make_uint4(a[u].x, a[u].z, b[u].x, b[u].z);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, to_f<T>(v[i])));
      }
    }
    int4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int i = 0; i < kVec; ++i) o[i] = from_f<T>(acc[i]);
    *reinterpret_cast<int4*>(static_cast<char*>(p.y) + t * p.ret_bytes + c * 16) = out;
  }
}

__global__ void __launch_bounds__(MoeConfig::kThreads) moe_combine_decode_kernel(PurlinMoeParams p) {
  __shared__ long long s_e;
  __shared__ int s_fail, s_rej;
  __shared__ int s_pre[PURLIN_MOE_MAX_EXPERTS + 1];  // valid rows of local experts before le
  __shared__ unsigned s_cap[PURLIN_MOE_MAX_RANKS];  // every rank's capacity (its header)
  long long* st = state(p);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (!call_begins(p, 1, s_e, s_fail, s_rej)) return;
  const long long e = s_e;
  const int par = int(e & 1);
  const snac::Epoch ep{uint32_t(e), uint32_t(e)};
  const long long W = p.world, L = p.local, cap = p.capacity;
  if (blockIdx.x == 0 && tid < W) {
    snac::st_packet(rwin_header(p, tid, par, p.rank), uint64_t(p.reject) | (uint64_t(cap) << 32), ep);
    sig_add(p, done_word(p, tid, p.rank), p.blocks);  // the done words count every combine (as ddone above)
  }
  if (!p.reject) {
    // the valid rows: local expert le's first row_counts[le] rows; warp 0 scans their prefix
    if (warp == 0) {
      int carry = 0;
      if (lane == 0) s_pre[0] = 0;
      for (long long b = 0; b < L; b += 32) {
        int c = b + lane < L ? p.row_counts[b + lane] : 0, x = c;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, x, o);
          if (lane >= o) x += y;
        }
        if (b + lane < L) s_pre[b + lane + 1] = carry + x;
        carry += __shfl_sync(0xffffffffu, x, 31);
      }
    }
    __syncthreads();
    const long long units = p.ret_bytes / 16, items = s_pre[L] * units;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long it = spread_item(); it < items; it += stride) {
      const long long v = it / units, u = it % units;
      long long lo = 0, hi = L;  // the expert le with s_pre[le] <= v < s_pre[le + 1]
      while (hi - lo > 1) {
        const long long mid = (lo + hi) / 2;
        if (s_pre[mid] <= v) lo = mid; else hi = mid;
      }
      const long long row = lo * W * cap + (v - s_pre[lo]);
      const int4 x = reinterpret_cast<const int4*>(static_cast<const char*>(p.expert_out) + row * p.ret_bytes)[u];
      st_unit(rwin_row(p, p.row_src[row], par, p.row_slot[row]) + u * 2 * snac::kPacketBytes, x, ep);
    }
  }
  stamp(p, 1, 1);
  // headers in: every rank's, also when I rejected (the window argument needs them)
  if (tid < W) {
    const char* ptr = rwin_header(p, p.rank, par, tid);
    uint4 v = snac::ld_packet(ptr);
    if (!wait_packet(p, ptr, ep, e, v, 3, tid)) {
      s_fail = 1;
    } else if (v.x != 0 && tid != p.rank) {
      if (blockIdx.x == 0) record(p, kRejected, 1, tid, -1, 0, 0, e, 0, false);
      s_rej = 1;
    } else {
      s_cap[tid] = v.z;  // the rank's capacity: my slots it took have j below it
    }
  }
  __syncthreads();
  stamp(p, 1, 2);
  if (!s_fail && !s_rej && !p.reject) {
    switch (p.dtype) {
      case PURLIN_DTYPE_BFLOAT16: reduce_packets<__nv_bfloat16>(p, par, ep, e, s_cap); break;
      case PURLIN_DTYPE_FLOAT16: reduce_packets<__half>(p, par, ep, e, s_cap); break;
      default: reduce_packets<float>(p, par, ep, e, s_cap); break;
    }
  }
  if (p.trace != nullptr) __syncthreads();
  stamp(p, 1, 3);
  finish(st + kCombExit, st + kCombEpoch, e);
}

}  // namespace purlin::moe
