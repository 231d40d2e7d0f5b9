"""The ipc provider on a GPU: two processes (gloo group), each on GPU 0 unless said otherwise.

Each rank fills its own workspace with a fresh random pattern, then reads every peer's workspace
through the peer pointer with the native copy atom and compares bitwise; a flag round trip goes
through the peers' workspaces (copy atom writes, torch reads of an aliasing tensor); close() twice
is harmless; a rank failing set-up makes every rank raise at once. Processes on one GPU time-slice
(a few ms a round trip), so iteration counts are tiny.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from purlin_sglang.testing import launch

pytestmark = pytest.mark.gpu

STAGING = 4 << 20
ROUND_TRIPS = 5
POLL_TIMEOUT_S = 10.0


class _DeviceArray:
    """A raw device pointer as a CUDA array (torch.as_tensor aliases it, no copy)."""

    def __init__(self, ptr: int, n: int, typestr: str):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr, "data": (ptr, False), "version": 3}


def view(ptr: int, n: int, dtype=torch.uint8) -> torch.Tensor:
    typestr = {torch.uint8: "|u1", torch.int64: "<i8"}[dtype]
    return torch.as_tensor(_DeviceArray(ptr, n, typestr), device="cuda")


def pattern(seed: int, rank: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed * 1009 + rank)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)


def _poll(flag: torch.Tensor, want: int, what: str) -> None:
    deadline = time.monotonic() + POLL_TIMEOUT_S
    while True:
        torch.cuda.synchronize()
        got = int(flag[0].item())
        if got == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: flag is {got}, waited {POLL_TIMEOUT_S}s for {want}")
        time.sleep(0.0002)


def exercise(ws, rank: int, world: int, seed: int) -> dict:
    """The data and flag checks over any DeviceWorkspace (shared with the torch provider's test)."""
    import torch.distributed as dist

    from purlin_sglang import native
    from purlin_sglang.errors import PurlinClosedError

    nbytes = ws.hbm_bytes
    ptrs = ws.base_ptrs
    stream = torch.cuda.current_stream().cuda_stream
    out = {"nbytes": nbytes, "nptrs": len(ptrs), "distinct_ptrs": len(set(ptrs)) == world}

    # A fresh workspace is zeroed.
    first = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    native.copy_atom(first.data_ptr(), ptrs[rank], nbytes, stream)
    torch.cuda.synchronize()
    out["zeroed"] = bool((first == 0).all())

    # Fill my workspace with my pattern (through a torch view of my own pointer).
    mine = pattern(seed, rank, nbytes)
    assert int((mine != 0).sum()) > nbytes // 2  # random, not zeros
    view(ptrs[rank], nbytes).copy_(mine)
    torch.cuda.synchronize()
    dist.barrier()

    # Read every rank's workspace through its pointer with the copy atom; compare bitwise.
    mismatched = {}
    for r in range(world):
        got = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        got.fill_(0xA5 if r % 2 else 0x5A)
        native.copy_atom(got.data_ptr(), ptrs[r], nbytes, stream)
        torch.cuda.synchronize()
        bad = int((got != pattern(seed, r, nbytes)).sum())
        if bad:
            mismatched[r] = bad
    out["mismatched_bytes"] = mismatched
    dist.barrier()  # nobody overwrites a pattern that a peer still reads

    # Flag round trips: rank 0 pings rank 1 (copy atom into rank 1's workspace), rank 1 polls its own
    # workspace with torch reads and pongs back into rank 0's; the others watch.
    flag = view(ptrs[rank], 1, torch.int64)
    value = torch.empty(1, dtype=torch.int64, device="cuda")
    t0 = time.monotonic()
    if world >= 2 and rank in (0, 1):
        peer = 1 - rank
        for i in range(1, ROUND_TRIPS + 1):
            if rank == 0:
                value.fill_(i)
                native.copy_atom(ptrs[peer], value.data_ptr(), 8, stream)
                torch.cuda.synchronize()
                _poll(flag, -i, f"rank 0, round trip {i}")
            else:
                _poll(flag, i, f"rank 1, round trip {i}")
                value.fill_(-i)
                native.copy_atom(ptrs[peer], value.data_ptr(), 8, stream)
                torch.cuda.synchronize()
    out["round_trip_ms"] = (time.monotonic() - t0) * 1e3 / ROUND_TRIPS
    del flag
    dist.barrier()  # every peer is done with my memory before I close

    ws.close()
    ws.close()
    out["hbm_after_close"] = ws.hbm_bytes
    try:
        ws.base_ptrs
        out["ptrs_after_close"] = "no error"
    except PurlinClosedError:
        out["ptrs_after_close"] = "PurlinClosedError"
    return out


def make_layout(world: int):
    """(layout, bytes per rank): the CUDA engine's per-rank DeviceLayout where it exists."""
    from purlin_sglang.memory import layout as layouts

    if hasattr(layouts, "DeviceLayout"):
        dl = layouts.DeviceLayout(world, STAGING)
        return dl, dl.rank_bytes
    wl = layouts.WorkspaceLayout(world, STAGING)
    return wl, wl.total_bytes


def _device_for(rank: int, placement: str) -> int:
    return 0 if placement == "one_gpu" else rank % torch.cuda.device_count()


def _ipc_worker(rank, world, seed, placement):
    from purlin_sglang.memory.ipc import IpcWorkspace

    dev = _device_for(rank, placement)
    torch.cuda.set_device(dev)
    layout, nbytes = make_layout(world)
    ws = IpcWorkspace.create(nbytes, None, dev, rank, world, layout=layout)
    assert ws.layout is layout and ws.provider == "ipc" and ws.device_index == dev
    return exercise(ws, rank, world, seed)


def check_results(results, world, nbytes):
    for rank, res in enumerate(results):
        assert res["nbytes"] == nbytes and res["nptrs"] == world and res["distinct_ptrs"], res
        assert res["zeroed"], f"rank {rank}: a fresh workspace was not zeroed"
        assert res["mismatched_bytes"] == {}, f"rank {rank}: bytes differ from each rank's pattern: {res}"
        assert res["hbm_after_close"] == 0 and res["ptrs_after_close"] == "PurlinClosedError", res


@pytest.mark.parametrize("placement", ["one_gpu", "per_rank_gpu"])
def test_ipc_two_processes_share_memory(placement):
    if placement == "per_rank_gpu" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (one per rank)")
    world = 2
    seed = int.from_bytes(os.urandom(4), "little")  # fresh every run
    results = launch(_ipc_worker, world, seed, placement, timeout_s=120)
    check_results(results, world, make_layout(world)[1])
    print(f"ipc {placement}: round trip {[round(r['round_trip_ms'], 3) for r in results]} ms")


def _attempt(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("ok", "", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e), time.monotonic() - t0)


def setup_failures_worker(rank, world, provider: str):
    """Two failing set-ups of GPU provider ``provider`` on GPU 0 (each fails on one rank; every
    rank must raise), then a good one: the group is still usable after failed set-ups."""
    import torch.distributed as dist

    from purlin_sglang.memory import device_provider

    workspace = device_provider(provider)
    torch.cuda.set_device(0)
    n = 1 << 20
    out = {
        # rank 1 names a GPU that does not exist.
        "bad_device": _attempt(lambda: workspace.create(n, None, 99 if rank == 1 else 0, rank, world)),
        # rank 0 asks for more memory than any GPU has.
        "too_big": _attempt(lambda: workspace.create(1 << 50 if rank == 0 else n, None, 0, rank, world)),
    }
    ws = workspace.create(n, None, 0, rank, world)
    out["after"] = len(ws.base_ptrs)
    dist.barrier()
    ws.close()
    return out


def test_ipc_setup_failure_raises_everywhere_quickly():
    # bad_device: cudaSetDevice fails on rank 1; too_big: cudaMalloc fails on rank 0.
    results = launch(setup_failures_worker, 2, "ipc", timeout_s=120)
    for rank, res in enumerate(results):
        kind, msg, elapsed = res["bad_device"]
        assert kind == "PurlinUnavailableError" and "rank 1: cudaSetDevice(99): cudaErrorInvalidDevice" in msg, msg
        assert elapsed < 10, (rank, elapsed)
        kind, msg, elapsed = res["too_big"]
        assert kind == "PurlinUnavailableError" and f"rank 0: cudaMalloc({1 << 50})" in msg, msg
        assert elapsed < 10, (rank, elapsed)
        assert res["after"] == 2
