// The C ABI of purlin_sglang._native, bound from Python by purlin_sglang/native.py (ctypes).
//
// Every CUDA entry point returns a cudaError_t code (0 = success) and never aborts: on a machine
// with no driver or no GPU it returns that error. Pointers may be local device memory or a
// peer's memory mapped over NVLink (P2P). Streams are cudaStream_t handles (0 = legacy default).
// Bump PURLIN_NATIVE_ABI_VERSION (native/CMakeLists.txt) whenever a signature, a struct or a
// constant here (or in purlin/encoding.h) changes; purlin_native_layout() exports them all and
// purlin_sglang/native.py compares that export with its own copies when it loads the library.
//
// Devices (ABI 7, kept since): this library links its own static CUDA runtime, whose current device is its own.
// Every entry point that launches or queries a device takes the CUDA device index (an argument, or
// the `device` field of its parameter struct) and makes that device current on the calling thread
// (cudaSetDevice where it differs) before it touches the device; it restores nothing,
// so on return the calling thread's current device is `device`. device == -1 keeps the runtime's
// current device (callers that manage it themselves).
#pragma once
#include <stddef.h>

#define PURLIN_API extern "C" __attribute__((visibility("default")))

// Always present (host-only builds too).
PURLIN_API int purlin_native_abi_version(void);
// JSON: {"abi": 7, "cuda": bool, "archs": ["90", ...], "nvcc": "13.0.88" | null, "reason": null | "why not", ...}
PURLIN_API const char* purlin_native_build_info(void);
// The layout this library was compiled with: *count entries (name, value), static storage. Names:
// "PURLIN_NATIVE_ABI_VERSION"; "sizeof(S)", "offsetof(S, f)" and "sizeof(S.f)" for every field of
// PurlinSnacParams and PurlinMoeParams; the macros and enums of this header by their C names;
// "snac.*" and "moe.*" for purlin/encoding.h (opcodes, kinds, buffers, shifts, error records, ...).
typedef struct PurlinAbiEntry {
  const char* name;
  long long value;
} PurlinAbiEntry;
PURLIN_API const PurlinAbiEntry* purlin_native_layout(int* count);

// Present only when the module was built with CUDA.
PURLIN_API const char* purlin_cuda_error_string(int code);
// Number of visible CUDA devices in *count; returns the cudaError_t of cudaGetDeviceCount.
PURLIN_API int purlin_cuda_device_count(int* count);
// The device this library's runtime was current on at its last launch or device query (after the
// entry point set it), or -1 before the first one. Process-wide; for tests and diagnostics.
PURLIN_API int purlin_native_last_device(void);
// Copy atom: dst[0:bytes] = src[0:bytes] on `stream` of `device` (asynchronous; the ranges must not
// overlap). Any alignment and any size; 16-byte accesses where dst and src agree modulo 16. At
// most `max_blocks` thread blocks (0 = enough to fill the device): collectives bound the SMs a copy
// may take. Safe under CUDA graph capture (one kernel launch, no host sync, no allocation).
PURLIN_API int purlin_copy_atom(void* dst, const void* src, size_t bytes, void* stream, int max_blocks, int device);
// The Hopper bulk-copy (TMA) variant of the copy atom (ABI 5): same contract, for dst and src
// that agree in their misalignment modulo 16; cudaErrorNotSupported on GPUs older than sm_90, on
// builds without sm_90 code and for other pairs. Through shared memory, so measured per size
// against the plain atom (docs/RESULTS.md) before any caller uses it.
PURLIN_API int purlin_copy_atom_bulk(void* dst, const void* src, size_t bytes, void* stream, int max_blocks,
                                     int device);

// Reduce atom (ABI 2). Element types, the `dtype` argument (0 is no type, on purpose):
enum purlin_dtype {
  PURLIN_DTYPE_BFLOAT16 = 1,  // accumulated in float32, rounded back to nearest even
  PURLIN_DTYPE_FLOAT16 = 2,   // accumulated in float32, rounded back to nearest even
  PURLIN_DTYPE_FLOAT32 = 3,
  PURLIN_DTYPE_FLOAT64 = 4,
  PURLIN_DTYPE_INT32 = 5,     // sum wraps modulo 2^32
  PURLIN_DTYPE_INT64 = 6,     // sum wraps modulo 2^64
};
// Reduction operators, the `op` argument. MAX/MIN propagate NaN (torch.maximum/minimum).
enum purlin_reduce_op {
  PURLIN_REDUCE_SUM = 1,
  PURLIN_REDUCE_MAX = 2,
  PURLIN_REDUCE_MIN = 3,
};
#define PURLIN_REDUCE_MAX_SOURCES 8
// dst[0:n] = op(srcs[0][0:n], ..., srcs[nsrc-1][0:n]) on `stream` (asynchronous), n = nbytes / the
// element size; 1 <= nsrc <= 8. Bitwise the CPU engine's reduction: sources combined in order
// ((s0 op s1) op s2) ..., 16-bit floats accumulated in float32. `srcs` is a HOST array of nsrc
// device pointers (read during the call only); every pointer must be aligned to the element size;
// 16-byte accesses where all pointers agree with dst modulo 16. dst may equal one source exactly
// (in place) but must not otherwise overlap one. At most `max_blocks` thread blocks (0 = enough
// to fill the device). Returns cudaErrorInvalidValue for an unknown dtype or op, nsrc out of
// range, nbytes not a multiple of the element size, or a null or misaligned pointer (nothing is
// launched); nbytes == 0 is a no-op. Safe under CUDA graph capture (one launch, no host sync).
PURLIN_API int purlin_reduce_atom(void* dst, const void* const* srcs, int nsrc, size_t nbytes, int dtype, int op,
                                  void* stream, int max_blocks, int device);

// ---- SNAC interpreter (ABI 5: per-block packet epochs) -----------------------------------------------------------
// One launch runs one rank's lowered schedule (purlin_sglang/snac/lower.py), encoded ONCE by the
// host (purlin_sglang/engines/cuda_ops.py) into a device op table of fixed 12-word int64 records.
// Every offset comes from the host's DeviceLayout (purlin_sglang/memory/layout.py) through this
// struct; the kernel computes none. All state lives in device memory (counters, mirrors), so a
// captured CUDA graph replays correctly; the host passes no sequence number.
#define PURLIN_SNAC_MAX_RANKS 64
#define PURLIN_SNAC_OP_WORDS 12
#define PURLIN_SNAC_EPOCH_WORDS 16  // per-block packet epochs: at most this many blocks per grid
#define PURLIN_SNAC_ERROR_WORDS 16  // the host-mapped error record (purlin/encoding.h: ErrorWord)
#define PURLIN_SNAC_DESC_RING 4     // call descriptors (ABI 8): slots per producer rank
#define PURLIN_SNAC_DESC_WORDS 3    // words per descriptor slot
typedef struct PurlinSnacParams {
  const long long* ops;       // device: n_ops records, then n_updates (byte offset, delta) pairs
  long long n_ops;
  long long n_updates;        // mirror updates applied by the kernel's last block (0: no exit counter)
  void* input;                // this call's input / output (device)
  void* output;
  void* bases[PURLIN_SNAC_MAX_RANKS];  // every rank's workspace base, as mapped here
  long long rank, world, dtype;        // dtype: a purlin_dtype, 0 = copy-only schedule
  long long blocks;                    // grid size: FIXED per workspace (arrival counters count it)
  long long max_items;
  long long notify_off, ack_off, sent_off, expect_off, acked_off, arrive_off, arrive_slots;
  long long exit_off, error_off, staging_off;  // byte offsets in a rank's workspace
  long long timeout_ns;                // bound of every wait (%globaltimer)
  long long* host_error;               // host-mapped pinned record (PURLIN_SNAC_ERROR_WORDS), written on a
                                       // timeout or a bad record: [code, op index, kind, peer, item, rank,
                                       // target, seen, tag] (purlin/encoding.h)
  long long tag;                       // the host's name for this schedule, echoed in the record
  long long epoch_off;                 // byte offset of my per-block packet-call counters (snac/packet.cuh)
  long long window_off, window_bytes;  // packet receive windows: [2 parities][world producers] x window_bytes
  long long packets;                   // the kernel kind (ABI 10: purlin/encoding.h KernelKind): kKernelStaged,
                                       // or kKernelPacket (the table holds only packet ops); others are invalid
  long long device;                    // the CUDA device of every pointer and of the stream (ABI 7)
  // Call descriptors (ABI 8; -1 in desc_off: off). At kernel start block 0 stores this call's
  // descriptor into slot desc_seq % PURLIN_SNAC_DESC_RING of row `rank` of every peer's descriptor
  // area ([producer][slot][PURLIN_SNAC_DESC_WORDS] int64 at desc_off): three words, each
  // (desc_seq mod 2^32) << 32 | payload, the payloads being desc_fp mod 2^32 (the call's
  // cross-rank fingerprint), the low and the high 32 bits of desc_info. A wait for a peer's signal
  // of this call compares the peer's slot for this call in its own area (loaded with its first
  // poll) once it completes, and reads it again while it spins past 20 us (kDescAfterNs): the same
  // seq with another fingerprint is a mismatch (error code 3), recorded with both sides'
  // descriptors, and the grid exits as on a timeout. No fence: a slot not yet visible says nothing.
  // The packet kernel reads no descriptor on its hot path: with desc_off >= 0 a packet's second flag
  // word is epoch ^ (desc_fp mod 2^32), so another call's packets never look ready and the stalled
  // wait compares the descriptors (snac/packet.cuh).
  long long desc_off;
  long long desc_seq;                  // the host's call number (frozen in a captured graph)
  long long desc_fp;
  long long desc_info;                 // the host's description code (purlin_sglang/engines/base.py)
} PurlinSnacParams;
// Enqueue one rank's schedule on `stream` (asynchronous; safe under CUDA graph capture: one launch,
// no host sync, no allocation). Returns a cudaError_t: cudaErrorInvalidValue for bad params,
// cudaErrorCooperativeLaunchTooLarge (nothing launched) when `blocks` blocks of the kernel cannot be
// resident on the device at once. An op the kernel cannot run (unknown opcode, a reduce in a
// copy-only schedule, dtype 0) is recorded in host_error (code 2) and breaks the workspace; so is a
// call whose peer made a different call at the same call number (code 3, see desc_off).
// ABI 9: the extension module's Python function snac_launch(params, input, output, seq, stream)
// (native/python/module.cpp) writes input, output and desc_seq into *params and calls this; it is
// the eager call's steady state (engines/cuda.py).
PURLIN_API int purlin_snac_execute(const PurlinSnacParams* params, void* stream);
// The fewest resident blocks per SM over EVERY interpreter and packet kernel (each at its own
// block size) on `device`, and its SM count; loads every kernel. Returns a cudaError_t.
PURLIN_API int purlin_snac_occupancy(int device, int* blocks_per_sm, int* sm_count);

// ---- MoE dispatch / combine (ABI 6) ----------------------------------------------------------------------------
// One launch per call and rank (native/moe/moe_kernel.cuh; plans: purlin_sglang/moe/plan.py). The
// struct's offsets come from the host's MoELayout (purlin_sglang/moe/region.py).
#define PURLIN_MOE_MAX_RANKS 64
#define PURLIN_MOE_MAX_EXPERTS 4096  // count matrix [world][local] kept in shared memory
#define PURLIN_MOE_ERROR_WORDS 16
#define PURLIN_MOE_PTR_WORDS 16  // a pointer block (one-pass mode): 8 dispatch words, 8 combine words
#define PURLIN_MOE_TRACE_WORDS 8  // phase stamps per kind (dispatch, combine) in PurlinMoeParams.trace

typedef struct PurlinMoeParams {
  void* bases[PURLIN_MOE_MAX_RANKS];  // every rank's MoE region, as mapped here
  long long rank, world, blocks;      // blocks: FIXED per region (the arrival counters count it)
  long long local, topk, tokens;      // E/W, K, T (this rank's tokens)
  long long max_tokens, capacity;     // recv slots per producer; rows per (source, local expert)
  long long payload_bytes, hdr_bytes, slot_bytes;  // dispatch row, header (16-aligned), recv slot stride
  long long ret_bytes;                 // combine row bytes (H * element size of expert_out)
  long long count_off, count_bytes;    // count words [2 parities][world producers] x count_bytes
  long long done_off;                  // done words [world producers] (8 bytes each)
  long long recv_off, recv_parity_bytes;  // [2][world][max_tokens] x slot_bytes
  long long ret_off, ret_parity_bytes;    // [2][max_tokens * topk] x ret_bytes
  long long state_off;                 // own words: see moe_kernel.cuh (State)
  long long timeout_ns;
  long long* host_error;               // host-mapped record (PURLIN_MOE_ERROR_WORDS words)
  // dispatch: the caller's tensors (the kernel routes, and quantises to FP8, itself) and the outputs
  const void* x;                       // [T] rows of `hidden` elements of x_dtype
  const void* ids;                     // [T, K] global expert ids (ids_bytes 4 or 8); outside [0, E): skipped
  long long ids_bytes;                 // 4 (int32) or 8 (int64)
  long long x_dtype;                   // purlin_dtype of x (bf16, f16, f32; any with quant 0)
  long long quant;                     // 0: rows travel as x; 1: FP8 e4m3 rows + per-token float32 scales
  void* out_x;                         // [local * world * capacity] rows of payload_bytes
  float* out_scales;                   // or null (quant 0)
  int* out_expert;
  int* out_src;
  long long* out_slot;
  int* out_counts;                     // [local]
  unsigned char* out_valid;            // [T, K] 1 where the slot's id is in [0, E)
  // combine
  const void* expert_out;              // [local * world * capacity] rows of ret_bytes
  const int* row_src;                  // the dispatch's out_src / out_slot
  const long long* row_slot;
  const unsigned char* valid;          // [T, K] the dispatch's out_valid
  const float* weights;                // [T, K] float32
  void* y;                             // [T] rows of ret_bytes
  long long dtype;                     // combine element: purlin_dtype (bf16, f16, f32)
  long long reject;                    // combine: 1 = this rank rejected its arguments: put nothing back, tell
                                       // every rank (its done word carries kRejectBit), reduce nothing
  long long device;                    // the CUDA device of every pointer and of the stream (ABI 7)
  long long one_device;                // 1: every rank's region lies on this GPU (virtual ranks): count and
                                       // done words signal at GPU scope; 0: at system scope (ABI 11)
  long long* trace;                    // or null: [2][PURLIN_MOE_TRACE_WORDS] globaltimer stamps (ns) of the
                                       // last dispatch (row 0) and combine (row 1), block 0 at the end of
                                       // each phase (moe_kernel.cuh), device-writable (ABI 12)
  // One-pass mode (ABI 13): every rank's outputs are addressable here (virtual ranks: one process). A source
  // writes each (token, expert) row straight into the receiver's out_x and the combine reads each expert
  // output where it lies; no receive slots, no return rows (moe_kernel.cuh, "one-pass mode").
  long long one_pass;                  // 1: one-pass mode (every rank of the world alike), 0: receive slots
  long long ptr_off;                   // pointer blocks [2 parities] x PURLIN_MOE_PTR_WORDS words (one pass)
  long long ddone_off;                 // dispatch delivered words [world producers] (8 bytes each; one pass)
  long long* out_ref;                  // dispatch, one pass: [T, K] (receiver << 32 | row there), -1: none
  const long long* row_ref;            // combine, one pass: the dispatch's out_ref
  // Decode mode (ABI 14): one round of flag-in-data packets an op, for a few tokens a rank (moe_kernel.cuh,
  // "decode mode"); in either of the modes above. out_ref / row_ref then hold each slot's (receiver << 32 |
  // its rank among my slots of its expert), -1: none.
  long long decode;                    // 1: this call runs in decode mode (every rank of the call alike)
  long long decode_tokens;             // the token slots of a decode window (tokens <= decode_tokens)
  long long win_off, win_bytes;        // dispatch windows [2 parities][world producers] x win_bytes
  long long rwin_off, rwin_parity_bytes;  // return windows [2][decode_tokens * topk] packet rows + headers
  const int* row_counts;               // combine, decode: the dispatch's out_counts (valid rows per expert)
} PurlinMoeParams;
// Enqueue one rank's dispatch / combine on `stream` (asynchronous; safe under CUDA graph capture: one
// launch, no host sync, no allocation). Waits are bounded by timeout_ns; a timeout, a capacity overflow,
// ids out of range or a mismatch between ranks is written to host_error (see moe_kernel.cuh).
// Returns a cudaError_t (cudaErrorInvalidValue for bad params: payload/ret bytes not multiples of 16,
// topk > 32, world * local > PURLIN_MOE_MAX_EXPERTS, tokens > max_tokens, ...), and
// cudaErrorCooperativeLaunchTooLarge (nothing launched) when `blocks` blocks cannot be resident at once.
PURLIN_API int purlin_moe_dispatch(const PurlinMoeParams* params, void* stream);
PURLIN_API int purlin_moe_combine(const PurlinMoeParams* params, void* stream);
// Max resident blocks per SM of both MoE kernels (the smaller) on `device`, and its SM count; loads both kernels.
PURLIN_API int purlin_moe_occupancy(int device, int* blocks_per_sm, int* sm_count);
