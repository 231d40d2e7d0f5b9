"""Timing shared by the atom benchmarks (bench_copy_atom.py, bench_reduce_atom.py)."""

from __future__ import annotations

import statistics

import torch


def time_ms(fn, iters: int, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each timed alone with CUDA events on the
    current stream (the host waits after every call), after ``warmup`` untimed calls."""
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
