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

from dataclasses import dataclass, replace
from typing import Union

from ..collectives import ReduceOp
from ..errors import PurlinPlanError
from .plan import (
    Ack, Beat, Buf, ConsumeStep, Drain, DrainAll, Hear, Notify, Plan, Push, RankProgram, Ref, Stage, Wait,
)
from .planner import consumers, producers
from .policy import ALIGN, PACKET_WINDOW_BYTES, max_items


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
    # A hybrid plan's schedule: its packet part, then its staged part where this rank has one; ``ops``
    # are theirs in that order. An engine runs the parts one after the other (the CUDA engine: the
    # packet kernel, then the interpreter). Empty for every other plan.
    parts: tuple["Schedule", ...] = ()


def part_range(length: int, i: int, k: int) -> tuple[int, int]:
    """Part ``i`` of ``k`` of ``length`` bytes, cut at multiples of ALIGN; the last part takes the tail."""
    def edge(j: int) -> int:
        if j >= k:
            return length
        e = (length * j) // k
        return e - e % ALIGN
    return edge(i), edge(i + 1)


class _Resolver:
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


def _trips(length: int, chunk: int) -> int:
    return max(1, -(-length // chunk))


def _size_mismatch(plan: Plan, src: Ref, got: int, dst: Ref, want: int) -> PurlinPlanError:
    return PurlinPlanError(f"{plan.spec.name}: rank {plan.rank} reads {got} bytes from {src} into {want} bytes "
                           f"of {dst}; the sizes do not match")


def _window_region(plan: Plan, r: "_Resolver", ref: Ref) -> tuple[int, int]:
    """(offset, length) of ``ref``, refused if it does not fit one packet receive window."""
    off, n = r.region(ref)
    if n > PACKET_WINDOW_BYTES:
        raise PurlinPlanError(
            f"{plan.spec.name}: the packet protocol carries at most {PACKET_WINDOW_BYTES} bytes per call "
            f"from one rank to another, rank {plan.rank} has {n}; use tuning.algorithm='auto' or a smaller "
            "tuning.packet_max_bytes")
    return off, n


def _lower_packet(plan: Plan, r: "_Resolver", sizes: Sizes, *, always: bool = False) -> Schedule:
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
            off, n = _window_region(plan, r, s.src)
            ops.append(PacketPut(s.peer, Span(Buf.INPUT, me, off, n)))
            send[s.peer] += n
        elif isinstance(s, Beat):  # one empty packet: no byte of any buffer is read
            ops.append(PacketPut(s.peer, Span(Buf.INPUT, me, 0, 0)))
        elif isinstance(s, Hear):  # waits for that packet; no byte of any buffer is written
            ops.append(PacketCopy(Span(Buf.OUTPUT, me, 0, 0), Span(Buf.WINDOW, s.peer, 0, 0)))
        elif isinstance(s, ConsumeStep):
            off, n = _window_region(plan, r, s.dst)
            srcs = []
            for x in s.srcs:
                if x.buf is Buf.WINDOW:
                    srcs.append(Span(Buf.WINDOW, x.rank, 0, n))
                    recv[x.rank] += n
                    continue
                xo, xn = r.region(x)
                if xn != n:
                    raise _size_mismatch(plan, x, xn, s.dst, n)
                srcs.append(Span(x.buf, me, xo, xn))
            dst = Span(Buf.OUTPUT, me, off, n)
            if s.consume.is_copy:
                ops.append(PacketCopy(dst, srcs[0]))
            else:
                ops.append(PacketReduce(s.consume.reduce, dst, tuple(srcs)))
        else:  # pragma: no cover - the planner emits nothing else for packets
            raise PurlinPlanError(f"{plan.spec.name}: internal: step {s} in a packet plan")
    return Schedule(plan, sizes, tuple(ops), tuple(send), tuple(recv), 0)


def _lower_hybrid(plan: Plan, r: "_Resolver", sizes: Sizes) -> Schedule:
    """A hybrid plan (planner.has_hybrid_form): each pair by the size of its region, which both of its
    ends know (my input slice c is what I send c, my output slice p what p sends me). A region of at
    most ``plan.pair_max_bytes`` travels in the packet part; a larger one through the staged part, a
    one-shot of those pairs only, and its pair exchanges one empty packet in the packet part instead
    (Beat / Hear) so that every packet call still pushes between every ordered pair. The packet part
    runs on every rank in every call, even one that moves no byte (``always``); the staged part only
    where this rank has a pair that goes staged. My own slice is copied in the packet part, or in the
    staged part when it is larger than ``pair_max_bytes`` (the staged copy atom; no peer waits for it)."""
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
    packet_plan = replace(plan, algorithm="packet", program=replace(plan.program, body=tuple(body)),
                          pair_max_bytes=0, staged=None)
    parts = [_lower_packet(packet_plan, r, sizes, always=True)]
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
        parts.append(lower(replace(st, program=program), sizes))
    send = tuple(map(sum, zip(*(p.send_bytes for p in parts))))
    recv = tuple(map(sum, zip(*(p.recv_bytes for p in parts))))
    ops = tuple(op for p in parts for op in p.ops)
    return Schedule(plan, sizes, ops, send, recv, parts[-1].staging_used, tuple(parts))


def _lower_direct(plan: Plan, r: "_Resolver", sizes: Sizes) -> Schedule:
    """A direct plan: one round, no chunks, no staging. A peer's input region is read in place at
    ``plan.input_at`` of the peer's staging region (a STAGE span: the symmetric heap is its tail), at
    the offset this rank computes from its own sizes (direct plans exist only where every rank knows
    every size: a fixed form's slices are equal, a V form's ``sizes`` are every rank's), as long as the
    region it lands in. The Drain becomes one ack wait per reader (nothing I notified still unread)."""
    me, world, spec = plan.rank, plan.world, plan.spec
    send, recv = [0] * world, [0] * world
    ops: list[Op] = []
    readers: tuple[int, ...] = ()

    def source(x: Ref, n: int, dst: Ref) -> Span:
        if x.rank == me:
            xo, xn = r.region(x)
            if xn != n:
                raise _size_mismatch(plan, x, xn, dst, n)
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


def _lower_direct_twoshot(plan: Plan, r: "_Resolver", sizes: Sizes) -> Schedule:
    """The direct two-shot (planner._direct_twoshot), chunk by chunk as the staged two-shot: the
    inputs-ready exchange (item 0), then per chunk k: drain my shard slot (k >= slots), reduce chunk k
    of my part of every input (peers' read in place at ``plan.input_at``) into it, notify; then each
    rank's chunk k of its shard: wait, copy into my output, ack. Then the inputs' acks (so that a later
    drain-all finds every notify acknowledged). No wait for my readers' acks at the end: rank q reads
    my input only to reduce its chunks, each before it notifies that chunk, and I return only after
    copying every chunk of every shard, so q has read all it reads of my input. A previous call's
    shard slots are drained first (WaitDrainAll), as every staged plan does."""
    me, world, chunk, slots, at = plan.rank, plan.world, plan.chunk_bytes, plan.slots, plan.input_at
    shard, red = world, plan.spec.consume.reduce
    others = tuple(q for q in range(world) if q != me)
    total = sum(sizes.input)  # == sum(sizes.output): _Resolver checked it
    parts = [part_range(total, q, world) for q in range(world)]
    trips = [_trips(hi - lo, chunk) for lo, hi in parts]
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

    for k in range(max(trips)):
        if k < trips[me]:
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
            if k >= trips[q]:
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


def lower(plan: Plan, sizes: Sizes) -> Schedule:
    """Resolve ``plan`` with this rank's ``sizes`` into a flat, ordered list of ops."""
    r = _Resolver(plan, sizes)
    if plan.algorithm == "packet":
        return _lower_packet(plan, r, sizes)
    if plan.algorithm == "hybrid":
        return _lower_hybrid(plan, r, sizes)
    if plan.algorithm == "direct":
        return _lower_direct(plan, r, sizes)
    if plan.algorithm == "direct-twoshot":
        return _lower_direct_twoshot(plan, r, sizes)
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
                    raise _size_mismatch(plan, src, r.length(src), s.dst, ln)
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
    n_iter = max((_trips(ln, chunk) for ln in lengths), default=1)
    for k in range(n_iter):
        for s, ln in zip(steps, lengths):
            if k >= _trips(ln, chunk):
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
