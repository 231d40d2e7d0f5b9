"""Lowering: a plan plus one rank's concrete sizes -> that rank's flat list of operations.

This is where sizes enter. Every quantity comes from the rank's own sizes: the
length of a peer's item that I read equals the length of the region it lands in,
so no rank needs another rank's sizes (what all_to_all_v needs). Engines run the
resulting ops in order; the CUDA engine can run the same ops, or resolve the plan
on the device when the sizes live there.

Signals are counters, one per (producer, consumer, item), each written by one side
only: ``notify[p][c][i]`` counts chunks ``p`` staged in item ``i`` for ``c``,
``ack[p][c][i]`` counts chunks ``c`` drained from it. A wait compares "at least".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..collectives import ReduceOp
from ..errors import PurlinPlanError
from . import registry
from .plan import Ack, Buf, ConsumeStep, Drain, DrainAll, Notify, Plan, Ref, Stage, Wait
from .planner import consumers, producers
from .policy import ALIGN, max_items


@dataclass(frozen=True)
class Sizes:
    """One rank's sizes in bytes: per input slice and per output slice (one entry when packed)."""

    input: tuple[int, ...]
    output: tuple[int, ...]


@dataclass(frozen=True)
class Span:
    buf: Buf
    rank: int
    offset: int
    nbytes: int

    def __str__(self) -> str:
        return f"{self.buf.value}[r{self.rank}][{self.offset}:{self.offset + self.nbytes}]"


@dataclass(frozen=True)
class Copy:
    dst: Span
    src: Span


@dataclass(frozen=True)
class Reduce:
    op: ReduceOp
    dst: Span
    srcs: tuple[Span, ...]  # rank order


@dataclass(frozen=True)
class Signal:
    kind: str  # "notify": notify[me][peer][item] += 1 ; "ack": ack[peer][me][item] += 1
    peer: int
    item: int


@dataclass(frozen=True)
class WaitSignal:
    """notify: wait for the next chunk of ``peer``'s item; ack: wait until ``peer`` drained all but ``lag`` chunks I notified."""

    kind: str
    peer: int
    item: int
    lag: int = 0


@dataclass(frozen=True)
class WaitDrainAll:
    """Wait until ``peers`` acknowledged every chunk I notified them, for item indices ``< items``."""

    peers: tuple[int, ...]
    items: int


@dataclass(frozen=True)
class PacketPut:
    """Push ``src`` into ``peer``'s receive window as flag-in-data packets (the packet protocol)."""

    peer: int
    src: Span


@dataclass(frozen=True)
class PacketCopy:
    """Copy ``src`` into ``dst``: a WINDOW source (``Span(WINDOW, p, 0, n)``) is the packets rank ``p``
    pushed to me in this call, waited for packet by packet; any other is a span of my own input, copied
    with the same per-thread packet mapping (so ``dst`` may be that very span: in place)."""

    dst: Span
    src: Span


@dataclass(frozen=True)
class PacketReduce:
    """Reduce in rank order into ``dst``; a source with buf WINDOW (``Span(WINDOW, p, 0, n)``) is the
    packets rank ``p`` pushed to me in this call, waited for packet by packet."""

    op: ReduceOp
    dst: Span
    srcs: tuple[Span, ...]


Op = Union[Copy, Reduce, Signal, WaitSignal, WaitDrainAll, PacketPut, PacketCopy, PacketReduce]


@dataclass(frozen=True)
class Schedule:
    plan: Plan
    sizes: Sizes
    ops: tuple[Op, ...]
    send_bytes: tuple[int, ...]  # per peer: bytes of my staging that it reads
    recv_bytes: tuple[int, ...]  # per peer: bytes of its staging that I read
    staging_used: int  # high-water mark of my staging, bytes
    # The schedule of an algorithm that runs in parts (registry kernel None; a hybrid plan's: its packet
    # part, then its staged part where this rank has one); ``ops`` are theirs in that order. An engine
    # runs the parts one after the other (the CUDA engine: each in its own kernel kind). Empty otherwise.
    parts: tuple["Schedule", ...] = ()


def part_range(length: int, i: int, k: int) -> tuple[int, int]:
    """Part ``i`` of ``k`` of ``length`` bytes, cut at multiples of ALIGN; the last part takes the tail."""
    def edge(j: int) -> int:
        if j >= k:
            return length
        e = (length * j) // k
        return e - e % ALIGN
    return edge(i), edge(i + 1)


class Resolver:
    """One rank's sizes applied to a plan's symbolic regions (every lowering reads regions through it)."""

    def __init__(self, plan: Plan, sizes: Sizes):
        self.plan, self.sizes, self.me = plan, sizes, plan.rank
        spec, world = plan.spec, plan.world
        for name, layout, vals in (("input", spec.input, sizes.input), ("output", spec.output, sizes.output)):
            want = world if layout.sliced else 1
            if len(vals) != want:
                raise PurlinPlanError(f"{spec.name}: {name} needs {want} size(s), got {len(vals)}")
            if any(v < 0 for v in vals):
                raise PurlinPlanError(f"{spec.name}: negative {name} size in {list(vals)}")
        if (not spec.input.sliced and not spec.output.sliced and self.me in producers(spec, world, plan.root)
                and self.me in consumers(spec, world, plan.root) and sum(sizes.input) != sum(sizes.output)):
            # checked here for every algorithm: the two-shot plan never copies my input to my output
            raise PurlinPlanError(
                f"{spec.name}: rank {self.me} has {sum(sizes.input)} input bytes but {sum(sizes.output)} "
                "output bytes; a packed payload lands whole in a packed output, so the sizes must match"
            )
        self.items = {it.index: it for it in plan.program.items}

    def region(self, ref: Ref) -> tuple[int, int]:
        """(offset, length) of a region of this rank's own input/output buffers."""
        if ref.rank != self.me or ref.buf is Buf.STAGE:
            raise PurlinPlanError(f"internal: cannot size {ref} on rank {self.me}")
        vals = self.sizes.input if ref.buf is Buf.INPUT else self.sizes.output
        if ref.index is None:
            off, length = 0, sum(vals)
        else:
            off, length = sum(vals[: ref.index]), vals[ref.index]
        lo, hi = part_range(length, *ref.part)
        return off + lo, hi - lo

    def length(self, ref: Ref) -> int:
        if ref.buf is Buf.WINDOW:
            raise PurlinPlanError(f"internal: cannot size {ref} on rank {self.me}")
        if ref.buf is Buf.STAGE:
            return self.region(self.items[ref.index].like)[1]
        return self.region(ref)[1]


def trips(length: int, chunk: int) -> int:
    """Chunks of ``chunk`` bytes in ``length`` bytes (at least one: an empty region still runs its steps)."""
    return max(1, -(-length // chunk))


def size_mismatch(plan: Plan, src: Ref, got: int, dst: Ref, want: int) -> PurlinPlanError:
    return PurlinPlanError(f"{plan.spec.name}: rank {plan.rank} reads {got} bytes from {src} into {want} bytes "
                           f"of {dst}; the sizes do not match")


def lower(plan: Plan, sizes: Sizes) -> Schedule:
    """Resolve ``plan`` with this rank's ``sizes`` into a flat, ordered list of ops: by the lowering of
    the registered algorithm that built it (snac/registry.py)."""
    return registry.get(plan.algorithm).lower(plan, Resolver(plan, sizes), sizes)


def lower_staged(plan: Plan, r: "Resolver", sizes: Sizes) -> Schedule:
    """A staged program (Stage / Notify / Wait / Consume / Ack / Drain steps, a DrainAll prologue), chunk
    by chunk: the body runs once per chunk of ``plan.chunk_bytes``, each item's chunks cycling through
    ``plan.slots`` slots of its staging (the one-shot, the two-shot, a hybrid plan's staged part)."""
    me, chunk, slots = plan.rank, plan.chunk_bytes, plan.slots
    world = plan.world
    send = [0] * world
    recv = [0] * world
    high = 0

    def slot(item: int, k: int, nbytes: int, owner: int) -> Span:
        nonlocal high
        off = (item * slots + k % slots) * chunk
        if owner == me:
            high = max(high, off + nbytes)
        return Span(Buf.STAGE, owner, off, nbytes)

    def piece(ref: Ref, k: int, length: int) -> Span:
        lo = k * chunk
        n = max(0, min(length, lo + chunk) - lo)
        if ref.buf is Buf.STAGE:
            return slot(ref.index, k, n, ref.rank)
        off, _ = r.region(ref)
        return Span(ref.buf, me, off + lo, n)

    steps = plan.program.body
    lengths = []
    for s in steps:
        if isinstance(s, (Stage, Drain, Notify)):
            ln = r.length(Ref(Buf.STAGE, me, s.item))
        elif isinstance(s, (Wait, Ack)):
            ln = r.length(s.like)
        else:
            ln = r.length(s.dst)
            for src in s.srcs:
                if src.buf is not Buf.STAGE and r.length(src) != ln:
                    raise size_mismatch(plan, src, r.length(src), s.dst, ln)
        lengths.append(ln)
        if isinstance(s, Notify):
            for p in s.peers:
                send[p] += ln
        elif isinstance(s, Wait):
            recv[s.peer] += ln

    ops: list[Op] = []
    # DrainAll covers what the PREVIOUS calls staged, whose items, readers and slot layout may
    # differ from this plan's (e.g. a two-shot all_reduce with world + 1 items, then a one-shot
    # all_gather whose one item spans the whole staging): so every peer and every item index.
    peers = tuple(p for p in range(world) if p != me)
    for s in plan.program.prologue:
        if isinstance(s, DrainAll):
            ops.append(WaitDrainAll(peers, max_items(world)))
    n_iter = max((trips(ln, chunk) for ln in lengths), default=1)
    for k in range(n_iter):
        for s, ln in zip(steps, lengths):
            if k >= trips(ln, chunk):
                continue
            if isinstance(s, Drain):
                if k >= slots:
                    for c in r.items[s.item].readers:
                        ops.append(WaitSignal("ack", c, s.item, slots - 1))
            elif isinstance(s, Stage):
                src = piece(s.src, k, ln)
                ops.append(Copy(slot(s.item, k, src.nbytes, me), src))
            elif isinstance(s, Notify):
                ops += [Signal("notify", p, s.item) for p in s.peers]
            elif isinstance(s, Wait):
                ops.append(WaitSignal("notify", s.peer, s.item))
            elif isinstance(s, Ack):
                ops.append(Signal("ack", s.peer, s.item))
            elif isinstance(s, ConsumeStep):
                dst = piece(s.dst, k, ln)
                srcs = tuple(piece(x, k, ln) for x in s.srcs)
                if s.consume.is_copy:
                    ops.append(Copy(dst, srcs[0]))
                else:
                    ops.append(Reduce(s.consume.reduce, dst, srcs))
    return Schedule(plan, sizes, tuple(ops), tuple(send), tuple(recv), high)
