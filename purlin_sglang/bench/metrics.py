"""Benchmark arithmetic: sizes, nccl-tests bus bandwidth, order statistics.

Conventions (shared/design/PERFORMANCE.md, after nccl-tests): algbw = bytes / time, where
bytes is the per-rank input for all_reduce / reduce_scatter / all_to_all, the per-rank output
for all_gather and the buffer for broadcast; busbw = algbw x a factor that makes every
collective comparable to the link bandwidth. V forms (run with equal splits) count like
their fixed forms.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

# The fixed form each V form is measured like (equal splits).
FIXED_FORM = {
    "all_gather_v": "all_gather",
    "reduce_scatter_v": "reduce_scatter",
    "all_to_all_v": "all_to_all",
}


def busbw_factor(collective: str, world: int) -> float:
    """nccl-tests' factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast 1."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"busbw_factor: world must be a positive int, got {world!r}")
    name = FIXED_FORM.get(collective, collective)
    if name == "all_reduce":
        return 2.0 * (world - 1) / world
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) / world
    if name == "broadcast":
        return 1.0
    raise ValueError(f"busbw_factor: unknown collective {collective!r}")


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def busbw_gbps(collective: str, world: int, nbytes: int, seconds: float) -> float:
    return algbw_gbps(nbytes, seconds) * busbw_factor(collective, world)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": KIB, "m": MIB, "g": GIB, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'4096', '1K', '64KiB', '1M', '1G' -> bytes (K/M/G are binary: 1K = 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"bad size {text!r}: use bytes or a K/M/G suffix, e.g. 4096, 64K, 1M, 1G")
    n = float(m.group(1)) * _UNIT[m.group(2).lower()]
    if n < 1 or n != int(n):
        raise ValueError(f"bad size {text!r}: must be a positive whole number of bytes")
    return int(n)


def size_sweep(min_bytes: int, max_bytes: int, factor: float) -> list[int]:
    """min, min*factor, ... up to max (inclusive when it lands on it)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"size sweep: need 1 <= min ({min_bytes}) <= max ({max_bytes})")
    if factor <= 1:
        raise ValueError(f"size sweep: --factor must be > 1, got {factor}")
    out, s = [], float(min_bytes)
    while s <= max_bytes * (1 + 1e-9):
        out.append(int(round(s)))
        s *= factor
    return out


def human_bytes(n: int) -> str:
    for unit, div in (("G", GIB), ("M", MIB), ("K", KIB)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)
