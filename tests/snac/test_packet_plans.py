"""The packet protocol's plans (latency regime): which collectives have a packet form, the plan
derived from the naming (pushes into receive windows, one copy per producer or one reduce in rank
order), its lowering at edge sizes (0 bytes, 1 byte, odd counts, a full receive window), the V forms
whose sizes every rank knows (empty slices still push one packet), the regime choice, and the
window-reuse rule that keeps rooted collectives off packets."""

from __future__ import annotations

import numpy as np
import pytest

import simulator as S
from purlin_sglang.collectives import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, CATALOG, REDUCE_SCATTER
from purlin_sglang.errors import PurlinPlanError
from purlin_sglang.snac import (
    Buf, ConsumeStep, PacketCopy, PacketPut, PacketReduce, Plan, Push, RankProgram, TuningPolicy, choose_algorithm,
    has_packet_form, lower, make_plan,
)
from purlin_sglang.snac.planner import _packet, largest_push
from purlin_sglang.snac.policy import PACKET_WINDOW_BYTES

ALL_SPECS = sorted(S.NAMED_SPECS.values(), key=lambda s: s.name) + S.all_valid_namings()
PACKET_SPECS = [s for s in ALL_SPECS if has_packet_form(s)]
FORCED = TuningPolicy(algorithm="packet")
STAGING = 1 << 20


def _lowered(spec, world, nbytes, policy=FORCED):
    """Every rank's packet schedule, ``nbytes`` per push (the naming's one size)."""
    sizes = S.consistent_sizes(spec, world, None, [[nbytes] * world] * world, [[0] * world] * world)
    return S.lower_all(spec, world, None, sizes, staging_bytes=STAGING, policy=policy), sizes


def test_packet_forms_are_the_collectives_without_a_root_whose_sizes_every_rank_knows():
    assert {n for n, s in CATALOG.items() if has_packet_form(s)} == {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v", "reduce_scatter_v"}
    assert not any(has_packet_form(s) for s in S.USER_SPECS.values())  # gather, reduce, scatter (V too)
    for spec in ALL_SPECS:  # all_to_all_v-like namings: a rank knows only its own splits
        both_sliced_v = spec.variable and spec.input.sliced and spec.output.sliced
        assert has_packet_form(spec) == (not spec.rooted and not both_sliced_v), spec
    assert len(PACKET_SPECS) >= 8  # the catalog's six plus user namings like them


@pytest.mark.parametrize("spec", PACKET_SPECS, ids=lambda s: s.name)
def test_packet_plan_is_derived_from_the_naming(spec):
    for world in range(1, 9):
        for me in range(world):
            plan = make_plan(spec, world, me, staging_bytes=STAGING, policy=FORCED)
            assert plan.algorithm == "packet" and plan.program.items == () and plan.program.prologue == ()
            assert (plan.n_items, plan.slots, plan.chunk_bytes) == (0, 1, PACKET_WINDOW_BYTES)
            pushes = [s for s in plan.program.body if isinstance(s, Push)]
            consumes = [s for s in plan.program.body if isinstance(s, ConsumeStep)]
            assert len(pushes) + len(consumes) == len(plan.program.body)
            # every other rank once, rotated from me + 1: the push graph is complete
            assert [s.peer for s in pushes] == [(me + d) % world for d in range(1, world)]
            for s in pushes:
                assert (s.src.buf, s.src.rank, s.src.part) == (Buf.INPUT, me, (0, 1))
                assert s.src.index == (s.peer if spec.input.sliced else None)
            mine = (Buf.INPUT, me, me if spec.input.sliced else None)
            if spec.consume.is_copy:
                assert [c.dst.index for c in consumes] == list(range(world))  # one copy per producer, slice p
                for p, c in enumerate(consumes):
                    assert c.consume.is_copy and c.dst.buf is Buf.OUTPUT and len(c.srcs) == 1
                    (x,) = c.srcs
                    assert (x.buf, x.rank, x.index) == (mine if p == me else (Buf.WINDOW, p, None))
            else:
                (c,) = consumes  # one reduce over every producer in rank order
                assert c.consume == spec.consume and (c.dst.buf, c.dst.index) == (Buf.OUTPUT, None)
                assert [(x.buf, x.rank, x.index) for x in c.srcs] == \
                    [mine if p == me else (Buf.WINDOW, p, None) for p in range(world)]


@pytest.mark.parametrize("spec", PACKET_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096 + 3, PACKET_WINDOW_BYTES])
def test_lowered_packet_schedules_at_edge_sizes(spec, nbytes):
    """Each output byte written exactly once, each push fits a window and lands whole in the
    consumer's window of its producer, one push per consumer, reductions in rank order."""
    for world in (1, 2, 3, 8):
        scheds, sizes = _lowered(spec, world, nbytes)
        for r, sched in enumerate(scheds):
            ops = sched.ops
            if nbytes == 0:  # a call that moves nothing has no op: no rank's epoch moves
                assert ops == () and sched.send_bytes == (0,) * world == sched.recv_bytes
                continue
            assert all(isinstance(op, (PacketPut, PacketCopy, PacketReduce)) for op in ops)
            puts = [op for op in ops if isinstance(op, PacketPut)]
            assert sorted(op.peer for op in puts) == [c for c in range(world) if c != r]  # one region each
            for op in puts:
                assert op.src.buf is Buf.INPUT and op.src.nbytes == nbytes <= PACKET_WINDOW_BYTES
                got = [x for o in scheds[op.peer].ops if not isinstance(o, PacketPut)
                       for x in ((o.src,) if isinstance(o, PacketCopy) else o.srcs)
                       if x.buf is Buf.WINDOW and x.rank == r]
                assert [(x.offset, x.nbytes) for x in got] == [(0, nbytes)], (r, op.peer)  # read once, whole
            dsts = sorted((op.dst for op in ops if not isinstance(op, PacketPut)), key=lambda d: d.offset)
            pos = 0
            for d in dsts:
                assert d.buf is Buf.OUTPUT and d.rank == r and d.offset == pos, (r, dsts)
                pos += d.nbytes
            assert pos == sum(sizes[r].output)
            for op in ops:
                if isinstance(op, PacketReduce):
                    assert [x.rank for x in op.srcs] == list(range(world))
                    assert all(x.nbytes == op.dst.nbytes for x in op.srcs)
                elif isinstance(op, PacketCopy) and op.src.buf is not Buf.WINDOW:
                    assert (op.src.buf, op.src.rank, op.src.nbytes) == (Buf.INPUT, r, op.dst.nbytes)
            assert sched.send_bytes == tuple(0 if c == r else nbytes for c in range(world)) == sched.recv_bytes
            assert sched.staging_used == 0


@pytest.mark.parametrize("spec", [ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL], ids=lambda s: s.name)
def test_a_push_larger_than_a_window_is_refused(spec):
    _lowered(spec, 3, PACKET_WINDOW_BYTES)
    with pytest.raises(PurlinPlanError, match=f"at most {PACKET_WINDOW_BYTES} bytes per call from one rank"):
        _lowered(spec, 3, PACKET_WINDOW_BYTES + 1)


def test_collectives_without_a_packet_form_run_oneshot_even_when_packets_are_forced():
    for spec in ALL_SPECS:
        if has_packet_form(spec):
            continue
        root = 0 if spec.rooted else None
        assert choose_algorithm(spec, 64, FORCED, packets=True, world=4) == "oneshot", spec
        assert choose_algorithm(spec, 64, TuningPolicy(), packets=True, world=4) == "oneshot", spec
        assert make_plan(spec, 4, 1, root=root, nbytes=64, staging_bytes=STAGING, policy=FORCED).algorithm == "oneshot"


V_PACKET_SPECS = [CATALOG["all_gather_v"], CATALOG["reduce_scatter_v"]]


def _v_sizes(spec, world, rows):
    """Every rank's sizes of a V call in which rank (or slice) p carries ``rows[p]`` bytes."""
    m = [[rows[c] if spec.input.sliced else rows[p] for c in range(world)] for p in range(world)]
    return S.consistent_sizes(spec, world, None, m, [[0] * world] * world)


@pytest.mark.parametrize("spec", V_PACKET_SPECS, ids=lambda s: s.name)
def test_v_forms_push_empty_slices_as_packets(spec):
    """A V call with empty slices keeps every push and every window read (one empty packet each way:
    the window-reuse rule); a V call empty on every rank has no op on any rank; every rank computes
    the same largest push, which decides the algorithm alike on all of them."""
    world, rows = 4, [0, 24, 0, 8]
    scheds = S.lower_all(spec, world, None, _v_sizes(spec, world, rows), staging_bytes=STAGING, policy=FORCED)
    for r, sched in enumerate(scheds):
        puts = [op for op in sched.ops if isinstance(op, PacketPut)]
        assert sorted(op.peer for op in puts) == [c for c in range(world) if c != r]
        assert [op.src.nbytes for op in puts] == [rows[op.peer if spec.input.sliced else r] for op in puts]
        reads = sorted(x.rank for op in sched.ops if not isinstance(op, PacketPut)
                       for x in ((op.src,) if isinstance(op, PacketCopy) else op.srcs) if x.buf is Buf.WINDOW)
        assert reads == [p for p in range(world) if p != r]
        assert largest_push(sched.sizes) == 24
    for r, sched in enumerate(S.lower_all(spec, world, None, _v_sizes(spec, world, [0] * world),
                                          staging_bytes=STAGING, policy=FORCED)):
        assert sched.ops == () and largest_push(sched.sizes) == 0


@pytest.mark.parametrize("spec", V_PACKET_SPECS, ids=lambda s: s.name)
def test_v_forms_choose_packets_from_the_groups_largest_push(spec):
    auto, small = TuningPolicy(), TuningPolicy(packet_max_bytes=4096)
    for push, policy, want in ((0, auto, "packet"), (4096, small, "packet"), (4097, small, "oneshot"),
                               (PACKET_WINDOW_BYTES, auto, "oneshot"),  # past packet_max_bytes (64 KiB)
                               (PACKET_WINDOW_BYTES, TuningPolicy(packet_max_bytes=PACKET_WINDOW_BYTES), "packet"),
                               (PACKET_WINDOW_BYTES + 1, FORCED, "packet")):  # forced: the lowering refuses it
        assert choose_algorithm(spec, 8, policy, packets=True, world=4, push=push) == want, (push, policy)
    # without the group's push (what one rank's input says is not the group's), a V form stays staged
    assert choose_algorithm(spec, 8, auto, packets=True, world=4) == "oneshot"
    assert choose_algorithm(spec, 8, auto, packets=False, world=4, push=8) == "oneshot"  # e.g. the CPU engine
    # a tuning table's bands are keyed by this rank's input bytes: never applied to a V form
    assert choose_algorithm(spec, 8, auto, packets=True, world=4, push=8, bands=((1 << 30, "oneshot"),)) == "packet"
    with pytest.raises(PurlinPlanError, match=f"at most {PACKET_WINDOW_BYTES} bytes per call"):
        S.lower_all(spec, 3, None, _v_sizes(spec, 3, [0, PACKET_WINDOW_BYTES + 8, 8]), staging_bytes=STAGING,
                    policy=FORCED)


def test_all_to_all_v_never_takes_packets():
    spec = CATALOG["all_to_all_v"]
    assert choose_algorithm(spec, 8, FORCED, packets=True, world=4, push=8) == "oneshot"
    assert choose_algorithm(spec, 8, TuningPolicy(), packets=True, world=4, push=8) == "oneshot"
    with pytest.raises(PurlinPlanError, match="has no packet form"):
        make_plan(spec, 4, 0, staging_bytes=STAGING, algorithm="packet")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("stick", [0.0, 1.0])
def test_back_to_back_v_packet_calls_with_empty_slices_never_overwrite_an_unread_window(world, stick):
    """V packet calls whose slices are empty for some ranks (one empty packet each way), calls empty
    on every rank (no op, no epoch) and fixed packet calls, back to back: the simulator lets ranks run
    ahead and checks every window read and every overwrite."""
    rng = np.random.default_rng(100 + world)
    calls = []
    for i, spec in enumerate([CATALOG["all_gather_v"], CATALOG["reduce_scatter_v"], ALL_REDUCE,
                              CATALOG["all_gather_v"], CATALOG["reduce_scatter_v"], ALL_GATHER] * 2):
        if spec.variable:
            rows = [0] * world if i == 3 else [8 * ((p + i) % 3) for p in range(world)]  # zeros among them
            sizes = _v_sizes(spec, world, rows)
        else:
            sizes = S.consistent_sizes(spec, world, None, [[24] * world] * world, [[0] * world] * world)
        dtype = None if spec.consume.is_copy else np.float32
        scheds = S.lower_all(spec, world, None, sizes, staging_bytes=4096, policy=FORCED)
        inputs = S.make_inputs(sizes, dtype, rng)
        calls.append(S.CallSetup(scheds, inputs, S.reference_outputs(spec, world, None, sizes, inputs, dtype),
                                 dtype, spec.name))
    for seed in range(4):
        S.simulate(calls, world=world, staging_bytes=4096, seed=seed, stickiness=stick)


def test_auto_takes_packets_while_the_largest_push_fits():
    auto, small = TuningPolicy(), TuningPolicy(packet_max_bytes=4096)
    whole = TuningPolicy(packet_max_bytes=PACKET_WINDOW_BYTES)
    m = auto.packet_max_bytes
    assert m == 64 * 1024 < PACKET_WINDOW_BYTES  # the default threshold, below the window
    for spec in (ALL_GATHER, ALL_REDUCE):  # a packed input: the push is the whole input
        assert choose_algorithm(spec, m, auto, packets=True, world=8) == "packet"
        assert choose_algorithm(spec, m + 1, auto, packets=True, world=8) == "oneshot"
        assert choose_algorithm(spec, PACKET_WINDOW_BYTES, whole, packets=True, world=8) == "packet"
        assert choose_algorithm(spec, PACKET_WINDOW_BYTES + 1, whole, packets=True, world=8) != "packet"
        assert choose_algorithm(spec, 4096, small, packets=True, world=8) == "packet"
        assert choose_algorithm(spec, 4097, small, packets=True, world=8) == "oneshot"
        assert choose_algorithm(spec, 0, auto, packets=True, world=8) == "packet"
        assert choose_algorithm(spec, 8, auto, packets=False, world=8) == "oneshot"  # e.g. the CPU engine
    for spec in (REDUCE_SCATTER, ALL_TO_ALL):  # a sliced input: one slice per consumer
        assert choose_algorithm(spec, 8 * m, auto, packets=True, world=8) == "packet"
        assert choose_algorithm(spec, 8 * m + 8, auto, packets=True, world=8) == "oneshot"
        assert choose_algorithm(spec, 8 * PACKET_WINDOW_BYTES, whole, packets=True, world=8) == "packet"
        assert choose_algorithm(spec, 8 * PACKET_WINDOW_BYTES + 8, whole, packets=True, world=8) == "oneshot"
        assert choose_algorithm(spec, 3 * 4096 + 1, small, packets=True, world=3) == "oneshot"  # rounded up
        assert choose_algorithm(spec, 2 * m, auto, packets=True) == "oneshot"  # no world: whole
        assert choose_algorithm(spec, None, auto, packets=True, world=8) == "oneshot"
    assert choose_algorithm(ALL_REDUCE, None, auto, packets=True, world=8) == "twoshot"
    assert choose_algorithm(ALL_GATHER, 1 << 20, FORCED, packets=True, world=2) == "packet"  # lowering refuses it
    for alg in ("oneshot", "twoshot"):
        assert choose_algorithm(ALL_GATHER, 64, TuningPolicy(algorithm=alg), packets=True, world=2) == "oneshot"
    assert choose_algorithm(ALL_REDUCE, 64, TuningPolicy(algorithm="twoshot"), packets=True, world=2) == "twoshot"


def _call(spec, world, nbytes, rng, scheds=None):
    root = 0 if spec.rooted else None
    sizes = S.consistent_sizes(spec, world, root, [[nbytes] * world] * world, [[nbytes] * world] * world)
    dtype = None if spec.consume.is_copy else np.float32
    if scheds is None:
        scheds = S.lower_all(spec, world, root, sizes, staging_bytes=4096, policy=FORCED)
    inputs = S.make_inputs(sizes, dtype, rng)
    expected = S.reference_outputs(spec, world, root, sizes, inputs, dtype)
    return S.CallSetup(scheds, inputs, expected, dtype, spec.name)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("stick", [0.0, 0.9, 1.0])
def test_back_to_back_packet_calls_never_overwrite_an_unread_window(world, stick):
    """Every packet call pushes between every ordered pair of ranks, so a producer that rewrites a
    window parity (two packet calls later) has received its reader's packets of the call in between:
    the simulator lets ranks run ahead (stickiness 1: a rank runs until it blocks) and checks it.
    A staged call in between advances no epoch."""
    rng = np.random.default_rng(world)
    specs = [ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER, ALL_REDUCE, BROADCAST, ALL_GATHER, ALL_REDUCE, ALL_TO_ALL]
    calls = [_call(spec, world, 24, rng) for spec in specs]
    for seed in range(4):
        S.simulate(calls, world=world, staging_bytes=4096, seed=seed, stickiness=stick)


def test_rooted_packet_plans_would_overwrite_unread_windows():
    """Why rooted collectives have no packet form: a broadcast root waits for nobody, so it can push
    its third call's packets into a window parity its reader has not read yet (the planner's derivation
    applied to a rooted naming, bypassing has_packet_form)."""
    world, root = 3, 0
    sizes = S.consistent_sizes(BROADCAST, world, root, [[40] * world] * world, [[40] * world] * world)
    scheds = [lower(Plan(BROADCAST, world, r, root, "packet", PACKET_WINDOW_BYTES, 1, 0,
                         RankProgram(r, (), (), tuple(_packet(BROADCAST, world, r, root)))), sizes[r])
              for r in range(world)]
    rng = np.random.default_rng(0)
    calls = [_call(BROADCAST, world, 40, rng, scheds) for _ in range(3)]
    S.simulate(calls[:1], world=world, staging_bytes=4096, seed=0, stickiness=1.0)  # one call alone is fine
    with pytest.raises(S.RaceError, match="has not read yet"):
        S.simulate(calls, world=world, staging_bytes=4096, seed=0, stickiness=1.0)
