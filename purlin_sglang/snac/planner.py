"""The SNAC planner: one derivation of Stage / Notify / Consume from a naming.

Nothing here knows a collective by name. The planner reads the spec's input and
output layouts and consume op and answers, for one rank: which regions it stages
into which items, who reads each item, which peers' items it waits for and how it
copies or reduces them into its output. These shapes of program come out:

* ``oneshot`` (latency regime, and every copy collective): each consumer reads
  every producer's contribution directly, one step.
* ``packet`` (latency regime of every fixed-size collective, engines with the packet protocol):
  each producer pushes what the naming sends each consumer into that consumer's receive window as
  flag-in-data packets; consumers copy or reduce straight from their windows; a pair of ranks the
  naming leaves silent (rooted forms) exchanges one empty packet. No staging, no signals, no acks:
  one step, twice the bytes.
* ``hybrid`` (all_to_all_v and namings like it, engines with the packet protocol): per ordered
  pair, a region of at most ``pair_max_bytes`` travels as packets, a larger one through a
  one-shot of those pairs only; both ends of a pair know its size, so they agree (below).
* ``direct`` (every collective with a packet form, when every rank's input lies in the symmetric
  heap at the same offset: memory/heap.py): each producer tells its consumers that its input is
  ready, each consumer copies or reduces the producers' inputs in place, acknowledges, and the
  producer waits for the acknowledgements before its call ends (the caller may then overwrite the
  input). No staging: one read of each input per consumer. Chosen by the call path where the
  staged one-shot would run; ``direct-twoshot`` where the two-shot would (all_reduce): rank ``q``
  reduces part ``q`` of every input in place into its staged shard, every rank copies every shard.
* ``twoshot`` (partitioned; reductions into a packed output that every rank
  receives, e.g. all_reduce): the output is cut into ``world`` parts, rank ``q``
  reduces part ``q`` from everyone into a staging item, then every rank copies
  every reduced part. Each rank reads ``2(n-1)/n`` of the payload instead of
  ``n-1`` payloads.

Both are chunked: the body runs once per chunk of at most ``chunk_bytes``, and
staging items cycle through ``slots`` slots, so payloads larger than the staging
buffer work (the throughput regime is the same program with many chunks).
"""

from __future__ import annotations

from ..collectives import COPY, CollectiveSpec
from ..errors import PurlinPlanError
from .plan import (
    DIRECT, Ack, Beat, Buf, ConsumeStep, Drain, DrainAll, Hear, Item, Notify, Plan, Push, RankProgram, Ref, Stage,
    Step, Wait,
)
from .policy import ALIGN, PACKET_WINDOW_BYTES, TuningPolicy, max_items


def producers(spec: CollectiveSpec, world: int, root: int | None) -> tuple[int, ...]:
    return (root,) if spec.input.rooted else tuple(range(world))


def consumers(spec: CollectiveSpec, world: int, root: int | None) -> tuple[int, ...]:
    return (root,) if spec.output.rooted else tuple(range(world))


def has_packet_form(spec: CollectiveSpec) -> bool:
    """Whether ``spec`` may run the packet protocol: every rank knows every push's size, so that all
    ranks agree on the algorithm without exchanging sizes (a packet call advances every rank's epoch,
    a staged one does not).

    * Fixed forms, rooted ones included: yes. A window parity is rewritten two packet calls later,
      which is safe only because each producer, in the packet call in between, waits for packets its
      consumer sent after finishing the earlier call: that needs a push between every ordered pair of
      ranks in every packet call. Where the naming moves nothing between a pair (the non-roots of
      a rooted input, to each other and to the root; likewise for a rooted output), the plan sends one
      empty packet instead (:class:`Beat`, waited for by a :class:`Hear`); without it the root would
      wait for nobody and could overwrite a window its reader has not read yet. Every rank's input
      is the same size (as torch.distributed asks), so all of them choose alike.
    * V forms whose sizes every rank passes in full (a packed side and a sliced side, no root:
      all_gather_v's and reduce_scatter_v's ``sizes``): yes; they choose from the largest push, which
      each rank can compute. A rank's empty slice still travels as one empty packet (snac/packet.cuh:
      packet_count).
    * Other V forms never: sliced on both sides (all_to_all_v), a rank knows only its own splits (they
      take :func:`has_hybrid_form` instead); a rooted V form's sizes are known to its root only.
    """
    return not spec.variable or not (spec.rooted or (spec.input.sliced and spec.output.sliced))


def has_hybrid_form(spec: CollectiveSpec) -> bool:
    """Whether ``spec`` may run ``hybrid``: V forms sliced on both sides, no root (all_to_all_v).

    Rank p knows what it sends each consumer (its input slice c) and rank c what it receives from each
    producer (its output slice p); for one pair the two are the same number (torch.distributed asks
    it), so the two ends choose alike, pair by pair, with no size exchange: packets up to
    ``pair_max_bytes``, else the one-shot. A pair that goes staged still exchanges one empty packet
    (:class:`Beat` / :class:`Hear`), so every packet call pushes between every ordered pair (the
    window-reuse rule of :func:`has_packet_form`) and every rank runs the packet part of every call:
    the ranks' epochs stay in step. A rank none of whose pairs goes staged runs no staged part."""
    return spec.variable and spec.input.sliced and spec.output.sliced and not spec.rooted


def packet_push_bytes(spec: CollectiveSpec, nbytes: int, world: int | None) -> int:
    """The largest single push of a call whose input is ``nbytes`` bytes on this rank: a sliced
    input sends one slice per consumer (``world`` None counts the whole input: never smaller). For a
    V form this is this rank's guess only; the call path passes the group's largest push
    (:func:`largest_push`) instead."""
    return -(-nbytes // world) if spec.input.sliced and world else nbytes


def largest_push(sizes) -> int:
    """The largest push of a call of a collective with a packet form, from ONE rank's lowering sizes
    (``snac.lower.Sizes``), the same on every rank: a packed input goes whole to every consumer and a
    sliced one slice by slice, and every such push lands in a region of some rank's output that this
    rank's sizes name too (a fixed form's slices are equal; a V form with a packet form has every
    rank's sizes on its sliced side)."""
    return max(sizes.input + sizes.output, default=0)


def algorithms_of(spec: CollectiveSpec, *, packets: bool) -> tuple[str, ...]:
    """The algorithms ``spec`` has on an engine with (``packets``) or without the packet protocol."""
    return (("packet",) if packets and has_packet_form(spec) else ()) + (
        ("hybrid",) if packets and has_hybrid_form(spec) else ()) + ("oneshot",) + (
        ("twoshot",) if _reduces_to_all(spec) else ())


def band(bands: tuple[tuple[int, str], ...], nbytes: int) -> str:
    """A tuning table's algorithm for ``nbytes``: the first band with ``nbytes <= max_bytes`` (beyond
    the last band: the last band's). Tables: snac/table.py."""
    for max_bytes, algorithm in bands:
        if nbytes <= max_bytes:
            return algorithm
    return bands[-1][1]


def choose_algorithm(spec: CollectiveSpec, nbytes: int | None, policy: TuningPolicy, *, packets: bool = False,
                     world: int | None = None, bands: tuple[tuple[int, str], ...] | None = None,
                     push: int | None = None) -> str:
    """The regime of one call; ``nbytes``: this rank's input bytes, ``world``: the group size.

    ``packets``: the engine runs the packet protocol (else ``packet`` becomes ``oneshot``, the same
    result bitwise). Collectives with a packet form (:func:`has_packet_form`) take ``packet`` when
    forced, or under ``auto`` when the largest push fits ``packet_max_bytes`` (and the window).
    Collectives with a hybrid form (:func:`has_hybrid_form`) take ``hybrid`` under ``auto`` and
    ``packet`` (``pair_max_bytes``: :func:`hybrid_pair_max`). Beyond that, only reductions of a
    packed payload into a packed output on every rank have a choice (``oneshot`` / ``twoshot``);
    everything else is ``oneshot``.

    ``bands``: this collective's measured bands from a tuning table (snac/table.py), used under
    ``auto`` for a known ``nbytes`` in place of the thresholds above, where the band's algorithm can
    run (``packet`` needs the protocol and a push that fits the window; else the thresholds decide).
    Tables hold fixed forms only: a V form's bands are ignored.

    ``push``: the group's largest push (:func:`largest_push`), which a V form must give (its
    ``nbytes`` differ between ranks); else :func:`packet_push_bytes` of ``nbytes``.
    The answer depends only on its arguments: ranks that agree on them agree on the algorithm."""
    algorithm = policy.algorithm
    if push is None and nbytes is not None and not spec.variable:
        push = packet_push_bytes(spec, nbytes, world)
    fits = push is not None and push <= PACKET_WINDOW_BYTES
    if algorithm == "auto" and bands and nbytes is not None and not spec.variable:
        measured = band(bands, nbytes)
        if measured != "packet":
            return measured
        if packets and has_packet_form(spec) and fits:
            return "packet"
    if packets and algorithm in ("auto", "packet") and has_packet_form(spec):
        if algorithm == "packet":
            return "packet"
        if fits and push <= policy.packet_max_bytes:
            return "packet"
    if packets and algorithm in ("auto", "packet") and has_hybrid_form(spec):
        return "hybrid"
    if not _reduces_to_all(spec) or algorithm in ("oneshot", "packet"):
        return "oneshot"
    if algorithm == "twoshot" or nbytes is None:  # size resolved later (e.g. on device): bounded traffic
        return "twoshot"
    return "oneshot" if nbytes <= policy.oneshot_max_bytes else "twoshot"


def make_plan(
    spec: CollectiveSpec,
    world: int,
    rank: int,
    *,
    root: int | None = None,
    nbytes: int | None = None,
    staging_bytes: int,
    policy: TuningPolicy | None = None,
    algorithm: str | None = None,
    input_at: int = -1,
) -> Plan:
    """Derive the plan of ``spec`` for ``rank`` of ``world``.

    ``algorithm``: the regime the caller chose with :func:`choose_algorithm` (``packet``, ``hybrid``,
    ``oneshot`` or ``twoshot``; the Communicator decides once per call shape and passes it
    here). None: choose it here from ``nbytes`` (the per-rank payload, if known on the host)
    and ``policy``, as for an engine with packets exactly when ``policy.algorithm`` forces them.
    The plan's structure does not depend on ``nbytes``. Deterministic: the same arguments give
    an equal plan. ``input_at``: for ``direct``, where every rank's input lies in its staging region
    (the symmetric heap), in bytes.
    """
    policy = policy or TuningPolicy()
    if world < 1:
        raise PurlinPlanError(f"{spec.name}: world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise PurlinPlanError(f"{spec.name}: rank {rank} is outside world size {world}")
    if spec.rooted:
        if root is None or not 0 <= root < world:
            raise PurlinPlanError(f"{spec.name}: needs a root rank in [0, {world}), got {root!r}")
    else:
        root = None
    if algorithm is None:
        algorithm = choose_algorithm(spec, nbytes, policy, packets=policy.algorithm == "packet", world=world)
    else:
        _check_algorithm(spec, algorithm)
    if algorithm == "packet":
        body = _packet(spec, world, rank, root)
        program = RankProgram(rank, (), (), tuple(body))
        notes = (f"flag-in-data packets pushed into each consumer's window; at most {PACKET_WINDOW_BYTES} "
                 "payload bytes per call",)
        return Plan(spec, world, rank, root, algorithm, PACKET_WINDOW_BYTES, 1, 0, program, notes)
    if algorithm in DIRECT:
        if input_at < 0:
            raise PurlinPlanError(f"{spec.name}: a direct plan needs input_at, where every rank's input lies in "
                                  "its symmetric heap")
        notes = (f"every rank's input at byte {input_at} of its staging region (the symmetric heap), read in place",)
        if algorithm == "direct":
            program = RankProgram(rank, (), (), tuple(_direct(spec, world, rank, root)))
            return Plan(spec, world, rank, root, algorithm, 0, 1, 1, program, notes, input_at=input_at)
        items, body = _direct_twoshot(spec, world, rank)
        chunk = _chunk_bytes(spec, staging_bytes, 1, policy)  # one staged item: my shard
        program = RankProgram(rank, tuple(items), (DrainAll(),), tuple(body))
        return Plan(spec, world, rank, root, algorithm, chunk, policy.slots, 1, program,
                    notes + (f"output cut into {world} parts; part q reduced by rank q into its staged shard",),
                    input_at=input_at)
    if algorithm == "hybrid":
        staged = make_plan(spec, world, rank, root=root, staging_bytes=staging_bytes, policy=policy,
                           algorithm="oneshot")
        pair_max = hybrid_pair_max(policy)
        program = RankProgram(rank, (), (), tuple(_packet(spec, world, rank, root)))
        notes = (f"per pair: at most {pair_max} bytes as flag-in-data packets, more through the one-shot below "
                 "(that pair then exchanges one empty packet)",)
        return Plan(spec, world, rank, root, algorithm, staged.chunk_bytes, staged.slots, staged.n_items, program,
                    notes, pair_max_bytes=pair_max, staged=staged)
    if algorithm == "twoshot":
        items, body, notes = _twoshot(spec, world, rank)
        n_items = max_items(world)
    else:
        items, body, notes = _oneshot(spec, world, rank, root)
        n_items = world if spec.input.sliced else 1
    slots = policy.slots
    chunk = _chunk_bytes(spec, staging_bytes, n_items, policy)
    prologue: tuple[Step, ...] = (DrainAll(),) if items else ()
    program = RankProgram(rank, tuple(items), prologue, tuple(body))
    return Plan(spec, world, rank, root, algorithm, chunk, slots, n_items, program, tuple(notes))


def _chunk_bytes(spec: CollectiveSpec, staging_bytes: int, n_items: int, policy: TuningPolicy) -> int:
    """The chunk of a staged plan: ``n_items`` items x ``tuning.slots`` slots share the staging, at
    most ``tuning.max_chunk_bytes`` each, aligned to ALIGN; too little staging is a PurlinPlanError."""
    slots = policy.slots
    chunk = min(policy.max_chunk_bytes, staging_bytes // (n_items * slots))
    chunk -= chunk % ALIGN
    if chunk < ALIGN:
        raise PurlinPlanError(
            f"{spec.name}: staging_bytes={staging_bytes} is too small for {n_items} items x {slots} slots "
            f"of at least {ALIGN} bytes; raise staging_bytes or lower tuning.slots"
        )
    return chunk


def _check_algorithm(spec: CollectiveSpec, algorithm: str) -> None:
    """A chosen ``algorithm`` must be one that ``spec`` has (what :func:`choose_algorithm` can answer)."""
    if algorithm == "packet" and not has_packet_form(spec):
        raise PurlinPlanError(f"{spec.name}: has no packet form (V forms sliced on both sides, and rooted V forms, "
                              "stay staged)")
    if algorithm == "direct" and not has_packet_form(spec):
        raise PurlinPlanError(f"{spec.name}: has no direct form (only collectives whose sizes every rank knows, "
                              "as for packets)")
    if algorithm == "direct-twoshot" and not _reduces_to_all(spec):
        raise PurlinPlanError(f"{spec.name}: has no direct two-shot form (only reductions of a packed payload into "
                              "a packed output on every rank)")
    if algorithm == "hybrid" and not has_hybrid_form(spec):
        raise PurlinPlanError(f"{spec.name}: has no hybrid form (only V forms sliced on both sides, with no root)")
    if algorithm == "twoshot" and not _reduces_to_all(spec):
        raise PurlinPlanError(f"{spec.name}: has no two-shot form (only reductions of a packed payload into a "
                              "packed output on every rank)")
    if algorithm not in ("packet", "hybrid", "oneshot", "twoshot") + DIRECT:
        raise PurlinPlanError(f"{spec.name}: algorithm must be 'packet', 'hybrid', 'oneshot', 'twoshot', 'direct' or "
                              f"'direct-twoshot', got {algorithm!r}")


def hybrid_pair_max(policy: TuningPolicy) -> int:
    """The largest region one pair moves as packets in a ``hybrid`` call: ``tuning.packet_max_bytes``
    (a push of a fixed form takes packets up to the same size), a whole receive window when
    ``tuning.algorithm`` forces packets. The same on every rank of a group (one config)."""
    return PACKET_WINDOW_BYTES if policy.algorithm == "packet" else policy.packet_max_bytes


def _reduces_to_all(spec: CollectiveSpec) -> bool:
    """Reductions of a packed payload into a packed output on every rank (all_reduce): the two-shot form."""
    return not spec.consume.is_copy and not spec.input.sliced and not spec.output.sliced and not spec.rooted


def _sent(spec: CollectiveSpec, me: int, c: int) -> Ref:
    """What I send consumer ``c``: my input slice ``c``, or my whole packed input."""
    return Ref(Buf.INPUT, me, c if spec.input.sliced else None)


def _consume(spec: CollectiveSpec, me: int, prods: tuple[int, ...], remote) -> list[ConsumeStep]:
    """My consume steps: each producer's contribution (``remote(p)`` for a peer, my own input for
    me) copied into its landing region, or all of them reduced in rank order into my output."""
    def source(p: int) -> Ref:
        return _sent(spec, me, me) if p == me else remote(p)

    if spec.output.sliced or spec.consume.is_copy:
        return [ConsumeStep(COPY, _landing(spec, me, p), (source(p),)) for p in prods]
    return [ConsumeStep(spec.consume, _landing(spec, me, prods[0]), tuple(source(p) for p in prods))]


def _landing(spec: CollectiveSpec, me: int, p: int) -> Ref:
    """Where producer ``p``'s contribution lands in my output: slice ``p``, or the whole output."""
    return Ref(Buf.OUTPUT, me, p if spec.output.sliced else None)


def _oneshot(spec: CollectiveSpec, world: int, me: int, root: int | None):
    """Every consumer reads each producer's contribution straight from the producer's staging."""
    prods = producers(spec, world, root)
    cons = consumers(spec, world, root)
    items: list[Item] = []
    body: list[Step] = []
    # Stage: what I send, one item per distinct region.
    if me in prods:
        if spec.input.sliced:
            for c in cons:
                if c != me:
                    items.append(Item(c, _sent(spec, me, c), (c,)))
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
            body.append(Wait(p, item_for_me, _landing(spec, me, p)))
        body += _consume(spec, me, prods, lambda p: Ref(Buf.STAGE, p, item_for_me))
        for p in remote:
            body.append(Ack(p, item_for_me, _landing(spec, me, p)))
    return items, body, ()


def _direct(spec: CollectiveSpec, world: int, me: int, root: int | None) -> list[Step]:
    """Tell my readers my input is ready (item 0: no staging is used), wait for my producers', copy or
    reduce their inputs in place (what ``p`` sends me: its input slice ``me``, or its whole input),
    acknowledge, then wait until every reader has acknowledged mine (``Drain``)."""
    prods, cons = producers(spec, world, root), consumers(spec, world, root)
    readers = tuple(c for c in cons if c != me) if me in prods else ()
    body: list[Step] = [Notify(0, readers)] if readers else []
    if me in cons:
        remote = [p for p in prods if p != me]
        body += [Wait(p, 0, _landing(spec, me, p)) for p in remote]
        body += _consume(spec, me, prods, lambda p: _sent(spec, p, me))
        body += [Ack(p, 0, _landing(spec, me, p)) for p in remote]
    if readers:
        body.append(Drain(0))
    return body


def _direct_twoshot(spec: CollectiveSpec, world: int, me: int):
    """The two-shot with every input read in place: after the inputs-ready exchange (item 0), reduce
    part ``me`` of every rank's input into my shard (staged, item ``world``: its chunks cycle through the
    slots), then copy every rank's shard into my output; acknowledge the inputs (no wait for my readers:
    they read my input before they notify their shards, all of which I copy). Lowered chunk by chunk as
    the two-shot is (lower._lower_direct_twoshot); the steps print the plan."""
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


def _packet(spec: CollectiveSpec, world: int, me: int, root: int | None) -> list[Step]:
    """Push what I send each consumer into its window (rotated: start at me + 1), then consume the
    packets each producer pushed to me: one copy per producer, or one reduce in rank order. A pair
    of ranks between which the naming moves nothing (rooted forms) exchanges one empty packet
    (:class:`Beat`, then :class:`Hear` after my consumes): the window-reuse rule of has_packet_form."""
    prods, cons = producers(spec, world, root), consumers(spec, world, root)

    def moves(p: int, c: int) -> bool:  # the naming moves a region from p to c
        return p in prods and c in cons

    others = [(me + d) % world for d in range(1, world)]
    body: list[Step] = [Push(_sent(spec, me, c), c) if moves(me, c) else Beat(c) for c in others]
    if me in cons:
        body += _consume(spec, me, prods, lambda p: Ref(Buf.WINDOW, p))
    body += [Hear(p) for p in others if not moves(p, me)]
    peers = [s.peer for s in body if isinstance(s, Push)]
    windows = [x.rank for s in body if isinstance(s, ConsumeStep) for x in s.srcs if x.buf is Buf.WINDOW]
    if len(set(peers)) < len(peers) or len(set(windows)) < len(windows):  # the window is per producer
        raise PurlinPlanError(f"{spec.name}: the packet protocol carries one region from each producer to each "
                              "consumer per call; use tuning.algorithm='oneshot'")
    return body


def _twoshot(spec: CollectiveSpec, world: int, me: int):
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
    notes = (f"output cut into {n} parts aligned to {ALIGN} bytes; part q is reduced by rank q",)
    return items, body, notes
