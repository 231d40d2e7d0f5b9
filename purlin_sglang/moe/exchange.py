"""The count exchange of an eager MoE dispatch (plan step ``count_exchange``), the same on every engine.

Two all-gathers over the context's ``all_gather``: first every rank's header (a status word, the
call's shape: num_experts, top-k, hidden size, x's dtype, fp8, capacity; then its tokens), then
every rank's counts (rows per global expert first; a part may append its own columns). Every rank
sees the same words, so every rank raises the same error, and none runs the rest of the call, for
a rank that rejected its own arguments (status 1 and its message: :meth:`CountExchange.reject`; that
rank raises its own error, the others a PurlinRejectedError naming it and quoting the message), a value the ranks disagree on (naming the argument), or a
(source rank, expert) count over ``capacity`` (PurlinCapacityError). The communicator stays usable.
Blocks the host (the counts are read there).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..errors import PurlinCapacityError, PurlinValueError, rejected_error, text_words, words_text
from ..native import DTYPE_CODES, reduce_dtype_code
from .engine import MoEContext

OP = "moe_dispatch"
HEADER_FIELDS = ("num_experts", "topk_ids (K columns)", "x (hidden size)", "x dtype", "dtype", "capacity")
CAUSE_WORDS = 32  # a rejecting rank's error message travels in this many int64 words (256 bytes)


def status_words(error: Exception | None) -> list[int]:
    """A rank's status in a MoE call's first all-gather: [1, its error message...] if it rejected its
    own arguments, else [0, 0...]; every rank sends the same number of words."""
    return [1] + text_words(str(error), CAUSE_WORDS) if error is not None else [0] * (1 + CAUSE_WORDS)


def raise_rejected(op: str, statuses: torch.Tensor, error: Exception | None) -> None:
    """After the all-gather of every rank's :func:`status_words` (``statuses`` [W, 1 + CAUSE_WORDS] on
    the host): a rank that rejected raises its own ``error``; if any rank rejected, the others raise a
    PurlinRejectedError naming it and quoting its message."""
    if error is not None:
        raise error
    causes = {q: words_text(row[1:].tolist()) for q, row in enumerate(statuses) if int(row[0])}
    if causes:
        raise rejected_error(op, causes)


_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


def _shown(name: str, col: list[int]) -> list:
    """A header column as the user knows it (dtype codes as dtype names)."""
    return [_DTYPE_NAMES.get(v, v) for v in col] if name == "x dtype" else col


def overflow(matrix: torch.Tensor, capacity: Optional[int], local_experts: int) -> Optional[PurlinCapacityError]:
    """The first (source rank, global expert) pair of the [W, E] count ``matrix`` over ``capacity``, as
    the error to raise, or None (also for exact rows: ``capacity`` None)."""
    if capacity is None:
        return None
    over = (matrix > capacity).nonzero()
    if not over.numel():
        return None
    p, g = (int(v) for v in over[0])
    n = int(matrix[p, g])
    return PurlinCapacityError(
        f"{OP}: rank {p} routed {n} rows to expert {g} (rank {g // local_experts}'s local expert "
        f"{g % local_experts}), more than capacity={capacity}; raise capacity (or "
        "moe.max_tokens_per_rank)", rank=p, expert=g, count=n, capacity=capacity)


class CountExchange:
    """One MoE part's count exchange over ``ctx.all_gather``.

    ``to_device(values)`` / ``to_host(t)``: how the part moves small int64 vectors between the host
    and its device (default: plain torch copies; the CUDA part's go through pinned memory, see
    docs/DESIGN.md, MoE, the loopback caveat)."""

    def __init__(self, ctx: MoEContext, to_device: Optional[Callable[[Sequence[int]], torch.Tensor]] = None,
                 to_host: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        self.ctx = ctx
        self._to_device = to_device or (lambda vals: torch.tensor(vals, dtype=torch.int64, device=ctx.device))
        self._to_host = to_host or (lambda t: t.cpu())
        self.tokens: list[int] = []  # every rank's tokens in the last header exchange

    def run(self, x: torch.Tensor, ids: torch.Tensor, num_experts: int, capacity: Optional[int], quant: str,
            counts: torch.Tensor) -> torch.Tensor:
        """The exchange of an eager dispatch this rank accepted: the header of (``x``, ``ids``,
        ``num_experts``, ``capacity``, ``quant``), then ``counts`` (1-D int64 on the device, rows per
        global expert first). Returns every rank's counts as a host tensor [W, counts.numel()] in
        rank order; raises (on every rank alike) as the module says. Collective."""
        header = (num_experts, ids.shape[1], x.shape[1], reduce_dtype_code(x.dtype), int(quant == "fp8"), capacity or 0)
        self._header(header, ids.shape[0])
        matrix = self._to_host(self.ctx.all_gather(counts)).view(self.ctx.world, -1)
        err = overflow(matrix[:, :num_experts], capacity, num_experts // self.ctx.world)
        if err is not None:
            raise err
        return matrix

    def reject(self, error: Exception) -> None:
        """This rank's arguments are bad: join the header exchange with status 1 (the peers raise naming
        this rank) and raise ``error``. Collective, as :meth:`run` is on the peers."""
        self._header((0,) * len(HEADER_FIELDS), 0, error=error)
        raise error  # not reached: _header raises it

    def _header(self, values: tuple[int, ...], tokens: int, error: Exception | None = None) -> None:
        """All-gather (status, values..., tokens) of every rank; raise PurlinValueError on every rank if
        a rank rejected its own arguments (``error``: that rank raises it, the others name that rank) or
        the ranks disagree on a value."""
        world = self.ctx.world
        vals = status_words(error) + ([0] * (len(values) + 1) if error is not None else list(values) + [tokens])
        seen = self._to_host(self.ctx.all_gather(self._to_device(vals))).view(world, -1)
        raise_rejected(OP, seen[:, : 1 + CAUSE_WORDS], error)
        fields = seen[:, 1 + CAUSE_WORDS:]
        self.tokens = fields[:, len(values)].tolist()  # every rank's token count (rank order)
        for i, name in enumerate(HEADER_FIELDS[: len(values)]):
            col = fields[:, i].tolist()
            if any(v != col[0] for v in col):
                raise PurlinValueError(f"{OP}: the ranks disagree on {name}: {_shown(name, col)} (rank order); "
                                       "every rank must call with the same value")
