"""The nvshmem provider on a GPU: two processes on ONE GPU (gloo group, unique-id bootstrap).

In the same two processes: an NvshmemWorkspace runs test_ipc_provider's data and flag checks
(``exercise``: zeroed, every rank's pattern read bitwise through the peer pointers, flag round trips,
close twice); then ``Communicator(None, "cuda", config={"memory": "nvshmem"})`` reuses the NVSHMEM
session (no second init) and its all_reduce and all_gather are bitwise the CPU engine's and the torch
reference's; then ``shutdown()`` frees the retired blocks and finalizes NVSHMEM. A second launch:
set-up failures on one rank raise on every rank at once, before NVSHMEM is touched, and a good
create still works afterwards (those processes exit without shutdown()).
"""

from __future__ import annotations

import os

import pytest
import torch

from purlin_sglang.testing.collectives import case  # noqa: E402
from _workers import mismatches_vs_cpu  # noqa: E402
from test_ipc_provider import _attempt, check_results, exercise, make_layout, setup_failures_worker  # noqa: E402

from purlin_sglang.memory.nvshmem import nvshmem_status  # noqa: E402
from purlin_sglang.testing import launch  # noqa: E402

_WHY = nvshmem_status()["reason"]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(bool(_WHY), reason=f"NVSHMEM is not usable in this installation: {_WHY}"),
]
ENV = {"NCCL_NVLS_ENABLE": "0", "CUDA_MODULE_LOADING": "EAGER"}
STAGING = 1 << 20


def _cases(seed: int) -> list[dict]:
    return [
        case("all_reduce", torch.float32, rows=3, width=5, seed=seed),
        case("all_reduce", torch.bfloat16, rows=64, width=33, seed=seed + 1),          # one-shot
        case("all_reduce", torch.bfloat16, rows=2048, width=129, seed=seed + 2),       # two-shot (528 KB)
        case("all_reduce", torch.float16, rows=7, width=3, op="max", seed=seed + 3),   # odd bytes
        case("all_gather", torch.float32, rows=3, width=5, seed=seed + 4),
        case("all_gather", torch.uint8, rows=3 * STAGING // 2, width=None, seed=seed + 5),  # > staging
    ]


def _worker(rank, world, seed):
    import torch.distributed as dist

    import purlin_sglang as ps
    from purlin_sglang.memory import nvshmem as nv

    torch.cuda.set_device(0)
    out = {}
    # 1. The workspace alone, with the CUDA engine's layout.
    layout, nbytes = make_layout(world)
    ws = nv.NvshmemWorkspace.create(nbytes, None, 0, rank, world, layout=layout)
    assert ws.layout is layout and ws.provider == "nvshmem" and ws.device_index == 0
    session = nv._SESSION
    out["peers"] = list(session.peers)
    out["nvls_env"] = os.environ.get("NVSHMEM_DISABLE_NVLS")
    out["exercise"] = exercise(ws, rank, world, seed)  # closes ws

    # 2. A communicator over the same processes: the same NVSHMEM session, bitwise the CPU engine.
    cfg = {"memory": "nvshmem", "staging_bytes": STAGING, "timeout_s": 30}
    cuda = ps.Communicator(None, "cuda", config=cfg)
    cpu = ps.Communicator(None, "cpu", config={"staging_bytes": STAGING, "timeout_s": 30})
    out["same_session"] = nv._SESSION is session
    out["comm"] = {"engine": cuda.engine_name, "memory": cuda.memory, "hbm": cuda.hbm_bytes}
    out["bad"] = mismatches_vs_cpu(cuda, cpu, _cases(seed), rank, world)
    dist.barrier()  # no peer still reads my memory (close is local)
    cuda.close()
    cpu.close()
    out["retired"] = len(session.retired)
    # 3. Collective teardown: the retired blocks are freed, then NVSHMEM is finalized.
    out["finalized"] = nv.shutdown()
    out["after"] = _attempt(lambda: nv.NvshmemWorkspace.create(nbytes, None, 0, rank, world))[:2]
    return out


def test_nvshmem_two_processes_one_gpu_workspace_then_communicator():
    world = 2
    seed = int.from_bytes(os.urandom(3), "little")
    results = launch(_worker, world, seed, timeout_s=240, env=ENV)
    check_results([r["exercise"] for r in results], world, make_layout(world)[1])
    for rank, res in enumerate(results):
        assert res["peers"] == results[0]["peers"] and len(res["peers"]) == world, res["peers"]
        assert res["nvls_env"] == "1"
        assert res["same_session"], "the communicator initialised NVSHMEM a second time"
        assert res["comm"]["engine"] == "cuda" and res["comm"]["memory"] == "nvshmem", res["comm"]
        assert res["comm"]["hbm"] > STAGING, res["comm"]
        assert res["bad"] == [], f"seed {seed} rank {rank}:\n" + "\n".join(res["bad"])
        assert res["retired"] == 1, res["retired"]  # the communicator's (the first was freed at its set-up)
        assert res["finalized"] is True
        kind, msg = res["after"]
        assert kind == "PurlinUnavailableError" and "finalized" in msg, msg
    print(f"nvshmem one_gpu: round trip {[round(r['exercise']['round_trip_ms'], 3) for r in results]} ms")


def test_nvshmem_setup_failure_raises_everywhere_quickly():
    # bad_device: refused on rank 1 before NVSHMEM starts; too_big: refused on rank 0 before nvshmem_malloc;
    # NVSHMEM starts at the good create after the failures (the processes exit without shutdown()).
    results = launch(setup_failures_worker, 2, "nvshmem", timeout_s=120, env=ENV)
    for rank, res in enumerate(results):
        kind, msg, elapsed = res["bad_device"]
        assert kind == "PurlinUnavailableError" and "rank 1:" in msg and "device_index=99" in msg, msg
        assert elapsed < 10, (rank, elapsed)
        kind, msg, elapsed = res["too_big"]
        assert kind == "PurlinUnavailableError" and "rank 0:" in msg and "bytes free" in msg, msg
        assert elapsed < 10, (rank, elapsed)
        assert res["after"] == 2
