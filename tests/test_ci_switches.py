"""The CI switches of tests/conftest.py: PURLIN_REQUIRE_SGLANG=1 and PURLIN_REQUIRE_GPU=1 turn the skips
they name into failures, and leave every other skip alone (a pytest run in a subprocess)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")

MODULE_SKIP = '''import pytest
pytest.importorskip("sglang.no_such_module_for_purlin_tests")

def test_never_runs():
    pass
'''
RUNTIME_SKIPS = '''import pytest

def test_gpu_skip():
    pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")

def test_sglang_skip():
    pytest.skip("needs sglang (tools/install-sglang-cpu.sh)")

def test_other_skip():
    pytest.skip("needs matplotlib")
'''


def _run(tmp_path: Path, env_set: dict) -> str:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    (tmp_path / "test_runtime_skips.py").write_text(RUNTIME_SKIPS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PURLIN_REQUIRE_")}
    env.update(env_set)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--continue-on-collection-errors", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return res.stdout + res.stderr


@pytest.mark.parametrize("env_set,want", [
    ({}, "4 skipped"),
    ({"PURLIN_REQUIRE_SGLANG": "1"}, "1 failed, 2 skipped, 1 error"),
    ({"PURLIN_REQUIRE_GPU": "1"}, "1 failed, 3 skipped"),
    ({"PURLIN_REQUIRE_SGLANG": "1", "PURLIN_REQUIRE_GPU": "1"}, "2 failed, 1 skipped, 1 error"),
])
def test_require_switches_turn_only_their_skips_into_failures(tmp_path, env_set, want):
    out = _run(tmp_path, env_set)
    assert want in out, out
    for switch in env_set:
        assert f"{switch}=1: this skip is a failure" in out, out
