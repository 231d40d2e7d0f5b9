"""The switches of tests/conftest.py: PURLIN_REQUIRE_SGLANG=1 and PURLIN_REQUIRE_GPU=1 turn the skips they
name into failures, and leave every other skip alone; --part K/N runs the K-th of N contiguous parts
(a pytest run in a subprocess)."""

from __future__ import annotations

import os
import re
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


GPU_MODULE = '''import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(True, reason="NVSHMEM is not usable in this installation")]


def test_marked_gpu():
    pass


@pytest.mark.skipif(True, reason="needs two GPUs")
def test_marked_gpu_needing_two():
    pass
'''


def _run(tmp_path: Path, env_set: dict, files: dict | None = None, args: tuple = ()) -> str:
    """pytest in a subprocess on ``files`` (name -> source) with the repo's conftest.py, no GPU visible."""
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    for name, text in (files or {"test_module_skip.py": MODULE_SKIP, "test_runtime_skips.py": RUNTIME_SKIPS}).items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PURLIN_REQUIRE_")}
    env.update(env_set, CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "--continue-on-collection-errors", *args, str(tmp_path)],
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


@pytest.mark.parametrize("env_set,want", [({}, "2 skipped"), ({"PURLIN_REQUIRE_GPU": "1"}, "2 errors")])
def test_without_a_gpu_the_gpu_marker_skips_first(tmp_path, env_set, want):
    """A gpu-marked test with other skips of its own or of its module is skipped for want of a GPU (the
    reason PURLIN_REQUIRE_GPU=1 turns into a failure: of the set-up, where marks skip), not for the
    other reasons."""
    out = _run(tmp_path, env_set, {"test_gpu_module.py": GPU_MODULE})
    assert want in out, out
    reported = [line for line in out.splitlines() if line.startswith(("SKIPPED", "FAILED", "ERROR"))]
    assert len(reported) == 2 and all("needs a CUDA" in line for line in reported), out


def test_the_gpu_skip_is_decided_once():
    """Every module of tests/gpu carries the gpu marker, and no test module repeats its skip with a
    skipif of its own on torch.cuda.is_available()."""
    tests = Path(__file__).parent
    unmarked = [p.name for p in (tests / "gpu").glob("test_*.py") if "pytest.mark.gpu" not in p.read_text()]
    repeats = [str(p.relative_to(tests)) for p in tests.rglob("test_*.py")
               if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", p.read_text())]
    assert not unmarked and not repeats, f"without the gpu marker: {unmarked}; repeating its skip: {repeats}"


SEVEN = {"test_first.py": "".join(f"def test_{c}():\n    pass\n\n" for c in "abc"),
         "test_second.py": "".join(f"def test_{c}():\n    pass\n\n" for c in "defg")}


def _ids(out: str) -> list[str]:
    return [line for line in out.splitlines() if "::test_" in line]


def test_the_parts_split_the_suite_in_order(tmp_path):
    whole = _ids(_run(tmp_path, {}, SEVEN, ("--collect-only",)))
    assert len(whole) == 7, whole
    parts = [_ids(_run(tmp_path, {}, SEVEN, ("--collect-only", "--part", f"{k}/3"))) for k in (1, 2, 3)]
    assert [i for part in parts for i in part] == whole, parts  # every test once, in the suite's order
    assert sorted(map(len, parts)) == [2, 2, 3], parts


@pytest.mark.parametrize("spec", ["3/2", "half"])
def test_a_bad_part_is_a_usage_error(tmp_path, spec):
    out = _run(tmp_path, {}, SEVEN, ("--part", spec))
    assert "--part wants K/N with 1 <= K <= N" in out and "passed" not in out, out
