"""The physical floor of a loopback run (all virtual ranks on one GPU), measured in the same run.

With every rank on one GPU, a collective can go no faster than one GPU's memory moving the
bytes it must touch: every rank's input read once and every rank's output written once, at
the device-to-device copy bandwidth (read + written counted), plus one signalling latency.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from .timing import time_each

COPY_BYTES = 256 << 20


def measure_floor(device: torch.device, world: int, config: Any = None, iters: int = 20) -> dict[str, Any]:
    """Copy bandwidth and a latency proxy on ``device``; every figure says what was measured."""
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        src = torch.randint(0, 255, (COPY_BYTES,), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        copy_s = statistics.median(time_each(lambda i: dst.copy_(src), iters, stream))
        a = torch.ones(1, dtype=torch.int32, device=device)
        b = torch.empty_like(a)
        for _ in range(10):
            b.copy_(a)
        tiny_s = statistics.median(time_each(lambda i: b.copy_(a), 200, stream))
    del src, dst
    latency = {
        "latency_us": tiny_s * 1e6,
        "latency_measured": "median CUDA-event time around one 4-byte device-to-device Tensor.copy_ "
                            "(one tiny kernel between two events; a proxy for a flag round trip: "
                            "the public API has no barrier to time)",
    }
    from ..api import Communicator

    if hasattr(Communicator, "barrier"):
        try:
            latency = _engine_barrier(device, world, config)
        except Exception as e:  # noqa: BLE001 - fall back to the proxy, and say why
            latency["latency_measured"] += f" (the engine barrier failed: {type(e).__name__}: {e})"
    return {
        "copy_GBps": 2 * COPY_BYTES / copy_s / 1e9,
        "copy_measured": "median CUDA-event time of torch Tensor.copy_ of 256 MiB device-to-device "
                         f"on one stream, {iters} runs; GB/s counts bytes read + written",
        **latency,
    }


def _engine_barrier(device: torch.device, world: int, config: Any) -> dict[str, Any]:
    from ..api import run_virtual

    def fn(comm):
        stream = torch.cuda.current_stream(device)
        for _ in range(10):
            comm.barrier()
        stream.synchronize()
        return time_each(lambda i: comm.barrier(), 100, stream)

    per_rank = run_virtual(world, fn, device=device, config=config)
    per_iter = [max(t) for t in zip(*per_rank)]
    return {
        "latency_us": statistics.median(per_iter) * 1e6,
        "latency_measured": f"median CUDA-event time of one Communicator.barrier() of {world} loopback "
                            "virtual ranks (slowest rank per round, 100 rounds)",
    }


def floor_us(floor: dict[str, Any], world: int, in_bytes: int, out_bytes: int) -> float:
    """Lowest possible time of one loopback call: latency + (all inputs read + all outputs written) / copy bw."""
    traffic = world * (in_bytes + out_bytes)
    return floor["latency_us"] + traffic / (floor["copy_GBps"] * 1e9) * 1e6
