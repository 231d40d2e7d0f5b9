"""One rank's own argument error reaches every rank of the call: the erring rank raises its error,
every peer a PurlinRejectedError that names it and quotes that error, at once (not after
``timeout_s``), and the call number is spent on every rank alike, so the next call is the next call
everywhere. The CPU engine (virtual ranks and processes) and the virtual ranks' launch gate."""

import threading
import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.errors import PurlinRejectedError, PurlinValueError
from purlin_sglang.testing import launch
from purlin_sglang.virtual import LaunchGate

CFG = {"staging_bytes": 1 << 16, "timeout_s": 60}

# (id, the erring rank's call, its peers' call of the same collective, the op name)
CASES = [
    ("out-dtype", lambda c: c.all_reduce(torch.ones(4), out=torch.empty(4, dtype=torch.float64)),
     lambda c: c.all_reduce(torch.ones(4)), "all_reduce"),
    ("bad-op", lambda c: c.all_reduce(torch.ones(4), op="avg"), lambda c: c.all_reduce(torch.ones(4)), "all_reduce"),
    ("none-input", lambda c: c.all_gather(None), lambda c: c.all_gather(torch.ones(2)), "all_gather"),
    ("a2av-splits-sum", lambda c: c.all_to_all_v(torch.ones(5, 2), [1] * c.world_size, [1] * c.world_size),
     lambda c: c.all_to_all_v(torch.ones(c.world_size, 2), [1] * c.world_size, [1] * c.world_size), "all_to_all_v"),
    ("agv-sizes", lambda c: c.all_gather_v(torch.ones(2), [1] * c.world_size),
     lambda c: c.all_gather_v(torch.ones(1), [1] * c.world_size), "all_gather_v"),
    ("a2av-both-names", lambda c: c.all_to_all_v(torch.ones(c.world_size), [1] * c.world_size,
                                                 input_split_sizes=[1] * c.world_size),
     lambda c: c.all_to_all_v(torch.ones(c.world_size), [1] * c.world_size, [1] * c.world_size), "all_to_all_v"),
    ("root-out-of-range", lambda c: c.broadcast(torch.ones(3), c.world_size),
     lambda c: c.broadcast(torch.ones(3), 0), "broadcast"),
]


def good_call(comm) -> bool:
    x = torch.full((5, 3), float(comm.rank + 1))
    want = torch.full((5, 3), float(sum(range(1, comm.world_size + 1))))
    return torch.equal(comm.all_reduce(x), want) and comm.all_gather(
        torch.tensor([comm.rank])).tolist() == list(range(comm.world_size))


def one_call(comm, bad_ranks, bad, peer):
    """This rank's part of one call (bad on ``bad_ranks``): (error type, message, .rank, .cause, seconds)."""
    t0 = time.monotonic()
    try:
        (bad if comm.rank in bad_ranks else peer)(comm)
    except PurlinValueError as e:
        return type(e).__name__, str(e), getattr(e, "rank", None), getattr(e, "cause", None), time.monotonic() - t0
    return None, "", None, None, time.monotonic() - t0


def check(res, bad_ranks, opname):
    own = {r: res[r][1] for r in bad_ranks}
    first = min(bad_ranks)
    for r, (name, msg, rank, cause, dt) in enumerate(res):
        assert dt < 1.0, (r, dt)  # at once: timeout_s is 60
        assert msg.startswith(opname + ":"), msg
        if r in bad_ranks:
            assert name not in (None, "PurlinRejectedError"), (r, name, msg)
        else:
            assert name == "PurlinRejectedError" and rank == first and cause == own[first], (r, name, rank, cause)
            assert f"rank {first} rejected its arguments" in msg and own[first] in msg, msg


@pytest.mark.parametrize("bad,peer,opname", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("bad_rank", [0, 2])
def test_virtual_ranks(bad, peer, opname, bad_rank):
    def fn(comm):
        return one_call(comm, {bad_rank}, bad, peer), good_call(comm)

    res = ps.run_virtual(3, fn, config=CFG)
    check([r[0] for r in res], {bad_rank}, opname)
    assert all(r[1] for r in res)


def test_two_ranks_reject_one_call_and_calls_in_a_row():
    # ranks 1 and 3 reject the same call (the peers name rank 1, and say rank 3 did too); then rank 0
    # rejects ten calls in a row (it may run ahead of a peer that has entered a call but not yet read
    # why it was rejected), and the peers raise in each, quoting it; then a good call
    bad, peer, opname = CASES[0][1:]

    def fn(comm):
        out = [one_call(comm, {1, 3}, bad, peer)]
        out += [one_call(comm, {0}, bad, peer) for _ in range(10)]
        return out, good_call(comm)

    res = ps.run_virtual(4, fn, config=CFG)
    check([r[0][0] for r in res], {1, 3}, opname)
    assert "ranks [3] rejected theirs too" in res[0][0][0][1]
    for i in range(1, 11):
        check([r[0][i] for r in res], {0}, opname)
    assert all(r[1] for r in res)


def test_a_rejected_call_then_a_mismatch_is_still_found():
    # the spent call number keeps the ranks aligned: a real mismatch in the next call is still a mismatch
    def fn(comm):
        first = one_call(comm, {0}, CASES[0][1], CASES[0][2])
        try:
            comm.all_reduce(torch.ones(4 if comm.rank else 5))
        except ps.PurlinError as e:
            return first, type(e).__name__
        return first, None

    res = ps.run_virtual(2, fn, config={**CFG, "timeout_s": 5})
    check([r[0] for r in res], {0}, "all_reduce")
    assert "PurlinMismatchError" in [r[1] for r in res], res


def _mp_case(rank, world, index, bad_rank):
    _, bad, peer, _ = CASES[index]
    comm = ps.Communicator(config=CFG)
    try:
        return one_call(comm, {bad_rank}, bad, peer), good_call(comm)
    finally:
        comm.close()


@pytest.mark.parametrize("index,bad_rank", [(0, 1), (3, 0), (2, 2)], ids=[CASES[i][0] for i in (0, 3, 2)])
def test_process_group(index, bad_rank):
    res = launch(_mp_case, 3, index, bad_rank, timeout_s=120)
    check([r[0] for r in res], {bad_rank}, CASES[index][3])
    assert all(r[1] for r in res)


def test_launch_gate_reject():
    # the virtual CUDA ranks' gate (pure host code): rank 1 rejects call 1; ranks 0 and 2 raise from
    # enter() quoting it, launching nothing; call 2 then meets on every rank
    gate = LaunchGate(3, timeout_s=60)
    out: dict = {}

    def rank(r):
        t0 = time.monotonic()
        try:
            if r == 1:
                gate.reject(1, 1, "all_reduce", "all_reduce: out has dtype torch.float64, x has torch.float32")
            else:
                gate.enter(r, 1, "all_reduce", 7, "x")
                out[r] = "launched"
                return
        except PurlinRejectedError as e:
            out[r] = (e.rank, e.cause, str(e), time.monotonic() - t0)
        gate.enter(r, 2, "all_gather", 9, "y")
        gate.launched(r, 2, "all_gather")
        out[(r, 2)] = True

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in (0, 2):
        got_rank, cause, msg, dt = out[r]
        assert got_rank == 1 and cause.startswith("all_reduce: out has dtype") and cause in msg and dt < 1.0
    assert 1 not in out and all(out[(r, 2)] for r in range(3))
