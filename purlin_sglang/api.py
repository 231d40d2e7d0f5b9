"""The public API: Communicator and run_virtual.

Collectives follow torch.distributed conventions along dim 0 (all_gather ==
all_gather_into_tensor, reduce_scatter == reduce_scatter_tensor, all_to_all(_v)
== all_to_all_single with splits; sizes are in rows of dim 0). Every method is
collective: every rank of the group must make the same calls in the same order.
Each validates its arguments before it touches shared state and returns the
output tensor (``out=`` if given).
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from typing import Any, Callable, Sequence

import torch

from .collectives import (
    ALL_GATHER, ALL_GATHER_V, ALL_REDUCE, ALL_TO_ALL, ALL_TO_ALL_V, BROADCAST, REDUCE_SCATTER,
    REDUCE_SCATTER_V, CollectiveSpec, ReduceOp,
)
from .config import PurlinConfig
from .engines import select_engine
from .engines.cpu import REDUCE_DTYPES, CallContext, CpuEngine, fingerprint
from .errors import (
    PurlinBrokenError, PurlinClosedError, PurlinConfigError, PurlinError, PurlinPlanError,
    PurlinTimeoutError, PurlinUnavailableError, PurlinValueError,
)
from .memory import HostWorkspace, WorkspaceLayout, setup_phase
from .memory.host import unlink_shared
from .moe import MoEDispatch
from .snac import Plan, Schedule, Sizes, choose_algorithm, lower, make_plan


def _coerce_config(config: Any) -> PurlinConfig:
    if config is None:
        return PurlinConfig()
    if isinstance(config, PurlinConfig):
        return config
    if isinstance(config, dict):
        return PurlinConfig.from_dict(config)
    raise PurlinConfigError(f"config must be a PurlinConfig, a dict or None, got {type(config).__name__}")


def _check_device(device: Any) -> torch.device:
    """``device`` as a torch.device of type cpu or cuda, else a PurlinValueError naming what is accepted."""
    accepted = "'cpu', 'cuda', 'cuda:N' or a torch.device of those types"
    if isinstance(device, bool) or not isinstance(device, (str, torch.device)):
        hint = f"; for GPU {device} use 'cuda:{device}'" if isinstance(device, int) and not isinstance(device, bool) else ""
        raise PurlinValueError(f"Communicator: device must be {accepted}, got {device!r} "
                               f"({type(device).__name__}){hint}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise PurlinValueError(f"Communicator: device must be {accepted}, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise PurlinValueError(f"Communicator: device must be {accepted}, got {device!r} (type {dev.type!r})")
    if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if dev.index >= n:
            raise PurlinValueError(f"Communicator: device {device!r} does not exist: this process sees {n} CUDA "
                                   f"device(s), cuda:0 to cuda:{n - 1}")
    return dev


def _check_group(group: Any) -> Any:
    """``group`` as a torch.distributed process group (None: the default group)."""
    import torch.distributed as dist

    if group is None:
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() returns to a rank outside it
        raise PurlinValueError("Communicator: this process is not a member of the given group")
    if not isinstance(group, dist.ProcessGroup):
        raise PurlinValueError(
            f"Communicator: group must be a torch.distributed ProcessGroup (e.g. dist.new_group(backend='gloo')) "
            f"or None for the default group, got {group!r} ({type(group).__name__})")
    return group


class _VirtualWorld:
    """Shared state of N virtual ranks in one process: host memory (CPU) or one loopback GPU allocation."""

    def __init__(self, world: int, config: PurlinConfig, device: torch.device, engine: str):
        self.world, self.config, self.engine = world, config, engine
        self.gate = None
        if device.type == "cuda":
            from .memory.loopback import LoopbackWorld
            from .virtual import LaunchGate

            self.gate = LaunchGate(world, config.timeout_s)  # eager calls return once every rank launched

            index = device.index if device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.workspace = LoopbackWorld(world, config.staging_bytes, index)
            from .engines.cuda_moe import SharedRegions

            self.moe_regions = SharedRegions()  # the MoE region, made by the first MoE call
        else:
            self.device = torch.device("cpu")
            self.workspace = HostWorkspace.private(WorkspaceLayout(world, config.staging_bytes))

    def rank_workspace(self, rank: int):
        return self.workspace.view(rank) if self.device.type == "cuda" else self.workspace

    def close(self) -> None:
        if self.device.type == "cuda":
            self.workspace.close()
            self.moe_regions.close()


class Communicator:
    """A group of ranks that run collectives together.

    ``group`` is a torch.distributed process group (a gloo CPU group is enough; it
    is used only to set up shared memory). ``device`` is ``"cpu"`` or a CUDA
    device. Collective: every rank constructs its Communicator with the same
    config. Close it with :meth:`close` (or use it as a context manager).
    """

    CALL_CACHE_SIZE = 512  # validated call shapes kept per communicator (the oldest is dropped first)

    def __init__(self, group: Any = None, device: Any = "cpu", config: Any = None):
        self._closed = True  # until _init finishes (close() and __del__ stay safe)
        self._broken_reason: str | None = None
        self._gate = None  # loopback virtual ranks only
        self.config = _coerce_config(config)
        self.device = _check_device(device)
        engine, self.memory = select_engine(self.device, self.config.memory, virtual=False)
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise PurlinValueError(
                "Communicator: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group('gloo', ...) first, or use purlin_sglang.run_virtual"
            )
        group = _check_group(group)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise PurlinValueError("Communicator: this process is not a member of the given group")
        with setup_phase.bounded(self.config.timeout_s):  # every set-up wait ends within timeout_s
            self._setup(group, rank, world, engine)

    def _setup(self, group: Any, rank: int, world: int, engine: Any) -> None:
        """The collective part of construction (inside :func:`setup_phase.bounded`)."""
        if engine.name != "cuda":
            self._init(self._host_workspace(group, rank, world), rank, world, engine.name, group)
            return
        ws = self._device_workspace(group, rank, world)
        try:  # the engine is built locally; every rank learns whether every rank managed
            self._init(ws, rank, world, engine.name, group)
            status = None
        except Exception as e:  # noqa: BLE001 - reported to every rank, re-raised below
            status, error = f"{type(e).__name__}: {e}", e
        statuses = setup_phase.gather_status(group, world, status, "Communicator")
        failed = [(r, m) for r, m in enumerate(statuses) if m is not None]
        if failed:
            self.close()
            ws.close()
            if status is not None:
                raise error
            raise PurlinUnavailableError("Communicator: the CUDA engine failed to start on "
                                         + "; ".join(f"rank {r}: {m}" for r, m in failed))

    def _host_workspace(self, group: Any, rank: int, world: int) -> HostWorkspace:
        """Rank 0 creates a /dev/shm workspace, every other rank maps it (collective over ``group``)."""
        import torch.distributed as dist

        layout = WorkspaceLayout(world, self.config.staging_bytes)
        src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        # Every failure below is reported to every rank (an all-gather that is also the barrier),
        # so a rank that cannot join never leaves the others blocked in a collective.
        path, ws, problem = None, None, None
        try:
            if rank == 0:
                try:
                    ws, path = HostWorkspace.create_shared(layout, self.config.shm_dir)
                except Exception as e:  # noqa: BLE001 - reported to every rank below
                    problem = ("unavailable", setup_phase.as_status(e)[2])
                box = [(path, self.config.staging_bytes)]
            else:
                box = [None]
            setup_phase.arrive("Communicator", group, world)
            dist.broadcast_object_list(box, src=src, group=group)
            path_seen, staging_seen = box[0]
            if rank != 0 and problem is None:
                if staging_seen != self.config.staging_bytes:
                    problem = ("config", f"rank 0 uses staging_bytes={staging_seen}, rank {rank} uses "
                                         f"{self.config.staging_bytes}; every rank needs the same config")
                elif path_seen is not None:
                    try:
                        ws = HostWorkspace.open_shared(layout, path_seen)
                    except Exception as e:  # noqa: BLE001 - reported to every rank below
                        problem = ("unavailable", setup_phase.as_status(e)[2])
            problems = setup_phase.gather_status(group, world, problem, "Communicator")
        finally:
            if path is not None:
                unlink_shared(path)  # every rank has mapped it (or failed): nothing can leak
        failed = [(r, p) for r, p in enumerate(problems) if p is not None]
        if failed:
            if ws is not None:
                ws.close()
            kind = PurlinConfigError if any(p[0] == "config" for _, p in failed) else PurlinUnavailableError
            raise kind("Communicator: " + "; ".join(f"rank {r}: {p[1]}" for r, p in failed))
        return ws

    def _device_workspace(self, group: Any, rank: int, world: int):
        """Every rank allocates its GPU workspace with the ``memory`` provider and maps its peers'.

        Collective over ``group``. The ranks first agree on the config that shapes the workspace
        (an all-gather that is also the barrier), so a mismatch is a PurlinConfigError on every rank.
        """
        from .memory import device_provider
        from .memory.layout import DeviceLayout

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        mine = {"staging_bytes": self.config.staging_bytes, "memory": self.memory}
        seen = setup_phase.gather_status(group, world, mine, "Communicator")
        differ = [k for k in mine if any(v[k] != seen[0][k] for v in seen)]
        if differ:
            raise PurlinConfigError(
                f"Communicator: ranks disagree on {', '.join(differ)}: "
                + "; ".join(f"{k}: " + ", ".join(f"rank {r}={v[k]!r}" for r, v in enumerate(seen)) for k in differ)
                + "; every rank needs the same config")
        dlayout = DeviceLayout(world, self.config.staging_bytes)
        provider = device_provider(self.memory)
        return provider.create(dlayout.rank_bytes, group, index, rank, world, layout=dlayout)

    @classmethod
    def _virtual(cls, vworld: _VirtualWorld, rank: int) -> "Communicator":
        self = cls.__new__(cls)
        self._closed = True  # until _init finishes (close() and __del__ stay safe)
        self._broken_reason = None
        self._gate = vworld.gate
        self.config = vworld.config
        self.device = vworld.device
        engine, self.memory = select_engine(self.device, self.config.memory, virtual=True)
        self._init(vworld.rank_workspace(rank), rank, vworld.world, engine.name, None)
        self._vworld = vworld
        return self

    def _init(self, ws: Any, rank: int, world: int, engine: str, group: Any) -> None:
        self.rank, self.world_size, self.group = rank, world, group
        self.engine_name = engine
        self._vworld = None
        self._moe = None
        self._ws = ws
        if engine == "cuda":
            from .engines.cuda import CudaEngine

            # Ranks of a group are processes (one GPU each, or time-sliced on one GPU): only this
            # rank's own grid must be co-resident. Virtual ranks share one GPU at once.
            on_gpu = 1 if group is not None else world
            self._engine = CudaEngine(ws, rank, world, self.config.timeout_s, ranks_on_gpu=on_gpu)
            from .engines.cuda_moe import CudaMoE

            # Made now (a pinned allocation, an occupancy query), not inside a call: in loopback, host
            # allocations while peers' kernels spin could stall. The MoE region itself comes later.
            self._moe = CudaMoE(self)
        else:
            self._engine = CpuEngine(ws, rank, world, self.config.timeout_s)
        self._engine_packets = bool(getattr(self._engine, "packets", False))  # the planner may choose "packet"
        self._seq = 0
        self._closed = False
        self._plans: dict[tuple, Plan] = {}
        self._schedules: dict[tuple, Schedule] = {}
        self._calls: dict[tuple, _Call] = {}  # the call cache: see _run

    # -- properties --------------------------------------------------------------------------
    @property
    def workspace_bytes(self) -> int:
        """Bytes of shared memory this communicator's group holds (host memory on CPU, HBM on CUDA)."""
        if self._closed:
            return 0
        return self._ws.hbm_bytes * self.world_size if self.engine_name == "cuda" else self._ws.nbytes

    @property
    def hbm_bytes(self) -> int:
        """Bytes of GPU memory this rank holds: its workspace plus its op tables (0 for the CPU engine)."""
        if self._closed or self.engine_name != "cuda":
            return 0
        return self._ws.hbm_bytes + self._engine.table_bytes + self.moe_hbm_bytes

    @property
    def moe_hbm_bytes(self) -> int:
        """Bytes of GPU memory this rank's MoE region holds (0 before the first CUDA MoE call)."""
        return self._moe.hbm_bytes if getattr(self, "_moe", None) is not None else 0

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
        sizes = self._splits("all_gather_v", "sizes", sizes)
        if sizes[self.rank] != self._rows(x):
            raise PurlinValueError(
                f"all_gather_v: sizes[{self.rank}]={sizes[self.rank]} but x has {self._rows(x)} rows on rank {self.rank}"
            )
        return self._run(ALL_GATHER_V, x, out, None, None, None, sizes)

    def reduce_scatter_v(self, x: torch.Tensor, sizes: Sequence[int], op: Any = "sum", *,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """Reduce-scatter where rank r receives ``sizes[r]`` rows (``sum(sizes) == x.shape[0]``)."""
        return self._run(REDUCE_SCATTER_V, x, out, op, None, sizes, None)

    def all_to_all_v(self, x: torch.Tensor, input_splits: Sequence[int], output_splits: Sequence[int], *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """all_to_all_single with splits: ``input_splits[r]`` rows go to rank r, ``output_splits[p]`` come from p."""
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
                     num_experts: int, capacity: int | None = None, dtype: torch.dtype | None = None) -> MoEDispatch:
        """Send every token to the ranks that own its top-k experts; return this rank's expert rows.

        Experts are split contiguously: rank r owns global experts [r*E/W, (r+1)*E/W). ``x`` [T, H]
        (T may differ per rank, may be 0), ``topk_ids`` [T, K] int32/int64 (-1: no expert, the slot
        is skipped), ``topk_weights`` [T, K] float. Each token travels once per destination rank.
        The result's ``x`` holds one row per (token, slot) routed here, grouped by local expert, then
        source rank, token index, k (see :class:`~purlin_sglang.moe.MoEDispatch`). ``capacity``:
        a fixed ``world * capacity`` rows per local expert (padding rows have expert -1); more than
        ``capacity`` rows from one source rank for one expert raise PurlinCapacityError (never
        silent loss). Without it the rows are sized exactly (eager; on CUDA the call then reads the
        counts on the host; under graph capture CUDA uses ``capacity = moe.max_tokens_per_rank``).
        ``dtype=torch.float8_e4m3fn``: FP8 rows with per-token float32 scales in ``.scales``.

        Collective. CPU: blocks the host. CUDA: see docs/DESIGN.md (MoE) for what it blocks and
        what is capturable. Bad arguments raise PurlinValueError naming the argument; in eager mode
        the peers learn of it in the call's header exchange and raise too (naming the rank), so a bad
        call on one rank costs no timeout and the communicator stays usable. Under graph capture
        the error is this rank's alone (no host exchange there).
        """
        self._check_usable("moe_dispatch")
        cuda = self.engine_name == "cuda"
        capturing = cuda and torch.cuda.is_current_stream_capturing()
        from .moe.validate import check_dispatch

        from .engines import cpu_moe

        try:
            quant = check_dispatch(x, topk_ids, topk_weights, num_experts, capacity, dtype, self.world_size,
                                   self.device, check_values=not cuda)  # CUDA checks the ids itself (eager only)
        except PurlinValueError as e:  # tell the peers (eager): every rank raises, the communicator stays usable
            if capturing:
                raise
            if cuda:  # either reject raises
                self._moe_engine().reject(e)
            else:
                cpu_moe.reject(self, "moe_dispatch", e)
        if cuda:
            return self._moe_engine().dispatch(x, topk_ids, topk_weights, num_experts, capacity, quant, capturing)
        plan = self._moe_plan("dispatch", num_experts, capacity, quant)
        return cpu_moe.dispatch(self, plan, x, topk_ids, topk_weights, id(self))

    def moe_combine(self, expert_out: torch.Tensor, d: MoEDispatch) -> torch.Tensor:
        """Return [T, H] on each source rank: per token, sum over k of ``topk_weights[t, k] *
        expert_out[row of (t, k)]``, accumulated in float32 in the order k = 0..K-1 (slots with id
        -1 skipped), in ``expert_out``'s dtype. ``expert_out`` [R, H] is in ``d.x``'s row order
        (padding rows are ignored). Deterministic: bitwise equal on both engines and to
        :func:`purlin_sglang.moe.reference.reference_combine`. Collective.
        """
        self._check_usable("moe_combine")
        from .moe.validate import check_combine

        check_combine(expert_out, d, self.device, id(self))
        if self.engine_name == "cuda":
            return self._moe_engine().combine(expert_out, d)
        from .engines import cpu_moe

        return cpu_moe.combine(self, expert_out, d)

    def _moe_plan(self, kind: str, num_experts: int, capacity: int | None, quant: str):
        from .collectives import MOE_COMBINE, MOE_DISPATCH
        from .snac.moe import make_moe_plan

        key = ("moe", kind, num_experts, capacity, quant)
        plan = self._plans.get(key)
        if plan is None:
            spec = MOE_DISPATCH if kind == "dispatch" else MOE_COMBINE
            plan = make_moe_plan(spec, self.world_size, self.rank, num_experts, capacity=capacity, quant=quant)
            self._plans[key] = plan
        return plan

    def _moe_engine(self):
        eng = getattr(self, "_moe", None)
        if eng is None:
            from .engines.cuda_moe import CudaMoE

            eng = self._moe = CudaMoE(self)
        return eng

    # -- the call path -----------------------------------------------------------------------
    # A call whose spec, op, root, dtype, shape and splits were seen before (and were valid then) skips
    # the planning and the argument checks that depend only on those: it finds its schedule, fingerprint
    # and output shape in self._calls. Checks that depend on the tensor objects (device, layout,
    # contiguity, out's dtype and shape, overlap) and on the communicator's state run on every call; a
    # call that fails one of them takes the full path below, which raises the error with its message.
    def _run(self, spec: Any, x: Any, out: Any, op: Any, root: Any, in_splits: Any, out_splits: Any) -> torch.Tensor:
        key = None
        if isinstance(x, torch.Tensor) and (op is None or type(op) in _KEY_OPS) and (root is None or type(root) is int):
            ins = in_splits if in_splits is None else _splits_key(in_splits)
            outs = out_splits if out_splits is None else _splits_key(out_splits)
            if ins is not _NO_KEY and outs is not _NO_KEY:
                key = (id(spec), op, root, x.dtype, x.shape, ins, outs)
                call = self._calls.get(key) if not self._closed else None
                if call is not None and call.spec is spec:
                    self._check_usable(call.name)
                    dev = self.device
                    if x.device == dev and x.layout == _STRIDED and x.is_contiguous():
                        if out is None:
                            out = torch.empty(call.out_shape, dtype=x.dtype, device=dev)
                            ok = True
                        elif (isinstance(out, torch.Tensor) and out.device == dev and out.layout == _STRIDED
                              and out.is_contiguous() and out.dtype is x.dtype and out.shape == call.out_shape):
                            a0, b0, an, bn = x.data_ptr(), out.data_ptr(), x.nbytes, out.nbytes
                            ok = not (a0 < b0 + bn and b0 < a0 + an) or (a0 == b0 and an == bn and call.in_place)
                        else:
                            ok = False
                        if ok:
                            self._seq += 1
                            self._execute(call.sched, CallContext(call.name, self._seq, call.fingerprint,
                                                                  x.dtype, x, out))
                            return out
        return self._run_checked(spec, x, out, op, root, in_splits, out_splits, key)

    def _run_checked(self, spec: Any, x: Any, out: Any, op: Any, root: Any, in_splits: Any, out_splits: Any,
                     key: tuple | None) -> torch.Tensor:
        """The full path: every check, planning and lowering (cached), then the call; ``key`` (if
        not None) files the validated call in the call cache."""
        name = spec.name if isinstance(spec, CollectiveSpec) else "run"
        self._check_usable(name)
        if not isinstance(spec, CollectiveSpec):
            raise PurlinValueError(f"run: spec must be a CollectiveSpec, got {type(spec).__name__}")
        consume = spec.consume
        if consume.is_copy:
            if op is not None:
                raise PurlinValueError(f"{name}: op={op!r} given, but {name} copies and does not reduce")
        else:
            try:
                consume = consume.with_op(op if op is not None else "sum")
            except PurlinValueError as e:  # messages start with the op (STYLE.md)
                raise PurlinValueError(f"{name}: {e}") from None
        if spec.rooted:
            if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world_size:
                raise PurlinValueError(f"{name}: root must be a rank in [0, {self.world_size}), got {root!r}")
        elif root is not None:
            raise PurlinValueError(f"{name}: root={root!r} given, but {name} has no root")
        self._check_tensor(name, "x", x)
        if not consume.is_copy and x.dtype not in REDUCE_DTYPES:
            raise PurlinValueError(
                f"{name}: cannot reduce dtype {x.dtype}; reductions support "
                f"{[str(d).replace('torch.', '') for d in REDUCE_DTYPES]}"
            )
        in_rows, out_rows = self._sizes(spec, x, in_splits, out_splits)
        rest = tuple(x.shape[1:])
        out_shape = (sum(out_rows),) + rest if x.dim() else ()
        if x.dim() == 0 and spec.output.sliced:
            raise PurlinValueError(f"{name}: x must have at least one dimension")
        out = self._check_out(spec, name, x, out, out_shape)
        row_bytes = x.element_size() * (int(torch.Size(rest).numel()) if x.dim() else 1)
        sizes = Sizes(tuple(r * row_bytes for r in in_rows), tuple(r * row_bytes for r in out_rows))
        nbytes = sum(sizes.input)
        algorithm = choose_algorithm(spec.with_consume(consume), nbytes, self.config.tuning,
                                     packets=self._engine_packets, world=self.world_size)
        pkey = (spec, consume, root, algorithm)
        plan = self._plans.get(pkey)
        if plan is None:
            s = spec if consume == spec.consume else spec.with_consume(consume)
            policy = self.config.tuning.model_copy(update={"algorithm": algorithm})
            plan = make_plan(s, self.world_size, self.rank, root=root, nbytes=nbytes,
                             staging_bytes=self.config.staging_bytes, policy=policy)
            self._plans[pkey] = plan
        skey = (pkey, sizes)
        sched = self._schedules.get(skey)
        if sched is None:
            sched = lower(plan, sizes)
            if len(self._schedules) > 256:
                self._schedules.clear()
            self._schedules[skey] = sched
        fixed_total = None if spec.variable else nbytes
        fp = fingerprint(plan.key + (str(x.dtype), row_bytes, fixed_total))
        if key is not None:
            calls = self._calls
            if len(calls) >= self.CALL_CACHE_SIZE:
                del calls[next(iter(calls))]  # the oldest entry
            calls[key] = _Call(spec, name, sched, fp, out_shape, not spec.input.sliced and not spec.output.sliced)
        self._seq += 1
        self._execute(sched, CallContext(name, self._seq, fp, x.dtype, x, out))
        return out

    # -- validation --------------------------------------------------------------------------
    def _check_usable(self, name: str) -> None:
        if self._closed:
            if self._broken_reason:
                raise PurlinBrokenError(
                    f"{name}: the communicator is broken by an earlier failure ({self._broken_reason}); its memory "
                    "was released then; create a new Communicator on every rank")
            raise PurlinClosedError(f"{name}: the communicator is closed; create a new one")
        if self.engine_name == "cuda":
            try:
                self._engine.check()  # a timeout recorded by an earlier kernel (no device sync)
                if self._moe is not None:
                    self._moe.check(fatal_only=True)  # a fatal error an earlier MoE kernel recorded (no sync)
            except PurlinError:
                self._release_broken()
                raise
        if self._engine.broken:
            reason = self._engine.broken
            self._release_broken()
            raise PurlinBrokenError(
                f"{name}: the communicator is broken by an earlier failure ({reason}); "
                "create a new Communicator on every rank"
            )

    def _execute(self, sched: Schedule, ctx: CallContext) -> None:
        """Run one call on the engine; a failure that breaks the engine releases this rank's memory."""
        gate = self._gate if self._gate is not None and not torch.cuda.is_current_stream_capturing() else None
        try:
            if gate is not None:
                gate.enter(self.rank, ctx.seq, ctx.op, ctx.fingerprint,
                           f"{ctx.op}(dtype={str(ctx.dtype).replace('torch.', '')}, shape={tuple(ctx.x.shape)})")
            self._engine.execute(sched, ctx)
            if gate is not None:
                gate.launched(self.rank, ctx.seq, ctx.op)
        except PurlinError as e:
            if self._engine.broken:
                # The engine's frames in the traceback hold views of the shared mapping: drop their
                # locals so that the mapping can really be unmapped now.
                traceback.clear_frames(e.__traceback__)
                self._release_broken()
            raise

    def _release_broken(self) -> None:
        """The engine is broken: free this rank's workspace and tables now (not at garbage collection);
        later calls raise PurlinBrokenError with the reason. Ranks of a virtual world share one
        workspace, released by run_virtual."""
        if self._closed or self._broken_reason:
            return
        self._broken_reason = self._engine.broken or "an earlier call failed"
        if self.group is not None:
            self.close()

    def _check_tensor(self, name: str, what: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            raise PurlinValueError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise PurlinValueError(f"{name}: {what} is on {t.device}, but the communicator runs on {self.device}")
        if t.is_sparse or t.layout != torch.strided:
            raise PurlinValueError(f"{name}: {what} must be a dense strided tensor")
        if not t.is_contiguous():
            raise PurlinValueError(f"{name}: {what} must be contiguous; call .contiguous() first")

    @staticmethod
    def _rows(x: torch.Tensor) -> int:
        return int(x.shape[0]) if x.dim() else 1

    def _splits(self, name: str, what: str, splits: Any) -> tuple[int, ...]:
        if splits is None:
            raise PurlinValueError(f"{name}: {what} is required for a V collective")
        if isinstance(splits, torch.Tensor):
            splits = splits.tolist()
        try:
            vals = tuple(splits)
        except TypeError:
            raise PurlinValueError(f"{name}: {what} must be a sequence of {self.world_size} ints") from None
        if len(vals) != self.world_size:
            raise PurlinValueError(f"{name}: {what} has {len(vals)} entries, the world size is {self.world_size}")
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, int):
                raise PurlinValueError(f"{name}: {what} must hold ints, got {v!r}")
            if v < 0:
                raise PurlinValueError(f"{name}: {what} has a negative size: {list(vals)}")
        return vals

    def _sizes(self, spec: CollectiveSpec, x: torch.Tensor, in_splits: Any, out_splits: Any):
        """Row counts per input slice and per output slice for this rank."""
        name, n, rows = spec.name, self.world_size, self._rows(x)
        in_term, out_term = _SPLIT_ARGS.get(name, ("in_splits", "out_splits"))
        if spec.input.sliced:
            if spec.variable:
                in_rows = self._splits(name, in_term, in_splits)
                if sum(in_rows) != rows:
                    raise PurlinValueError(
                        f"{name}: {in_term} sum to {sum(in_rows)} rows but x has {rows} rows on rank {self.rank}"
                    )
            else:
                if in_splits is not None:
                    raise PurlinValueError(f"{name}: in_splits is only for V collectives")
                if rows % n:
                    raise PurlinValueError(f"{name}: dim 0 of x ({rows}) must be divisible by the world size ({n})")
                in_rows = (rows // n,) * n
        else:
            if in_splits is not None:
                raise PurlinValueError(f"{name}: in_splits given, but the input is packed")
            in_rows = (rows,)
        if spec.output.sliced:
            if spec.variable:
                out_rows = self._splits(name, out_term, out_splits)
            else:
                if out_splits is not None:
                    raise PurlinValueError(f"{name}: out_splits is only for V collectives")
                out_rows = ((rows,) if not spec.input.sliced else (rows // n,)) * n
        else:
            if out_splits is not None:
                raise PurlinValueError(f"{name}: out_splits given, but the output is packed")
            out_rows = (in_rows[self.rank],) if spec.input.sliced else (rows,)
        return in_rows, out_rows

    def _check_out(self, spec: CollectiveSpec, name: str, x: torch.Tensor, out: Any, shape: tuple) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=x.dtype, device=self.device)
        self._check_tensor(name, "out", out)
        if out.dtype != x.dtype:
            raise PurlinValueError(f"{name}: out has dtype {out.dtype}, x has {x.dtype}; they must match")
        if tuple(out.shape) != tuple(shape):
            raise PurlinValueError(f"{name}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
        if _overlaps(x, out):
            same = x.data_ptr() == out.data_ptr() and x.nbytes == out.nbytes
            if not (same and not spec.input.sliced and not spec.output.sliced):
                raise PurlinValueError(
                    f"{name}: out overlaps x; only all_reduce and broadcast may run in place (out is x)"
                )
        return out

    # -- lifetime ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until this rank's enqueued calls finished; raise an error one of them recorded.

        Blocks the host (a stream synchronize on CUDA; a no-op on CPU, whose calls block). CUDA calls
        report a timeout lazily: at the next call on this rank, or here.
        """
        self._check_usable("synchronize")
        if self.engine_name == "cuda":
            self._engine.synchronize()
            if self._moe is not None:
                self._moe.synchronize()

    @contextlib.contextmanager
    def capture(self):
        """Context for CUDA graph capture (the CPU engine captures nothing: a no-op).

        Calls inside are capturable: no host sync, no allocation by purlin. Every call captured
        must have been run once before (same collective, sizes and dtype) so that its op table
        exists: calls that were not are refused with a message saying to warm up outside the
        capture (as torch symmetric memory does). Errors of replayed calls surface at the next
        eager call or :meth:`synchronize`.
        """
        self._check_usable("capture")
        yield self

    def close(self) -> None:
        """Free this rank's resources. Not collective; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_engine", None) is None:
            return
        if self.engine_name == "cuda" and self.group is not None:
            with contextlib.suppress(Exception):  # my kernels end (at worst by timeout) before my memory goes
                torch.cuda.synchronize(self.device)
        if getattr(self, "_moe", None) is not None:
            self._moe.close()
            self._moe = None
        self._engine.close()
        if self.group is not None:  # a process-shared mapping is this rank's own
            self._ws.close()
        self._ws = None
        self._plans.clear()
        self._schedules.clear()
        self._calls.clear()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class _Call:
    """A validated call of one shape: what running it again needs besides the tensors."""

    __slots__ = ("spec", "name", "sched", "fingerprint", "out_shape", "in_place")

    def __init__(self, spec: CollectiveSpec, name: str, sched: Schedule, fp: int, out_shape: tuple,
                 in_place: bool):
        self.spec, self.name, self.sched, self.fingerprint = spec, name, sched, fp
        self.out_shape, self.in_place = out_shape, in_place  # in_place: out may be x


_STRIDED = torch.strided
# The caller's names of the V collectives' split arguments (in messages); run() takes in_splits / out_splits.
_SPLIT_ARGS = {"all_to_all_v": ("input_splits", "output_splits"), "all_gather_v": ("sizes", "sizes"),
               "reduce_scatter_v": ("sizes", "sizes")}
_KEY_OPS = (str, ReduceOp)  # op values the call cache takes (exact types: no subclass can alias a key)
_NO_KEY = object()


def _splits_key(splits: Any) -> Any:
    """Splits as a tuple of exact ints (the cache key part), or _NO_KEY: such a call is not cached.

    Exact ints only: ``True == 1`` and ``1.0 == 1`` would otherwise hit the entry of a valid call."""
    t = type(splits)
    if t is list:
        splits = tuple(splits)
    elif t is not tuple:
        return _NO_KEY
    for v in splits:
        if type(v) is not int:
            return _NO_KEY
    return splits


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


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
    than this per rank should raise it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PurlinValueError(f"run_virtual: world_size must be a positive int, got {world_size!r}")
    cfg = _coerce_config(config)
    dev = torch.device(device)
    engine, _ = select_engine(dev, cfg.memory, virtual=True)
    vworld = _VirtualWorld(world_size, cfg, dev, engine.name)
    cuda = vworld.device.type == "cuda"
    comms: list[Communicator] = []
    try:
        comms = [Communicator._virtual(vworld, r) for r in range(world_size)]
    except BaseException:
        for c in comms:
            c.close()
        vworld.close()
        raise
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size
    if cuda:  # one stream per rank; inputs made before the call are complete before any rank starts
        streams, release_streams = _rank_streams(vworld.device, world_size)
        _reserve(vworld.device, streams, reserve_bytes)
        torch.cuda.synchronize(vworld.device)

    def call(r: int) -> Any:
        if not cuda:
            return fn(comms[r])
        with torch.cuda.device(vworld.device), torch.cuda.stream(streams[r]):
            out = fn(comms[r])
            if not comms[r]._closed:
                comms[r].synchronize()  # results complete, and a recorded timeout raised here
            return out

    def body(r: int) -> None:
        try:
            results[r] = call(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[r] = e
            comms[r]._engine.mark_broken(f"rank {r} raised {type(e).__name__}: {e}")
            if vworld.gate is not None:
                vworld.gate.fail(r, f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=body, args=(r,), name=f"purlin-vrank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    try:
        for r, t in enumerate(threads):
            t.join(cfg.timeout_s * 4 + 60)
            if t.is_alive():
                raise PurlinTimeoutError(
                    f"run_virtual: rank {r} did not return within {cfg.timeout_s * 4 + 60:g}s", rank=r, missing=[r]
                )
    finally:
        if cuda:  # every rank's kernels have ended (at worst by their timeouts) before memory is freed
            torch.cuda.synchronize(vworld.device)
        for c in comms:
            c.close()
        vworld.close()
        if cuda and not any(t.is_alive() for t in threads):
            release_streams()  # (a rank thread still alive keeps its stream: leaked, not freed under it)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        root = [f for f in failed if not isinstance(f[1], PurlinBrokenError)] or failed
        r, e = root[0]
        if len(failed) > 1 and isinstance(e, Exception):
            e.add_note(f"run_virtual: ranks {[f[0] for f in failed]} failed; this is rank {r}'s error")
        raise e
    return results


def _reserve(device: torch.device, streams: list, nbytes: int) -> None:
    """Fill torch's caching allocator for each stream (its blocks serve later allocations on that
    stream without a cudaMalloc): one large block of ``nbytes`` and 16 MiB of small blocks."""
    for s in streams:
        with torch.cuda.device(device), torch.cuda.stream(s):
            big = torch.empty(max(0, int(nbytes)), dtype=torch.uint8, device=device)
            small = [torch.empty(1 << 19, dtype=torch.uint8, device=device) for _ in range(32)]
            del big, small


def _rank_streams(device: torch.device, n: int) -> tuple[list, Callable[[], None]]:
    """``n`` CUDA streams of the rank threads, and a function that releases them.

    Not torch's pool: ``torch.cuda.Stream()`` hands out 32 pooled streams round robin, so a rank's
    stream could be the very stream another rank (or code in a rank thread that makes its own
    ``torch.cuda.Stream()``) runs on; two ranks on one stream wait for each other's kernels and time
    out. Streams of their own come from cuda-python when it is importable; otherwise pooled streams,
    checked to be distinct here (code in rank threads must then not make streams of its own).
    """
    from .memory.ipc import _error_text, _load_cudart

    try:
        cudart = _load_cudart()
    except PurlinUnavailableError:
        cudart = None
    if cudart is not None:
        handles = []
        with torch.cuda.device(device):
            for _ in range(n):
                err, h = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
                if int(err) != 0:
                    for made in handles:
                        cudart.cudaStreamDestroy(made)
                    raise PurlinError(f"run_virtual: cudaStreamCreateWithFlags: {_error_text(cudart, err)}")
                handles.append(h)

        def release() -> None:
            for h in handles:
                cudart.cudaStreamDestroy(h)

        return [torch.cuda.ExternalStream(int(h), device=device) for h in handles], release
    streams = [torch.cuda.Stream(device=device) for _ in range(n)]
    if len({s.cuda_stream for s in streams}) != n:
        raise PurlinError(f"run_virtual: torch's stream pool gave {n} ranks fewer than {n} distinct streams; "
                          "install cuda-python so the ranks get streams of their own")
    return streams, lambda: None


__all__ = ["Communicator", "run_virtual", "PurlinError", "PurlinPlanError"]
