"""The nvshmem provider without a GPU: "not built in" and argument errors on every rank, the set-up
protocol (unique-id broadcast, one session per process, retired blocks freed collectively, shutdown)
over two real gloo ranks with a fake shim, and, where this build has NVSHMEM, that the shim loads.

The real NVSHMEM path is tests/gpu/test_nvshmem_provider.py. One launch runs every scenario.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from _fakes import FakeShim
from purlin_sglang import memory, native
from purlin_sglang.errors import PurlinValueError
from purlin_sglang.memory import nvshmem
from purlin_sglang.memory.device import DeviceWorkspace
from purlin_sglang.testing import launch

NBYTES = 1 << 16
WHEEL_REASON = ("the nvidia-nvshmem-cu13 (or -cu12) wheel was not installed (not importable by /usr/bin/python3) "
                "when purlin_sglang was built")


def _not_built_info() -> dict:
    return {"built": True, "cuda": True, "path": "/nowhere/_native.so",
            "nvshmem": {"built": False, "reason": WHEEL_REASON}}


def _attempt(fn):
    t0 = time.monotonic()
    try:
        return ("ok", fn(), time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the parent checks the type and text
        return (type(e).__name__, str(e), time.monotonic() - t0)


def _collective(fake) -> list:
    """The calls that would be collective (or start a bootstrap) in real NVSHMEM."""
    return [c[0] for c in fake.calls if c[0] in ("get_uniqueid", "init", "malloc", "free", "finalize")]


def _reset(mod):
    mod._SESSION, mod._FINALIZED, mod._BROKEN, mod._SHIM = None, False, "", None


def _scenarios(rank, world):
    """Every scenario, in the same order on every rank."""
    import purlin_sglang.memory.nvshmem as nv

    out = {}
    real_load, real_info = nv._load_shim, nv._native_build_info

    def create(nbytes=NBYTES, device_index=0, r=rank, w=world, layout=None):
        return nv.NvshmemWorkspace.create(nbytes, None, device_index, r, w, layout=layout)

    def use(fake):
        _reset(nv)
        nv._load_shim = lambda: fake
        return fake

    # 1. Not built in: every rank raises PurlinUnavailableError naming the wheel, at once.
    _reset(nv)
    nv._native_build_info = _not_built_info
    out["not_built"] = _attempt(create)
    nv._native_build_info = real_info

    # 2. This installation as it is (not built in, or built in on a machine without a GPU).
    import torch

    _reset(nv)
    if not torch.cuda.is_available():  # with a GPU this would really initialise NVSHMEM: the GPU test's job
        out["real"] = _attempt(create)
    out["real_status"] = nv.nvshmem_status()

    # 3. Bad arguments on one rank only: PurlinValueError everywhere, before anything is loaded.
    for key, kw in {"bad_nbytes": {"nbytes": 0 if rank == 1 else NBYTES}, "bool_nbytes": {"nbytes": True},
                    "bad_rank": {"r": 1 - rank}, "bad_world": {"w": 3},
                    "bad_device": {"device_index": -1 if rank == 0 else 0}}.items():
        fake = use(FakeShim(rank))
        out[key] = _attempt(lambda: create(**kw)) + (_collective(fake),)

    # 4. A fresh session: rank 0's id reaches every rank, PE = rank, own pointer + nvshmem_ptr for peers.
    fake = use(FakeShim(rank))
    marker = object()
    ws = create(layout=marker)
    own = 0x7F0000000000 + (rank << 36)
    out["fresh"] = {
        "ptrs": ws.base_ptrs, "own": own, "hbm": ws.hbm_bytes, "layout_kept": ws.layout is marker,
        "conforms": isinstance(ws, DeviceWorkspace), "provider": ws.provider, "calls": list(fake.calls),
        "env_nvls": os.environ.get("NVSHMEM_DISABLE_NVLS"),
    }
    # 5. The same processes again: no second init; the first block is freed once BOTH ranks closed it.
    ws.close()
    ws.close()
    out["fresh"]["closed"] = (ws.hbm_bytes, _attempt(lambda: ws.base_ptrs)[0])
    n = len(fake.calls)
    ws2 = create()
    out["reuse"] = {"calls": fake.calls[n:], "live": sorted(fake.live)}
    # 6. Closed on rank 0 only: the next set-up frees nothing of it.
    if rank == 0:
        ws2.close()
    n = len(fake.calls)
    ws3 = create()
    out["half_closed"] = fake.calls[n:]
    # 7. shutdown with open workspaces: frees what every rank retired, does not finalize.
    n = len(fake.calls)
    out["shutdown_open"] = (nv.shutdown(), fake.calls[n:])
    for w_ in (ws2, ws3):
        w_.close()
    n = len(fake.calls)
    out["shutdown"] = (nv.shutdown(), fake.calls[n:], sorted(fake.live))
    out["after_shutdown"] = _attempt(create)
    out["shutdown_again"] = _attempt(nv.shutdown)

    # 8. Another session on rank 1 (other processes): both refuse before any NVSHMEM call.
    fake = use(FakeShim(rank))
    if rank == 1:
        nv._SESSION = nv._Session((("elsewhere", 1), ("elsewhere", 2)), 0)
    out["other_session"] = _attempt(create) + (_collective(fake),)

    # 9. NVSHMEM already initialised by someone else on rank 0.
    fake = use(FakeShim(rank, init_status=2 if rank == 0 else 0))
    out["foreign_init"] = _attempt(create) + (_collective(fake),)

    # 10. Too little free memory on rank 1; no GPU on rank 0.
    fake = use(FakeShim(rank, free=NBYTES - 1 if rank == 1 else 1 << 30))
    out["no_memory"] = _attempt(create) + (_collective(fake),)
    fake = use(FakeShim(rank, devices=0 if rank == 0 else 1))
    out["no_gpu"] = _attempt(create) + (_collective(fake),)

    # 11. Init fails on rank 1: both raise; rank 0's half-made session refuses further use.
    fake = use(FakeShim(rank, fail={"init": 1} if rank == 1 else {}))
    out["init_fails"] = _attempt(create)
    out["after_init_fails"] = _attempt(create)

    # 12. nvshmem_ptr fails on rank 1: both raise; the block is retired everywhere and freed next time.
    fake = use(FakeShim(rank, fail={"ptr": 1} if rank == 1 else {}))
    out["ptr_fails"] = _attempt(create)
    fake.fail.clear()
    n = len(fake.calls)
    ws = create()
    out["after_ptr_fails"] = [c[0] for c in fake.calls[n:] if c[0] in ("init", "free", "malloc")]
    ws.close()

    # 13. nvshmem_malloc fails on rank 0: both raise; the session is broken (frees cannot be matched).
    fake = use(FakeShim(rank, fail={"malloc": 1} if rank == 0 else {}))
    out["malloc_fails"] = _attempt(create)
    out["after_malloc_fails"] = _attempt(create)

    # 14. Ranks disagree on the size.
    fake = use(FakeShim(rank))
    out["size_mismatch"] = _attempt(lambda: create(nbytes=NBYTES * (rank + 1))) + (
        _collective(fake),)

    nv._load_shim = real_load
    _reset(nv)
    return out


@pytest.fixture(scope="module")
def scenarios():
    return launch(_scenarios, 2, timeout_s=120)


def _both_raise(scenarios, key, kind, *needles, max_s=10.0):
    for rank, res in enumerate(scenarios):
        got = res[key]
        assert got[0] == kind, (rank, key, got)
        for needle in needles:
            assert needle in got[1], (rank, key, needle, got[1])
        assert got[2] < max_s, (rank, key, got)  # nobody waited out a timeout
        for extra in got[3:]:
            assert extra == [], (rank, key, "NVSHMEM was called", extra)


def test_not_built_raises_naming_the_wheel_on_every_rank(scenarios):
    _both_raise(scenarios, "not_built", "PurlinUnavailableError", "rank(s) [0, 1]",
                "memory='nvshmem': this build of purlin_sglang has no NVSHMEM support", "nvidia-nvshmem-cu13",
                "pip install nvidia-nvshmem-cu13")


def test_this_installation_is_unavailable_without_a_gpu(scenarios):
    if "real" not in scenarios[0]:
        pytest.skip("a GPU is visible: the no-GPU error path does not apply")
    for res in scenarios:
        st = res["real_status"]
        kind, msg, elapsed = res["real"]
        assert kind == "PurlinUnavailableError" and elapsed < 10, res["real"]
        if not st["built"]:
            assert "no NVSHMEM support" in msg or "native library is not built" in msg, msg
        else:  # built in (CI: CUDA build with the wheel that torch brings): no GPU here
            assert "cudaGetDeviceCount" in msg, msg


def test_argument_errors_raise_value_error_on_every_rank(scenarios):
    _both_raise(scenarios, "bad_nbytes", "PurlinValueError", "rank 1:", "layout_nbytes must be >= 1")
    _both_raise(scenarios, "bool_nbytes", "PurlinValueError", "must be an int")
    _both_raise(scenarios, "bad_rank", "PurlinValueError", "pass the group's own rank")
    _both_raise(scenarios, "bad_world", "PurlinValueError", "world=3")
    _both_raise(scenarios, "bad_device", "PurlinValueError", "rank 0:", "device_index must be >= 0")


def test_fresh_session_broadcasts_rank0_uid_and_maps_peers(scenarios):
    for rank, res in enumerate(scenarios):
        f = res["fresh"]
        own = [0x7F0000000000 + (r << 36) for r in range(2)]
        assert f["ptrs"] == [own[rank] if r == rank else own[rank] + ((r + 1) << 32) for r in range(2)]
        assert f["hbm"] == NBYTES and f["layout_kept"] and f["conforms"] and f["provider"] == "nvshmem"
        names = [c[0] for c in f["calls"]]
        assert names.count("get_uniqueid") == (1 if rank == 0 else 0), names
        init = [c for c in f["calls"] if c[0] == "init"]
        assert init == [("init", b"U\x00", rank, 2, 0)], init  # rank 0's id, PE = rank
        assert names.index("init") < names.index("malloc"), names
        assert f["env_nvls"] == "1"
        assert f["closed"] == (0, "PurlinClosedError")


def test_reuse_frees_blocks_closed_on_every_rank_only(scenarios):
    for rank, res in enumerate(scenarios):
        own = 0x7F0000000000 + (rank << 36)
        calls = [c for c in res["reuse"]["calls"] if c[0] in ("init", "get_uniqueid", "free", "malloc")]
        assert calls == [("free", own), ("malloc", NBYTES)], calls  # no second init
        assert res["half_closed"][-1][0] != "free" and not any(c[0] == "free" for c in res["half_closed"])
        ok, calls = res["shutdown_open"]
        assert ok is False and not any(c[0] in ("free", "finalize") for c in calls), calls
        ok, calls, live = res["shutdown"]
        assert ok is True and [c[0] for c in calls] == ["free", "free", "finalize"], calls
        assert [c[1] for c in calls[:2]] == [own + (1 << 24), own + (2 << 24)]  # oldest first, same on both
        assert live == []
        kind, msg, _ = res["after_shutdown"]
        assert kind == "PurlinUnavailableError" and "finalized" in msg and "start new processes" in msg, msg
        assert res["shutdown_again"][:2] == ("ok", False)


def test_session_conflicts_raise_before_nvshmem_is_called(scenarios):
    _both_raise(scenarios, "other_session", "PurlinUnavailableError", "one process holds one nvshmem group")
    _both_raise(scenarios, "foreign_init", "PurlinUnavailableError", "rank 0:", "already initialised")
    _both_raise(scenarios, "no_memory", "PurlinUnavailableError", "rank 1:", "bytes free")
    _both_raise(scenarios, "no_gpu", "PurlinUnavailableError", "rank 0:", "0 GPU(s) are visible")
    _both_raise(scenarios, "size_mismatch", "PurlinValueError", "disagree on layout_nbytes")


def test_failures_inside_nvshmem_raise_everywhere(scenarios):
    _both_raise(scenarios, "init_fails", "PurlinUnavailableError", "rank 1: init: fake failure")
    _both_raise(scenarios, "after_init_fails", "PurlinUnavailableError", "restart the processes")
    _both_raise(scenarios, "ptr_fails", "PurlinUnavailableError", "rank 1: ptr: fake failure")
    for res in scenarios:
        assert res["after_ptr_fails"] == ["free", "malloc"], res["after_ptr_fails"]
    _both_raise(scenarios, "malloc_fails", "PurlinUnavailableError", "rank 0: nvshmem_malloc: fake NULL")
    _both_raise(scenarios, "after_malloc_fails", "PurlinUnavailableError", "restart the processes")


# -- in-process checks (no launch) ------------------------------------------------------------------
def test_status_says_why_and_never_raises(monkeypatch):
    st = nvshmem.nvshmem_status()
    assert set(st) >= {"built", "reason", "version", "wheel", "library", "runtime_dir"}
    assert st["built"] or st["reason"]
    monkeypatch.setattr(nvshmem, "_native_build_info", _not_built_info)
    st = nvshmem.nvshmem_status()
    assert not st["built"] and "nvidia-nvshmem-cu13" in st["reason"] and "no NVSHMEM support" in st["reason"]
    monkeypatch.setattr(nvshmem, "_native_build_info", lambda: {"built": True, "path": "/x/_native.so"})
    assert "predates the nvshmem provider" in nvshmem.nvshmem_status()["reason"]


def test_build_info_has_an_nvshmem_entry():
    info = native.build_info()
    nv = info.get("nvshmem")
    assert isinstance(nv, dict) and isinstance(nv["built"], bool), info
    if not info["cuda"]:
        assert not nv["built"] and "without CUDA" in nv["reason"]
    if nv["built"]:
        assert nv["version"].count(".") == 2 and nv["library"] == "libpurlin_nvshmem.so", nv


def test_create_without_torch_distributed_raises_at_once():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(PurlinValueError, match="NvshmemWorkspace.create: torch.distributed is not initialized"):
        nvshmem.NvshmemWorkspace.create(NBYTES, None, 0, 0, 1)


def test_registry_and_lazy_export():
    assert memory.DEVICE_PROVIDERS["nvshmem"] == "purlin_sglang.memory.nvshmem:NvshmemWorkspace"
    assert memory.device_provider("nvshmem") is nvshmem.NvshmemWorkspace
    assert memory.NvshmemWorkspace is nvshmem.NvshmemWorkspace
    assert nvshmem.NvshmemWorkspace.provider == "nvshmem"


def test_engine_lists_nvshmem_as_wired_for_groups():
    from purlin_sglang import engines

    cuda = next(e for e in engines.ENGINES if e.name == "cuda")
    assert "nvshmem" in cuda.memories and "nvshmem" not in cuda.virtual_memories


def test_import_has_no_side_effects():
    """Importing the provider loads no library, sets no NVSHMEM variable, touches no GPU."""
    code = (
        "import os, sys, torch\n"
        "maps = lambda: open('/proc/self/maps').read()\n"
        "had_shim = 'libpurlin_nvshmem' in maps()\n"
        "import purlin_sglang.memory, purlin_sglang.memory.nvshmem as nv\n"
        "assert nv._SHIM is None and nv._SESSION is None\n"
        "assert ('libpurlin_nvshmem' in maps()) == had_shim\n"
        "assert not any(k.startswith('NVSHMEM_') for k in os.environ), [k for k in os.environ if 'NVSHMEM' in k]\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVSHMEM_")}
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120, env=env)


def test_built_shim_loads_without_a_gpu():
    """Where NVSHMEM is built in: the shim, libnvshmem_host.so.3 and the uid plugin load; nothing initialises."""
    if not nvshmem.nvshmem_status()["built"]:
        pytest.skip(f"NVSHMEM not built in: {nvshmem.nvshmem_status()['reason']}")
    code = (
        "import json, os\n"
        "import purlin_sglang.memory.nvshmem as nv\n"
        "shim = nv._load_shim()\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(json.dumps({'uid': shim.uid_bytes, 'headers': shim.headers_version, 'runtime': shim.runtime_version(),"
        " 'status': shim.init_status(), 'plugin': 'nvshmem_bootstrap_uid.so.3' in maps,"
        " 'host': 'libnvshmem_host.so.3' in maps, 'status_dict': nv.nvshmem_status()}))\n"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=120, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    st = got["status_dict"]
    assert got["uid"] == 128 and got["headers"] == st["version"] and got["status"] == 0, got
    assert got["runtime"].split(".")[:2] == st["version"].split(".")[:2], got
    assert got["plugin"] and got["host"], got
