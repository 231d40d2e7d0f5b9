"""RoutedCommunicator: a purlin Communicator behind a serving framework's group coordinator.

The framework-neutral half of a plugin (SGLang's adapter, :mod:`purlin_sglang.sglang`, derives
from it): the routing table (which ops, which sizes), eligibility, the fallback counters and
their report, the CUDA-graph warm-up rule and the deterministic mode. Like the frameworks' own
device communicators (custom all-reduce, pymscclpp, torch symm-mem) it has a ``disabled``
flag, cheap ``should_<op>(...)`` predicates, ops that return ``None`` when the call is not
eligible (the caller then runs its original path, NCCL) and ``destroy()``. Eligibility never
depends on anything that may differ between the ranks of a group (see :mod:`.routing`), so
every rank takes the same path.

Argument order follows torch.distributed: ``all_gather(output, input)`` ==
``all_gather_into_tensor``, ``reduce_scatter(output, input)`` == ``reduce_scatter_tensor``,
``all_to_all(output, input)`` == ``all_to_all_single`` with equal splits; sizes of the V
forms are rows of dim 0 per rank, as in ``GroupCoordinator.all_gatherv`` / ``reduce_scatterv``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from datetime import timedelta
from typing import Any, Hashable, Optional, Sequence

import torch

from ..api import Communicator
from ..engines.base import REDUCE_DTYPES
from ..errors import PurlinTopologyError
from .routing import PluginConfig, for_deterministic_inference

logger = logging.getLogger(__name__)

WARM_KEYS = 4096  # calls (op, group-wide sizes, dtype) remembered as warmed up, least recently used dropped
NOT_WARM = "not warmed up"
SPANS_NODES = "spans nodes"  # the group is on several nodes and purlin cannot join them (topology.inter_node)


class RoutedCommunicator:
    """One framework group's purlin communicator, built on the group's CPU (gloo) group.

    Construction is collective over ``group`` (every rank of it must construct one with
    the same config); a group of one rank builds nothing and is ``disabled``. ``device``
    picks the engine: a CUDA device runs purlin's CUDA engine on the configured ``memory``
    provider (``auto`` = ``ipc``), ``cpu`` the CPU engine. ``deterministic``: the framework runs
    batch-invariant (SGLang's ``--enable-deterministic-inference``): every enabled reduction stays
    on purlin at every size (:func:`.routing.for_deterministic_inference`).

    Host blocking: CPU-engine ops return when this rank's part is done. CUDA ops are
    enqueued on the caller's current stream and return at once (no host or device sync);
    a CUDA call's error (a peer that never joined: a timeout) is raised at a later call on
    this rank, or is logged by :meth:`destroy`.

    CUDA graphs: a call made while the current stream is capturing is served only if the
    same call (op, group-wide sizes, dtype) was served eagerly before, so that its device
    op table exists (a framework's CUDA-graph runner runs every shape eagerly, inside its
    graph-capture context, before it captures it: SGLang's twice); any other call declines, is
    counted as a fallback with reason ``"not warmed up"``, and the original path (pynccl in
    graph mode) runs it. Every rank sees the same calls, so every rank decides the same. The
    framework's graph-capture context (SGLang: ``GroupCoordinator.graph_capture``) enters
    :meth:`capture` (purlin's capture context nested inside the framework's).
    """

    def __init__(self, group: Any, device: Any, config: Optional[PluginConfig] = None, *, name: str = "",
                 deterministic: bool = False):
        import torch.distributed as dist

        self.config = config if config is not None else PluginConfig()
        self.routing = self.config.routing
        self.name = name or "group"
        self.device = torch.device(device)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.disabled = True
        self.routed: Counter = Counter()        # op -> calls served by purlin (captured ones included)
        self.captured: Counter = Counter()      # op -> calls served by purlin while the stream was capturing
        self.fallbacks: Counter = Counter()     # (op, reason) -> calls left to the original path
        self._bypass = 0
        self._capture_depth = 0                 # > 0 inside the framework's graph-capture context
        self._warm: OrderedDict = OrderedDict()  # keys of calls served (LRU, at most WARM_KEYS)
        self._group = group
        self._report_every = float(self.config.report_interval_s)
        self._last_report = time.monotonic()
        self._comm: Optional[Communicator] = None
        self._watch_stop = threading.Event()  # ends the error watch (destroy)
        self.unavailable: Optional[str] = None  # why purlin cannot serve this group at all (then disabled)
        if self.world_size > 1:
            try:
                self._comm = Communicator(group, self.device, config=self.config.purlin)
            except PurlinTopologyError as e:  # a group across nodes with no way to join them: the framework's path
                self.unavailable = SPANS_NODES
                self.fallbacks[("group", SPANS_NODES)] += 1  # the whole group, once (its report shows it)
                logger.warning("purlin[%s]: %s; this group's collectives take the framework's own path (fallback "
                               "group/%s)", self.name, e, SPANS_NODES)
                return
            self.device = self._comm.device  # normalized ("cuda" -> "cuda:N")
            self.disabled = False
            if self._comm.engine_name == "cuda" and self.config.error_watch_s > 0:
                threading.Thread(target=self._watch_errors, args=(self._comm, self.config.error_watch_s),
                                 name=f"purlin-watch-{self.name}", daemon=True).start()
            if deterministic:
                self.routing, notes = for_deterministic_inference(self.routing)
                if notes and self.rank == 0:
                    logger.info("purlin[%s]: deterministic inference: reductions stay on purlin at every size "
                                "(batch-invariant): %s", self.name, "; ".join(notes))

    @property
    def communicator(self) -> Optional[Communicator]:
        """The purlin :class:`~purlin_sglang.Communicator` underneath (None once destroyed or for one rank)."""
        return self._comm

    @property
    def bypassed(self) -> bool:
        """True inside :meth:`bypass`: every op declines without counting (the caller's own fallback runs)."""
        return self._bypass > 0

    @property
    def engine(self) -> str:
        """``"cuda"`` or ``"cpu"`` (``"none"`` when disabled)."""
        return self._comm.engine_name if self._comm is not None else "none"

    # -- eligibility -------------------------------------------------------------------------
    def is_capturing(self) -> bool:
        """True while the current CUDA stream is capturing a graph (always False on CPU)."""
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def why_not(self, op: str, tensors: Sequence[torch.Tensor], nbytes: int, *, reduce: bool = False,
                key: Optional[Hashable] = None) -> Optional[str]:
        """Why ``op`` on ``tensors`` must take the original path, or None if purlin takes it. Pure.

        ``key`` names the call for the warm-up check during graph capture (None: never warmed up).
        """
        if self.disabled:
            return self.unavailable or "disabled"
        if self._bypass:
            return "bypass"
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                return "not a tensor"
            if t.device != self.device:
                return "device"
            if not t.is_contiguous():
                return "not contiguous"
        if reduce and tensors[0].dtype not in REDUCE_DTYPES:
            return "dtype"
        route = self.routing.route(op)
        if not route.enabled:
            return "off"
        if not route.admits(nbytes):
            return "size"
        if self.is_capturing() and (key is None or key not in self._warm):
            return NOT_WARM
        return None

    def _decide(self, op: str, tensors: Sequence[torch.Tensor], nbytes: int, *, reduce: bool = False,
                key: Optional[Hashable] = None) -> bool:
        reason = self.why_not(op, tensors, nbytes, reduce=reduce, key=key)
        if reason is None:
            return True
        if reason != "bypass":
            self.fallbacks[(op, reason)] += 1
            self._maybe_report()
        return False

    def _maybe_report(self) -> None:
        """Log :meth:`summary` at most every ``report_interval_s`` (never while capturing a graph)."""
        if self._report_every and time.monotonic() - self._last_report >= self._report_every \
                and not self.is_capturing():
            self._last_report = time.monotonic()
            logger.info("%s", self.summary())

    def note_served(self, op: str) -> None:
        """Count a call of ``op`` served by purlin (counted as captured while capturing) in the routing
        report. Also called by a MoE dispatcher (SGLang's adapter) for its moe_dispatch / moe_combine
        calls on this group's communicator, so that the report shows them."""
        self.routed[op] += 1
        if self.is_capturing():
            self.captured[op] += 1
        self._maybe_report()

    def _served(self, op: str, key: Hashable) -> None:
        """Count a served call and remember its key as warmed up."""
        self._warm[key] = None
        self._warm.move_to_end(key)
        while len(self._warm) > WARM_KEYS:
            self._warm.popitem(last=False)
        self.note_served(op)

    def is_warm(self, key: Hashable) -> bool:
        """Whether the call named ``key`` (see the ``*_key`` helpers) was served eagerly before."""
        return key in self._warm

    @staticmethod
    def all_reduce_key(inp: torch.Tensor) -> tuple:
        return ("all_reduce", inp.dtype, tuple(inp.shape))

    def would_all_reduce(self, inp: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce` would take ``inp`` now. Pure (counts nothing)."""
        return self.why_not("all_reduce", (inp,), _nbytes(inp), reduce=True, key=self.all_reduce_key(inp)) is None

    def should_all_reduce(self, inp: torch.Tensor) -> bool:
        """True if :meth:`all_reduce` takes ``inp``; a False answer is counted as a fallback."""
        return self._decide("all_reduce", (inp,), _nbytes(inp), reduce=True, key=self.all_reduce_key(inp))

    def should_all_gather(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        return (self._shape_ok("all_gather", output, inp, gather=True)
                and self._decide("all_gather", (output, inp), max(_nbytes(output), _nbytes(inp)),
                                 key=("all_gather", inp.dtype, tuple(inp.shape))))

    def should_reduce_scatter(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        return (self._shape_ok("reduce_scatter", output, inp, gather=False)
                and self._decide("reduce_scatter", (output, inp), max(_nbytes(output), _nbytes(inp)), reduce=True,
                                 key=("reduce_scatter", inp.dtype, tuple(inp.shape))))

    def should_all_to_all(self, output: torch.Tensor, inp: torch.Tensor) -> bool:
        ok = inp.dim() >= 1 and output.numel() == inp.numel() and inp.shape[0] % self.world_size == 0
        if not ok:
            self.fallbacks[("all_to_all", "shape")] += 1
            return False
        return self._decide("all_to_all", (output, inp), _nbytes(inp), key=("all_to_all", inp.dtype, tuple(inp.shape)))

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
        res = self._comm.all_reduce(inp, out=out)
        self._served("all_reduce", self.all_reduce_key(inp))
        return res

    def all_gather(self, output: torch.Tensor, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """all_gather_into_tensor: rank r's ``inp`` lands in slice r of dim 0 of ``output``."""
        if not self.should_all_gather(output, inp):
            return None
        self._comm.all_gather(inp, out=output.view((inp.shape[0] * self.world_size,) + tuple(inp.shape[1:])))
        self._served("all_gather", ("all_gather", inp.dtype, tuple(inp.shape)))
        return output

    def reduce_scatter(self, output: torch.Tensor, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """reduce_scatter_tensor (sum): rank r receives the reduced slice r of dim 0."""
        if not self.should_reduce_scatter(output, inp):
            return None
        self._comm.reduce_scatter(inp, out=output.view((inp.shape[0] // self.world_size,) + tuple(inp.shape[1:])))
        self._served("reduce_scatter", ("reduce_scatter", inp.dtype, tuple(inp.shape)))
        return output

    def all_to_all(self, output: torch.Tensor, inp: torch.Tensor) -> Optional[torch.Tensor]:
        """all_to_all_single with equal splits."""
        if not self.should_all_to_all(output, inp):
            return None
        self._comm.all_to_all(inp, out=output.view(inp.shape))
        self._served("all_to_all", ("all_to_all", inp.dtype, tuple(inp.shape)))
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
        return self.why_not("all_gather_v", tensors, sum(sizes) * _row_bytes(inp), key=self._v_key("all_gather_v", inp, sizes))

    def all_gather_v(self, inp: torch.Tensor, sizes: Optional[Sequence[int]],
                     output: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """GroupCoordinator.all_gatherv for one tensor: ``sizes[r]`` rows from rank r (None: equal)."""
        reason = self.why_not_all_gather_v(inp, sizes, output)
        if reason is not None:
            if reason != "bypass":
                self.fallbacks[("all_gather_v", reason)] += 1
            return None
        sizes = self._gather_sizes(inp, sizes)
        res = self._comm.all_gather_v(inp, sizes, out=output)
        self._served("all_gather_v", self._v_key("all_gather_v", inp, sizes))
        return res

    def _gather_sizes(self, inp: torch.Tensor, sizes: Optional[Sequence[int]]) -> list:
        return [int(inp.shape[0])] * self.world_size if sizes is None else [int(s) for s in sizes]

    @staticmethod
    def _v_key(op: str, inp: torch.Tensor, sizes: Sequence[int]) -> tuple:
        # The same on every rank: the sizes and the row shape (not this rank's row count).
        return (op, inp.dtype, tuple(sizes), tuple(inp.shape[1:]))

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
        key = self._v_key("reduce_scatter_v", inp, sizes)
        if not self._decide("reduce_scatter_v", (inp,) if output is None else (inp, output), _nbytes(inp),
                            reduce=True, key=key):
            return None
        res = self._comm.reduce_scatter_v(inp, sizes, out=output)
        self._served("reduce_scatter_v", key)
        return res

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
        """Entered by the framework's graph-capture context (SGLang's GroupCoordinator.graph_capture).

        Enters the purlin Communicator's :meth:`~purlin_sglang.Communicator.capture`. Inside,
        eager calls (the framework's warm-up runs) are served and remembered as warmed up; calls made
        while the stream is capturing are served only if warmed up (see the class docstring).
        """
        ctx = self._comm.capture() if self._comm is not None else contextlib.nullcontext()
        with ctx:
            self._capture_depth += 1
            try:
                yield self
            finally:
                self._capture_depth -= 1

    def _watch_errors(self, comm: Communicator, every: float) -> None:
        """Log each error a kernel of this rank records, once, as soon as it appears, and each peer process
        that exits (``Communicator.lost_peers``), once (a daemon thread; it reads host memory and /proc only
        and ends with :meth:`destroy`). A non-fatal error (a MoE capacity overflow) is cleared when a call
        raises it, so a later error is logged too."""
        last, lost = None, set()
        while not self._watch_stop.wait(every):
            try:
                error = comm.pending_error()
                gone = comm.lost_peers()
            except Exception:  # noqa: BLE001 - a communicator closed under the watch: nothing to report
                return
            for peer, pid in sorted(gone.items()):
                if peer not in lost:
                    lost.add(peer)
                    logger.error("purlin[%s]: rank %d: peer rank %d (pid %d) has exited; this rank's calls that "
                                 "need it end with PurlinTimeoutError after timeout_s (%gs)", self.name, self.rank,
                                 peer, pid, comm.config.timeout_s)
            text = None if error is None else f"{type(error).__name__}: {error}"
            if text is not None and text != last:
                logger.error("purlin[%s]: rank %d: %s", self.name, self.rank, text)
            last = text

    def summary(self) -> str:
        routed = ", ".join(f"{k}={v}" for k, v in sorted(self.routed.items())) or "none"
        fell = ", ".join(f"{op}/{why}={n}" for (op, why), n in sorted(self.fallbacks.items())) or "none"
        text = f"purlin[{self.name}]: routed {routed}; fell back to the original path: {fell}"
        if self.captured:
            text += "; captured in CUDA graphs: " + ", ".join(f"{k}={v}" for k, v in sorted(self.captured.items()))
        return text

    def destroy(self) -> None:
        """Log the routing summary once and free purlin's memory (``Communicator.close``). Safe twice.

        CUDA: waits for this rank's enqueued calls, then for every rank of the group to get
        that far (a barrier on the CPU group, bounded by ``timeout_s``; a rank that never
        arrives is logged and the memory is freed anyway), since peers read this rank's memory.
        """
        if self._comm is None:
            return
        logger.info("%s", self.summary())
        self._watch_stop.set()
        comm, self._comm = self._comm, None
        self.disabled = True
        self._warm.clear()
        if comm.engine_name == "cuda":
            try:
                torch.cuda.synchronize(comm.device)  # every stream (graph replays too): my kernels have ended
                comm.synchronize()  # raises an error one of them recorded
            except Exception as e:  # noqa: BLE001 - a late error of an earlier call: report, still free
                logger.warning("purlin[%s]: an earlier call failed: %s", self.name, e)
            try:
                import torch.distributed as dist

                dist.monitored_barrier(group=self._group, timeout=timedelta(seconds=comm.config.timeouts.destroy_s),
                                       wait_all_ranks=True)
            except Exception as e:  # noqa: BLE001 - a peer that is gone reads nothing any more
                logger.warning("purlin[%s]: not every rank reached destroy (%s); freeing purlin's memory anyway",
                               self.name, e)
        comm.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name}, rank={self.rank}/{self.world_size}, "
                f"device={self.device}, engine={self.engine}, disabled={self.disabled})")


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _row_bytes(t: torch.Tensor) -> int:
    return int(torch.Size(t.shape[1:]).numel()) * t.element_size()
