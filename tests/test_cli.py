"""The command line: demo checks correctness and says so in its exit code; info runs anywhere and tells the
truth about CUDA; an argument or config error is one line on stderr and exit code 2 (``--debug``: the
traceback too); a run that checked or measured nothing does not exit 0."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from purlin_sglang import cli

ROOT = Path(__file__).resolve().parents[1]


def test_demo_small_is_correct(tmp_path, capsys):
    out = tmp_path / "demo.json"
    rc = cli.main(["demo", "--min-world", "2", "--max-world", "3", "--iters", "1", "--bytes", "4096",
                   "--json", str(out)])
    text = capsys.readouterr()
    assert rc == 0, text.out
    rows = json.loads(out.read_text())
    assert {r["collective"] for r in rows} == {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v",
        "reduce_scatter_v", "all_to_all_v", "broadcast"}
    assert {r["world"] for r in rows} == {2, 3}
    assert all(r["correct"] for r in rows)
    assert "16 of 16 correct" in text.out
    assert "progress" in text.err or "#" in text.err


def test_demo_reports_a_wrong_result(monkeypatch, capsys):
    real = cli._reference

    def broken(name, world, cases):
        ref = real(name, world, cases)
        if name == "all_gather":
            ref = [r + 1 for r in ref]
        return ref

    monkeypatch.setattr(cli, "_reference", broken)
    rc = cli.main(["demo", "--min-world", "2", "--max-world", "2", "--iters", "1", "--bytes", "1024"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "NO" in out and "7 of 8 correct" in out


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("purlin_sglang", "torch", "native library", "GPU", "NVSHMEM", "sglang", "engines"):
        assert key in info
    assert "cuda" in info["native_build_info"]


def test_bad_world_range_is_a_usage_error(capsys):
    assert cli.main(["demo", "--min-world", "4", "--max-world", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "purlin-sglang: error: demo: need --min-world <= --max-world, got 4 > 2\n"


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "purlin_sglang", "info"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "native library:" in r.stdout


@pytest.mark.parametrize("script", ["custom_collective.py", "symmetric_heap.py"])
def test_examples_run(script):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_multiprocess_example_runs():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "multiprocess_cpu.py"), "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("correct") == 2


def _readme_bash_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return [b.split("```", 1)[0].strip() for b in readme.split("```bash")[1:]]


def test_readme_test_command_is_what_ci_runs():
    """The line after '# README test command' in .ci/run is, verbatim, a bash block of the README."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index("# README test command") + 1].strip()
    assert command in _readme_bash_blocks(), f"README has no bash block equal to .ci/run's {command!r}"


def test_readme_demo_and_tests_use_separate_venvs():
    """The demo installs torch into a venv of its own: the test set-up (torch 2.14.1 with its CUDA
    runtime wheels) must not replace it silently."""
    blocks = _readme_bash_blocks()
    demo = next(b for b in blocks if "purlin-sglang demo" in b)
    demo_venv = re.search(r"python3 -m venv (\S+)", demo).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    test_venv = re.search(r"install-sglang-cpu\.sh (\S+)", ci).group(1)
    assert demo_venv.rstrip("/") != test_venv.rstrip("/"), (demo_venv, test_venv)


# -- errors: one line on stderr, exit code 2 ------------------------------------------------------------
def purlin_sglang(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "purlin_sglang", *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def one_error_line(rc: int, out: str, err: str) -> str:
    """The error line of a refused command: exit code 2, nothing on stdout, one line on stderr."""
    assert rc == 2, (rc, out, err)
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith("purlin-sglang: error: "), err
    return err


def refused(capsys, argv: list[str]) -> str:
    rc = cli.main(argv)
    cap = capsys.readouterr()
    return one_error_line(rc, cap.out, cap.err)


@pytest.fixture
def bad_configs(tmp_path):
    (tmp_path / "typo.yaml").write_text("timout_s: 3\n")
    (tmp_path / "type.yaml").write_text("timeout_s: soon\n")
    (tmp_path / "yaml.yaml").write_text("timeout_s: [1, 2\n")
    return tmp_path


@pytest.mark.parametrize("argv,says", [
    (["info", "--config", "{dir}/typo.yaml"], ["unknown key 'timout_s'", "did you mean 'timeout_s'?", "known keys:"]),
    (["info", "--config", "{dir}/type.yaml"], ["key 'timeout_s'", "valid number", "'soon'"]),
    (["info", "--config", "{dir}/yaml.yaml"], ["not valid YAML"]),  # YAML's own message spans lines
    (["info", "--config", "{dir}/missing.yaml"], ["missing.yaml: cannot read"]),
    (["demo", "--rows", "0"], ["demo: argument --rows: need an integer >= 1, got 0"]),
    (["demo", "--iters", "0"], ["demo: argument --iters: need an integer >= 1, got 0"]),
    (["demo", "--timeout", "-1"], ["demo: argument --timeout: need a number > 0"]),
    (["demo", "--json", "{dir}/no/such/folder/x.json"], ["demo: --json", "folder does not exist"]),
    (["demo", "--bogus"], ["demo: unrecognized arguments: --bogus", "purlin-sglang demo --help"]),
    (["frobnicate"], ["invalid choice: 'frobnicate'"]),
    ([], ["required: {demo,info,tune,bench}"]),
    (["bench", "collectives", "--device", "cpu", "--modes", "graph"], ["--modes graph needs CUDA", "--modes eager"]),
    (["bench", "collectives", "--device", "cpu", "--baselines", "nccl"], ["['nccl'] cannot run on the cpu engine"]),
    (["bench", "collectives", "--device", "cpu", "--factor", "1"], ["argument --factor: need a number > 1"]),
    (["tune", "--device", "cpu", "--collectives", "all_gather"],
     ["tune: nothing to choose between for all_gather (only oneshot) on the cpu engine", "here: all_reduce"]),
    (["tune", "--device", "cpu", "--collectives", "all_gather_v"], ["all_gather_v (a V form)"]),
    (["tune", "--device", "cpu", "--min-bytes", "64K", "--max-bytes", "1K"], ["tune: size sweep"]),
    (["bench", "moe", "--device", "cpu", "--world", "0"], ["bench moe: --world must be >= 1, got 0"]),
    (["bench", "offline", "--compare", "nccl,purlin"], ["bench offline: no model"]),
])
def test_an_argument_or_config_error_is_one_line_and_exit_code_2(argv, says, bad_configs, capsys):
    err = refused(capsys, [a.format(dir=bad_configs) for a in argv])
    for text in says:
        assert text in err, err


def test_the_process_exits_2_with_the_one_line(bad_configs):
    r = purlin_sglang("info", "--config", str(bad_configs / "typo.yaml"))
    err = one_error_line(r.returncode, r.stdout, r.stderr)
    assert "unknown key 'timout_s' (did you mean 'timeout_s'?" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal given when there is no GPU")
@pytest.mark.parametrize("argv", [["bench", "collectives", "--device", "cuda"], ["tune", "--device", "cuda"]])
def test_cuda_without_a_gpu_is_refused_up_front(argv, capsys):
    err = refused(capsys, argv)
    assert "--device cuda, but the CUDA engine cannot run" in err and "use --device cpu" in err, err


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_prints_the_traceback_before_the_error_line(where, bad_configs):
    argv = ["info", "--config", str(bad_configs / "typo.yaml")]
    r = purlin_sglang(*(["--debug", *argv] if where == "before" else [*argv, "--debug"]))
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):" and "PurlinConfigError" in r.stderr
    assert lines[-1].startswith("purlin-sglang: error: purlin config ") and "'timout_s'" in lines[-1]


def test_a_failure_during_a_run_is_one_line_and_exit_code_1(monkeypatch, capsys):
    import purlin_sglang
    from purlin_sglang.errors import PurlinTimeoutError

    def times_out(*args, **kwargs):
        raise PurlinTimeoutError("all_reduce: rank 0 waited 60 s for rank 1\nthat never arrived", op="all_reduce")

    monkeypatch.setattr(purlin_sglang, "run_virtual", times_out)
    assert cli.main(["demo", "--max-world", "2"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "purlin-sglang: error: all_reduce: rank 0 waited 60 s for rank 1 that never arrived"


# -- runs that measured nothing do not exit 0 -------------------------------------------------------------
def test_bench_collectives_with_nothing_measured_exits_1(monkeypatch, tmp_path, capsys):
    from purlin_sglang.bench import collectives
    from purlin_sglang.errors import PurlinUnavailableError

    def unavailable(*args, **kwargs):
        raise PurlinUnavailableError("memory='host': not here")

    monkeypatch.setattr(collectives, "run_purlin", unavailable)
    rc = cli.main(["bench", "collectives", "--device", "cpu", "--world", "2", "--sizes", "1K", "--iters", "1",
                   "--collectives", "all_reduce", "--baselines", "none", "--out", str(tmp_path)])
    text = capsys.readouterr()
    assert rc == 1, text.out + text.err
    assert "0 of 0 results correct" in text.out and "nothing was measured" in text.err


def test_tune_with_nothing_measured_exits_1_and_writes_no_table(monkeypatch, tmp_path, capsys):
    from purlin_sglang.bench import tune

    def fails(*args, **kwargs):
        raise RuntimeError("the engine fell over")

    monkeypatch.setattr(tune, "run_purlin", fails)
    out = tmp_path / "t.json"
    rc = cli.main(["tune", "--device", "cpu", "--min-bytes", "1K", "--max-bytes", "1K", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "nothing was measured" in text and "the engine fell over" in text
    assert not out.exists()


# -- info tells the truth about CUDA -----------------------------------------------------------------------
def info_of(capsys) -> dict:
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key, value in info.items():
        assert value not in ("", None) and not str(value).rstrip().endswith(":"), (key, value)
    return info


@pytest.fixture
def fake_gpu(monkeypatch):
    """torch sees one GPU of compute capability ``fake_gpu[0]`` and the native library has CUDA for sm_90."""
    from purlin_sglang import native

    cap = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: cap[0])
    monkeypatch.setattr(native, "build_info", lambda: {"built": True, "cuda": True, "archs": ["90"], "nvcc": "13.0",
                                                        "reason": None})
    return cap


def test_info_says_which_communicators_exist_and_whether_they_can_run_here(capsys):
    info = info_of(capsys)
    com = info["communicators"]
    assert "cpu: run_virtual over host (ready); process groups over host (ready)" in com
    assert "run_virtual over loopback" in com and "process groups over ipc" in com
    assert "torch" in com and "nvshmem" in com
    assert "no CUDA communicators" not in json.dumps(info) and "HBM held by communicators" not in info
    if not torch.cuda.is_available():
        assert info["GPU"].startswith("none")
        assert info["engines"] == "cpu (reference): ready; cuda: cannot run here: no CUDA GPU is visible to torch"
        assert "cuda (none here: the engine cannot run" in com


def test_info_with_a_usable_gpu_says_cuda_is_ready(fake_gpu, capsys):
    info = info_of(capsys)
    assert info["GPU"] == "cuda:0 Fake GPU (sm_90)"
    assert info["native library"] == "built with CUDA for archs 90 (nvcc 13.0)"
    assert info["engines"] == "cpu (reference): ready; cuda: ready"
    assert "cuda: run_virtual over loopback (ready); process groups over ipc" in info["communicators"]


def test_info_with_a_gpu_older_than_the_build_says_why_cuda_cannot_run(fake_gpu, capsys):
    fake_gpu[0] = (8, 0)
    info = info_of(capsys)
    assert info["GPU"] == "cuda:0 Fake GPU (sm_80)"
    assert "cuda: cannot run here: the GPU is sm_80, older than every architecture the native library was built " \
           "for (90); reinstall with PURLIN_CUDA_ARCHS=80" in info["engines"]


def test_info_with_a_build_without_cuda_says_why(monkeypatch, capsys):
    from purlin_sglang import native

    monkeypatch.setattr(native, "build_info", lambda: {"built": True, "cuda": False, "archs": [], "nvcc": None,
                                                        "reason": "PURLIN_DISABLE_CUDA=1"})
    info = info_of(capsys)
    assert info["native library"] == "built without CUDA: PURLIN_DISABLE_CUDA=1"
    assert "cuda: cannot run here: the native library was built without CUDA: PURLIN_DISABLE_CUDA=1" in info["engines"]


def test_info_names_what_a_memory_provider_lacks(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("cuda.") else real(name, *a))  # no cuda-python
    com = info_of(capsys)["communicators"]
    assert "ipc (unavailable: needs cuda-python (cuda.bindings.runtime is not importable); pip install cuda-python)" \
        in com, com
