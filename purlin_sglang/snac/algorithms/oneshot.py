"""``oneshot``: every consumer reads each producer's contribution straight from the producer's staging.

The latency regime of reductions into a packed output on every rank (up to
``tuning.oneshot_max_bytes``), and every other collective on an engine without the packet protocol:
one step. Each producer stages what it sends (one item per consumer of a sliced input, one item for
a packed one), notifies its readers; each consumer waits, copies or reduces (in rank order) from the
producers' staging into its output, and acknowledges. Chunked like every staged plan
(snac/lower.py lower_staged). The selector's fallback: every collective has this form.
"""

from __future__ import annotations

from ...abi import KERNEL_STAGED
from ..lower import lower_staged
from ..plan import Ack, Buf, Drain, DrainAll, Item, Notify, Plan, RankProgram, Ref, Stage, Step, Wait
from ..planner import chunk_bytes, consume_steps, consumers, landing, producers, sent
from ..registry import Algorithm, Request, Selection

NAME = "oneshot"


def has_form(spec) -> bool:
    return True


def program(spec, world: int, me: int, root: int | None) -> tuple[list[Item], list[Step]]:
    """(my staging items, my per-chunk steps)."""
    prods = producers(spec, world, root)
    cons = consumers(spec, world, root)
    items: list[Item] = []
    body: list[Step] = []
    # Stage: what I send, one item per distinct region.
    if me in prods:
        if spec.input.sliced:
            for c in cons:
                if c != me:
                    items.append(Item(c, sent(spec, me, c), (c,)))
        else:
            readers = tuple(c for c in cons if c != me)
            if readers:
                items.append(Item(0, Ref(Buf.INPUT, me, None), readers))
    for it in items:
        body.append(Drain(it.index))
        body.append(Stage(it.like, it.index))
        body.append(Notify(it.index, it.readers))
    # Consume: where each producer's contribution lands in my output.
    if me in cons:
        item_for_me = me if spec.input.sliced else 0
        remote = [p for p in prods if p != me]
        for p in remote:
            body.append(Wait(p, item_for_me, landing(spec, me, p)))
        body += consume_steps(spec, me, prods, lambda p: Ref(Buf.STAGE, p, item_for_me))
        for p in remote:
            body.append(Ack(p, item_for_me, landing(spec, me, p)))
    return items, body


def plan(req: Request) -> Plan:
    spec, world, rank = req.spec, req.world, req.rank
    items, body = program(spec, world, rank, req.root)
    n_items = world if spec.input.sliced else 1
    chunk = chunk_bytes(spec, req.staging_bytes, n_items, req.policy)
    prologue: tuple[Step, ...] = (DrainAll(),) if items else ()
    return Plan(spec, world, rank, req.root, req.algorithm.name, chunk, req.policy.slots, n_items,
                RankProgram(rank, tuple(items), prologue, tuple(body)), ())


def takes(sel: Selection) -> bool:
    return True


ALGORITHM = Algorithm(
    name=NAME, has_form=has_form, form="one-shot form", plan=plan, lower=lower_staged, kernel=KERNEL_STAGED,
    priority=0, fallback=True, auto=takes, forced_by=(NAME,), tunable=True,
)
