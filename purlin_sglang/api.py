"""The public API: Communicator and run_virtual.

Collectives follow torch.distributed conventions along dim 0 (all_gather ==
all_gather_into_tensor, reduce_scatter == reduce_scatter_tensor, all_to_all(_v)
== all_to_all_single with splits; sizes are in rows of dim 0). Every method is
collective: every rank of the group must make the same calls in the same order.
Each validates its arguments before it touches shared state and returns the
output tensor (``out=`` if given). The argument checks, planning and caches are in
calls.py, the group's set-up in memory/bootstrap.py, the virtual ranks in virtual.py.
"""

from __future__ import annotations

import contextlib
import traceback
from datetime import timedelta
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch

from . import engines
from .capture import capturing_here, close_deferred, collection_paused, defer_close
from .calls import CacheInfo, CallPath, check_device, check_group, coerce_config, is_exchange, one_of
from .collectives import (
    ALL_GATHER, ALL_GATHER_V, ALL_REDUCE, ALL_TO_ALL, ALL_TO_ALL_V, BROADCAST, REDUCE_SCATTER,
    REDUCE_SCATTER_V, CollectiveSpec,
)
from .engines.base import CallContext, first_split_mismatch
from .snac.table import TableInUse
from .errors import (PurlinError, PurlinMismatchError, PurlinPlanError, PurlinTimeoutError, PurlinUnavailableError,
                     PurlinValueError, rejected_error, text_words, words_text)
from .memory import bootstrap, setup_phase
from .memory.heap import SymmetricHeap, heap_start, region_bytes
from .moe import MoEDispatch
from .moe.engine import MoEContext
from .moe.validate import checked_combine, checked_dispatch
from .multinode.communicator import TwoLevel, become
from .multinode.layout import NodeLayout
from .virtual import VirtualWorld, run_world

SPLIT_CAUSE_WORDS = 32  # a rejected exchange's message in the split check's row: 256 bytes of UTF-8


class Communicator:
    """A group of ranks that run collectives together.

    ``group`` is a torch.distributed process group (a gloo CPU group is enough; it
    sets up shared memory, and a CUDA process group compares its ``all_to_all_v`` splits over it:
    config ``split_check``). ``device`` is ``"cpu"`` or a CUDA
    device. ``config``: a :class:`PurlinConfig`, a dict of its keys, the path of a YAML file
    of them, or None (the defaults). Collective: every rank constructs its Communicator with the same
    config. Close it with :meth:`close` (or use it as a context manager).
    """

    CALL_CACHE_SIZE = 512  # validated call shapes kept per communicator (the oldest is dropped first)

    def __init__(self, group: Any = None, device: Any = "cpu", config: Any = None):
        self._closed = True  # until _init finishes (close() and __del__ stay safe)
        self._broken_reason: str | None = None
        self._gate = self._vworld = None  # virtual ranks only
        self.config = coerce_config(config)
        self.device = check_device(device)
        engine, self.memory = engines.select_engine(self.device, self.config.memory, virtual=False)
        group, rank, world = check_group(group)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", self.device.index if self.device.index is not None
                                       else torch.cuda.current_device())
        with setup_phase.bounded(self.config.timeouts.setup_s):  # every set-up wait ends within timeout_s
            nodes, hosts = bootstrap.node_of_rank(group, rank, world, self.config.topology.node_of_rank)
            self._nodes = nodes
            if len(set(nodes)) > 1:  # two levels: purlin inside each node, torch.distributed between
                become(self, MultiNodeCommunicator, group, rank, world, NodeLayout(nodes, hosts))
                return
            ws = bootstrap.group_workspace(self.memory, group, rank, world,
                                           region_bytes(self.config.staging_bytes, self.config.symmetric_bytes),
                                           shm_dir=self.config.shm_dir, device_index=self.device.index or 0)
            # Ranks of a group are processes (one GPU each, or time-sliced on one GPU): only this rank's
            # own grid must be co-resident. The engine is built locally; every rank learns whether every
            # rank managed.
            bootstrap.report_started(group, world, engine.name,
                                     lambda: self._init(ws, rank, world, engine.name, group, ranks_on_gpu=1),
                                     lambda: (self.close(), ws.close()))

    @classmethod
    def _virtual(cls, vworld: VirtualWorld, rank: int, engine: str, memory: str) -> "Communicator":
        self = cls.__new__(cls)
        self._closed = True  # until _init finishes (close() and __del__ stay safe)
        self._broken_reason = None
        self._gate, self._vworld = vworld.gate, vworld
        self.config, self.device, self.memory = vworld.config, vworld.device, memory
        self._nodes = (0,) * vworld.world  # threads of one process (run_virtual checks topology)
        # Virtual ranks share one GPU at once: every rank's grid must be co-resident.
        self._init(vworld.rank_workspace(rank), rank, vworld.world, engine, None, ranks_on_gpu=vworld.world)
        return self

    def _init(self, ws: Any, rank: int, world: int, engine: str, group: Any, *, ranks_on_gpu: int) -> None:
        close_deferred()  # communicators dropped during an earlier capture
        self.rank, self.world_size, self.group = rank, world, group
        self.engine_name = engine
        self._moe = None
        self._ws = ws
        self._engine = engines.create(engine, ws, rank, world, self.config.timeout_s, ranks_on_gpu=ranks_on_gpu,
                                      call_check=self.config.device_call_check)
        self._path = CallPath(rank, world, self.device, self.config, packets=bool(self._engine.packets),
                              maxsize=self.CALL_CACHE_SIZE,
                              placement="one_gpu" if ranks_on_gpu > 1 else "gpu_per_rank")
        self._seq = 0
        self._split_check = self._host_split_check()
        if self._gate is not None and hasattr(self._engine, "can_resync"):
            self._engine.can_resync = False  # virtual ranks hear of a rejection in the launch gate, before launching
        region, why = None, f"the {self.memory} provider cannot hand out heap tensors"
        if self.config.symmetric_bytes and hasattr(ws, "staging_region"):  # nothing runs here without a heap
            try:
                region = ws.staging_region(rank)
            except Exception as e:  # noqa: BLE001 - the heap is then unavailable, with the reason
                why = f"the {self.memory} provider's staging region could not be wrapped as a tensor: {e}"
        self._heap = SymmetricHeap(region, heap_start(self.config.staging_bytes), self.config.symmetric_bytes, why)
        self._path.heap = self._heap if self._heap.hi else None  # None: no lookup pays for a heap check
        self._closed = False
        # Made now (CUDA: a pinned allocation, an occupancy query), not inside a call: in loopback, host
        # allocations while peers' kernels spin could stall. The MoE region itself comes later.
        self._moe = engines.create_moe(engine, MoEContext(
            rank=rank, world=world, device=self.device, config=self.config, owner=id(self), all_gather=self.all_gather,
            all_to_all_v=self.all_to_all_v, mark_broken=self._engine.mark_broken, ranks_on_gpu=ranks_on_gpu,
            memory=self.memory, group=group, shared_regions=self._vworld.moe_regions if self._vworld else None))

    # -- properties --------------------------------------------------------------------------
    @property
    def workspace_bytes(self) -> int:
        """Bytes of shared memory this communicator's group holds (host memory on CPU, HBM on CUDA)."""
        if self._closed:
            return 0
        return self._ws.hbm_bytes * self.world_size if self.device.type == "cuda" else self._ws.nbytes

    @property
    def hbm_bytes(self) -> int:
        """Bytes of GPU memory this rank holds: its workspace plus its op tables (0 for the CPU engine)."""
        if self._closed or self.device.type != "cuda":
            return 0
        return self._ws.hbm_bytes + self._engine.table_bytes + self.moe_hbm_bytes

    @property
    def node_of_rank(self) -> tuple[int, ...]:
        """The node id of every rank of the group (config ``topology.node_of_rank``, else the ranks'
        hosts). A group on several nodes runs its collectives in two levels (purlin_sglang.multinode)."""
        return self._nodes

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or a failure released this rank's memory): every call raises."""
        return self._closed

    def moe_trace(self) -> Optional[dict[str, dict[str, int]]]:
        """With config ``moe.trace`` on the CUDA engine: when this rank's last ``moe_dispatch`` and
        ``moe_combine`` kernels ended each phase, ``{"dispatch": {"start": ns, "put": ns, ...}, "combine":
        {...}}`` (the GPU's globaltimer, one clock for every virtual rank of a GPU; block 0 of the grid;
        phases in ``abi.MOE_TRACE_PHASES``). Waits for this rank's MoE calls. None otherwise."""
        if self._closed:
            raise engines.closed_error("moe_trace", self._broken_reason)
        return self._moe.trace() if self._moe is not None else None

    @property
    def moe_hbm_bytes(self) -> int:
        """Bytes of GPU memory this rank's MoE region holds (0 before the first CUDA MoE call)."""
        return self._moe.hbm_bytes if getattr(self, "_moe", None) is not None else 0

    def symmetric_empty(self, shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` in this rank's symmetric heap (config ``symmetric_bytes``;
        not zeroed). Every rank must allocate the same sizes in the same order, so that a tensor lies at
        the same heap offset on every rank. A collective whose input is such a tensor, at the same
        offset on every rank, reads its peers' inputs in place (the ``direct`` plans: no staging copy),
        where it would otherwise run the staged one-shot; an in-place call, or one whose output
        overlaps its input, stays staged. Nothing is freed before :meth:`close`; the tensor must not be
        used after it. Every provider has one (a CUDA process group's, through the CUDA array
        interface; a provider that cannot wrap its memory raises PurlinUnavailableError with the
        reason). Local."""
        self._check_usable("symmetric_empty")
        return self._heap.empty(shape, dtype)

    def cache_info(self) -> CacheInfo:
        """This rank's call caches: hits and misses of the call cache, the entries held now and its bound
        (:attr:`CALL_CACHE_SIZE`), as a :class:`~purlin_sglang.calls.CacheInfo`. Local; cheap."""
        return self._path.info()

    def algorithm(self, collective: str | CollectiveSpec, nbytes: int | None) -> str:
        """The algorithm (``packet``, ``hybrid``, ``oneshot`` or ``twoshot``) this communicator runs for a
        call of ``collective`` (a catalog name or a spec) whose input on this rank is ``nbytes`` bytes
        (for all_gather_v and reduce_scatter_v: the group's largest push, the largest ``sizes`` entry in
        bytes; all_to_all_v is ``hybrid`` on the CUDA engine whatever its sizes, each pair choosing
        packets or the one-shot by its own size): what the call path chooses, from ``tuning`` and its
        table (:meth:`tuning_info`), for an input outside the symmetric heap (one inside it runs
        ``direct`` / ``direct-twoshot`` where this says ``oneshot`` / ``twoshot``: :meth:`symmetric_empty`).
        Local; cheap."""
        return self._path.algorithm(collective, nbytes)

    def tuning_info(self) -> TableInUse:
        """Which crossovers this communicator's planner uses: the tuning table's bands for its world
        (``tuning.table``) or the built-in thresholds, with the reason (e.g. a table of another GPU)."""
        return self._path.table

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._engine.broken else "ready")
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"engine={self.engine_name}, memory={self.memory}, {state})")

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op: Any = "sum", *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce ``x`` over all ranks; every rank receives the result. ``out`` may be ``x`` (in place)."""
        return self._run(ALL_REDUCE, x, out, op, None, None, None)

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate every rank's ``x`` along dim 0 in rank order (all_gather_into_tensor)."""
        return self._run(ALL_GATHER, x, out, None, None, None, None)

    def reduce_scatter(self, x: torch.Tensor, op: Any = "sum", *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce ``x`` over ranks; rank r receives slice r of dim 0 (reduce_scatter_tensor)."""
        return self._run(REDUCE_SCATTER, x, out, op, None, None, None)

    def all_to_all(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Slice r of ``x`` goes to rank r; slice p of the output came from rank p (equal splits)."""
        return self._run(ALL_TO_ALL, x, out, None, None, None, None)

    def all_gather_v(self, x: torch.Tensor, sizes: Sequence[int], *, out: torch.Tensor | None = None) -> torch.Tensor:
        """All-gather with per-rank row counts ``sizes`` (``sizes[rank] == x.shape[0]``)."""
        try:
            sizes = self._path.gather_sizes(x, sizes)
        except PurlinValueError as e:
            self._announce("all_gather_v", e)
        return self._run(ALL_GATHER_V, x, out, None, None, None, sizes)

    def reduce_scatter_v(self, x: torch.Tensor, sizes: Sequence[int], op: Any = "sum", *,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce-scatter where rank r receives ``sizes[r]`` rows (``sum(sizes) == x.shape[0]``)."""
        return self._run(REDUCE_SCATTER_V, x, out, op, None, sizes, None)

    def all_to_all_v(self, x: torch.Tensor, input_splits: Sequence[int] | None = None,
                     output_splits: Sequence[int] | None = None, *, out: torch.Tensor | None = None,
                     input_split_sizes: Sequence[int] | None = None,
                     output_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """all_to_all_single with splits: ``input_splits[r]`` rows go to rank r, ``output_splits[p]`` come from p.

        ``input_split_sizes`` / ``output_split_sizes`` (torch.distributed's names) are accepted instead."""
        try:
            input_splits = one_of("all_to_all_v", "input_splits", input_splits, "input_split_sizes", input_split_sizes)
            output_splits = one_of("all_to_all_v", "output_splits", output_splits, "output_split_sizes",
                                   output_split_sizes)
        except PurlinValueError as e:
            self._announce("all_to_all_v", e)
        return self._run(ALL_TO_ALL_V, x, out, None, None, input_splits, output_splits)

    def broadcast(self, x: torch.Tensor, root: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the root's ``x`` to every rank; by default in place into ``x`` (as torch.distributed)."""
        return self._run(BROADCAST, x, x if out is None else out, None, root, None, None)

    def run(self, spec: CollectiveSpec, x: torch.Tensor, *, out: torch.Tensor | None = None, op: Any = None,
            root: int | None = None, in_splits: Sequence[int] | None = None,
            out_splits: Sequence[int] | None = None) -> torch.Tensor:
        """Run any collective named by ``spec`` (a catalog entry or your own).

        ``op``: the reduction for reduce specs (default sum). ``root``: for rooted
        specs. ``in_splits`` / ``out_splits``: row counts per rank for sliced V
        layouts. Blocks the host until this rank's part is done.
        """
        return self._run(spec, x, out, op, root, in_splits, out_splits)

    # -- MoE expert parallelism ---------------------------------------------------------------
    def moe_dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                     num_experts: int, capacity: int | None = None, dtype: torch.dtype | None = None,
                     max_tokens: int | None = None) -> MoEDispatch:
        """Send every token to the ranks that own its top-k experts; return this rank's expert rows.

        Rank r owns global experts [r*E/W, (r+1)*E/W). ``x`` [T, H] (T may differ per rank, may be 0),
        ``topk_ids`` [T, K] int32/int64 (-1: the slot is skipped), ``topk_weights`` [T, K] float. A
        token travels once per destination rank. The result's ``x``: one row per (token, slot) routed
        here, grouped by local expert, source rank, token, k (:class:`~purlin_sglang.moe.MoEDispatch`).
        ``capacity``: ``world * capacity`` rows per local expert (padding rows: expert -1); more rows
        from one source for one expert raise PurlinCapacityError (never silent loss). Without it the
        rows are sized exactly (CUDA eager reads the counts on the host; under graph capture CUDA
        uses ``moe.max_tokens_per_rank``). ``dtype=torch.float8_e4m3fn``: FP8 rows, per-token float32
        ``.scales``. ``max_tokens``: the most tokens any rank dispatches in this call, the same value on
        every rank (default: this rank's T); the CUDA engine picks its decode mode from it under graph
        capture (``moe.decode_tokens``; eager calls use the exchanged counts), so every rank takes the
        same mode. Collective; what it blocks and captures: docs/DESIGN.md (MoE). A bad argument
        raises PurlinValueError; eager, the peers raise too, naming the rank (no timeout, the
        communicator stays usable); under graph capture only this rank raises.
        """
        self._check_usable("moe_dispatch")
        return checked_dispatch(self._moe, x, topk_ids, topk_weights, num_experts, capacity, dtype, self.world_size,
                                self.device, max_tokens=max_tokens)

    def moe_combine(self, expert_out: torch.Tensor, d: MoEDispatch) -> torch.Tensor:
        """Return [T, H] on each source rank: per token, sum over k of ``topk_weights[t, k] *
        expert_out[row of (t, k)]``, accumulated in float32 in the order k = 0..K-1 (slots with id
        -1 skipped), in ``expert_out``'s dtype. ``expert_out`` [R, H] is in ``d.x``'s row order
        (padding rows are ignored). Deterministic: bitwise equal on both engines and to
        :func:`purlin_sglang.moe.reference.reference_combine`. Collective.

        Arguments one rank rejects (PurlinValueError naming the argument there) end the call on every
        rank without a timeout: the CPU engine's peers raise at once, naming that rank; the CUDA engine's
        at their next MoE call's end or ``synchronize()``. The communicator stays usable.
        """
        self._check_usable("moe_combine")
        return checked_combine(self._moe, expert_out, d, self.device, id(self))

    # -- the call path (calls.py: checks, the algorithm, plans and caches) ---------------------
    def _run(self, spec: Any, x: Any, out: Any, op: Any, root: Any, in_splits: Any, out_splits: Any) -> torch.Tensor:
        call, got = self._path.lookup(spec, x, out, op, root, in_splits, out_splits)  # (empty once closed)
        if call is not None:  # a call shape seen (and valid) before: its cached schedule
            self._check_usable(call.name)
            out = got
            if call.splits is not None and self._split_check:
                self._check_splits(call.name, call.splits)
            launch = call.launch
            if launch:  # the steady state: the engine's prepared launch of this shape, one native call
                self._seq += 1
                try:
                    self._engine.launch(launch, x, out, self._seq)
                except PurlinError as e:
                    self._failed(e)
                    raise
                return out
        else:  # the full path: every check, planning and lowering; ``got`` is the call-cache key
            name = spec.name if isinstance(spec, CollectiveSpec) else "run"
            self._check_usable(name)
            try:
                call, out = self._path.prepare(spec, x, out, op, root, in_splits, out_splits, got)
            except PurlinValueError as e:
                if is_exchange(spec) and self._split_check:  # the peers wait in the split check: tell them
                    self._reject_in_split_check(name, e)
                self._announce(name, e)
            if call.splits is not None and self._split_check:
                self._check_splits(call.name, call.splits)
        self._seq += 1
        ctx = CallContext(call.name, self._seq, call.fingerprint, x.dtype, x, out, call.info, call.splits)
        self._execute(ctx, call.sched)
        if call.launch is None:
            # Bound once it ran: an engine that prepares launches (CudaEngine.bind), and no launch gate (which
            # must see every eager call of a virtual rank); otherwise every call of the shape runs execute().
            bind = getattr(self._engine, "bind", None) if self._gate is None else None
            call.launch = bind(call.sched, ctx) if bind is not None else False
        return out

    def _host_split_check(self) -> bool:
        """Whether this rank compares an exchange's splits with its peers over the host group before the
        call (config ``split_check``): a process group over gloo whose engine cannot see them (CUDA).
        Decided once, in ``_init``: none of it changes over the communicator's life."""
        if self.group is None or self.world_size == 1 or getattr(self._engine, "checks_splits", True):
            return False
        if not self.config.split_check:
            return False
        import torch.distributed as dist

        return dist.get_backend(self.group) == "gloo"

    def _check_splits(self, op: str, splits: tuple) -> None:
        """Every rank's (input rows per peer, output rows per peer) of this call, over the host group
        (:meth:`_gather_splits`): where two ranks disagree on the rows between them, every rank raises the
        same PurlinMismatchError naming both arguments; where a rank rejected its own arguments, every peer
        raises a PurlinRejectedError quoting it. Either before anything moves and before the call number is
        spent, so the communicator stays usable."""
        rows = self._gather_splits(op, splits, None)
        world = self.world_size
        causes = {q: words_text(r[1 + 2 * world:]) for q, r in enumerate(rows) if r[0]}
        if causes:
            raise rejected_error(op, causes, self._seq + 1)
        why = first_split_mismatch(op, [r[1:1 + world] for r in rows], [r[1 + world:1 + 2 * world] for r in rows])
        if why is not None:
            raise PurlinMismatchError(why, op=op, rank=self.rank)

    def _reject_in_split_check(self, op: str, error: PurlinValueError) -> NoReturn:
        """This rank rejected its own arguments of an exchange whose peers are in the split check: its row
        there carries the mark and its message, so they raise quoting it; then ``error`` is raised."""
        try:
            self._gather_splits(op, None, str(error))
        except PurlinError:
            pass  # a peer that never comes: the communicator is broken now; this rank's own error all the same
        raise error

    def _gather_splits(self, op: str, splits: tuple | None, cause: str | None) -> list[list[int]]:
        """One gloo all-gather over the group of a row per rank, [rejected, input rows per peer, output rows
        per peer, the rejection's message in SPLIT_CAUSE_WORDS words], its wait bounded by ``timeout_s``.
        A peer that never makes the call is a PurlinTimeoutError, and the communicator is broken (the
        group's exchanges are out of step then)."""
        import torch.distributed as dist

        world = self.world_size
        row = [1 if cause is not None else 0]
        row += [*splits[0], *splits[1]] if splits is not None else [0] * (2 * world)
        row += text_words(cause, SPLIT_CAUSE_WORDS) if cause is not None else [0] * SPLIT_CAUSE_WORDS
        mine = torch.tensor(row, dtype=torch.int64)
        got = [torch.empty_like(mine) for _ in range(world)]
        try:
            dist.all_gather(got, mine, group=self.group, async_op=True).wait(
                timeout=timedelta(seconds=self.config.timeout_s))
        except RuntimeError as e:  # gloo: "Operation timed out!", or a peer's connection closed
            error = PurlinTimeoutError(
                f"{op}: rank {self.rank} waited {self.config.timeout_s:g}s (timeout_s) for its peers to compare the "
                f"splits of call #{self._seq + 1} over the host group ({e}): a rank did not make this call, or "
                "has died; the communicator is broken (create a new one on every rank)", op=op, rank=self.rank)
            self._engine.mark_broken(str(error))
            self._failed(error)
            raise error from None
        return [g.tolist() for g in got]

    def _announce(self, op: str, error: PurlinValueError) -> NoReturn:
        """This rank rejected its own arguments of a collective: where the ranks can hear it (the CPU
        engine's descriptors; virtual ranks' launch gate) the call is announced as rejected, so that
        every peer raises a PurlinRejectedError quoting ``error`` instead of waiting for this rank, and
        the call number is spent on every rank alike; then ``error`` is raised. On a CUDA process group
        the engine writes a rejected descriptor into the peers' workspaces (CudaEngine.reject): their
        kernels of the call, already running, stop and they raise PurlinRejectedError; every rank then
        resets its protocol state with the others at the start of its next call (CudaEngine.resync), so
        the communicator stays usable. A call under graph capture raises it here only."""
        if self._closed or self._engine.broken or self.world_size == 1:
            raise error
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise error
        engine_reject = getattr(self._engine, "reject", None)
        if self._gate is None and engine_reject is None:
            raise error
        self._seq += 1
        if self._gate is not None:
            self._gate.reject(self.rank, self._seq, op, str(error))
        else:
            engine_reject(self._seq, op, str(error))
        raise error

    def _check_usable(self, name: str) -> None:
        if self._closed:
            raise engines.closed_error(name, self._broken_reason)
        try:
            if getattr(self._engine, "resync_pending", None) is not None and name != "synchronize":
                self._resync(name)
            engines.check_usable(name, self._engine, self._moe)
        except PurlinError:
            if getattr(self._engine, "resync_pending", None) is None:  # (a rejection just raised: usable)
                self._release_broken()
            raise

    def _resync(self, name: str) -> None:
        """A CUDA process group after a rejected call, raised on every rank: at this rank's next call (not at
        ``synchronize()``, which makes no call: a rank may synchronize and then wait for its peers' hosts),
        the reset of every rank's state with the others (CudaEngine.resync), from the call number they all
        agree on. A rank that never comes: PurlinTimeoutError after ``timeout_s``, the communicator broken.
        Not under graph capture (it copies and waits): there it raises, and the reset stays owed."""
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise PurlinUnavailableError(
                f"{name}: after a rejected call this rank resets the communicator's state with its peers at its "
                "next call, which cannot happen under CUDA graph capture; make one eager call on every rank first")
        self._seq = self._engine.resync(self._seq)

    def _execute(self, ctx: CallContext, sched: Any) -> None:
        """Run one call on the engine; a failure that breaks the engine releases this rank's memory."""
        try:
            if self._gate is None:
                self._engine.execute(sched, ctx)
            else:  # virtual ranks: the launch gate around it (virtual.py)
                self._gate.execute(self.rank, ctx, lambda: self._engine.execute(sched, ctx))
        except PurlinError as e:
            self._failed(e)
            raise

    def _failed(self, e: PurlinError) -> None:
        """A call raised ``e``: where it broke the engine, release this rank's memory now."""
        if self._engine.broken:
            # The engine's frames in the traceback hold views of the shared mapping: drop their
            # locals so that the mapping can really be unmapped now.
            traceback.clear_frames(e.__traceback__)
            self._release_broken()

    def _release_broken(self) -> None:
        """The engine is broken: free this rank's workspace and tables now (not at garbage collection);
        later calls raise PurlinBrokenError with the reason. Ranks of a virtual world share one
        workspace, released by run_virtual."""
        if self._closed or self._broken_reason:
            return
        self._broken_reason = self._engine.broken or "an earlier call failed"
        if self.group is not None:
            self.close()

    # -- lifetime ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until this rank's enqueued calls finished; raise an error one of them recorded.

        Blocks the host (a stream synchronize on CUDA; a no-op on CPU, whose calls block). CUDA calls
        report a timeout lazily: at the next call on this rank, or here.
        """
        self._check_usable("synchronize")
        try:
            self._engine.synchronize()
            if self._moe is not None:
                self._moe.synchronize()
        except PurlinError as e:
            self._failed(e)
            raise

    def pending_error(self) -> Optional[PurlinError]:
        """The error the device recorded for one of this rank's earlier calls and that its next call (or
        :meth:`synchronize`) will raise, or None; None too once closed, and on the CPU engine, whose calls
        raise as they run. Reads host memory only: no device sync, nothing changed, safe to call from
        another thread while calls run (a watchdog: SGLang's plugin logs it as soon as it appears, also
        when a CUDA graph's replays make no call that would raise it)."""
        engine, moe = self._engine, self._moe
        if self._closed or engine is None:
            return None
        return engine.recorded_error() or (moe.recorded_error() if moe is not None else None)

    def lost_peers(self) -> dict[int, int]:
        """The peers (rank -> pid) whose processes have exited since this communicator was made, among those
        this process can watch: ranks of a CUDA process group on this host, in this pid namespace (their
        pids come with the IPC set-up; a pid is checked with its start time, so a reused one is not
        mistaken for the peer). {} elsewhere (virtual ranks, the CPU engine, other memory providers) and
        once closed. Reads /proc only: safe from another thread while calls run. A call that needs a lost
        peer still ends with PurlinTimeoutError after ``timeout_s``; this says why, at once."""
        ws = None if self._closed else self._ws
        lost = getattr(ws, "lost_peers", None)
        return lost() if callable(lost) else {}

    @contextlib.contextmanager
    def capture(self):
        """Context for CUDA graph capture (the CPU engine captures nothing: a no-op).

        Calls inside are capturable: no host sync, no allocation by purlin. Every call captured
        must have been run once before (same collective, sizes and dtype) so that its op table
        exists: calls that were not are refused with a message saying to warm up outside the
        capture (as torch symmetric memory does). Errors of replayed calls surface at the next
        eager call or :meth:`synchronize`.

        Python's cyclic garbage collector is paused inside (restored when the last capture context of
        the process exits): a collection in the middle of a capture runs the finalisers of whatever
        unrelated objects it frees (an old CUDA graph, event or communicator), and a CUDA call made by
        one of them from the capturing thread invalidates the capture. Enter it before
        ``torch.cuda.graph``, as SGLang's graph runner freezes the collector around its captures.
        """
        self._check_usable("capture")
        with collection_paused():
            yield self

    def close(self) -> None:
        """Free this rank's resources. Not collective; safe to call twice. Every part is released even
        when one fails to (a CUDA call of a broken process, say); then the first failure is raised."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_engine", None) is None:
            return
        if self.device.type == "cuda" and self.group is not None:
            with contextlib.suppress(Exception):  # my kernels end (at worst by timeout) before my memory goes
                torch.cuda.synchronize(self.device)
        failures: list[Exception] = []

        def release(fn: Callable[[], None]) -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - raised below, after every part is released
                failures.append(e)

        if getattr(self, "_moe", None) is not None:
            release(self._moe.close)
            self._moe = None
        release(self._engine.close)
        if self.group is not None:  # a process-shared mapping is this rank's own
            release(self._ws.close)
        self._ws = None
        self._path.clear()
        if failures:
            raise failures[0]

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if capturing_here():  # no CUDA call inside a capture: closed when the capture ends
                defer_close(self)
                return
            self.close()
        except Exception:
            pass


class MultiNodeCommunicator(TwoLevel, Communicator):
    __doc__ = TwoLevel.__doc__
    _node_class = Communicator


def run_virtual(world_size: int, fn: Callable[[Communicator], Any], device: Any = "cpu", config: Any = None,
                reserve_bytes: int = 256 << 20) -> list:
    """Call ``fn(comm)`` once per virtual rank, concurrently, and return the results in rank order.

    Virtual ranks are threads of this process sharing one workspace: host memory on CPU; on
    ``device="cuda"``, loopback ranks on ONE GPU (one allocation, each rank its own thread and
    stream, running the CUDA engine; each rank's stream is synchronized after ``fn`` returns).

    On CUDA, an eager call is launched only once every virtual rank has reached it and returns only
    once every virtual rank has enqueued it (the launch gate, purlin_sglang/virtual.py), so ``fn``
    may run ordinary host code between calls: ``.cpu()``, ``.item()``, ``print(tensor)``, new
    tensors, even ``torch.cuda.synchronize()``. Still unsafe: replaying CUDA graphs that hold
    collectives (no gate runs inside a graph: launch every rank's replay before blocking any rank's
    host, as the bench does), capturing in several rank threads at once (torch refuses concurrent
    captures: serialize them), and host code that waits for another rank's host (a Python barrier
    of your own inside a call sequence the ranks do not share).
    If any rank raises, the others are released (CPU: their waits fail fast; CUDA: they time
    out) and the first root-cause error is re-raised.

    ``reserve_bytes`` (CUDA): bytes of torch's caching allocator reserved on each rank's stream
    before the ranks start (plus a few MiB of small blocks). Loopback ranks share one CUDA context,
    and a cudaMalloc in one rank while its peers' kernels wait for that rank's next launch stalls
    until their timeout; eager code in ``fn`` (MoE calls, expert computations) that allocates more
    than this per rank should raise it. When the world ends (every rank's kernels done), torch's
    unused cached memory goes back to the driver (``torch.cuda.empty_cache()``): blocks cached for
    the rank streams could serve no later stream.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PurlinValueError(f"run_virtual: world_size must be a positive int, got {world_size!r}")
    if not callable(fn):
        raise PurlinValueError(f"run_virtual: fn must be a callable taking the rank's Communicator, got {fn!r}")
    if isinstance(reserve_bytes, bool) or not isinstance(reserve_bytes, int) or reserve_bytes < 0:
        raise PurlinValueError(f"run_virtual: reserve_bytes must be an int >= 0, got {reserve_bytes!r}")
    return run_world(world_size, fn, check_device(device, "run_virtual"), coerce_config(config), reserve_bytes,
                     make=Communicator._virtual, mark_broken=lambda comm, why: comm._engine.mark_broken(why))


__all__ = ["Communicator", "MultiNodeCommunicator", "run_virtual", "CacheInfo", "PurlinError", "PurlinPlanError"]
