"""`purlin-sglang bench moe` with the MoE kernels' grid set per run: blocks per rank.

An experiment, not a setting of the library: before each run it sets the bound the CUDA MoE part
sizes its grid with (``purlin_sglang.moe.cuda.MAX_BLOCKS``, read when a communicator starts, so it
holds for every world of that run), and restores it afterwards. Each run writes its own results
directory, ``OUT/blocks-N``. Usage (GPU machine; the words after ``--`` go to ``bench moe``)::

    python3 benchmarks/bench_moe_grid.py --blocks 16,8,4,2,1 --out DIR -- --tokens 1 --dtypes bf16 --no-reference
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def run(blocks: list[int], bench_args: list[str], out: Path, main=None) -> int:
    """``bench moe BENCH_ARGS --out OUT/blocks-N`` for each N of ``blocks``; the worst exit code."""
    import purlin_sglang.moe.cuda as moe_cuda

    if main is None:
        from purlin_sglang.cli import main
    saved, worst = moe_cuda.MAX_BLOCKS, 0
    try:
        for n in blocks:
            moe_cuda.MAX_BLOCKS = n
            print(f"=== {n} blocks a rank", flush=True)
            worst = max(worst, main(["bench", "moe", *bench_args, "--out", str(out / f"blocks-{n}")]) or 0)
    finally:
        moe_cuda.MAX_BLOCKS = saved
    return worst


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    mine, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", required=True, help="blocks per rank, comma-separated (each at least 1)")
    p.add_argument("--out", default="bench-results/moe-grid")
    args = p.parse_args(mine)
    try:
        args.blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        p.error(f"--blocks: integers separated by commas, not {args.blocks!r}")
    if min(args.blocks) < 1:
        p.error("--blocks: each at least 1")
    if any(w == "--out" or w.startswith("--out=") for w in rest):
        p.error("give --out before '--': each run writes OUT/blocks-N")
    return args, rest


if __name__ == "__main__":
    a, bench_args = parse(sys.argv[1:])
    sys.exit(run(a.blocks, bench_args, Path(a.out)))
