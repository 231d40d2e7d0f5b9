"""``bench offline`` on a CPU machine: options and the command line of each run (``--config`` honoured,
the command line beating the file), the locally generated prompts in SGLang 0.5.23's own dataset
loaders, the flags and result keys checked against the installed benchmark's source, result-line
parsing, table / JSON / PNG, the start-up errors, and ``--compare`` end to end through child
processes that run a FAKE benchmark (tests/bench/_fake_offline_throughput.py: made-up numbers).
Nothing here serves a model: that needs a GPU build of sglang."""

import argparse
import ast
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from purlin_sglang import cli
from purlin_sglang.bench import offline

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
FAKE = "_fake_offline_throughput"  # the FAKE benchmark module in this folder
HAS_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(not HAS_SGLANG, reason="needs sglang (tools/install-sglang-cpu.sh)")


def parse(argv):
    p = argparse.ArgumentParser()
    offline.add_arguments(p)
    return p.parse_args(argv)


def write_yaml(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def loaded():
    pytest.importorskip("sglang.srt.server_args")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True


def sglang_source(rel: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    return Path(list(spec.submodule_search_locations)[0]) / rel


# -- options and command lines --------------------------------------------------------------------
def test_cli_dry_run_writes_dataset_and_prints_both_runs(tmp_path, capsys):
    rc = cli.main(["bench", "offline", "--compare", "nccl,purlin", "--model-path", "m", "--num-prompts", "5",
                   "--out", str(tmp_path), "--dry-run", "--", "--mem-fraction-static", "0.5"])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [line for line in out.splitlines() if line.startswith("[")]
    assert len(lines) == 2 and "--comm-backend nccl" in lines[0] and "--comm-backend purlin" in lines[1]
    assert all("--mem-fraction-static 0.5" in line and "-m purlin_sglang.bench.offline" in line for line in lines)
    data = json.loads((tmp_path / "dataset.json").read_text())
    assert len(data) == 16  # at least the 16 warm-up requests of SGLang's benchmark
    assert not list(tmp_path.glob("result-*")) and not (tmp_path / "offline.json").exists()


def test_command_line_of_each_backend(tmp_path):
    cfg = write_yaml(tmp_path / "s.yaml", "comm-backend: purlin\nnum-prompts: 30\nseed: 7\ntp-size: 4\n"
                                          "model-path: /models/x\n")
    plan = offline.resolve(parse(["--config", cfg, "--seed", "9", "--load-format", "dummy",
                                  "--", "--mem-fraction-static", "0.5"]))
    assert plan.backends == ["purlin"]  # from the file
    assert plan.bench == {"dataset_name": "random", "num_prompts": 30, "random_input_len": 256,
                          "random_output_len": 64, "seed": 9}  # file beats defaults, command line beats file
    assert plan.tp == 4 and plan.server == {"load_format": "dummy"}
    cmd = offline.child_command(plan, "nccl", "/d.json", "/r.jsonl")
    assert cmd[:4] == [sys.executable, "-m", "purlin_sglang.bench.offline", offline.BENCH_MODULE]
    assert cmd[4:6] == ["--config", os.path.abspath(cfg)]  # first: SGLang's merger puts the file's flags first
    assert cmd[-6:] == ["--dataset-path", "/d.json", "--comm-backend", "nccl", "--result-filename", "/r.jsonl"]
    assert cmd[cmd.index("--seed") + 1] == "9" and cmd[cmd.index("--load-format") + 1] == "dummy"
    assert cmd.index("--mem-fraction-static") < cmd.index("--dataset-name")
    assert "--model-path" not in cmd  # left to the file
    compare = offline.resolve(parse(["--config", cfg, "--compare", "purlin,nccl"]))
    assert compare.backends == ["purlin", "nccl"]


@needs_sglang
def test_child_flags_merge_in_sglang_with_cli_beating_file(loaded, tmp_path):
    """The child's argv, merged by SGLang's own ConfigArgumentMerger and parsed by its parser."""
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    from purlin_sglang.sglang import plugin

    fake = importlib.import_module(FAKE)
    cfg = write_yaml(tmp_path / "s.yaml", "comm-backend: purlin\npurlin-config: %s\ntp-size: 4\n"
                                          "load-format: dummy\nnum-prompts: 30\n" % (ROOT / "configs/purlin.yaml"))
    plan = offline.resolve(parse(["--config", cfg, "--compare", "nccl,purlin", "--tp-size", "2",
                                  "--model-path", "/m"]))
    for backend in plan.backends:
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        fake.BenchArgs.add_cli_args(parser)
        argv = ConfigArgumentMerger(parser).merge_config_with_args(
            offline.child_command(plan, backend, "/d.json", "/r.jsonl")[4:])
        args = parser.parse_args(argv)
        sa = ServerArgs.from_cli_args(args)
        assert plugin.settings_of(sa).backend == backend  # --compare beats the file's comm-backend
        assert (sa.tp_size, sa.load_format, sa.model_path, args.num_prompts) == (2, "dummy", "/m", 30)


@pytest.mark.parametrize("argv, match", [
    (["--compare", "nccl,purlin", "--comm-backend", "nccl", "--model-path", "m"], "not both"),
    (["--model-path", "m", "--", "--num-prompts", "3"], "--num-prompts after --"),
    (["--model-path", "m", "--", "--result-filename=x"], "--result-filename after --"),
    (["--model-path", "m", "--", "--tensor-parallel-size", "2"], "--tensor-parallel-size after --"),
    ([], "no model"),
    (["--model-path", "m", "--num-prompts", "0"], "--num-prompts must be a positive"),
    (["--model-path", "m", "--tp-size", "0"], "tp-size must be a positive"),
])
def test_bad_options_are_named(argv, match):
    with pytest.raises(offline.OfflineError, match=match):
        offline.resolve(parse(argv))


@pytest.mark.parametrize("text, match", [
    ("- a\n- b\n", "must hold a mapping"),
    ("comm-backend: gloo\nmodel-path: m\n", "'gloo'"),
    ("dataset-name: mmmu\nmodel-path: m\n", "'mmmu'"),
    ("tp-size: two\nmodel-path: m\n", "tp-size"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_config_files_are_named(tmp_path, text, match):
    cfg = write_yaml(tmp_path / "s.yaml", text)
    with pytest.raises(offline.OfflineError, match=match):
        offline.resolve(parse(["--config", cfg]))
    with pytest.raises(offline.OfflineError, match="existing .yaml"):
        offline.resolve(parse(["--config", str(tmp_path / "missing.yaml"), "--model-path", "m"]))


@pytest.mark.parametrize("value", ["nccl,foo", "nccl,nccl", ","])
def test_bad_compare_lists_are_rejected(value, capsys):
    with pytest.raises(SystemExit):
        parse(["--compare", value])
    assert "bad --compare" in capsys.readouterr().err


# -- the dataset -------------------------------------------------------------------------------------
def test_dataset_is_deterministic_and_checked(tmp_path):
    a = offline.write_dataset(tmp_path / "a.json", 20, seed=3)
    b = offline.write_dataset(tmp_path / "b.json", 20, seed=3)
    c = offline.write_dataset(tmp_path / "c.json", 20, seed=4)
    assert a["sha256"] == b["sha256"] != c["sha256"] and a["conversations"] == 20
    row = json.loads((tmp_path / "a.json").read_text())[0]
    assert [t["from"] for t in row["conversations"]] == ["human", "gpt"]
    assert set(row["conversations"][0]["value"].split()) <= set(offline.WORDS)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty.json").write_text("[]")
    for name, match in (("missing.json", "not found"), ("bad.json", "not valid JSON"),
                        ("empty.json", "no conversation")):
        with pytest.raises(offline.OfflineError, match=match):
            offline.describe_dataset(tmp_path / name)


def _sglang_dataset_module(name: str, monkeypatch):
    """sglang.benchmark.datasets.<name>, real code. The package's __init__ imports every dataset
    module, some of which need the 'datasets' package that the CPU install lacks: without it, the
    package is stood in for by an empty one on the same folder, so only <name> and its imports load."""
    full = f"sglang.benchmark.datasets.{name}"
    try:
        return importlib.import_module(full)
    except ImportError:
        pass
    pkg = types.ModuleType("sglang.benchmark.datasets")
    pkg.__path__ = [str(sglang_source("benchmark/datasets"))]
    monkeypatch.setitem(sys.modules, "sglang.benchmark.datasets", pkg)
    monkeypatch.delitem(sys.modules, full, raising=False)
    return importlib.import_module(full)


@needs_sglang
def test_generated_dataset_is_read_by_sglang_loaders_without_downloading(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    import numpy as np
    import random
    from transformers import AutoTokenizer

    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
    make_tiny_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_tiny_model)
    make_tiny_model.write_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    path = tmp_path / "dataset.json"
    offline.write_dataset(path, 16, seed=42)
    rnd = _sglang_dataset_module("random", monkeypatch)
    share = _sglang_dataset_module("sharegpt", monkeypatch)

    def no_download(*a, **k):
        raise AssertionError("SGLang tried to download a dataset")

    monkeypatch.setattr(rnd, "download_and_cache_hf_file", no_download)
    monkeypatch.setattr(share, "download_and_cache_hf_file", no_download)
    random.seed(42)
    np.random.seed(42)
    # the offline benchmark's warm-up call (256 input, 16 output tokens, range ratio 1) on our file
    rows = rnd.sample_random_requests(input_len=256, output_len=16, num_prompts=16, range_ratio=1.0,
                                      tokenizer=tok, dataset_path=str(path))
    assert len(rows) == 16
    assert all(isinstance(r.prompt, str) and r.prompt and r.output_len == 16 for r in rows)
    assert {r.prompt_len for r in rows} == {256 - tok.num_special_tokens_to_add()}
    rows = share.sample_sharegpt_requests(dataset_path=str(path), num_requests=10, tokenizer=tok)
    assert len(rows) == 10 and all(r.prompt_len >= 48 and r.output_len >= 16 for r in rows)


@needs_sglang
def test_flags_and_result_keys_match_sglang_benchmark_source():
    """Read the installed offline_throughput.py (it cannot be imported without SGLang's GPU stack)."""
    src = sglang_source("benchmark/offline_throughput.py")
    tree = ast.parse(src.read_text())
    flags, choices, keys, funcs = set(), {}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
            flags.update(names)
            for kw in node.keywords:
                if kw.arg == "choices" and isinstance(kw.value, ast.List):
                    choices[names[0]] = {e.value for e in kw.value.elts}
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                getattr(node.targets[0], "id", "") == "measurement_results":
            keys.update(k.value for k in node.value.keys)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            funcs.add(node.name)
    passed = {f"--{k.replace('_', '-')}" for k in offline.BENCH_DEFAULTS} | {"--dataset-path", "--result-filename"}
    assert passed <= flags
    assert set(offline.DATASET_NAMES) <= choices["--dataset-name"]
    assert set(offline.RESULT_KEYS) <= keys
    assert {"cli_main", "BenchArgs"} <= funcs
    fake = argparse.ArgumentParser()
    importlib.import_module(FAKE).BenchArgs.add_cli_args(fake)
    assert {o for a in fake._actions for o in a.option_strings if o.startswith("--")} - {"--help"} <= flags


@needs_sglang
def test_server_flags_exist_in_sglang_parser(loaded):
    from sglang.srt.server_args import ServerArgs

    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    wanted = {f"--{k.replace('_', '-')}" for k in offline.SERVER_FLAGS} | {"--comm-backend", "--config",
                                                                          "--tensor-parallel-size"}
    assert wanted <= set(p._option_string_actions)


# -- result lines, table, JSON, chart ----------------------------------------------------------------
def _line(backend_latency: float, n: int = 10, **extra) -> dict:
    t = backend_latency
    return {"backend": "engine", "successful_requests": n, "total_latency": t, "total_input_tokens": 100 * n,
            "total_output_tokens": 10 * n, "request_throughput": n / t, "input_throughput": 100 * n / t,
            "output_throughput": 10 * n / t, "total_throughput": 110 * n / t, "last_gen_throughput": 1.0, **extra}


def test_result_lines_are_parsed_and_checked():
    text = json.dumps(_line(2.0)) + "\n\n" + json.dumps(_line(1.0, extra_key=1)) + "\n"
    rows = offline.parse_result_lines(text)
    assert [r["total_latency"] for r in rows] == [2.0, 1.0] and rows[1]["extra_key"] == 1
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        offline.parse_result_lines(json.dumps(_line(1.0)) + "\n{oops\n")
    bad = _line(1.0)
    del bad["output_throughput"]
    with pytest.raises(ValueError, match="output_throughput"):
        offline.parse_result_lines(json.dumps(bad))


def test_table_ratio_and_chart(tmp_path):
    rows = offline.compare_table({"nccl": _line(2.0), "purlin": _line(1.6)})
    by = {r["metric"]: r for r in rows}
    assert by["request_throughput"]["ratio_purlin_over_nccl"] == pytest.approx(1.25)
    assert by["total_latency"]["ratio_purlin_over_nccl"] == pytest.approx(0.8)
    assert by["total_latency"]["better"] == "lower"
    text = offline.format_table(rows, ["nccl", "purlin"])
    assert "purlin/nccl" in text and "1.250+" in text and "0.800-" in text and "5.00" in text
    single = offline.format_table(offline.compare_table({"purlin": _line(1.6)}), ["purlin"])
    assert "purlin/nccl" not in single and "6.25" in single
    pytest.importorskip("matplotlib")
    assert offline.plot_compare(rows, ["nccl", "purlin"], tmp_path / "c.png") is None
    names = offline.legend_names(["nccl", "purlin"], nccl_free=True)
    assert names == {"nccl": "nccl (SGLang's collectives on gloo)", "purlin": "purlin"}
    assert offline.legend_names(["nccl", "purlin"], nccl_free=False)["nccl"] == "nccl"
    assert offline.plot_compare(rows, ["nccl", "purlin"], tmp_path / "d.png", names=names, subtitle="TP=2") is None
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_second_run_failing_keeps_the_first_and_shows_the_log(tmp_path, monkeypatch, capsys):
    """run_child is replaced in-process by a stand-in: nccl writes a result line, purlin exits 1."""
    def stand_in(cmd, log_path, label, timeout, every=30.0):
        backend, result = cmd[cmd.index("--comm-backend") + 1], cmd[cmd.index("--result-filename") + 1]
        if backend == "purlin":
            log_path.write_text("line one\nRuntimeError: purlin exploded here\n")
            return 1, 0.5
        log_path.write_text("ok\n")
        Path(result).write_text(json.dumps(_line(2.0)) + "\n")
        return 0, 0.7

    monkeypatch.setattr(offline, "run_child", stand_in)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no matplotlib: the JSON is still written
    rc = cli.main(["bench", "offline", "--compare", "nccl,purlin", "--model-path", "m", "--out", str(tmp_path),
                   "--benchmark-module", FAKE])
    cap = capsys.readouterr()
    assert rc == 1
    assert "the purlin run failed (exit code 1" in cap.err and "RuntimeError: purlin exploded here" in cap.err
    assert "install matplotlib" in cap.out and not (tmp_path / "offline.png").exists()
    doc = json.loads((tmp_path / "offline.json").read_text())
    assert doc["failed"] == "purlin" and doc["runs"][1]["error"] == "exit code 1"
    assert doc["runs"][0]["result"]["total_latency"] == 2.0 and doc["runs"][0]["result_lines"] == [_line(2.0)]
    assert doc["settings"]["benchmark_module"] == FAKE


# -- start-up errors ------------------------------------------------------------------------------------
def test_preflight_names_the_fix(monkeypatch, tmp_path):
    import torch

    plan = offline.resolve(parse(["--model-path", "m", "--tp-size", "2", "--out", str(tmp_path)]))
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "sglang" else real_find(n, *a))
    assert "tools/install-sglang-cpu.sh" in offline.preflight(plan) and "GPU kernel" in offline.preflight(plan)
    monkeypatch.setattr(importlib.util, "find_spec", real_find)
    if HAS_SGLANG:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert "needs a CUDA GPU" in offline.preflight(plan)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        assert "--tp-size 2 needs 2 GPUs; torch sees 1" in offline.preflight(plan)
        nf = offline.resolve(parse(["--model-path", "m", "--tp-size", "4", "--nccl-free", "--out", str(tmp_path)]))
        assert offline.preflight(nf) is None  # --nccl-free: ranks share the one GPU
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
        assert "--nccl-free needs one GPU for its 4 ranks; torch sees 0" in offline.preflight(nf)
    plan.module = FAKE
    assert offline.preflight(plan) is None


def test_nccl_free_reaches_every_child_and_the_record(tmp_path):
    plan = offline.resolve(parse(["--model-path", "m", "--tp", "2", "--nccl-free", "--compare", "nccl,purlin"]))
    assert plan.nccl_free and plan.tp == 2
    for b in plan.backends:
        cmd = offline.child_command(plan, b, "/d.json", "/r.jsonl")
        assert cmd.count("--purlin-nccl-free") == 1 and cmd[cmd.index("--comm-backend") + 1] == b
    assert "--purlin-nccl-free" not in offline.child_command(
        offline.resolve(parse(["--model-path", "m", "--tp", "2"])), "nccl", "/d.json", "/r.jsonl")
    cfg = write_yaml(tmp_path / "s.yaml", "model-path: /m\npurlin-nccl-free: true\n")
    assert offline.resolve(parse(["--config", cfg])).nccl_free  # also from an SGLang config file
    with pytest.raises(offline.OfflineError, match="--purlin-nccl-free"):
        offline.resolve(parse(["--model-path", "m", "--", "--purlin-nccl-free"]))  # owned: use --nccl-free


@pytest.mark.skipif(not HAS_SGLANG, reason="needs sglang")
def test_no_gpu_stops_before_any_run(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: this would start a real run")
    rc = cli.main(["bench", "offline", "--compare", "nccl,purlin", "--model-path", "m", "--out", str(tmp_path)])
    assert rc == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written before the check


# -- real child processes ------------------------------------------------------------------------------
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # killed, and not yet reaped by whoever inherited it
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


@pytest.mark.parametrize("exits", [True, False], ids=["exits-leaving-a-worker", "runs-past-timeout"])
def test_run_child_ends_what_it_started(tmp_path, capsys, exits):
    body = ("import subprocess, sys, time; w = subprocess.Popen(['sleep', '60']); print(w.pid, flush=True); "
            + ("sys.exit(0)" if exits else "time.sleep(60)"))
    log = tmp_path / "log.txt"
    rc, secs = offline.run_child([sys.executable, "-c", body], log, "demo", timeout=1.5, every=0.5)
    assert (rc, secs < 30) == ((0, True) if exits else (None, True))
    pid = int(log.read_text().split()[0])
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)
    if not exits:
        assert "demo: running, " in capsys.readouterr().out  # progress every `every` seconds
def _bench(argv, monkeypatch, capsys):
    """``bench offline`` in this process; its children are real processes that find the fake on PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.chdir(ROOT)
    rc = cli.main(["bench", "offline", *argv])
    cap = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, cap.out, cap.err)


def test_child_that_cannot_import_the_benchmark_says_why(tmp_path, monkeypatch, capsys):
    r = _bench(["--model-path", "m", "--out", str(tmp_path), "--benchmark-module", "no_such_module_purlin_test"],
               monkeypatch, capsys)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "the nccl run failed (exit code 3" in r.stderr
    assert "cannot import no_such_module_purlin_test" in r.stderr and "GPU kernel packages" in r.stderr
    assert json.loads((tmp_path / "offline.json").read_text())["failed"] == "nccl"


@needs_sglang
def test_compare_end_to_end_with_the_fake_benchmark(tmp_path, monkeypatch, capsys):
    """Two real children (plugin loaded, --config expanded, SGLang's parser), each running the FAKE benchmark."""
    fake = importlib.import_module(FAKE)
    cfg = write_yaml(tmp_path / "serve.yaml", "comm-backend: purlin\npurlin-config: configs/purlin.yaml\n"
                                              "tp-size: 4\nload-format: dummy\nnum-prompts: 24\n")
    out = tmp_path / "out"
    r = _bench(["--compare", "nccl,purlin", "--config", cfg, "--tp-size", "2", "--model-path", str(tmp_path / "m"),
                "--benchmark-module", FAKE, "--out", str(out), "--", "--mem-fraction-static", "0.5"],
               monkeypatch, capsys)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[1/2] nccl: starting" in r.stdout and "[2/2] purlin: done in" in r.stdout
    assert "purlin/nccl" in r.stdout
    doc = json.loads((out / "offline.json").read_text())
    seen = {run["backend"]: run["result"] for run in doc["runs"]}
    assert list(seen) == ["nccl", "purlin"] and doc["failed"] is None
    for backend, res in seen.items():
        assert res["fake"] is True and res["fake_comm_backend"] == backend  # reached ServerArgs via the plugin
        assert res["fake_tp_size"] == 2 and res["fake_load_format"] == "dummy"  # CLI beats file; file used
        assert res["successful_requests"] == 24 and res["fake_dataset_sha256"] == doc["dataset"]["sha256"]
    assert seen["purlin"]["fake_purlin_config"] == str(ROOT / "configs" / "purlin.yaml")
    expect = fake.FAKE_SECONDS_PER_REQUEST["nccl"] / fake.FAKE_SECONDS_PER_REQUEST["purlin"]
    ratio = {row["metric"]: row["ratio_purlin_over_nccl"] for row in doc["table"]}
    assert ratio["request_throughput"] == pytest.approx(expect)
    assert ratio["total_latency"] == pytest.approx(1 / expect)
    assert doc["runs"][0]["result_lines"] == [seen["nccl"]]
    if importlib.util.find_spec("matplotlib"):
        assert (out / "offline.png").read_bytes()[:4] == b"\x89PNG"
