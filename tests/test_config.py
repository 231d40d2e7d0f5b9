"""PurlinConfig: defaults, YAML, rejection of unknown keys and bad values (naming the key), and how
the config reaches run_virtual / Communicator (as a dict too), incl. providers this machine lacks."""

import os
from pathlib import Path
from datetime import timedelta

import pytest
import torch

import purlin_sglang as ps
from purlin_sglang import PurlinConfig
from purlin_sglang.errors import PurlinConfigError, PurlinUnavailableError, PurlinValueError
from purlin_sglang.snac.policy import TuningPolicy

MiB = 1 << 20


def test_defaults():
    c = PurlinConfig()
    assert c.timeout_s == 60
    assert c.staging_bytes == 64 * MiB
    assert c.memory == "auto"
    assert c.deterministic is True
    assert c.tuning.algorithm == "auto" and c.tuning.slots == 2
    assert PurlinConfig.from_dict(None) == c == PurlinConfig.from_dict({})


def test_frozen():
    with pytest.raises(Exception):
        PurlinConfig().timeout_s = 3


def test_from_yaml(tmp_path):
    p = tmp_path / "purlin.yaml"
    p.write_text("timeout_s: 2.5\nstaging_bytes: 8192\nmemory: host\ndeterministic: true\n"
                 "tuning:\n  algorithm: twoshot\n  slots: 4\n")
    c = PurlinConfig.from_yaml(p)
    assert (c.timeout_s, c.staging_bytes, c.memory) == (2.5, 8192, "host")
    assert (c.tuning.algorithm, c.tuning.slots) == ("twoshot", 4)
    assert PurlinConfig.from_yaml(str(p)) == c
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert PurlinConfig.from_yaml(empty) == PurlinConfig()


@pytest.mark.parametrize("data,key", [
    ({"timeout": 5}, "timeout"),
    ({"staging": 4096}, "staging"),
    ({"tuning": {"algo": "oneshot"}}, "tuning.algo"),
])
def test_unknown_keys_are_rejected_by_name(data, key):
    with pytest.raises(PurlinConfigError) as info:
        PurlinConfig.from_dict(data)
    assert f"unknown key '{key}'" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_key_in_yaml_names_the_file_and_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("timeout_s: 5\nstaging-bytes: 4096\n")
    with pytest.raises(PurlinConfigError) as info:
        PurlinConfig.from_yaml(p)
    assert "unknown key 'staging-bytes'" in str(info.value) and str(p) in str(info.value)


@pytest.mark.parametrize("data,key", [
    ({"timeout_s": -1}, "timeout_s"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": "soon"}, "timeout_s"),
    ({"memory": "foo"}, "memory"),
    ({"staging_bytes": 10}, "staging_bytes"),
    ({"staging_bytes": -4096}, "staging_bytes"),
    ({"staging_bytes": "lots"}, "staging_bytes"),
    ({"deterministic": "maybe"}, "deterministic"),
    ({"tuning": {"slots": 0}}, "tuning.slots"),
    ({"tuning": {"algorithm": "threeshot"}}, "tuning.algorithm"),
    ({"tuning": {"oneshot_max_bytes": -1}}, "tuning.oneshot_max_bytes"),
    ({"tuning": {"max_chunk_bytes": 1}}, "tuning.max_chunk_bytes"),
    ({"tuning": 3}, "tuning"),
])
def test_bad_values_are_rejected_naming_the_key(data, key):
    with pytest.raises(PurlinConfigError) as info:
        PurlinConfig.from_dict(data)
    assert f"key '{key}'" in str(info.value), str(info.value)


@pytest.mark.parametrize("make,says", [
    (lambda: PurlinConfig(timout_s=3), ["PurlinConfig: unknown key 'timout_s'", "did you mean 'timeout_s'?",
                                        "known keys: timeout_s, staging_bytes"]),
    (lambda: PurlinConfig(timeout_s="soon"), ["PurlinConfig: key 'timeout_s'", "valid number", "'soon'"]),
    (lambda: PurlinConfig(memory="gpu"), ["key 'memory'", "ipc", "host", "(got 'gpu')"]),
    (lambda: PurlinConfig(tuning={"algo": "oneshot"}), ["unknown key 'tuning.algo'", "did you mean 'algorithm'?"]),
    (lambda: PurlinConfig(moe={"dtype": "fp16"}), ["key 'moe.dtype'", "'bf16'", "'fp8'"]),
    (lambda: TuningPolicy(slot=3), ["TuningPolicy: unknown key 'slot'", "did you mean 'slots'?"]),
    (lambda: PurlinConfig(colour="red"), ["unknown key 'colour' (known keys: timeout_s"]),  # nothing close
])
def test_the_constructors_raise_config_errors_naming_the_key(make, says):
    with pytest.raises(PurlinConfigError) as info:
        make()
    msg = str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in msg and "pydantic" not in msg, msg
    for text in says:
        assert text in msg, msg


def test_a_misspelt_key_in_a_file_gets_a_suggestion(tmp_path):
    p = tmp_path / "typo.yaml"
    p.write_text("timeout_s: 5\ntuning:\n  slot: 4\n")
    with pytest.raises(PurlinConfigError, match=r"unknown key 'tuning.slot' \(did you mean 'slots'\?") as info:
        PurlinConfig.from_yaml(p)
    assert str(p) in str(info.value)


def test_a_constructed_config_equals_the_one_read_and_refuses_assignment_with_a_config_error():
    c = PurlinConfig(timeout_s=3, tuning=TuningPolicy(slots=4), moe={"dtype": "bf16"})
    assert c == PurlinConfig.from_dict({"timeout_s": 3, "tuning": {"slots": 4}, "moe": {"dtype": "bf16"}})
    with pytest.raises(PurlinConfigError, match=r"key 'timeout_s' cannot be set.*config.replace\(timeout_s=\.\.\.\)"):
        c.timeout_s = 5
    with pytest.raises(PurlinConfigError, match="TuningPolicy is frozen"):
        c.tuning.slots = 8
    assert (c.timeout_s, c.tuning.slots) == (3, 4) and c.replace(timeout_s=5).timeout_s == 5


def test_several_bad_keys_are_all_named():
    with pytest.raises(PurlinConfigError) as info:
        PurlinConfig.from_dict({"timeout_s": -1, "memory": "foo", "colour": "red"})
    msg = str(info.value)
    assert "'timeout_s'" in msg and "'memory'" in msg and "'colour'" in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n", "just a string\n"])
def test_yaml_that_is_not_a_mapping(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(PurlinConfigError, match="expected a mapping") as info:
        PurlinConfig.from_yaml(p)
    assert str(p) in str(info.value)


def test_invalid_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("timeout_s: [1, 2\n")
    with pytest.raises(PurlinConfigError, match="not valid YAML"):
        PurlinConfig.from_yaml(p)


def test_unreadable_files(tmp_path):
    with pytest.raises(PurlinConfigError, match="cannot read") as info:
        PurlinConfig.from_yaml(tmp_path / "missing.yaml")
    assert "missing.yaml" in str(info.value)
    with pytest.raises(PurlinConfigError, match="cannot read"):
        PurlinConfig.from_yaml(tmp_path)  # a directory
    if os.geteuid() != 0:  # root reads anything
        p = tmp_path / "locked.yaml"
        p.write_text("timeout_s: 1\n")
        p.chmod(0)
        with pytest.raises(PurlinConfigError, match="cannot read"):
            PurlinConfig.from_yaml(p)


def test_replace_validates():
    c = PurlinConfig().replace(timeout_s=3)
    assert c.timeout_s == 3 and c.staging_bytes == 64 * MiB
    with pytest.raises(PurlinConfigError, match="'staging_bytes'"):
        PurlinConfig().replace(staging_bytes=1)


def test_config_as_dict_reaches_run_virtual():
    cfg = {"staging_bytes": 8192, "timeout_s": 7, "tuning": {"algorithm": "twoshot"}}

    def fn(comm):
        return comm.config, comm.workspace_bytes, comm.all_reduce(torch.ones(4) * (comm.rank + 1)).tolist()

    res = ps.run_virtual(2, fn, config=cfg)
    for c, ws, out in res:
        assert isinstance(c, PurlinConfig) and c.staging_bytes == 8192 and c.timeout_s == 7
        assert c.tuning.algorithm == "twoshot"
        assert 2 * 8192 <= ws < 2 * 8192 + 64 * 1024  # the staging size is what was asked for
        assert out == [3.0] * 4
    same = ps.run_virtual(2, fn, config=PurlinConfig.from_dict(cfg))
    assert [r[0] for r in same] == [r[0] for r in res]


@pytest.mark.parametrize("bad", [["timeout_s", 1], 5, 2.5])
def test_config_of_the_wrong_type(bad):
    with pytest.raises(PurlinConfigError, match="config must be a PurlinConfig, a dict, the path of a YAML file or None"):
        ps.run_virtual(1, lambda c: None, config=bad)


def test_config_given_as_the_path_of_a_yaml_file(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("timeout_s: 7\nstaging_bytes: 8192\n")
    for cfg in (str(f), f):
        got = ps.run_virtual(2, lambda c: (c.config.timeout_s, c.config.staging_bytes), config=cfg)
        assert got == [(7.0, 8192)] * 2
    with pytest.raises(PurlinConfigError, match=r"config 'timeout_s: 1': no such file; a string config is the path"):
        ps.run_virtual(1, lambda c: None, config="timeout_s: 1")  # YAML text is not a path
    (tmp_path / "bad.yaml").write_text("timeout_s: -1\n")
    with pytest.raises(PurlinConfigError, match="timeout_s"):
        ps.run_virtual(1, lambda c: None, config=tmp_path / "bad.yaml")


def test_bad_config_dict_in_run_virtual_names_the_key():
    with pytest.raises(PurlinConfigError, match="key 'timeout_s'"):
        ps.run_virtual(2, lambda c: None, config={"timeout_s": -5})


@pytest.mark.parametrize("memory", ["ipc", "nvshmem", "torch", "loopback"])
def test_gpu_memory_providers_on_cpu_are_unavailable(memory):
    with pytest.raises(PurlinUnavailableError) as info:
        ps.run_virtual(1, lambda c: None, config={"memory": memory})
    msg = str(info.value)
    assert f"memory={memory!r}" in msg and "host" in msg and "CUDA engine" in msg
    assert isinstance(info.value, RuntimeError)


def test_host_memory_explicitly():
    assert ps.run_virtual(2, lambda c: (c.memory, c.engine_name), config={"memory": "host"}) == [("host", "cpu")] * 2
    assert ps.run_virtual(1, lambda c: c.memory, config={"staging_bytes": 4096}) == ["host"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_device_without_gpu_is_unavailable_and_says_why(device):
    with pytest.raises(PurlinUnavailableError) as info:
        ps.run_virtual(2, lambda c: None, device=device)
    msg = str(info.value)
    assert "no CUDA GPU is visible" in msg and "CUDA engine" in msg, msg


@pytest.fixture
def single_process_group(tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_communicator_takes_a_config_dict(single_process_group):
    with ps.Communicator(config={"staging_bytes": 4096, "timeout_s": 3}) as comm:
        assert comm.config.staging_bytes == 4096 and comm.config.timeout_s == 3
        assert (comm.rank, comm.world_size) == (0, 1)
        x = torch.randn(5, 3)
        assert torch.equal(comm.all_reduce(x), x)
        assert torch.equal(comm.all_gather(x), x)


def test_communicator_rejects_bad_configs_and_providers(single_process_group):
    with pytest.raises(PurlinConfigError, match="unknown key 'timeoutt'"):
        ps.Communicator(config={"timeoutt": 3})
    with pytest.raises(PurlinUnavailableError, match="memory='ipc'"):
        ps.Communicator(config={"memory": "ipc"})
    if not torch.cuda.is_available():
        with pytest.raises(PurlinUnavailableError, match="no CUDA GPU is visible"):
            ps.Communicator(device="cuda")


def test_communicator_without_torch_distributed():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(PurlinValueError, match="torch.distributed is not initialized.*run_virtual"):
        ps.Communicator(config={"staging_bytes": 4096})


def test_plugin_config_is_parsed_once_per_process_and_again_when_the_file_changes(tmp_path, monkeypatch):
    from purlin_sglang import routed
    from purlin_sglang.sglang import settings

    path = tmp_path / "purlin.yaml"
    path.write_text("timeout_s: 7\n")
    parsed = []
    real = routed.PluginConfig.from_yaml.__func__

    def counting(cls, p, **kw):
        parsed.append(p)
        return real(cls, p, **kw)

    monkeypatch.setattr(routed.PluginConfig, "from_yaml", classmethod(counting))
    first = settings.CommSettings("purlin", str(path)).load_config()
    again = [settings.CommSettings("purlin", str(path)).load_config() for _ in range(3)]  # e.g. one per group
    assert first.purlin.timeout_s == 7 and all(c is first for c in again) and len(parsed) == 1
    path.write_text("timeout_s: 9.5\n")  # another size (and mtime): read again
    assert settings.load_plugin_config(str(path)).purlin.timeout_s == 9.5 and len(parsed) == 2
    path.unlink()
    with pytest.raises(PurlinConfigError, match="cannot read"):
        settings.load_plugin_config(str(path))


def test_every_timeout_comes_from_timeout_s():
    from purlin_sglang.config import timeouts

    t = PurlinConfig(timeout_s=2.5).timeouts
    assert t == timeouts(2.5)
    assert (t.call_s, t.kernel_ns, t.setup_s, t.destroy_s, t.join_s) == (2.5, 2_500_000_000, 2.5, 2.5, 70.0)
    assert timeouts(0.25).destroy_s == 1.0  # the plugin's destroy barrier waits at least a second


def test_the_shipped_config_file_lists_every_key_at_its_default():
    # configs/purlin.yaml is the README's "every default": each key of PurlinConfig, no other, each
    # at the value the class defaults to
    import yaml

    path = Path(__file__).resolve().parents[1] / "configs" / "purlin.yaml"
    data = yaml.safe_load(path.read_text())

    def keys(d, prefix=""):
        out = set()
        for k, v in d.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
        return out

    default = PurlinConfig().model_dump()
    assert keys(data) == keys(default)
    assert PurlinConfig.from_yaml(path) == PurlinConfig()
