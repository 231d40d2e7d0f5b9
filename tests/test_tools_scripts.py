"""The device scripts (tools/*.sh) cannot run here, but they must parse, and every one that runs the
GPU tests must make a skipped GPU test fail (PURLIN_REQUIRE_GPU=1, tests/conftest.py). Device time
is short: a script that dies on a syntax error wastes a whole call."""

import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
SCRIPTS = sorted(TOOLS.glob("*.sh"))


def test_there_are_scripts():
    assert {p.name for p in SCRIPTS} >= {"gpu-serve.sh", "gpu-moe.sh", "gpu-eager-ab.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


GPU_TEST_SCRIPTS = [p for p in SCRIPTS if p.name.startswith("gpu-") and "-m pytest" in p.read_text()]


def test_the_gpu_test_scripts_are_found():
    assert {p.name for p in GPU_TEST_SCRIPTS} >= {"gpu-moe.sh"}


@pytest.mark.parametrize("script", GPU_TEST_SCRIPTS, ids=lambda p: p.name)
def test_scripts_that_run_gpu_tests_require_the_gpu(script):
    assert "PURLIN_REQUIRE_GPU=1" in script.read_text(), f"{script.name} runs pytest without PURLIN_REQUIRE_GPU=1"


def test_eager_ab_refuses_an_unknown_step(tmp_path):
    r = subprocess.run(["bash", str(TOOLS / "gpu-eager-ab.sh"), "nonsense"], capture_output=True, text=True,
                       env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "usage" in r.stderr


def test_target_table_reads_the_kept_records_and_a_missing_record_stays_empty(tmp_path):
    """tools/issue16_table.py prints the latency and bandwidth targets' table from the H200 records of
    2026-12-05 (docs/results): each row from its own record, nothing filled in where a record is missing."""
    import sys

    prefix = Path(__file__).resolve().parents[1] / "docs/results/2026-12-05-h200"
    r = subprocess.run([sys.executable, str(TOOLS / "issue16_table.py"), str(prefix)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].lstrip("| "): line for line in r.stdout.splitlines()[2:]}
    assert len(rows) == 11
    heap = next(v for k, v in rows.items() if "symmetric heap" in k)
    assert "0.61 / 0.81 / 0.93 / 0.92" in heap and heap.endswith("| yes / yes / yes / yes |")
    assert rows["all_reduce 8 KiB packet, 8 ranks (graph A/B, median of rounds)"].endswith("| 6.47 | 6.36 | <= 4.0 | no |")
    r = subprocess.run([sys.executable, str(TOOLS / "issue16_table.py"), str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert all("| - |" in line or "- / -" in line or "-/-" in line for line in r.stdout.splitlines()[2:])
