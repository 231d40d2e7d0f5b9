"""``purlin-sglang bench offline``: SGLang's offline throughput benchmark with the purlin plugin loaded.

SGLang's ``python -m sglang.benchmark.offline_throughput`` (sglang 0.5.23) parses its flags
before any plugin loads and has no ``--config``, so it knows neither ``--comm-backend`` nor a
YAML file. Each run here is a child process of this module (``python -m
purlin_sglang.bench.offline MODULE ARGS``) that loads SGLang's plugins first, expands
``--config FILE.yaml`` into flags the way ``sglang serve`` does (the command line beats the
file), then calls the benchmark's own ``cli_main()``. ``--compare nccl,purlin`` runs one child
per backend, in turn, on the same prompts and seed, then prints a side-by-side table and
writes ``offline.json`` (every raw result line, the table) and ``offline.png`` to ``--out``.

Nothing is downloaded: prompts come from a local ShareGPT-format JSON file (``--dataset-path``)
or are generated with ``--seed`` into ``--out``; SGLang reads that file for the ``random``,
``sharegpt`` and warm-up requests. Children get ``HF_HUB_OFFLINE=1`` unless it is set.
A real run needs a CUDA GPU and a full GPU build of sglang; ``--dry-run`` needs neither.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import importlib
import importlib.util
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..errors import PurlinValueError
from .args import positive_float

BENCH_MODULE = "sglang.benchmark.offline_throughput"
BACKENDS = ("nccl", "purlin")  # the plugin's --comm-backend choices (purlin_sglang.sglang.plugin)
DATASET_NAMES = ("random", "sharegpt", "generated-shared-prefix")
# Bench flags this command always passes, resolved as: command line > --config file > these.
BENCH_DEFAULTS = {"dataset_name": "random", "num_prompts": 200, "random_input_len": 256,
                  "random_output_len": 64, "seed": 42}
SERVER_FLAGS = ("model_path", "tp_size", "load_format", "purlin_config")  # passed only when given
# Flags owned by this command: given after --, they would contradict what it records.
OWNED = {f"--{k.replace('_', '-')}" for k in (*BENCH_DEFAULTS, *SERVER_FLAGS)} | {
    "--dataset-path", "--comm-backend", "--config", "--result-filename", "--tensor-parallel-size",
    "--purlin-nccl-free"}
NCCL_FREE_FLAG = "--purlin-nccl-free"  # the plugin's NCCL-free mode (purlin_sglang/sglang/single_gpu.py)
# The keys of one result line of SGLang's benchmark (written with --result-filename).
RESULT_KEYS = ("backend", "successful_requests", "total_latency", "total_input_tokens",
               "total_output_tokens", "request_throughput", "input_throughput", "output_throughput",
               "total_throughput")
# (key, label, unit, which way is better) rows of the comparison table.
METRICS = (
    ("request_throughput", "request throughput", "req/s", "higher"),
    ("input_throughput", "input token throughput", "tok/s", "higher"),
    ("output_throughput", "output token throughput", "tok/s", "higher"),
    ("total_throughput", "total token throughput", "tok/s", "higher"),
    ("total_latency", "latency, whole run", "s", "lower"),
    ("successful_requests", "successful requests", "", None),
    ("total_input_tokens", "input tokens", "", None),
    ("total_output_tokens", "output tokens", "", None),
)
# Words of the locally generated prompts (examples/make_tiny_model.py trains its tokenizer on them).
WORDS = tuple("""
the a an of to in on at by for with from into over under after before between through during
model token prompt request batch layer tensor kernel stream graph device memory cache buffer
rank group peer chunk slot flag epoch signal stage notify consume reduce gather scatter copy
server client engine worker scheduler process thread queue channel link switch fabric node
fast slow small large short long early late first last next other same every each many few
read write send receive wait check count measure compare choose route fall back keep drop
river mountain forest garden window kitchen letter market harbor island valley bridge station
morning evening winter summer number question answer story reason method result example pattern
quiet bright simple careful gentle sudden steady narrow distant common ancient modern hidden
one two three four five six seven eight nine ten hundred thousand
""".split())


class OfflineError(RuntimeError):
    """A problem that stops ``bench offline``; the message names the option or the step."""


# -- the dataset: ShareGPT format, made locally ---------------------------------------------------
def write_dataset(path: Path, conversations: int, seed: int) -> dict[str, Any]:
    """Write ``conversations`` two-turn ShareGPT-format conversations of random WORDS to ``path``.

    Deterministic in ``seed`` (same file, same bytes). Returns the dataset's description.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(conversations):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(48, 384)))
        reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 256)))
        rows.append({"id": f"purlin-local-{i}",
                     "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=0))
    return describe_dataset(path, generated=True, seed=seed)


def describe_dataset(path: Path, generated: bool = False, seed: Optional[int] = None) -> dict[str, Any]:
    """Check that ``path`` is a ShareGPT-format JSON list SGLang can read without downloading anything."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise OfflineError(f"bench offline: --dataset-path {path} not found; omit it to generate prompts "
                           "locally") from None
    except (OSError, ValueError) as e:
        raise OfflineError(f"bench offline: --dataset-path {path} is not valid JSON ({e}); SGLang would "
                           "download ShareGPT instead: give a local ShareGPT-format file, or omit it") from None
    turns = [len(d.get("conversations", d.get("conversation", []))) for d in data if isinstance(d, dict)] \
        if isinstance(data, list) else []
    usable = sum(1 for t in turns if t >= 2)
    if not usable:
        raise OfflineError(f"bench offline: --dataset-path {path} has no conversation of 2 or more turns "
                           "(ShareGPT format: a list of {\"conversations\": [{\"from\", \"value\"}, ...]})")
    return {"path": str(path), "generated": generated, "seed": seed, "conversations": usable,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


# -- options ---------------------------------------------------------------------------------------
def _backends_arg(text: str) -> list[str]:
    vals = [t.strip() for t in text.split(",") if t.strip()]
    bad = [v for v in vals if v not in BACKENDS]
    if not vals or bad or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"bad --compare {text!r}: use distinct names from {list(BACKENDS)}, "
                                         "e.g. nccl,purlin")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``bench offline``; SGLang flags it does not know go after ``--``."""
    a = p.add_argument
    a("--compare", type=_backends_arg, default=None, metavar="B1,B2",
      help="run each --comm-backend in turn (separate processes, same prompts and seed), e.g. nccl,purlin")
    a("--comm-backend", choices=BACKENDS, default=None,
      help="one run with this backend (default: comm-backend of --config, else nccl); not with --compare")
    a("--config", metavar="FILE.yaml", help="SGLang config file (keys are flags without the dashes, e.g. "
      "configs/purlin-sglang.yaml); honoured as 'sglang serve' does: the command line beats the file")
    a("--purlin-config", metavar="PATH", help="purlin YAML for --comm-backend purlin (e.g. configs/purlin.yaml)")
    a("--model-path", help="the model directory (e.g. one made by examples/make_tiny_model.py)")
    a("--tp-size", "--tp", dest="tp_size", type=int, help="tensor-parallel size (GPUs)")
    a("--load-format", help="SGLang's --load-format, e.g. dummy (random weights, nothing read)")
    a("--nccl-free", action="store_true", default=None,
      help="every run with the plugin's --purlin-nccl-free (TP ranks may share a GPU; gloo device groups): "
           "the nccl run is then SGLang's own collectives on gloo, the reference for purlin; the GPU-count "
           "check asks for one GPU only (also purlin-nccl-free: true in --config)")
    a("--dataset-name", choices=DATASET_NAMES, help=f"default {BENCH_DEFAULTS['dataset_name']}")
    a("--dataset-path", help="a local ShareGPT-format JSON file (default: generate one in --out from --seed)")
    a("--num-prompts", type=int, help=f"default {BENCH_DEFAULTS['num_prompts']}")
    a("--random-input-len", type=int, help=f"default {BENCH_DEFAULTS['random_input_len']}")
    a("--random-output-len", type=int, help=f"default {BENCH_DEFAULTS['random_output_len']}")
    a("--seed", type=int, help=f"prompt generation and sampling seed (default {BENCH_DEFAULTS['seed']})")
    a("--out", help="results directory (default ./bench-results/offline-<timestamp>)")
    a("--timeout", type=positive_float, default=3600.0, help="seconds one run may take before it is stopped")
    a("--dry-run", action="store_true", help="write the dataset and print each run's command; run nothing")
    a("--benchmark-module", default=BENCH_MODULE,
      help="module whose cli_main() is the benchmark (default SGLang's); another one skips the sglang and "
           "GPU checks (the tests pass a fake)")
    a("sglang_args", nargs="*", metavar="-- SGLANG_ARG",
      help="after --: further flags for SGLang's benchmark, passed through (e.g. -- --mem-fraction-static 0.5)")


@dataclass
class Plan:
    """A resolved ``bench offline`` invocation: what every child runs with."""

    backends: list[str]
    bench: dict[str, Any]
    server: dict[str, Any]
    config: Optional[str]
    config_values: dict[str, Any]
    dataset_path: Optional[str]
    out: Path
    module: str
    passthrough: list[str] = field(default_factory=list)
    timeout: float = 3600.0
    tp: int = 1  # the tensor-parallel size, from the command line or --config (for the GPU count check)
    nccl_free: bool = False  # --purlin-nccl-free for every run (ranks may share a GPU)


def read_sglang_config(path: Optional[str]) -> dict[str, Any]:
    """The --config YAML as {underscored key: value}; raises OfflineError naming the file."""
    if path is None:
        return {}
    p = Path(path)
    if p.suffix.lower() not in (".yaml", ".yml") or not p.is_file():
        raise OfflineError(f"bench offline: --config {path}: need an existing .yaml/.yml file")
    import yaml

    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise OfflineError(f"bench offline: --config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise OfflineError(f"bench offline: --config {path} must hold a mapping of flag: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def resolve(args: argparse.Namespace) -> Plan:
    """Apply command line > --config file > defaults; raises OfflineError naming the option."""
    cfg = read_sglang_config(args.config)
    passthrough = list(args.sglang_args or [])
    if passthrough[:1] == ["--"]:
        passthrough = passthrough[1:]
    clash = sorted({t.split("=", 1)[0] for t in passthrough} & OWNED)
    if clash:
        raise OfflineError(f"bench offline: {', '.join(clash)} after -- would override what this command "
                           "sets; give them as options of bench offline, before --")
    if args.compare and args.comm_backend:
        raise OfflineError("bench offline: give --compare or --comm-backend, not both")
    backends = args.compare or [args.comm_backend or cfg.get("comm_backend") or "nccl"]
    if backends[0] not in BACKENDS:
        raise OfflineError(f"bench offline: comm-backend {backends[0]!r} in {args.config} is not one of "
                           f"{list(BACKENDS)}")
    bench = {k: getattr(args, k) if getattr(args, k) is not None else cfg.get(k, d)
             for k, d in BENCH_DEFAULTS.items()}
    if bench["dataset_name"] not in DATASET_NAMES:
        raise OfflineError(f"bench offline: dataset-name {bench['dataset_name']!r} is not one of "
                           f"{list(DATASET_NAMES)} (the ones that read a local file)")
    for k in ("num_prompts", "random_input_len", "random_output_len"):
        if not isinstance(bench[k], int) or bench[k] < 1:
            raise OfflineError(f"bench offline: --{k.replace('_', '-')} must be a positive integer, "
                               f"got {bench[k]!r}")
    server = {k: getattr(args, k) for k in SERVER_FLAGS if getattr(args, k) is not None}
    if "model_path" not in server and "model_path" not in cfg:
        raise OfflineError("bench offline: no model: give --model-path DIR (examples/make_tiny_model.py makes "
                           "a tiny one) or model-path in --config")
    tp = next((v for v in (server.get("tp_size"), cfg.get("tp_size"), cfg.get("tensor_parallel_size"))
               if v is not None), 1)
    if not str(tp).isdigit() or int(tp) < 1:
        raise OfflineError(f"bench offline: tp-size must be a positive integer, got {tp!r}")
    out = Path(args.out) if args.out else Path("bench-results") / _dt.datetime.now().strftime("offline-%Y%m%d-%H%M%S")
    dataset = args.dataset_path if args.dataset_path is not None else cfg.get("dataset_path")
    nccl_free = bool(args.nccl_free if args.nccl_free is not None else cfg.get("purlin_nccl_free", False))
    return Plan(backends, bench, server, args.config, cfg, dataset, out, args.benchmark_module, passthrough,
                args.timeout, int(tp), nccl_free)


def child_command(plan: Plan, backend: str, dataset_path: str, result_path: str) -> list[str]:
    """The command line of one run: our child entry point, the benchmark module, SGLang's flags."""
    cmd = [sys.executable, "-m", "purlin_sglang.bench.offline", plan.module]
    if plan.config:
        cmd += ["--config", os.path.abspath(plan.config)]
    for k in SERVER_FLAGS:
        if k in plan.server:
            cmd += [f"--{k.replace('_', '-')}", str(plan.server[k])]
    if plan.nccl_free:
        cmd.append(NCCL_FREE_FLAG)
    cmd += plan.passthrough
    for k in BENCH_DEFAULTS:
        cmd += [f"--{k.replace('_', '-')}", str(plan.bench[k])]
    return cmd + ["--dataset-path", dataset_path, "--comm-backend", backend, "--result-filename", result_path]


def preflight(plan: Plan) -> Optional[str]:
    """Why SGLang's benchmark cannot run here (None: it can, or another --benchmark-module is used)."""
    if plan.module != BENCH_MODULE:
        return None
    if importlib.util.find_spec("sglang") is None:
        return (f"bench offline: sglang is not installed in this Python ({sys.executable}); install "
                "sglang==0.5.23 WITH its GPU kernel packages (pip install 'purlin-sglang[sglang]') on a GPU "
                "machine. tools/install-sglang-cpu.sh installs it without them: enough for the plugin's "
                "tests and for --dry-run, not for serving")
    import torch

    if not torch.cuda.is_available():
        return ("bench offline: SGLang's offline benchmark serves the model and needs a CUDA GPU; torch sees "
                "none here (--dry-run still shows what would run)")
    tp, n = plan.tp, torch.cuda.device_count()
    if plan.nccl_free and n < 1:
        return f"bench offline: --nccl-free needs one GPU for its {tp} ranks; torch sees {n}"
    if tp > n and not plan.nccl_free:
        return (f"bench offline: --tp-size {tp} needs {tp} GPUs; torch sees {n} (--nccl-free runs several ranks "
                "on one GPU, without NCCL)")
    return None


# -- running the children --------------------------------------------------------------------------
def _tail(path: Path, lines: int = 30) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _stop(proc: subprocess.Popen) -> None:
    """End the child and whatever it started and left (its own process group: SGLang's workers)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # (unreaped zombies also count: this wait is bounded)
            proc.poll()
            os.killpg(proc.pid, 0)
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.poll()


def run_child(cmd: list[str], log_path: Path, label: str, timeout: float, every: float = 30.0):
    """Run one child with its output in ``log_path``; print progress; return (exit code or None, seconds)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while True:
                left = timeout - (time.monotonic() - t0)
                if left <= 0:
                    _stop(proc)
                    return None, time.monotonic() - t0
                try:
                    rc = proc.wait(timeout=min(every, left))
                    _stop(proc)  # workers it left behind would hold GPUs the next run needs
                    return rc, time.monotonic() - t0
                except subprocess.TimeoutExpired:
                    last = (_tail(log_path, 1) or [""])[0][:100]
                    print(f"    {label}: running, {time.monotonic() - t0:.0f} s elapsed; log: {last}", flush=True)
        except BaseException:
            _stop(proc)
            raise


def parse_result_lines(text: str) -> list[dict[str, Any]]:
    """The JSON lines of a --result-filename file; raises ValueError naming a bad line or missing keys."""
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"result line {i} is not JSON: {e}") from None
        if not isinstance(row, dict):
            raise ValueError(f"result line {i} is not a JSON object")
        missing = [k for k in RESULT_KEYS if k not in row]
        if missing:
            raise ValueError(f"result line {i} lacks {missing} (not SGLang's offline benchmark format?)")
        rows.append(row)
    return rows


# -- the comparison ---------------------------------------------------------------------------------
def compare_table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per metric: the value of each backend and, with both, the ratio purlin / nccl."""
    rows = []
    for key, label, unit, better in METRICS:
        vals = {b: r.get(key) for b, r in results.items()}
        n, p = vals.get("nccl"), vals.get("purlin")
        ratio = p / n if isinstance(n, (int, float)) and isinstance(p, (int, float)) and n else None
        rows.append({"metric": key, "label": label, "unit": unit, "better": better, "values": vals,
                     "ratio_purlin_over_nccl": ratio})
    return rows


def format_table(rows: list[dict[str, Any]], backends: list[str]) -> str:
    ratio = "nccl" in backends and "purlin" in backends
    head = f"{'metric':<26}{'unit':<7}" + "".join(f"{b:>14}" for b in backends) + \
        (f"{'purlin/nccl':>13}" if ratio else "")
    lines = [head]
    for r in rows:
        cells = "".join(f"{_num(r['values'].get(b)):>14}" for b in backends)
        rr = r["ratio_purlin_over_nccl"]
        extra = (f"{rr:>12.3f}" + {"higher": "+", "lower": "-", None: " "}[r["better"]]) if ratio and rr else ""
        lines.append(f"{r['label']:<26}{r['unit']:<7}{cells}{extra}")
    if ratio:
        lines.append("(ratio > 1 is better where marked +, < 1 where marked -)")
    return "\n".join(lines)


def _num(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1e6 else f"{v:.4g}"
    return "-" if v is None else str(v)


def legend_names(backends: list[str], nccl_free: bool) -> dict[str, str]:
    """What each backend name means on a chart: under --nccl-free, "nccl" is SGLang's own collectives on gloo."""
    return {b: ("nccl (SGLang's collectives on gloo)" if nccl_free and b == "nccl" else b) for b in backends}


def plot_compare(rows: list[dict[str, Any]], backends: list[str], path: Path, *,
                 names: Optional[dict[str, str]] = None, subtitle: str = "") -> Optional[str]:
    """Bar charts (throughputs, latency) to ``path``; returns a note instead when it cannot. ``names``:
    legend text per backend; ``subtitle``: a second title line (tp, order of the runs)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - any import failure means no chart
        return "install matplotlib for the chart (pip install 'purlin-sglang[bench]'); wrote the JSON only"
    by = {r["metric"]: r for r in rows}
    panels = [("tokens / s", ["input_throughput", "output_throughput", "total_throughput"]),
              ("requests / s", ["request_throughput"]), ("seconds (whole run)", ["total_latency"])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1, 1]})
    width = 0.8 / max(len(backends), 1)
    for ax, (ylabel, keys) in zip(axes, panels):
        for i, b in enumerate(backends):
            ys = [by[k]["values"].get(b) or 0 for k in keys]
            xs = [j + (i - (len(backends) - 1) / 2) * width for j in range(len(keys))]
            ax.bar(xs, ys, width, label=(names or {}).get(b, b), color=f"C{i}")
        ax.set_xticks(range(len(keys)), [by[k]["label"].replace(" throughput", "") for k in keys], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    fig.suptitle("SGLang offline throughput: " + " vs ".join(backends) + (f"\n{subtitle}" if subtitle else ""))
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except Exception as e:  # noqa: BLE001
        return f"chart {path.name} failed: {type(e).__name__}: {e}"
    finally:
        plt.close(fig)
    return None


def run(args: argparse.Namespace) -> int:
    """``bench offline``: exit 0 when every run gave a result, 1 when one failed, 2 when none could start."""
    try:
        plan = resolve(args)
        why = None if args.dry_run else preflight(plan)
        if why:
            raise OfflineError(why)
        plan.out.mkdir(parents=True, exist_ok=True)
        if plan.dataset_path is None:
            dataset = write_dataset(plan.out.resolve() / "dataset.json", max(plan.bench["num_prompts"], 16),
                                    plan.bench["seed"])
        else:
            dataset = describe_dataset(Path(plan.dataset_path).resolve())
    except OfflineError as e:  # nothing ran: the command line prints the message and exits 2
        raise PurlinValueError(str(e)) from e
    if plan.nccl_free:
        print("bench offline: --nccl-free: every run with --purlin-nccl-free; 'nccl' = SGLang's own collectives on "
              "gloo", flush=True)
    print(f"bench offline: {' then '.join(plan.backends)}; {plan.bench['num_prompts']} prompts "
          f"({plan.bench['dataset_name']}, seed {plan.bench['seed']}) from {dataset['path']}", flush=True)
    runs, results, failed = [], {}, None
    for i, backend in enumerate(plan.backends, 1):
        result_file, log = plan.out / f"result-{backend}.jsonl", plan.out / f"log-{backend}.txt"
        cmd = child_command(plan, backend, dataset["path"], str(result_file.resolve()))
        if args.dry_run:
            print(f"[{i}/{len(plan.backends)}] {backend}: {shlex.join(cmd)}")
            continue
        result_file.unlink(missing_ok=True)
        print(f"[{i}/{len(plan.backends)}] {backend}: starting (log: {log})", flush=True)
        rc, secs = run_child(cmd, log, backend, plan.timeout)
        entry: dict[str, Any] = {"backend": backend, "command": cmd, "log": str(log), "returncode": rc,
                                 "elapsed_s": round(secs, 3), "result_file": str(result_file)}
        runs.append(entry)
        problem = f"timed out after {plan.timeout:.0f} s" if rc is None else (f"exit code {rc}" if rc else None)
        if problem is None:
            try:
                lines = parse_result_lines(result_file.read_text()) if result_file.exists() else []
                entry["result_lines"] = lines
                problem = None if lines else f"exited 0 but wrote no result line to {result_file}"
            except ValueError as e:
                problem = f"{result_file}: {e}"
        if problem:
            failed = backend
            print(f"error: bench offline: the {backend} run failed ({problem}, {secs:.1f} s); the last lines "
                  f"of {log}:", file=sys.stderr)
            for line in _tail(log):
                print(f"    {line}", file=sys.stderr)
            entry["error"] = problem
            break
        results[backend] = entry["result"] = entry["result_lines"][-1]
        r = entry["result"]
        print(f"[{i}/{len(plan.backends)}] {backend}: done in {secs:.1f} s: {r['request_throughput']:.2f} req/s, "
              f"{r['output_throughput']:.1f} output tok/s", flush=True)
    if args.dry_run:
        print(f"dry run: wrote {dataset['path']}; ran nothing")
        return 0
    rows = compare_table(results)
    doc = {"command": "purlin-sglang bench offline", "environment": _environment(),
           "settings": {"backends": plan.backends, **plan.bench, "server": plan.server, "tp_size": plan.tp,
                        "nccl_free": plan.nccl_free,
                        "nccl_means": "SGLang's own collectives on gloo device groups (--purlin-nccl-free)"
                        if plan.nccl_free else "SGLang's own collectives (NCCL and its custom paths)",
                        "config_file": plan.config, "config": plan.config_values,
                        "sglang_args": plan.passthrough, "benchmark_module": plan.module},
           "dataset": dataset, "runs": runs, "table": rows, "failed": failed}
    (plan.out / "offline.json").write_text(json.dumps(doc, indent=2, default=str))
    note = None
    if results:
        print(format_table(rows, [b for b in plan.backends if b in results]))
        done = [b for b in plan.backends if b in results]
        note = plot_compare(rows, done, plan.out / "offline.png", names=legend_names(done, plan.nccl_free),
                            subtitle=f"TP={plan.tp}, run one after the other in this order: {', '.join(done)}")
    print(f"wrote {plan.out / 'offline.json'}" + ("" if note or not results else f" and {plan.out / 'offline.png'}"))
    if note:
        print(note)
    return 1 if failed else 0


def _environment() -> dict[str, Any]:
    import torch

    from .environment import environment

    return environment("cuda" if torch.cuda.is_available() else "cpu")


# -- the child: plugins first, then the benchmark's own main ---------------------------------------
def child_main(argv: list[str]) -> int:
    """``python -m purlin_sglang.bench.offline MODULE ARGS...``: one benchmark run in this process."""
    if not argv or argv[0].startswith("-"):
        print("usage: python -m purlin_sglang.bench.offline MODULE [SGLANG ARGS...] "
              f"(MODULE: {BENCH_MODULE})", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure is reported the same way
        print(f"bench offline: cannot import {name}: {type(e).__name__}: {e}. SGLang's benchmark needs the full "
              "sglang==0.5.23 install with its GPU kernel packages; tools/install-sglang-cpu.sh installs only "
              "what the plugin's tests need", file=sys.stderr)
        return 3
    try:
        from sglang.srt.plugins import load_plugins
    except ImportError as e:
        print(f"bench offline: cannot import SGLang's plugin loader ({e}); install sglang=="
              "0.5.23 in this Python", file=sys.stderr)
        return 3
    from ..sglang import plugin

    load_plugins()
    missing = plugin.missing_hooks([t for t, _, _ in plugin.HOOKS if t.startswith("sglang.srt.server_args.")])
    if missing:
        print(f"bench offline: the purlin_sglang plugin is not in effect in SGLang ({'; '.join(missing)}); "
              "install purlin_sglang in this Python, and if SGLANG_PLUGINS is set, include purlin_sglang in it",
              file=sys.stderr)
        return 3
    if "--config" in rest:
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        if hasattr(mod, "BenchArgs"):
            mod.BenchArgs.add_cli_args(parser)
        try:
            rest = ConfigArgumentMerger(parser).merge_config_with_args(rest)
        except (ValueError, OSError) as e:
            print(f"bench offline: --config: {e}", file=sys.stderr)
            return 2
    main = getattr(mod, "cli_main", None)
    if not callable(main):
        print(f"bench offline: {name} has no cli_main(); this command supports sglang=={plugin.SUPPORTED_SGLANG}",
              file=sys.stderr)
        return 3
    print(f"bench offline child: {name} {shlex.join(rest)}", flush=True)
    sys.argv = [name, *rest]
    main()
    return 0


if __name__ == "__main__":  # a child run; SGLang's spawned workers import this module as __mp_main__
    sys.exit(child_main(sys.argv[1:]))
