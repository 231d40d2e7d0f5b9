"""Test helpers for the SNAC planner: consistent workloads, reference results, and a protocol simulator.

Three independent pieces, used by ``test_plan_structure.py`` and ``test_plan_properties.py``:

* **Workloads** (:func:`consistent_sizes`): globally consistent per-rank :class:`Sizes` for any
  naming, built from a world x world matrix of "what p sends to c" byte counts; buffers that do
  not take part (a rooted layout's non-root side) get unrelated junk sizes, which the planner
  must ignore.
* **References** (:func:`reference_outputs`): the expected output bytes of every rank, written
  from torch.distributed semantics for the collectives that have a torch name, and from the
  naming rules of :class:`CollectiveSpec` for any other naming. Nothing here imports the
  planner.
* **The simulator** (:func:`simulate`): runs every rank's lowered op list on numpy byte buffers
  with a seeded random interleaving of the ranks, with exactly the counter semantics of
  ``purlin_sglang.engines.cpu`` (see below), and checks

  - no deadlock (all ranks finish; otherwise :class:`DeadlockError` lists each blocked op),
  - no slot-reuse race (:class:`RaceError`): every staging byte carries a version tag
    (producer, item, call, chunk) set when it is written; a consumer that reads a peer's staging
    must see exactly the tag of the chunk its latest notify wait published, and a producer may
    not overwrite a staging byte whose chunk some notified reader has not acknowledged yet,
  - protocol sanity (:class:`ProtocolError`): spans inside their buffers, pull only, reduce
    spans element-aligned and of equal length, acks never ahead of the notifies consumed,
    every notify consumed and acknowledged by the end,
  - outputs (:class:`OutputError`): every consuming rank's output equals the reference and
    each output byte was written exactly once; non-consuming ranks write nothing,
  - packets (the packet protocol, ``PacketPut`` / ``PacketCopy`` / ``PacketReduce``): a push lands
    whole in the consumer's window ``[epoch parity][producer]`` (the epoch counts the rank's calls
    that ran packet ops, as the CUDA engine's), a window read waits for this call's epoch, and a
    push may not overwrite a window its reader has not read yet (:class:`RaceError`), nor push
    twice into one window in one call or more than a window holds (:class:`ProtocolError`).

Counter semantics (as ``CpuEngine._run``): ``notify[p, c, i]`` is incremented by producer ``p``
per Signal("notify", c, i); a consumer's WaitSignal("notify", p, i) waits until it is >= the
consumer's own running count of such waits (incremented by the wait); Signal("ack", p, i) on rank
``c`` increments ``ack[p, c, i]``; WaitSignal("ack", c, i, lag) on producer ``p`` waits until
``ack[p, c, i] >= notify[p, c, i] - lag``; WaitDrainAll waits until ``ack == notify`` for every
listed peer and item index ``< items``. Counters persist across calls; nothing is reset.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from purlin_sglang import reference as R
from purlin_sglang.collectives import (
    CATALOG, COPY, PACKED, PACKED_V, REDUCE, SCATTERED, SCATTERED_V, TRANSPOSED, TRANSPOSED_V,
    CollectiveSpec, Layout, ReduceOp,
)
from purlin_sglang.errors import PurlinPlanError
from purlin_sglang.snac import (
    Buf, Copy, PacketCopy, PacketPut, PacketReduce, Reduce, Schedule, Signal, Sizes, Span, WaitDrainAll, WaitSignal,
)
from purlin_sglang.snac.policy import PACKET_WINDOW_BYTES

# ---------------------------------------------------------------------------------------------
# Namings
# ---------------------------------------------------------------------------------------------

GATHER = CollectiveSpec("gather", PACKED, SCATTERED.root(), COPY)
GATHER_V = CollectiveSpec("gather_v", PACKED_V, SCATTERED_V.root(), COPY)
REDUCE_TO_ROOT = CollectiveSpec("reduce", PACKED, PACKED.root(), REDUCE)
SCATTER = CollectiveSpec("scatter", SCATTERED.root(), PACKED, COPY)
SCATTER_V = CollectiveSpec("scatter_v", SCATTERED_V.root(), PACKED_V, COPY)
USER_SPECS = {s.name: s for s in (GATHER, GATHER_V, REDUCE_TO_ROOT, SCATTER, SCATTER_V)}
NAMED_SPECS: dict[str, CollectiveSpec] = {**CATALOG, **USER_SPECS}


def _all_layouts() -> list[Layout]:
    out = []
    for base in (PACKED, SCATTERED, TRANSPOSED, PACKED_V, SCATTERED_V, TRANSPOSED_V):
        out += [base, base.root()]
    return out


def all_valid_namings() -> list[CollectiveSpec]:
    """Every (input, output, consume) combination that ``check_spec`` accepts, named generically."""
    specs = []
    for i, o, c in itertools.product(_all_layouts(), _all_layouts(), (COPY, REDUCE)):
        name = f"x_{i.name}_{o.name}_{'copy' if c.is_copy else 'reduce'}".replace("@", "_")
        try:
            specs.append(CollectiveSpec(name, i, o, c))
        except PurlinPlanError:
            pass
    return specs


def producers(spec: CollectiveSpec, world: int, root: int | None) -> tuple[int, ...]:
    """Ranks whose input takes part (written here from the layout docs, not imported)."""
    return (root,) if spec.input.rooted else tuple(range(world))


def consumers(spec: CollectiveSpec, world: int, root: int | None) -> tuple[int, ...]:
    return (root,) if spec.output.rooted else tuple(range(world))


# ---------------------------------------------------------------------------------------------
# Workloads: globally consistent sizes
# ---------------------------------------------------------------------------------------------

def consistent_sizes(
    spec: CollectiveSpec, world: int, root: int | None, m: Sequence[Sequence[int]], junk: Sequence[Sequence[int]]
) -> list[Sizes]:
    """Per-rank Sizes where ``m[p][c]`` is (before the naming's equalities) what p sends to c.

    Equalities imposed by the naming: fixed forms send one size everywhere; a packed input
    sends the same payload to every consumer; a packed output receives the same size from
    every producer. ``junk[r][k]`` sizes the buffers of ranks that do not take part.
    """
    prods, cons = producers(spec, world, root), consumers(spec, world, root)

    def b(p: int, c: int) -> int:
        if not spec.variable:
            return m[0][0]
        if not spec.input.sliced and not spec.output.sliced:
            return m[prods[0]][cons[0]]
        if not spec.input.sliced:
            return m[p][cons[0]]
        if not spec.output.sliced:
            return m[prods[0]][c]
        return m[p][c]

    out = []
    for r in range(world):
        if r in prods:
            if spec.input.sliced:
                inp = tuple(b(r, c) if c in cons else junk[r][c] for c in range(world))
            else:
                inp = (b(r, cons[0]),)
        else:
            inp = tuple(junk[r][:world]) if spec.input.sliced else (junk[r][0],)
        if r in cons:
            if spec.output.sliced:
                outp = tuple(b(p, r) for p in range(world))  # a sliced output has every rank producing
            else:
                outp = (b(prods[0], r),)
        else:
            outp = tuple(junk[r][:world]) if spec.output.sliced else (junk[r][-1],)
        out.append(Sizes(inp, outp))
    return out


REDUCE_DTYPES = {1: (np.int8,), 2: (np.int16,), 4: (np.int32, np.float32), 8: (np.int64, np.float64)}


def make_inputs(sizes: Sequence[Sizes], dtype, rng: np.random.Generator) -> list[np.ndarray]:
    """Random input bytes per rank: for copies bytes 0..254 (0xFF is the output poison); for
    reductions random non-zero elements of ``dtype`` (distinct floats)."""
    bufs = []
    for s in sizes:
        n = sum(s.input)
        if dtype is None:
            bufs.append(rng.integers(0, 255, size=n, dtype=np.uint8))
            continue
        dt = np.dtype(dtype)
        assert n % dt.itemsize == 0, (n, dt)
        k = n // dt.itemsize
        if dt.kind == "f":
            v = rng.uniform(0.25, 4.0, size=k) * rng.choice([-1.0, 1.0], size=k)
            v = v.astype(dt)
        else:
            info = np.iinfo(dt)
            v = rng.integers(1, int(info.max), size=k, dtype=np.int64) * rng.choice([-1, 1], size=k)
            v = v.astype(dt)
        bufs.append(np.ascontiguousarray(v).view(np.uint8).copy())
    return bufs


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------

def _split(buf: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    edges = np.cumsum([0, *sizes])
    assert edges[-1] == len(buf), (edges[-1], len(buf))
    return [buf[edges[i]: edges[i + 1]] for i in range(len(sizes))]


def _reduce(op: ReduceOp, parts: Sequence[np.ndarray], dtype) -> np.ndarray:
    """Elementwise reduction of byte arrays viewed as ``dtype``, combined in the given (rank) order."""
    views = [p.view(dtype) for p in parts]
    fn = {ReduceOp.SUM: np.add, ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}[op]
    acc = functools.reduce(lambda a, x: fn(a, x), views[1:], views[0].copy())
    return np.ascontiguousarray(acc).view(np.uint8)


def _torch_reference(name, spec, world, root, sizes, inputs, dtype):
    """torch.distributed semantics (all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
    all_to_all_single, broadcast, gather, reduce, scatter and the V forms) from the package's torch
    reference (purlin_sglang.reference) over the byte buffers viewed as ``dtype`` (bytes for copies),
    or None for an unnamed collective."""
    dt = np.dtype(np.uint8 if dtype is None or spec.consume.is_copy else dtype)
    item = dt.itemsize
    xs = [torch.from_numpy(np.ascontiguousarray(b).view(dt).copy()) for b in inputs]
    op = "sum" if spec.consume.is_copy else spec.consume.reduce.value

    def elems(nbytes) -> list[int]:
        return [n // item for n in nbytes]

    base = name[:-2] if name.endswith("_v") else name
    if base == "all_reduce":
        outs = [R.all_reduce(xs, r, op) for r in range(world)]
    elif base == "all_gather":
        outs = [R.all_gather(xs, r) for r in range(world)]
    elif base == "reduce_scatter":
        outs = [R.reduce_scatter_v(xs, r, elems(sizes[c].output[0] for c in range(world)), op) for r in range(world)]
    elif base == "all_to_all":
        outs = [R.all_to_all_v(xs, r, [elems(sizes[p].input) for p in range(world)]) for r in range(world)]
    elif base == "broadcast":
        outs = [R.broadcast(xs, r, root) for r in range(world)]
    elif base == "gather":
        outs = [R.gather(xs, r, root) for r in range(world)]
    elif base == "reduce":
        outs = [R.reduce(xs, r, root, op) for r in range(world)]
    elif base == "scatter":
        outs = [R.scatter(xs, r, root, elems(sizes[root].input)) for r in range(world)]
    else:
        return None
    return [None if t is None else t.contiguous().numpy().view(np.uint8).copy() for t in outs]


def _naming_reference(spec, world, root, sizes, inputs, dtype):
    """The naming rules of CollectiveSpec: p sends its input slice c (or its whole packed input)
    to c; it lands in c's output slice p (sliced output) or is reduced into / copied to the whole
    output (packed output)."""
    prods, cons = producers(spec, world, root), consumers(spec, world, root)

    def sent(p: int, c: int) -> np.ndarray:
        return _split(inputs[p], sizes[p].input)[c] if spec.input.sliced else inputs[p]

    outs: list[np.ndarray | None] = []
    for c in range(world):
        if c not in cons:
            outs.append(None)
        elif spec.output.sliced:
            outs.append(np.concatenate([sent(p, c) for p in range(world)]))
        elif spec.consume.is_copy:
            (p,) = prods
            outs.append(sent(p, c).copy())
        else:
            outs.append(_reduce(spec.consume.reduce, [sent(p, c) for p in prods], dtype))
    return outs


def reference_outputs(spec, world, root, sizes, inputs, dtype, *, use_naming: bool = False):
    """Expected output bytes per rank (None: the rank's output must stay untouched)."""
    ref = None if use_naming else _torch_reference(spec.name, spec, world, root, sizes, inputs, dtype)
    if ref is None:
        ref = _naming_reference(spec, world, root, sizes, inputs, dtype)
    return ref


# ---------------------------------------------------------------------------------------------
# The simulator
# ---------------------------------------------------------------------------------------------

class SimulationError(AssertionError):
    """Base of every failure the simulator detects."""


class DeadlockError(SimulationError):
    pass


class RaceError(SimulationError):
    pass


class ProtocolError(SimulationError):
    pass


class OutputError(SimulationError):
    pass


@dataclass
class CallSetup:
    """One collective call on every rank: lowered schedules, input bytes, expected outputs."""

    schedules: Sequence[Schedule]
    inputs: Sequence[np.ndarray]
    expected: Sequence[np.ndarray | None]
    dtype: object = None  # element dtype of reductions
    name: str = ""
    inplace: bool = False  # every rank's output IS its input buffer (in-place all_reduce / broadcast)


@dataclass(frozen=True)
class Tag:
    producer: int
    item: int
    call: int
    chunk: int

    def __str__(self) -> str:
        return f"(r{self.producer} item{self.item} call{self.call} chunk{self.chunk})"


@dataclass
class SimResult:
    outputs: list[list[np.ndarray]]  # [call][rank]
    steps: int
    trace: list = field(default_factory=list)


POISON = 0xFF  # every output byte starts as 0xFF (a NaN for float32/float64 views)
PACKET_OPS = (PacketPut, PacketCopy, PacketReduce)


def _moves_packets(op) -> bool:
    """A packet op the CUDA encoder keeps, as the kernel runs it: an empty one still moves one packet
    (the lowering leaves no packet op in a call that moves nothing; a call with none leaves the epoch),
    except a copy of 0 bytes from my own input, which the encoder drops."""
    if isinstance(op, PacketCopy):
        return op.dst.nbytes > 0 or op.src.buf is Buf.WINDOW
    return isinstance(op, PACKET_OPS)


def _window_srcs(op) -> list[Span]:
    srcs = (op.src,) if isinstance(op, PacketCopy) else op.srcs if isinstance(op, PacketReduce) else ()
    return [x for x in srcs if x.buf is Buf.WINDOW]


class _Sim:
    def __init__(self, calls: Sequence[CallSetup], world: int, staging_bytes: int, seed: int,
                 stickiness: float, trace_len: int = 24):
        self.calls, self.world = list(calls), world
        self.rng = random.Random(seed)
        self.stickiness = stickiness
        self.staging = [np.zeros(staging_bytes, np.uint8) for _ in range(world)]
        self.stag = [np.full(staging_bytes, -1, np.int64) for _ in range(world)]  # tag id per byte
        self.tags: list[Tag] = []
        self.tag_span: list[tuple[int, int]] = []
        self.tag_readers: list[list[tuple[int, int]]] = []  # (consumer, mailbox position) per tag
        self.notify: dict = defaultdict(int)  # (p, c, i) -> count (== producer's "sent" mirror)
        self.ack: dict = defaultdict(int)  # (p, c, i)
        self.expect: dict = defaultdict(int)  # (p, c, i): consumer's running count of notify waits
        self.mailbox: dict = defaultdict(list)  # (p, c, i) -> tag id published by each notify
        self.last_write: dict = {}  # (p, i) -> tag id of p's latest write of item i
        self.writes: dict = defaultdict(int)  # (p, call, i) -> writes of item i in this call
        self.ci = [0] * world
        self.pc = [0] * world
        self.inputs = [[np.asarray(c.inputs[r], np.uint8).copy() for r in range(world)] for c in self.calls]
        self.outputs = []
        self.written = []
        for c in self.calls:
            for r in range(world):
                if c.schedules[r].plan.rank != r or c.schedules[r].plan.world != world:
                    raise ProtocolError(f"call {c.name}: schedule {r} is for rank {c.schedules[r].plan.rank}")
            if c.inplace:
                k = len(self.outputs)
                for r in range(world):
                    if len(self.inputs[k][r]) != sum(c.schedules[r].sizes.output):
                        raise ProtocolError(f"call {c.name}: in place, but rank {r}'s output size differs")
                self.outputs.append(self.inputs[k])  # the same arrays: writes to out change in
            else:
                self.outputs.append([np.full(sum(c.schedules[r].sizes.output), POISON, np.uint8)
                                     for r in range(world)])
            self.written.append([np.zeros(sum(c.schedules[r].sizes.output), np.int32) for r in range(world)])
        self.trace: deque = deque(maxlen=trace_len)
        self.steps = 0
        # packets: epoch[k][r] of call k on rank r; windows[(owner, parity, producer)] = [epoch, bytes, read]
        self.epoch, n = [], [0] * world
        for c in self.calls:
            self.epoch.append([n[r] + 1 for r in range(world)])
            n = [n[r] + any(_moves_packets(op) for op in c.schedules[r].ops) for r in range(world)]
        self.windows: dict = {}

    # -- state queries ------------------------------------------------------------------------
    def _op(self, r: int):
        while self.ci[r] < len(self.calls):
            ops = self.calls[self.ci[r]].schedules[r].ops
            if self.pc[r] < len(ops):
                return ops[self.pc[r]]
            self.ci[r] += 1
            self.pc[r] = 0
        return None

    def _ready(self, r: int, op) -> bool:
        if isinstance(op, WaitSignal):
            if op.kind == "notify":
                return self.notify[op.peer, r, op.item] >= self.expect[op.peer, r, op.item] + 1
            if op.kind == "ack":
                return self.ack[r, op.peer, op.item] >= self.notify[r, op.peer, op.item] - op.lag
            raise ProtocolError(f"rank {r}: unknown wait kind {op.kind!r}")
        if isinstance(op, WaitDrainAll):
            return all(self.ack[r, c, i] >= self.notify[r, c, i] for c in op.peers for i in range(op.items))
        if _moves_packets(op):
            e = self.epoch[self.ci[r]][r]
            return all(self.windows.get((r, e & 1, x.rank), (0,))[0] == e for x in _window_srcs(op))
        return True

    def _where(self, r: int) -> str:
        c = self.calls[self.ci[r]]
        return f"rank {r} call {self.ci[r]} ({c.name or c.schedules[r].plan.spec.name}) op #{self.pc[r]}"

    def _trace_text(self) -> str:
        return "\n".join(f"    r{r} c{ci} #{pc}: {op}" for r, ci, pc, op in self.trace)

    def _blocked_text(self) -> str:
        lines = []
        for r in range(self.world):
            op = self._op(r)
            if op is None:
                lines.append(f"  rank {r}: finished")
                continue
            detail = ""
            if isinstance(op, WaitSignal) and op.kind == "notify":
                detail = f"notify[{op.peer},{r},{op.item}]={self.notify[op.peer, r, op.item]}, " \
                         f"needs {self.expect[op.peer, r, op.item] + 1}"
            elif isinstance(op, WaitSignal):
                detail = f"ack[{r},{op.peer},{op.item}]={self.ack[r, op.peer, op.item]}, needs " \
                         f"{self.notify[r, op.peer, op.item] - op.lag}"
            elif isinstance(op, WaitDrainAll):
                missing = [(c, i, self.ack[r, c, i], self.notify[r, c, i]) for c in op.peers
                           for i in range(op.items) if self.ack[r, c, i] < self.notify[r, c, i]]
                detail = f"undrained (peer, item, acks, notifies): {missing}"
            elif isinstance(op, PACKET_OPS):
                e = self.epoch[self.ci[r]][r]
                seen = {x.rank: self.windows.get((r, e & 1, x.rank), (0,))[0] for x in _window_srcs(op)}
                detail = f"needs packets of epoch {e}; the windows (producer: epoch) hold {seen}"
            lines.append(f"  {self._where(r)} blocked on {op}: {detail}")
        return "\n".join(lines)

    # -- buffers --------------------------------------------------------------------------------
    def _buf(self, r: int, span: Span, writing: bool) -> np.ndarray:
        if span.buf is Buf.STAGE:
            if writing and span.rank != r:
                raise ProtocolError(f"{self._where(r)}: writes rank {span.rank}'s staging {span}; "
                                    "the simulator models the pull protocol only (stage into your own)")
            base = self.staging[span.rank]
        else:
            if span.rank != r:
                raise ProtocolError(f"{self._where(r)}: touches another rank's user buffer {span}")
            base = (self.inputs if span.buf is Buf.INPUT else self.outputs)[self.ci[r]][r]
            if writing and span.buf is Buf.INPUT:
                raise ProtocolError(f"{self._where(r)}: writes its input {span}")
        if span.offset < 0 or span.nbytes < 0 or span.offset + span.nbytes > len(base):
            raise ProtocolError(f"{self._where(r)}: span {span} overruns its buffer of {len(base)} bytes")
        return base

    def _item_of(self, r: int, span: Span) -> int:
        plan = self.calls[self.ci[r]].schedules[r].plan
        per_item = plan.chunk_bytes * plan.slots
        item = span.offset // per_item
        if (span.offset + span.nbytes - 1) // per_item != item:
            raise ProtocolError(f"{self._where(r)}: staging span {span} crosses an item boundary")
        return item

    def _read(self, r: int, span: Span) -> np.ndarray:
        base = self._buf(r, span, writing=False)
        if span.buf is Buf.STAGE and span.nbytes:
            self._check_read(r, span)
        return base[span.offset: span.offset + span.nbytes].copy()

    def _check_read(self, r: int, span: Span) -> None:
        p, i = span.rank, self._item_of(r, span)
        if p == r:
            tid = self.last_write.get((r, i))
            what = f"its own latest write of item {i}"
        else:
            e = self.expect[p, r, i]
            box = self.mailbox[p, r, i]
            if e == 0 or e > len(box):
                raise RaceError(f"{self._where(r)}: reads {span} (rank {p} item {i}) before any notify of it")
            if self.ack[p, r, i] >= e:
                raise RaceError(f"{self._where(r)}: reads {span} after acknowledging that chunk")
            tid = box[e - 1]
            what = f"the chunk published by notify #{e} of rank {p} item {i}"
        tags = np.unique(self.stag[p][span.offset: span.offset + span.nbytes])
        lo, n = self.tag_span[tid] if tid is not None else (0, -1)
        ok = (tid is not None and len(tags) == 1 and tags[0] == tid and lo <= span.offset
              and span.offset + span.nbytes <= lo + n and self.tags[tid].call == self.ci[r])
        if not ok:
            seen = [str(self.tags[t]) if t >= 0 else "never written" for t in tags]
            want = str(self.tags[tid]) if tid is not None else "none"
            raise RaceError(
                f"{self._where(r)}: reads staging {span} expecting {what} = {want} at "
                f"[{lo}:{lo + n}], but the bytes hold {seen}\n  recent ops:\n{self._trace_text()}")

    def _write(self, r: int, span: Span, data: np.ndarray) -> None:
        base = self._buf(r, span, writing=True)
        if len(data) != span.nbytes:
            raise ProtocolError(f"{self._where(r)}: writes {len(data)} bytes into {span}")
        if span.buf is Buf.STAGE:
            i = self._item_of(r, span) if span.nbytes else span.offset // self._per_item(r)
            for t in np.unique(self.stag[r][span.offset: span.offset + span.nbytes]):
                if t < 0:
                    continue
                tag = self.tags[t]
                for c, pos in self.tag_readers[t]:
                    if self.ack[r, c, tag.item] <= pos:
                        raise RaceError(
                            f"{self._where(r)}: overwrites staging {span} holding chunk {tag} before reader "
                            f"rank {c} acknowledged it (acks {self.ack[r, c, tag.item]}, needs {pos + 1})"
                            f"\n  recent ops:\n{self._trace_text()}")
            key = (r, self.ci[r], i)
            tid = len(self.tags)
            self.tags.append(Tag(r, i, self.ci[r], self.writes[key]))
            self.tag_span.append((span.offset, span.nbytes))
            self.tag_readers.append([])
            self.writes[key] += 1
            self.last_write[r, i] = tid
            self.stag[r][span.offset: span.offset + span.nbytes] = tid
        elif span.buf is Buf.OUTPUT:
            self.written[self.ci[r]][r][span.offset: span.offset + span.nbytes] += 1
        base[span.offset: span.offset + span.nbytes] = data

    def _per_item(self, r: int) -> int:
        plan = self.calls[self.ci[r]].schedules[r].plan
        return plan.chunk_bytes * plan.slots

    # -- one step -----------------------------------------------------------------------------
    def _exec(self, r: int, op) -> None:
        self.trace.append((r, self.ci[r], self.pc[r], op))
        if isinstance(op, Copy):
            if op.dst.nbytes != op.src.nbytes:
                raise ProtocolError(f"{self._where(r)}: copy of unequal spans {op.src} -> {op.dst}")
            self._write(r, op.dst, self._read(r, op.src))
        elif isinstance(op, Reduce):
            self._reduce(r, op, [self._read(r, s) for s in op.srcs])
        elif isinstance(op, PacketPut):  # an empty push still lands (one empty packet)
            self._push(r, op)
        elif isinstance(op, (PacketCopy, PacketReduce)):
            srcs = (op.src,) if isinstance(op, PacketCopy) else op.srcs
            parts = [self._pull(r, x) if x.buf is Buf.WINDOW else None for x in srcs]  # empty ones too
            if op.dst.nbytes:
                parts = [self._read(r, x) if p is None else p for x, p in zip(srcs, parts)]
                if isinstance(op, PacketCopy):
                    if op.src.nbytes != op.dst.nbytes:
                        raise ProtocolError(f"{self._where(r)}: packet copy of unequal spans {op.src} -> {op.dst}")
                    self._write(r, op.dst, parts[0])
                else:
                    self._reduce(r, op, parts)
        elif isinstance(op, Signal):
            if op.peer == r or not 0 <= op.peer < self.world:
                raise ProtocolError(f"{self._where(r)}: signals rank {op.peer}")
            if op.kind == "notify":
                key = (r, op.peer, op.item)
                tid = self.last_write.get((r, op.item))
                if tid is None or self.tags[tid].call != self.ci[r]:
                    raise ProtocolError(f"{self._where(r)}: notifies item {op.item} to rank {op.peer} "
                                        "without having staged it in this call")
                box = self.mailbox[key]
                if box and box[-1] == tid:
                    raise ProtocolError(f"{self._where(r)}: notifies the same chunk {self.tags[tid]} of item "
                                        f"{op.item} to rank {op.peer} twice")
                self.tag_readers[tid].append((op.peer, len(box)))
                box.append(tid)
                self.notify[key] += 1
            elif op.kind == "ack":
                key = (op.peer, r, op.item)
                self.ack[key] += 1
                if self.ack[key] > self.expect[key]:
                    raise ProtocolError(f"{self._where(r)}: acknowledges chunk {self.ack[key]} of rank "
                                        f"{op.peer} item {op.item} before waiting for it")
            else:
                raise ProtocolError(f"{self._where(r)}: unknown signal kind {op.kind!r}")
        elif isinstance(op, WaitSignal):
            if op.kind == "notify":
                self.expect[op.peer, r, op.item] += 1
        elif isinstance(op, WaitDrainAll):
            pass
        else:
            raise ProtocolError(f"{self._where(r)}: unknown op {op!r}")
        self.pc[r] += 1
        self.steps += 1

    def _reduce(self, r: int, op, parts: list) -> None:
        dtype = self.calls[self.ci[r]].dtype
        if dtype is None:
            raise ProtocolError(f"{self._where(r)}: a reduce in a call without an element dtype")
        size = np.dtype(dtype).itemsize
        for s in (op.dst, *op.srcs):
            if s.nbytes != op.dst.nbytes:
                raise ProtocolError(f"{self._where(r)}: reduce spans of unequal length: {op}")
            if s.buf is not Buf.WINDOW and (s.offset % size or s.nbytes % size):
                raise ProtocolError(f"{self._where(r)}: reduce span {s} is not aligned to {size}-byte elements")
        if not parts:
            raise ProtocolError(f"{self._where(r)}: a reduce without sources")
        self._write(r, op.dst, _reduce(op.op, parts, dtype))

    def _push(self, r: int, op: PacketPut) -> None:
        """My input span, whole, into ``op.peer``'s window [parity][me] with this call's epoch."""
        if op.src.buf is not Buf.INPUT or op.peer == r or not 0 <= op.peer < self.world:
            raise ProtocolError(f"{self._where(r)}: pushes {op.src} to rank {op.peer}")
        if op.src.nbytes > PACKET_WINDOW_BYTES:
            raise ProtocolError(f"{self._where(r)}: pushes {op.src.nbytes} bytes, a window holds {PACKET_WINDOW_BYTES}")
        e = self.epoch[self.ci[r]][r]
        key = (op.peer, e & 1, r)
        old = self.windows.get(key)
        if old is not None and old[0] == e:
            raise ProtocolError(f"{self._where(r)}: pushes twice into rank {op.peer}'s window in one call")
        if old is not None and not old[2]:
            raise RaceError(f"{self._where(r)}: overwrites rank {op.peer}'s window [{e & 1}][{r}] holding the "
                            f"packets of epoch {old[0]}, which rank {op.peer} has not read yet"
                            f"\n  recent ops:\n{self._trace_text()}")
        self.windows[key] = [e, self._read(r, op.src), False]

    def _pull(self, r: int, x: Span) -> np.ndarray:
        """The packets ``x.rank`` pushed me in this call (readiness waited for their epoch)."""
        w = self.windows[r, self.epoch[self.ci[r]][r] & 1, x.rank]
        if x.offset != 0 or len(w[1]) != x.nbytes:
            raise ProtocolError(f"{self._where(r)}: reads {x}, but rank {x.rank} pushed {len(w[1])} bytes")
        w[2] = True
        return w[1]

    def run(self) -> SimResult:
        last = None
        while True:
            ready = []
            for r in range(self.world):
                op = self._op(r)
                if op is not None and self._ready(r, op):
                    ready.append((r, op))
            if not ready:
                if all(self._op(r) is None for r in range(self.world)):
                    break
                raise DeadlockError(f"deadlock after {self.steps} steps:\n{self._blocked_text()}"
                                    f"\n  recent ops:\n{self._trace_text()}")
            pick = None
            if last is not None and self.rng.random() < self.stickiness:
                pick = next((x for x in ready if x[0] == last), None)
            if pick is None:
                pick = ready[self.rng.randrange(len(ready))]
            last = pick[0]
            self._exec(*pick)
        self._check_end()
        return SimResult(self.outputs, self.steps)

    def _check_end(self) -> None:
        for (owner, parity, producer), (e, _, read) in self.windows.items():
            if not read:
                raise ProtocolError(f"after all calls: rank {owner} never read the packets of epoch {e} that "
                                    f"rank {producer} pushed it")
        for key in set(self.notify) | set(self.expect) | set(self.ack):
            n, e, a = self.notify[key], self.expect[key], self.ack[key]
            if not n == e == a:
                p, c, i = key
                raise ProtocolError(f"after all calls: rank {p} notified rank {c} {n} times for item {i}, "
                                    f"which waited {e} times and acknowledged {a} times")
        for k, call in enumerate(self.calls):
            for r in range(self.world):
                want, got, w = call.expected[r], self.outputs[k][r], self.written[k][r]
                name = call.name or call.schedules[r].plan.spec.name
                if want is None:
                    if w.any():
                        raise OutputError(f"call {k} ({name}): rank {r} consumes nothing but wrote "
                                          f"{int((w > 0).sum())} output bytes")
                    continue
                if len(w) and (w.min() != 1 or w.max() != 1):
                    bad = np.flatnonzero(w != 1)
                    raise OutputError(f"call {k} ({name}): rank {r} output bytes written {w[bad[0]]} times "
                                      f"(first at byte {bad[0]}, {len(bad)} bytes not written exactly once)")
                if len(want) != len(got) or not np.array_equal(want, got):
                    bad = np.flatnonzero(want != got) if len(want) == len(got) else [-1]
                    raise OutputError(f"call {k} ({name}): rank {r} output differs from the reference "
                                      f"(len {len(got)} vs {len(want)}, first bad byte {bad[0]} of {len(bad)})")


def lower_all(spec: CollectiveSpec, world: int, root: int | None, sizes: Sequence[Sizes], *,
              staging_bytes: int, policy=None, nbytes: int | None = None) -> list[Schedule]:
    """Plan and lower ``spec`` on every rank (test glue; the references above never use it)."""
    from purlin_sglang.snac import lower, make_plan

    plans = [make_plan(spec, world, r, root=root, nbytes=nbytes, staging_bytes=staging_bytes, policy=policy)
             for r in range(world)]
    return [lower(p, s) for p, s in zip(plans, sizes)]


def simulate(calls: Sequence[CallSetup], *, world: int, staging_bytes: int, seed: int = 0,
             stickiness: float = 0.0) -> SimResult:
    """Run ``calls`` (in order, on every rank) on one simulated workspace; raise on any violation.

    ``stickiness``: the probability of letting the last rank run again (when it is runnable),
    which lets ranks run far ahead of each other; 0 is a uniform random interleaving.
    """
    return _Sim(calls, world, staging_bytes, seed, stickiness).run()
