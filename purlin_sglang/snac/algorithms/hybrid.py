"""``hybrid``: per ordered pair, packets or a one-shot of the larger pairs (V forms sliced on both sides).

For namings like all_to_all_v (planner.has_hybrid_form), on engines with the packet protocol: a
region of at most ``pair_max_bytes`` travels as packets (the packet program, algorithms/packet.py),
a larger one through a one-shot of those pairs only (algorithms/oneshot.py); both ends of a pair
know its size, so they agree with no size exchange. Its schedules run in parts: the packet part in
the packet kernel, then the staged part (where this rank has one) in the interpreter. Taken under
``auto`` and when ``tuning.algorithm`` forces packets.
"""

from __future__ import annotations

from dataclasses import replace

from ..lower import Resolver, Schedule, Sizes, lower as lower_plan
from ..plan import Ack, Beat, ConsumeStep, Drain, DrainAll, Hear, Notify, Plan, Push, RankProgram, Stage, Wait
from ..planner import has_hybrid_form, make_plan
from ..policy import PACKET_WINDOW_BYTES
from ..registry import Algorithm, Request, Selection
from . import oneshot, packet

NAME = "hybrid"
FORCED_BY = (packet.NAME,)  # tuning.algorithm values that ask for it (it is how these namings take packets)


def pair_max_bytes(policy) -> int:
    """The largest region one pair moves as packets in a ``hybrid`` call: ``tuning.packet_max_bytes``
    (a push of a fixed form takes packets up to the same size), a whole receive window when
    ``tuning.algorithm`` forces packets. The same on every rank of a group (one config)."""
    return PACKET_WINDOW_BYTES if policy.algorithm in FORCED_BY else policy.packet_max_bytes


def plan(req: Request) -> Plan:
    spec, world, rank, root = req.spec, req.world, req.rank, req.root
    staged = make_plan(spec, world, rank, root=root, staging_bytes=req.staging_bytes, policy=req.policy,
                       algorithm=oneshot.NAME)
    pair_max = pair_max_bytes(req.policy)
    program = RankProgram(rank, (), (), tuple(packet.program(spec, world, rank, root)))
    notes = (f"per pair: at most {pair_max} bytes as flag-in-data packets, more through the one-shot below "
             "(that pair then exchanges one empty packet)",)
    return Plan(spec, world, rank, root, req.algorithm.name, staged.chunk_bytes, staged.slots, staged.n_items,
                program, notes, pair_max_bytes=pair_max, staged=staged)


def lower(plan: Plan, r: Resolver, sizes: Sizes) -> Schedule:
    """Each pair by the size of its region, which both of its ends know (my input slice c is what I
    send c, my output slice p what p sends me). A region of at most ``plan.pair_max_bytes`` travels in
    the packet part; a larger one through the staged part, a one-shot of those pairs only, and its pair
    exchanges one empty packet in the packet part instead (Beat / Hear) so that every packet call still
    pushes between every ordered pair. The packet part runs on every rank in every call, even one that
    moves no byte (``always``); the staged part only where this rank has a pair that goes staged. My
    own slice is copied in the packet part, or in the staged part when it is larger than
    ``pair_max_bytes`` (the staged copy atom; no peer waits for it)."""
    me, limit = plan.rank, plan.pair_max_bytes
    big_send = {c for c, n in enumerate(sizes.input) if c != me and n > limit}
    big_recv = {p for p, n in enumerate(sizes.output) if p != me and n > limit}
    big_own = sizes.output[me] > limit  # == sizes.input[me]: the call path checks it (calls.py _sizes)
    body = []
    for s in plan.program.body:
        if isinstance(s, Push) and s.peer in big_send:
            body.append(Beat(s.peer))
        elif isinstance(s, ConsumeStep) and s.dst.index in big_recv:
            body.append(Hear(s.dst.index))
        elif not (isinstance(s, ConsumeStep) and s.dst.index == me and big_own):
            body.append(s)
    packet_plan = replace(plan, algorithm=packet.NAME, program=replace(plan.program, body=tuple(body)),
                          pair_max_bytes=0, staged=None)
    parts = [packet.lower(packet_plan, r, sizes, always=True)]
    st = plan.staged
    items = tuple(it for it in st.program.items if set(it.readers) <= big_send)
    kept = {it.index for it in items}

    def staged_pair(s) -> bool:
        if isinstance(s, (Drain, Stage, Notify)):
            return s.item in kept
        if isinstance(s, (Wait, Ack)):
            return s.peer in big_recv
        return s.dst.index in big_recv or (s.dst.index == me and big_own)  # a consume: that producer's slice

    steps = tuple(s for s in st.program.body if staged_pair(s))
    if steps:
        program = RankProgram(me, items, (DrainAll(),) if items else (), steps)
        parts.append(lower_plan(replace(st, program=program), sizes))
    send = tuple(map(sum, zip(*(p.send_bytes for p in parts))))
    recv = tuple(map(sum, zip(*(p.recv_bytes for p in parts))))
    ops = tuple(op for p in parts for op in p.ops)
    return Schedule(plan, sizes, ops, send, recv, parts[-1].staging_used, tuple(parts))


def takes(sel: Selection) -> bool:
    """Under ``auto``: always (each pair chooses packets or the one-shot by its own size)."""
    return True


ALGORITHM = Algorithm(
    name=NAME, has_form=has_hybrid_form, form="hybrid form (only V forms sliced on both sides, with no root)",
    plan=plan, lower=lower, kernel=None, packets=True, priority=20, auto=takes, forced_by=FORCED_BY, tunable=True,
)
