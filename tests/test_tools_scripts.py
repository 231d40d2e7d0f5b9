"""The device scripts (tools/*.sh) cannot run here, but they must parse, and every one that runs the
GPU tests must make a skipped GPU test fail (PURLIN_REQUIRE_GPU=1, tests/conftest.py). Device time
is short: a script that dies on a syntax error wastes a whole call."""

import subprocess
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
SCRIPTS = sorted(TOOLS.glob("*.sh"))


def test_there_are_scripts():
    assert {p.name for p in SCRIPTS} >= {"gpu-session.sh", "gpu-serve.sh", "gpu-moe.sh", "gpu-eager-ab.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


GPU_TEST_SCRIPTS = [p for p in SCRIPTS if p.name.startswith("gpu-") and "-m pytest" in p.read_text()]


def test_the_gpu_test_scripts_are_found():
    assert {p.name for p in GPU_TEST_SCRIPTS} >= {"gpu-session.sh", "gpu-moe.sh"}


@pytest.mark.parametrize("script", GPU_TEST_SCRIPTS, ids=lambda p: p.name)
def test_scripts_that_run_gpu_tests_require_the_gpu(script):
    assert "PURLIN_REQUIRE_GPU=1" in script.read_text(), f"{script.name} runs pytest without PURLIN_REQUIRE_GPU=1"


def test_eager_ab_refuses_an_unknown_step(tmp_path):
    r = subprocess.run(["bash", str(TOOLS / "gpu-eager-ab.sh"), "nonsense"], capture_output=True, text=True,
                       env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "usage" in r.stderr
