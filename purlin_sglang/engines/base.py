"""The engine contract: what every datapath engine implements and what a call hands it.

An engine executes one rank's lowered SNAC schedules over a workspace (host memory for the CPU
engine, a device workspace for the CUDA engine). ``engines.create(name, ...)`` builds one by name;
``api.Communicator`` talks to it only through :class:`Engine` and :class:`CallContext`, so a new
engine is a new registry entry, not a new branch in the API. An engine's MoE part has a contract of
its own, in the MoE wing: :mod:`purlin_sglang.moe.engine`.
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


# ---- call descriptions: what a peer's descriptor says of its call, for mismatch messages -------------------
# A 64-bit code (the CPU engine's descriptor ring, the CUDA engine's device descriptors): bits 0-7 the
# collective (1 + its index in DESC_OPS, 0: a naming of the user's), 8-15 the dtype (1 + its index in
# DESC_DTYPES, 0: another), 16-23 the reduction (1 + its index in DESC_REDUCE, 0: a copy), 24-31
# root + 1 (0: no root), 32-62 this rank's input bytes (capped at 2^31 - 1, so the code is a
# non-negative int64). The same in every process of one version.
DESC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_gather_v", "reduce_scatter_v",
            "all_to_all_v", "broadcast")
DESC_DTYPES = tuple(d for d in (
    torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128, getattr(torch, "float8_e4m3fn", None),
    getattr(torch, "float8_e5m2", None)) if d is not None)
DESC_REDUCE = ("sum", "max", "min")
_DESC_OP_CODE = {n: i + 1 for i, n in enumerate(DESC_OPS)}
_DESC_DTYPE_CODE = {d: i + 1 for i, d in enumerate(DESC_DTYPES)}
_DESC_REDUCE_CODE = {n: i + 1 for i, n in enumerate(DESC_REDUCE)}


def call_info(op: str, dtype: torch.dtype, nbytes: int, plan: Any = None) -> int:
    """The description code of one call (see DESC_OPS); ``plan`` (a SNAC Plan) gives the root and the reduction."""
    root = getattr(plan, "root", None)
    reduce = getattr(getattr(getattr(plan, "spec", None), "consume", None), "reduce", None)
    red = 0 if reduce is None else _DESC_REDUCE_CODE.get(getattr(reduce, "value", reduce), 0)
    r = 0 if root is None else min(root + 1, 0xFF)
    return (_DESC_OP_CODE.get(op, 0) | _DESC_DTYPE_CODE.get(dtype, 0) << 8 | red << 16 | r << 24
            | min(int(nbytes), 0x7FFFFFFF) << 32)


def describe_info(info: int) -> str:
    """A call's description code as the user would write the call: ``all_reduce(dtype=bfloat16,
    op=max, 8192 bytes in)``, ``broadcast(dtype=float32, root=0, 16 bytes in)``; fields the code
    does not know are left out."""
    info = int(info) & ((1 << 64) - 1)
    o, d, red, r, n = info & 0xFF, (info >> 8) & 0xFF, (info >> 16) & 0xFF, (info >> 24) & 0xFF, info >> 32
    name = DESC_OPS[o - 1] if 0 < o <= len(DESC_OPS) else "a collective of the user's naming"
    parts = []
    if 0 < d <= len(DESC_DTYPES):
        parts.append(f"dtype={str(DESC_DTYPES[d - 1]).replace('torch.', '')}")
    if 0 < red <= len(DESC_REDUCE) and DESC_REDUCE[red - 1] != "sum":
        parts.append(f"op={DESC_REDUCE[red - 1]}")
    if r:
        parts.append(f"root={r - 1}" if r < 0xFF else "root>=254")
    parts.append(f"{n}{'+' if n == 0x7FFFFFFF else ''} bytes in")
    return f"{name}({', '.join(parts)})"


def mismatch_message(op: str, rank: int, peer: int, seq: int, mine: str, theirs: str) -> str:
    """The one message of two ranks that made different calls at call number ``seq`` (every engine
    and the loopback launch gate): both sides, as described by :func:`describe_info` or the gate."""
    return (f"{op}: rank {rank} and rank {peer} entered call #{seq} with different collectives, reductions, dtypes, "
            f"roots or sizes: rank {rank} called {mine}, rank {peer} called {theirs}; every rank must make the same "
            "calls in the same order")


# The caller's names of a V collective's split arguments (api.Communicator's parameter names), each with the
# entry a rank gives for one pair of ranks (producer "p", consumer "c"): (the input side's, the output
# side's). Other namings are run with run(in_splits=, out_splits=): SPLIT_ARGS_RUN.
SPLIT_ARGS = {
    "all_to_all_v": (("input_splits", "c"), ("output_splits", "p")),
    "all_gather_v": (("sizes", "p"), ("sizes", "p")),
    "reduce_scatter_v": (("sizes", "c"), ("sizes", "c")),
}
SPLIT_ARGS_RUN = (("in_splits", "c"), ("out_splits", "p"))


SPLITS_DISAGREE = "the split sizes disagree between ranks: every rank must pass sizes that agree with its peers'"


def split_pair_message(op: str, p: int, c: int, sent: str, expected: str) -> str:
    """The one sentence of producer ``p`` sending ``sent`` (rows, as a phrase) to consumer ``c``, which
    expects ``expected``: with the caller's argument names (:data:`SPLIT_ARGS`)."""
    (send_arg, send_at), (recv_arg, recv_at) = SPLIT_ARGS.get(op, SPLIT_ARGS_RUN)
    at = {"p": p, "c": c}
    return (f"{op}: rank {p} sends {sent} to rank {c} (its {send_arg}[{at[send_at]}]), but rank {c} "
            f"expects {expected} from rank {p} (its {recv_arg}[{at[recv_at]}])")


def first_split_pair(sends: "list | tuple", expects: "list | tuple") -> "tuple[int, int] | None":
    """The first pair (p, q) in rank order where ``sends[p][q]`` (what rank p sends to rank q) is not
    ``expects[q][p]`` (what rank q expects from rank p), or None: the pair every rank names."""
    for p, row in enumerate(sends):
        for q, n in enumerate(row):
            if n != expects[q][p]:
                return p, q
    return None


def first_split_mismatch(op: str, sends: "list | tuple", expects: "list | tuple") -> "str | None":
    """The first pair of ranks whose splits disagree (:func:`first_split_pair`), as the message every rank
    raises, or None: ``sends[p][q]`` rows rank p sends to rank q (its input splits), ``expects[q][p]``
    rows rank q expects from rank p (its output splits)."""
    pair = first_split_pair(sends, expects)
    if pair is None:
        return None
    p, q = pair
    return f"{split_pair_message(op, p, q, rows_phrase(sends[p][q]), rows_phrase(expects[q][p]))}; {SPLITS_DISAGREE}"


def rows_phrase(n: int) -> str:
    """``1 row`` or ``n rows``: a row count in an error message."""
    return f"{n} row{'s' if n != 1 else ''}"


def fold32(fp: int) -> int:
    """A 63-bit fingerprint folded to the 32 bits a device descriptor word carries."""
    return (fp ^ (fp >> 32)) & 0xFFFFFFFF


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat uint8 view (an empty one for an empty tensor)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class CallContext:
    """What one call needs besides the schedule: names for messages and the user's buffers.

    ``x`` and ``y`` are the user's input and output tensors (contiguous, validated). ``inp`` and
    ``out`` are flat uint8 views of them, made on first use: the CPU engine works on those, the
    CUDA engine reads only the data pointers, so its calls make no views."""

    __slots__ = ("op", "seq", "fingerprint", "dtype", "x", "y", "info", "splits", "_inp", "_out")

    def __init__(self, op: str, seq: int, fp: int, dtype: torch.dtype, x: torch.Tensor, y: torch.Tensor,
                 info: int = 0, splits: Any = None):
        self.op, self.seq, self.fingerprint, self.dtype, self.x, self.y = op, seq, fp, dtype, x, y
        self.info = info  # the call's description code (call_info), for mismatch messages
        self.splits = splits  # (input rows per peer, output rows per peer) of an exchange with both, else None
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
    """One rank's datapath. Built by ``engines.create(name, ws, rank, world, timeout_s, ranks_on_gpu=,
    call_check=)``: the class is called with those arguments (``call_check``: config
    ``device_call_check``, which an engine that always checks may ignore).

    ``broken`` is None while usable, else why not (set by :meth:`mark_broken` or a recorded failure).
    ``packets``: whether the engine runs packet plans (the planner may then choose ``"packet"``).

    Optional, a steady state for repeated calls (the CUDA engine has it): ``bind(sched, ctx)``, called
    once after :meth:`execute` ran a call of a new shape, returns an object prepared for calls of that
    shape; later calls of the shape are ``launch(bound, x, y, seq)`` instead of :meth:`execute` (the
    communicator has checked the engine usable and the tensors; ``seq`` is the call number). Not
    used where a loopback launch gate must see every call.
    """

    name: str
    packets: bool
    broken: Optional[str]

    def execute(self, sched: Schedule, ctx: CallContext) -> None:
        """Run (CPU: blocks until done) or enqueue (CUDA) this rank's part of one call. Collective."""

    def check(self) -> None:
        """Raise an error an earlier call recorded, without waiting for the device."""

    def recorded_error(self) -> Optional[Exception]:
        """The error :meth:`check` would raise now, or None; changes nothing, waits for nothing, safe from
        another thread (host engines: always None, their calls raise as they run)."""

    def synchronize(self) -> None:
        """Wait until this rank's enqueued calls are done; raise an error one of them recorded."""

    @property
    def table_bytes(self) -> int:
        """Device memory held for op tables (0 for host engines)."""

    def mark_broken(self, reason: str) -> None:
        """Make every later call fail with ``reason`` (peers waiting on this rank stop too where they can)."""

    def close(self) -> None:
        """Drop this engine's references to the workspace and its tables. Local; safe twice."""
