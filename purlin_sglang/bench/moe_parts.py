"""Where the MoE exchange's time goes: its parts timed apart on loopback ranks, in graph mode.

Per token count and wire dtype, one ``run_virtual`` world on one GPU; every rank captures a graph of
``--calls`` calls of one part and the replays are timed with CUDA events (the slowest rank per
iteration, median over iterations):

* ``torch_route``: the routing as torch device ops (``moe.routing``: route, send positions, FP8
  quantisation): what a dispatch costs when it routes outside its kernel (a reference for the others);
* ``dispatch``: the whole ``moe_dispatch`` call (prologue + kernel);
* ``combine``: ``moe_combine`` of that dispatch's rows;
* ``pair``: dispatch then combine.

With ``--profile`` the run is also recorded with the torch profiler and the table of device kernels
(total time, calls, time per call) is written beside the JSON: the kernels of every part and rank
together, so per-call figures are what to read. With ``--timeline`` (instead of ``--profile``) each
config is recorded apart and its pair graph's kernels are read back per stream (a stream is a rank):
each kernel's duration, the gaps between a rank's kernels, the ranks' start spread and the time from
one dispatch start to the next (``moe_timeline.py``), with ``timeline-T-DTYPE.json`` (the MoE kernels of
the profiler's trace) and ``.png`` (a few pairs in step, a row per rank). Usage (GPU machine)::

    python -m purlin_sglang.bench.moe_parts --tokens 1,128,4096 --out DIR [--profile | --timeline] [--phases N]

With ``--phases N`` the communicators run with ``moe.trace`` and N more pairs are replayed one at a
time: the kernels stamp the end of each phase (the GPU's clock), and the table gives each phase's
time per rank (``phase_table``): launch skew, routing and puts, the count words, the wait for the
slowest peer, expand, padding; put back, done words, wait, reduce. Each traced graph holds
``--trace-calls`` pairs and the stamps are its last pair's: with 1 the dispatch's ``start`` is the ranks'
launch skew, with more the pairs run in step as in a decode step's graph.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from .args import add_decode_tokens, add_launch_ahead
from .metrics import percentile
from .moe_check import DTYPES, make_inputs, max_pair_load
from .purlin_runner import GraphPool, Options, graph_samples, rank_stream, settle


def _parts(comm, inp, experts: int, capacity: int, wire):
    from ..moe.routing import quantize_fp8, route, send_positions

    def torch_route(i):
        r = route(inp.ids, experts, comm.world_size)
        return send_positions(r.to_rank), (quantize_fp8(inp.x) if wire is not None else None)

    d = comm.moe_dispatch(inp.x, inp.ids, inp.w, num_experts=experts, capacity=capacity, dtype=wire)
    eo = d.x.to(torch.bfloat16, copy=True)  # the stand-in expert output: the rows as they came
    parts = {
        "dispatch": lambda i: comm.moe_dispatch(inp.x, inp.ids, inp.w, num_experts=experts, capacity=capacity,
                                                dtype=wire),
        "combine": lambda i: comm.moe_combine(eo, d),
        "pair": lambda i: comm.moe_combine(eo, comm.moe_dispatch(inp.x, inp.ids, inp.w, num_experts=experts,
                                                                 capacity=capacity, dtype=wire)),
    }
    return {"torch_route": torch_route, **parts}


def run_config(tokens: int, dtype: str, args) -> dict:
    from ..api import run_virtual

    wire = DTYPES[dtype]
    world, experts = args.world, args.experts
    inputs = [make_inputs(tokens, args.hidden, args.topk, experts, 1000 * args.seed + r, torch.device("cpu"))
              for r in range(world)]
    capacity = args.capacity or max(16, -(-max_pair_load([i.ids for i in inputs], experts) // 16) * 16)
    barrier = threading.Barrier(world, timeout=150.0)  # a rank that raised must not leave its peers waiting
    opts = Options(dtype=torch.bfloat16, iters=args.iters, warmup=3, graph_calls=args.calls, rotate=1, l2_bytes=0,
                   seed=0, timeout_s=60.0, launch_ahead=args.launch_ahead)

    traced = dataclasses.replace(opts, iters=1, warmup=0, graph_calls=args.trace_calls)

    t_start = time.monotonic()

    def log(rank: int, part: str):
        """--verbose: each rank's stages of a part (capture, replays) with the seconds since the start."""
        if not args.verbose:
            return lambda stage: None
        return lambda stage: sys.stderr.write(f"    {time.monotonic() - t_start:7.2f}s rank {rank} {part} {stage}\n")

    def fn(comm):
        dev = comm.device
        stream = rank_stream(comm)
        side = torch.cuda.Stream(dev)
        pool = GraphPool()  # every graph of this rank, one after another, in one pool
        i = inputs[comm.rank]
        inp = type(i)(i.x.to(dev), i.ids.to(dev), i.w.to(dev))
        out = {}
        settle(stream, barrier)
        parts = _parts(comm, inp, experts, capacity, wire)  # runs one eager dispatch (the combine's input)
        settle(stream, barrier)
        for name, step in parts.items():
            if comm.rank == 0:
                sys.stderr.write(f"  {name}\n")
            out[name] = graph_samples(comm, step, stream, side, barrier, opts, stage=log(comm.rank, name), pool=pool)
        stamps = []
        if comm.rank == 0 and args.phases:
            sys.stderr.write(f"  {args.phases} traced pairs\n")
        for _ in range(args.phases):  # --trace-calls pairs a graph: the stamps are the last pair's
            graph_samples(comm, parts["pair"], stream, side, barrier, traced, pool=pool)
            stamps.append(comm.moe_trace())
        return out, stamps

    rows = experts * capacity  # expert rows per rank: E/W local experts x W sources x capacity
    reserve = int(rows * args.hidden * 2 * (2 * args.calls + 4) + (512 << 20))
    moe = {"max_tokens_per_rank": max(tokens, 1), "trace": args.phases > 0, "one_pass": args.one_pass == "on"}
    if args.decode_tokens is not None:
        moe["decode_tokens"] = args.decode_tokens
    ranks = run_virtual(world, fn, device="cuda", config={"timeout_s": 60.0, "moe": moe}, reserve_bytes=reserve)
    per_rank = [r[0] for r in ranks]
    res = {"tokens": tokens, "dtype": dtype, "capacity": capacity, "world": world}
    for name in per_rank[0]:
        worst = [max(t) for t in zip(*(r[name] for r in per_rank))]
        res[name + "_us"] = percentile(worst, 50) * 1e6
    if args.phases:
        res["phases"] = phase_table([r[1] for r in ranks])
    return res


def timed_config(tokens: int, dtype: str, args, out: Path) -> dict:
    """run_config under the torch profiler: the MoE kernels of its trace to ``timeline-T-DTYPE.json``, their
    pair timeline into the result (``timeline``) and a chart of a few pairs in step beside it."""
    from torch.profiler import ProfilerActivity, profile

    from .moe_timeline import (kernel_events, pair_timeline, plot_timeline, read_trace, replay_timeline,
                               write_events)

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        r = run_config(tokens, dtype, args)
    path = out / f"timeline-{tokens}-{dtype}.json"
    full = out / f".trace-{tokens}-{dtype}.json"  # every kernel of the run (hundreds of MB): read, then dropped
    prof.export_chrome_trace(str(full))
    try:
        events = kernel_events(read_trace(full))
    finally:
        full.unlink(missing_ok=True)
    write_events(events, path)
    r["timeline"] = pair_timeline(events)
    r["replays"] = replay_timeline(events, args.calls)
    why = plot_timeline(events, path.with_suffix(".png"), title=f"{tokens} tokens/rank {dtype}: MoE kernels per "
                        "rank's stream (blue dispatch, orange combine)")
    if why:
        sys.stderr.write(f"  no timeline chart: {why}\n")
    return r


def phase_table(stamps: list[list[dict]]) -> dict:
    """The kernels' phase stamps of one pair per sample (``stamps[rank][sample]``, Communicator.moe_trace)
    as us: for each kind and phase, the time since the rank's previous phase ended; a dispatch's
    ``start`` counts from the earliest rank's dispatch start (the launch skew), a combine's ``start``
    from the latest rank's dispatch end. Median and largest over ranks, each the median over samples."""
    acc: dict = {}
    for s in range(len(stamps[0])):
        sample = [r[s] for r in stamps]
        origin = {"dispatch": min(x["dispatch"]["start"] for x in sample),
                  "combine": max(max(x["dispatch"].values()) for x in sample)}
        for kind in ("dispatch", "combine"):
            per_phase: dict[str, list[float]] = {}
            for x in sample:
                prev = origin[kind]
                for name, t in x[kind].items():
                    per_phase.setdefault(name, []).append((t - prev) / 1e3)
                    prev = t
            for name, v in per_phase.items():
                slot = acc.setdefault(kind, {}).setdefault(name, {"median": [], "max": []})
                slot["median"].append(percentile(v, 50))
                slot["max"].append(max(v))
    return {kind: {name: {k: round(percentile(v, 50), 2) for k, v in d.items()} for name, d in phases.items()}
            for kind, phases in acc.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m purlin_sglang.bench.moe_parts", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,128,4096")
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--calls", type=int, default=10, help="calls per captured graph")
    add_launch_ahead(p)
    p.add_argument("--capacity", type=int, default=None,
                   help="rows per (source rank, expert) (default: the routing's largest, rounded up to 16, at least 16)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also write the torch profiler's kernel table")
    p.add_argument("--timeline", action="store_true",
                   help="also record each config with the torch profiler and give the pair graph's kernel timeline "
                        "(durations, gaps between kernels, the ranks' start spread: bench/moe_timeline.py)")
    p.add_argument("--one-pass", choices=("on", "off"), default="on",
                   help="moe.one_pass (on: rows straight into the receivers' outputs; off: the receive-slot path)")
    add_decode_tokens(p)
    p.add_argument("--phases", type=int, default=0, metavar="N",
                   help="also N pairs with the kernels' phase stamps (moe.trace): each phase's us, per rank")
    p.add_argument("--trace-calls", type=int, default=1, metavar="N",
                   help="pairs per traced graph (the stamps are the last one's: N > 1 shows calls in step, "
                        "after the first pair has absorbed the ranks' launch skew)")
    p.add_argument("--verbose", action="store_true", help="print each rank's capture and replays as they begin")
    p.add_argument("--out", default="bench-results/moe-parts")
    args = p.parse_args(argv)
    if args.profile and args.timeline:
        p.error("--profile and --timeline each record with the profiler: choose one")
    if args.capacity is not None and args.capacity < 1:
        p.error("--capacity must be at least 1")
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)  # stopped: say where every rank was
    if not torch.cuda.is_available():
        print("purlin-sglang: error: bench moe_parts needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [(int(t), d) for t in args.tokens.split(",") for d in args.dtypes.split(",")]
    results = []
    prof = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
    for n, (t, d) in enumerate(configs, 1):
        sys.stderr.write(f"[{n}/{len(configs)}] tokens {t} {d}\n")
        r = timed_config(t, d, args, out) if args.timeline else run_config(t, d, args)
        results.append(r)
        sys.stderr.write("  " + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k.endswith("_us")) + "\n")
    if prof is not None:
        prof.__exit__(None, None, None)
        (out / "kernels.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                                                    max_name_column_width=70))
    (out / "moe_parts.json").write_text(json.dumps({"settings": vars(args), "rows": results}, indent=2))
    keys = [k for k in results[0] if k.endswith("_us")]
    print("tokens dtype cap " + " ".join(keys))
    for r in results:
        print(f"{r['tokens']} {r['dtype']} {r['capacity']} " + " ".join(f"{r.get(k, float('nan')):.1f}" for k in keys))
    for r in results:
        if "timeline" in r:
            print(f"{r['tokens']} {r['dtype']} pair timeline, us (median): " +
                  ", ".join(f"{k} {v}" for k, v in r["timeline"].items()))
        if "replays" in r:
            print(f"{r['tokens']} {r['dtype']} replays, us (median): " +
                  ", ".join(f"{k} {v}" for k, v in r["replays"].items()))
        for kind, phases in r.get("phases", {}).items():
            print(f"{r['tokens']} {r['dtype']} {kind} phases, us (median / max over ranks): " +
                  ", ".join(f"{n} {v['median']:.1f} / {v['max']:.1f}" for n, v in phases.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
