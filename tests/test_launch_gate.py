"""The loopback launch gate (purlin_sglang/virtual.py) on its own, with plain threads: the two
rendezvous of a call, a rank that never comes named with its stack, a failed rank releasing the rest.
Its effect on the CUDA engine is tested in tests/gpu/test_loopback_host_code.py."""

import threading
import time

import pytest
import torch

from purlin_sglang.errors import PurlinBrokenError, PurlinMismatchError, PurlinTimeoutError
from purlin_sglang.virtual import LaunchGate


def _run(world, body):
    errors, threads = [None] * world, []

    def wrap(r):
        try:
            body(r)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    for r in range(world):
        threads.append(threading.Thread(target=wrap, args=(r,), name=f"purlin-vrank{r}"))
        threads[-1].start()
    for t in threads:
        t.join(30)
    return errors


def test_no_rank_launches_before_all_reached_and_none_returns_before_all_launched():
    world, calls = 4, 5
    gate, log, lock = LaunchGate(world, 10), [], threading.Lock()

    def body(r):
        for seq in range(1, calls + 1):
            time.sleep(0.001 * ((r * 7 + seq) % 4))  # ranks arrive in a different order every call
            with lock:
                log.append(("reach", seq, r))
            gate.enter(r, seq, "all_reduce")
            with lock:
                log.append(("launch", seq, r))
            gate.launched(r, seq, "all_reduce")
            with lock:
                log.append(("return", seq, r))

    assert _run(world, body) == [None] * world
    for seq in range(1, calls + 1):
        first_launch = min(i for i, e in enumerate(log) if e[:2] == ("launch", seq))
        last_launch = max(i for i, e in enumerate(log) if e[:2] == ("launch", seq))
        first_return = min(i for i, e in enumerate(log) if e[:2] == ("return", seq))
        last_reach = max(i for i, e in enumerate(log) if e[:2] == ("reach", seq))
        assert last_reach < first_launch  # nobody launches before every rank reached the call
        assert last_launch < first_return  # nobody returns before every rank launched


def test_a_rank_that_never_comes_is_named_with_where_it_is():
    gate = LaunchGate(3, 0.5)
    stop = threading.Event()

    def body(r):
        if r == 2:
            stop.wait(5)  # somewhere else entirely
            return
        gate.enter(r, 1, "all_gather")

    t0 = time.monotonic()
    errors = _run(3, body)
    stop.set()
    assert time.monotonic() - t0 < 10
    for r in (0, 1):
        e = errors[r]
        assert isinstance(e, PurlinTimeoutError) and e.missing == (2,), e
        assert "for call #1: rank 2 never reached it" in str(e) and "purlin-vrank2" in str(e) and "stop.wait" in str(e), e


def test_a_failed_rank_releases_the_others_at_once():
    gate = LaunchGate(3, 20)

    def body(r):
        if r == 1:
            gate.fail(1, "ValueError: bad input")
            return
        gate.enter(r, 1, "broadcast")

    t0 = time.monotonic()
    errors = _run(3, body)
    assert time.monotonic() - t0 < 5
    for r in (0, 2):
        assert isinstance(errors[r], PurlinBrokenError) and "rank 1 failed before it reached call #1" in str(errors[r]), errors[r]


@pytest.mark.parametrize("as_text", [True, False])
def test_ranks_in_different_calls_are_told_both_sides(as_text):
    """The call path passes (dtype, shape), formatted only for the error; text works too."""
    gate = LaunchGate(2, 10)
    f32 = "all_reduce(dtype=float32, shape=(4,))" if as_text else (torch.float32, torch.Size([4]))
    bf16 = "all_gather(dtype=bfloat16, shape=(2, 3))" if as_text else (torch.bfloat16, torch.Size([2, 3]))

    def body(r):
        gate.enter(r, 1, "all_reduce", 11, f32)
        if r == 0:
            gate.enter(r, 2, "all_reduce", 11, f32)
        else:
            gate.enter(r, 2, "all_gather", 22, bf16)

    errors = _run(2, body)
    for r in (0, 1):
        e = errors[r]
        assert isinstance(e, PurlinMismatchError) and e.peer == 1 - r, e
        assert f"rank {r} and rank {1 - r} entered call #2" in str(e), e
        assert "all_reduce(dtype=float32, shape=(4,))" in str(e) and "all_gather(dtype=bfloat16, shape=(2, 3))" in str(e)


def test_execute_launches_between_the_two_rendezvous_and_not_after_a_mismatch(monkeypatch):
    """LaunchGate.execute, what Communicator._execute calls for virtual ranks: every rank's launch
    after all reached the call, every return after all launched; ranks whose calls differ launch nothing."""
    from purlin_sglang.engines.base import CallContext

    # the gate serves CUDA ranks only; here no capture is in progress (and no GPU need be there)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    world, gate, log, lock = 3, LaunchGate(3, 10), [], threading.Lock()
    x = torch.zeros(4)

    def body(r):
        time.sleep(0.002 * r)
        ctx = CallContext("all_reduce", 1, 7, x.dtype, x, x, 0)
        with lock:
            log.append(("reach", r))
        gate.execute(r, ctx, lambda: log.append(("launch", r)))
        with lock:
            log.append(("return", r))

    assert _run(world, body) == [None] * world
    kinds = [k for k, _ in log]
    assert kinds.index("launch") > max(i for i, k in enumerate(kinds) if k == "reach"), log
    assert min(i for i, k in enumerate(kinds) if k == "return") > max(i for i, k in enumerate(kinds) if k == "launch")

    gate2, launched = LaunchGate(2, 10), []

    def body2(r):
        ctx = CallContext("all_reduce" if r == 0 else "all_gather", 1, 7 + r, x.dtype, x, x, 0)
        gate2.execute(r, ctx, lambda: launched.append(r))

    errors = _run(2, body2)
    assert all(isinstance(e, PurlinMismatchError) for e in errors), errors
    assert launched == []


def test_communicator_calls_go_through_the_gate(monkeypatch):
    """The wiring in Communicator._execute: with a gate (CUDA virtual ranks; forced here on CPU virtual
    ranks, whose CPU engine then runs inside it) every call passes both rendezvous, results unchanged,
    and ranks that make different calls get the gate's PurlinMismatchError before any launch."""
    import purlin_sglang as ps
    from purlin_sglang import virtual

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    seen = []
    real = LaunchGate.execute

    def counting(self, rank, ctx, launch):
        seen.append((rank, ctx.seq, ctx.op))
        return real(self, rank, ctx, launch)

    monkeypatch.setattr(LaunchGate, "execute", counting)
    init = virtual.VirtualWorld.__init__

    def with_gate(self, world, config, device):
        init(self, world, config, device)
        self.gate = LaunchGate(world, 10)

    monkeypatch.setattr(virtual.VirtualWorld, "__init__", with_gate)
    xs = [torch.randn(5, 3) for _ in range(2)]
    got = ps.run_virtual(2, lambda c: (c.all_reduce(xs[c.rank].clone()), c.all_gather(xs[c.rank])))
    for r in range(2):
        torch.testing.assert_close(got[r][0], xs[0] + xs[1], rtol=0, atol=0)
        torch.testing.assert_close(got[r][1], torch.cat(xs), rtol=0, atol=0)
    assert sorted(seen) == [(0, 1, "all_reduce"), (0, 2, "all_gather"), (1, 1, "all_reduce"), (1, 2, "all_gather")]
    with pytest.raises(PurlinMismatchError):
        ps.run_virtual(2, lambda c: c.all_reduce(xs[c.rank]) if c.rank == 0 else c.all_gather(xs[c.rank]))


def test_ranks_whose_exchange_splits_disagree_all_raise_naming_both_arguments():
    # rank 2 sends 1 row to rank 1, which expects 2 from it; ranks 0 and 1 and 2 all raise, none launches
    world = 3
    sends = [(1, 1, 1), (1, 1, 1), (1, 1, 1)]
    expects = [(1, 1, 1), (1, 1, 2), (1, 1, 1)]
    gate = LaunchGate(world, 10)

    def body(r):
        gate.enter(r, 1, "all_to_all_v", 7, "x", (sends[r], expects[r]))

    errors = _run(world, body)
    for e in errors:
        assert isinstance(e, PurlinMismatchError), errors
        assert ("all_to_all_v: rank 2 sends 1 row to rank 1 (its input_splits[1]), but rank 1 expects 2 rows "
                "from rank 2 (its output_splits[2])") in str(e), str(e)
    # splits that agree pass: rank r expects from p what p sends to r
    uneven = [(0, 2, 1), (3, 0, 0), (1, 1, 4)]
    good = LaunchGate(world, 10)
    agreed = _run(world, lambda r: good.enter(r, 1, "all_to_all_v", 7, "x",
                                              (uneven[r], tuple(uneven[p][r] for p in range(world)))))
    assert agreed == [None] * world, agreed


def test_a_slow_rank_still_sees_a_mismatch_after_its_peer_has_entered_the_next_call():
    # rank 1 checks the first call only after rank 0 raised there and entered the second: rank 0's entry
    # of the first must still be what rank 1 compares with, so both raise and both then make the second
    world = 2
    sends, expects = [(1, 1), (1, 1)], [(1, 1), (1, 2)]
    rank0_in_call_2 = threading.Event()

    class SlowCheck(LaunchGate):
        def _meet(self, what, rank, seq, op):
            super()._meet(what, rank, seq, op)
            if what == "reach" and seq == 1 and rank == 1:
                assert rank0_in_call_2.wait(5)  # rank 0 has raised and entered its next call

        def enter(self, rank, seq, *args):
            if seq == 2 and rank == 0:
                rank0_in_call_2.set()
            super().enter(rank, seq, *args)

    gate, outcome = SlowCheck(world, 10), [None] * world

    def body(r):
        try:
            gate.enter(r, 1, "all_to_all_v", 7, "x", (sends[r], expects[r]))
            outcome[r] = "passed"
        except PurlinMismatchError:
            outcome[r] = "mismatch"
        gate.enter(r, 2, "all_to_all_v", 7, "x", (sends[r], sends[r]))
        gate.launched(r, 2, "all_to_all_v")

    assert _run(world, body) == [None] * world
    assert outcome == ["mismatch", "mismatch"], outcome
