"""Where the staged one-shot's latency goes: the 8 KiB all_reduce one-shot schedule with parts taken out,
each timed in CUDA graphs as the engine bench times a collective (why a small one-shot costs several
times the packet path at 8 KiB).

Each variant is the real one-shot schedule of every rank (planner + lowering, as a call would make it)
with some op kinds removed, run through the CUDA engine directly (no call path), in a fresh loopback
world of its own (a variant leaves the workspace counters where only that variant expects them).
Variants only drop a signal together with every wait for it, so none can hang; the ones that drop
the drain or the signals let a rank overwrite staging a peer may still read, so their OUTPUTS ARE
NOT CHECKED: they are timings of a protocol's parts, not collectives.

    python3 benchmarks/bench_staged_parts.py [--worlds 2,8] [--bytes 8192] [--json out.json]

Reading: "full" minus "no drain-all" is what the drain of the previous call's acks costs on the
critical path; "no drain-all" minus "no drain-all, no acks" the ack signals; "full" minus "sync
only" the bytes (stage copy and reduce); "no op" the interpreter kernel's own launch; the packet
rows put the packet kernel beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading

from purlin_sglang.collectives.catalog import ALL_REDUCE
from purlin_sglang.snac import Copy, Reduce, Signal, Sizes, WaitDrainAll, WaitSignal, lower, make_plan

STAGING = 1 << 20


def _notify(op) -> bool:
    return isinstance(op, (Signal, WaitSignal)) and op.kind == "notify"


def _ack(op) -> bool:
    return isinstance(op, Signal) and op.kind == "ack"


def _data(op) -> bool:
    return isinstance(op, (Copy, Reduce))


# name -> (algorithm, which ops of the schedule stay)
VARIANTS = {
    "full": ("oneshot", lambda op: True),
    "no drain-all": ("oneshot", lambda op: not isinstance(op, WaitDrainAll)),
    "no drain-all, no acks": ("oneshot", lambda op: not isinstance(op, WaitDrainAll) and not _ack(op)),
    "sync only (no copy, no reduce)": ("oneshot", lambda op: not _data(op)),
    "notifies and their waits only": ("oneshot", _notify),
    "data only (stage copy and reduce, no signal; racy)": ("oneshot", _data),
    "no op (the interpreter kernel's launch)": ("oneshot", lambda op: False),
    "packet": ("packet", lambda op: True),
    "packet kernel, no op": ("packet", lambda op: False),
}


def variant(name: str, world: int, rank: int, nbytes: int, staging_bytes: int = STAGING):
    """Rank ``rank``'s schedule of variant ``name``: the all_reduce of ``nbytes`` per rank as the planner
    and the lowering make it for the variant's algorithm, with the ops the variant drops taken out."""
    algorithm, keep = VARIANTS[name]
    plan = make_plan(ALL_REDUCE, world, rank, nbytes=nbytes, staging_bytes=staging_bytes, algorithm=algorithm)
    sched = lower(plan, Sizes((nbytes,), (nbytes,)))
    return dataclasses.replace(sched, ops=tuple(op for op in sched.ops if keep(op)))


def time_variant(name: str, world: int, nbytes: int, calls: int = 50, replays: int = 20, timings: int = 5) -> dict:
    """Variant ``name`` at ``world`` ranks: every rank's schedule launched through its CudaEngine,
    ``calls`` per captured graph, timed as the engine bench times a collective (slowest rank)."""
    import torch

    import purlin_sglang as ps
    from purlin_sglang.engines.base import CallContext
    from purlin_sglang.engines.cuda_ops import encode

    from bench_cuda_engine import _graph_time as graph_time  # a sibling script (this folder is sys.path[0])
    barrier, lock = threading.Barrier(world), threading.Lock()

    def fn(comm):
        eng = comm._engine
        x = torch.randn(nbytes // 2, device=comm.device).to(torch.bfloat16)
        out = torch.empty_like(x)
        sched = variant(name, world, comm.rank, nbytes)
        seq = [0]

        def step():
            seq[0] += 1
            eng.execute(sched, CallContext("all_reduce", seq[0], 0, x.dtype, x, out))

        barrier.wait()
        step()  # outside any capture: uploads the table
        comm.synchronize()
        us = graph_time(step, comm.synchronize, calls, replays, timings, barrier, lock)
        enc = encode(sched, eng.dlayout)
        return us, enc.n_ops, enc.n_barriers

    res = ps.run_virtual(world, fn, device="cuda", config={"staging_bytes": STAGING, "device_call_check": False})
    return {"variant": name, "world": world, "bytes_per_rank": nbytes, "us_per_call": max(r[0] for r in res),
            "us_per_call_by_rank": [round(r[0], 2) for r in res], "records": res[0][1], "grid_barriers": res[0][2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,8")
    ap.add_argument("--bytes", type=int, default=8192, help="per-rank all_reduce payload (bf16)")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    rows = []
    worlds = [int(w) for w in a.worlds.split(",")]
    for world in [1] + [w for w in worlds if w != 1]:
        for name in VARIANTS:
            if world == 1 and name not in ("full", "no op (the interpreter kernel's launch)", "packet"):
                continue  # one rank: no peer, nothing to take out
            row = time_variant(name, world, a.bytes)
            rows.append(row)
            print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    print(f"\n{'variant':<52}" + "".join(f"{'world ' + str(w):>10}" for w in sorted({r['world'] for r in rows})))
    for name in VARIANTS:
        cells = {r["world"]: r["us_per_call"] for r in rows if r["variant"] == name}
        print(f"{name:<52}" + "".join(f"{cells[w]:>10.2f}" if w in cells else f"{'-':>10}"
                                      for w in sorted({r['world'] for r in rows})))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "bytes_per_rank": a.bytes,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
