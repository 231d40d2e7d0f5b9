"""``purlin-sglang bench moe``: MoE dispatch / combine on virtual ranks, against a torch reference.

Per token count and payload dtype, one ``run_virtual`` world (loopback ranks on one GPU, or the CPU
engine's threads with ``--device cpu``). Each rank makes its tokens and a random top-k routing
(distinct experts per token; seeded), then:

1. checks one dispatch -> stand-in experts -> combine against the float64 reference (moe_check.py;
   in capacity mode where graphs are timed); in eager mode, for small shapes, also bitwise against
   the loop reference of ``purlin_sglang.moe.reference`` (float32 accumulation: the engines' contract);
2. times ``moe_dispatch``, ``moe_combine`` and the pair (dispatch then combine, no expert work):
   CUDA graphs by default on a GPU (``graph_calls`` calls captured per graph, captures serialised
   across virtual ranks, replays timed with CUDA events: bench/purlin_runner.py), eager on the CPU;
   the pair's output after the replays is checked again;
3. times the torch reference path (eager: ``all_gather`` of tokens and routing, ``index_select`` of
   this rank's (token, slot) rows, the stand-in experts, ``index_add`` and ``reduce_scatter``), on the
   same communicator, checked too; its time is the sum of its three phases, each timed alone with the
   ranks synchronised between them (loopback ranks share one GPU: a rank's local kernels must not queue
   behind peers' kernels that wait for it; the check's dispatch, experts and combine are kept apart so too).

Rows report the median / p10 / p90 of the slowest rank per iteration, the payload bytes moved
(summed over ranks), and on a GPU the copy ceiling measured in the same run (bench/floor.py: a
loopback exchange of B bytes must read and write them: ceiling = 2 B / copy bandwidth) with the
fraction of it reached, and each rank's HBM footprint (``Communicator.hbm_bytes``: workspace, op
tables and MoE region; ``moe_hbm_bytes``: the MoE region alone). Writes
``moe.json`` and ``moe.png`` to ``--out``, prints a table; exit code 1 if any result is wrong.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import inspect
import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from ..config import MoESettings
from .args import add_decode_tokens, add_launch_ahead, start
from .metrics import percentile
from .moe_check import (DTYPES, bitwise_vs_reference, check, expert_scale, make_inputs, max_pair_load, run_experts,
                        wire_bytes)
from .purlin_runner import Options, graph_samples, rank_stream, settle
from .timing import sync, time_each

GRAPH_BUDGET = 512 << 20  # bytes of call outputs one captured graph may hold per rank


def _ints(text: str) -> list[int]:
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: use ints, e.g. 128,4096") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"bad list {text!r}: need ints >= 0")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``bench moe`` (defaults marked GPU/CPU depend on --device)."""
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if torch sees a GPU")
    p.add_argument("--tokens", type=_ints, default=None, help="tokens per rank, comma list (GPU 128,4096; CPU 16,64)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (GPU 7168, CPU 64)")
    p.add_argument("--topk", type=int, default=None, help="experts per token (GPU 8, CPU 4)")
    p.add_argument("--experts", type=int, default=None, help="experts in all (GPU 256, CPU 16)")
    p.add_argument("--world", type=int, default=None, help="virtual ranks (GPU 8, CPU 4)")
    p.add_argument("--dtypes", default="bf16,fp8", help="payload dtypes on the wire: bf16, fp8 (comma list)")
    p.add_argument("--mode", choices=("graph", "eager"), default=None, help="GPU graph, CPU eager (graph needs CUDA)")
    p.add_argument("--capacity", type=int, default=None,
                   help="rows per (source rank, expert) in graph mode (default: this routing's largest, rounded "
                        "up to 16); eager mode sizes rows exactly")
    p.add_argument("--drop-every", type=int, default=0, help="every N-th token's last slot is -1 (0: none)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (GPU 20, CPU 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (GPU 5, CPU 1)")
    p.add_argument("--graph-calls", type=int, default=10, help="calls captured per graph (fewer if outputs are large)")
    add_launch_ahead(p)
    p.add_argument("--no-reference", action="store_true", help="skip the torch reference path")
    p.add_argument("--signal-scope", choices=("auto", "system"), default="auto",
                   help="moe.signal_scope of the communicators (system: as ranks on several GPUs signal)")
    p.add_argument("--one-pass", choices=("on", "off"), default="on",
                   help="moe.one_pass: virtual ranks write rows straight into each other's outputs (on) or take "
                        "the receive-slot path of ranks in separate processes (off)")
    add_decode_tokens(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="timeout_s of each communicator")
    p.add_argument("--out", default=None, help="results directory (default ./bench-results/moe-<timestamp>)")


def cuda_path(args: argparse.Namespace, tokens: int) -> str:
    """Which CUDA MoE kernels a call of ``tokens`` tokens a rank runs (every rank of the bench has as many):
    ``decode`` (at most moe.decode_tokens), else ``one-pass`` or ``slots`` (moe.one_pass)."""
    limit = args.decode_tokens if args.decode_tokens is not None else MoESettings().decode_tokens
    if limit and tokens <= limit:
        return "decode"
    return "one-pass" if args.one_pass == "on" else "slots"


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the device-dependent defaults and validate; raises ValueError naming the option."""
    gpu = torch.cuda.is_available()
    args.device = args.device or ("cuda" if gpu else "cpu")
    cuda = args.device == "cuda"
    if cuda and not gpu:
        raise ValueError("bench moe: --device cuda but torch sees no CUDA GPU; use --device cpu")
    for name, g, c in (("tokens", [128, 4096], [16, 64]), ("hidden", 7168, 64), ("topk", 8, 4),
                       ("experts", 256, 16), ("world", 8, 4), ("iters", 20, 5), ("warmup", 5, 1),
                       ("mode", "graph", "eager")):
        if getattr(args, name) is None:
            setattr(args, name, g if cuda else c)
    if args.mode == "graph" and not cuda:
        raise ValueError("bench moe: --mode graph needs --device cuda")
    args.dtypes = [d.strip() for d in str(args.dtypes).split(",") if d.strip()] if isinstance(args.dtypes, str) \
        else args.dtypes
    bad = [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.dtypes:
        raise ValueError(f"bench moe: unknown --dtypes {bad}; choose from {list(DTYPES)}")
    if args.world < 1 or args.experts % args.world:
        raise ValueError(f"bench moe: --world must be >= 1, got {args.world}" if args.world < 1
                         else f"bench moe: --experts {args.experts} must be a multiple of --world {args.world}")
    if not 1 <= args.topk <= args.experts:
        raise ValueError(f"bench moe: need 1 <= --topk <= --experts (got {args.topk})")
    if args.hidden < 1 or args.iters < 1 or args.warmup < 0 or args.graph_calls < 1:
        raise ValueError("bench moe: need --hidden >= 1, --iters >= 1, --warmup >= 0, --graph-calls >= 1")
    if args.capacity is not None and args.capacity < 1:
        raise ValueError("bench moe: --capacity must be >= 1")
    args.out = args.out or str(Path("bench-results") / _dt.datetime.now().strftime("moe-%Y%m%d-%H%M%S"))
    return args


def torch_reference(comm, inp, s: torch.Tensor, experts: int, settle=lambda: None, stream=None,
                    chunk: int = 8192) -> tuple[torch.Tensor, float]:
    """The expert-parallel layer from standard collectives: all-gather tokens and routing, index this
    rank's (token, slot) rows, the stand-in experts, index_add, reduce-scatter. Returns the result and
    its time in seconds: the sum of its three phases, each timed alone (CUDA events on the rank's stream,
    or the host clock) with ``settle()`` (every rank synchronized) between them: on loopback ranks a
    rank's local kernels must not queue behind peers' kernels that wait for it."""
    world, k = comm.world_size, inp.ids.shape[1]
    local = experts // world
    lo, hi = comm.rank * local, (comm.rank + 1) * local
    box = {}

    def gather(i):
        box["x"] = comm.all_gather(inp.x)
        box["meta"] = comm.all_gather(torch.cat([inp.ids.to(torch.float32), inp.w.to(torch.float32)], 1).contiguous())

    def experts_step(i):
        x_all, meta = box["x"], box["meta"]
        ids_all, w_all = meta[:, :k].to(torch.int64), meta[:, k:]
        t, kk = ((ids_all >= lo) & (ids_all < hi)).nonzero(as_tuple=True)
        coef = s[ids_all[t, kk]] * w_all[t, kk]
        part = torch.zeros(x_all.shape, dtype=torch.float32, device=x_all.device)
        for j in range(0, t.shape[0], chunk):  # float32 temporaries of ``chunk`` rows
            rows = x_all.index_select(0, t[j:j + chunk]).to(torch.float32) * coef[j:j + chunk, None]
            part.index_add_(0, t[j:j + chunk], rows)
        box["part"] = part.to(torch.bfloat16)

    def reduce(i):
        box["y"] = comm.reduce_scatter(box["part"])

    total = 0.0
    for phase in (gather, experts_step, reduce):
        settle()
        total += time_each(phase, 1, stream)[0]
    settle()
    return box["y"], total


def _config_run(args, tokens: int, dtype_name: str, with_reference: bool, device: torch.device) -> dict:
    """One run_virtual world: every rank checks, then times; returns per-rank results and the settings."""
    from ..api import run_virtual

    wire = DTYPES[dtype_name]
    world, experts, local = args.world, args.experts, args.experts // args.world
    inputs = [make_inputs(tokens, args.hidden, args.topk, experts, args.seed * 1000 + r, torch.device("cpu"),
                          args.drop_every) for r in range(world)]
    graph = args.mode == "graph"
    capacity = None
    if graph:
        most = max_pair_load([i.ids for i in inputs], experts)
        capacity = args.capacity or max(16, -(-most // 16) * 16)
    barrier = threading.Barrier(world)
    opts = Options(dtype=torch.bfloat16, iters=args.iters, warmup=args.warmup, graph_calls=args.graph_calls,
                   rotate=1, l2_bytes=0, seed=args.seed, timeout_s=args.timeout, launch_ahead=args.launch_ahead)

    def fn(comm):
        r, dev = comm.rank, comm.device
        stream = rank_stream(comm)
        side = torch.cuda.Stream(dev) if graph else None
        inp = inputs[r]
        inp = type(inp)(inp.x.to(dev), inp.ids.to(dev), inp.w.to(dev))
        s = expert_scale(experts, dev)

        def dispatch():
            return comm.moe_dispatch(inp.x, inp.ids, inp.w, num_experts=experts, capacity=capacity, dtype=wire)

        settled = functools.partial(settle, stream, barrier)  # every rank's work done (purlin_runner.settle)
        # The check: inputs staged, then dispatch, experts and combine apart (loopback ranks share one GPU).
        settled()
        d = dispatch()
        settled()
        eo = run_experts(d.x, d.scales, d.expert, r, local, s)
        settled()
        y = comm.moe_combine(eo, d)
        settled()
        ok, err, ratio = check(y, inp, experts, wire)
        res = {"ok": ok, "err": err, "ratio": ratio, "rows": d.rows, "hbm": comm.hbm_bytes,
               "moe_hbm": getattr(comm, "moe_hbm_bytes", None),
               "workspace": comm.workspace_bytes, "y": y.cpu() if not graph else None}
        barrier.wait()
        per_call = d.rows * args.hidden * d.x.element_size() + tokens * args.hidden * 2
        calls = max(1, min(args.graph_calls, GRAPH_BUDGET // max(per_call, 1)))
        o = Options(**{**opts.__dict__, "graph_calls": calls})
        last: dict[str, Any] = {}
        steps = {"dispatch": lambda i: dispatch(), "combine": lambda i: comm.moe_combine(eo, d),
                 "pair": lambda i: last.__setitem__("y", comm.moe_combine(eo, dispatch()))}
        for op, step in steps.items():
            if r == 0:
                sys.stderr.write(f"  {dtype_name} tokens {tokens}: timing {op} ({args.mode})\n")
            if graph:
                res[op] = graph_samples(comm, step, stream, side, barrier, o)
            else:
                for i in range(args.warmup):
                    step(i)
                sync(stream)
                barrier.wait()
                res[op] = time_each(step, args.iters, stream)
        sync(side if graph else stream)
        comm.synchronize()  # raises an error a replayed call recorded (a timeout, a capacity overflow)
        res["pair_ok"] = check(last["y"], inp, experts, wire)[0]
        res["graph_calls"] = calls if graph else None
        steps.clear()
        d = eo = y = None  # noqa: F841 - their memory is free for the torch reference
        last.clear()
        if with_reference:
            if r == 0:
                sys.stderr.write(f"  tokens {tokens}: timing the torch reference (eager)\n")
            yr, _ = torch_reference(comm, inp, s, experts, settled, stream)
            res["ref_ok"], res["ref_err"], _ = check(yr, inp, experts, None)
            for _ in range(args.warmup):
                torch_reference(comm, inp, s, experts, settled, stream)
            res["reference"] = [torch_reference(comm, inp, s, experts, settled, stream)[1] for _ in range(args.iters)]
        return res

    cfg = {"timeout_s": args.timeout, "moe": {"max_tokens_per_rank": max(tokens, 1), "signal_scope": args.signal_scope,
                                              "one_pass": args.one_pass == "on"}}
    if args.decode_tokens is not None:
        cfg["moe"]["decode_tokens"] = args.decode_tokens
    extra = {}
    if device.type == "cuda" and "reserve_bytes" in inspect.signature(run_virtual).parameters:
        # loopback ranks share one CUDA context: a rank's cudaMalloc while peers' kernels wait for it
        # stalls, so each rank's eager peak is reserved up front (run_virtual's reserve_bytes)
        extra["reserve_bytes"] = reserve_bytes(args, tokens, capacity, with_reference)
    per_rank = run_virtual(world, fn, device=device, config=cfg, **extra)
    return {"inputs": inputs, "capacity": capacity, "ranks": per_rank}


def reserve_bytes(args, tokens: int, capacity: int | None, with_reference: bool = True) -> int:
    """An upper estimate of one rank's eager allocations in ``_config_run`` (bytes); the torch
    reference's only where it runs."""
    h, k, w = args.hidden, args.topk, args.world
    rows = args.experts * (capacity or tokens)  # expert rows: L * W * capacity (exact rows are fewer)
    purlin = rows * h * 2 * 2 + 8192 * h * 4 + tokens * h * 2 * 4
    reference = w * tokens * h * (2 + 4 + 2) + 8192 * h * (2 + 4 + 4) + tokens * w * k * 16 if with_reference else 0
    return int(1.25 * (purlin + reference)) + (256 << 20)


def _samples(per_rank: list[dict], key: str) -> list[float]:
    return [max(t) for t in zip(*(pr[key] for pr in per_rank))]


def make_rows(args, tokens: int, dtype_name: str, run: dict, floor: dict | None) -> list[dict]:
    ranks, inputs = run["ranks"], run["inputs"]
    wire = DTYPES[dtype_name]
    d_bytes, c_bytes = wire_bytes([i.ids for i in inputs], args.experts, args.world, args.hidden, wire)
    base = {"tokens": tokens, "hidden": args.hidden, "topk": args.topk, "experts": args.experts, "world": args.world,
            "capacity": run["capacity"], "rows": max(pr["rows"] for pr in ranks),
            "hbm_bytes": max(pr["hbm"] for pr in ranks), "moe_hbm_bytes": ranks[0]["moe_hbm"],
            "workspace_bytes": ranks[0]["workspace"],
            "graph_calls": ranks[0]["graph_calls"]}
    # exact rows (eager) and small enough: also bitwise against the loop reference of purlin_sglang.moe
    bitwise = bitwise_vs_reference([pr["y"] for pr in ranks], inputs, args.experts, wire)
    checked = all(pr["ok"] for pr in ranks) and bitwise is not False
    rows = []
    todo = [("purlin", "dispatch", dtype_name, d_bytes, checked), ("purlin", "combine", dtype_name, c_bytes, checked),
            ("purlin", "pair", dtype_name, d_bytes + c_bytes, checked and all(pr["pair_ok"] for pr in ranks))]
    if "reference" in ranks[0]:
        todo.append(("torch-ref", "pair", "bf16", None, all(pr["ref_ok"] for pr in ranks)))
    for impl, op, dt, nbytes, ok in todo:
        samples = _samples(ranks, "reference" if impl == "torch-ref" else op)
        med = percentile(samples, 50)
        row = {"impl": impl, "op": op, "dtype": dt, "mode": "eager" if impl == "torch-ref" else args.mode, **base,
               "bytes": nbytes, "time_us_median": med * 1e6, "time_us_p10": percentile(samples, 10) * 1e6,
               "time_us_p90": percentile(samples, 90) * 1e6, "correct": ok, "iters": len(samples),
               "max_abs_err": max(pr["ref_err" if impl == "torch-ref" else "err"] for pr in ranks)}
        if impl == "purlin":
            row["err_over_bound"] = max(pr["ratio"] for pr in ranks)
            row["bitwise_vs_reference"] = bitwise
            if getattr(args, "device", None) == "cuda":  # (make_rows takes any namespace with the row options)
                row["path"] = cuda_path(args, tokens)
        # every row has the ceiling fields: null where there is no copy rate (the CPU) or no byte count
        row.update(ceiling_us=None, of_ceiling=None, over_ceiling_us=None)
        if nbytes is not None and med > 0:
            row["GBps"] = nbytes / med / 1e9
            if floor is not None:
                row["ceiling_us"] = 2 * nbytes / (floor["copy_GBps"] * 1e9) * 1e6
                row["of_ceiling"] = row["ceiling_us"] / row["time_us_median"]
                row["over_ceiling_us"] = row["time_us_median"] - row["ceiling_us"]  # the fixed overhead, roughly
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from .environment import environment
    from .moe_report import format_table, plot

    args, out_dir = start(args, resolve)
    device = torch.device(args.device)
    floor = None
    if device.type == "cuda":
        from .floor import measure_floor

        sys.stderr.write("bench moe: measuring the copy ceiling (device copy bandwidth)\n")
        floor = measure_floor(device, args.world, {"timeout_s": args.timeout})
    configs = [(t, d) for t in args.tokens for d in args.dtypes]
    sys.stderr.write(f"bench moe: device {args.device}, world {args.world}, hidden {args.hidden}, top-{args.topk} of "
                     f"{args.experts} experts, tokens/rank {args.tokens}, dtypes {args.dtypes}, mode {args.mode}, "
                     f"{len(configs)} configs\n")
    rows: list[dict] = []
    failures: list[dict] = []
    for n, (tokens, dt) in enumerate(configs, 1):
        sys.stderr.write(f"[{n}/{len(configs)}] tokens {tokens}, {dt}\n")
        with_ref = not args.no_reference and dt == args.dtypes[0]
        try:
            result = _config_run(args, tokens, dt, with_ref, device)
        except Exception as e:  # noqa: BLE001 - reported as a failed config, the run goes on
            msg = f"{type(e).__name__}: {e}"
            sys.stderr.write(f"  FAILED: {msg}\n")
            failures.append({"tokens": tokens, "dtype": dt, "error": msg})
            continue
        new = make_rows(args, tokens, dt, result, floor)
        rows.extend(new)
        sys.stderr.write("  " + ", ".join(f"{r['impl']} {r['op']} {r['time_us_median']:.1f} us"
                                          f"{'' if r['correct'] else ' WRONG'}" for r in new) + "\n")
    settings = {k: getattr(args, k) for k in ("device", "tokens", "hidden", "topk", "experts", "world", "dtypes",
                                              "mode", "capacity", "drop_every", "iters", "warmup", "graph_calls",
                                              "launch_ahead", "seed", "timeout", "signal_scope", "one_pass")}
    settings["decode_tokens"] = (args.decode_tokens if args.decode_tokens is not None
                                 else MoESettings().decode_tokens)  # calls of up to this many tokens: decode mode
    settings["timing"] = ("per iteration the slowest rank; CUDA events on each rank's stream (graph: one replay "
                          "of graph_calls calls / graph_calls; launch_ahead: the replays enqueued behind a GPU "
                          "sleep, run back to back) or time.perf_counter (CPU); pair = dispatch then combine, no "
                          "expert work; torch-ref = all_gather + index + stand-in experts + "
                          "reduce_scatter, eager, the sum of the three phases timed apart")
    result = {"environment": environment(args.device), "settings": settings, "floor": floor, "rows": rows,
              "failures": failures, "argv": sys.argv}
    (out_dir / "moe.json").write_text(json.dumps(result, indent=2, default=str))
    png, why = plot(rows, out_dir / "moe.png")
    print(format_table(rows, floor))
    for f in failures:
        print(f"FAILED: tokens {f['tokens']} {f['dtype']}: {f['error']}")
    print(f"wrote {out_dir / 'moe.json'}" + (f" and {png}" if png else ""))
    if why:
        print(why)
    bad = [r for r in rows if not r["correct"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} results correct" + (f"; {len(failures)} configs failed" if failures else ""))
    return 1 if bad or failures else 0
