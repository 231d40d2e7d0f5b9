"""``purlin-sglang`` (also ``python -m purlin_sglang``): demo, info, tune and the benchmarks.

* ``demo``: runs every catalog collective on the best engine present for world
  sizes 2 to 8, checks each against a plain torch reference and prints a table;
  the exit code is 1 on any mismatch.
* ``info``: what this installation has (native build, GPU, engines and the communicators they can
  build here, NVSHMEM, SGLang) and which tuning table is in force (``--config PATH``: a purlin YAML
  config whose ``tuning.table`` is read).
* ``tune``: measure the algorithms' crossovers on this machine and write a tuning table
  (purlin_sglang/bench/tune.py).
* ``bench collectives | offline | moe``: the benchmarks (purlin_sglang/bench/).

Exit codes, every command: 0 done, and every result it checked was right; 1 a wrong result, a failed
run or measurement, or a run that ended with nothing checked or measured; 2 an argument, config or file
error, or a run this machine cannot do, refused before it starts (one line on stderr,
``purlin-sglang: error: ...``, and with --debug the traceback before it); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch

from . import __version__
from .bench.args import nonneg_int, positive_float, positive_int
from .bench.environment import dist_version
from .errors import PurlinError, PurlinUnavailableError, PurlinValueError

PROG = "purlin-sglang"


# -- demo cases: inputs and the expected results (purlin_sglang.reference) ----------------------
def _case_inputs(name: str, world: int, rows: int, cols: int, gen: torch.Generator):
    """Per-rank inputs and call arguments for one collective; sizes vary per rank for V forms."""
    def rnd(n: int) -> torch.Tensor:
        return torch.randn(n, cols, generator=gen)

    if name in ("all_reduce", "all_gather", "broadcast"):
        return [(rnd(rows), {}) for _ in range(world)]
    if name in ("reduce_scatter", "all_to_all"):
        return [(rnd(rows * world), {}) for _ in range(world)]
    if name == "all_gather_v":
        sizes = [int(torch.randint(0, 2 * rows + 1, (1,), generator=gen)) for _ in range(world)]
        return [(rnd(sizes[r]), {"sizes": sizes}) for r in range(world)]
    if name == "reduce_scatter_v":
        sizes = [int(torch.randint(0, 2 * rows + 1, (1,), generator=gen)) for _ in range(world)]
        return [(rnd(sum(sizes)), {"sizes": sizes}) for _ in range(world)]
    if name == "all_to_all_v":
        m = torch.randint(0, 2 * rows + 1, (world, world), generator=gen).tolist()
        return [(rnd(sum(m[r])), {"input_splits": m[r], "output_splits": [m[p][r] for p in range(world)]})
                for r in range(world)]
    raise KeyError(name)


def _reference(name: str, world: int, cases) -> list[torch.Tensor]:
    """What every rank must receive (torch.distributed semantics; sums in rank order, bitwise)."""
    from . import reference as R

    xs = [c[0] for c in cases]
    if name == "broadcast":
        return [R.broadcast(xs, r, 0) for r in range(world)]
    if name == "reduce_scatter_v":
        return [R.reduce_scatter_v(xs, r, cases[0][1]["sizes"]) for r in range(world)]
    if name == "all_to_all_v":
        return [R.all_to_all_v(xs, r, [c[1]["input_splits"] for c in cases]) for r in range(world)]
    return [getattr(R, name)(xs, r) for r in range(world)]


def _call(comm, name: str, x: torch.Tensor, kw: dict) -> torch.Tensor:
    if name == "broadcast":
        return comm.broadcast(x.clone() if comm.rank == 0 else torch.empty_like(x), root=0)
    return getattr(comm, name)(x, **kw)


def _progress(done: int, total: int, label: str) -> None:
    """A progress bar on stderr (one line per tenth when stderr is not a terminal)."""
    if not sys.stderr.isatty():
        if done == total or done % max(1, total // 10) == 0:
            sys.stderr.write(f"progress {done}/{total} {label}\n")
        return
    width = 30
    fill = width * done // max(total, 1)
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {label:<28}{end}")
    sys.stderr.flush()


def cmd_demo(args: argparse.Namespace) -> int:
    from . import run_virtual
    from .collectives import CATALOG

    if args.max_world < args.min_world:
        raise PurlinValueError(f"demo: need --min-world <= --max-world, got {args.min_world} > {args.max_world}")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise PurlinValueError(f"demo: --json {args.json}: its folder does not exist; create it or name another path")
    worlds = list(range(args.min_world, args.max_world + 1))
    names = list(CATALOG)
    from .engines import cuda_engine_status

    device, engine, tag = "cpu", "cpu (reference, virtual ranks)", "cpu"
    if torch.cuda.is_available():
        why = cuda_engine_status()
        if why:
            print(f"note: a GPU is present, but {why}; using the CPU engine", file=sys.stderr)
        else:
            device, engine, tag = "cuda", "cuda (loopback virtual ranks on one GPU)", "cuda"
    cols = max(1, args.bytes // (4 * args.rows))
    total, done, rows_out, bad = len(worlds) * len(names), 0, [], 0
    _progress(0, total, "")
    gen = torch.Generator().manual_seed(args.seed)
    for world in worlds:
        for name in names:
            cases = _case_inputs(name, world, args.rows, cols, gen)
            ref = _reference(name, world, cases)

            def fn(comm, name=name, cases=cases):
                x, kw = cases[comm.rank]
                x = x.to(comm.device)
                out = _call(comm, name, x, kw)
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    _call(comm, name, x, kw)
                    comm.synchronize()
                    times.append(time.perf_counter() - t0)
                return out.cpu(), times

            results = run_virtual(world, fn, device=device, config={"timeout_s": args.timeout})
            ok = all(torch.equal(results[r][0], ref[r]) for r in range(world))
            bad += not ok
            nbytes = sum(c[0].numel() * c[0].element_size() for c in cases) // world
            med = statistics.median(results[0][1])
            rows_out.append({"collective": name, "world": world, "bytes": nbytes, "engine": tag,
                             "correct": ok, "median_us": med * 1e6})
            done += 1
            _progress(done, total, f"{name} world={world}")
    print(f"purlin_sglang {__version__} demo: engine {engine}, float32, ~{args.bytes} bytes per rank, "
          f"median of {args.iters} calls")
    print(f"{'collective':<18}{'world':>6}{'bytes/rank':>12}{'engine':>8}{'correct':>9}{'median':>12}")
    for r in rows_out:
        print(f"{r['collective']:<18}{r['world']:>6}{r['bytes']:>12}{r['engine']:>8}"
              f"{'yes' if r['correct'] else 'NO':>9}{r['median_us']:>10.1f}us")
    if args.json:
        Path(args.json).write_text(json.dumps(rows_out, indent=2))
        print(f"wrote {args.json}")
    print(f"{len(rows_out) - bad} of {len(rows_out)} correct")
    return 1 if bad else 0


def _nvshmem() -> str:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return "not found (install the [cu12] or [cu13] extra)"
    for base in spec.submodule_search_locations:
        libs = sorted((Path(base) / "nvshmem" / "lib").glob("libnvshmem_host.so*"))
        if libs:
            ver = dist_version("nvidia-nvshmem-cu13") or dist_version("nvidia-nvshmem-cu12") or "?"
            return f"{ver} at {libs[0].parent}"
    return "not found (install the [cu12] or [cu13] extra)"


def _table_in_force(config_path: str | None, gpus: list[str]) -> str:
    """The tuning table a communicator of this config would use here, or the built-in thresholds."""
    from .config import PurlinConfig

    from .snac.table import THRESHOLDS, load_table, shipped_tables

    path = PurlinConfig.from_yaml(config_path).tuning.table if config_path else None
    if path == THRESHOLDS:
        return "none: built-in thresholds (tuning.packet_max_bytes, tuning.oneshot_max_bytes; tuning.table: thresholds)"
    paths = [path] if path is not None else shipped_tables()
    lines = []
    for p in paths:
        t = load_table(p)
        here = gpus[0] if t.engine == "cuda" and gpus else "cpu"
        applies = (f"in force for {t.placement} communicators" if t.device == here
                   else f"NOT applied here (this machine: {here})")
        lines.append(f"{'shipped ' if path is None else ''}{p}: device {t.device} ({t.engine} engine), placement "
                     f"{t.placement}, worlds {list(t.worlds)}, collectives {', '.join(t.collectives)}; {applies}")
    if not any("in force" in x for x in lines):
        lines.append("elsewhere: built-in thresholds (tuning.packet_max_bytes, tuning.oneshot_max_bytes)")
    return "; ".join(lines)


def _native_line(b: dict) -> str:
    if not b.get("built"):
        return f"NOT built: {b.get('reason')}"
    if b.get("cuda"):
        return f"built with CUDA for archs {','.join(b.get('archs') or [])} (nvcc {b.get('nvcc')})"
    return f"built without CUDA: {b.get('reason') or 'the build did not record why'}"


def _gpu_line() -> str:
    if torch.cuda.is_available():
        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        return ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})"
                         for i, (major, minor) in enumerate(caps))
    if torch.version.cuda is None:
        return f"none: torch {torch.__version__} is built without CUDA"
    return (f"none visible to torch (built for CUDA {torch.version.cuda}): no NVIDIA driver or GPU found, "
            "or CUDA_VISIBLE_DEVICES hides them")


def _communicators_line() -> str:
    """Per engine, the communicators it builds (run_virtual, process groups) and over which memory: ready or why not."""
    from .engines import communicators

    kinds = communicators()
    parts = []
    for engine in dict.fromkeys(k.engine for k in kinds):
        mine = [k for k in kinds if k.engine == engine]
        usable = not mine[0].engine_why
        modes = []
        for mode, label in (("virtual", "run_virtual"), ("group", "process groups")):
            mems = [k.memory + (f" (unavailable: {k.memory_why})" if k.memory_why else " (ready)" if usable else "")
                    for k in mine if k.mode == mode]
            modes.append(f"{label} over {', '.join(mems)}")
        head = engine if usable else f"{engine} (none here: the engine cannot run, see engines)"
        parts.append(f"{head}: {'; '.join(modes)}")
    return " | ".join(parts)


def cmd_info(args: argparse.Namespace) -> int:
    from . import native
    from .engines import cuda_engine_status
    from .memory import providers

    b = native.build_info()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    why = cuda_engine_status()
    info: dict[str, Any] = {
        "purlin_sglang": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__ + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else " (without CUDA)"),
        "native library": _native_line(b),
        "GPU": _gpu_line(),
        "engines": "cpu (reference): ready; cuda: " + (why.replace("the CUDA engine cannot run: ", "cannot run here: ")
                                                       if why else "ready"),
        "communicators": _communicators_line(),
        "memory providers": providers.describe(),
        "NVSHMEM": _nvshmem(),
        "sglang": dist_version("sglang") or "not installed (install the [sglang] extra)",
        "tuning table": _table_in_force(args.config, gpus),
    }
    if args.json:
        print(json.dumps({**info, "native_build_info": b}, indent=2))
    else:
        for k, v in info.items():
            print(f"{k + ':':<28}{v}")
    return 0


def _add_bench(sub: Any, common: argparse.ArgumentParser) -> None:
    """``bench <what>``: benchmarks (purlin_sglang/bench/): ``bench collectives``, ``bench offline``, ``bench moe``."""
    from .bench import collectives as bench_collectives

    b = sub.add_parser("bench", parents=[common],
                       help="benchmarks: 'bench collectives' times every collective against baselines; "
                       "'bench offline' runs SGLang's offline throughput benchmark per --comm-backend")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    c = bsub.add_parser("collectives", parents=[common],
                        help="time every catalog collective (and NCCL / symm-mem / SGLang baselines)",
                        description=bench_collectives.__doc__.split("\n\n")[0])
    bench_collectives.add_arguments(c)
    c.set_defaults(fn=bench_collectives.run)
    from .bench import offline as bench_offline

    o = bsub.add_parser("offline", parents=[common], help="SGLang's offline throughput benchmark with the purlin "
                        "plugin; --compare nccl,purlin", description=bench_offline.__doc__.split("\n\n")[0])
    bench_offline.add_arguments(o)
    o.set_defaults(fn=bench_offline.run)
    from .bench import moe as bench_moe

    m = bsub.add_parser("moe", parents=[common],
                        help="time MoE dispatch / combine (and a torch reference) on virtual ranks",
                        description=bench_moe.__doc__.split("\n\n")[0])
    bench_moe.add_arguments(m)
    m.set_defaults(fn=bench_moe.run)
    _named_choices(bsub)


class _Parser(argparse.ArgumentParser):
    """argparse that raises its errors (PurlinValueError) instead of printing usage and exiting: ``main``
    prints them as one line and exits 2, as it does every other argument or config error."""

    def error(self, message: str) -> NoReturn:
        command = self.prog[len(PROG):].strip()
        raise PurlinValueError(f"{command + ': ' if command else ''}{message} (see '{self.prog} --help')")


def parser() -> argparse.ArgumentParser:
    """The command line of ``purlin-sglang``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, print its traceback too (the error line alone otherwise)")
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[-1].replace("``", "'"),
                parents=[common])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", parents=[common], help="run every collective, check against torch, print a table")
    d.add_argument("--min-world", type=positive_int, default=2)
    d.add_argument("--max-world", type=positive_int, default=8)
    d.add_argument("--bytes", type=positive_int, default=64 * 1024, help="approximate payload bytes per rank")
    d.add_argument("--rows", type=positive_int, default=64, help="rows of dim 0 per rank")
    d.add_argument("--iters", type=positive_int, default=5, help="timed calls per collective")
    d.add_argument("--seed", type=nonneg_int, default=0)
    d.add_argument("--timeout", type=positive_float, default=60.0, help="timeout_s of each communicator")
    d.add_argument("--json", help="also write the table as JSON to this path")
    d.set_defaults(fn=cmd_demo)
    i = sub.add_parser("info", parents=[common], help="print what this installation has")
    i.add_argument("--json", action="store_true")
    i.add_argument("--config", default=None, help="a purlin YAML config: show the tuning table it names")
    i.set_defaults(fn=cmd_info)
    from .bench import tune

    t = sub.add_parser("tune", parents=[common], help="measure the algorithms' crossovers here and write a tuning "
                       "table (JSON)", description=tune.__doc__.split("\n\n")[0])
    tune.add_arguments(t)
    t.set_defaults(fn=tune.run)
    _add_bench(sub, common)
    _named_choices(sub)
    return p


def _named_choices(sub: Any) -> None:
    """Subcommands named by their choices in argparse's messages ("required: {demo,info,...}"), not by dest."""
    sub.metavar = "{" + ",".join(sub.choices) + "}"


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit code (module docstring). An argument, config, file or machine
    error prints one line, ``purlin-sglang: error: ...`` (with ``--debug``, after the traceback), and
    returns 2; a PurlinError during a run (a timeout, a mismatch) the same way, returning 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[:argv.index("--")] if "--" in argv else argv  # what follows -- belongs to another program
    debug = "--debug" in own
    try:
        args, extra = parser().parse_known_args(argv)
        if extra:  # named with the command they were given to (argparse names the top level)
            command = " ".join(c for c in (args.cmd, getattr(args, "bench_cmd", None)) if c)
            raise PurlinValueError(f"{command}: unrecognized arguments: {' '.join(extra)} "
                                   f"(see '{PROG} {command} --help')")
        args.argv = argv
        return args.fn(args)
    except (PurlinValueError, PurlinUnavailableError, OSError) as e:
        return _fail(e, 2, debug)
    except PurlinError as e:
        return _fail(e, 1, debug)
    except KeyboardInterrupt as e:
        return _fail(e, 130, debug, "interrupted")


def _fail(e: BaseException, code: int, debug: bool, text: str | None = None) -> int:
    """Print ``e`` as one line on stderr (its traceback first with ``--debug``); return ``code``."""
    if debug:
        traceback.print_exception(e)
    msg = " ".join(line.strip() for line in (text or str(e) or type(e).__name__).splitlines() if line.strip())
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
