"""The symmetric heap (config ``symmetric_bytes``, ``Communicator.symmetric_empty``) and the ``direct``
plans it opens: a collective whose input lies in the heap, at the same offset on every rank, reads its
peers' inputs in place. Checked on the CPU engine (real threads, the same ops as the CUDA engine runs):
every collective with a packet form bitwise the torch reference, the same heap tensor rewritten
between calls while slow readers are still reading (the producer's final ack wait is what keeps that
safe), the fallbacks (in place, an overlapping output, an input outside the heap), a rank whose input
is elsewhere (a mismatch, not a hang), and the heap's own errors."""

from __future__ import annotations

import random
import time

import pytest
import torch

import purlin_sglang as ps
import purlin_sglang.engines.cpu as cpu_engine
from purlin_sglang.bench.traffic import plan_bytes
from purlin_sglang.collectives import CATALOG
from purlin_sglang.errors import PurlinMismatchError, PurlinPlanError, PurlinValueError
from purlin_sglang.snac import Buf, Copy, Reduce, Signal, Sizes, WaitSignal, lower, make_plan
from purlin_sglang.testing import launch
from purlin_sglang.testing.collectives import PACKET_FORMS, check_case_in_heap, heap_cases

HEAP = {"staging_bytes": 1 << 16, "symmetric_bytes": 4 << 20, "timeout_s": 20}


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_with_a_packet_form_reads_heap_inputs_in_place(world):
    cases = heap_cases(17 * world)

    def fn(comm):
        for c in cases:
            check_case_in_heap(comm, c)
        return sorted({(c.name, c.sched.plan.algorithm) for c in comm._path.calls.values()})

    ran = ps.run_virtual(world, fn, config=HEAP)
    assert ran[0] == sorted({(n, "direct") for n in PACKET_FORMS}), ran[0]


@pytest.mark.parametrize("twoshot", [False, True])
def test_a_heap_tensor_rewritten_between_calls_while_readers_are_slow(monkeypatch, twoshot):
    """Each producer waits for its readers' acks before its call returns, so the caller may rewrite its
    heap input at once: peers that read slowly (a random pause before every read of a peer's heap or
    shard) still see the call's data, over many calls on 4 ranks; ``twoshot``: the all_reduce runs the
    direct two-shot, its shard chunks of 16 bytes all in one slot (so each chunk waits for the acks of
    the one before it)."""
    slow = cpu_engine.CpuEngine._view
    rng = random.Random(5)

    def view(self, span, ctx):
        if span.buf is Buf.STAGE and span.rank != self.rank:
            time.sleep(rng.random() * 2e-3)
        return slow(self, span, ctx)

    monkeypatch.setattr(cpu_engine.CpuEngine, "_view", view)

    def fn(comm):
        r, w = comm.rank, comm.world_size
        x = comm.symmetric_empty((8, 16), torch.float32)
        bad = 0
        for i in range(20):
            x.copy_(torch.arange(128.).view(8, 16) * (r + 1) + i)
            got = comm.all_reduce(x)
            want = sum(torch.arange(128.).view(8, 16) * (q + 1) + i for q in range(w))
            bad += not torch.equal(got, want)
            g = comm.all_gather(x)
            bad += not all(torch.equal(g[8 * q: 8 * q + 8], torch.arange(128.).view(8, 16) * (q + 1) + i)
                           for q in range(w))
        return bad, {c.name: c.sched.plan.algorithm for c in comm._path.calls.values()}

    one_slot = {"oneshot_max_bytes": 0, "max_chunk_bytes": 16, "slots": 1}
    cfg = {**HEAP, "staging_bytes": 4096, "tuning": one_slot} if twoshot else HEAP
    algs = {"all_reduce": "direct-twoshot" if twoshot else "direct", "all_gather": "direct"}
    assert ps.run_virtual(4, fn, config=cfg) == [(0, algs)] * 4


def test_in_place_overlapping_and_outside_inputs_stay_staged_and_the_cache_tells_them_apart():
    """In place (out is x) a reader would read what I already wrote: staged. An input outside the heap:
    staged. The same shape in the heap and outside it, alternating, each gets its own plan."""
    def alg(comm, t, out):  # the plan the call cache holds for this call now
        return comm._path.lookup(CATALOG["all_reduce"], t, out, "sum", None, None, None)[0].sched.plan.algorithm

    def fn(comm):
        r, w = comm.rank, comm.world_size
        x = comm.symmetric_empty(64, torch.float32)
        plain = torch.empty(64)
        algs, bad = [], 0
        for i in range(3):
            for t in (x, plain, x):
                t.copy_(torch.arange(64.) + r + i)
                want = sum(torch.arange(64.) + q + i for q in range(w))
                bad += not torch.equal(comm.all_reduce(t), want)
                algs.append(alg(comm, t, None))
            x.copy_(torch.arange(64.) + r)
            assert comm.all_reduce(x, out=x) is x  # in place
            bad += not torch.equal(x, sum(torch.arange(64.) + q for q in range(w)))
            algs.append(alg(comm, x, x))
        return bad, algs

    (bad, algs), _ = ps.run_virtual(2, fn, config=HEAP)
    assert bad == 0
    assert algs == ["direct", "oneshot", "direct", "oneshot"] * 3, algs


def test_a_rank_whose_input_is_outside_the_heap_gets_a_mismatch_not_a_hang():
    def fn(comm):
        x = comm.symmetric_empty(16, torch.float32) if comm.rank == 0 else torch.empty(16)
        x.fill_(1.0)
        return comm.all_reduce(x)

    with pytest.raises(PurlinMismatchError, match="all_reduce"):
        ps.run_virtual(2, fn, config={**HEAP, "timeout_s": 10})


def test_heap_errors_name_the_fix():
    def no_heap(comm):
        return comm.symmetric_empty(4, torch.float32)

    with pytest.raises(PurlinValueError, match="no symmetric heap; set config symmetric_bytes"):
        ps.run_virtual(1, no_heap, config={"staging_bytes": 1 << 16})

    def full(comm):
        a = comm.symmetric_empty((1000,), torch.float32)
        assert a.data_ptr() % 256 == 0 and a.shape == (1000,) and a.dtype == torch.float32
        b = comm.symmetric_empty((2, 3), torch.bfloat16)
        assert b.data_ptr() - a.data_ptr() == 4096  # 4000 bytes, then the next 256-byte boundary
        with pytest.raises(PurlinValueError, match="do not fit.*raise config symmetric_bytes"):
            comm.symmetric_empty(1 << 20, torch.float32)
        with pytest.raises(PurlinValueError, match="dtype must be a torch.dtype"):
            comm.symmetric_empty(4, "float32")
        with pytest.raises(PurlinValueError, match="negative size"):
            comm.symmetric_empty((2, -1), torch.float32)
        comm.close()
        with pytest.raises(ps.PurlinError, match="symmetric_empty"):
            comm.symmetric_empty(4, torch.float32)
        return True

    assert ps.run_virtual(1, full, config={"staging_bytes": 1 << 16, "symmetric_bytes": 1 << 16}) == [True]


def test_the_heap_size_is_checked_like_every_key():
    from purlin_sglang.errors import PurlinConfigError

    assert ps.PurlinConfig().symmetric_bytes == 0
    with pytest.raises(PurlinConfigError, match="symmetric_bytes"):
        ps.PurlinConfig.from_dict({"symmetric_bytes": -1})


def test_a_config_without_a_heap_keeps_the_workspace_as_it_was():
    from purlin_sglang.memory.heap import heap_start, region_bytes

    assert region_bytes(1 << 16, 0) == 1 << 16 and region_bytes(5000, 100) == 8192 + 100 == heap_start(5000) + 100
    sizes = ps.run_virtual(2, lambda comm: comm.workspace_bytes, config={"staging_bytes": 1 << 16})
    with_heap = ps.run_virtual(2, lambda comm: comm.workspace_bytes, config={"staging_bytes": 1 << 16,
                                                                           "symmetric_bytes": 1 << 16})
    assert with_heap[0] - sizes[0] == 2 * (1 << 16)  # each rank's region grew by the heap


# -- the plans ------------------------------------------------------------------------------------------
W, N = 8, 1 << 16
AT = 1 << 20  # where the inputs lie in every rank's staging region


def _direct(name, sizes, rank=0):
    return lower(make_plan(CATALOG[name], W, rank, staging_bytes=1 << 16, algorithm="direct", input_at=AT), sizes)


@pytest.mark.parametrize("name, sizes, want", [
    ("reduce_scatter", Sizes((N // W,) * W, (N // W,)), 9 * N // 8),  # read 8 slices, write one: the floor
    ("all_to_all", Sizes((N // W,) * W, (N // W,) * W), 2 * N),  # read N, write N: the floor
    ("all_gather", Sizes((N,), (N,) * W), 16 * N),  # read 8 inputs, write 8N (the floor: 9N)
    ("all_reduce", Sizes((N,), (N,)), 9 * N),  # one-shot: read 8 inputs, write N
])
def test_direct_plans_move_no_staging_bytes(name, sizes, want):
    sched = _direct(name, sizes)
    assert plan_bytes(sched) == want
    data = [op for op in sched.ops if isinstance(op, (Copy, Reduce))]
    srcs = [s for op in data for s in ((op.src,) if isinstance(op, Copy) else op.srcs)]
    assert all(op.dst.buf is Buf.OUTPUT for op in data)  # nothing is staged
    peer = [s for s in srcs if s.rank != 0]
    assert peer and all(s.buf is Buf.STAGE and s.offset >= AT for s in peer)
    if CATALOG[name].input.sliced:  # rank 0 reads slice 0 of every peer's input
        assert all(s.offset == AT for s in peer)
    notifies = [op for op in sched.ops if isinstance(op, Signal) and op.kind == "notify"]
    drains = [op for op in sched.ops if isinstance(op, WaitSignal) and op.kind == "ack"]
    assert sorted(op.peer for op in notifies) == sorted(op.peer for op in drains) == list(range(1, W))
    assert sched.ops.index(drains[0]) == len(sched.ops) - len(drains)  # the last thing a call does


def test_direct_plans_exist_only_with_an_offset_and_a_packet_form():
    with pytest.raises(PurlinPlanError, match="needs input_at"):
        make_plan(CATALOG["all_gather"], 2, 0, staging_bytes=1 << 16, algorithm="direct")
    with pytest.raises(PurlinPlanError, match="has no direct form"):
        make_plan(CATALOG["all_to_all_v"], 2, 0, staging_bytes=1 << 16, algorithm="direct", input_at=0)
    a = make_plan(CATALOG["all_gather"], 2, 0, staging_bytes=1 << 16, algorithm="direct", input_at=4096)
    b = make_plan(CATALOG["all_gather"], 2, 0, staging_bytes=1 << 16, algorithm="direct", input_at=8192)
    assert a.key != b.key  # ranks whose inputs lie at other offsets are in different calls


def test_the_direct_two_shot_moves_three_and_an_eighth_payloads():
    """Reduce part 0 of 8 inputs in place (N read, N/8 written to my shard), copy 8 shards out (2N): the
    staged two-shot's 4.875N less the staging of 7 parts, 0.64 of the floor's 2N at most."""
    plan = make_plan(CATALOG["all_reduce"], W, 0, staging_bytes=1 << 24, algorithm="direct-twoshot", input_at=AT)
    sched = lower(plan, Sizes((N,), (N,)))
    assert plan_bytes(sched) == 25 * N // 8
    reduces = [op for op in sched.ops if isinstance(op, Reduce)]
    assert len(reduces) == 1 and reduces[0].dst.buf is Buf.STAGE and reduces[0].dst.rank == 0
    assert [s.offset for s in reduces[0].srcs[1:]] == [AT] * (W - 1) and reduces[0].srcs[0].buf is Buf.INPUT
    with pytest.raises(PurlinPlanError, match="has no direct two-shot form"):
        make_plan(CATALOG["all_gather"], W, 0, staging_bytes=1 << 24, algorithm="direct-twoshot", input_at=AT)
    small = lower(make_plan(CATALOG["all_reduce"], 3, 1, staging_bytes=4096, algorithm="direct-twoshot",
                            input_at=AT), Sizes((40000,), (40000,)))
    assert small.staging_used <= 4096 and sum(isinstance(op, Reduce) for op in small.ops) > 2  # chunks cycle slots


@pytest.mark.parametrize("world", [2, 3, 5])
def test_large_all_reduces_of_heap_inputs_run_the_direct_two_shot(world):
    def fn(comm):
        r, w = comm.rank, comm.world_size
        bad = 0
        for n, dt in ((40001, torch.float32), (3, torch.float32), (20000, torch.bfloat16)):
            x = comm.symmetric_empty(n, dt)
            for i in range(2):
                xs = [(torch.arange(float(n)) % 97 * (q + 1) + i).to(dt) for q in range(w)]
                x.copy_(xs[r])
                acc = xs[0].float()
                for t in xs[1:]:
                    acc = acc + t.float()
                bad += not torch.equal(comm.all_reduce(x), acc.to(dt))
                bad += not torch.equal(comm.all_reduce(x, op="max"), xs[-1])
        return bad, sorted({c.sched.plan.algorithm for c in comm._path.calls.values()})

    cfg = {**HEAP, "staging_bytes": 8192, "tuning": {"oneshot_max_bytes": 1024}}
    res = ps.run_virtual(world, fn, config=cfg)
    assert res == [(0, ["direct", "direct-twoshot"])] * world, res


def _mp_heap(rank, world):
    """A CPU process group (host shared memory): the heap is each rank's tail of the shared file."""
    cfg = {"staging_bytes": 4096, "symmetric_bytes": 1 << 20, "timeout_s": 20, "tuning": {"oneshot_max_bytes": 1024}}
    with ps.Communicator(config=cfg) as comm:
        for c in heap_cases(11):
            check_case_in_heap(comm, c)
        x = comm.symmetric_empty(40001, torch.float32)
        x.copy_(torch.arange(40001.) * (rank + 1))
        ok = torch.equal(comm.all_reduce(x), sum(torch.arange(40001.) * (q + 1) for q in range(world)))
        return ok, sorted({(c.name, c.sched.plan.algorithm) for c in comm._path.calls.values()})


def test_a_cpu_process_group_reads_heap_inputs_in_place():
    res = launch(_mp_heap, 2, timeout_s=120)
    want = sorted({(n, "direct") for n in PACKET_FORMS} | {("all_reduce", "direct-twoshot")})
    assert res == [(True, want)] * 2, res
