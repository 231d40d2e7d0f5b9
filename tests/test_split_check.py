"""The host split check of a process group whose engine cannot compare all_to_all_v splits (a CUDA process
group; config ``split_check``), run on the CPU: real processes over a real gloo group, the CPU engine told
that it does not check them (``checks_splits = False``, the CUDA engine's value), so the communicator's
host check is what catches the disagreement. On the GPU: tests/gpu/test_cuda_group.py."""

from __future__ import annotations

import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.engines.cpu import CpuEngine
from purlin_sglang.testing import launch

CFG = {"staging_bytes": 1 << 16, "timeout_s": 20}
WORLD = 3


def _rows(world):
    """rank p sends p + q + 1 rows to rank q: (input_splits, output_splits) of rank r, and its input."""
    def of(r):
        send = [r + q + 1 for q in range(world)]
        recv = [p + r + 1 for p in range(world)]
        return send, recv, torch.arange(sum(send), dtype=torch.float32) + 100 * r
    return of


def _worker(rank, world, split_check, late_rank):
    CpuEngine.checks_splits = False  # as the CUDA engine: the host check must catch it
    comm = ps.Communicator(config={**CFG, "split_check": split_check})
    try:
        send, recv, x = _rows(world)(rank)
        good = comm.all_to_all_v(x, send, recv)  # a call of this shape first: the second takes the cached path
        bad = list(recv)
        if rank == 1:
            bad[2] += 1  # rank 1 expects one row more from rank 2 than rank 2 sends
        if rank == late_rank:
            time.sleep(1.0)
        t0 = time.monotonic()
        err = None
        try:
            comm.all_to_all_v(x, send, bad)
        except ps.PurlinMismatchError as e:
            err = str(e)
        dt = time.monotonic() - t0
        again = comm.all_to_all_v(x, send, recv)  # usable: the next call is the next call everywhere
        return err, dt, torch.equal(good, again), good.tolist()
    finally:
        comm.close()


@pytest.mark.parametrize("late_rank", [None, 1, 2], ids=["together", "erring-late", "peer-late"])
def test_disagreeing_splits_raise_on_every_rank_naming_both_and_the_group_stays_usable(late_rank):
    res = launch(_worker, WORLD, True, late_rank, timeout_s=120)
    want = ("all_to_all_v: rank 2 sends 4 rows to rank 1 (its input_splits[1]), but rank 1 expects 5 rows from "
            "rank 2 (its output_splits[2])")
    of = _rows(WORLD)
    for r, (err, dt, same, good) in enumerate(res):
        assert err is not None and want in err, (r, err)
        assert "in call #" not in err, err  # the host check's words, before the call number is spent
        assert dt < 5.0, (r, dt)  # at once (the late rank's second), not a timeout
        assert same, r
        expect = torch.cat([of(p)[2][sum(of(p)[0][:r]):sum(of(p)[0][:r + 1])] for p in range(WORLD)])
        assert good == expect.tolist(), r


def _skipper(rank, world):
    CpuEngine.checks_splits = False
    comm = ps.Communicator(config={**CFG, "timeout_s": 2})
    send, recv, x = _rows(world)(rank)
    if rank == 0:
        return "skipped"
    t0 = time.monotonic()
    try:
        comm.all_to_all_v(x, send, recv)
        return "no error"
    except ps.PurlinTimeoutError as e:
        return str(e), time.monotonic() - t0, e.missing


def test_a_rank_that_never_makes_the_call_is_a_timeout_within_timeout_s():
    res = launch(_skipper, 2, timeout_s=120)
    assert res[0] == "skipped"
    msg, dt, missing = res[1]
    assert msg.startswith("all_to_all_v: rank 1 waited 2s (timeout_s) for its peers to compare the splits of call "
                          "#1 over the host group"), msg
    assert dt < 10, dt


def test_with_the_check_off_the_host_does_not_compare():
    # the CPU engine's own check (which the CUDA engine does not have) then finds it, in the call: its words
    res = launch(_worker, WORLD, False, None, timeout_s=120)
    for err, dt, same, good in res:
        assert err is not None and "in call #2" in err, err


def _rejecting(rank, world):
    CpuEngine.checks_splits = False
    comm = ps.Communicator(config=CFG)
    try:
        send, recv, x = _rows(world)(rank)
        t0 = time.monotonic()
        try:
            if rank == 2:
                comm.all_to_all_v(x[:-1], send, recv)  # its splits add up to one row more than its input has
            else:
                comm.all_to_all_v(x, send, recv)
            out = ("no error",)
        except ps.PurlinRejectedError as e:
            out = ("rejected", e.rank, e.cause, str(e))
        except ps.PurlinValueError as e:
            out = ("own", str(e))
        dt = time.monotonic() - t0
        good = comm.all_to_all_v(x, send, recv)  # usable: the next call is the next call everywhere
        return out, dt, good.tolist()
    finally:
        comm.close()


def test_a_rank_that_rejects_its_exchange_arguments_is_quoted_by_its_peers_at_once():
    res = launch(_rejecting, WORLD, timeout_s=120)
    own = res[2][0]
    assert own[0] == "own" and "input_splits" in own[1], own
    of = _rows(WORLD)
    for r, (out, dt, good) in enumerate(res):
        assert dt < 5.0, (r, dt)  # not the 20 s timeout
        if r != 2:
            assert out[0] == "rejected" and out[1] == 2 and out[2] == own[1] and f'"{own[1]}"' in out[3], out
        expect = torch.cat([of(p)[2][sum(of(p)[0][:r]):sum(of(p)[0][:r + 1])] for p in range(WORLD)])
        assert good == expect.tolist(), r
