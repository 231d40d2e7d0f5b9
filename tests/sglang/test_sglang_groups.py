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


def test_a_group_on_two_simulated_nodes_takes_the_two_level_path(tmp_path):
    cfg = _config(tmp_path, "topology:\n  node_of_rank: [0, 0, 1, 1]\n")
    facts = launch(W.routed_collectives, 4, cfg, timeout_s=300)
    for f in facts:
        assert f["communicator"] == "MultiNodeCommunicator", f
        assert f["routed"]["all_reduce"] >= 3 and f["routed"]["all_gather_v"] >= 1, f


def test_a_group_across_nodes_that_purlin_may_not_join_keeps_sglangs_path_counted_and_logged(tmp_path):
    cfg = _config(tmp_path, "topology:\n  node_of_rank: [0, 0, 1, 1]\n  inter_node: 'off'\n")
    facts = launch(W.spanning_group_kept_on_sglang, 4, cfg, timeout_s=300)
    for f in facts:
        assert f["disabled"] and f["unavailable"] == "spans nodes" and f["all_reduce_ok"], f
        assert f["fallbacks"] == {"group/spans nodes": 1}, f
        assert len(f["logged"]) == 1 and "topology.inter_node is 'off'" in f["logged"][0], f


def test_fallback_paths_run_the_original(tmp_path):
    cfg = _config(tmp_path, "routing:\n  all_reduce: {max_bytes: 64}\n  all_gather: {enabled: false}\n")
    facts = launch(W.fallback_paths, 2, cfg, timeout_s=180)
    for f in facts:
        assert f["routed"] == {"all_reduce": 1}, f  # the small tensor
        # Once per op call that ran the original path; _resolve_outplace_all_reduce_method is a query.
        assert f["fallbacks"] == {"all_reduce/size": 1, "all_reduce/dtype": 1, "all_reduce/not contiguous": 1,
                                  "all_gather/off": 1}, f


def test_nccl_default_leaves_sglang_unchanged():
    assert launch(W.nccl_unchanged, 2, timeout_s=180) == [{"ok": True}] * 2


def test_groups_outside_the_routing_table_get_no_purlin():
    assert launch(W.group_not_covered, 2, timeout_s=180) == [True, True]


def test_shipped_purlin_config_builds_a_group():
    """configs/purlin.yaml (a PurlinConfig file) is a valid --purlin-config."""
    facts = launch(W.routed_collectives, 2, os.path.join(ROOT, "configs", "purlin.yaml"), timeout_s=180)
    assert facts[0]["routed"]["all_reduce"] == 4


def test_competing_paths_switched_off_with_one_line_each(tmp_path):
    """With purlin: custom AR, mscclpp, torch symm-mem and FlashInfer fusion are off in the published
    config and in parallel_state's flags (read back), each said once per process; the group gets
    purlin and no custom AR. --enable-symm-mem (which would take every all-reduce) gets a warning."""
    facts = launch(W.conflicting_paths, 2, "purlin", _config(tmp_path, ""), timeout_s=180)
    for f in facts:
        assert f["leaves"] == {"disable_custom_all_reduce": True, "enable_mscclpp": False,
                               "enable_torch_symm_mem": False, "flashinfer_allreduce_fusion_backend": None}, f
        assert f["flags"] == dict.fromkeys(W.CONFLICT_FLAGS, False), f
        assert f["fusion_backend"] is None, f
        assert f["purlin"] == [True, True] and f["ca"] == [False, False], f
        assert f["override_sources"] == ["purlin_sglang (--comm-backend purlin)"], f
        info = [m for lvl, m in f["lines"] if lvl == "INFO" and "switched off" in m]
        assert len(info) == 4, f["lines"]
        for name in ("custom all-reduce", "mscclpp all-reduce", "torch symmetric-memory all-reduce",
                     "FlashInfer all-reduce fusion"):
            assert sum(m.startswith(f"purlin_sglang: {name} switched off") for m in info) == 1, (name, info)
        warn = [m for lvl, m in f["lines"] if lvl == "WARNING"]
        assert len(warn) == 1 and "--enable-symm-mem" in warn[0], f["lines"]
        groups = [m for _, m in f["lines"] if m.startswith("purlin_sglang: group ")]
        assert len(groups) == 2 and all("2 ranks on cpu through purlin" in m for m in groups), groups
        switch = [x for x in f["lines"] if not x[1].startswith("purlin_sglang: group ")]
        assert switch == [x for x in f["after_first"] if not x[1].startswith("purlin_sglang: group ")], \
            "the second group must not log the switch-off again"


def test_competing_paths_untouched_with_nccl(tmp_path):
    facts = launch(W.conflicting_paths, 2, "nccl", None, timeout_s=180)
    for f in facts:
        assert f["leaves"] == W.CONFLICT_LEAVES, f
        assert f["flags"] == dict.fromkeys(W.CONFLICT_FLAGS, True), f
        assert f["purlin"] == [False, False] and f["override_sources"] == [] and f["lines"] == [], f


def test_graph_capture_nesting_and_warm_up_rule(tmp_path):
    facts = launch(W.capture_paths, 2, _config(tmp_path, ""), timeout_s=180)
    ops = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v", "reduce_scatter_v")
    for f in facts:
        # purlin's capture() is entered inside SGLang's graph_capture, and left before it, also on error
        assert f["events"] == ["sglang enter", "purlin enter", "body", "purlin exit", "sglang exit",
                               "sglang enter", "purlin enter", "purlin exit", "sglang exit"], f["events"]
        assert f["depth_inside"] == 1 and f["after"]["depth"] == 0 and f["after"]["error_depth"] == 0, f
        assert f["after"]["ctx"] == "sglang-context", f
        # two warm-ups + one captured call per op, each correct; the captured one served by purlin
        assert f["checks"] == {op: [True, True, True] for op in ops}, f["checks"]
        assert f["captured"] == dict.fromkeys(ops, 1), f
        assert f["routed"] == {**dict.fromkeys(ops, 3), "all_reduce": 3 + 3}, f  # + 3 for the LRU check
        # not warmed up while capturing: the original path ran (correctly), or purlin declined
        assert f["not_warm"] == {"all_reduce": True, "all_gather": True, "resolve": None, "reduce_scatter": False,
                                 "all_to_all": False, "all_gather_v": "not warmed up"}, f["not_warm"]
        assert f["fallbacks"] == {f"{op}/not warmed up": 1
                                  for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}, f
        assert f["after"]["warm_lru"] == [False, True, True], f
        assert "captured in CUDA graphs: all_gather=1" in f["summary"], f["summary"]
