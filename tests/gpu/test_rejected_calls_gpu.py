"""One virtual rank's argument error on the CUDA engine (eager): the peers raise PurlinRejectedError
from the launch gate at once, naming it and quoting its error, no rank launches the call, and the
next calls (a new shape and one already bound) are correct on every rank. The same contract as
tests/test_rejected_calls.py on the CPU engine."""

from __future__ import annotations

import time

import pytest
import torch

import purlin_sglang as ps

pytestmark = pytest.mark.gpu
CFG = {"staging_bytes": 1 << 20, "timeout_s": 60}


@pytest.mark.parametrize("bad_rank", [0, 2])
def test_a_rejected_call_on_one_virtual_rank(bad_rank):
    def fn(comm):
        dev = comm.device
        x = torch.full((1024,), float(comm.rank + 1), device=dev)
        first = comm.all_reduce(x)  # a shape the ranks have seen before the rejected call
        t0 = time.monotonic()
        try:
            if comm.rank == bad_rank:
                comm.all_reduce(x, out=torch.empty(1024, dtype=torch.float16, device=dev))
            else:
                comm.all_reduce(x)
            err = None
        except ps.PurlinValueError as e:
            err = (type(e).__name__, str(e), getattr(e, "rank", None), getattr(e, "cause", None))
        dt = time.monotonic() - t0
        again = comm.all_reduce(x)
        g = comm.all_gather(torch.full((3,), comm.rank, device=dev, dtype=torch.int32))
        torch.cuda.synchronize(dev)
        want = float(sum(range(1, comm.world_size + 1)))
        ok = bool((first == want).all() and (again == want).all())
        return err, dt, ok, g.cpu().tolist()

    res = ps.run_virtual(3, fn, device="cuda", config=CFG)
    own = res[bad_rank][0][1]
    assert own.startswith("all_reduce: out has dtype"), own
    for r, (err, dt, ok, g) in enumerate(res):
        assert err is not None and dt < 1.0 and ok, (r, err, dt, ok)
        assert g == [q for q in range(3) for _ in range(3)], g
        if r != bad_rank:
            name, msg, rank, cause = err
            assert name == "PurlinRejectedError" and rank == bad_rank and cause == own and own in msg, err


def test_disagreeing_all_to_all_v_splits_raise_on_every_virtual_rank_naming_both_arguments():
    world = 4

    def fn(comm):
        dev, r = comm.device, comm.rank
        send = [r + q for q in range(world)]  # rank p sends p + q rows to rank q
        recv = [p + r for p in range(world)]
        bad = list(recv)
        if r == 1:
            bad[3] += 1  # rank 1 expects one row more from rank 3 than rank 3 sends
        x = torch.arange(sum(send), device=dev, dtype=torch.float32) + 100 * r
        t0 = time.monotonic()
        try:
            comm.all_to_all_v(x, send, bad)
            err = None
        except ps.PurlinMismatchError as e:
            err = str(e)
        dt = time.monotonic() - t0
        y = comm.all_to_all_v(x, send, recv)  # the communicator stays usable: a correct call after it
        torch.cuda.synchronize(dev)
        want = torch.cat([(torch.arange(sum(p + q for q in range(world))) + 100 * p)[sum(p + q for q in range(r)):
                                                                              sum(p + q for q in range(r + 1))]
                          for p in range(world)])
        return err, dt, torch.equal(y.cpu(), want.float())

    for r, (err, dt, ok) in enumerate(ps.run_virtual(world, fn, device="cuda", config=CFG)):
        assert err is not None and ("rank 3 sends 4 rows to rank 1 (its input_splits[1]), but rank 1 expects 5 rows "
                                    "from rank 3 (its output_splits[3])") in err, (r, err)
        assert dt < 1.0 and ok, (r, dt, ok)
