"""Plans: plain, printable, deterministic data of Stage / Notify / Consume steps.

A plan is what the planner derives from a naming and what every engine executes.
Its structure never depends on payload sizes: regions are named symbolically
(``Ref``: "input slice 3 of rank 1, part 2 of 4"), and the body of a rank's program
is run once per chunk, the number of chunks of each step following from the sizes
that are resolved later (on the host by :mod:`purlin_sglang.snac.lower`, or on the
device by an engine that keeps sizes there).

Staging protocol (pull): a producer copies a region into one of its own staging
*items* (Stage), tells the item's readers (Notify); a reader waits for it (Wait),
copies or reduces it into its output or into one of its own items (Consume), and
acknowledges the drained chunk (Ack). Each item has ``slots`` chunk slots used
cyclically, so a producer re-writing a slot first waits for the readers' acks of
the chunk that used it before (Drain). A call starts by draining everything the
previous call staged (DrainAll), so items may be laid out differently per call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Union

from ..collectives import CollectiveSpec, Consume


class Buf(str, enum.Enum):
    INPUT = "in"
    OUTPUT = "out"
    STAGE = "stage"
    WINDOW = "window"  # packets a producer pushed into my receive window


@dataclass(frozen=True)
class Ref:
    """A symbolic region: ``index`` is a slice (input/output, None = whole buffer) or an item (stage)."""

    buf: Buf
    rank: int
    index: int | None = None
    part: tuple[int, int] = (0, 1)

    def __str__(self) -> str:
        s = f"{self.buf.value}[r{self.rank}]"
        if self.index is not None:
            s += f".{'item' if self.buf is Buf.STAGE else 's'}{self.index}"
        if self.part != (0, 1):
            s += f"/p{self.part[0]}of{self.part[1]}"
        return s


@dataclass(frozen=True)
class Item:
    """One staging item of this rank: chunk-sized slots, filled from regions shaped like ``like``."""

    index: int
    like: Ref  # a region of this rank's own buffers with the item's length
    readers: tuple[int, ...]

    def __str__(self) -> str:
        return f"item{self.index} (like {self.like}) -> readers {list(self.readers)}"


@dataclass(frozen=True)
class DrainAll:
    """Prologue: wait until every reader acknowledged everything this rank staged before."""

    def __str__(self) -> str:
        return "drain-all"


@dataclass(frozen=True)
class Drain:
    """Before re-using a slot of ``item``: wait for its readers' acks of the chunk ``slots`` back."""

    item: int

    def __str__(self) -> str:
        return f"drain item{self.item}"


@dataclass(frozen=True)
class Stage:
    src: Ref
    item: int

    def __str__(self) -> str:
        return f"stage {self.src} -> item{self.item}"


@dataclass(frozen=True)
class Push:
    """Write ``src`` into ``peer``'s receive window as packets (the packet protocol's Stage + Notify)."""

    src: Ref
    peer: int

    def __str__(self) -> str:
        return f"push {self.src} -> window of r{self.peer} (packets)"


@dataclass(frozen=True)
class Beat:
    """Push one empty packet into ``peer``'s receive window: a pair of ranks between which the naming
    moves nothing (a rooted collective's silent pairs) still exchanges a packet every packet call,
    which the window-reuse rule needs (snac/packet.cuh)."""

    peer: int

    def __str__(self) -> str:
        return f"beat -> window of r{self.peer} (one empty packet)"


@dataclass(frozen=True)
class Hear:
    """Wait for ``peer``'s empty packet (its :class:`Beat`) in my receive window."""

    peer: int

    def __str__(self) -> str:
        return f"hear r{self.peer}'s beat (one empty packet)"


@dataclass(frozen=True)
class Notify:
    item: int
    peers: tuple[int, ...]

    def __str__(self) -> str:
        return f"notify item{self.item} -> {list(self.peers)}"


@dataclass(frozen=True)
class Wait:
    peer: int
    item: int
    like: Ref  # a region of this rank's buffers with the length of the awaited item

    def __str__(self) -> str:
        return f"wait r{self.peer}.item{self.item}"


@dataclass(frozen=True)
class ConsumeStep:
    consume: Consume
    dst: Ref
    srcs: tuple[Ref, ...]  # in rank order for reductions

    def __str__(self) -> str:
        return f"{self.consume} {', '.join(map(str, self.srcs))} -> {self.dst}"


@dataclass(frozen=True)
class Ack:
    peer: int
    item: int
    like: Ref

    def __str__(self) -> str:
        return f"ack r{self.peer}.item{self.item}"


Step = Union[DrainAll, Drain, Stage, Push, Beat, Hear, Notify, Wait, ConsumeStep, Ack]


@dataclass(frozen=True)
class RankProgram:
    rank: int
    items: tuple[Item, ...]
    prologue: tuple[Step, ...]
    body: tuple[Step, ...]  # executed once per chunk


@dataclass(frozen=True)
class Plan:
    """Everything an engine needs to run one collective on one rank, minus the sizes."""

    spec: CollectiveSpec
    world: int
    rank: int
    root: int | None
    algorithm: str  # the name of the registered algorithm that built it (snac/registry.py)
    chunk_bytes: int
    slots: int
    n_items: int  # staging items per rank (the same on every rank)
    program: RankProgram
    notes: tuple[str, ...] = field(default=())
    # a plan with a staged part (algorithms/hybrid.py): ``program`` is the packet program; a pair whose
    # region is at most ``pair_max_bytes`` travels in it, a larger one through ``staged`` (a one-shot plan)
    pair_max_bytes: int = 0
    staged: "Plan | None" = None
    # a plan that reads the symmetric heap (algorithms/direct.py): where every rank's input lies in its
    # staging region (memory/heap.py), in bytes; consumers read their peers' inputs there in place; -1: none
    input_at: int = -1

    @property
    def key(self) -> tuple:
        """What must agree across ranks for them to be in the same call (sizes aside): with the pair
        bound of a plan with a staged part, and the heap offset of a plan that reads the heap."""
        return (
            self.spec.name, self.spec.input.name, self.spec.output.name, self.spec.consume.name,
            self.world, self.root, self.algorithm, self.chunk_bytes, self.slots, self.n_items,
        ) + ((self.pair_max_bytes,) if self.staged is not None else ()) + (
            (self.input_at,) if self.input_at >= 0 else ())

    def describe(self) -> str:
        """A readable listing of the plan (deterministic: the same plan prints the same text)."""
        p = self.program
        lines = [
            f"plan {self.spec}",
            f"  world={self.world} rank={self.rank} root={self.root} algorithm={self.algorithm} "
            f"chunk={self.chunk_bytes}B slots={self.slots} items={self.n_items}",
        ]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  {it}" for it in p.items]
        lines += [f"  prologue: {s}" for s in p.prologue]
        lines += [f"  per chunk: {s}" for s in p.body]
        if self.staged is not None:
            lines.append(f"  pairs of more than {self.pair_max_bytes} bytes, staged:")
            lines += ["  " + line for line in self.staged.describe().splitlines()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()
