"""Benchmark: the native reduce atom against torch's device-to-device copy (not a pytest test).

    python3 benchmarks/bench_reduce_atom.py [--mib 64] [--iters 20] [--json out.json]

Each case: warm-up, then the median of ``--iters`` CUDA-event-timed calls. GB/s counts bytes
read plus bytes written ((nsrc + 1) x size per source), like bench_copy_atom.py; "of copy" is the
ratio to torch's 256 MiB device-to-device copy measured in the same run (target >= 85%).
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from purlin_sglang import native
from purlin_sglang.bench.timing import time_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="size of each source (and of dst)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    lib = native.load()
    gpu = torch.cuda.get_device_name(torch.cuda.current_device())
    sid = torch.cuda.current_stream().cuda_stream
    rows: list[dict] = []

    def case(name: str, moved: int, fn, copy_gbs: float | None = None) -> float:
        ms = time_ms(fn, args.iters)
        gbs = moved / (ms * 1e-3) / 1e9
        row = {"case": name, "bytes_moved": moved, "median_ms": round(ms, 4), "GBps": round(gbs, 1)}
        if copy_gbs:
            row["of_copy"] = round(gbs / copy_gbs, 3)
        rows.append(row)
        ratio = f"{100 * gbs / copy_gbs:6.1f}%" if copy_gbs else ""
        print(f"{name:<44s} {moved / 2**20:9.1f} MiB moved {ms * 1e3:9.1f} us {gbs:8.1f} GB/s {ratio}", flush=True)
        return gbs

    # The ceiling: torch's device-to-device copy of 256 MiB (read + written counted).
    big = 256 << 20
    csrc = torch.randint(0, 256, (big,), dtype=torch.uint8, device="cuda")
    cdst = torch.empty_like(csrc)
    copy_gbs = case("torch copy_ 256 MiB", 2 * big, lambda: cdst.copy_(csrc))
    case("copy_atom 256 MiB", 2 * big, lambda: lib.copy_atom(cdst.data_ptr(), csrc.data_ptr(), big, sid), copy_gbs)
    del csrc, cdst

    size = args.mib << 20
    for dtype in (torch.bfloat16, torch.float32):
        n = size // dtype.itemsize
        srcs = [torch.randn(n + 64, device="cuda").to(dtype) for _ in range(8)]  # never zeros
        dst = torch.empty(n + 64, dtype=dtype, device="cuda")
        name = str(dtype).removeprefix("torch.")
        for nsrc in (8, 4, 2):
            ptrs = [s.data_ptr() for s in srcs[:nsrc]]
            moved = (nsrc + 1) * size
            case(f"reduce {name} sum {nsrc}->1 {args.mib} MiB", moved,
                 lambda p=ptrs: lib.reduce_atom(dst.data_ptr(), p, size, dtype, "sum", sid), copy_gbs)
            if nsrc == 2:
                case(f"torch.add {name} 2->1 {args.mib} MiB", moved,
                     lambda: torch.add(srcs[0][:n], srcs[1][:n], out=dst[:n]), copy_gbs)
        ptrs = [s.data_ptr() for s in srcs]
        if dtype == torch.bfloat16:
            case(f"reduce {name} max 8->1 {args.mib} MiB", 9 * size,
                 lambda: lib.reduce_atom(dst.data_ptr(), ptrs, size, dtype, "max", sid), copy_gbs)
            for blocks in (16, 32, 66, 132):
                case(f"reduce {name} sum 8->1 max_blocks={blocks}", 9 * size,
                     lambda b=blocks: lib.reduce_atom(dst.data_ptr(), ptrs, size, dtype, "sum", sid, max_blocks=b),
                     copy_gbs)
            e = dtype.itemsize
            case(f"reduce {name} sum 8->1 all +1 elem (+2 B)", 9 * (size - e),
                 lambda: lib.reduce_atom(dst.data_ptr() + e, [p + e for p in ptrs], size - e, dtype, "sum", sid),
                 copy_gbs)
            case(f"reduce {name} sum 8->1 src0 +1 elem (elementwise)", 9 * (size - e),
                 lambda: lib.reduce_atom(dst.data_ptr(), [ptrs[0] + e] + ptrs[1:], size - e, dtype, "sum", sid),
                 copy_gbs)
        torch.cuda.synchronize()
        # A sanity check on what was timed last in this dtype (the full-size sum of 8 sources).
        lib.reduce_atom(dst.data_ptr(), ptrs, size, dtype, "sum", sid)
        acc = srcs[0][:n].float()
        for s in srcs[1:]:
            acc += s[:n].float()
        assert torch.equal(dst[:n], acc.to(dtype)), f"reduce_atom {dtype} result differs from torch"
        del srcs, dst, acc

    result = {
        "date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
        "build": native.build_info(), "iters": args.iters, "mib_per_source": args.mib,
        "copy_ceiling_GBps": round(copy_gbs, 1), "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
