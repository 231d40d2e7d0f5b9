"""Faults on the GPU path: a rank process SIGKILLed while its call is in flight, eager and in a CUDA
graph replay.

Two processes on one GPU (CUDA IPC between them, time-sliced: few calls). The victim enqueues its
call behind a spin kernel (``torch.cuda._sleep``), so the call has been entered on the host but its
kernel has not run when the process is killed: its peer's kernel waits for signals that never come.
The survivor must raise ``PurlinTimeoutError`` naming the dead rank within ``timeout_s`` (plus the
time-slicing's slack), ``lost_peers()`` must name that rank while the call is still outstanding (what
SGLang's plugin logs), its kernel must have exited (the device synchronizes at once afterwards: no
GPU left spinning), no process may hang, and new communicators on the same GPU must work: in the
survivor's own process (two virtual ranks) and in a fresh group of two processes.

A rank that stops calling: ``test_cuda_group.py``, ``test_skipped_call_times_out_...``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from purlin_sglang.testing import WorkerError, launch

pytestmark = pytest.mark.gpu
ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "CUDA_MODULE_LOADING": "EAGER"}
TIMEOUT_S = 3.0
SPIN_CYCLES = 4_000_000_000  # about 2 s of one spinning thread: the victim's call is queued behind it
VICTIM = 1


def _x(rank: int, n: int = 4096) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234 + rank)
    return torch.randn(n, generator=g)


def _survive(comm, call) -> dict:
    """The survivor's side: its call, the error, how long it took, whether the device is idle right
    after it, and whether a new communicator works in this process."""
    import purlin_sglang as ps
    from purlin_sglang.errors import PurlinError

    err, seen, stop = None, {}, threading.Event()

    def watch():  # what SGLang's plugin's error watch reads while the call is outstanding
        while not stop.is_set():
            lost = comm.lost_peers()
            if lost:
                seen.update(lost=dict(lost), at=time.monotonic() - t0)
                return
            time.sleep(0.05)

    t0 = time.monotonic()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        call()
        torch.cuda.current_stream().synchronize()
        comm.synchronize()
    except PurlinError as e:
        err = e
    finally:
        stop.set()
        watcher.join(5)
    elapsed = time.monotonic() - t0
    t1 = time.monotonic()
    torch.cuda.synchronize()  # returns at once only if no kernel of this process still spins
    idle_s = time.monotonic() - t1
    comm.close()

    def fresh(c):
        y = c.all_reduce(torch.full((64,), float(c.rank + 1), device=c.device))
        return y.cpu().tolist() == [3.0] * 64

    fresh_ok = ps.run_virtual(2, fresh, device="cuda", config={"timeout_s": 10}) == [True, True]
    return {"error": type(err).__name__ if err else None, "message": str(err) if err else "",
            "rank": getattr(err, "rank", None), "missing": tuple(getattr(err, "missing", ()) or ()),
            "elapsed": elapsed, "idle_s": idle_s, "fresh_ok": fresh_ok, "lost": seen.get("lost"),
            "lost_at": seen.get("at")}


def _killed_in_call(rank, world, mode):
    import purlin_sglang as ps

    torch.cuda.set_device(0)
    comm = ps.Communicator(None, "cuda", config={"memory": "ipc", "staging_bytes": 1 << 20,
                                                "timeout_s": TIMEOUT_S})
    dev = comm.device
    x = _x(rank).to(dev)
    y = torch.empty_like(x)
    want = (_x(0) + _x(1)).tolist()
    comm.all_reduce(x, out=y)  # warm-up: the op table exists before a capture
    comm.synchronize()
    assert y.cpu().tolist() == want
    graph = None
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        with comm.capture(), torch.cuda.graph(graph):
            comm.all_reduce(x, out=y)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert y.cpu().tolist() == want  # a good replay on both ranks first
    import torch.distributed as dist

    dist.barrier()
    y.fill_(float("nan"))
    if rank == VICTIM:
        torch.cuda._sleep(SPIN_CYCLES)  # the call below queues behind this: entered on the host, its kernel still waiting
        if graph is not None:
            graph.replay()
        else:
            comm.all_reduce(x, out=y)
        os.kill(os.getpid(), signal.SIGKILL)
    return _survive(comm, graph.replay if graph is not None else lambda: comm.all_reduce(x, out=y))


def _fresh_group(rank, world):
    import purlin_sglang as ps

    torch.cuda.set_device(0)
    comm = ps.Communicator(None, "cuda", config={"memory": "ipc", "staging_bytes": 1 << 20, "timeout_s": 30})
    y = comm.all_reduce(_x(rank).to(comm.device))
    comm.synchronize()
    ok = torch.equal(y.cpu(), _x(0) + _x(1))
    import torch.distributed as dist

    dist.barrier()
    comm.close()
    return ok


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_rank_killed_in_a_call_times_out_its_peer_whose_kernel_exits(mode):
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as info:
        launch(_killed_in_call, 2, mode, timeout_s=180, fail_grace_s=60, env=ENV)
    wall = time.monotonic() - t0
    e = info.value
    assert e.failures[VICTIM].kind == "died" and e.failures[VICTIM].exitcode == -signal.SIGKILL, e
    survivor = 1 - VICTIM
    assert survivor not in e.failures, e.failures.get(survivor)
    r = e.results[survivor]
    assert r["error"] == "PurlinTimeoutError", r
    assert r["rank"] == survivor and r["missing"] == (VICTIM,), r
    assert r["message"].startswith("all_reduce: ") and f"rank {VICTIM}" in r["message"], r
    assert r["elapsed"] < TIMEOUT_S + 5, r  # within timeout_s (plus the time-slicing's slack)
    assert r["idle_s"] < 1.0, r  # the survivor's kernel has exited: nothing of it still spins
    assert r["fresh_ok"], r  # a new communicator in the survivor's process works
    # while its call was outstanding, lost_peers() named the dead rank (its pid), before the timeout ended it
    assert r["lost"] is not None and list(r["lost"]) == [VICTIM] and r["lost"][VICTIM] > 0, r
    assert r["lost_at"] < r["elapsed"] + 0.5, r
    assert wall < 150, wall  # no process hung
    assert launch(_fresh_group, 2, timeout_s=120, env=ENV) == [True, True]  # and a new group of processes
