"""purlin as vLLM 0.33.0's expert-parallel MoE exchange, its graph-capture hook, its config hook and
vLLM's CLI, against vLLM's real code on CPU gloo ranks (the rank jobs run in the vLLM venv, as in
test_vllm_adapter.py).

The MoE layer is a real ``FusedMoEKernel`` with the prepare/finalize vLLM itself picks for TP-only EP,
swapped for purlin's by the ``moe_kernel`` hook, and experts written in torch (``TorchExperts`` in
_vllm_moe_job.py: vLLM's CPU experts need ``vllm._C``, which the CUDA wheel lacks). vLLM's own
``GroupCoordinator.graph_capture`` cannot run on this machine (it makes CUDA streams, and asserts a
CUDA communicator on the group), so the capture hook runs on the real TP coordinator with a stand-in
for vLLM's context."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_vllm_adapter import ROOT, run_job, vllm_python

MOE_JOB = Path(__file__).with_name("_vllm_moe_job.py")
CONFIG_JOB = Path(__file__).with_name("_vllm_config_job.py")
MOE_ON = {"purlin": {"staging_bytes": 1 << 20, "moe": {"dispatcher": "purlin"}}}


@pytest.fixture(scope="module")
def moe_facts():
    return run_job(2, MOE_ON, job=MOE_JOB)


@pytest.fixture(scope="module")
def config_facts():
    py = vllm_python()
    t0 = time.monotonic()
    r = subprocess.run([py, str(CONFIG_JOB)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}, cwd=str(ROOT))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    sys.stderr.write(f"vLLM config job: {time.monotonic() - t0:.1f} s\n")
    return json.loads(lines[-1][len("RESULT "):])


def test_the_ep_layer_over_purlin_equals_the_one_rank_layer_bitwise(moe_facts):
    for facts in moe_facts:
        # fp32 at 16 / 7 / 1 tokens, bf16 at 9, exact rows and fixed rows with padding; vs float64 too
        assert len(facts["checks"]) == 8 + 3 + 8 and all(facts["checks"].values()), facts["checks"]
        assert facts["tp_routed"].get("all_reduce", 0) >= 8, facts  # the runner's all-reduce: purlin, rank order


def test_the_hook_put_purlins_prepare_finalize_in_vllms_kernel(moe_facts):
    for facts in moe_facts:
        assert facts["vllm_picks"] == "MoEPrepareAndFinalizeNoDPEPModular", facts  # vLLM's choice for TP-only EP
        assert facts["prepare_finalize"] == "PurlinPrepareAndFinalize", facts  # ... replaced by the hook
        assert facts["calls"] == {"moe_dispatch": facts["expected_calls"], "moe_combine": facts["expected_calls"]}
        assert facts["report"] == {"replaced": 2,  # the fp32 and bf16 EP layers; the one-rank layers are kept
                                   "kept: expert parallelism is off (--enable-expert-parallel with TP > 1)": 2}
        assert facts["own_prepare_finalize"] == "MoEPrepareAndFinalizeNoDPEPModular"  # without the purlin key
        assert facts["output_is_reduced"] is False  # the runner's TP all-reduce completes the shard
        assert facts["ep_moe_comm"] == "Communicator" and facts["moe_comm_closed_by_destroy"], facts


def test_graph_capture_enters_purlins_context_for_tp_and_the_moe_exchange(moe_facts):
    for facts in moe_facts:
        assert facts["vllm_graph_capture_on_cpu"] != "ran", facts  # vLLM's own needs CUDA: a stand-in runs
        cap = facts["capture"]
        assert cap["vllm_entered"] and cap["ctx"] == "ctx", cap  # vLLM's context outside, its value passed on
        assert cap["depth_inside"] == 1 and cap["depth_after"] == 0, cap  # TP's routed communicator
        assert cap["moe_inside"] == 1 and cap["moe_exited"] == 1, cap  # the EP group's MoE communicator
        assert cap["captures"] == {"tp:0": 1, "ep:0": 1}, cap


def test_every_hook_is_applied_once_however_often_the_plugin_loads(moe_facts):
    for facts in moe_facts:
        assert facts["register_again"] is True and facts["missing"] == [], facts
        assert facts["wrapped_once"] == {"communicator_class": 1, "platform_config": 1, "graph_capture": 1,
                                         "moe_kernel": 1}, facts


def test_vllm_serve_help_lists_the_switch_purlin_uses(config_facts):
    help_ = config_facts["help"]
    assert help_["has_flag"] and help_["is_an_option"], help_
    assert config_facts["hooks_before_parser"] and help_["hooks_after_parser"] == [], config_facts  # the parser
    # loads the general plugins: purlin's start-up hooks are in effect once it is built


def test_purlin_turns_the_fused_allreduce_rmsnorm_pass_off(config_facts):
    assert config_facts["fuse"] == {"purlin": False, "without": True}, config_facts


def test_a_moe_dtype_vllm_does_not_serve_fails_at_config_time(config_facts):
    assert "purlin.moe.dtype: 'fp8' is not served under vLLM" in (config_facts["bad_moe_dtype"] or ""), config_facts
