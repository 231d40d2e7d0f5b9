"""``packet``: flag-in-data packets pushed into each consumer's receive window (the latency regime).

For every collective with a packet form (planner.has_packet_form), on engines with the packet
protocol: each producer pushes what the naming sends each consumer into that consumer's receive
window as packets that carry their own flag (snac/packet.cuh); consumers copy or reduce straight
from their windows; a pair of ranks the naming leaves silent (rooted forms) exchanges one empty
packet. No staging, no signals, no acks: one step, twice the bytes, at most one receive window
(``PACKET_WINDOW_BYTES``) per pair and call. Under ``auto`` while the largest push is at most
``tuning.packet_max_bytes``; its tables run in the packet kernel.
"""

from __future__ import annotations

from ...abi import KERNEL_PACKET
from ...errors import PurlinPlanError
from ..lower import Op, PacketCopy, PacketPut, PacketReduce, Resolver, Schedule, Sizes, Span, size_mismatch
from ..plan import Beat, Buf, ConsumeStep, Hear, Plan, Push, RankProgram, Ref, Step
from ..planner import consume_steps, consumers, has_packet_form, producers, sent
from ..policy import PACKET_WINDOW_BYTES
from ..registry import Algorithm, Request, Selection

NAME = "packet"


def program(spec, world: int, me: int, root: int | None) -> list[Step]:
    """Push what I send each consumer into its window (rotated: start at me + 1), then consume the
    packets each producer pushed to me: one copy per producer, or one reduce in rank order. A pair
    of ranks between which the naming moves nothing (rooted forms) exchanges one empty packet
    (:class:`Beat`, then :class:`Hear` after my consumes): the window-reuse rule of has_packet_form."""
    prods, cons = producers(spec, world, root), consumers(spec, world, root)

    def moves(p: int, c: int) -> bool:  # the naming moves a region from p to c
        return p in prods and c in cons

    others = [(me + d) % world for d in range(1, world)]
    body: list[Step] = [Push(sent(spec, me, c), c) if moves(me, c) else Beat(c) for c in others]
    if me in cons:
        body += consume_steps(spec, me, prods, lambda p: Ref(Buf.WINDOW, p))
    body += [Hear(p) for p in others if not moves(p, me)]
    peers = [s.peer for s in body if isinstance(s, Push)]
    windows = [x.rank for s in body if isinstance(s, ConsumeStep) for x in s.srcs if x.buf is Buf.WINDOW]
    if len(set(peers)) < len(peers) or len(set(windows)) < len(windows):  # the window is per producer
        raise PurlinPlanError(f"{spec.name}: the packet protocol carries one region from each producer to each "
                              "consumer per call; use tuning.algorithm='oneshot'")
    return body


def plan(req: Request) -> Plan:
    spec, world, rank, root = req.spec, req.world, req.rank, req.root
    body = program(spec, world, rank, root)
    notes = (f"flag-in-data packets pushed into each consumer's window; at most {PACKET_WINDOW_BYTES} "
             "payload bytes per call",)
    return Plan(spec, world, rank, root, req.algorithm.name, PACKET_WINDOW_BYTES, 1, 0,
                RankProgram(rank, (), (), tuple(body)), notes)


def window_region(plan: Plan, r: Resolver, ref: Ref) -> tuple[int, int]:
    """(offset, length) of ``ref``, refused if it does not fit one packet receive window."""
    off, n = r.region(ref)
    if n > PACKET_WINDOW_BYTES:
        raise PurlinPlanError(
            f"{plan.spec.name}: the packet protocol carries at most {PACKET_WINDOW_BYTES} bytes per call "
            f"from one rank to another, rank {plan.rank} has {n}; use tuning.algorithm='auto' or a smaller "
            "tuning.packet_max_bytes")
    return off, n


def lower(plan: Plan, r: Resolver, sizes: Sizes, *, always: bool = False) -> Schedule:
    """The packet plan: one round, no chunks (each push fits one receive window). A window holds
    what its producer pushed me, as long as the region it lands in (the naming's sizes agree).

    Empty pushes and consumes stay (a V form's empty slice), and so do a rooted form's beats: each
    still moves one packet, because the window-reuse rule needs a push between every ordered pair in
    every packet call. A call of an unrooted form that moves no byte on this rank has no op at all;
    for every unrooted collective with a packet form that holds on every rank alike
    (planner.largest_push), so no rank's epoch moves. A rooted form always runs its pushes and beats:
    a rank sees only its own side of the naming (the other side of a rooted layout may hold anything),
    so "nothing moves" is not something every rank can tell alike. ``always``: neither does a hybrid
    plan's packet part (each rank knows only its own splits)."""
    me, world = plan.rank, plan.world
    send, recv = [0] * world, [0] * world
    ops: list[Op] = []
    if not always and not plan.spec.rooted and not any(sizes.input) and not any(sizes.output):
        return Schedule(plan, sizes, (), tuple(send), tuple(recv), 0)
    for s in plan.program.body:
        if isinstance(s, Push):
            off, n = window_region(plan, r, s.src)
            ops.append(PacketPut(s.peer, Span(Buf.INPUT, me, off, n)))
            send[s.peer] += n
        elif isinstance(s, Beat):  # one empty packet: no byte of any buffer is read
            ops.append(PacketPut(s.peer, Span(Buf.INPUT, me, 0, 0)))
        elif isinstance(s, Hear):  # waits for that packet; no byte of any buffer is written
            ops.append(PacketCopy(Span(Buf.OUTPUT, me, 0, 0), Span(Buf.WINDOW, s.peer, 0, 0)))
        elif isinstance(s, ConsumeStep):
            off, n = window_region(plan, r, s.dst)
            srcs = []
            for x in s.srcs:
                if x.buf is Buf.WINDOW:
                    srcs.append(Span(Buf.WINDOW, x.rank, 0, n))
                    recv[x.rank] += n
                    continue
                xo, xn = r.region(x)
                if xn != n:
                    raise size_mismatch(plan, x, xn, s.dst, n)
                srcs.append(Span(x.buf, me, xo, xn))
            dst = Span(Buf.OUTPUT, me, off, n)
            if s.consume.is_copy:
                ops.append(PacketCopy(dst, srcs[0]))
            else:
                ops.append(PacketReduce(s.consume.reduce, dst, tuple(srcs)))
        else:  # pragma: no cover - the planner emits nothing else for packets
            raise PurlinPlanError(f"{plan.spec.name}: internal: step {s} in a packet plan")
    return Schedule(plan, sizes, tuple(ops), tuple(send), tuple(recv), 0)


def fits(sel: Selection) -> bool:
    """The largest push is known and fits one receive window."""
    return sel.push is not None and sel.push <= PACKET_WINDOW_BYTES


def takes(sel: Selection) -> bool:
    """Under ``auto``: the largest push fits the window and ``tuning.packet_max_bytes``."""
    return fits(sel) and sel.push <= sel.policy.packet_max_bytes


ALGORITHM = Algorithm(
    name=NAME, has_form=has_packet_form,
    form="packet form (V forms sliced on both sides, and rooted V forms, stay staged)",
    plan=plan, lower=lower, kernel=KERNEL_PACKET, packets=True, priority=30, auto=takes, forced_by=(NAME,),
    fits=fits, tunable=True, agreed_sizes=True,
)
