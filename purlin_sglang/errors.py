"""One error hierarchy for purlin_sglang.

Every error the library raises on purpose is a :class:`PurlinError`. Each subclass
also derives from the builtin that fits (``ValueError`` for bad arguments,
``RuntimeError`` for state and runtime failures), so callers that already catch
those keep working.
"""

from __future__ import annotations

from typing import Iterable


class PurlinError(Exception):
    """Base of every purlin_sglang error."""


class PurlinValueError(PurlinError, ValueError):
    """A bad argument: wrong dtype, device, shape, sizes, op or spec. Nothing was touched."""


class PurlinRejectedError(PurlinValueError):
    """Another rank rejected its own arguments of this call: every rank skipped the call and the
    communicator stays usable (on a CUDA process group, whose kernels were already running, they stopped
    mid-call and every rank reset the communicator's state before raising; where that reset could not
    run, the communicator is broken, as the message says). ``rank`` is the rank
    that rejected them (the lowest, if several did), ``cause`` its own error message, which this message
    quotes; ``op`` the call."""

    def __init__(self, message: str, *, op: str = "", rank: int = -1, cause: str = ""):
        super().__init__(message)
        self.op, self.rank, self.cause = op, rank, cause


class PurlinConfigError(PurlinValueError):
    """A bad configuration key or value; the message names the key."""


class PurlinPlanError(PurlinValueError):
    """A collective naming or size set that the SNAC planner cannot plan."""


class PurlinUnavailableError(PurlinError, RuntimeError):
    """A requested engine, provider or native feature is not present; the message says what is missing."""


class PurlinTopologyError(PurlinUnavailableError):
    """A group spans several nodes and cannot run across them (``topology.inter_node`` is ``off``, its
    backend is missing, or the nodes hold different numbers of ranks); the message names the nodes.
    Frameworks' plugins catch it to keep their own path for that group."""


class PurlinClosedError(PurlinError, RuntimeError):
    """The communicator was closed; create a new one."""


class PurlinBrokenError(PurlinError, RuntimeError):
    """An earlier failure (timeout, mismatch) left the communicator unusable; create a new one."""


class PurlinCudaError(PurlinError, RuntimeError):
    """A CUDA call in the native library failed; ``code`` is the cudaError_t value."""

    def __init__(self, message: str, *, code: int):
        super().__init__(message)
        self.code = code


class PurlinTimeoutError(PurlinError, RuntimeError):
    """A rank waited longer than ``timeout_s`` for peers that never arrived."""

    def __init__(self, message: str, *, op: str = "", rank: int = -1, missing: Iterable[int] = ()):
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.missing = tuple(missing)


class PurlinCapacityError(PurlinError, RuntimeError):
    """A MoE dispatch routed more rows from one source rank to one expert than ``capacity``.

    ``rank`` is the source rank, ``expert`` the global expert id, ``count`` the rows it routed.
    Nothing was lost silently: the call raised (CPU), or the device recorded it and the next call
    or ``synchronize()`` raised (CUDA; the rows past capacity were not delivered)."""

    def __init__(self, message: str, *, rank: int = -1, expert: int = -1, count: int = 0, capacity: int = 0):
        super().__init__(message)
        self.rank, self.expert, self.count, self.capacity = rank, expert, count, capacity


class PurlinMismatchError(PurlinError, RuntimeError):
    """Ranks entered the same call with different collectives, dtypes or sizes."""

    def __init__(self, message: str, *, op: str = "", rank: int = -1, peer: int = -1):
        super().__init__(message)
        self.op = op
        self.rank = rank
        self.peer = peer


class PurlinPluginError(PurlinError, RuntimeError):
    """A framework plugin (SGLang's, vLLM's) cannot do what was asked (hooks missing, communicator not
    buildable)."""


def rejected_error(op: str, causes: dict[int, str], seq: int | None = None) -> PurlinRejectedError:
    """What a rank raises when peers rejected their own arguments of its call ``op`` (``causes``: each
    such rank's own error message): the lowest such rank named, its message quoted."""
    rank = min(causes)
    others = sorted(causes)[1:]
    also = f" (ranks {others} rejected theirs too)" if others else ""
    call = f" call #{seq}" if seq is not None else " this call"
    return PurlinRejectedError(
        f"{op}: rank {rank} rejected its arguments of{call}: \"{causes[rank]}\"{also}; every rank skipped the "
        "call and the communicator stays usable", op=op, rank=rank, cause=causes[rank])


def text_words(text: str, words: int) -> list[int]:
    """``text`` as ``words`` int64 values (UTF-8, cut to fit, zero-padded): a message that travels
    in int64 signal words or tensors."""
    raw = text.encode("utf-8")[: 8 * words]
    raw = raw.decode("utf-8", "ignore").encode("utf-8").ljust(8 * words, b"\0")  # no cut character
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in range(0, 8 * words, 8)]


def words_text(values) -> str:
    """The text :func:`text_words` encoded."""
    raw = b"".join(int(v).to_bytes(8, "little", signed=True) for v in values)
    return raw.rstrip(b"\0").decode("utf-8", "replace")


__all__ = [
    "PurlinError",
    "PurlinValueError",
    "PurlinRejectedError",
    "PurlinConfigError",
    "PurlinPlanError",
    "PurlinUnavailableError",
    "PurlinTopologyError",
    "PurlinClosedError",
    "PurlinBrokenError",
    "PurlinCudaError",
    "PurlinTimeoutError",
    "PurlinMismatchError",
    "PurlinCapacityError",
    "PurlinPluginError",
]
