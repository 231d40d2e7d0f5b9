"""The packet path's graph times, for an A/B of two builds in one device call (``tools/gpu.sh ab graph``
runs this script for this build and for a baseline, alternating, several rounds).

    python3 benchmarks/bench_graph_ab.py --label new [--timings 5] [--cases 8k-w8,...]

One JSON line per case: the slowest rank's time per call (each rank's median of ``--timings`` timings
of 20 replays x 50 captured calls; bench_cuda_engine.py graph_case). A build without the
config key ``device_call_check`` (before ABI 8) runs each case once, labelled ``check: null``.
"""

from __future__ import annotations

import argparse
import json

import purlin_sglang as ps
from purlin_sglang.engines import cuda as cuda_engine

# name -> (world, KiB, blocks per rank); "floor-*": no collective (bench_cuda_engine.floor_case: one small
# copy kernel per graph node on every rank stream, the timing's floor), the same in both builds
CASES = {"8k-w8": (8, 8, 16), "1k-w8": (8, 1, 16), "32k-w8": (8, 32, 16), "8k-w8-4blk": (8, 8, 4),
         "8k-w1": (1, 8, 16), "8k-w2": (2, 8, 16), "floor-w8": (8, 8, 0), "floor-w1": (1, 8, 0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--timings", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args()
    import bench_cuda_engine as bench  # a sibling script: this folder is sys.path[0] when a script here runs

    has_check = hasattr(ps.PurlinConfig(), "device_call_check")

    def emit(name: str, check, r: dict) -> None:
        print(json.dumps({"label": a.label, "case": name, "check": check, "us_per_call": round(r["us_per_call"], 3),
                          "by_rank": r["us_per_call_by_rank"]}), flush=True)

    for name in a.cases.split(","):
        world, kib, blocks = CASES[name]
        if name.startswith("floor"):
            if hasattr(bench, "floor_case"):
                emit(name, None, bench.floor_case(world, kib << 10, 50, 20, timings=a.timings))
            continue
        cuda_engine.MAX_BLOCKS = blocks
        for check in ((False, True) if has_check else (None,)):
            cfg = {"staging_bytes": 1 << 20, "tuning": {"algorithm": "packet"}}
            if check is not None:
                cfg["device_call_check"] = check
            emit(name, check, bench.graph_case(world, kib << 10, 50, 20, cfg, timings=a.timings))
    cuda_engine.MAX_BLOCKS = 16


if __name__ == "__main__":
    main()
