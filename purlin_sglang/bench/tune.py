"""``purlin-sglang tune``: measure the crossovers between algorithms and write a tuning table.

For every collective with more than one algorithm on the engine at hand (``snac.algorithms_of``),
every world size and every size of a geometric grid, each algorithm is forced
(``tuning.algorithm``) and timed on virtual ranks: on CUDA as CUDA graphs of ``--graph-calls``
calls timed with events (loopback ranks on one GPU), on the CPU engine eagerly with
``time.perf_counter``. One call per case is checked against the torch reference first; a wrong
result or a failed run is reported and exits 1, and never becomes a table entry; a run that measured
nothing writes no table. ``--collectives`` naming one with nothing to choose between on this engine
(one algorithm, or a V form) is refused before anything runs (exit 2). The time of a
case is the median over ``--iters`` (after ``--warmup``) of the slowest rank's time. The table
(format: snac/table.py) gives, per world and collective, size bands with the fastest algorithm;
``tuning.table: PATH`` makes the planner use it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from .cases import DTYPES, make_case
from .args import csv_list, factor_arg, nonneg_int, positive_float, positive_int, size_arg, worlds_arg
from .metrics import human_bytes, size_sweep
from .purlin_runner import Options, run_purlin

_DEFAULTS = {  # (worlds, min, max, factor, iters, warm-up, refine): CPU small enough to finish in seconds
    "cuda": ([2, 4, 8], 1 << 10, 16 << 20, 4.0, 20, 5, 2),
    "cpu": ([2], 1 << 10, 64 << 10, 4.0, 5, 1, 0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="engine (default: cuda if torch sees a GPU, else cpu)")
    p.add_argument("--worlds", type=worlds_arg, default=None, help="comma list (default 2,4,8 GPU; 2 CPU)")
    p.add_argument("--collectives", type=csv_list, default=None,
                   help="comma list (default: every collective with more than one algorithm)")
    p.add_argument("--min-bytes", type=size_arg, default=None, help="per-rank input, sweep start (default 1K)")
    p.add_argument("--max-bytes", type=size_arg, default=None, help="sweep end (default 16M GPU, 64K CPU)")
    p.add_argument("--factor", type=factor_arg, default=None, help="sweep step (default 4)")
    p.add_argument("--refine", type=nonneg_int, default=None,
                   help="times to halve the step (geometrically) where the fastest algorithm changes between two "
                        "measured sizes: the midpoint is measured too (default 2 GPU: a crossover then lies within "
                        "a factor 4^(1/4) = 1.41 of its measured size; 0 CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--iters", type=positive_int, default=None, help="timed repetitions (default 20 GPU, 5 CPU)")
    p.add_argument("--warmup", type=nonneg_int, default=None, help="untimed repetitions first (default 5 GPU, 1 CPU)")
    p.add_argument("--graph-calls", type=positive_int, default=20, help="calls per timed graph replay (CUDA)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive_float, default=60.0, help="timeout_s of each communicator")
    p.add_argument("--out", default="tuning-table.json", help="where the table is written")


def candidates(device: str, names: list[str] | None) -> dict[str, tuple[str, ...]]:
    """Collective -> the algorithms to time, for those with more than one on this engine.

    Raises PurlinValueError for a name that is not in the catalog or, among ``names``, one that has
    nothing to choose between here (one algorithm, or a V form)."""
    from ..collectives import CATALOG
    from ..errors import PurlinValueError
    from ..snac import algorithms_of

    unknown = [n for n in names or () if n not in CATALOG]
    if unknown:
        raise PurlinValueError(f"tune: unknown collective(s) {unknown}; choose from {list(CATALOG)}")
    found = {n: algorithms_of(CATALOG[n], packets=device == "cuda") for n in CATALOG}
    # V forms: not tuned (a table's bands are keyed by this rank's input bytes, which differ between
    # the ranks of a V call; the planner ignores bands for them and uses tuning.packet_max_bytes)
    tunable = {n: a for n, a in found.items() if len(a) > 1 and not CATALOG[n].variable}
    untunable = [n for n in names or () if n not in tunable]
    if untunable:
        why = ", ".join(f"{n} ({'a V form' if CATALOG[n].variable else 'only ' + found[n][0]})" for n in untunable)
        raise PurlinValueError(f"tune: nothing to choose between for {why} on the {device} engine; "
                               f"--collectives takes those with more than one algorithm here: {', '.join(tunable)}")
    return {n: tunable[n] for n in names} if names else tunable


def bands(times: dict[int, dict[str, float]]) -> list[list]:
    """Sorted [max_bytes, fastest algorithm] bands from {size: {algorithm: seconds}}, equal neighbours merged."""
    out: list[list] = []
    for size in sorted(times):
        best = min(times[size], key=times[size].get)
        if out and out[-1][1] == best:
            out[-1][0] = size
        else:
            out.append([size, best])
    return out


def crossover_midpoints(measured: dict[int, dict[str, float]]) -> list[int]:
    """Sizes between two neighbouring measured sizes whose fastest algorithms differ: their geometric mean,
    rounded down to a multiple of 256 bytes (64 for small sizes), where that lies strictly between them."""
    sizes = sorted(measured)
    best = {b: min(measured[b], key=measured[b].get) for b in sizes}
    out = []
    for a, b in zip(sizes, sizes[1:]):
        if best[a] != best[b]:
            step = 256 if a >= 4096 else 64
            m = int((a * b) ** 0.5) // step * step
            if a < m < b:
                out.append(m)
    return out


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name(torch.cuda.current_device()) if device == "cuda" else "cpu"


def run(args: argparse.Namespace) -> int:
    from ..snac import registry
    from ..snac.planner import selection
    from ..snac.policy import TuningPolicy
    from ..collectives import CATALOG
    from ..engines import cuda_engine_status
    from ..errors import PurlinValueError
    from .. import __version__

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    why = cuda_engine_status() if device == "cuda" else ""
    if why:
        raise PurlinValueError(f"tune: --device cuda, but {why}; use --device cpu")
    worlds, lo, hi, factor, iters, warmup, refine = _DEFAULTS[device]
    worlds = args.worlds or worlds
    iters, warmup = args.iters or iters, warmup if args.warmup is None else args.warmup
    refine = refine if args.refine is None else args.refine
    try:
        sizes = size_sweep(args.min_bytes or lo, args.max_bytes or hi, args.factor or factor)
    except ValueError as e:
        raise PurlinValueError(f"tune: {e}; use --min-bytes <= --max-bytes") from None
    todo = candidates(device, args.collectives)
    dtype = DTYPES[args.dtype]
    mode = "graph" if device == "cuda" else "eager"
    sys.stderr.write(f"tune: {device} ({_device_name(device)}), worlds {worlds}, {len(sizes)} sizes "
                     f"{human_bytes(sizes[0])}..{human_bytes(sizes[-1])}, {args.dtype}, {mode}, median of {iters}\n")
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    entries: dict[str, dict[str, list]] = {}

    def measure(world: int, name: str, algorithms, grid: list[int], times: dict[int, dict[str, float]]) -> None:
        """Time every algorithm at every size of ``grid`` (those it runs), into ``times`` and ``rows``."""
        cases = {c.in_numel * c.elsize: c for c in (make_case(name, s, world, dtype) for s in grid)}
        cases = {b: c for b, c in cases.items() if b not in times}
        times.update({b: {} for b in cases})
        for algorithm in algorithms:
            entry, policy = registry.get(algorithm), TuningPolicy(algorithm=algorithm)
            mine = [b for b in cases if entry.fits(selection(CATALOG[name], b, policy, packets=True, world=world))]
            if not mine:
                continue
            sys.stderr.write(f"tune: world {world} {name} {algorithm}: {len(mine)} sizes\n")
            opts = Options(dtype=dtype, iters=iters, warmup=warmup, graph_calls=args.graph_calls, rotate=1,
                           l2_bytes=1 << 62, seed=args.seed, timeout_s=args.timeout,
                           tuning={"algorithm": algorithm})
            try:
                per_rank = run_purlin(name, world, mode, [cases[b] for b in mine], opts, torch.device(device))
            except Exception as e:  # noqa: BLE001 - reported; the run goes on and exits 1
                failures.append(f"world {world} {name} {algorithm}: {type(e).__name__}: {e}")
                sys.stderr.write(f"tune: FAILED {failures[-1]}\n")
                continue
            for i, b in enumerate(mine):
                res = [pr[1][i] for pr in per_rank]
                samples = [max(t) for t in zip(*(x["samples"] for x in res))]
                ok = all(x["ok"] for x in res)
                med = statistics.median(samples)
                rows.append({"world": world, "collective": name, "algorithm": algorithm, "bytes": b,
                             "median_us": med * 1e6, "correct": ok, "exact": all(x["exact"] for x in res)})
                if ok:
                    times[b][algorithm] = med
                else:
                    failures.append(f"world {world} {name} {algorithm} {human_bytes(b)}: WRONG result")
                    sys.stderr.write(f"tune: {failures[-1]}\n")

    for world in worlds:
        for name, algorithms in todo.items():
            times: dict[int, dict[str, float]] = {}
            measure(world, name, algorithms, sizes, times)
            for _ in range(refine):  # the crossovers: measure between neighbours whose winners differ
                mids = crossover_midpoints({b: t for b, t in times.items() if t})
                if not mids:
                    break
                sys.stderr.write(f"tune: world {world} {name}: crossover sizes {[human_bytes(m) for m in mids]}\n")
                measure(world, name, algorithms, mids, times)
            measured = {b: t for b, t in times.items() if t}
            if measured:
                entries.setdefault(str(world), {})[name] = bands(measured)
    table = {"format": 1, "device": _device_name(device), "engine": device,
             "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
             "command": "purlin-sglang " + " ".join(shlex.quote(a) for a in getattr(args, "argv", [])),
             "purlin_sglang": __version__,
             # CUDA: virtual ranks, every rank on this one GPU (snac/table.py: where a table applies)
             "placement": "one_gpu" if device == "cuda" else "any",
             "dtype": args.dtype, "mode": mode, "iters": iters, "warmup": warmup,
             "entries": entries, "measurements": rows}
    if rows:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(table, indent=1))
        for world, per in entries.items():
            for name, bs in per.items():
                print(f"world {world} {name:<16}" + "  ".join(f"<={human_bytes(b)} {a}" for b, a in bs))
        print(f"wrote {args.out} ({len(rows)} measurements)")
    for f in failures:
        print(f"error: {f}")
    if not rows:
        print(f"error: tune: nothing was measured, so no table was written to {args.out}")
    return 1 if failures or not rows else 0
