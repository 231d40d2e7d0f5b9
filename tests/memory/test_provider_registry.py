"""Provider names live in one place (memory/providers.py): config validation, the engines, the memory
package's GPU provider lookup, the CLI and the SGLang plugin all read that registry. No GPU needed."""

from __future__ import annotations

import pytest

import purlin_sglang as ps
from purlin_sglang import cli, engines, memory
from purlin_sglang.errors import PurlinConfigError, PurlinUnavailableError
from purlin_sglang.memory import providers
from purlin_sglang.routed import PluginConfig


def test_the_registry():
    assert providers.names() == ("ipc", "torch", "nvshmem", "loopback", "host")
    assert providers.choices() == ("auto",) + providers.names()
    assert providers.choices(groups=True) == ("auto", "ipc", "torch", "nvshmem", "host")
    assert providers.for_engine("cuda", virtual=False) == ("ipc", "torch", "nvshmem")
    assert providers.for_engine("cuda", virtual=True) == ("loopback",)
    assert providers.for_engine("cpu", virtual=False) == providers.for_engine("cpu", virtual=True) == ("host",)


@pytest.mark.parametrize("name", providers.choices())
def test_config_takes_every_provider(name):
    assert ps.PurlinConfig.from_dict({"memory": name}).memory == name


def test_config_refuses_other_names_and_lists_the_registry():
    with pytest.raises(PurlinConfigError) as info:
        ps.PurlinConfig.from_dict({"memory": "shm"})
    assert "key 'memory'" in str(info.value) and ", ".join(providers.choices()) in str(info.value)


def test_engines_run_on_the_registry_providers():
    for eng in engines.ENGINES:
        assert eng.memories == providers.for_engine(eng.name, virtual=False), eng.name
        assert eng.virtual_memories == providers.for_engine(eng.name, virtual=True), eng.name
    assert {n for e in engines.ENGINES for n in e.memories + e.virtual_memories} == set(providers.names())


def test_a_provider_of_another_engine_is_refused_with_its_owner():
    with pytest.raises(PurlinUnavailableError, match="the loopback provider belongs to the CUDA engine"):
        ps.run_virtual(1, lambda c: None, config={"memory": "loopback"})


def test_gpu_provider_classes_come_from_the_registry():
    assert memory.PROVIDERS == providers.choices()
    assert memory.DEVICE_PROVIDERS == providers.device_targets()
    assert set(memory.DEVICE_PROVIDERS) == {"ipc", "torch", "nvshmem"}
    for name in memory.DEVICE_PROVIDERS:
        assert memory.device_provider(name).provider == name  # each class carries its registry name
    with pytest.raises(PurlinUnavailableError, match="loopback"):
        memory.device_provider("loopback")  # built by run_virtual, not per rank


def test_cli_info_lists_every_provider(capsys):
    assert cli.main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("memory providers:"))
    for p in providers.PROVIDERS:
        assert f"{p.name} ({p.engine} engine" in line


def test_the_plugin_refuses_a_provider_that_serves_no_process_group():
    with pytest.raises(PurlinConfigError) as info:
        PluginConfig.from_dict({"memory": "loopback"}, source="--purlin-config x.yaml")
    msg = str(info.value)
    assert msg.startswith("--purlin-config x.yaml: key 'memory': 'loopback' serves virtual ranks")
    assert "auto, ipc, torch, nvshmem, host" in msg
    for name in providers.choices(groups=True):
        assert PluginConfig.from_dict({"memory": name}).purlin.memory == name
