"""Timers: CUDA events on a GPU stream, time.perf_counter on the host.

``time_each(step, iters, stream)`` runs ``step(i)`` ``iters`` times and returns one duration
in seconds per call. On CUDA each call is bracketed by events recorded on ``stream`` (the
rank's own stream) and the host blocks only once at the end, so the timed loop issues work
back to back as nccl-tests does.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable


def time_each(step: Callable[[int], Any], iters: int, stream: Any = None) -> list[float]:
    if stream is None:
        out = []
        for i in range(iters):
            t0 = time.perf_counter()
            step(i)
            out.append(time.perf_counter() - t0)
        return out
    import torch

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record(stream)
        step(i)
        ends[i].record(stream)
    stream.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]


def sync(stream: Any) -> None:
    """Wait for everything issued on ``stream`` (no-op on the host)."""
    if stream is not None:
        stream.synchronize()


LAUNCH_AHEAD_S = 0.05  # the GPU sleep that holds a stream while the host enqueues its timed replays


def time_graph_replays(graph: Any, side: Any, calls: int, warmup: int, iters: int,
                       barrier: Callable[[], Any], ahead: bool = False) -> list[float]:
    """Seconds per captured call: warm-up replays, a host ``barrier`` so every rank starts
    together, then ``iters`` replays timed with events on ``side``, each divided by ``calls``.

    ``ahead`` (``--launch-ahead``): the stream first runs a GPU sleep of LAUNCH_AHEAD_S while the host
    enqueues every timed replay, so the replays run back to back and the host's launch time between
    them is not timed. Without it, a host that launches more slowly than the GPU runs a replay leaves
    the stream idle between replays, and ranks whose replays start out of step wait for each other at
    the start of each one (virtual ranks: eight host threads launch into one CUDA context). Warns on
    stderr when the sleep ended before the last replay was enqueued (those timings include launches)."""
    import torch

    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            graph.replay()
        side.synchronize()
        barrier()
        if not ahead:
            return [t / calls for t in time_each(lambda i: graph.replay(), iters, side)]
        rate_khz = getattr(torch.cuda.get_device_properties(side.device), "clock_rate", 0) or 2_000_000
        torch.cuda._sleep(int(LAUNCH_AHEAD_S * rate_khz * 1e3))
        held = torch.cuda.Event()
        held.record(side)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            starts[i].record(side)
            graph.replay()
            ends[i].record(side)
        if held.query():
            sys.stderr.write(f"  launch-ahead: the {LAUNCH_AHEAD_S * 1e3:g} ms GPU sleep ended before the host had "
                             f"enqueued {iters} replays: these timings include host launch time\n")
        side.synchronize()
        return [s.elapsed_time(e) / 1e3 / calls for s, e in zip(starts, ends)]


def time_ms(fn: Callable[[], Any], iters: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each timed alone with CUDA events on the
    current stream (the host waits after every call), after ``warmup`` untimed calls. (The atom
    benchmarks, benchmarks/bench_*_atom.py.)"""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
