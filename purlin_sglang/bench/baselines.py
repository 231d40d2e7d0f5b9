"""Baselines timed in the same command: torch.distributed (NCCL on GPU, gloo on CPU), torch
symmetric-memory all-reduce, SGLang's custom all-reduce.

Each needs one process per rank (and, on GPU, one GPU per process), so they run in spawned
worker processes, each case checked against the same torch reference and timed the same way
as purlin (slowest rank per iteration). What the machine cannot run is returned as a skip
with a one-line reason, never an error.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import queue as _queue
import sys
import tempfile
from typing import Any

import torch

from .cases import Case, check, fresh_input, make_case
from .purlin_runner import Options, input_seed
from .timing import time_each, time_graph_replays

GPU_IMPLS = {"nccl": ("nccl",), "symm_mem": ("symm_mem_one_shot", "symm_mem_two_shot"),
             "sglang": ("sglang_custom_ar",)}


def _sglang_reason() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not importable (install the [sglang] extra)"
    return None


def _symm_mem_reason() -> str | None:
    try:
        ops = torch.ops.symm_mem
        if not hasattr(ops, "one_shot_all_reduce") or not hasattr(ops, "two_shot_all_reduce_"):
            return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce / two_shot_all_reduce_"
    except Exception as e:  # noqa: BLE001
        return f"torch.ops.symm_mem unavailable: {e}"
    return None


def run_baselines(args, opts: Options, device: torch.device) -> tuple[list[dict], list[dict]]:
    from .rows import make_row

    rows, skipped = [], []

    def skip(impl: str, world: int, reason: str) -> None:
        skipped.append({"impl": impl, "world": world, "reason": reason})

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for world in args.world:
        impls: list[str] = []
        backend = "nccl" if device.type == "cuda" else "gloo"
        for b in args.baselines:
            if b == "gloo":
                if device.type == "cuda":
                    skip("gloo", world, "the gloo baseline is for --device cpu")
                    continue
                impls.append("gloo")
                continue
            if device.type != "cuda":
                skip(b, world, f"{b} needs CUDA (device is cpu)")
                continue
            why = {"sglang": _sglang_reason, "symm_mem": _symm_mem_reason}.get(b, lambda: None)()
            if why is None and gpus < world:
                why = (f"needs one process per GPU: world {world} needs {world} GPUs, this machine has {gpus} "
                       f"(on one GPU only world 1 runs; add it with --world 1,{world})")
            if why:
                skip(b, world, why)
                continue
            impls.extend(GPU_IMPLS[b])
        if not impls:
            continue
        cases = [make_case(c, s, world, opts.dtype) for c in args.collectives for s in args.sizes]
        modes = [m for m in args.modes if m == "eager" or device.type == "cuda"]
        sys.stderr.write(f"  baselines {impls} world {world}: {len(cases)} cases, modes {modes}\n")
        try:
            per_rank = _launch(world, backend, impls, cases, modes, opts, device.type)
        except Exception as e:  # noqa: BLE001 - a launcher failure is a skip with its reason
            for impl in impls:
                skip(impl, world, f"launch failed: {type(e).__name__}: {e}")
            continue
        seen_skip = set()
        for key in per_rank[0]:
            impl, ci, mode = key
            res = [pr[key] for pr in per_rank]
            case = cases[ci]
            reason = next((x["skip"] for x in res if "skip" in x), None)
            if reason is not None:
                k = (impl, case.collective, mode, reason)
                if k not in seen_skip:
                    seen_skip.add(k)
                    skipped.append({"impl": impl, "collective": case.collective, "world": world, "mode": mode,
                                    "reason": reason})
                continue
            samples = [max(t) for t in zip(*(x["samples"] for x in res))]
            row = make_row(impl, backend if impl in ("nccl", "gloo") else "torch", case, mode,
                           args.dtype, samples, all(x["ok"] for x in res), all(x["exact"] for x in res),
                           max(x["err"] for x in res), res[0]["buffers"])
            if res[0].get("note"):
                row["note"] = res[0]["note"]
            rows.append(row)
    return rows, skipped


def _launch(world: int, backend: str, impls: list[str], cases: list[Case], modes: list[str], opts: Options,
            device_type: str) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="purlin-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, backend, store, impls, cases, modes, opts,
                                                    device_type, q), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        got: dict[int, Any] = {}
        deadline = opts.timeout_s * 4 + 120 + 0.5 * len(cases) * len(impls)
        try:
            while len(got) < world:
                try:
                    r, payload = q.get(timeout=deadline)
                except _queue.Empty:
                    raise TimeoutError(f"baseline workers did not finish within {deadline:.0f}s") from None
                if isinstance(payload, str):
                    raise RuntimeError(f"rank {r}: {payload}")
                got[r] = payload
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()  # only the workers this call started
    return [got[r] for r in range(world)]


class _Dist:
    """torch.distributed collectives by catalog name. all_reduce and broadcast run in place
    (torch.distributed has no out-of-place form), on the rotated input buffers."""

    in_place = ("all_reduce", "broadcast")

    def __init__(self, dist, world: int):
        self.dist, self.world = dist, world

    def __call__(self, case: Case, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        d, n, name = self.dist, self.world, case.collective
        if name == "all_reduce":
            d.all_reduce(x)
            return x
        if name == "broadcast":
            d.broadcast(x, src=0)
            return x
        if name == "all_gather":
            d.all_gather_into_tensor(out, x)
        elif name == "all_gather_v":
            d.all_gather(list(out.chunk(n)), x)
        elif name == "reduce_scatter":
            d.reduce_scatter_tensor(out, x)
        elif name == "reduce_scatter_v":
            d.reduce_scatter(out, list(x.chunk(n)))
        elif name == "all_to_all":
            d.all_to_all_single(out, x)
        elif name == "all_to_all_v":
            splits = [case.in_numel // n] * n
            d.all_to_all_single(out, x, splits, splits)
        else:
            raise ValueError(name)
        return out


def _symm_call(kind: str, group_name: str):
    ops = torch.ops.symm_mem

    def call(case: Case, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if kind == "one_shot":
            if hasattr(ops, "one_shot_all_reduce_out"):
                return ops.one_shot_all_reduce_out(x, "sum", group_name, out)
            return ops.one_shot_all_reduce(x, "sum", group_name)
        if hasattr(ops, "two_shot_all_reduce_out"):
            return ops.two_shot_all_reduce_out(x, "sum", group_name, out)
        ops.two_shot_all_reduce_(x, "sum", group_name)
        return x

    return call


def _worker(rank, world, backend, store_path, impls, cases, modes, opts: Options, device_type, q) -> None:
    try:
        import warnings

        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renames of *_tensor ops

        if device_type == "cuda":
            torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=opts.timeout_s))
        out: dict = {}
        try:
            for impl in impls:
                _run_impl(impl, dist, rank, world, dev, cases, modes, opts, out)
        finally:
            dist.destroy_process_group()
        q.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, f"{type(e).__name__}: {e}"))


def _run_impl(impl, dist, rank, world, dev, cases, modes, opts: Options, out: dict) -> None:
    stream = torch.cuda.current_stream(dev) if dev.type == "cuda" else None
    alloc = torch.empty
    setup_error = None
    note = None
    if impl in ("nccl", "gloo"):
        call = _Dist(dist, world)
        note = "all_reduce/broadcast in place (torch.distributed has no out-of-place form)"
        only = None
    elif impl.startswith("symm_mem"):
        only = ("all_reduce",)
        try:
            import torch.distributed._symmetric_memory as symm

            group_name = dist.group.WORLD.group_name
            if hasattr(symm, "enable_symm_mem_for_group"):
                try:
                    symm.enable_symm_mem_for_group(group_name)
                except Exception:  # noqa: BLE001 - newer torch needs none
                    pass

            def alloc(n, dtype=None, device=None):  # noqa: F811 - symmetric buffers for the inputs
                t = symm.empty(n, dtype=dtype, device=device)
                symm.rendezvous(t, group_name)
                return t

            call = _symm_call(impl.removeprefix("symm_mem_"), group_name)
        except Exception as e:  # noqa: BLE001
            setup_error = f"torch symmetric memory set-up failed: {type(e).__name__}: {e}"
    else:  # sglang_custom_ar
        only = ("all_reduce",)
        try:
            from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce

            ca = CustomAllreduce(group=dist.new_group(backend="gloo"), device=dev)
            if getattr(ca, "disabled", False):
                setup_error = "SGLang's CustomAllreduce disabled itself on this machine (see its log)"

            def call(case, x, o):  # noqa: F811
                y = ca.custom_all_reduce(x)
                if y is None:
                    raise _NotEligible(f"SGLang custom all-reduce declines {case.nbytes} bytes (above max_size)")
                return y
        except Exception as e:  # noqa: BLE001
            setup_error = f"SGLang custom all-reduce set-up failed: {type(e).__name__}: {e}"
    for ci, case in enumerate(cases):
        for mode in modes:
            key = (impl, ci, mode)
            if only is not None and case.collective not in only:
                out[key] = {"skip": f"{impl} implements all_reduce only"}
                continue
            if setup_error:
                out[key] = {"skip": setup_error}
                continue
            if mode == "graph" and impl == "sglang_custom_ar":
                out[key] = {"skip": "graph mode of SGLang's custom all-reduce is not wired into this harness"}
                continue
            try:
                out[key] = _time_case(call, case, ci, mode, rank, world, dev, stream, opts, alloc, dist)
                if note and case.collective in _Dist.in_place:
                    out[key]["note"] = note
            except _NotEligible as e:
                out[key] = {"skip": str(e)}
            except Exception as e:  # noqa: BLE001 - same on every rank, as the collectives fail alike
                out[key] = {"skip": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}


class _NotEligible(Exception):
    pass


def _time_case(call, case: Case, ci: int, mode: str, rank: int, world: int, dev, stream, opts: Options,
               alloc, dist) -> dict:
    nbuf = opts.buffers(case, 1)  # one GPU (or host) per rank
    xs_all = [fresh_input(case, opts.dtype, dev, input_seed(opts.seed, ci, p, 0)) for p in range(world)]
    bufs = []
    for j in range(nbuf):
        b = alloc(case.in_numel, dtype=opts.dtype, device=dev)
        b.copy_(xs_all[rank] if j == 0 else fresh_input(case, opts.dtype, dev, input_seed(opts.seed, ci, rank, j)))
        bufs.append(b)
    o = torch.empty(case.out_numel, dtype=opts.dtype, device=dev)
    keep = bufs[0].clone()
    got = call(case, bufs[0], o)
    ok, exact, err = check(case, got, xs_all, rank)
    bufs[0].copy_(keep)  # an in-place call overwrote it
    del xs_all, keep, got

    def step(i: int) -> None:
        call(case, bufs[i % nbuf], o)

    if mode == "eager":
        for i in range(opts.warmup):
            step(i)
        dist.barrier()
        samples = time_each(step, opts.iters, stream)
    else:
        side = torch.cuda.Stream(dev)
        side.wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            for j in range(opts.graph_calls):
                step(j)
        samples = time_graph_replays(g, side, opts.graph_calls, opts.warmup, opts.iters, dist.barrier,
                                     ahead=opts.launch_ahead)
        del g
    return {"ok": ok, "exact": exact, "err": err, "samples": samples, "buffers": nbuf}
