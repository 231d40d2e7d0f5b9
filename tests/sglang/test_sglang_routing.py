"""The plugin's config and communicator without SGLang (these run in CI, where sglang is absent)."""

import os

import pytest

import _sglang_workers as W
from purlin_sglang.errors import PurlinConfigError
from purlin_sglang.routed import PluginConfig, RoutingTable, for_deterministic_inference
from purlin_sglang.sglang.routing import deterministic_inference
from purlin_sglang.testing import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_shipped_purlin_yaml_is_a_plugin_config():
    cfg = PluginConfig.from_yaml(os.path.join(ROOT, "configs", "purlin.yaml"))
    assert cfg.purlin.timeout_s == 60 and cfg.routing == RoutingTable()


def test_routing_table_keys_and_defaults():
    cfg = PluginConfig.from_dict({"timeout_s": 5, "routing": {"all_gather": {"enabled": False}, "groups": ["tp"]}})
    assert cfg.purlin.timeout_s == 5
    assert not cfg.routing.route("all_gather").admits(16) and cfg.routing.route("all_reduce").admits(16)
    assert cfg.routing.covers("tp") and not cfg.routing.covers("pp")
    assert PluginConfig.from_dict({"routing": {"groups": None}}).routing.covers("world")
    with pytest.raises(PurlinConfigError, match="routing.all_reduce.max_bytes"):
        PluginConfig.from_dict({"routing": {"all_reduce": {"max_bytes": -1}}})
    with pytest.raises(PurlinConfigError, match="unknown key 'routing.broadcast'"):
        PluginConfig.from_dict({"routing": {"broadcast": {}}})
    with pytest.raises(PurlinConfigError, match="unknown key 'staging'"):
        PluginConfig.from_dict({"staging": 1})


def test_group_communicator_convention():
    facts = launch(W.communicator_alone, 2, timeout_s=120)
    for f in facts:
        assert f["fallbacks"] == {"all_reduce/size": 1, "all_gather/shape": 1}, f
        assert "routed all_gather=1, all_reduce=1" in f["summary"], f


def test_deterministic_inference_widens_the_reduce_routes_only(monkeypatch):
    table = PluginConfig.from_dict({"routing": {"all_reduce": {"min_bytes": 8, "max_bytes": 1024},
                                                "reduce_scatter_v": {"enabled": False}}}).routing
    wide, notes = for_deterministic_inference(table)
    for op in ("all_reduce", "reduce_scatter"):
        assert wide.route(op).admits(0) and wide.route(op).admits(1 << 40), op
    assert not wide.route("reduce_scatter_v").enabled and any("reduce_scatter_v stays off" in n for n in notes)
    assert wide.route("all_gather") == table.route("all_gather") and not wide.route("all_gather").admits(1 << 40)
    assert any(n.startswith("all_reduce every size (was 8..1024") for n in notes)
    for value, on in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", value)
        assert deterministic_inference() is on


def test_group_communicator_keeps_reductions_on_purlin_under_deterministic_inference():
    facts = launch(W.communicator_deterministic, 2, timeout_s=120)
    for f in facts:
        assert f["fallbacks"] == {"all_gather/size": 1}, f
        assert f["reduce_scatter_v"] is False, f
