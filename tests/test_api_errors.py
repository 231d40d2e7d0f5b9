"""Bad inputs: each raises a PurlinError that is also a ValueError (or RuntimeError), names the op,
and leaves the communicator usable: a correct call afterwards works on every rank."""

import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.collectives import ALL_GATHER, ALL_REDUCE, COPY, PACKED, REDUCE, SCATTERED, CollectiveSpec
from purlin_sglang.errors import PurlinClosedError, PurlinError, PurlinRejectedError, PurlinValueError

CFG = {"staging_bytes": 1 << 16, "timeout_s": 5}
GATHER = CollectiveSpec("gather", PACKED, SCATTERED.root(), COPY)
REDUCE_TO_ROOT = CollectiveSpec("reduce", PACKED, PACKED.root(), REDUCE)
W = 3  # world size of the virtual tests

f32 = torch.float32


def x4(*shape, dtype=f32):
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


# (id, the bad call (comm -> anything), the op name the message must start with)
BAD = [
    ("dtype-x-out", lambda c: c.all_reduce(x4(3), out=torch.empty(3, dtype=torch.float64)), "all_reduce"),
    ("dtype-x-out-gather", lambda c: c.all_gather(x4(2), out=torch.empty(2 * W, dtype=torch.int32)), "all_gather"),
    ("device-x", lambda c: c.all_reduce(torch.empty(3, device="meta")), "all_reduce"),
    ("device-out", lambda c: c.all_gather(x4(2), out=torch.empty(2 * W, device="meta")), "all_gather"),
    ("out-shape", lambda c: c.all_gather(x4(2, 3), out=torch.empty(2 * W, 4)), "all_gather"),
    ("out-shape-rows", lambda c: c.all_reduce(x4(2, 3), out=torch.empty(3, 3)), "all_reduce"),
    ("out-shape-flat", lambda c: c.reduce_scatter(x4(W, 2), out=torch.empty(2)), "reduce_scatter"),
    ("noncontig-x", lambda c: c.all_reduce(x4(4, 6).t()), "all_reduce"),
    ("noncontig-x-strided", lambda c: c.all_gather(x4(8)[::2]), "all_gather"),
    ("noncontig-out", lambda c: c.all_reduce(x4(3, 2), out=torch.empty(2, 3).t()), "all_reduce"),
    ("rs-not-divisible", lambda c: c.reduce_scatter(x4(W + 1, 2)), "reduce_scatter"),
    ("a2a-not-divisible", lambda c: c.all_to_all(x4(2 * W - 1)), "all_to_all"),
    ("agv-splits-length", lambda c: c.all_gather_v(x4(1), [1] * (W - 1)), "all_gather_v"),
    ("rsv-splits-length", lambda c: c.reduce_scatter_v(x4(W), [1] * (W + 1)), "reduce_scatter_v"),
    ("a2av-in-length", lambda c: c.all_to_all_v(x4(W), [1] * (W + 1), [1] * W), "all_to_all_v"),
    ("a2av-out-length", lambda c: c.all_to_all_v(x4(W), [1] * W, [1] * (W - 1)), "all_to_all_v"),
    ("agv-negative", lambda c: c.all_gather_v(x4(1), [1, -1, 1]), "all_gather_v"),
    ("rsv-negative", lambda c: c.reduce_scatter_v(x4(3), [4, -2, 1]), "reduce_scatter_v"),
    ("a2av-negative-out", lambda c: c.all_to_all_v(x4(3), [1, 1, 1], [2, -1, 2]), "all_to_all_v"),
    ("rsv-sum", lambda c: c.reduce_scatter_v(x4(4), [1, 1, 1]), "reduce_scatter_v"),
    ("a2av-in-sum", lambda c: c.all_to_all_v(x4(4), [1, 1, 1], [1, 1, 1]), "all_to_all_v"),
    ("agv-size-rank", lambda c: c.all_gather_v(x4(2), [1, 1, 1]), "all_gather_v"),
    ("splits-not-ints", lambda c: c.all_gather_v(x4(1), [1.0, 1.0, 1.0]), "all_gather_v"),
    ("splits-bools", lambda c: c.reduce_scatter_v(x4(3), [True, True, True]), "reduce_scatter_v"),
    ("splits-not-sequence", lambda c: c.all_gather_v(x4(1), 3), "all_gather_v"),
    ("splits-missing", lambda c: c.run(ps.CATALOG["all_gather_v"], x4(1)), "all_gather_v"),
    ("splits-for-fixed", lambda c: c.run(ALL_GATHER, x4(1), out_splits=[1] * W), "all_gather"),
    ("op-avg", lambda c: c.all_reduce(x4(3), "avg"), "all_reduce"),
    ("op-avg-rs", lambda c: c.reduce_scatter(x4(W), op="avg"), "reduce_scatter"),
    ("op-not-str", lambda c: c.all_reduce(x4(3), 7), "all_reduce"),
    ("reduce-bool", lambda c: c.all_reduce(torch.ones(3, dtype=torch.bool)), "all_reduce"),
    ("reduce-complex", lambda c: c.all_reduce(torch.ones(3, dtype=torch.complex64)), "all_reduce"),
    ("reduce-int16", lambda c: c.reduce_scatter(torch.ones(W, dtype=torch.int16)), "reduce_scatter"),
    ("root-too-big", lambda c: c.broadcast(x4(3), W), "broadcast"),
    ("root-negative", lambda c: c.broadcast(x4(3), -1), "broadcast"),
    ("root-bool", lambda c: c.broadcast(x4(3), True), "broadcast"),
    ("root-missing", lambda c: c.run(GATHER, x4(2), out=torch.empty(2 * W)), "gather"),
    ("root-missing-reduce", lambda c: c.run(REDUCE_TO_ROOT, x4(2)), "reduce"),
    ("root-unrooted", lambda c: c.run(ALL_REDUCE, x4(3), root=0), "all_reduce"),
    ("op-for-copy", lambda c: c.run(ALL_GATHER, x4(2), op="sum"), "all_gather"),
    ("op-for-broadcast", lambda c: c.run(ps.CATALOG["broadcast"], x4(2), op="max", root=0), "broadcast"),
    ("overlap-gather", lambda c: (lambda buf: c.all_gather(buf[:2], out=buf))(x4(2 * W)), "all_gather"),
    ("overlap-gather-tail", lambda c: (lambda buf: c.all_gather(buf[-2:], out=buf))(x4(2 * W)), "all_gather"),
    ("overlap-a2a-inplace", lambda c: (lambda buf: c.all_to_all(buf, out=buf))(x4(W)), "all_to_all"),
    ("overlap-rs-partial", lambda c: (lambda buf: c.reduce_scatter(buf[:W], out=buf[W - 1:W]))(x4(W)),
     "reduce_scatter"),
    ("not-tensor-x", lambda c: c.all_reduce([1.0, 2.0]), "all_reduce"),
    ("not-tensor-out", lambda c: c.all_gather(x4(2), out="out"), "all_gather"),
    ("not-tensor-numpy", lambda c: c.all_reduce(x4(3).numpy()), "all_reduce"),
    ("not-spec", lambda c: c.run("all_reduce", x4(3)), "run"),
    ("zero-dim-gather", lambda c: c.all_gather(torch.tensor(1.0)), "all_gather"),
]


def good_call(comm):
    """A correct call on every rank whose result depends on every rank: proves the group is intact."""
    x = torch.full((5, 3), float(comm.rank + 1))
    out = comm.all_reduce(x)
    want = torch.full((5, 3), float(sum(range(1, comm.world_size + 1))))
    assert torch.equal(out, want), (comm.rank, out)
    g = comm.all_gather(torch.tensor([comm.rank], dtype=torch.int64))
    assert g.tolist() == list(range(comm.world_size))
    return True


def expect_bad(comm, bad, opname):
    with pytest.raises(PurlinError) as info:
        bad(comm)
    e = info.value
    assert isinstance(e, (ValueError, RuntimeError)), type(e)
    assert str(e).startswith(opname + ":"), str(e)
    return type(e)


@pytest.mark.parametrize("bad,opname", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_on_every_rank_then_a_good_call(bad, opname):
    def fn(comm):
        kind = expect_bad(comm, bad, opname)
        assert good_call(comm)
        return kind

    kinds = ps.run_virtual(W, fn, config=CFG)
    assert all(issubclass(k, PurlinValueError) for k in kinds), kinds


@pytest.mark.parametrize("bad,opname", [b[1:] for b in BAD[::4]], ids=[b[0] for b in BAD[::4]])
def test_bad_input_on_one_rank_raises_on_every_rank(bad, opname):
    # Rank 0's arguments are bad, its peers' call is fine: rank 0 raises its own error, the peers a
    # PurlinRejectedError quoting it (not a timeout), the call number is spent on every rank alike, so
    # the next good call matches everywhere.
    def fn(comm):
        t0 = time.monotonic()
        if comm.rank == 0:
            with pytest.raises(PurlinValueError) as info:
                bad(comm)
        else:
            with pytest.raises(PurlinRejectedError) as info:
                comm.all_reduce(x4(3))
        e, dt = info.value, time.monotonic() - t0
        return type(e).__name__, str(e), getattr(e, "rank", None), getattr(e, "cause", None), dt, good_call(comm)

    res = ps.run_virtual(W, fn, config={**CFG, "timeout_s": 60})
    own = res[0][1]
    assert own.startswith(opname + ":"), own
    for name, msg, rank, cause, dt, ok in res[1:]:
        assert name == "PurlinRejectedError" and rank == 0 and cause == own, (name, rank, cause, own)
        assert "rank 0 rejected its arguments" in msg and own in msg, msg
        assert dt < 1.0, dt
    assert all(r[-1] for r in res)


def test_every_bad_input_in_sequence_on_one_communicator():
    def fn(comm):
        for _, bad, opname in BAD:
            expect_bad(comm, bad, opname)
        return good_call(comm)

    assert ps.run_virtual(W, fn, config=CFG) == [True] * W


def test_messages_say_how_to_fix():
    def fn(comm):
        msgs = {}
        for key, call in {
            "noncontig": lambda: comm.all_reduce(x4(4, 6).t()),
            "divisible": lambda: comm.reduce_scatter(x4(W + 1)),
            "dtype": lambda: comm.all_reduce(torch.ones(2, dtype=torch.bool)),
            "op": lambda: comm.all_reduce(x4(2), "avg"),
            "root": lambda: comm.broadcast(x4(2), 9),
        }.items():
            try:
                call()
            except PurlinValueError as e:
                msgs[key] = str(e)
        return msgs

    m = ps.run_virtual(W, fn, config=CFG)[0]
    assert ".contiguous()" in m["noncontig"]
    assert "divisible by the world size (3)" in m["divisible"]
    assert "float32" in m["dtype"] and "torch.bool" in m["dtype"]
    assert "'sum'" in m["op"] and "'max'" in m["op"] and "'min'" in m["op"]
    assert "[0, 3)" in m["root"] and "9" in m["root"]


def test_use_after_close_raises_closed_on_every_call():
    def fn(comm):
        good_call(comm)
        comm.close()
        comm.close()  # twice is harmless
        calls = [lambda: comm.all_reduce(x4(3)), lambda: comm.all_gather(x4(1)),
                 lambda: comm.broadcast(x4(2), 0), lambda: comm.run(ALL_REDUCE, x4(2)),
                 lambda: comm.all_gather_v(x4(1), [1] * W), lambda: comm.capture().__enter__()]
        for call in calls:
            with pytest.raises(PurlinClosedError, match="closed") as info:
                call()
            assert isinstance(info.value, RuntimeError)
        assert comm.workspace_bytes == 0 and "closed" in repr(comm)
        return True

    assert ps.run_virtual(W, fn, config=CFG) == [True] * W


def test_close_inside_a_with_block_and_a_new_group_works():
    held = []

    def fn(comm):
        with comm as c:
            assert c is comm
            good_call(c)
        held.append(comm)
        return comm.workspace_bytes

    assert ps.run_virtual(2, fn, config=CFG) == [0, 0]
    for c in held:
        with pytest.raises(PurlinClosedError):
            c.all_reduce(x4(2))
    assert ps.run_virtual(2, good_call, config=CFG) == [True, True]


def test_run_virtual_rejects_bad_world_size():
    for world in (0, -1, 1.5, True, "2"):
        with pytest.raises(PurlinValueError, match="run_virtual: world_size"):
            ps.run_virtual(world, good_call, config=CFG)


@pytest.mark.parametrize("device,says", [
    ("tpu", "got 'tpu'"),
    ("cuda:x", "got 'cuda:x'"),
    (torch.device("meta"), "(type 'meta')"),
    (3, "for GPU 3 use 'cuda:3'"),
    (None, "got None (NoneType)"),
])
def test_run_virtual_rejects_a_bad_device_naming_the_accepted_ones(device, says):
    with pytest.raises(PurlinValueError) as info:
        ps.run_virtual(2, good_call, device=device, config=CFG)
    msg = str(info.value)
    assert msg.startswith("run_virtual: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device"), msg
    assert says in msg, msg


def test_run_virtual_rejects_a_bad_fn_or_reserve():
    with pytest.raises(PurlinValueError, match="run_virtual: fn must be a callable"):
        ps.run_virtual(2, None, config=CFG)
    for bad in (-1, 1.5, True):
        with pytest.raises(PurlinValueError, match="run_virtual: reserve_bytes must be an int >= 0"):
            ps.run_virtual(2, good_call, config=CFG, reserve_bytes=bad)


def test_staging_too_small_for_the_plan_is_a_plan_error_and_harmless():
    from purlin_sglang.errors import PurlinPlanError

    def fn(comm):
        with pytest.raises(PurlinPlanError, match="all_reduce: staging_bytes=4096 is too small") as info:
            comm.all_reduce(x4(3))  # two-shot on 8 ranks: 9 items x 64 slots in 4096 bytes, under 16 a slot
        assert "tuning.slots" in str(info.value)
        return comm.all_gather(torch.tensor([comm.rank])).tolist()  # a call that needs fewer items works

    cfg = {"staging_bytes": 4096, "timeout_s": 5, "tuning": {"slots": 64, "algorithm": "twoshot"}}
    assert ps.run_virtual(8, fn, config=cfg) == [list(range(8))] * 8


def test_close_releases_every_part_when_one_fails_and_raises_that_failure():
    released = []

    class _FailingMoE:
        def close(self):
            released.append("moe")
            raise RuntimeError("cudaFree: an illegal memory access was encountered")

    def fn(comm):
        engine_close = comm._engine.close
        comm._moe = _FailingMoE()
        comm._engine.close = lambda: (released.append("engine"), engine_close())
        with pytest.raises(RuntimeError, match="illegal memory access"):
            comm.close()
        assert comm.closed and released == ["moe", "engine"]  # the engine went too
        comm.close()  # a second close: nothing left, nothing raised
        return True

    assert ps.run_virtual(1, fn, device="cpu") == [True]
