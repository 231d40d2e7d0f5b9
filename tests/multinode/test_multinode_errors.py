"""Errors of a group on several (simulated) nodes, CPU engine inside the nodes and gloo between them.

* One rank's argument error reaches every rank of the call, on its node and on the others: the
  erring rank raises its own error, every peer a PurlinRejectedError naming it and quoting it, at once
  (timeout_s is 60), and the next calls are correct everywhere (the status round of every two-level
  call on the CPU engine).
* A rank that skips a call: its peers raise PurlinTimeoutError or PurlinBrokenError (never a bare
  error of torch.distributed) within timeout_s, and later calls raise PurlinBrokenError saying why.
"""

from __future__ import annotations

import tempfile
import time

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.errors import PurlinBrokenError, PurlinError, PurlinTimeoutError
from purlin_sglang.testing import launch
from test_rejected_calls import CASES, check, good_call, one_call  # noqa: E402

LAYOUTS = {"2x2": [0, 0, 1, 1], "interleaved": [1, 0, 1, 0]}


def _rejects(rank, world, nodes, shm, index, bad_ranks):
    _, bad, peer, _ = CASES[index]
    cfg = {"staging_bytes": 1 << 16, "timeout_s": 60, "shm_dir": shm, "topology": {"node_of_rank": nodes}}
    with ps.Communicator(config=cfg) as comm:
        assert type(comm).__name__ == "MultiNodeCommunicator"
        first = one_call(comm, bad_ranks, bad, peer)
        return first, good_call(comm), one_call(comm, set(), bad, peer)[0], good_call(comm)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("index,bad_ranks", [(0, {0}), (1, {3}), (2, {1}), (3, {2}), (4, {0}), (5, {3}), (6, {1}),
                                             (0, {1, 2})],
                         ids=[CASES[i][0] for i in (0, 1, 2, 3, 4, 5, 6)] + ["two-nodes-reject"])
def test_one_ranks_argument_error_reaches_every_node(layout, index, bad_ranks):
    with tempfile.TemporaryDirectory() as shm:
        res = launch(_rejects, 4, LAYOUTS[layout], shm, index, bad_ranks, timeout_s=120)
    check([r[0] for r in res], bad_ranks, CASES[index][3])
    for first, good, again, good_again in res:
        assert good and good_again, res  # the next calls are correct on every rank
        assert again is None  # the same call with good arguments everywhere then runs


def _skips(rank, world, shm, skipper):
    cfg = {"staging_bytes": 1 << 16, "timeout_s": 3, "shm_dir": shm, "topology": {"node_of_rank": [0, 0, 1, 1]}}
    comm = ps.Communicator(config=cfg)
    comm.all_reduce(torch.ones(4))
    if rank == skipper:
        return "skipped"
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
        first = ("no error", "")
    except PurlinError as e:
        first = (type(e).__name__, str(e))
    dt = time.monotonic() - t0
    try:
        comm.all_gather(torch.ones(2))
        later = ("no error", "")
    except PurlinError as e:
        later = (type(e).__name__, str(e))
    comm.close()
    return first, dt, later


@pytest.mark.parametrize("skipper", [1, 2])
def test_a_rank_that_skips_a_call_breaks_the_group_with_purlin_errors(skipper):
    # (other exceptions, e.g. a bare RuntimeError of gloo, fail the worker and so the launch)
    with tempfile.TemporaryDirectory() as shm:
        res = launch(_skips, 4, shm, skipper, timeout_s=120, fail_grace_s=30)
    assert res[skipper] == "skipped"
    for r, out in enumerate(res):
        if r == skipper:
            continue
        (kind, msg), dt, (later_kind, later_msg) = out
        assert kind in (PurlinTimeoutError.__name__, PurlinBrokenError.__name__), (r, kind, msg)
        assert msg.startswith("all_reduce: ") and "broken" in msg, (r, msg)
        assert dt < 3 + 5, (r, dt)
        assert later_kind == PurlinBrokenError.__name__ and later_msg.startswith("all_gather: "), (r, later_msg)
