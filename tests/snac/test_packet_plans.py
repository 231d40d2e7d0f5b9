"""The packet protocol's plans (latency regime): which collectives have a packet form, the plan
derived from the naming (pushes into receive windows, one copy per producer or one reduce in rank
order, one empty packet each way between the ranks a rooted naming leaves silent), its lowering at
edge sizes (0 bytes, 1 byte, odd counts, a full receive window), the V forms whose sizes every rank
knows (empty slices still push one packet), the regime choice, the window-reuse rule that the
empty packets keep for rooted collectives, and the hybrid plans of all_to_all_v (each pair by its
size: packets or a one-shot of the large pairs)."""

from __future__ import annotations

import numpy as np
import pytest

import simulator as S
from purlin_sglang.collectives import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, CATALOG, REDUCE_SCATTER
from purlin_sglang.errors import PurlinPlanError
from purlin_sglang.snac import (
    Beat, Buf, ConsumeStep, Copy, Hear, PacketCopy, PacketPut, PacketReduce, Plan, Push, RankProgram, Signal,
    TuningPolicy, WaitDrainAll, WaitSignal, algorithms_of, choose_algorithm, has_hybrid_form, has_packet_form, lower,
    make_plan,
)
from purlin_sglang.snac.algorithms.packet import program as packet_program
from purlin_sglang.snac.planner import largest_push
from purlin_sglang.snac.policy import PACKET_WINDOW_BYTES

ALL_SPECS = sorted(S.NAMED_SPECS.values(), key=lambda s: s.name) + S.all_valid_namings()
PACKET_SPECS = [s for s in ALL_SPECS if has_packet_form(s)]
FORCED = TuningPolicy(algorithm="packet")
STAGING = 1 << 20


def _root(spec, world):
    """A root that is neither rank 0 nor the last rank where the world allows (None: no root)."""
    return (world // 2) if spec.rooted else None


def _lowered(spec, world, nbytes, policy=FORCED):
    """Every rank's packet schedule, ``nbytes`` per push (the naming's one size)."""
    root = _root(spec, world)
    sizes = S.consistent_sizes(spec, world, root, [[nbytes] * world] * world, [[0] * world] * world)
    return S.lower_all(spec, world, root, sizes, staging_bytes=STAGING, policy=policy), sizes


def _data_pair(spec, world, root, p, c) -> bool:
    """Whether the naming moves a region from p to c (else the pair exchanges one empty packet)."""
    return p in S.producers(spec, world, root) and c in S.consumers(spec, world, root)


def test_packet_forms_are_the_collectives_whose_sizes_every_rank_knows():
    assert {n for n, s in CATALOG.items() if has_packet_form(s)} == {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v", "reduce_scatter_v", "broadcast"}
    user = {n for n, s in S.USER_SPECS.items() if has_packet_form(s)}
    assert user == {n for n, s in S.USER_SPECS.items() if not s.variable} and user  # gather, reduce, scatter
    for spec in ALL_SPECS:  # all_to_all_v-like namings: a rank knows only its own splits; rooted V: the root only
        assert has_packet_form(spec) == (not spec.variable or not (
            spec.rooted or (spec.input.sliced and spec.output.sliced))), spec
    assert len(PACKET_SPECS) >= 12  # the catalog's seven plus user namings like them
    assert any(s.rooted and s.input.rooted for s in PACKET_SPECS) and any(s.output.rooted for s in PACKET_SPECS)


@pytest.mark.parametrize("spec", PACKET_SPECS, ids=lambda s: s.name)
def test_packet_plan_is_derived_from_the_naming(spec):
    for world in range(1, 9):
        for root in (range(world) if spec.rooted else (None,)):
            prods, cons = S.producers(spec, world, root), S.consumers(spec, world, root)
            for me in range(world):
                plan = make_plan(spec, world, me, root=root, staging_bytes=STAGING, policy=FORCED)
                assert plan.algorithm == "packet" and plan.program.items == () and plan.program.prologue == ()
                assert (plan.n_items, plan.slots, plan.chunk_bytes) == (0, 1, PACKET_WINDOW_BYTES)
                body = plan.program.body
                sends = [s for s in body if isinstance(s, (Push, Beat))]
                consumes = [s for s in body if isinstance(s, ConsumeStep)]
                hears = [s for s in body if isinstance(s, Hear)]
                assert body == tuple(sends + consumes + hears)
                # every other rank once, rotated from me + 1: the push graph is complete, a push where the
                # naming moves a region, else one empty packet (a beat), heard after my consumes
                others = [(me + d) % world for d in range(1, world)]
                assert [s.peer for s in sends] == others
                assert [isinstance(s, Push) for s in sends] == [_data_pair(spec, world, root, me, c) for c in others]
                assert [h.peer for h in hears] == [p for p in others if not _data_pair(spec, world, root, p, me)]
                for s in sends:
                    if isinstance(s, Push):
                        assert (s.src.buf, s.src.rank, s.src.part) == (Buf.INPUT, me, (0, 1))
                        assert s.src.index == (s.peer if spec.input.sliced else None)
                if me not in cons:
                    assert consumes == []
                    continue
                mine = (Buf.INPUT, me, me if spec.input.sliced else None)
                if spec.consume.is_copy or spec.output.sliced:
                    want = [p for p in range(world) if p in prods]
                    assert [c.dst.index for c in consumes] == (want if spec.output.sliced else [None] * len(want))
                    for p, c in zip(want, consumes):  # one copy per producer, into slice p (or the whole output)
                        assert c.consume.is_copy and c.dst.buf is Buf.OUTPUT and len(c.srcs) == 1
                        (x,) = c.srcs
                        assert (x.buf, x.rank, x.index) == (mine if p == me else (Buf.WINDOW, p, None))
                else:
                    (c,) = consumes  # one reduce over every producer in rank order
                    assert c.consume == spec.consume and (c.dst.buf, c.dst.index) == (Buf.OUTPUT, None)
                    assert [(x.buf, x.rank, x.index) for x in c.srcs] == \
                        [mine if p == me else (Buf.WINDOW, p, None) for p in prods]


@pytest.mark.parametrize("spec", PACKET_SPECS, ids=lambda s: s.name)
@pytest.mark.parametrize("nbytes", [0, 1, 7, 4096 + 3, PACKET_WINDOW_BYTES])
def test_lowered_packet_schedules_at_edge_sizes(spec, nbytes):
    """Each output byte written exactly once, each push fits a window and lands whole in the
    consumer's window of its producer, one push per other rank (an empty one between the ranks a
    rooted naming leaves silent), reductions in rank order."""
    for world in (1, 2, 3, 8):
        scheds, sizes = _lowered(spec, world, nbytes)
        root = _root(spec, world)
        cons = S.consumers(spec, world, root)
        for r, sched in enumerate(scheds):
            ops = sched.ops
            data = [c for c in range(world) if c != r and _data_pair(spec, world, root, r, c)]
            if nbytes == 0 and not spec.rooted:  # a call that moves nothing has no op: no rank's epoch moves
                assert ops == () and sched.send_bytes == (0,) * world == sched.recv_bytes
                continue
            assert all(isinstance(op, (PacketPut, PacketCopy, PacketReduce)) for op in ops)
            puts = [op for op in ops if isinstance(op, PacketPut)]
            assert sorted(op.peer for op in puts) == [c for c in range(world) if c != r]  # every other rank once
            for op in puts:
                want = nbytes if op.peer in data else 0  # a beat: one empty packet
                assert op.src.buf is Buf.INPUT and op.src.nbytes == want <= PACKET_WINDOW_BYTES
                got = [x for o in scheds[op.peer].ops if not isinstance(o, PacketPut)
                       for x in ((o.src,) if isinstance(o, PacketCopy) else o.srcs)
                       if x.buf is Buf.WINDOW and x.rank == r]
                assert [(x.offset, x.nbytes) for x in got] == [(0, want)], (r, op.peer)  # read once, whole
            dsts = sorted((op.dst for op in ops if not isinstance(op, PacketPut) and op.dst.nbytes),
                          key=lambda d: d.offset)
            pos = 0
            for d in dsts:
                assert d.buf is Buf.OUTPUT and d.rank == r and d.offset == pos, (r, dsts)
                pos += d.nbytes
            assert pos == (sum(sizes[r].output) if r in cons else 0)
            for op in ops:
                if isinstance(op, PacketReduce):
                    assert [x.rank for x in op.srcs] == list(S.producers(spec, world, root))
                    assert all(x.nbytes == op.dst.nbytes for x in op.srcs)
                elif isinstance(op, PacketCopy) and op.src.buf is not Buf.WINDOW:
                    assert (op.src.buf, op.src.rank, op.src.nbytes) == (Buf.INPUT, r, op.dst.nbytes)
            assert sched.send_bytes == tuple(nbytes if c in data else 0 for c in range(world))
            assert sched.recv_bytes == tuple(nbytes if p != r and _data_pair(spec, world, root, p, r) else 0
                                             for p in range(world))
            assert sched.staging_used == 0


@pytest.mark.parametrize("spec", [ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL], ids=lambda s: s.name)
def test_a_push_larger_than_a_window_is_refused(spec):
    _lowered(spec, 3, PACKET_WINDOW_BYTES)
    with pytest.raises(PurlinPlanError, match=f"at most {PACKET_WINDOW_BYTES} bytes per call from one rank"):
        _lowered(spec, 3, PACKET_WINDOW_BYTES + 1)


def test_collectives_without_a_packet_form_run_oneshot_or_hybrid_even_when_packets_are_forced():
    """No packet form: rooted V forms run oneshot; all_to_all_v-like namings run hybrid where the engine
    has packets (auto or forced packets), else oneshot."""
    for spec in ALL_SPECS:
        if has_packet_form(spec):
            continue
        root = 0 if spec.rooted else None
        want = "hybrid" if has_hybrid_form(spec) else "oneshot"
        assert choose_algorithm(spec, 64, FORCED, packets=True, world=4) == want, spec
        assert choose_algorithm(spec, 64, TuningPolicy(), packets=True, world=4) == want, spec
        assert choose_algorithm(spec, 64, TuningPolicy(), packets=False, world=4) == "oneshot", spec
        assert choose_algorithm(spec, 64, TuningPolicy(algorithm="oneshot"), packets=True, world=4) == "oneshot"
        assert make_plan(spec, 4, 1, root=root, nbytes=64, staging_bytes=STAGING, policy=FORCED).algorithm == want


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


def test_all_to_all_v_takes_the_hybrid_plan_never_the_packet_plan():
    spec = CATALOG["all_to_all_v"]
    assert has_hybrid_form(spec) and not has_packet_form(spec)
    assert {n for n, s in CATALOG.items() if has_hybrid_form(s)} == {"all_to_all_v"}
    assert all(has_hybrid_form(s) == (s.variable and s.input.sliced and s.output.sliced and not s.rooted)
               for s in ALL_SPECS)
    assert choose_algorithm(spec, 8, FORCED, packets=True, world=4, push=8) == "hybrid"
    assert choose_algorithm(spec, 1 << 30, TuningPolicy(), packets=True, world=4, push=1 << 30) == "hybrid"
    assert algorithms_of(spec, packets=True) == ("hybrid", "oneshot")
    assert algorithms_of(spec, packets=False) == ("oneshot",)
    with pytest.raises(PurlinPlanError, match="has no packet form"):
        make_plan(spec, 4, 0, staging_bytes=STAGING, algorithm="packet")
    with pytest.raises(PurlinPlanError, match="has no hybrid form"):
        make_plan(ALL_TO_ALL, 4, 0, staging_bytes=STAGING, algorithm="hybrid")
    plan = make_plan(spec, 4, 1, staging_bytes=STAGING, algorithm="hybrid")
    assert plan.pair_max_bytes == TuningPolicy().packet_max_bytes and plan.staged.algorithm == "oneshot"
    assert make_plan(spec, 4, 1, staging_bytes=STAGING, policy=FORCED).pair_max_bytes == PACKET_WINDOW_BYTES
    assert plan.key[-1] == plan.pair_max_bytes  # ranks must agree on it
    assert "staged:" in plan.describe()


A2AV = CATALOG["all_to_all_v"]
SMALL_PAIRS = TuningPolicy(packet_max_bytes=64)  # pairs of more than 64 bytes go staged


def _a2av(world, m, policy=SMALL_PAIRS):
    """Every rank's hybrid all_to_all_v schedule for the send matrix ``m[p][c]`` (bytes)."""
    sizes = S.consistent_sizes(A2AV, world, None, m, [[0] * world] * world)
    plans = [make_plan(A2AV, world, r, staging_bytes=4096, policy=policy, algorithm="hybrid") for r in range(world)]
    return [lower(p, s) for p, s in zip(plans, sizes)], sizes


def _a2av_matrix(world, rng, limit=64):
    """Bytes p sends c: small, empty, just at the limit, just past it and large, own slices too."""
    choice = [0, 8, limit, limit + 8, 200, 1000, 24]
    return [[int(rng.choice(choice)) for _ in range(world)] for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_hybrid_pairs_agree_on_both_ends(world):
    """The two ends of every ordered pair make the same choice from their own sizes: a push of n bytes is
    read as n bytes from that producer's window (n = 0: the pair goes staged, or is empty), a staged
    pair is an item of the producer read by exactly that consumer, and every rank's packet part pushes
    to and reads from every peer once (the window-reuse rule), its staged part only where it has a
    large pair."""
    rng = np.random.default_rng(world)
    for _ in range(6):
        m = _a2av_matrix(world, rng)
        scheds, _ = _a2av(world, m)
        for p, sp in enumerate(scheds):
            assert sp.plan.algorithm == "hybrid" and sp.parts[0].plan.algorithm == "packet"
            packet = sp.parts[0].ops
            puts = {op.peer: op.src.nbytes for op in packet if isinstance(op, PacketPut)}
            reads = {op.src.rank: op.dst.nbytes for op in packet if isinstance(op, PacketCopy)
                     and op.src.buf is Buf.WINDOW}
            assert sorted(puts) == sorted(reads) == [c for c in range(world) if c != p]
            for c in puts:
                small = m[p][c] <= SMALL_PAIRS.packet_max_bytes
                assert puts[c] == (m[p][c] if small else 0)
                creads = {op.src.rank: op.dst.nbytes for op in scheds[c].parts[0].ops
                          if isinstance(op, PacketCopy) and op.src.buf is Buf.WINDOW}
                assert creads[p] == puts[c], (p, c, m)
                staged_p = sp.parts[1].ops if len(sp.parts) > 1 else ()
                staged_c = scheds[c].parts[1].ops if len(scheds[c].parts) > 1 else ()
                notifies = sum(isinstance(op, Signal) and op.kind == "notify" and op.peer == c for op in staged_p)
                waits = sum(isinstance(op, WaitSignal) and op.kind == "notify" and op.peer == p for op in staged_c)
                assert notifies == waits and (notifies > 0) == (not small), (p, c, m)
            big = any(n > 64 for n in m[p]) or any(m[q][p] > 64 for q in range(world))
            assert (len(sp.parts) == 2) == big, (p, m)
            assert sp.ops == tuple(op for part in sp.parts for op in part.ops)
            own = [op for part in sp.parts for op in part.ops
                   if isinstance(op, (Copy, PacketCopy)) and op.src.buf is Buf.INPUT and op.dst.buf is Buf.OUTPUT]
            assert sum(op.dst.nbytes for op in own) == m[p][p]  # my own slice, copied once
            if len(sp.parts) > 1:
                assert not any(isinstance(op, PacketPut) for op in sp.parts[1].ops)
                assert all(isinstance(op, WaitDrainAll) for op in sp.parts[1].ops[:1]
                           if any(isinstance(o, Signal) and o.kind == "notify" for o in sp.parts[1].ops))


def test_hybrid_calls_that_move_nothing_still_run_their_packet_part():
    """A rank whose splits are all zero cannot know that its peers' are too: its packet part pushes one
    empty packet to every peer and reads one from each, so every rank's epoch moves alike."""
    scheds, _ = _a2av(3, [[0, 0, 0], [0, 0, 0], [0, 0, 0]])
    for sc in scheds:
        assert len(sc.parts) == 1
        assert sum(isinstance(op, PacketPut) for op in sc.ops) == 2
        assert sum(isinstance(op, PacketCopy) and op.src.buf is Buf.WINDOW for op in sc.ops) == 2


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("stick", [0.0, 0.9, 1.0])
def test_back_to_back_hybrid_calls_never_overwrite_an_unread_window_or_slot(world, stick):
    """Hybrid all_to_all_v calls with pairs on both sides of the limit, empty ones and calls that move
    nothing, between fixed packet calls and staged calls: the simulator lets ranks run ahead and checks
    every window read and overwrite, every staging slot, and every output."""
    rng = np.random.default_rng(300 + world)
    calls = []
    for i in range(10):
        if i % 4 == 3:
            spec = (ALL_REDUCE, ALL_GATHER)[i % 2]
            calls.append(_call(spec, world, 24, rng))
            continue
        m = [[0] * world for _ in range(world)] if i == 5 else _a2av_matrix(world, rng)
        scheds, sizes = _a2av(world, m)
        inputs = S.make_inputs(sizes, None, rng)
        calls.append(S.CallSetup(scheds, inputs, S.reference_outputs(A2AV, world, None, sizes, inputs, None),
                                 None, "all_to_all_v"))
    assert any(len(sc.parts) == 2 for c in calls if c.name == "all_to_all_v" for sc in c.schedules)
    assert any(len(sc.parts) == 1 for c in calls if c.name == "all_to_all_v" for sc in c.schedules)
    for seed in range(3):
        S.simulate(calls, world=world, staging_bytes=4096, seed=seed, stickiness=stick)


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


def _call(spec, world, nbytes, rng, scheds=None, root=0):
    root = root if spec.rooted else None
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


def test_rooted_packet_plans_without_beats_would_overwrite_unread_windows():
    """Why a rooted packet plan sends empty packets between its silent pairs: without them a broadcast
    root waits for nobody, so it can push its third call's packets into a window parity its reader has
    not read yet (the planner's plan with its beats and hears taken out)."""
    world, root = 3, 0
    sizes = S.consistent_sizes(BROADCAST, world, root, [[40] * world] * world, [[40] * world] * world)
    bodies = [tuple(s for s in packet_program(BROADCAST, world, r, root) if not isinstance(s, (Beat, Hear)))
              for r in range(world)]
    scheds = [lower(Plan(BROADCAST, world, r, root, "packet", PACKET_WINDOW_BYTES, 1, 0,
                         RankProgram(r, (), (), bodies[r])), sizes[r]) for r in range(world)]
    rng = np.random.default_rng(0)
    calls = [_call(BROADCAST, world, 40, rng, scheds) for _ in range(3)]
    S.simulate(calls[:1], world=world, staging_bytes=4096, seed=0, stickiness=1.0)  # one call alone is fine
    with pytest.raises(S.RaceError, match="has not read yet"):
        S.simulate(calls, world=world, staging_bytes=4096, seed=0, stickiness=1.0)


ROOTED_PACKET_SPECS = [s for s in PACKET_SPECS if s.rooted]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("stick", [0.0, 0.9, 1.0])
def test_back_to_back_rooted_packet_calls_never_overwrite_an_unread_window(world, stick):
    """The planner's rooted packet plans (broadcast, and rooted user namings: gather, reduce, scatter
    and the like), with their beats, back to back with changing roots, between unrooted packet calls,
    and 0-byte rooted calls (which still exchange their beats): the simulator lets ranks run ahead
    and checks every window read and every overwrite, and every output."""
    rng = np.random.default_rng(200 + world)
    calls = []
    for i, spec in enumerate([BROADCAST, BROADCAST, ALL_REDUCE] + ROOTED_PACKET_SPECS + [BROADCAST, ALL_GATHER]):
        root = (3 * i + 1) % world
        nbytes = 0 if i == 1 else 8 * (1 + i % 5)
        calls.append(_call(spec, world, nbytes, rng, root=root))
    assert sum(c.name == "broadcast" for c in calls) >= 3 and len(calls) >= 8
    assert all(sc.plan.algorithm == "packet" for c in calls for sc in c.schedules)
    beats = [op for c in calls if c.name == "broadcast" for sc in c.schedules for op in sc.ops
             if isinstance(op, PacketPut) and op.src.nbytes == 0]
    assert len(beats) >= 3 * (world - 1) * (world - 1)  # every non-root to every other rank, every broadcast
    for seed in range(3):
        S.simulate(calls, world=world, staging_bytes=4096, seed=seed, stickiness=stick)
