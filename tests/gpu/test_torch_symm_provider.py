"""The torch provider (torch.distributed._symmetric_memory) on GPUs, as far as the machine allows.

Same checks as the ipc provider (tests/gpu/test_ipc_provider.py). PyTorch's symmetric memory may
refuse two processes on one GPU; where it does, the one-GPU test skips with PyTorch's own message
(as observed), also with PyTorch's TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1; with one GPU per
rank it must work.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from purlin_sglang.testing import launch
from test_ipc_provider import _attempt, check_results, exercise, make_layout

pytestmark = pytest.mark.gpu

ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0"}


def _torch_worker(rank, world, seed, placement):
    from purlin_sglang.errors import PurlinUnavailableError
    from purlin_sglang.memory.torch_symm import TorchSymmWorkspace

    dev = rank % torch.cuda.device_count() if placement == "per_rank_gpu" else 0
    torch.cuda.set_device(dev)
    layout, nbytes = make_layout(world)
    t0 = time.monotonic()
    try:
        ws = TorchSymmWorkspace.create(nbytes, None, dev, rank, world, layout=layout)
    except PurlinUnavailableError as e:
        return {"unavailable": str(e), "elapsed": time.monotonic() - t0}
    assert ws.layout is layout and ws.provider == "torch"
    return exercise(ws, rank, world, seed)


# one_gpu: PyTorch's defaults; one_gpu_overlap: two ranks on one GPU with PyTorch's own switch
# TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (multicast, which it then skips, is off here anyway).
PLACEMENTS = {
    "one_gpu": {},
    "one_gpu_overlap": {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"},
    "per_rank_gpu": {},
}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_torch_symm_two_processes_share_memory(placement):
    if placement == "per_rank_gpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one per rank)")
    if placement == "one_gpu" and os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"):
        pytest.skip("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES is set in this environment")
    world = 2
    seed = int.from_bytes(os.urandom(4), "little")
    results = launch(_torch_worker, world, seed, placement, timeout_s=90, env={**ENV, **PLACEMENTS[placement]})
    refused = [r.get("unavailable") for r in results if "unavailable" in r]
    if refused:
        assert len(refused) == world, f"only some ranks refused: {results}"  # set-up is agreed on
        assert all(r["elapsed"] < 60 for r in results), results
        if placement != "per_rank_gpu":
            pytest.skip(f"torch symmetric memory refuses two processes on one GPU here: {refused[0]}")
        pytest.fail(f"torch symmetric memory failed with one GPU per rank: {refused[0]}")
    check_results(results, world, make_layout(world)[1])
    print(f"torch {placement}: round trip {[round(r['round_trip_ms'], 3) for r in results]} ms")


def _torch_failure_worker(rank, world):
    from purlin_sglang.memory.torch_symm import TorchSymmWorkspace

    torch.cuda.set_device(0)
    return _attempt(lambda: TorchSymmWorkspace.create(1 << 20, None, 99 if rank == 1 else 0, rank, world))


def test_torch_symm_setup_failure_raises_everywhere_quickly():
    results = launch(_torch_failure_worker, 2, timeout_s=120, env=ENV)
    for rank, (kind, msg, elapsed) in enumerate(results):
        assert kind == "PurlinUnavailableError" and "rank 1:" in msg and "device_index=99" in msg, msg
        assert elapsed < 10, (rank, elapsed)
