"""Mismatched calls seen on the device (config ``device_call_check``): a PurlinMismatchError naming
both calls at once, not a PurlinTimeoutError after ``timeout_s``; and no false alarm.

Each kernel publishes its call's descriptor (call number, folded fingerprint, description) to its
peers; a wait for a peer's signal of the call compares the peer's descriptor, loaded as the wait
began, once it completes, and reads it again while it stalls past 20 us (native.h desc_off).

Covered here: two processes on one GPU (CUDA IPC, eager calls), virtual ranks whose CUDA graphs
captured different calls (graph replays bypass the host's launch gate), calls that differ but
complete (equal bytes, the same plan) with one rank late, a peer that is only late (no mismatch),
and every collective bitwise equal to the CPU engine with the check on. Calls that differ but
complete on both sides are caught only by a rank whose first wait begins after its peer's
descriptor is visible (best effort; docs/DESIGN.md).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from _workers import mismatches_vs_cpu  # noqa: E402
from purlin_sglang.testing import launch  # noqa: E402
from purlin_sglang.testing.collectives import COLLECTIVES, case  # noqa: E402

pytestmark = pytest.mark.gpu
ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "CUDA_MODULE_LOADING": "EAGER"}
STAGING = 1 << 20
TIMEOUT_S = 30.0  # far above what a detected mismatch may take
CHECKED = {"staging_bytes": STAGING, "timeout_s": TIMEOUT_S, "device_call_check": True}

# (rank 0's call, rank 1's call, what rank 0's message says of rank 0's call, ... of rank 1's): pairs whose
# waits stall on at least one side.
PAIRS = {
    "all_reduce-vs-all_gather": (("all_reduce", torch.bfloat16, 4096), ("all_gather", torch.float32, 256),
                                 "all_reduce(dtype=bfloat16, 8192 bytes in)", "all_gather(dtype=float32, 1024 bytes in)"),
    "sizes": (("all_reduce", torch.float32, 1024), ("all_reduce", torch.float32, 8192),
              "all_reduce(dtype=float32, 4096 bytes in)", "all_reduce(dtype=float32, 32768 bytes in)"),
    "staged-vs-packet": (("all_reduce", torch.bfloat16, 1 << 18), ("all_to_all", torch.bfloat16, 64),
                         "all_reduce(dtype=bfloat16, 524288 bytes in)", "all_to_all(dtype=bfloat16, 128 bytes in)"),
    # equal bytes through the same packet plan: no wait stalls; rank 0 enters late and finds rank 1's
    # descriptor published when its first wait begins
    "equal-bytes-late": (("all_reduce", torch.float32, 1024), ("all_reduce", torch.bfloat16, 2048),
                         "all_reduce(dtype=float32, 4096 bytes in)", "all_reduce(dtype=bfloat16, 4096 bytes in)"),
}
LATE = {"equal-bytes-late": 0}  # pair -> the rank that enters the mismatched call 0.2 s late


def _call(comm, what):
    name, dtype, n = what
    x = torch.randn(n, device=comm.device).to(dtype)
    return getattr(comm, name)(x)


def _outcome(comm, fn):
    """(error type name, message, seconds) of fn() and a synchronize; ("ok", "", s) if none."""
    from purlin_sglang.errors import PurlinError

    t0 = time.monotonic()
    try:
        fn()
        comm.synchronize()
        return "ok", "", time.monotonic() - t0
    except PurlinError as e:
        return type(e).__name__, str(e), time.monotonic() - t0


def _process_worker(rank, world, pair, seed):
    import torch.distributed as dist

    import purlin_sglang as ps

    torch.cuda.set_device(0)
    torch.manual_seed(seed + rank)
    comm = ps.Communicator(None, "cuda", config={"memory": "ipc", **CHECKED})
    cpu = ps.Communicator(None, "cpu", config={"staging_bytes": STAGING, "timeout_s": TIMEOUT_S})
    cases = [case(c, torch.float32, rows=3, width=5, seed=seed + i) for i, c in enumerate(COLLECTIVES)]
    cases.append(case("all_reduce", torch.bfloat16, rows=2048, width=129, seed=seed + 99))  # two-shot
    bad = mismatches_vs_cpu(comm, cpu, cases, rank, world)  # the check on changes no result
    # a peer that is only late (rank 1 enters 0.5 s after rank 0): no mismatch
    if rank == 1:
        time.sleep(0.5)
    late = _outcome(comm, lambda: _call(comm, ("all_reduce", torch.float32, 1000)))
    dist.barrier()
    a, b = PAIRS[pair][0], PAIRS[pair][1]
    if LATE.get(pair) == rank:
        time.sleep(0.2)
    got = _outcome(comm, lambda: _call(comm, a if rank == 0 else b))
    dist.barrier()  # both kernels have ended before either frees the memory the other polls
    comm.close()
    cpu.close()
    return bad, late, got


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_processes_that_call_differently_get_a_mismatch_naming_both_calls(pair):
    seed = int.from_bytes(os.urandom(3), "little")
    res = launch(_process_worker, 2, pair, seed, timeout_s=240, env=ENV)
    mine0, mine1 = PAIRS[pair][2], PAIRS[pair][3]
    for rank, (bad, late, _) in enumerate(res):
        assert bad == [], f"seed {seed} rank {rank}:\n" + "\n".join(bad)
        assert late[0] == "ok", (rank, late)
    outcomes = [r[2] for r in res]
    found = [(rank, o) for rank, o in enumerate(outcomes) if o[0] == "PurlinMismatchError"]
    assert found, outcomes
    for rank, (kind, msg, secs) in found:
        peer = 1 - rank
        assert secs < 10, (rank, secs, msg)  # at once, not after timeout_s (30 s)
        calls = {0: mine0, 1: mine1}
        assert f"rank {rank} called {calls[rank]}, rank {peer} called {calls[peer]}" in msg, msg
    for kind, msg, secs in outcomes:
        assert kind in ("ok", "PurlinMismatchError", "PurlinBrokenError"), (kind, msg)


def _graphs_that_differ(config: dict, second_op: str | None = None):
    """Two virtual ranks warm up the same two calls, then rank 0 captures an all_reduce and rank 1
    an all_gather as the same call number (``second_op``: an all_reduce of the same tensor with that
    reduction instead: equal bytes through the same packet plan), and each replays its graph;
    run_virtual raises what a rank's synchronize raised."""
    import purlin_sglang as ps

    barrier, lock, graphs = threading.Barrier(2), threading.Lock(), []  # graphs outlive their replays

    def fn(comm):
        x = torch.randn(4096, device=comm.device).to(torch.bfloat16)
        z = torch.randn(256, device=comm.device)
        y_x, y_z = torch.empty_like(x), torch.empty(512, device=comm.device)
        if second_op:
            second = lambda: comm.all_reduce(x, second_op, out=y_x)  # noqa: E731
        else:
            second = lambda: comm.all_gather(z, out=y_z)  # noqa: E731
        comm.all_reduce(x, out=y_x)  # warm-up of both calls on both ranks (the same order: the gate agrees)
        second()
        comm.synchronize()
        g = torch.cuda.CUDAGraph()
        graphs.append(g)
        barrier.wait()
        with lock, torch.cuda.graph(g, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
            if comm.rank == 0:
                comm.all_reduce(x, out=y_x)
            else:
                second()
        barrier.wait()
        g.replay()
        comm.synchronize()

    ps.run_virtual(2, fn, device="cuda", config=config)


def test_virtual_ranks_whose_graphs_captured_different_calls_get_a_mismatch():
    from purlin_sglang.errors import PurlinMismatchError

    t0 = time.monotonic()
    with pytest.raises(PurlinMismatchError) as info:
        _graphs_that_differ(CHECKED)
    secs, msg = time.monotonic() - t0, str(info.value)
    assert secs < 15, (secs, msg)  # not after timeout_s (30 s)
    assert "all_reduce(dtype=bfloat16, 8192 bytes in)" in msg and "all_gather(dtype=float32, 1024 bytes in)" in msg, msg


def test_graphs_whose_packet_calls_differ_only_in_the_reduction_get_a_mismatch():
    """Equal bytes through the same packet plan, both replays launched together: every wait would
    complete, so only the packets' signature (snac/packet.cuh) can catch it, and it must, every time."""
    from purlin_sglang.errors import PurlinMismatchError

    for _ in range(3):
        with pytest.raises(PurlinMismatchError) as info:
            _graphs_that_differ(CHECKED, second_op="max")
        msg = str(info.value)
        assert "all_reduce(dtype=bfloat16, op=max, 8192 bytes in)" in msg, msg


def test_the_check_off_leaves_a_mismatch_to_the_timeout():
    """With the check off (device_call_check false) the same graph mismatch is a timeout after timeout_s."""
    from purlin_sglang.errors import PurlinTimeoutError

    with pytest.raises(PurlinTimeoutError):
        _graphs_that_differ({"staging_bytes": STAGING, "timeout_s": 2.0, "device_call_check": False})
