"""Two gloo ranks build real SGLang GroupCoordinators; the hooked ops run on purlin's CPU engine."""

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang.srt.distributed.parallel_state")

import os  # noqa: E402

import _sglang_workers as W  # noqa: E402

from purlin_sglang.testing import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp_path, text: str) -> str:
    p = tmp_path / "purlin.yaml"
    p.write_text("timeout_s: 30\nstaging_bytes: 1048576\n" + text)
    return str(p)


def test_routed_ops_match_original_path(tmp_path):
    facts = launch(W.routed_collectives, 2, _config(tmp_path, ""), timeout_s=180)
    for f in facts:
        assert f["routed"] == {"all_reduce": 4, "all_gather": 2, "reduce_scatter": 1, "all_to_all": 1,
                               "all_gather_v": 4, "reduce_scatter_v": 1}, f
        assert set(f["fallbacks"]) == set(), f  # bypassed reference calls are not counted
        assert f["summary"].startswith("purlin[tp:0]: routed all_gather=2")


def test_fallback_paths_run_the_original(tmp_path):
    cfg = _config(tmp_path, "routing:\n  all_reduce: {max_bytes: 64}\n  all_gather: {enabled: false}\n")
    facts = launch(W.fallback_paths, 2, cfg, timeout_s=180)
    for f in facts:
        assert f["routed"] == {"all_reduce": 1}, f  # the small tensor
        assert f["fallbacks"] == {"all_reduce/size": 2, "all_reduce/dtype": 1, "all_reduce/not contiguous": 1,
                                  "all_gather/off": 1}, f


def test_nccl_default_leaves_sglang_unchanged():
    assert launch(W.nccl_unchanged, 2, timeout_s=180) == [{"ok": True}] * 2


def test_groups_outside_the_routing_table_get_no_purlin():
    assert launch(W.group_not_covered, 2, timeout_s=180) == [True, True]


def test_shipped_purlin_config_builds_a_group():
    """configs/purlin.yaml (a PurlinConfig file) is a valid --purlin-config."""
    facts = launch(W.routed_collectives, 2, os.path.join(ROOT, "configs", "purlin.yaml"), timeout_s=180)
    assert facts[0]["routed"]["all_reduce"] == 4
