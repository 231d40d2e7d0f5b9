"""Fakes shared by the CPU tests of the GPU memory providers: a cuda-python runtime (``FakeCudart``,
for the ipc provider), the NVSHMEM shim (``FakeShim``), and one rank's view of a process group whose
all-gathers the test scripts (``FakeGroup``), so that a provider's ``create`` runs in this process.
"""

from __future__ import annotations

import ctypes
import types

import torch.distributed as dist

from purlin_sglang.errors import PurlinUnavailableError
from purlin_sglang.memory import ipc


class _FakeHandle:
    def __init__(self):
        self._buf = ctypes.create_string_buffer(ipc.IPC_HANDLE_BYTES)

    def getPtr(self):  # noqa: N802 - cuda-python's spelling
        return ctypes.addressof(self._buf)


class FakeCudart:
    """Enough of cuda.bindings.runtime for IpcWorkspace; ``fail`` maps a call name to an error code."""

    cudaIpcMemLazyEnablePeerAccess = 1
    cudaError_t = types.SimpleNamespace(cudaErrorPeerAccessAlreadyEnabled=704)
    cudaIpcMemHandle_t = _FakeHandle
    NAMES = {2: "cudaErrorMemoryAllocation", 101: "cudaErrorInvalidDevice", 704: "cudaErrorPeerAccessAlreadyEnabled"}

    def __init__(self, rank, *, devices=1, bus=None, fail=(), can_access=1, already_enabled=False):
        self.rank = rank
        self.devices = devices
        self.bus = bus if bus is not None else [0] * devices  # bus id number of each local device
        self.fail = dict(fail)
        self.can_access = can_access
        self.already_enabled = already_enabled
        self.current = 0
        self.calls = []
        self.live = set()  # pointers allocated and not freed
        self.opened = set()  # pointers opened and not closed

    def _call(self, name, *values):
        self.calls.append(name)
        code = self.fail.get(name, 0)
        return (code, *([None] * len(values))) if code else (0, *values)

    def cudaGetErrorName(self, err):  # noqa: N802
        return 0, self.NAMES.get(int(err), f"cudaError{int(err)}").encode()

    def cudaGetErrorString(self, err):  # noqa: N802
        return 0, f"fake error {int(err)}".encode()

    def cudaGetDevice(self):  # noqa: N802
        return self._call("cudaGetDevice", self.current)

    def cudaSetDevice(self, d):  # noqa: N802
        if d >= self.devices:
            self.calls.append("cudaSetDevice")
            return (101,)
        self.current = d
        return self._call("cudaSetDevice")

    def cudaMalloc(self, n):  # noqa: N802
        out = self._call("cudaMalloc", 0x7F0000000000 + (self.rank << 32))
        if out[0] == 0:
            self.live.add(out[1])
        return out

    def cudaMemset(self, ptr, value, n):  # noqa: N802
        assert ptr in self.live and value == 0 and n > 0
        return self._call("cudaMemset")

    def cudaDeviceSynchronize(self):  # noqa: N802
        return self._call("cudaDeviceSynchronize")

    def cudaIpcGetMemHandle(self, ptr):  # noqa: N802
        h = _FakeHandle()
        ctypes.memmove(h.getPtr(), b"H" + ptr.to_bytes(8, "little"), 9)
        return self._call("cudaIpcGetMemHandle", h)

    def cudaDeviceGetPCIBusId(self, length, d):  # noqa: N802
        return self._call("cudaDeviceGetPCIBusId", f"0000:{self.bus[d]:02X}:00.0".encode() + b"\0" * 8)

    def cudaDeviceGetByPCIBusId(self, bus):  # noqa: N802
        num = int(bus.decode().split(":")[1], 16)
        return self._call("cudaDeviceGetByPCIBusId", self.bus.index(num) if num in self.bus else 0)

    def cudaDeviceCanAccessPeer(self, d, peer):  # noqa: N802
        return self._call("cudaDeviceCanAccessPeer", self.can_access)

    def cudaDeviceEnablePeerAccess(self, peer, flags):  # noqa: N802
        self.calls.append(f"cudaDeviceEnablePeerAccess({peer})")
        return (704,) if self.already_enabled else (0,)

    def cudaGetLastError(self):  # noqa: N802
        return self._call("cudaGetLastError")

    def cudaIpcOpenMemHandle(self, h, flags):  # noqa: N802
        raw = ctypes.string_at(h.getPtr(), 9)
        assert raw[:1] == b"H" and flags == 1
        ptr = int.from_bytes(raw[1:9], "little") + 0x1000  # "mapped" at another address
        out = self._call("cudaIpcOpenMemHandle", ptr)
        if out[0] == 0:
            self.opened.add(ptr)
        return out

    def cudaIpcCloseMemHandle(self, ptr):  # noqa: N802
        self.opened.discard(ptr)
        return self._call("cudaIpcCloseMemHandle")

    def cudaFree(self, ptr):  # noqa: N802
        self.live.discard(ptr)
        return self._call("cudaFree")


class FakeShim:
    """Enough of nvshmem._Shim for the set-up protocol; ``fail`` maps a method name to an error text."""

    uid_bytes = 128

    def __init__(self, rank, *, fail=(), devices=1, free=1 << 30, init_status=0):
        self.rank = rank
        self.fail = dict(fail)
        self.devices = devices
        self.free_bytes = free
        self.status = init_status
        self.calls = []
        self.next_ptr = 0x7F0000000000 + (rank << 36)
        self.live = set()

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if name in self.fail:
            raise PurlinUnavailableError(f"{name}: fake failure")

    def device_count(self):
        self._call("device_count")
        return self.devices

    def mem_info(self, device):
        self._call("mem_info", device)
        return self.free_bytes, 2 * self.free_bytes

    def init_status(self):
        self._call("init_status")
        return self.status

    def get_uniqueid(self):
        self._call("get_uniqueid")
        return b"U" + self.rank.to_bytes(1, "little") + bytes(126)

    def init(self, uid, pe, npes, device):
        self._call("init", uid[:2], pe, npes, device)
        self.status = 2

    def malloc(self, device, nbytes):
        self.calls.append(("malloc", nbytes))
        if "malloc" in self.fail:
            return 0, PurlinUnavailableError("nvshmem_malloc: fake NULL")
        ptr = self.next_ptr
        self.next_ptr += 1 << 24
        self.live.add(ptr)
        return ptr, None

    def ptr(self, block, pe):
        self._call("ptr", pe)
        return block + ((pe + 1) << 32)  # "mapped" elsewhere, distinct per PE

    def free(self, device, block):
        self._call("free", block)
        self.live.discard(block)

    def finalize(self, device):
        self._call("finalize")
        self.status = 0


class FakeGroup:
    """Rank ``rank`` of a process group of ``world`` processes, as the providers' set-up sees it.

    Each ``all_gather_object`` is one exchange (numbered from 1): this rank's object for itself and
    ``peers(n, mine, r)`` for each peer ``r``. Exchange ``fail_at`` raises ``error`` instead, as
    torch.distributed does when a peer process died after the set-up began.
    """

    group_name = "fake"

    def __init__(self, rank, world, peers, *, fail_at=None, error=None):
        self.rank, self.world, self.peers = rank, world, peers
        self.fail_at, self.error = fail_at, error
        self.exchanges = 0

    def install(self, monkeypatch) -> "FakeGroup":
        """Answer torch.distributed's queries and all-gathers for this group (undone by ``monkeypatch``)."""
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_rank", self._get_rank)
        monkeypatch.setattr(dist, "get_world_size", self._get_world_size)
        monkeypatch.setattr(dist, "all_gather_object", self._all_gather_object)
        assert dist.is_initialized() and (dist.get_rank(self), dist.get_world_size(self)) == (self.rank, self.world)
        return self

    def _get_rank(self, group=None):
        assert group is self, group
        return self.rank

    def _get_world_size(self, group=None):
        assert group is self, group
        return self.world

    def _all_gather_object(self, out, obj, group=None):
        assert group is self and len(out) == self.world, (group, len(out))
        self.exchanges += 1
        if self.exchanges == self.fail_at:
            raise self.error
        for r in range(self.world):
            out[r] = obj if r == self.rank else self.peers(self.exchanges, obj, r)
