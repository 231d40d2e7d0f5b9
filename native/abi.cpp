// purlin_native_layout(): the layout this library was compiled with, for native.py to compare with its
// own copies at load (a mismatch is an error at import, not a hang or a wrong sum). Host only, in every
// build (with or without CUDA). Every field of both parameter structs is listed; a field added to a
// struct but not here still changes "sizeof(...)", which native.py compares too.
#include <cstddef>

#include "purlin/encoding.h"
#include "purlin/native.h"
#include "purlin_build_info.h"

namespace {

#define PURLIN_FIELD(S, f) {"offsetof(" #S ", " #f ")", (long long)offsetof(S, f)}, \
                           {"sizeof(" #S "." #f ")", (long long)sizeof(((S*)nullptr)->f)}
#define PURLIN_CONST(name) {#name, (long long)(name)}

using namespace purlin;

const PurlinAbiEntry kLayout[] = {
    {"PURLIN_NATIVE_ABI_VERSION", PURLIN_NATIVE_ABI_VERSION},
    // ---- PurlinSnacParams ----
    {"sizeof(PurlinSnacParams)", (long long)sizeof(PurlinSnacParams)},
    PURLIN_FIELD(PurlinSnacParams, ops), PURLIN_FIELD(PurlinSnacParams, n_ops),
    PURLIN_FIELD(PurlinSnacParams, n_updates), PURLIN_FIELD(PurlinSnacParams, input),
    PURLIN_FIELD(PurlinSnacParams, output), PURLIN_FIELD(PurlinSnacParams, bases),
    PURLIN_FIELD(PurlinSnacParams, rank), PURLIN_FIELD(PurlinSnacParams, world),
    PURLIN_FIELD(PurlinSnacParams, dtype), PURLIN_FIELD(PurlinSnacParams, blocks),
    PURLIN_FIELD(PurlinSnacParams, max_items), PURLIN_FIELD(PurlinSnacParams, notify_off),
    PURLIN_FIELD(PurlinSnacParams, ack_off), PURLIN_FIELD(PurlinSnacParams, sent_off),
    PURLIN_FIELD(PurlinSnacParams, expect_off), PURLIN_FIELD(PurlinSnacParams, acked_off),
    PURLIN_FIELD(PurlinSnacParams, arrive_off), PURLIN_FIELD(PurlinSnacParams, arrive_slots),
    PURLIN_FIELD(PurlinSnacParams, exit_off), PURLIN_FIELD(PurlinSnacParams, error_off),
    PURLIN_FIELD(PurlinSnacParams, staging_off), PURLIN_FIELD(PurlinSnacParams, timeout_ns),
    PURLIN_FIELD(PurlinSnacParams, host_error), PURLIN_FIELD(PurlinSnacParams, tag),
    PURLIN_FIELD(PurlinSnacParams, epoch_off), PURLIN_FIELD(PurlinSnacParams, window_off),
    PURLIN_FIELD(PurlinSnacParams, window_bytes), PURLIN_FIELD(PurlinSnacParams, packets),
    PURLIN_FIELD(PurlinSnacParams, device), PURLIN_FIELD(PurlinSnacParams, desc_off),
    PURLIN_FIELD(PurlinSnacParams, desc_seq), PURLIN_FIELD(PurlinSnacParams, desc_fp),
    PURLIN_FIELD(PurlinSnacParams, desc_info),
    // ---- PurlinMoeParams ----
    {"sizeof(PurlinMoeParams)", (long long)sizeof(PurlinMoeParams)},
    PURLIN_FIELD(PurlinMoeParams, bases), PURLIN_FIELD(PurlinMoeParams, rank),
    PURLIN_FIELD(PurlinMoeParams, world), PURLIN_FIELD(PurlinMoeParams, blocks),
    PURLIN_FIELD(PurlinMoeParams, local), PURLIN_FIELD(PurlinMoeParams, topk),
    PURLIN_FIELD(PurlinMoeParams, tokens), PURLIN_FIELD(PurlinMoeParams, max_tokens),
    PURLIN_FIELD(PurlinMoeParams, capacity), PURLIN_FIELD(PurlinMoeParams, payload_bytes),
    PURLIN_FIELD(PurlinMoeParams, hdr_bytes), PURLIN_FIELD(PurlinMoeParams, slot_bytes),
    PURLIN_FIELD(PurlinMoeParams, ret_bytes), PURLIN_FIELD(PurlinMoeParams, count_off),
    PURLIN_FIELD(PurlinMoeParams, count_bytes), PURLIN_FIELD(PurlinMoeParams, done_off),
    PURLIN_FIELD(PurlinMoeParams, recv_off), PURLIN_FIELD(PurlinMoeParams, recv_parity_bytes),
    PURLIN_FIELD(PurlinMoeParams, ret_off), PURLIN_FIELD(PurlinMoeParams, ret_parity_bytes),
    PURLIN_FIELD(PurlinMoeParams, state_off), PURLIN_FIELD(PurlinMoeParams, timeout_ns),
    PURLIN_FIELD(PurlinMoeParams, host_error), PURLIN_FIELD(PurlinMoeParams, x),
    PURLIN_FIELD(PurlinMoeParams, ids), PURLIN_FIELD(PurlinMoeParams, ids_bytes),
    PURLIN_FIELD(PurlinMoeParams, x_dtype), PURLIN_FIELD(PurlinMoeParams, quant),
    PURLIN_FIELD(PurlinMoeParams, out_x), PURLIN_FIELD(PurlinMoeParams, out_scales),
    PURLIN_FIELD(PurlinMoeParams, out_expert), PURLIN_FIELD(PurlinMoeParams, out_src),
    PURLIN_FIELD(PurlinMoeParams, out_slot), PURLIN_FIELD(PurlinMoeParams, out_counts),
    PURLIN_FIELD(PurlinMoeParams, out_valid), PURLIN_FIELD(PurlinMoeParams, expert_out),
    PURLIN_FIELD(PurlinMoeParams, row_src), PURLIN_FIELD(PurlinMoeParams, row_slot),
    PURLIN_FIELD(PurlinMoeParams, valid), PURLIN_FIELD(PurlinMoeParams, weights),
    PURLIN_FIELD(PurlinMoeParams, y), PURLIN_FIELD(PurlinMoeParams, dtype),
    PURLIN_FIELD(PurlinMoeParams, reject), PURLIN_FIELD(PurlinMoeParams, device),
    PURLIN_FIELD(PurlinMoeParams, one_device), PURLIN_FIELD(PurlinMoeParams, trace),
    PURLIN_FIELD(PurlinMoeParams, one_pass), PURLIN_FIELD(PurlinMoeParams, ptr_off),
    PURLIN_FIELD(PurlinMoeParams, ddone_off), PURLIN_FIELD(PurlinMoeParams, out_ref),
    PURLIN_FIELD(PurlinMoeParams, row_ref), PURLIN_FIELD(PurlinMoeParams, decode),
    PURLIN_FIELD(PurlinMoeParams, decode_tokens), PURLIN_FIELD(PurlinMoeParams, win_off),
    PURLIN_FIELD(PurlinMoeParams, win_bytes), PURLIN_FIELD(PurlinMoeParams, rwin_off),
    PURLIN_FIELD(PurlinMoeParams, rwin_parity_bytes), PURLIN_FIELD(PurlinMoeParams, row_counts),
    // ---- native.h: limits, the dtype and reduce-op tables ----
    PURLIN_CONST(PURLIN_SNAC_MAX_RANKS), PURLIN_CONST(PURLIN_SNAC_OP_WORDS), PURLIN_CONST(PURLIN_SNAC_EPOCH_WORDS),
    PURLIN_CONST(PURLIN_SNAC_ERROR_WORDS), PURLIN_CONST(PURLIN_SNAC_DESC_RING), PURLIN_CONST(PURLIN_SNAC_DESC_WORDS),
    PURLIN_CONST(PURLIN_REDUCE_MAX_SOURCES),
    PURLIN_CONST(PURLIN_MOE_MAX_RANKS), PURLIN_CONST(PURLIN_MOE_MAX_EXPERTS), PURLIN_CONST(PURLIN_MOE_ERROR_WORDS),
    PURLIN_CONST(PURLIN_MOE_TRACE_WORDS), PURLIN_CONST(PURLIN_MOE_PTR_WORDS),
    PURLIN_CONST(PURLIN_DTYPE_BFLOAT16), PURLIN_CONST(PURLIN_DTYPE_FLOAT16), PURLIN_CONST(PURLIN_DTYPE_FLOAT32),
    PURLIN_CONST(PURLIN_DTYPE_FLOAT64), PURLIN_CONST(PURLIN_DTYPE_INT32), PURLIN_CONST(PURLIN_DTYPE_INT64),
    PURLIN_CONST(PURLIN_REDUCE_SUM), PURLIN_CONST(PURLIN_REDUCE_MAX), PURLIN_CONST(PURLIN_REDUCE_MIN),
    // ---- purlin/encoding.h: the op table ----
    {"snac.op.COPY", snac::kCopy}, {"snac.op.REDUCE", snac::kReduce}, {"snac.op.SIGNAL", snac::kSignal},
    {"snac.op.WAIT", snac::kWait}, {"snac.op.BARRIER", snac::kBarrier}, {"snac.op.DRAINALL", snac::kDrainAll},
    {"snac.op.PACKET_PUT", snac::kPacketPut}, {"snac.op.PACKET_REDUCE", snac::kPacketReduce},
    {"snac.op.PACKET_COPY", snac::kPacketCopy},
    {"snac.word0.sub_shift", snac::kSubShift}, {"snac.word0.nsrc_shift", snac::kNsrcShift},
    {"snac.word0.flags_shift", snac::kFlagsShift}, {"snac.word0.opcode_mask", snac::kOpcodeMask},
    {"snac.word0.sub_mask", snac::kSubMask}, {"snac.word0.nsrc_mask", snac::kNsrcMask},
    {"snac.flag.INPLACE_ONLY", snac::kFlagInPlaceOnly},
    {"snac.kernel.STAGED", snac::kKernelStaged}, {"snac.kernel.PACKET", snac::kKernelPacket},
    {"snac.kind.NOTIFY", snac::kNotify}, {"snac.kind.ACK", snac::kAck}, {"snac.kind.DRAIN", snac::kDrain},
    {"snac.kind.BARRIER", snac::kBarrierKind}, {"snac.kind.PACKET", snac::kPacketKind},
    {"snac.buf.INPUT", snac::kInput}, {"snac.buf.OUTPUT", snac::kOutput}, {"snac.buf.STAGE", snac::kStage},
    {"snac.buf.WINDOW", snac::kWindow},
    {"snac.ref.buf_shift", snac::kRefBufShift}, {"snac.ref.rank_shift", snac::kRefRankShift},
    {"snac.ref.rank_bits", snac::kRefRankBits}, {"snac.ref.offset_bits", snac::kRefOffsetBits},
    {"snac.packet.bytes", snac::kPacketBytes}, {"snac.packet.payload", snac::kPacketPayload},
    // the error record: word indices, then codes
    {"snac.error.code", snac::kErrCode}, {"snac.error.op", snac::kErrOp}, {"snac.error.kind", snac::kErrKind},
    {"snac.error.peer", snac::kErrPeer}, {"snac.error.item", snac::kErrItem}, {"snac.error.rank", snac::kErrRank},
    {"snac.error.target", snac::kErrTarget}, {"snac.error.seen", snac::kErrSeen}, {"snac.error.tag", snac::kErrTag},
    {"snac.error.peer_info_lo", snac::kErrPeerInfoLo}, {"snac.error.peer_info_hi", snac::kErrPeerInfoHi},
    {"snac.error.my_info", snac::kErrMyInfo},
    {"snac.error_code.TIMEOUT", snac::kErrTimeout}, {"snac.error_code.BAD_RECORD", snac::kErrBadRecord},
    {"snac.error_code.MISMATCH", snac::kErrMismatch}, {"snac.desc.after_ns", snac::kDescAfterNs},
    {"snac.desc.seq_shift", snac::kDescSeqShift},
    // ---- MoE ----
    {"moe.state_words", moe::kStateWords},
    {"moe.error_code.TIMEOUT", moe::kTimeout}, {"moe.error_code.OVERFLOW", moe::kOverflow},
    {"moe.error_code.BAD_IDS", moe::kBadIds}, {"moe.error_code.MISMATCH", moe::kMismatch},
    {"moe.error_code.REJECTED", moe::kRejected}, {"moe.reject_bit", moe::kRejectBit},
    {"moe.decode_meta", moe::kDecodeMeta},
};

#undef PURLIN_FIELD
#undef PURLIN_CONST

static_assert(snac::kErrMyInfo < PURLIN_SNAC_ERROR_WORDS, "the SNAC error record has room for every word");
static_assert(moe::kFatal < moe::kStateWords, "kStateWords counts every MoE state word");

}  // namespace

PURLIN_API const PurlinAbiEntry* purlin_native_layout(int* count) {
  if (count != nullptr) *count = int(sizeof(kLayout) / sizeof(kLayout[0]));
  return kLayout;
}
