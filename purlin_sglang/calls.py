"""The call path behind :class:`~purlin_sglang.Communicator`: argument checks, planning, caches.

:class:`CallPath` turns one call's arguments into what an engine runs: it validates them (every
error a PurlinValueError whose message starts with the collective's name), chooses the algorithm
once (``snac.select``: a registry entry), plans (``snac.make_plan`` with that algorithm), lowers and
fingerprints, and caches each of those. A call whose spec, op, root, dtype, shape and splits were
seen before (and were valid then) skips the planning and the checks that depend only on those: it
finds its schedule, fingerprint and output shape in the call cache. Checks that depend on the
tensor objects (device, layout, contiguity, out's dtype and shape, overlap) run on every call; a
call that fails one of them takes the full path, which raises the error with its message.
:meth:`CallPath.info` is the public view of the caches (``Communicator.cache_info()``).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, NamedTuple

import torch

from .collectives import CATALOG, CollectiveSpec, ReduceOp
from .config import PurlinConfig
from .engines.base import REDUCE_DTYPES, SPLIT_ARGS, SPLIT_ARGS_RUN, call_info, fingerprint, rows_phrase
from .errors import PurlinConfigError, PurlinValueError
from .snac import Algorithm, Plan, Schedule, Sizes, lower, make_plan, registry, select
from .snac.planner import largest_push
from .snac.table import TableInUse, bands_for

logger = logging.getLogger(__name__)
_STRIDED = torch.strided
_KEY_OPS = (str, ReduceOp)  # op values the call cache takes (exact types: no subclass can alias a key)
_NO_KEY = object()
SCHEDULE_CACHE_SIZE = 256  # lowered schedules kept (all are dropped when it is exceeded)


class CacheInfo(NamedTuple):
    """A communicator's caches (``Communicator.cache_info()``): ``hits`` calls whose shape was in the
    call cache (served from it, unless a check of the tensors sent it down the full path to raise),
    ``misses`` calls whose shape was not (they take the full path: every check, planning and
    lowering, each cached), ``calls`` / ``plans`` / ``schedules`` entries held now, ``maxsize``
    the call cache's bound (the oldest entry is dropped first)."""

    hits: int
    misses: int
    calls: int
    plans: int
    schedules: int
    maxsize: int


class Checked(NamedTuple):
    """A call whose arguments passed :meth:`CallPath.check`: its name, reduction (``consume`` with the
    op), row counts per input and output slice on this rank, output shape, and output tensor."""

    name: str
    consume: Any
    in_rows: tuple
    out_rows: tuple
    out_shape: tuple
    out: torch.Tensor


class Call:
    """A validated call of one shape: what running it again needs besides the tensors."""

    __slots__ = ("spec", "name", "sched", "fingerprint", "info", "out_shape", "in_place", "in_bytes", "out_bytes",
                 "like_x", "launch", "splits")

    def __init__(self, spec: CollectiveSpec, name: str, sched: Schedule, fp: int, out_shape: tuple,
                 in_place: bool, info: int = 0, in_bytes: int = 0, out_bytes: int = 0, like_x: bool = False):
        self.spec, self.name, self.sched, self.fingerprint = spec, name, sched, fp
        self.info = info  # the description code of mismatch messages (engines/base.py call_info)
        self.out_shape, self.in_place = out_shape, in_place  # in_place: out may be x
        self.in_bytes, self.out_bytes = in_bytes, out_bytes  # of x and of out (both fixed by the call's shape)
        self.like_x = like_x  # out has x's shape: a new out is torch.empty_like(x) (cheaper than by shape)
        # The engine's prepared launch of this shape (Engine.bind), once a call ran through execute(): None
        # until then, False where the engine does not bind (or a launch gate must see each call).
        self.launch: Any = None
        self.splits: Any = None  # (input rows per peer, output rows per peer) of an exchange (all_to_all_v)


def coerce_config(config: Any) -> PurlinConfig:
    if config is None:
        return PurlinConfig()
    if isinstance(config, PurlinConfig):
        return config
    if isinstance(config, dict):
        return PurlinConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):  # a YAML file, as PurlinConfig.from_yaml
        if not os.path.isfile(config):
            raise PurlinConfigError(
                f"config {str(config)!r}: no such file; a string config is the path of a YAML file "
                f"(PurlinConfig.from_yaml); otherwise pass a dict, a PurlinConfig or None"
            )
        return PurlinConfig.from_yaml(config)
    raise PurlinConfigError(
        f"config must be a PurlinConfig, a dict, the path of a YAML file or None, got {type(config).__name__}"
    )


def check_device(device: Any, op: str = "Communicator") -> torch.device:
    """``device`` as a torch.device of type cpu or cuda, else a PurlinValueError (starting with ``op``)
    naming what is accepted."""
    accepted = "'cpu', 'cuda', 'cuda:N' or a torch.device of those types"
    if isinstance(device, bool) or not isinstance(device, (str, torch.device)):
        hint = f"; for GPU {device} use 'cuda:{device}'" if type(device) is int else ""
        raise PurlinValueError(f"{op}: device must be {accepted}, got {device!r} "
                               f"({type(device).__name__}){hint}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise PurlinValueError(f"{op}: device must be {accepted}, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise PurlinValueError(f"{op}: device must be {accepted}, got {device!r} (type {dev.type!r})")
    if dev.type == "cuda" and dev.index is not None and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if dev.index >= n:
            raise PurlinValueError(f"{op}: device {device!r} does not exist: this process sees {n} CUDA "
                                   f"device(s), cuda:0 to cuda:{n - 1}")
    return dev


def is_exchange(spec: Any) -> bool:
    """A V form whose every rank sends a slice to and receives a slice from every rank (all_to_all_v and
    user namings like it): its per-peer sizes differ between ranks, so they are compared across ranks
    (``Call.splits``) rather than folded into the call's fingerprint."""
    return isinstance(spec, CollectiveSpec) and spec.variable and spec.input.sliced and spec.output.sliced \
        and not (spec.input.rooted or spec.output.rooted)


def check_group(group: Any) -> tuple[Any, int, int]:
    """(the process group, this process's rank in it, its size); ``group`` None: the default group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise PurlinValueError(
            "Communicator: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group('gloo', ...) first, or use purlin_sglang.run_virtual"
        )
    if group is None:
        group = dist.group.WORLD
    elif group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() returns to a rank outside it
        raise PurlinValueError("Communicator: this process is not a member of the given group")
    elif not isinstance(group, dist.ProcessGroup):
        raise PurlinValueError(
            f"Communicator: group must be a torch.distributed ProcessGroup (e.g. dist.new_group(backend='gloo')) "
            f"or None for the default group, got {group!r} ({type(group).__name__})")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise PurlinValueError("Communicator: this process is not a member of the given group")
    return group, rank, world


_TOLD: set[tuple] = set()


def table_in_use(config: PurlinConfig, device: torch.device, world: int, placement: str = "any") -> TableInUse:
    """The tuning table's bands for a communicator of ``world`` ranks on ``device`` (snac/table.py),
    logged once per process and table: applied, or why not (another GPU model, no entry)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
    else:
        name = "cpu"
    used = bands_for(config.tuning.table, name, device.type, world, placement)
    if used.path is not None and (used.reason not in _TOLD):
        _TOLD.add(used.reason)
        logger.log(logging.INFO if used.bands else logging.WARNING, "purlin_sglang: tuning: %s", used.reason)
    return used


def rows(x: torch.Tensor) -> int:
    return int(x.shape[0]) if x.dim() else 1


class CallPath:
    """One rank's call path: checks, the algorithm, plans, schedules, fingerprints, and their caches."""

    def __init__(self, rank: int, world: int, device: torch.device, config: PurlinConfig, *, packets: bool,
                 maxsize: int = 512, placement: str = "any"):
        self.rank, self.world, self.device, self.config = rank, world, device, config
        self.packets = packets  # the engine runs the packet protocol: algorithms that need it may be chosen
        self.maxsize = maxsize
        self.hits = self.misses = 0
        self.plans: dict[tuple, Plan] = {}
        self.schedules: dict[tuple, Schedule] = {}
        self.calls: dict[tuple, Call] = {}  # insertion-ordered: the first entry is the oldest
        # measured bands (tuning.table), or None: the built-in thresholds
        self.table = table_in_use(config, device, world, placement)
        self.heap: Any = None  # the communicator's SymmetricHeap (memory/heap.py) where it has one

    def algorithm(self, spec: CollectiveSpec | str, nbytes: int | None, push: int | None = None) -> str:
        """The name of :meth:`select`'s algorithm."""
        return self.select(spec, nbytes, push).name

    def select(self, spec: CollectiveSpec | str, nbytes: int | None, push: int | None = None) -> Algorithm:
        """The algorithm (a registry entry) of a call of ``spec`` (or a catalog name) whose input on this
        rank is ``nbytes`` bytes: the same on every rank (it depends on the config, the world, the device
        model and the group-wide size). ``push``: the group's largest push (``snac.planner.largest_push``),
        which a V form needs for a packet; without it a V form's ``nbytes`` is taken as that push (the
        call path always passes it)."""
        if isinstance(spec, str) and spec in CATALOG:
            spec = CATALOG[spec]
        if not isinstance(spec, CollectiveSpec):
            raise PurlinValueError(f"algorithm: collective must be a catalog name ({', '.join(CATALOG)}) or a "
                                   f"CollectiveSpec, got {spec!r}")
        if push is None and spec.variable:
            push = nbytes
        bands = self.table.bands.get(spec.name) if self.table.bands else None
        return select(spec, nbytes, self.config.tuning, packets=self.packets, world=self.world, bands=bands,
                      push=push)

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, len(self.calls), len(self.plans), len(self.schedules), self.maxsize)

    def clear(self) -> None:
        self.plans.clear()
        self.schedules.clear()
        self.calls.clear()

    # -- the cached path ----------------------------------------------------------------------
    def lookup(self, spec: Any, x: Any, out: Any, op: Any, root: Any, in_splits: Any,
               out_splits: Any) -> tuple[Call | None, Any]:
        """(the cached call, the output tensor) when this call may skip the full path, else (None, the
        key under which the full path files it: None for arguments the cache does not take)."""
        if not (isinstance(x, torch.Tensor) and (op is None or type(op) in _KEY_OPS)
                and (root is None or type(root) is int)):
            self.misses += 1
            return None, None
        ins = in_splits if in_splits is None else _splits_key(in_splits)
        outs = out_splits if out_splits is None else _splits_key(out_splits)
        if ins is _NO_KEY or outs is _NO_KEY:
            self.misses += 1
            return None, None
        dtype = x.dtype
        key = (id(spec), op, root, dtype, x.shape, ins, outs)
        heap = self.heap
        if heap is not None:  # where x lies in the symmetric heap decides the plan (direct), and
            at = _address(x)  # an in-place call of such an x stays staged: a key of its own
            key += (heap.offset_of(at), isinstance(out, torch.Tensor) and out.data_ptr() == at)
        call = self.calls.get(key)
        if call is None or call.spec is not spec:
            self.misses += 1
            return None, key
        self.hits += 1
        dev = self.device
        if not (x.device == dev and x.layout == _STRIDED and x.is_contiguous()):
            return None, key
        if out is None:
            # x is contiguous: empty_like (strides preserved) gives a contiguous out
            out = torch.empty_like(x) if call.like_x else torch.empty(call.out_shape, dtype=dtype, device=dev)
        elif (isinstance(out, torch.Tensor) and out.device == dev and out.layout == _STRIDED
              and out.is_contiguous() and out.dtype is dtype and out.shape == call.out_shape):
            a0, b0, an, bn = x.data_ptr(), out.data_ptr(), call.in_bytes, call.out_bytes
            if (a0 < b0 + bn and b0 < a0 + an) and not (a0 == b0 and an == bn and call.in_place):
                return None, key
        else:
            return None, key
        return call, out

    # -- the full path ------------------------------------------------------------------------
    def check(self, spec: Any, x: Any, out: Any, op: Any, root: Any, in_splits: Any,
              out_splits: Any) -> Checked:
        """Every argument check of a call (no planning): what it names, its row counts and its output
        tensor (``out``, or a new one), or a PurlinValueError starting with the collective's name."""
        name = spec.name if isinstance(spec, CollectiveSpec) else "run"
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
            if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world:
                raise PurlinValueError(f"{name}: root must be a rank in [0, {self.world}), got {root!r}")
        elif root is not None:
            raise PurlinValueError(f"{name}: root={root!r} given, but {name} has no root")
        self.check_tensor(name, "x", x)
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
        return Checked(name, consume, in_rows, out_rows, out_shape, out)

    def prepare(self, spec: Any, x: Any, out: Any, op: Any, root: Any, in_splits: Any, out_splits: Any,
                key: tuple | None) -> tuple[Call, torch.Tensor]:
        """Every check, planning and lowering (cached); ``key`` (if not None) files the call in the cache."""
        name, consume, in_rows, out_rows, out_shape, out = self.check(spec, x, out, op, root, in_splits, out_splits)
        rest = tuple(x.shape[1:])
        row_bytes = x.element_size() * (int(torch.Size(rest).numel()) if x.dim() else 1)
        sizes = Sizes(tuple(r * row_bytes for r in in_rows), tuple(r * row_bytes for r in out_rows))
        nbytes = sum(sizes.input)
        named = spec if consume == spec.consume else spec.with_consume(consume)
        chosen = self.select(named, nbytes, largest_push(sizes) if spec.variable else None)
        heap_form = registry.heap_form(chosen)
        input_at = self._direct_input(named, heap_form, x, out)
        if input_at >= 0:  # the algorithm that reads the heap in place of the chosen one
            chosen = heap_form
        algorithm = chosen.name
        pkey = (spec, consume, root, algorithm, input_at)
        plan = self.plans.get(pkey)
        if plan is None:
            plan = make_plan(named, self.world, self.rank, root=root, nbytes=nbytes,
                             staging_bytes=self.config.staging_bytes, policy=self.config.tuning, algorithm=algorithm,
                             input_at=input_at)
            self.plans[pkey] = plan
        skey = (pkey, sizes)
        sched = self.schedules.get(skey)
        if sched is None:
            sched = lower(plan, sizes)
            if len(self.schedules) > SCHEDULE_CACHE_SIZE:
                self.schedules.clear()
            self.schedules[skey] = sched
        fp = fingerprint(plan.key + (str(x.dtype), row_bytes, _agreed_sizes(spec, chosen, sizes, nbytes)))
        in_place = not spec.input.sliced and not spec.output.sliced and input_at < 0  # a direct plan: never
        call = Call(spec, name, sched, fp, out_shape, in_place,
                    call_info(name, x.dtype, nbytes, plan), x.nbytes, x.element_size() * math.prod(out_shape),
                    out_shape == tuple(x.shape))
        if is_exchange(spec):
            call.splits = (tuple(in_rows), tuple(out_rows))  # the launch gate compares them across ranks
        if key is not None:
            if len(self.calls) >= self.maxsize:
                del self.calls[next(iter(self.calls))]  # the oldest entry
            self.calls[key] = call
        return call, out

    def _direct_input(self, spec: CollectiveSpec, heap_form: Algorithm | None, x: torch.Tensor,
                      out: torch.Tensor) -> int:
        """Where x lies in this rank's staging region when the call runs ``heap_form``, the algorithm
        that reads the heap in place of the chosen one (``direct`` for the staged one-shot,
        ``direct-twoshot`` for the two-shot), else -1: x wholly in the symmetric heap, a collective
        that has that form (every rank knows every size), peers to read from, and an output apart
        from x (readers still read my input while I write my output). Every rank must pass its input
        at the same heap offset: the offset is part of the plan, so ranks that differ get different
        fingerprints."""
        heap = self.heap
        if heap is None or heap_form is None or self.world < 2 or not heap_form.has_form(spec):
            return -1
        off = heap.offset_of(_address(x))
        if off < 0 or off + x.nbytes > heap.nbytes or _overlaps(x, out):
            return -1
        return heap.start + off

    # -- checks -------------------------------------------------------------------------------
    def check_tensor(self, name: str, what: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            raise PurlinValueError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != self.device:
            raise PurlinValueError(f"{name}: {what} is on {t.device}, but the communicator runs on {self.device}")
        if t.is_sparse or t.layout != torch.strided:
            raise PurlinValueError(f"{name}: {what} must be a dense strided tensor")
        if not t.is_contiguous():
            raise PurlinValueError(f"{name}: {what} must be contiguous; call .contiguous() first")

    def gather_sizes(self, x: Any, sizes: Any) -> tuple[int, ...]:
        """all_gather_v's ``sizes``, checked: a row count per rank, this rank's equal to ``x``'s rows."""
        sizes = self.splits("all_gather_v", "sizes", sizes)
        if sizes[self.rank] != rows(x):
            raise PurlinValueError(
                f"all_gather_v: sizes[{self.rank}]={sizes[self.rank]} but x has {rows(x)} rows on rank {self.rank}")
        return sizes

    def splits(self, name: str, what: str, splits: Any) -> tuple[int, ...]:
        if splits is None:
            raise PurlinValueError(f"{name}: {what} is required for a V collective")
        if isinstance(splits, torch.Tensor):
            splits = splits.tolist()
        try:
            vals = tuple(splits)
        except TypeError:
            raise PurlinValueError(f"{name}: {what} must be a sequence of {self.world} ints") from None
        if len(vals) != self.world:
            raise PurlinValueError(f"{name}: {what} has {len(vals)} entries, the world size is {self.world}")
        for v in vals:
            if isinstance(v, bool) or not isinstance(v, int):
                raise PurlinValueError(f"{name}: {what} must hold ints, got {v!r}")
            if v < 0:
                raise PurlinValueError(f"{name}: {what} has a negative size: {list(vals)}")
        return vals

    def _sizes(self, spec: CollectiveSpec, x: torch.Tensor, in_splits: Any, out_splits: Any):
        """Row counts per input slice and per output slice for this rank."""
        name, n, nrows = spec.name, self.world, rows(x)
        (in_term, _), (out_term, _) = SPLIT_ARGS.get(name, SPLIT_ARGS_RUN)  # the caller's names, for messages
        if spec.input.sliced:
            if spec.variable:
                in_rows = self.splits(name, in_term, in_splits)
                if sum(in_rows) != nrows:
                    raise PurlinValueError(
                        f"{name}: {in_term} sum to {sum(in_rows)} rows but x has {nrows} rows on rank {self.rank}"
                    )
            else:
                if in_splits is not None:
                    raise PurlinValueError(f"{name}: in_splits is only for V collectives")
                if nrows % n:
                    raise PurlinValueError(f"{name}: dim 0 of x ({nrows}) must be divisible by the world size ({n})")
                in_rows = (nrows // n,) * n
        else:
            if in_splits is not None:
                raise PurlinValueError(f"{name}: in_splits given, but the input is packed")
            in_rows = (nrows,)
        if spec.output.sliced:
            if spec.variable:
                out_rows = self.splits(name, out_term, out_splits)
            else:
                if out_splits is not None:
                    raise PurlinValueError(f"{name}: out_splits is only for V collectives")
                out_rows = ((nrows,) if not spec.input.sliced else (nrows // n,)) * n
        else:
            if out_splits is not None:
                raise PurlinValueError(f"{name}: out_splits given, but the output is packed")
            out_rows = (in_rows[self.rank],) if spec.input.sliced else (nrows,)
        if is_exchange(spec):
            # a rank's own slice goes from its input slice `rank` to its output slice `rank`: both sizes are
            # its own, so a disagreement is caught here, in the user's terms, before any peer is involved
            r, a, b = self.rank, in_rows[self.rank], out_rows[self.rank]
            if a != b:
                raise PurlinValueError(
                    f"{name}: rank {r} sends {rows_phrase(a)} to itself ({in_term}[{r}]) but expects "
                    f"{rows_phrase(b)} from itself ({out_term}[{r}]); the two must be equal"
                )
        return in_rows, out_rows

    def _check_out(self, spec: CollectiveSpec, name: str, x: torch.Tensor, out: Any, shape: tuple) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=x.dtype, device=self.device)
        self.check_tensor(name, "out", out)
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


def _agreed_sizes(spec: CollectiveSpec, algorithm: Algorithm, sizes: Sizes, nbytes: int) -> Any:
    """The sizes every rank of a call passes alike, for its fingerprint: a fixed form's input bytes; a
    V form's sizes on its sliced side where its algorithm has every rank know every size
    (``agreed_sizes``: packets, whose ranks that disagree on them then get each other's packets refused
    and a mismatch error, and the direct plans, whose readers compute each peer's offsets from them);
    None for a staged V form, whose waits compare the byte counts of each pair instead."""
    if not spec.variable:
        return nbytes
    if algorithm.agreed_sizes:
        return sizes.output if spec.output.sliced else sizes.input
    return None


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


def _address(x: torch.Tensor) -> int:
    """Where ``x`` starts in memory; for an empty view too (its ``data_ptr()`` is 0): a V form's rank
    with no rows passes an empty view of its heap buffer, which must still be found in the heap."""
    p = x.data_ptr()
    if p == 0 and x.numel() == 0:
        p = x.untyped_storage().data_ptr() + x.storage_offset() * x.element_size()
    return p


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def one_of(op: str, name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """``value``, or ``alias_value`` where only the alias (torch.distributed's name) was given to ``op``."""
    if alias_value is None:
        return value
    if value is not None:
        raise PurlinValueError(f"{op}: give {name} or {alias}, not both")
    return alias_value
