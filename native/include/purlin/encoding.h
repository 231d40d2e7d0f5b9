// Constants shared by the kernels (snac/, moe/) and the layout export (abi.cpp): the SNAC op-table
// encoding, the host-mapped error records, the packet format and the MoE state words. Plain C++
// (no CUDA), so the host-only build exports the same values. Python keeps its own copies
// (purlin_sglang/engines/cuda_ops.py, native.py); native.load() compares them with
// purlin_native_layout() and refuses a library that disagrees.
#pragma once
#include "purlin/native.h"

namespace purlin::snac {

// Word 0 of a record: opcode | sub << 8 | nsrc << 16 | flags << 24.
enum Opcode : int {
  kCopy = 1, kReduce = 2, kSignal = 3, kWait = 4, kBarrier = 5, kDrainAll = 6, kPacketPut = 7, kPacketReduce = 8,
  kPacketCopy = 9
};
constexpr int kSubShift = 8, kNsrcShift = 16, kFlagsShift = 24;
enum Kind : int { kNotify = 0, kAck = 1, kDrain = 2, kBarrierKind = 3, kPacketKind = 4 };
// A buffer reference: buf << 62 | rank << 48 | byte offset (48 bits).
enum Buf : int { kInput = 0, kOutput = 1, kStage = 2, kWindow = 3 };
constexpr int kRefBufShift = 62, kRefRankShift = 48, kRefRankBits = 14, kRefOffsetBits = 48;
constexpr long long kFlagInPlaceOnly = 1;

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

}  // namespace purlin::moe
