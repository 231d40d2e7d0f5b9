"""The interface every GPU symmetric-memory provider implements (loopback, ipc, nvshmem, torch).

A provider gives each rank one workspace laid out by :class:`WorkspaceLayout` (signal words,
then staging) in GPU memory, and the device pointers of every rank's workspace as mapped in
this process (a peer's over NVLink P2P or CUDA IPC; in loopback, all in one allocation). The
engines compute every offset through the layout; providers only allocate, exchange and map.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..errors import PurlinClosedError
from .layout import WorkspaceLayout


@runtime_checkable
class DeviceWorkspace(Protocol):
    layout: WorkspaceLayout
    rank: int
    device_index: int
    provider: str  # its name in memory/providers.py

    @property
    def base_ptrs(self) -> list[int]:
        """Device pointer of rank r's workspace, valid in this process, for every r."""

    @property
    def hbm_bytes(self) -> int:
        """GPU memory this rank's workspace holds (its own allocation, not the peers')."""

    def close(self) -> None:
        """Unmap peers and free this rank's memory. Safe to call twice."""


class _DeviceBytes:
    """``nbytes`` bytes of device memory at ``ptr``, described by the CUDA array interface (version 2:
    no stream; the memory is ready)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def device_bytes(ptr: int, nbytes: int, device_index: int):
    """A uint8 CUDA tensor over ``nbytes`` of device memory at ``ptr`` (not owned: no free, no copy)."""
    import torch

    return torch.as_tensor(_DeviceBytes(ptr, nbytes), device=torch.device("cuda", device_index))


class WorkspaceLifetime:
    """What every provider's workspace shares: its fields, ``closed``, ``base_ptrs`` and
    ``hbm_bytes`` (which refuse or report 0 once closed), use as a context manager, a repr.

    Subclasses call ``__init__`` with the fields, keep every rank's pointer in ``_ptrs`` (or
    override ``_mapped_ptrs``) and define ``close()``, which sets ``_closed``.
    """

    _closed: bool

    def __init__(self, *, rank: int, world: int, device_index: int, nbytes: int, layout: Any = None):
        self.layout = layout
        self.rank = rank
        self.world = world
        self.device_index = device_index
        self.nbytes = nbytes
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise PurlinClosedError(f"{type(self).__name__}.{what}: the workspace is closed; create a new one")

    def _mapped_ptrs(self) -> list[int]:
        return list(self._ptrs)

    @property
    def base_ptrs(self) -> list[int]:
        """Device pointer of rank r's workspace, valid in this process, for every r."""
        self._check_open("base_ptrs")
        return self._mapped_ptrs()

    @property
    def hbm_bytes(self) -> int:
        """GPU memory of this rank's own allocation (0 once closed)."""
        return 0 if self._closed else self.nbytes

    def staging_region(self, rank: int):
        """This process's rank's staging region (a DeviceLayout's) as a uint8 CUDA tensor over the
        workspace memory, no copy (memory/heap.py: the symmetric heap is its tail). The tensor does not
        keep the memory alive: it is valid until :meth:`close`."""
        self._check_open("staging_region")
        if rank != self.rank:
            raise ValueError(f"staging_region: rank {rank} is not this process's rank {self.rank}")
        return device_bytes(self.base_ptrs[rank] + self.layout.staging_off, self.layout.staging_bytes,
                            self.device_index)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.nbytes} bytes"
        return (f"{type(self).__name__}(rank={self.rank}, world={self.world}, "
                f"device={self.device_index}, {state})")
