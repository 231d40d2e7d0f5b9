"""The Python mirror of the native ABI, in one place: the parameter structs, the op-table encoding,
the dtype and reduce-op codes, the error records, the kernel kinds and the layout constants that
``native/include/purlin/native.h`` and ``native/include/purlin/encoding.h`` define.

Plain data: this module imports nothing of the package (and not torch), so the encoder
(snac/encoding.py, engines/cuda_ops.py), the workspace layouts (memory/) and the loader
(native.py) all read it without importing each other. :func:`python_layout` lists every value
under the name ``purlin_native_layout()`` exports it with; ``native.load()`` compares the two and
refuses a library that disagrees, naming each field or constant with both values.
"""

from __future__ import annotations

import ctypes

ABI_VERSION = 14  # PURLIN_NATIVE_ABI_VERSION (native/CMakeLists.txt)

# ---- native.h: limits, the dtype and reduce-op tables -------------------------------------------------------
SNAC_MAX_RANKS = 64  # PURLIN_SNAC_MAX_RANKS
SNAC_OP_WORDS = 12  # PURLIN_SNAC_OP_WORDS: int64 words per op record
SNAC_EPOCH_WORDS = 16  # PURLIN_SNAC_EPOCH_WORDS: per-block packet epochs, so at most this many blocks per grid
REDUCE_MAX_SOURCES = 8  # PURLIN_REDUCE_MAX_SOURCES
# THE dtype table of Python and C++: enum purlin_dtype (0 is no type: a copy-only schedule), enum purlin_reduce_op.
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3, "float64": 4, "int32": 5, "int64": 6}
REDUCE_OP_CODES = {"sum": 1, "max": 2, "min": 3}

_ll = ctypes.c_longlong
_vp = ctypes.c_void_p


class SnacParams(ctypes.Structure):
    """native.h's PurlinSnacParams (compared field by field with the library's at load)."""

    _fields_ = [
        ("ops", ctypes.c_void_p), ("n_ops", _ll), ("n_updates", _ll),
        ("input", ctypes.c_void_p), ("output", ctypes.c_void_p),
        ("bases", ctypes.c_void_p * SNAC_MAX_RANKS),
        ("rank", _ll), ("world", _ll), ("dtype", _ll), ("blocks", _ll), ("max_items", _ll),
        ("notify_off", _ll), ("ack_off", _ll), ("sent_off", _ll), ("expect_off", _ll), ("acked_off", _ll),
        ("arrive_off", _ll), ("arrive_slots", _ll), ("exit_off", _ll), ("error_off", _ll), ("staging_off", _ll),
        ("timeout_ns", _ll), ("host_error", ctypes.c_void_p), ("tag", _ll),
        ("epoch_off", _ll), ("window_off", _ll), ("window_bytes", _ll), ("packets", _ll), ("device", _ll),
        ("desc_off", _ll), ("desc_seq", _ll), ("desc_fp", _ll), ("desc_info", _ll),
    ]


MOE_MAX_RANKS = 64  # PURLIN_MOE_MAX_RANKS


class MoeParams(ctypes.Structure):
    """native.h's PurlinMoeParams (compared field by field with the library's at load)."""

    _fields_ = [("bases", ctypes.c_void_p * MOE_MAX_RANKS)] + [(n, _ll) for n in (
        "rank", "world", "blocks", "local", "topk", "tokens", "max_tokens", "capacity", "payload_bytes",
        "hdr_bytes", "slot_bytes", "ret_bytes", "count_off", "count_bytes", "done_off", "recv_off",
        "recv_parity_bytes", "ret_off", "ret_parity_bytes", "state_off", "timeout_ns")] + [(n, _vp) for n in (
        "host_error", "x", "ids")] + [(n, _ll) for n in ("ids_bytes", "x_dtype", "quant")] + [(n, _vp) for n in (
        "out_x", "out_scales", "out_expert", "out_src", "out_slot", "out_counts", "out_valid", "expert_out",
        "row_src", "row_slot", "valid", "weights", "y")] + [(n, _ll) for n in ("dtype", "reject", "device", "one_device")] + [
        ("trace", ctypes.c_void_p)] + [(n, _ll) for n in ("one_pass", "ptr_off", "ddone_off")] + [
        (n, _vp) for n in ("out_ref", "row_ref")] + [(n, _ll) for n in (
        "decode", "decode_tokens", "win_off", "win_bytes", "rwin_off", "rwin_parity_bytes")] + [("row_counts", _vp)]


# ---- encoding.h: the SNAC op table -------------------------------------------------------------------------
OP_WORDS = SNAC_OP_WORDS
COPY, REDUCE, SIGNAL, WAIT, BARRIER, DRAINALL, PACKET_PUT, PACKET_REDUCE, PACKET_COPY = 1, 2, 3, 4, 5, 6, 7, 8, 9
OPCODES = {"COPY": COPY, "REDUCE": REDUCE, "SIGNAL": SIGNAL, "WAIT": WAIT, "BARRIER": BARRIER, "DRAINALL": DRAINALL,
           "PACKET_PUT": PACKET_PUT, "PACKET_REDUCE": PACKET_REDUCE, "PACKET_COPY": PACKET_COPY}
# Word 0 of a record: opcode | sub << SUB_SHIFT | nsrc << NSRC_SHIFT | flags << FLAGS_SHIFT, each field
# within its mask (flags: every bit from FLAGS_SHIFT up).
SUB_SHIFT, NSRC_SHIFT, FLAGS_SHIFT = 8, 16, 24
OPCODE_MASK, SUB_MASK, NSRC_MASK = 0xFF, 0xFF, 0xFF
FLAG_INPLACE_ONLY = 1
# Signal and wait kinds (a SIGNAL / WAIT record's sub field; the kind of a recorded timeout).
NOTIFY, ACK, DRAIN, BARRIER_KIND, PACKET_KIND = 0, 1, 2, 3, 4
KIND_NAMES = {NOTIFY: "notify", ACK: "ack", DRAIN: "drain", BARRIER_KIND: "barrier", PACKET_KIND: "packet"}
# A buffer reference: buf << REF_BUF_SHIFT | rank << REF_RANK_SHIFT | byte offset (REF_OFFSET_BITS bits).
BUF_CODES = {"INPUT": 0, "OUTPUT": 1, "STAGE": 2, "WINDOW": 3}
REF_BUF_SHIFT, REF_RANK_SHIFT, REF_RANK_BITS, REF_OFFSET_BITS = 62, 48, 14, 48
# The kernel a table runs in (PurlinSnacParams.packets): the staged interpreter or the packet kernel.
KERNEL_STAGED, KERNEL_PACKET = 0, 1

# ---- encoding.h: packets and device call descriptors ------------------------------------------------------
PACKET_BYTES, PACKET_PAYLOAD = 16, 8  # a packet: 8 payload bytes and the epoch twice
# Descriptors (native.h desc_off): slots per producer, int64 words per slot; each word is
# seq << DESC_SEQ_SHIFT | payload (32 bits); a stalled wait reads its peer's descriptor after DESC_AFTER_NS.
SNAC_DESC_RING, SNAC_DESC_WORDS, SNAC_DESC_AFTER_NS = 4, 3, 20000
DESC_SEQ_SHIFT = 32

# ---- encoding.h: the SNAC kernels' host-mapped error record (word i is field i) ---------------------------
SNAC_ERROR_WORDS = 16
SNAC_ERROR_FIELDS = ("code", "op", "kind", "peer", "item", "rank", "target", "seen", "tag", "peer_info_lo",
                     "peer_info_hi", "my_info")
SNAC_ERROR_CODES = {"TIMEOUT": 1, "BAD_RECORD": 2, "MISMATCH": 3}

# ---- MoE: native.h, encoding.h (purlin::moe) and the MoE region's layout ----------------------------------
MOE_MAX_EXPERTS = 4096  # native.h PURLIN_MOE_MAX_EXPERTS
MOE_STATE_BYTES = 128  # the MoE region's state area (moe/region.py): holds encoding.h's kStateWords words
# The MoE kernels' record (PURLIN_MOE_ERROR_WORDS words; word 0 one of these codes).
MOE_ERROR_WORDS = 16
MOE_ERROR_CODES = {"TIMEOUT": 1, "OVERFLOW": 2, "BAD_IDS": 3, "MISMATCH": 4, "REJECTED": 5}
# The kernels' phase stamps (PurlinMoeParams.trace): PURLIN_MOE_TRACE_WORDS words per kind, the phases
# in the order the kernels stamp them (moe_kernel.cuh); unused words stay 0.
MOE_TRACE_WORDS = 8
MOE_TRACE_PHASES = {"dispatch": ("start", "put", "notify", "wait", "expand", "pad"),
                    "combine": ("start", "put_back", "notify", "wait", "reduce")}
# The same stamps of the one-pass mode's kernels (virtual ranks: rows straight into the receivers' outputs).
MOE_TRACE_PHASES_ONE_PASS = {"dispatch": ("start", "route", "counts_out", "counts_in", "put", "delivered", "pad",
                                          "received"),
                             "combine": ("start", "ready_out", "ready_in", "reduce", "readers_done")}
# The same stamps of the decode mode's kernels (one round of packets an op).
MOE_TRACE_PHASES_DECODE = {"dispatch": ("start", "route", "headers_out", "put", "headers_in", "pad", "expand"),
                           "combine": ("start", "put_back", "headers_in", "reduce")}
MOE_PTR_WORDS = 16  # a one-pass pointer block per parity (native.h PURLIN_MOE_PTR_WORDS)
MOE_DECODE_META = 1 << 60  # a decode-mode header's meta word carries it (encoding.h kDecodeMeta)
MOE_REJECT_BIT = 1 << 62  # a combine done word of a rank that rejected its arguments (encoding.h kRejectBit)


def _struct_layout(cname: str, cls: type) -> dict[str, int]:
    out = {f"sizeof({cname})": ctypes.sizeof(cls)}
    for name, _ in cls._fields_:
        field = getattr(cls, name)
        out[f"offsetof({cname}, {name})"] = field.offset
        out[f"sizeof({cname}.{name})"] = field.size
    return out


def python_layout() -> dict[str, int]:
    """What this package's Python side believes the native ABI is, under purlin_native_layout()'s names."""
    out = {"PURLIN_NATIVE_ABI_VERSION": ABI_VERSION}
    out.update(_struct_layout("PurlinSnacParams", SnacParams))
    out.update(_struct_layout("PurlinMoeParams", MoeParams))
    out.update({
        "PURLIN_SNAC_MAX_RANKS": SNAC_MAX_RANKS, "PURLIN_SNAC_OP_WORDS": OP_WORDS,
        "PURLIN_SNAC_EPOCH_WORDS": SNAC_EPOCH_WORDS, "PURLIN_SNAC_ERROR_WORDS": SNAC_ERROR_WORDS,
        "PURLIN_SNAC_DESC_RING": SNAC_DESC_RING, "PURLIN_SNAC_DESC_WORDS": SNAC_DESC_WORDS,
        "snac.desc.after_ns": SNAC_DESC_AFTER_NS, "snac.desc.seq_shift": DESC_SEQ_SHIFT,
        "PURLIN_REDUCE_MAX_SOURCES": REDUCE_MAX_SOURCES, "PURLIN_MOE_MAX_RANKS": MOE_MAX_RANKS,
        "PURLIN_MOE_MAX_EXPERTS": MOE_MAX_EXPERTS, "PURLIN_MOE_ERROR_WORDS": MOE_ERROR_WORDS,
        "PURLIN_MOE_TRACE_WORDS": MOE_TRACE_WORDS, "PURLIN_MOE_PTR_WORDS": MOE_PTR_WORDS,
    })
    out.update({f"PURLIN_DTYPE_{n.upper()}": v for n, v in DTYPE_CODES.items()})
    out.update({f"PURLIN_REDUCE_{n.upper()}": v for n, v in REDUCE_OP_CODES.items()})
    out.update({f"snac.op.{n}": v for n, v in OPCODES.items()})
    out.update({f"snac.kind.{n.upper()}": v for v, n in KIND_NAMES.items()})
    out.update({f"snac.buf.{n}": v for n, v in BUF_CODES.items()})
    out.update({"snac.kernel.STAGED": KERNEL_STAGED, "snac.kernel.PACKET": KERNEL_PACKET})
    out.update({
        "snac.word0.sub_shift": SUB_SHIFT, "snac.word0.nsrc_shift": NSRC_SHIFT, "snac.word0.flags_shift": FLAGS_SHIFT,
        "snac.word0.opcode_mask": OPCODE_MASK, "snac.word0.sub_mask": SUB_MASK, "snac.word0.nsrc_mask": NSRC_MASK,
        "snac.flag.INPLACE_ONLY": FLAG_INPLACE_ONLY,
        "snac.ref.buf_shift": REF_BUF_SHIFT, "snac.ref.rank_shift": REF_RANK_SHIFT,
        "snac.ref.rank_bits": REF_RANK_BITS, "snac.ref.offset_bits": REF_OFFSET_BITS,
        "snac.packet.bytes": PACKET_BYTES, "snac.packet.payload": PACKET_PAYLOAD,
    })
    out.update({f"snac.error.{n}": i for i, n in enumerate(SNAC_ERROR_FIELDS)})
    out.update({f"snac.error_code.{n}": v for n, v in SNAC_ERROR_CODES.items()})
    out.update({f"moe.error_code.{n}": v for n, v in MOE_ERROR_CODES.items()})
    out["moe.reject_bit"] = MOE_REJECT_BIT
    out["moe.decode_meta"] = MOE_DECODE_META
    return out
