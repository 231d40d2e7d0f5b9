"""Host cost of the split check (config ``split_check``) per eager all_to_all_v, without a GPU (not a test).

    python3 benchmarks/bench_split_check.py [--worlds 2,3] [--iters 200] [--rounds 2] [--json out.json]

A CUDA process group compares every rank's all_to_all_v splits over its gloo group before each call.
The same host code is timed here on a CPU-engine process group of real processes over gloo, the engine
told that it does not check splits itself (``checks_splits = False``, the CUDA engine's value), against
the same group with the check left to the engine: us per call (mean over ``--iters`` calls of 1 row to
every peer, after 20 untimed), every rank's figure, the two settings alternating for ``--rounds``.
On a machine with fewer cores than ranks the processes share cores: the figures are then upper bounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _rank(rank, world, host_check, iters):
    import purlin_sglang as ps
    from purlin_sglang.engines.cpu import CpuEngine

    CpuEngine.checks_splits = not host_check
    comm = ps.Communicator(config={"staging_bytes": 1 << 16, "timeout_s": 30, "split_check": True})
    try:
        send, x = [1] * world, torch.ones(world)
        for _ in range(20):
            comm.all_to_all_v(x, send, send)
        t0 = time.perf_counter()
        for _ in range(iters):
            comm.all_to_all_v(x, send, send)
        return (time.perf_counter() - t0) / iters * 1e6
    finally:
        comm.close()


def main(argv=None) -> int:
    from purlin_sglang.testing import launch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,3")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        for rnd in range(1, args.rounds + 1):
            for host_check in (False, True):
                us = launch(_rank, world, host_check, args.iters, timeout_s=600)
                rows.append({"world": world, "round": rnd, "host_check": host_check, "us_per_call": us})
                print(f"world {world} round {rnd} {'host check ' if host_check else 'engine only'} "
                      f"us per call: {', '.join(f'{v:.1f}' for v in us)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
