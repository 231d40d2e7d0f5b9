"""PurlinGroupCommunicator: a purlin Communicator in SGLang's communicator convention.

Like SGLang's own device communicators (custom all-reduce, pymscclpp, torch symm-mem) it
has a ``disabled`` flag, cheap ``should_<op>(...)`` predicates, ops that return ``None``
when the call is not eligible (the caller then runs its original path, NCCL) and
``destroy()``. Eligibility never depends on anything that may differ between the ranks of
a group (see :mod:`.routing`), so every rank takes the same path.

Argument order follows torch.distributed: ``all_gather(output, input)`` ==
``all_gather_into_tensor``, ``reduce_scatter(output, input)`` == ``reduce_scatter_tensor``,
``all_to_all(output, input)`` == ``all_to_all_single`` with equal splits; sizes of the V
forms are rows of dim 0 per rank, as in ``GroupCoordinator.all_gatherv`` / ``reduce_scatterv``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any, Optional, Sequence

import torch

from ..api import Communicator
from ..engines.cpu import REDUCE_DTYPES
from .routing import PluginConfig

logger = logging.getLogger(__name__)


class PurlinGroupCommunicator:
    """One SGLang group's purlin communicator, built on the group's CPU (gloo) group.

    Construction is collective over ``group`` (every rank of it must construct one with
    the same config); a group of one rank builds nothing and is ``disabled``. Ops block the
    host until this rank's part is done (CPU engine). Not safe under CUDA graph capture
    yet: while capturing, every op declines and the original path runs.
    """

    def __init__(self, group: Any, device: Any, config: Optional[PluginConfig] = None, *, name: str = ""):
        import torch.distributed as dist

        self.config = config if config is not None else PluginConfig()
        self.routing = self.config.routing
        self.name = name or "group"
        self.device = torch.device(device)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.disabled = True
        self.routed: Counter = Counter()        # op -> calls served by purlin
        self.fallbacks: Counter = Counter()     # (op, reason) -> calls left to the original path
        self._bypass = 0
        self._capturing = False
        self._comm: Optional[Communicator] = None
        if self.world_size > 1:
            self._comm = Communicator(group, self.device, config=self.config.purlin)
            self.disabled = False

    # -- eligibility -------------------------------------------------------------------------
    def why_not(self, op: str, tensors: Sequence[torch.Tensor], nbytes: int, *, reduce: bool = False) -> Optional[str]:
        """Why ``op`` on ``tensors`` must take the original path, or None if purlin takes it. Pure."""
        if self.disabled:
            return "disabled"
        if self._bypass:
            return "bypass"
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                return "not a tensor"
            if t.device != self.device:
                return "device"
            if not t.is_contiguous():
                return "not contiguous"
            if t.is_cuda and torch.cuda.is_current_stream_capturing():
                return "graph capture"
        if self._capturing and any(t.is_cuda for t in tensors):
            return "graph capture"
        if reduce and tensors[0].dtype not in REDUCE_DTYPES:
            return "dtype"
        route = self.routing.route(op)
        if not route.enabled:
            return "off"
        if not route.admits(nbytes):
            return "size"
        return None

    def _decide(self, op: str, tensors: Sequence[torch.Tensor], nbytes: int, *, reduce: bool = False) -> bool:
        reason = self.why_not(op, tensors, nbytes, reduce=reduce)
        if reason is None:
            return True
        if reason != "bypass":
            self.fallbacks[(op, reason)] += 1
        return False

    def should_all_reduce(self, inp: torch.Tensor) -> bool:
        """True if :meth:`all_reduce` takes ``inp``; a False answer is counted as a fallback."""
        return self._decide("all_reduce", (inp,), _nbytes(inp), reduce=True)

    def should_all_gather(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        return (self._shape_ok("all_gather", output, inp, gather=True)
                and self._decide("all_gather", (output, inp), max(_nbytes(output), _nbytes(inp))))

    def should_reduce_scatter(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        return (self._shape_ok("reduce_scatter", output, inp, gather=False)
                and self._decide("reduce_scatter", (output, inp), max(_nbytes(output), _nbytes(inp)), reduce=True))

    def should_all_to_all(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        ok = inp.dim() >= 1 and output.numel() == inp.numel() and inp.shape[0] % self.world_size == 0
        if not ok:
            self.fallbacks[("all_to_all", "shape")] += 1
            return False
        return self._decide("all_to_all", (output, inp), _nbytes(inp))

    def _shape_ok(self, op: str, output: torch.Tensor, inp: torch.Tensor, *, gather: bool) -> bool:
        big, small = (output, inp) if gather else (inp, output)
        ok = (isinstance(big, torch.Tensor) and isinstance(small, torch.Tensor) and inp.dim() >= 1
              and big.numel() == small.numel() * self.world_size and big.dtype == small.dtype
              and (gather or inp.shape[0] % self.world_size == 0))
        if not ok:
            self.fallbacks[(op, "shape")] += 1
        return ok

    # -- ops: each returns None when not eligible (the caller runs its original path) -----------
    def all_reduce(self, inp: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Sum ``inp`` over the group into a new tensor (or ``out``; ``out`` may be ``inp``)."""
        if not self.should_all_reduce(inp):
            return None
        self.routed["all_reduce"] += 1
        return self._comm.all_reduce(inp, out=out)

    def all_gather(self, output: torch.Tensor, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """all_gather_into_tensor: rank r's ``inp`` lands in slice r of dim 0 of ``output``."""
        if not self.should_all_gather(output, inp):
            return None
        self.routed["all_gather"] += 1
        self._comm.all_gather(inp, out=output.view((inp.shape[0] * self.world_size,) + tuple(inp.shape[1:])))
        return output

    def reduce_scatter(self, output: torch.Tensor, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """reduce_scatter_tensor (sum): rank r receives the reduced slice r of dim 0."""
        if not self.should_reduce_scatter(output, inp):
            return None
        self.routed["reduce_scatter"] += 1
        self._comm.reduce_scatter(inp, out=output.view((inp.shape[0] // self.world_size,) + tuple(inp.shape[1:])))
        return output

    def all_to_all(self, output: torch.Tensor, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """all_to_all_single with equal splits."""
        if not self.should_all_to_all(output, inp):
            return None
        self.routed["all_to_all"] += 1
        self._comm.all_to_all(inp, out=output.view(inp.shape))
        return output

    def why_not_all_gather_v(self, inp: torch.Tensor, sizes: Optional[Sequence[int]],
                             output: Optional[torch.Tensor] = None) -> Optional[str]:
        """Why :meth:`all_gather_v` would decline these arguments (None: it takes them). Pure."""
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
            return "shape"
        sizes = self._gather_sizes(inp, sizes)
        if len(sizes) != self.world_size or sizes[self.rank] != inp.shape[0] or (
                output is not None and tuple(output.shape) != (sum(sizes),) + tuple(inp.shape[1:])):
            return "shape"
        tensors = (inp,) if output is None else (inp, output)
        return self.why_not("all_gather_v", tensors, sum(sizes) * _row_bytes(inp))

    def all_gather_v(self, inp: torch.Tensor, sizes: Optional[Sequence[int]],
                     output: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """GroupCoordinator.all_gatherv for one tensor: ``sizes[r]`` rows from rank r (None: equal)."""
        reason = self.why_not_all_gather_v(inp, sizes, output)
        if reason is not None:
            if reason != "bypass":
                self.fallbacks[("all_gather_v", reason)] += 1
            return None
        self.routed["all_gather_v"] += 1
        return self._comm.all_gather_v(inp, self._gather_sizes(inp, sizes), out=output)

    def _gather_sizes(self, inp: torch.Tensor, sizes: Optional[Sequence[int]]) -> list:
        return [int(inp.shape[0])] * self.world_size if sizes is None else [int(s) for s in sizes]

    def reduce_scatter_v(self, inp: torch.Tensor, sizes: Optional[Sequence[int]],
                         output: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """GroupCoordinator.reduce_scatterv (sum): rank r receives ``sizes[r]`` rows (None: equal)."""
        if not isinstance(inp, torch.Tensor) or inp.dim() < 1:
            self.fallbacks[("reduce_scatter_v", "shape")] += 1
            return None
        rows = int(inp.shape[0])
        if sizes is None:
            sizes = [rows // self.world_size] * self.world_size if rows % self.world_size == 0 else []
        sizes = [int(s) for s in sizes]
        ok = len(sizes) == self.world_size and sum(sizes) == rows
        if ok and output is not None:
            ok = tuple(output.shape) == (sizes[self.rank],) + tuple(inp.shape[1:])
        if not ok:
            self.fallbacks[("reduce_scatter_v", "shape")] += 1
            return None
        if not self._decide("reduce_scatter_v", (inp,) if output is None else (inp, output), _nbytes(inp), reduce=True):
            return None
        self.routed["reduce_scatter_v"] += 1
        return self._comm.reduce_scatter_v(inp, sizes, out=output)

    # -- lifetime ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def bypass(self):
        """Within this context every op declines without counting (the caller's own fallback)."""
        self._bypass += 1
        try:
            yield
        finally:
            self._bypass -= 1

    @contextlib.contextmanager
    def capture(self):
        """Entered by GroupCoordinator.graph_capture: CUDA ops decline while capturing (not graph-safe yet)."""
        prev, self._capturing = self._capturing, True
        try:
            yield self
        finally:
            self._capturing = prev

    def summary(self) -> str:
        routed = ", ".join(f"{k}={v}" for k, v in sorted(self.routed.items())) or "none"
        fell = ", ".join(f"{op}/{why}={n}" for (op, why), n in sorted(self.fallbacks.items())) or "none"
        return f"purlin[{self.name}]: routed {routed}; fell back to the original path: {fell}"

    def destroy(self) -> None:
        """Log the routing summary once and free the communicator. Not collective; safe twice."""
        if self._comm is None:
            return
        logger.info("%s", self.summary())
        self._comm.close()
        self._comm = None
        self.disabled = True

    def __repr__(self) -> str:
        return (f"PurlinGroupCommunicator({self.name}, rank={self.rank}/{self.world_size}, "
                f"device={self.device}, disabled={self.disabled})")


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _row_bytes(t: torch.Tensor) -> int:
    return int(torch.Size(t.shape[1:]).numel()) * t.element_size()
