"""Property tests of SNAC plans and their lowering, and protocol simulation of whole calls.

Workloads are random: a naming (every catalog spec, rooted user specs such as gather / reduce /
scatter, and every naming check_spec accepts), world 1..8, a random root, globally consistent
per-rank sizes (0 included, not multiples of 16 bytes), a staging buffer small enough to force
many chunks, 1..3 slots, and every algorithm (``packet`` forced: the collectives with a packet
form push into receive windows, the others run ``oneshot``).

Static properties check every rank's lowered op list; the simulator (tests/snac/simulator.py)
then runs all ranks together with random interleavings and checks deadlock freedom, slot-reuse
races and the outputs against references written from torch.distributed semantics.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simulator as S
from purlin_sglang.collectives import CATALOG, CollectiveSpec, Consume, ReduceOp
from purlin_sglang.snac import (
    Buf, Copy, PacketCopy, PacketReduce, Reduce, Schedule, Signal, Sizes, Span, TuningPolicy, WaitDrainAll,
    WaitSignal, make_plan,
)

ROW_BYTES = (1, 2, 3, 4, 6, 8, 12, 16, 24)
NAMED = sorted(S.NAMED_SPECS.values(), key=lambda s: s.name)
NAMINGS = S.all_valid_namings()
ALL_SPECS = NAMED + NAMINGS  # hypothesis samples lists unevenly: parametrize over specs instead
REDUCE_SPECS = [s for s in ALL_SPECS if not s.consume.is_copy]
by_spec = pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass
class Workload:
    spec: CollectiveSpec
    world: int
    root: int | None
    policy: TuningPolicy
    nbytes: int | None
    sizes: list
    dtype: object  # numpy element dtype for reductions, None for copies
    staging_bytes: int = 0
    schedules: list | None = None

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return (f"Workload({self.spec}, world={self.world}, root={self.root}, policy={self.policy!r}, "
                f"nbytes={self.nbytes}, staging_bytes={self.staging_bytes}, dtype={self.dtype}, "
                f"sizes={[(s.input, s.output) for s in self.sizes]})")


def _n_items(spec, world, root, policy, nbytes) -> int:
    return make_plan(spec, world, 0, root=root, nbytes=nbytes, staging_bytes=1 << 30, policy=policy).n_items


@st.composite
def call_shapes(draw, world=None, specs=None, max_rows=8):
    """A naming with a root, op, dtype, policy and consistent sizes (staging is chosen later)."""
    spec = draw(st.sampled_from(specs if specs is not None else NAMED + NAMINGS))
    if not spec.consume.is_copy:
        spec = spec.with_consume(Consume(draw(st.sampled_from(list(ReduceOp)))))
    world = world if world is not None else draw(st.integers(1, 8))
    root = draw(st.integers(0, world - 1)) if spec.rooted else None
    if spec.consume.is_copy:
        dtype = None
        row_bytes = draw(st.sampled_from(ROW_BYTES))
    else:
        size = draw(st.sampled_from([1, 2, 4, 8]))
        dtype = draw(st.sampled_from(S.REDUCE_DTYPES[size]))
        row_bytes = draw(st.sampled_from([b for b in ROW_BYTES if b % size == 0]))
    rows = st.integers(0, max_rows)
    m = [[draw(rows) * row_bytes for _ in range(world)] for _ in range(world)]
    junk = [[draw(rows) * row_bytes for _ in range(world)] for _ in range(world)]
    sizes = S.consistent_sizes(spec, world, root, m, junk)
    algorithm = draw(st.sampled_from(["auto", "oneshot", "twoshot", "packet"]))
    policy = TuningPolicy(algorithm=algorithm, slots=draw(st.integers(1, 3)),
                          oneshot_max_bytes=draw(st.sampled_from([0, 64, 256, 1 << 20])),
                          max_chunk_bytes=draw(st.sampled_from([16, 40, 64, 4 << 20])))
    nbytes = draw(st.sampled_from([None, sum(sizes[0].input)]))
    return Workload(spec, world, root, policy, nbytes, sizes, dtype)


def _staging(draw, need: int) -> int:
    """need = n_items * slots (max over the calls): room for 1..4 chunks of 16 bytes, plus slack
    (a packet plan stages nothing: need 0 still gets a staging buffer)."""
    need = max(need, 1)
    return need * 16 * draw(st.integers(1, 4)) + draw(st.integers(0, need * 16 - 1))


@st.composite
def workloads(draw, **kw):
    w = draw(call_shapes(**kw))
    need = _n_items(w.spec, w.world, w.root, w.policy, w.nbytes) * w.policy.slots
    w.staging_bytes = _staging(draw, need)
    w.schedules = lower_workload(w)
    return w


def lower_workload(w: Workload) -> list[Schedule]:
    return S.lower_all(w.spec, w.world, w.root, w.sizes, staging_bytes=w.staging_bytes, policy=w.policy,
                       nbytes=w.nbytes)


WRITES = (Copy, Reduce, PacketCopy, PacketReduce)


def _ops(sched, kind):
    return [op for op in sched.ops if isinstance(op, kind)]


def _stage_spans(sched):
    for op in sched.ops:
        if isinstance(op, Copy):
            spans = (op.dst, op.src)
        elif isinstance(op, Reduce):
            spans = (op.dst, *op.srcs)
        else:
            continue
        yield from (s for s in spans if s.buf is Buf.STAGE)


# -- static properties of every rank's lowered op list ------------------------------------------

@by_spec
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_every_output_byte_is_written_exactly_once(spec, data):
    w = data.draw(workloads(specs=[spec]))
    cons = S.consumers(w.spec, w.world, w.root)
    for r, sched in enumerate(w.schedules):
        dsts = [op.dst for op in sched.ops if isinstance(op, WRITES) and op.dst.buf is Buf.OUTPUT]
        total = sum(w.sizes[r].output)
        assert all(d.rank == r for d in dsts), f"rank {r} writes another rank's output: {dsts}"
        if r not in cons:  # (a packet plan's hear op names a 0-byte region: it waits and writes nothing)
            assert [d for d in dsts if d.nbytes] == [], f"rank {r} consumes nothing but writes {dsts}"
            continue
        assert all(0 <= d.offset <= total and d.nbytes >= 0 for d in dsts)
        pos = 0
        for d in sorted((d for d in dsts if d.nbytes), key=lambda d: d.offset):
            assert d.offset == pos, f"rank {r}: output gap or overlap at {pos}: next span {d}"
            pos += d.nbytes
        assert pos == total, f"rank {r}: output covered up to {pos} of {total} bytes"


@pytest.mark.parametrize("spec", REDUCE_SPECS, ids=lambda s: s.name)
@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_reduce_sources_are_every_producer_once_in_rank_order(spec, data):
    w = data.draw(workloads(specs=[spec]))
    prods = S.producers(w.spec, w.world, w.root)
    for r, sched in enumerate(w.schedules):
        reduces = _ops(sched, (Reduce, PacketReduce))
        empty_packet_call = sched.plan.algorithm == "packet" and not sched.ops  # moves nothing: no op
        if (r in S.consumers(w.spec, w.world, w.root) or sched.plan.algorithm == "twoshot") and not empty_packet_call:
            assert reduces, f"rank {r} reduces nothing"
        remote = Buf.WINDOW if sched.plan.algorithm == "packet" else Buf.STAGE
        for op in reduces:
            assert op.op is w.spec.consume.reduce
            assert isinstance(op, PacketReduce) == (sched.plan.algorithm == "packet"), op
            ranks = [s.rank for s in op.srcs]
            want = list(range(w.world)) if sched.plan.algorithm == "twoshot" else list(prods)
            assert ranks == want, f"rank {r}: reduce sources from ranks {ranks}, want {want}"
            assert all(s.nbytes == op.dst.nbytes for s in op.srcs), op
            for s in op.srcs:  # my own contribution comes from my input; peers' from their staging (window)
                assert s.buf is (Buf.INPUT if s.rank == r else remote), (r, s)


@by_spec
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_staging_never_overruns(spec, data):
    w = data.draw(workloads(specs=[spec]))
    for r, sched in enumerate(w.schedules):
        plan = sched.plan
        limit = min(w.staging_bytes, plan.n_items * plan.slots * plan.chunk_bytes)
        assert plan.chunk_bytes % 16 == 0 and plan.chunk_bytes >= 16
        assert plan.n_items * plan.slots * plan.chunk_bytes <= w.staging_bytes
        own_high = 0
        for s in _stage_spans(sched):
            assert 0 <= s.offset and s.offset + s.nbytes <= limit, f"rank {r}: {s} outside [0, {limit})"
            assert s.nbytes <= plan.chunk_bytes and s.offset % plan.chunk_bytes == 0, (r, s, plan.chunk_bytes)
            if s.rank == r:
                own_high = max(own_high, s.offset + s.nbytes)
        assert own_high <= sched.staging_used <= w.staging_bytes, (own_high, sched.staging_used)


@by_spec
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_cross_rank_signal_counts_and_bytes_agree(spec, data):
    w = data.draw(workloads(specs=[spec]))
    scheds = w.schedules
    assert len({s.plan.key for s in scheds}) == 1, "ranks disagree on the plan key"
    notify_sent, notify_wait, ack_sent, ack_wait = Counter(), Counter(), Counter(), Counter()
    for r, sched in enumerate(scheds):
        for op in sched.ops:
            if isinstance(op, Signal):
                assert op.peer != r and 0 <= op.peer < w.world and 0 <= op.item < sched.plan.n_items
                if op.kind == "notify":
                    notify_sent[r, op.peer, op.item] += 1
                else:
                    ack_sent[op.peer, r, op.item] += 1  # (producer, consumer, item)
            elif isinstance(op, WaitSignal):
                assert op.peer != r and 0 <= op.peer < w.world and 0 <= op.item < sched.plan.n_items
                if op.kind == "notify":
                    notify_wait[op.peer, r, op.item] += 1
                else:
                    assert 0 <= op.lag < sched.plan.slots
                    ack_wait[r, op.peer, op.item] += 1
    assert notify_sent == notify_wait, "notifies sent != notify waits (producer, consumer, item)"
    assert ack_sent == notify_sent, "every notified chunk must be acknowledged exactly once"
    assert set(ack_wait) <= set(notify_sent)
    for p in range(w.world):
        for c in range(w.world):
            assert scheds[p].send_bytes[c] == scheds[c].recv_bytes[p], (p, c)
        assert scheds[p].send_bytes[p] == 0 and scheds[p].recv_bytes[p] == 0


# -- protocol simulation ------------------------------------------------------------------------

def _setup(w: Workload, rng: np.random.Generator, schedules=None) -> S.CallSetup:
    inputs = S.make_inputs(w.sizes, w.dtype, rng)
    expected = S.reference_outputs(w.spec, w.world, w.root, w.sizes, inputs, w.dtype)
    return S.CallSetup(schedules or w.schedules, inputs, expected, w.dtype, w.spec.name)


interleavings = st.tuples(st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.5, 0.9, 0.99]))


@by_spec
@settings(max_examples=16, **SETTINGS)
@given(data=st.data())
def test_simulated_call_is_race_free_and_correct(spec, data):
    w = data.draw(workloads(specs=[spec]))
    seed, stick = data.draw(interleavings)
    S.simulate([_setup(w, np.random.default_rng(seed))], world=w.world, staging_bytes=w.staging_bytes,
               seed=seed, stickiness=stick)


PACKED_TO_PACKED = [s for s in ALL_SPECS if not s.input.sliced and not s.output.sliced]


@pytest.mark.parametrize("spec", PACKED_TO_PACKED, ids=lambda s: s.name)
@settings(max_examples=8, **SETTINGS)
@given(data=st.data())
def test_in_place_packed_collectives(spec, data):
    """out IS x (what the API allows for all_reduce and broadcast): no rank may overwrite a part of
    its input that it (or a peer, through its staging) still has to read."""
    w = data.draw(call_shapes(specs=[spec]))
    prods = S.producers(w.spec, w.world, w.root)
    w.sizes = [Sizes(s.input, s.input) if r in prods else Sizes(s.output, s.output) for r, s in enumerate(w.sizes)]
    need = _n_items(w.spec, w.world, w.root, w.policy, w.nbytes) * w.policy.slots
    w.staging_bytes = _staging(data.draw, need)
    w.schedules = lower_workload(w)
    seed, stick = data.draw(interleavings)
    call = _setup(w, np.random.default_rng(seed))
    call.inplace = True
    S.simulate([call], world=w.world, staging_bytes=w.staging_bytes, seed=seed, stickiness=stick)


@st.composite
def call_sequences(draw):
    world = draw(st.integers(1, 6))
    shapes = draw(st.lists(call_shapes(world=world, max_rows=6), min_size=2, max_size=4))
    need = max(_n_items(w.spec, w.world, w.root, w.policy, w.nbytes) * w.policy.slots for w in shapes)
    staging = _staging(draw, need)
    for w in shapes:
        w.staging_bytes = staging
        w.schedules = lower_workload(w)
    return shapes


@settings(max_examples=150, **SETTINGS)
@given(call_sequences(), interleavings)
def test_consecutive_calls_on_one_workspace(calls, inter):
    """Counters and staging persist across calls whose plans lay staging out differently."""
    seed, stick = inter
    rng = np.random.default_rng(seed)
    S.simulate([_setup(w, rng) for w in calls], world=calls[0].world,
               staging_bytes=calls[0].staging_bytes, seed=seed, stickiness=stick)


def test_references_agree_with_the_naming_rules():
    """The torch.distributed references and the generic naming reference are two independent
    formulations; they must agree on every named collective."""
    rng = np.random.default_rng(7)
    checked = 0
    for spec in NAMED:
        for world in (1, 3, 4):
            for root in (range(world) if spec.rooted else [None]):
                m = rng.integers(0, 5, size=(world, world)) * 8
                junk = rng.integers(0, 5, size=(world, world)) * 8
                sizes = S.consistent_sizes(spec, world, root, m.tolist(), junk.tolist())
                dtype = None if spec.consume.is_copy else np.float64
                inputs = S.make_inputs(sizes, dtype, rng)
                a = S.reference_outputs(spec, world, root, sizes, inputs, dtype)
                b = S.reference_outputs(spec, world, root, sizes, inputs, dtype, use_naming=True)
                assert S._torch_reference(spec.name, spec, world, root, sizes, inputs, dtype) is not None
                for x, y in zip(a, b):
                    assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), spec
                checked += 1
    assert checked > 30


# -- the simulator catches broken schedules ------------------------------------------------------

def _broken_workload(name="all_to_all", slots=1):
    """3 ranks, several chunks per item (7 chunks of 32 bytes), tiny staging."""
    spec = CATALOG[name]
    world = 3
    root = 0 if spec.rooted else None
    sizes = S.consistent_sizes(spec, world, root, [[200] * world] * world, [[0] * world] * world)
    w = Workload(spec, world, root, TuningPolicy(slots=slots), None, sizes, None)
    w.staging_bytes = _n_items(spec, world, root, w.policy, None) * slots * 32
    w.schedules = lower_workload(w)
    assert max(len([o for o in s.ops if isinstance(o, Signal) and o.kind == "notify"]) for s in w.schedules) > 6
    return w


def _strip(schedules, keep):
    return [replace(s, ops=tuple(op for op in s.ops if keep(op))) for s in schedules]


SEEDS = range(8)


@pytest.mark.parametrize("stick", [0.0, 0.9])
def test_intact_schedule_passes_the_simulator(stick):
    w = _broken_workload()
    for seed in SEEDS:
        S.simulate([_setup(w, np.random.default_rng(seed))], world=w.world, staging_bytes=w.staging_bytes,
                   seed=seed, stickiness=stick)


@pytest.mark.parametrize("name,slots", [("all_to_all", 1), ("all_gather", 1), ("broadcast", 1), ("broadcast", 2),
                                        ("broadcast", 3)])
def test_simulator_detects_missing_slot_drains(name, slots):
    """Drop the Drain waits (WaitSignal "ack"): producers overwrite slots their readers still need.
    (With slots >= 2 a collective in which every rank also consumes is throttled by its own
    consume waits, so a producer that is not a consumer, the broadcast root, shows the race.)"""
    w = _broken_workload(name, slots)
    broken = _strip(w.schedules, lambda op: not (isinstance(op, WaitSignal) and op.kind == "ack"))
    assert sum(len(s.ops) for s in broken) < sum(len(s.ops) for s in w.schedules)
    # stickiness 1: whichever rank runs first runs until it blocks, so the producer gets ahead
    for seed in SEEDS:
        with pytest.raises(S.RaceError, match="before reader rank"):
            S.simulate([_setup(w, np.random.default_rng(seed), broken)], world=w.world,
                       staging_bytes=w.staging_bytes, seed=seed, stickiness=1.0)
    # uniformly random interleavings find it too
    caught = 0
    for seed in SEEDS:
        try:
            S.simulate([_setup(w, np.random.default_rng(seed), broken)], world=w.world,
                       staging_bytes=w.staging_bytes, seed=seed, stickiness=0.0)
        except S.RaceError:
            caught += 1
    assert caught >= 1, caught


def test_simulator_detects_a_missing_drain_all_between_calls():
    """A two-shot all_reduce then a one-shot all_gather re-lays staging out: without the DrainAll
    prologue (or with one that only drains the new plan's items, the bug fixed in lower.py) the
    all_gather overwrites shards that peers are still reading."""
    world, staging = 3, 128
    shapes = []
    for spec, policy, dtype in ((CATALOG["all_reduce"], TuningPolicy(algorithm="twoshot", slots=1), np.float64),
                                (CATALOG["all_gather"], TuningPolicy(slots=1), None)):
        sizes = S.consistent_sizes(spec, world, None, [[160] * world] * world, [[0] * world] * world)
        w = Workload(spec, world, None, policy, None, sizes, dtype, staging_bytes=staging)
        w.schedules = lower_workload(w)
        shapes.append(w)
    old_style = [replace(s, ops=tuple(
        WaitDrainAll(tuple(sorted({c for it in s.plan.program.items for c in it.readers})), s.plan.n_items)
        if isinstance(op, WaitDrainAll) else op for op in s.ops)) for s in shapes[1].schedules]
    no_drain = _strip(shapes[1].schedules, lambda op: not isinstance(op, WaitDrainAll))
    # stickiness 1: the last rank to publish its shard runs on into the all_gather, overwriting
    # that shard before its readers (who were waiting for it) have read it
    for seed in SEEDS:
        for stick in (0.9, 1.0):
            rng = np.random.default_rng(seed)
            S.simulate([_setup(w, rng) for w in shapes], world=world, staging_bytes=staging, seed=seed,
                       stickiness=stick)
        for second in (old_style, no_drain):
            rng = np.random.default_rng(seed)
            with pytest.raises(S.RaceError, match="before reader rank"):
                S.simulate([_setup(shapes[0], rng), _setup(shapes[1], rng, second)], world=world,
                           staging_bytes=staging, seed=seed, stickiness=1.0)


def test_simulator_detects_reads_before_notify():
    w = _broken_workload()
    broken = _strip(w.schedules, lambda op: not (isinstance(op, WaitSignal) and op.kind == "notify"))
    for seed in SEEDS:
        with pytest.raises(S.RaceError, match="before any notify|expecting"):
            S.simulate([_setup(w, np.random.default_rng(seed), broken)], world=w.world,
                       staging_bytes=w.staging_bytes, seed=seed)


def test_simulator_detects_deadlock():
    w = _broken_workload()
    sched = w.schedules[1]
    ops = list(sched.ops)
    # the LAST notify: counters compare "at least", so an earlier missing notify shifts the
    # chunks (a race the read check reports) and only the last wait starves
    last = max(i for i, op in enumerate(ops) if isinstance(op, Signal) and op.kind == "notify")
    del ops[last]
    broken = list(w.schedules)
    broken[1] = replace(sched, ops=tuple(ops))
    with pytest.raises(S.DeadlockError, match="blocked on"):
        S.simulate([_setup(w, np.random.default_rng(0), broken)], world=w.world, staging_bytes=w.staging_bytes)
    # the FIRST notify missing: every later notify publishes the previous chunk's slot
    ops = list(sched.ops)
    ops.remove(next(op for op in ops if isinstance(op, Signal) and op.kind == "notify"))
    broken[1] = replace(sched, ops=tuple(ops))
    with pytest.raises(S.SimulationError):
        S.simulate([_setup(w, np.random.default_rng(0), broken)], world=w.world, staging_bytes=w.staging_bytes)


def test_simulator_detects_wrong_outputs():
    w = _broken_workload()
    ops = list(w.schedules[2].ops)
    k = next(i for i, op in enumerate(ops) if isinstance(op, Copy) and op.dst.buf is Buf.OUTPUT
             and op.src.buf is Buf.INPUT)
    src = ops[k].src
    ops[k] = Copy(ops[k].dst, replace(src, offset=src.offset + 1 if src.offset == 0 else src.offset - 1))
    broken = list(w.schedules)
    broken[2] = replace(w.schedules[2], ops=tuple(ops))
    with pytest.raises(S.OutputError, match="differs from the reference"):
        S.simulate([_setup(w, np.random.default_rng(0), broken)], world=w.world, staging_bytes=w.staging_bytes)
    # a duplicated output write is caught even when the bytes happen to be right
    ops = list(w.schedules[0].ops)
    k = next(i for i, op in enumerate(ops) if isinstance(op, Copy) and op.dst.buf is Buf.OUTPUT)
    ops.insert(k, ops[k])
    broken = list(w.schedules)
    broken[0] = replace(w.schedules[0], ops=tuple(ops))
    with pytest.raises(S.OutputError, match="exactly once"):
        S.simulate([_setup(w, np.random.default_rng(0), broken)], world=w.world, staging_bytes=w.staging_bytes)


def test_simulator_detects_a_non_consumer_writing_output():
    spec = S.GATHER
    world, root = 3, 1
    sizes = S.consistent_sizes(spec, world, root, [[40] * world] * world, [[24] * world] * world)
    w = Workload(spec, world, root, TuningPolicy(), None, sizes, None, staging_bytes=4096)
    w.schedules = lower_workload(w)
    s0 = w.schedules[0]
    extra = Copy(Span(Buf.OUTPUT, 0, 0, 8), Span(Buf.INPUT, 0, 0, 8))
    broken = [replace(s0, ops=s0.ops + (extra,))] + list(w.schedules[1:])
    S.simulate([_setup(w, np.random.default_rng(0))], world=world, staging_bytes=4096)
    with pytest.raises(S.OutputError, match="consumes nothing"):
        S.simulate([_setup(w, np.random.default_rng(0), broken)], world=world, staging_bytes=4096)


def test_simulator_detects_an_in_place_hazard():
    """In place, a rank that reduces into its output before staging its input stages the result."""
    spec, world = CATALOG["all_reduce"], 2
    w = Workload(spec, world, None, TuningPolicy(algorithm="oneshot"), None, [Sizes((64,), (64,))] * world,
                 np.float64, staging_bytes=4096)
    w.schedules = lower_workload(w)
    o = w.schedules[0].ops
    assert [type(x).__name__ for x in o] == ["WaitDrainAll", "Copy", "Signal", "WaitSignal", "Reduce", "Signal"]
    late_stage = [replace(w.schedules[0], ops=(o[0], o[3], o[4], o[1], o[2], o[5])), w.schedules[1]]
    call = _setup(w, np.random.default_rng(0), late_stage)
    S.simulate([call], world=world, staging_bytes=4096)  # fine out of place
    call = _setup(w, np.random.default_rng(0), late_stage)
    call.inplace = True
    with pytest.raises(S.OutputError, match="rank 1 output differs"):
        S.simulate([call], world=world, staging_bytes=4096)
