"""A provider's ``create`` that raises has released what it allocated or mapped, whatever it raises.

Each case runs one rank's ``create`` in this process over a :class:`FakeGroup` of three ranks whose
all-gathers the test scripts: an exchange raises ``RuntimeError`` (what torch.distributed raises when
a peer process died after set-up began) or ``KeyboardInterrupt``, or a local step fails, at each
point of the set-up. The error must reach the caller unchanged (the same object) and, once it has:

* ipc: every cudaMalloc is freed and every handle opened with cudaIpcOpenMemHandle is closed;
* torch: the symmetric tensor and its rendezvous handle are unreferenced (the traceback that the
  caller holds does not keep them), so PyTorch frees and unmaps them;
* nvshmem: the half-made block is not kept as a live workspace, and the process's NVSHMEM refuses
  further collective use (its heap may differ between PEs).

The set-up protocol over real processes is tests/memory/test_providers_cpu.py and test_nvshmem_cpu.py.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import types
import weakref

import pytest
import torch

from _fakes import FakeCudart, FakeGroup, FakeShim
from purlin_sglang.errors import PurlinUnavailableError
from purlin_sglang.memory import ipc, nvshmem, torch_symm

NBYTES = 1 << 16
WORLD, RANK = 3, 1  # a middle rank: peers on both sides
PEERS = [r for r in range(WORLD) if r != RANK]
KINDS = [RuntimeError, KeyboardInterrupt]  # what an exchange raises: a peer died; an interrupt here


def _raises_same(fn, error):
    """Run ``fn``, which must raise ``error`` itself; return pytest's info (it holds the traceback)."""
    with pytest.raises(type(error)) as info:
        fn()
    assert info.value is error
    gc.collect()
    return info


# -- ipc ------------------------------------------------------------------------------------------
def _own_ptr(rank: int) -> int:
    return 0x7F0000000000 + (rank << 32)  # FakeCudart's cudaMalloc


def _ipc_peers(n, mine, r):
    """Peer ``r``'s status: phase 1 its handle (FakeCudart's format), phase 2 ok."""
    if n == 1:
        raw = (b"H" + _own_ptr(r).to_bytes(8, "little")).ljust(ipc.IPC_HANDLE_BYTES, b"\0")
        return ("ok", {"handle": raw, "bus_id": "0000:00:00.0", "nbytes": NBYTES, "pid": os.getpid() + 1 + r,
                       "device_index": 0})
    return ("ok", None)


class ScriptedCudart(FakeCudart):
    """FakeCudart whose ``n``-th call of ``name`` fails: with CUDA error ``code``, or raising ``exc``."""

    def __init__(self, rank, *, name="", n=0, code=0, exc=None):
        super().__init__(rank)
        self.script = (name, n, code, exc)

    def _call(self, name, *values):
        out = super()._call(name, *values)
        want, n, code, exc = self.script
        if name == want and self.calls.count(name) == n:
            if exc is not None:
                raise exc
            return (code, *([None] * len(values)))
        return out


def _ipc_create(monkeypatch, fake, *, fail_at=None, error=None):
    monkeypatch.setattr(ipc, "load_cudart", lambda: fake)
    group = FakeGroup(RANK, WORLD, _ipc_peers, fail_at=fail_at, error=error).install(monkeypatch)
    return lambda: ipc.IpcWorkspace.create(NBYTES, group, 0, RANK, WORLD)


def _assert_ipc_released(fake):
    assert fake.live == set(), "device memory left allocated"
    assert fake.opened == set(), "peer mappings left open"
    assert "cudaMalloc" in fake.calls and "cudaFree" in fake.calls


def test_ipc_success_keeps_everything_until_close(monkeypatch):
    fake = FakeCudart(RANK)
    ws = _ipc_create(monkeypatch, fake)()
    assert fake.live == {_own_ptr(RANK)} and fake.opened == {_own_ptr(r) + 0x1000 for r in PEERS}
    assert "cudaFree" not in fake.calls and "cudaIpcCloseMemHandle" not in fake.calls
    assert ws.base_ptrs == [_own_ptr(r) + (0 if r == RANK else 0x1000) for r in range(WORLD)]
    ws.close()
    _assert_ipc_released(fake)


@pytest.mark.parametrize("kind", KINDS)
def test_ipc_exchange_fails_after_own_malloc(monkeypatch, kind):
    error = kind("[gloo] Connection closed by peer")
    fake = FakeCudart(RANK)
    _raises_same(_ipc_create(monkeypatch, fake, fail_at=1, error=error), error)
    _assert_ipc_released(fake)
    assert "cudaIpcOpenMemHandle" not in fake.calls


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", range(len(PEERS) + 1))
def test_ipc_exchange_fails_after_k_peer_handles_opened(monkeypatch, k, kind):
    """The (k+1)-th cudaIpcOpenMemHandle fails (none does for k = every peer), then the exchange raises."""
    error = kind("[gloo] Connection closed by peer")
    fake = ScriptedCudart(RANK, name="cudaIpcOpenMemHandle", n=k + 1, code=201)
    _raises_same(_ipc_create(monkeypatch, fake, fail_at=2, error=error), error)
    assert fake.calls.count("cudaIpcCloseMemHandle") == k
    _assert_ipc_released(fake)


@pytest.mark.parametrize("k", range(len(PEERS)))
def test_ipc_interrupted_while_opening_peer_handles(monkeypatch, k):
    error = KeyboardInterrupt()
    fake = ScriptedCudart(RANK, name="cudaIpcOpenMemHandle", n=k + 1, exc=error)
    _raises_same(_ipc_create(monkeypatch, fake), error)
    assert fake.calls.count("cudaIpcCloseMemHandle") == k
    _assert_ipc_released(fake)


@pytest.mark.parametrize("call", ["cudaMemset", "cudaDeviceSynchronize", "cudaIpcGetMemHandle"])
def test_ipc_interrupted_after_own_malloc(monkeypatch, call):
    error = KeyboardInterrupt()
    fake = ScriptedCudart(RANK, name=call, n=1, exc=error)
    _raises_same(_ipc_create(monkeypatch, fake), error)
    _assert_ipc_released(fake)


# -- torch ----------------------------------------------------------------------------------------
class _Tensor:
    def zero_(self):
        return self


class _Handle:
    buffer_ptrs = [0x1000 * (r + 1) for r in range(WORLD)]


def _torch_peers(n, mine, r):
    return ("ok", {"nbytes": NBYTES} if n == 1 else None)


def _torch_create(monkeypatch, made, *, peers=_torch_peers, fail_at=None, error=None):
    """``made`` collects weak references to every tensor and handle the fake symmetric memory hands out."""

    def empty(nbytes, dtype, device):
        t = _Tensor()
        made.append(weakref.ref(t))
        return t

    def rendezvous(tensor, group_name):
        h = _Handle()
        made.append(weakref.ref(h))
        return h

    symm_mem = types.ModuleType(torch_symm._MODULE)
    symm_mem.empty, symm_mem.rendezvous = empty, rendezvous
    monkeypatch.setitem(sys.modules, torch_symm._MODULE, symm_mem)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert torch.cuda.is_available() and torch_symm._load_symm_mem() is symm_mem
    group = FakeGroup(RANK, WORLD, peers, fail_at=fail_at, error=error).install(monkeypatch)
    return lambda: torch_symm.TorchSymmWorkspace.create(NBYTES, group, 0, RANK, WORLD)


def test_torch_success_keeps_the_tensor_and_handle(monkeypatch):
    made = []
    ws = _torch_create(monkeypatch, made)()
    assert [type(m()) for m in made] == [_Tensor, _Handle] and ws.tensor is made[0]()
    ws.close()
    gc.collect()
    assert [m() for m in made] == [None, None]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fail_at,n_made", [(1, 1), (2, 2)], ids=["after_empty", "after_rendezvous"])
def test_torch_exchange_fails(monkeypatch, fail_at, n_made, kind):
    error, made = kind("[gloo] Connection closed by peer"), []
    info = _raises_same(_torch_create(monkeypatch, made, fail_at=fail_at, error=error), error)
    assert len(made) == n_made and info.traceback
    assert [m() for m in made] == [None] * n_made, "the traceback keeps the symmetric allocation alive"


def test_torch_peer_fails_at_rendezvous(monkeypatch):
    def peer_fails(n, mine, r):
        return _torch_peers(n, mine, r) if n == 1 else ("error", "unavailable", "gone")

    made = []
    with pytest.raises(PurlinUnavailableError, match=r"ranks \[0, 2\]: gone") as info:
        _torch_create(monkeypatch, made, peers=peer_fails)()
    gc.collect()
    assert len(made) == 2 and info.traceback
    assert [m() for m in made] == [None, None], "the traceback keeps the symmetric allocation alive"


# -- nvshmem --------------------------------------------------------------------------------------
def _nvshmem_peers(n, mine, r):
    """Exchanges of a fresh NVSHMEM set-up: 1 checks, 2 rank 0's unique id, 3 init, 4 malloc."""
    if n == 1:
        return ("ok", {"nbytes": NBYTES, "ident": (socket.gethostname(), os.getpid() + 1 + r), "peers": None,
                       "retired": []})
    if n == 2:
        return ("ok", b"U" + bytes(127) if r == 0 else None)
    return ("ok", True) if n == 4 else ("ok", None)


def _nvshmem_create(monkeypatch, fake, *, fail_at=None, error=None):
    for name, value in (("_SESSION", None), ("_FINALIZED", False), ("_BROKEN", ""), ("_SHIM", None)):
        monkeypatch.setattr(nvshmem, name, value)
    monkeypatch.setattr(nvshmem, "_load_shim", lambda: fake)
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")  # create sets it; the test leaves the environment as it was
    group = FakeGroup(RANK, WORLD, _nvshmem_peers, fail_at=fail_at, error=error).install(monkeypatch)
    return lambda: nvshmem.NvshmemWorkspace.create(NBYTES, group, 0, RANK, WORLD)


def test_nvshmem_success_keeps_the_block(monkeypatch):
    fake = FakeShim(RANK)
    ws = _nvshmem_create(monkeypatch, fake)()
    assert list(nvshmem._SESSION.live.values()) == [ws.base_ptrs[RANK]] and nvshmem._BROKEN == ""
    ws.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fail_at", [3, 4], ids=["after_init", "after_malloc"])
def test_nvshmem_exchange_fails_after_a_collective_call(monkeypatch, fail_at, kind):
    error, fake = kind("[gloo] Connection closed by peer"), FakeShim(RANK)
    create = _nvshmem_create(monkeypatch, fake, fail_at=fail_at, error=error)
    _raises_same(create, error)
    held = nvshmem._SESSION
    assert held is None or not held.live, "a half-made block is kept as a live workspace"
    assert nvshmem._BROKEN, "NVSHMEM is left open to collective calls that the peers cannot match"
    n = len(fake.calls)
    with pytest.raises(PurlinUnavailableError, match="restart the processes"):
        create()
    assert [c[0] for c in fake.calls[n:] if c[0] in ("init", "malloc", "free")] == []
