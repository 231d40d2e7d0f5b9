"""Benchmark: the native copy atom against torch's device-to-device copy (not a pytest test).

    python3 benchmarks/bench_copy_atom.py [--mib 256] [--iters 20] [--json out.json]

Each case: warm-up, then the median of ``--iters`` CUDA-event-timed calls. GB/s counts bytes
read plus bytes written (2 x size), like the measured-facts table in ARCHITECTURE.md.
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
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    lib = native.load()
    dev = torch.cuda.current_device()
    gpu = torch.cuda.get_device_name(dev)
    stream = torch.cuda.current_stream()
    sid = stream.cuda_stream
    total = args.mib << 20
    src = torch.randint(0, 256, (total + 64,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    rows = []

    def case(name: str, nbytes: int, fn) -> None:
        ms = time_ms(fn, args.iters)
        gbs = 2 * nbytes / (ms * 1e-3) / 1e9
        rows.append({"case": name, "bytes": nbytes, "median_ms": round(ms, 4), "GBps": round(gbs, 1)})
        print(f"{name:<40s} {nbytes / 2**20:9.2f} MiB  {ms * 1e3:9.1f} us  {gbs:8.1f} GB/s", flush=True)

    base_s, base_d = src.data_ptr(), dst.data_ptr()
    for mib in sorted({1, 16, args.mib}):
        n = mib << 20
        case(f"torch copy_ {mib} MiB", n, lambda n=n: dst[:n].copy_(src[:n]))
        case(f"copy_atom {mib} MiB", n, lambda n=n: lib.copy_atom(base_d, base_s, n, sid))
    bulk = torch.cuda.get_device_capability(dev)[0] >= 9
    for kib in (64, 256, 1024, 4096, 16384, 65536, args.mib << 10):  # the bulk (TMA) atom, per size
        n = kib << 10
        case(f"copy_atom {kib} KiB", n, lambda n=n: lib.copy_atom(base_d, base_s, n, sid))
        if bulk:
            case(f"copy_atom_bulk {kib} KiB", n, lambda n=n: lib.copy_atom_bulk(base_d, base_s, n, sid))
    if bulk:
        for blocks in (66, 132):
            case(f"copy_atom_bulk {args.mib} MiB max_blocks={blocks}", total,
                 lambda b=blocks: lib.copy_atom_bulk(base_d, base_s, total, sid, max_blocks=b))
        torch.cuda.synchronize()
        assert torch.equal(dst[:total], src[:total]), "copy_atom_bulk result differs from src"
    n = total
    for blocks in (16, 132, 264):
        case(f"copy_atom {args.mib} MiB max_blocks={blocks}", n,
             lambda b=blocks: lib.copy_atom(base_d, base_s, n, sid, max_blocks=b))
    case(f"copy_atom {args.mib} MiB +3 bytes, dst/src +5", n + 3,
         lambda: lib.copy_atom(base_d + 5, base_s + 5, n + 3, sid))  # same misalignment: 16 B body
    case(f"copy_atom {args.mib} MiB dst+8 (8 B accesses)", n, lambda: lib.copy_atom(base_d + 8, base_s, n, sid))
    case(f"copy_atom {args.mib} MiB dst+4 (4 B accesses)", n, lambda: lib.copy_atom(base_d + 4, base_s, n, sid))
    case(f"copy_atom {args.mib} MiB dst+1 (1 B accesses)", n, lambda: lib.copy_atom(base_d + 1, base_s, n, sid))
    torch.cuda.synchronize()
    assert torch.equal(dst[1 : n + 1], src[:n]), "copy_atom result differs from src"

    result = {
        "date": datetime.date.today().isoformat(), "gpu": gpu, "torch": torch.__version__,
        "build": native.build_info(), "iters": args.iters, "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
