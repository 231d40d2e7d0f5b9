"""The framework-neutral routed communicator (purlin_sglang.routed): no framework imported, the
routing table and its counters, the deterministic mode as an argument, config errors naming the
caller's flag. The SGLang adapter's own tests (tests/sglang) run through it too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import _routed_workers as W
import purlin_sglang.routed as routed
from purlin_sglang.errors import PurlinConfigError
from purlin_sglang.routed import PluginConfig
from purlin_sglang.testing import launch

FRAMEWORKS = ("sglang", "vllm", "purlin_sglang.sglang")


def test_the_routed_layer_imports_no_framework():
    for path in sorted(Path(routed.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if isinstance(node, ast.ImportFrom) and node.level:
                names = ["purlin_sglang." * (node.level == 2) + (node.module or "")]
            for n in names:
                assert not any(n == f or n.startswith(f + ".") for f in FRAMEWORKS), (path.name, n)


@pytest.mark.parametrize("deterministic", [False, True])
def test_routes_counts_and_the_deterministic_mode(deterministic):
    facts = launch(W.convention, 2, deterministic, timeout_s=120)
    for f in facts:
        # deterministic: every enabled reduction on purlin at every size; the copy ops keep their bounds
        assert f["served_big"] is deterministic, f
        want = {"all_gather/size": 1} if deterministic else {"all_gather/size": 1, "all_reduce/size": 1}
        assert f["fallbacks"] == want, f
        assert f"routed all_reduce={2 if deterministic else 1}" in f["summary"], f


def test_config_errors_name_the_callers_flag(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("routing:\n  all_reduce:\n    max_byte: 4\n")
    with pytest.raises(PurlinConfigError, match=r"^--my-flag .*bad.yaml: unknown key 'routing.all_reduce.max_byte'"):
        PluginConfig.from_yaml(bad, flag="--my-flag")
    with pytest.raises(PurlinConfigError, match=r"^config .*bad.yaml"):
        PluginConfig.from_yaml(bad)
