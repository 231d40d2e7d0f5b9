"""Diagnostic (not a test): repeat test_payloads_larger_than_staging[*-8]'s sequence (8 loopback
ranks, 8 KiB staging, a new op table per call) and print every rank's error, with the op-table
upload of the engine (pinned mirror + copy kernel on the rank's stream) and with a synchronous
pageable host-to-device copy instead, which stalls the other loopback ranks' launches until they
time out at 8 ranks.

    python3 benchmarks/diag_staging_timeout.py [--reps 3] [--blocks 16,8]
"""

from __future__ import annotations

import argparse
import threading

import torch

import purlin_sglang as ps  # noqa: E402
from purlin_sglang.testing.collectives import case, case_call, case_inputs  # noqa: E402
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


def pageable_put(self, words, lib, stream):
    """The upload the engine avoids: a synchronous copy from pageable memory."""
    n = max(1, int(words.size))
    cur = self.chunks[-1]
    assert self.used + n <= cur.numel(), "diag: arena full"
    view = cur[self.used: self.used + n]
    if words.size:
        view.copy_(torch.from_numpy(words))
    self.used += (n + 15) // 16 * 16
    return view


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--blocks", default="16")
    a = ap.parse_args()
    full = [case(coll, torch.float32, rows=rows, width=257, seed=3, root=1)
            for coll, rows in [("all_reduce", 100), ("all_gather", 60), ("reduce_scatter", 33),
                               ("all_to_all", 33), ("broadcast", 100), ("all_to_all_v", 9)]]
    kernel_put = cuda_engine._Arena.put
    tally = {}
    for upload, put in (("pinned+kernel", kernel_put), ("pageable copy", pageable_put)):
        cuda_engine._Arena.put = put
        for blocks in [int(b) for b in a.blocks.split(",")]:
            cuda_engine.MAX_BLOCKS = blocks
            for alg in ("twoshot", "oneshot"):
                for rep in range(a.reps):
                    cfg = {"staging_bytes": 8192, "timeout_s": 3, "tuning": {"algorithm": alg}}
                    res = run(8, full, cfg)
                    key = (upload, blocks, alg)
                    tally.setdefault(key, [0, 0])[res != "ok"] += 1
                    print(f"upload={upload} blocks={blocks} {alg} rep {rep}: {res}", flush=True)
    cuda_engine._Arena.put = kernel_put
    print("summary (upload, blocks, algorithm): [ok, failed]")
    for key, (ok, bad) in tally.items():
        print(f"  {key}: ok {ok}, failed {bad}")


if __name__ == "__main__":
    main()
