"""The ipc and torch providers without a GPU: imports, error paths, protocol conformance, set-up protocol.

The ipc set-up protocol (status all-gathers, handle exchange, peer access, clean-up on failure) runs
here over two real gloo ranks with a fake cuda-python runtime, so every failure path is exercised on
CPU; the real CUDA path is tests/gpu/test_ipc_provider.py. One launch runs every scenario (spawned
processes cost seconds each on a small machine).
"""

from __future__ import annotations

import subprocess
import sys
import time
import types

import pytest
import torch

from _fakes import FakeCudart
from purlin_sglang import memory
from purlin_sglang.errors import PurlinClosedError, PurlinUnavailableError, PurlinValueError
from purlin_sglang.memory import ipc, torch_symm
from purlin_sglang.memory.device import DeviceWorkspace
from purlin_sglang.testing import launch

NBYTES = 1 << 16


def _attempt(fn):
    t0 = time.monotonic()
    try:
        value = fn()
        return ("ok", value, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the parent checks the type and text
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _ipc_scenarios(rank, world):
    """Every ipc set-up scenario with the fake runtime, in the same order on every rank."""
    import purlin_sglang.memory.ipc as ipc_mod

    out = {}

    def create(fake, nbytes=NBYTES, device_index=0, r=rank, w=world, layout=None):
        ipc_mod.load_cudart = lambda: fake
        return ipc_mod.IpcWorkspace.create(nbytes, None, device_index, r, w, layout=layout)

    # 1. Same GPU: own pointer for me, opened pointers for peers, no peer access calls; close twice.
    fake = FakeCudart(rank)
    marker = object()
    ws = create(fake, layout=marker)
    own = 0x7F0000000000 + (rank << 32)
    out["same_gpu"] = {
        "ptrs": ws.base_ptrs, "own": own, "hbm": ws.hbm_bytes, "layout_kept": ws.layout is marker,
        "conforms": isinstance(ws, DeviceWorkspace), "provider": ws.provider,
        "peer_calls": [c for c in fake.calls if "Peer" in c],
    }
    ws.close()
    n_calls = len(fake.calls)
    ws.close()
    out["same_gpu"].update(
        after_close_live=sorted(fake.live), after_close_opened=sorted(fake.opened), hbm_closed=ws.hbm_bytes,
        second_close_calls=len(fake.calls) - n_calls, ptrs_closed=_attempt(lambda: ws.base_ptrs)[0],
    )

    # 2. Different GPUs: peer access is enabled (already-enabled is not an error, and gets cleared).
    fake = FakeCudart(rank, devices=2, bus=[0x10, 0x20], already_enabled=True)
    ws = create(fake, device_index=rank)
    out["two_gpus"] = {"calls": list(fake.calls), "ptrs": ws.base_ptrs}
    ws.close()

    # 3. No P2P between the GPUs on rank 0 only: both raise; rank 1 unmaps what it opened and frees.
    fake = FakeCudart(rank, devices=2, bus=[0x10, 0x20], can_access=0 if rank == 0 else 1)
    out["no_p2p"] = _attempt(lambda: create(fake, device_index=rank)) + (sorted(fake.live), sorted(fake.opened))

    # 4. cudaMalloc fails on rank 1: both raise at once; rank 0 frees its allocation.
    fake = FakeCudart(rank, fail={"cudaMalloc": 2} if rank == 1 else {})
    out["malloc_fails"] = _attempt(lambda: create(fake)) + (sorted(fake.live),)

    # 5. An invalid device on rank 1 (cudaSetDevice fails).
    fake = FakeCudart(rank)
    out["bad_device"] = _attempt(lambda: create(fake, device_index=7 if rank == 1 else 0)) + (sorted(fake.live),)

    # 6. Ranks disagree on the size.
    fake = FakeCudart(rank)
    out["size_mismatch"] = _attempt(lambda: create(fake, nbytes=NBYTES * (rank + 1))) + (sorted(fake.live),)

    # 7. Bad arguments on one rank only: every rank raises PurlinValueError, nobody hangs.
    fake = FakeCudart(rank)
    out["bad_nbytes"] = _attempt(lambda: create(fake, nbytes=0 if rank == 1 else NBYTES)) + (sorted(fake.live),)
    fake = FakeCudart(rank)
    out["bad_rank"] = _attempt(lambda: create(fake, r=1 - rank)) + (sorted(fake.live),)
    fake = FakeCudart(rank)
    out["bad_world"] = _attempt(lambda: create(fake, w=3)) + (sorted(fake.live),)
    fake = FakeCudart(rank)
    out["bool_nbytes"] = _attempt(lambda: create(fake, nbytes=True)) + (sorted(fake.live),)

    # 8. cudaIpcOpenMemHandle fails on rank 0: rank 1 closes its mapping and frees.
    fake = FakeCudart(rank, fail={"cudaIpcOpenMemHandle": 201} if rank == 0 else {})
    out["open_fails"] = _attempt(lambda: create(fake)) + (sorted(fake.live), sorted(fake.opened))

    # 9. The real cuda-python on this machine (no GPU expected): a clear PurlinUnavailableError on both.
    ipc_mod.load_cudart = _REAL_LOAD
    if not torch.cuda.is_available():
        out["real_no_gpu"] = _attempt(lambda: ipc_mod.IpcWorkspace.create(NBYTES, None, 0, rank, world))

    # 10. The torch provider on this machine, and with the API missing.
    import purlin_sglang.memory.torch_symm as ts

    if not torch.cuda.is_available():
        out["torch_no_gpu"] = _attempt(lambda: ts.TorchSymmWorkspace.create(NBYTES, None, 0, rank, world))
    saved = sys.modules.get(ts._MODULE)
    try:
        sys.modules[ts._MODULE] = types.ModuleType(ts._MODULE)  # a torch whose module lacks the API
        sys.modules[ts._MODULE].empty = lambda *a, **k: None
        out["torch_no_rendezvous"] = _attempt(lambda: ts.TorchSymmWorkspace.create(NBYTES, None, 0, rank, world))
        sys.modules[ts._MODULE] = None  # a torch without the module
        out["torch_no_module"] = _attempt(lambda: ts.TorchSymmWorkspace.create(NBYTES, None, 0, rank, world))
    finally:
        if saved is None:
            sys.modules.pop(ts._MODULE, None)
        else:
            sys.modules[ts._MODULE] = saved
    return out


_REAL_LOAD = ipc.load_cudart


@pytest.fixture(scope="module")
def scenarios():
    return launch(_ipc_scenarios, 2, timeout_s=120)


def test_same_gpu_maps_peers_and_close_is_idempotent(scenarios):
    for rank, res in enumerate(scenarios):
        s = res["same_gpu"]
        own = [0x7F0000000000 + (r << 32) for r in range(2)]
        assert s["ptrs"] == [own[r] if r == rank else own[r] + 0x1000 for r in range(2)]
        assert s["hbm"] == NBYTES and s["layout_kept"] and s["conforms"] and s["provider"] == "ipc"
        assert s["peer_calls"] == []  # one GPU: no peer access to enable
        assert s["after_close_live"] == [] and s["after_close_opened"] == []
        assert s["second_close_calls"] == 0 and s["hbm_closed"] == 0
        assert s["ptrs_closed"] == "PurlinClosedError"


def test_different_gpus_enable_peer_access(scenarios):
    for rank, res in enumerate(scenarios):
        calls = res["two_gpus"]["calls"]
        assert f"cudaDeviceEnablePeerAccess({1 - rank})" in calls
        assert "cudaDeviceCanAccessPeer" in calls and "cudaGetLastError" in calls


def _assert_both_raise(scenarios, key, kind, *needles, max_s=10.0):
    for rank, res in enumerate(scenarios):
        got = res[key]
        assert got[0] == kind, (rank, got)
        for needle in needles:
            assert needle in got[1], (rank, needle, got[1])
        assert got[2] < max_s, (rank, got)  # nobody waited out a timeout
        for leftover in got[3:]:
            assert leftover == [], (rank, key, "leaked", leftover)


def test_setup_failures_raise_on_every_rank_and_free(scenarios):
    _assert_both_raise(scenarios, "no_p2p", "PurlinUnavailableError", "rank(s) [0]", "cannot access")
    _assert_both_raise(scenarios, "malloc_fails", "PurlinUnavailableError", "rank(s) [1]",
                       "cudaMalloc(65536): cudaErrorMemoryAllocation")
    _assert_both_raise(scenarios, "bad_device", "PurlinUnavailableError", "rank 1: cudaSetDevice(7): "
                       "cudaErrorInvalidDevice")
    _assert_both_raise(scenarios, "open_fails", "PurlinUnavailableError", "rank(s) [0]", "cudaIpcOpenMemHandle")


def test_argument_errors_raise_value_error_on_every_rank(scenarios):
    _assert_both_raise(scenarios, "size_mismatch", "PurlinValueError", "disagree on layout_nbytes")
    _assert_both_raise(scenarios, "bad_nbytes", "PurlinValueError", "rank 1:", "layout_nbytes must be >= 1")
    _assert_both_raise(scenarios, "bad_rank", "PurlinValueError", "pass the group's own rank")
    _assert_both_raise(scenarios, "bad_world", "PurlinValueError", "world=3")
    _assert_both_raise(scenarios, "bool_nbytes", "PurlinValueError", "must be an int")


def test_real_runtime_without_gpu_is_unavailable(scenarios):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the no-GPU error path does not apply")
    for res in scenarios:
        kind, msg, elapsed = res["real_no_gpu"]
        assert kind == "PurlinUnavailableError", msg
        assert "cudaGetDevice" in msg or "pip install cuda-python" in msg, msg
        assert elapsed < 10


def test_torch_provider_errors(scenarios):
    for res in scenarios:
        if not torch.cuda.is_available():
            kind, msg, _ = res["torch_no_gpu"]
            assert kind == "PurlinUnavailableError" and "needs a CUDA GPU" in msg, msg
        kind, msg, _ = res["torch_no_rendezvous"]
        assert kind == "PurlinUnavailableError" and "torch.distributed._symmetric_memory.rendezvous" in msg, msg
        kind, msg, _ = res["torch_no_module"]
        assert kind == "PurlinUnavailableError" and "needs torch.distributed._symmetric_memory" in msg, msg


# -- in-process checks (no launch) ------------------------------------------------------------------
def test_missing_cuda_python_says_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", None)
    monkeypatch.setitem(sys.modules, "cuda.cudart", None)
    with pytest.raises(PurlinUnavailableError, match="pip install cuda-python"):
        ipc.load_cudart()


def test_create_without_torch_distributed_raises_at_once():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(PurlinValueError, match="IpcWorkspace.create: torch.distributed is not initialized"):
        ipc.IpcWorkspace.create(NBYTES, None, 0, 0, 1)
    with pytest.raises(PurlinValueError, match="TorchSymmWorkspace.create: torch.distributed is not initialized"):
        torch_symm.TorchSymmWorkspace.create(NBYTES, None, 0, 0, 1)


def test_torch_workspace_conforms_and_closes_twice():
    handle = types.SimpleNamespace(buffer_ptrs=[0x1000, 0x2000])
    ws = torch_symm.TorchSymmWorkspace(rank=1, world=2, device_index=0, nbytes=NBYTES, tensor=object(),
                                       handle=handle, layout="L")
    assert isinstance(ws, DeviceWorkspace)
    assert ws.base_ptrs == [0x1000, 0x2000] and ws.hbm_bytes == NBYTES and ws.layout == "L"
    assert ws.provider == "torch"
    ws.close()
    ws.close()
    assert ws.hbm_bytes == 0 and ws.closed
    with pytest.raises(PurlinClosedError):
        ws.base_ptrs  # noqa: B018


def test_lazy_exports_and_registry():
    assert memory.IpcWorkspace is ipc.IpcWorkspace
    assert memory.TorchSymmWorkspace is torch_symm.TorchSymmWorkspace
    assert memory.device_provider("ipc") is ipc.IpcWorkspace
    assert memory.device_provider("torch") is torch_symm.TorchSymmWorkspace
    with pytest.raises(PurlinUnavailableError, match="available: ipc, torch, nvshmem"):
        memory.device_provider("no_such_provider")
    with pytest.raises(AttributeError):
        memory.NoSuchThing  # noqa: B018


def test_import_has_no_side_effects():
    """Importing the providers imports no CUDA module beyond what torch itself imports, and no symm mem."""
    code = (
        "import sys, torch\n"
        "before = {m for m in sys.modules if m.startswith('cuda')}\n"
        "import purlin_sglang.memory, purlin_sglang.memory.ipc, purlin_sglang.memory.torch_symm\n"
        "after = {m for m in sys.modules if m.startswith('cuda')}\n"
        "assert after == before, sorted(after - before)\n"
        "assert 'torch.distributed._symmetric_memory' not in sys.modules\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
