"""--purlin-nccl-free on CPU with real sglang 0.5.23: the flag, the hooks in effect, the rank -> GPU mapping,
the backend choice, pynccl off and the V forms on purlin (two gloo ranks), the shipped YAML."""

import pytest

pytest.importorskip("sglang")
pytest.importorskip("sglang.srt.distributed.parallel_state")

import os  # noqa: E402

import _sglang_workers as W  # noqa: E402

from purlin_sglang.sglang import plugin, single_gpu  # noqa: E402
from purlin_sglang.testing import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def loaded():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return True


def parse(argv):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(["--model-path", "dummy", *argv])


def test_map_gpu_id():
    assert [single_gpu.map_gpu_id(g, 1) for g in range(4)] == [0, 0, 0, 0]
    assert [single_gpu.map_gpu_id(g, 2) for g in range(4)] == [0, 1, 0, 1]
    assert [single_gpu.map_gpu_id(g, 8) for g in range(4)] == [0, 1, 2, 3]  # ids that exist are kept
    assert [single_gpu.map_gpu_id(g, 3, base_gpu_id=1) for g in (1, 2, 3, 4)] == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="no GPU"):
        single_gpu.map_gpu_id(0, 0)
    with pytest.raises(ValueError, match="base-gpu-id"):
        single_gpu.map_gpu_id(3, 2, base_gpu_id=2)


def test_hooks_of_the_mode_are_in_effect(loaded):
    assert plugin.missing_hooks(plugin.NCCL_FREE_TARGETS) == []
    assert set(plugin.NCCL_FREE_TARGETS) - set(plugin.WORKER_TARGETS) == {
        "sglang.srt.utils.common.maybe_reindex_device_id",
        "sglang.srt.distributed.parallel_state.get_default_distributed_backend"}


def test_flag_and_yaml(loaded, monkeypatch):
    assert plugin.settings_of(parse([])).nccl_free is False
    sa = parse(["--purlin-nccl-free", "--tp-size", "2"])  # with the default backend: SGLang's paths on gloo
    assert plugin.settings_of(sa) == plugin.CommSettings("nccl", None, True)
    monkeypatch.chdir(ROOT)
    sa = parse(["--config", os.path.join(ROOT, "configs", "purlin-sglang-nccl-free.yaml")])
    assert plugin.settings_of(sa) == plugin.CommSettings(
        "purlin", os.path.join(ROOT, "configs", "purlin-nccl-free.yaml"), True)
    cfg = plugin.settings_of(sa).load_config()
    assert cfg.purlin.memory == "ipc" and cfg.report_interval_s == 10
    assert all(cfg.routing.route(op).max_bytes >= 1 << 30 for op in ("all_reduce", "all_gather", "reduce_scatter",
                                                                    "all_gather_v", "reduce_scatter_v", "all_to_all"))


def test_launcher_folds_rank_gpu_ids_onto_the_visible_gpus(loaded, monkeypatch):
    """The engine's own binding (sglang.srt.utils.maybe_reindex_device_id) is the hooked one."""
    import sglang.srt.utils as su

    monkeypatch.setattr(single_gpu, "_visible_gpus", lambda: 1)
    with plugin.activate("purlin", None, nccl_free=True):
        got = []
        for gpu_id in range(4):
            with su.maybe_reindex_device_id(gpu_id) as g:
                got.append(g)
    assert got == [0, 0, 0, 0]
    with plugin.activate("purlin", None):
        with su.maybe_reindex_device_id(3) as g:
            assert g == 3  # off by default


def test_pynccl_off_backend_gloo_and_v_forms_on_purlin(tmp_path):
    cfg = tmp_path / "purlin.yaml"
    cfg.write_text("timeout_s: 30\nstaging_bytes: 1048576\n")
    for f in launch(W.nccl_free_groups, 2, str(cfg), timeout_s=180):
        assert (f["backend_default"], f["backend_nccl_free"], f["backend_cpu"]) == ("nccl", "gloo", "gloo"), f
        assert f["ref"] == {"use_pynccl": False, "ca": False, "purlin": False}, f
        assert f["ref_gatherv"] != "ran", f  # SGLang's own all_gatherv needs pynccl
        assert f["purlin"] == {"use_pynccl": False, "ca": False, "purlin": True}, f
        assert f["gatherv_ok"] and f["scatterv_ok"], f
        assert f["routed"] == {"all_gather_v": 1, "reduce_scatter_v": 1}, f
