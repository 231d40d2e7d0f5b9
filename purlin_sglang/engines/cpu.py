"""The CPU reference engine: executes lowered SNAC schedules on CPU tensors.

It is the oracle for the CUDA engine and the datapath for CPU groups. It runs the
same ops whichever way the ranks live (threads of one process, or processes on one
host); only the workspace differs. Reductions accumulate 16-bit floats in float32
and combine contributions in the order the plan lists them (rank order), so every
rank computes bitwise identical results on every run.

Every call starts with a rendezvous: a rank publishes its call descriptor, then reads every peer's
descriptor of the same call before it moves a byte. So a mismatch is found before any data moves,
and a rank that rejected its own arguments (:meth:`CpuEngine.reject`: its descriptor says so, its
reject words say why) makes every peer raise at once, naming it and quoting its error, with no
counter touched: the next call is the next call on every rank.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..collectives import ReduceOp
from ..config import timeouts
from ..errors import (PurlinBrokenError, PurlinError, PurlinMismatchError, PurlinTimeoutError, rejected_error,
                      text_words, words_text)
from ..memory.host import HostWorkspace
from ..memory.layout import REJECT_WORDS, REJECTED, RING, STATE_BROKEN, STATE_OK
from ..snac import Buf, Copy, Reduce, Schedule, Signal, Span, WaitDrainAll, WaitSignal
from .base import (SPLITS_DISAGREE, CallContext, describe_info, first_split_pair, mismatch_message, rows_phrase,
                   split_pair_message)

_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def split_mismatch(ctx: "CallContext", p: int, c: int, sent: int, expected: int) -> str:
    """The message for producer ``p`` sending ``sent`` bytes to consumer ``c``, which expects ``expected``:
    in rows, with the caller's argument names."""
    x = ctx.x
    row = x.element_size() * (int(torch.Size(x.shape[1:]).numel()) if x.dim() else 1)

    def rows(n: int) -> str:
        return rows_phrase(n // row) if row and n % row == 0 else f"{n} bytes"
    return f"{split_pair_message(ctx.op, p, c, rows(sent), rows(expected))} in call #{ctx.seq}; {SPLITS_DISAGREE}"


def _pause(polls: int) -> None:
    """Between two polls of a peer's word: a yield for the first 64, then a sleep growing to 1 ms."""
    time.sleep(0 if polls < 64 else min(1e-3, 1e-6 * polls))


class CpuEngine:
    """The CPU reference engine (implements :class:`~.base.Engine`): calls block the host until done."""

    name = "cpu"
    packets = False  # runs one-shot where the CUDA engine runs packets: the same bits

    def __init__(self, ws: HostWorkspace, rank: int, world: int, timeout_s: float, *,
                 ranks_on_gpu: int | None = None, call_check: bool = True):
        self.ws, self.rank, self.world = ws, rank, world
        self.timeout_s = timeouts(timeout_s).call_s  # the bound of every wait for a peer
        lay = ws.layout
        self.layout = lay
        # Local mirrors of the counters this rank writes or expects.
        self.sent = np.zeros((world, lay.max_items), dtype=np.int64)  # notifies I sent to c
        self.expect = np.zeros((world, lay.max_items), dtype=np.int64)  # notifies I consumed from p
        self.broken: str | None = None
        self._rejects: dict[int, str] = {}  # peers that rejected their arguments of the current call

    # -- state -------------------------------------------------------------------------------
    @property
    def table_bytes(self) -> int:
        return 0  # no device op tables

    def recorded_error(self) -> None:
        return None  # calls block and raise as they run

    def check(self) -> None:
        """Nothing is recorded for later: a CPU call raises its own errors."""

    def synchronize(self) -> None:
        """A no-op: every CPU call has finished when it returns."""

    def mark_broken(self, reason: str) -> None:
        self.broken = self.broken or reason
        if self.ws.words is not None:
            self.ws.words[self.layout.state_base + self.rank] = STATE_BROKEN

    def _publish(self, ctx: CallContext, sched: Schedule) -> None:
        w, lay = self.ws.words, self.layout
        off = lay.desc_offset(self.rank, ctx.seq % RING)
        w[off + 1] = ctx.fingerprint
        w[off + 2] = ctx.info
        w[off + 3: off + 3 + self.world] = sched.send_bytes
        w[off + 3 + self.world: off + 3 + 2 * self.world] = sched.recv_bytes
        w[off] = ctx.seq  # last: publishes the entry

    def _peer_seq(self, peer: int) -> int:
        w, lay = self.ws.words, self.layout
        return max(int(w[lay.desc_offset(peer, s)]) for s in range(RING))

    def _check_peer(self, ctx: CallContext, sched: Schedule, peer: int) -> bool:
        """True once ``peer`` is seen in this call with a matching descriptor; raises on a mismatch."""
        w, lay = self.ws.words, self.layout
        off = lay.desc_offset(peer, ctx.seq % RING)
        if int(w[off]) != ctx.seq:
            return False
        fp, info = int(w[off + 1]), int(w[off + 2])
        if int(w[off]) != ctx.seq:  # overwritten while reading: the peer is already past this call
            return True
        if fp == REJECTED:  # the peer rejected its arguments: its reject words say why (written before)
            r = lay.reject_offset(peer, ctx.seq % RING)
            text = words_text(w[r + 2: r + REJECT_WORDS]) if int(w[r]) == ctx.seq else ""
            if text and int(w[r + 1]) > 8 * (REJECT_WORDS - 2):
                text += " [...]"  # cut to the reject words
            self._rejects[peer] = text or "(its message was not readable)"
            return True
        if fp != ctx.fingerprint:
            self._fail(PurlinMismatchError(
                mismatch_message(ctx.op, self.rank, peer, ctx.seq, describe_info(ctx.info), describe_info(info)),
                op=ctx.op, rank=self.rank, peer=peer))
        return True

    def reject(self, seq: int, op: str, message: str) -> None:
        """This rank rejected its own arguments of call ``seq`` (``message``: its error): publish why, then
        the call's descriptor marked REJECTED, and wait (bounded by the timeout) until every peer has
        entered the call, so none can miss it. The caller raises its own error; no counter moves."""
        w, lay, me = self.ws.words, self.layout, self.rank
        if w is None:
            return
        r = lay.reject_offset(me, seq % RING)
        text = text_words(message, REJECT_WORDS - 2)
        w[r] = seq
        w[r + 1] = len(message.encode("utf-8"))
        w[r + 2: r + REJECT_WORDS] = text
        off = lay.desc_offset(me, seq % RING)
        w[off + 1] = REJECTED
        w[off + 2] = 0
        w[off + 3: off + 3 + self.world] = 0
        w[off] = seq
        deadline = time.monotonic() + self.timeout_s
        polls = 0
        for p in range(self.world):
            while p != me and self._peer_seq(p) < seq and int(w[lay.state_base + p]) == STATE_OK:
                if time.monotonic() > deadline:
                    return  # a peer that never comes times out on its own
                polls += 1
                _pause(polls)

    def _meet(self, ctx: CallContext, sched: Schedule, verified: set) -> None:
        """Every peer's descriptor of this call read (and checked) before any data moves; raise a
        PurlinRejectedError if a peer rejected its arguments (the communicator stays usable)."""
        self._rejects.clear()
        for p in range(self.world):
            if p != self.rank:
                self._wait(ctx, sched, p, lambda p=p: p in verified, "its entry into this call", verified)
        if self._rejects:
            causes, self._rejects = dict(self._rejects), {}
            raise rejected_error(ctx.op, causes, ctx.seq)
        self._check_pairs(ctx)

    def _check_pairs(self, ctx: CallContext) -> None:
        """Every pair of ranks of this call, from the descriptors (all of this call, all read): the bytes
        rank p sends to rank q must be those q expects from p. On a disagreement every rank raises the same
        PurlinMismatchError (the first pair in rank order) before any data moves, so the communicator stays
        usable and the next call is the next call everywhere."""
        w, lay, n = self.ws.words, self.layout, self.world
        starts = np.array([lay.desc_offset(p, ctx.seq % RING) + 3 for p in range(n)])
        counts = w[starts[:, None] + np.arange(2 * n)].tolist()  # row p: [sends to 0..n-1, expects from 0..n-1]
        sends, expects = [row[:n] for row in counts], [row[n:] for row in counts]
        pair = first_split_pair(sends, expects)
        if pair is not None:
            p, q = pair
            raise PurlinMismatchError(split_mismatch(ctx, p, q, sends[p][q], expects[q][p]),
                                      op=ctx.op, rank=self.rank, peer=q if self.rank == p else p)

    def _fail(self, err: PurlinError) -> None:
        self.mark_broken(str(err))
        raise err

    def _wait(self, ctx: CallContext, sched: Schedule, peer: int, ready, what: str, verified: set,
              in_call: bool = True) -> None:
        """Wait until ``ready()``. ``in_call``: the awaited signal is one ``peer`` gives in THIS call, so
        once it is seen the peer's descriptor of this call is published (it is written first) and is
        checked before the caller reads anything (a check made only before the signal arrived could
        miss a descriptor published in between, and a mismatched call would read garbage)."""
        if peer not in verified and self._check_peer(ctx, sched, peer):
            verified.add(peer)
        if ready():
            if in_call and peer not in verified:
                self._check_peer(ctx, sched, peer)  # False only if already overwritten: peer is far ahead
                verified.add(peer)
            return
        w, lay = self.ws.words, self.layout
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        polls = 0
        while True:
            if ready():
                if in_call and peer not in verified:
                    self._check_peer(ctx, sched, peer)
                    verified.add(peer)
                return
            if peer not in verified and self._check_peer(ctx, sched, peer):
                verified.add(peer)
            if int(w[lay.state_base + peer]) != STATE_OK:
                self._fail(PurlinBrokenError(
                    f"{ctx.op}: rank {self.rank} stopped waiting for rank {peer} ({what}, call #{ctx.seq}): "
                    f"rank {peer} failed; create a new Communicator on every rank"))
            now = time.monotonic()
            if now > deadline:
                behind = [p for p in range(self.world) if p != self.rank and self._peer_seq(p) < ctx.seq]
                missing = behind or [peer]
                detail = ", ".join(f"rank {p} last entered call #{self._peer_seq(p)}" for p in missing)
                self._fail(PurlinTimeoutError(
                    f"{ctx.op}: rank {self.rank} waited {self.timeout_s:g}s in call #{ctx.seq} for "
                    f"rank(s) {missing} ({what}); {detail}. A rank skipped this call or is stuck; "
                    "the communicator is now broken",
                    op=ctx.op, rank=self.rank, missing=missing))
            polls += 1
            _pause(polls)

    # -- execution ---------------------------------------------------------------------------
    def _view(self, span: Span, ctx: CallContext) -> torch.Tensor:
        if span.buf is Buf.INPUT:
            base = ctx.inp
        elif span.buf is Buf.OUTPUT:
            base = ctx.out
        else:
            base = self.ws.staging[span.rank]
        return base[span.offset: span.offset + span.nbytes]

    def execute(self, sched: Schedule, ctx: CallContext) -> None:
        """Run one rank's schedule. Collective: blocks until this rank's part is done."""
        if self.broken:
            raise PurlinBrokenError(f"{ctx.op}: the communicator is broken ({self.broken})")
        try:
            self._run(sched, ctx)
        except PurlinError:
            raise
        except BaseException as e:  # never leave peers waiting on a half-run call
            self.mark_broken(f"{type(e).__name__}: {e}")
            raise

    def _run(self, sched: Schedule, ctx: CallContext) -> None:
        w, lay, me = self.ws.words, self.layout, self.rank
        self._publish(ctx, sched)
        verified: set[int] = set()
        self._meet(ctx, sched, verified)
        for op in sched.ops:
            if isinstance(op, Copy):
                dst, src = self._view(op.dst, ctx), self._view(op.src, ctx)
                if dst.numel() and dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            elif isinstance(op, Reduce):
                self._reduce(op, ctx)
            elif isinstance(op, Signal):
                if op.kind == "notify":
                    self.sent[op.peer, op.item] += 1
                    w[lay.notify_index(me, op.peer, op.item)] = self.sent[op.peer, op.item]
                else:
                    w[lay.ack_index(op.peer, me, op.item)] += 1  # only I write this word
            elif isinstance(op, WaitSignal):
                if op.kind == "notify":
                    self.expect[op.peer, op.item] += 1
                    idx, target = lay.notify_index(op.peer, me, op.item), self.expect[op.peer, op.item]
                    what = f"chunk {target} of its staging item {op.item}"
                else:
                    idx = lay.ack_index(me, op.peer, op.item)
                    target = self.sent[op.peer, op.item] - op.lag
                    what = f"drain of my staging item {op.item}"
                self._wait(ctx, sched, op.peer, lambda: w[idx] >= target, what, verified)
            elif isinstance(op, WaitDrainAll):
                for c in op.peers:
                    for i in range(op.items):
                        idx, target = lay.ack_index(me, c, i), self.sent[c, i]
                        self._wait(ctx, sched, c, lambda: w[idx] >= target,
                                   "drain of the previous call's staging", verified, in_call=False)

    def _reduce(self, op: Reduce, ctx: CallContext) -> None:
        if op.dst.nbytes == 0:
            return
        dtype = ctx.dtype
        acc_dtype = _ACC.get(dtype, dtype)
        views = [self._view(s, ctx).view(dtype) for s in op.srcs]
        acc = views[0].to(acc_dtype, copy=True)
        for v in views[1:]:
            v = v.to(acc_dtype)
            if op.op is ReduceOp.SUM:
                acc.add_(v)
            elif op.op is ReduceOp.MAX:
                torch.maximum(acc, v, out=acc)
            else:
                torch.minimum(acc, v, out=acc)
        self._view(op.dst, ctx).view(dtype).copy_(acc)

    def close(self) -> None:
        self.ws = None
