"""The symmetric heap: tensors at the same offset of every rank's workspace (config ``symmetric_bytes``).

The heap is the tail of each rank's staging region: staging is ``staging_bytes``, then, from the next
4096-byte boundary, ``symmetric_bytes`` of heap (:func:`region_bytes` is what the providers allocate
and every rank agrees on). Plans keep using the first ``staging_bytes``; a STAGE ref with a larger
offset reaches the heap, so engines read a peer's heap exactly as they read its staging.

``Communicator.symmetric_empty`` hands out tensors from it with a bump allocator. Every rank allocates
the same sizes in the same order, so a tensor has the same offset on every rank: a peer's copy is at
``offset`` of the peer's heap. A call whose input lies in the heap (at the same offset on every rank)
may read the peers' inputs in place: the ``direct`` plans (snac/planner.py). Memory is returned when
the communicator closes; its tensors must not be used after that.
"""

from __future__ import annotations

import math

import torch

from ..errors import PurlinUnavailableError, PurlinValueError

PAGE = 4096
ALIGN = 256  # bytes: every heap tensor starts at a multiple of this


def heap_start(staging_bytes: int) -> int:
    """Offset of the heap in a staging region (after ``staging_bytes``, at a page boundary)."""
    return -(-staging_bytes // PAGE) * PAGE


def region_bytes(staging_bytes: int, symmetric_bytes: int) -> int:
    """Bytes of each rank's staging region: staging, then the heap (none: exactly ``staging_bytes``)."""
    return staging_bytes if symmetric_bytes == 0 else heap_start(staging_bytes) + symmetric_bytes


class SymmetricHeap:
    """One rank's heap: ``region`` is its staging region as a uint8 tensor (None where this provider
    cannot hand out tensors: ``why_not`` says so), the heap its bytes ``[start, start + nbytes)``."""

    def __init__(self, region: torch.Tensor | None, start: int, nbytes: int, why_not: str = ""):
        self.start, self.nbytes, self.why_not = start, nbytes, why_not
        self._region = region if nbytes else None
        self._next = 0
        lo = region.data_ptr() + start if self._region is not None else 0
        self.lo, self.hi = lo, lo + (nbytes if self._region is not None else 0)  # data_ptr range

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` at the next free offset (not zeroed)."""
        if self.nbytes == 0:
            raise PurlinValueError("symmetric_empty: the communicator has no symmetric heap; set config "
                                   "symmetric_bytes (bytes per rank, the same on every rank)")
        if self._region is None:
            raise PurlinUnavailableError(f"symmetric_empty: {self.why_not}")
        if not isinstance(dtype, torch.dtype):
            raise PurlinValueError(f"symmetric_empty: dtype must be a torch.dtype, got {dtype!r}")
        try:
            shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        except (TypeError, ValueError):
            raise PurlinValueError(f"symmetric_empty: shape must be an int or a sequence of ints, got {shape!r}") \
                from None
        if any(s < 0 for s in shape):
            raise PurlinValueError(f"symmetric_empty: negative size in shape {shape}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        off = -(-self._next // ALIGN) * ALIGN
        if off + nbytes > self.nbytes:
            raise PurlinValueError(
                f"symmetric_empty: {nbytes} bytes do not fit: {self.nbytes - off} of the heap's {self.nbytes} bytes "
                "are left (nothing is freed before the communicator closes); raise config symmetric_bytes")
        self._next = off + nbytes
        a = self.start + off
        return self._region[a: a + nbytes].view(dtype).view(shape)

    def offset_of(self, ptr: int) -> int:
        """The heap offset of data pointer ``ptr`` (-1 outside the heap)."""
        return ptr - self.lo if self.lo <= ptr < self.hi else -1
