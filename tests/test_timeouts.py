"""Timeouts and mismatches: a rank that skips a call, ranks that disagree, a rank that raises.

Nothing may hang: every wait is bounded by ``timeout_s``; disagreements are detected from the
call descriptors (quickly, not by timing out); afterwards the communicator is broken, says so,
and a new one works.
"""

import dataclasses
import threading
import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang import config as ps_config
from purlin_sglang.errors import PurlinBrokenError, PurlinMismatchError, PurlinTimeoutError
from purlin_sglang.testing import launch

SHORT = {"staging_bytes": 1 << 16, "timeout_s": 2}
LONG = {"staging_bytes": 1 << 16, "timeout_s": 20}  # mismatches must be found long before this


def outcome(call):
    """(exception or None, seconds the call took)."""
    t0 = time.monotonic()
    try:
        call()
        return None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the tests inspect it
        return e, time.monotonic() - t0


def then_broken(comm):
    """The next call on a failed communicator raises PurlinBrokenError quickly, with a clear message."""
    e, dt = outcome(lambda: comm.all_reduce(torch.ones(4)))
    assert isinstance(e, PurlinBrokenError), repr(e)
    assert dt < 3  # at once, or as soon as the failed peer has marked itself broken
    assert str(e).startswith("all_reduce: ") and "create a new Communicator" in str(e), str(e)
    if "the communicator is broken" in str(e):
        assert str(e).startswith("all_reduce: the communicator is broken by an earlier failure ("), str(e)
    else:  # this rank learnt it only now, from a peer that failed; from now on it is broken too
        assert "failed" in str(e), str(e)
        e, dt = outcome(lambda: comm.all_gather(torch.ones(4)))
        assert isinstance(e, PurlinBrokenError) and dt < 0.5, repr(e)
        assert str(e).startswith("all_gather: the communicator is broken by an earlier failure ("), str(e)
    assert "broken" in repr(comm)
    return True


def good_group(comm):
    out = comm.all_reduce(torch.full((3,), float(comm.rank + 1)))
    assert out.tolist() == [comm.world_size * (comm.world_size + 1) / 2] * 3
    return True


@pytest.mark.parametrize("world,skipper", [(2, 1), (3, 0)])
def test_rank_skips_a_call_the_others_time_out_naming_it(world, skipper):
    def fn(comm):
        comm.all_reduce(torch.ones(8))  # a good call first: the skip is in call #2
        if comm.rank == skipper:
            return "skipped"  # and makes no further collective calls
        e, dt = outcome(lambda: comm.all_reduce(torch.ones(8)))
        assert isinstance(e, PurlinTimeoutError), repr(e)
        assert 2 <= dt < 2 + 3, dt
        assert e.op == "all_reduce" and e.rank == comm.rank and e.missing == (skipper,)
        msg = str(e)
        assert msg.startswith("all_reduce:"), msg
        assert f"rank {comm.rank} waited 2s" in msg and f"[{skipper}]" in msg and "call #2" in msg, msg
        assert f"rank {skipper} last entered call #1" in msg, msg
        return then_broken(comm)

    res = ps.run_virtual(world, fn, config=SHORT)
    assert res[skipper] == "skipped" and all(r is True for i, r in enumerate(res) if i != skipper)
    assert ps.run_virtual(world, good_group, config=SHORT) == [True] * world


def test_skip_of_a_call_where_the_skipper_only_consumes():
    # broadcast from root 0: the root's schedule never waits for rank 1, but every call starts by
    # reading each peer's descriptor of it, so the broadcast itself finds rank 1 missing and names it.
    def fn(comm):
        if comm.rank == 0:
            e, dt = outcome(lambda: comm.broadcast(torch.ones(4), 0))
            assert isinstance(e, PurlinTimeoutError), repr(e)
            assert e.missing == (1,) and "broadcast" in str(e) and dt < 5
            return then_broken(comm)
        return "skipped"

    assert ps.run_virtual(2, fn, config=SHORT) == [True, "skipped"]


def disagree(call, world=2, late=None):
    """Run ``call(comm)`` (which disagrees between ranks) on every rank; check it is a quick mismatch.

    At least one rank raises PurlinMismatchError; a rank may instead see its peer fail
    (PurlinBrokenError) or, if its own part was consistent, return; its next call then reports
    the broken communicator. Returns the per-rank errors of the disagreeing call. Rank ``late``
    enters the call 0.1 s after the others (so they are already waiting for it).
    """
    def fn(comm):
        if comm.rank == late:
            time.sleep(0.1)
        e, dt = outcome(lambda: call(comm))
        assert dt < 5, dt
        assert e is None or isinstance(e, (PurlinMismatchError, PurlinBrokenError)), repr(e)
        then_broken(comm)
        return e

    errs = ps.run_virtual(world, fn, config=LONG)
    assert any(isinstance(e, PurlinMismatchError) for e in errs), errs
    for e in errs:
        if isinstance(e, PurlinMismatchError):
            assert 0 <= e.peer < world and e.peer != e.rank and str(e).startswith(e.op + ":"), e
    assert ps.run_virtual(world, good_group, config=LONG) == [True] * world  # a new group works
    return errs


CALLS = {
    "all_reduce": lambda c: c.all_reduce(torch.ones(4)),
    "all_gather": lambda c: c.all_gather(torch.ones(4)),
    "all_to_all": lambda c: c.all_to_all(torch.ones(4)),
    "reduce_scatter": lambda c: c.reduce_scatter(torch.ones(4)),
    "all_reduce-bf16": lambda c: c.all_reduce(torch.ones(4, dtype=torch.bfloat16)),
    "all_reduce-max": lambda c: c.all_reduce(torch.ones(4), "max"),
    "all_reduce-6": lambda c: c.all_reduce(torch.ones(6)),
    "all_gather-2x2": lambda c: c.all_gather(torch.ones(2, 2)),
    "broadcast-root0": lambda c: c.broadcast(torch.ones(4), 0),
    "broadcast-root1": lambda c: c.broadcast(torch.ones(4), 1),
}


@pytest.mark.parametrize("a,b", [
    ("all_reduce", "all_gather"), ("all_gather", "all_to_all"), ("reduce_scatter", "all_reduce"),
    ("all_reduce", "all_reduce-bf16"), ("all_reduce", "all_reduce-max"), ("all_reduce", "all_reduce-6"),
    ("all_gather", "all_gather-2x2"), ("broadcast-root0", "broadcast-root1"), ("broadcast-root0", "all_gather"),
], ids=lambda v: v)
@pytest.mark.parametrize("late", [None, 1])
def test_ranks_disagree_on_the_call_mismatch_not_timeout(a, b, late):
    disagree(lambda comm: CALLS[a if comm.rank == 0 else b](comm), late=late)


def test_mismatch_message_names_ranks_and_call():
    errs = disagree(lambda comm: comm.all_reduce(torch.ones(4)) if comm.rank == 0 else comm.all_gather(torch.ones(4)))
    e = next(e for e in errs if isinstance(e, PurlinMismatchError))
    assert e.peer == 1 - e.rank and e.op in ("all_reduce", "all_gather")
    assert f"rank {e.rank} and rank {e.peer} entered call #1 with different collectives" in str(e), e
    # both sides' calls, each as its rank made it
    assert "rank 0 called all_reduce(dtype=float32, 16 bytes in)" in str(e), e
    assert "rank 1 called all_gather(dtype=float32, 16 bytes in)" in str(e), e


@pytest.mark.parametrize("a,b,mine,theirs", [
    ("all_reduce", "all_reduce-bf16", "all_reduce(dtype=float32, 16 bytes in)", "all_reduce(dtype=bfloat16, 8 bytes in)"),
    ("all_reduce", "all_reduce-6", "all_reduce(dtype=float32, 16 bytes in)", "all_reduce(dtype=float32, 24 bytes in)"),
    ("all_reduce", "all_reduce-max", "all_reduce(dtype=float32, 16 bytes in)",
     "all_reduce(dtype=float32, op=max, 16 bytes in)"),
    ("broadcast-root0", "broadcast-root1", "broadcast(dtype=float32, root=0, 16 bytes in)",
     "broadcast(dtype=float32, root=1, 16 bytes in)"),
], ids=["dtype", "size", "op", "root"])
def test_mismatch_message_describes_each_side(a, b, mine, theirs):
    errs = disagree(lambda comm: CALLS[a if comm.rank == 0 else b](comm))
    e = next(e for e in errs if isinstance(e, PurlinMismatchError))
    calls = {0: mine, 1: theirs}
    assert f"rank {e.rank} called {calls[e.rank]}, rank {e.peer} called {calls[e.peer]}" in str(e), e


def splits_disagree(call, world, expected, late=None):
    """Run ``call(comm)`` (splits that disagree between ranks) on every rank: every rank raises the same
    PurlinMismatchError naming ``expected`` within 1 s (timeout 20 s), before any data moves, and the
    communicator stays usable: the next calls are correct everywhere."""
    def fn(comm):
        if comm.rank == late:
            time.sleep(0.1)
        e, dt = outcome(lambda: call(comm))
        assert isinstance(e, PurlinMismatchError), repr(e)
        assert dt < 1 + (0.1 if late is not None else 0), dt
        assert e.rank == comm.rank and e.op and str(e).startswith(e.op + ":"), e
        for n in (3, 5):  # the next calls are the next calls on every rank
            out = comm.all_reduce(torch.full((n,), float(comm.rank + 1)))
            assert out.tolist() == [comm.world_size * (comm.world_size + 1) / 2] * n
        return str(e)

    msgs = ps.run_virtual(world, fn, config=LONG)
    assert len(set(msgs)) == 1, msgs  # one message, word for word, on every rank
    assert expected in msgs[0] and "split sizes disagree" in msgs[0], msgs[0]
    return msgs[0]


@pytest.mark.parametrize("late", [None, 0, 1])
def test_all_to_all_v_splits_that_disagree_raise_on_every_rank(late):
    def call(comm):
        # rank 0 sends 2 rows to rank 1, but rank 1 expects 1 row from rank 0
        if comm.rank == 0:
            return comm.all_to_all_v(torch.ones(3, 2), [1, 2], [1, 1])
        return comm.all_to_all_v(torch.ones(2, 2), [1, 1], [1, 1])

    splits_disagree(call, 2, "all_to_all_v: rank 0 sends 2 rows to rank 1 (its input_splits[1]), but rank 1 "
                    "expects 1 row from rank 0 (its output_splits[0])", late=late)


def test_splits_that_disagree_between_two_other_ranks_reach_the_third():
    # ranks 1 and 2 disagree; rank 0's own pairs agree, and it raises the same error (it does not wait
    # for data that ranks 1 and 2 will never send)
    def call(comm):
        ins = {0: [1, 1, 1], 1: [1, 1, 3], 2: [1, 1, 1]}[comm.rank]
        outs = {0: [1, 1, 1], 1: [1, 1, 1], 2: [1, 1, 1]}[comm.rank]
        return comm.all_to_all_v(torch.randn(sum(ins), 4), ins, outs)

    splits_disagree(call, 3, "rank 1 sends 3 rows to rank 2 (its input_splits[2]), but rank 2 expects 1 row "
                    "from rank 1 (its output_splits[1])")


@pytest.mark.parametrize("late", [None, 0, 1])
def test_all_gather_v_sizes_that_disagree_raise_on_every_rank(late):
    def call(comm):
        sizes = [1, 2] if comm.rank == 0 else [1, 1]
        return comm.all_gather_v(torch.ones(sizes[comm.rank]), sizes)

    splits_disagree(call, 2, "all_gather_v: rank", late=late)


def test_all_to_all_v_splits_that_disagree_in_processes():
    # the same contract across processes (shared memory between them)
    res = launch(_process_splits, 2, timeout_s=120)
    assert res[0] == res[1] and "rank 0 sends 2 rows to rank 1" in res[0], res


def _process_splits(rank, world):
    comm = ps.Communicator(config=LONG)
    try:
        ins = [1, 2] if rank == 0 else [1, 1]
        e, dt = outcome(lambda: comm.all_to_all_v(torch.ones(sum(ins), 2), ins, [1, 1]))
        assert isinstance(e, PurlinMismatchError) and dt < 1, (repr(e), dt)
        out = comm.all_to_all_v(torch.full((2, 2), float(rank)), [1, 1], [1, 1])
        assert out[:, 0].tolist() == [0.0, 1.0], out
        return str(e)
    finally:
        comm.close()


def test_disagreement_among_three_ranks():
    disagree(lambda comm: comm.all_reduce(torch.ones(3 if comm.rank == 2 else 6)), world=3)


def test_an_ordinary_exception_in_one_rank_is_what_run_virtual_raises():
    class Boom(Exception):
        pass

    def fn(comm):
        comm.all_reduce(torch.ones(2))
        if comm.rank == 1:
            raise Boom("rank 1 fails in user code")
        comm.all_reduce(torch.ones(2))  # rank 1 never comes: its failure must release us
        return "unreachable"

    t0 = time.monotonic()
    with pytest.raises(Boom, match="rank 1 fails in user code") as info:
        ps.run_virtual(3, fn, config=LONG)
    assert time.monotonic() - t0 < 5  # released at once, not after timeout_s
    assert any("ranks [0, 1, 2] failed" in n for n in getattr(info.value, "__notes__", [])), info.value
    assert ps.run_virtual(3, good_group, config=LONG) == [True] * 3


def test_a_rank_left_waiting_in_user_code_reports_the_error_of_the_rank_that_raised(monkeypatch):
    """Rank 0 raises in user code; rank 1 waits on something of the caller's that purlin cannot release
    (an event here, a test's barrier in practice): the join timeout names rank 1 and carries rank 0's
    error as its cause and in a note, so the root cause is not hidden behind the timeout."""
    class Boom(Exception):
        pass

    real = ps_config.timeouts
    monkeypatch.setattr(ps_config, "timeouts", lambda s: dataclasses.replace(real(s), join_s=1.0))
    release = threading.Event()

    def fn(comm):
        comm.all_reduce(torch.ones(2))
        if comm.rank == 0:
            raise Boom("rank 0 fails in user code")
        release.wait(30)  # the caller's own wait
        return "released"

    try:
        with pytest.raises(PurlinTimeoutError, match="rank 1 did not return") as info:
            ps.run_virtual(2, fn, config=LONG)
    finally:
        release.set()
    assert isinstance(info.value.__cause__, Boom)
    assert any("rank 0 had raised Boom: rank 0 fails in user code" in n for n in info.value.__notes__)


def test_waiting_peers_see_a_failed_rank_as_broken_not_timeout():
    def fn(comm):
        if comm.rank == 1:
            try:
                comm.all_reduce(torch.ones(2, dtype=torch.float64))  # disagrees with rank 0: mismatch
            except Exception as e:  # noqa: BLE001
                return type(e)
            return None
        time.sleep(0.2)
        e, dt = outcome(lambda: comm.all_reduce(torch.ones(2)))
        return type(e), dt

    (k0, dt), k1 = ps.run_virtual(2, fn, config=LONG)
    assert {k0, k1} <= {PurlinMismatchError, PurlinBrokenError} and PurlinMismatchError in {k0, k1}
    assert dt < 5


# -- multi-process ---------------------------------------------------------------------------
def _mp_skip(rank, world, skipper):
    comm = ps.Communicator(config={"staging_bytes": 1 << 16, "timeout_s": 2})
    try:
        comm.all_reduce(torch.ones(8))
        if rank == skipper:
            res = ("skipped",)
        else:
            e, dt = outcome(lambda: comm.all_reduce(torch.ones(8)))
            b, _ = outcome(lambda: comm.all_gather(torch.ones(1)))
            res = (type(e).__name__, dt, getattr(e, "missing", None), getattr(e, "op", None), str(e),
                   type(b).__name__, str(b))
    finally:
        comm.close()
    # a new Communicator on every rank (the skipper included) works
    with ps.Communicator(config={"staging_bytes": 1 << 16, "timeout_s": 5}) as fresh:
        return res, fresh.all_reduce(torch.full((2,), float(rank + 1))).tolist()


def test_multiprocess_skip_times_out_then_broken_then_a_new_communicator_works():
    res = launch(_mp_skip, 3, 2, timeout_s=120)
    assert res[2][0] == ("skipped",)
    for rank in (0, 1):
        (kind, dt, missing, op, msg, later, later_msg), _ = res[rank]
        assert kind == "PurlinTimeoutError", res[rank]
        assert 2 <= dt < 5 and missing == (2,) and op == "all_reduce"
        assert f"rank {rank} waited 2s" in msg and "rank 2 last entered call #1" in msg, msg
        assert later == "PurlinBrokenError" and later_msg.startswith("all_gather: the communicator is broken")
    assert [r[1] for r in res] == [[6.0, 6.0]] * 3
