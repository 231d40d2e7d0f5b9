"""``purlin-sglang bench collectives``: time every catalog collective against its baselines.

For each collective, world size, mode and size: one call is checked against a plain torch
reference (fresh random inputs), then the calls are timed (CUDA events on a GPU,
``time.perf_counter`` on the CPU engine), after a warm-up, as the median / p10 / p90 of
``--iters``. Rows give algbw and nccl-tests busbw, and for purlin the algorithm it ran and the bytes
its plan reads and writes (bench/traffic.py); on a GPU, the loopback floor (bench/floor.py), the
fraction of it reached and the best fraction the plan can reach ("plan max"). Baselines run in the same command where
the machine allows them and are listed as skipped, with the reason, where it does not. Writes
``results.json`` and plots to ``--out``, prints a table, and exits 1 if any result is wrong or nothing
was measured. What cannot run on the chosen device (graph mode or a GPU baseline on the CPU engine,
``--device cuda`` without a usable CUDA engine) is refused before anything runs (exit 2).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .cases import DTYPES, make_case
from .args import (add_launch_ahead, csv_list, factor_arg, nonneg_int, positive_float, positive_int, size_arg,
                   sizes_arg, start, worlds_arg)
from .metrics import human_bytes, size_sweep
from .environment import environment
from .purlin_runner import Options, run_purlin
from .rows import add_plan, error_row, make_row

H200_L2 = 60 << 20
BASELINES = ("nccl", "symm_mem", "sglang", "gloo")


def _collective_names() -> list[str]:
    from ..collectives import CATALOG

    return list(CATALOG)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench collectives`` (defaults marked GPU/CPU depend on --device)."""
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="engine device (default: cuda if torch sees a GPU, else cpu)")
    p.add_argument("--collectives", type=csv_list, default=None, help="comma list (default: the whole catalog)")
    p.add_argument("--world", type=worlds_arg, default=None,
                   help="comma list of world sizes (default: 8 on GPU loopback, 4 on CPU)")
    p.add_argument("--sizes", type=sizes_arg, default=None,
                   help="comma list of sizes, e.g. 1K,64K,1M (overrides the sweep)")
    p.add_argument("--min-bytes", type=size_arg, default=None, help="sweep start (default 1K)")
    p.add_argument("--max-bytes", type=size_arg, default=None, help="sweep end (default 1G on GPU, 1M on CPU)")
    p.add_argument("--factor", type=factor_arg, default=None, help="sweep step (default 2 on GPU, 4 on CPU)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="element type (reductions sum)")
    p.add_argument("--modes", type=csv_list, default=None,
                   help="eager,graph (default: both on GPU, eager on CPU; graph needs CUDA)")
    p.add_argument("--iters", type=positive_int, default=None, help="timed iterations (default 20 GPU, 10 CPU)")
    p.add_argument("--warmup", type=nonneg_int, default=None, help="untimed iterations first (default 5 GPU, 2 CPU)")
    p.add_argument("--graph-calls", type=positive_int, default=50,
                   help="calls captured in one graph (graph mode; 50, as benchmarks/bench_cuda_engine.py: with "
                        "few calls per replay the rank threads' launches, not the GPU, set the pace)")
    add_launch_ahead(p)
    p.add_argument("--rotate", type=positive_int, default=3,
                   help="input buffers used in turn when the inputs sharing one L2 exceed --l2-bytes")
    p.add_argument("--l2-bytes", type=size_arg, default=H200_L2, help="L2 size (default 60M, H200)")
    p.add_argument("--baselines", type=csv_list, default=["auto"],
                   help=f"comma list of {','.join(BASELINES)}, or auto (nccl,symm_mem,sglang on GPU; gloo on "
                        "CPU) or none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--symmetric", action="store_true",
                   help="purlin's inputs in its symmetric heap (config symmetric_bytes): collectives with a "
                        "direct form read their peers' inputs in place where they would stage "
                        "(rows: purlin-<engine>+heap)")
    p.add_argument("--timeout", type=positive_float, default=60.0, help="timeout_s of each communicator")
    p.add_argument("--out", default=None, help="results directory (default ./bench-results/<timestamp>)")


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the device-dependent defaults and validate; raises PurlinValueError naming the option.

    Combinations that cannot run here are refused before anything runs: --device cuda without a usable
    CUDA engine, graph mode or a GPU baseline on the CPU engine, the gloo baseline on CUDA."""
    from ..engines import cuda_engine_status
    from ..errors import PurlinValueError

    def refuse(msg: str) -> PurlinValueError:
        return PurlinValueError(f"bench collectives: {msg}")

    gpu = torch.cuda.is_available()
    if args.device is None:
        args.device = "cuda" if gpu else "cpu"
    cuda = args.device == "cuda"
    why = cuda_engine_status() if cuda else ""
    if why:
        raise refuse(f"--device cuda, but {why}; use --device cpu")
    names = _collective_names()
    args.collectives = args.collectives or names
    bad = [c for c in args.collectives if c not in names]
    if bad:
        raise refuse(f"unknown collective(s) {bad}; choose from {names}")
    args.world = args.world or [8 if cuda else 4]
    if args.sizes is None:
        try:
            args.sizes = size_sweep(args.min_bytes or 1 << 10, args.max_bytes or (1 << 30 if cuda else 1 << 20),
                                    args.factor or (2.0 if cuda else 4.0))
        except ValueError as e:
            raise refuse(f"{e}; use --min-bytes <= --max-bytes") from None
    elif args.min_bytes or args.max_bytes or args.factor:
        raise refuse("give either --sizes or --min-bytes/--max-bytes/--factor, not both")
    args.modes = args.modes or (["eager", "graph"] if cuda else ["eager"])
    bad = [m for m in args.modes if m not in ("eager", "graph")]
    if bad:
        raise refuse(f"unknown mode(s) {bad}; use eager, graph")
    if "graph" in args.modes and not cuda:
        raise refuse("--modes graph needs CUDA (CUDA graphs), but the device is cpu; use --modes eager on the CPU "
                     "engine")
    args.iters = args.iters if args.iters is not None else (20 if cuda else 10)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    if args.baselines == ["auto"]:
        args.baselines = ["nccl", "symm_mem", "sglang"] if cuda else ["gloo"]
    elif args.baselines == ["none"]:
        args.baselines = []
    bad = [b for b in args.baselines if b not in BASELINES]
    if bad:
        raise refuse(f"unknown baseline(s) {bad}; choose from {list(BASELINES)}, auto, none")
    wrong = [b for b in args.baselines if (b == "gloo") == cuda]
    if wrong:
        raise refuse(f"baseline(s) {wrong} cannot run on the {args.device} engine: nccl, symm_mem and sglang need "
                     "--device cuda, gloo is for --device cpu; use --baselines auto or none")
    if args.out is None:
        args.out = str(Path("bench-results") / _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    return args


def run(args: argparse.Namespace) -> int:
    from ..errors import PurlinUnavailableError

    args, out_dir = start(args, resolve)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    opts = Options(dtype=dtype, iters=args.iters, warmup=args.warmup, graph_calls=args.graph_calls,
                   rotate=args.rotate, l2_bytes=args.l2_bytes, seed=args.seed, timeout_s=args.timeout,
                   symmetric=args.symmetric, launch_ahead=args.launch_ahead)
    env = environment(args.device)
    rows: list[dict] = []
    skipped: list[dict] = []
    floor = None
    if device.type == "cuda":
        from .floor import measure_floor

        sys.stderr.write("measuring the physical floor (device copy bandwidth, latency proxy)\n")
        floor = measure_floor(device, max(args.world), {"timeout_s": args.timeout})
    sys.stderr.write(f"bench collectives: device {args.device}, worlds {args.world}, modes {args.modes}, "
                     f"{len(args.sizes)} sizes {human_bytes(args.sizes[0])}..{human_bytes(args.sizes[-1])}, "
                     f"{args.dtype}, iters {args.iters}, warm-up {args.warmup}\n")
    for mode in args.modes:
        for world in args.world:
            for name in args.collectives:
                cases = [make_case(name, s, world, dtype) for s in args.sizes]
                try:
                    per_rank = run_purlin(name, world, mode, cases, opts, device)
                except PurlinUnavailableError as e:
                    skipped.append({"impl": "purlin", "collective": name, "world": world, "mode": mode,
                                    "reason": str(e)})
                    continue
                except Exception as e:  # noqa: BLE001 - reported per row, the run goes on
                    msg = f"{type(e).__name__}: {e}"
                    if getattr(e, "purlin_where", None):
                        msg = f"{msg.splitlines()[0]} ({e.purlin_where})"
                    sys.stderr.write(f"  purlin {mode} world {world} {name}: FAILED {msg}\n")
                    rows.extend(error_row("purlin", c, mode, args.dtype, msg) for c in cases)
                    continue
                engine = per_rank[0][0] + ("+heap" if args.symmetric else "")
                for ci, case in enumerate(cases):
                    res = [pr[1][ci] for pr in per_rank]
                    samples = [max(t) for t in zip(*(x["samples"] for x in res))]
                    worst = max(x["err"] for x in res)
                    row = make_row("purlin", engine, case, mode, args.dtype, samples, all(x["ok"] for x in res),
                                   all(x["exact"] for x in res), worst, res[0]["buffers"], floor)
                    add_plan(row, [x.get("algorithm") for x in res], [x.get("plan_bytes") for x in res])
                    rows.append(row)
    if args.baselines:
        from .baselines import run_baselines

        b_rows, b_skipped = run_baselines(args, opts, device)
        rows.extend(b_rows)
        skipped.extend(b_skipped)
    result = {"environment": env, "settings": _settings(args), "floor": floor, "rows": rows, "skipped": skipped}
    (out_dir / "results.json").write_text(json.dumps(result, indent=2, default=str))
    from .plot import plot_results

    plots, why = plot_results(rows, out_dir)
    print(format_table(rows, floor))
    for s in skipped:
        where = " ".join(f"{k}={s[k]}" for k in ("collective", "world", "mode") if k in s)
        print(f"skipped: {s['impl']} {where}: {s['reason']}".replace("  ", " "))
    if floor:
        print(f"floor: copy {floor['copy_GBps']:.0f} GB/s ({floor['copy_measured']}); "
              f"latency {floor['latency_us']:.2f} us ({floor['latency_measured']})")
    print(f"wrote {out_dir / 'results.json'}" + (f" and {len(plots)} plot(s)" if plots else ""))
    if why:
        print(why)
    bad = [r for r in rows if not r.get("correct")]
    print(f"{len(rows) - len(bad)} of {len(rows)} results correct")
    if not rows:
        print("error: bench collectives: nothing was measured (every run was skipped, see above)", file=sys.stderr)
        return 1
    return 1 if bad else 0


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("device", "collectives", "world", "sizes", "dtype", "modes", "iters", "warmup", "graph_calls",
            "launch_ahead", "rotate", "l2_bytes", "baselines", "seed", "timeout")
    s = {k: getattr(args, k) for k in keys}
    s["timing"] = ("per iteration, the slowest rank's time; CUDA events on each rank's stream (GPU) or "
                   "time.perf_counter (CPU); graph mode: iters replays of a graph of graph_calls calls, queued "
                   "back to back on each rank's stream (events between them, no host wait), each replay's time "
                   "/ graph_calls")
    s["reduce_op"] = "sum"
    return s


def _bw(v: float) -> str:
    return f"{v:>9.3f}" if v < 10 else f"{v:>9.1f}"


def format_table(rows: list[dict], floor: dict | None = None) -> str:
    head = (f"{'collective':<17}{'impl':<20}{'mode':<6}{'world':>5}{'bytes':>8}{'median us':>11}{'p10':>10}"
            f"{'p90':>10}{'algbw':>9}{'busbw':>9}{'correct':>8}")
    if floor:
        head += f"{'floor us':>10}{'of floor':>9}{'plan max':>9}  algorithm"
    lines = [head]
    for r in rows:
        impl = f"purlin-{r['engine']}" if r["impl"] == "purlin" and r.get("engine") else r["impl"]
        if "error" in r:
            lines.append(f"{r['collective']:<17}{impl:<20}{r['mode']:<6}{r['world']:>5}"
                         f"{human_bytes(r['bytes']):>8}  ERROR {r['error'][:80]}")
            continue
        line = (f"{r['collective']:<17}{impl:<20}{r['mode']:<6}{r['world']:>5}{human_bytes(r['bytes']):>8}"
                f"{r['time_us_median']:>11.1f}{r['time_us_p10']:>10.1f}{r['time_us_p90']:>10.1f}"
                f"{_bw(r['algbw_GBps'])}{_bw(r['busbw_GBps'])}{'yes' if r['correct'] else 'NO':>8}")
        if floor and "floor_us" in r:
            best = r.get("plan_of_floor_max")
            plan = f"{best:>9.2f}" if best else f"{'-':>9}"
            line += f"{r['floor_us']:>10.1f}{r['of_floor']:>9.2f}{plan}  {r.get('algorithm') or '-'}"
        lines.append(line)
    lines.append("(times in us; algbw/busbw in GB/s, nccl-tests convention; median/p10/p90 over iterations, "
                 "slowest rank per iteration" + ("; plan max: the best 'of floor' the plan can reach, floor bytes / "
                                                 "bytes the plan reads and writes (bench/traffic.py)" if floor else "")
                 + ")")
    return "\n".join(lines)

