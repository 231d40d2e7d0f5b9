"""The ``loopback`` provider: N virtual ranks in ONE process on ONE GPU.

One allocation (through torch's caching allocator, zeroed once at creation) holds every rank's
workspace, laid out by :class:`~purlin_sglang.memory.layout.DeviceLayout`; ``base_ptrs[r]`` is
rank r's slice. The kernels are those that run between real peers: only the pointer table differs.
Creating it blocks the host (allocation and a zero fill, then a device synchronize); it is not
safe under CUDA graph capture. Grids must keep all ranks' blocks co-resident (engines/cuda.py).
"""

from __future__ import annotations

import torch

from .layout import DeviceLayout


class LoopbackWorld:
    """The shared allocation of all virtual ranks; ``view(r)`` is rank r's DeviceWorkspace."""

    def __init__(self, world: int, staging_bytes: int, device_index: int):
        self.layout = DeviceLayout(world, staging_bytes)
        self.world, self.device_index = world, device_index
        n = self.layout.rank_bytes * world
        self._buf = torch.zeros(n, dtype=torch.uint8, device=torch.device("cuda", device_index))
        torch.cuda.synchronize(device_index)  # zeroed before any rank's kernel can run
        base = self._buf.data_ptr()
        self._ptrs = [base + r * self.layout.rank_bytes for r in range(world)]

    @property
    def base_ptrs(self) -> list[int]:
        return list(self._ptrs)

    def view(self, rank: int) -> "LoopbackWorkspace":
        return LoopbackWorkspace(self, rank)

    def close(self) -> None:
        self._buf = None
        self._ptrs = []


class LoopbackWorkspace:
    """Rank ``rank``'s view of a :class:`LoopbackWorld` (implements DeviceWorkspace)."""

    provider = "loopback"

    def __init__(self, shared: LoopbackWorld, rank: int):
        self._shared = shared
        self.layout = shared.layout
        self.rank = rank
        self.device_index = shared.device_index

    @property
    def base_ptrs(self) -> list[int]:
        return self._shared.base_ptrs

    @property
    def hbm_bytes(self) -> int:
        return self.layout.rank_bytes

    def staging_region(self, rank: int):
        """Rank ``rank``'s staging region as a uint8 tensor (memory/heap.py: the heap is its tail)."""
        at = rank * self.layout.rank_bytes + self.layout.staging_off
        return self._shared._buf[at: at + self.layout.staging_bytes]

    def close(self) -> None:
        self._shared = None
