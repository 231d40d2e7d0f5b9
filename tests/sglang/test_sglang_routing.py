"""The plugin's config and communicator without SGLang (these run in CI, where sglang is absent)."""

import os

import pytest

import _sglang_workers as W
from purlin_sglang.errors import PurlinConfigError
from purlin_sglang.sglang.routing import PluginConfig, RoutingTable
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
