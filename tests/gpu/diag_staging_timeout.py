"""Diagnostic (not a test): repeat test_payloads_larger_than_staging[twoshot-8]'s sequence and print
every rank's error, for the intermittent reduce_scatter timeout seen on 2026-12-02.

    python3 -P tests/gpu/diag_staging_timeout.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engines"))
import purlin_sglang as ps  # noqa: E402
from _torch_reference import case, case_call, case_inputs  # noqa: E402
from purlin_sglang.engines import cuda as cuda_engine  # noqa: E402


def run(world, cases, cfg):
    barrier = threading.Barrier(world)
    errors = {}

    def fn(comm):
        jobs = []
        for c in cases:
            xs = case_inputs(c, world)
            jobs.append((c, xs[comm.rank].to(comm.device)))
        torch.cuda.current_stream().synchronize()
        barrier.wait()
        try:
            for c, x in jobs:
                case_call(comm, c, x, None)
            comm.synchronize()
        except Exception as e:  # noqa: BLE001
            errors[comm.rank] = f"{type(e).__name__}: {e}"
            raise

    try:
        ps.run_virtual(world, fn, device="cuda", config=cfg)
        return "ok"
    except Exception:  # noqa: BLE001
        return "\n    ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    full = [case(coll, torch.float32, rows=rows, width=257, seed=3, root=1)
            for coll, rows in [("all_reduce", 100), ("all_gather", 60), ("reduce_scatter", 33),
                               ("all_to_all", 33), ("broadcast", 100), ("all_to_all_v", 9)]]
    variants = {
        "full sequence, twoshot": (full, "twoshot"),
        "full sequence, oneshot": (full, "oneshot"),
        "all_gather then reduce_scatter": (full[1:3], "twoshot"),
        "reduce_scatter alone": (full[2:3], "twoshot"),
    }
    for blocks in (16, 8):
        cuda_engine.MAX_BLOCKS = blocks
        for name, (cs, alg) in variants.items():
            for rep in range(a.reps):
                cfg = {"staging_bytes": 8192, "timeout_s": 3, "tuning": {"algorithm": alg}}
                print(f"blocks={blocks} {name} rep {rep}: {run(8, cs, cfg)}", flush=True)


if __name__ == "__main__":
    main()
