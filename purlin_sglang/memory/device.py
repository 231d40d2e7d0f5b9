"""The interface every GPU symmetric-memory provider implements (loopback, ipc, nvshmem, torch).

A provider gives each rank one workspace laid out by :class:`WorkspaceLayout` (signal words,
then staging) in GPU memory, and the device pointers of every rank's workspace as mapped in
this process (a peer's over NVLink P2P or CUDA IPC; in loopback, all in one allocation). The
engines compute every offset through the layout; providers only allocate, exchange and map.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .layout import WorkspaceLayout


@runtime_checkable
class DeviceWorkspace(Protocol):
    layout: WorkspaceLayout
    rank: int
    device_index: int
    provider: str  # "loopback" | "ipc" | "nvshmem" | "torch"

    @property
    def base_ptrs(self) -> list[int]:
        """Device pointer of rank r's workspace, valid in this process, for every r."""

    @property
    def hbm_bytes(self) -> int:
        """GPU memory this rank's workspace holds (its own allocation, not the peers')."""

    def close(self) -> None:
        """Unmap peers and free this rank's memory. Safe to call twice."""


class WorkspaceLifetime:
    """What every provider's workspace shares: ``closed``, use as a context manager, a repr.

    Subclasses set ``rank``, ``world``, ``device_index``, ``nbytes`` and ``_closed`` and define
    ``close()``.
    """

    _closed: bool

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.nbytes} bytes"
        return (f"{type(self).__name__}(rank={self.rank}, world={self.world}, "
                f"device={self.device_index}, {state})")
