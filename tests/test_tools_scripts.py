"""tools/: the device runner (tools/gpu.sh) cannot run its GPU steps here, but its command line, the checks
it makes before running anything, its plan (--dry-run) and the steps that fail before a GPU is needed can
be run; and the A/B table printer (tools/results_table.py) reads the kept records. Device time is
short: a runner that dies on a command line or a syntax error wastes a whole call."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
STEPS = ("setup", "test", "demo", "collectives", "moe", "engine", "tune", "script", "serve", "ab", "pack-base")


def gpu(*args: str, runner: Path = TOOLS / "gpu.sh") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run(["bash", str(runner), *args], capture_output=True, text=True, timeout=120, env=env)


def dry(tmp_path: Path, *args: str) -> tuple[list[str], list[str]]:
    """--dry-run with --out and --work under tmp_path: (the commands printed, the step lines)."""
    r = gpu("--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *args)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists(), "a dry run wrote something"
    lines = r.stdout.splitlines()
    return [x for x in lines if x.startswith("+ ")], [x for x in lines if not x.startswith("+ ")]


def wheels(tmp_path: Path) -> Path:
    d = tmp_path / "wheels"
    d.mkdir()
    (d / "pydantic-2.0-py3-none-any.whl").write_bytes(b"")
    return d


@pytest.mark.parametrize("script", sorted(TOOLS.glob("*.sh")), ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_help_names_every_step_option_and_mode():
    r = gpu("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: bash tools/gpu.sh [OPTIONS] STEP"), r.stderr
    for word in (*STEPS, "--wheels", "--out", "--work", "--base", "--budget", "--keep-going", "--pack", "--dry-run",
                 "graph", "eager", "engine", "collectives", "parts", "kernel", "--rounds", "--runs", "--model",
                 "--gpu-per-rank", "tp1pair", "PURLIN_REQUIRE_GPU=1"):
        assert re.search(rf"(^|\s){re.escape(word)}(\s|,|$)", r.stdout), f"--help does not name {word}"
    assert gpu("-h").stdout == r.stdout


@pytest.mark.parametrize("args,message", [
    ([], "no step given"),
    (["frobnicate"], "unknown step 'frobnicate'"),
    (["--frob", "test"], "unknown option '--frob'"),
    (["--budget", "soon", "test"], "--budget needs seconds"),
    (["--out"], "--out needs a value"),
    (["setup", "tset"], "setup takes no arguments (got 'tset'"),
    (["ab"], "ab: needs a MODE"),
    (["ab", "fast"], "ab: mode 'fast' unknown"),
    (["ab", "graph", "--rounds", "0"], "ab: --rounds needs a count"),
    (["ab", "moe", "--run-limit", "soon"], "ab: --run-limit needs seconds"),
    (["ncu", "--count", "0", "bench", "moe"], "ncu: --count needs a count"),
    (["test", "ncu"], "ncu: needs the purlin-sglang command"),
    (["serve", "--runs", "tp1,tp3"], "serve: run 'tp3' unknown"),
    (["serve", "--prompts", "many"], "serve: --prompts needs a count"),
    (["serve", "--model", "configs"], "serve: --model configs: no config.json"),
    (["serve", "--fast"], "serve: unknown option '--fast'"),
    (["script", "benchmarks/no_such_bench.py"], "script: needs a Python file"),
    (["test", "demo", "ab", "nope"], "ab: mode 'nope' unknown"),  # every step is checked before any runs
])
def test_a_command_line_it_cannot_use_runs_nothing(tmp_path, args, message):
    r = gpu("--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *args)
    assert r.returncode == 2 and r.stderr.startswith("gpu.sh: ") and message in r.stderr, r.stderr
    assert r.stdout == "" and not (tmp_path / "out").exists()


def test_setup_needs_a_wheel_dir_with_wheels_the_other_steps_do_not(tmp_path):
    r = gpu("--wheels", str(tmp_path / "none"), "setup")
    assert r.returncode == 2 and f"setup: --wheels {tmp_path / 'none'}: no such directory" in r.stderr
    (tmp_path / "empty").mkdir()
    r = gpu("--wheels", str(tmp_path / "empty"), "--dry-run", "setup")
    assert r.returncode == 2 and "no .whl file in it" in r.stderr
    cmds, _ = dry(tmp_path, "--wheels", str(tmp_path / "none"), "test")
    assert len(cmds) == 1


def test_dry_run_setup_then_tests_then_a_bench_each_with_its_own_arguments(tmp_path):
    w = wheels(tmp_path)
    work, out = tmp_path / "work", tmp_path / "out"
    cmds, steps = dry(tmp_path, "--wheels", str(w), "setup", "test", "tests/gpu/test_packets.py", "-x", "-kpacket",
                      "collectives", "--world", "8")
    assert [s.split()[:2] for s in steps] == [["setup", "dry"], ["test", "dry"], ["collectives", "dry"]]
    install, build, info, pytest_cmd, bench = cmds
    assert f"--target {work}/deps {w}/pydantic-2.0-py3-none-any.whl" in install and "--no-index" in install
    assert build.endswith(f"pip install --no-build-isolation --no-deps --target {work}/new {ROOT}  > {out}/build.log")
    assert "-m purlin_sglang info" in info
    site = f"PYTHONPATH={work}/new:{work}/deps"
    assert f"env PURLIN_REQUIRE_GPU=1 PURLIN_FAILURE_LOG={out}/test-failures.log {site} python3 -P -m pytest" in pytest_cmd
    assert pytest_cmd.endswith(f"tests/gpu/test_packets.py -x -kpacket  > {out}/test.log")
    assert bench.endswith(f"bench collectives --world 8 --out {out}/collectives  > {out}/collectives.log")


def test_the_test_step_runs_tests_gpu_by_default_and_a_repeated_step_gets_its_own_files(tmp_path):
    cmds, steps = dry(tmp_path, "test", "engine", "engine", "--world", "2")
    assert cmds[0].endswith(f"--tb=short tests/gpu  > {tmp_path}/out/test.log")
    out = tmp_path / "out"
    assert cmds[1].endswith(f"benchmarks/bench_cuda_engine.py --json {out}/engine.json  > {out}/engine.log")
    assert "--world 2 --json " + str(tmp_path / "out/engine-2.json") in cmds[2]
    assert [s.split()[0] for s in steps] == ["test", "engine", "engine-2"]
    cmds, _ = dry(tmp_path, "test", "--part", "1/2", "-x")  # options only: still tests/gpu
    assert cmds[0].endswith(f"--tb=short --part 1/2 -x tests/gpu  > {tmp_path}/out/test.log")


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs this repository's git history")
def test_ab_builds_the_base_and_alternates_the_builds_round_by_round(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    work = tmp_path / "work"
    cmds, steps = dry(tmp_path, "--base", "HEAD", "ab", "graph", "--rounds", "3", "--cases", "8k-w8")
    assert cmds[0].endswith(f"archive --format=tar -o {work}/base-src.tar {head}  > {tmp_path}/out/ab/build-base.log")
    assert f"--target {work}/base {work}/base-src" in cmds[2]
    runs = [c for c in cmds if "bench_graph_ab.py" in c]
    labels = [re.search(r"--label (\w+)", c).group(1) for c in runs]
    assert labels == ["new", "base", "base", "new", "new", "base"]
    for c, label in zip(runs, labels):
        assert f"PYTHONPATH={work}/{label}:{work}/deps" in c
        assert c.endswith(f"--cases 8k-w8  > {tmp_path}/out/ab/graph.jsonl")
    assert cmds[-1].startswith(f"+ python3 tools/results_table.py {tmp_path}/out/ab")
    assert f"against {head[:10]} (HEAD)" in steps[0]
    cmds, _ = dry(tmp_path, "--base", "HEAD", "ab", "kernel", "--rounds", "1", "--collectives", "all_reduce")
    kernel = [c for c in cmds if "bench collectives" in c or "bench_staged_parts" in c]
    assert len(kernel) == 4 and "--modes graph --baselines none --collectives all_reduce --out" in kernel[0]
    assert kernel[1].split("python3 ")[1].startswith("benchmarks/bench_staged_parts.py --worlds 2,8 --json")
    cmds, _ = dry(tmp_path, "--base", "HEAD", "ab", "moe", "--rounds", "2", "--tokens", "1,128")
    moe = [c for c in cmds if "bench moe" in c]
    assert [re.search(r"ab/moe-(\w+-\d)", c).group(1) for c in moe] == ["new-1", "base-1", "base-2", "new-2"]
    assert all("bench moe --tokens 1,128 --out" in c for c in moe)
    cmds, _ = dry(tmp_path, "--budget", "500", "--base", "HEAD", "ab", "moe", "--rounds", "1", "--run-limit", "90",
                  "--tokens", "4096")
    moe = [c for c in cmds if "bench moe" in c]
    assert len(moe) == 2 and all(c.startswith("+ timeout --kill-after=10 90 ") for c in moe), moe
    assert all("--run-limit" not in c for c in moe) and "timeout --kill-after=10 90 " not in cmds[0]
    assert not cmds[-1].startswith("+ timeout --kill-after=10 90 ")  # the table: the budget only
    cmds, steps = dry(tmp_path, "test", "ncu", "--skip", "2", "bench", "moe", "--world", "1", "test")
    assert [st.split()[0] for st in steps] == ["test", "ncu"]  # every word after ncu is its own
    out = tmp_path / "out"
    assert "ncu --clock-control none --target-processes all --kernel-name regex:moe_dispatch --launch-skip 2 " \
           "--launch-count 2 " in cmds[-2] and f"--export {out}/ncu/report " in cmds[-2]
    assert cmds[-2].endswith(f"python3 -P -m purlin_sglang bench moe --world 1 test  > {out}/ncu.log")
    assert cmds[-1].startswith(f"+ ncu --import {out}/ncu/report.ncu-rep --page details")
    cmds, steps = dry(tmp_path, "script", "-m", "purlin_sglang.bench.moe_parts", "--tokens", "1")
    assert steps[0].split()[:2] == ["script-moe_parts", "dry"]
    assert "python3 -P -m purlin_sglang.bench.moe_parts --tokens 1" in cmds[-1]
    cmds, steps = dry(tmp_path, "--base", "HEAD", "ab", "engine", "--rounds", "1", "engine")  # a mode, then a step
    assert [s.split()[0] for s in steps] == ["ab", "engine"]
    assert sum("bench_cuda_engine.py" in c for c in cmds) == 3
    # two ab steps in one run: each its own directory (the second does not replace the first's records)
    cmds, steps = dry(tmp_path, "--base", "HEAD", "ab", "moe", "--rounds", "1", "--tokens", "1", "ab", "moe",
                      "--rounds", "1", "--tokens", "128")
    assert [s.split()[0] for s in steps] == ["ab", "ab-2"] and "table ab-2/table.md" in steps[1]
    moe = [c for c in cmds if "bench moe" in c]
    assert [re.search(r"/out/(ab(?:-2)?)/moe-", c).group(1) for c in moe] == ["ab", "ab", "ab-2", "ab-2"]
    assert all("--tokens 1 --out" in c for c in moe[:2]) and all("--tokens 128 --out" in c for c in moe[2:])
    tables = [c for c in cmds if "results_table.py" in c]
    assert [t.split("results_table.py ")[1].split()[0] for t in tables] == [f"{tmp_path}/out/ab", f"{tmp_path}/out/ab-2"]


def test_ab_takes_the_packed_base_first_or_says_how_to_make_it(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    for name in ("gpu.sh", "gpu_serve.sh"):
        shutil.copy(TOOLS / name, repo / "tools" / name)
    runner = repo / "tools" / "gpu.sh"
    r = gpu("ab", "graph", runner=runner)
    assert r.returncode == 2 and "no git history here" in r.stderr and "pack-base" in r.stderr, r.stderr
    (repo / ".whl").mkdir()
    src = tmp_path / "pyproject.toml"
    src.write_text("[project]\n")
    with tarfile.open(repo / ".whl" / "base.tar.gz", "w:gz", format=tarfile.PAX_FORMAT,
                      pax_headers={"comment": "0123456789abcdef"}) as tar:
        tar.add(src, arcname="pyproject.toml")
    r = gpu("--dry-run", "--work", str(tmp_path / "work"), "ab", "eager", "--rounds", "1", runner=runner)
    assert r.returncode == 0, r.stderr
    assert f"tar -xzf .whl/base.tar.gz -C {tmp_path}/work/base-src" in r.stdout
    assert "against .whl/base.tar.gz (0123456789)" in r.stdout
    # with a git history too (the device's copy of it may name an older main), the packed base still wins;
    # an explicit --base REF takes the history
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q", "-b", "main"], ["add", "tools"], ["commit", "-q", "-m", "x"]):
        subprocess.run(git + args, check=True, capture_output=True)
    r = gpu("--dry-run", "--work", str(tmp_path / "work"), "ab", "eager", "--rounds", "1", runner=runner)
    assert r.returncode == 0 and "against .whl/base.tar.gz (0123456789)" in r.stdout, r.stdout + r.stderr
    r = gpu("--dry-run", "--work", str(tmp_path / "work"), "--base", "main", "ab", "eager", "--rounds", "1",
            runner=runner)
    assert r.returncode == 0 and "git -C" in r.stdout and "(main)" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs this repository's git history")
def test_pack_base_writes_an_archive_of_the_ref_that_names_its_commit(tmp_path):
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    r = gpu("--wheels", str(tmp_path / "wh"), "--out", str(tmp_path / "out"), "--base", "HEAD", "pack-base")
    assert r.returncode == 0 and r.stdout.startswith("pack-base      ok"), r.stdout + r.stderr
    with tarfile.open(tmp_path / "wh" / "base.tar.gz") as tar:
        assert tar.pax_headers["comment"] == head and "pyproject.toml" in tar.getnames()


def test_the_first_failing_step_ends_the_run_unless_keep_going(tmp_path):
    base = ("--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"))
    r = gpu(*base, "test", "demo")
    assert r.returncode == 1
    test, demo = r.stdout.splitlines()
    assert test.split()[:2] == ["test", "FAIL"] and f"no build in {tmp_path}/work/new" in test
    assert demo.split()[:2] == ["demo", "skip"] and "a step before it failed" in demo
    r = gpu(*base, "--keep-going", "test", "demo")
    assert r.returncode == 1 and [x.split()[:2] for x in r.stdout.splitlines()] == [["test", "FAIL"], ["demo", "FAIL"]]


def test_a_script_runs_against_the_build_and_the_budget_stops_the_run(tmp_path):
    (tmp_path / "work" / "new" / "purlin_sglang").mkdir(parents=True)  # a build, as far as the runner can tell
    script = tmp_path / "nap.py"
    script.write_text("import os, sys, time\nprint(os.environ['PYTHONPATH'])\ntime.sleep(float(sys.argv[1]))\n"
                      "print('slept', sys.argv[1])\n")
    out = tmp_path / "out"
    r = gpu("--out", str(out), "--work", str(tmp_path / "work"), "--budget", "3",
            "script", str(script), "0", "script", str(script), "60", "demo")
    assert r.returncode == 1
    first, second, *tail, demo = r.stdout.splitlines()
    assert first.split()[:2] == ["script-nap", "ok"] and first.endswith("slept 0")
    assert (out / "script-nap.log").read_text().startswith(f"{tmp_path}/work/new:{tmp_path}/work/deps\n")
    assert second.split()[:2] == ["script-2-nap", "FAIL"] and "stopped: the budget (--budget 3) is spent" in second
    assert tail and all(x.startswith("    | ") for x in tail)  # the end of its log
    assert demo.split()[:2] == ["demo", "skip"]


def test_pack_leaves_one_archive_of_everything_under_out(tmp_path):
    (tmp_path / "work" / "new" / "purlin_sglang").mkdir(parents=True)
    (tmp_path / "hello.py").write_text("print('hello')\n")
    (tmp_path / "fails.py").write_text("raise SystemExit('no luck')\n")
    out = tmp_path / "out"
    r = gpu("--out", str(out), "--work", str(tmp_path / "work"), "--pack",
            "script", str(tmp_path / "hello.py"), "script", str(tmp_path / "fails.py"))
    assert r.returncode == 1
    assert [x.split()[:2] for x in r.stdout.splitlines()[:2]] == [["script-hello", "ok"], ["script-2-fails", "FAIL"]]
    assert [p.name for p in out.iterdir()] == ["out.tar.gz"]
    with tarfile.open(out / "out.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["./script-2-fails.log", "./script-hello.log"]
        assert tar.extractfile("./script-hello.log").read() == b"hello\n"


def test_serve_runs_each_named_run_once_in_the_order_given(tmp_path):
    cmds, steps = dry(tmp_path, "serve", "--runs", "tp1,core", "--prompts", "8")
    clients = [c for c in cmds if "serve_client.py run" in c]
    names = [re.search(r"--name (\S+)", c).group(1) for c in clients]
    assert names == ["tp1-nccl", "tp1-purlin-yaml", "tp2-gloo-ref", "tp2-purlin-eager", "tp2-purlin-graph"]
    assert all("--prompts 8 " in c for c in clients)
    assert "--reference tp2-gloo-ref" in clients[3] and "--nccl-free" in clients[3]
    servers = [c for c in cmds if c.startswith("+ python3 -m sglang.launch_server")]
    assert len(servers) == 5 and "--tp-size 2" in servers[2] and "--disable-cuda-graph" in servers[2]
    assert "serve_client.py compare" in cmds[-1]
    cmds, _ = dry(tmp_path, "serve", "--runs", "tp2", "--gpu-per-rank")
    names = [re.search(r"--name (\S+)", c).group(1) for c in cmds if "serve_client.py run" in c]
    assert names == ["tp2-nccl", "tp2-purlin"]


def test_serve_moe_graphs_and_faults(tmp_path):
    cmds, _ = dry(tmp_path, "serve", "--runs", "moe-graph,fault")
    names = [re.search(r"--name (\S+)", c).group(1) for c in cmds if "serve_client.py" in c and "--name" in c]
    assert names == ["moe-ep2-gloo-ref", "moe-ep2-purlin-graph", "moe-ep4-gloo-ref", "moe-ep4-purlin-graph",
                     "fault-tp2-eager", "fault-tp2-graph"]
    servers = [c for c in cmds if c.startswith("+ python3 -m sglang.launch_server")]
    assert "--ep-size 4" in servers[3] and "--moe-a2a-backend purlin" in servers[3]
    assert "--disable-cuda-graph" not in servers[3] and "--disable-prefill-cuda-graph" in servers[3]
    faults = [c for c in cmds if "serve_client.py fault" in c]
    assert len(faults) == 2 and all("--victim 1" in c and "--timeout-s 20" in c for c in faults)
    assert "--disable-cuda-graph" in servers[4] and "--disable-cuda-graph" not in servers[5]


def table(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / "results_table.py"), *args], capture_output=True, text=True)


def test_results_table_reads_the_kept_records():
    r = table(str(ROOT / "docs/results/2026-12-05-h200"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "| 8k-w8 | True | 6.47 | 6.36 | 0.983 |" in lines  # the graph A/B: median of three rounds each
    assert "| 1 | out= | 15.39 | 7.64 | 0.496 |" in lines  # the eager A/B
    assert "| impl | collective | mode | world | bytes | base | new | symmetric | new/base |" in lines
    assert "| graph 128 KiB bf16 packet | 8 | - | 12.95 | - |" in lines  # a case the base did not run


def test_results_table_of_an_ab_folder_takes_the_median_and_marks_wrong_results(tmp_path):
    rows = [{"label": lab, "case": "8k-w8", "check": True, "us_per_call": v}
            for lab, vs in (("new", (1, 3, 2)), ("base", (6, 4, 5))) for v in vs]
    (tmp_path / "graph.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    for lab, t, ok in (("new", 7.0, False), ("base", 8.0, True)):
        (tmp_path / f"collectives-{lab}-1").mkdir()
        (tmp_path / f"collectives-{lab}-1" / "results.json").write_text(json.dumps({"rows": [
            {"impl": "purlin", "collective": "all_reduce", "mode": "graph", "world": 8, "bytes": 8192,
             "time_us_median": t, "correct": ok}]}))
    for lab, t in (("new", 12.0), ("base", 30.0)):
        (tmp_path / f"moe-{lab}-1").mkdir()
        (tmp_path / f"moe-{lab}-1" / "moe.json").write_text(json.dumps({"rows": [
            {"impl": "purlin", "op": "pair", "dtype": "bf16", "mode": "graph", "world": 8, "tokens": 1,
             "time_us_median": t, "correct": True}]}))
    r = table(str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "| 8k-w8 | True | 5.00 | 2.00 | 0.400 |" in r.stdout.splitlines()
    assert "| purlin | pair | bf16 | graph | 8 | 1 | 30.00 | 12.00 | 0.400 |" in r.stdout.splitlines()
    assert "| purlin | all_reduce | graph | 8 | 8192 | 8.00 | 7.00 (wrong) | 0.875 |" in r.stdout.splitlines()
    empty = tmp_path / "empty"
    empty.mkdir()
    r = table(str(empty))
    assert r.returncode == 1 and r.stdout == "" and "no records under" in r.stderr


def test_the_test_step_keeps_each_failure_as_it_happens(tmp_path):
    """A device call's budget can stop pytest before its summary: the test step names a failure log that
    tests/conftest.py appends each failing test's report to as soon as it fails."""
    cmds, _ = dry(tmp_path, "test", "tests/gpu/test_moe.py")
    assert f"PURLIN_FAILURE_LOG={tmp_path}/out/test-failures.log " in cmds[0]
    spec = importlib.util.spec_from_file_location("purlin_tests_conftest", ROOT / "tests" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    log = tmp_path / "failures.log"

    def report(nodeid, failed, when="call"):
        return types.SimpleNamespace(nodeid=nodeid, failed=failed, when=when, longreprtext=f"AssertionError: {nodeid}")

    os.environ.pop("PURLIN_FAILURE_LOG", None)
    conftest.pytest_runtest_logreport(report("a.py::t0", True))  # no log asked for: nothing written
    assert not log.exists()
    try:
        os.environ["PURLIN_FAILURE_LOG"] = str(log)
        conftest.pytest_runtest_logreport(report("a.py::t1", False))
        conftest.pytest_runtest_logreport(report("a.py::t2", True))
        conftest.pytest_runtest_logreport(report("a.py::t3", True, when="setup"))
    finally:
        del os.environ["PURLIN_FAILURE_LOG"]
    text = log.read_text()
    assert text.startswith("FAILED a.py::t2 (in call)\nAssertionError: a.py::t2\n")
    assert "FAILED a.py::t3 (in setup)" in text and "t1" not in text and "t0" not in text
