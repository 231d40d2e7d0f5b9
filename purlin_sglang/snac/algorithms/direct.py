"""``direct``: the one-shot reading every rank's input in place, in the symmetric heap.

For every collective with a packet form (every rank knows every size), when every rank's input lies
in the symmetric heap at the same offset (memory/heap.py): each producer tells its consumers that its
input is ready, each consumer copies or reduces the producers' inputs in place, acknowledges, and the
producer waits for the acknowledgements before its call ends (the caller may then overwrite the
input). No staging: one read of each input per consumer. The call path takes it where the staged
one-shot would run (``heap_form_of``); the selector never does.
"""

from __future__ import annotations

from ...abi import KERNEL_STAGED
from ...errors import PurlinPlanError
from ..lower import Copy, Op, Reduce, Resolver, Schedule, Signal, Sizes, Span, WaitSignal, size_mismatch
from ..plan import Ack, Buf, ConsumeStep, Drain, Notify, Plan, RankProgram, Ref, Step, Wait
from ..planner import consume_steps, consumers, has_packet_form, landing, producers, sent
from ..registry import Algorithm, Request
from . import oneshot

NAME = "direct"


def heap_notes(req: Request) -> tuple[str, ...]:
    """The notes of a plan that reads every rank's input in the heap; refuses a request without ``input_at``."""
    if req.input_at < 0:
        raise PurlinPlanError(f"{req.spec.name}: a direct plan needs input_at, where every rank's input lies in "
                              "its symmetric heap")
    return (f"every rank's input at byte {req.input_at} of its staging region (the symmetric heap), read in place",)


def program(spec, world: int, me: int, root: int | None) -> list[Step]:
    """Tell my readers my input is ready (item 0: no staging is used), wait for my producers', copy or
    reduce their inputs in place (what ``p`` sends me: its input slice ``me``, or its whole input),
    acknowledge, then wait until every reader has acknowledged mine (``Drain``)."""
    prods, cons = producers(spec, world, root), consumers(spec, world, root)
    readers = tuple(c for c in cons if c != me) if me in prods else ()
    body: list[Step] = [Notify(0, readers)] if readers else []
    if me in cons:
        remote = [p for p in prods if p != me]
        body += [Wait(p, 0, landing(spec, me, p)) for p in remote]
        body += consume_steps(spec, me, prods, lambda p: sent(spec, p, me))
        body += [Ack(p, 0, landing(spec, me, p)) for p in remote]
    if readers:
        body.append(Drain(0))
    return body


def plan(req: Request) -> Plan:
    spec, world, rank, root = req.spec, req.world, req.rank, req.root
    notes = heap_notes(req)
    return Plan(spec, world, rank, root, req.algorithm.name, 0, 1, 1,
                RankProgram(rank, (), (), tuple(program(spec, world, rank, root))), notes, input_at=req.input_at)


def lower(plan: Plan, r: Resolver, sizes: Sizes) -> Schedule:
    """One round, no chunks, no staging. A peer's input region is read in place at ``plan.input_at`` of
    the peer's staging region (a STAGE span: the symmetric heap is its tail), at the offset this rank
    computes from its own sizes (direct plans exist only where every rank knows every size: a fixed
    form's slices are equal, a V form's ``sizes`` are every rank's), as long as the region it lands in.
    The Drain becomes one ack wait per reader (nothing I notified still unread)."""
    me, world, spec = plan.rank, plan.world, plan.spec
    send, recv = [0] * world, [0] * world
    ops: list[Op] = []
    readers: tuple[int, ...] = ()

    def source(x: Ref, n: int, dst: Ref) -> Span:
        if x.rank == me:
            xo, xn = r.region(x)
            if xn != n:
                raise size_mismatch(plan, x, xn, dst, n)
            return Span(x.buf, me, xo, xn)
        if x.index is None:
            off = 0
        else:
            off = sum(sizes.input[: x.index]) if spec.variable else x.index * n
        recv[x.rank] += n
        return Span(Buf.STAGE, x.rank, plan.input_at + off, n)

    for s in plan.program.body:
        if isinstance(s, Notify):
            readers = s.peers
            ops += [Signal("notify", c, s.item) for c in s.peers]
            for c in s.peers:
                send[c] += r.length(Ref(Buf.INPUT, me, c if spec.input.sliced else None))
        elif isinstance(s, Wait):
            ops.append(WaitSignal("notify", s.peer, s.item))
        elif isinstance(s, ConsumeStep):
            off, n = r.region(s.dst)
            srcs = tuple(source(x, n, s.dst) for x in s.srcs)
            dst = Span(Buf.OUTPUT, me, off, n)
            ops.append(Copy(dst, srcs[0]) if s.consume.is_copy else Reduce(s.consume.reduce, dst, srcs))
        elif isinstance(s, Ack):
            ops.append(Signal("ack", s.peer, s.item))
        elif isinstance(s, Drain):
            ops += [WaitSignal("ack", c, s.item, 0) for c in readers]
        else:  # pragma: no cover - the planner emits nothing else for direct plans
            raise PurlinPlanError(f"{spec.name}: internal: step {s} in a direct plan")
    return Schedule(plan, sizes, tuple(ops), tuple(send), tuple(recv), 0)


ALGORITHM = Algorithm(
    name=NAME, has_form=has_packet_form,
    form="direct form (only collectives whose sizes every rank knows, as for packets)",
    plan=plan, lower=lower, kernel=KERNEL_STAGED, heap_form_of=oneshot.NAME, agreed_sizes=True,
)
