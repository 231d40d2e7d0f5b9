"""The device op table's encoding, as native/include/purlin/encoding.h writes it: opcodes, word-0 and
reference bit fields, signal kinds, buffer codes. Plain constants (no import of the native library), so
both the encoder (engines/cuda_ops.py) and the load-time layout check (native.python_layout) read them
from here without importing each other; native.load() compares every name below with the library's."""

from __future__ import annotations

from .plan import Buf

OP_WORDS = 12
COPY, REDUCE, SIGNAL, WAIT, BARRIER, DRAINALL, PACKET_PUT, PACKET_REDUCE, PACKET_COPY = 1, 2, 3, 4, 5, 6, 7, 8, 9
OPCODES = {"COPY": COPY, "REDUCE": REDUCE, "SIGNAL": SIGNAL, "WAIT": WAIT, "BARRIER": BARRIER, "DRAINALL": DRAINALL,
           "PACKET_PUT": PACKET_PUT, "PACKET_REDUCE": PACKET_REDUCE, "PACKET_COPY": PACKET_COPY}
SUB_SHIFT, NSRC_SHIFT, FLAGS_SHIFT = 8, 16, 24  # word 0: opcode | sub << 8 | nsrc << 16 | flags << 24
NOTIFY, ACK, DRAIN, BARRIER_KIND, PACKET_KIND = 0, 1, 2, 3, 4
KIND_NAMES = {NOTIFY: "notify", ACK: "ack", DRAIN: "drain", BARRIER_KIND: "barrier", PACKET_KIND: "packet"}
FLAG_INPLACE_ONLY = 1
BUF_CODES = {Buf.INPUT: 0, Buf.OUTPUT: 1, Buf.STAGE: 2, Buf.WINDOW: 3}
REF_BUF_SHIFT, REF_RANK_SHIFT, REF_RANK_BITS, REF_OFFSET_BITS = 62, 48, 14, 48  # buf << 62 | rank << 48 | offset
