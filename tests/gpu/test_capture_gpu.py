"""A graph captured inside ``Communicator.capture()`` survives garbage whose finalisers make CUDA calls:
reference cycles made inside the capture, with enough allocation after them that the cyclic collector
would run there, are freed after the capture (their finalisers see no capture), and the replayed graph
is correct against a float64 reference on fresh inputs, its output poisoned before each replay."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang.capture import capturing_here

pytestmark = pytest.mark.gpu
SEED = int.from_bytes(os.urandom(3), "little")
CFG = {"staging_bytes": 1 << 20, "timeout_s": 10}


class _Cycle:
    """Garbage only the cyclic collector frees; its finaliser notes whether this thread was capturing and
    synchronises the device (a call that invalidates a capture running on the thread that collects)."""

    def __init__(self, log: list):
        self.log, self.me = log, self

    def __del__(self):
        self.log.append(capturing_here())
        torch.cuda.synchronize()


@pytest.mark.parametrize("world", [2, 4])
def test_garbage_collected_inside_a_capture_waits_for_its_end(world):
    barrier, one_capture = threading.Barrier(world), threading.Lock()
    rounds, n = 3, 4097

    def fn(comm):
        gen = torch.Generator().manual_seed(SEED + comm.rank)
        data = [torch.randn(n, generator=gen) for _ in range(rounds)]
        x = torch.randn(n, device=comm.device)
        out = torch.empty_like(x)
        comm.all_reduce(x, out=out)  # warm-up: its op table exists before the capture
        comm.synchronize()
        barrier.wait()
        g, log = torch.cuda.CUDAGraph(), []
        with one_capture:
            with comm.capture(), torch.cuda.graph(g, stream=torch.cuda.current_stream(),
                                                  capture_error_mode="thread_local"):
                comm.all_reduce(x, out=out)
                for _ in range(64):
                    _Cycle(log)
                junk = [[i] for i in range(50000)]  # would trigger the collector many times over
                del junk
        barrier.wait()
        got = []
        for d in data:
            x.copy_(d)
            out.fill_(float("nan"))
            g.replay()
            comm.synchronize()
            barrier.wait()
            got.append(out.cpu())
            barrier.wait()
        gc.collect()  # the cycles go now, outside any capture
        return got, log

    res = ps.run_virtual(world, fn, device="cuda", config=CFG)
    for r, (_, log) in enumerate(res):
        assert len(log) == 64, f"rank {r}: {len(log)} of 64 finalisers ran"
        assert not any(log), f"rank {r}: {sum(log)} of 64 finalisers ran inside the capture"
    for k in range(rounds):
        want = sum(_nth(SEED + r, k, n) for r in range(world))
        for r in range(world):
            torch.testing.assert_close(res[r][0][k].double(), want, rtol=1e-5, atol=1e-5)


def _nth(seed: int, k: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) for _ in range(k + 1)][k].double()
