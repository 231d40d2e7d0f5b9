"""Loopback CUDA-engine timings on one GPU: small all_reduce inside a CUDA graph, a 64 MiB all_reduce
(GB/s of the HBM bytes the plan moves), and the eager host overhead of a small call.

    python3 benchmarks/bench_cuda_engine.py [--world 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import threading

import torch

import purlin_sglang as ps
from purlin_sglang.snac import Copy, Reduce


try:
    from purlin_sglang.bench.traffic import plan_bytes  # packet ops counted too
except ImportError:  # a baseline build before bench/traffic.py: copies and reductions only
    def plan_bytes(sched) -> int:
        """HBM bytes one rank's schedule reads plus writes (copies 2n, reductions (k + 1) n)."""
        total = 0
        for op in sched.ops:
            if isinstance(op, Copy) and op.dst.nbytes and op.dst != op.src:
                total += 2 * op.dst.nbytes
            elif isinstance(op, Reduce):
                total += (len(op.srcs) + 1) * op.dst.nbytes
        return total


def _graph_time(step, sync, calls: int, replays: int, timings: int, barrier, lock) -> float:
    """One rank: ``calls`` of ``step`` captured in one graph (one capture at a time: ``lock``), replayed
    ``replays`` times with the other ranks; the median over ``timings`` of the time per call in us."""
    g = torch.cuda.CUDAGraph()
    barrier.wait()
    with lock, torch.cuda.graph(g, stream=torch.cuda.current_stream(), capture_error_mode="thread_local"):
        for _ in range(calls):
            step()
    barrier.wait()
    g.replay()
    sync()
    got = []
    for _ in range(timings):
        barrier.wait()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(replays):
            g.replay()
        e.record()
        sync()
        got.append(s.elapsed_time(e) * 1e3 / (replays * calls))
    return sorted(got)[len(got) // 2]


def graph_case(world: int, nbytes: int, calls: int, replays: int, cfg: dict, timings: int = 1) -> dict:
    """``calls`` all_reduces of ``nbytes`` bf16 captured in one graph per rank, replayed ``replays`` times;
    the time per call of each rank (the median of ``timings`` such timings), and the slowest rank's."""
    barrier = threading.Barrier(world)
    lock = threading.Lock()

    def fn(comm):
        n = nbytes // 2
        x = torch.randn(n, device=comm.device).to(torch.bfloat16)
        out = torch.empty_like(x)
        comm.all_reduce(x, out=out)
        comm.synchronize()
        # (comm._schedules: the builds before the call path, which `tools/gpu.sh ab graph` times as baselines)
        sched = next(iter((comm._path.schedules if hasattr(comm, "_path") else comm._schedules).values()))
        us = _graph_time(lambda: comm.all_reduce(x, out=out), comm.synchronize, calls, replays, timings, barrier, lock)
        return us, plan_bytes(sched), sched.plan.algorithm

    res = ps.run_virtual(world, fn, device="cuda", config=cfg)
    us = max(r[0] for r in res)
    moved = sum(r[1] for r in res)
    return {"world": world, "bytes_per_rank": nbytes, "algorithm": res[0][2], "us_per_call": us,
            "us_per_call_by_rank": [round(r[0], 2) for r in res], "plan_hbm_bytes": moved,
            "plan_hbm_GBps": moved / (us * 1e-6) / 1e9, "algbw_GBps": nbytes / (us * 1e-6) / 1e9}


def floor_case(world: int, nbytes: int, calls: int, replays: int, timings: int = 1) -> dict:
    """The graph floor of the loopback timing with no collective: each rank captures ``calls`` copies of
    ``nbytes`` (``out.copy_(x)``, one small kernel each) in its own graph, and the ranks replay them
    concurrently on their own streams, timed as graph_case times a collective. What a call costs here
    is launch and scheduling of one graph node with ``world`` rank streams sharing one GPU, and no
    cross-rank wait; a packet call's time above it is the exchange."""
    barrier = threading.Barrier(world)
    lock = threading.Lock()

    def fn(comm):
        x = torch.randn(nbytes // 2, device=comm.device).to(torch.bfloat16)
        out = torch.empty_like(x)
        out.copy_(x)
        sync = torch.cuda.current_stream().synchronize  # no purlin call to wait for
        sync()
        return _graph_time(lambda: out.copy_(x), sync, calls, replays, timings, barrier, lock)

    res = ps.run_virtual(world, fn, device="cuda", config={"staging_bytes": 1 << 16})
    return {"world": world, "bytes_per_rank": nbytes, "algorithm": "none (Tensor.copy_)", "us_per_call": max(res),
            "us_per_call_by_rank": [round(r, 2) for r in res]}


def eager_case(world: int, nbytes: int, iters: int) -> dict:
    """Eager host time per call: bench_eager_host.py's measurement (one copy of it)."""
    from bench_eager_host import eager  # a sibling script: this folder is sys.path[0] when a script here runs

    r = eager(world, iters, nbytes)
    return {"world": world, "bytes_per_rank": nbytes, "host_us_per_call_median": r["median_us"],
            "host_us_per_call_p90": r["p90_us"], "eager_us_per_call": r["wall_us_per_call"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    from purlin_sglang.engines import cuda as cuda_engine

    small = {"staging_bytes": 1 << 20}
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)

    try:
        from purlin_sglang.snac.policy import PACKET_WINDOW_BYTES as window
    except ImportError:
        window = 64 << 10
    emit({"case": "graph 8 KiB bf16", **graph_case(a.world, 8192, 50, 20, small)})
    for kib in (1, 4, 8, 16, 32, 64, 128, 256):  # the packet / one-shot crossover
        for alg in ("packet", "oneshot"):
            if alg == "packet" and kib << 10 > window:  # this build's receive window
                continue
            cfg = {**small, "tuning": {"algorithm": alg}}
            emit({"case": f"graph {kib} KiB bf16 {alg}", **graph_case(a.world, kib << 10, 50, 20, cfg)})
    for w in (1, a.world):  # the timing's floor: one small copy kernel per graph node, no exchange
        emit({"case": "graph floor: 8 KiB Tensor.copy_, no collective", **floor_case(w, 8192, 50, 20)})
    # the device call check's cost (config device_call_check: a descriptor push per kernel; predicted
    # within run-to-run noise, the stores are fire-and-forget and the check runs only in stalled waits)
    for kib, alg in ((8, "packet"), (64, "oneshot")):
        for check in (False, True):
            cfg = {**small, "tuning": {"algorithm": alg}, "device_call_check": check}
            emit({"case": f"graph {kib} KiB bf16 {alg}, device_call_check {'on' if check else 'off'}",
                  **graph_case(a.world, kib << 10, 50, 20, cfg)})
    emit({"case": "graph 64 MiB bf16", **graph_case(a.world, 64 << 20, 2, 5, {"staging_bytes": 64 << 20})})
    emit({"case": "eager 8 KiB bf16, 1 rank", **eager_case(1, 8192, 200)})
    emit({"case": "eager 8 KiB bf16", **eager_case(a.world, 8192, 200)})
    for w in (1, 2):
        emit({"case": "graph 8 KiB bf16", **graph_case(w, 8192, 50, 20, small)})
    for blocks in (1, 4):
        cuda_engine.MAX_BLOCKS = blocks
        emit({"case": f"graph 8 KiB bf16, {blocks} blocks/rank", **graph_case(a.world, 8192, 50, 20, small)})
    cuda_engine.MAX_BLOCKS = 16
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
