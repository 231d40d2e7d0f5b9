"""MoE dispatch / combine timing on loopback virtual ranks (one GPU), graph mode.

Each rank captures `--iters` calls in one CUDA graph (dispatch alone, combine alone, the pair) and
replays it; all ranks run at once, so a time is the wall time of one call on EVERY rank together
(loopback: all ranks' traffic shares one GPU's HBM). "wire" bytes: the rows that travel (each token
once per destination rank, payload + header), summed over ranks; the copy ceiling is a device copy of
the same byte count timed in the same run. Prints one JSON line per case.

    python3 benchmarks/bench_moe.py --world 8 --tokens 128 --hidden 7168 --topk 8 --experts 256
"""

import argparse
import json
import threading
import time

import torch

import purlin_sglang as ps


def make_inputs(world, tokens, hidden, topk, experts, seed):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=g).to(torch.bfloat16) for _ in range(world)]
    ids = [torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]) for _ in range(world)]
    ws = [torch.rand(tokens, topk, generator=g) for _ in range(world)]
    return xs, ids, ws


def copy_ceiling(nbytes, dev, reps=20):
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / reps


def bench(args, qdtype):
    world, T, H, K, E = args.world, args.tokens, args.hidden, args.topk, args.experts
    cap = args.capacity
    xs, ids, ws = make_inputs(world, T, H, K, E, 1)
    barrier = threading.Barrier(world)
    one_capture = threading.Lock()
    out = {}
    cfg = {"staging_bytes": 1 << 20, "timeout_s": 60, "moe": {"max_tokens_per_rank": T}}

    def fn(comm):
        r, dev = comm.rank, comm.device
        x, i, w = xs[r].to(dev), ids[r].to(dev), ws[r].to(dev)
        sent = int(((i.to(torch.int64) // (E // world))[:, :, None] == torch.arange(world, device=dev)).any(1).sum())
        comm.synchronize()
        barrier.wait()  # inputs staged on every rank before any call (no host copies while peers wait)
        d = comm.moe_dispatch(x, i, w, num_experts=E, capacity=cap, dtype=qdtype)
        eo = torch.randn(d.x.shape, device=dev).to(torch.bfloat16)
        comm.moe_combine(eo, d)
        comm.synchronize()
        graphs = {}
        for name in ("dispatch", "combine", "pair"):
            barrier.wait()
            g = torch.cuda.CUDAGraph()
            with one_capture, comm.capture(), torch.cuda.graph(g, stream=torch.cuda.current_stream(),
                                                               capture_error_mode="thread_local"):
                for _ in range(args.iters):
                    if name in ("dispatch", "pair"):
                        dd = comm.moe_dispatch(x, i, w, num_experts=E, capacity=cap, dtype=qdtype)
                    if name == "combine":
                        comm.moe_combine(eo, d)
                    if name == "pair":
                        comm.moe_combine(eo, dd)
            graphs[name] = g
        times = {}
        for name, g in graphs.items():
            g.replay()
            comm.synchronize()
            barrier.wait()
            t0 = time.perf_counter()
            for _ in range(args.reps):
                g.replay()
            comm.synchronize()
            barrier.wait()
            times[name] = (time.perf_counter() - t0) / (args.reps * args.iters)
        if r == 0:
            out["times"] = times
            out["hbm"] = comm.moe_hbm_bytes
        return sent

    sent = ps.run_virtual(world, fn, device="cuda", config=cfg, reserve_bytes=args.reserve_mib << 20)
    elem = 1 if qdtype is not None else 2
    hdr = -(-4 * (2 * K + 2) // 16) * 16
    wire = sum(sent) * (H * elem + hdr)
    slots = world * T * K * H * 2  # combine: every (t, k) row back, bf16
    ceil_d = copy_ceiling(wire, torch.device("cuda"))
    ceil_c = copy_ceiling(slots, torch.device("cuda"))
    t = out["times"]
    return {
        "world": world, "tokens": T, "hidden": H, "topk": K, "experts": E, "capacity": cap,
        "dtype": "fp8" if qdtype is not None else "bf16",
        "dispatch_us": t["dispatch"] * 1e6, "combine_us": t["combine"] * 1e6, "pair_us": t["pair"] * 1e6,
        "dispatch_wire_bytes": wire, "combine_wire_bytes": slots,
        "copy_ceiling_dispatch_us": ceil_d * 1e6, "copy_ceiling_combine_us": ceil_c * 1e6,
        "dispatch_vs_ceiling": ceil_d / t["dispatch"], "combine_vs_ceiling": ceil_c / t["combine"],
        "moe_region_bytes_per_rank": out["hbm"], "gpu": torch.cuda.get_device_name(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--reserve-mib", type=int, default=1024, help="run_virtual reserve_bytes per rank (MiB)")
    args = ap.parse_args()
    for dt in args.dtypes.split(","):
        print(json.dumps(bench(args, torch.float8_e4m3fn if dt == "fp8" else None)), flush=True)


if __name__ == "__main__":
    main()
