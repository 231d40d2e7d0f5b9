"""Host time of an eager loopback all_reduce (8 KiB bf16), for an A/B of two builds in one device call.

    python3 benchmarks/bench_eager_host.py [--worlds 1,8] [--iters 2000] [--profile N] [--label L]

Uses only the public API (``run_virtual``, ``Communicator.all_reduce``), so the same script times an
older build (PYTHONPATH in front). Per world: the median and p90 over calls of the slowest rank's
``time.perf_counter`` around each call, and the wall time per call; with ``out=`` and with a new
output per call (``"out": "new"``, SGLang's way). ``--profile N``: then N calls of
world 1 under cProfile, the 15 functions with the most own time (where the host time goes).
One JSON line per world and output mode on stdout (with the 1-minute load average); the profile on stderr.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import threading
import time

import torch

import purlin_sglang as ps


def eager(world: int, iters: int, nbytes: int = 8192, new_out: bool = False) -> dict:
    """Eager all_reduce of ``nbytes`` bf16 per rank (``out=``; ``new_out``: without it, a new output
    per call, as SGLang calls it), ``iters`` timed calls after 20."""
    barrier = threading.Barrier(world)

    def fn(comm):
        x = torch.randn(nbytes // 2, device=comm.device).to(torch.bfloat16)
        out = None if new_out else torch.empty_like(x)
        for _ in range(20):
            comm.all_reduce(x, out=out)
        comm.synchronize()
        barrier.wait()
        host = []
        t0 = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            comm.all_reduce(x, out=out)
            host.append(time.perf_counter() - t)
        comm.synchronize()
        host.sort()
        return host[len(host) // 2] * 1e6, host[len(host) * 9 // 10] * 1e6, (time.perf_counter() - t0) * 1e6 / iters

    res = ps.run_virtual(world, fn, device="cuda", config={"staging_bytes": 1 << 20})
    return {"world": world, "bytes_per_rank": nbytes, "out": "new" if new_out else "out=",
            "median_us": round(max(r[0] for r in res), 2),
            "p90_us": round(max(r[1] for r in res), 2), "wall_us_per_call": round(max(r[2] for r in res), 2)}


def profile(calls: int) -> None:
    def fn(comm):
        x = torch.randn(4096, device=comm.device).to(torch.bfloat16)
        out = torch.empty_like(x)
        for _ in range(20):
            comm.all_reduce(x, out=out)
        comm.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            comm.all_reduce(x, out=out)
        prof.disable()
        comm.synchronize()
        return prof

    prof = ps.run_virtual(1, fn, device="cuda", config={"staging_bytes": 1 << 20})[0]
    pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="1,8")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--profile", type=int, default=0)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    for w in (int(v) for v in a.worlds.split(",")):
        for new_out in (False, True):
            row = eager(w, a.iters, new_out=new_out)
            # host load while it ran: eager host time is CPU-bound, so a busy machine (a process left by an
            # earlier step, a build) shows here rather than as a difference between builds
            print(json.dumps({"label": a.label, "version": getattr(ps, "__file__", "?"), **row,
                              "loadavg_1m": round(os.getloadavg()[0], 2)}), flush=True)
    if a.profile:
        profile(a.profile)


if __name__ == "__main__":
    main()
