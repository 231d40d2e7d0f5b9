"""CLI smoke tests: demo checks correctness and says so in its exit code; info runs anywhere."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    rc = cli.main(["demo", "--min-world", "2", "--max-world", "2", "--iters", "0", "--bytes", "1024"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "NO" in out and "7 of 8 correct" in out


def test_info_json(capsys):
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("purlin_sglang", "torch", "native library", "GPU", "NVSHMEM", "sglang", "engines"):
        assert key in info
    assert "cuda" in info["native_build_info"]


def test_bad_world_range_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--min-world", "4", "--max-world", "2"])
    assert e.value.code == 2


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
