"""The loopback CUDA engine checked against the CPU engine (the oracle), shared by test_cuda_engine.py
and test_packets.py: run a list of cases on both, out= (poisoned) and in place, compare bitwise."""

from __future__ import annotations

import os
import threading

import purlin_sglang as ps  # noqa: E402
from purlin_sglang.testing.collectives import assert_bits_equal, case_call, case_expected, case_inputs, poison_like  # noqa: E402

SEED = int.from_bytes(os.urandom(3), "little")  # fresh inputs every run; printed on failure
CFG = {"staging_bytes": 1 << 20, "timeout_s": 8}
INPLACE = ("all_reduce", "broadcast")


def _prepare(comm, c: dict, inplace: bool):
    xs = case_inputs(c, comm.world_size)
    want, _ = case_expected(c, comm.world_size, comm.rank, xs)
    x = xs[comm.rank].to(comm.device)
    return c, x, (x if inplace else poison_like(want).to(comm.device)), xs[comm.rank], inplace


def check(world: int, cases: list[dict], config=CFG, inplace: bool = True) -> None:
    """Run ``cases`` on the CUDA engine and on the CPU engine; bitwise equal, out= and in place.

    Every device buffer is allocated before the first collective and the ranks meet at a barrier:
    a device allocation while another loopback rank's kernel runs would serialize the ranks'
    streams (CUDA's implicit synchronization) and cost a timeout (docs/DESIGN.md)."""
    barrier = threading.Barrier(world)

    def fn(comm):
        jobs = [_prepare(comm, c, False) for c in cases]
        if inplace:
            jobs += [_prepare(comm, c, True) for c in cases if c["coll"] in INPLACE]
        barrier.wait()
        for c, x, out, _, _ in jobs:
            assert case_call(comm, c, x, out) is out
        comm.synchronize()
        res = []
        for c, x, out, x0, inpl in jobs:
            if not inpl:
                assert_bits_equal(x.cpu(), x0, f"{c['coll']}: the input must be left unchanged")
            res.append(out.cpu())
        return res

    got = ps.run_virtual(world, fn, device="cuda", config=config)
    ref = ps.run_virtual(world, fn, device="cpu", config=config)
    labels = [c["coll"] for c in cases] + [c["coll"] + " in place" for c in cases if inplace and c["coll"] in INPLACE]
    for r in range(world):
        for i, label in enumerate(labels):
            assert_bits_equal(got[r][i], ref[r][i], f"seed {SEED} world {world} rank {r}: {label} cuda vs cpu")
