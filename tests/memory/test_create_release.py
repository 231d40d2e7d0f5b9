"""A provider's ``create`` that raises has released what it allocated or mapped, whatever it raises.

Each case runs one rank's ``create`` in this process over a :class:`FakeGroup` of three ranks whose
all-gathers the test scripts: an exchange raises ``RuntimeError`` (what torch.distributed raises when
a peer process died after set-up began) or ``KeyboardInterrupt``, or a local step fails, at each
point of the set-up. The error must reach the caller unchanged (the same object) and, once it has:

* ipc: every cudaMalloc is freed and every handle opened with cudaIpcOpenMemHandle is closed.

The set-up protocol over real processes is tests/memory/test_providers_cpu.py.
"""

from __future__ import annotations

import gc
import os

import pytest

from _fakes import FakeCudart, FakeGroup
from purlin_sglang.memory import ipc

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
