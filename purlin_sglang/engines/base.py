"""The engine contract: what every datapath engine implements and what a call hands it.

An engine executes one rank's lowered SNAC schedules over a workspace (host memory for the CPU
engine, a device workspace for the CUDA engine). ``engines.create(name, ...)`` builds one by name;
``api.Communicator`` talks to it only through :class:`Engine` and :class:`CallContext`, so a new
engine is a new registry entry, not a new branch in the API.
"""

from __future__ import annotations

import zlib
from typing import Any, Optional, Protocol, runtime_checkable

import torch

from ..snac import Schedule

# Dtypes the reduce atoms support (16-bit floats accumulate in float32, in rank order).
REDUCE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)


def fingerprint(key: tuple) -> int:
    """A stable 63-bit digest of a call's cross-rank invariants (the same in every process)."""
    data = repr(key).encode()
    return (zlib.crc32(data) << 31) ^ zlib.adler32(data)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat uint8 view (an empty one for an empty tensor)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class CallContext:
    """What one call needs besides the schedule: names for messages and the user's buffers.

    ``x`` and ``y`` are the user's input and output tensors (contiguous, validated). ``inp`` and
    ``out`` are flat uint8 views of them, made on first use: the CPU engine works on those, the
    CUDA engine reads only the data pointers, so its calls make no views."""

    __slots__ = ("op", "seq", "fingerprint", "dtype", "x", "y", "_inp", "_out")

    def __init__(self, op: str, seq: int, fp: int, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor):
        self.op, self.seq, self.fingerprint, self.dtype, self.x, self.y = op, seq, fp, dtype, x, y
        self._inp = self._out = None

    @property
    def inp(self) -> torch.Tensor:
        if self._inp is None:
            self._inp = byte_view(self.x)
        return self._inp

    @property
    def out(self) -> torch.Tensor:
        if self._out is None:
            self._out = byte_view(self.y)
        return self._out


@runtime_checkable
class Engine(Protocol):
    """One rank's datapath. Built by ``engines.create(name, ws, rank, world, timeout_s, ranks_on_gpu=)``.

    ``broken`` is None while usable, else why not (set by :meth:`mark_broken` or a recorded failure).
    ``packets``: whether the engine runs packet plans (the planner may then choose ``"packet"``).
    """

    name: str
    packets: bool
    broken: Optional[str]

    def execute(self, sched: Schedule, ctx: CallContext) -> None:
        """Run (CPU: blocks until done) or enqueue (CUDA) this rank's part of one call. Collective."""

    def check(self) -> None:
        """Raise an error an earlier call recorded, without waiting for the device."""

    def synchronize(self) -> None:
        """Wait until this rank's enqueued calls are done; raise an error one of them recorded."""

    @property
    def table_bytes(self) -> int:
        """Device memory held for op tables (0 for host engines)."""

    def mark_broken(self, reason: str) -> None:
        """Make every later call fail with ``reason`` (peers waiting on this rank stop too where they can)."""

    def close(self) -> None:
        """Drop this engine's references to the workspace and its tables. Local; safe twice."""


@runtime_checkable
class MoEEngine(Protocol):
    """One rank's MoE dispatch / combine, built by ``engines.create_moe(name, comm)`` for a Communicator."""

    hbm_bytes: int

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 capacity: Optional[int], quant: str, capturing: bool) -> Any: ...

    def combine(self, expert_out: torch.Tensor, d: Any) -> torch.Tensor: ...

    def reject(self, error: Exception) -> None:
        """An eager dispatch whose arguments this rank rejected: tell the peers (they raise naming this
        rank) and raise ``error``."""
        ...

    def check(self, fatal_only: bool = False) -> None: ...

    def synchronize(self) -> None: ...

    def close(self) -> None: ...
