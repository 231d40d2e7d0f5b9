"""The SNAC planner: one derivation of Stage / Notify / Consume from a naming.

Nothing here knows a collective by name, nor an algorithm. The planner reads the spec's input and
output layouts and consume op; each algorithm (a registered unit: snac/registry.py, one module each
in snac/algorithms/) builds, for one rank, which regions it stages into which items, who reads each
item, which peers' items it waits for and how it copies or reduces them into its output, from the
helpers below. The built-in algorithms:

* ``oneshot`` (latency regime, and every copy collective): each consumer reads every producer's
  contribution directly, one step (algorithms/oneshot.py).
* ``twoshot`` (reductions into a packed output that every rank receives, e.g. all_reduce): the
  output is cut into ``world`` parts, rank ``q`` reduces part ``q`` from everyone, then every rank
  copies every reduced part (algorithms/twoshot.py).
* ``packet`` (latency regime of every fixed-size collective, engines with the packet protocol):
  flag-in-data packets pushed into each consumer's receive window (algorithms/packet.py).
* ``hybrid`` (all_to_all_v and namings like it, engines with the packet protocol): per ordered
  pair, packets or a one-shot of the larger pairs (algorithms/hybrid.py).
* ``direct`` / ``direct-twoshot`` (inputs in the symmetric heap): the one-shot and the two-shot
  reading every rank's input in place (algorithms/direct.py, algorithms/direct_twoshot.py).

The staged ones are chunked: the body runs once per chunk of at most ``chunk_bytes``, and staging
items cycle through ``slots`` slots, so payloads larger than the staging buffer work (the
throughput regime is the same program with many chunks).

:func:`select` is the one selector: from the tuning policy, a tuning table's bands and the call's
size it returns a registry entry; :func:`make_plan` asks that entry for the plan.
"""

from __future__ import annotations

from ..collectives import COPY, CollectiveSpec
from ..errors import PurlinPlanError
from . import registry
from .plan import Buf, ConsumeStep, Plan, Ref
from .policy import ALIGN, AUTO, TuningPolicy
from .registry import Algorithm, Request, Selection


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


def reduces_to_all(spec: CollectiveSpec) -> bool:
    """Reductions of a packed payload into a packed output on every rank (all_reduce): the two-shot form."""
    return not spec.consume.is_copy and not spec.input.sliced and not spec.output.sliced and not spec.rooted


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
    """The algorithms ``spec`` has on an engine with (``packets``) or without the packet protocol: the
    registered ones a tuning table may name (``purlin-sglang tune`` times them), in registration order."""
    return tuple(e.name for e in registry.registered()
                 if e.tunable and e.has_form(spec) and (packets or not e.packets))


def band(bands: tuple[tuple[int, str], ...], nbytes: int) -> str:
    """A tuning table's algorithm for ``nbytes``: the first band with ``nbytes <= max_bytes`` (beyond
    the last band: the last band's). Tables: snac/table.py."""
    for max_bytes, algorithm in bands:
        if nbytes <= max_bytes:
            return algorithm
    return bands[-1][1]


def selection(spec: CollectiveSpec, nbytes: int | None, policy: TuningPolicy, *, packets: bool = False,
              world: int | None = None, push: int | None = None) -> Selection:
    """What the selector knows of a call (registry.Selection); ``push`` defaults to
    :func:`packet_push_bytes` of ``nbytes`` for a fixed form."""
    if push is None and nbytes is not None and not spec.variable:
        push = packet_push_bytes(spec, nbytes, world)
    return Selection(spec, nbytes, push, policy, packets)


def select(spec: CollectiveSpec, nbytes: int | None, policy: TuningPolicy, *, packets: bool = False,
           world: int | None = None, bands: tuple[tuple[int, str], ...] | None = None,
           push: int | None = None) -> Algorithm:
    """The algorithm (a registry entry) of one call; ``nbytes``: this rank's input bytes, ``world``: the
    group size. The one selector: the call path, :func:`make_plan` and the tuning tools ask it.

    Only algorithms the call may run are candidates (:meth:`Algorithm.runs`: the naming has the form,
    and ``packets``, the engine runs the packet protocol, where the algorithm needs it). A forced
    ``tuning.algorithm`` takes the candidate of highest priority that it asks for (``forced_by``).
    Under ``auto``, ``bands`` (this collective's measured bands from a tuning table, snac/table.py)
    decide for a known ``nbytes`` where the band's algorithm is a candidate whose ``fits`` accepts the
    call (tables hold fixed forms only: a V form's bands are ignored); else the candidate of highest
    priority whose ``auto`` rule takes the call (the thresholds ``packet_max_bytes`` and
    ``oneshot_max_bytes``). Else the registry's fallback.

    ``push``: the group's largest push (:func:`largest_push`), which a V form must give (its
    ``nbytes`` differ between ranks); else :func:`packet_push_bytes` of ``nbytes``.
    The answer depends only on its arguments: ranks that agree on them agree on the algorithm."""
    sel = selection(spec, nbytes, policy, packets=packets, world=world, push=push)
    candidates = [e for e in registry.by_priority() if e.runs(sel)]
    if policy.algorithm != AUTO:
        return next((e for e in candidates if policy.algorithm in e.forced_by), registry.fallback())
    if bands and nbytes is not None and not spec.variable:
        measured = registry.find(band(bands, nbytes))
        if measured in candidates and measured.fits(sel):
            return measured
    return next((e for e in candidates if e.auto is not None and e.auto(sel)), registry.fallback())


def choose_algorithm(spec: CollectiveSpec, nbytes: int | None, policy: TuningPolicy, *, packets: bool = False,
                     world: int | None = None, bands: tuple[tuple[int, str], ...] | None = None,
                     push: int | None = None) -> str:
    """The name of :func:`select`'s answer (what ``Communicator.algorithm`` reports)."""
    return select(spec, nbytes, policy, packets=packets, world=world, bands=bands, push=push).name


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

    ``algorithm``: the name of the registered algorithm the caller chose with :func:`select` (the
    Communicator decides once per call shape and passes it here). None: choose it here from ``nbytes``
    (the per-rank payload, if known on the host) and ``policy``, as for an engine with packets exactly
    when ``policy.algorithm`` forces an algorithm that needs them. The plan's structure does not depend
    on ``nbytes``. Deterministic: the same arguments give an equal plan. ``input_at``: for an algorithm
    that reads the symmetric heap (``direct``), where every rank's input lies in its staging region, in
    bytes.
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
        forced_packets = any(e.packets for e in registry.registered() if policy.algorithm in e.forced_by)
        entry = select(spec, nbytes, policy, packets=forced_packets, world=world)
    else:
        entry = registry.find(algorithm)
        if entry is None:
            raise PurlinPlanError(f"{spec.name}: {registry.unknown(algorithm)}")
        if not entry.has_form(spec):
            raise PurlinPlanError(f"{spec.name}: has no {entry.form}")
    return entry.plan(Request(entry, spec, world, rank, root, staging_bytes, policy, input_at))


def chunk_bytes(spec: CollectiveSpec, staging_bytes: int, n_items: int, policy: TuningPolicy) -> int:
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


# ---- program helpers the algorithms share --------------------------------------------------------------------
def sent(spec: CollectiveSpec, me: int, c: int) -> Ref:
    """What I send consumer ``c``: my input slice ``c``, or my whole packed input."""
    return Ref(Buf.INPUT, me, c if spec.input.sliced else None)


def landing(spec: CollectiveSpec, me: int, p: int) -> Ref:
    """Where producer ``p``'s contribution lands in my output: slice ``p``, or the whole output."""
    return Ref(Buf.OUTPUT, me, p if spec.output.sliced else None)


def consume_steps(spec: CollectiveSpec, me: int, prods: tuple[int, ...], remote) -> list[ConsumeStep]:
    """My consume steps: each producer's contribution (``remote(p)`` for a peer, my own input for
    me) copied into its landing region, or all of them reduced in rank order into my output."""
    def source(p: int) -> Ref:
        return sent(spec, me, me) if p == me else remote(p)

    if spec.output.sliced or spec.consume.is_copy:
        return [ConsumeStep(COPY, landing(spec, me, p), (source(p),)) for p in prods]
    return [ConsumeStep(spec.consume, landing(spec, me, prods[0]), tuple(source(p) for p in prods))]
