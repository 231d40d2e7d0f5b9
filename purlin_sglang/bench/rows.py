"""Result rows of the collectives bench (purlin's and the baselines' alike)."""

from __future__ import annotations

from typing import Any

from . import metrics
from .metrics import percentile


def make_row(impl: str, engine: str, case, mode: str, dtype: str, samples: list[float], ok: bool,
             exact: bool, err: float, buffers: int, floor: dict | None = None) -> dict[str, Any]:
    med = percentile(samples, 50)
    row = {
        "impl": impl, "engine": engine, "collective": case.collective, "world": case.world,
        "bytes": case.nbytes, "requested_bytes": case.nominal, "in_bytes": case.in_numel * case.elsize,
        "out_bytes": case.out_numel * case.elsize, "mode": mode, "dtype": dtype,
        "time_us_median": med * 1e6, "time_us_p10": percentile(samples, 10) * 1e6,
        "time_us_p90": percentile(samples, 90) * 1e6,
        "algbw_GBps": metrics.algbw_gbps(case.nbytes, med),
        "busbw_GBps": metrics.busbw_gbps(case.collective, case.world, case.nbytes, med),
        "correct": ok, "exact": exact, "max_abs_err": err, "iters": len(samples), "buffers": buffers,
    }
    if floor is not None:
        from .floor import floor_us

        f = floor_us(floor, case.world, row["in_bytes"], row["out_bytes"])
        row["floor_us"] = f
        row["of_floor"] = f / row["time_us_median"] if med > 0 else None
    return row


def add_plan(row: dict[str, Any], algorithms: list, plan_bytes: list) -> None:
    """The algorithm purlin ran (rank 0's; the ranks agree) and the bytes its plan moves over all ranks
    (bench/traffic.py), with ``floor_bytes`` (every input read once, every output written once) and
    ``plan_of_floor_max`` = floor bytes / plan bytes: the best ``of_floor`` this plan can reach."""
    row["algorithm"] = algorithms[0] if algorithms else None
    if plan_bytes and all(b is not None for b in plan_bytes):
        row["plan_bytes"] = sum(plan_bytes)
        row["floor_bytes"] = row["world"] * (row["in_bytes"] + row["out_bytes"])
        row["plan_of_floor_max"] = row["floor_bytes"] / row["plan_bytes"] if row["plan_bytes"] else None


def error_row(impl: str, case, mode: str, dtype: str, error: str) -> dict[str, Any]:
    return {"impl": impl, "engine": None, "collective": case.collective, "world": case.world,
            "bytes": case.nbytes, "requested_bytes": case.nominal, "mode": mode, "dtype": dtype,
            "correct": False, "error": error}
