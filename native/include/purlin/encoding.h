// Constants shared by the kernels (snac/, moe/) and the layout export (abi.cpp): the SNAC op-table
// encoding, the kernel kinds, the host-mapped error records, the packet and descriptor formats and the
// MoE state words. Plain C++ (no CUDA), so the host-only build exports the same values. The kernels
// decode records only through these names (snac/ops.cuh: opcode_of, sub_of, ref_rank, ...), so the
// values exported here are the values the kernels run with. Python keeps its own copies in one module
// (purlin_sglang/abi.py); native.load() compares them with purlin_native_layout() and refuses a
// library that disagrees.
#pragma once
#include "purlin/native.h"

namespace purlin::snac {

// Word 0 of a record: opcode | sub << kSubShift | nsrc << kNsrcShift | flags << kFlagsShift, each
// field within its mask (flags: every bit from kFlagsShift up).
enum Opcode : int {
  kCopy = 1, kReduce = 2, kSignal = 3, kWait = 4, kBarrier = 5, kDrainAll = 6, kPacketPut = 7, kPacketReduce = 8,
  kPacketCopy = 9
};
constexpr int kSubShift = 8, kNsrcShift = 16, kFlagsShift = 24;
constexpr long long kOpcodeMask = 0xff, kSubMask = 0xff, kNsrcMask = 0xff;
static_assert(kOpcodeMask < (1ll << kSubShift) && (kSubMask << kSubShift) < (1ll << kNsrcShift) &&
                  (kNsrcMask << kNsrcShift) < (1ll << kFlagsShift),
              "the fields of word 0 do not overlap");
enum Kind : int { kNotify = 0, kAck = 1, kDrain = 2, kBarrierKind = 3, kPacketKind = 4 };
// A buffer reference: buf << kRefBufShift | rank << kRefRankShift | byte offset (kRefOffsetBits bits).
enum Buf : int { kInput = 0, kOutput = 1, kStage = 2, kWindow = 3 };
constexpr int kRefBufShift = 62, kRefRankShift = 48, kRefRankBits = 14, kRefOffsetBits = 48;
static_assert(kRefOffsetBits <= kRefRankShift && kRefRankShift + kRefRankBits <= kRefBufShift,
              "the fields of a buffer reference do not overlap");
constexpr long long kFlagInPlaceOnly = 1;
// The kernel a table runs in (PurlinSnacParams.packets): the staged interpreter (snac/interpreter.cuh) or
// the packet kernel (snac/packet.cuh). The host picks it per schedule from the algorithm that made it.
enum KernelKind : int { kKernelStaged = 0, kKernelPacket = 1 };

// A packet: 8 payload bytes and the call's epoch twice (snac/packet.cuh).
constexpr int kPacketBytes = 16;
constexpr int kPacketPayload = 8;

// The host-mapped error record (PURLIN_SNAC_ERROR_WORDS int64 words); word 0 is written last.
enum ErrorWord : int {
  kErrCode = 0, kErrOp = 1, kErrKind = 2, kErrPeer = 3, kErrItem = 4, kErrRank = 5, kErrTarget = 6, kErrSeen = 7,
  kErrTag = 8, kErrPeerInfoLo = 9, kErrPeerInfoHi = 10, kErrMyInfo = 11
};
// kErrCode values. A bad record (unknown opcode, a reduce in the copy-only kernel, a reduce record
// with an unknown operator or source count) puts the opcode in kErrKind, word 0 in kErrSeen.
// A mismatch (two ranks made different calls at the same call number: their fingerprints differ)
// puts my descriptor word 0 in kErrTarget, the peer's in kErrSeen, the peer's other two words in
// kErrPeerInfoLo / kErrPeerInfoHi (0 where a word belonged to another call) and my desc_info in kErrMyInfo.
enum ErrorCode : int { kErrTimeout = 1, kErrBadRecord = 2, kErrMismatch = 3 };
// A wait reads its peer's descriptor again each time it has spun past this (the fast path reads it once,
// with its first poll).
constexpr long long kDescAfterNs = 20000;
// A descriptor word (native.h desc_off): (call number mod 2^32) << kDescSeqShift | a 32-bit payload.
constexpr int kDescSeqShift = 32;

}  // namespace purlin::snac

namespace purlin::moe {

// My region's own words at state_off (moe/moe_kernel.cuh).
enum StateWord : int { kDispEpoch = 0, kCombEpoch = 1, kDispArrive = 2, kDispExit = 3, kCombArrive = 4,
                       kCombExit = 5, kFatal = 6 };
constexpr int kStateWords = 7;
// Word 0 of the host-mapped record (PURLIN_MOE_ERROR_WORDS words).
enum ErrorCode : int { kTimeout = 1, kOverflow = 2, kBadIds = 3, kMismatch = 4, kRejected = 5 };
// A combine done word of a rank that rejected its own arguments (it put nothing back): the epoch with this
// bit set. Waits compare the epoch below it; a peer that sees the bit records kRejected and skips its reduce.
constexpr long long kRejectBit = 1ll << 62;
// In a decode-mode header's meta word (moe_kernel.cuh, "decode mode"): its producer runs the decode mode.
constexpr long long kDecodeMeta = 1ll << 60;

}  // namespace purlin::moe
