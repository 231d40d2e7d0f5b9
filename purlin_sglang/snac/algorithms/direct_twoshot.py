"""``direct-twoshot``: the two-shot reading every rank's input in place, in the symmetric heap.

For reductions of a packed payload into a packed output on every rank (all_reduce), when every rank's
input lies in the symmetric heap at the same offset: after an inputs-ready exchange, rank ``q``
reduces part ``q`` of every input in place into its staged shard, every rank copies every shard. The
call path takes it where the staged two-shot would run (``heap_form_of``); the selector never does.
"""

from __future__ import annotations

from ...abi import KERNEL_STAGED
from ...collectives import COPY
from ..lower import (
    Copy, Op, Reduce, Resolver, Schedule, Signal, Sizes, Span, WaitDrainAll, WaitSignal, part_range, trips,
)
from ..plan import Ack, Buf, ConsumeStep, Drain, DrainAll, Item, Notify, Plan, RankProgram, Ref, Step, Wait
from ..planner import chunk_bytes, reduces_to_all
from ..policy import max_items
from ..registry import Algorithm, Request
from . import direct, twoshot

NAME = "direct-twoshot"


def program(spec, world: int, me: int) -> tuple[list[Item], list[Step]]:
    """The two-shot with every input read in place: after the inputs-ready exchange (item 0), reduce
    part ``me`` of every rank's input into my shard (staged, item ``world``: its chunks cycle through the
    slots), then copy every rank's shard into my output; acknowledge the inputs (no wait for my readers:
    they read my input before they notify their shards, all of which I copy). Lowered chunk by chunk as
    the two-shot is (:func:`lower`); the steps print the plan."""
    n, shard = world, world
    others = tuple(q for q in range(n) if q != me)

    def in_part(q: int, rank: int = me) -> Ref:
        return Ref(Buf.INPUT, rank, None, (q, n))

    def out_part(q: int) -> Ref:
        return Ref(Buf.OUTPUT, me, None, (q, n))

    items = [Item(shard, in_part(me), others)]
    body: list[Step] = [Notify(0, others)] if others else []
    body += [Wait(p, 0, in_part(me)) for p in others]
    body += [Drain(shard),
             ConsumeStep(spec.consume, Ref(Buf.STAGE, me, shard), tuple(in_part(me, p) for p in range(n)))]
    if others:
        body.append(Notify(shard, others))
    body += [Wait(q, shard, out_part(q)) for q in others]
    body += [ConsumeStep(COPY, out_part(q), (Ref(Buf.STAGE, q, shard),)) for q in range(n)]
    body += [Ack(q, shard, out_part(q)) for q in others] + [Ack(p, 0, in_part(me)) for p in others]
    return items, body


def plan(req: Request) -> Plan:
    spec, world, rank = req.spec, req.world, req.rank
    notes = direct.heap_notes(req)
    items, body = program(spec, world, rank)
    chunk = chunk_bytes(spec, req.staging_bytes, 1, req.policy)  # one staged item: my shard
    return Plan(spec, world, rank, req.root, req.algorithm.name, chunk, req.policy.slots, 1,
                RankProgram(rank, tuple(items), (DrainAll(),), tuple(body)),
                notes + (f"output cut into {world} parts; part q reduced by rank q into its staged shard",),
                input_at=req.input_at)


def lower(plan: Plan, r: Resolver, sizes: Sizes) -> Schedule:
    """Chunk by chunk as the staged two-shot: the inputs-ready exchange (item 0), then per chunk k:
    drain my shard slot (k >= slots), reduce chunk k of my part of every input (peers' read in place at
    ``plan.input_at``) into it, notify; then each rank's chunk k of its shard: wait, copy into my output,
    ack. Then the inputs' acks (so that a later drain-all finds every notify acknowledged). No wait for
    my readers' acks at the end: rank q reads my input only to reduce its chunks, each before it
    notifies that chunk, and I return only after copying every chunk of every shard, so q has read all
    it reads of my input. A previous call's shard slots are drained first (WaitDrainAll), as every
    staged plan does."""
    me, world, chunk, slots, at = plan.rank, plan.world, plan.chunk_bytes, plan.slots, plan.input_at
    shard, red = world, plan.spec.consume.reduce
    others = tuple(q for q in range(world) if q != me)
    total = sum(sizes.input)  # == sum(sizes.output): the Resolver checked it
    parts = [part_range(total, q, world) for q in range(world)]
    counts = [trips(hi - lo, chunk) for lo, hi in parts]
    send, recv = [0] * world, [0] * world
    high = 0
    ops: list[Op] = [WaitDrainAll(others, max_items(world))] if others else []
    ops += [Signal("notify", c, 0) for c in others]
    ops += [WaitSignal("notify", p, 0) for p in others]

    def piece(q: int, k: int) -> tuple[int, int, int]:
        """(offset in the payload, bytes, slot offset) of chunk k of part q."""
        lo, hi = parts[q]
        a = lo + k * chunk
        return a, max(0, min(hi, a + chunk) - a), (k % slots) * chunk

    for k in range(max(counts)):
        if k < counts[me]:
            a, n, slot = piece(me, k)
            if k >= slots:
                ops += [WaitSignal("ack", c, shard, slots - 1) for c in others]
            srcs = tuple(Span(Buf.INPUT, me, a, n) if p == me else Span(Buf.STAGE, p, at + a, n) for p in range(world))
            ops.append(Reduce(red, Span(Buf.STAGE, me, slot, n), srcs))
            high = max(high, slot + n)
            ops += [Signal("notify", c, shard) for c in others]
            for p in others:
                recv[p] += n
                send[p] += n
        for q in range(world):
            if k >= counts[q]:
                continue
            a, n, slot = piece(q, k)
            if q == me:
                ops.append(Copy(Span(Buf.OUTPUT, me, a, n), Span(Buf.STAGE, me, slot, n)))
                continue
            ops += [WaitSignal("notify", q, shard), Copy(Span(Buf.OUTPUT, me, a, n), Span(Buf.STAGE, q, slot, n)),
                    Signal("ack", q, shard)]
            recv[q] += n
    for c in others:  # c reads its part of my input in place
        send[c] += parts[c][1] - parts[c][0]
    ops += [Signal("ack", p, 0) for p in others]
    return Schedule(plan, sizes, tuple(ops), tuple(send), tuple(recv), high)


ALGORITHM = Algorithm(
    name=NAME, has_form=reduces_to_all,
    form="direct two-shot form (only reductions of a packed payload into a packed output on every rank)",
    plan=plan, lower=lower, kernel=KERNEL_STAGED, heap_form_of=twoshot.NAME, agreed_sizes=True,
)
