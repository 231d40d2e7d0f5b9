"""Bytes a lowered schedule moves through memory: what a plan costs next to the bench's copy floor.

The floor (bench/floor.py) counts every rank's input read once and every rank's output written once.
A plan moves more: a staged plan copies into staging and reads it back, a two-shot plan reduces into a
shard and copies it out, packets are twice their payload. ``plan_bytes`` counts what one rank's
schedule reads plus writes, so ``floor bytes / plan bytes`` is the best fraction of the floor the plan
can reach at the copy bandwidth, and ``of_floor`` divided by it is how much of the copy bandwidth the
bytes actually moved got.
"""

from __future__ import annotations

import math

from ..snac import Buf, Copy, PacketCopy, PacketPut, PacketReduce, Reduce


def plan_bytes(sched) -> int:
    """Bytes one rank's schedule reads plus writes: a copy 2n, a reduction of k sources (k + 1) n; a
    packet put reads its n bytes once (consecutive puts of one source share the load) and writes 2n per
    consumer, a packet window read 2n, a direct read n, a write n."""
    total, put_srcs = 0, set()
    for op in sched.ops:
        if isinstance(op, Copy):
            if op.dst.nbytes and op.dst != op.src:
                total += 2 * op.dst.nbytes
        elif isinstance(op, Reduce):
            total += (len(op.srcs) + 1) * op.dst.nbytes
        elif isinstance(op, PacketPut):
            total += 2 * op.src.nbytes + (0 if op.src in put_srcs else op.src.nbytes)
            put_srcs.add(op.src)
        elif isinstance(op, (PacketCopy, PacketReduce)):
            srcs = (op.src,) if isinstance(op, PacketCopy) else op.srcs
            if isinstance(op, PacketCopy) and op.src == op.dst:
                continue
            n = op.dst.nbytes
            total += n + sum(2 * n if x.buf is Buf.WINDOW else n for x in srcs)
    return total


def last_call(comm, out_numel: int):
    """(algorithm, plan bytes) of the call ``comm`` filed last in its call cache (a call of a new shape
    is filed last), or (None, None) when that call's output is not ``out_numel`` elements long."""
    calls = getattr(getattr(comm, "_path", None), "calls", None)
    if not calls:
        return None, None
    call = next(reversed(calls.values()))
    if math.prod(call.out_shape) != out_numel:
        return None, None
    return call.sched.plan.algorithm, plan_bytes(call.sched)
