"""The set-up protocol the GPU providers (ipc, torch, nvshmem) share: phases agreed on by every rank.

A provider's ``create`` runs in phases. In each, every rank does its local part inside
``try`` and turns the outcome into a status, ``("ok", payload)`` or ``("error", kind,
message)`` (:func:`as_status`); :func:`agree` then all-gathers the statuses over the group's
CPU (gloo) process group and raises on EVERY rank if any rank failed, naming the failed ranks
and why. So no rank enters a collective (a rendezvous, an NVSHMEM init) that a peer will not
enter, and every rank raises the same error instead of waiting.

Every set-up wait is bounded: inside :func:`bounded` (``Communicator`` wraps its whole
construction in it, with its ``timeout_s``), each phase first meets the other ranks at a gloo
``monitored_barrier`` with that timeout, so a rank that never arrives is a
:class:`PurlinTimeoutError` naming it (on the rank that sees who is missing: the group's rank 0)
instead of a wait for the process group's own timeout (30 minutes for gloo). Groups of other
backends are not bounded this way (monitored_barrier is gloo-only).

Imports nothing from CUDA; torch.distributed is imported on first use.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from datetime import timedelta
from typing import Any, Iterator

from ..errors import PurlinConfigError, PurlinError, PurlinTimeoutError, PurlinUnavailableError, PurlinValueError

_TIMEOUT: contextvars.ContextVar = contextvars.ContextVar("purlin_setup_timeout_s", default=None)
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


@contextlib.contextmanager
def bounded(timeout_s: float | None) -> Iterator[None]:
    """Within this block, every set-up phase waits at most ``timeout_s`` for the other ranks."""
    token = _TIMEOUT.set(timeout_s)
    try:
        yield
    finally:
        _TIMEOUT.reset(token)


def arrive(op: str, group, world: int) -> None:
    """Meet every rank of ``group`` within the set-up timeout (no-op outside :func:`bounded`, for
    one rank, or for a group whose backend is not gloo); else raise PurlinTimeoutError."""
    timeout_s = _TIMEOUT.get()
    if timeout_s is None or world <= 1:
        return
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    if dist.get_backend(group) != "gloo":
        return
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        me = dist.get_rank(group)
        m = _MISSING.search(str(e))
        missing = [int(v) for v in m.group(1).replace(" ", "").split(",") if v] if m else []
        who = (f"rank(s) {missing} never arrived" if missing else
               "rank 0 did not confirm that every rank arrived (its own error names the missing ranks)")
        raise PurlinTimeoutError(
            f"{op}: set-up waited {timeout_s:g}s (timeout_s) on rank {me}: {who}; every rank must construct "
            "the Communicator together (a rank that crashed or took another code path?)",
            op=op, rank=me, missing=missing) from None


class _Fail(Exception):
    """A set-up problem of this rank: ``kind`` ("value" | "unavailable") and the message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def setup_group(op: str, group) -> tuple[Any, int]:
    """(the process group to set up over, its size); None: the default group. Raises at once if
    torch.distributed is not initialized or this process is not a member."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise PurlinValueError(
            f"{op}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group('gloo', ...) first (the handles travel over a CPU group)"
        )
    group = group if group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise PurlinValueError(f"{op}: this process is not a member of the given group")
    return group, dist.get_world_size(group)


def check_int(op: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (bools refused), else a _Fail("value")."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Fail("value", f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise _Fail("value", f"{op}: {name} must be >= {minimum}, got {value}")
    return value


def check_membership(op: str, group, rank: Any, world: Any) -> None:
    """``rank`` and ``world`` must be this process's rank in ``group`` and its size."""
    import torch.distributed as dist

    check_int(op, "rank", rank, 0)
    check_int(op, "world", world, 1)
    got_rank, got_world = dist.get_rank(group), dist.get_world_size(group)
    if (rank, world) != (got_rank, got_world):
        raise _Fail("value", f"{op}: rank={rank}, world={world} but this process is rank {got_rank} "
                             f"of {got_world} in the group; pass the group's own rank and size")


def check_create_args(op: str, group, layout_nbytes: Any, device_index: Any, rank: Any, world: Any) -> None:
    """The arguments every provider's ``create`` takes, checked on this rank (a _Fail("value") if bad)."""
    check_int(op, "layout_nbytes", layout_nbytes, 1)
    check_int(op, "device_index", device_index, 0)
    check_membership(op, group, rank, world)


def gather_status(group, world: int, mine: tuple, op: str = "set-up") -> list:
    """All-gather one status per rank (a collective that is also the barrier of a set-up phase).

    ``mine`` is ``("ok", payload)`` or ``("error", kind, message)``. Every rank gets the same
    list, so every rank takes the same decision.
    """
    import torch.distributed as dist

    arrive(op, group, world)
    got: list = [None] * world
    dist.all_gather_object(got, mine, group=group)
    return got


def raise_failures(op: str, statuses: list, *, per_rank: bool = False) -> None:
    """Raise on every rank if any rank's status is an error.

    The class follows the kinds: ``config`` (PurlinConfigError) wins over ``value``
    (PurlinValueError), which wins over ``unavailable`` (PurlinUnavailableError). The message names
    the failed ranks; ``per_rank`` gives it as ``"<op>: rank r: why; rank s: why"`` (one entry per
    failed rank), else ranks that failed the same way are named together.
    """
    failed = [(r, s) for r, s in enumerate(statuses) if s is None or s[0] != "ok"]
    if not failed:
        return
    kinds = {s[1] if s else "unavailable" for _, s in failed}
    cls = (PurlinConfigError if "config" in kinds else PurlinValueError if "value" in kinds
           else PurlinUnavailableError)
    if per_rank:
        raise cls(f"{op}: " + "; ".join(f"rank {r}: {s[2] if s else 'no status'}" for r, s in failed))
    by_message: dict[str, list[int]] = {}  # ranks that failed the same way are named together
    for r, s in failed:
        msg = s[2] if s else "no status"
        by_message.setdefault(msg[len(op) + 2:] if msg.startswith(f"{op}: ") else msg, []).append(r)
    text = "; ".join(f"rank {rs[0]}: {m}" if len(rs) == 1 else f"ranks {rs}: {m}" for m, rs in by_message.items())
    raise cls(f"{op}: set-up failed on rank(s) {[r for r, _ in failed]}: {text}")


def agree(op: str, group, world: int, mine: tuple, *, per_rank: bool = False) -> list:
    """End a set-up phase: all-gather every rank's status, raise on every rank if any failed.

    Collective over ``group``; blocks the host. Returns every rank's payload, in rank order.
    ``per_rank``: the error's message form (see :func:`raise_failures`).
    """
    statuses = gather_status(group, world, mine, op)
    raise_failures(op, statuses, per_rank=per_rank)
    return [s[1] for s in statuses]


def as_status(exc: BaseException) -> tuple:
    """The status that reports ``exc`` (raised by this rank's part of a phase) to every rank."""
    if isinstance(exc, _Fail):
        return ("error", exc.kind, exc.message)
    if isinstance(exc, PurlinValueError):
        return ("error", "value", str(exc))
    if isinstance(exc, PurlinError):
        return ("error", "unavailable", str(exc))
    return ("error", "unavailable", f"{type(exc).__name__}: {exc}")


def check_same_nbytes(op: str, payloads: list) -> None:
    """Every rank's ``payload["nbytes"]`` must be the same (the workspace layout is the same everywhere)."""
    sizes = {r: p["nbytes"] for r, p in enumerate(payloads)}
    if len(set(sizes.values())) != 1:
        raise PurlinValueError(f"{op}: ranks disagree on layout_nbytes {sizes}; every rank needs the same "
                               "workspace layout (same world and staging_bytes)")
