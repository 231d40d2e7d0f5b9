"""The device op table's encoding, as the planner's types meet it: the constants of
:mod:`purlin_sglang.abi` (opcodes, word-0 fields, signal kinds, reference fields, kernel kinds),
and the buffer codes keyed by :class:`~purlin_sglang.snac.plan.Buf`. The encoder
(engines/cuda_ops.py) reads them here; native.load() compares the ABI module with the library."""

from __future__ import annotations

from ..abi import (  # noqa: F401  (re-exported: the encoder, tests and tools read them from here)
    ACK, BARRIER, BARRIER_KIND, COPY, DRAIN, DRAINALL, FLAG_INPLACE_ONLY, FLAGS_SHIFT, KERNEL_PACKET, KERNEL_STAGED,
    KIND_NAMES, NOTIFY, NSRC_MASK, NSRC_SHIFT, OP_WORDS, OPCODE_MASK, OPCODES, PACKET_COPY, PACKET_KIND, PACKET_PUT,
    PACKET_REDUCE, REDUCE, REF_BUF_SHIFT, REF_OFFSET_BITS, REF_RANK_BITS, REF_RANK_SHIFT, SIGNAL, SUB_MASK, SUB_SHIFT,
    WAIT,
)
from ..abi import BUF_CODES as _BUF_BY_NAME
from .plan import Buf

BUF_CODES = {b: _BUF_BY_NAME[b.name] for b in Buf}
