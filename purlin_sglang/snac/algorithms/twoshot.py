"""``twoshot``: a reduce-scatter of the parts, then an all-gather of the reduced parts (partitioned).

For reductions of a packed payload into a packed output on every rank (all_reduce): the output is
cut into ``world`` parts aligned to ALIGN; rank ``q`` reduces part ``q`` from everyone into a staging
item (its shard), then every rank copies every shard. Each rank reads ``2(n-1)/n`` of the payload
instead of ``n-1`` payloads: under ``auto`` above ``tuning.oneshot_max_bytes``, and when the size is
resolved later (bounded traffic). Chunked like every staged plan (snac/lower.py lower_staged).
"""

from __future__ import annotations

from ...abi import KERNEL_STAGED
from ...collectives import COPY
from ..lower import lower_staged
from ..plan import Ack, Buf, ConsumeStep, Drain, DrainAll, Item, Notify, Plan, RankProgram, Ref, Stage, Step, Wait
from ..planner import chunk_bytes, reduces_to_all
from ..policy import ALIGN, max_items
from ..registry import Algorithm, Request, Selection

NAME = "twoshot"


def program(spec, world: int, me: int) -> tuple[list[Item], list[Step]]:
    """Reduce part ``me`` of everyone's input into my shard item, then copy every shard out."""
    n = world
    shard = n  # item index of my reduced part
    others = tuple(q for q in range(n) if q != me)

    def in_part(q: int) -> Ref:
        return Ref(Buf.INPUT, me, None, (q, n))

    def out_part(q: int) -> Ref:
        return Ref(Buf.OUTPUT, me, None, (q, n))

    items = [Item(q, in_part(q), (q,)) for q in others]
    items.append(Item(shard, in_part(me), others))
    body: list[Step] = []
    for q in others:  # reduce-scatter of the parts
        body += [Drain(q), Stage(in_part(q), q), Notify(q, (q,))]
    body += [Wait(p, me, in_part(me)) for p in others]
    body.append(Drain(shard))
    srcs = tuple(in_part(me) if p == me else Ref(Buf.STAGE, p, me) for p in range(n))
    body.append(ConsumeStep(spec.consume, Ref(Buf.STAGE, me, shard), srcs))
    body += [Ack(p, me, in_part(me)) for p in others]
    if others:  # all-gather of the reduced parts
        body.append(Notify(shard, others))
    body += [Wait(q, shard, out_part(q)) for q in others]
    for q in range(n):
        body.append(ConsumeStep(COPY, out_part(q), (Ref(Buf.STAGE, q, shard),)))
    body += [Ack(q, shard, out_part(q)) for q in others]
    return items, body


def plan(req: Request) -> Plan:
    spec, world, rank = req.spec, req.world, req.rank
    items, body = program(spec, world, rank)
    n_items = max_items(world)
    chunk = chunk_bytes(spec, req.staging_bytes, n_items, req.policy)
    notes = (f"output cut into {world} parts aligned to {ALIGN} bytes; part q is reduced by rank q",)
    return Plan(spec, world, rank, req.root, req.algorithm.name, chunk, req.policy.slots, n_items,
                RankProgram(rank, tuple(items), (DrainAll(),), tuple(body)), notes)


def takes(sel: Selection) -> bool:
    """Under ``auto``: above ``tuning.oneshot_max_bytes``, or when the size is resolved later."""
    return sel.nbytes is None or sel.nbytes > sel.policy.oneshot_max_bytes


ALGORITHM = Algorithm(
    name=NAME, has_form=reduces_to_all,
    form="two-shot form (only reductions of a packed payload into a packed output on every rank)",
    plan=plan, lower=lower_staged, kernel=KERNEL_STAGED, priority=10, auto=takes, forced_by=(NAME,), tunable=True,
)
