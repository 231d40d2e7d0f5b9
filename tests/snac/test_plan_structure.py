"""Structure tests of the SNAC planner: determinism, size independence, describe(), coverage of
every spec x world x rank x root, the TuningPolicy regime choice, and argument errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import simulator as S
from purlin_sglang.collectives import ALL_REDUCE, CATALOG, CollectiveSpec
from purlin_sglang.errors import PurlinPlanError
from purlin_sglang.snac.policy import PACKET_WINDOW_BYTES
from purlin_sglang.snac import (
    ALIGN, Ack, ConsumeStep, Drain, DrainAll, Notify, Sizes, Stage, TuningPolicy, Wait, WaitDrainAll,
    choose_algorithm, lower, make_plan,
)
from purlin_sglang.snac.policy import max_items

NAMED = sorted(S.NAMED_SPECS.values(), key=lambda s: s.name)
ALL_SPECS = NAMED + S.all_valid_namings()
POLICIES = [TuningPolicy(), TuningPolicy(algorithm="oneshot", slots=1), TuningPolicy(algorithm="twoshot", slots=3)]
STAGING = 1 << 20


def _roots(spec, world):
    return range(world) if spec.rooted else [None]


def _cases(worlds=range(1, 9), specs=ALL_SPECS):
    for spec in specs:
        for world in worlds:
            for root in _roots(spec, world):
                yield spec, world, root


def _twoshot_ok(spec: CollectiveSpec) -> bool:
    """From the TuningPolicy docs: two-shot is for reductions of a packed payload into a packed output."""
    return not spec.consume.is_copy and not spec.input.sliced and not spec.output.sliced and not spec.rooted


def _plans(spec, world, root, **kw):
    kw.setdefault("staging_bytes", STAGING)
    return [make_plan(spec, world, r, root=root, **kw) for r in range(world)]


# -- determinism ---------------------------------------------------------------------------------

def test_plans_are_deterministic():
    for spec, world, root in _cases(worlds=(1, 2, 5, 8)):
        for policy in POLICIES:
            for r in range(world):
                a = make_plan(spec, world, r, root=root, staging_bytes=STAGING, policy=policy)
                b = make_plan(spec, world, r, root=root, staging_bytes=STAGING, policy=policy.model_copy())
                assert a == b and hash(a) == hash(b)
                assert a.describe() == b.describe()
                sizes = S.consistent_sizes(spec, world, root, [[40] * world] * world, [[8] * world] * world)
                assert lower(a, sizes[r]) == lower(b, sizes[r])


def _describe_all() -> list[str]:
    out = []
    for spec in sorted(S.NAMED_SPECS.values(), key=lambda s: s.name):
        for alg in ("oneshot", "twoshot"):
            for world in (3, 6):
                for rank in range(world):
                    root = 1 if spec.rooted else None
                    plan = make_plan(spec, world, rank, root=root, staging_bytes=65536,
                                     policy=TuningPolicy(algorithm=alg))
                    out.append(plan.describe())
    return out


def test_describe_is_identical_across_processes_and_hash_seeds():
    """No dependence on set/dict iteration order or object identity: a fresh interpreter with
    another hash seed prints the same plans as this one."""
    here = os.path.dirname(os.path.abspath(__file__))  # on the child's PYTHONPATH, as pytest put it on ours
    script = "import json, test_plan_structure as t; print(json.dumps(t._describe_all()))"
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = dict(os.environ, PYTHONHASHSEED=seed)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.getcwd(), env.get("PYTHONPATH", "")) if p)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    theirs, mine = json.loads(res.stdout), _describe_all()
    assert len(mine) == len(NAMED) * 2 * 9
    assert theirs == mine


# -- sizes never shape a plan --------------------------------------------------------------------

@pytest.mark.parametrize("policy", [TuningPolicy(algorithm="oneshot", slots=1, max_chunk_bytes=16),
                                    TuningPolicy(algorithm="twoshot", slots=3, max_chunk_bytes=16)],
                         ids=["oneshot", "twoshot"])
def test_plan_does_not_depend_on_sizes(policy):
    """A forced regime: nbytes (the only size make_plan sees, and optional) changes nothing; and one
    plan lowers with any sizes."""
    import numpy as np

    rng = np.random.default_rng(3)
    for spec, world, root in _cases(worlds=(1, 3, 7)):
        for r in range(world):
            base = make_plan(spec, world, r, root=root, staging_bytes=4096, policy=policy)
            for nbytes in (0, 1, 17, 1 << 30):
                assert make_plan(spec, world, r, root=root, nbytes=nbytes, staging_bytes=4096, policy=policy) == base
        plans = _plans(spec, world, root, staging_bytes=4096, policy=policy)
        op_counts = set()
        scale = world if not spec.input.sliced and not spec.output.sliced else 1  # two-shot: world parts
        for trial in range(3):
            m = ((trial * 8 * scale + rng.integers(0, 8, size=(world, world))) * 3).tolist()
            junk = (rng.integers(0, 9, size=(world, world)) * 3).tolist()
            if trial == 0:
                m = junk = [[0] * world] * world
            sizes = S.consistent_sizes(spec, world, root, m, junk)
            scheds = [lower(p, s) for p, s in zip(plans, sizes)]
            assert all(sc.plan is p for sc, p in zip(scheds, plans))
            op_counts.add(sum(len(sc.ops) for sc in scheds))
        if world > 1:
            assert len(op_counts) > 1, f"{spec}: the op lists should grow with the sizes"


def test_auto_plans_within_one_regime_are_equal():
    pol = TuningPolicy(oneshot_max_bytes=1000)
    for world in (1, 2, 4, 8):
        small = [make_plan(ALL_REDUCE, world, 0, nbytes=n, staging_bytes=STAGING, policy=pol) for n in (0, 1, 999, 1000)]
        large = [make_plan(ALL_REDUCE, world, 0, nbytes=n, staging_bytes=STAGING, policy=pol)
                 for n in (1001, 1 << 40, None)]
        assert all(p == small[0] for p in small) and all(p == large[0] for p in large)
        assert small[0].algorithm == "oneshot" and large[0].algorithm == "twoshot"


# -- describe ------------------------------------------------------------------------------------

def test_describe_is_printable(capsys):
    for spec, world, root in _cases(worlds=(1, 2, 4)):
        for policy in POLICIES:
            for plan in _plans(spec, world, root, policy=policy):
                text = plan.describe()
                assert str(plan) == text
                print(plan)
                assert text.isascii()
                lines = text.split("\n")
                assert all(line.strip() and line.isprintable() for line in lines)
                assert " at 0x" not in text and "object" not in text, text  # no default reprs
                assert lines[0] == f"plan {spec}"
                assert f"world={world} rank={plan.rank} root={root} algorithm={plan.algorithm}" in lines[1]
                assert f"chunk={plan.chunk_bytes}B slots={plan.slots} items={plan.n_items}" in lines[1]
                prog = plan.program
                want = [str(it) for it in prog.items] + [f"prologue: {s}" for s in prog.prologue] + \
                       [f"per chunk: {s}" for s in prog.body]
                assert [line.strip() for line in lines[2 + len(plan.notes):]] == want
    out = capsys.readouterr().out
    assert "plan all_reduce: packed -> packed, reduce(sum)" in out
    assert "per chunk: stage in[r0] -> item0" in out


def test_describe_reads_as_the_protocol():
    plan = make_plan(CATALOG["all_gather"], 3, 1, staging_bytes=3 * 16 * 2, policy=TuningPolicy(slots=2))
    assert plan.describe() == "\n".join([
        "plan all_gather: packed -> scattered, copy",
        "  world=3 rank=1 root=None algorithm=oneshot chunk=48B slots=2 items=1",
        "  item0 (like in[r1]) -> readers [0, 2]",
        "  prologue: drain-all",
        "  per chunk: drain item0",
        "  per chunk: stage in[r1] -> item0",
        "  per chunk: notify item0 -> [0, 2]",
        "  per chunk: wait r0.item0",
        "  per chunk: wait r2.item0",
        "  per chunk: copy stage[r0].item0 -> out[r1].s0",
        "  per chunk: copy in[r1] -> out[r1].s1",
        "  per chunk: copy stage[r2].item0 -> out[r1].s2",
        "  per chunk: ack r0.item0",
        "  per chunk: ack r2.item0",
    ])


# -- every spec plans on every world, rank and root ----------------------------------------------

@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_every_spec_plans_for_every_world_rank_and_root(spec):
    for world in range(1, 9):
        for root in _roots(spec, world):
            for policy in POLICIES:
                plans = _plans(spec, world, root, policy=policy)
                prods, cons = S.producers(spec, world, root), S.consumers(spec, world, root)
                assert len({p.key for p in plans}) == 1, "ranks must agree on the plan key"
                for r, plan in enumerate(plans):
                    assert (plan.rank, plan.world, plan.root, plan.spec) == (r, world, root, spec)
                    assert plan.slots == policy.slots
                    prog = plan.program
                    assert prog.rank == r
                    idx = [it.index for it in prog.items]
                    assert len(set(idx)) == len(idx) and all(0 <= i < plan.n_items <= max_items(world) for i in idx)
                    for it in prog.items:
                        assert r not in it.readers and set(it.readers) <= set(cons), (r, it)
                        assert it.readers or (plan.algorithm == "twoshot" and world == 1), (r, it)
                        assert list(it.readers) == sorted(it.readers)
                    staged = {s.item for s in prog.body if isinstance(s, Stage)}
                    assert (r in prods) or not staged, "only producers stage"
                    assert prog.prologue == ((DrainAll(),) if prog.items else ())
                    waits = [s for s in prog.body if isinstance(s, Wait)]
                    acks = [s for s in prog.body if isinstance(s, Ack)]
                    assert sorted((w.peer, w.item) for w in waits) == sorted((a.peer, a.item) for a in acks)
                    assert all(w.peer != r for w in waits)
                    consumes = [s for s in prog.body if isinstance(s, ConsumeStep)]
                    if r in cons:
                        assert consumes
                    elif plan.algorithm == "oneshot":
                        assert not consumes and not waits, "a rank outside a rooted output consumes nothing"
                    for s in prog.body:
                        if isinstance(s, (Drain, Stage, Notify)):
                            assert s.item in idx
                        if isinstance(s, Notify):
                            assert s.peers == next(it.readers for it in prog.items if it.index == s.item)


def test_world_one_moves_nothing_between_ranks():
    for spec, _, root in _cases(worlds=(1,)):
        for policy in POLICIES:
            (plan,) = _plans(spec, 1, root, policy=policy)
            sizes = S.consistent_sizes(spec, 1, root, [[24]], [[8]])
            sched = lower(plan, sizes[0])
            assert sched.send_bytes == (0,) and sched.recv_bytes == (0,)
            assert not any(type(op).__name__ in ("Signal", "WaitSignal") for op in sched.ops)


# -- the regime follows TuningPolicy --------------------------------------------------------------

@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_algorithm_follows_tuning_policy(spec):
    for limit in (0, 64, 256 * 1024):
        for alg in ("auto", "oneshot", "twoshot"):
            pol = TuningPolicy(algorithm=alg, oneshot_max_bytes=limit)
            for nbytes in (None, 0, limit - 1, limit, limit + 1, 1 << 32):
                if nbytes is not None and nbytes < 0:
                    continue
                if not _twoshot_ok(spec) or alg == "oneshot":
                    want = "oneshot"
                elif alg == "twoshot" or nbytes is None:
                    want = "twoshot"
                else:
                    want = "oneshot" if nbytes <= limit else "twoshot"
                assert choose_algorithm(spec, nbytes, pol) == want, (alg, limit, nbytes)
                root = 0 if spec.rooted else None
                for world in (1, 4):
                    plan = make_plan(spec, world, world - 1, root=root, nbytes=nbytes, staging_bytes=STAGING, policy=pol)
                    assert plan.algorithm == want
                    n_items = world + 1 if want == "twoshot" else (world if spec.input.sliced else 1)
                    assert plan.n_items == n_items


def test_default_policy_regimes_for_all_reduce():
    pol = TuningPolicy()
    assert pol.algorithm == "auto" and pol.oneshot_max_bytes == 256 * 1024
    assert make_plan(ALL_REDUCE, 8, 0, nbytes=256 * 1024, staging_bytes=STAGING).algorithm == "oneshot"
    assert make_plan(ALL_REDUCE, 8, 0, nbytes=256 * 1024 + 1, staging_bytes=STAGING).algorithm == "twoshot"
    assert make_plan(ALL_REDUCE, 8, 0, staging_bytes=STAGING).algorithm == "twoshot"  # size unknown
    for name, spec in CATALOG.items():
        if name != "all_reduce":
            for nbytes in (None, 1 << 30):
                plan = make_plan(spec, 8, 0, root=0 if spec.rooted else None, nbytes=nbytes, staging_bytes=STAGING,
                                 policy=TuningPolicy(algorithm="twoshot"))
                assert plan.algorithm == "oneshot", name


def test_chunk_is_the_largest_aligned_fit():
    for spec, world, root in _cases(worlds=(1, 3, 8), specs=NAMED):
        for slots in (1, 2, 3, 7):
            for max_chunk in (16, 40, 4096, 4 << 20):
                for staging in (777, 4096, 10_000, 1 << 20):
                    pol = TuningPolicy(slots=slots, max_chunk_bytes=max_chunk, algorithm="twoshot")
                    n_items = make_plan(spec, world, 0, root=root, staging_bytes=1 << 30, policy=pol).n_items
                    if n_items * slots * ALIGN > staging:
                        continue
                    plan = make_plan(spec, world, 0, root=root, staging_bytes=staging, policy=pol)
                    c = plan.chunk_bytes
                    assert c % ALIGN == 0 and ALIGN <= c <= max_chunk
                    assert n_items * slots * c <= staging
                    assert c + ALIGN > max_chunk or n_items * slots * (c + ALIGN) > staging


# -- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", NAMED, ids=lambda s: s.name)
def test_too_small_staging_raises(spec):
    for world in (1, 2, 5, 8):
        root = world - 1 if spec.rooted else None
        for alg in ("oneshot", "twoshot"):
            for slots in (1, 2, 3):
                pol = TuningPolicy(algorithm=alg, slots=slots)
                n_items = make_plan(spec, world, 0, root=root, staging_bytes=1 << 30, policy=pol).n_items
                least = n_items * slots * ALIGN
                for r in range(world):
                    assert make_plan(spec, world, r, root=root, staging_bytes=least, policy=pol).chunk_bytes == ALIGN
                    for bad in (least - 1, least // 2, 0, -1):
                        with pytest.raises(PurlinPlanError, match="staging_bytes"):
                            make_plan(spec, world, r, root=root, staging_bytes=bad, policy=pol)


@pytest.mark.parametrize("spec", NAMED, ids=lambda s: s.name)
def test_bad_world_rank_root_raise(spec):
    ok_root = 0 if spec.rooted else None
    for world in (0, -1, -8):
        with pytest.raises(PurlinPlanError, match="world size"):
            make_plan(spec, world, 0, root=ok_root, staging_bytes=STAGING)
    for world in (1, 4):
        for rank in (-1, world, world + 3):
            with pytest.raises(PurlinPlanError, match="rank"):
                make_plan(spec, world, rank, root=ok_root, staging_bytes=STAGING)
        if spec.rooted:
            for root in (None, -1, world, world + 1):
                with pytest.raises(PurlinPlanError, match="root"):
                    make_plan(spec, world, 0, root=root, staging_bytes=STAGING)
        else:  # a root means nothing to an unrooted collective: ignored, not recorded
            assert make_plan(spec, world, 0, root=2, staging_bytes=STAGING).root is None
    assert issubclass(PurlinPlanError, ValueError)


def test_lower_rejects_sizes_that_do_not_fit_the_naming():
    for spec in NAMED:
        for alg in ("oneshot", "twoshot"):
            world, root = 3, 1 if spec.rooted else None
            plan = make_plan(spec, world, 1, root=root, staging_bytes=STAGING, policy=TuningPolicy(algorithm=alg))
            nin = world if spec.input.sliced else 1
            nout = world if spec.output.sliced else 1
            lower(plan, Sizes((8,) * nin, (8,) * nout))
            for bad in (Sizes((8,) * (nin + 1), (8,) * nout), Sizes((8,) * nin, (8,) * (nout + 1)),
                        Sizes((8,) * (nin - 1), (8,) * nout), Sizes((-8,) + (8,) * (nin - 1), (8,) * nout),
                        Sizes((8,) * nin, (8,) * (nout - 1) + (-8,))):
                with pytest.raises(PurlinPlanError):
                    lower(plan, bad)


@pytest.mark.parametrize("alg", ["oneshot", "twoshot"])
def test_lower_rejects_a_packed_payload_that_does_not_fit_its_output(alg):
    """Every rank of an all_reduce must reject in != out, whichever algorithm (two-shot once
    accepted it silently, because it never copies my input straight to my output)."""
    for world in (1, 2, 3, 8):
        for r, plan in enumerate(_plans(ALL_REDUCE, world, None, policy=TuningPolicy(algorithm=alg))):
            lower(plan, Sizes((160,), (160,)))
            for i, o in ((160, 176), (176, 160), (0, 16)):
                with pytest.raises(PurlinPlanError, match="sizes"):
                    lower(plan, Sizes((i,), (o,)))


def test_drain_all_covers_every_peer_and_item():
    """A call's DrainAll must cover what any previous call could have staged (see lower.py)."""
    for spec, world, root in _cases(worlds=(2, 5)):
        for policy in POLICIES:
            for plan in _plans(spec, world, root, policy=policy):
                sizes = S.consistent_sizes(spec, world, root, [[16] * world] * world, [[16] * world] * world)
                ops = lower(plan, sizes[plan.rank]).ops
                drains = [op for op in ops if isinstance(op, WaitDrainAll)]
                if plan.program.items:
                    assert drains == [WaitDrainAll(tuple(p for p in range(world) if p != plan.rank), world + 1)]
                    assert ops[0] == drains[0]
                else:
                    assert drains == []


# -- the packet protocol (latency regime) -------------------------------------------------------
def test_packet_plan_pushes_to_every_peer_rotated_and_reduces_in_rank_order():
    from purlin_sglang.snac import Buf, PacketPut, PacketReduce, Push

    plan = make_plan(ALL_REDUCE, 4, 1, nbytes=4096, staging_bytes=STAGING, policy=TuningPolicy(algorithm="packet"))
    assert plan.algorithm == "packet" and plan.program.items == () and plan.program.prologue == ()
    pushes = [s for s in plan.program.body if isinstance(s, Push)]
    assert [s.peer for s in pushes] == [2, 3, 0]
    (consume,) = [s for s in plan.program.body if isinstance(s, ConsumeStep)]
    assert [(r.buf, r.rank) for r in consume.srcs] == [(Buf.WINDOW, 0), (Buf.INPUT, 1), (Buf.WINDOW, 2), (Buf.WINDOW, 3)]
    sched = lower(plan, Sizes((4094,), (4094,)))
    assert [type(op) for op in sched.ops] == [PacketPut] * 3 + [PacketReduce]
    assert all(op.src.nbytes == 4094 for op in sched.ops[:3]) and sched.ops[3].dst.nbytes == 4094
    assert sched.send_bytes == (4094, 0, 4094, 4094) and sched.recv_bytes == (4094, 0, 4094, 4094)
    assert "push in[r1] -> window of r2 (packets)" in plan.describe()


def test_packet_plan_refuses_payloads_larger_than_a_window():
    plan = make_plan(ALL_REDUCE, 2, 0, nbytes=None, staging_bytes=STAGING, policy=TuningPolicy(algorithm="packet"))
    w = PACKET_WINDOW_BYTES
    lower(plan, Sizes((w,), (w,)))
    with pytest.raises(PurlinPlanError, match=f"at most {w} bytes per call"):
        lower(plan, Sizes((w + 16,), (w + 16,)))


def test_packet_choice_needs_an_engine_with_packets_and_a_small_payload():
    from purlin_sglang.collectives import ALL_GATHER, BROADCAST

    auto = TuningPolicy()
    assert choose_algorithm(ALL_REDUCE, 8192, auto, packets=True) == "packet"
    assert choose_algorithm(ALL_REDUCE, 8192, auto) == "oneshot"  # e.g. the CPU engine
    assert choose_algorithm(ALL_REDUCE, auto.packet_max_bytes + 16, auto, packets=True) == "oneshot"
    assert choose_algorithm(ALL_REDUCE, None, auto, packets=True) == "twoshot"
    assert choose_algorithm(ALL_GATHER, 8192, auto, packets=True) == "packet"  # more in test_packet_plans.py
    assert choose_algorithm(BROADCAST, 8192, auto, packets=True) == "packet"  # rooted: beats for silent pairs
    assert choose_algorithm(ALL_REDUCE, 8192, TuningPolicy(packet_max_bytes=0), packets=True) == "oneshot"
    assert choose_algorithm(ALL_REDUCE, 1 << 20, TuningPolicy(algorithm="packet"), packets=True) == "packet"
    assert choose_algorithm(ALL_REDUCE, 8192, TuningPolicy(algorithm="packet")) == "oneshot"
    with pytest.raises(Exception, match="packet_max_bytes"):
        TuningPolicy(packet_max_bytes=1 << 20)
