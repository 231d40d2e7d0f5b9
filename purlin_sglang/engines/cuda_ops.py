"""Encoding a lowered schedule into the CUDA interpreter's device op table (native/snac/ops.cuh).

Done ONCE per schedule on the host; the table then lives on the device and a call is one launch.
Three things are decided here, not on the device:

* signal values and wait targets as "my mirror at kernel start + k", k counted within the call;
* arrival slots: the i-th signal or barrier of the schedule uses counter ``i % ARRIVE_SLOTS``. A
  slot may be reused within one call only once every block has passed its previous use; the
  encoder proves that from the waits (see ``_Guard``) and refuses a schedule it cannot prove;
* grid barriers: blocks split each data op differently, so a data op that reads or overwrites a
  local range another data op of the same call touched (e.g. two-shot's copy out of my own reduced
  shard) gets a barrier before it, unless a passed drain wait already proves that op complete.
  A conflict that exists only when the output IS the input (in-place all_reduce / broadcast) gets
  a barrier that the kernel runs only for in-place calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..abi import REDUCE_MAX_SOURCES, REDUCE_OP_CODES
from ..errors import PurlinPlanError
from ..memory.layout import ARRIVE_SLOTS, DeviceLayout
from ..snac import (
    Buf, Copy, PacketCopy, PacketPut, PacketReduce, Reduce, Schedule, Signal, Span, WaitDrainAll, WaitSignal,
)

# The op table's encoding (abi.py through snac/encoding.py; checked against the library's at native.load()).
from ..snac.encoding import (  # noqa: F401  (re-exported: tests and tools read them from here)
    ACK, BARRIER, BARRIER_KIND, BUF_CODES, COPY, DRAIN, DRAINALL, FLAG_INPLACE_ONLY, FLAGS_SHIFT, KIND_NAMES,
    NOTIFY, NSRC_MASK, NSRC_SHIFT, OP_WORDS, OPCODE_MASK, OPCODES, PACKET_COPY, PACKET_KIND, PACKET_PUT, PACKET_REDUCE,
    REDUCE, REF_BUF_SHIFT, REF_OFFSET_BITS, REF_RANK_BITS, REF_RANK_SHIFT, SIGNAL, SUB_MASK, SUB_SHIFT, WAIT,
)

_BUF = BUF_CODES
_REDOP = REDUCE_OP_CODES
MAX_REDUCE_SOURCES = REDUCE_MAX_SOURCES


@dataclass(frozen=True)
class Encoded:
    words: np.ndarray  # int64: n_ops records of OP_WORDS, then n_updates (offset, delta) pairs
    n_ops: int
    n_updates: int
    n_barriers: int


def _ref(s: Span) -> int:
    if s.offset >= 1 << REF_OFFSET_BITS or s.rank >= 1 << REF_RANK_BITS:
        raise PurlinPlanError(f"cuda engine: span {s} is out of the encodable range")
    v = (_BUF[s.buf] << REF_BUF_SHIFT) | (s.rank << REF_RANK_SHIFT) | s.offset
    return v - (1 << 64) if v >= 1 << 63 else v


class _Guard:
    """Local read/write ranges of data ops not yet proven complete on every block."""

    def __init__(self, me: int, alias_io: bool):
        self.me, self.alias_io = me, alias_io
        self.real: list = []  # (record index, reads, writes): checked without aliasing
        self.alias: list = []  # the same, checked with input == output

    def _ranges(self, spans, alias: bool):
        out = []
        for s in spans:
            if s.nbytes == 0 or (s.buf is Buf.STAGE and s.rank != self.me):
                continue
            buf = Buf.INPUT if (alias and s.buf is Buf.OUTPUT) else s.buf
            out.append((buf, s.offset, s.offset + s.nbytes))
        return out

    @staticmethod
    def _hit(a, b) -> bool:
        return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)

    def _conflicts(self, pending, reads, writes) -> bool:
        return any(self._hit(writes, w) or self._hit(writes, r) or self._hit(reads, w) for _, r, w in pending)

    def check(self, reads, writes) -> int:
        """0: no barrier; 1: a barrier; 2: a barrier for in-place calls only."""
        if self._conflicts(self.real, self._ranges(reads, False), self._ranges(writes, False)):
            return 1
        if self.alias_io and self._conflicts(self.alias, self._ranges(reads, True), self._ranges(writes, True)):
            return 2
        return 0

    def add(self, index: int, reads, writes) -> None:
        self.real.append((index, self._ranges(reads, False), self._ranges(writes, False)))
        if self.alias_io:
            self.alias.append((index, self._ranges(reads, True), self._ranges(writes, True)))

    def done_before(self, index: int) -> None:
        self.real = [e for e in self.real if e[0] >= index]
        self.alias = [e for e in self.alias if e[0] >= index]


def _reduce_record(code: int, op, plan) -> list[int]:
    """A REDUCE or PACKET_REDUCE record: op, source count, dst ref, bytes, source refs in rank order."""
    if len(op.srcs) > MAX_REDUCE_SOURCES:
        raise PurlinPlanError(
            f"{plan.spec.name}: the CUDA engine reduces at most {MAX_REDUCE_SOURCES} contributions per op "
            f"(world size {plan.world}); use at most {MAX_REDUCE_SOURCES} ranks for reductions")
    w0 = code | (_REDOP[op.op.value] << SUB_SHIFT) | (len(op.srcs) << NSRC_SHIFT)
    return [w0, _ref(op.dst), op.dst.nbytes] + [_ref(s) for s in op.srcs]


def _check_run(recs: list, op: Signal, name: str) -> None:
    """The kernel gives a run of consecutive signals in parallel: no counter may appear twice in one."""
    kind = NOTIFY if op.kind == "notify" else ACK
    for r in reversed(recs):
        if r[0] & OPCODE_MASK != SIGNAL:
            return
        if (r[0] >> SUB_SHIFT) & SUB_MASK == kind and r[1] == op.peer and r[2] == op.item:
            raise PurlinPlanError(f"{name}: internal: two {op.kind} signals to rank {op.peer} item {op.item} "
                                  "with no op between them")


def encode(sched: Schedule, dl: DeviceLayout) -> Encoded:
    """The device op table of ``sched`` for a workspace laid out by ``dl``."""
    plan = sched.plan
    me, spec = plan.rank, plan.spec
    recs: list[list[int]] = []
    sent: dict = {}
    expect: dict = {}
    acked: dict = {}
    notify_at: dict = {}  # (c, item) -> [(record index, ordinal)] of my notifies this call
    ordinal = 0
    done_ordinal = 0  # every block has passed every signal / barrier with a smaller ordinal
    guard = _Guard(me, alias_io=not spec.input.sliced and not spec.output.sliced)
    n_barriers = 0

    def slot() -> int:
        nonlocal ordinal
        o = ordinal
        if o >= ARRIVE_SLOTS and done_ordinal <= o - ARRIVE_SLOTS:
            raise PurlinPlanError(
                f"{spec.name}: the CUDA engine cannot prove arrival counter {o % ARRIVE_SLOTS} free for "
                f"signal #{o} of this call; lower tuning.slots or raise staging_bytes")
        ordinal += 1
        return o

    def data(rec: list[int], reads, writes) -> None:
        nonlocal n_barriers, done_ordinal
        need = guard.check(reads, writes)
        if need:
            o = slot()
            recs.append([BARRIER | ((FLAG_INPLACE_ONLY if need == 2 else 0) << FLAGS_SHIFT), o % ARRIVE_SLOTS])
            n_barriers += 1
            if need == 1:
                guard.done_before(len(recs))
                done_ordinal = max(done_ordinal, o + 1)
            else:
                guard.alias = []
        guard.add(len(recs), reads, writes)
        recs.append(rec)

    for op in sched.ops:
        if isinstance(op, Copy):
            if op.dst.nbytes:
                data([COPY, _ref(op.dst), _ref(op.src), op.dst.nbytes], [op.src], [op.dst])
        elif isinstance(op, Reduce):
            rec = _reduce_record(REDUCE, op, plan)  # checked even when empty
            if op.dst.nbytes:
                data(rec, list(op.srcs), [op.dst])
        elif isinstance(op, Signal):
            key = (op.peer, op.item)
            _check_run(recs, op, spec.name)
            o = slot()
            if op.kind == "notify":
                sent[key] = sent.get(key, 0) + 1
                notify_at.setdefault(key, []).append((len(recs), o))
                recs.append([SIGNAL | (NOTIFY << SUB_SHIFT), op.peer, op.item, o % ARRIVE_SLOTS, sent[key]])
            else:
                acked[key] = acked.get(key, 0) + 1
                recs.append([SIGNAL | (ACK << SUB_SHIFT), op.peer, op.item, o % ARRIVE_SLOTS, acked[key]])
        elif isinstance(op, WaitSignal):
            key = (op.peer, op.item)
            if op.kind == "notify":
                expect[key] = expect.get(key, 0) + 1
                recs.append([WAIT | (NOTIFY << SUB_SHIFT), op.peer, op.item, expect[key]])
            else:
                k = sent.get(key, 0) - op.lag
                recs.append([WAIT | (ACK << SUB_SHIFT), op.peer, op.item, k])
                if k >= 1:  # the peer acked my k-th notify: every block passed it
                    index, o = notify_at[key][k - 1]
                    guard.done_before(index)
                    done_ordinal = max(done_ordinal, o + 1)
        elif isinstance(op, PacketPut):
            # Packet ops need no barriers: thread t handles packets t, t + threads, ... of every
            # packet op, so my own input and output are touched by one thread per element.
            # Consecutive puts of one source become one record: each payload word is loaded once.
            # Every packet op is kept, empty ones too: one empty packet still travels (the lowering
            # leaves no op in a call that moves nothing; snac/packet.cuh packet_count).
            last = recs[-1] if recs else None
            if (last is not None and last[0] == PACKET_PUT and last[1] == _ref(op.src)
                    and last[2] == op.src.nbytes and last[3] < OP_WORDS - 4):
                last.append(op.peer)
                last[3] += 1
            else:
                recs.append([PACKET_PUT, _ref(op.src), op.src.nbytes, 1, op.peer])
        elif isinstance(op, PacketCopy):  # dst ref, bytes, src ref (a window, or my own input)
            if op.dst.nbytes or op.src.buf is Buf.WINDOW:
                recs.append([PACKET_COPY, _ref(op.dst), op.dst.nbytes, _ref(op.src)])
        elif isinstance(op, PacketReduce):
            recs.append(_reduce_record(PACKET_REDUCE, op, plan))
        elif isinstance(op, WaitDrainAll):
            if any(sent.get((c, i), 0) for c in op.peers for i in range(op.items)):
                raise PurlinPlanError(f"{spec.name}: internal: drain-all after this call's own notifies")
            recs.append([DRAINALL, op.items])
        else:  # pragma: no cover
            raise PurlinPlanError(f"{spec.name}: internal: unknown op {op!r}")

    updates: list[int] = []  # packet epochs are per block, bumped by each block itself (snac/packet.cuh)
    for base, counts in ((dl.sent_off, sent), (dl.expect_off, expect), (dl.acked_off, acked)):
        for (peer, item), n in sorted(counts.items()):
            updates += [dl.word(base, peer, item), n]
    words = np.zeros(len(recs) * OP_WORDS + len(updates), dtype=np.int64)
    for i, r in enumerate(recs):
        words[i * OP_WORDS: i * OP_WORDS + len(r)] = r
    words[len(recs) * OP_WORDS:] = updates
    return Encoded(words, len(recs), len(updates) // 2, n_barriers)
